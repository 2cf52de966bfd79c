"""blockfs.serve.kernelfs: the kernel-protocol route — what the kernel is sent, counted by the server.

These tests check mechanisms, not speed: a listed file is never looked up, a file whose block is loaded is
never read through the server (its pages were pushed), files are right whatever the kernel keeps or drops.
Counts are read with the stats xattr (a GETXATTR: it moves neither the lookup nor the read count), from
a mount only this test reads.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

import blockfs
from blockfs import cli, protocol
from blockfs.client import control_dir
from capability import has_fuse, require
from treeutil import make_class_tree
from mountutil import mounted
from polling import wait_until

pytestmark = pytest.mark.fuse


@pytest.fixture(scope="module")
def packed(tmp_path_factory) -> tuple[Path, Path]:
    require(has_fuse(), "/dev/fuse")
    root = tmp_path_factory.mktemp("kfs")
    make_class_tree(root / "src", files=300, seed=3, sizes=(1, 40_000))
    blockfs.pack(root / "src", root / "packed", block_size=256 << 10, fsync=False)  # ~20 blocks
    return root / "src", root / "packed"


def stats(mnt: Path) -> dict:
    return json.loads(os.getxattr(control_dir(mnt), protocol.STATS_XATTR))


def requests(mnt: Path) -> dict:
    return stats(mnt)["requests"]


def walk(root: Path) -> list[str]:
    return sorted(os.path.relpath(os.path.join(d, f), root) for d, _, fs in os.walk(root) for f in fs)


def same_bytes(mnt: Path, src: Path, names: list[str]) -> None:
    for name in names:
        assert (mnt / name).read_bytes() == (src / name).read_bytes(), name


def test_after_a_listing_no_lookup_and_no_read_reaches_the_server(packed, tmp_path):
    src, dest = packed
    with mounted(dest, tmp_path / "mnt", binding="kernel") as m:
        n_blocks = stats(m.path)["dataset"]["blocks"]
        wait_until(lambda: stats(m.path)["cache"]["cached_blocks"] == n_blocks, "prefill to load every block")
        names = walk(m.path)  # READDIRPLUS: the kernel learns every node with its attributes
        assert names == walk(src)
        wait_until(lambda: stats(m.path)["page_cache"]["files_pushed"] == len(names), "every listed file pushed")
        before = requests(m.path)
        same_bytes(m.path, src, names)
        after = requests(m.path)
        assert after.get("lookup", 0) == before.get("lookup", 0)
        assert after.get("read", 0) == before.get("read", 0)
        assert after.get("readdirplus", 0) > 0 and "readdir" not in after
        assert after.get("open", 0) <= 1 and after.get("opendir", 0) <= 1  # ENOSYS once, then never sent


def test_a_file_whose_block_is_not_loaded_is_read_through_the_server(packed, tmp_path):
    src, dest = packed
    with mounted(dest, tmp_path / "mnt", "--no-prefill", binding="kernel") as m:
        names = walk(src)
        same_bytes(m.path, src, names)  # looked up by path: no listing, every block loaded on its first miss
        s = stats(m.path)
        assert s["requests"]["read"] > 0 and s["requests"]["lookup"] >= len(names)
        assert s["counters"]["block_loads"] == s["dataset"]["blocks"]


def test_pushes_to_nodes_the_kernel_never_learned_are_skipped_without_error(packed, tmp_path):
    src, dest = packed
    with mounted(dest, tmp_path / "mnt", binding="kernel") as m:
        n_blocks = stats(m.path)["dataset"]["blocks"]
        wait_until(lambda: stats(m.path)["cache"]["cached_blocks"] == n_blocks, "prefill to load every block")
        assert stats(m.path)["page_cache"]["files_pushed"] == 0  # no node known: nothing pushed, nothing failed
        name = walk(src)[7]
        assert (m.path / name).read_bytes() == (src / name).read_bytes()
        assert stats(m.path)["page_cache"]["push_errors"] == 0


def test_files_read_right_after_the_kernel_drops_their_pages(packed, tmp_path):
    src, dest = packed
    with mounted(dest, tmp_path / "mnt", binding="kernel") as m:
        n_blocks = stats(m.path)["dataset"]["blocks"]
        wait_until(lambda: stats(m.path)["cache"]["cached_blocks"] == n_blocks, "prefill to load every block")
        names = walk(m.path)
        wait_until(lambda: stats(m.path)["page_cache"]["files_pushed"] == len(names), "every listed file pushed")
        reads = requests(m.path).get("read", 0)
        for name in names:  # drop every page the push put there
            fd = os.open(m.path / name, os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)
        same_bytes(m.path, src, names)
        assert requests(m.path).get("read", 0) > reads  # the pages were gone: the server answered again


@pytest.mark.parametrize("policy", ["cache-once", "lru", "none"])
def test_every_policy_serves_every_file_right_on_the_kernel_route(packed, tmp_path, policy):
    src, dest = packed
    size = sum((src / n).stat().st_size for n in walk(src))
    with mounted(dest, tmp_path / "mnt", "--policy", policy, "--cache-size", str(size // 3), "--no-retain",
                 binding="kernel") as m:  # fmt: skip
        names = walk(m.path)
        assert names == walk(src)
        same_bytes(m.path, src, names[::-1])
        assert stats(m.path)["mount"]["binding"] == "kernel"


def test_the_kernel_route_refuses_a_libfuse_only_option_in_one_line(packed, tmp_path):
    _, dest = packed
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    done = cli.main(["mount", str(dest), str(mnt), "--fuse", "kernel", "-o", "max_threads=4", "--foreground"])
    assert done != 0
    assert not os.path.ismount(mnt)


def test_a_file_the_kernel_will_not_take_keeps_no_other_file_of_its_block_out(tmp_path, caplog):
    """One file's failed push (a struct.error was what a file of 4 GiB got) is counted and said once, in
    one line; every other file of the job is still pushed.  In-process: the push is called as the pusher
    thread calls it, with a stand-in session (no /dev/fuse)."""
    import logging
    import struct

    from blockfs.serve.options import MountOptions
    from blockfs.serve.server import assembled
    from kernelcalls import KernelCalls

    src = tmp_path / "src"
    src.mkdir()
    names = [f"f{i}.bin" for i in range(6)]
    for i, name in enumerate(names):
        (src / name).write_bytes(bytes([i]) * (1000 + i))
    blockfs.pack(src, tmp_path / "packed", fsync=False)  # one block
    options = MountOptions(cache_bytes=64 << 20, prefill=False, lock_memory=False)
    with caplog.at_level(logging.DEBUG), assembled(tmp_path / "packed", tmp_path / "mnt", options,
                                                   route="kernel") as fs:  # fmt: skip
        calls = KernelCalls(fs)
        nodes = [calls.lookup_path(name.encode())[1] for name in names]
        assert calls.read(names[0].encode()) == (src / names[0]).read_bytes()  # loads the block
        stored: list[int] = []

        def store(nodeid: int, data, offset: int = 0) -> bool:
            if nodeid == nodes[1]:
                raise struct.error("'I' format requires 0 <= number <= 4294967295")
            stored.append(nodeid)
            return True

        calls.session.store = store  # type: ignore[method-assign]
        assert fs._push([n - 1 for n in nodes]) == []
        assert sorted(stored) == sorted(nodes[:1] + nodes[2:])
        assert fs.pushed["push_errors"] == 1 and fs.pushed["files_pushed"] == len(names) - 1
    said = [r for r in caplog.records if "page cache" in r.getMessage() and r.levelno >= logging.WARNING]
    assert len(said) == 1 and names[1] in said[0].getMessage() and not said[0].exc_info


def test_a_file_of_several_store_pieces_is_pushed_whole_and_read_with_no_read_sent(tmp_path):
    """The kernel takes a file pushed in pieces (offsets advancing, the last page partial): a file of
    two pieces and a bit is read from the page cache alone, exact."""
    from blockfs.serve import wire

    require(has_fuse(), "/dev/fuse")
    src = tmp_path / "src"
    src.mkdir()
    big = os.urandom(2 * wire.STORE_PIECE + 12_345)
    (src / "big.bin").write_bytes(big)
    (src / "small.bin").write_bytes(b"beside it")
    blockfs.pack(src, tmp_path / "packed", fsync=False)
    with mounted(tmp_path / "packed", tmp_path / "mnt", binding="kernel") as m:
        wait_until(lambda: stats(m.path)["cache"]["cached_blocks"] == 1, "prefill to load the block")
        assert sorted(os.listdir(m.path)) == ["big.bin", "small.bin"]  # the kernel learns both nodes
        wait_until(lambda: stats(m.path)["page_cache"]["files_pushed"] == 2, "both files pushed")
        reads = requests(m.path).get("read", 0)
        assert (m.path / "big.bin").read_bytes() == big and (m.path / "small.bin").read_bytes() == b"beside it"
        assert requests(m.path).get("read", 0) == reads and stats(m.path)["page_cache"]["push_errors"] == 0
