"""The cryptographic hash that names a dataset and pins every byte of it: BLAKE3, 256-bit.

The chain (drawn in :mod:`.format`): the dataset's name is the digest of its ``blockfs.json`` as stored;
``blockfs.json`` holds the index file's digest; the index holds, per block, the digest of its header and
of its data section, and per file the digest of its bytes.  Chosen by measurement (``tools/bench/bench_hash.py``):
on one core BLAKE3 hashes 1 MiB-64 MiB buffers 3.5-5x faster than SHA-256 or BLAKE2b from ``hashlib``;
only CRC-32, which proves nothing against a writer who means it, is faster.  A block read from a local
file is hashed in pieces on two hashing threads while its next piece is read (``chunk_digests_later``),
so the hash overlaps the read; anything else is hashed by the thread that read it.
"""

from __future__ import annotations

import os
import re
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING

from blake3 import blake3

from ..errors import IdentityError

if TYPE_CHECKING:
    from _typeshed import ReadableBuffer  # bytes, bytearray, memoryview, mmap: anything with the buffer protocol

ALGORITHM = "blake3"
DIGEST_SIZE = 32
_NAME = re.compile(r"^blake3:[0-9a-f]{64}$")


def digest(data: ReadableBuffer) -> bytes:
    """The 32-byte BLAKE3 digest of ``data`` (bytes or any buffer; the GIL is released while it hashes)."""
    return blake3(data).digest()


def hasher() -> blake3:
    """An incremental hasher (``update(piece)``, then ``digest()``)."""
    return blake3()


class FillingDigest:
    """The digest of a buffer filled front to back, each piece hashed on a thread of its own as soon as it is
    filled (:meth:`filled`) while the next is being filled: a mount's index (1.5 GB at ten million files)
    costs the time of its copy, not that plus its hash.  The buffer must stay unchanged until :meth:`digest`."""

    def __init__(self, buf: ReadableBuffer, hashed: Callable[[int, int], None] | None = None) -> None:
        self._buf = buf
        self._after = hashed  # called with each piece's (start, end) once it is hashed
        self._hash = blake3()
        self._hashed = 0
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="blockfs-index-hash")  # one thread: pieces in order

    def filled(self, end: int) -> None:
        """The buffer is final up to ``end``: hash what was not yet."""
        if end > self._hashed:
            self._pool.submit(self._update, self._hashed, end)
            self._hashed = end

    def _update(self, start: int, end: int) -> None:
        with memoryview(self._buf) as view, view[start:end] as piece:
            self._hash.update(piece)
        if self._after is not None:
            self._after(start, end)

    def digest(self) -> bytes:
        """The digest of everything :meth:`filled` said (waits for its hashing)."""
        self._pool.shutdown(wait=True)
        return self._hash.digest()

    def abandon(self) -> None:
        """Stop: nothing more is hashed; returns once nothing holds the buffer."""
        self._pool.shutdown(wait=True, cancel_futures=True)


class ChunkHasher:
    """The digest of each ``chunk``-byte piece of a stream fed in pieces of any size (the last may be
    shorter): what the index holds of a block's data section, so a piece of a big file is checked alone."""

    def __init__(self, chunk: int) -> None:
        self._chunk = chunk
        self._hash = blake3()
        self._filled = 0
        self._done: list[bytes] = []

    def update(self, data: ReadableBuffer) -> None:
        view = memoryview(data)
        while len(view):
            take = min(len(view), self._chunk - self._filled)
            self._hash.update(view[:take])
            self._filled += take
            view = view[take:]
            if self._filled == self._chunk:
                self._done.append(self._hash.digest())
                self._hash, self._filled = blake3(), 0

    def digests(self) -> bytes:
        """Every chunk's digest, back to back (32 bytes each; nothing for an empty stream)."""
        if self._filled:
            self._done.append(self._hash.digest())
            self._hash, self._filled = blake3(), 0
        return b"".join(self._done)


def chunk_digests(data: ReadableBuffer, chunk: int) -> bytes:
    """The digest of each ``chunk``-byte piece of ``data``, back to back."""
    view = memoryview(data)
    return b"".join(blake3(view[i : i + chunk]).digest() for i in range(0, len(view), chunk))


class _HashingThreads:
    """Two threads that hash behind a reader (BLAKE3 releases the GIL), made anew in a forked child, where
    the parent's threads do not exist."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._pool: ThreadPoolExecutor | None = None
        self._pid = 0

    def submit(self, data: ReadableBuffer, chunk: int) -> Future[bytes]:
        with self._lock:
            if self._pool is None or self._pid != os.getpid():
                self._pool, self._pid = ThreadPoolExecutor(2, thread_name_prefix="blockfs-hash"), os.getpid()
            return self._pool.submit(chunk_digests, data, chunk)


_HASHING = _HashingThreads()


def chunk_digests_later(data: ReadableBuffer, chunk: int) -> Future[bytes]:
    """:func:`chunk_digests` of ``data`` on a hashing thread; the future's ``result()`` is the digests.
    ``data`` must stay unchanged until then."""
    return _HASHING.submit(data, chunk)


def file_digest(path: str | os.PathLike | int) -> bytes:
    """The digest of a whole file, read in 16 MiB pieces; ``path`` may be a descriptor (closed after)."""
    h = blake3()
    with open(path, "rb") as f:
        while piece := f.read(16 << 20):
            h.update(piece)
    return h.digest()


def name_of(metadata_bytes: bytes) -> str:
    """A dataset's name: ``blake3:<hex>`` of its ``blockfs.json`` as stored."""
    return f"{ALGORITHM}:{blake3(metadata_bytes).hexdigest()}"


def is_hex_digest(value: object) -> bool:
    return isinstance(value, str) and len(value) == 2 * DIGEST_SIZE and all(c in "0123456789abcdef" for c in value)


def parse_name(text: str) -> str:
    """A dataset name as given by a user (``blake3:<64 hex>``; a bare 64-digit hex is taken as BLAKE3)."""
    name = text.strip().lower()
    if is_hex_digest(name):
        name = f"{ALGORITHM}:{name}"
    if not _NAME.match(name):
        raise IdentityError(
            f"--expect {text!r} is not a dataset name: give it as 'blake3:' and 64 hex digits, as 'blockfs info' prints"
        )
    return name


def check_name(where: str, actual: str | None, expected: str | None) -> None:
    """Refuse a dataset whose name is not the pinned one, in one line naming both; ``actual`` None: a dataset
    with no metadata to name it by (a mount's control directory without it), which no pin can accept."""
    if expected is None:
        return
    if actual is None:
        raise IdentityError(
            f"{where} has no name (no metadata to derive it from), so it cannot be the pinned "
            f"{parse_name(expected)}: refusing to read it"
        )
    if actual != parse_name(expected):
        raise IdentityError(f"{where} is {actual}, not the pinned {parse_name(expected)}: refusing to read it")
