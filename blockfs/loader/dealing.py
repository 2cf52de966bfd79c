"""How the block-shuffled order deals blocks out and merges them: pure NumPy helpers, no policy.

:mod:`blockfs.loader.order` decides *what* each rank, worker and lane reads; these functions do the
mechanics — deal items to the least-loaded bin, cut blocks repeated cyclically at a count, expand ranges
without a Python loop, shuffle inside blocks by per-slot keys, and merge lanes uniformly at random — so the
order's own function reads as the steps it takes.
"""

from __future__ import annotations

import heapq
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from .order import BlockLayout


def deal(sizes: np.ndarray, n_bins: int) -> tuple[np.ndarray, np.ndarray]:
    """Deal items in order, each to the bin with the smallest load so far (ties: the lowest bin).

    Returns each item's bin and the bin's load before it (where the item starts inside its bin).
    """
    if n_bins == 1:
        within = np.zeros(sizes.size, dtype=np.int64)
        np.cumsum(sizes[:-1], out=within[1:])
        return np.zeros(sizes.size, dtype=np.int64), within
    heap = [(0, b) for b in range(n_bins)]
    bins, starts = [], []
    for size in sizes.tolist():
        load, b = heap[0]
        bins.append(b)
        starts.append(load)
        heapq.heapreplace(heap, (load + size, b))
    return np.array(bins, dtype=np.int64), np.array(starts, dtype=np.int64)


def cyclic_segments(sizes: np.ndarray, target: int) -> tuple[np.ndarray, np.ndarray]:
    """Cut the blocks of ``sizes``, repeated cyclically, at ``target`` samples.

    Returns (index into ``sizes``, length) of each run read from the start of a block; only the last run
    can be shorter than its block.
    """
    if target == 0:
        return np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int64)
    rounds, rest = divmod(target, int(sizes.sum()))
    ends = np.cumsum(sizes)
    last = int(np.searchsorted(ends, rest))  # the block in which the last partial round stops
    blocks = np.concatenate([np.tile(np.arange(sizes.size), rounds), np.arange(last + 1 if rest else 0)])
    lengths = np.concatenate([np.tile(sizes, rounds), sizes[: last + 1 if rest else 0]])
    if rest:
        lengths[-1] = rest - (ends[last - 1] if last else 0)
    return blocks, lengths


def ranges(starts: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """``concatenate([arange(s, s + n) for s, n in zip(starts, lengths)])``, without the loop."""
    before = np.cumsum(lengths) - lengths
    return np.arange(int(lengths.sum()), dtype=np.int64) + np.repeat(starts - before, lengths)


def shuffle_within_blocks(layout: BlockLayout, blocks: np.ndarray, sort_keys: np.ndarray) -> np.ndarray:
    """The files of ``blocks``, block after block, each block in the epoch's order for it.

    The order inside a block comes from the epoch's key of each slot, so it is the same whichever rank
    or worker computes it.
    """
    sizes = layout.block_sizes[blocks]
    slots = ranges(layout.block_offsets[blocks], sizes)
    block_rank = np.repeat(np.arange(blocks.size, dtype=np.int64), sizes)
    return layout.block_files[slots[np.argsort((block_rank << 32) | sort_keys[slots])]]


def interleave(files: np.ndarray, seg_len: np.ndarray, lanes: int, rng: np.random.Generator) -> np.ndarray:
    """Merge runs of files through ``lanes`` lanes that each read one run at a time.

    Runs go to lanes in order, each to the lane that would empty first at equal speed; a uniformly random
    interleave of the lanes then places them (its next sample comes from a lane with probability
    proportional to what the lane has left, so all lanes end together).
    """
    lanes = max(1, min(lanes, seg_len.size))  # lanes beyond one per run would stay empty
    lane, start = deal(seg_len, lanes)
    lane_len = np.bincount(lane, weights=seg_len, minlength=lanes).astype(np.int64)
    lane_base = np.cumsum(lane_len) - lane_len
    lane_major = ranges(lane_base[lane] + start, seg_len)
    # A shuffled multiset of lane labels: the k-th occurrence of lane i is where lane i's k-th sample goes.
    labels = np.repeat(np.arange(lanes, dtype=np.min_scalar_type(lanes)), lane_len)
    rng.shuffle(labels)
    position = np.argsort(labels, kind="stable")
    out = np.empty(files.size, dtype=np.int64)
    out[position[lane_major]] = files
    return out
