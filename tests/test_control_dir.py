"""blockfs.serve.control.control_dir: the control directory, in-process (no FUSE, no mount)."""

from __future__ import annotations

import errno
import json
import stat
import threading
from pathlib import Path

import pytest
from treeutil import make_class_tree

import blockfs
from blockfs import protocol
from blockfs.core.dataset import PackedDataset
from blockfs.errors import CorruptBlockError
from blockfs.serve.control import control_dir as control_module
from blockfs.serve.control.control_dir import SNAPSHOTS_KEPT, ControlDirectory, control_name_for

CTL = b"/.blockfs"


@pytest.fixture(scope="module")
def packed(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("control")
    make_class_tree(root / "src", files=90, seed=5, sizes=(300, 2500))
    blockfs.pack(root / "src", root / "p", block_size=16 << 10, fsync=False)
    return root / "p"


class Counting:
    """Statistics that change at every call, and whose parts must agree: a torn read shows as a mismatch."""

    def __init__(self) -> None:
        self.calls = 0
        self.lock = threading.Lock()

    def __call__(self) -> dict:
        with self.lock:
            self.calls += 1
            n = self.calls
        return {"n": n, "pad": "x" * (n % 997), "check": n * 7}


@pytest.fixture
def control(packed):
    ds = PackedDataset(packed)
    ctl = ControlDirectory(ds, control_name_for(ds), Counting())
    yield ctl
    ctl.close()
    ds.close()


def read_all(ctl: ControlDirectory, raw: bytes, chunk: int = 4096) -> bytes:
    out, offset = bytearray(), 0
    while data := ctl.read(raw, chunk, offset):
        out += data
        offset += len(data)
    return bytes(out)


def test_listing_and_kinds(control, packed):
    names = [name for name, _mode, _ino in control.readdir(CTL)]
    assert names == [".", "..", "blocks", "index.bfi", "metadata.json", "stats.json"]
    modes = {name: mode for name, mode, _ino in control.readdir(CTL)}
    assert modes["stats.json"] == stat.S_IFLNK and modes["blocks"] == stat.S_IFDIR
    assert modes["index.bfi"] == stat.S_IFREG
    n_blocks = PackedDataset(packed).n_blocks
    blocks = [name for name, _m, _i in control.readdir(CTL + b"/blocks")][2:]
    assert blocks == [protocol.block_file_name(b) for b in range(n_blocks)]
    inos = [ino for _n, _m, ino in control.readdir(CTL)] + [i for _n, _m, i in control.readdir(CTL + b"/blocks")][2:]
    assert len(set(inos[2:])) == len(inos) - 2  # every control file its own inode
    assert stat.S_ISDIR(control.getattr(CTL).mode)
    assert control.owns(CTL + b"/x") and control.owns(CTL) and not control.owns(b"/.blockfsx")


def test_metadata_and_index_are_the_datasets_bytes(control, packed):
    meta = (packed / "blockfs.json").read_bytes()
    assert read_all(control, CTL + b"/metadata.json", 100) == meta
    assert control.getattr(CTL + b"/metadata.json").size == len(meta)
    index = (packed / "index.bfi").read_bytes()
    assert read_all(control, CTL + b"/index.bfi", 1000) == index
    assert control.getattr(CTL + b"/index.bfi").size == len(index)


def test_block_files_are_served_byte_for_byte(control, packed):
    paths = sorted((packed / "blocks").iterdir())
    for b, path in enumerate(paths):
        raw = path.read_bytes()
        name = CTL + b"/blocks/" + protocol.block_file_name(b).encode()
        assert control.getattr(name).size == len(raw)
        assert read_all(control, name, 999) == raw
        assert control.read(name, 10, len(raw) + 5) == b""


def test_a_damaged_range_is_an_eio_error_and_the_rest_reads(tmp_path, packed):
    import shutil

    shutil.copytree(packed, tmp_path / "p")
    ds = PackedDataset(tmp_path / "p")
    head = ds.store.header(0)
    path = ds.store.block_paths[0]
    raw = Path(path).read_bytes()
    pos = head.data_start + int(head.offsets[0])
    with open(path, "r+b") as f:
        f.seek(pos)
        f.write(bytes([raw[pos] ^ 0xFF]))
    ctl = ControlDirectory(ds, ".blockfs", Counting())
    try:
        name = CTL + b"/blocks/" + protocol.block_file_name(0).encode()
        with pytest.raises(CorruptBlockError) as raised:
            ctl.read(name, 100, pos - 10)
        assert raised.value.errno == errno.EIO and raised.value.block == 0
        last = head.data_start + int(head.offsets[-1])  # the last file is intact
        assert ctl.read(name, 50, last) == raw[last : last + 50]
        assert ctl.read(name, head.data_start, 0) == raw[: head.data_start]  # the header too
    finally:
        ctl.close()
        ds.close()


def test_errors_carry_their_errno(control):
    cases = [
        (lambda: control.getattr(CTL + b"/nope"), errno.ENOENT),
        (lambda: control.getattr(CTL + b"/blocks/99999999"), errno.ENOENT),
        (lambda: control.getattr(CTL + b"/blocks/0"), errno.ENOENT),  # not the 8-digit spelling
        (lambda: control.read(CTL + b"/blocks", 10, 0), errno.EISDIR),
        (lambda: control.readdir(CTL + b"/index.bfi"), errno.ENOTDIR),
        (lambda: control.readlink(CTL + b"/index.bfi"), errno.EINVAL),
        (lambda: control.getxattr(CTL, protocol.PREFETCH_XATTR), errno.ENODATA),
        (lambda: control.getxattr(CTL + b"/index.bfi", protocol.STATS_XATTR), errno.ENODATA),
        (lambda: control.getattr(CTL + b"/stats/000000000999.json"), errno.ENOENT),
    ]
    for call, expected in cases:
        with pytest.raises(OSError) as raised:
            call()
        assert raised.value.errno == expected


def test_xattrs_give_live_stats_and_the_socket_addresses(control, packed):
    assert control.listxattr(CTL) == [protocol.STATS_XATTR]
    first = json.loads(control.getxattr(CTL, protocol.STATS_XATTR))
    assert json.loads(control.getxattr(CTL, protocol.STATS_XATTR))["n"] == first["n"] + 1  # live
    with PackedDataset(packed) as ds:
        control = ControlDirectory(ds, control_name_for(ds), Counting(), b"\0p", b"\0s")
    assert control.getxattr(CTL, protocol.PREFETCH_XATTR) == b"\0p"
    assert control.getxattr(CTL, protocol.SHARE_XATTR) == b"\0s"
    assert sorted(control.listxattr(CTL)) == sorted(
        [protocol.STATS_XATTR, protocol.PREFETCH_XATTR, protocol.SHARE_XATTR]
    )
    assert control.listxattr(CTL + b"/stats.json") == []


def test_stats_json_leads_to_a_fixed_snapshot_per_resolution(control):
    link = CTL + b"/stats.json"
    assert stat.S_ISLNK(control.getattr(link).mode)
    first = control.readlink(link)
    second = control.readlink(link)
    assert first != second and first.startswith(b"stats/")
    assert control.getattr(link).size == len(first)  # the link's size is its target's length
    one = read_all(control, CTL + b"/" + first)
    control.getxattr(CTL, protocol.STATS_XATTR)  # the statistics move on ...
    assert read_all(control, CTL + b"/" + first, 3) == one  # ... a snapshot does not
    assert control.getattr(CTL + b"/" + first).size == len(one)
    assert json.loads(one)["n"] + 1 == json.loads(read_all(control, CTL + b"/" + second))["n"]
    listed = [name for name, _m, _i in control.readdir(CTL + b"/stats")][2:]
    assert listed == [first.partition(b"/")[2].decode(), second.partition(b"/")[2].decode()]


def test_idle_snapshots_are_dropped_and_handed_back_to_forget(control, monkeypatch):
    link = CTL + b"/stats.json"
    first = control.readlink(link)
    for _ in range(SNAPSHOTS_KEPT):
        control.readlink(link)
    assert control.take_evicted() == []  # more than SNAPSHOTS_KEPT, but none idle yet: all kept
    assert control.read(CTL + b"/" + first, 10, 0)
    monkeypatch.setattr(control_module, "SNAPSHOT_IDLE_S", 0.0)  # now every snapshot counts as idle
    second = control.readlink(link)
    dropped = [CTL + b"/stats/%012d.json" % g for g in (2, 3)]  # the least recently read, not the first
    assert control.take_evicted() == dropped
    assert control.take_evicted() == []
    with pytest.raises(OSError) as raised:
        control.read(dropped[0], 10, 0)
    assert raised.value.errno == errno.ENOENT
    assert read_all(control, CTL + b"/" + first) and read_all(control, CTL + b"/" + second)
    assert len(control.readdir(CTL + b"/stats")) == 2 + SNAPSHOTS_KEPT


def test_snapshots_are_bounded_even_when_all_are_read(control, monkeypatch):
    monkeypatch.setattr(control_module, "SNAPSHOTS_MAX", SNAPSHOTS_KEPT + 3)
    for _ in range(SNAPSHOTS_KEPT + 10):
        control.readlink(CTL + b"/stats.json")
    assert len(control.readdir(CTL + b"/stats")) == 2 + SNAPSHOTS_KEPT + 3
    assert len(control.take_evicted()) == 7


def test_concurrent_readers_never_see_a_torn_snapshot(control):
    # Each reader opens stats.json (resolves the link) and reads it in small pieces while the others do
    # the same: every read must be one whole snapshot, whose parts agree.
    failures: list[str] = []

    def reader() -> None:
        for _ in range(150):
            target = control.readlink(CTL + b"/stats.json")
            try:
                s = json.loads(read_all(control, CTL + b"/" + target, chunk=37))
                assert s["check"] == 7 * s["n"] and len(s["pad"]) == s["n"] % 997
            except (ValueError, AssertionError, KeyError, OSError) as e:
                failures.append(f"{target!r}: {e!r}")

    threads = [threading.Thread(target=reader) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not failures, failures[:3]


def test_the_name_avoids_the_datasets_entries(tmp_path):
    (tmp_path / "src" / ".blockfs").mkdir(parents=True)
    (tmp_path / "src" / ".blockfs-1").write_bytes(b"x")
    (tmp_path / "src" / "a").write_bytes(b"y")
    blockfs.pack(tmp_path / "src", tmp_path / "p", fsync=False)
    with PackedDataset(tmp_path / "p") as ds:
        assert control_name_for(ds) == ".blockfs-2"
        assert control_name_for(ds, "ctl") == "ctl"


# --- another user under --allow-other -----------------------------------------------------------------
NOBODY_READS = r"""
import errno, json, os, sys
fd = int(sys.argv[1])
os.setgid(65534)
os.setuid(65534)
out = {}
for rel in sys.argv[2:]:
    try:
        f = os.open(rel, os.O_RDONLY, dir_fd=fd)
        os.read(f, 16)
        os.close(f)
        out[rel] = 0
    except OSError as e:
        out[rel] = e.errno
print(json.dumps(out))
"""


def _as_nobody(root: Path, rels: list[str]) -> dict:
    """What a process of user 65534 gets reading each of ``rels`` under ``root`` (0 or an errno)."""
    import os
    import subprocess
    import sys

    fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY)  # opened as root: the mount point's parents may be 0700
    try:
        done = subprocess.run(
            [sys.executable, "-c", NOBODY_READS, str(fd), *rels], pass_fds=(fd,), capture_output=True, text=True
        )
    finally:
        os.close(fd)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


@pytest.mark.fuse
def test_under_allow_other_another_user_cannot_read_a_private_files_bytes_through_the_control_files(tmp_path):
    import os

    from capability import has_fuse, require
    from mountutil import mounted

    require(has_fuse(), "/dev/fuse")
    require(os.geteuid() == 0, "root (to read as another user)")
    src = tmp_path / "src"
    (src / "open").mkdir(parents=True)
    (src / "open" / "public.txt").write_bytes(b"anyone\n")
    (src / "secret.txt").write_bytes(b"owner only\n")
    (src / "secret.txt").chmod(0o600)
    for d in (src, src / "open"):
        d.chmod(0o755)
    blockfs.pack(src, tmp_path / "packed", fsync=False)
    public = tmp_path / "public"
    (public / "d").mkdir(parents=True)
    (public / "d" / "a.txt").write_bytes(b"a\n")
    public.chmod(0o755)
    blockfs.pack(public, tmp_path / "packed-public", fsync=False)
    control = protocol.DEFAULT_CONTROL
    private_files = [f"{control}/{protocol.INDEX_FILE}", f"{control}/{protocol.BLOCKS_DIR}/00000000"]
    with mounted(tmp_path / "packed", tmp_path / "mnt", "--allow-other") as m:
        seen = _as_nobody(
            m.path,
            [
                "open/public.txt",
                "secret.txt",
                f"{control}/{protocol.METADATA_FILE}",
                f"{control}/{protocol.STATS_FILE}",
                *private_files,
            ],
        )
        assert seen["open/public.txt"] == 0 and seen["secret.txt"] == errno.EACCES
        assert seen[f"{control}/{protocol.METADATA_FILE}"] == 0 and seen[f"{control}/{protocol.STATS_FILE}"] == 0
        assert all(seen[rel] == errno.EACCES for rel in private_files), seen
        for rel in private_files:  # the owner still reads them (the loader does)
            assert (m.path / rel).read_bytes()[:4]
    with mounted(tmp_path / "packed-public", tmp_path / "mnt2", "--allow-other") as m:
        seen = _as_nobody(m.path, ["d/a.txt", *private_files])
        assert all(v == 0 for v in seen.values()), seen  # a tree everyone may read hides nothing from them


def test_the_control_files_that_reveal_the_tree_grant_only_what_every_entry_grants():
    import numpy as np

    from blockfs.core.index import KIND_DIR, KIND_FILE, KIND_SYMLINK
    from blockfs.serve.control.control_dir import reveal_mode

    kinds = np.array([KIND_DIR, KIND_FILE, KIND_SYMLINK], dtype=np.uint8)
    arrays = lambda d, f: {"kind": kinds, "mode": np.array([d, f, 0o777], dtype=np.uint32)}  # noqa: E731
    assert reveal_mode(arrays(0o755, 0o644)) == 0o444
    assert reveal_mode(arrays(0o750, 0o640)) == 0o440
    assert reveal_mode(arrays(0o755, 0o600)) == 0o400
    assert reveal_mode(arrays(0o711, 0o644)) == 0o400  # a directory others may not list: its names are private
