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


def deal_then_pour(sizes: np.ndarray, n_bins: int, cap: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Deal items whole, in order, each to the least-loaded bin while it fits under ``cap``; from the first
    item that does not fit, pour that item and all after it, as one stream of units, into the bins.

    The pour levels the bins (water-filling, never above ``cap``): the emptiest are filled first, so every
    bin gets a unit while units last, and the bins end within one unit of each other or at ``cap``.  Each
    bin takes one contiguous run of the stream (the bins in order of load, then number), so an item is split
    only where a run ends.  Units beyond what the bins hold (``sum(sizes) > n_bins * cap``) are left out.

    Returns the pieces, in item order: (item, bin, start inside the item, length).
    """
    sizes = np.asarray(sizes, dtype=np.int64)
    loads = np.zeros(n_bins, dtype=np.int64)
    heap = [(0, b) for b in range(n_bins)]
    item_bin: list[int] = []
    for size in sizes.tolist():
        load, b = heap[0]
        if load + size > cap:
            break
        item_bin.append(b)
        loads[b] = load + size
        heapq.heapreplace(heap, (load + size, b))
    whole = len(item_bin)
    items = [np.arange(whole, dtype=np.int64)]
    bins = [np.array(item_bin, dtype=np.int64)]
    starts = [np.zeros(whole, dtype=np.int64)]
    lengths = [sizes[:whole]]
    rest = sizes[whole:]
    poured = _water_fill(loads, cap, int(rest.sum()))
    order = np.lexsort((np.arange(n_bins), loads))  # by load, then bin number
    amounts = poured[order]
    # Cut the stream (the remaining items back to back) at the bins' runs; split each item where a run ends.
    item_ends = np.cumsum(rest)
    run_ends = np.cumsum(amounts)
    cuts = np.union1d(item_ends, run_ends)
    cuts = cuts[(cuts > 0) & (cuts <= run_ends[-1])]  # n_bins >= 1: there is a last run
    if cuts.size:
        piece_starts = np.concatenate([[0], cuts[:-1]])
        piece_item = np.searchsorted(item_ends, piece_starts, side="right")
        piece_bin = order[np.searchsorted(run_ends, piece_starts, side="right")]
        item_begin = item_ends - rest
        items.append(whole + piece_item)
        bins.append(piece_bin)
        starts.append(piece_starts - item_begin[piece_item])
        lengths.append(cuts - piece_starts)
    return tuple(np.concatenate(x).astype(np.int64) for x in (items, bins, starts, lengths))  # type: ignore[return-value]


def _water_fill(loads: np.ndarray, cap: int, units: int) -> np.ndarray:
    """How many of ``units`` each bin takes so the emptiest rise first, none above ``cap``: the bins below
    a level ``L`` rise to it, and some of those at ``L`` take one more, lowest (load, bin) first."""
    room = np.maximum(cap - loads, 0)
    units = min(units, int(room.sum()))
    if units == 0:
        return np.zeros(loads.size, dtype=np.int64)

    def taken(level: int) -> np.ndarray:
        return np.clip(level - loads, 0, room)

    low, high = 0, cap  # the highest level whose fill fits in ``units``
    while low < high:
        mid = (low + high + 1) // 2
        if int(taken(mid).sum()) <= units:
            low = mid
        else:
            high = mid - 1
    amounts = taken(low)
    extra = units - int(amounts.sum())
    if extra:
        can = np.flatnonzero(loads + amounts == low)  # at the level and still below cap (else extra == 0)
        can = can[np.lexsort((can, loads[can]))][:extra]
        amounts[can] += 1
    return amounts


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
