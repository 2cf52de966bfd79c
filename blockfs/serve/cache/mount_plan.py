"""The plan of one mount, made once: the memory plan, a remote dataset's disk tier, and each node's part.

The serving process makes it (:func:`make_mount_plan`, while assembling the mount) and reports it to the
command that started it (:func:`blockfs.serve.server.serve`'s ``on_plan``: a pipe to ``blockfs mount``,
which prints it); ``blockfs plan``, with no server, calls the same function.  Every step is a few NumPy
passes over the index's columns, never a Python object per file, so a mount of millions of files plans
in the time of a sort.  The report is plain JSON-ready values (:meth:`MountPlan.report`), so it crosses a
pipe and is printed by the same code either way.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Literal

import numpy as np

from ...core.dataset import PackedDataset
from ...core.index import KIND_FILE
from ...core.partition import partition_blocks
from .memory_plan import MemoryPlan, disk_tier_plan
from .retain import plan_dataset


def node_part(ds: PackedDataset, nodes: int, node_rank: int, seed: int) -> list[int]:
    """The blocks of node ``node_rank`` under ``partition="node"`` (the loaders' split: same inputs)."""
    return np.flatnonzero(_node_of_block(ds, nodes, seed) == node_rank).tolist()


def _node_of_block(ds: PackedDataset, nodes: int, seed: int) -> np.ndarray:
    a = ds.index.arrays
    return partition_blocks(np.diff(a["block_offsets"]), nodes, seed=seed, block_bytes=a["block_sizes"])


def node_part_bytes(ds: PackedDataset, nodes: int, seed: int) -> list[int]:
    """The file bytes of each node's part (``partition="node"``), node by node."""
    a = ds.index.arrays
    files = a["kind"] == KIND_FILE
    per_block = np.bincount(a["block"][files].astype(np.int64), weights=a["size"][files], minlength=ds.n_blocks)
    per_node = np.bincount(_node_of_block(ds, nodes, seed), weights=per_block, minlength=nodes)
    return [int(b) for b in per_node]


@dataclasses.dataclass(frozen=True)
class MountPlan:
    """What :func:`make_mount_plan` chose: the memory plan, the distinct files it numbers (block, slot and
    size arrays, in plan id order), whether retained files are kept, and the report's other parts."""

    memory: MemoryPlan
    files: tuple[np.ndarray, np.ndarray, np.ndarray] = dataclasses.field(repr=False)
    retains: bool
    dataset: dict[str, int]
    remote: bool
    disk_tier: dict[str, Any] | None
    nodes: dict[str, Any] | None

    def report(self) -> dict[str, Any]:
        """The plan as plain JSON-ready values: what the server reports and ``blockfs plan --json`` adds to."""
        return {
            "plan": self.memory.to_dict(),
            "dataset": self.dataset,
            "remote": self.remote,
            "disk_tier": self.disk_tier,
            "nodes": self.nodes,
        }


def retains(retain: bool, policy: str) -> bool:
    """Whether a mount keeps retained files: asked for, and a policy that caches at all (``none`` reads
    every file from storage, so nothing is kept)."""
    return retain and policy != "none"


def make_mount_plan(
    ds: PackedDataset,
    budget_bytes: int,
    *,
    strategy: str | None = None,
    threshold: int | Literal["auto"] | None = None,
    retain: bool = True,
    policy: str = "cache-once",
    nodes: int = 1,
    partition_seed: int = 0,
) -> MountPlan:
    """The plan of a mount of ``ds`` under ``budget_bytes``: what the server uses and ``blockfs plan`` prints."""
    keeps = retains(retain, policy)
    memory, files = plan_dataset(ds.index.arrays, budget_bytes, strategy=strategy, threshold=threshold, retain=keeps)
    memory = dataclasses.replace(memory, n_entries=ds.index.n_entries - 1)  # every entry but the root is listed
    meta = ds.metadata
    dataset = {
        "n_files": int(meta["n_files"]),
        "file_bytes": int(meta["file_bytes"]),
        "n_blocks": int(meta["n_blocks"]),
    }
    tier, disk = ds.disk_tier, None
    if tier is not None:
        disk = disk_tier_plan(
            memory, int(meta["block_bytes"]), tier.budget, tier.stats()["used"], tier.root, one_block=memory.block_bytes
        )
    parts = None
    if nodes > 1:
        parts = {
            "nodes": nodes,
            "partition_seed": partition_seed,
            "part_bytes": node_part_bytes(ds, nodes, partition_seed),
        }
    return MountPlan(memory, files, keeps, dataset, ds.is_remote, disk, parts)
