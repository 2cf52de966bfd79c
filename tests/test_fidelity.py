"""The loader's default order mixes classes in its batches as well as a global shuffle, on a class-sorted tree.

The property that keeps accuracy (tools/bench/bench_fidelity.py trains on it): an ImageFolder tree is sorted by
class, and a block-shuffled epoch over blocks cut in that order feeds batches of a few classes. A default
(shuffled) pack plus the loader's default order must give batches whose mean class entropy is at least
0.95x a global shuffle's; a ``--order directory`` pack must fail that same check, so the check can fail.

The epoch is computed without FUSE or torch: the pack's layout from its index, then
:func:`blockfs.loader.epochplan.plan_epoch` with what ``BlockLoader`` passes it by default. That this is
what the loader reads is checked against a real ``BlockLoader`` over a fake mount (needs torch).
"""

from __future__ import annotations

import itertools
import sys
from pathlib import Path

import numpy as np
import pytest
from test_loader import make_fake_mount

import blockfs
from blockfs.core.dataset import PackedDataset
from blockfs.loader.epochplan import plan_epoch
from blockfs.loader.order import BlockLayout, batch_class_entropy, global_shuffled_order

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tools"))
import make_dataset as md  # noqa: E402

GUARD = 0.95  # the default order's batch entropy, at least this fraction of a global shuffle's
BATCH = 32
FILES, CLASSES, FILES_PER_BLOCK = 2400, 24, 50  # a class spans two blocks, as ImageNet's in 64 MiB blocks
DEFAULT_BLOCKS_IN_FLIGHT = 6  # BlockLoader's default; test_the_loader_reads_this_plan fails if it changes


@pytest.fixture(scope="module")
def packs(tmp_path_factory) -> Path:
    """A class-sorted tree (``class_NN/…``), packed with the default (shuffled) order and in directory order."""
    root = tmp_path_factory.mktemp("fidelity")
    md.make_dataset(root / "src", "tiny", files=FILES, classes=CLASSES, seed=0)
    for order in ("shuffled", "directory"):
        blockfs.pack(root / "src", root / order, order=order, files_per_block=FILES_PER_BLOCK, fsync=False)
    return root


def default_plan(packed: Path, *, seed: int, epoch: int, num_workers: int = 0, rank: int = 0, world_size: int = 1):
    """The epoch plan ``BlockLoader(mount, BATCH, seed=seed, num_workers=...)`` reads, and the labels."""
    with PackedDataset(packed) as ds:
        layout = BlockLayout(*ds.layout)
        labels = np.array(ds.labels, dtype=np.int64)
    plan = plan_epoch(
        layout,
        batch_size=BATCH,
        seed=seed,
        epoch=epoch,
        rank=rank,
        world_size=world_size,
        num_workers=num_workers,
        blocks_in_flight=DEFAULT_BLOCKS_IN_FLIGHT,
        drop_last=False,
        reuse=False,
    )
    return plan, labels


def entropy_vs_global(packed: Path, **sharding: int) -> float:
    """Mean batch class entropy of the default order over 3 epochs, as a fraction of a global shuffle's."""
    ours, uniform = [], []
    for epoch in range(3):
        plan, labels = default_plan(packed, seed=7, epoch=epoch, **sharding)
        ours.append(batch_class_entropy(plan.sequence, labels, BATCH))
        files = np.flatnonzero(labels >= 0)
        shuffled = files[global_shuffled_order(files.size, seed=7, epoch=epoch)][: plan.sequence.size]
        uniform.append(batch_class_entropy(shuffled, labels, BATCH))
    return float(np.mean(ours) / np.mean(uniform))


def test_the_source_tree_is_sorted_by_class(packs):
    # Without this the test below would prove nothing: a directory-order pack of it has one class per block.
    with PackedDataset(packs / "directory") as ds:
        offsets, files = ds.layout
        labels = np.asarray(ds.labels)
        classes_per_block = [np.unique(labels[files[a:b]]).size for a, b in itertools.pairwise(offsets)]
    assert max(classes_per_block) == 1
    assert len(classes_per_block) == FILES // FILES_PER_BLOCK


@pytest.mark.parametrize(
    "sharding",
    [{}, {"num_workers": 2}, {"rank": 1, "world_size": 2, "num_workers": 2}],
    ids=["one-process", "2-workers", "rank-1-of-2"],
)
@pytest.mark.parametrize("order, mixes", [("shuffled", True), ("directory", False)])
def test_default_order_mixes_classes_like_a_global_shuffle(packs, order, mixes, sharding):
    """The default pack passes the guard; a directory-order pack (one class per block) fails it."""
    ratio = entropy_vs_global(packs / order, **sharding)
    assert (ratio >= GUARD) is mixes, f"{order} pack: batch entropy {ratio:.3f}x a global shuffle's"
    if not mixes:  # not a near miss: batches of a few classes
        assert ratio < 0.7, f"{order} pack: batch entropy {ratio:.3f}x a global shuffle's"


@pytest.mark.torch
@pytest.mark.parametrize("num_workers", [0, 2])
def test_the_loader_reads_this_plan(torch_module, packs, tmp_path, num_workers):
    """``BlockLoader`` with its defaults yields the ids of :func:`default_plan`, batch for batch."""
    from blockfs.loader import BlockLoader

    mount = make_fake_mount(packs / "shuffled", tmp_path / "mnt")
    plan, _ = default_plan(packs / "shuffled", seed=3, epoch=2, num_workers=num_workers)
    with BlockLoader(mount, BATCH, seed=3, num_workers=num_workers) as loader:
        loader.set_epoch(2)
        batches = [ids.tolist() for _, _, ids in loader]
    assert batches == [plan.fresh_ids(k).tolist() for k in range(len(plan))]
