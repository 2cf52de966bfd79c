"""Peers (``--peers``): mounts of one S3 dataset on loopback ports, standing in for the nodes of a job.

One fetch per block for the whole cluster in epoch 1 and none in epoch 2; a peer serving flipped bytes, a
short body, another dataset's block or nothing costs a timeout, then the store, and is avoided; the
endpoint refuses whatever is not a whole block of the mounted dataset asked for with the job's secret; a
peer killed mid-epoch leaves reads going, and is used again once it is back.
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import http.client
import http.server
import json
import os
import signal
import socket
import threading
from collections.abc import Callable
from pathlib import Path

import pytest
from capability import has_fuse, require
from mountutil import mounted, release
from polling import wait_until
from s3server import _free_port
from treeutil import make_class_tree

import blockfs
from blockfs import protocol
from blockfs.cli.mount_commands import _stats_text
from blockfs.client import control_dir, read_stats
from blockfs.core import format as fmt
from blockfs.errors import MountError
from blockfs.serve.mount_options import MountOptions
from blockfs.serve.peers import read_secret
from blockfs.storage.peer_protocol import AUTH_HEADER, block_path
from blockfs.storage.peer_tier import HEAD_BYTES, rendezvous_owners

pytestmark = pytest.mark.fuse
SECRET = "peer-test-secret-7Hq2"


@pytest.fixture(autouse=True)
def _fuse_and_secret(monkeypatch):
    require(has_fuse(), "/dev/fuse")
    monkeypatch.setenv("BLOCKFS_PEER_SECRET", SECRET)  # the mounts' environment (mountutil copies it)
    for name in ("NODE_RANK", "GROUP_RANK", "BLOCKFS_PEERS"):
        monkeypatch.delenv(name, raising=False)


@pytest.fixture(scope="module")
def tree(tmp_path_factory):
    """48 files of 2-6 KiB in blocks of 16 KiB (a dozen blocks), packed locally too (the expected bytes)."""
    root = tmp_path_factory.mktemp("peers")
    make_class_tree(root / "src", 48, seed=32, sizes=(2048, 6144))
    blockfs.pack(root / "src", root / "packed", block_size="16KiB", fsync=False)
    return root


@pytest.fixture
def url(s3, tree):
    url = f"s3://{s3.new_bucket()}/ds"
    blockfs.pack(tree / "src", url, block_size="16KiB", fsync=False)
    return url


def ports(n: int) -> list[str]:
    return [f"127.0.0.1:{_free_port()}" for _ in range(n)]


def read_all(mountpoint: Path, names: list[str], uncached: bool = False) -> dict[str, bytes]:
    """Each file's bytes; ``uncached``: the kernel's pages of it dropped first, so the read reaches the mount."""
    out = {}
    for name in names:
        with open(mountpoint / name, "rb") as f:
            if uncached:
                os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
            out[name] = f.read()
    return out


def expected(tree: Path) -> dict[str, bytes]:
    src = tree / "src"
    return {os.path.relpath(p, src): Path(p).read_bytes() for p in sorted(map(str, src.rglob("*.bin")))}


def owned_blocks(tree: Path, peers: list[str], owner: int) -> list[list[str]]:
    """The files of each block node ``owner`` owns (rendezvous hashing over ``peers``, as every node computes)."""
    with blockfs.open_dataset(tree / "packed") as ds:
        owners = rendezvous_owners(ds.n_blocks, peers)
        return [sorted(os.fsdecode(p) for p in ds.files_in_block(b)) for b in range(ds.n_blocks) if owners[b] == owner]


def drawn_peers(
    tree: Path, enough: Callable[[list[list[str]]], bool], draw: Callable[[], list[str]] = lambda: ports(2)
) -> tuple[list[str], list[list[str]]]:
    """Peer addresses (``draw()``: free ports) under which node 1's blocks (:func:`owned_blocks`) are
    ``enough`` for a test, and those blocks.  Ownership hashes the addresses, ports included, so one draw
    of random ports can leave node 1 too few blocks: draw again (a few tries at most, in practice)."""
    for _ in range(50):
        peers = draw()
        theirs = owned_blocks(tree, peers, 1)
        if enough(theirs):
            return peers, theirs
    raise AssertionError("no draw of ports gave node 1 the blocks the test needs: choose a tree with more blocks")


def peer_args(peers: list[str], rank: int, *extra: str) -> tuple[str, ...]:
    return ("--peers", ",".join(peers), "--peer-rank", str(rank), *extra)


def store_bytes_bound(tree: Path, nodes: int) -> int:
    """The most the store may send ``nodes`` mounts when each block is fetched once for all of them: each
    block's bytes once (its head is fetched once however many threads read its header at once, and a data
    section read after it takes the head's part of it from there), and what opening the dataset costs each
    node."""
    with blockfs.open_dataset(tree / "packed") as ds:
        sizes = [int(n) for n in ds.index.arrays["block_sizes"]]
    opening = sum(os.path.getsize(tree / "packed" / name) for name in (fmt.METADATA_NAME, fmt.INDEX_NAME))
    return sum(sizes) + nodes * opening


def test_three_nodes_fetch_each_block_from_the_store_once_then_never(url, tree, tmp_path):
    want = expected(tree)
    peers = ports(3)
    budget = str(int(sum(len(d) for d in want.values()) * 0.6))  # together 1.8 datasets; alone 0.6 of one
    bound = store_bytes_bound(tree, 3)
    with contextlib.ExitStack() as stack:
        nodes = [
            stack.enter_context(
                mounted(url, tmp_path / f"n{rank}", "--cache-size", budget, "--no-retain", *peer_args(peers, rank))
            )
            for rank in range(3)
        ]
        for m in nodes:  # epoch 1: every node reads every file
            assert read_all(m.path, list(want)) == want
        first = [read_stats(m.path)["storage"] for m in nodes]
        store = sum(s["remote"]["bytes"] for s in first)
        # Every block fetched from the store once for the whole cluster; three nodes alone would fetch it thrice.
        assert store <= bound, (store, bound)
        assert sum(s["peers"]["bytes"] for s in first) > 0
        # Epoch 2, past the kernel's page cache (each file's pages dropped first, so every read reaches the
        # mount): the nodes' memory together holds the dataset, and the store serves no byte of a block.
        served = [read_stats(m.path)["counters"]["bytes_served"] for m in nodes]
        for m in nodes:
            assert read_all(m.path, list(want), uncached=True) == want
        assert all(read_stats(m.path)["counters"]["bytes_served"] > n for m, n in zip(nodes, served, strict=True))
        second = [read_stats(m.path)["storage"] for m in nodes]
        assert [s["remote"]["bytes"] for s in second] == [s["remote"]["bytes"] for s in first]
        assert not any(SECRET in m.log_text() or SECRET in json.dumps(read_stats(m.path)) for m in nodes)


class FakePeer:
    """A peer at ``address`` that answers every block request in one bad way (``mode``): flipped bytes, a
    short body, another dataset's block, nothing (it hangs), another range than the one asked for (headers
    that name the range asked), or the whole block to a request for a range; or flipped bytes only for a
    range longer than any file (a data section: ``flipped_sections``)."""

    def __init__(self, mode: str, blocks: Path, other: Path) -> None:
        self.mode, self.requests, self.ranges, self.stop = mode, 0, 0, threading.Event()
        fake = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def do_GET(self) -> None:  # noqa: N802
                fake.requests += 1
                block = int(self.path.rsplit("/", 1)[1])
                if fake.mode == "hangs":
                    fake.stop.wait(30)
                    return
                data = Path(fmt.block_path(blocks, block)).read_bytes()
                asked = self.headers.get("Range")
                fake.ranges += asked is not None
                lo, hi = 0, len(data)
                if asked is not None:
                    first, last = asked.removeprefix("bytes=").split("-")
                    lo, hi = int(first), int(last) + 1
                start = fmt.decode_header(data, "block").data_start  # every file's bytes flipped, the header not
                flipped = lambda: (data[:start] + bytes(x ^ 1 for x in data[start:]))[lo:hi]  # noqa: E731
                body = {
                    "flipped": flipped,
                    # right for a file's range, flipped for a data section's (longer than any file of the tree)
                    "flipped_sections": lambda: flipped() if hi - lo > 6144 else data[lo:hi],
                    "short": lambda: data[lo:hi][: (hi - lo) // 2],
                    "other": lambda: (
                        Path(fmt.block_path(other, block)).read_bytes()[: len(data)].ljust(len(data), b"\0")[lo:hi]
                    ),
                    "shifted": lambda: (data + data)[lo + 1 : hi + 1],  # one byte on: every file's bytes wrong
                    "whole": lambda: data,
                }[fake.mode]()
                whole = fake.mode == "whole" or (lo, hi) == (0, len(data))
                self.send_response(200 if whole else 206)
                self.send_header("Content-Length", str(len(data) if whole else hi - lo))
                if not whole:
                    self.send_header("Content-Range", f"bytes {lo}-{hi - 1}/{len(data)}")
                self.end_headers()
                self.wfile.write(body)
                self.close_connection = True

            def log_message(self, *args: object) -> None:
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.address = f"127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.stop.set()
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture(scope="module")
def other(tmp_path_factory) -> Path:
    """Another dataset packed alike: its blocks are what a peer serving the wrong dataset sends."""
    root = tmp_path_factory.mktemp("other")
    make_class_tree(root / "src", 48, seed=99, sizes=(2048, 6144))
    blockfs.pack(root / "src", root / "packed", block_size="16KiB", fsync=False)
    return root / "packed"


@pytest.mark.parametrize("mode", ["flipped", "short", "other", "hangs", "shifted", "whole"])
def test_a_bad_peer_costs_a_timeout_then_the_store_and_is_avoided(url, tree, other, tmp_path, mode):
    fake = FakePeer(mode, tree / "packed", other)
    try:
        peers, blocks = drawn_peers(tree, bool, lambda: [ports(1)[0], fake.address])  # the fake owns some
        theirs = sorted(name for files in blocks for name in files)
        want = expected(tree)
        with mounted(
            url,
            tmp_path / "mnt",
            "--cache-size",
            "0",
            *peer_args(peers, 0, "--peer-timeout", "0.5", "--peer-backoff", "60"),
        ) as m:
            assert read_all(m.path, theirs) == {n: want[n] for n in theirs}
            s = read_stats(m.path)["storage"]["peers"]["by_peer"][fake.address]
            failure = "rejected" if mode in ("flipped", "other", "shifted") else "errors"
            assert s["avoided"] and s[failure] >= 1
            asked = fake.requests
            assert 1 <= asked <= 3  # the first fetch (and any in flight beside it), then none
            if mode in ("shifted", "whole"):  # refused: bytes not the range asked for, or the whole block
                assert fake.ranges >= 1
            assert read_all(m.path, list(want)) == want  # every file, the fake's blocks from the store
            assert fake.requests == asked
            assert "avoiding it" in m.log_text() and SECRET not in m.log_text()
    finally:
        fake.close()


def _get(address: str, path: str, secret: str | None = SECRET, headers: dict | None = None) -> tuple[int, bytes]:
    host, port = address.rsplit(":", 1)
    conn = http.client.HTTPConnection(host, int(port), timeout=10)
    try:
        sent = dict(headers or {})
        if secret is not None:
            sent[AUTH_HEADER] = hmac.new(secret.encode(), b"GET " + path.encode(), hashlib.sha256).hexdigest()
        conn.request("GET", path, headers=sent)
        resp = conn.getresponse()
        return resp.status, resp.read()
    finally:
        conn.close()


def test_the_endpoint_serves_only_whole_blocks_of_its_dataset_to_the_job(url, tree, tmp_path):
    peers = ports(2)
    with blockfs.open_dataset(tree / "packed") as ds:
        name, n = ds.digest, ds.n_blocks
    owners = rendezvous_owners(n, peers)
    mine = next(b for b in range(n) if owners[b] == 0)
    theirs = next(b for b in range(n) if owners[b] == 1)
    block = Path(fmt.block_path(tree / "packed", mine)).read_bytes()
    with mounted(url, tmp_path / "mnt", "--cache-size", "0", "--no-prefill", *peer_args(peers, 0)) as m:
        me, path = peers[0], block_path(name, mine)
        assert _get(me, path) == (200, block)  # the owner fetches it, verified, and serves it whole
        assert _get(me, path, headers={"Range": "bytes=10-99"}) == (206, block[10:100])
        refused = {
            "no secret": _get(me, path, secret=None),
            "a wrong secret": _get(me, path, secret="not-the-secret"),
            "another dataset": _get(me, block_path("blake3:" + "ab" * 32, mine)),
            "a path": _get(me, "/blockfs/v1/../../etc/passwd"),
            "a path in the dataset": _get(me, f"/blockfs/v1/{name.removeprefix('blake3:')}/../index.bfi"),
            "a block out of range": _get(me, block_path(name, n)),
            "a negative block": _get(me, block_path(name, -1)),
            "another node's block": _get(me, block_path(name, theirs)),
            "a range past the block": _get(me, path, headers={"Range": f"bytes=0-{len(block)}"}),
            "two ranges": _get(me, path, headers={"Range": "bytes=0-1,5-9"}),
        }
        statuses = {why: status for why, (status, _body) in refused.items()}
        assert statuses == {
            "no secret": 401,
            "a wrong secret": 401,
            "another dataset": 404,
            "a path": 404,
            "a path in the dataset": 404,
            "a block out of range": 404,
            "a negative block": 404,
            "another node's block": 404,
            "a range past the block": 416,
            "two ranges": 416,
        }
        assert not any(block[:64] in body for _status, body in refused.values())
        served = read_stats(m.path)["storage"]["peers"]["served"]
        assert served["refused"] == len(refused) and served["ranges_served"] == 2
        # Memory (--cache-size 0) holds nothing: the block was read through the verifier once, then kept for
        # the range asked for after it (the requests for a block's other files).
        assert served["fetched_for_peers"] == 1
        assert SECRET not in m.log_text()


def test_a_file_of_a_block_another_node_owns_is_asked_for_as_its_range(url, tree, tmp_path):
    peers = ports(2)
    want = expected(tree)
    with blockfs.open_dataset(tree / "packed") as ds:
        owners = rendezvous_owners(ds.n_blocks, peers)
        sizes = ds.index.arrays["block_sizes"]
        block = max((b for b in range(ds.n_blocks) if owners[b] == 1), key=lambda b: int(sizes[b]))
        size, name = int(sizes[block]), min((os.fsdecode(p) for p in ds.files_in_block(block)), key=len)
    assert HEAD_BYTES + len(want[name]) < size, "choose a tree whose blocks hold more than a head and a file"
    with (
        mounted(url, tmp_path / "b", "--cache-size", "0", *peer_args(peers, 1)),
        mounted(url, tmp_path / "a", "--cache-size", "0", *peer_args(peers, 0)) as a,
    ):
        assert read_all(a.path, [name]) == {name: want[name]}
        got = read_stats(a.path)["storage"]["peers"]["by_peer"][peers[1]]
        # Its header (in the first HEAD_BYTES) and the file's own bytes: not the block.
        assert 0 < got["bytes"] <= HEAD_BYTES + len(want[name]), (got, size)


def test_a_peer_killed_mid_epoch_then_back_is_used_again(url, tree, tmp_path):
    peers, theirs = drawn_peers(tree, lambda blocks: len(blocks) >= 3)  # node 1's blocks, each a list of its files
    want = expected(tree)
    args = ("--cache-size", "0", "--peer-timeout", "0.5", "--peer-backoff", "0.2")
    with mounted(url, tmp_path / "a", *peer_args(peers, 0, *args)) as a:

        def from_b() -> int:
            return read_stats(a.path)["storage"]["peers"]["by_peer"][peers[1]]["fetches"]

        with mounted(url, tmp_path / "b", *peer_args(peers, 1, *args)) as b:
            assert read_all(a.path, theirs[0]) == {n: want[n] for n in theirs[0]}
            assert from_b() >= 1
            b.proc.send_signal(signal.SIGKILL)  # gone mid-epoch
            b.proc.wait(10)
            release(b.path)
            before = from_b()
            ours = [n for n in want if not any(n in files for files in theirs)]
            rest = ours + theirs[1]  # reads go on: node 0's blocks, and one of node 1's from the store
            assert read_all(a.path, rest) == {n: want[n] for n in rest}
            assert from_b() == before
        with mounted(url, tmp_path / "b2", *peer_args(peers, 1, *args)):  # back, on the same address
            # Each read a file of another block of node 1's: it is asked again once the backoff has ended.
            fresh = iter(name for files in theirs[2:] for name in files)

            def asked_again() -> bool:
                name = next(fresh)
                assert read_all(a.path, [name]) == {name: want[name]}
                return from_b() > before

            wait_until(asked_again, what="node 1 to be asked again", timeout=30)


def test_the_secret_file_must_be_the_users_alone(tmp_path):
    path = tmp_path / "secret"
    path.write_text("s3cr3t\n")
    path.chmod(0o644)
    with pytest.raises(MountError, match="no one else may read"):
        read_secret(os.fspath(path))
    path.chmod(0o600)
    assert read_secret(os.fspath(path)) == b"s3cr3t"
    (tmp_path / "link").symlink_to(path)
    with pytest.raises(MountError, match="link"):
        read_secret(os.fspath(tmp_path / "link"))
    assert "s3cr3t" not in repr(MountOptions(cache_bytes=0, peer_secret_file=os.fspath(path)))


def test_plan_says_what_the_nodes_hold_together_and_what_the_store_serves(tree):
    import subprocess
    import sys

    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "blockfs",
            "plan",
            os.fspath(tree / "packed"),
            "--cache-size",
            "1MiB",
            "--no-retain",
            "--peers",
            "a:1,b:1,c:1",
        ],
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0, done.stderr
    line = next(t for t in done.stdout.splitlines() if t.startswith("peers:"))
    assert "3 nodes hold" in line and "(100%)" in line and "0 B per epoch after" in line, line


@pytest.fixture(scope="module")
def small_files(tmp_path_factory):
    """240 files of 300-900 bytes in blocks of 16 KiB (about 27 files a block), packed locally too."""
    root = tmp_path_factory.mktemp("small")
    make_class_tree(root / "src", 240, seed=7, sizes=(300, 900))
    blockfs.pack(root / "src", root / "packed", block_size="16KiB", fsync=False)
    return root


def window_budget(tree: Path, peers: list[str], rank: int, blocks: int) -> tuple[int, int]:
    """A budget that holds node ``rank``'s own blocks and ``blocks`` of the largest besides (the window), and
    that largest block's size."""
    with blockfs.open_dataset(tree / "packed") as ds:
        sizes = [int(n) for n in ds.index.arrays["block_sizes"]]
        owners = rendezvous_owners(ds.n_blocks, peers)
    return sum(n for b, n in enumerate(sizes) if owners[b] == rank) + blocks * max(sizes), max(sizes)


def test_a_block_another_node_owns_is_fetched_whole_once_for_the_reads_that_follow(s3, small_files, tmp_path):
    url = f"s3://{s3.new_bucket()}/ds"
    blockfs.pack(small_files / "src", url, block_size="16KiB", fsync=False)
    # Node 1 owns three blocks or more, of ten files or more (about one draw of ports in ten gives fewer).
    peers, theirs = drawn_peers(small_files, lambda blocks: len(blocks) >= 3 and min(map(len, blocks)) >= 10)
    want = expected(small_files)
    budget, largest = window_budget(small_files, peers, 0, 2)  # a window of two blocks
    with (
        mounted(url, tmp_path / "b", "--cache-size", str(10 * budget), "--no-retain", *peer_args(peers, 1)),
        # Node a loads nothing of its own accord (no prefill, no read-ahead): the store bytes compared below
        # move only with its reads (its prefill of its own blocks, still running, once moved them).
        mounted(
            url,
            tmp_path / "a",
            "--cache-size",
            str(budget),
            "--no-retain",
            "--no-prefill",
            "--readahead",
            "0",
            *peer_args(peers, 0),
        ) as a,
    ):
        for files in theirs:  # node 1's blocks one after another, each one's files in turn (a block-shuffled order)
            assert read_all(a.path, files) == {n: want[n] for n in files}
        stats = read_stats(a.path)
        got = stats["storage"]["peers"]["by_peer"][peers[1]]
        # Per block: its head, its first file alone, then its data section whole: never a request a file.
        assert got["fetches"] <= 3 * len(theirs), (got, len(theirs))
        window = stats["cache"]["window"]
        assert stats["counters"]["window_loads"] >= len(theirs)
        # Bounded: two blocks at most, and the window and the cache's own budget together within --cache-size.
        assert window["capacity_bytes"] == 2 * largest
        assert window["held_bytes"] <= window["capacity_bytes"] and window["blocks"] <= 2
        assert stats["cache"]["budget_bytes"] + window["capacity_bytes"] <= budget
        assert "\nwindow " in _stats_text(stats, None, 1.0)  # blockfs stats shows it
        # Read again (past the kernel's pages): still right, and from the window or a peer, never the store.
        store = stats["storage"]["remote"]["bytes"]
        for files in theirs:
            assert read_all(a.path, files, uncached=True) == {n: want[n] for n in files}
        assert read_stats(a.path)["storage"]["remote"]["bytes"] == store


def test_a_peers_data_section_that_fails_its_check_is_dropped_and_read_from_the_store(s3, small_files, other, tmp_path):
    url = f"s3://{s3.new_bucket()}/ds"
    blockfs.pack(small_files / "src", url, block_size="16KiB", fsync=False)
    fake = FakePeer("flipped_sections", small_files / "packed", other)
    try:
        peers, theirs = drawn_peers(small_files, bool, lambda: [ports(1)[0], fake.address])  # the fake owns some
        want = expected(small_files)
        budget, _largest = window_budget(small_files, peers, 0, 2)
        args = ("--cache-size", str(budget), "--no-retain", "--peer-timeout", "0.5", "--peer-backoff", "60")
        with mounted(url, tmp_path / "mnt", *peer_args(peers, 0, *args)) as m:
            for files in theirs:
                assert read_all(m.path, files) == {n: want[n] for n in files}
            s = read_stats(m.path)
            got = s["storage"]["peers"]["by_peer"][fake.address]
            assert got["rejected"] >= 1 and got["avoided"]  # the data section failed its check: dropped
            assert s["counters"]["window_loads"] >= 1  # and the window read the store's block instead
            assert "avoiding it" in m.log_text()
    finally:
        fake.close()


def announce(mountpoint: Path, blocks: list[int]) -> None:
    """What blockfs's loader does at an epoch's start: the blocks it reads next, to the mount's prefetch socket."""
    address = os.getxattr(control_dir(mountpoint), protocol.PREFETCH_XATTR)
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as channel:
        channel.connect(address)
        channel.sendall(protocol.encode_announcement(blocks))


def node_blocks(tree: Path, peers: list[str], owner: int) -> list[int]:
    """The blocks node ``owner`` owns (rendezvous hashing over ``peers``)."""
    with blockfs.open_dataset(tree / "packed") as ds:
        return [b for b, o in enumerate(rendezvous_owners(ds.n_blocks, peers)) if o == owner]


def test_an_announced_block_another_node_owns_is_fetched_whole_before_its_reads(s3, small_files, tmp_path):
    url = f"s3://{s3.new_bucket()}/ds"
    blockfs.pack(small_files / "src", url, block_size="16KiB", fsync=False)
    peers, theirs = drawn_peers(small_files, lambda blocks: len(blocks) >= 3)
    blocks, theirs = node_blocks(small_files, peers, 1)[:3], theirs[:3]
    want = expected(small_files)
    budget, _largest = window_budget(small_files, peers, 0, 3)  # a window of three blocks
    quiet = ("--no-retain", "--no-prefill", "--readahead", "0")  # node a loads only what is announced or read
    with (
        mounted(url, tmp_path / "b", "--cache-size", str(10 * budget), "--no-retain", *peer_args(peers, 1)),
        mounted(url, tmp_path / "a", "--cache-size", str(budget), *quiet, *peer_args(peers, 0)) as a,
    ):
        announce(a.path, blocks)
        wait_until(lambda: read_stats(a.path)["counters"]["window_loads"] == 3, what="node 1's blocks fetched ahead")
        before = read_stats(a.path)
        asked = before["storage"]["peers"]["by_peer"][peers[1]]["fetches"]
        assert before["counters"]["file_reads"] == 0 and before["counters"]["files_served"] == 0  # before any read
        for files in theirs:
            assert read_all(a.path, files) == {n: want[n] for n in files}
        after = read_stats(a.path)
        assert after["storage"]["peers"]["by_peer"][peers[1]]["fetches"] == asked  # no request for any file
        assert after["counters"]["file_reads"] == 0 and after["counters"]["window_loads"] == 3  # each block once
        assert after["counters"]["window_ahead_loads"] == 3 and "3 of them ahead" in _stats_text(after, None, 1.0)


def test_an_announced_data_section_that_fails_its_check_is_dropped_and_read_from_the_store(
    s3, small_files, other, tmp_path
):
    url = f"s3://{s3.new_bucket()}/ds"
    blockfs.pack(small_files / "src", url, block_size="16KiB", fsync=False)
    fake = FakePeer("flipped_sections", small_files / "packed", other)
    try:
        peers, theirs = drawn_peers(small_files, bool, lambda: [ports(1)[0], fake.address])  # the fake owns some
        blocks = node_blocks(small_files, peers, 1)[:2]
        want = expected(small_files)
        budget, _largest = window_budget(small_files, peers, 0, 2)
        args = ("--cache-size", str(budget), "--no-retain", "--no-prefill", "--readahead", "0")
        args += ("--peer-timeout", "0.5", "--peer-backoff", "60")
        with mounted(url, tmp_path / "mnt", *peer_args(peers, 0, *args)) as m:
            announce(m.path, blocks)

            def fetched() -> dict:
                s = read_stats(m.path)
                got = s["storage"]["peers"]["by_peer"][fake.address]
                return s if got["rejected"] >= 1 and s["counters"]["window_ahead_loads"] >= 1 else {}

            # The fake's bytes failed their check, were dropped and the fake avoided; the store's section held
            # instead (a block whose header came from the fake first is left for its reads).
            s = wait_until(fetched, what="a forged section refused and the store's fetched ahead")
            assert s["storage"]["peers"]["by_peer"][fake.address]["avoided"]
            assert s["counters"]["files_served"] == 0  # all before any read
            for files in theirs[: len(blocks)]:
                assert read_all(m.path, files) == {n: want[n] for n in files}
            assert "avoiding it" in m.log_text()
    finally:
        fake.close()
