"""Which ids each batch of an epoch reads: pure NumPy, no torch, no I/O.

**The epoch's sequence** is a pure function of (seed, epoch, rank, world size, number of workers, batch
size): each of the ``W = max(1, num_workers)`` workers has its own :func:`~blockfs.loader.order.block_shuffled_order`
(disjoint whole blocks); the rank's sequence takes ``batch_size`` samples from worker 0, then from worker 1,
and so on round robin, skipping a worker that has run out -- the sequence a torch ``DataLoader`` with
``batch_size`` gives over :class:`~blockfs.loader.block_loader.BlockShuffleDataset` -- and is cut into batches of
``batch_size``, so every rank has the same number of batches. Batch ``k`` is read by worker process
``k mod W``, mostly the one that owns its blocks. Resuming replays the same plan from the first batch not
yet handed out. With reuse (see :mod:`blockfs.loader.reuse`) a batch reads only its fresh half from the sequence.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .order import BlockLayout, block_shuffled_order
from .reuse import ReusePlan, plan_reuse

__all__ = ["EpochPlan", "merge_worker_orders", "plan_epoch"]


@dataclass(frozen=True, eq=False)
class EpochPlan:
    """Batch ``k`` reads ``sequence[bounds[k]:bounds[k + 1]]`` fresh (plus ``reuse``'s cached samples)."""

    sequence: np.ndarray
    bounds: np.ndarray
    reuse: ReusePlan | None
    selected: np.ndarray | None

    def __len__(self) -> int:
        return self.bounds.size - 1

    def fresh_ids(self, k: int) -> np.ndarray:
        return self.sequence[self.bounds[k] : self.bounds[k + 1]]


def merge_worker_orders(orders: list[np.ndarray], chunk: int) -> np.ndarray:
    """Round robin over the workers' orders, ``chunk`` samples at a time, skipping those that ran out."""
    if len(orders) == 1:
        return np.asarray(orders[0], dtype=np.int64)
    keys = np.concatenate([np.arange(o.size) // chunk * len(orders) + w for w, o in enumerate(orders)])
    return np.concatenate(orders).astype(np.int64)[np.argsort(keys, kind="stable")]


def plan_epoch(
    layout: BlockLayout,
    *,
    batch_size: int,
    seed: int,
    epoch: int,
    rank: int,
    world_size: int,
    num_workers: int,
    blocks_in_flight: int,
    drop_last: bool,
    reuse: bool,
    selected: np.ndarray | None = None,
    nodes: int = 1,
    node_of_block: np.ndarray | None = None,
) -> EpochPlan:
    """The batches of ``epoch`` for ``rank`` over ``layout`` (``selected``: the ids it was cut down to)."""
    workers = max(1, num_workers)
    orders = [
        block_shuffled_order(
            layout,
            seed=seed,
            epoch=epoch,
            rank=rank,
            world_size=world_size,
            worker=w,
            num_workers=workers,
            blocks_in_flight=blocks_in_flight,
            drop_last=drop_last,
            nodes=nodes,
            node_of_block=node_of_block,
        )
        for w in range(workers)
    ]
    if not reuse:
        sequence = merge_worker_orders(orders, batch_size)
        n = sequence.size
        bounds = np.append(np.arange(0, n, batch_size), n)
        if drop_last and n % batch_size:
            bounds = bounds[:-1]
        return EpochPlan(sequence, bounds, None, selected)
    sequence = merge_worker_orders(orders, batch_size - batch_size // 2)
    plan = plan_reuse(sequence.size, batch_size, seed=seed, epoch=epoch, rank=rank, drop_last=drop_last)
    return EpochPlan(sequence, plan.fresh_bounds, plan, selected)
