"""blockfs.serve.fuse.libfuse_adapter: the FUSE adapter's operations called in-process on an assembled mount (no kernel).

The mount is the one ``blockfs mount`` serves (:func:`blockfs.serve.server.assembled`), with its caches
and control sockets; only libfuse is left out.  Needs a FUSE binding to import, not ``/dev/fuse``.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import shutil
import stat

import pytest
from treeutil import EDGE_MTIME_NS, make_edge_tree

import blockfs
from blockfs import protocol
from blockfs.core.dataset import PackedDataset
from blockfs.errors import MountError
from blockfs.serve.fuse import libfuse_adapter as fs_module
from blockfs.serve.mount_options import MountOptions
from blockfs.serve.server import assembled

try:
    FuseOSError = fs_module.load_binding("mfusepy").FuseOSError
except MountError as e:  # no FUSE binding installed (a machine without libfuse)
    pytest.skip(str(e), allow_module_level=True)
ENC = fs_module.ENCODING


def p(raw: bytes) -> str:
    """A path as the binding hands it over."""
    return raw.decode(ENC)


@pytest.fixture(scope="module")
def edge_pack(tmp_path_factory):
    root = tmp_path_factory.mktemp("fs")
    src = make_edge_tree(root / "src")
    blockfs.pack(root / "src", root / "packed", block_size=4096, fsync=False)
    return root, src


@pytest.fixture
def fs(edge_pack, tmp_path):
    root, _ = edge_pack
    options = MountOptions(cache_bytes=1 << 20, prefill=False, lock_memory=False)
    with assembled(root / "packed", tmp_path / "mnt", options, route="mfusepy") as mounted:
        yield mounted


def errno_of(call) -> int:
    with pytest.raises(FuseOSError) as raised:
        call()
    return raised.value.errno


def test_getattr_matches_the_source_tree(fs, edge_pack):
    _, src = edge_pack
    for dirpath, dirnames, filenames in os.walk(src):
        for name in dirnames + filenames:
            path = os.path.join(dirpath, name)
            rel = b"/" + os.path.relpath(path, src)
            st = os.lstat(path)
            attr = fs.getattr(p(rel))
            assert attr["st_mode"] == st.st_mode, rel
            assert attr["st_mtime"] == EDGE_MTIME_NS
            if stat.S_ISREG(st.st_mode) or stat.S_ISLNK(st.st_mode):
                assert attr["st_size"] == st.st_size, rel
    assert stat.S_ISDIR(fs.getattr("/")["st_mode"])
    hard = fs.getattr(p(b"/class_c/hardlink_to_one"))
    assert hard["st_ino"] == fs.getattr("/class_a/one.txt")["st_ino"] and hard["st_nlink"] == 2


def test_readdir_lists_names_with_modes_and_inodes(fs, edge_pack):
    _, src = edge_pack
    entries = fs.readdir(p(b"/class_b"), None)
    names = [name for name, _attr, _off in entries]
    assert names[:2] == [".", ".."]
    assert sorted(n.encode(ENC) for n in names[2:]) == sorted(os.listdir(os.path.join(src, b"class_b")))
    assert all(attr["st_ino"] > 0 for _n, attr, _o in entries)
    root_names = [name for name, _a, _o in fs.readdir("/", None)]
    assert fs.view.control.name not in root_names  # the control directory is not listed


def test_read_and_readlink_return_the_source_bytes(fs, edge_pack):
    _, src = edge_pack
    data = open(os.path.join(src, b"class_a/big.bin"), "rb").read()
    assert fs.read("/class_a/big.bin", len(data) + 10, 0, None) == data
    assert fs.read("/class_a/big.bin", 100, 1000, None) == data[1000:1100]
    assert fs.read(p(b"/class_b/\xff\xfe not utf8.bin"), 100, 0, None) == b"bytes\x00\xff"
    assert fs.readlink("/class_a/link_rel") == "one.txt"
    assert fs.readlink("/dangling_abs") == "/nonexistent/target"


def test_xattrs_name_the_control_directory_and_label_files(fs):
    assert fs.getxattr("/", protocol.CONTROL_XATTR) == fs.view.control.name.encode()
    assert fs.getxattr("/class_a/one.txt", protocol.BLOCK_XATTR).isdigit()
    assert protocol.LABEL_XATTR in fs.listxattr("/class_a/one.txt")
    assert errno_of(lambda: fs.getxattr("/class_a/one.txt", "user.other")) == errno.ENODATA
    ctl = "/" + fs.view.control.name
    assert json.loads(fs.getxattr(ctl, protocol.STATS_XATTR))["mount"]["control"] == fs.view.control.name
    address = fs.getxattr(ctl, protocol.PREFETCH_XATTR)
    assert address.startswith(protocol.PREFETCH_SOCKET_PREFIX)


def test_control_files_through_the_adapter(fs, edge_pack):
    root, _ = edge_pack
    ctl = "/" + fs.view.control.name
    target = fs.readlink(ctl + "/stats.json")
    stats = json.loads(fs.read(f"{ctl}/{target}", 1 << 20, 0, None))
    assert stats["dataset"]["files"] == PackedDataset(root / "packed").metadata["n_files"]
    assert fs.read(ctl + "/metadata.json", 1 << 20, 0, None) == (root / "packed" / "blockfs.json").read_bytes()
    assert stat.S_ISLNK(fs.getattr(ctl + "/stats.json")["st_mode"])


def test_errors_become_errno_values(fs):
    assert errno_of(lambda: fs.getattr("/nope")) == errno.ENOENT
    assert errno_of(lambda: fs.getattr("/class_a/one.txt/x")) in (errno.ENOTDIR, errno.ENOENT)
    assert errno_of(lambda: fs.read("/class_a", 10, 0, None)) == errno.EISDIR
    assert errno_of(lambda: fs.readlink("/class_a/one.txt")) == errno.EINVAL
    assert errno_of(lambda: fs.getattr("/" + fs.view.control.name + "/nope")) == errno.ENOENT
    assert errno_of(lambda: fs.write("/class_a/one.txt", b"x", 0, None)) == errno.EROFS
    assert fs.requests["getattr"] >= 3


def test_a_damaged_block_fails_its_files_with_eio_and_one_log_line(edge_pack, tmp_path, caplog):
    root, src = edge_pack
    shutil.copytree(root / "packed", tmp_path / "p")
    with PackedDataset(tmp_path / "p") as ds:
        e = ds.lookup(b"class_a/big.bin")
        block = int(ds.index.arrays["block"][e])
        head = ds.store.header(block)
        pos = head.data_start + int(head.offsets[int(ds.index.arrays["slot"][e])])
    with open(ds.store.block_paths[block], "r+b") as f:
        f.seek(pos)
        byte = f.read(1)
        f.seek(pos)
        f.write(bytes([byte[0] ^ 1]))
    options = MountOptions(cache_bytes=1 << 20, prefill=False, lock_memory=False)
    with caplog.at_level(logging.ERROR), assembled(tmp_path / "p", tmp_path / "mnt", options, route="mfusepy") as fs:
        for _ in range(3):
            assert errno_of(lambda: fs.read("/class_a/big.bin", 100, 0, None)) == errno.EIO
        assert fs.view.stats()["errors"] == {
            "damaged_files_read": 3,
            "damaged_blocks_reported": [block],
            "failed_reads": 0,
        }
        assert fs.read("/class_a/one.txt", 10, 0, None) == b"hello\n"  # the mount stays up
    lines = [r for r in caplog.records if "answering EIO" in r.getMessage()]
    assert len(lines) == 1 and "big.bin" in lines[0].getMessage()


def test_the_error_log_logs_a_damaged_block_once_and_a_failing_block_once_a_minute(caplog, monkeypatch):
    from blockfs.errors import BlockReadError, CorruptBlockError
    from blockfs.serve import errorlog

    now = [1000.0]
    monkeypatch.setattr(errorlog.time, "monotonic", lambda: now[0])
    errors = errorlog.ErrorLog()
    with caplog.at_level(logging.ERROR, logger="blockfs.serve.errorlog"):
        for _ in range(3):
            errors.report(CorruptBlockError("block 4: damaged", block=4))
            errors.report(BlockReadError("block 7: gone", block=7))
        now[0] += errorlog.FAILED_READ_LOG_S
        errors.report(BlockReadError("block 7: gone", block=7))
    assert [r.getMessage().split(":")[0] for r in caplog.records] == ["block 4", "block 7", "block 7"]
    assert errors.stats() == {"damaged_files_read": 3, "damaged_blocks_reported": [4], "failed_reads": 4}
