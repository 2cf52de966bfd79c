"""``BlockCache``: whole blocks held in memory under one byte budget, in front of a :class:`BlockStore`.

What it promises (the mount's serving rules):

* A block the policy admits is read whole, in one sequential read, into anonymous memory
  (:mod:`blockfs.serve.cache.block_memory`: never a file-backed map, which the kernel would reclaim like page cache),
  verified by the store; every later read of a file in it is a memory copy.
* Concurrent misses of one block read it once (single flight: the first reader loads, the others wait on
  its future).  The bytes are reserved with the policy *before* the read, so two loads can never both count
  on the same room.
* A block the policy would refuse (cache-once with a full budget, ``none``) is never read whole to serve
  one file: the file alone is read and verified by its own CRC (:mod:`blockfs.serve.cache.uncached`).
* Blocks are also loaded before they are asked for (:mod:`blockfs.serve.cache.background_loads`): prefill, read-ahead
  when reads move through blocks in order, and the blocks a loader announces.
* A damaged block — its data checksum fails, its header is wrong, or it is not this dataset's, on two
  fetches (:meth:`BlockStore._checked`) — is never cached, and that is remembered for its stored version;
  its files are then read one by one, each verified by its own CRC, so only the files whose bytes are
  damaged fail.  Once the stored block is another version (replaced, restored), it is read and cached anew:
  a read of a damaged block also has its version looked at again :data:`DAMAGE_RECHECK_S` later, in the
  background, since the reads that follow a replacement may never come here (the kernel keeps the pages
  of the files just read alone).  A *failed read* (missing file, EMFILE, EIO) is not damage: it fails the
  reads waiting on it and nothing is remembered, so the next read tries again.
* A cached block's memory is a sealed memfd where the process has descriptors to spare, so that
  :meth:`BlockCache.share` can hand a loader on this machine a descriptor of it (:mod:`blockfs.serve.control.share`).
  Only policies that never evict share: a loader's map keeps a block's pages alive, which must not hold
  memory the budget has given back.

The cache holds blocks only.  Retained small files (the memory plan's other half) sit in a store of their
own (:mod:`blockfs.serve.cache.retain`), consulted before the blocks and funded from the same budget by the plan.
"""

from __future__ import annotations

import logging
import threading
import weakref
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

from ...core import format as fmt
from ...core.store import BlockStore
from ...errors import BlockReadError, CorruptBlockError
from .background_loads import LOADER_THREADS, READAHEAD_BLOCKS, BackgroundLoads
from .block_loads import BlockLoads
from .block_memory import BlockMemory
from .block_window import BlockWindow
from .cache_stats import CacheCounters
from .cached_block import CachedBlock
from .damaged_blocks import DAMAGE_RECHECK_S, DamagedBlocks
from .policies import DEFAULT_POLICY, make_policy
from .readahead import SequentialReads
from .shared_blocks import NotShared, SharedBlocks
from .uncached import UncachedFiles

log = logging.getLogger(__name__)

__all__ = ["DAMAGE_RECHECK_S", "READAHEAD_BLOCKS", "BlockCache", "NotShared"]


class BlockCache:
    """Serves ``read_file`` from whole cached blocks, or file by file from the store.

    ``budget_bytes`` bounds the bytes of cached block data; ``policy`` is a name from
    :data:`blockfs.serve.cache.policies.POLICIES`.  ``n_files`` (the dataset's file count) lets the statistics cut
    reads into epochs.  Thread-safe; call :meth:`close` to stop the loaders.
    """

    def __init__(
        self,
        store: BlockStore,
        budget_bytes: int,
        policy: str = DEFAULT_POLICY,
        *,
        readahead: int = READAHEAD_BLOCKS,
        loaders: int = LOADER_THREADS,
        lock_memory: bool = True,
        n_files: int = 0,
        share: bool = True,
        on_load: Callable[[int], None] | None = None,
        admits: Callable[[BlockCache, int, int], bool] | None = None,
        window_bytes: int = 0,
        window_for: Callable[[int], bool] | None = None,
    ) -> None:
        # The window (blocks another node owns, read whole for the reads that follow) is part of the budget.
        window_bytes = min(max(0, window_bytes), budget_bytes) if window_for is not None else 0
        self._policy = make_policy(policy, budget_bytes - window_bytes)
        self._touch = self._policy.name == "lru"  # only recency-ordered policies care about hits
        # Only a policy that never evicts shares: a loader's map would keep an evicted block's pages alive.
        self.shares = share and not self._policy.evicts and self._policy.name != "none"
        self._memory = BlockMemory(lock=lock_memory, memfds=self.shares)
        self._lock = threading.Lock()
        self._blocks: dict[int, CachedBlock] = {}
        self._loading: dict[int, Future] = {}
        self.closed = False
        # Asked (this cache, block, data bytes) before the policy, under the lock: False keeps the block out of
        # memory (with peers, room is kept for the blocks this node owns; serve/peers.py).  It must not block.
        self._admits = admits
        self._counters = CacheCounters(n_files)
        # Lambdas over a proxy, not bound methods: a cycle would keep an unclosed cache's memory (see below).
        me = weakref.proxy(self)
        # Never cached, their files served one by one, until the stored block is another version.
        self._damaged = DamagedBlocks(store, self._counters, self._lock, lambda block: me._load_if_replaced(block))
        # ``on_load`` is called with the block each time a block is published; the kernel adapter pushes its
        # files into the page cache from there.  Runs in the loading thread: it must only queue work.
        self._loads = BlockLoads(
            store,
            self._memory,
            self._damaged,
            self._counters,
            self._lock,
            self._policy,
            self._blocks,
            self._loading,
            on_load,
        )
        self._shared = SharedBlocks(
            self.shares,
            self._policy.name,
            self._blocks,
            lambda block: me.load(block),
            self._damaged,
            self._lock,
            self._counters,
        )
        self._files = UncachedFiles(store, self._counters)
        self._window = (
            BlockWindow(store, window_bytes, window_for, self._counters)
            if window_for is not None and window_bytes > 0
            else None
        )
        self._sequence = SequentialReads()
        # A proxy, not a reference: a cycle would keep an unclosed cache's memory until the cycle collector ran.
        self._background = BackgroundLoads(
            weakref.proxy(self),
            store.n_blocks,
            readahead=readahead,
            threads=loaders,
            to_disk=store.files.keeps_copies,
            to_window=self._window is not None,
        )

    # --- the reader interface ---------------------------------------------------------------------
    def read_file(self, block: int, slot: int, crc: int, offset: int = 0, size: int = -1) -> bytes:
        """Bytes ``[offset, offset + size)`` of one file (all of it by default), verified."""
        cached = self.cached(block)
        if cached is not None:
            data = cached.read(slot, offset, size)
            self._served(block, slot, offset, len(data), hit=True)
            return data
        try:
            return self._read_miss(block, slot, crc, offset, size)
        except BlockReadError:
            self._counters.add("read_errors")
            raise

    def holds(self, block: int) -> bool:
        """Whether ``block`` is in memory now (a read of it will not wait on storage)."""
        return block in self._blocks or (self._window is not None and self._window.get(block) is not None)

    def cached(self, block: int) -> CachedBlock | None:
        """The block in memory (cached, or in the window), or None; what it holds stays valid for as long as
        the caller keeps it."""
        cached = self._blocks.get(block)
        if cached is None and self._window is not None:
            return self._window.get(block)
        return cached

    def count_hit(self, block: int, slot: int, offset: int, nbytes: int) -> None:
        """Count a read its caller served from :meth:`cached` itself, as :meth:`read_file` counts its hits
        (and read ahead when reads move through blocks in order): :meth:`_served` of a hit, one call less."""
        self._counters.read(offset, nbytes, True)
        if self._window is not None:
            self._window.note_read(block, slot, offset)
        if self._touch:
            with self._lock:
                if block in self._policy:
                    self._policy.touch(block)
        if self._sequence.step(block):
            self._background.read_ahead(block)

    def note_pushed(self, block: int, slot: int) -> None:
        """File ``slot`` of ``block`` handed to the kernel's page cache whole (its reads will not come here): for
        the window, that file is read."""
        if self._window is not None:
            self._window.note_read(block, slot, 0)

    def note_hit(self, offset: int, nbytes: int) -> None:
        """Count a read served from memory outside the blocks (a retained file) in the same statistics."""
        self._counters.read(offset, nbytes, hit=True)

    def _served(self, block: int, slot: int, offset: int, nbytes: int, hit: bool) -> None:
        """Count one read; keep LRU's order; read ahead when reads move through blocks in order."""
        self._counters.read(offset, nbytes, hit)
        if hit and self._window is not None:
            self._window.note_read(block, slot, offset)
        if hit and self._touch:
            with self._lock:
                if block in self._policy:
                    self._policy.touch(block)
        if self._sequence.step(block):
            self._background.read_ahead(block)

    def _read_miss(self, block: int, slot: int, crc: int, offset: int, size: int) -> bytes:
        # A damaged block replaced since is forgotten here, before its header is read.
        if self._damaged.is_damaged(block):
            self._damaged.look_again_later(block)
        head = self._loads.header(block)  # small; raises for a missing, foreign or damaged header
        with self._lock:
            cached = self._blocks.get(block)
            if cached is None:
                future, mine = self._claim(block, head)
        if cached is not None:
            data = cached.read(slot, offset, size)
            self._served(block, slot, offset, len(data), hit=True)
            return data
        self._served(block, slot, offset, 0, hit=False)
        loaded: bytes | None = None
        if future is not None:
            try:
                loaded = self._await(block, head, future, mine).read(slot, offset, size)
            except CorruptBlockError:
                pass  # the block is damaged: read (and verify) this file alone
        elif self._window is not None and not self._damaged.is_damaged(block):
            windowed = self._window.read(block, slot, head)  # another node's block, read whole on its second miss
            if windowed is not None:
                loaded = windowed.read(slot, offset, size)
        if loaded is None:
            loaded = self._files.read(block, slot, crc, offset, size, head)
        self._counters.add("bytes_served", len(loaded))
        return loaded

    def _load_if_replaced(self, block: int) -> None:
        """A damaged block read earlier is due a look at its version: load it if it was replaced."""
        if not self.closed and self.wanted(block):  # wanted() looks at the version: replaced, not damaged
            self._background.load_soon(block, "replaced_loads")

    # --- sharing ----------------------------------------------------------------------------------
    def share(self, block: int) -> int:
        """A new descriptor of the sealed memory holding ``block``'s verified data (the caller closes it).

        Loads the block first, as a read's miss would, if the policy admits it.  Raises :class:`NotShared`
        saying why when there is none to give: the policy evicts (or caches nothing), the budget is full,
        the block is damaged or cannot be read, or its memory could not be made shareable.
        """
        return self._shared.share(block)

    def load(self, block: int) -> CachedBlock | None:
        """``block`` from memory, loaded now (or waited for: single flight with every other load) if the
        policy admits it; None when it does not.  Raises CorruptBlockError / BlockReadError."""
        cached = self._blocks.get(block)
        if cached is not None:
            return cached
        head = self._loads.header(block)
        with self._lock:
            cached = self._blocks.get(block)
            if cached is not None:
                return cached
            future, mine = self._claim(block, head)
        return None if future is None else self._await(block, head, future, mine)

    # --- admission and single flight ----------------------------------------------------------------
    def _claim(self, block: int, head: fmt.BlockHeader) -> tuple[Future | None, bool]:
        """Under the lock: the load to wait for (and whether this caller must run it), or None."""
        future = self._loading.get(block)
        if future is not None:
            return future, False
        if self.closed or block in self._damaged:
            return None, False
        if self._admits is not None and not self._admits(self, block, head.data_size):
            return None, False
        evicted = self._policy.admit(block, head.data_size)  # reserves the room before any byte is read
        if evicted is None:
            return None, False
        for victim in evicted:
            self._loads.drop(self._blocks.pop(victim, None))
        future = Future()
        self._loading[block] = future
        return future, True

    def _await(self, block: int, head: fmt.BlockHeader, future: Future, mine: bool) -> CachedBlock:
        """The claimed block: loaded here if this caller claimed it, else waited for (single flight)."""
        if mine:
            self._loads.load(block, head, future)
        else:
            self._counters.add("load_waits")
        return future.result()

    def wanted(self, block: int) -> bool:
        """Whether a background load of ``block`` could help: not cached, loading or known damaged."""
        return block not in self._blocks and block not in self._loading and not self._damaged.is_damaged(block)

    @property
    def full(self) -> bool:
        return self._policy.used_bytes >= self._policy.budget_bytes

    def count(self, name: str) -> None:
        self._counters.add(name)

    def window_ahead(self, block: int, current: Callable[[], bool]) -> Callable[[], object] | None:
        """Claim room in the window for ``block``, another node's block a loader announced, waiting while
        ``current()`` for a block held there to be read out (:meth:`BlockWindow.claim_ahead`).  Returns the
        load to run (it fetches the data section whole, verified), None when it declined: no window, not
        another node's, in memory or being loaded, known damaged, or no longer current."""
        if self._window is None or self.closed or block in self._blocks or block in self._loading:
            return None
        if not self._window.eligible(block):  # this node's own: the cache's prefetch loads it (no header read)
            return None
        try:
            head = self._loads.header(block)
        except (CorruptBlockError, BlockReadError):
            return None  # reported when a file of it is read
        if self._damaged.is_damaged(block):
            return None
        load = self._window.claim_ahead(block, head, lambda: current() and not self.closed)
        if load is None:
            return None

        def run() -> object:
            try:
                return load()
            except (CorruptBlockError, BlockReadError):
                return None  # the window dropped it: the reads read their files alone, which reports it

        return run

    def copy_ahead(self, block: int) -> bool:
        """Fetch ``block`` into the disk tier before a read needs it (a loader announced it, and memory
        will not hold it); whether it was copied.  A failure is left for the read to report."""
        return self._loads.copy_ahead(block)

    def load_ahead(self, block: int, counter: str, *, fill_only: bool) -> int | None:
        """Load ``block`` before any read asks for it, if :meth:`claim_ahead` lets it.  Returns the block's
        data bytes when this call loaded it (or failed to), None when it declined."""
        load = self.claim_ahead(block, counter, fill_only=fill_only)
        return None if load is None else load()

    def claim_ahead(self, block: int, counter: str, *, fill_only: bool) -> Callable[[], int] | None:
        """Claim ``block``'s room for a background load, if the guard every background load passes lets it:
        not cached, loading or damaged; the policy would admit it (a guess that does not fit is not a
        refusal of a read); with ``fill_only``, only into free room, evicting nothing.  Returns the load to
        run (it returns the data bytes), None when it declined.  Claiming apart from loading lets a caller
        claim blocks in a chosen order and still load them side by side."""
        try:
            head = self._loads.header(block)
        except (CorruptBlockError, BlockReadError):
            return None  # reported when a file of it is read
        damaged = self._damaged.is_damaged(block)  # outside the lock: it may look at the stored version
        with self._lock:
            wanted = block not in self._blocks and block not in self._loading and not damaged
            if not wanted or block in self._policy or self.closed:
                return None
            room = self._policy.budget_bytes - self._policy.used_bytes
            if (fill_only and head.data_size > room) or not self._policy.would_admit(block, head.data_size):
                return None
            future, mine = self._claim(block, head)
            if future is None or not mine:  # marked damaged since the look above, outside the lock
                return None
        self._counters.add(counter)

        def load() -> int:
            self._loads.load(block, head, future)
            return head.data_size

        return load

    # --- loading ahead ----------------------------------------------------------------------------
    def keep_to(self, blocks: list[int]) -> None:
        """Load ahead only ``blocks``, this node's part (see :meth:`BackgroundLoads.keep_to`)."""
        self._background.keep_to(blocks)

    def start_prefill(self) -> None:
        """Load blocks in the background, in order, while they fit without evicting anything.

        The blocks a cache-once budget will hold are then read sequentially at disk speed while the first
        epoch runs, instead of each on its first miss; a miss of a block not loaded yet loads it at once
        in the reading thread, so prefill never delays a read.
        """
        self._background.start_prefill()

    def preload(self, on_block: Callable[[int], None] | None = None) -> None:
        """What :meth:`start_prefill` does, now, in this thread (``on_block(bytes)`` after each block)."""
        self._background.prefill(on_block)

    def prefetch(self, blocks: list[int]) -> None:
        """Load ``blocks`` in the background, in this order, as far as they fit without evicting anything
        (a loader's announcement of what it reads next); a new call replaces the one before.  Another
        node's blocks go to the window instead, each as soon as room is made for it."""
        if self._window is not None:
            self._window.announced(blocks)
        self._background.prefetch(blocks)

    # --- statistics and life cycle ----------------------------------------------------------------
    @property
    def policy_name(self) -> str:
        return self._policy.name

    @property
    def budget_bytes(self) -> int:
        return self._policy.budget_bytes

    @property
    def used_bytes(self) -> int:
        """Bytes the policy has given to blocks (loaded or loading)."""
        return self._policy.used_bytes

    def stats(self) -> dict[str, Any]:
        """Counters, cache fill and per-epoch hit rates, as plain JSON-ready values."""
        counters, epochs = self._counters.snapshot()
        cache = {"policy": self._policy.name, **self._loads.fill(), "file_buffer_bytes": self._files.buffer.nbytes}
        if self._window is not None:
            cache["window"] = self._window.stats()
        return {"counters": counters, "cache": cache, "epochs": epochs, "uptime_s": self._counters.uptime_s}

    def close(self) -> None:
        """Stop the loaders and drop every cached block."""
        with self._lock:
            self.closed = True
        self._damaged.close()
        self._background.close()
        if self._window is not None:
            self._window.close()
        with self._lock:
            for cached in self._blocks.values():
                self._loads.drop(cached)
            self._blocks.clear()
        self._files.buffer.clear()
