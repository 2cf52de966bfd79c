"""Block cache policies: which blocks to keep, as bookkeeping over block ids and byte sizes.

A policy never holds block bytes, reads a file or takes a lock: the cache module owns the bytes and the
lock and asks the policy what to do.  Every policy has the same small interface (:class:`BlockPolicy`)
and is picked by name from :data:`POLICIES`:

``cache-once``
    CoorDL's MinIO cache (the seed's "COO"): a block is admitted while it fits in the room left; nothing
    is ever evicted.  Under a random order every epoch, each epoch then hits ``budget / dataset`` of its
    reads, which recency-based policies do not reach because they thrash.
``lru`` / ``fifo``
    cachetools' orderings, evicting the least recently used / first inserted blocks to make room; a single
    block larger than the whole budget is refused.  They exist so the benefit of cache-once can be measured.
``none``
    Refuses everything: every read goes to storage.

The budget counts bytes: each policy wraps a cachetools cache whose values are block sizes
(``getsizeof=int``), so cachetools keeps ``currsize`` and, for LRU/FIFO, picks the victims; a
``popitem`` override records them so :meth:`BlockPolicy.admit` can tell the cache which blocks to drop.
"""

from __future__ import annotations

import operator
from abc import ABC, abstractmethod
from typing import ClassVar

import cachetools

__all__ = [
    "BlockPolicy",
    "CacheOncePolicy",
    "DEFAULT_POLICY",
    "FIFOPolicy",
    "LRUPolicy",
    "NoCachePolicy",
    "POLICIES",
    "make_policy",
]


class _EvictionLog(cachetools.Cache[int, int]):
    """A byte-counted cache that remembers the keys ``popitem()`` evicts; listed first among a cache's bases,
    it wraps that cache's own ``popitem()`` (LRU, FIFO)."""

    def __init__(self, maxsize: int) -> None:
        super().__init__(maxsize, getsizeof=int)  # values are sizes in bytes
        self.evicted: list[int] = []

    def popitem(self) -> tuple[int, int]:
        key, nbytes = super().popitem()
        self.evicted.append(key)
        return key, nbytes


class _UnorderedCache(_EvictionLog, cachetools.Cache):
    """Byte-counted cache that no policy here lets evict (cache-once checks for room first)."""


class _LRUCache(_EvictionLog, cachetools.LRUCache):
    pass


class _FIFOCache(_EvictionLog, cachetools.FIFOCache):
    pass


class BlockPolicy(ABC):
    """Which blocks stay in memory, within a budget of ``budget_bytes``.

    Subclasses choose the ordering (``_cache_type``) and the admission rule (``_fits``).  Counters
    ``admissions``, ``refusals`` and ``evictions`` count calls since construction, for the mount's stats.
    """

    name: ClassVar[str]
    evicts: ClassVar[bool] = False  # whether a held block can be dropped to make room for another
    _cache_type: ClassVar[type[_EvictionLog]] = _UnorderedCache

    def __init__(self, budget_bytes: int) -> None:
        budget_bytes = operator.index(budget_bytes)
        if budget_bytes < 0:
            raise ValueError(f"cache budget must be >= 0 bytes, not {budget_bytes}")
        self.budget_bytes = budget_bytes
        self.admissions = 0
        self.refusals = 0
        self.evictions = 0
        self._cache = self._cache_type(budget_bytes)

    @abstractmethod
    def _fits(self, nbytes: int) -> bool:
        """Whether a new block of ``nbytes`` is admitted (evicting others if the policy evicts)."""

    def would_admit(self, key: int, nbytes: int) -> bool:
        """Whether :meth:`admit` would accept this block now; changes nothing."""
        self._check_new(key, nbytes)
        return self._fits(nbytes)

    def admit(self, key: int, nbytes: int) -> list[int] | None:
        """Account for a new block of ``nbytes``.

        Returns None when the block is refused (the caller must not keep it), otherwise the keys evicted to
        make room, oldest victim first (the caller must drop their bytes); often an empty list.
        """
        if not self.would_admit(key, nbytes):
            self.refusals += 1
            return None
        log = self._cache.evicted
        log.clear()
        self._cache[key] = nbytes
        self.admissions += 1
        self.evictions += len(log)
        return list(log)

    def touch(self, key: int) -> None:
        """Record a hit on a held block (LRU moves it to the most recently used end)."""
        if key not in self._cache:
            raise KeyError(f"block {key} is not held by the {self.name} policy; admit it first")
        self._cache.get(key)  # a lookup is what reorders a cachetools LRU

    def discard(self, key: int) -> None:
        """Forget a block (dropped by the cache, e.g. after a read error); unknown keys are ignored."""
        self._cache.pop(key, None)

    def __contains__(self, key: object) -> bool:
        return key in self._cache

    def __len__(self) -> int:
        return len(self._cache)

    @property
    def used_bytes(self) -> int:
        """Bytes of the blocks held now."""
        return int(self._cache.currsize)  # a sum of the int sizes; typed float for float-valued getsizeof

    def stats(self) -> dict[str, int]:
        """Counters and fill, for the mount's statistics."""
        return {
            "budget_bytes": self.budget_bytes,
            "used_bytes": self.used_bytes,
            "blocks": len(self),
            "admissions": self.admissions,
            "refusals": self.refusals,
            "evictions": self.evictions,
        }

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(budget_bytes={self.budget_bytes}, used_bytes={self.used_bytes}, blocks={len(self)})"
        )

    def _check_new(self, key: int, nbytes: int) -> None:
        if nbytes < 0:
            raise ValueError(f"block {key}: size must be >= 0 bytes, not {nbytes}")
        if key in self._cache:
            raise ValueError(f"block {key} is already held by the {self.name} policy; call touch() on a hit")


class CacheOncePolicy(BlockPolicy):
    """Admit a block while it fits in the room left; never evict (CoorDL's MinIO)."""

    name = "cache-once"

    def _fits(self, nbytes: int) -> bool:
        return self.used_bytes + nbytes <= self.budget_bytes


class LRUPolicy(BlockPolicy):
    """Evict the least recently admitted-or-touched blocks to make room."""

    name = "lru"
    evicts = True
    _cache_type = _LRUCache

    def _fits(self, nbytes: int) -> bool:
        return nbytes <= self.budget_bytes


class FIFOPolicy(BlockPolicy):
    """Evict the first admitted blocks to make room, whatever their hits."""

    name = "fifo"
    evicts = True
    _cache_type = _FIFOCache

    def _fits(self, nbytes: int) -> bool:
        return nbytes <= self.budget_bytes


class NoCachePolicy(BlockPolicy):
    """Refuse every block."""

    name = "none"

    def _fits(self, nbytes: int) -> bool:
        return False


POLICIES: dict[str, type[BlockPolicy]] = {
    cls.name: cls for cls in (CacheOncePolicy, LRUPolicy, FIFOPolicy, NoCachePolicy)
}
DEFAULT_POLICY = CacheOncePolicy.name


def make_policy(name: str, budget_bytes: int) -> BlockPolicy:
    """The policy called ``name`` (a key of :data:`POLICIES`) with a budget of ``budget_bytes``."""
    try:
        cls = POLICIES[name]
    except KeyError:
        raise ValueError(f"unknown cache policy {name!r}; choose one of: {', '.join(POLICIES)}") from None
    return cls(budget_bytes)
