"""Retained target files on the mount (issue 4): kept in memory after their first read, whatever happens to
their blocks; the mount's plan equals ``blockfs plan``; memory stays within the budget."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from capability import has_fuse, require
from mountutil import mounted, release

import blockfs
from blockfs.client import read_stats
from blockfs.core.dataset import PackedDataset
from blockfs.core.format import BLOCKS_DIR
from blockfs.serve.cache.retain import plan_dataset, unique_files
from blockfs.serve.cache.uncached import FILE_BUFFER_BYTES

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tools"))

import make_dataset as md  # noqa: E402


@pytest.fixture(scope="module")
def packed(tmp_path_factory):
    root = tmp_path_factory.mktemp("retain")
    md.make_dataset(root / "src", "imagenet", files=480, classes=4, seed=3)  # ~52 MiB, lognormal sizes
    blockfs.pack(root / "src", root / "p", block_size=1 << 20, fsync=False)
    return root


def _names(src: Path) -> list[str]:
    return sorted(os.path.relpath(os.path.join(d, f), src) for d, _, fs in os.walk(src) for f in fs)


def test_unique_files_counts_hard_links_once(tmp_path):
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "a").write_bytes(b"x" * 100)
    os.link(tmp_path / "src" / "a", tmp_path / "src" / "b")
    (tmp_path / "src" / "c").write_bytes(b"y" * 7)
    blockfs.pack(tmp_path / "src", tmp_path / "p", fsync=False)
    with PackedDataset(tmp_path / "p") as ds:
        _blocks, _slots, sizes = unique_files(ds.index.arrays)
    assert sorted(sizes.tolist()) == [7, 100]


@pytest.mark.parametrize("order", ["<", ">"])
def test_unique_files_reads_sizes_in_the_index_byte_order(tmp_path, order):
    """The index declares its sizes little-endian ('<u8'); the sizes come out right whatever the machine's
    own order: here a column of either order stands for an index read on a machine of the other."""
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "a").write_bytes(b"x" * 100)
    (tmp_path / "src" / "c").write_bytes(b"y" * 70000)
    blockfs.pack(tmp_path / "src", tmp_path / "p", fsync=False)
    with PackedDataset(tmp_path / "p") as ds:
        arrays = {name: ds.index.arrays[name] for name in ("kind", "block", "slot", "block_counts", "block_files")}
        arrays["size"] = ds.index.arrays["size"].astype(order + "u8")
        _blocks, _slots, sizes = unique_files(arrays)
    assert sorted(sizes.tolist()) == [100, 70000]


def test_two_files_in_one_slot_are_told_from_neighbouring_slots():
    """The hard-link test marks each (block, slot) once: slots side by side, in or across blocks, are not one."""
    from blockfs.serve.cache.retain import _shares_slots, slot_base

    base = slot_base(np.array([3, 2]))  # block 0: slots 0-2, block 1: slots 0-1
    every = base[np.array([0, 0, 0, 1, 1])] + np.array([2, 0, 1, 1, 0])
    assert not _shares_slots(every, int(base[-1]))
    assert _shares_slots(np.append(every[:2], every[1]), int(base[-1]))
    assert not _shares_slots(every[:0], int(base[-1]))


@pytest.mark.fuse
def test_retained_files_survive_their_blocks_and_memory_stays_in_budget(packed, tmp_path):
    require(has_fuse(), "needs FUSE")
    dest, src = packed / "p", packed / "src"
    total = json.loads((dest / "blockfs.json").read_text())["file_bytes"]
    budget = total // 4
    names = _names(src)
    planned = json.loads(
        subprocess.run(
            [sys.executable, "-m", "blockfs", "plan", str(dest), "--cache-size", str(budget), "--json"],
            check=True,
            capture_output=True,
            text=True,
        ).stdout
    )
    with PackedDataset(dest) as ds:
        plan, (blocks, slots, _sizes) = plan_dataset(ds.index.arrays, budget)
        a = ds.index.arrays
        retained_keys = set(zip(blocks[plan.retained].tolist(), slots[plan.retained].tolist(), strict=True))
        is_retained = {
            name: (int(a["block"][e]), int(a["slot"][e])) in retained_keys for name in names for e in [ds.lookup(name)]
        }
    assert 0 < sum(is_retained.values()) < len(names)
    # Work on a copy of the blocks: the test destroys them.
    work = tmp_path / "p"
    subprocess.run(["cp", "-r", str(dest), str(work)], check=True)
    with mounted(work, tmp_path / "mnt", "--cache-size", str(budget), "--open-mode", "none") as m:
        for name in names[:20]:
            (m.path / name).read_bytes()
        baseline = m.rss_bytes()
        for epoch in range(2):
            random.Random(epoch).shuffle(names)
            for name in names:
                assert (m.path / name).read_bytes() == (src / name).read_bytes()
        growth = m.rss_bytes() - baseline
        stats = read_stats(m.path)
        # The plan the mount uses is the one `blockfs plan` prints.
        for key in ("budget_bytes", "dataset_bytes", "retained_files", "retained_bytes", "block_cache_bytes"):
            assert stats["plan"][key] == planned[key], key
        r = stats["retained"]
        assert r["retained_files"] == planned["retained_files"] and r["retained_bytes"] == planned["retained_bytes"]
        assert r["retained_hits"] >= planned["retained_files"]  # every target hit in the 2nd epoch
        assert r["storage_bytes_avoided"] >= planned["retained_bytes"]
        # RSS: retained files + block cache (the budget) plus the file buffer and allocator slack.
        assert growth <= budget + (24 << 20), (growth, budget)

        for block in sorted((work / BLOCKS_DIR).iterdir()):
            os.truncate(block, 0)  # root ignores chmod; a truncated block is unreadable for anyone
        failed, still_read = 0, 0
        for name in names:
            if is_retained[name]:
                assert (m.path / name).read_bytes() == (src / name).read_bytes(), name
            else:
                try:
                    still_read += len((m.path / name).read_bytes())
                except OSError as e:
                    assert e.errno == 5, (name, e)  # EIO
                    failed += 1
        # Other files fail unless they are still in a cached block or the small current-file buffer.
        cached = read_stats(m.path)["cache"]["used_bytes"]
        assert still_read <= cached + FILE_BUFFER_BYTES and failed > 0, (still_read, cached, failed)
        assert read_stats(m.path)["retained"]["retained_files"] == planned["retained_files"]  # still up


@pytest.mark.fuse
def test_foreground_mount_with_relative_paths_serves_after_chdir(packed, tmp_path):
    require(has_fuse(), "needs FUSE")
    (tmp_path / "mnt").mkdir()
    log = tmp_path / "mnt.log"
    rel_dest = os.path.relpath(packed / "p", tmp_path)
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "blockfs",
            "mount",
            rel_dest,
            "mnt",
            "--foreground",
            "--log",
            str(log),
            "--cache-size",
            "0",
            "--open-mode",
            "none",
        ],
        cwd=tmp_path,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        from blockfs.serve.daemon import wait_until_mounted

        wait_until_mounted(tmp_path / "mnt", proc, 30, str(log))
        name = _names(packed / "src")[0]
        assert (tmp_path / "mnt" / name).read_bytes() == (packed / "src" / name).read_bytes()
        assert read_stats(tmp_path / "mnt")["mount"]["dest"] == str(packed / "p")
    finally:
        release(tmp_path / "mnt", proc)


@pytest.mark.fuse
def test_preload_when_everything_fits_serves_the_first_epoch_from_memory(packed, tmp_path):
    require(has_fuse(), "needs FUSE")
    dest, src = packed / "p", packed / "src"
    total = json.loads((dest / "blockfs.json").read_text())["file_bytes"]
    with mounted(
        dest, tmp_path / "mnt", "--cache-size", str(2 * total), "--preload", "--no-prefill", "--open-mode", "none"
    ) as m:
        before = read_stats(m.path)
        assert before["plan"]["fits"] and before["retained"] is None
        assert (
            before["cache"]["used_bytes"] == before["dataset"]["block_bytes"]
            or before["counters"]["block_loads"] == before["dataset"]["blocks"]
        )
        for name in _names(src)[:100]:
            (m.path / name).read_bytes()
        after = read_stats(m.path)["counters"]
    assert after["file_hits"] == 100 and after["bytes_from_storage"] == before["counters"]["bytes_from_storage"]


@pytest.mark.fuse
def test_open_mode_targets_keeps_kernel_pages_of_retained_files_only(packed, tmp_path):
    """``--open-mode targets``: the kernel keeps a retained file's pages across opens (a re-read reaches
    no Python ``read``) and drops every other file's pages at open (each re-read reaches the mount)."""
    require(has_fuse(), "needs FUSE")
    dest, src = packed / "p", packed / "src"
    budget = json.loads((dest / "blockfs.json").read_text())["file_bytes"] // 4
    names = _names(src)
    with PackedDataset(dest) as ds:
        plan, (blocks, slots, _sizes) = plan_dataset(ds.index.arrays, budget)
        retained_keys = set(zip(blocks[plan.retained].tolist(), slots[plan.retained].tolist(), strict=True))
        a = ds.index.arrays
        kept = [n for n in names if (int(a["block"][ds.lookup(n)]), int(a["slot"][ds.lookup(n)])) in retained_keys]
    others = sorted(set(names) - set(kept))
    assert kept and others
    with mounted(dest, tmp_path / "mnt", "--cache-size", str(budget), "--open-mode", "targets") as m:
        sample = kept[:10] + others[:10]
        for name in sample:
            assert (m.path / name).read_bytes() == (src / name).read_bytes()

        def requests_to_reread(name: str) -> int:
            before = read_stats(m.path)["requests"].get("read", 0)
            assert (m.path / name).read_bytes() == (src / name).read_bytes()
            return read_stats(m.path)["requests"].get("read", 0) - before

        assert [requests_to_reread(n) for n in kept[:10]] == [0] * 10
        assert all(requests_to_reread(n) >= 1 for n in others[:10])
        assert read_stats(m.path)["mount"]["open_mode"] == "targets"


def test_plan_selection_for_a_million_files_keeps_the_smallest_within_the_budget():
    # How fast this is: tools/bench/bench_plan.py.
    from blockfs.serve.cache.memory_plan import make_memory_plan

    sizes = np.random.default_rng(0).lognormal(11, 1, 1_000_000).astype(np.int64)
    plan = make_memory_plan(sizes, int(sizes.sum()) // 2)
    assert plan.retained_files > 500_000 and int(plan.retained.sum()) == plan.retained_files
    assert int(sizes[plan.retained].sum()) == plan.retained_bytes
    assert plan.retained_bytes + plan.block_cache_bytes <= plan.budget_bytes
    assert sizes[plan.retained].max() <= sizes[~plan.retained].min()  # most files: the smallest ones


@pytest.mark.parametrize("retain", [True, False], ids=["retention", "blocks-only"])
def test_the_plan_holds_its_budget_and_a_later_epoch_reads_only_what_it_does_not_hold(packed, retain):
    """Issue 29, item 10, in-process: with the dataset twice the budget, after one epoch the retained files
    and the cached blocks hold the budget but for less than one block and one file, and the next epoch (a
    new random order) reads from storage exactly the bytes they do not hold — counted by the mount's own
    counters.  (What the disk itself read beyond that was the kernel's readahead: test_store.)"""
    from blockfs.serve.cache.block_cache import BlockCache
    from blockfs.serve.cache.retain import RetainingReader

    dest, src = packed / "p", packed / "src"
    names = _names(src)
    with PackedDataset(dest) as ds:
        total = int(ds.metadata["file_bytes"])
        budget = total // 2
        plan, (blocks, slots, sizes) = plan_dataset(ds.index.arrays, budget, retain=retain)
        cache = BlockCache(ds.store, plan.block_cache_bytes, lock_memory=False, n_files=len(sizes), readahead=0)
        retainer = None
        if plan.retained_files:
            mask = plan.retained
            retainer = RetainingReader(cache, blocks[mask], slots[mask], sizes[mask], lock_memory=False)
        ds = ds.reading_through(retainer if retainer is not None else cache)
        try:
            for epoch in range(2):
                order = names[:]
                random.Random(epoch).shuffle(order)
                before = cache.stats()["counters"]["bytes_from_storage"]
                for name in order:
                    assert ds.read(name) == (src / name).read_bytes()
                fetched = cache.stats()["counters"]["bytes_from_storage"] - before
            held = cache.stats()["cache"]["used_bytes"] + (retainer.stats()["retained_bytes"] if retainer else 0)
            largest_block = int(np.max(ds.index.arrays["block_sizes"]))
            assert held >= budget - largest_block - int(sizes.max()), (held, budget)
            assert fetched <= total - held, (fetched, total, held)  # nothing held is read again
        finally:
            if retainer is not None:
                retainer.close()
            cache.close()


class _Blocks:
    """A stand-in for the block cache: file (block, slot) holds ``size`` bytes of the byte ``block``."""

    def __init__(self, size: int) -> None:
        self.size, self.reads = size, 0

    def read_file(self, block: int, slot: int, crc: int, offset: int = 0, size: int = -1) -> bytes:
        self.reads += 1
        return bytes([block % 256]) * self.size

    def note_hit(self, offset: int, size: int) -> None:
        pass


@pytest.mark.parametrize("counted", [False, True], ids=["widths-from-targets", "widths-from-the-index"])
def test_retained_targets_are_found_by_array_and_cost_no_object_per_file(counted):
    """200,000 targets spread over blocks: the table that finds them is arrays (bytes per target, not a
    dict entry's hundreds), and every target, and only a target, is served from the arena once read.  The
    table's rows per block are each block's slots up to its last target, or the index's block_counts as the
    mount gives them (no pass over the targets to find them)."""
    import tracemalloc

    from blockfs.serve.cache.retain import RetainingReader

    rng = np.random.default_rng(4)
    n_blocks, per_block = 400, 1000
    every = np.arange(n_blocks * per_block)
    chosen = np.sort(rng.choice(every, size=200_000, replace=False))
    blocks, slots = chosen // per_block, chosen % per_block
    cache = _Blocks(3)
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        counts = np.full(n_blocks, per_block) if counted else None
        reader = RetainingReader(
            cache, blocks, slots, np.full(chosen.size, 3), lock_memory=False, slots_per_block=counts
        )  # type: ignore[arg-type]
        held = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    try:
        assert held < 40 * chosen.size, f"{held / chosen.size:.0f} bytes a target"
        assert reader.targets == chosen.size
        target = set(chosen.tolist())
        for key in rng.choice(every, size=2000).tolist() + [n_blocks * per_block + 5]:
            b, s = divmod(key, per_block)
            assert reader.is_target(b, s) == (key in target)
            assert not reader.holds(b, s)
        assert not reader.is_target(-1, 0) and not reader.is_target(0, -1) and not reader.is_target(10**6, 0)
        b, s = int(blocks[7]), int(slots[7])
        assert reader.read_file(b, s, 0) == bytes([b]) * 3 and reader.holds(b, s)
        reads = cache.reads
        assert reader.read_file(b, s, 0, 1, 5) == bytes([b]) * 2 and cache.reads == reads  # from the arena
    finally:
        reader.close()


def test_a_target_past_its_blocks_slots_is_refused():
    from blockfs.serve.cache.retain import RetainingReader

    with pytest.raises(ValueError, match="past its block's slots"):
        RetainingReader(
            _Blocks(3),
            np.array([0, 1]),
            np.array([0, 4]),
            np.array([3, 3]),
            lock_memory=False,
            slots_per_block=np.array([5, 4]),
        )  # type: ignore[arg-type]
