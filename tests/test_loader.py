"""The companion loader (blockfs.loader.block_loader): order, reads, resume, reuse, importance, device, examples.

Most tests read a *fake mount*: the packed tree unpacked into a directory that carries the control
directory and its ``user.blockfs.control`` attribute exactly as a mount shows them, so the loader's logic
is tested without FUSE. The tests at the end run through a real mount (tests/mountutil.py, always
unmounted).
"""

from __future__ import annotations

import errno
import gc
import io
import json
import os
import pickle
import shutil
import socket
import subprocess
import sys
import threading
import warnings
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
from capability import has_fuse, has_torch, require, require_gpu
from mountutil import mounted, plain_unmount
from polling import wait_until

import blockfs
from blockfs.core.dataset import PackedDataset
from blockfs.core.unpack import unpack
from blockfs.errors import FormatError
from blockfs.loader.order import batch_class_entropy, block_shuffled_order, global_shuffled_order

pytestmark = pytest.mark.torch
REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tools"))

import make_dataset as md  # noqa: E402

B = 32


def make_fake_mount(packed: Path, out: Path, control: str = ".blockfs", blocks: bool = True) -> Path:
    """What a mount of ``packed`` shows, as a plain directory: the tree, the control directory (with the
    block files under ``blocks/`` unless ``blocks=False``, as an older mount shows it), the xattr."""
    with PackedDataset(packed) as ds:
        unpack(ds, out)
        paths = ds.store.block_paths
    (out / control).mkdir()
    if blocks:
        (out / control / "blocks").mkdir()
        for b, path in enumerate(paths):
            shutil.copy(path, out / control / "blocks" / f"{b:08d}")
    shutil.copy(packed / "index.bfi", out / control / "index.bfi")
    shutil.copy(packed / "blockfs.json", out / control / "metadata.json")
    (out / control / "stats.json").write_text("{}")
    os.setxattr(out, "user.blockfs.control", control.encode())
    return out


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """480 small files in 8 classes, packed in random order into 30 blocks of 16, and its fake mount."""
    root = tmp_path_factory.mktemp("tiny")
    md.make_dataset(root / "src", "tiny", files=480, classes=8, seed=0)
    blockfs.pack(root / "src", root / "packed", files_per_block=16, fsync=False)
    make_fake_mount(root / "packed", root / "mnt")
    return root


@pytest.fixture
def bl(torch_module):
    """The loader module (it imports torch): a skip where torch is missing."""
    import blockfs.loader.block_loader

    return blockfs.loader.block_loader


def epoch_ids(loader) -> list[list[int]]:
    return [ids.tolist() for _, _, ids in loader]


def flat(batches: list[list[int]]) -> list[int]:
    return [i for b in batches for i in b]


def index_of(tiny):
    from blockfs.core.index import PackedIndex

    return PackedIndex(tiny / "packed" / "index.bfi")


# --- finding the mount, bad input ------------------------------------------------------------------------
def test_a_path_that_is_not_a_blockfs_mount_is_refused_by_name(bl, tiny, tmp_path):
    plain = tmp_path / "plain"
    plain.mkdir()
    for path, shown in [
        (plain, "no 'user.blockfs.control' attribute"),
        (tmp_path / "missing", "not a directory"),
        (tiny / "packed", "it is a packed dataset, not its mount"),
    ]:
        with pytest.raises(FileNotFoundError, match=shown) as raised:
            bl.BlockLoader(path, 8)
        assert str(path) in str(raised.value)
    os.setxattr(plain, "user.blockfs.control", b".blockfs")
    with pytest.raises(blockfs.BlockfsError, match="has no index.bfi"):
        bl.BlockLoader(plain, 8)
    os.setxattr(plain, "user.blockfs.control", b"../elsewhere")
    with pytest.raises(blockfs.BlockfsError, match="'../elsewhere' is not the name of a control directory"):
        bl.BlockShuffleDataset(plain)


@pytest.mark.parametrize(
    ("kw", "shown"),
    [
        (dict(batch_size=0), "batch_size must be an integer of at least 1 \\(got 0\\)"),
        (dict(batch_size=-3), "got -3"),
        (dict(batch_size=8, rank=2, world_size=2), "rank must be in \\[0, 2\\) for world_size=2 \\(got 2\\)"),
        (dict(batch_size=8, rank=-1), "got -1"),
        (dict(batch_size=8, world_size=0), "world_size must be an integer of at least 1 \\(got 0\\)"),
        (dict(batch_size=8, num_workers=-1), "num_workers must be an integer of at least 0 \\(got -1\\)"),
        (dict(batch_size=8, seed=-5), "seed must be an integer of at least 0 \\(got -5\\)"),
        (dict(batch_size=1, reuse=True), "reuse needs batch_size of at least 2 \\(got 1\\)"),
    ],
)
def test_bad_arguments_name_the_value(bl, tiny, kw, shown):
    with pytest.raises(ValueError, match=shown):
        bl.BlockLoader(tiny / "mnt", **kw)


def test_report_losses_without_the_importance_option_says_how_to_enable_it(bl, tiny):
    loader = bl.BlockLoader(tiny / "mnt", B)
    with pytest.raises(RuntimeError, match="importance=ImportanceConfig"):
        loader.report_losses([1], [0.5])


# --- order and content --------------------------------------------------------------------------------
@pytest.mark.parametrize("workers", [0, 2])
def test_an_epoch_yields_every_file_once_with_its_bytes_and_label(bl, tiny, workers):
    loader = bl.BlockLoader(tiny / "mnt", B, num_workers=workers, device="cpu")
    classes = loader.classes
    batches = list(loader)
    assert len(batches) == len(loader) == 15
    ids = [i for _, _, b in batches for i in b.tolist()]
    assert sorted(ids) == sorted(loader.mount.file_ids.tolist())
    for samples, labels, batch_ids in batches:
        assert len(samples) == len(labels) == len(batch_ids) == B
        assert labels.dtype == batch_ids.dtype == __import__("torch").int64
        for data, label, i in zip(samples, labels.tolist(), batch_ids.tolist(), strict=True):
            rel = os.path.relpath(loader.path(i), loader.root)
            assert data == (tiny / "src" / rel).read_bytes()
            assert rel.split("/")[0] == classes[label]  # labels come from the index, not from paths


@pytest.mark.parametrize("pickled_below", [0, 1 << 30], ids=["shared-memory", "pickled"])
def test_batches_cross_from_workers_pickled_or_in_shared_memory_with_the_same_bytes(
    bl, tiny, monkeypatch, pickled_below
):
    from blockfs.loader import batches

    monkeypatch.setattr(batches, "PICKLED_BATCH_BYTES", pickled_below)  # forked workers inherit it
    with bl.BlockLoader(tiny / "mnt", B, num_workers=2) as loader:
        seen = 0
        for samples, labels, ids in loader:
            assert isinstance(samples, bl.ByteBatch) and labels.dtype == ids.dtype == __import__("torch").int64
            assert list(samples) == [Path(loader.path(i)).read_bytes() for i in ids.tolist()]
            assert labels.tolist() == loader.mount.labels[ids.numpy()].tolist()
            seen += len(ids)
        assert seen == len(loader.mount.file_ids)


class CollectedWhere:
    """Garbage only the collector frees (it refers to itself), which notes the pid of the process that did."""

    def __init__(self, record: Path) -> None:
        self.record, self.me = record, self

    def __del__(self) -> None:
        with open(self.record, "a") as f:
            f.write(f"{os.getpid()}\n")


_COLLECTED = []


def collecting_once(data: bytes) -> bytes:
    """A decode that runs a full collection the first time it is called in a process (a worker's)."""
    if not _COLLECTED:
        _COLLECTED.append(gc.collect())
    return data


def test_worker_processes_never_collect_what_they_inherited(bl, tiny, tmp_path):
    """What the loader's process holds when its workers are forked is never freed by their collectors: a
    CUDA tensor freed in a worker aborts it (its copy of the CUDA context is unusable), as a worker's
    collector did once on an H100. Here the garbage notes who collected it."""
    record = tmp_path / "collected"
    gc.disable()  # the garbage must still be there when the workers are forked
    try:
        CollectedWhere(record)
        with bl.BlockLoader(tiny / "mnt", B, collecting_once, "cpu", num_workers=2) as loader:
            assert len(list(loader)) == 15  # each worker ran a full collection
    finally:
        gc.enable()
    gc.collect()
    assert record.read_text().split() == [str(os.getpid())]  # freed here, by this process, and only here


def test_without_block_files_in_the_mount_files_are_opened_by_path(bl, tiny, tmp_path):
    # A mount without blocks/ (an older one): the same epoch, read file by file.
    make_fake_mount(tiny / "packed", tmp_path / "old", blocks=False)
    with bl.BlockLoader(tmp_path / "old", B, seed=3) as old, bl.BlockLoader(tiny / "mnt", B, seed=3) as new:
        assert old.mount._blocks_dir is None and new.mount._blocks_dir is not None
        for (a, la, ia), (b, lb, ib) in zip(old, new, strict=True):
            assert list(a) == list(b) and la.tolist() == lb.tolist() and ia.tolist() == ib.tolist()


def test_a_block_file_from_another_dataset_is_refused_by_name(bl, tiny, tmp_path):
    fake = make_fake_mount(tiny / "packed", tmp_path / "mixed")
    blocks = fake / ".blockfs" / "blocks"
    shutil.copy(blocks / "00000003", blocks / "00000004")  # block 4's file now holds block 3
    with bl.BlockLoader(fake, B, seed=0) as loader:
        victim = int(loader.mount.layout.block_files[loader.mount.layout.block_offsets[4]])
        with pytest.raises(FormatError, match="header says block 3"):
            loader.mount.read(victim)


def test_block_headers_are_read_through_the_formats_one_reader(bl, tiny, monkeypatch):
    from blockfs.core import format as fmt

    seen = []
    real = fmt.read_header

    def spy(pread, where, *args, **kwargs):
        seen.append(where)
        return real(pread, where, *args, **kwargs)

    monkeypatch.setattr(fmt, "read_header", spy)
    with bl.BlockLoader(tiny / "mnt", B, seed=0) as loader:
        entry = int(loader.mount.file_ids[0])
        assert loader.mount.read(entry) == Path(loader.path(entry)).read_bytes()
        assert seen == [f"block {int(loader.mount.block_of[entry])} through the mount at {loader.mount.root}"]


def test_epochs_differ_and_the_seed_fixes_the_order(bl, tiny):
    def order(seed, epoch):
        loader = bl.BlockLoader(tiny / "mnt", B, seed=seed)
        loader.set_epoch(epoch)
        return flat(epoch_ids(loader))

    assert order(0, 1) == order(0, 1)
    assert order(0, 1) != order(0, 2)
    assert order(0, 1) != order(1, 1)


def test_the_sequence_merges_the_workers_block_orders(bl, tiny):
    loader = bl.BlockLoader(tiny / "mnt", B, num_workers=2, seed=3)
    loader.set_epoch(4)
    layout = loader.mount.layout
    orders = [block_shuffled_order(layout, seed=3, epoch=4, worker=w, num_workers=2) for w in range(2)]
    assert flat(epoch_ids(loader)) == bl.merge_worker_orders(orders, B).tolist()
    # The workers' orders hold disjoint whole blocks.
    blocks = [set(loader.mount.block_of[o].tolist()) for o in orders]
    assert not blocks[0] & blocks[1]


@pytest.mark.parametrize("drop_last", [False, True])
@pytest.mark.parametrize("workers", [0, 2])
def test_ranks_read_disjoint_blocks_and_the_same_number_of_batches(bl, tiny, drop_last, workers):
    world = 3
    per_rank = []
    for rank in range(world):
        loader = bl.BlockLoader(tiny / "mnt", 24, rank=rank, world_size=world, num_workers=workers, drop_last=drop_last)
        loader.set_epoch(1)
        per_rank.append(epoch_ids(loader))
    assert len({len(batches) for batches in per_rank}) == 1
    assert len({len(flat(batches)) for batches in per_rank}) == 1
    block_of = index_of(tiny).arrays["block"]
    rank_blocks = [set(block_of[flat(b)].tolist()) for b in per_rank]
    assert all(not rank_blocks[a] & rank_blocks[b] for a in range(world) for b in range(a + 1, world))
    rank_files = [set(flat(b)) for b in per_rank]
    assert all(not rank_files[a] & rank_files[b] for a in range(world) for b in range(a + 1, world))
    seen = Counter(i for batches in per_rank for i in flat(batches))
    if drop_last:
        assert max(seen.values()) == 1 and all(len(b) == 24 for batches in per_rank for b in batches)
    else:
        assert set(seen) == set(np.flatnonzero(index_of(tiny).arrays["kind"] == 0).tolist())


def test_block_shuffle_dataset_in_a_dataloader_gives_the_same_order(bl, tiny):
    import torch

    dataset = bl.BlockShuffleDataset(tiny / "mnt", seed=5)
    dataset.set_epoch(2)
    loader = torch.utils.data.DataLoader(dataset, batch_size=B, num_workers=2)
    ours = bl.BlockLoader(tiny / "mnt", B, seed=5, num_workers=2)
    ours.set_epoch(2)
    theirs = [i for _, _, ids in loader for i in ids.tolist()]
    assert theirs == flat(epoch_ids(ours))
    assert len(dataset) == len(theirs) == 480


def test_set_epoch_reaches_persistent_workers(bl, tiny):
    # DistributedSampler.set_epoch works with persistent_workers=True; so must ours: the workers, started
    # in epoch 0, must read epoch 1's order when the next iterator starts.
    import torch

    dataset = bl.BlockShuffleDataset(tiny / "mnt", seed=5)
    loader = torch.utils.data.DataLoader(dataset, batch_size=B, num_workers=2, persistent_workers=True)
    seen = []
    for epoch in range(2):
        dataset.set_epoch(epoch)
        seen.append([i for _, _, ids in loader for i in ids.tolist()])
        expected = bl.BlockLoader(tiny / "mnt", B, seed=5, num_workers=2)
        expected.set_epoch(epoch)
        assert seen[epoch] == flat(epoch_ids(expected)), f"epoch {epoch}"
    assert seen[0] != seen[1] and sorted(seen[0]) == sorted(seen[1])


@pytest.fixture(scope="module")
def with_readme(tmp_path_factory):
    """An ImageFolder tree of 64 files in 4 classes plus a top-level README.txt (label -1), fake-mounted."""
    root = tmp_path_factory.mktemp("readme")
    md.make_dataset(root / "src", "tiny", files=64, classes=4, seed=2)
    (root / "src" / "README.txt").write_text("not a sample\n")
    blockfs.pack(root / "src", root / "packed", files_per_block=8, fsync=False)
    make_fake_mount(root / "packed", root / "mnt")
    return root


def test_files_outside_class_directories_are_left_out_unless_unlabeled(bl, with_readme):
    import torch

    mnt = with_readme / "mnt"
    readme = [i for i in bl.BlockfsMount(mnt).file_ids.tolist() if bl.BlockfsMount(mnt).labels[i] < 0]
    assert len(readme) == 1  # the README, as ImageFolder would not yield it
    default = flat(epoch_ids(bl.BlockLoader(mnt, 8)))
    assert len(default) == 64 and readme[0] not in default
    assert readme[0] in flat(epoch_ids(bl.BlockLoader(mnt, 8, unlabeled=True)))
    dataset = bl.BlockShuffleDataset(mnt)
    assert len(dataset) == 64 and all(label >= 0 for _, label, _ in dataset)
    assert len(bl.BlockShuffleDataset(mnt, unlabeled=True)) == 65
    ids = [i for _, _, batch in torch.utils.data.DataLoader(dataset, batch_size=8, num_workers=2) for i in batch]
    assert len(ids) == 64 and readme[0] not in ids


def test_batches_mix_classes_as_well_as_a_global_shuffle(bl, tiny):
    """Mean per-batch class entropy of the loader's batches, against a global shuffle (randomly packed)."""
    labels = index_of(tiny).arrays["label"]
    ours, uniform = [], []
    for epoch in range(4):
        loader = bl.BlockLoader(tiny / "mnt", B, num_workers=2, seed=epoch)
        ours.append(batch_class_entropy(np.array(flat(epoch_ids(loader))), labels, B))
        files = loader.mount.file_ids
        uniform.append(batch_class_entropy(files[global_shuffled_order(files.size, seed=epoch, epoch=0)], labels, B))
    assert np.mean(ours) >= 0.95 * np.mean(uniform)


# --- batches, device ----------------------------------------------------------------------------------
def size_and_first_byte(data: bytes):
    import torch

    return torch.tensor([len(data), data[0]], dtype=torch.float32)


def as_array(data: bytes) -> np.ndarray:
    return np.frombuffer(data[:4], dtype=np.uint8).copy()


def test_byte_samples_come_in_one_buffer_that_behaves_as_a_list_of_bytes(bl, tiny):
    import torch

    with bl.BlockLoader(tiny / "mnt", B, num_workers=2) as loader:
        samples, _, ids = next(iter(loader))
        files = [Path(loader.path(i)).read_bytes() for i in ids.tolist()]
    assert isinstance(samples, bl.ByteBatch) and samples.data.dtype == torch.uint8
    assert int(samples.offsets[-1]) == samples.data.numel() == sum(map(len, files))
    assert samples == files and list(samples) == files and samples[-1] == files[-1]
    rows = np.array([3, 0, 5])
    assert list(samples.take(rows)) == [files[r] for r in rows]
    assert list(bl.ByteBatch.cat([samples.take(rows), samples])) == [files[r] for r in rows] + files
    assert pickle.loads(pickle.dumps(samples)) == samples
    with pytest.raises(IndexError):
        samples[B]


def test_the_mount_view_pickles_as_its_path_for_spawned_workers(bl, tiny):
    mount = bl.BlockfsMount(tiny / "mnt")
    copy = pickle.loads(pickle.dumps(mount))
    some = int(mount.file_ids[7])
    assert copy.read(some) == mount.read(some) and copy.path(some) == mount.path(some)
    np.testing.assert_array_equal(copy.layout.block_files, mount.layout.block_files)
    mount.close()
    copy.close()


def test_equal_shape_samples_are_stacked_and_ragged_ones_stay_lists(bl, tiny):
    import torch

    samples, labels, ids = next(iter(bl.BlockLoader(tiny / "mnt", B, size_and_first_byte, "cpu", num_workers=2)))
    assert isinstance(samples, torch.Tensor) and samples.shape == (B, 2)
    samples, _, _ = next(iter(bl.BlockLoader(tiny / "mnt", B, as_array, "cpu")))
    assert isinstance(samples, torch.Tensor) and samples.dtype == torch.uint8 and samples.shape == (B, 4)
    ragged, _, _ = next(iter(bl.BlockLoader(tiny / "mnt", B, lambda d: torch.zeros(len(d)), "cpu")))
    assert isinstance(ragged, list) and len(ragged) == B
    fields, _, _ = next(iter(bl.BlockLoader(tiny / "mnt", B, lambda d: (len(d), d), "cpu")))
    assert isinstance(fields[0], torch.Tensor) and isinstance(fields[1], list)


def test_cuda_without_cuda_warns_once_and_runs_on_the_cpu(bl, tiny, monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # also where there is a GPU: no skip
    with pytest.warns(RuntimeWarning, match="CUDA is not available") as caught:
        loader = bl.BlockLoader(tiny / "mnt", B, size_and_first_byte, "cuda")
        samples, labels, _ = next(iter(loader))
        list(loader)
    assert len(caught) == 1
    assert samples.device.type == labels.device.type == "cpu"
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert bl.BlockLoader(tiny / "mnt", B).device.type == "cpu"  # device=None: the best there is


# --- on a GPU: marked gpu, skipped where there is none (CI included); tools/gpu_check.sh runs them -------
PADDED = 8192  # bytes a row: every tiny file is smaller (2-6 KiB)


@pytest.fixture
def gpu(bl):
    """torch, where a CUDA GPU is usable (capability.require_gpu)."""
    require_gpu()
    import torch

    return torch


def padded(data: bytes):
    """A file's bytes as a zero-padded row of PADDED uint8: a decoded sample that carries every byte."""
    import torch

    row = torch.zeros(PADDED, dtype=torch.uint8)
    row[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    return row


def weighted_sums(rows):
    """One int64 a row, on the rows' device, that changes with any byte and with its position."""
    import torch

    weights = torch.arange(1, rows.shape[1] + 1, dtype=torch.int64, device=rows.device)
    return (rows.to(torch.int64) * weights).sum(1)


GPU_SLEEP_CYCLES = 20_000_000  # ~10 ms of an H100's time: longer than the host takes to make a batch


@pytest.mark.gpu
@pytest.mark.parametrize("lagging", ["compute", "copies"])
@pytest.mark.parametrize(("workers", "reuse"), [(0, False), (2, False), (2, True)])
def test_decoded_batches_reach_the_gpu_intact_whichever_stream_lags(
    gpu, bl, tiny, monkeypatch, lagging, workers, reuse
):
    """The feeder copies each batch on its side stream and the training reads it on the current one. A sleep
    kernel a batch holds one of the two back, and each batch is freed while the kernel that reads it may
    still wait. With the compute lagging, memory the allocator handed to a later copy before that kernel ran
    (no ``record_stream``) gives wrong sums; with the copies lagging, a kernel that does not wait for its
    batch's copy (no ``wait_event``) does. On an H100, with ``record_stream`` taken out the compute-lagging
    runs with workers failed, and with ``wait_event`` taken out every copies-lagging run did."""
    torch = gpu
    from blockfs.loader import batches

    if lagging == "copies":
        issue = batches.DeviceFeeder._issue

        def slow_issue(self, batch):
            with torch.cuda.stream(self.stream):
                torch.cuda._sleep(GPU_SLEEP_CYCLES)
            return issue(self, batch)

        monkeypatch.setattr(batches.DeviceFeeder, "_issue", slow_issue)
    loader = bl.BlockLoader(tiny / "mnt", B, padded, "cuda", num_workers=workers, reuse=reuse)
    sums, labels_seen, ids_seen = [], [], []
    for epoch in range(2):
        loader.set_epoch(epoch)
        for samples, labels, ids in loader:
            assert samples.is_cuda and labels.is_cuda and not ids.is_cuda
            assert samples.shape == (len(ids), PADDED) and samples.dtype == torch.uint8
            if lagging == "compute":
                torch.cuda._sleep(GPU_SLEEP_CYCLES)
            sums.append(weighted_sums(samples))  # queued on the current stream; read after the whole run
            labels_seen.append(labels + 0)
            ids_seen.append(ids)
            del samples, labels
    ids = torch.cat(ids_seen)
    expected = weighted_sums(torch.stack([padded(Path(loader.path(i)).read_bytes()) for i in ids.tolist()]))
    assert torch.equal(torch.cat(sums).cpu(), expected)
    assert torch.cat(labels_seen).tolist() == loader.mount.labels[ids.numpy()].tolist()
    assert Counter(Counter(ids.tolist()).values()) == {4 if reuse else 2: 480}  # two epochs; reuse: twice each
    loader.close()


@pytest.mark.gpu
@pytest.mark.parametrize(("workers", "reuse"), [(0, False), (2, False), (0, True)])
def test_byte_batches_stay_on_the_host_pinned_and_labels_reach_the_gpu(gpu, bl, tiny, workers, reuse):
    with bl.BlockLoader(tiny / "mnt", B, device="cuda", num_workers=workers, reuse=reuse) as loader:
        seen = Counter()
        for samples, labels, ids in loader:
            assert isinstance(samples, bl.ByteBatch) and samples.data.is_pinned() and not samples.data.is_cuda
            assert labels.is_cuda and not ids.is_cuda
            assert list(samples) == [Path(loader.path(i)).read_bytes() for i in ids.tolist()]
            assert labels.tolist() == loader.mount.labels[ids.numpy()].tolist()
            seen.update(ids.tolist())
        assert seen == Counter({i: 2 if reuse else 1 for i in loader.mount.file_ids.tolist()})


# --- resume -------------------------------------------------------------------------------------------
def roundtrip(state: dict) -> dict:
    """Through torch.save / torch.load(weights_only=True), as a checkpoint goes."""
    import torch

    buffer = io.BytesIO()
    torch.save(state, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=True)


def interrupted(make, epoch: int, stop: int) -> tuple[list, list]:
    """Batches of one uninterrupted epoch, and of the same epoch stopped after ``stop`` batches, then
    restored into a new loader."""
    with make() as full:
        full.set_epoch(epoch)
        expected = [(ids.tolist(), s) for s, _, ids in full]
    with make() as first:
        first.set_epoch(epoch)
        got = []
        for samples, _, ids in first:
            got.append((ids.tolist(), samples))
            if len(got) == stop:
                break
        state = roundtrip(first.state_dict())
    assert state["batches_done"] == stop
    with make() as again:
        again.load_state_dict(state)
        again.set_epoch(epoch)  # the epoch of the state keeps its resume point
        got += [(ids.tolist(), s) for s, _, ids in again]
    return expected, got


@pytest.mark.parametrize("reuse", [False, True])
@pytest.mark.parametrize("workers", [0, 2])
def test_resume_mid_epoch_gives_the_rest_of_the_epoch_exactly(bl, tiny, workers, reuse):
    def make():
        return bl.BlockLoader(tiny / "mnt", 20, num_workers=workers, seed=1, reuse=reuse)

    expected, got = interrupted(make, epoch=3, stop=7)
    assert [ids for ids, _ in got] == [ids for ids, _ in expected]
    assert [s for _, s in got] == [s for _, s in expected]


def test_resume_under_ddp_restores_each_rank(bl, tiny):
    for rank in range(2):

        def make(rank=rank):
            return bl.BlockLoader(tiny / "mnt", 16, rank=rank, world_size=2, num_workers=2, seed=2)

        expected, got = interrupted(make, epoch=1, stop=5)
        assert [ids for ids, _ in got] == [ids for ids, _ in expected]
    rank0 = bl.BlockLoader(tiny / "mnt", 16, rank=0, world_size=2)
    rank1 = bl.BlockLoader(tiny / "mnt", 16, rank=1, world_size=2)
    with pytest.raises(ValueError, match="saved with rank=0, this loader has rank=1"):
        rank1.load_state_dict(rank0.state_dict())


@pytest.mark.parametrize("drop_last", [False, True])
def test_ddp_over_few_blocks_a_rank_apiece_pads_at_most_world_size_minus_one_and_resumes_exactly(bl, tiny, drop_last):
    # 30 blocks of 16 over 7 ranks: 4.3 blocks a rank, so whole blocks alone would leave ranks up to a
    # block apart; the last blocks' files are split, and the ranks end within one sample (issue 28).
    world = 7

    def make(rank):
        return bl.BlockLoader(tiny / "mnt", 16, rank=rank, world_size=world, num_workers=2, seed=2, drop_last=drop_last)

    per_rank = []
    for rank in range(world):
        with make(rank) as loader:
            loader.set_epoch(1)
            per_rank.append(flat(epoch_ids(loader)))
    n = 480
    per_rank_count = n // world // 16 * 16 if drop_last else -(-n // world)  # drop_last: whole batches only
    assert {len(ids) for ids in per_rank} == {per_rank_count}
    seen = Counter(i for ids in per_rank for i in ids)
    repeats, left_out = sum(seen.values()) - len(seen), n - len(seen)
    assert (repeats, left_out) == ((0, n - world * per_rank_count) if drop_last else (-n % world, 0))
    rank_files = [set(ids) for ids in per_rank]
    assert sum(map(len, rank_files)) == len(set().union(*rank_files))  # disjoint, apart from own repeats
    for rank in (0, world - 1):
        expected, got = interrupted(lambda rank=rank: make(rank), epoch=1, stop=2)
        assert [ids for ids, _ in got] == [ids for ids, _ in expected]


def test_resume_needs_the_same_arguments(bl, tiny):
    state = bl.BlockLoader(tiny / "mnt", B, num_workers=2).state_dict()
    with pytest.raises(ValueError, match="saved with num_workers=2, this loader has num_workers=0"):
        bl.BlockLoader(tiny / "mnt", B).load_state_dict(state)


def test_a_state_taken_after_an_epoch_resumes_with_the_next_one(bl, tiny):
    loader = bl.BlockLoader(tiny / "mnt", B)
    loader.set_epoch(2)
    list(loader)
    again = bl.BlockLoader(tiny / "mnt", B)
    again.load_state_dict(loader.state_dict())
    again.set_epoch(2)
    assert list(again) == []
    again.set_epoch(3)
    loader.set_epoch(3)
    assert epoch_ids(again) == epoch_ids(loader)


# --- reuse --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("workers", [0, 2])
def test_reuse_reads_half_of_each_batch_and_yields_every_sample_twice(bl, tiny, workers):
    reads = []

    def counting(data: bytes) -> bytes:
        reads.append(1)  # counted in this process only when there are no workers
        return data

    loader = bl.BlockLoader(tiny / "mnt", B, counting, num_workers=workers, reuse=True)
    batches = list(loader)
    ids = flat([b.tolist() for _, _, b in batches])
    assert Counter(Counter(ids).values()) == {2: 480}  # every sample exactly twice per epoch
    assert len(batches) == len(loader) == 2 * 480 // B
    for samples, _, batch_ids in batches:  # a reused sample is the same sample
        for data, i in zip(samples, batch_ids.tolist(), strict=True):
            assert data == Path(loader.path(i)).read_bytes()
    if workers == 0:
        assert len(reads) == 480  # each sample read once: B/2 reads per step instead of B


# --- importance ---------------------------------------------------------------------------------------
class PrefetchListener:
    """A stand-in for the mount's prefetch socket: collects each announcement (block ids, in order)."""

    def __init__(self, path: Path) -> None:
        self.server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.server.bind(os.fspath(path))
        self.server.listen()
        self.announcements: list[list[int]] = []
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.server.accept()
            except OSError:
                return
            with conn:
                data = b""
                while chunk := conn.recv(65536):
                    data += chunk
            self.announcements.append([int(x) for x in data.split()])

    def wait(self, count: int) -> None:
        wait_until(lambda: len(self.announcements) >= count, f"{count} prefetch announcements")

    def close(self) -> None:
        self.server.close()


def synthetic_losses(ids: np.ndarray, epoch: int, volatile: set, hard: set) -> np.ndarray:
    """Volatile samples jump between 4 and 0.2 from epoch to epoch, hard ones stay at 3, the rest at 0.1."""
    out = np.full(ids.size, 0.1)
    out[[i in hard for i in ids.tolist()]] = 3.0
    out[[i in volatile for i in ids.tolist()]] = 4.0 if epoch % 2 == 0 else 0.2
    return out + 1e-3 * (ids % 7)


@pytest.mark.parametrize("workers", [0, 2])
def test_importance_trains_on_the_volatile_and_hardest_samples_in_block_order(bl, tiny, tmp_path, workers):
    files = bl.BlockfsMount(tiny / "mnt").file_ids
    rng = np.random.default_rng(0)
    picked = rng.permutation(files)
    volatile, hard = set(picked[:48].tolist()), set(picked[48:144].tolist())

    listener = PrefetchListener(tmp_path / "prefetch.sock")
    os.setxattr(tiny / "mnt" / ".blockfs", "user.blockfs.prefetch", os.fsencode(tmp_path / "prefetch.sock"))
    try:
        config = bl.ImportanceConfig(fraction=0.25, warmup_epochs=2)
        loader = bl.BlockLoader(tiny / "mnt", 16, num_workers=workers, importance=config, seed=4)
        for epoch in range(3):
            loader.set_epoch(epoch)
            seen = []
            for _, _, ids in loader:
                loader.report_losses(ids, synthetic_losses(ids.numpy(), epoch, volatile, hard))
                seen += ids.tolist()
            if epoch < 2:
                assert sorted(seen) == sorted(files.tolist())  # warm-up: full epochs
        listener.wait(3)
    finally:
        os.removexattr(tiny / "mnt" / ".blockfs", "user.blockfs.prefetch")
        listener.close()

    chosen = set(seen)
    assert len(seen) == len(chosen) == 120  # a quarter of 480, each once
    assert volatile <= chosen and chosen - volatile <= hard
    np.testing.assert_array_equal(np.sort(loader.selected), np.sort(seen))
    # Still block order: the block-shuffled order of the layout cut down to the selected files.
    keep = np.zeros(loader.mount.n_entries, dtype=bool)
    keep[loader.selected] = True
    from blockfs.loader.importance import subset_layout

    sub = subset_layout(loader.mount.layout, keep)
    w = max(1, workers)
    orders = [block_shuffled_order(sub, seed=4, epoch=2, worker=k, num_workers=w) for k in range(w)]
    assert seen == bl.merge_worker_orders(orders, 16).tolist()
    # Announced ahead: epoch 2's blocks are those of the selected files, first needed first.
    block_of = loader.mount.block_of
    first_use = list(dict.fromkeys(block_of[seen].tolist()))
    assert listener.announcements[-1] == first_use
    assert len(listener.announcements) == 3 and len(listener.announcements[0]) == 30


def test_importance_state_resumes_the_selected_epoch_exactly(bl, tiny):
    files = bl.BlockfsMount(tiny / "mnt").file_ids
    volatile, hard = set(files[::9].tolist()), set(files[1::5].tolist())

    def make():
        return bl.BlockLoader(tiny / "mnt", 16, importance=bl.ImportanceConfig(0.5, 2), num_workers=2)

    loader = make()
    for epoch in range(2):
        loader.set_epoch(epoch)
        for _, _, ids in loader:
            loader.report_losses(ids, synthetic_losses(ids.numpy(), epoch, volatile, hard))
    loader.set_epoch(2)
    expected = epoch_ids(loader)
    # The same run, interrupted after 4 batches of epoch 2 and restored into a new loader.
    first = make()
    for epoch in range(2):
        first.set_epoch(epoch)
        for _, _, ids in first:
            first.report_losses(ids, synthetic_losses(ids.numpy(), epoch, volatile, hard))
    first.set_epoch(2)
    got = []
    for _, _, ids in first:
        got.append(ids.tolist())
        first.report_losses(ids, synthetic_losses(ids.numpy(), 2, volatile, hard))
        if len(got) == 4:
            break
    again = make()
    again.load_state_dict(roundtrip(first.state_dict()))
    again.set_epoch(2)
    assert got + epoch_ids(again) == expected
    assert len(flat(expected)) == 240


def test_importance_without_losses_reads_everything_and_says_why(bl, tiny):
    loader = bl.BlockLoader(tiny / "mnt", B, importance=bl.ImportanceConfig(0.5, 1))
    loader.set_epoch(1)
    with pytest.warns(RuntimeWarning, match="no losses were reported"):
        assert len(flat(epoch_ids(loader))) == 480


# --- files decode cannot read (issue 28) ------------------------------------------------------------------
@pytest.fixture(scope="module")
def corrupt(tmp_path_factory):
    """64 real PNGs in 2 classes plus, in class 0, a zero-byte PNG and one that is not a PNG at all."""
    root = tmp_path_factory.mktemp("corrupt")
    md.make_dataset(root / "src", "learnable", files=64, classes=2, seed=1, image_size=16)
    first_class = sorted(p for p in (root / "src").iterdir() if p.is_dir())[0]
    (first_class / "zero.png").write_bytes(b"")
    (first_class / "text.png").write_bytes(b"not a png\n")
    blockfs.pack(root / "src", root / "packed", files_per_block=8, fsync=False)
    make_fake_mount(root / "packed", root / "mnt")
    return root


def decode_png(data: bytes):
    import torch
    from PIL import Image

    with Image.open(io.BytesIO(data)) as image:
        return torch.from_numpy(np.asarray(image.convert("RGB"), dtype=np.float32).copy())


def bad_ids(loader) -> set[int]:
    return {int(i) for i in loader.mount.file_ids if loader.path(i).endswith(("zero.png", "text.png"))}


@pytest.mark.parametrize("workers", [0, 2])
def test_a_file_decode_cannot_read_is_named_by_path_and_id_with_the_cause_chained(bl, corrupt, workers):
    from PIL import UnidentifiedImageError

    with bl.BlockLoader(corrupt / "mnt", 8, decode_png, num_workers=workers, seed=1) as loader:
        with pytest.raises(blockfs.BlockfsError) as raised:
            epoch_ids(loader)
        e = raised.value
        assert isinstance(e, ValueError) and e.sample_id in bad_ids(loader)
        assert e.path == loader.path(e.sample_id) and e.path.endswith(".png")
        message = str(e)
        assert "\n" not in message and repr(e.path) in message and f"sample {e.sample_id}" in message
        assert "on_decode_error='skip'" in message
        assert isinstance(e.__cause__, UnidentifiedImageError)  # from a worker too: pickled across
    dataset = bl.BlockShuffleDataset(corrupt / "mnt", decode=decode_png)
    with pytest.raises(blockfs.BlockfsError, match=r"decode failed on '.*\.png' \(sample \d+\)") as raised:
        list(dataset)
    assert isinstance(raised.value.__cause__, UnidentifiedImageError)
    dataset.close()


@pytest.mark.parametrize("workers", [0, 2])
def test_skipping_bad_files_keeps_batches_aligned_and_counts_them(bl, corrupt, workers):
    with bl.BlockLoader(corrupt / "mnt", 8, decode_png, num_workers=workers, seed=1, on_decode_error="skip") as loader:
        bad = bad_ids(loader)
        assert len(bad) == 2 and loader.skipped == 0
        for epoch in range(2):
            loader.set_epoch(epoch)
            seen = []
            for samples, labels, ids in loader:
                assert samples.shape[0] == labels.shape[0] == ids.shape[0] > 0
                assert samples.shape[1:] == (16, 16, 3)
                assert labels.tolist() == loader.mount.labels[ids.numpy()].tolist()  # rows still aligned
                seen += ids.tolist()
            assert sorted(seen) == sorted(set(loader.mount.file_ids.tolist()) - bad)
            assert loader.skipped == 2 * (epoch + 1) and loader.skipped_ids == sorted(bad)


def test_on_decode_error_takes_raise_or_skip_and_skip_is_not_combined_with_reuse(bl, corrupt):
    with pytest.raises(ValueError, match="on_decode_error must be 'raise' or 'skip' \\(got 'ignore'\\)"):
        bl.BlockLoader(corrupt / "mnt", 8, on_decode_error="ignore")
    with pytest.raises(ValueError, match="does not combine with reuse=True"):
        bl.BlockLoader(corrupt / "mnt", 8, on_decode_error="skip", reuse=True)
    # A decode that reads nothing leaves no batch to yield (and DDP ranks must keep their step counts).
    with bl.BlockLoader(corrupt / "mnt", 8, lambda data: 1 // 0, on_decode_error="skip") as loader:
        with pytest.raises(blockfs.BlockfsError, match="decode failed on all 8 samples of a batch.*ZeroDivisionError"):
            epoch_ids(loader)


def test_the_training_example_names_a_bad_image_in_one_line_or_skips_it(bl, corrupt):
    args = ("--epochs", "1", "--image-size", "16", "--batch-size", "8")
    command = [sys.executable, str(REPO / "examples" / "train_block_loader.py"), str(corrupt / "mnt"), *args]
    failed = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert failed.returncode == 2, failed.stdout + failed.stderr
    assert failed.stderr.count("\n") == 1 and "Traceback" not in failed.stderr, failed.stderr
    assert ".png' (sample " in failed.stderr and "--skip-bad" in failed.stderr
    skipped = run_example("train_block_loader.py", corrupt / "mnt", *args, "--skip-bad")
    assert "skipped 2 samples the decoder could not read" in skipped.stdout


# --- the examples -------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def learnable(tmp_path_factory):
    root = tmp_path_factory.mktemp("learnable")
    md.make_dataset(root / "src", "learnable", files=256, classes=4, seed=1)
    blockfs.pack(root / "src", root / "packed", block_size=64 << 10, fsync=False)
    make_fake_mount(root / "packed", root / "mnt")
    return root


def run_example(script: str, *args, timeout: float = 300) -> subprocess.CompletedProcess:
    command = [sys.executable, str(REPO / "examples" / script), *map(str, args)]
    done = subprocess.run(command, capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, done.stdout + done.stderr
    return done


TRAIN_ARGS = ("--epochs", "3", "--seed", "1", "--workers", "2")


@pytest.fixture(scope="module")
def trained_on_fake_mount(learnable, tmp_path_factory) -> dict:
    """The training example's result on ``learnable``'s fake mount, run once for the module: the resume test
    and the real-mount test compare their runs (same arguments) with it."""
    require(has_torch(), "PyTorch")  # made before the tests' own (function-scoped) checks
    out = tmp_path_factory.mktemp("trained") / "fake.json"
    run_example("train_block_loader.py", learnable / "mnt", *TRAIN_ARGS, "--out", out)
    return json.loads(out.read_text())


@pytest.mark.slow
def test_the_training_example_learns_and_resumes_with_identical_losses(bl, learnable, trained_on_fake_mount, tmp_path):
    run_example(
        "train_block_loader.py", learnable / "mnt", *TRAIN_ARGS, "--out", tmp_path / "b.json", "--resume-at", "13"
    )
    assert_learned_and_resumed_exactly(trained_on_fake_mount, json.loads((tmp_path / "b.json").read_text()))


def assert_learned_and_resumed_exactly(whole: dict, resumed: dict) -> None:
    """The training example's results: a run, and one checkpointed at step 13 and rebuilt from it."""
    assert whole["losses"] == resumed["losses"] and whole["steps"] == 3 * 256 // B
    assert sum(whole["losses"][-5:]) < sum(whole["losses"][:5])
    assert whole["final_accuracy"] > 0.4  # 4 classes: chance is 0.25


@pytest.mark.gpu
def test_the_training_example_trains_on_the_gpu_and_resumes_with_identical_losses(gpu, bl, learnable, tmp_path):
    """The example's determinism (deterministic algorithms, fixed seeds) holds on a GPU too: a resumed run
    gives the same losses bit for bit."""
    args = (learnable / "mnt", *TRAIN_ARGS, "--device", "cuda")
    whole = run_example("train_block_loader.py", *args, "--out", tmp_path / "a.json")
    assert ", cuda" in whole.stdout.splitlines()[0], whole.stdout
    run_example("train_block_loader.py", *args, "--out", tmp_path / "b.json", "--resume-at", "13")
    assert_learned_and_resumed_exactly(*(json.loads((tmp_path / name).read_text()) for name in ("a.json", "b.json")))


@pytest.mark.slow
def test_the_ddp_example_trains_two_ranks_in_step(bl, tiny, tmp_path):
    out = tmp_path / "ddp.json"
    # The timeout only catches two ranks waiting on each other for ever; it is not a speed claim.
    run_example(
        "ddp_train.py",
        tiny / "mnt",
        "--world-size",
        "2",
        "--epochs",
        "2",
        "--batch-size",
        "16",
        "--workers",
        "1",
        "--importance",
        "0.5",
        "--warmup",
        "1",
        "--out",
        out,
        timeout=300,
    )
    result = json.loads(out.read_text())
    ranks = result["ranks"]
    assert len(ranks) == 2
    assert ranks[0]["steps"] == ranks[1]["steps"] > 0
    for epoch in range(2):
        seen = [set(r["ids"][epoch]) for r in ranks]
        assert not seen[0] & seen[1]  # disjoint blocks, so disjoint samples
        if epoch == 0:
            assert len(seen[0] | seen[1]) == 480
        else:  # both ranks selected from the same (all-reduced) losses: half of the data, split
            assert len(seen[0] | seen[1]) == 240
    assert ranks[0]["final_params"] == pytest.approx(ranks[1]["final_params"])  # DDP kept them in step


@pytest.mark.slow
def test_the_ddp_example_trains_on_a_tree_with_a_top_level_readme(bl, with_readme, tmp_path):
    out = tmp_path / "ddp.json"
    run_example(
        "ddp_train.py",
        with_readme / "mnt",
        "--world-size",
        "2",
        "--epochs",
        "1",
        "--batch-size",
        "8",
        "--out",
        out,
        timeout=300,
    )
    ranks = json.loads(out.read_text())["ranks"]
    assert len(set(ranks[0]["ids"][0]) | set(ranks[1]["ids"][0])) == 64


# --- through a real mount -----------------------------------------------------------------------------
@pytest.fixture
def fuse_ok():
    require(has_fuse(), "/dev/fuse")


@pytest.mark.fuse
@pytest.mark.parametrize("share", [True, False], ids=["shared-blocks", "no-share"])
def test_through_a_real_mount_every_file_once_and_an_exact_resume(bl, tiny, tmp_path, fuse_ok, share):
    extra = () if share else ("--no-share",)
    with mounted(tiny / "packed", tmp_path / "mnt", "--cache-size", "64MiB", *extra) as m:

        def make():
            return bl.BlockLoader(m.path, B, num_workers=2, seed=1)

        with make() as loader:
            batches = list(loader)
            ids = [i for _, _, b in batches for i in b.tolist()]
            assert sorted(ids) == sorted(loader.mount.file_ids.tolist())
            for samples, _, batch_ids in batches[:3]:
                for data, i in zip(samples, batch_ids.tolist(), strict=True):
                    assert data == (tiny / "src" / os.path.relpath(loader.path(i), loader.root)).read_bytes()
            stats = loader.mount.stats()
        expected, got = interrupted(make, epoch=1, stop=6)
        assert got == expected
        # The loaders are closed, so nothing holds the mount: a plain (not lazy) unmount succeeds at once.
        done = plain_unmount(m.path)
        assert done.returncode == 0, done.stderr
    # Block order: each block was read from storage once, the rest were memory hits.
    assert stats["counters"]["block_loads"] == 30
    if share:  # every block handed over as shared memory (once per worker); files do not go through FUSE
        assert stats["counters"]["blocks_shared"] >= 30
        assert stats["counters"]["files_served"] < 480
    else:
        assert stats["counters"]["blocks_shared"] == 0
        assert stats["counters"]["files_served"] >= 480
    # Read through blocks/: no path lookup per file (one per block file, control files and directories).
    assert stats["requests"].get("getattr", 0) < 100, stats["requests"]


@pytest.mark.fuse
def test_a_damaged_block_fails_only_its_damaged_file_through_shared_blocks(tiny, tmp_path, fuse_ok):
    from blockfs.loader.mount_client import BlockfsMount

    dest = tmp_path / "packed"
    shutil.copytree(tiny / "packed", dest)
    with PackedDataset(dest) as ds:
        head = ds.store.header(5)
        path = ds.store.block_paths[5]
        a = ds.index.arrays
        victim = int(np.flatnonzero((a["block"] == 5) & (a["slot"] == 3))[0])
        files = np.flatnonzero(a["kind"] == 0)
        expected = {int(e): ds.read_entry(int(e)) for e in files}
    with open(path, "r+b") as f:  # one byte inside slot 3's file
        f.seek(head.data_start + int(head.offsets[3]) + 1)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0xFF]))
    with mounted(dest, tmp_path / "mnt", "--cache-size", "64MiB") as m:
        view = BlockfsMount(m.path)
        try:
            assert view.shared is not None
            for e, data in expected.items():
                if e == victim:
                    with pytest.raises(OSError) as caught:
                        view.read(e)
                    assert caught.value.errno == errno.EIO and "block 5" in str(caught.value)
                else:
                    assert view.read(e) == data  # its block's other files too, read one by one
            assert "damaged" in view.shared.refused[5] or "checksum" in view.shared.refused[5]
            assert len(view.shared.refused) == 1 and view.shared.failed is None
        finally:
            view.close()


@pytest.mark.fuse
@pytest.mark.slow
def test_the_training_example_through_a_real_mount(bl, learnable, trained_on_fake_mount, tmp_path, fuse_ok):
    with mounted(learnable / "packed", tmp_path / "mnt", "--cache-size", "64MiB") as m:
        run_example("train_block_loader.py", m.path, *TRAIN_ARGS, "--out", tmp_path / "mount.json")
    mount, fake = json.loads((tmp_path / "mount.json").read_text()), trained_on_fake_mount
    assert mount["losses"] == fake["losses"]  # the same bytes, labels and order through either
    assert mount["final_accuracy"] > 0.4


# --- partition="node" -------------------------------------------------------------------------------------
def node_epoch(bl, tiny, rank, epoch, **kw):
    loader = bl.BlockLoader(tiny / "mnt", 8, rank=rank, world_size=4, partition="node", nodes=2, device="cpu", **kw)
    loader.set_epoch(epoch)
    ids = [i for _, _, b in loader for i in b.tolist()]
    loader.close()
    return ids


def test_node_partition_reads_each_nodes_part_every_epoch_and_every_sample_once(bl, tiny):
    parts = []
    for epoch in (0, 1):
        per_rank = [node_epoch(bl, tiny, r, epoch) for r in range(4)]
        assert len({len(ids) for ids in per_rank}) == 1  # every rank the same number of samples
        all_ids = [i for ids in per_rank for i in ids]
        assert len(set(all_ids)) == 480  # every sample, the short ranks padded with their own (DistributedSampler)
        parts.append([set(per_rank[0] + per_rank[1]), set(per_rank[2] + per_rank[3])])
    assert parts[0] == parts[1] and not parts[0][0] & parts[0][1]  # each node's part is fixed and its own


def test_node_partition_takes_its_nodes_from_torchrun_and_checks_them(bl, tiny, monkeypatch):
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    loader = bl.BlockLoader(tiny / "mnt", 8, rank=3, world_size=4, partition="node", device="cpu")
    assert loader.nodes == 2
    loader.close()
    monkeypatch.setenv("GROUP_RANK", "0")
    with pytest.raises(ValueError, match="belongs to node 1.*GROUP_RANK/NODE_RANK says 0"):
        bl.BlockLoader(tiny / "mnt", 8, rank=3, world_size=4, partition="node", device="cpu")
    monkeypatch.delenv("LOCAL_WORLD_SIZE")
    monkeypatch.delenv("GROUP_RANK")
    with pytest.raises(ValueError, match="needs the number of nodes"):
        bl.BlockLoader(tiny / "mnt", 8, rank=0, world_size=4, partition="node", device="cpu")
    with pytest.raises(ValueError, match="world_size=3 is not a multiple of nodes=2"):
        bl.BlockLoader(tiny / "mnt", 8, rank=0, world_size=3, partition="node", nodes=2, device="cpu")
    with pytest.raises(ValueError, match="partition must be 'global' or 'node'"):
        bl.BlockLoader(tiny / "mnt", 8, partition="nodes", device="cpu")


def test_node_partition_resumes_exactly(bl, tiny):
    kw = dict(rank=1, world_size=4, partition="node", nodes=2, device="cpu")
    full = bl.BlockLoader(tiny / "mnt", 8, **kw)
    full.set_epoch(1)
    expected = [b.tolist() for _, _, b in full]
    first = bl.BlockLoader(tiny / "mnt", 8, **kw)
    first.set_epoch(1)
    it = iter(first)
    done = [next(it)[2].tolist() for _ in range(3)]
    state = first.state_dict()
    resumed = bl.BlockLoader(tiny / "mnt", 8, **kw)
    resumed.load_state_dict(state)
    assert done + [b.tolist() for _, _, b in resumed] == expected
    with pytest.raises(ValueError, match="partition"):
        bl.BlockLoader(tiny / "mnt", 8, rank=1, world_size=4, device="cpu").load_state_dict(state)
    for loader in (full, first, resumed):
        loader.close()


def test_expect_pins_the_mounted_dataset_and_the_state_names_it(bl, tiny):
    """Issue 23: the loader checks the mount's dataset by name, records it, and resumes on no other."""
    from blockfs.core.digest import name_of
    from blockfs.errors import IdentityError

    name = name_of((tiny / "packed" / "blockfs.json").read_bytes())
    wrong = "blake3:" + "0" * 64
    with pytest.raises(IdentityError, match="not the pinned"):
        bl.BlockLoader(tiny / "mnt", 8, expect=wrong)
    with pytest.raises(IdentityError, match="not the pinned"):
        bl.BlockShuffleDataset(tiny / "mnt", expect=wrong)
    loader = bl.BlockLoader(tiny / "mnt", 8, expect=name)
    try:
        state = loader.state_dict()
        assert state["dataset"] == name
        with pytest.raises(IdentityError, match=f"cannot resume.*{wrong}"):
            loader.load_state_dict(dict(state, dataset=wrong))
        loader.load_state_dict(state)
    finally:
        loader.close()
