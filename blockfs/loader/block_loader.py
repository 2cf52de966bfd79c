"""The companion loader: block-shuffled batches read through a blockfs mount, on the GPU one batch ahead.

    loader = BlockLoader("/mnt/imagenet", batch_size=256, decode=my_decode, device="cuda", num_workers=4)
    for epoch in range(90):
        loader.set_epoch(epoch)
        for samples, labels, ids in loader: ...

The mount is found and read by :class:`~blockfs.loader.mount_client.BlockfsMount` (which also announces each epoch's
blocks to the mount); batches, reuse's sample cache and the copy to the device are in :mod:`blockfs.loader.batches`.

**The epoch's sequence** is a pure function of (seed, epoch, rank, world size, number of workers, batch
size), planned by :func:`~blockfs.loader.epochplan.plan_epoch`; batch ``k`` is read by worker process ``k mod W``
and resuming replays the same plan from the first batch not yet handed out.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import os
import warnings
from collections import Counter
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, IterableDataset, get_worker_info

from ..errors import IdentityError
from .batches import (
    ON_DECODE_ERROR,
    BatchReader,
    ByteBatch,
    DeviceFeeder,
    SampleCache,
    WorkList,
    collate_samples,
    decode_error,
    identity,
    on_host,
    pinned,
    resolve_device,
)
from .epochplan import EpochPlan, merge_worker_orders, plan_epoch
from .importance import ImportanceConfig, LossTracker, select_important, subset_layout
from .mount_client import BlockfsMount
from .order import BlockLayout, block_shuffled_order, partition_blocks

__all__ = [
    "BlockLoader",
    "BlockShuffleDataset",
    "BlockfsMount",
    "ByteBatch",
    "ImportanceConfig",
    "collate_samples",
    "merge_worker_orders",
]

STATE_VERSION = 1


@contextlib.contextmanager
def _left_to_this_process(forking: bool) -> Iterator[None]:
    """While worker processes are forked (``forking``): every object this process has is kept out of their
    garbage collectors' reach (``gc.freeze``), and back in this one's after. Among them may be garbage that
    holds CUDA tensors (an exception's traceback, an abandoned epoch's batches): a forked worker's copy of
    the CUDA context is unusable, and such a tensor freed there aborts the worker (seen on an H100:
    "CUDA error: initialization error" in a tensor's destructor, called by the worker's collector)."""
    if not forking:
        yield
        return
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


def _distributed() -> tuple[int, int] | None:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return None


def _check_int(name: str, value: object, low: int) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < low:
        raise ValueError(f"{name} must be an integer of at least {low} (got {value!r})")
    return int(value)


def _sharding(rank: int | None, world_size: int | None) -> tuple[int, int]:
    """rank and world size: the keywords where given, else torch.distributed's, else (0, 1)."""
    from_dist = _distributed() or (0, 1)
    world_size = _check_int("world_size", from_dist[1] if world_size is None else world_size, 1)
    rank = from_dist[0] if rank is None else rank
    if isinstance(rank, bool) or not isinstance(rank, (int, np.integer)) or not 0 <= rank < world_size:
        raise ValueError(f"rank must be in [0, {world_size}) for world_size={world_size} (got {rank!r})")
    return int(rank), world_size


PARTITIONS = ("global", "node")


def _nodes(partition: str, nodes: int | None, rank: int, world_size: int) -> int:
    """How many nodes the blocks are split among: 1 for ``partition="global"``; for ``"node"`` the keyword,
    else torchrun's ``WORLD_SIZE / LOCAL_WORLD_SIZE``, checked against ``GROUP_RANK``/``NODE_RANK``."""
    if partition not in PARTITIONS:
        raise ValueError(f"partition must be 'global' or 'node' (got {partition!r})")
    if partition == "global":
        if nodes not in (None, 1):
            raise ValueError(f"nodes={nodes!r} only applies with partition='node'")
        return 1
    if nodes is None:
        local = os.environ.get("LOCAL_WORLD_SIZE")
        if local is None:
            raise ValueError(
                "partition='node' needs the number of nodes: pass nodes=N, or run under torchrun "
                "(which sets LOCAL_WORLD_SIZE)"
            )
        local_size = _check_int("LOCAL_WORLD_SIZE", int(local), 1)
        if world_size % local_size:
            raise ValueError(
                f"world_size={world_size} is not a multiple of LOCAL_WORLD_SIZE={local_size}: "
                "partition='node' needs the same number of ranks on every node"
            )
        nodes = world_size // local_size
    nodes = _check_int("nodes", nodes, 1)
    if world_size % nodes:
        raise ValueError(
            f"world_size={world_size} is not a multiple of nodes={nodes}: partition='node' needs "
            "the same number of ranks on every node"
        )
    group = os.environ.get("GROUP_RANK", os.environ.get("NODE_RANK"))
    per_node = world_size // nodes
    if group is not None and group.isdigit() and int(group) != rank // per_node:
        raise ValueError(
            f"rank {rank} of {world_size} on {nodes} nodes belongs to node {rank // per_node} (ranks are numbered "
            f"node by node, {per_node} per node, as torchrun does), but GROUP_RANK/NODE_RANK says {group}"
        )
    return nodes


def _node_of_block(mount: BlockfsMount, nodes: int, seed: int) -> np.ndarray | None:
    """Each block's node, from the whole dataset (so the importance option's subsets keep the same split)."""
    if nodes == 1:
        return None
    return partition_blocks(mount.layout, nodes, seed=seed, block_bytes=mount.block_bytes)


def _samples(mount: BlockfsMount, unlabeled: bool) -> tuple[BlockLayout, np.ndarray]:
    """The layout and ids of the files an epoch reads.  As torchvision's ImageFolder, a labelled dataset's
    files outside the class directories (label -1: a top-level README.txt) are left out unless
    ``unlabeled``; a dataset without labels (``--labels none``) is read whole."""
    ids = mount.file_ids
    labelled = mount.labels[ids] >= 0
    if unlabeled or labelled.all() or not labelled.any():
        return mount.layout, ids
    keep = np.zeros(mount.n_entries, dtype=bool)
    keep[ids[labelled]] = True
    return subset_layout(mount.layout, keep), ids[labelled]


# --- the loaders ----------------------------------------------------------------------------------------
class BlockShuffleDataset(IterableDataset):
    """Samples ``(decode(bytes), label, id)`` in block-shuffled order, for your own ``DataLoader``.

    Each ``DataLoader`` worker reads its own share (``torch.utils.data.get_worker_info()``), the same
    share :class:`BlockLoader` gives its worker of that number; ``DataLoader(ds, batch_size=B,
    num_workers=W)`` then yields the same ids in the same order as ``BlockLoader(..., batch_size=B,
    num_workers=W)``, except that its last batches are each worker's partial one. Call :meth:`set_epoch`
    before each epoch, as with ``DistributedSampler``: the epoch lives in shared memory, so workers kept by
    ``persistent_workers=True`` read the new one when their next iterator starts.  ``unlabeled=True`` also
    yields files outside the class directories (label -1), which are left out by default.  A file
    ``decode`` raises on stops the iteration with a :class:`~blockfs.errors.DecodeError` naming its path and
    id (to skip such files and count them, use :class:`BlockLoader`'s ``on_decode_error="skip"``).
    """

    def __init__(
        self,
        root: str | os.PathLike,
        *,
        decode: Callable[[bytes], Any] = identity,
        seed: int = 0,
        rank: int | None = None,
        world_size: int | None = None,
        blocks_in_flight: int = 6,
        drop_last: bool = False,
        partition: str = "global",
        nodes: int | None = None,
        unlabeled: bool = False,
        expect: str | None = None,
    ) -> None:
        self.mount = BlockfsMount(root, expect=expect)
        self.decode = decode
        self.unlabeled = bool(unlabeled)
        self.seed = _check_int("seed", seed, 0)
        self.rank, self.world_size = _sharding(rank, world_size)
        self.partition, self.nodes = partition, _nodes(partition, nodes, self.rank, self.world_size)
        self.node_of_block = _node_of_block(self.mount, self.nodes, self.seed)
        self.blocks_in_flight = _check_int("blocks_in_flight", blocks_in_flight, 1)
        self.drop_last = bool(drop_last)
        # One int64 in shared memory: a worker process (forked or spawned: torch's pickler sends shared
        # tensors as shared memory) sees what set_epoch writes here after the worker started.
        self._epoch = torch.zeros(1, dtype=torch.int64).share_memory_()

    @property
    def epoch(self) -> int:
        return int(self._epoch[0])

    def set_epoch(self, epoch: int) -> None:
        self._epoch[0] = _check_int("epoch", epoch, 0)

    def order(self, worker: int = 0, num_workers: int = 1) -> np.ndarray:
        """The ids ``worker`` of ``num_workers`` reads this epoch."""
        return block_shuffled_order(
            _samples(self.mount, self.unlabeled)[0],
            seed=self.seed,
            epoch=self.epoch,
            rank=self.rank,
            world_size=self.world_size,
            worker=worker,
            num_workers=num_workers,
            blocks_in_flight=self.blocks_in_flight,
            drop_last=self.drop_last,
            nodes=self.nodes,
            node_of_block=self.node_of_block,
        )

    def __len__(self) -> int:
        return int(self.order().size)

    def close(self) -> None:
        """Unmap the index, so the mount can be unmounted."""
        self.mount.close()

    def __iter__(self) -> Iterator[tuple[Any, int, int]]:
        info = get_worker_info()
        order = self.order(info.id, info.num_workers) if info is not None else self.order()
        labels = self.mount.labels
        for i in order.tolist():
            data = self.mount.read(i)
            try:
                sample = self.decode(data)
            except Exception as e:
                raise decode_error(i, self.mount.path(i), e) from e
            yield sample, int(labels[i]), i


class BlockLoader:
    """Batches ``(samples, labels, ids)`` of a blockfs mount in block-shuffled order (see the module doc).

    ``decode(bytes) -> sample`` runs in the workers; ``collate(list of samples)`` (default
    :func:`collate_samples`) makes the batch. A file ``decode`` raises on stops the iteration with a
    :class:`~blockfs.errors.DecodeError` naming its path and sample id (decode's exception chained);
    ``on_decode_error="skip"`` leaves such files out of their batches instead (a batch is then shorter, its
    samples, labels and ids still aligned) and counts them in :attr:`skipped` / :attr:`skipped_ids`. ``rank``/``world_size`` default to torch.distributed's when it
    is initialised. ``drop_last`` follows ``DistributedSampler`` (drop rather than pad to equal rank sizes)
    and also drops a last partial batch. ``reuse=True``: see :mod:`blockfs.loader.reuse`. ``importance=``: an
    :class:`ImportanceConfig`, see :mod:`blockfs.loader.importance` and :meth:`report_losses`. Files outside
    the class directories of a labelled dataset (label -1) are left out, as ImageFolder does; ``unlabeled=True``
    reads them too.

    One iteration at a time; ``state_dict()`` after a batch and ``load_state_dict()`` in a new loader
    (same arguments, same number of workers) continue with exactly the batches that would have followed.
    """

    def __init__(
        self,
        root: str | os.PathLike,
        batch_size: int,
        decode: Callable[[bytes], Any] = identity,
        device: str | torch.device | None = None,
        *,
        seed: int = 0,
        num_workers: int = 0,
        rank: int | None = None,
        world_size: int | None = None,
        drop_last: bool = False,
        blocks_in_flight: int = 6,
        reuse: bool = False,
        importance: ImportanceConfig | None = None,
        collate: Callable[[list], Any] = collate_samples,
        prefetch_factor: int = 2,
        multiprocessing_context: str | None = None,
        partition: str = "global",
        nodes: int | None = None,
        unlabeled: bool = False,
        expect: str | None = None,
        on_decode_error: str = "raise",
    ) -> None:
        self.batch_size = _check_int("batch_size", batch_size, 1)
        if on_decode_error not in ON_DECODE_ERROR:
            raise ValueError(f"on_decode_error must be 'raise' or 'skip' (got {on_decode_error!r})")
        if on_decode_error == "skip" and reuse:
            raise ValueError(
                "on_decode_error='skip' does not combine with reuse=True (a reused half would miss "
                "its skipped samples): leave one of them out"
            )
        self.seed = _check_int("seed", seed, 0)
        self.num_workers = _check_int("num_workers", num_workers, 0)
        self.blocks_in_flight = _check_int("blocks_in_flight", blocks_in_flight, 1)
        self.prefetch_factor = _check_int("prefetch_factor", prefetch_factor, 1)
        self.rank, self.world_size = _sharding(rank, world_size)
        self.partition, self.nodes = partition, _nodes(partition, nodes, self.rank, self.world_size)
        if reuse and self.batch_size < 2:
            raise ValueError(f"reuse needs batch_size of at least 2 (got {batch_size}): half of a batch is reused")
        if importance is not None and not isinstance(importance, ImportanceConfig):
            raise TypeError(f"importance must be an ImportanceConfig or None (got {type(importance).__name__})")
        self.drop_last, self.reuse, self.importance = bool(drop_last), bool(reuse), importance
        self.unlabeled = bool(unlabeled)
        self.mount = BlockfsMount(root, expect=expect)
        self._layout, self._sample_ids = _samples(self.mount, self.unlabeled)
        self.node_of_block = _node_of_block(self.mount, self.nodes, self.seed)
        self.device = resolve_device(device)
        self.decode = decode
        self.on_decode_error = on_decode_error
        self._reader = BatchReader(self.mount, decode, collate, on_decode_error)
        self._skipped: list[int] = []  # ids left out because decode failed on them, in the order met
        self.multiprocessing_context = multiprocessing_context
        self._work = WorkList()
        self._dataloader: DataLoader | None = None
        self._feeder = DeviceFeeder(self.device)
        self._tracker = LossTracker(self.mount.n_entries) if importance is not None else None
        self._planned_epoch = -1  # the last epoch whose losses were folded into the tracker
        self.epoch = 0
        self._plan: EpochPlan | None = None
        self._position = 0  # batches of this epoch handed out
        self._resume_at: int | None = None

    # --- epochs and order ---------------------------------------------------------------------------
    @property
    def root(self) -> str:
        return self.mount.root

    @property
    def classes(self) -> list[str] | None:
        return self.mount.classes

    def path(self, i: int | torch.Tensor) -> str:
        """The path in the mount of the file with id ``i``."""
        return self.mount.path(int(i))

    def set_epoch(self, epoch: int) -> None:
        """Start ``epoch`` (a new order); the epoch of a just-loaded state keeps its resume point."""
        epoch = _check_int("epoch", epoch, 0)
        if epoch != self.epoch or self._resume_at is None:
            self._resume_at = None
            self._position = 0
        if epoch != self.epoch:
            self._plan = None
        self.epoch = epoch

    def __len__(self) -> int:
        """Batches in this epoch (for this rank)."""
        return len(self._epoch_plan())

    @property
    def skipped(self) -> int:
        """Samples left out since this loader was made because ``decode`` failed on them
        (``on_decode_error="skip"``; a bad file counts once per epoch that reads it)."""
        return len(self._skipped)

    @property
    def skipped_ids(self) -> list[int]:
        """The distinct ids of the files counted in :attr:`skipped` (``loader.path(i)`` names each)."""
        return sorted(set(self._skipped))

    @property
    def selected(self) -> np.ndarray | None:
        """The ids the importance option selected for this epoch (None: every sample)."""
        return self._epoch_plan().selected

    def _epoch_plan(self) -> EpochPlan:
        if self._plan is None:
            self._plan = self._build_plan()
            blocks = self.mount.block_of[self._plan.sequence]
            _, first = np.unique(blocks, return_index=True)
            self.mount.announce(blocks[np.sort(first)])
        return self._plan

    def _build_plan(self) -> EpochPlan:
        layout, selected = self._layout, self._select()
        if selected is not None:
            keep = np.zeros(self.mount.n_entries, dtype=bool)
            keep[selected] = True
            layout = subset_layout(layout, keep)
        return plan_epoch(
            layout,
            batch_size=self.batch_size,
            seed=self.seed,
            epoch=self.epoch,
            rank=self.rank,
            world_size=self.world_size,
            num_workers=self.num_workers,
            blocks_in_flight=self.blocks_in_flight,
            drop_last=self.drop_last,
            reuse=self.reuse,
            selected=selected,
            nodes=self.nodes,
            node_of_block=self.node_of_block,
        )

    def _select(self) -> np.ndarray | None:
        if self._tracker is None or self.importance is None:  # a tracker exists exactly with importance
            return None
        if self.epoch != self._planned_epoch:
            self._all_reduce(self._tracker.pending_sum, self._tracker.pending_count)
            self._tracker.fold()
            self._planned_epoch = self.epoch
        if self.epoch < self.importance.warmup_epochs:
            return None
        if not self._tracker.observed:
            warnings.warn(
                f"importance: no losses were reported before epoch {self.epoch}, so it reads every sample; "
                "call loader.report_losses(ids, losses) after each step",
                RuntimeWarning,
                stacklevel=4,
            )
            return None
        return select_important(
            self._tracker, self._sample_ids, self.importance.fraction, seed=self.seed, epoch=self.epoch
        )

    def _all_reduce(self, *arrays: np.ndarray) -> None:
        """Sum ``arrays`` in place over the ranks, so every rank selects from the same losses."""
        if self.world_size == 1 or _distributed() is None or dist.get_world_size() != self.world_size:
            return
        flat = torch.from_numpy(np.concatenate([a.astype(np.float64) for a in arrays]))
        if dist.get_backend() == "nccl":
            flat = flat.cuda()
        dist.all_reduce(flat)
        summed = flat.cpu().numpy()
        start = 0
        for a in arrays:
            a[:] = summed[start : start + a.size].astype(a.dtype)
            start += a.size

    def report_losses(self, ids: Any, losses: Any) -> None:
        """Record each sample's loss of this step (``reduction="none"``), for the importance option.

        Under DDP each rank reports its own samples; the ranks' losses are summed (all-reduce) when the next
        epoch starts (its first ``iter`` or ``len``), which every rank must reach, as with any collective.
        """
        if self._tracker is None:
            raise RuntimeError(
                "report_losses needs the importance option: BlockLoader(..., importance=ImportanceConfig())"
            )
        self._tracker.report(_to_numpy(ids), _to_numpy(losses))

    # --- iteration ----------------------------------------------------------------------------------
    def __iter__(self) -> Iterator[tuple[Any, Any, torch.Tensor]]:
        plan = self._epoch_plan()
        start = self._resume_at if self._resume_at is not None else 0
        self._resume_at = None
        self._position = start
        for k, batch in enumerate(self._feeder(self._host_batches(plan, start)), start):
            self._position = k + 1
            yield batch

    def _host_batches(self, plan: EpochPlan, start: int) -> Iterator[tuple]:
        todo = [k for k in range(start, len(plan)) if plan.bounds[k + 1] > plan.bounds[k]]
        asked = [plan.fresh_ids(k) for k in todo]
        reads = self._counted(map(on_host, self._pipeline(asked)), asked) if todo else iter(())
        if plan.reuse is None:
            yield from reads
            return
        cache = SampleCache()
        if start:  # a resumed epoch: the cache holds what earlier batches read and did not reuse yet
            held = plan.reuse.cached_before(start)
            if held.size:
                cache.put(held, self._reader[plan.sequence[held]])
        pin = self.device.type == "cuda"
        for k in range(start, len(plan)):
            fresh_range = plan.reuse.fresh(k)
            fresh = next(reads) if len(fresh_range) else None
            batch = cache.take(plan.reuse.reused_in(k), fresh)
            if fresh is not None:
                cache.put(fresh_range, fresh)
            yield pinned(batch) if pin else batch

    def _counted(self, batches: Iterator[tuple], asked: list[np.ndarray]) -> Iterator[tuple]:
        """``batches``, noting the ids each left out (``on_decode_error="skip"``) in :attr:`skipped`."""
        for batch, ids in zip(batches, asked, strict=False):
            if len(batch[2]) < ids.size:
                missing = Counter(ids.tolist())
                missing.subtract(batch[2].tolist())
                self._skipped.extend(missing.elements())
            yield batch

    def _pipeline(self, items: list[np.ndarray]) -> Iterator:
        """The read pipeline's batches over ``items``; its workers persist across epochs (a spawned worker
        costs seconds of imports), and the work list they are fed is set anew for each iteration."""
        self._work.items = items
        if self._dataloader is None:
            workers = self.num_workers
            self._dataloader = DataLoader(
                self._reader,
                batch_size=None,
                sampler=self._work,
                num_workers=workers,
                collate_fn=identity,
                pin_memory=self.device.type == "cuda",
                prefetch_factor=self.prefetch_factor if workers else None,
                persistent_workers=workers > 0,
                multiprocessing_context=self.multiprocessing_context,
            )
        with _left_to_this_process(self.num_workers > 0):  # the workers are forked in the first iter()
            return iter(self._dataloader)

    def close(self) -> None:
        """Stop the worker processes and unmap the index, so the mount can be unmounted (the end of the
        process does the same); the loader cannot be used after."""
        dataloader, self._dataloader = self._dataloader, None
        iterator = getattr(dataloader, "_iterator", None)
        if iterator is not None and hasattr(iterator, "_shutdown_workers"):
            iterator._shutdown_workers()
        self.mount.close()

    def __enter__(self) -> BlockLoader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # --- resume -------------------------------------------------------------------------------------
    def _config(self) -> dict:
        return {
            "seed": self.seed,
            "rank": self.rank,
            "world_size": self.world_size,
            "num_workers": self.num_workers,
            "batch_size": self.batch_size,
            "blocks_in_flight": self.blocks_in_flight,
            "drop_last": self.drop_last,
            "reuse": self.reuse,
            "n_entries": self.mount.n_entries,
            "partition": self.partition,
            "nodes": self.nodes,
            "importance": dataclasses.asdict(self.importance) if self.importance else None,
            "unlabeled": self.unlabeled,
        }

    def state_dict(self) -> dict:
        """Where this rank is: the epoch and the batches of it handed out, plus the loss statistics.

        Plain ints, strings and tensors, so ``torch.save``/``torch.load(weights_only=True)`` keep it.
        """
        state: dict = {"version": STATE_VERSION, "epoch": self.epoch, "batches_done": self._position}
        state["config"] = self._config()
        state["dataset"] = self.mount.digest  # its name: a resume on any other dataset is refused
        if self._tracker is not None:
            state["losses"] = {k: torch.from_numpy(v) for k, v in self._tracker.state_dict().items()}
            state["planned_epoch"] = self._planned_epoch
        return state

    def load_state_dict(self, state: dict) -> None:
        """Continue where ``state`` was taken: the next iteration yields the batches that would have followed."""
        if state.get("version") != STATE_VERSION:
            raise ValueError(f"loader state version {state.get('version')!r}; this blockfs reads {STATE_VERSION}")
        saved = state.get("dataset")
        if saved is not None and saved != self.mount.digest:
            raise IdentityError(
                f"cannot resume: the state was saved on dataset {saved}, the mount at {self.root} "
                f"serves {self.mount.digest}"
            )
        for key, value in self._config().items():
            saved = state["config"].get(
                key, {"partition": "global", "nodes": 1, "unlabeled": True}.get(key)
            )  # older states
            if saved != value:
                raise ValueError(
                    f"cannot resume: the state was saved with {key}={saved!r}, this loader has {key}={value!r}; "
                    "an exact resume needs the same arguments (and the same rank)"
                )
        if self._tracker is not None:
            self._tracker.load_state_dict({k: _to_numpy(v) for k, v in state["losses"].items()})
            self._planned_epoch = int(state["planned_epoch"])
        self.epoch = _check_int("epoch", state["epoch"], 0)
        self._plan = None
        self._position = self._resume_at = _check_int("batches_done", state["batches_done"], 0)


def _to_numpy(x: Any) -> np.ndarray:
    if isinstance(x, torch.Tensor):
        return x.detach().cpu().numpy()
    return np.asarray(x)
