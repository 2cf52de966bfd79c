"""Tests for blockfs.serve.cache.memory_plan: selection, budget split, expected hit rates, size parsing."""

from __future__ import annotations

import json

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from blockfs.serve.cache import memory_plan
from blockfs.serve.cache.memory_plan import (
    DEFAULT_RETAIN_SHARE,
    budget_from_memory_fraction,
    format_size,
    make_memory_plan,
    parse_size,
    read_mem_available,
)
from blockfs.serve.cache.policies import CacheOncePolicy

MB, GB = 10**6, 10**9


def source_example_sizes() -> np.ndarray:
    """The source document's example, in a scrambled order so ids and sizes do not line up."""
    sizes = np.array([50 * MB] * 100 + [200 * MB] * 20 + [1 * GB] * 30)
    return np.random.default_rng(7).permutation(sizes)


class TestSourceExample:
    def test_most_files_keeps_exactly_the_120_smaller_files(self):
        sizes = source_example_sizes()
        plan = make_memory_plan(sizes, 9_500 * MB)
        assert not plan.fits
        np.testing.assert_array_equal(plan.retained, sizes < 1 * GB)
        assert (plan.retained_files, plan.retained_bytes, plan.block_cache_bytes) == (120, 9 * GB, 500 * MB)
        # The 1 GB files cannot sit in a 500 MB block cache: only the retained files hit.
        assert plan.expected_file_hit_rate == pytest.approx(120 / 150)
        assert plan.expected_byte_hit_rate == pytest.approx(9 / 39)

    def test_threshold_auto_picks_the_same_files(self):
        sizes = source_example_sizes()
        plan = make_memory_plan(sizes, 9_500 * MB, strategy="threshold", threshold="auto")
        assert plan.threshold == 200 * MB and plan.requested_threshold is None
        np.testing.assert_array_equal(plan.retained, sizes <= 200 * MB)

    def test_given_threshold_is_applied(self):
        sizes = source_example_sizes()
        plan = make_memory_plan(sizes, 9_500 * MB, strategy="threshold", threshold=100 * MB)
        assert plan.threshold == 100 * MB
        np.testing.assert_array_equal(plan.retained, sizes <= 100 * MB)
        assert plan.block_cache_bytes == 9_500 * MB - 5 * GB

    def test_threshold_that_does_not_fit_is_lowered_and_said_so(self):
        sizes = source_example_sizes()
        plan = make_memory_plan(sizes, 9_500 * MB, strategy="threshold", threshold=2 * GB)
        assert (plan.requested_threshold, plan.threshold, plan.retained_files) == (2 * GB, 200 * MB, 120)
        assert "lowered from" in plan.describe()

    def test_describe_and_to_dict(self):
        plan = make_memory_plan(source_example_sizes(), 9_500 * MB)
        text = plan.describe()
        for expected in ("does not fit", "120 files", "cache-once", "80.0% of files", "23.1% of bytes"):
            assert expected in text
        data = json.loads(json.dumps(plan.to_dict()))
        assert data["retained_files"] == 120 and "retained" not in data
        assert data["expected_storage_bytes_per_epoch"] == 30 * GB


def test_default_gives_retention_the_whole_budget():
    assert DEFAULT_RETAIN_SHARE == 1.0


def test_zero_budget():
    plan = make_memory_plan(np.array([0, 5, 7]), 0)
    assert not plan.fits
    assert (plan.retained_files, plan.retained_bytes, plan.block_cache_bytes) == (1, 0, 0)  # the empty file
    assert (plan.expected_file_hit_rate, plan.expected_byte_hit_rate) == (pytest.approx(1 / 3), 0.0)


def test_one_file_larger_than_the_budget():
    plan = make_memory_plan(np.array([100]), 50)
    assert (plan.fits, plan.retained_files, plan.block_cache_bytes) == (False, 0, 50)
    assert (plan.expected_file_hit_rate, plan.expected_byte_hit_rate) == (0.0, 0.0)

    plan = make_memory_plan(np.array([100, 10, 10]), 50)
    assert plan.retained.tolist() == [False, True, True]
    assert plan.expected_file_hit_rate == pytest.approx(2 / 3)


def test_all_files_equal():
    sizes = np.full(10, 10)
    most = make_memory_plan(sizes, 35)
    assert most.retained.tolist() == [True] * 3 + [False] * 7  # ties go to the lower ids
    assert most.expected_file_hit_rate == most.expected_byte_hit_rate == pytest.approx(0.3)
    # A threshold keeps files of one size together or not at all.
    by_threshold = make_memory_plan(sizes, 35, strategy="threshold")
    assert (by_threshold.threshold, by_threshold.retained_files, by_threshold.block_cache_bytes) == (0, 0, 35)
    assert by_threshold.expected_byte_hit_rate == pytest.approx(0.35)


@pytest.mark.parametrize("sizes", [[], [0, 0], [1, 2, 3], [10] * 4])
def test_everything_fits(sizes):
    sizes = np.array(sizes, dtype=np.int64)
    plan = make_memory_plan(sizes, int(sizes.sum()), strategy="threshold", threshold=1)
    assert plan.fits and plan.retained_files == 0 and plan.block_cache_bytes == plan.budget_bytes
    assert (plan.expected_file_hit_rate, plan.expected_byte_hit_rate) == (1.0, 1.0)
    assert "fits" in plan.describe() and plan.expected_storage_bytes_per_epoch == 0


def test_retained_mask_is_read_only():
    plan = make_memory_plan(np.array([1, 2, 3]), 4)
    with pytest.raises(ValueError):
        plan.retained[0] = True


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"sizes": np.array([[1]])}, "1-D array of integers"),
        ({"sizes": np.array([1.5])}, "1-D array of integers"),
        ({"sizes": np.array([1, -2])}, "file 1 has a negative size"),
        ({"budget_bytes": -1}, "-1"),
        ({"strategy": "largest"}, "'largest'.*most-files, threshold"),
        ({"retain_share": 1.5}, "1.5"),
        ({"threshold": 10}, "needs strategy 'threshold'"),
        ({"strategy": "threshold", "threshold": -1}, "must be >= 0"),
    ],
)
def test_bad_arguments_are_named(kwargs, match):
    arguments = {"sizes": np.array([1, 2]), "budget_bytes": 1} | kwargs
    with pytest.raises(ValueError, match=match):
        make_memory_plan(arguments.pop("sizes"), arguments.pop("budget_bytes"), **arguments)


size_lists = hnp.arrays(np.int64, st.integers(0, 40), elements=st.integers(0, 1000))


@settings(max_examples=300, deadline=None)
@given(sizes=size_lists, budget=st.integers(0, 20_000), share=st.floats(0, 1))
def test_most_files_keeps_the_most_files_that_fit(sizes, budget, share):
    plan = make_memory_plan(sizes, budget, retain_share=share)
    if plan.fits:
        return
    limit = int(budget * share)
    assert plan.retained_bytes == int(sizes[plan.retained].sum()) <= limit
    ordered = np.sort(sizes)
    # The k + 1 smallest files are the cheapest k + 1: if they overflow, no k + 1 files fit.
    assert ordered[: plan.retained_files + 1].sum() > limit
    expected_ids = np.argsort(sizes, kind="stable")[: plan.retained_files]
    np.testing.assert_array_equal(plan.retained_ids, np.sort(expected_ids))
    assert plan.retained_bytes + plan.block_cache_bytes == budget


# The selection by size classes (linear: a sum per class, one class sorted) against the selection by one sort of
# every file, the code it replaced (kept as the fallback): the same files, threshold and bytes whatever the
# ties, wherever the budget ends, and whether sizes share a class (above 2**16 bytes) or not.
_CLASS_EDGES = [0, 1, 2**16 - 1, 2**16, 2**16 + 1, 2**16 + 2, 2**17 + 3, 2**40, 2**40 + 1, 2**40 + 2**24]
class_sizes = st.one_of(
    hnp.arrays(np.int64, st.integers(1, 60), elements=st.integers(0, 12)),  # ties everywhere
    hnp.arrays(np.int64, st.integers(1, 60), elements=st.integers(0, 2**21)),  # classes of many sizes
    hnp.arrays(np.int64, st.integers(1, 60), elements=st.sampled_from(_CLASS_EDGES)),
)


@settings(max_examples=500, deadline=None)
@given(sizes=class_sizes, where=st.floats(0, 1), edge=st.integers(0, 4), pick=st.integers(0, 59))
def test_selection_by_size_classes_is_the_selection_by_sorting(sizes, where, edge, pick):
    total = int(sizes.sum())
    prefix = np.concatenate([[0], np.cumsum(np.sort(sizes))])  # what the k smallest files take, for each k
    k = round(where * sizes.size)
    share = [int(where * total), int(prefix[k]), int(prefix[k]) - 1, 0, total - 1][edge]
    if not 0 <= share < total:
        return
    requested = [None, int(sizes[pick % sizes.size]), int(sizes[pick % sizes.size]) + 1, int(where * 2**21)]
    for strategy, threshold in [("most-files", None)] + [("threshold", t) for t in requested]:
        by_class = memory_plan._select(sizes, share, strategy, threshold)
        by_sort = memory_plan._select_sorted(sizes, share, strategy, threshold)
        np.testing.assert_array_equal(by_class[0], by_sort[0])
        assert by_class[1:] == by_sort[1:], (strategy, threshold)


def test_size_classes_keep_the_order_of_sizes_and_small_sizes_exact():
    sizes = np.sort(np.concatenate([np.array(_CLASS_EDGES), np.random.default_rng(4).integers(0, 2**45, 5000)]))
    classes = memory_plan._size_classes(sizes)
    assert (np.diff(classes) >= 0).all()
    small = sizes < 2**16
    np.testing.assert_array_equal(classes[small], sizes[small])
    assert classes.max() < 2**21  # a bincount over the classes stays small


def test_byte_sums_too_large_for_the_classes_are_selected_by_sorting():
    sizes = np.array([2**52, 7, 2**52, 3, 2**52], dtype=np.int64)  # 1.5 * 2**53 bytes in all
    plan = make_memory_plan(sizes, 2**52 + 10)
    assert plan.retained.tolist() == [True, True, False, True, False]
    assert plan.retained_bytes == 2**52 + 10


@settings(max_examples=300, deadline=None)
@given(sizes=size_lists, budget=st.integers(0, 20_000), share=st.floats(0, 1), given_=st.integers(0, 1200))
def test_threshold_keeps_every_file_under_a_threshold_that_fits(sizes, budget, share, given_):
    for requested in ("auto", given_):
        plan = make_memory_plan(sizes, budget, strategy="threshold", threshold=requested, retain_share=share)
        if plan.fits:
            return
        limit = int(budget * share)
        np.testing.assert_array_equal(plan.retained, sizes <= plan.threshold)
        assert plan.retained_bytes <= limit
        if plan.threshold != given_:  # auto, or lowered: the next size up does not fit
            next_size = sizes[sizes > plan.threshold].min()
            assert sizes[sizes <= next_size].sum() > limit


@settings(max_examples=300, deadline=None)
@given(sizes=size_lists, budget=st.integers(0, 20_000), strategy=st.sampled_from(["most-files", "threshold"]))
def test_expected_hit_rates_are_rates_and_favour_files(sizes, budget, strategy):
    plan = make_memory_plan(sizes, budget, strategy=strategy)
    assert 0 <= plan.expected_byte_hit_rate <= plan.expected_file_hit_rate + 1e-12 <= 1 + 1e-12


def simulate_epochs(sizes, plan, files_per_block, epochs, seed=0):
    """(file hit rate, byte hit rate, bytes read from storage) per epoch, in a random file order each
    epoch, with files assigned to blocks at random, a cache-once block cache of the plan's size, and the
    plan's retained files kept after their first read.  A miss reads the whole block when the cache admits
    it, otherwise only the file."""
    rng = np.random.default_rng(seed)
    block_of = rng.permutation(sizes.size) // files_per_block
    block_bytes = np.bincount(block_of, weights=sizes).astype(np.int64).tolist()
    block_of, sizes_list, retained = block_of.tolist(), sizes.tolist(), plan.retained.tolist()
    cache, kept, results = CacheOncePolicy(plan.block_cache_bytes), set(), []
    for _ in range(epochs):
        file_hits = byte_hits = storage = 0
        for f in rng.permutation(sizes.size).tolist():
            block = block_of[f]
            if f in kept or block in cache:
                file_hits, byte_hits = file_hits + 1, byte_hits + sizes_list[f]
            elif cache.admit(block, block_bytes[block]) is not None:
                storage += block_bytes[block]
            else:
                storage += sizes_list[f]
            if retained[f]:
                kept.add(f)
        results.append((file_hits / sizes.size, byte_hits / sizes.sum(), storage))
    return results


@pytest.mark.parametrize("retain_share", [DEFAULT_RETAIN_SHARE, 0.5, 0.0])
def test_expected_hit_rates_match_a_simulation(retain_share):
    sizes = np.random.default_rng(1).lognormal(np.log(50_000), 1.0, 20_000).astype(np.int64)
    plan = make_memory_plan(sizes, int(sizes.sum()) // 2, retain_share=retain_share)
    for file_rate, byte_rate, _ in simulate_epochs(sizes, plan, files_per_block=32, epochs=3)[1:]:
        assert file_rate == pytest.approx(plan.expected_file_hit_rate, abs=0.02)
        assert byte_rate == pytest.approx(plan.expected_byte_hit_rate, abs=0.02)


def test_default_plan_meets_the_target_at_twice_the_budget():
    """At dataset = 2 x budget, from the 2nd epoch: <= 55 % of the bytes read, file hits >= 1.3 x bytes."""
    sizes = np.random.default_rng(2).lognormal(np.log(50_000), 1.0, 20_000).astype(np.int64)
    plan = make_memory_plan(sizes, int(sizes.sum()) // 2)
    for file_rate, byte_rate, storage in simulate_epochs(sizes, plan, files_per_block=32, epochs=3)[1:]:
        assert storage <= 0.55 * plan.dataset_bytes
        assert file_rate >= 1.3 * byte_rate


def test_a_million_files_are_planned_within_the_budget():
    # How fast: tools/bench/bench_plan.py (a ratio to one argsort of the sizes).
    sizes = np.random.default_rng(3).lognormal(np.log(100_000), 1.5, 1_000_000).astype(np.int64)
    budget = int(sizes.sum()) // 3
    for strategy in ("most-files", "threshold"):
        plan = make_memory_plan(sizes, budget, strategy=strategy)
        assert 0 < plan.retained_files < sizes.size
        assert int(sizes[plan.retained].sum()) == plan.retained_bytes <= budget


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("123", 123),
        ("0", 0),
        ("1B", 1),
        (" 7 ", 7),
        ("64MiB", 64 * 2**20),
        ("64mib", 64 * 2**20),
        ("1.5G", 3 * 2**29),
        ("2k", 2048),
        (".5K", 512),
        ("10 GB", 10 * GB),
        ("9.5GB", 9_500 * MB),
        ("1T", 2**40),
        ("0.1K", 102),
    ],
)
def test_parse_size(text, expected):
    assert parse_size(text) == expected


@pytest.mark.parametrize("text", ["", "abc", "-1", "1.2.3", "5 XB", "1e3", "inf", "G", "1 G B"])
def test_parse_size_names_the_text_and_the_accepted_forms(text):
    with pytest.raises(ValueError, match=rf"{text!r}.*'64MiB'"):
        parse_size(text)


@pytest.mark.parametrize("nbytes", [0, 1, 1023, 1024, 1536, 9_500 * MB, 3 * 2**40, 5 * 2**50])
def test_format_size_reads_back(nbytes):
    assert parse_size(format_size(nbytes)) == pytest.approx(nbytes, rel=0.005)


def test_read_mem_available(tmp_path):
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:       2048 kB\nMemFree:         100 kB\nMemAvailable:   1000 kB\n")
    assert read_mem_available(meminfo) == 1000 * 1024
    assert budget_from_memory_fraction(0.5, meminfo) == 500 * 1024
    with pytest.raises(ValueError, match="1.5"):
        budget_from_memory_fraction(1.5, meminfo)
    meminfo.write_text("MemTotal:       2048 kB\n")
    with pytest.raises(OSError, match="no MemAvailable"):
        read_mem_available(meminfo)
