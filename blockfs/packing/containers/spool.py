"""Decompress a compressed archive once into an anonymous spool file that supports ``pread``.

``pack`` shuffles files across blocks and writes blocks from several threads, so it needs random access
to every file; a gzip/bzip2/xz stream only reads forwards.  Decompressing the stream once, sequentially,
into a file gives random access with bounded memory (one input and one output buffer) at the cost of
disk space equal to the uncompressed archive.  The spool file has no name (``O_TMPFILE``, or unlinked at
once), so a crash or a kill leaves nothing behind: the kernel frees it when its descriptor closes.

Decompressor objects (not ``gzip.GzipFile`` and friends) are used so that everything before a damaged
or truncated spot reaches the spool: ``--skip-damaged`` then keeps all members that precede it.

:class:`Spool` decompresses in a child process, so the tar listing can read each header as soon as it is
spooled instead of after the whole stream: on two cores the listing (a third of a second for 30,000
members) hides behind decompression.
"""

from __future__ import annotations

import bz2
import errno
import json
import lzma
import os
import signal
import tempfile
import zlib
from collections.abc import Callable, Iterator
from typing import BinaryIO, Union

from ...errors import SourceError
from ..forking import fork_child
from .base import DamageLog

Decompressor = Union["zlib._Decompress", bz2.BZ2Decompressor, lzma.LZMADecompressor]
DECOMPRESSORS: dict[str, Callable[[], Decompressor]] = {
    "gzip": lambda: zlib.decompressobj(wbits=16 + zlib.MAX_WBITS),
    "bzip2": bz2.BZ2Decompressor,
    "xz": lzma.LZMADecompressor,
}
DECOMPRESS_ERRORS = (OSError, EOFError, zlib.error, lzma.LZMAError)
PIECE_IN = 1 << 20  # compressed bytes per read
PIECE_OUT = 4 << 20  # decompressed bytes per write: bounds memory whatever the compression ratio


class _Damaged(Exception):
    pass


def spool_dir_for(dest: str | os.PathLike) -> str:
    """Where a pack into ``dest`` spools: beside it (on its filesystem, never on a RAM-backed /tmp)."""
    parent = os.path.dirname(os.path.abspath(os.fspath(dest)))
    while not os.path.isdir(parent):
        parent = os.path.dirname(parent)
    return parent


def anonymous_file(directory: str) -> int:
    """A read-write descriptor of a new file in ``directory`` that no name refers to."""
    try:
        return os.open(directory, os.O_TMPFILE | os.O_RDWR, 0o600)
    except OSError as e:  # filesystems without O_TMPFILE: create, then unlink at once
        if e.errno not in (errno.EOPNOTSUPP, errno.EISDIR, errno.EINVAL):
            raise SourceError(f"cannot create a spool file in {directory!r}: {e.strerror}") from e
    fd, name = tempfile.mkstemp(dir=directory, prefix=".blockfs-spool-")
    os.unlink(name)
    return fd


def decompressed(raw: BinaryIO, compression: str) -> Iterator[bytes]:
    """The decompressed bytes of ``raw``, piece by piece; concatenated streams (``cat a.gz b.gz``) join.

    Raises ``_Damaged`` when the data cannot be decoded or ends before the stream's end marker.
    """
    d = DECOMPRESSORS[compression]()
    fed = False
    while chunk := raw.read(PIECE_IN):
        data = chunk
        while data:
            fed = True
            try:
                yield from _drain(d, data)
            except DECOMPRESS_ERRORS as e:
                raise _Damaged(str(e) or type(e).__name__) from e
            data = d.unused_data if d.eof else b""
            if d.eof:
                if not data.strip(b"\0"):  # zero padding after the last stream, as tape blocking leaves
                    return
                d, fed = DECOMPRESSORS[compression](), False
    if fed and not d.eof:
        raise _Damaged("the stream ends before its end marker: it is truncated")


def _drain(d: Decompressor, data: bytes) -> Iterator[bytes]:
    """Feed ``data``, yielding output in pieces of at most PIECE_OUT bytes."""
    if isinstance(d, (bz2.BZ2Decompressor, lzma.LZMADecompressor)):
        yield d.decompress(data, PIECE_OUT)
        while not d.eof and not d.needs_input:
            yield d.decompress(b"", PIECE_OUT)
        return
    while not d.eof:
        out = d.decompress(data, PIECE_OUT)
        yield out
        data = d.unconsumed_tail
        if not data and len(out) < PIECE_OUT:  # input used up and no output held back
            return


class Spool:
    """``path`` being decompressed into an anonymous file in ``directory`` by a forked child process.

    A process, not a thread: the tar listing is Python work, and a decompressing thread that gives up
    the GIL for every piece of output waits for it again each time (decompressing a 146 MB archive took
    0.98 s beside a busy Python thread instead of 0.45 s).  The child reports its progress through a
    pipe; readers call :meth:`available` before reading spooled bytes, :meth:`finish` waits for the end
    and gives the size.  Damage is an error (raised to the reader that waits for the bytes, or by
    ``finish``) or, with --skip-damaged, a record and a shorter spool.  Call :meth:`finish` or
    :meth:`cancel` before closing :attr:`fd`.
    """

    def __init__(self, path: str, compression: str, directory: str, damage: DamageLog) -> None:
        self.fd = anonymous_file(directory)
        self._damage = damage
        self._written = 0
        self._done = False
        read_end, write_end = os.pipe()
        try:
            self._pid = fork_child(lambda: _decompress_into(self.fd, path, compression, write_end))
        except BaseException:
            os.close(read_end)
            os.close(self.fd)
            raise
        finally:
            os.close(write_end)
        self._messages = os.fdopen(read_end, "rb")

    def available(self, end: int) -> int:
        """Wait until the first ``end`` bytes are spooled or the stream has ended; how many of them are."""
        while self._written < end and not self._done:
            self._next_message()
        return min(end, self._written)

    def finish(self) -> int:
        """Wait for the end of the stream; the spool's size."""
        while not self._done:
            self._next_message()
        return self._written

    def cancel(self) -> None:
        """Stop decompressing now."""
        if self._pid:
            try:
                os.kill(self._pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self._done = True
        self._reap()

    def _next_message(self) -> None:
        line = self._messages.readline()
        if not line:
            self._done = True
            status = self._reap()
            raise SourceError(
                f"the process decompressing {self._damage.where!r} died (wait status {status}); "
                "retry, and if it happens again, test the archive with its own tool (gzip -t, bzip2 -t or xz -t)"
            )
        kind, *rest = json.loads(line)
        if kind == "written":
            self._written = rest[0]
            return
        self._done = True
        self._reap()
        if kind == "damaged":
            self._damage.report(self._written, rest[0])
        elif kind == "oserror":
            raise OSError(*rest)

    def _reap(self) -> int:
        status = 0
        if self._pid:
            _pid, status = os.waitpid(self._pid, 0)
            self._pid = 0
            self._messages.close()
        return status


def _decompress_into(fd: int, path: str, compression: str, messages: int) -> None:
    """The child's work: decompress ``path`` into ``fd``, one JSON line per piece to ``messages``."""

    def say(*message: object) -> None:
        _write_all(messages, memoryview(json.dumps(message).encode() + b"\n"))

    written = 0
    try:
        with open(path, "rb") as raw:
            try:
                for piece in decompressed(raw, compression):
                    _write_all(fd, memoryview(piece))
                    written += len(piece)
                    say("written", written)
            except _Damaged as e:
                say(
                    "damaged",
                    f"{compression} stream damaged near compressed byte {raw.tell()} ({e}); "
                    "offsets count decompressed bytes",
                )
                return
    except OSError as e:
        say("oserror", e.errno, e.strerror, e.filename)
        return
    say("done")


def _write_all(fd: int, data: memoryview) -> None:
    while data:
        data = data[os.write(fd, data) :]
