"""``blockfs unpack`` (blockfs/core/unpack.py): the exact inverse of pack, and nothing a damaged index
can turn into wrong bytes or wrong links (issue 17 #3, and #7's endless read)."""

from __future__ import annotations

import os

import pytest
from fuzz.indexutil import entry_of, rewrite_index
from fuzz.treesnap import tree_snapshot
from treeutil import make_edge_tree

from blockfs import open_dataset
from blockfs.core.unpack import unpack
from blockfs.errors import BlockfsError, IndexFormatError
from blockfs.packing.packer import pack

N_FILES = 16


@pytest.fixture
def classes(tmp_path):
    """class0/f0000.bin .. f0015.bin, each with its own bytes, packed as ``ds``."""
    src = tmp_path / "src"
    (src / "class0").mkdir(parents=True)
    for i in range(N_FILES):
        (src / "class0" / f"f{i:04d}.bin").write_bytes(f"file {i} ".encode() * (i + 1))
    pack(src, tmp_path / "ds", fsync=False, workers=1)
    return tmp_path


def _one_bit_apart(arrays) -> tuple[int, int]:
    """Two different files whose inode numbers differ in one bit: (the one to damage, the other)."""
    files = [entry_of(arrays, f"class0/f{i:04d}.bin".encode()) for i in range(N_FILES)]
    for e in files:
        for other in files:
            flipped = int(arrays["ino"][e]) ^ int(arrays["ino"][other])
            if other != e and flipped & (flipped - 1) == 0:
                return e, other
    raise AssertionError("no two inode numbers one bit apart")


def _flip_ino_bit(arrays) -> None:
    """One bit of a file's inode number flipped, and (as a thorough forger would) both link counts 2."""
    e, other = _one_bit_apart(arrays)
    arrays["ino"][e] = arrays["ino"][other]
    arrays["nlink"][[e, other]] = 2


def test_unpack_gives_back_the_tree_with_its_hard_links(tmp_path):
    src = make_edge_tree(tmp_path / "src")
    pack(src, tmp_path / "ds", fsync=False, workers=1)
    with open_dataset(tmp_path / "ds") as ds:
        assert unpack(ds, tmp_path / "out") == ds.index.n_entries - 1
    assert tree_snapshot(tmp_path / "out") == tree_snapshot(src)
    assert tree_snapshot(src)["hardlink groups"]  # the tree has one to keep


def test_a_flipped_inode_bit_is_refused_at_open(classes):
    rewrite_index(classes / "ds", _flip_ino_bit)
    with pytest.raises(IndexFormatError, match=r"class0/f\d{4}\.bin.*claims inode"):
        open_dataset(classes / "ds")


def test_unpack_links_only_files_stored_together_even_unchecked(classes, monkeypatch):
    rewrite_index(classes / "ds", _flip_ino_bit)
    monkeypatch.setattr("blockfs.core.index_checks.check_tree", lambda arrays, where, release=None: None)
    with open_dataset(classes / "ds") as ds:
        unpack(ds, classes / "out")
    inodes = set()
    for i in range(N_FILES):
        path = classes / "out" / "class0" / f"f{i:04d}.bin"
        assert path.read_bytes() == (classes / "src" / "class0" / f"f{i:04d}.bin").read_bytes()
        inodes.add(path.stat().st_ino)
    assert len(inodes) == N_FILES


def test_unpack_fails_when_the_index_claims_more_bytes_than_stored(classes, monkeypatch):
    def grow(arrays):
        arrays["size"][entry_of(arrays, b"class0/f0003.bin")] += 1

    rewrite_index(classes / "ds", grow)
    with open_dataset(classes / "ds") as ds, pytest.raises(BlockfsError, match="f0003"):
        unpack(ds, classes / "out")


def test_unpack_refuses_an_output_that_is_not_empty(classes):
    (classes / "out").mkdir()
    (classes / "out" / "keep").write_bytes(b"mine")
    with open_dataset(classes / "ds") as ds, pytest.raises(BlockfsError, match="not an empty directory"):
        unpack(ds, classes / "out")
    assert os.listdir(classes / "out") == ["keep"]
