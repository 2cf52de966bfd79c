"""Importance-aware sample selection (seed document 001): pure NumPy bookkeeping, no I/O, no torch.

The training loop reports each sample's loss (``BlockLoader.report_losses``); a :class:`LossTracker`
turns the reports of one epoch into one observation per sample (their mean) and keeps, per sample, the
number of epochs observed, the running mean and variance of those per-epoch losses (Welford) and the last
one. Epochs ``0 .. warmup_epochs - 1`` read every sample. From then on, :func:`select_important` picks
the epoch's samples:

1. **split by volatility**: every sample observed in at least two epochs has the variance of its
   per-epoch losses; 2-means on those variances (exact in one dimension, :func:`two_means_threshold`)
   puts the upper cluster in the *volatile* group and the rest in the *stable* group. A sample observed in
   fewer than two epochs is volatile (its loss is not known well enough to skip it);
2. **score**: a sample's importance is its last observed loss (never observed: +inf);
3. **select** ``round(fraction * n)`` samples: the volatile group first, highest score first, so each
   epoch measures (re-scores) their loss again by training on them; the rest of the budget goes to the
   stable samples of the highest last loss, which keep that loss until they are trained on again. When
   the volatile group is larger than the budget, its highest-scoring members fill it.

Ties are broken by a key drawn from ``(seed, epoch)``, so every rank that holds the same losses selects the
same samples. The selected samples are still read in block order: :func:`subset_layout` keeps the blocks
and drops the unselected files, and the block-shuffled order runs over that.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .order import BlockLayout

__all__ = [
    "ImportanceConfig",
    "LossTracker",
    "select_important",
    "subset_layout",
    "two_means_threshold",
    "volatile_mask",
]

_TIE_STREAM = 0x1A9F  # keeps the tie-break draws apart from the order's own streams


@dataclass(frozen=True)
class ImportanceConfig:
    """Train each epoch after ``warmup_epochs`` full ones on the most important ``fraction`` of samples."""

    fraction: float = 0.5
    warmup_epochs: int = 2

    def __post_init__(self) -> None:
        if not 0.0 < self.fraction <= 1.0:
            raise ValueError(f"importance fraction must be in (0, 1] (got {self.fraction})")
        if self.warmup_epochs < 1:
            raise ValueError(
                f"importance warmup_epochs must be at least 1 (got {self.warmup_epochs}): "
                "the first epoch has no losses to select by"
            )


class LossTracker:
    """Per-sample loss statistics over epochs, for sample ids ``0 .. n_ids - 1``."""

    ARRAYS = ("count", "mean", "m2", "last", "pending_sum", "pending_count")

    def __init__(self, n_ids: int) -> None:
        if n_ids < 0:
            raise ValueError(f"n_ids must be non-negative (got {n_ids})")
        self.n_ids = n_ids
        self.count = np.zeros(n_ids, dtype=np.int64)  # epochs observed
        self.mean = np.zeros(n_ids, dtype=np.float64)
        self.m2 = np.zeros(n_ids, dtype=np.float64)  # sum of squared deviations (Welford)
        self.last = np.full(n_ids, np.nan, dtype=np.float64)
        self.pending_sum = np.zeros(n_ids, dtype=np.float64)  # this epoch's reports, not folded yet
        self.pending_count = np.zeros(n_ids, dtype=np.int64)

    def report(self, ids: np.ndarray, losses: np.ndarray) -> None:
        """Add one loss per id to the current epoch's observations (a repeated id is averaged)."""
        ids = np.asarray(ids, dtype=np.int64).reshape(-1)
        losses = np.asarray(losses, dtype=np.float64).reshape(-1)
        if ids.shape != losses.shape:
            raise ValueError(f"{ids.size} ids but {losses.size} losses: report one loss per sample")
        if ids.size and (ids.min() < 0 or ids.max() >= self.n_ids):
            bad = ids[(ids < 0) | (ids >= self.n_ids)][0]
            raise ValueError(f"sample id {bad} is out of range 0..{self.n_ids - 1}")
        if not np.all(np.isfinite(losses)):
            bad = ids[~np.isfinite(losses)][0]
            raise ValueError(f"the loss of sample {bad} is not finite ({losses[~np.isfinite(losses)][0]})")
        np.add.at(self.pending_sum, ids, losses)
        np.add.at(self.pending_count, ids, 1)

    def fold(self) -> int:
        """Turn the pending reports into one observation per reported sample; returns how many samples."""
        seen = np.flatnonzero(self.pending_count)
        x = self.pending_sum[seen] / self.pending_count[seen]
        self.count[seen] += 1
        delta = x - self.mean[seen]
        self.mean[seen] += delta / self.count[seen]
        self.m2[seen] += delta * (x - self.mean[seen])
        self.last[seen] = x
        self.pending_sum[:] = 0.0
        self.pending_count[:] = 0
        return int(seen.size)

    @property
    def observed(self) -> bool:
        """Whether any sample has a folded observation."""
        return bool(np.any(self.count))

    def variance(self) -> np.ndarray:
        """Sample variance of each id's per-epoch losses; NaN with fewer than two observations."""
        out = np.full(self.n_ids, np.nan)
        known = self.count >= 2
        out[known] = self.m2[known] / (self.count[known] - 1)
        return out

    def state_dict(self) -> dict[str, np.ndarray]:
        return {name: getattr(self, name).copy() for name in self.ARRAYS}

    def load_state_dict(self, state: dict[str, np.ndarray]) -> None:
        for name in self.ARRAYS:
            value = np.asarray(state[name], dtype=getattr(self, name).dtype)
            if value.shape != (self.n_ids,):
                raise ValueError(f"loss state {name!r} holds {value.size} ids; this dataset has {self.n_ids}")
            setattr(self, name, value.copy())


def two_means_threshold(values: np.ndarray) -> float:
    """The exact 2-means split of 1-D ``values``: the upper cluster is ``values > threshold``.

    Sorted values are split where the within-cluster sum of squares is least, i.e. where
    ``S_low**2 / n_low + S_high**2 / n_high`` is largest. With fewer than two distinct values there is no
    upper cluster (+inf).
    """
    ordered = np.sort(np.asarray(values, dtype=np.float64).reshape(-1))
    if ordered.size < 2 or ordered[0] == ordered[-1]:
        return float("inf")
    v = ordered - ordered.mean()  # centring keeps the prefix sums small; the split does not move
    prefix = np.cumsum(v)[:-1]
    n_low = np.arange(1, v.size, dtype=np.float64)
    total = prefix[-1] + v[-1]
    gain = prefix**2 / n_low + (total - prefix) ** 2 / (v.size - n_low)
    gain[ordered[:-1] == ordered[1:]] = -np.inf  # a split must fall between two different values
    # Equal splits can differ by rounding; take the lowest of those within rounding of the best, so the
    # threshold does not depend on the order in which floating-point sums happened to round.
    tolerance = 1e-12 * float(np.dot(v, v))
    return float(ordered[int(np.flatnonzero(gain >= gain.max() - tolerance)[0])])


def volatile_mask(tracker: LossTracker, ids: np.ndarray) -> np.ndarray:
    """Whether each of ``ids`` is in the volatile group (see the module docstring)."""
    variance = tracker.variance()[np.asarray(ids, dtype=np.int64)]
    known = ~np.isnan(variance)
    volatile = ~known
    if np.any(known):
        volatile[known] = variance[known] > two_means_threshold(variance[known])
    return volatile


def select_important(tracker: LossTracker, ids: np.ndarray, fraction: float, *, seed: int, epoch: int) -> np.ndarray:
    """The ``round(fraction * len(ids))`` ids (at least one) to train on this epoch, sorted."""
    ids = np.asarray(ids, dtype=np.int64)
    if ids.size == 0:
        return ids.copy()
    budget = min(ids.size, max(1, round(fraction * ids.size)))
    volatile = volatile_mask(tracker, ids)
    score = tracker.last[ids]
    score = np.where(np.isnan(score), np.inf, score)
    rng = np.random.default_rng(np.random.SeedSequence([seed, epoch, _TIE_STREAM]))
    tie = rng.random(ids.size)
    # lexsort: the last key is the primary one: volatile first, then the highest score, then the tie key.
    ranked = np.lexsort((tie, -score, ~volatile))
    return np.sort(ids[ranked[:budget]])


def subset_layout(layout: BlockLayout, keep: np.ndarray) -> BlockLayout:
    """The layout with only the files whose ``keep[id]`` is true; every block stays, maybe empty."""
    keep = np.asarray(keep, dtype=bool)
    kept = keep[layout.block_files]
    block_of_slot = np.repeat(np.arange(layout.n_blocks), layout.block_sizes)
    offsets = np.zeros(layout.n_blocks + 1, dtype=np.int64)
    np.cumsum(np.bincount(block_of_slot[kept], minlength=layout.n_blocks), out=offsets[1:])
    return BlockLayout(offsets, layout.block_files[kept])
