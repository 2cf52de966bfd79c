"""The index: lookups, listings, and damage or hostile paths rejected at open."""

from __future__ import annotations

import os

import numpy as np
import pytest

import blockfs
from blockfs.errors import IndexFormatError
from blockfs.core.index import KIND_DIR, PackedIndex
from indexutil import patch_array as _patch


@pytest.fixture
def packed(tmp_path, edge_tree):
    blockfs.pack(edge_tree, tmp_path / "p", block_size=2000)
    return tmp_path / "p"


def test_every_path_is_found_and_listed(packed, edge_tree):
    idx = PackedIndex(packed / "index.bfi")
    seen = 0
    for dirpath, dirnames, filenames in os.walk(edge_tree):
        rel_dir = os.path.relpath(dirpath, edge_tree)
        rel_dir = b"" if rel_dir == b"." else rel_dir
        entry = idx.find(rel_dir)
        assert entry >= 0 and idx.kind(entry) == KIND_DIR
        assert idx.names(entry) == sorted(dirnames + filenames)
        for name in dirnames + filenames:
            rel = os.path.join(rel_dir, name) if rel_dir else name
            assert idx.path(idx.find(rel)) == rel
            seen += 1
    assert seen == idx.n_entries - 1
    assert idx.find(b"class_a/missing") == -1 and idx.find(b"class_a/one.txt/x") == -1


def _rename_component(arr, old: bytes, new: bytes):
    assert len(old) == len(new)
    blob = arr.tobytes()
    pos = blob.index(old)
    arr[pos : pos + len(new)] = np.frombuffer(new, dtype=np.uint8)


@pytest.mark.parametrize(
    "old, new, why",
    [
        (b"\0empty_dir\0", b"\0../ptydir\0", "forbidden"),
        (b"\0class_a/one.txt\0", b"\0class_a/../.txt\0", "forbidden"),
        (b"\0class_b\0", b"\0/lass_b\0", "forbidden"),
        (b"\0empty_dir\0", b"\0empty//ir\0", "forbidden"),
        (b"\0empty_dir\0", b"\0./pty_dir\0", "forbidden"),
    ],
)
def test_hostile_paths_are_rejected_at_open(packed, old, new, why):
    _patch(packed / "index.bfi", "paths", lambda a: _rename_component(a, old, new))
    with pytest.raises(IndexFormatError, match=why):
        PackedIndex(packed / "index.bfi")


def test_block_or_slot_out_of_range_is_rejected_at_open(packed):
    idx = PackedIndex(packed / "index.bfi")
    n_blocks = idx.n_blocks
    first_file = int(np.flatnonzero(idx.arrays["block"] >= 0)[0])
    idx.close()
    _patch(packed / "index.bfi", "block", lambda a: a.__setitem__(first_file, n_blocks))
    with pytest.raises(IndexFormatError, match=f"names block {n_blocks}, outside"):
        PackedIndex(packed / "index.bfi")
    _patch(packed / "index.bfi", "block", lambda a: a.__setitem__(first_file, 0))
    _patch(packed / "index.bfi", "slot", lambda a: a.__setitem__(first_file, 10_000))
    with pytest.raises(IndexFormatError, match="slot 10000"):
        PackedIndex(packed / "index.bfi")


def test_damaged_index_file_is_named(packed):
    data = (packed / "index.bfi").read_bytes()
    (packed / "index.bfi").write_bytes(b"XXXXXXXX" + data[8:])
    with pytest.raises(IndexFormatError, match="not a blockfs index"):
        blockfs.open_dataset(packed)
    (packed / "index.bfi").write_bytes(data[:1000])
    with pytest.raises(IndexFormatError, match="index.bfi"):
        blockfs.open_dataset(packed)
