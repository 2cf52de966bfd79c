"""The index: lookups, listings, and damage or hostile paths rejected at open."""

from __future__ import annotations

import os
import stat
import tempfile

import numpy as np
import pytest
from fuzz.indexutil import patch_array as _patch
from fuzz.indexutil import rewrite_toc
from hypothesis import given, settings
from hypothesis import strategies as st

import blockfs
from blockfs.core.index import KIND_DIR, PackedIndex
from blockfs.core.index_checks import find_forbidden_component
from blockfs.errors import IndexFormatError


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
        kids = idx.children(entry)
        start, length = idx.name_spans(entry, kids.start, kids.stop)
        table = idx.arrays["paths"].tobytes()
        assert [table[a : a + n] for a, n in zip(start, length, strict=True)] == idx.names(entry)
        assert idx.joined_names(entry) == b"".join(n + b"\0" for n in idx.names(entry))
        for name in dirnames + filenames:
            rel = os.path.join(rel_dir, name) if rel_dir else name
            assert idx.path(idx.find(rel)) == rel
            seen += 1
    assert seen == idx.n_entries - 1
    assert idx.find(b"class_a/missing") == -1 and idx.find(b"class_a/one.txt/x") == -1


def test_a_name_is_found_in_its_directory_as_its_path_is_found(packed, monkeypatch):
    # find_child hashes the name from its directory's kept hash and matches by parent and name: the same entry
    # as find() of the path, for every entry, and -1 for a missing name, a name of another directory, a path
    # of several components and "." or ".."; with each directory's path built once, whatever the lookups.
    from blockfs.core import index as index_module

    idx = PackedIndex(packed / "index.bfi")
    asked = [
        (idx.find(p.rpartition(b"/")[0]), p.rpartition(b"/")[2], e)
        for e in range(1, idx.n_entries)
        for p in [idx.path(e)]
    ]
    built = []
    path = PackedIndex.path
    monkeypatch.setattr(PackedIndex, "path", lambda self, e: built.append(e) or path(self, e))
    for _ in range(2):
        for parent, name, e in asked:
            assert idx.find_child(parent, name) == e, name
    assert sorted(built) == sorted({parent for parent, _, _ in asked} - {0})  # each directory's once; the root's never
    monkeypatch.setattr(PackedIndex, "path", path)
    a = idx.find(b"class_a")
    for parent, name in ((a, b"missing"), (0, b"one.txt"), (0, b"class_a/one.txt"), (a, b"."), (a, b"..")):
        assert idx.find_child(parent, name) == -1, (parent, name)
    # The kept hashes are bounded: past DIR_SEEDS_KEPT directories they start afresh, and lookups still agree.
    monkeypatch.setattr(index_module, "DIR_SEEDS_KEPT", 1)
    fresh = PackedIndex(packed / "index.bfi")
    for parent, name, e in asked:
        assert fresh.find_child(parent, name) == e, name
    assert len(fresh._dir_seeds) == 1


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


def test_an_object_dtype_in_the_table_of_contents_is_an_index_format_error(packed):
    # Issue 12: this raised a bare ValueError from NumPy.
    rewrite_toc(packed / "index.bfi", lambda toc: toc["arrays"]["size"].__setitem__(0, "|O"))
    with pytest.raises(IndexFormatError, match="array 'size' has dtype '|O'"):
        PackedIndex(packed / "index.bfi")


# --- property: any tree packs to an index that answers exactly as the tree does ---------------------------
NAME_PARTS = [b"a", b"B", b"z", b".", b" ", b"-", b"\n", b"\xff", b"\xc3\x28", "é".encode()]
names = (
    st.lists(st.sampled_from(NAME_PARTS), min_size=1, max_size=3).map(b"".join).filter(lambda n: n not in (b".", b".."))
)
# (kind, which existing directory is the parent, name, which existing file a hard link names / content size)
steps = st.lists(
    st.tuples(st.sampled_from(["file", "dir", "symlink", "hardlink"]), st.integers(0, 50), names, st.integers(0, 300)),
    min_size=1,
    max_size=25,
)


def _build_tree(root: bytes, plan) -> None:
    dirs, files = [root], []
    for kind, which, name, n in plan:
        path = os.path.join(dirs[which % len(dirs)], name)
        if os.path.lexists(path):
            continue
        if kind == "dir":
            os.mkdir(path)
            dirs.append(path)
        elif kind == "symlink":
            os.symlink(name * (n % 3 + 1), path)  # dangling or not, relative: stored, never followed
        elif kind == "hardlink" and files:
            os.link(files[n % len(files)], path)
        else:
            with open(path, "wb") as f:
                f.write(os.urandom(n))
            files.append(path)


@settings(max_examples=30, deadline=None)
@given(plan=steps)
def test_lookups_listings_nlink_and_inodes_match_the_tree(plan):
    with tempfile.TemporaryDirectory(prefix="blockfs-prop-") as tmp:
        src, dest = os.path.join(os.fsencode(tmp), b"src"), os.path.join(tmp, "p")
        os.mkdir(src)
        _build_tree(src, plan)
        blockfs.pack(src, dest, files_per_block=3, fsync=False)
        with blockfs.open_dataset(dest) as ds:
            _check_against_tree(ds, src)


def _check_against_tree(ds, src: bytes) -> None:
    packed_ino_of: dict[int, int] = {}  # source inode -> packed inode: must be one-to-one
    seen = 0
    for dirpath, dirnames, filenames in os.walk(src):
        rel_dir = os.path.relpath(dirpath, src)
        rel_dir = b"" if rel_dir == b"." else rel_dir
        assert ds.listdir(rel_dir) == sorted(os.listdir(dirpath))
        for name in ([b""] if not rel_dir else []) + dirnames + filenames:
            rel = os.path.join(rel_dir, name) if name else rel_dir
            real, st_ = os.lstat(os.path.join(src, rel)), ds.stat(rel)
            assert ds.path_of(st_.entry) == rel
            assert st_.mode == real.st_mode and st_.mtime_ns == real.st_mtime_ns, rel
            assert st_.nlink == real.st_nlink, rel
            if stat.S_ISREG(real.st_mode):
                assert ds.read(rel) == open(os.path.join(src, rel), "rb").read(), rel
                assert packed_ino_of.setdefault(real.st_ino, st_.ino) == st_.ino, rel
            elif stat.S_ISLNK(real.st_mode):
                assert ds.readlink(rel) == os.readlink(os.path.join(src, rel)), rel
            seen += 1
    assert seen == ds.index.n_entries
    assert len(set(packed_ino_of.values())) == len(packed_ino_of)  # distinct files keep distinct inodes


def _forbidden_by_components(blob: bytes) -> bool:
    """The plain-Python meaning of a forbidden path table: some path, split on "/", has an empty, "." or
    ".." component (the root's empty path, first, excepted)."""
    paths = blob[1:-1].split(b"\0")[1:] if len(blob) > 2 else []
    return any(c in (b"", b".", b"..") for p in paths for c in p.split(b"/"))


@settings(max_examples=300, deadline=None)
@given(
    paths=st.lists(
        st.lists(st.sampled_from([b"a", b".", b"/", b"b."]), min_size=1, max_size=6).map(b"".join), max_size=6
    ),
    piece=st.sampled_from([1, 2, 3, 5, 1 << 20]),
)
def test_forbidden_components_are_found_whatever_the_piece_size(paths, piece):
    blob = b"\0\0" + b"".join(p + b"\0" for p in paths)
    found = find_forbidden_component(np.frombuffer(blob, dtype=np.uint8), piece)
    assert (found >= 0) == _forbidden_by_components(blob), blob
