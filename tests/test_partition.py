"""``partition="node"``: the blocks split among nodes once, balanced, and each epoch dealt within a node.

Invariants (Hypothesis, pure NumPy): fixed across epochs, disjoint, covering, balanced, equal per-rank
counts, deterministic for a seed."""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st
from test_order import block_of, layouts

from blockfs.loader.order import BlockLayout, block_shuffled_order, partition_blocks


def node_outputs(layout, nodes, local, num_workers, drop_last, epoch, seed=3):
    """Everything each rank reads in ``epoch`` (its workers concatenated), ranks in order."""
    kw = dict(
        seed=seed, epoch=epoch, world_size=nodes * local, num_workers=num_workers, drop_last=drop_last, nodes=nodes
    )
    return [
        np.concatenate([block_shuffled_order(layout, rank=r, worker=w, **kw) for w in range(num_workers)])
        for r in range(nodes * local)
    ]


def enough(layout: BlockLayout, nodes: int, local: int) -> bool:
    if layout.n_files == 0:
        return True
    if np.count_nonzero(layout.block_sizes) < nodes:
        return False
    node_of = partition_blocks(layout, nodes, seed=3)
    return all(np.count_nonzero(layout.block_sizes[node_of == k]) >= local for k in range(nodes))


@given(layouts(), st.integers(1, 4), st.integers(0, 2**32))
def test_the_partition_is_fixed_covering_and_deterministic(layout, nodes, seed):
    assume(np.count_nonzero(layout.block_sizes) >= nodes)
    node_of = partition_blocks(layout, nodes, seed=seed)
    assert node_of.shape == (layout.n_blocks,) and node_of.min(initial=0) >= 0 and node_of.max(initial=0) < nodes
    assert np.array_equal(node_of, partition_blocks(layout, nodes, seed=seed))
    if nodes > 1:
        assert set(node_of[layout.block_sizes > 0].tolist()) == set(range(nodes))  # every node has a part


@settings(max_examples=150)
@given(layouts(), st.integers(1, 3), st.integers(1, 3), st.integers(1, 3), st.booleans())
def test_node_ranks_read_only_their_part_the_same_every_epoch_with_equal_counts(
    layout, nodes, local, workers, drop_last
):
    assume(enough(layout, nodes, local))
    owner = block_of(layout)
    node_of = partition_blocks(layout, nodes, seed=3)
    seen = []
    for epoch in (0, 1, 5):
        per_rank = node_outputs(layout, nodes, local, workers, drop_last, epoch)
        count = per_rank[0].size
        assert all(r.size == count for r in per_rank)  # DistributedSampler's equal counts
        for rank, ids in enumerate(per_rank):
            assert set(node_of[owner[ids]].tolist()) <= {rank // local}  # only its own node's blocks
        rank_files = [set(r.tolist()) for r in per_rank]
        assert sum(map(len, rank_files)) == len(set().union(*rank_files))  # disjoint samples
        rank_blocks = [set(owner[r].tolist()) for r in per_rank]
        shared = sum(map(len, rank_blocks)) - len(set().union(*rank_blocks))
        assert shared <= nodes * (local - 1)  # only a node's last blocks are split, between its own ranks
        everything = Counter(np.concatenate(per_rank).tolist()) if per_rank else Counter()
        if drop_last:
            assert max(everything.values(), default=1) == 1
        else:
            assert set(everything) == set(layout.block_files.tolist())  # every sample, every epoch
        node_sets = [set(np.concatenate(per_rank[k * local : (k + 1) * local]).tolist()) for k in range(nodes)]
        seen.append(node_sets)
    if not drop_last:
        assert seen[0] == seen[1] == seen[2]  # a node reads the same samples every epoch


def test_the_partition_balances_samples_and_bytes():
    rng = np.random.default_rng(0)
    sizes = rng.integers(50, 150, size=400)
    offsets = np.concatenate([[0], np.cumsum(sizes)])
    layout = BlockLayout(offsets, rng.permutation(int(offsets[-1])))
    block_bytes = rng.integers(1 << 20, 64 << 20, size=400)
    for nodes in (2, 4, 8):
        node_of = partition_blocks(layout, nodes, seed=1, block_bytes=block_bytes)
        samples = np.bincount(node_of, weights=sizes, minlength=nodes)
        nbytes = np.bincount(node_of, weights=block_bytes, minlength=nodes)
        assert samples.max() / samples.mean() < 1.1 and nbytes.max() / nbytes.mean() < 1.1, (nodes, samples, nbytes)


def test_bad_node_counts_name_the_values():
    layout = BlockLayout(np.arange(0, 41, 10), np.arange(40))
    with pytest.raises(ValueError, match="world_size=3 is not a multiple of nodes=2"):
        block_shuffled_order(layout, seed=0, epoch=0, world_size=3, nodes=2)
    with pytest.raises(ValueError, match="nodes=5 but the layout has only 4 non-empty blocks"):
        partition_blocks(layout, 5, seed=0)
