"""A packed dataset in an S3-compatible store (moto on loopback), read without mounting: the same bytes as
the local pack, the disk tier kept across opens, damage and failed reads kept apart on every tier."""

from __future__ import annotations

import errno
import os
import random

import pytest
from s3server import SECRET, upload_tree

import blockfs
from blockfs.core import format as fmt
from blockfs.errors import BlockReadError, CorruptBlockError, NotADatasetError

FILES = 240


@pytest.fixture(scope="module")
def local_pack(tmp_path_factory):
    root = tmp_path_factory.mktemp("remote-src")
    rng = random.Random(5)
    contents = {}
    for i in range(FILES):
        rel = f"class{i % 3}/f{i:04d}.bin"
        data = rng.randbytes(rng.randint(50, 6000))
        os.makedirs(root / "src" / f"class{i % 3}", exist_ok=True)
        (root / "src" / rel).write_bytes(data)
        contents[rel] = data
    blockfs.pack(root / "src", root / "packed", files_per_block=40, fsync=False)
    return root / "packed", contents


@pytest.fixture
def url(s3, local_pack):
    """A fresh bucket holding the pack under ``ds/``."""
    bucket = s3.new_bucket()
    upload_tree(s3, bucket, "ds", local_pack[0])
    return f"s3://{bucket}/ds"


def read_all(ds, contents) -> None:
    for rel, data in contents.items():
        assert ds.read(rel) == data, rel


def remote_counts(ds) -> dict:
    return ds.store.files.stats()["remote"]


def test_a_remote_dataset_reads_exactly_the_local_bytes(url, local_pack):
    _, contents = local_pack
    with blockfs.open_dataset(url) as ds:
        assert ds.location == url and ds.is_remote
        assert sorted(ds.listdir("")) == ["class0", "class1", "class2"]
        read_all(ds, contents)
        counts = remote_counts(ds)
        root = ds.root
    assert counts["failures"] == 0 and counts["requests"] > 0
    assert not os.path.exists(root)  # the private copy of the index is gone at close


def test_file_reads_fetch_about_the_bytes_they_serve(url, local_pack):
    """Without a tier, a file is one ranged GET of its bytes: remote bytes stay near the bytes served."""
    _, contents = local_pack
    with blockfs.open_dataset(url) as ds:
        before = remote_counts(ds)["bytes"]
        read_all(ds, contents)
        fetched = remote_counts(ds)["bytes"] - before
        heads = sum(min(64 << 10, int(n)) for n in ds.index.arrays["block_sizes"])
    served = sum(len(d) for d in contents.values())
    assert fetched <= 1.1 * served + heads, (fetched, served, heads)


def test_the_disk_tier_is_kept_across_opens_and_serves_with_no_block_gets(url, local_pack, tmp_path):
    _, contents = local_pack
    cache = tmp_path / "disk"
    with blockfs.open_dataset(url, disk_cache=cache, disk_cache_size=1 << 30) as ds:
        read_all(ds, contents)
        tier = ds.store.files.stats()["disk_tier"]
        assert tier["blocks"] == ds.n_blocks and tier["copies_written"] == ds.n_blocks
    with blockfs.open_dataset(url, disk_cache=cache, disk_cache_size=1 << 30) as ds:
        read_all(ds, contents)
        counts = remote_counts(ds)
        tier = ds.store.files.stats()["disk_tier"]
    meta_size = os.path.getsize(local_pack[0] / fmt.METADATA_NAME)
    assert counts["requests"] == 1 and counts["bytes"] == meta_size, counts  # the metadata only: no index, no block
    assert tier["remote_reads"] == 0 and tier["disk_reads"] > 0
    names = os.listdir(cache)
    assert len(names) == 1 and sorted(os.listdir(cache / names[0] / "blocks"))[0] == "00000000.blk"
    assert not any(".tmp" in n for n in os.listdir(cache / names[0] / "blocks"))


def test_the_disk_tier_keeps_only_what_its_budget_holds(url, local_pack, tmp_path):
    _, contents = local_pack
    packed, _ = local_pack
    one_block = os.path.getsize(fmt.block_path(packed, 0))
    index_bytes = os.path.getsize(packed / fmt.INDEX_NAME) + os.path.getsize(packed / fmt.METADATA_NAME)
    budget = index_bytes + 2 * one_block + 10
    with blockfs.open_dataset(url, disk_cache=tmp_path / "d", disk_cache_size=budget) as ds:
        read_all(ds, contents)
        read_all(ds, contents)
        tier = ds.store.files.stats()["disk_tier"]
    assert tier["used"] <= budget and 1 <= tier["blocks"] <= 2


def test_a_damaged_copy_on_disk_is_dropped_and_read_from_the_remote(url, local_pack, tmp_path):
    _, contents = local_pack
    cache = tmp_path / "disk"
    with blockfs.open_dataset(url, disk_cache=cache, disk_cache_size=1 << 30) as ds:
        read_all(ds, contents)
        copy = ds.disk_tier.path(1)
    with open(copy, "r+b") as f:
        f.seek(os.path.getsize(copy) - 7)
        f.write(b"\xffBROKEN")
    with blockfs.open_dataset(url, disk_cache=cache, disk_cache_size=1 << 30) as ds:
        read_all(ds, contents)
        tier = ds.store.files.stats()["disk_tier"]
        assert tier["copies_dropped"] == 1 and tier["remote_reads"] >= 1
        read_all(ds, contents)


def test_a_damaged_object_fails_its_files_only_and_is_kept_in_no_tier(s3, url, local_pack, tmp_path):
    _, contents = local_pack
    bucket, prefix = url[5:].split("/", 1)
    key = f"{prefix}/blocks/00000002.blk"
    body = bytearray(s3.client().get_object(Bucket=bucket, Key=key)["Body"].read())
    body[-3] ^= 0xFF
    s3.client().put_object(Bucket=bucket, Key=key, Body=bytes(body))
    with blockfs.open_dataset(url, disk_cache=tmp_path / "d", disk_cache_size=1 << 30) as ds:
        damaged = {os.fsdecode(p) for p in ds.files_in_block(2)}
        failed = set()
        for rel, data in contents.items():
            try:
                assert ds.read(rel) == data
            except CorruptBlockError:
                failed.add(rel)
        assert failed and failed <= damaged
        assert not ds.disk_tier.has(2) and ds.disk_tier.has(1)


def test_a_missing_object_is_a_failed_read_not_damage(s3, url, local_pack):
    _, contents = local_pack
    bucket, prefix = url[5:].split("/", 1)
    key = f"{prefix}/blocks/00000003.blk"
    body = s3.client().get_object(Bucket=bucket, Key=key)["Body"].read()
    s3.client().delete_object(Bucket=bucket, Key=key)
    with blockfs.open_dataset(url) as ds:
        name = sorted(os.fsdecode(p) for p in ds.files_in_block(3))[0]
        with pytest.raises(BlockReadError) as raised:
            ds.read(name)
        assert not isinstance(raised.value, CorruptBlockError) and raised.value.errno == errno.EIO
        assert "blocks/00000003.blk" in str(raised.value) and SECRET not in str(raised.value)
        s3.client().put_object(Bucket=bucket, Key=key, Body=body)
        assert ds.read(name) == contents[name]


def test_a_url_that_holds_no_dataset_says_so(s3):
    bucket = s3.new_bucket()
    with pytest.raises(NotADatasetError, match="not a packed dataset"):
        blockfs.open_dataset(f"s3://{bucket}/nothing")
    s3.client().put_object(Bucket=bucket, Key="half/.blockfs-packing", Body=b"")
    with pytest.raises(NotADatasetError, match="unfinished pack"):
        blockfs.open_dataset(f"s3://{bucket}/half")


def test_a_repacked_url_never_meets_the_old_copies(s3, local_pack, tmp_path):
    packed, contents = local_pack
    bucket = s3.new_bucket()
    url = f"s3://{bucket}/ds"
    upload_tree(s3, bucket, "ds", packed)
    cache = tmp_path / "disk"
    with blockfs.open_dataset(url, disk_cache=cache, disk_cache_size=1 << 30) as ds:
        ds.read(sorted(contents)[0])
        old_root = ds.disk_tier.root
    other = tmp_path / "other"
    blockfs.pack(packed.parent / "src", other, files_per_block=40, seed=9, fsync=False)
    upload_tree(s3, bucket, "ds", other)
    with blockfs.open_dataset(url, disk_cache=cache, disk_cache_size=1 << 30) as ds:
        assert ds.disk_tier.root != old_root and not os.path.exists(old_root)
        read_all(ds, contents)


def test_announced_blocks_memory_will_not_hold_are_fetched_into_the_disk_tier(url, tmp_path):
    from polling import wait_until

    from blockfs.serve.cache.block_cache import BlockCache

    with blockfs.open_dataset(url, disk_cache=tmp_path / "d", disk_cache_size=1 << 30) as ds:
        cache = BlockCache(ds.store, 0, "cache-once", readahead=0, lock_memory=False, n_files=10, share=False)
        try:
            announced = [4, 1, 3]
            cache.prefetch(announced)
            wait_until(lambda: all(ds.disk_tier.has(b) for b in announced), what="announced blocks on disk")
            assert not ds.disk_tier.has(0) and not ds.disk_tier.has(2)
            assert cache.stats()["counters"]["disk_copies_ahead"] == 3
        finally:
            cache.close()


def _cache_blocks(ds, budget: int, blocks: list[int], policy: str = "cache-once"):
    """A memory cache of ``budget`` bytes over ``ds`` that has read one file of each of ``blocks``."""
    from blockfs.serve.cache.block_cache import BlockCache

    cache = BlockCache(ds.store, budget, policy, readahead=0, lock_memory=False, n_files=FILES, share=False)
    a = ds.index.arrays
    for b in blocks:
        entry = int(a["block_files"][int(a["block_offsets"][b])])
        cache.read_file(b, int(a["slot"][entry]), int(a["crc"][entry]))
    return cache


def test_a_disk_tier_smaller_than_the_dataset_keeps_only_blocks_memory_does_not_hold(url, local_pack, tmp_path):
    biggest = max(os.path.getsize(p) for p in (local_pack[0] / "blocks").iterdir())
    with blockfs.open_dataset(url, disk_cache=tmp_path / "d", disk_cache_size=5 * biggest // 2) as ds:
        assert not ds.store.files.copies_memory_blocks  # room for two of the six blocks
        memory = 2 * biggest
        cache = _cache_blocks(ds, memory, [0, 1, 2, 3])
        try:
            held = [b for b in range(4) if b in cache._blocks]
            assert held == [0, 1]  # memory took the first two, cache-once
            # The tier holds what memory does not: together they hold more than either alone.
            assert not ds.disk_tier.has(0) and not ds.disk_tier.has(1)
            assert ds.disk_tier.has(2) and ds.disk_tier.has(3)
        finally:
            cache.close()


def test_a_small_disk_tier_still_copies_blocks_an_evicting_memory_policy_may_drop(url, local_pack, tmp_path):
    biggest = max(os.path.getsize(p) for p in (local_pack[0] / "blocks").iterdir())
    with blockfs.open_dataset(url, disk_cache=tmp_path / "d", disk_cache_size=5 * biggest // 2) as ds:
        assert not ds.store.files.copies_memory_blocks
        cache = _cache_blocks(ds, 2 * biggest, [0, 1], policy="lru")
        try:
            assert 0 in cache._blocks and 1 in cache._blocks
            assert ds.disk_tier.has(0) and ds.disk_tier.has(1)  # LRU may evict them: the tier keeps them
        finally:
            cache.close()


def test_a_disk_tier_that_holds_the_dataset_copies_memory_blocks_too_so_a_reopen_reads_nothing_remote(
    url, local_pack, tmp_path
):
    cache_dir = tmp_path / "d"
    with blockfs.open_dataset(url, disk_cache=cache_dir, disk_cache_size=1 << 30) as ds:
        assert ds.store.files.copies_memory_blocks
        cache = _cache_blocks(ds, 1 << 30, list(range(ds.n_blocks)))
        cache.close()
        assert all(ds.disk_tier.has(b) for b in range(ds.n_blocks))
    with blockfs.open_dataset(url, disk_cache=cache_dir, disk_cache_size=1 << 30) as ds:
        read_all(ds, local_pack[1])
        assert ds.store.files.stats()["disk_tier"]["remote_reads"] == 0


@pytest.fixture(scope="module")
def big_blocks(tmp_path_factory):
    """Blocks well over a ranged read's head (64 KiB), so a server ignoring Range cannot pass unseen."""
    root = tmp_path_factory.mktemp("http-src")
    rng = random.Random(8)
    contents = {}
    for i in range(60):
        rel = f"c{i % 2}/f{i:02d}.bin"
        os.makedirs(root / "src" / f"c{i % 2}", exist_ok=True)
        contents[rel] = rng.randbytes(rng.randint(10_000, 30_000))
        (root / "src" / rel).write_bytes(contents[rel])
    blockfs.pack(root / "src", root / "packed", files_per_block=20, fsync=False)
    return root / "packed", contents


def test_an_http_url_reads_the_dataset(big_blocks):
    from httpserver import serving

    packed, contents = big_blocks
    with serving(packed) as (base, _faults), blockfs.open_dataset(base + "/") as ds:
        read_all(ds, contents)


def test_an_http_server_that_ignores_range_gives_a_clear_error_never_wrong_bytes(big_blocks):
    from httpserver import serving

    packed, contents = big_blocks
    with serving(packed) as (base, faults), blockfs.open_dataset(base + "/") as ds:
        faults.ignore_range = True
        errors = []
        for rel, data in contents.items():
            try:
                assert ds.read(rel) == data, rel  # whatever is served is right
            except BlockReadError as e:
                errors.append(str(e))
        assert errors and all("ignored the byte range" in e for e in errors), errors[:3]


def test_a_copy_a_crash_left_half_written_is_removed_at_open(url, local_pack, tmp_path):
    _, contents = local_pack
    cache = tmp_path / "disk"
    with blockfs.open_dataset(url, disk_cache=cache, disk_cache_size=1 << 30) as ds:
        blocks = os.path.dirname(ds.disk_tier.path(0))
    half = os.path.join(blocks, "00000000.blk.tmp-123-456")
    with open(half, "wb") as f:
        f.write(b"half a block")
    with blockfs.open_dataset(url, disk_cache=cache, disk_cache_size=1 << 30) as ds:
        assert not os.path.exists(half) and not ds.disk_tier.has(0)
        read_all(ds, contents)


def test_a_disk_cache_for_a_local_dataset_is_refused(local_pack, tmp_path):
    from blockfs.storage.remote import RemoteConfigError

    with pytest.raises(RemoteConfigError, match="local"):
        blockfs.open_dataset(local_pack[0], disk_cache=tmp_path / "d", disk_cache_size=1 << 20)
