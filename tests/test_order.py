"""Invariants of the loader's sample orders (blockfs.loader.order), checked over random layouts."""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from blockfs.loader.order import (
    ORDERS,
    BlockLayout,
    batch_class_entropy,
    block_shuffled_order,
    get_order,
    global_shuffled_order,
    sequential_order,
    shard_order,
)


@st.composite
def layouts(draw, max_blocks: int = 24, max_size: int = 40) -> BlockLayout:
    """Blocks of random sizes (empty ones too) holding a random permutation of file ids 0..n-1."""
    sizes = draw(st.lists(st.integers(0, max_size), max_size=max_blocks))
    offsets = np.concatenate([[0], np.cumsum(sizes, dtype=np.int64)])
    ids = np.random.default_rng(draw(st.integers(0, 2**32 - 1))).permutation(int(offsets[-1]))
    return BlockLayout(offsets, ids)


def uniform_layout(n_files: int, block_size: int, seed: int = 0) -> BlockLayout:
    """Blocks of ``block_size`` files (the last one shorter), randomly filled."""
    offsets = np.append(np.arange(0, n_files, block_size), n_files)
    return BlockLayout(offsets, np.random.default_rng(seed).permutation(n_files))


def block_of(layout: BlockLayout) -> np.ndarray:
    """The block of each file id."""
    blocks = np.empty(layout.n_files, dtype=np.int64)
    blocks[layout.block_files] = np.repeat(np.arange(layout.n_blocks), layout.block_sizes)
    return blocks


def enough_blocks(layout: BlockLayout, world_size: int) -> bool:
    return layout.n_files == 0 or np.count_nonzero(layout.block_sizes) >= world_size


def rank_outputs(layout, world_size, num_workers, drop_last, name="block_shuffled"):
    """order[rank][worker] for every rank and worker of one epoch."""
    order = get_order(name)
    kw = dict(seed=7, epoch=2, world_size=world_size, num_workers=num_workers, drop_last=drop_last)
    return [[order(layout, rank=r, worker=w, **kw) for w in range(num_workers)] for r in range(world_size)]


# --- one rank, one worker -------------------------------------------------------------------------------


@given(layouts(), st.integers(0, 2**40), st.integers(0, 50), st.integers(1, 9))
def test_every_epoch_is_a_permutation(layout, seed, epoch, in_flight):
    order = block_shuffled_order(layout, seed=seed, epoch=epoch, blocks_in_flight=in_flight)
    assert order.dtype == np.int64
    assert np.array_equal(np.sort(order), np.sort(layout.block_files))


@given(layouts(), st.integers(1, 9), st.integers(1, 3), st.data())
def test_at_most_blocks_in_flight_blocks_are_open_at_once(layout, in_flight, world_size, data):
    """A block is open from its first sample to its last; no more than ``blocks_in_flight`` overlap."""
    assume(enough_blocks(layout, world_size))
    rank = data.draw(st.integers(0, world_size - 1))
    kw = dict(rank=rank, world_size=world_size, blocks_in_flight=in_flight, drop_last=True)  # no repeats
    order = block_shuffled_order(layout, seed=3, epoch=1, **kw)
    blocks = block_of(layout)[order]
    first = np.full(layout.n_blocks, order.size)
    np.minimum.at(first, blocks, np.arange(order.size))
    last = np.full(layout.n_blocks, -1)
    np.maximum.at(last, blocks, np.arange(order.size))
    opened = np.bincount(first[first < order.size], minlength=order.size + 1)
    closed = np.bincount(last[last >= 0] + 1, minlength=order.size + 1)
    assert np.cumsum(opened - closed).max(initial=0) <= in_flight


@pytest.mark.parametrize("in_flight", [1, 3, 6])
def test_a_window_of_64_samples_spans_few_blocks(in_flight):
    # With blocks of at least 64 files a lane changes block at most once within 64 samples.
    layout = uniform_layout(20_000, 100)
    blocks = block_of(layout)[block_shuffled_order(layout, seed=1, epoch=0, blocks_in_flight=in_flight)]
    windows = np.lib.stride_tricks.sliding_window_view(blocks, 64)
    distinct = (np.diff(np.sort(windows, axis=1), axis=1) != 0).sum(axis=1) + 1
    assert distinct.max() <= 2 * in_flight
    assert np.mean(distinct) <= in_flight + 1


def test_epochs_differ_and_the_same_arguments_give_the_same_order():
    layout = uniform_layout(5_000, 64)
    again = BlockLayout(layout.block_offsets, layout.block_files)
    kw = dict(seed=11, rank=1, world_size=2, worker=1, num_workers=3)
    first = block_shuffled_order(layout, epoch=0, **kw)
    assert np.array_equal(first, block_shuffled_order(again, epoch=0, **kw))
    assert not np.array_equal(first, block_shuffled_order(layout, epoch=1, **kw))
    assert not np.array_equal(first, block_shuffled_order(layout, epoch=0, **{**kw, "seed": 12}))


def test_a_batch_mixes_blocks_of_one_class_each():
    # Class-sorted packing, one class per block: only the interleave of open blocks mixes a batch.
    layout = BlockLayout(np.arange(0, 50_001, 250), np.arange(50_000))
    labels = np.repeat(np.arange(200) % 10, 250)
    one_open, six_open = (
        batch_class_entropy(block_shuffled_order(layout, seed=0, epoch=0, blocks_in_flight=f), labels, 64)
        for f in (1, 6)
    )
    assert one_open < 0.5 < 1.5 < six_open


def test_class_mixing_is_close_to_a_global_shuffle_on_a_randomly_packed_dataset():
    n_files = 100_000
    layout = uniform_layout(n_files, 256)
    labels = np.random.default_rng(5).integers(0, 10, n_files)
    block = batch_class_entropy(block_shuffled_order(layout, seed=1, epoch=0), labels, 64)
    uniform = batch_class_entropy(global_shuffled_order(n_files, seed=1, epoch=0), labels, 64)
    assert block >= 0.95 * uniform


# --- ranks and workers ----------------------------------------------------------------------------------


@settings(max_examples=150)
@given(layouts(), st.integers(1, 5), st.integers(1, 4), st.booleans())
def test_ranks_read_disjoint_samples_the_same_count_and_pad_at_most_world_size_minus_one(
    layout, world_size, num_workers, drop_last
):
    assume(enough_blocks(layout, world_size))
    n = layout.n_files
    per_rank = [np.concatenate(w) for w in rank_outputs(layout, world_size, num_workers, drop_last)]
    count = per_rank[0].size
    assert all(r.size == count for r in per_rank)
    # DistributedSampler's counts, whatever the blocks: padding (or dropping) of at most world_size - 1.
    assert count == (n // world_size if drop_last else -(-n // world_size))
    rank_files = [set(r.tolist()) for r in per_rank]
    assert sum(map(len, rank_files)) == len(set().union(*rank_files))  # a repeat is of the rank's own file
    owner = block_of(layout)
    rank_blocks = [set(owner[r].tolist()) for r in per_rank]
    shared = sum(map(len, rank_blocks)) - len(set().union(*rank_blocks))
    assert shared <= world_size - 1  # only the last blocks are split, one per boundary between ranks
    everything = Counter(np.concatenate(per_rank).tolist())
    if drop_last:
        assert max(everything.values(), default=1) == 1
        assert n - len(everything) == n % world_size
    else:
        assert set(everything) == set(layout.block_files.tolist())
        assert sum(everything.values()) - n == count * world_size - n <= world_size - 1


@pytest.mark.parametrize("n_blocks, world_size", [(5, 2), (5, 4), (3, 3), (7, 2), (10, 8), (40, 6)])
@pytest.mark.parametrize("drop_last", [False, True])
def test_few_blocks_repeat_or_drop_at_most_world_size_minus_one_samples_per_epoch(n_blocks, world_size, drop_last):
    """Issue 28: 5 blocks over 2 ranks repeated 230 of a rank's 1,014 samples; DistributedSampler pads
    ``world_size - 1`` at most."""
    n = n_blocks * 406 - 3
    layout = uniform_layout(n, 406)
    for epoch in range(3):
        kw = dict(seed=0, epoch=epoch, world_size=world_size, num_workers=2, drop_last=drop_last)
        reads = Counter(
            np.concatenate(
                [block_shuffled_order(layout, rank=r, worker=w, **kw) for r in range(world_size) for w in range(2)]
            ).tolist()
        )
        repeats = sum(reads.values()) - len(reads)
        left_out = n - len(reads)
        assert (repeats, left_out) == ((0, n % world_size) if drop_last else (-n % world_size, 0))


@settings(max_examples=150)
@given(layouts(), st.integers(1, 3), st.integers(1, 5), st.booleans(), st.data())
def test_workers_split_their_rank_into_whole_blocks(layout, world_size, num_workers, drop_last, data):
    assume(enough_blocks(layout, world_size))
    rank = data.draw(st.integers(0, world_size - 1))
    kw = dict(seed=5, epoch=4, rank=rank, world_size=world_size, drop_last=drop_last)
    whole = block_shuffled_order(layout, **kw)
    parts = [block_shuffled_order(layout, worker=w, num_workers=num_workers, **kw) for w in range(num_workers)]
    assert Counter(np.concatenate(parts).tolist()) == Counter(whole.tolist())
    owner = block_of(layout)
    worker_blocks = [set(owner[p].tolist()) for p in parts]
    assert sum(map(len, worker_blocks)) == len(set().union(*worker_blocks))


@pytest.mark.parametrize("drop_last", [False, True])
def test_the_last_blocks_are_split_across_ranks_and_a_short_rank_pads_with_its_own_files(drop_last):
    # Blocks of 10, 10 and 5 files over two ranks: whole blocks would give one rank 15 files, the other 10.
    layout = BlockLayout([0, 10, 20, 25], np.arange(25))
    owner = block_of(layout)
    for epoch in range(4):
        kw = dict(seed=0, epoch=epoch, world_size=2, drop_last=drop_last)
        orders = [block_shuffled_order(layout, rank=r, **kw) for r in range(2)]
        assert [o.size for o in orders] == ([12, 12] if drop_last else [13, 13])
        short, long = sorted(orders, key=lambda o: len(set(o.tolist())))
        assert len(set(long.tolist())) == (12 if drop_last else 13)
        assert len(set(short.tolist())) == 12
        assert not set(short.tolist()) & set(long.tolist())
        split = set(owner[short].tolist()) & set(owner[long].tolist())
        assert len(split) == 1  # one block read by both ranks, each of its files by one
        if not drop_last:
            assert sorted(Counter(short.tolist()).values()) == [1] * 11 + [2]  # one sample of padding


@pytest.mark.parametrize("name", sorted(ORDERS))
@pytest.mark.parametrize("world_size, num_workers", [(1, 1), (3, 2), (4, 3)])
def test_every_order_covers_the_data_once_plus_padding(name, world_size, num_workers):
    layout = uniform_layout(1_001, 37)
    outputs = rank_outputs(layout, world_size, num_workers, drop_last=False, name=name)
    per_rank = [np.concatenate(w) for w in outputs]
    assert len({r.size for r in per_rank}) == 1
    everything = np.concatenate(per_rank)
    assert set(everything.tolist()) == set(range(1_001))
    assert everything.size - 1_001 < world_size * 37  # padding: less than a block per rank


def test_shard_order_follows_distributed_sampler():
    order = np.random.default_rng(0).permutation(10)
    for world_size in range(1, 5):
        padded = np.concatenate([order, order])[: -(-10 // world_size) * world_size]
        kept = order[: 10 // world_size * world_size]
        for r in range(world_size):
            assert np.array_equal(shard_order(order, rank=r, world_size=world_size), padded[r::world_size])
            dropped = shard_order(order, rank=r, world_size=world_size, drop_last=True)
            assert np.array_equal(dropped, kept[r::world_size])
    assert np.array_equal(shard_order(order, worker=1, num_workers=3), order[1::3])


# --- the baselines, the registry, the entropy -------------------------------------------------------------


def test_global_and_sequential_orders():
    layout = uniform_layout(500, 32)
    assert np.array_equal(sequential_order(layout), layout.block_files)
    first = global_shuffled_order(500, seed=1, epoch=0)
    assert np.array_equal(np.sort(first), np.arange(500))
    assert np.array_equal(first, global_shuffled_order(500, seed=1, epoch=0))
    assert not np.array_equal(first, global_shuffled_order(500, seed=1, epoch=1))


def test_get_order_names_the_known_orders():
    assert get_order("block_shuffled") is block_shuffled_order
    with pytest.raises(ValueError, match="block_shuffled, global, sequential"):
        get_order("random")


def test_batch_class_entropy():
    labels = np.array([0, 0, 1, 1, 2, 3, 4, 5])
    assert batch_class_entropy(np.array([0, 1, 0, 1]), labels, 2) == 0.0
    assert batch_class_entropy(np.array([0, 2, 1, 3, 4]), labels, 2) == pytest.approx(1.0)  # 4 is left over
    assert batch_class_entropy(np.array([4, 5, 6, 7]), labels, 4) == pytest.approx(2.0)
    with pytest.raises(ValueError, match="3 samples"):
        batch_class_entropy(np.arange(3), labels, 4)


# --- bad input --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(ORDERS))
@pytest.mark.parametrize(
    "bad, shown",
    [
        (dict(rank=2, world_size=2), "rank.*2"),
        (dict(rank=-1), "rank.*-1"),
        (dict(world_size=0), "world_size.*0"),
        (dict(worker=3, num_workers=3), "worker.*3"),
        (dict(num_workers=0), "num_workers.*0"),
        (dict(blocks_in_flight=0), "blocks_in_flight.*0"),
        (dict(epoch=-1), "epoch.*-1"),
        (dict(seed=-5), "seed.*-5"),
    ],
)
def test_bad_arguments_name_the_value(name, bad, shown):
    args = dict(seed=0, epoch=0) | bad
    with pytest.raises(ValueError, match=shown):
        get_order(name)(uniform_layout(100, 10), **args)


def test_more_ranks_than_non_empty_blocks_is_refused():
    layout = BlockLayout([0, 5, 5, 9], np.arange(9))
    with pytest.raises(ValueError, match="world_size=3.*2 non-empty"):
        block_shuffled_order(layout, seed=0, epoch=0, world_size=3)


@pytest.mark.parametrize(
    "offsets, files, shown",
    [
        ([1, 3], [0, 1], "start with 0.*1"),
        ([0, 3, 2], [0, 1], "decrease.*block 1"),
        ([0, 2], [0, 1, 2], "ends at 2.*3 ids"),
        ([0, 3], [0, 1, 1], "file id 1"),
        ([0, 2], [0, -4], "-4"),
        ([[0, 2]], [0, 1], "one-dimensional"),
    ],
)
def test_bad_layouts_are_refused(offsets, files, shown):
    with pytest.raises(ValueError, match=shown):
        BlockLayout(offsets, files)


def test_layout_from_file_blocks():
    layout = BlockLayout.from_file_blocks([1, 0, 1, 1], [2, 0, 0, 1], n_blocks=3)
    assert layout.block_offsets.tolist() == [0, 1, 4, 4]
    assert layout.block_files.tolist() == [1, 2, 3, 0]
    assert not layout.block_files.flags.writeable
    with pytest.raises(ValueError, match="n_blocks=1"):
        BlockLayout.from_file_blocks([0, 2], n_blocks=1)
