"""``UncachedFiles``: files of blocks the cache does not hold, read alone from the store, verified.

A block the policy refuses (cache-once with a full budget, ``none``) is never read whole to serve one file:
the file alone is read and verified by its own CRC (:meth:`BlockStore.read_file`).  FUSE asks for a file
in 128 KiB pieces, so a small "current file" buffer keeps the file (or, for a file too big for it, a window
of it) and a file read in pieces costs one storage read.  The buffer holds a few files at a time, not
bytes' worth of them: 16 MiB of small files would otherwise act as an LRU cache of the last files read and
hit across epochs, outside the budget.
"""

from __future__ import annotations

import threading
from collections import OrderedDict

from ...core import format as fmt
from ...core.store import BlockStore
from .cache_stats import CacheCounters

FILE_BUFFER_BYTES = 16 << 20  # the current-file buffer (outside the budget: a small fixed overhead)
FILE_BUFFER_FILES = 8  # files in it at once: one per reader mid-file, with room to spare
FILE_WINDOW = 4 << 20  # piece of a file too big for that buffer read at a time


class UncachedFiles:
    """Reads of single files for the cache, counted in its ``counters``."""

    def __init__(self, store: BlockStore, counters: CacheCounters) -> None:
        self._store = store
        self._counters = counters
        self.buffer = FileBuffer(FILE_BUFFER_BYTES, FILE_BUFFER_FILES)

    def read(self, block: int, slot: int, crc: int, offset: int, size: int, head: fmt.BlockHeader) -> bytes:
        """Bytes ``[offset, offset + size)`` of one file (``size < 0``: to its end), verified."""
        length = int(head.sizes[slot])
        if size < 0 or offset + size > length:
            size = max(0, length - offset)
        if offset == 0 and size == length:  # the whole file in one request: no need to buffer it
            return self._store_read(block, slot, crc, 0, length)
        key = (block, slot)
        data = self.buffer.get(key, offset, size)
        if data is not None:
            self._counters.add("buffer_hits")
            return data
        if length <= FILE_BUFFER_BYTES:
            start, window = 0, self._store_read(block, slot, crc, 0, length)
        else:
            start = offset - offset % FILE_WINDOW
            span = min(max(FILE_WINDOW, offset + size - start), length - start)
            if head.chunk_crcs is None and not self._store.checks_pieces:  # narrow, no digests: one CRC for the file
                self._counters.add("file_bytes_read", self._store.verify_file(block, slot, crc))
            window = self._store_read(block, slot, crc, start, span)
        self.buffer.put(key, start, window)
        return window[offset - start : offset - start + size]

    def _store_read(self, block: int, slot: int, crc: int, offset: int, size: int) -> bytes:
        data = self._store.read_file(block, slot, crc, offset, size)
        self._counters.add_many(file_reads=1, file_bytes_read=len(data))
        return data


class FileBuffer:
    """Recently read windows of files, at most ``capacity`` bytes and ``files`` files."""

    def __init__(self, capacity: int, files: int) -> None:
        self._capacity = capacity
        self._max_files = files
        self._items: OrderedDict[tuple[int, int], tuple[int, bytes]] = OrderedDict()
        self._lock = threading.Lock()
        self.nbytes = 0

    def get(self, key: tuple[int, int], offset: int, size: int) -> bytes | None:
        with self._lock:
            item = self._items.get(key)
            if item is None:
                return None
            start, data = item
            if not (start <= offset and offset + size <= start + len(data)):
                return None
            self._items.move_to_end(key)
        return data[offset - start : offset - start + size]

    def put(self, key: tuple[int, int], start: int, data: bytes) -> None:
        with self._lock:
            old = self._items.pop(key, None)
            if old is not None:
                self.nbytes -= len(old[1])
            self._items[key] = (start, data)
            self.nbytes += len(data)
            while len(self._items) > 1 and (self.nbytes > self._capacity or len(self._items) > self._max_files):
                _key, (_start, dropped) = self._items.popitem(last=False)
                self.nbytes -= len(dropped)

    def clear(self) -> None:
        with self._lock:
            self._items.clear()
            self.nbytes = 0
