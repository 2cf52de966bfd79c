"""Decompress a compressed archive once into an anonymous spool file that supports ``pread``.

``pack`` shuffles files across blocks and writes blocks from several threads, so it needs random access
to every file; a gzip/bzip2/xz stream only reads forwards.  Decompressing the stream once, sequentially,
into a file gives random access with bounded memory (one input and one output buffer) at the cost of
disk space equal to the uncompressed archive.  The spool file has no name (``O_TMPFILE``, or unlinked at
once), so a crash or a kill leaves nothing behind: the kernel frees it when its descriptor closes.

Decompressor objects (not ``gzip.GzipFile`` and friends) are used so that everything before a damaged
or truncated spot reaches the spool: ``--skip-damaged`` then keeps all members that precede it.
"""

from __future__ import annotations

import bz2
import errno
import lzma
import os
import tempfile
import zlib
from typing import Callable, Iterator, Union

from ..errors import SourceError
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


def decompressed(raw, compression: str) -> Iterator[bytes]:
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


def spool(path: str, compression: str, directory: str, damage: DamageLog) -> tuple[int, int]:
    """Decompress ``path`` into an anonymous file in ``directory``; return (descriptor, size).

    A damaged or truncated stream is an error naming how far it decompressed; with --skip-damaged what
    came out before the damage is kept (the tar reader then drops the member it cuts).
    """
    fd = anonymous_file(directory)
    size = 0
    try:
        with open(path, "rb") as raw:
            try:
                for piece in decompressed(raw, compression):
                    _write_all(fd, memoryview(piece))
                    size += len(piece)
            except _Damaged as e:
                damage.report(size, f"{compression} stream damaged near compressed byte {raw.tell()} ({e}); "
                                    "offsets count decompressed bytes")
    except BaseException:
        os.close(fd)
        raise
    return fd, size


def _write_all(fd: int, data: memoryview) -> None:
    while data:
        data = data[os.write(fd, data):]
