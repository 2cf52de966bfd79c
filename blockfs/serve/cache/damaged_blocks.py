"""``DamagedBlocks``: the blocks a :class:`~blockfs.serve.cache.block_cache.BlockCache` found damaged.

A damaged block (its data checksum fails, its header is wrong, or it is not this dataset's) is remembered
with the stored version found damaged: it is never cached, and its files are served one by one, until the
stored block is another version (replaced, restored).  That version is looked at again at most every
:data:`DAMAGE_RECHECK_S` when a read asks, and once more that long after a read of the block, in the
background (a timer per block), since the reads that follow a replacement may never come.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from ...core.store import BlockStore
from .cache_stats import CacheCounters

log = logging.getLogger(__name__)

__all__ = ["DAMAGE_RECHECK_S", "DamagedBlocks"]

DAMAGE_RECHECK_S = 2.0  # how often a damaged block's stored version is looked at again (a stat, or a HEAD)


class DamagedBlocks:
    """The damage record, guarded by the cache's ``lock`` (shared, so that a claim made under it sees it).

    ``on_due(block)`` runs in a timer thread when a damaged block read earlier is due a look at its version;
    it must only queue work.
    """

    def __init__(
        self, store: BlockStore, counters: CacheCounters, lock: threading.Lock, on_due: Callable[[int], None]
    ) -> None:
        self._store = store
        self._counters = counters
        self._lock = lock
        self._on_due = on_due
        # Damaged blocks -> (the stored version found damaged, when it was last looked at).
        self._versions: dict[int, tuple[object, float]] = {}
        self._looks: dict[int, threading.Timer] = {}  # damaged blocks read since: a look at their version due
        self._closed = False

    def __contains__(self, block: int) -> bool:
        """Whether ``block`` is known damaged, without a new look at its version (that is I/O): callable
        from under the lock."""
        return block in self._versions

    def mark(self, block: int) -> None:
        """Remember ``block`` as damaged in its stored version now (counted once)."""
        version = self._store.version(block)
        with self._lock:
            if block in self._versions:
                return
            self._versions[block] = (version, time.monotonic())
        self._counters.add("damaged_blocks")

    def is_damaged(self, block: int) -> bool:
        """Whether ``block`` is known damaged.  At most every :data:`DAMAGE_RECHECK_S` the stored block's
        version is looked at again: a block replaced since (a file renamed over it, an object restored) is
        forgotten as damaged and read anew."""
        with self._lock:
            known = self._versions.get(block)
        if known is None:
            return False
        version, checked = known
        now = time.monotonic()
        if now - checked < DAMAGE_RECHECK_S:
            return True
        current = self._store.version(block)
        with self._lock:
            if current is None or current == version:
                self._versions[block] = (version, now)
                return True
            self._versions.pop(block, None)
        self._store.renew(block)
        log.info("block %d was replaced since it was found damaged: reading it anew", block)
        return False

    def look_again_later(self, block: int) -> None:
        """Once :data:`DAMAGE_RECHECK_S` have passed since the last look, call ``on_due(block)`` (which looks
        at damaged ``block``'s version again), whether or not another read comes (at most one look due)."""
        with self._lock:
            known = self._versions.get(block)
            if self._closed or known is None or block in self._looks:
                return
            delay = max(0.0, known[1] + DAMAGE_RECHECK_S - time.monotonic()) + 0.01
            timer = self._looks[block] = threading.Timer(delay, self._look_again, (block,))
        timer.name = f"blockfs-look-{block}"
        timer.daemon = True
        timer.start()

    def _look_again(self, block: int) -> None:
        with self._lock:
            self._looks.pop(block, None)
        try:
            self._on_due(block)
        except Exception as e:  # noqa: BLE001 - a look that failed (closing, a store gone): the next read looks
            log.debug("looking at damaged block %d again failed: %s", block, e)

    def close(self) -> None:
        """Cancel the looks due; none is started after."""
        with self._lock:
            self._closed = True
            looks, self._looks = list(self._looks.values()), {}
        for timer in looks:
            timer.cancel()
