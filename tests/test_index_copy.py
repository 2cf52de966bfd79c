"""A mount's index held in a private unnamed file (blockfs/core/index_copy.py): the bytes checked are the bytes
served, whatever happens to the dataset's index.bfi afterwards, and the copy is page cache, not anonymous memory."""

from __future__ import annotations

import errno
import os

import numpy as np
import pytest
from mountutil import mapped_file

import blockfs
from blockfs.core import index_copy, kept_copies
from blockfs.core.dataset import PackedDataset
from blockfs.core.index import PackedIndex
from blockfs.core.index_copy import IndexCopies
from blockfs.errors import IndexFormatError


@pytest.fixture
def packed(tmp_path, edge_tree):
    blockfs.pack(edge_tree, tmp_path / "p", block_size=2000)
    return tmp_path / "p"


def _mapping(index: PackedIndex) -> tuple[str, int]:
    """(the path of the mapping that holds the index's bytes, its anonymous kB), from /proc/self/smaps."""
    address = np.frombuffer(index.raw, dtype=np.uint8, count=1).ctypes.data
    found = None
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()
            if "-" in head[0] and ":" not in head[0] and len(head) >= 5:
                start, end = (int(x, 16) for x in head[0].split("-"))
                found = (" ".join(head[5:]), start <= address < end)
            elif line.startswith("Anonymous:") and found is not None and found[1]:
                return found[0], int(head[1])
    raise AssertionError("the index's bytes are in no mapping")


@pytest.mark.parametrize("kept", [0, 4], ids=["none-kept", "kept"])
def test_the_copy_is_an_unnamed_file_of_the_directory_and_no_writer_of_the_dataset_reaches_it(packed, tmp_path, kept):
    """In place (as ``cp other.bfi index.bfi`` writes), then truncated: the mount's index still holds the
    bytes it checked, answers lookups (no SIGBUS), and the copy directory holds no name anyone could open
    but the copy kept for the next mount, mode 0400 (blockfs/core/kept_copies.py), where one is kept."""
    path = packed / "index.bfi"
    original = path.read_bytes()
    copies = tmp_path / "copies"
    ds = PackedDataset(packed, copies=IndexCopies(copies, kept=kept))
    index = ds.index
    where, anonymous_kb = _mapping(index)
    assert where.startswith(str(copies.resolve()) + "/") and where.endswith("(deleted)"), where
    assert anonymous_kb == 0
    digest = ds.metadata["index"]["blake3"]
    assert sorted(os.listdir(copies)) == (["kept"] if kept else [])
    if kept:
        kept_copies.wait_kept()  # named once synced, on a thread of its own
        assert sorted(os.listdir(copies / "kept")) == [digest, digest + ".id"]
    entry = index.n_entries - 1
    name = index.path(entry)

    with open(path, "r+b") as f:  # the same file, written in place: a map of index.bfi would see this
        f.write(bytes(b ^ 0xFF for b in original))
    assert bytes(index.raw) == original
    os.truncate(path, 0)  # a map of index.bfi would now fault (SIGBUS) on every touch
    assert bytes(index.raw) == original
    assert index.find(name) == entry and index.path(entry) == name
    ds.close()


def test_a_copy_directory_in_memory_or_refused_leaves_the_index_in_anonymous_memory(packed, tmp_path, monkeypatch):
    """tmpfs would only move the same unreclaimable memory elsewhere; an unsafe directory is not written in."""
    monkeypatch.setattr(index_copy, "_on_memory_fs", lambda fd: True)
    index = PackedIndex(packed / "index.bfi", copies=IndexCopies(tmp_path / "copies"))
    assert _mapping(index)[0] == ""  # anonymous
    index.close()
    monkeypatch.undo()
    shared = tmp_path / "shared"
    shared.mkdir(mode=0o777)
    shared.chmod(0o777)  # writable by others: refused
    index = PackedIndex(packed / "index.bfi", copies=IndexCopies(shared))
    assert _mapping(index)[0] == "" and os.listdir(shared) == []
    index.close()


def test_the_copy_falls_back_to_sendfile_and_names_a_file_that_shrank(packed, tmp_path, monkeypatch):
    original = (packed / "index.bfi").read_bytes()

    def cross_device(*args: object) -> int:
        raise OSError(errno.EXDEV, "cross-device")

    monkeypatch.setattr(os, "copy_file_range", cross_device)
    index = PackedIndex(packed / "index.bfi", copies=IndexCopies(tmp_path / "copies"))
    assert bytes(index.raw) == original and _mapping(index)[0].endswith("(deleted)")
    index.close()

    monkeypatch.setattr(os, "sendfile", lambda *args: 0)  # the file ends early: it shrank while copied
    with pytest.raises(IndexFormatError, match="changed while it was read"):
        PackedIndex(packed / "index.bfi", copies=IndexCopies(tmp_path / "copies"))


@pytest.mark.parametrize("copied", [True, False], ids=["copied", "in-memory"])
def test_the_digest_hashed_piece_by_piece_as_the_index_is_read_is_the_files(packed, tmp_path, monkeypatch, copied):
    """The index is hashed on a thread while it is read (a mount's 1.5 GB index at ten million files then costs
    the read alone); in small pieces here, so every piece boundary and the short last piece are crossed."""
    from blockfs.core import digest, index_format

    original = (packed / "index.bfi").read_bytes()
    monkeypatch.setattr(index_copy, "PIECE", 1021)
    monkeypatch.setattr(index_format, "READ_PIECE", 1021)
    assert len(original) > 3 * 1021 and len(original) % 1021
    copies = IndexCopies(tmp_path / "copies") if copied else None
    buf, hashed = index_format.read_index_file_hashed(str(packed / "index.bfi"), "index", copies)
    assert hashed == digest.digest(original) and bytes(buf) == original
    assert (mapped_file(buf) or "").endswith("(deleted)") == copied
    buf.close()

    # And the digest checked is that one: a byte changed before the read is refused, as before.
    damaged = bytearray(original)
    damaged[-1] ^= 1
    (packed / "index.bfi").write_bytes(bytes(damaged))
    with pytest.raises(IndexFormatError, match="checksum mismatch"):
        PackedDataset(packed, copies=copies)
