"""``BackgroundLoads``: blocks loaded before a read asks for them, on background threads.

Three reasons to load a block early, all through the cache's one admission guard
(:meth:`blockfs.serve.cache.block_cache.BlockCache.load_ahead`):

* **prefill** — at mount, the blocks a cache-once budget will hold, in order, read at disk speed while the
  first epoch runs instead of each on its first miss;
* **read-ahead** — the next blocks, once reads move through blocks in order
  (:class:`blockfs.serve.cache.readahead.SequentialReads`);
* **prefetch** — the blocks a loader announced it reads next (:mod:`blockfs.serve.control.announce`); a new
  announcement replaces the one before.  With peers, the announced blocks another node owns go to the
  cache's window (:mod:`blockfs.serve.cache.block_window`) instead, on threads of their own: each waits there
  until a block held is read out, so the reads find the next blocks in memory, and a wait never delays the
  other loads.

Prefill and prefetch only fill free room: they never evict, so they cannot push out a block being read.
A miss of a block not loaded yet loads it at once in the reading thread: background loads never delay a
read.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Protocol

LOADER_THREADS = 2  # background loaders
WINDOW_THREADS = 2  # fetches ahead into the window at once (a section's transfer overlaps the next one's request)
READAHEAD_BLOCKS = 2  # blocks loaded ahead once reads move through blocks in order


class AheadLoadable(Protocol):
    """What the background loads need from the cache."""

    closed: bool

    @property
    def full(self) -> bool: ...

    def wanted(self, block: int) -> bool: ...

    def load_ahead(self, block: int, counter: str, *, fill_only: bool) -> int | None: ...

    def claim_ahead(self, block: int, counter: str, *, fill_only: bool) -> Callable[[], int] | None: ...

    def copy_ahead(self, block: int) -> bool: ...

    def window_ahead(self, block: int, current: Callable[[], bool]) -> Callable[[], object] | None: ...

    def count(self, name: str) -> None: ...


class BackgroundLoads:
    """A pool of ``threads`` loader threads (started on first use) in front of ``cache``."""

    def __init__(
        self,
        cache: AheadLoadable,
        n_blocks: int,
        *,
        readahead: int,
        threads: int,
        to_disk: bool = False,
        to_window: bool = False,
    ) -> None:
        self._cache = cache
        self._to_disk = to_disk  # announced blocks memory will not hold go to a remote dataset's disk tier
        # announced blocks of other nodes go to the window, on threads of their own (they wait there for room)
        self._window_pool = (
            ThreadPoolExecutor(WINDOW_THREADS, thread_name_prefix="blockfs-window") if to_window else None
        )
        self._window_order = threading.Lock()  # their room is claimed in the announced order
        self._n_blocks = n_blocks
        self._readahead = max(0, readahead)
        self._threads = max(1, threads)
        self._pool = ThreadPoolExecutor(self._threads, thread_name_prefix="blockfs-load")
        self._lock = threading.Lock()
        self._claim_order = threading.Lock()  # announced blocks are claimed in the announced order
        self._generation = 0  # of the latest announcement
        self._part: frozenset[int] | None = None  # the blocks prefill and read-ahead may load (None: all)

    def start_prefill(self) -> None:
        if not self._cache.closed:
            self._pool.submit(self.prefill)

    def keep_to(self, blocks: list[int]) -> None:
        """Prefill and read-ahead load only ``blocks`` (this node's part under ``partition="node"``): a
        cache-once budget spent on another node's blocks would never serve this node."""
        self._part = frozenset(blocks)

    def prefill(self, on_block: Callable[[int], None] | None = None) -> None:
        """Load blocks in order while they fit without evicting (``on_block(bytes)`` after each).  A block
        too big for the room left is passed over: a smaller one further on may still fit."""
        for block in range(self._n_blocks) if self._part is None else sorted(self._part):
            if self._cache.closed or self._cache.full:
                return
            if self._cache.wanted(block):
                loaded = self._cache.load_ahead(block, "prefill_loads", fill_only=True)
                if loaded is not None and on_block is not None:
                    on_block(loaded)

    def read_ahead(self, block: int) -> None:
        """Load the blocks after ``block`` (reads move through blocks in order)."""
        if self._cache.closed:
            return
        for ahead in range(block + 1, min(block + 1 + self._readahead, self._n_blocks)):
            if self._cache.wanted(ahead) and (self._part is None or ahead in self._part):
                self._pool.submit(self._cache.load_ahead, ahead, "readahead_loads", fill_only=False)

    def load_soon(self, block: int, counter: str) -> None:
        """Load ``block`` on a loader thread, as a read's miss would (a damaged block found replaced)."""
        if self._cache.closed:
            return
        try:
            self._pool.submit(self._cache.load_ahead, block, counter, fill_only=False)
        except RuntimeError:  # closed meanwhile: the pool takes nothing more
            pass

    def prefetch(self, blocks: list[int]) -> None:
        """Load ``blocks`` in this order as far as they fit without evicting; replaces the last call's list."""
        with self._lock:
            if self._cache.closed:
                return
            self._generation += 1
            generation = self._generation
        self._cache.count("announcements")
        # Every loader thread takes the next block from the one list: reading a block and checking its
        # CRC overlap across threads (both release the GIL), and the blocks still arrive in order.
        queue = iter(list(blocks))
        for _ in range(self._threads):
            self._pool.submit(self._prefetch, queue, generation)
        if self._window_pool is not None:
            window = iter(list(blocks))
            for _ in range(WINDOW_THREADS):
                self._window_pool.submit(self._prefetch_window, window, generation)

    def _current(self, generation: int) -> bool:
        return not self._cache.closed and self._generation == generation

    def _prefetch_window(self, blocks: Iterator[int], generation: int) -> None:
        """Another node's announced blocks into the window, in order (the cache's own are _prefetch's)."""
        while True:
            with self._window_order:  # claimed in order, loaded side by side
                with self._lock:
                    if not self._current(generation):
                        return
                    block = next(blocks, None)
                if block is None:
                    return
                load = self._cache.window_ahead(block, lambda: self._current(generation))
            if load is not None:
                load()

    def _prefetch(self, blocks: Iterator[int], generation: int) -> None:
        while True:
            # A block's room is claimed before the next block is taken, so a later block can never take
            # the room an earlier one needs; the loads themselves still run side by side.
            with self._claim_order:
                with self._lock:
                    full = self._cache.full
                    if self._cache.closed or self._generation != generation or (full and not self._to_disk):
                        return
                    block = next(blocks, None)  # under the lock: the threads share the iterator
                if block is None:
                    return
                load = None if full else self._cache.claim_ahead(block, "prefetch_loads", fill_only=True)
            if load is not None:
                load()
            elif self._to_disk:  # memory will not hold it: a remote dataset's disk tier may
                self._cache.copy_ahead(block)

    def close(self) -> None:
        """Stop: queued loads are dropped, running ones finish (the cache is closed first)."""
        self._pool.shutdown(wait=True, cancel_futures=True)
        if self._window_pool is not None:  # a fetch waiting for room sees the cache closed within ROOM_WAIT_S
            self._window_pool.shutdown(wait=True, cancel_futures=True)
