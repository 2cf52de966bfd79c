"""``SharedBlocks``: descriptors of cached blocks' sealed memory for loaders on this machine
(:meth:`~blockfs.serve.cache.block_cache.BlockCache.share`, served by :mod:`blockfs.serve.control.share`)."""

from __future__ import annotations

import os
import threading
from collections.abc import Callable

from ...errors import BlockReadError, CorruptBlockError
from .cache_stats import CacheCounters
from .cached_block import CachedBlock
from .damaged_blocks import DamagedBlocks

__all__ = ["NotShared", "SharedBlocks"]


class NotShared(Exception):
    """Why :meth:`BlockCache.share` hands out no descriptor for a block (the caller reads it otherwise)."""


class SharedBlocks:
    """Hands out descriptors of the cache's ``blocks`` (guarded by its ``lock``); ``load`` is the cache's
    :meth:`~blockfs.serve.cache.block_cache.BlockCache.load`.  ``shares`` False (with the ``policy`` name):
    every request is refused."""

    def __init__(
        self,
        shares: bool,
        policy: str,
        blocks: dict[int, CachedBlock],
        load: Callable[[int], CachedBlock | None],
        damaged: DamagedBlocks,
        lock: threading.Lock,
        counters: CacheCounters,
    ) -> None:
        self._shares = shares
        self._policy = policy
        self._blocks = blocks
        self._load = load
        self._damaged = damaged
        self._lock = lock
        self._counters = counters

    def share(self, block: int) -> int:
        """See :meth:`BlockCache.share`."""
        if not self._shares:
            raise NotShared(f"the {self._policy} policy does not share blocks")
        cached = self._blocks.get(block)
        if cached is None:
            try:
                cached = self._cached_or_loaded(block)
            except (CorruptBlockError, BlockReadError) as e:
                raise NotShared(str(e)) from None
        with self._lock:
            fd = cached.fd
            if fd is None:
                raise NotShared(f"block {block} is held in memory that cannot be shared")
            self._counters.add("blocks_shared")
            return os.dup(fd)  # under the lock: a drop cannot close fd in between

    def _cached_or_loaded(self, block: int) -> CachedBlock:
        """``block`` in the cache, loaded (or waited for) now if need be; NotShared if it is not admitted."""
        cached = self._load(block)
        if cached is None:
            why = (
                "damaged (its checksum or header is wrong, or it is not this dataset's)"
                if (block in self._damaged)
                else "not admitted: the cache budget is full"
            )
            raise NotShared(f"block {block} is {why}")
        return cached
