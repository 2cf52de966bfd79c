"""PackedDataset: opening (metadata, index, their agreement) and reading by path without a mount."""

from __future__ import annotations

import os

import numpy as np
import pytest
from fuzz.indexutil import edit_metadata

import blockfs
from blockfs.core.dataset import PackedDataset, read_metadata
from blockfs.core.format import PACKING_MARKER
from blockfs.core.index import KIND_DIR, KIND_FILE, KIND_SYMLINK
from blockfs.errors import (
    EntryNotFoundError,
    FormatError,
    IndexFormatError,
    IsADirectoryEntryError,
    NotADatasetError,
    NotADirectoryEntryError,
    NotASymlinkError,
    UnsupportedVersionError,
)


@pytest.fixture
def packed(tmp_path, edge_tree):
    blockfs.pack(edge_tree, tmp_path / "p", block_size=2000)
    return tmp_path / "p"


# --- read_metadata ---------------------------------------------------------------------------------------
def test_read_metadata_names_what_is_not_a_dataset_and_the_fix(tmp_path):
    (tmp_path / "file").write_text("x")
    with pytest.raises(NotADatasetError, match="is not a directory"):
        read_metadata(str(tmp_path / "file"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(NotADatasetError, match="run 'blockfs pack' first") as raised:
        read_metadata(str(tmp_path / "empty"))
    assert isinstance(raised.value, FileNotFoundError)  # callers may catch the builtin
    (tmp_path / "empty" / PACKING_MARKER).write_text("")
    with pytest.raises(NotADatasetError, match="unfinished pack .* run 'blockfs pack' again"):
        read_metadata(str(tmp_path / "empty"))


def test_read_metadata_refuses_unreadable_foreign_and_newer_metadata(packed):
    meta = (packed / "blockfs.json").read_text()
    (packed / "blockfs.json").write_text(meta[: len(meta) // 2])
    with pytest.raises(FormatError, match="unreadable metadata"):
        read_metadata(str(packed))
    (packed / "blockfs.json").write_text('{"format": "other"}')
    with pytest.raises(FormatError, match="not blockfs metadata"):
        read_metadata(str(packed))
    (packed / "blockfs.json").write_text(meta)
    edit_metadata(packed, lambda m: m.__setitem__("format_version", 99))
    with pytest.raises(UnsupportedVersionError, match="upgrade blockfs"):
        read_metadata(str(packed))


def test_read_metadata_returns_what_pack_wrote(packed, edge_tree):
    meta = read_metadata(str(packed))
    assert meta["format"] == "blockfs" and meta["classes"] == ["class_a", "class_b", "class_c", "empty_dir"]
    assert meta["n_files"] == sum(not os.path.islink(os.path.join(d, f)) for d, _, fs in os.walk(edge_tree) for f in fs)


# --- opening: index and metadata must be one pack's -------------------------------------------------------
def test_a_missing_index_is_named(packed):
    os.unlink(packed / "index.bfi")
    with pytest.raises(IndexFormatError, match="index.bfi: cannot open"):
        PackedDataset(packed)


def test_block_counts_of_metadata_and_index_must_agree(packed):
    edit_metadata(packed, lambda m: m.__setitem__("n_blocks", m["n_blocks"] + 1))
    with pytest.raises(IndexFormatError, match="blocks, the metadata"):
        PackedDataset(packed)


def test_the_index_of_another_pack_is_refused_by_its_crc(tmp_path, edge_tree):
    blockfs.pack(edge_tree, tmp_path / "a", block_size=2000, seed=1)
    blockfs.pack(edge_tree, tmp_path / "b", block_size=2000, seed=2)
    os.replace(tmp_path / "b" / "index.bfi", tmp_path / "a" / "index.bfi")
    with pytest.raises(IndexFormatError, match="checksum mismatch"):
        PackedDataset(tmp_path / "a")


# --- reading by path ----------------------------------------------------------------------------------------
def test_stat_listdir_readlink_and_read_answer_as_the_tree(packed, edge_tree):
    with blockfs.open_dataset(packed) as ds:
        st = ds.stat("class_a/one.txt")
        real = os.lstat(os.path.join(edge_tree, b"class_a/one.txt"))
        assert (st.kind, st.kind_name, st.size, st.mode, st.mtime_ns, st.nlink) == (
            KIND_FILE,
            "file",
            real.st_size,
            real.st_mode,
            real.st_mtime_ns,
            real.st_nlink,
        )
        assert ds.stat("/class_a/one.txt") == st == ds.stat(b"class_a/one.txt")  # str, bytes, leading "/"
        assert ds.stat("class_c/hardlink_to_one").ino == st.ino
        assert ds.stat("").kind == ds.stat("/").kind == KIND_DIR
        assert ds.stat("class_a/link_rel").kind == KIND_SYMLINK
        assert ds.listdir("class_b") == sorted(os.fsdecode(n) for n in os.listdir(os.path.join(edge_tree, b"class_b")))
        assert ds.listdir(b"class_b") == sorted(os.listdir(os.path.join(edge_tree, b"class_b")))
        assert ds.listdir() == sorted(os.fsdecode(n) for n in os.listdir(edge_tree))
        assert ds.readlink("class_a/link_rel") == "one.txt" and ds.readlink(b"dangling_abs") == b"/nonexistent/target"
        assert ds.read("class_a/big.bin") == open(os.path.join(edge_tree, b"class_a/big.bin"), "rb").read()
        assert ds.read("class_a/big.bin", 100, 5) == (bytes(range(256)) * 700)[100:105]
        assert b"".join(ds.read_pieces(ds.lookup("class_a/big.bin"))) == bytes(range(256)) * 700
        assert ds.read("class_a/empty.bin") == b"" and list(ds.read_pieces(ds.lookup("class_a/empty.bin"))) == []


def test_wrong_kinds_and_missing_paths_raise_errors_that_are_also_builtins(packed):
    with blockfs.open_dataset(packed) as ds:
        with pytest.raises(EntryNotFoundError) as raised:
            ds.stat("class_a/missing")
        assert isinstance(raised.value, FileNotFoundError)
        with pytest.raises(NotADirectoryEntryError):
            ds.listdir("class_a/one.txt")
        with pytest.raises(NotASymlinkError):
            ds.readlink("class_a/one.txt")
        with pytest.raises(IsADirectoryEntryError):
            ds.read("class_a")
        with pytest.raises(EntryNotFoundError, match="not a regular file"):
            ds.read("class_a/link_rel")


def test_labels_classes_layout_and_file_ids(packed):
    with blockfs.open_dataset(packed) as ds:
        files = ds.file_ids
        assert np.all(ds.index.arrays["kind"][files] == KIND_FILE)
        assert ds.classes[ds.labels[ds.lookup("class_b/with space.txt")]] == "class_b"
        assert ds.labels[ds.lookup("top_level_file")] == -1
        off, members = ds.layout
        assert off.size == ds.n_blocks + 1 and sorted(members.tolist()) == files.tolist()
        assert sum(len(ds.files_in_block(b)) for b in range(ds.n_blocks)) == files.size
