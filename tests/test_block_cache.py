"""blockfs.serve.cache.block_cache: what the block cache promises, checked in-process (no FUSE).

(That cached blocks live in anonymous memory is checked in test_block_memory.py.)"""

from __future__ import annotations

import ctypes
import errno
import logging
import os
import random
import threading

import pytest
from polling import wait_until

import blockfs
from blockfs.core import format as fmt
from blockfs.core.dataset import PackedDataset
from blockfs.errors import BlockReadError, CorruptBlockError
from blockfs.serve.cache.block_cache import BlockCache
from blockfs.serve.cache.policies import POLICIES
from blockfs.serve.cache.uncached import FILE_BUFFER_FILES


def _tree(root, files=240, seed=0, sizes=(1000, 5000)) -> dict[str, bytes]:
    rng = random.Random(seed)
    contents = {}
    for i in range(files):
        rel = f"c{i % 3}/f{i:04d}.bin"
        data = rng.randbytes(rng.randint(*sizes))
        path = os.path.join(root, rel)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "wb") as f:
            f.write(data)
        contents[rel] = data
    return contents


@pytest.fixture(scope="module")
def packed(tmp_path_factory):
    root = tmp_path_factory.mktemp("cache")
    contents = _tree(root / "src")
    blockfs.pack(root / "src", root / "p", block_size=64 << 10, fsync=False)
    return root / "p", contents


def open_cached(dest, budget: int, policy: str = "cache-once", **kw) -> tuple[PackedDataset, BlockCache]:
    ds = PackedDataset(dest)
    cache = BlockCache(ds.store, budget, policy, n_files=int(ds.metadata["n_files"]), **kw)
    return ds.reading_through(cache), cache


def dataset_bytes(ds: PackedDataset) -> int:
    return int(ds.metadata["file_bytes"])


def measure(dest) -> tuple[int, list[int]]:
    """The dataset's file bytes and each block's data size, for choosing a budget."""
    with PackedDataset(dest) as ds:
        return dataset_bytes(ds), [ds.store.header(b).data_size for b in range(ds.n_blocks)]


def block_order(ds: PackedDataset) -> list[bytes]:
    return [p for b in range(ds.n_blocks) for p in ds.files_in_block(b)]


@pytest.mark.parametrize("policy", sorted(POLICIES))
def test_every_policy_serves_every_byte(packed, policy):
    dest, contents = packed
    budget = measure(dest)[0] // 3
    ds, cache = open_cached(dest, budget, policy)
    try:
        names = list(contents)
        for epoch in range(2):
            random.Random(epoch).shuffle(names)
            for name in names:
                assert ds.read(name) == contents[name]
        assert cache.stats()["cache"]["used_bytes"] <= budget
    finally:
        cache.close()


def test_concurrent_misses_of_one_block_read_it_once(packed):
    dest, contents = packed
    ds, cache = open_cached(dest, 1 << 30, readahead=0)
    files = ds.files_in_block(0)
    barrier = threading.Barrier(len(files))
    results = {}

    def read(path: bytes) -> None:
        barrier.wait()
        results[path] = ds.read(path)

    threads = [threading.Thread(target=read, args=(p,)) for p in files]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    cache.close()
    assert all(results[p] == contents[os.fsdecode(p)] for p in files)
    c = cache.stats()["counters"]
    assert c["block_loads"] == 1
    assert c["block_bytes_read"] == ds.store.header(0).data_size


@pytest.mark.parametrize("order", ["random", "block"])
def test_storage_reads_stay_within_the_bytes_not_served_from_memory(packed, order):
    dest, contents = packed
    total = measure(dest)[0]
    ds, cache = open_cached(dest, total // 2)
    try:
        names = [os.fsencode(n) for n in contents] if order == "random" else block_order(ds)
        before = 0
        for epoch in range(3):
            if order == "random":
                random.Random(epoch).shuffle(names)
            served_from_memory = 0
            hits_before = cache.stats()["counters"]["file_hits"]
            for name in names:
                stats_before = cache.stats()["counters"]["block_hits"]
                data = ds.read(name)
                if cache.stats()["counters"]["block_hits"] > stats_before:
                    served_from_memory += len(data)
            c = cache.stats()["counters"]
            storage = c["bytes_from_storage"] - before
            before = c["bytes_from_storage"]
            if epoch > 0:  # the first epoch also fills the cache (those bytes are served from memory later)
                assert storage <= 1.1 * (total - served_from_memory), (epoch, storage, total, served_from_memory)
                hit_rate = (c["file_hits"] - hits_before) / len(names)
                assert hit_rate == pytest.approx(0.5, abs=0.1)
    finally:
        cache.close()


def test_a_refused_block_is_never_read_whole(packed):
    dest, contents = packed
    ds, cache = open_cached(dest, 0)  # cache-once with no room: every block is refused
    try:
        for name in list(contents)[:50]:
            assert ds.read(name) == contents[name]
        c = cache.stats()["counters"]
        assert c["block_loads"] == 0
        assert c["file_bytes_read"] == sum(len(contents[n]) for n in list(contents)[:50])
    finally:
        cache.close()


def test_reads_in_block_order_load_the_next_blocks_ahead(packed):
    dest, contents = packed
    ds, cache = open_cached(dest, 1 << 30, readahead=2)
    try:
        for block in range(3):  # three blocks in order...
            for name in ds.files_in_block(block):
                assert ds.read(name) == contents[os.fsdecode(name)]
        wait_until(lambda: {3, 4} <= set(cache._blocks), "read-ahead to load blocks 3 and 4")
        assert {3, 4} <= set(cache._blocks) and 5 not in cache._blocks  # ...and the next two arrive unasked
        assert cache.stats()["counters"]["readahead_loads"] == 2
        for name in block_order(ds):
            assert ds.read(name) == contents[os.fsdecode(name)]
        c = cache.stats()["counters"]
        assert c["block_loads"] == ds.n_blocks  # every block read once, ahead or not
    finally:
        cache.close()


def test_random_order_does_not_read_ahead(packed):
    dest, contents = packed
    ds, cache = open_cached(dest, 1 << 30, readahead=2)
    try:
        names = sorted(contents)
        random.Random(5).shuffle(names)
        for name in names:
            ds.read(name)
        c = cache.stats()["counters"]
        assert c["readahead_loads"] <= 2 and c["block_loads"] == ds.n_blocks
    finally:
        cache.close()


def test_a_file_read_in_pieces_is_read_from_storage_once(tmp_path):
    data = os.urandom(700_000)
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "big.bin").write_bytes(data)
    (tmp_path / "src" / "small.bin").write_bytes(b"x")
    blockfs.pack(tmp_path / "src", tmp_path / "p", fsync=False)
    ds, cache = open_cached(tmp_path / "p", 0)
    try:
        piece = 128 << 10
        got = b"".join(ds.read("big.bin", off, piece) for off in range(0, len(data), piece))
        assert got == data
        c = cache.stats()["counters"]
        assert c["file_reads"] == 1 and c["file_bytes_read"] == len(data)
        assert c["buffer_hits"] == -(-len(data) // piece) - 1
    finally:
        cache.close()


def test_the_file_buffer_holds_current_files_not_the_last_epoch(packed):
    """Files read alone in pieces are buffered while being read; the buffer must not become a cache of
    the last files read (with small files, 16 MiB of them would hit across epochs, outside the budget)."""
    dest, contents = packed
    ds, cache = open_cached(dest, 0)
    try:
        names = sorted(contents)[: FILE_BUFFER_FILES * 4]
        for name in names:
            assert ds.read(name, 0, 100) + ds.read(name, 100) == contents[name]  # two requests, as FUSE sends
        c = cache.stats()["counters"]
        assert c["buffer_hits"] == len(names) and c["file_reads"] == len(names)
        for name in names[: FILE_BUFFER_FILES * 2]:  # read again, oldest first: all long gone
            ds.read(name, 100)
        assert cache.stats()["counters"]["file_reads"] == len(names) + FILE_BUFFER_FILES * 2
    finally:
        cache.close()


def _corrupt_one_file(ds: PackedDataset, block: int) -> bytes:
    """Flip a byte inside the first file of ``block``; return that file's path."""
    head = ds.store.header(block)
    pos = head.data_start + int(head.offsets[0]) + 1
    with open(ds.store.block_paths[block], "r+b") as f:
        f.seek(pos)
        byte = f.read(1)
        f.seek(pos)
        f.write(bytes([byte[0] ^ 0xFF]))
    return ds.files_in_block(block)[0]


@pytest.mark.parametrize("budget", [0, 1 << 30])
def test_a_damaged_block_fails_only_its_damaged_file(tmp_path, budget):
    contents = _tree(tmp_path / "src", files=60)
    blockfs.pack(tmp_path / "src", tmp_path / "p", block_size=64 << 10, fsync=False)
    with PackedDataset(tmp_path / "p") as plain:
        bad = _corrupt_one_file(plain, 1)
    ds, cache = open_cached(tmp_path / "p", budget)
    try:
        with pytest.raises(CorruptBlockError) as raised:
            ds.read(bad)
        assert raised.value.errno == errno.EIO and raised.value.block == 1
        for name, data in contents.items():
            if os.fsencode(name) != bad:
                assert ds.read(name) == data
        if budget:
            assert cache.stats()["counters"]["damaged_blocks"] == 1
            assert 1 not in cache._blocks
    finally:
        cache.close()


def test_lru_evicts_and_stays_within_budget(packed):
    dest, contents = packed
    sizes = measure(dest)[1]
    ds, cache = open_cached(dest, max(sizes) * 2, "lru", readahead=0)
    try:
        for name in block_order(ds):
            assert ds.read(name) == contents[os.fsdecode(name)]
        s = cache.stats()
        assert s["cache"]["evictions"] == ds.n_blocks - s["cache"]["cached_blocks"] > 0
        assert s["cache"]["used_bytes"] <= max(sizes) * 2
    finally:
        cache.close()


def test_when_mlock_is_refused_one_warning_and_reads_go_on(packed, caplog):
    dest, contents = packed
    ds, cache = open_cached(dest, 1 << 30)

    def refuse(address, length):
        ctypes.set_errno(errno.ENOMEM)
        return -1

    cache._memory.memlock._mlock = refuse
    try:
        with caplog.at_level(logging.WARNING, logger="blockfs.serve.cache.block_memory"):
            for name, data in contents.items():
                assert ds.read(name) == data
        warnings = [r for r in caplog.records if "cannot pin" in r.getMessage()]
        assert len(warnings) == 1 and "ENOMEM" in warnings[0].getMessage()
        s = cache.stats()["cache"]
        assert s["locked_bytes"] == 0 and s["cached_blocks"] == ds.n_blocks
        assert "ENOMEM" in s["mlock"]
    finally:
        cache.close()


def test_epochs_are_cut_by_the_file_count(packed):
    dest, contents = packed
    ds, cache = open_cached(dest, 1 << 30)
    try:
        for _ in range(3):
            for name in contents:
                ds.read(name)
        epochs = cache.stats()["epochs"]
        assert [e["files"] for e in epochs] == [len(contents)] * 3
        assert epochs[1]["hit_rate"] == epochs[2]["hit_rate"] == 1.0
        assert 0 < epochs[0]["hit_rate"] < 1
    finally:
        cache.close()


def test_prefill_loads_what_fits_in_order_without_any_read(packed):
    dest, contents = packed
    sizes = measure(dest)[1]
    budget = sum(sizes[:3]) + sizes[3] // 2  # room for three blocks and a half
    ds, cache = open_cached(dest, budget)
    try:
        cache.start_prefill()
        # A load is counted when it starts: wait for the blocks themselves, not for the counter.
        wait_until(lambda: {0, 1, 2} <= set(cache._blocks), "prefill to load blocks 0, 1 and 2")
        s = cache.stats()
        assert s["counters"]["reads"] == 0 and s["counters"]["prefill_loads"] >= 3
        assert {0, 1, 2} <= set(cache._blocks) and s["cache"]["used_bytes"] <= budget
        for name, data in contents.items():
            assert ds.read(name) == data
        assert cache.stats()["cache"]["evictions"] == 0
    finally:
        cache.close()


# --- foreign blocks, damaged headers and failed reads ---------------------------------------------------
def _copy_pack(packed, tmp_path):
    import shutil

    dest, contents = packed
    shutil.copytree(dest, tmp_path / "p")
    return tmp_path / "p", contents


def test_a_block_from_another_pack_is_never_cached_or_served(tmp_path):
    """Issue 17's reproduction: the same tree packed with another seed; one of its blocks copied in."""
    contents = _tree(tmp_path / "src", files=400)
    for name, seed in (("A", 0), ("B", 1)):
        blockfs.pack(tmp_path / "src", tmp_path / name, files_per_block=100, seed=seed, fsync=False)
    (tmp_path / "A" / "blocks" / "00000000.blk").write_bytes((tmp_path / "B" / "blocks" / "00000000.blk").read_bytes())
    ds, cache = open_cached(tmp_path / "A", 1 << 30)
    try:
        foreign = {os.fsdecode(p) for p in ds.files_in_block(0)}
        for _ in range(2):
            for name, data in contents.items():
                if name in foreign:
                    with pytest.raises(CorruptBlockError, match="does not belong to this dataset"):
                        ds.read(name)
                else:
                    assert ds.read(name) == data
        c = cache.stats()["counters"]
        assert 0 not in cache._blocks and c["damaged_blocks"] == 1 and c["block_loads"] == ds.n_blocks - 1
    finally:
        cache.close()


def test_a_header_claiming_billions_of_files_is_one_damaged_block(packed, tmp_path):
    dest, contents = _copy_pack(packed, tmp_path)
    with open(fmt.block_path(dest, 2), "r+b") as f:
        f.seek(fmt.PREAMBLE_SIZE)
        f.write((2**32 - 2).to_bytes(4, "little"))
    ds, cache = open_cached(dest, 1 << 30)
    try:
        bad = {os.fsdecode(p) for p in ds.files_in_block(2)}
        for name in sorted(bad) * 2:
            with pytest.raises(CorruptBlockError, match="damaged header") as raised:
                ds.read(name)
            assert raised.value.block == 2
        c = cache.stats()["counters"]
        assert c["damaged_blocks"] == 1 and c["block_loads"] == 0
    finally:
        cache.close()


def test_a_block_file_gone_during_reads_fails_them_and_is_read_once_back(packed, tmp_path):
    """A failed read is not damage: nothing is remembered, and the restored block is cached as usual."""
    dest, contents = _copy_pack(packed, tmp_path)
    path = fmt.block_path(dest, 1)
    ds, cache = open_cached(dest, 1 << 30, readahead=0)
    try:
        names = [os.fsdecode(p) for p in ds.files_in_block(1)]
        os.rename(path, path + ".away")
        for name in names[:3]:
            with pytest.raises(BlockReadError) as raised:
                ds.read(name)
            assert raised.value.errno == errno.EIO and not isinstance(raised.value, CorruptBlockError)
        os.rename(path + ".away", path)
        for name in names:
            assert ds.read(name) == contents[name]
        c = cache.stats()["counters"]
        assert c["damaged_blocks"] == 0 and c["read_errors"] == 3 and 1 in cache._blocks
        assert c["block_loads"] == 1 and c["file_reads"] == 0  # the whole block, once: not file by file
    finally:
        cache.close()


def test_an_io_error_while_loading_fails_that_read_and_the_next_read_loads_the_block(packed, monkeypatch):
    dest, contents = packed
    ds, cache = open_cached(dest, 1 << 30, readahead=0)
    real = os.preadv
    failures = []

    def preadv(fd, buffers, offset):
        if not failures:
            failures.append(offset)
            raise OSError(errno.EIO, os.strerror(errno.EIO))
        return real(fd, buffers, offset)

    monkeypatch.setattr(os, "preadv", preadv)
    try:
        name = os.fsdecode(ds.files_in_block(0)[0])
        with pytest.raises(BlockReadError, match="Input/output error"):
            ds.read(name)
        assert ds.read(name) == contents[name]
        c = cache.stats()["counters"]
        assert failures and c["load_errors"] == 1 and c["damaged_blocks"] == 0 and c["block_loads"] == 1
        assert 0 in cache._blocks and cache.stats()["cache"]["used_bytes"] == ds.store.header(0).data_size
    finally:
        cache.close()


def test_out_of_descriptors_fails_one_read_and_the_next_succeeds(packed, tmp_path, monkeypatch):
    dest, contents = _copy_pack(packed, tmp_path)
    real_open = os.open
    refused = []

    def open_(path, flags, *args, **kw):
        if not refused and os.fsdecode(path).endswith(".blk"):
            refused.append(path)  # once: the first block file opened
            raise OSError(errno.EMFILE, os.strerror(errno.EMFILE), path)
        return real_open(path, flags, *args, **kw)

    monkeypatch.setattr(os, "open", open_)
    ds, cache = open_cached(dest, 1 << 30, readahead=0)
    try:
        name = os.fsdecode(ds.files_in_block(0)[0])
        with pytest.raises(BlockReadError, match="Too many open files"):
            ds.read(name)
        for name in map(os.fsdecode, ds.files_in_block(0)):
            assert ds.read(name) == contents[name]
        assert refused and cache.stats()["counters"]["damaged_blocks"] == 0 and 0 in cache._blocks
    finally:
        cache.close()


def test_a_block_found_damaged_while_claiming_ahead_is_declined(packed, monkeypatch):
    # claim_ahead looks for damage outside the lock; a reader's failed load may mark the block damaged
    # before the claim takes the lock, and the claim then has no load to run.
    dest, _ = packed
    ds, cache = open_cached(dest, 1 << 30, readahead=0)
    looked = cache._damaged.is_damaged

    def look_then_found_damaged(block):
        answer = looked(block)
        cache._damaged.mark(block)  # what the reader that failed does, between the look and the lock
        return answer

    monkeypatch.setattr(cache._damaged, "is_damaged", look_then_found_damaged)
    try:
        assert cache.load_ahead(0, "prefill_loads", fill_only=False) is None
        assert 0 not in cache._blocks and 0 not in cache._loading and cache.stats()["cache"]["used_bytes"] == 0
    finally:
        cache.close()


def test_a_damaged_block_replaced_after_its_last_read_is_loaded_with_no_read_after(packed, tmp_path):
    """Issue 29, item 9: the reads that follow a replacement may never come (the kernel keeps the pages of
    files read alone), so a read of a damaged block has its version looked at again once the recheck
    interval has passed, and the replaced block is loaded and cached then, with no further read."""
    dest, contents = _copy_pack(packed, tmp_path)
    path = fmt.block_path(dest, 1)
    whole = open(path, "rb").read()
    os.truncate(path, len(whole) // 2)  # as a copy in progress leaves it
    ds, cache = open_cached(dest, 1 << 30, readahead=0)
    try:
        names = [os.fsdecode(p) for p in ds.files_in_block(1)]
        with pytest.raises(CorruptBlockError):
            ds.read(names[0])
        with open(path + ".partial", "wb") as f:
            f.write(whole)
        os.rename(path + ".partial", path)  # what rsync and cp + mv do
        assert ds.read(names[1]) == contents[names[1]]  # right at once, read alone (within the interval)
        wait_until(lambda: cache.holds(1), "the replaced block to be loaded with no further read")
        c = cache.stats()["counters"]
        assert c["replaced_loads"] == 1 and c["damaged_blocks"] == 1
        assert all(ds.read(name) == contents[name] for name in names)
    finally:
        cache.close()
