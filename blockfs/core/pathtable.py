"""Many paths as one array of bytes: how the index stores them, and how the packer holds them while it
builds one.

A Python list of ten million ``bytes`` costs about 70 bytes a path beyond the path itself; here a path
costs its bytes, its NUL and one 8-byte offset.  The layout is the index's ``paths``/``path_offsets``
(:mod:`.index_format`): ``\\0``, then every path NUL-terminated; path ``i`` is
``blob[off[i] : off[i + 1] - 1]``.  Paths are therefore read in chunks (one ``split`` of a contiguous
run) or one at a time, never all at once as objects.
"""

from __future__ import annotations

import zlib
from collections.abc import Iterable, Iterator

import numpy as np

from .heap import give_back

CHUNK = 1 << 16  # paths per chunk when paths are read or gathered: bounded transient memory


class PathTable:
    """Paths (relative, "/"-separated bytes; b"" is the root) back to back, NUL-terminated."""

    def __init__(self, blob: np.ndarray, offsets: np.ndarray) -> None:
        self.blob = blob  # uint8: b"\0" then each path and its NUL
        self.offsets = offsets  # uint64, n + 1; offsets[0] == 1
        self._view = blob.data  # slicing a memoryview is several times faster than an array
        self._off = offsets.data.cast("B").cast("Q")

    @classmethod
    def from_list(cls, paths: Iterable[bytes]) -> PathTable:
        builder = PathTableBuilder()
        for p in paths:
            builder.add(p)
        return builder.finish()

    def __len__(self) -> int:
        return int(self.offsets.size) - 1

    def __getitem__(self, i: int) -> bytes:
        return self._view[self._off[i] : self._off[i + 1] - 1].tobytes()

    def lengths(self) -> np.ndarray:
        """Each path's length in bytes (without its NUL)."""
        return np.diff(self.offsets) - np.uint64(1)

    def chunks(self, size: int = CHUNK) -> Iterator[tuple[int, list[bytes]]]:
        """(first position, the paths from there) for consecutive runs of at most ``size`` paths."""
        n = len(self)
        for start in range(0, n, size):
            end = min(n, start + size)
            run = self._view[self._off[start] : self._off[end] - 1].tobytes()
            yield start, run.split(b"\0")

    def take(self, order: np.ndarray) -> PathTable:
        """The paths at positions ``order``, in that order (built chunk by chunk into one new array)."""
        offsets = self.take_offsets(order)
        blob = np.empty(int(offsets[-1]), dtype=np.uint8)
        pos = 0
        for piece in self.take_pieces(order):
            blob[pos : pos + piece.size] = piece
            pos += piece.size
        return PathTable(blob, offsets)

    def take_offsets(self, order: np.ndarray) -> np.ndarray:
        """The offsets of :meth:`take`'s table, without its blob."""
        order = np.asarray(order)  # any integer dtype: no copy
        offsets = np.empty(order.size + 1, dtype=np.uint64)
        offsets[0] = 1
        for start in range(0, order.size, CHUNK):  # each path's length with its NUL, a chunk at a time
            at = order[start : start + CHUNK]
            offsets[start + 1 : start + 1 + at.size] = self.offsets[at + 1] - self.offsets[at]
        np.cumsum(offsets[1:], out=offsets[1:])
        offsets[1:] += 1
        return offsets

    def take_pieces(self, order: np.ndarray, crcs: np.ndarray | None = None) -> Iterator[np.ndarray]:
        """The blob of :meth:`take`'s table piece by piece (its leading NUL first), never whole: a packer
        writes it straight into the index, so the paths are never held twice.  ``crcs``: filled with each
        taken path's CRC-32 (without its NUL), for the index's hash table."""
        yield np.zeros(1, dtype=np.uint8)
        view, off = self._view, self._off
        order = np.asarray(order)
        for start in range(0, order.size, CHUNK):
            ids = order[start : start + CHUNK].tolist()
            if crcs is not None:
                crcs[start : start + len(ids)] = [zlib.crc32(view[off[i] : off[i + 1] - 1]) for i in ids]
            yield np.frombuffer(b"".join([view[off[i] : off[i + 1]] for i in ids]), dtype=np.uint8)


class PathTableBuilder:
    """Paths added one at a time, held as joined chunks until :meth:`finish` copies them into one array."""

    def __init__(self) -> None:
        self._pending: list[bytes] = []
        self._chunks: list[bytes] = []
        self._lengths: list[np.ndarray] = []
        self._n = 0

    def add(self, path: bytes) -> None:
        if b"\0" in path:
            raise ValueError(f"path {path!r} holds a NUL byte")
        self._pending.append(path)
        if len(self._pending) >= CHUNK:
            self._flush()

    def __len__(self) -> int:
        return self._n + len(self._pending)

    def _flush(self) -> None:
        if self._pending:
            self._chunks.append(b"\0".join(self._pending) + b"\0")
            self._lengths.append(np.fromiter(map(len, self._pending), dtype=np.uint64, count=len(self._pending)))
            self._n += len(self._pending)
            self._pending = []

    def finish(self) -> PathTable:
        self._flush()
        lengths = np.concatenate(self._lengths) if self._lengths else np.zeros(0, dtype=np.uint64)
        self._lengths = []
        offsets = np.empty(lengths.size + 1, dtype=np.uint64)
        offsets[0] = 1
        np.cumsum(lengths + 1, out=offsets[1:])
        offsets[1:] += 1
        blob = np.empty(int(offsets[-1]), dtype=np.uint8)
        blob[0] = 0
        pos = 1
        self._chunks.reverse()
        while self._chunks:  # each chunk freed once copied: the paths are never held twice
            chunk = self._chunks.pop()
            blob[pos : pos + len(chunk)] = np.frombuffer(chunk, dtype=np.uint8)
            pos += len(chunk)
            del chunk
            if len(self._chunks) % 16 == 0:
                give_back()  # the freed chunks, to the system: else they count until reused
        return PathTable(blob, offsets)
