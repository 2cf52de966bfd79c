"""The reuse option (seed document 000): half of each batch read fresh, half taken from a sample cache.

A pure NumPy plan over *positions* ``0 .. n - 1`` of a rank's epoch sequence (the order in which its
samples are read fresh); the loader holds the decoded samples. With batch size ``B``:

- batch ``k`` takes ``min(B // 2, cached)`` samples from the cache, chosen uniformly at random, and
  *evicts* them (a cached sample is used once); it fills the rest of the batch with the next fresh
  samples of the sequence; after the batch, its fresh samples join the cache;
- so the first batch is all fresh (the cache starts empty), every later batch is half fresh
  (``B - B // 2``) and half reused (``B // 2``), and once the fresh samples run out the last batches
  drain the cache;
- **each sample is yielded exactly twice per epoch**: once in the batch that reads it, and once from
  the cache, on average about two batches later (the cache holds about ``B`` samples and gives up
  ``B // 2`` per batch). An epoch reads each sample from storage once and has ``ceil(2 n / B)`` batches
  (two when ``n < B``): twice the steps, half the reads per step. With ``drop_last`` a last partial
  batch -- reused samples only -- is dropped, so its samples are yielded once.

The random choices come from ``(seed, epoch, rank)``, so the plan of an epoch can be recomputed for an
exact resume; :meth:`ReusePlan.cached_before` says which samples the cache holds when batch ``k`` starts.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

__all__ = ["ReusePlan", "plan_reuse"]

_REUSE_STREAM = 0x5E05E  # keeps the reuse draws apart from the order's own streams


@dataclass(frozen=True, eq=False)
class ReusePlan:
    """Batch ``k`` reads positions ``fresh_bounds[k]:fresh_bounds[k + 1]`` fresh, then the cached
    positions ``reused[reused_offsets[k]:reused_offsets[k + 1]]``."""

    fresh_bounds: np.ndarray
    reused_offsets: np.ndarray
    reused: np.ndarray

    def __len__(self) -> int:
        return self.fresh_bounds.size - 1

    def fresh(self, k: int) -> range:
        return range(int(self.fresh_bounds[k]), int(self.fresh_bounds[k + 1]))

    def reused_in(self, k: int) -> np.ndarray:
        return self.reused[self.reused_offsets[k] : self.reused_offsets[k + 1]]

    def cached_before(self, k: int) -> np.ndarray:
        """The positions in the cache when batch ``k`` starts: read fresh before it, not reused yet."""
        read = np.arange(int(self.fresh_bounds[k]), dtype=np.int64)
        return np.setdiff1d(read, self.reused[: self.reused_offsets[k]], assume_unique=True)

    def times_seen(self) -> np.ndarray:
        """How many batches hold each position (2 for all, unless ``drop_last`` dropped a batch)."""
        n = int(self.fresh_bounds[-1])
        return np.ones(n, dtype=np.int64) + np.bincount(self.reused, minlength=n)


def plan_reuse(n: int, batch_size: int, *, seed: int, epoch: int, rank: int = 0, drop_last: bool = False) -> ReusePlan:
    """The reuse plan of an epoch of ``n`` fresh samples (see the module docstring)."""
    if batch_size < 2:
        raise ValueError(f"reuse needs batch_size of at least 2 (got {batch_size}): half of a batch is reused")
    if n < 0:
        raise ValueError(f"n must be non-negative (got {n})")
    rng = np.random.default_rng(np.random.SeedSequence([seed, epoch, _REUSE_STREAM], spawn_key=(rank,)))
    half = batch_size // 2
    cache: list[int] = []
    bounds, offsets = [0], [0]
    reused: list[int] = []
    start = 0
    while start < n or cache:
        take = min(half, len(cache))
        fresh = min(batch_size - take, n - start)
        take = min(batch_size - fresh, len(cache))  # no fresh left: drain up to a whole batch
        picked = rng.choice(len(cache), size=take, replace=False) if take else np.zeros(0, dtype=np.int64)
        gone = set(picked.tolist())
        reused.extend(cache[i] for i in picked.tolist())
        cache = [p for i, p in enumerate(cache) if i not in gone]
        cache.extend(range(start, start + fresh))
        start += fresh
        bounds.append(start)
        offsets.append(len(reused))
    if drop_last and len(bounds) > 1:
        size = (bounds[-1] - bounds[-2]) + (offsets[-1] - offsets[-2])
        if size < batch_size:
            bounds.pop()
            offsets.pop()
            del reused[offsets[-1] :]
    return ReusePlan(
        np.asarray(bounds, dtype=np.int64), np.asarray(offsets, dtype=np.int64), np.asarray(reused, dtype=np.int64)
    )
