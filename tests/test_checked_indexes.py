"""The record of checked indexes: a re-open of the same index by the same code skips the contents' checks,
and nothing else does (another index, another code version, a damaged record, a directory not the user's)."""

from __future__ import annotations

import os
import time

import pytest

import blockfs
import blockfs.core.index as index_module
from blockfs.core import checked_indexes
from blockfs.core.checked_indexes import CheckedIndexes
from blockfs.core.dataset import PackedDataset
from blockfs.core.format import INDEX_NAME
from blockfs.errors import IndexFormatError


@pytest.fixture
def checks(monkeypatch):
    """Counts the calls of the index's contents checks (still running them)."""
    calls = []
    real = index_module.validate_arrays

    def counting(*args, **kwargs):
        calls.append(args[1])
        return real(*args, **kwargs)

    monkeypatch.setattr(index_module, "validate_arrays", counting)
    return calls


@pytest.fixture
def packed(tmp_path, edge_tree):
    blockfs.pack(edge_tree, tmp_path / "p", block_size=2000)
    return tmp_path / "p"


def open_twice(packed, record) -> list[bool]:
    skipped = []
    for _ in range(2):
        with PackedDataset(packed, checked=record) as ds:
            skipped.append(ds.index.checks_skipped)
    return skipped


def digest_of(packed) -> str:
    with PackedDataset(packed) as ds:
        return ds.metadata["index"]["blake3"]


def test_a_second_open_of_the_same_index_skips_the_checks_and_nothing_else_does(packed, tmp_path, checks):
    record = CheckedIndexes(tmp_path / "record")
    with PackedDataset(packed, checked=record) as ds:  # checked now, and recorded
        assert (ds.index.checks_skipped, ds.index.checks_recorded) == (False, True)
    with PackedDataset(packed, checked=record) as ds:
        assert (ds.index.checks_skipped, ds.index.checks_recorded) == (True, False)
    assert len(checks) == 1
    assert (tmp_path / "record").stat().st_mode & 0o777 == 0o700
    # Without a record (every command but mount and plan), always checked.
    with PackedDataset(packed) as ds:
        assert not ds.index.checks_skipped and not ds.index.checks_recorded
    assert len(checks) == 2


def test_another_index_is_checked(tmp_path, edge_tree, checks):
    record = CheckedIndexes(tmp_path / "record")
    blockfs.pack(edge_tree, tmp_path / "a", block_size=2000)
    with open(os.path.join(edge_tree, b"one-more"), "wb") as f:
        f.write(b"another file, another index")
    blockfs.pack(edge_tree, tmp_path / "b", block_size=2000)
    assert digest_of(tmp_path / "a") != digest_of(tmp_path / "b")
    checks.clear()
    assert open_twice(tmp_path / "a", record) == [False, True]
    assert open_twice(tmp_path / "b", record) == [False, True]
    assert len(checks) == 2


def test_a_record_of_other_check_code_is_ignored(packed, tmp_path, checks, monkeypatch):
    record = CheckedIndexes(tmp_path / "record")
    open_twice(packed, record)
    monkeypatch.setattr(checked_indexes, "_tag", "0.1.0-other-check-code")
    assert open_twice(packed, record) == [False, True]
    assert len(checks) == 2


def test_the_check_code_tag_follows_the_check_modules_source():
    tag = checked_indexes.code_tag()
    assert tag.startswith(blockfs.__version__ + "-") and len(tag) > len(blockfs.__version__) + 16
    assert set(checked_indexes._CHECK_MODULES) >= {"index_checks", "treecheck", "index_format"}


@pytest.mark.parametrize("damage", ["garbage", "truncated", "empty", "directory", "link"])
def test_a_damaged_record_is_ignored_and_written_again(packed, tmp_path, checks, damage):
    record = CheckedIndexes(tmp_path / "record")
    open_twice(packed, record)
    entry = tmp_path / "record" / digest_of(packed)
    good = entry.read_bytes()
    entry.unlink()
    if damage == "garbage":
        entry.write_bytes(good.replace(b"checked", b"chucked"))
    elif damage == "truncated":
        entry.write_bytes(good[:-5])
    elif damage == "empty":
        entry.write_bytes(b"")
    elif damage == "directory":
        entry.mkdir()
    else:
        (tmp_path / "elsewhere").write_bytes(good)
        entry.symlink_to(tmp_path / "elsewhere")
    checks.clear()
    with PackedDataset(packed, checked=record) as ds:
        assert not ds.index.checks_skipped
    assert len(checks) == 1
    if damage != "directory":  # a directory in the way stays (rename cannot replace it); checked every time
        assert entry.is_file() and not entry.is_symlink() and entry.read_bytes() == good
        assert (tmp_path / "elsewhere").exists() or damage != "link"


def test_a_record_does_not_excuse_an_index_whose_digest_is_wrong(packed, tmp_path):
    record = CheckedIndexes(tmp_path / "record")
    open_twice(packed, record)
    index = packed / INDEX_NAME
    data = bytearray(index.read_bytes())
    data[-1] ^= 1
    index.write_bytes(bytes(data))
    with pytest.raises(IndexFormatError, match="checksum mismatch"):
        PackedDataset(packed, checked=record)


@pytest.mark.parametrize("unsafe", ["link", "writable", "foreign"])
def test_a_record_directory_not_the_users_own_is_neither_read_nor_written(packed, tmp_path, checks, unsafe):
    real = tmp_path / "real"
    real.mkdir(mode=0o700)
    where = tmp_path / "record"
    if unsafe == "link":
        where.symlink_to(real)
    elif unsafe == "writable":
        where, real = real, real
        os.chmod(real, 0o777)
    else:
        if os.geteuid() != 0:
            pytest.skip("chown to another user needs root")
        os.chown(real, 12345, 12345)
        where = real
    # Even a record that says "checked" there is not believed.
    (real / digest_of(packed)).write_bytes(checked_indexes.CheckedIndexes._content(digest_of(packed)))
    before = sorted(os.listdir(real))
    checks.clear()
    assert open_twice(packed, CheckedIndexes(where)) == [False, False]
    assert len(checks) == 2
    assert sorted(os.listdir(real)) == before  # nothing written
    with PackedDataset(packed, checked=CheckedIndexes(where)) as ds:
        assert not ds.index.checks_recorded  # and the open says so


def test_the_default_directory(monkeypatch, tmp_path):
    monkeypatch.setenv("BLOCKFS_CHECKED_DIR", "")
    assert CheckedIndexes.default() is None
    monkeypatch.delenv("BLOCKFS_CHECKED_DIR")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert checked_indexes.default_directory() == str(tmp_path / "blockfs" / "checked-indexes")
    monkeypatch.setenv("XDG_CACHE_HOME", "relative")
    assert checked_indexes.default_directory() == os.path.expanduser("~/.cache/blockfs/checked-indexes")


def test_only_the_newest_records_are_kept(packed, tmp_path, monkeypatch):
    monkeypatch.setattr(checked_indexes, "KEPT", 3)
    directory = tmp_path / "record"
    directory.mkdir(mode=0o700)
    for i in range(5):
        path = directory / f"{i:064x}"
        path.write_bytes(b"old")
        os.utime(path, ns=(i * 10**9, i * 10**9))
    CheckedIndexes(directory).add(digest_of(packed))
    assert sorted(os.listdir(directory)) == sorted([f"{3:064x}", f"{4:064x}", digest_of(packed)])


@pytest.mark.fuse
def test_the_mount_log_says_how_long_the_open_took_and_whether_the_checks_ran(tmp_path, edge_tree, monkeypatch):
    """Through a real mount: the first mount of an index never checked here says its paths' checks were left
    for later, then that they passed and were recorded; the next that every check was skipped; and a mount
    with no record that every mount runs them."""
    from capability import has_fuse, require
    from mountutil import mounted

    require(has_fuse(), "needs FUSE")
    monkeypatch.setenv(checked_indexes.DIRECTORY_ENV, str(tmp_path / "packs-record"))  # what the pack records
    blockfs.pack(edge_tree, tmp_path / "p", block_size=2000, fsync=False)
    with PackedDataset(tmp_path / "p") as ds:
        entries = ds.index.n_entries
    monkeypatch.setenv(checked_indexes.DIRECTORY_ENV, str(tmp_path / "mounts-record"))

    def opened(n: int, then: str | None = None) -> str:
        """The mount's 'dataset opened' line; with ``then``, once a later line holds it too (polled)."""
        with mounted(tmp_path / "p", tmp_path / f"mnt{n}") as m:
            deadline = time.monotonic() + 30
            while then is not None and then not in m.log_text() and time.monotonic() < deadline:
                time.sleep(0.02)
            text = m.log_text()
        lines = [line for line in text.splitlines() if "dataset opened in " in line]
        assert len(lines) == 1 and f" s ({entries:,} entries); " in lines[0], lines
        assert then is None or then in text, text
        return lines[0]

    first = opened(1, then=f"the paths of the dataset's {entries:,} entries checked in ")
    assert "every check of its contents run but its paths', checked as each directory is first used" in first
    assert "once the mount serves, then recorded: the next mount of it here skips them" in first
    assert "its checks skipped: it passed them on this machine before" in opened(2)
    monkeypatch.setenv(checked_indexes.DIRECTORY_ENV, "")  # no record kept
    assert "once the mount serves (recorded nowhere: every mount of it runs them)" in opened(3)
