"""One contract suite over every ``BlockFiles`` (local files, ranged GETs from S3 and from HTTP, the disk
tier in front of S3, empty and holding copies, and the peer tier in front of S3, with a peer that owns
every block), as ``test_policies`` runs one over every policy.

Each implementation holds the same packed dataset; every test asks the same questions of each: exact bytes
at any range, the error for a read past the end, a missing block or a block number that is not one,
``version`` across a replacement, the copy hooks, ``stats`` and ``close``, and reads from many threads.
The servers are the suite's real ones on loopback (moto for S3, ``httpserver`` for HTTP).
"""

from __future__ import annotations

import contextlib
import errno
import http.server
import importlib.util
import json
import os
import random
import shutil
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import pytest
from capability import require
from s3server import ACCESS_KEY, REGION, SECRET

import blockfs
from blockfs.core import format as fmt
from blockfs.storage.blockfiles import BlockFiles, LocalBlockFiles
from blockfs.storage.remote_blocks import HEAD_BYTES as HEAD  # reads below it come from a block's kept head

MiB = 1 << 20
PART = 300_000  # the remote's part size: a read_into bigger than it is several parallel GETs
PLAIN = ["local", "s3", "http"]
TIERED = ["tiered-cold", "tiered-warm"]
KINDS = PLAIN + TIERED + ["peered"]
TIER_KEY = "0123456789abcdef0123"
# What `blockfs stats` prints from stats.json's storage section (cli/mount_commands.py).
REMOTE_KEYS = {"requests", "bytes", "retries", "failures"}
TIER_KEYS = {
    "used",
    "budget",
    "blocks",
    "disk_reads",
    "disk_bytes",
    "remote_reads",
    "remote_bytes",
    "copies_written",
    "copies_dropped",
}


@pytest.fixture(scope="module")
def packed(tmp_path_factory) -> tuple[Path, list[bytes]]:
    """A dataset of two blocks of a few MiB (so ranges cross 1 MiB and the remote's parts), and their bytes."""
    root = tmp_path_factory.mktemp("contract")
    rng = random.Random(24)
    for i in range(11):
        path = root / "src" / f"c{i % 2}" / f"f{i:02d}.bin"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(rng.randbytes(rng.randint(350_000, 450_000)))
    blockfs.pack(root / "src", root / "packed", block_size="3MiB", fsync=False)
    n = len(os.listdir(root / "packed" / fmt.BLOCKS_DIR))
    blocks = [Path(fmt.block_path(root / "packed", b)).read_bytes() for b in range(n)]
    assert n >= 2 and all(len(data) > MiB + HEAD for data in blocks), [len(d) for d in blocks]
    return root / "packed", blocks


@pytest.fixture(scope="module")
def www(tmp_path_factory):
    """One HTTP server with byte ranges for the module (each test serves its own directory under it)."""
    require(importlib.util.find_spec("obstore") is not None, "obstore (pip install -e '.[test]')")
    from httpserver import serving

    root = tmp_path_factory.mktemp("www")
    with serving(root) as (base, _faults):
        yield root, base


@contextlib.contextmanager
def block_peer(blocks: list[bytes]):
    """A peer on loopback that owns ``blocks`` and serves each whole or the one range asked for (the peer
    protocol, no checks of its own: the contract is about the chain's bytes); yields its address."""

    class Handler(http.server.BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def do_GET(self) -> None:  # noqa: N802
            data = blocks[int(self.path.rsplit("/", 1)[1])]
            asked = self.headers.get("Range")
            lo, hi = (0, len(data)) if asked is None else (int(x) for x in asked.removeprefix("bytes=").split("-"))
            hi += asked is not None  # bytes=a-b names its last byte
            self.send_response(200 if asked is None else 206)
            self.send_header("Content-Length", str(hi - lo))
            if asked is not None:
                self.send_header("Content-Range", f"bytes {lo}-{hi - 1}/{len(data)}")
            self.end_headers()
            self.wfile.write(data[lo:hi])

        def log_message(self, *args: object) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield f"127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


@dataclass
class Impl:
    """One implementation under test, and how to change what it reads from behind its back."""

    kind: str
    files: BlockFiles
    blocks: list[bytes]  # what each block file holds (the tests' expectation)
    replace: Callable[[int, bytes], None]  # put other bytes where block b lives (a new file or object)
    remove: Callable[[int], None]  # delete block b where it lives (a tier's copy is left alone)
    sizes_from_index: bool  # size() is the index's (remote): it sends no request, even for a missing block

    @property
    def tiered(self) -> bool:
        return self.kind in TIERED


def _replace_file(path: Path, data: bytes) -> None:
    """A new file renamed over the old one, as a repack or restore would put it (a new inode)."""
    tmp = path.with_name(path.name + ".new")
    tmp.write_bytes(data)
    os.replace(tmp, path)


def _copy_blocks(packed: Path, to: Path) -> list[Path]:
    shutil.copytree(packed / fmt.BLOCKS_DIR, to / fmt.BLOCKS_DIR)
    return [Path(fmt.block_path(to, b)) for b in range(len(os.listdir(to / fmt.BLOCKS_DIR)))]


def _remote_files(url: str, options: dict, n: int, sizes: list[int]):
    from blockfs.storage.remote import RemoteStore
    from blockfs.storage.remote_blocks import RemoteBlockFiles

    # A request past an object's end must fail at once: a retried one would hold a test for this long.
    store = RemoteStore(url, {**options, "part_size": PART, "concurrency": 4, "retry_timeout": 10})
    return RemoteBlockFiles(store, [fmt.block_path("", b) for b in range(n)], sizes)


@pytest.fixture(params=KINDS)
def impl(request, packed, tmp_path):
    """Each implementation over its own copy of the dataset (tests replace and delete blocks), closed after."""
    source, blocks = packed
    blocks = list(blocks)
    n, sizes = len(blocks), [len(data) for data in blocks]
    kind = request.param
    closers: list[Callable[[], None]] = []
    if kind == "local":
        paths = _copy_blocks(source, tmp_path / "local")
        files = LocalBlockFiles([os.fspath(p) for p in paths])
        made = Impl(
            kind,
            files,
            blocks,
            lambda b, data: _replace_file(paths[b], data),
            lambda b: paths[b].unlink(),
            sizes_from_index=False,
        )
    elif kind == "http":
        root, base = request.getfixturevalue("www")
        mine = tmp_path.name  # a directory of this test's own under the served root
        paths = _copy_blocks(source, root / mine)
        files = _remote_files(f"{base}/{mine}", {}, n, sizes)
        made = Impl(
            kind,
            files,
            blocks,
            lambda b, data: _replace_file(paths[b], data),
            lambda b: paths[b].unlink(),
            sizes_from_index=True,
        )
    else:
        s3 = request.getfixturevalue("s3")
        bucket = s3.new_bucket()
        client = s3.client()
        keys = [f"ds/{fmt.block_path('', b)}" for b in range(n)]
        for key, data in zip(keys, blocks, strict=True):
            client.put_object(Bucket=bucket, Key=key, Body=data)
        url = f"s3://{bucket}/ds"
        options = {"endpoint": s3.endpoint, "access_key_id": ACCESS_KEY, "secret_access_key": SECRET, "region": REGION}
        files = _remote_files(url, options, n, sizes)
        if kind in TIERED:
            from blockfs.storage.disk_tier import DiskTier
            from blockfs.storage.tiered import TieredBlockFiles

            tier = DiskTier(tmp_path / "disk", 1 << 30, TIER_KEY, url)
            closers.append(tier.close)  # the dataset's location owns the tier, not the files
            files = TieredBlockFiles(files, tier)
            if kind == "tiered-warm":
                for b, data in enumerate(blocks):  # as the store hands over a block verified whole
                    assert files.wants_copy(b)
                    files.keep_copy(b, data[:100], memoryview(data)[100:])
                    assert tier.has(b) and not files.wants_copy(b)
        if kind == "peered":
            from blockfs.storage.chain import TierChain
            from blockfs.storage.peer_tier import PeerOptions, PeerTier

            address = request.getfixturevalue("peer_address")
            # A peer that owns every block, avoided for the test's length once its bytes fail a check.
            peers = PeerTier(PeerOptions(("127.0.0.1:1", address), 0, b"secret", backoff=600), "ab" * 32, sizes)
            peers.set_owners([1] * n)
            files = TierChain([peers], files)
        made = Impl(
            kind,
            files,
            blocks,
            lambda b, data: client.put_object(Bucket=bucket, Key=keys[b], Body=data),
            lambda b: client.delete_object(Bucket=bucket, Key=keys[b]),
            sizes_from_index=True,
        )
    try:
        yield made
    finally:
        made.files.close()
        for close in closers:
            close()


@pytest.fixture
def peer_address(packed):
    with block_peer(packed[1]) as address:
        yield address


plain = pytest.mark.parametrize("impl", PLAIN, indirect=True)
tiered = pytest.mark.parametrize("impl", TIERED, indirect=True)


def ranges(size: int, seed: int) -> list[tuple[int, int]]:
    """(offset, length) pairs: the start, the middle, the end, across the remote's head, across 1 MiB, zero
    lengths, and fixed random ones."""
    fixed = [
        (0, 12),
        (0, HEAD),
        (HEAD - 10, 20),
        (size // 2, 4096),
        (size - 7, 7),
        (MiB - 100, 200),
        (MiB - 5000, 2 * 5000 + PART),
        (0, 0),
        (size // 2, 0),
        (size, 0),
        (0, size),
    ]
    rng = random.Random(seed)
    drawn = []
    for _ in range(12):
        offset = rng.randrange(size)
        drawn.append((offset, rng.randint(0, min(size - offset, 2 * PART))))
    return fixed + drawn


def reads_right(files: BlockFiles, block: int, data: bytes, offset: int, length: int) -> None:
    """pread and read_into of ``length`` bytes at ``offset`` both return the file's bytes there."""
    want = data[offset : offset + length]
    got = files.pread(block, length, offset)
    assert isinstance(got, bytes) and got == want, (block, offset, length)
    out = bytearray(b"\xa5" * length)
    assert files.read_into(block, memoryview(out), offset) is None
    assert out == want, (block, offset, length)


def test_size_is_the_block_files_size(impl):
    assert [impl.files.size(b) for b in range(len(impl.blocks))] == [len(data) for data in impl.blocks]
    assert len(impl.files.names) == len(impl.blocks)


def test_reads_return_exactly_the_files_bytes_at_any_range(impl):
    for b, data in enumerate(impl.blocks):
        for offset, length in ranges(len(data), seed=b):
            reads_right(impl.files, b, data, offset, length)


def test_a_read_past_the_end_or_at_a_negative_offset_fails_with_oserror_and_harms_nothing(impl):
    files, data = impl.files, impl.blocks[0]
    size = len(data)
    retries = files.stats().get("remote", {}).get("retries", 0)
    for offset, length in ((size - 5, 10), (size, 1), (size + 1000, 10), (0, size + 1)):
        with pytest.raises(OSError) as raised:
            files.pread(0, length, offset)
        assert raised.value.errno == errno.EIO, (offset, length, raised.value)
        with pytest.raises(OSError) as raised:
            files.read_into(0, memoryview(bytearray(length)), offset)
        assert raised.value.errno == errno.EIO, (offset, length, raised.value)
    for offset, length in ((-1, 10), (-HEAD, HEAD + 1), (0, -1)):
        with pytest.raises(OSError) as raised:
            files.pread(0, length, offset)
        assert raised.value.errno == errno.EINVAL, (offset, length, raised.value)
    with pytest.raises(OSError) as raised:
        files.read_into(0, memoryview(bytearray(10)), -1)
    assert raised.value.errno == errno.EINVAL, raised.value
    # A request that cannot succeed is not retried, and a tier does not blame its copy for the caller's range.
    assert files.stats().get("remote", {}).get("retries", 0) == retries
    if impl.kind == "tiered-warm":
        assert files.stats()["disk_tier"]["copies_dropped"] == 0 and not files.wants_copy(0)
    reads_right(files, 0, data, size - 100, 100)


@pytest.mark.parametrize("block", ["n", -1, "-n-1"])
def test_a_number_that_is_not_a_block_is_an_index_error(impl, block):
    """A caller's mistake, not a failed read (an OSError would be retried): and -1 is not the last block."""
    n = len(impl.blocks)
    block = {"n": n, "-n-1": -n - 1}.get(block, block)
    with pytest.raises(IndexError):
        impl.files.size(block)
    with pytest.raises(IndexError):
        impl.files.pread(block, 10, 0)
    with pytest.raises(IndexError):
        impl.files.read_into(block, memoryview(bytearray(10)), 0)
    with pytest.raises(IndexError):
        impl.files.version(block)


def test_a_missing_block_fails_with_enoent_and_has_no_version(impl):
    files, data = impl.files, impl.blocks[1]
    reads_right(files, 1, data, 0, 12)  # a descriptor, a kept head: state the missing block must not outlive
    impl.remove(1)
    files.discard(1)
    files.drop_copy(1)  # what the store does when a read fails its check (the tier's copy goes)
    for offset, length in ((0, 12), (MiB, 4096)):
        with pytest.raises(OSError) as raised:
            files.pread(1, length, offset)
        assert raised.value.errno == errno.ENOENT, raised.value
        with pytest.raises(OSError) as raised:
            files.read_into(1, memoryview(bytearray(length)), offset)
        assert raised.value.errno == errno.ENOENT, raised.value
    if impl.sizes_from_index:
        assert files.size(1) == len(data)  # no request for a size: the index knows it
    else:
        with pytest.raises(OSError) as raised:
            files.size(1)
        assert raised.value.errno == errno.ENOENT
    assert files.version(1) is None
    reads_right(files, 0, impl.blocks[0], MiB - 100, 200)  # the other block is untouched


def test_version_is_stable_and_a_replaced_block_is_read_anew_after_discard(impl):
    files, old = impl.files, impl.blocks[0]
    first = files.version(0)
    assert first is not None and hash(first) is not None
    reads_right(files, 0, old, 0, 12)
    reads_right(files, 0, old, MiB, 4096)
    assert files.version(0) == first and files.version(1) != first
    new = bytes(x ^ 0x5A for x in old)  # the same size: only the identity tells it apart
    impl.replace(0, new)
    assert files.version(0) != first
    files.discard(0)
    files.drop_copy(0)  # the store's answer to a failed check: a tier's copy is not the block
    for offset, length in ((0, 12), (HEAD - 10, 20), (MiB - 100, 200), (0, len(new))):
        reads_right(files, 0, new, offset, length)
    again = files.version(0)
    assert again is not None and files.version(0) == again != first


@plain
def test_the_copy_hooks_do_nothing_without_a_tier(impl):
    files, data = impl.files, impl.blocks[0]
    assert files.keeps_copies is False
    assert not any(files.wants_copy(b) for b in range(len(impl.blocks)))
    files.keep_copy(0, b"not the header", memoryview(b"nor the data"))
    reads_right(files, 0, data, 0, 4096)
    assert files.drop_copy(0) is False
    files.refuse_copy(0)
    files.allow_copy(0)
    assert files.wants_copy(0) is False
    reads_right(files, 0, data, 0, 4096)


@tiered
def test_the_tier_keeps_refuses_allows_and_drops_copies(impl):
    files, data = impl.files, impl.blocks[0]
    assert files.keeps_copies is True
    if impl.kind == "tiered-warm":
        assert not files.wants_copy(0)  # it holds one: never replaced (cache-once)
        assert files.drop_copy(0) is True
    assert files.drop_copy(0) is False  # none left
    assert files.wants_copy(0)
    files.refuse_copy(0)  # a damaged block: no whole fetch for a copy
    assert not files.wants_copy(0)
    files.allow_copy(0)  # replaced since
    assert files.wants_copy(0)

    files.keep_copy(0, data[:64], memoryview(data)[64:])
    assert not files.wants_copy(0)
    before = files.stats()
    reads_right(files, 0, data, 0, len(data))
    after = files.stats()
    assert after["remote"]["requests"] == before["remote"]["requests"]  # served by the copy
    assert after["disk_tier"]["disk_reads"] >= before["disk_tier"]["disk_reads"] + 2

    impl.replace(0, bytes(len(data)))  # the copy is trusted until a check fails ...
    files.discard(0)
    reads_right(files, 0, data, 0, 4096)
    assert files.drop_copy(0) is True  # ... then the remote's block is read
    reads_right(files, 0, bytes(len(data)), 0, 4096)
    assert files.stats()["disk_tier"]["copies_dropped"] >= 1


def test_stats_hold_the_documented_counters_and_count_reads(impl):
    files = impl.files
    before = files.stats()
    json.dumps(before)  # it becomes stats.json
    if impl.kind == "local":
        assert before == {}
        return
    assert REMOTE_KEYS <= before["remote"].keys()
    assert all(isinstance(before["remote"][k], int) for k in REMOTE_KEYS)
    assert ("disk_tier" in before) == impl.tiered
    if impl.tiered:
        assert TIER_KEYS <= before["disk_tier"].keys()
    reads_right(files, 1, impl.blocks[1], MiB, 4096)
    after = files.stats()
    if impl.kind == "tiered-warm":
        assert after["disk_tier"]["disk_reads"] >= before["disk_tier"]["disk_reads"] + 2
        assert after["remote"]["requests"] == before["remote"]["requests"]
    elif impl.kind == "peered":  # from its owner exactly the ranges read (pread, read_into), never the block
        assert after["peers"]["bytes"] == before["peers"]["bytes"] + 2 * 4096
        assert after["remote"]["requests"] == before["remote"]["requests"]
    else:
        assert after["remote"]["requests"] >= before["remote"]["requests"] + 2
        assert after["remote"]["bytes"] >= before["remote"]["bytes"] + 2 * 4096
    if impl.kind == "tiered-cold":
        assert after["disk_tier"]["remote_reads"] >= before["disk_tier"]["remote_reads"] + 2


def test_close_is_idempotent_and_a_later_read_opens_what_it_needs_again(impl):
    files, data = impl.files, impl.blocks[0]
    reads_right(files, 0, data, 0, len(data))  # descriptors, heads, the remote's part pool
    files.close()
    files.close()
    reads_right(files, 0, data, MiB - 100, 200)
    reads_right(files, 0, data, 0, len(data))
    files.close()  # and again by the fixture


def test_concurrent_reads_and_discards_return_the_right_bytes(impl):
    """Threads read random ranges of both blocks at once, some first forgetting the block's descriptor or
    head as a failed read would (a descriptor is closed only once no read uses it)."""
    files, blocks = impl.files, impl.blocks
    threads = 6
    start = threading.Barrier(threads, timeout=30)

    def reader(seed: int) -> int:
        rng = random.Random(seed)
        start.wait()
        for _ in range(16):
            b = rng.randrange(len(blocks))
            if rng.random() < 0.25:
                files.discard(b)
            offset = rng.randrange(len(blocks[b]))
            length = rng.randint(0, min(len(blocks[b]) - offset, 2 * PART + 1))
            reads_right(files, b, blocks[b], offset, length)
        return seed

    with ThreadPoolExecutor(threads) as pool:
        done = [pool.submit(reader, seed) for seed in range(threads)]
        assert sorted(f.result(timeout=120) for f in done) == list(range(threads))
