"""The fast tar header parser gives what tarfile gives, and hands over to tarfile where it should."""

from __future__ import annotations

import io
import os
import subprocess
import tarfile

import numpy as np
import pytest
from treeutil import make_edge_tree

from blockfs.packing.containers.base import WindowReader
from blockfs.packing.containers.tarheaders import fast_members

ENCODING = ("utf-8", "surrogateescape")
FIELDS = ("name", "type", "mode", "size", "mtime", "linkname", "offset", "offset_data")


def _tarfile_members(path) -> list[tarfile.TarInfo]:
    with tarfile.open(path, encoding=ENCODING[0], errors=ENCODING[1]) as tar:
        return tar.getmembers()


def _fast(path) -> tuple[list[tarfile.TarInfo], int | None]:
    fd = os.open(path, os.O_RDONLY)
    try:
        gen = fast_members(WindowReader(fd, 4096).read, os.fstat(fd).st_size, *ENCODING)
        members = []
        while True:
            try:
                members.append(next(gen))
            except StopIteration as done:
                return members, done.value
    finally:
        os.close(fd)


def _described(m: tarfile.TarInfo) -> tuple:
    return tuple(getattr(m, f) for f in FIELDS) + (m.pax_headers.get("mtime"),)


def _tree(root) -> bytes:
    """The edge tree without its non-UTF-8 name (GNU tar marks that pax header BINARY: tarfile's job),
    plus names past ustar's 100 + 155 bytes."""
    root = make_edge_tree(root)
    os.unlink(os.path.join(root, b"class_b/\xff\xfe not utf8.bin"))
    long_dir = os.path.join(root, b"d" * 120)
    os.makedirs(long_dir)
    with open(os.path.join(long_dir, b"f" * 130), "wb") as f:
        f.write(b"long")
    os.symlink(b"t" * 150, os.path.join(root, b"long_link"))
    os.utime(long_dir, ns=(1_500_000_000_000_000_001,) * 2)
    return root


@pytest.mark.parametrize("fmt", ["gnu", "pax", "oldgnu"])
def test_every_member_as_tarfile_reads_it(tmp_path, fmt):
    src = _tree(tmp_path / "src")
    archive = tmp_path / "a.tar"
    subprocess.run(["tar", f"--format={fmt}", "-C", os.fsdecode(src), "-cf", str(archive), "."], check=True)
    fast, rest = _fast(archive)
    assert rest is None  # all of it parsed here, none left to tarfile
    assert [_described(m) for m in fast] == [_described(m) for m in _tarfile_members(archive)]


def test_python_written_ustar_and_pax_members(tmp_path):
    rng = np.random.default_rng(0)
    archive = tmp_path / "py.tar"
    with tarfile.open(archive, "w", format=tarfile.PAX_FORMAT) as tar:
        for i, name in enumerate(["a.bin", "dir/" + "p" * 90 + "/" + "n" * 90, "ünïcode/名前.jpg"]):
            data = rng.bytes(700 * i)
            info = tarfile.TarInfo(name)
            info.size, info.mtime, info.mode = len(data), 1_600_000_000.25 + i, 0o640
            tar.addfile(info, io.BytesIO(data))
    fast, rest = _fast(archive)
    assert rest is None
    assert [_described(m) for m in fast] == [_described(m) for m in _tarfile_members(archive)]


def test_a_header_left_to_tarfile_stops_the_fast_path_there(tmp_path):
    # A GNU sparse member in the middle: the members before it are parsed here, and the offset of the
    # sparse one is returned for tarfile.
    src = tmp_path / "src"
    src.mkdir()
    (src / "a_first").write_bytes(b"first")
    with open(src / "b_sparse", "wb") as f:
        f.truncate(1 << 20)
        f.write(b"x")
    (src / "c_last").write_bytes(b"last")
    archive = tmp_path / "s.tar"
    subprocess.run(
        ["tar", "--sparse", "--format=gnu", "-C", str(src), "-cf", str(archive), "a_first", "b_sparse", "c_last"],
        check=True,
    )
    fast, rest = _fast(archive)
    reference = _tarfile_members(archive)
    assert [m.name for m in fast] == ["a_first"]
    assert rest == reference[1].offset and reference[1].issparse()


def test_a_bad_checksum_is_left_to_tarfile(tmp_path):
    archive = tmp_path / "a.tar"
    src = tmp_path / "src"
    src.mkdir()
    for name in ("one", "two", "three"):
        (src / name).write_bytes(name.encode() * 100)
    subprocess.run(["tar", "-C", str(src), "-cf", str(archive), "one", "two", "three"], check=True)
    second = _tarfile_members(archive)[1].offset
    with open(archive, "r+b") as f:
        f.seek(second + 148)
        f.write(b"0000001\0")
    fast, rest = _fast(archive)
    assert [m.name for m in fast] == ["one"] and rest == second
