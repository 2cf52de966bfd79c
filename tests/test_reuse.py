"""The reuse plan (blockfs.loader.reuse): half fresh, half cached, every sample twice per epoch."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from blockfs.loader.reuse import plan_reuse


def replay(plan, batch_size):
    """Walk the plan with a real cache (a set); return (fresh, reused) counts per batch."""
    cache: set[int] = set()
    counts = []
    for k in range(len(plan)):
        reused = plan.reused_in(k).tolist()
        assert set(reused) <= cache, f"batch {k} reuses samples that are not cached"
        assert len(set(reused)) == len(reused)
        np.testing.assert_array_equal(np.sort(plan.cached_before(k)), np.sort(list(cache)))
        cache -= set(reused)  # evicted on use
        cache |= set(plan.fresh(k))  # fed by the fresh reads
        counts.append((len(plan.fresh(k)), len(reused)))
    return counts, cache


@settings(max_examples=60, deadline=None)
@given(n=st.integers(0, 300), batch_size=st.integers(2, 40), seed=st.integers(0, 5))
def test_every_sample_is_seen_twice_and_reads_per_batch_halve(n, batch_size, seed):
    plan = plan_reuse(n, batch_size, seed=seed, epoch=1)
    counts, left = replay(plan, batch_size)
    assert not left  # the last batches drain the cache
    np.testing.assert_array_equal(plan.times_seen(), np.full(n, 2))
    # ceil(2n / B) batches; with fewer samples than a batch, one batch reads them and one reuses them.
    assert len(plan) == (-(-2 * n // batch_size) if n >= batch_size else 2 * (n > 0))
    half, rest = batch_size // 2, batch_size - batch_size // 2
    for k, (fresh, reused) in enumerate(counts):
        assert fresh + reused == batch_size or k == len(counts) - 1 or n < batch_size
        if k == 0:
            assert reused == 0  # nothing cached yet: the first batch is all fresh
        elif fresh and k < len(counts) - 1 and plan.fresh_bounds[k + 1] < n:
            assert (fresh, reused) == (rest, half)


def test_drop_last_drops_only_a_partial_last_batch():
    plan = plan_reuse(43, 10, seed=0, epoch=0, drop_last=True)
    sizes = [len(plan.fresh(k)) + len(plan.reused_in(k)) for k in range(len(plan))]
    assert sizes == [10] * 8  # 86 samples: the last 6, all reused ones, are dropped
    seen = plan.times_seen()
    assert seen.sum() == 80 and np.count_nonzero(seen == 1) == 6
    assert len(plan_reuse(45, 10, seed=0, epoch=0, drop_last=True)) == 9  # 90 samples: nothing to drop


def test_the_plan_is_a_function_of_seed_epoch_and_rank():
    a = plan_reuse(200, 16, seed=3, epoch=2, rank=1)
    b = plan_reuse(200, 16, seed=3, epoch=2, rank=1)
    np.testing.assert_array_equal(a.reused, b.reused)
    for other in (dict(seed=4, epoch=2, rank=1), dict(seed=3, epoch=3, rank=1), dict(seed=3, epoch=2, rank=0)):
        assert not np.array_equal(plan_reuse(200, 16, **other).reused, a.reused)


def test_a_reused_sample_comes_back_about_two_batches_later():
    plan = plan_reuse(10_000, 64, seed=0, epoch=0)
    batch_of_read = np.repeat(np.arange(len(plan)), np.diff(plan.fresh_bounds))
    batch_of_reuse = np.repeat(np.arange(len(plan)), np.diff(plan.reused_offsets))
    delay = batch_of_reuse - batch_of_read[plan.reused]
    assert delay.min() >= 1
    assert 1.5 < delay.mean() < 3.0


def test_bad_arguments_name_the_value():
    with pytest.raises(ValueError, match="batch_size of at least 2 \\(got 1\\)"):
        plan_reuse(10, 1, seed=0, epoch=0)
    with pytest.raises(ValueError, match="got -1"):
        plan_reuse(-1, 8, seed=0, epoch=0)
