"""The contract both FUSE adapters keep over :class:`blockfs.serve.view.MountView` (fsspec's pattern: one
suite, a fixture per adapter): the same tree, attributes, listings, bytes, links, extended attributes,
control directory and errno values, whichever route translates them.  In-process on an assembled mount
(:func:`blockfs.serve.server.assembled`): no kernel, no /dev/fuse; the libfuse route needs its binding."""

from __future__ import annotations

import errno
import json
import os
import stat

import pytest
from adapterclients import KernelClient, LibfuseClient
from treeutil import EDGE_MTIME_NS, make_edge_tree

import blockfs
from blockfs import protocol
from blockfs.core.dataset import PackedDataset
from blockfs.errors import MountError
from blockfs.serve.mount_options import MountOptions
from blockfs.serve.server import assembled


@pytest.fixture(scope="module")
def edge(tmp_path_factory):
    root = tmp_path_factory.mktemp("contract")
    src = make_edge_tree(root / "src")
    blockfs.pack(root / "src", root / "packed", block_size=4096, fsync=False)
    return root, src


@pytest.fixture(scope="module", params=["kernel", "mfusepy"])
def client(request, edge, tmp_path_factory):
    root, _src = edge
    if request.param != "kernel":
        from blockfs.serve.fuse.libfuse_adapter import load_binding

        try:
            load_binding(request.param)
        except MountError as e:  # no FUSE binding on this machine
            pytest.skip(str(e))
    options = MountOptions(cache_bytes=1 << 20, prefill=False, lock_memory=False)
    with assembled(root / "packed", tmp_path_factory.mktemp("mnt"), options, route=request.param) as fs:
        yield KernelClient(fs) if request.param == "kernel" else LibfuseClient(fs)


def errno_of(call) -> int:
    with pytest.raises(OSError) as raised:
        call()
    return raised.value.errno


def source_entries(src: bytes) -> list[tuple[bytes, os.stat_result]]:
    out = []
    for dirpath, dirnames, filenames in os.walk(src):
        for name in dirnames + filenames:
            path = os.path.join(dirpath, name)
            out.append((os.path.relpath(path, src), os.lstat(path)))
    return out


def control(client) -> bytes:
    return client.getxattr(b"", protocol.CONTROL_XATTR)


def test_attributes_are_the_source_trees(client, edge):
    _, src = edge
    for rel, st in source_entries(src):
        got = client.stat(rel)
        assert (got.mode, got.mtime_ns) == (st.st_mode, EDGE_MTIME_NS), rel
        if not stat.S_ISDIR(st.st_mode):
            assert got.size == st.st_size, rel
    assert stat.S_ISDIR(client.stat(b"").mode)
    hard, one = client.stat(b"class_c/hardlink_to_one"), client.stat(b"class_a/one.txt")
    assert hard.ino == one.ino and hard.nlink == 2


def test_listings_are_the_source_trees_and_leave_the_control_directory_out(client, edge):
    _, src = edge
    for dirpath, _dirs, _files in os.walk(src):
        rel = os.path.relpath(dirpath, src)
        rel = b"" if rel == b"." else rel
        assert sorted(client.listdir(rel)) == sorted(os.listdir(dirpath)), rel
    assert control(client) not in client.listdir(b"")


def test_bytes_and_links_are_the_sources(client, edge):
    _, src = edge
    big = open(os.path.join(src, b"class_a/big.bin"), "rb").read()
    assert client.read(b"class_a/big.bin") == big
    assert client.read(b"class_a/big.bin", 100, 1000) == big[1000:1100]
    assert client.read(b"class_b/\xff\xfe not utf8.bin") == b"bytes\x00\xff"
    assert client.read(b"class_a/empty.bin") == b""
    assert client.readlink(b"class_a/link_rel") == b"one.txt"
    assert client.readlink(b"dangling_abs") == b"/nonexistent/target"


def test_extended_attributes_label_files_and_name_the_control_directory(client):
    assert control(client) == protocol.DEFAULT_CONTROL.encode()
    assert client.getxattr(b"class_a/one.txt", protocol.BLOCK_XATTR).isdigit()
    assert protocol.LABEL_XATTR in client.listxattr(b"class_a/one.txt")
    assert client.listxattr(b"class_a") == []


def test_the_control_directory_is_reached_by_name_from_the_root(client, edge):
    root, _ = edge
    ctl = control(client)
    assert stat.S_ISDIR(client.stat(ctl).mode)
    assert sorted(client.listdir(ctl)) == sorted(
        os.fsencode(n) for n in (protocol.BLOCKS_DIR, protocol.INDEX_FILE, protocol.METADATA_FILE, protocol.STATS_FILE)
    )
    with PackedDataset(root / "packed") as ds:
        n_blocks, n_files = ds.n_blocks, ds.metadata["n_files"]
    assert len(client.listdir(ctl + b"/" + protocol.BLOCKS_DIR.encode())) == n_blocks
    assert client.read(ctl + b"/" + protocol.METADATA_FILE.encode()) == (root / "packed" / "blockfs.json").read_bytes()
    link = ctl + b"/" + protocol.STATS_FILE.encode()
    assert stat.S_ISLNK(client.stat(link).mode)
    snapshot = json.loads(client.read(ctl + b"/" + client.readlink(link)))
    assert snapshot["dataset"]["files"] == n_files and snapshot["mount"]["control"] == ctl.decode()
    assert {"binding", "open_mode"} <= set(snapshot["mount"])  # the route's facts
    live = json.loads(client.getxattr(ctl, protocol.STATS_XATTR))
    assert live["dataset"]["digest"] == snapshot["dataset"]["digest"]
    assert client.getxattr(ctl, protocol.PREFETCH_XATTR).startswith(protocol.PREFETCH_SOCKET_PREFIX)
    assert client.stat(ctl + b"/" + protocol.BLOCKS_DIR.encode()).ino != client.stat(ctl).ino


def test_errors_are_the_same_errno_values(client):
    ctl = control(client)
    assert errno_of(lambda: client.stat(b"nope")) == errno.ENOENT
    assert errno_of(lambda: client.stat(b"class_a/one.txt/x")) in (errno.ENOTDIR, errno.ENOENT)
    assert errno_of(lambda: client.read(b"class_a")) == errno.EISDIR
    assert errno_of(lambda: client.readlink(b"class_a/one.txt")) == errno.EINVAL
    assert errno_of(lambda: client.getxattr(b"class_a/one.txt", "user.other")) == errno.ENODATA
    assert errno_of(lambda: client.listdir(b"class_a/one.txt")) == errno.ENOTDIR
    assert errno_of(lambda: client.stat(ctl + b"/nope")) == errno.ENOENT
    assert errno_of(lambda: client.read(ctl + b"/" + protocol.BLOCKS_DIR.encode())) == errno.EISDIR
    assert errno_of(lambda: client.getxattr(ctl + b"/metadata.json", protocol.STATS_XATTR)) == errno.ENODATA


def test_statfs_counts_the_datasets_entries(client, edge):
    root, _ = edge
    blocks, files = client.statfs()
    with PackedDataset(root / "packed") as ds:
        assert files == ds.index.n_entries and blocks == -(-int(ds.metadata["file_bytes"]) // 4096)
