"""``RetainingReader``: the memory plan's retained target files, kept in memory after their first read.

It sits in front of a :class:`BlockCache` (same ``read_file`` interface).  A target file's first read
reads the whole file through the cache (from a cached block or alone from storage, verified either way)
and copies it into a slot of one anonymous arena sized exactly to the plan's retained bytes; every later
read of it is a memory copy, whatever happened to its block since (evicted, never cached, even deleted).

One arena rather than one map per file: small files would each round up to a page, and the offsets of
every target are known from the plan, so no allocator is needed.  The arena is an anonymous map (never
file-backed, which the kernel would reclaim like page cache); its pages become resident as files arrive,
and it is ``mlock``-ed where the process may (see :class:`blockfs.serve.memory.MemoryLock`).
"""

from __future__ import annotations

import mmap
import threading
from typing import Any, Callable, Literal

import numpy as np

from .cache import BlockCache
from .memory import MemoryLock
from ..core.index import KIND_FILE


def slot_base(block_counts: np.ndarray) -> np.ndarray:
    """Where each block's slots start in one numbering of every (block, slot) of a dataset: the file in
    slot ``s`` of block ``b`` is ``base[b] + s``, dense, so per-file state fits an array."""
    base = np.zeros(len(block_counts) + 1, dtype=np.int64)
    np.cumsum(block_counts, out=base[1:])
    return base


def unique_files(arrays: Any) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(block, slot, size) of each distinct file of an index, hard links counted once, in entry order."""
    files = np.flatnonzero(arrays["kind"] == KIND_FILE)
    block = arrays["block"][files].astype(np.int64)
    slot = arrays["slot"][files].astype(np.int64)
    base = slot_base(arrays["block_counts"])
    keys = base[block] + slot
    # The index's checks bound the slots by the files (core/index_checks.py), so the count array is small.
    if keys.size and np.bincount(keys, minlength=int(base[-1])).max() > 1:  # hard links: keep each file's first
        _, first = np.unique(keys, return_index=True)
        first.sort()
    else:  # no two entries share a slot (the common case): no sort at all
        first = np.arange(keys.size)
    return block[first], slot[first], arrays["size"][files][first].astype(np.int64)


class RetainingReader:
    """Serves target files from memory after their first read; everything else from ``cache``.

    ``blocks``, ``slots``, ``sizes``: the target files (the plan's ``retained`` mask applied to
    :func:`unique_files`); ``block_counts``: the slots of every block (the index's column).  Where each
    target sits in the arena is an array over every (block, slot) of the dataset (:func:`slot_base`),
    never a Python object per file: built in a few NumPy passes at mount.  Thread-safe.
    """

    def __init__(
        self,
        cache: BlockCache,
        blocks: np.ndarray,
        slots: np.ndarray,
        sizes: np.ndarray,
        block_counts: np.ndarray,
        *,
        lock_memory: bool = True,
    ) -> None:
        self._cache = cache
        sizes = np.asarray(sizes, dtype=np.int64)
        base = slot_base(block_counts)
        keys = base[np.asarray(blocks, dtype=np.int64)] + np.asarray(slots, dtype=np.int64)
        self.capacity = int(sizes.sum())
        self._targets = int(sizes.size)
        start = np.full(int(base[-1]), -1, dtype=np.int64)  # -1: not a target
        start[keys] = np.cumsum(sizes) - sizes
        length = np.zeros(int(base[-1]), dtype=np.int64)
        length[keys] = sizes
        # memoryviews: indexing one gives a Python int far faster than NumPy's scalars (one per read).
        self._base = base.data.cast("B").cast("q")
        self._start = start.data.cast("B").cast("q")
        self._length = length.data.cast("B").cast("q")
        self._held = bytearray(int(base[-1]))  # 1: read once, its bytes are in the arena
        self._arena = mmap.mmap(-1, max(self.capacity, 1))
        self._memlock = MemoryLock(lock_memory and self.capacity > 0)
        self._locked = self._memlock.lock(self._arena) if self.capacity else False
        self._lock = threading.Lock()
        self._c = {"retained_files": 0, "retained_bytes": 0, "retained_hits": 0, "retained_reads": 0,
                   "storage_bytes_avoided": 0}  # fmt: skip

    def read_file(self, block: int, slot: int, crc: int, offset: int = 0, size: int = -1) -> bytes:
        key = self._base[block] + slot
        start = self._start[key]
        if start < 0:
            return self._cache.read_file(block, slot, crc, offset, size)
        length = self._length[key]
        if size < 0 or offset + size > length:
            size = max(0, length - offset)
        if self._held[key]:
            with self._lock:
                self._c["retained_reads"] += 1
                self._c["storage_bytes_avoided"] += size
                if offset == 0:
                    self._c["retained_hits"] += 1
            self._cache.note_hit(offset, size)
            return self._arena[start + offset : start + offset + size]
        data = self._cache.read_file(block, slot, crc, 0, length)  # the whole file, once, verified
        if len(data) == length:
            self._arena[start : start + length] = data  # concurrent first reads write the same bytes
            with self._lock:
                if not self._held[key]:
                    self._held[key] = 1
                    self._c["retained_files"] += 1
                    self._c["retained_bytes"] += length
        return data[offset : offset + size]

    def preload(self, crcs: dict[tuple[int, int], int], on_file: Callable[[int], None] | None = None) -> None:
        """Read every target file now (``crcs``: key -> CRC); ``on_file(bytes)`` after each."""
        for (block, slot), crc in crcs.items():
            if self.is_target(block, slot) and not self.holds(block, slot):
                data = self.read_file(block, slot, crc)
                if on_file:
                    on_file(len(data))

    def holds(self, block: int, slot: int) -> bool:
        """Whether this file is held now (read once already): a read of it is a memory copy."""
        return bool(self._held[self._base[block] + slot])

    def is_target(self, block: int, slot: int) -> bool:
        """Whether the plan retains this file (read yet or not)."""
        return self._start[self._base[block] + slot] >= 0

    @property
    def targets(self) -> int:
        return self._targets

    def stats(self) -> dict[str, Any]:
        with self._lock:
            c = dict(self._c)
        return {**c, "target_files": self._targets, "target_bytes": self.capacity,
                "locked": self._locked, "mlock": self._memlock.failure or ("locked" if self._locked else "off")}  # fmt: skip

    def close(self) -> None:
        with self._lock:
            self._held = bytearray(len(self._held))
        self._arena.close()


def plan_dataset(
    arrays: Any,
    budget_bytes: int,
    *,
    strategy: str | None = None,
    threshold: int | Literal["auto"] | None = None,
    retain: bool = True,
) -> tuple[Any, tuple[np.ndarray, np.ndarray, np.ndarray]]:
    """The memory plan of a dataset's index (``blockfs plan`` and the mount share it) and its files.

    Returns ``(plan, (blocks, slots, sizes))`` with the distinct files in plan id order; ``retain=False``
    gives every byte of the budget to the block cache (for comparisons)."""
    from .plan import DEFAULT_STRATEGY, make_memory_plan

    blocks, slots, sizes = unique_files(arrays)
    strategy = strategy or ("threshold" if threshold is not None else DEFAULT_STRATEGY)
    if strategy != "threshold":
        threshold = None
    plan = make_memory_plan(sizes, budget_bytes, strategy=strategy, threshold=threshold,
                            retain_share=1.0 if retain else 0.0)  # fmt: skip
    return plan, (blocks, slots, sizes)
