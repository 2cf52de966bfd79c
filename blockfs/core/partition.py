"""Which node's part each block is in, under ``partition="node"``: one pure function, shared by the loader
(which deals only its node's blocks to its ranks) and the mount (which fills its tiers with that part).

The split is fixed for a (seed, dataset, number of nodes) -- the same every epoch -- so each node's
cache-once tiers hold its part, and N nodes hold N budgets' worth of the dataset.
"""

from __future__ import annotations

import heapq

import numpy as np

_STREAM = 0x9A27  # the partition's own random stream, apart from the epochs'


def partition_blocks(
    samples_per_block: np.ndarray, nodes: int, *, seed: int, block_bytes: np.ndarray | None = None
) -> np.ndarray:
    """The node of each block (int64): balanced by samples and, where ``block_bytes`` is given, by bytes too.

    Blocks are dealt largest first (by their share of the samples plus their share of the bytes; ties in a
    seeded random order) to the node with the least so far.  Empty blocks go to node 0.
    """
    if nodes < 1:
        raise ValueError(f"nodes must be at least 1 (got {nodes})")
    if seed < 0:
        raise ValueError(f"seed must be at least 0 (got {seed})")
    sizes = np.asarray(samples_per_block, dtype=np.float64)
    weight = sizes / max(1.0, sizes.sum())
    if block_bytes is not None:
        block_bytes = np.asarray(block_bytes, dtype=np.float64)
        if block_bytes.shape != sizes.shape:
            raise ValueError(f"{block_bytes.size} block sizes in bytes given for {sizes.size} blocks")
        weight = weight + block_bytes / max(1.0, block_bytes.sum())
    node_of = np.zeros(sizes.size, dtype=np.int64)
    non_empty = np.flatnonzero(sizes > 0)
    if nodes == 1 or non_empty.size == 0:
        return node_of
    if non_empty.size < nodes:
        raise ValueError(
            f"nodes={nodes} but the layout has only {non_empty.size} non-empty blocks: every node "
            "needs a block of its own"
        )
    ties = np.random.default_rng(np.random.SeedSequence([seed], spawn_key=(_STREAM,))).permutation(non_empty.size)
    dealt = non_empty[ties][np.argsort(-weight[non_empty][ties], kind="stable")]
    heap = [(0.0, node) for node in range(nodes)]
    for block in dealt.tolist():
        load, node = heap[0]
        node_of[block] = node
        heapq.heapreplace(heap, (load + float(weight[block]), node))
    return node_of
