"""Issue 17 #4 and #5: nothing written outside OUT, nothing read from outside SRC.

A forged index must not make ``unpack`` write outside OUT, and is refused when opened.

Each forged dataset keeps ``blockfs.json``'s index CRC right, so only the tree checks can tell.  The
``unpack`` tests also switch the open-time tree check off, to show that ``unpack`` is safe on its own.
"""

from __future__ import annotations

import os
import threading

import numpy as np
import pytest
from fuzz.indexutil import entry_of, index_arrays, rename_entry, rewrite_index
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from treeutil import make_edge_tree

from blockfs import open_dataset
from blockfs.cli import main
from blockfs.core import treecheck
from blockfs.core.directory_checks import DirectoryChecks
from blockfs.core.index import KIND_DIR, KIND_FILE, KIND_SYMLINK
from blockfs.core.unpack import unpack
from blockfs.errors import BlockfsError, IndexFormatError, SourceError
from blockfs.packing.packer import pack
from blockfs.packing.sources import DirectorySource


@pytest.fixture
def hostile(tmp_path):
    """A packed tree with a symlink to a victim directory (``l``) and one to a victim file (``r``)."""
    victim_dir = tmp_path / "victim_dir"
    victim_dir.mkdir()
    victim_file = tmp_path / "victim_file"
    victim_file.write_bytes(b"precious")
    src = tmp_path / "src"
    for rel, data in ((b"a/x", b"inside a"), (b"b/y", b"inside b"), (b"c/d/z", b"deep"), (b"s", b"plain s")):
        path = os.path.join(os.fsencode(src), rel)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "wb") as f:
            f.write(data)
    os.symlink(victim_dir, src / "l")
    os.symlink(victim_file, src / "r")
    pack(src, tmp_path / "ds", labels="none", fsync=False, workers=1)
    return tmp_path


def _no_tree_check(monkeypatch) -> None:
    monkeypatch.setattr("blockfs.core.index_checks.check_tree", lambda arrays, where, release=None: None)


def _dir_becomes_symlink(arrays) -> None:
    """Directory ``a`` (holding ``a/x``) turns into the symlink ``l`` -> victim_dir."""
    a, link = entry_of(arrays, b"a"), entry_of(arrays, b"l")
    arrays["kind"][a] = KIND_SYMLINK
    arrays["slot"][a] = arrays["slot"][link]


def _symlink_and_file_share_a_name(arrays) -> None:
    """The symlink ``r`` -> victim_file is renamed ``s``, the name of the file listed after it."""
    rename_entry(arrays, b"r", b"s")


def test_open_refuses_an_entry_beneath_a_symlink(hostile):
    rewrite_index(hostile / "ds", _dir_becomes_symlink)
    with pytest.raises(IndexFormatError, match=r"'a/x'.*not a directory"):
        open_dataset(hostile / "ds")


def test_open_refuses_two_entries_with_one_name(hostile):
    rewrite_index(hostile / "ds", _symlink_and_file_share_a_name)
    with pytest.raises(IndexFormatError, match=r"\('s'\) repeats"):
        open_dataset(hostile / "ds")


@pytest.mark.parametrize("forge", [_dir_becomes_symlink, _symlink_and_file_share_a_name])
def test_unpack_of_a_forged_index_fails_from_the_cli_and_writes_nothing_outside(hostile, forge, capsys):
    rewrite_index(hostile / "ds", forge)
    assert main(["unpack", str(hostile / "ds"), str(hostile / "out")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "index" in err and "Traceback" not in err
    assert os.listdir(hostile / "victim_dir") == []
    assert (hostile / "victim_file").read_bytes() == b"precious"


def test_unpack_does_not_write_through_a_symlink_even_unchecked(hostile, monkeypatch):
    rewrite_index(hostile / "ds", _dir_becomes_symlink)
    _no_tree_check(monkeypatch)
    with open_dataset(hostile / "ds") as ds, pytest.raises(BlockfsError, match=r"'a/x'"):
        unpack(ds, hostile / "out")
    assert os.listdir(hostile / "victim_dir") == []
    assert not os.path.lexists(hostile / "out" / "a")  # the symlink was not made before its "child"


def test_unpack_does_not_overwrite_through_a_repeated_name_even_unchecked(hostile, monkeypatch):
    rewrite_index(hostile / "ds", _symlink_and_file_share_a_name)
    _no_tree_check(monkeypatch)
    with open_dataset(hostile / "ds") as ds, pytest.raises(BlockfsError, match=r"'s'.*already exists"):
        unpack(ds, hostile / "out")
    assert (hostile / "victim_file").read_bytes() == b"precious"
    assert (hostile / "out" / "s").read_bytes() == b"plain s"  # the file, not the link, holds the name


def test_unpack_does_not_follow_a_symlink_that_appears_under_out(hostile, monkeypatch):
    """Even a symlink placed in OUT by someone else while unpacking is not followed (O_NOFOLLOW walk)."""
    out = hostile / "out"
    with open_dataset(hostile / "ds") as ds:
        original = ds.read_entry

        def swap_then_read(e, offset=0, size=-1):
            if ds.path_of(e) == b"a/x" and not os.path.islink(out / "c"):
                os.rmdir(out / "c")  # "c" exists (empty) by now: directories come before files
                os.symlink(hostile / "victim_dir", out / "c")
            return original(e, offset, size)

        monkeypatch.setattr(ds, "read_entry", swap_then_read)
        with pytest.raises(BlockfsError, match=r"'c/d'.*on its path"):
            unpack(ds, out)
    assert os.listdir(hostile / "victim_dir") == []


@pytest.mark.parametrize(
    "moved, new_parent, why",
    [
        (b"b/y", b"a", "not a name inside its parent"),
        (b"c/d/z", b"c", "not a name inside its parent"),
        (b"a/x", b"s", "not a directory"),
    ],
)
def test_open_refuses_an_entry_not_named_inside_its_parent(hostile, moved, new_parent, why):
    def reparent(arrays):
        arrays["parent"][entry_of(arrays, moved)] = entry_of(arrays, new_parent)

    rewrite_index(hostile / "ds", reparent)
    with pytest.raises(IndexFormatError, match=rf"{moved.decode()!r}\) .*{why}"):
        open_dataset(hostile / "ds")


def test_open_refuses_a_directory_listing_that_disagrees_with_the_parents(hostile):
    def swap_listings(arrays):
        a, b = entry_of(arrays, b"a"), entry_of(arrays, b"b")
        arrays["child_start"][[a, b]] = arrays["child_start"][[b, a]]

    rewrite_index(hostile / "ds", swap_listings)
    with pytest.raises(IndexFormatError, match="is listed in directory entry"):
        open_dataset(hostile / "ds")


# --- the vectorised check against a plain one, on random damage -----------------------------------
def reference_tree_problem(a) -> str | None:
    """The rules of :mod:`blockfs.core.treecheck`, written as a plain loop: the first rule broken."""
    n = a["kind"].size
    off, blob = a["path_offsets"], a["paths"].tobytes()
    path = [blob[int(off[e]) : int(off[e + 1]) - 1] for e in range(n)]
    if path[0] != b"":
        return "root path"
    for e in range(1, n):
        p = int(a["parent"][e])
        if p >= n or a["kind"][p] != KIND_DIR:
            return "parent"
        prefix = path[p] + b"/" if path[p] else b""
        name = path[e][len(prefix) :]
        if not path[e].startswith(prefix) or not name or b"/" in name:
            return "path"
    listed: dict[int, int] = {}
    for d in range(n):
        start, count = int(a["child_start"][d]), int(a["child_count"][d])
        if count and a["kind"][d] != KIND_DIR:
            return "listing"
        for e in range(start, start + count):
            if e in listed or not 0 < e < n:
                return "listing"
            listed[e] = d
    if set(listed) != set(range(1, n)) or any(int(a["parent"][e]) != d for e, d in listed.items()):
        return "listing"
    if any(a["parent"][e] == a["parent"][e + 1] and not path[e] < path[e + 1] for e in range(1, n - 1)):
        return "siblings"
    for e in range(n):
        first = int(a["ino"][e]) - 1
        if first == e:
            continue
        if not 0 <= first < n or a["kind"][e] != KIND_FILE or a["kind"][first] != KIND_FILE:
            return "inode"
        if int(a["ino"][first]) != first + 1 or (a["block"][e], a["slot"][e]) != (a["block"][first], a["slot"][first]):
            return "inode"
    return None


@pytest.fixture(scope="module")
def edge_arrays(tmp_path_factory):
    root = tmp_path_factory.mktemp("edge")
    pack(make_edge_tree(root / "src"), root / "ds", labels="none", fsync=False, workers=1)
    arrays = index_arrays(root / "ds")
    assert reference_tree_problem(arrays) is None
    return arrays


COLUMNS = ("parent", "child_start", "child_count", "ino", "kind", "block", "paths")


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    st.lists(st.tuples(st.sampled_from(COLUMNS), st.integers(0, 1 << 16), st.integers(0, 60)), min_size=1, max_size=3)
)
def test_tree_check_agrees_with_a_plain_loop_on_random_damage(edge_arrays, changes):
    a = _damaged(edge_arrays, changes)
    expected = reference_tree_problem(a)
    try:
        treecheck.check_tree(a, "index X")
    except IndexFormatError as e:
        assert expected is not None, f"refused a valid tree: {e}"
        assert str(e).startswith("index X: ")
    else:
        assert expected is None, f"accepted a tree with a bad {expected}"


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    st.lists(st.tuples(st.sampled_from(COLUMNS), st.integers(0, 1 << 16), st.integers(0, 60)), min_size=1, max_size=3)
)
def test_a_mounts_deferred_checks_refuse_exactly_what_the_whole_check_refuses(edge_arrays, changes):
    """The shape at open, then every directory on first use, refuse what the plain loop does; and the
    whole-tree pass a mount runs once serving (``check_all``) agrees with the directories' verdicts."""
    a = _damaged(edge_arrays, changes)
    expected = reference_tree_problem(a)
    refused = []
    try:
        tree = treecheck.check_tree_shape(a, "index X")
    except IndexFormatError as e:
        refused.append(str(e))
    else:
        checks = DirectoryChecks(tree)
        for d in np.flatnonzero(a["kind"] == KIND_DIR):
            try:
                checks.ensure(int(d))
            except IndexFormatError as e:
                refused.append(str(e))
        assert checks.check_all(threading.Event()) == (not refused)
    assert bool(refused) == (expected is not None), (expected, refused)
    assert all(message.startswith("index X: ") for message in refused)


def _damaged(edge_arrays, changes):
    a = {k: v.copy() for k, v in edge_arrays.items()}
    n = a["kind"].size
    for column, where, value in changes:
        if column == "paths":  # any byte but a NUL, for any byte but a NUL (the path table's own check)
            at = 1 + where % (a["paths"].size - 1)
            if a["paths"][at]:
                a["paths"][at] = b"/ab.x\xff"[value % 6]
        elif column == "kind":
            a["kind"][where % n] = value % 3
        else:
            a[column][where % n] = value % (n + 2)
    return a


# --- issue 17 #5: pack reads nothing from outside SRC, whatever changes under it -------------------
@pytest.fixture
def racy(tmp_path):
    """SRC with d/x, d/y, e/z, and a secret directory beside it (same filesystem: it can be hard-linked)."""
    for rel, data in (
        ("src/d/x", b"public x"),
        ("src/d/y", b"public y"),
        ("src/e/z", b"public z"),
        ("secret/x", b"SECRET x"),
        ("secret/y", b"SECRET y"),
    ):
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_bytes(data)
    return tmp_path


def _dir_to_symlink(root):
    os.rename(root / "src" / "d", root / "d_old")
    os.symlink(root / "secret", root / "src" / "d")


def _file_to_hard_link(root):
    os.unlink(root / "src" / "d" / "x")
    os.link(root / "secret" / "x", root / "src" / "d" / "x")


def _nothing_secret_in(dest) -> None:
    for dirpath, _, names in os.walk(dest):
        for name in names:
            with open(os.path.join(dirpath, name), "rb") as f:
                assert b"SECRET" not in f.read(), os.path.join(dirpath, name)


class _SwapAfterWalk(DirectorySource):
    """A source whose tree is changed between the walk and the reads, as a racing user would."""

    def __init__(self, root, swap, use_openat2: bool) -> None:
        super().__init__(root / "src")
        self._swap, self._swap_root = swap, root
        if not use_openat2:
            self._openat2 = False  # the component-by-component fallback

    def entries(self):
        yield from super().entries()
        self._swap(self._swap_root)


@pytest.mark.parametrize("use_openat2", [True, False], ids=["openat2", "per-component"])
@pytest.mark.parametrize("workers", [1, 2], ids=["threads", "forked"])
@pytest.mark.parametrize("swap", [_dir_to_symlink, _file_to_hard_link])
def test_pack_reads_nothing_swapped_in_after_the_walk(racy, swap, workers, use_openat2):
    if use_openat2 and not _SwapAfterWalk(racy, swap, True)._openat2:
        pytest.skip("this kernel has no openat2")
    source = _SwapAfterWalk(racy, swap, use_openat2)
    with pytest.raises(SourceError, match=r"'d/[xy]' in .* is not what the walk listed"):
        pack(source, racy / "ds", files_per_block=1, workers=workers, fsync=False)
    _nothing_secret_in(racy / "ds")


@pytest.mark.parametrize("workers", [1, 2], ids=["threads", "forked"])
def test_skip_unreadable_leaves_swapped_files_out(racy, workers):
    pack(
        _SwapAfterWalk(racy, _dir_to_symlink, True),
        racy / "ds",
        files_per_block=1,
        workers=workers,
        fsync=False,
        skip_unreadable=True,
    )
    _nothing_secret_in(racy / "ds")
    with open_dataset(racy / "ds") as ds:
        assert ds.read_entry(ds.lookup("e/z")) == b"public z"
        assert ds.index.find(b"d/x") < 0 and ds.index.find(b"d/y") < 0


def test_the_walk_does_not_list_a_directory_swapped_during_it(racy, monkeypatch):
    listed = DirectorySource._entry

    def swap_after_listing_d(self, path, *rest):
        entry = listed(self, path, *rest)
        if path == b"d":
            _dir_to_symlink(racy)
        return entry

    monkeypatch.setattr(DirectorySource, "_entry", swap_after_listing_d)
    with pytest.raises(SourceError, match=r"'d' in .* is not what the walk listed"):
        pack(racy / "src", racy / "ds", fsync=False, workers=1)
    assert not os.path.exists(racy / "ds")
