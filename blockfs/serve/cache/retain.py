"""``RetainingReader``: the memory plan's retained target files, kept in memory after their first read.

It sits in front of a :class:`BlockCache` (same ``read_file`` interface).  A target file's first read
reads the whole file through the cache (from a cached block or alone from storage, verified either way)
and copies it into a slot of one anonymous arena sized exactly to the plan's retained bytes; every later
read of it is a memory copy, whatever happened to its block since (evicted, never cached, even deleted).

One arena rather than one map per file: small files would each round up to a page, and the offsets of
every target are known from the plan, so no allocator is needed.  The arena is an anonymous map (never
file-backed, which the kernel would reclaim like page cache); its pages become resident as files arrive,
and it is ``mlock``-ed where the process may (see :class:`blockfs.serve.cache.block_memory.MemoryLock`).
"""

from __future__ import annotations

import mmap
import threading
from collections.abc import Callable
from typing import Any, Literal

import numpy as np

from ...core.index import KIND_FILE
from .block_cache import BlockCache
from .block_memory import MemoryLock


def slot_base(block_counts: np.ndarray) -> np.ndarray:
    """Where each block's slots start in one numbering of every (block, slot) of a dataset: the file in
    slot ``s`` of block ``b`` is ``base[b] + s``, dense, so per-file state fits an array."""
    base = np.zeros(len(block_counts) + 1, dtype=np.int64)
    np.cumsum(block_counts, out=base[1:])
    return base


def unique_files(arrays: Any) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(block, slot, size) of each distinct file of an index, hard links counted once, in entry order:
    block and slot in the index's own types (i4, u4), size as int64.  Every mount makes these, so each
    column is gathered once (no copy of a copy: fresh pages cost a mount as much as the arithmetic)."""
    files = np.flatnonzero(arrays["kind"] == KIND_FILE)
    block, slot = arrays["block"][files], arrays["slot"][files]
    # Sizes as int64 without a copy: every file fits in its block (core/index_checks.py), far below 2**63.
    # Signed in the column's own byte order (the index declares '<u8'): a native int64 view of it would
    # swap every size's bytes on a big-endian machine.
    size = arrays["size"][files]
    size = size.view(np.dtype(np.int64).newbyteorder(size.dtype.byteorder))
    if not files.size:
        return block, slot, size
    base = slot_base(arrays["block_counts"])
    keys = base[block] + slot  # each file's (block, slot) as one number below base[-1]
    if _shares_slots(keys, int(base[-1])):  # hard links: keep each file's first
        _, first = np.unique(keys, return_index=True)
        first.sort()
        return block[first], slot[first], size[first]
    return block, slot, size  # no two entries share a slot (the common case): no sort, no second gather


def _shares_slots(keys: np.ndarray, n_slots: int) -> bool:
    """Whether two of ``keys`` (files' (block, slot) numbers, each below ``n_slots``: every slot is in its
    block's range, core/index_checks.py) are one: a hard link.  One byte a slot marked, then counted:
    0.1-0.2 s at ten million files, where comparing neighbours in ``block_files`` took 0.7 s (two gathers
    in an order unrelated to the entries')."""
    seen = np.zeros(n_slots, dtype=np.uint8)
    seen[keys] = 1
    return int(np.count_nonzero(seen)) < keys.size


class RetainingReader:
    """Serves target files from memory after their first read; everything else from ``cache``.

    ``blocks``, ``slots``, ``sizes``: the target files (the plan's ``retained`` mask applied to
    :func:`unique_files`).  Where each target sits in the arena is a table over the (block, slot)s up to
    each block's last target, never a Python object per file: built in a few NumPy passes at mount.
    Thread-safe.
    """

    def __init__(
        self,
        cache: BlockCache,
        blocks: np.ndarray,
        slots: np.ndarray,
        sizes: np.ndarray,
        *,
        lock_memory: bool = True,
        slots_per_block: np.ndarray | None = None,
    ) -> None:
        self._cache = cache
        blocks, slots = np.asarray(blocks, dtype=np.int64), np.asarray(slots, dtype=np.int64)
        sizes = np.asarray(sizes, dtype=np.int64)
        starts = np.cumsum(sizes) - sizes  # each target's place in the arena
        self.capacity = int(sizes.sum())
        self.n_targets = int(sizes.size)
        # Where each target lives, in arrays (no Python object per file): target (block, slot) is row
        # base[block] + slot of a table as long as the blocks' slots (``slots_per_block``: the index's
        # block_counts, which bound every slot; else each block's up to its last target); a row holds the
        # file's start in the arena and its length, or -1 where the file is not a target.
        if slots_per_block is not None:
            width = np.asarray(slots_per_block, dtype=np.int64)  # no pass over the targets: 0.25 s at 10 M
            if blocks.size and (int(blocks.max()) >= width.size or np.any(slots >= width[blocks])):
                raise ValueError("a target's slot is past its block's slots")
        else:
            width = np.zeros(int(blocks.max()) + 1 if blocks.size else 0, dtype=np.int64)
            np.maximum.at(width, blocks, slots + 1)
        base = np.concatenate([[0], np.cumsum(width)]).astype(np.int64)
        rows = base[blocks] + slots
        start, length = np.full(int(base[-1]), -1, dtype=np.int64), np.full(int(base[-1]), -1, dtype=np.int64)
        start[rows], length[rows] = starts, sizes
        # Read through memoryviews: indexing one gives a Python int far faster than NumPy's scalars.
        self._base = base.data.cast("B").cast("q")
        self._start = start.data.cast("B").cast("q")
        self._length = length.data.cast("B").cast("q")
        self._held = bytearray(int(base[-1]))  # 1: read once, in the arena
        self._arena = mmap.mmap(-1, max(self.capacity, 1))
        self._memlock = MemoryLock(lock_memory and self.capacity > 0)
        self._locked = self._memlock.lock(self._arena) if self.capacity else False
        self._lock = threading.Lock()
        self._c = {
            "retained_files": 0,
            "retained_bytes": 0,
            "retained_hits": 0,
            "retained_reads": 0,
            "storage_bytes_avoided": 0,
        }

    def _row(self, block: int, slot: int) -> int:
        """The table row of a target file, or -1."""
        if not 0 <= block < len(self._base) - 1:
            return -1
        row = self._base[block] + slot
        return row if 0 <= slot and row < self._base[block + 1] and self._length[row] >= 0 else -1

    def read_file(self, block: int, slot: int, crc: int, offset: int = 0, size: int = -1) -> bytes:
        held = self.read_held(block, slot, offset, size)
        if held is not None:
            return held
        row = self._row(block, slot)
        if row < 0:
            return self._cache.read_file(block, slot, crc, offset, size)
        start, length = self._start[row], self._length[row]
        if size < 0 or offset + size > length:
            size = max(0, length - offset)
        data = self._cache.read_file(block, slot, crc, 0, length)  # the whole file, once, verified
        if len(data) == length:
            self._arena[start : start + length] = data  # concurrent first reads write the same bytes
            with self._lock:
                if not self._held[row]:
                    self._held[row] = 1
                    self._c["retained_files"] += 1
                    self._c["retained_bytes"] += length
        return data[offset : offset + size]

    def read_held(self, block: int, slot: int, offset: int = 0, size: int = -1, *, count: bool = True) -> bytes | None:
        """A held file's bytes from ``offset`` (``size`` < 0: to its end), counted as a retained read (unless
        ``count`` is False: a push, not a read); None where the file is not held (not a target, or not read
        yet): a memory copy, never a wait."""
        row = self._row(block, slot)
        if row < 0 or not self._held[row]:
            return None
        start, length = self._start[row], self._length[row]
        if size < 0 or offset + size > length:
            size = max(0, length - offset)
        if not count:
            return self._arena[start + offset : start + offset + size]
        with self._lock:
            self._c["retained_reads"] += 1
            self._c["storage_bytes_avoided"] += size
            if offset == 0:
                self._c["retained_hits"] += 1
        self._cache.note_hit(offset, size)
        return self._arena[start + offset : start + offset + size]

    def preload(self, crcs: dict[tuple[int, int], int], on_file: Callable[[int], None] | None = None) -> None:
        """Read every target file now (``crcs``: key -> CRC); ``on_file(bytes)`` after each."""
        for (block, slot), crc in crcs.items():
            row = self._row(block, slot)
            if row >= 0 and not self._held[row]:
                data = self.read_file(block, slot, crc)
                if on_file:
                    on_file(len(data))

    def holds(self, block: int, slot: int) -> bool:
        """Whether this file is held now (read once already): a read of it is a memory copy."""
        row = self._row(block, slot)
        return row >= 0 and bool(self._held[row])

    def is_target(self, block: int, slot: int) -> bool:
        """Whether the plan retains this file (read yet or not)."""
        return self._row(block, slot) >= 0

    @property
    def targets(self) -> int:
        return self.n_targets

    def stats(self) -> dict[str, Any]:
        with self._lock:
            c = dict(self._c)
        return {
            **c,
            "target_files": self.n_targets,
            "target_bytes": self.capacity,
            "locked": self._locked,
            "mlock": self._memlock.failure or ("locked" if self._locked else "off"),
        }

    def close(self) -> None:
        with self._lock:
            self._held[:] = bytes(len(self._held))  # nothing is held once the arena is gone
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
    from .memory_plan import DEFAULT_STRATEGY, make_memory_plan

    blocks, slots, sizes = unique_files(arrays)
    strategy = strategy or ("threshold" if threshold is not None else DEFAULT_STRATEGY)
    if strategy != "threshold":
        threshold = None
    block_sizes = arrays.get("block_sizes") if hasattr(arrays, "get") else None
    one_block = int(np.median(block_sizes)) if block_sizes is not None and len(block_sizes) else 0
    plan = make_memory_plan(
        sizes,
        budget_bytes,
        strategy=strategy,
        threshold=threshold,
        retain_share=1.0 if retain else 0.0,
        block_bytes=one_block,
    )
    return plan, (blocks, slots, sizes)
