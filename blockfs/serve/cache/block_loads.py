"""``BlockLoads``: what :class:`~blockfs.serve.cache.block_cache.BlockCache` fetches from its store.

A block's header (a damaged or foreign one remembered as damaged); a claimed block's data section whole into
fresh anonymous memory (:mod:`blockfs.serve.cache.block_memory`), verified by the store, then published to the
cache's blocks (or its error to every waiter); a block's copy into the disk tier ahead of a read; and how
full the cache is.
Admission and single flight (which block is claimed, by whom) stay with the cache.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

from ...core import format as fmt
from ...core.store import BlockStore
from ...errors import BlockReadError, CorruptBlockError
from .block_memory import BlockMemory
from .cache_stats import CacheCounters
from .cached_block import CachedBlock
from .damaged_blocks import DamagedBlocks
from .policies import BlockPolicy

log = logging.getLogger(__name__)

__all__ = ["BlockLoads"]


class BlockLoads:
    """Loads for one cache, into its ``blocks`` and out of its ``loading`` (both guarded by its ``lock``,
    with its ``policy``).  ``on_load(block)`` runs after each block published, in the loading thread."""

    def __init__(
        self,
        store: BlockStore,
        memory: BlockMemory,
        damaged: DamagedBlocks,
        counters: CacheCounters,
        lock: threading.Lock,
        policy: BlockPolicy,
        blocks: dict[int, CachedBlock],
        loading: dict[int, Future],
        on_load: Callable[[int], None] | None,
    ) -> None:
        self._store = store
        self._memory = memory
        self._damaged = damaged
        self._counters = counters
        self._lock = lock
        self._policy = policy
        self._blocks = blocks
        self._loading = loading
        self._on_load = on_load

    def header(self, block: int) -> fmt.BlockHeader:
        """The store's header of ``block``; a damaged or foreign one is remembered and counted once."""
        try:
            return self._store.header(block)
        except CorruptBlockError:
            self._damaged.mark(block)
            raise

    def load(self, block: int, head: fmt.BlockHeader, future: Future) -> None:
        """Read a claimed block whole, verify it, and publish it (or the error) to every waiter."""
        try:
            cached = self._read(block, head)
        except BaseException as e:
            with self._lock:
                self._loading.pop(block, None)
                self._policy.discard(block)
            self._counters.add("load_errors")
            if isinstance(e, CorruptBlockError):
                self._damaged.mark(block)
            log.debug("loading block %d failed: %s", block, e)
            future.set_exception(e)
            return
        with self._lock:
            self._loading.pop(block, None)
            kept = block in self._policy  # not evicted (LRU/FIFO) while it was loading
            if kept:
                self._blocks[block] = cached
            else:
                self.drop(cached)
        self._counters.add("block_loads")
        self._counters.add("block_bytes_read", head.data_size)
        future.set_result(cached)
        if kept and self._on_load is not None:
            self._on_load(block)

    def _read(self, block: int, head: fmt.BlockHeader) -> CachedBlock:
        """The data section in fresh anonymous memory, read by the store and verified, with the sealed
        memfd behind it (None where the block is not to be shared)."""
        if head.data_size == 0:
            return CachedBlock(b"", None, head, False)
        buf, memfd = self._memory.allocate(block, head.data_size)
        try:
            # A policy that never evicts keeps the block for the mount's life (an evicting one may drop it).
            self._store.read_data_into(block, head, buf, held_in_memory=not self._policy.evicts)
        except BaseException:
            self._memory.release(memfd)  # the map goes with the last reference (a traceback may hold one)
            raise
        return CachedBlock(buf, self._memory.seal(memfd), head, self._memory.memlock.lock(buf))

    def drop(self, cached: CachedBlock | None) -> None:
        """Give a cached block's memory back."""
        # Readers still holding the block keep it alive; the map goes when the last reference does.
        if cached is not None:
            self._memory.release(cached.fd, cached.nbytes if cached.locked else 0)
            cached.fd = None

    def fill(self) -> dict[str, Any]:
        """The policy's statistics, the blocks loaded and loading, and the memory they pin (for ``stats()``)."""
        with self._lock:
            policy = self._policy.stats()
            cached_blocks = len(self._blocks)
            loading = len(self._loading)
        memlock = self._memory.memlock
        return {
            **policy,
            "cached_blocks": cached_blocks,
            "loading_blocks": loading,
            "fill": policy["used_bytes"] / policy["budget_bytes"] if policy["budget_bytes"] else 0.0,
            "locked_bytes": memlock.locked_bytes,
            "mlock": memlock.describe(),
        }

    def copy_ahead(self, block: int) -> bool:
        """See :meth:`BlockCache.copy_ahead`."""
        if self._damaged.is_damaged(block) or not self._store.files.wants_copy(block):
            return False
        try:
            self._store.copy_into_tier(block)
        except (CorruptBlockError, BlockReadError) as e:
            log.debug("copying block %d ahead failed: %s", block, e)
            return False
        self._counters.add("disk_copies_ahead")
        return True
