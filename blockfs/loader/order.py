"""Sample orders for the loader: pure NumPy functions of (seed, epoch, rank, worker), no I/O.

The block-shuffled order reads whole blocks, so a block is fetched once per epoch, while the order still
changes every epoch and every batch mixes several blocks:

1. the epoch's blocks are permuted, and the files inside each block are shuffled;
2. the permuted blocks are dealt to ranks (DDP), each to the rank with the fewest samples so far, so ranks
   read disjoint blocks, except the last few, whose files are dealt across the ranks so that their counts
   end within one sample of each other; each rank is then padded or trimmed to the same count (see
   :func:`block_shuffled_order`), and its blocks are dealt to its data-loader workers the same way;
3. a worker keeps ``blocks_in_flight`` blocks open, one per *lane*: its blocks are dealt to the lanes in
   permutation order (each to the lane that empties first), and the lanes are merged uniformly at random,
   so when a lane's block runs out the next block of that lane takes its place (FFCV's pages in flight).

Everything random derives from ``(seed, epoch)`` only, so every rank and worker computes the same
permutation and assignment without talking to the others.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import numpy as np

from ..core.partition import partition_blocks as core_partition
from .dealing import cyclic_segments, deal, deal_then_pour, interleave, ranges, shuffle_within_blocks

__all__ = [
    "ORDERS",
    "BlockLayout",
    "OrderFn",
    "batch_class_entropy",
    "block_shuffled_order",
    "get_order",
    "global_shuffled_order",
    "partition_blocks",
    "sequential_order",
    "shard_order",
]


@dataclass(frozen=True, eq=False)
class BlockLayout:
    """Which files each block holds, in CSR form; arrays are copied to int64 and frozen read-only.

    Block ``b`` holds the file ids ``block_files[block_offsets[b]:block_offsets[b + 1]]`` in slot order.
    Blocks may differ in size and may be empty; file ids are unique and non-negative but need not be
    ``0..n_files-1`` (ids of directories or links may be missing).
    """

    block_offsets: np.ndarray
    block_files: np.ndarray

    def __post_init__(self) -> None:
        offsets = _frozen_int64(self.block_offsets, "block_offsets")
        files = _frozen_int64(self.block_files, "block_files")
        if offsets.size == 0 or offsets[0] != 0:
            first = offsets[0] if offsets.size else "nothing"
            raise ValueError(f"block_offsets must start with 0 (got {first})")
        steps = np.diff(offsets)
        if np.any(steps < 0):
            b = int(np.argmax(steps < 0))
            raise ValueError(f"block_offsets must not decrease: block {b} goes from {offsets[b]} to {offsets[b + 1]}")
        if offsets[-1] != files.size:
            raise ValueError(f"block_offsets ends at {offsets[-1]} but block_files holds {files.size} ids")
        if files.size and files.min() < 0:
            raise ValueError(f"file ids must be non-negative (got {files.min()})")
        ids = np.sort(files)
        repeated = ids[1:][ids[1:] == ids[:-1]]
        if repeated.size:
            raise ValueError(f"file id {repeated[0]} is in more than one slot")
        object.__setattr__(self, "block_offsets", offsets)
        object.__setattr__(self, "block_files", files)

    @classmethod
    def from_file_blocks(
        cls, block_of_file: np.ndarray, slot_of_file: np.ndarray | None = None, *, n_blocks: int | None = None
    ) -> BlockLayout:
        """Build the layout of files ``0..len(block_of_file)-1`` from each file's block (and slot).

        Without slots, files keep their id order inside a block. ``n_blocks`` keeps trailing empty blocks.
        """
        blocks = np.asarray(block_of_file, dtype=np.int64)
        if blocks.size and blocks.min() < 0:
            raise ValueError(f"block numbers must be non-negative (got {blocks.min()})")
        needed = int(blocks.max()) + 1 if blocks.size else 0
        n_blocks = needed if n_blocks is None else n_blocks
        if n_blocks < needed:
            raise ValueError(f"n_blocks={n_blocks} but a file is in block {needed - 1}")
        if slot_of_file is None:
            files = np.argsort(blocks, kind="stable")
        else:
            slots = np.asarray(slot_of_file, dtype=np.int64)
            if slots.shape != blocks.shape:
                raise ValueError(f"{slots.size} slots given for {blocks.size} files")
            files = np.lexsort((slots, blocks))
        offsets = np.zeros(n_blocks + 1, dtype=np.int64)
        np.cumsum(np.bincount(blocks, minlength=n_blocks), out=offsets[1:])
        return cls(offsets, files)

    @property
    def n_blocks(self) -> int:
        return self.block_offsets.size - 1

    @property
    def n_files(self) -> int:
        return self.block_files.size

    @property
    def block_sizes(self) -> np.ndarray:
        """Number of files in each block."""
        return np.diff(self.block_offsets)


class OrderFn(Protocol):
    """The common signature of every order in :data:`ORDERS`."""

    def __call__(
        self,
        layout: BlockLayout,
        *,
        seed: int,
        epoch: int,
        rank: int = 0,
        world_size: int = 1,
        worker: int = 0,
        num_workers: int = 1,
        blocks_in_flight: int = 6,
        drop_last: bool = False,
    ) -> np.ndarray: ...


def block_shuffled_order(
    layout: BlockLayout,
    *,
    seed: int,
    epoch: int,
    rank: int = 0,
    world_size: int = 1,
    worker: int = 0,
    num_workers: int = 1,
    blocks_in_flight: int = 6,
    drop_last: bool = False,
    nodes: int = 1,
    node_of_block: np.ndarray | None = None,
) -> np.ndarray:
    """The file ids that data-loader ``worker`` of ``rank`` reads in ``epoch``, in order (int64).

    ``nodes > 1`` (``partition="node"``): the blocks are split among the nodes once (``node_of_block``,
    by default :func:`partition_blocks` of this layout), ranks ``k * L .. k * L + L - 1`` (``L = world_size
    / nodes``) are node ``k``'s, and each epoch deals only node ``k``'s blocks, in the epoch's permutation,
    to them.  Counts are equal across all ranks as below.

    Counts follow torch's ``DistributedSampler``. Blocks go to ranks whole while they fit under the count;
    the files of the blocks after that (the last few of the permutation) are split across the ranks, a
    contiguous run of a block's shuffled files per rank, so a split block is read by two or more ranks but
    each file by one. A rank owns the samples of its blocks and pieces, in this epoch's permutation order,
    each block's files in their shuffled order, repeated cyclically and cut at the rank count. Every rank
    yields the same count:

    - ``drop_last=False``: ``ceil(N / world_size)``. Every file is read exactly once, and each shorter rank
      pads by repeating samples from the start of its own sequence (the first files of its first blocks,
      cyclically), never another rank's: at most ``world_size - 1`` samples of the epoch are padding.
    - ``drop_last=True``: ``floor(N / world_size)``. The last ``N mod world_size`` files of the stream of
      split blocks are left out (at most ``world_size - 1``); no file is read twice.

    With ``nodes > 1`` each node's blocks are split among its own ranks only, so the count is the largest
    (smallest with ``drop_last``) node's ``ceil`` (``floor``) of its files over its ranks: the nodes' parts
    differ by whole blocks, and so may the padding.

    A rank's blocks go to its workers whole and in permutation order, each to the worker with the fewest
    samples so far (padding included), so the workers' orders together hold exactly the rank's samples. A
    padding sample is read by the worker that owns its block, as a repeat of that block dealt to a lane
    after all of the worker's own blocks (so it is read near the end, or alongside the first read of the
    block when the worker has fewer blocks than ``blocks_in_flight``). A worker gets an empty order when
    its rank has fewer blocks than workers.

    Raises ValueError for a bad argument, or when there are fewer non-empty blocks than ranks.
    """
    _check_sharding(rank, world_size, worker, num_workers)
    _check_at_least("blocks_in_flight", blocks_in_flight, 1)
    _check_nodes(nodes, world_size)
    node_of = None
    if nodes > 1:
        node_of = partition_blocks(layout, nodes, seed=seed) if node_of_block is None else np.asarray(node_of_block)
    rng = _epoch_rng(seed, epoch)
    permuted = rng.permutation(layout.n_blocks)
    sort_keys = rng.integers(0, 2**32, size=layout.n_files, dtype=np.uint32)
    blocks, seg_block, seg_start, seg_len = _rank_segments(layout, permuted, rank, world_size, drop_last, node_of)
    files, seg_len = _worker_files(layout, blocks, seg_block, seg_start, seg_len, worker, num_workers, sort_keys)
    merge_rng = _epoch_rng(seed, epoch, world_size, rank, num_workers, worker)
    return interleave(files, seg_len, blocks_in_flight, merge_rng)


def _rank_segments(
    layout: BlockLayout,
    permuted: np.ndarray,
    rank: int,
    world_size: int,
    drop_last: bool,
    node_of: np.ndarray | None = None,
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """``rank``'s blocks (in permutation order) and the runs it reads of them: (blocks, run's index into
    blocks, run's start in its block's shuffled files, run's length), cut at the count every rank yields.
    ``node_of``: each block's node, whose ranks alone it is dealt to (``partition="node"``)."""
    sizes = layout.block_sizes[permuted]
    if node_of is None:
        pieces = _deal_to_ranks(sizes, world_size, drop_last, f"world_size={world_size}", "the layout")
    else:
        nodes = int(node_of.max()) + 1 if node_of.size else 1
        local = world_size // max(nodes, 1)
        parts = []
        for node in range(nodes):
            here = np.flatnonzero(node_of[permuted] == node)
            item, rank_of, start, length = _deal_to_ranks(
                sizes[here], local, drop_last, f"{local} ranks per node", f"node {node}'s part"
            )
            parts.append((here[item], node * local + rank_of, start, length))
        item, rank_of, start, length = (np.concatenate(x) for x in zip(*parts, strict=True))
        by_item = np.argsort(item, kind="stable")  # back to permutation order
        pieces = item[by_item], rank_of[by_item], start[by_item], length[by_item]
    item, rank_of, start, length = pieces
    loads = np.bincount(rank_of, weights=length, minlength=world_size).astype(np.int64)
    target = int(loads.min() if drop_last else loads.max())
    mine = (rank_of == rank) & (length > 0)
    blocks, starts, lengths = permuted[item[mine]], start[mine], length[mine]
    seg_block, seg_len = cyclic_segments(lengths, target)
    return blocks, seg_block, starts[seg_block], seg_len


def _deal_to_ranks(
    sizes: np.ndarray, ranks: int, drop_last: bool, who: str, what: str
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """The pieces of blocks each rank among ``ranks`` reads: (block's index in ``sizes``, rank, start, length).

    Blocks go whole, in order, to the rank with the fewest samples so far, while they fit under
    ``ceil(N / ranks)`` (``floor`` with ``drop_last``); the files of the blocks after that are dealt across
    the ranks (:func:`~blockfs.loader.dealing.deal_then_pour`), so the ranks end within one sample of each
    other, as ``DistributedSampler``'s do, and at most ``ranks - 1`` samples are padding (or dropped).
    """
    non_empty = int(np.count_nonzero(sizes))
    if 0 < non_empty < ranks:
        raise ValueError(f"{who} but {what} has only {non_empty} non-empty blocks: every rank needs a block of its own")
    total = int(sizes.sum())
    cap = total // ranks if drop_last else -(-total // ranks)
    return deal_then_pour(sizes, ranks, cap)


def _worker_files(
    layout: BlockLayout,
    blocks: np.ndarray,
    seg_block: np.ndarray,
    seg_start: np.ndarray,
    seg_len: np.ndarray,
    worker: int,
    num_workers: int,
    sort_keys: np.ndarray,
) -> tuple[np.ndarray, np.ndarray]:
    """The files ``worker`` reads of its rank's runs, run after run, and those runs' lengths."""
    # Whole blocks to workers, balanced by what each block contributes to this rank (padding included).
    per_block = np.bincount(seg_block, weights=seg_len, minlength=blocks.size).astype(np.int64)
    used = np.flatnonzero(per_block)
    worker_of = np.full(blocks.size, -1, dtype=np.int64)
    worker_of[used] = deal(per_block[used], num_workers)[0]
    keep = worker_of[seg_block] == worker
    seg_block, seg_start, seg_len = seg_block[keep], seg_start[keep], seg_len[keep]
    own = np.flatnonzero(worker_of == worker)
    local = np.full(blocks.size, -1, dtype=np.int64)
    local[own] = np.arange(own.size)

    shuffled = shuffle_within_blocks(layout, blocks[own], sort_keys)
    own_starts = np.zeros(own.size, dtype=np.int64)
    np.cumsum(layout.block_sizes[blocks[own]][:-1], out=own_starts[1:])
    return shuffled[ranges(own_starts[local[seg_block]] + seg_start, seg_len)], seg_len


def partition_blocks(
    layout: BlockLayout, nodes: int, *, seed: int, block_bytes: np.ndarray | None = None
) -> np.ndarray:
    """The node each block belongs to under ``partition="node"`` (see :mod:`blockfs.core.partition`)."""
    return core_partition(layout.block_sizes, nodes, seed=seed, block_bytes=block_bytes)


def global_shuffled_order(n_files: int, *, seed: int, epoch: int) -> np.ndarray:
    """A uniform permutation of ``0..n_files-1``: the baseline that ignores blocks."""
    _check_at_least("n_files", n_files, 0)
    return _epoch_rng(seed, epoch).permutation(n_files)


def sequential_order(layout: BlockLayout) -> np.ndarray:
    """Every file once, block by block in slot order: the order that reads storage front to back."""
    return layout.block_files.copy()


def shard_order(
    order: np.ndarray,
    *,
    rank: int = 0,
    world_size: int = 1,
    worker: int = 0,
    num_workers: int = 1,
    drop_last: bool = False,
) -> np.ndarray:
    """The part of a flat order that ``worker`` of ``rank`` reads, with ``DistributedSampler``'s rule.

    The order is repeated cyclically (padding) or cut (``drop_last``) to ``world_size`` times
    ``ceil(N / world_size)`` (``floor`` with ``drop_last``) samples; rank ``r`` takes every
    ``world_size``-th sample from ``r``, and its worker ``w`` every ``num_workers``-th of those from ``w``.
    """
    _check_sharding(rank, world_size, worker, num_workers)
    order = np.asarray(order, dtype=np.int64)
    per_rank = order.size // world_size if drop_last else -(-order.size // world_size)
    total = per_rank * world_size
    return np.resize(order, total)[rank::world_size][worker::num_workers]


def _global_order(
    layout: BlockLayout,
    *,
    seed: int,
    epoch: int,
    rank: int = 0,
    world_size: int = 1,
    worker: int = 0,
    num_workers: int = 1,
    blocks_in_flight: int = 6,
    drop_last: bool = False,
) -> np.ndarray:
    """:func:`global_shuffled_order` over the layout's files, sharded; ``blocks_in_flight`` only checked."""
    _check_at_least("blocks_in_flight", blocks_in_flight, 1)
    order = layout.block_files[global_shuffled_order(layout.n_files, seed=seed, epoch=epoch)]
    return shard_order(
        order, rank=rank, world_size=world_size, worker=worker, num_workers=num_workers, drop_last=drop_last
    )


def _sequential_order(
    layout: BlockLayout,
    *,
    seed: int,
    epoch: int,
    rank: int = 0,
    world_size: int = 1,
    worker: int = 0,
    num_workers: int = 1,
    blocks_in_flight: int = 6,
    drop_last: bool = False,
) -> np.ndarray:
    """:func:`sequential_order`, sharded; the same every epoch, ``seed`` and ``blocks_in_flight`` checked."""
    _check_seed(seed, epoch)
    _check_at_least("blocks_in_flight", blocks_in_flight, 1)
    return shard_order(
        sequential_order(layout),
        rank=rank,
        world_size=world_size,
        worker=worker,
        num_workers=num_workers,
        drop_last=drop_last,
    )


ORDERS: dict[str, OrderFn] = {
    "block_shuffled": block_shuffled_order,
    "global": _global_order,
    "sequential": _sequential_order,
}


def get_order(name: str) -> OrderFn:
    """The order registered as ``name``; all share :class:`OrderFn`'s signature."""
    try:
        return ORDERS[name]
    except KeyError:
        raise ValueError(f"unknown order {name!r}; known orders: {', '.join(sorted(ORDERS))}") from None


def batch_class_entropy(order: np.ndarray, labels: np.ndarray, batch_size: int) -> float:
    """Mean Shannon entropy, in bits, of the class histogram of each full batch of ``order``.

    ``labels[i]`` is the (non-negative integer) class of file id ``i``; a trailing partial batch is
    ignored. A global shuffle scores close to the entropy of the class distribution; one class per batch
    scores 0.
    """
    _check_at_least("batch_size", batch_size, 1)
    order = np.asarray(order, dtype=np.int64)
    n_batches = order.size // batch_size
    if n_batches == 0:
        raise ValueError(f"the order holds {order.size} samples, fewer than one batch of {batch_size}")
    batch_labels = np.asarray(labels)[order[: n_batches * batch_size]].astype(np.int64)
    if batch_labels.min() < 0:
        raise ValueError(f"labels must be non-negative (got {batch_labels.min()})")
    n_classes = int(batch_labels.max()) + 1
    rows = np.repeat(np.arange(n_batches), batch_size) * n_classes
    counts = np.bincount(rows + batch_labels, minlength=n_batches * n_classes).reshape(n_batches, n_classes)
    p = counts / batch_size
    with np.errstate(divide="ignore", invalid="ignore"):
        bits = np.where(p > 0, -p * np.log2(p), 0.0)
    return float(bits.sum(axis=1).mean())


def _epoch_rng(seed: int, epoch: int, *stream: int) -> np.random.Generator:
    """The generator of ``(seed, epoch)``; ``stream`` picks an independent one for a rank/worker's own use."""
    _check_seed(seed, epoch)
    return np.random.default_rng(np.random.SeedSequence([seed, epoch], spawn_key=stream))


def _check_seed(seed: int, epoch: int) -> None:
    _check_at_least("seed", seed, 0)
    _check_at_least("epoch", epoch, 0)


def _check_at_least(name: str, value: int, low: int) -> None:
    if value < low:
        raise ValueError(f"{name} must be at least {low} (got {value})")


def _check_sharding(rank: int, world_size: int, worker: int, num_workers: int) -> None:
    _check_at_least("world_size", world_size, 1)
    _check_at_least("num_workers", num_workers, 1)
    if not 0 <= rank < world_size:
        raise ValueError(f"rank must be in [0, {world_size}) for world_size={world_size} (got {rank})")
    if not 0 <= worker < num_workers:
        raise ValueError(f"worker must be in [0, {num_workers}) for num_workers={num_workers} (got {worker})")


def _check_nodes(nodes: int, world_size: int) -> None:
    _check_at_least("nodes", nodes, 1)
    if world_size % nodes:
        raise ValueError(
            f"world_size={world_size} is not a multiple of nodes={nodes}: every node must run the same number "
            "of ranks (torchrun's LOCAL_WORLD_SIZE)"
        )


def _frozen_int64(values: np.ndarray, name: str) -> np.ndarray:
    array = np.array(values, dtype=np.int64)
    if array.ndim != 1:
        raise ValueError(f"{name} must be one-dimensional (got shape {array.shape})")
    array.setflags(write=False)
    return array
