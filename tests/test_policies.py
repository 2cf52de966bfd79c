"""Tests for blockfs.serve.cache.policies: one conformance suite over every policy, then each policy's own rule."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from blockfs.serve.cache.policies import (
    DEFAULT_POLICY,
    POLICIES,
    CacheOncePolicy,
    FIFOPolicy,
    LRUPolicy,
    NoCachePolicy,
    make_policy,
)

keys = st.integers(0, 15)
operations = st.lists(
    st.one_of(
        st.tuples(st.just("admit"), keys, st.integers(0, 150)),
        st.tuples(st.just("touch"), keys),
        st.tuples(st.just("discard"), keys),
    ),
    max_size=60,
)


@pytest.mark.parametrize("name", sorted(POLICIES))
class TestConformance:
    """What every policy promises, checked against a model of the held blocks after every operation."""

    @settings(max_examples=150, deadline=None)
    @given(budget=st.integers(0, 100), ops=operations)
    def test_random_operations_keep_the_invariants(self, name, budget, ops):
        policy = make_policy(name, budget)
        held: dict[int, int] = {}  # the model: block id -> bytes
        admitted = refused = evicted_total = 0
        for op, key, *rest in ops:
            if op == "admit" and key in held:
                with pytest.raises(ValueError, match="already held"):
                    policy.admit(key, rest[0])
            elif op == "admit":
                would = policy.would_admit(key, rest[0])
                evicted = policy.admit(key, rest[0])
                assert (evicted is not None) == would
                if evicted is None:
                    refused += 1
                    assert key not in policy
                else:
                    admitted += 1
                    evicted_total += len(evicted)
                    for victim in evicted:
                        assert victim not in policy
                        del held[victim]
                    held[key] = rest[0]
            elif op == "touch" and key in held:
                policy.touch(key)
            elif op == "touch":
                with pytest.raises(KeyError):
                    policy.touch(key)
            else:
                before = policy.used_bytes
                policy.discard(key)
                assert policy.used_bytes == before - held.pop(key, 0)
                assert key not in policy
            assert policy.used_bytes <= policy.budget_bytes
            assert policy.used_bytes == sum(held.values())
            assert len(policy) == len(held)
            assert all(k in policy for k in held)
        assert (policy.admissions, policy.refusals, policy.evictions) == (admitted, refused, evicted_total)

    def test_would_admit_has_no_side_effects(self, name):
        policy = make_policy(name, 100)
        policy.admit(1, 60)
        before = (policy.stats(), 1 in policy)
        for nbytes in (0, 40, 41, 100, 101):
            policy.would_admit(2, nbytes)
        assert (policy.stats(), 1 in policy) == before
        assert 2 not in policy

    def test_negative_size_is_rejected(self, name):
        with pytest.raises(ValueError, match="size must be >= 0"):
            make_policy(name, 100).admit(1, -1)

    def test_stats_name_the_counters(self, name):
        policy = make_policy(name, 10)
        policy.admit(1, 5)
        policy.admit(2, 50)
        stats = policy.stats()
        assert stats["budget_bytes"] == 10
        assert stats["admissions"] + stats["refusals"] == 2
        assert stats["used_bytes"] == policy.used_bytes
        assert stats["blocks"] == len(policy)


def test_registry_and_default():
    assert set(POLICIES) == {"cache-once", "lru", "fifo", "none"}
    assert DEFAULT_POLICY == "cache-once"
    assert all(POLICIES[name].name == name for name in POLICIES)


def test_unknown_policy_lists_the_names():
    with pytest.raises(ValueError, match="'mru'.*cache-once, lru, fifo, none"):
        make_policy("mru", 10)


def test_negative_budget_is_rejected():
    with pytest.raises(ValueError, match="-1"):
        make_policy("lru", -1)


def test_cache_once_admits_while_room_remains_and_never_evicts():
    policy = CacheOncePolicy(100)
    assert [policy.admit(key, 25) for key in range(4)] == [[], [], [], []]
    assert policy.admit(4, 1) is None
    assert policy.admit(5, 0) == []  # an empty block costs no room
    for key in range(4):
        policy.touch(key)
    assert policy.admit(6, 25) is None
    assert (policy.used_bytes, policy.evictions, policy.refusals) == (100, 0, 2)
    assert all(key in policy for key in range(4))


def test_cache_once_takes_a_smaller_block_that_still_fits():
    policy = CacheOncePolicy(100)
    policy.admit(1, 60)
    assert policy.admit(2, 50) is None
    assert policy.admit(3, 40) == []
    assert policy.used_bytes == 100


def test_cache_once_room_freed_by_discard_is_reused():
    policy = CacheOncePolicy(50)
    policy.admit(1, 50)
    policy.discard(1)
    assert policy.admit(2, 50) == []


def test_lru_evicts_the_least_recently_touched():
    policy = LRUPolicy(30)
    for key in (0, 1, 2):
        policy.admit(key, 10)
    policy.touch(0)
    assert policy.admit(3, 10) == [1]
    policy.touch(2)
    assert policy.admit(4, 20) == [0, 3]
    assert sorted(k for k in range(5) if k in policy) == [2, 4]
    assert policy.evictions == 3


def test_fifo_evicts_the_oldest_inserted_whatever_its_hits():
    policy = FIFOPolicy(30)
    for key in (0, 1, 2):
        policy.admit(key, 10)
    policy.touch(0)
    policy.touch(0)
    assert policy.admit(3, 10) == [0]
    assert policy.admit(4, 15) == [1, 2]
    assert sorted(k for k in range(5) if k in policy) == [3, 4]


@pytest.mark.parametrize("cls", [LRUPolicy, FIFOPolicy])
def test_evicting_policies_refuse_a_block_larger_than_the_budget(cls):
    policy = cls(30)
    policy.admit(0, 10)
    assert not policy.would_admit(1, 31)
    assert policy.admit(1, 31) is None
    assert 0 in policy and policy.evictions == 0
    assert policy.admit(2, 30) == [0]


def test_none_refuses_everything():
    policy = NoCachePolicy(10**9)
    assert policy.admit(1, 0) is None
    assert policy.admit(2, 10) is None
    assert (len(policy), policy.used_bytes, policy.refusals) == (0, 0, 2)


def simulate_hit_rates(name: str, n_blocks: int, files_per_block: int, budget_blocks: int, epochs: int):
    """Per-epoch hit rate of a policy over equal-size blocks read in a random file order each epoch."""
    rng = np.random.default_rng(2024)
    block_bytes = 1000
    policy = make_policy(name, budget_blocks * block_bytes)
    block_of_file = np.repeat(np.arange(n_blocks), files_per_block)
    rates = []
    for _ in range(epochs):
        hits = 0
        for block in rng.permutation(block_of_file).tolist():
            if block in policy:
                policy.touch(block)
                hits += 1
            else:
                policy.admit(block, block_bytes)
        rates.append(hits / block_of_file.size)
    return rates


@pytest.mark.parametrize("fraction", [0.25, 0.5, 0.75])
def test_cache_once_hits_budget_over_dataset_each_epoch_and_beats_lru(fraction):
    n_blocks, files_per_block, epochs = 400, 4, 5
    budget_blocks = int(fraction * n_blocks)
    cache_once = simulate_hit_rates("cache-once", n_blocks, files_per_block, budget_blocks, epochs)[1:]
    lru = simulate_hit_rates("lru", n_blocks, files_per_block, budget_blocks, epochs)[1:]
    assert all(abs(rate - fraction) <= 0.02 for rate in cache_once)
    assert np.mean(cache_once) >= np.mean(lru)
