"""Importance-aware selection (blockfs.loader.importance) on synthetic losses."""

from __future__ import annotations

from fractions import Fraction

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from blockfs.loader.importance import (
    ImportanceConfig,
    LossTracker,
    select_important,
    subset_layout,
    two_means_threshold,
    volatile_mask,
)
from blockfs.loader.order import BlockLayout


def brute_force_threshold(values: np.ndarray) -> float:
    """The 2-means split that minimises the within-cluster squared error, by trying every cut.

    Exact in rational arithmetic (the values are integers), so equal splits really are equal; of those
    the lowest cut is the answer, as two_means_threshold promises.
    """
    v = sorted(Fraction(int(x)) for x in values)
    best, cut = None, None
    for i in range(1, len(v)):
        if v[i - 1] == v[i]:
            continue
        low, high = v[:i], v[i:]
        mean_low, mean_high = sum(low) / len(low), sum(high) / len(high)
        sse = sum((x - mean_low) ** 2 for x in low) + sum((x - mean_high) ** 2 for x in high)
        if best is None or sse < best:
            best, cut = sse, v[i - 1]
    return np.inf if cut is None else float(cut)


@settings(max_examples=80, deadline=None)
@given(st.lists(st.integers(0, 50), min_size=1, max_size=30))
def test_two_means_is_the_exact_split(values):
    values = np.asarray(values, dtype=np.float64)
    assert two_means_threshold(values) == brute_force_threshold(values)


def test_two_means_takes_the_lowest_of_equal_splits():
    # cutting after 21 or after 26 leaves the same squared error (553.5); the lower cut is the answer
    values = np.array([0, 7, 15, 17, 19, 21, 25, 26, 44], dtype=np.float64)
    assert two_means_threshold(values) == 21.0


def test_two_means_separates_two_groups():
    rng = np.random.default_rng(0)
    values = np.concatenate([rng.normal(1.0, 0.1, 900), rng.normal(10.0, 0.5, 100)])
    threshold = two_means_threshold(values)
    assert np.count_nonzero(values > threshold) == 100
    assert two_means_threshold(np.full(5, 2.0)) == np.inf


def test_tracker_folds_one_observation_per_epoch():
    tracker = LossTracker(4)
    tracker.report([0, 1, 1], [1.0, 2.0, 4.0])  # id 1 twice in one epoch: averaged
    assert tracker.fold() == 2
    tracker.report([0, 1], [3.0, 3.0])
    tracker.fold()
    np.testing.assert_allclose(tracker.last, [3.0, 3.0, np.nan, np.nan])
    np.testing.assert_allclose(tracker.count, [2, 2, 0, 0])
    variance = tracker.variance()
    np.testing.assert_allclose(variance[:2], [2.0, 0.0])  # var([1, 3]) and var([3, 3])
    assert np.isnan(variance[2:]).all()
    state = tracker.state_dict()
    other = LossTracker(4)
    other.load_state_dict(state)
    np.testing.assert_array_equal(other.variance()[:2], variance[:2])


@pytest.mark.parametrize(
    ("ids", "losses", "shown"),
    [([0, 9], [1.0, 1.0], "sample id 9"), ([0], [float("nan")], "not finite"), ([0, 1], [1.0], "2 ids but 1 losses")],
)
def test_bad_reports_name_the_value(ids, losses, shown):
    with pytest.raises(ValueError, match=shown):
        LossTracker(4).report(ids, losses)


def synthetic(n: int = 1000, epochs: int = 3) -> tuple[LossTracker, np.ndarray, np.ndarray]:
    """10 % volatile samples (loss jumps between epochs), 20 % stable hard (loss 3), the rest easy (0.1)."""
    rng = np.random.default_rng(1)
    ids = np.arange(n)
    volatile = rng.permutation(n)[: n // 10]
    hard = np.setdiff1d(rng.permutation(n)[: 3 * n // 10], volatile)[: n // 5]
    tracker = LossTracker(n)
    for epoch in range(epochs):
        losses = np.full(n, 0.1) + rng.normal(0, 0.01, n)
        losses[hard] = 3.0 + rng.normal(0, 0.01, hard.size)
        losses[volatile] = (4.0 if epoch % 2 == 0 else 0.2) + rng.normal(0, 0.01, volatile.size)
        tracker.report(ids, losses)
        tracker.fold()
    return tracker, volatile, hard


def test_volatile_samples_are_those_whose_loss_varies():
    tracker, volatile, _ = synthetic()
    mask = volatile_mask(tracker, np.arange(1000))
    np.testing.assert_array_equal(np.flatnonzero(mask), np.sort(volatile))


def test_selection_takes_volatile_then_the_hardest_stable_samples():
    tracker, volatile, hard = synthetic()
    chosen = select_important(tracker, np.arange(1000), 0.25, seed=0, epoch=3)
    assert chosen.size == 250
    assert set(volatile.tolist()) <= set(chosen.tolist())
    assert set(chosen.tolist()) - set(volatile.tolist()) <= set(hard.tolist())
    # A budget smaller than the volatile group: the volatile samples of the highest last loss.
    few = select_important(tracker, np.arange(1000), 0.05, seed=0, epoch=3)
    assert few.size == 50 and set(few.tolist()) <= set(volatile.tolist())
    # Deterministic for (seed, epoch): every rank that holds the same losses selects the same samples.
    np.testing.assert_array_equal(chosen, select_important(tracker, np.arange(1000), 0.25, seed=0, epoch=3))


def test_samples_never_scored_are_selected_first():
    tracker = LossTracker(10)
    tracker.report(np.arange(8), np.arange(8, dtype=float))
    tracker.fold()
    chosen = select_important(tracker, np.arange(10), 0.3, seed=0, epoch=1)
    assert {8, 9} <= set(chosen.tolist())


def test_subset_layout_keeps_blocks_and_slot_order():
    layout = BlockLayout([0, 3, 3, 6], [5, 1, 4, 0, 2, 3])
    keep = np.zeros(6, dtype=bool)
    keep[[1, 4, 2]] = True
    sub = subset_layout(layout, keep)
    np.testing.assert_array_equal(sub.block_offsets, [0, 2, 2, 3])
    np.testing.assert_array_equal(sub.block_files, [1, 4, 2])


@pytest.mark.parametrize(
    ("kw", "shown"),
    [(dict(fraction=0.0), "got 0.0"), (dict(fraction=1.5), "got 1.5"), (dict(warmup_epochs=0), "got 0")],
)
def test_config_names_a_bad_value(kw, shown):
    with pytest.raises(ValueError, match=shown):
        ImportanceConfig(**kw)
