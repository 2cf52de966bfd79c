"""``DiskTier`` under another user and a full disk: a ``--disk-cache DIR`` that is not this user's alone is
refused in one line; links planted inside it are never followed, written through or deleted through; only
the tier's own names are deleted; a full disk stops copying with one log line naming the directory."""

from __future__ import annotations

import contextlib
import logging
import os
import subprocess

import pytest
from capability import require

from blockfs.storage.disk_tier import DiskTier
from blockfs.storage.owned import UnsafeDirectoryError

KEY = "0123456789abcdef0123"
OTHER_KEY = "fedcba9876543210fedc"
URL = "s3://bucket/ds"
NOBODY = 65534


@pytest.fixture
def victim(tmp_path):
    """A directory and a file that no disk tier may touch, with what they hold now."""
    place = tmp_path / "victim"
    place.mkdir()
    (place / "precious.txt").write_bytes(b"keep me\n")
    target = tmp_path / "root-only"
    target.write_bytes(b"root's secret\n")
    target.chmod(0o600)
    return place, target


def untouched(victim) -> None:
    place, target = victim
    assert sorted(os.listdir(place)) == ["precious.txt"]
    assert (place / "precious.txt").read_bytes() == b"keep me\n"
    assert target.read_bytes() == b"root's secret\n"
    assert os.stat(target).st_mode & 0o777 == 0o600


def one_line(e: BaseException, *words: str) -> str:
    text = str(e)
    assert "\n" not in text and all(w in text for w in words), text
    return text


def test_a_directory_of_another_user_is_refused_and_nothing_is_written_in_it(tmp_path):
    require(os.geteuid() == 0, "root (to give a directory to another user)")
    disk = tmp_path / "disk"
    disk.mkdir()
    os.chown(disk, NOBODY, NOBODY)
    with pytest.raises(UnsafeDirectoryError) as raised:
        DiskTier(disk, 1 << 20, KEY, URL)
    one_line(raised.value, str(disk), f"uid {NOBODY}", "--disk-cache")
    assert os.listdir(disk) == []


def test_a_directory_others_may_write_in_or_a_link_to_one_is_refused(tmp_path):
    disk = tmp_path / "disk"
    disk.mkdir()
    disk.chmod(0o777)
    with pytest.raises(UnsafeDirectoryError) as raised:
        DiskTier(disk, 1 << 20, KEY, URL)
    one_line(raised.value, str(disk), "writable by other users", "chmod go-w")
    real = tmp_path / "real"
    real.mkdir()
    (tmp_path / "link").symlink_to(real)
    with pytest.raises(UnsafeDirectoryError) as raised:
        DiskTier(tmp_path / "link", 1 << 20, KEY, URL)
    one_line(raised.value, "link", "symbolic link")
    assert os.listdir(real) == []


def test_a_directory_inside_one_another_user_can_change_is_refused(tmp_path):
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)  # no sticky bit: anyone may rename DIR away and put another in its place
    with pytest.raises(UnsafeDirectoryError) as raised:
        DiskTier(shared / "disk", 1 << 20, KEY, URL)
    one_line(raised.value, str(shared), "another user can change")


def test_a_planted_blocks_link_is_refused_and_the_victim_is_untouched(tmp_path, victim):
    disk = tmp_path / "disk"
    (disk / KEY).mkdir(parents=True)
    os.symlink(victim[0], disk / KEY / "blocks")
    os.symlink(victim[1], disk / KEY / "source")
    with pytest.raises(UnsafeDirectoryError) as raised:
        DiskTier(disk, 1 << 30, KEY, URL)
    one_line(raised.value, os.path.join(str(disk), KEY, "blocks"), "symbolic link", "remove it")
    untouched(victim)


def test_a_planted_source_link_is_replaced_never_written_through(tmp_path, victim):
    disk = tmp_path / "disk"
    (disk / KEY / "blocks").mkdir(parents=True)
    os.symlink(victim[1], disk / KEY / "source")
    tier = DiskTier(disk, 1 << 30, KEY, URL)
    try:
        assert not os.path.islink(disk / KEY / "source")
        assert (disk / KEY / "source").read_text() == URL
    finally:
        tier.close()
    untouched(victim)


def test_forgetting_an_older_pack_deletes_only_the_tiers_own_names(tmp_path, victim):
    disk = tmp_path / "disk"
    old = disk / OTHER_KEY
    (old).mkdir(parents=True)
    (old / "source").write_text(URL)
    (old / "blockfs.json").write_text("{}")
    os.symlink(victim[0], old / "blocks")  # an older pack whose blocks directory is a link
    os.symlink(victim[1], disk / "aaaaaaaaaaaaaaaaaaaa")  # a key-shaped link to a file
    third = disk / "bbbbbbbbbbbbbbbbbbbb"
    third.mkdir()
    os.symlink(victim[1], third / "source")  # a source that is a link: never read, never followed
    tier = DiskTier(disk, 1 << 30, KEY, URL)
    tier.close()
    untouched(victim)
    assert not (old / "blockfs.json").exists() and not (old / "source").exists()
    assert os.path.islink(old / "blocks")  # not the tier's: left where it is, and its target untouched
    assert os.path.islink(third / "source")


def test_only_block_copies_and_temporary_files_are_deleted_at_open(tmp_path):
    disk = tmp_path / "disk"
    blocks = disk / KEY / "blocks"
    blocks.mkdir(parents=True)
    (blocks / "00000003.blk").write_bytes(b"x" * 10)
    (blocks / "00000004.blk.tmp-12-34").write_bytes(b"half")
    (blocks / "notes.txt").write_bytes(b"someone's")
    tier = DiskTier(disk, 1 << 30, KEY, URL)
    try:
        assert tier.has(3) and not tier.has(4)
        assert sorted(os.listdir(blocks)) == ["00000003.blk", "notes.txt"]
    finally:
        tier.close()


def test_a_copy_replaced_by_a_link_is_never_read_through(tmp_path, victim):
    disk = tmp_path / "disk"
    tier = DiskTier(disk, 1 << 30, KEY, URL)
    try:
        assert tier.put_block(0, b"head", memoryview(b"data"))
        os.unlink(tier.path(0))
        os.symlink(victim[1], tier.path(0))
        with pytest.raises(OSError):
            tier.open_copy(0)
        tier.remove(0)
        assert not os.path.lexists(tier.path(0))
    finally:
        tier.close()
    untouched(victim)


@contextlib.contextmanager
def tiny_tmpfs(where, size: str):
    """A tmpfs of ``size`` at ``where``, always unmounted."""
    require(os.geteuid() == 0, "root (to mount a tmpfs)")
    where.mkdir()
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size},mode=0700", "tmpfs", str(where)], capture_output=True, text=True
    )
    require(done.returncode == 0, f"mount -t tmpfs ({done.stderr.strip()})")
    try:
        yield where
    finally:
        subprocess.run(["umount", "-l", str(where)], capture_output=True)


def test_a_full_disk_stops_copying_with_one_line_naming_the_directory(tmp_path, caplog):
    with tiny_tmpfs(tmp_path / "small", "256k") as disk:
        tier = DiskTier(disk, 1 << 30, KEY, URL)
        try:
            block = memoryview(os.urandom(40 << 10))
            with caplog.at_level(logging.WARNING, logger="blockfs.storage.disk_tier"):
                kept = [tier.put_block(b, b"", block) for b in range(20)]
            assert kept[0] and not all(kept)
            lines = [r.getMessage() for r in caplog.records]
            assert len(lines) == 1 and str(disk) in lines[0] and "--disk-cache-size" in lines[0], lines
            assert not tier.room_for(1) and tier.budget == tier.stats()["used"]
            assert not any(".tmp-" in n for n in os.listdir(os.path.join(tier.root, "blocks")))
        finally:
            tier.close()


def test_a_full_disk_when_the_index_is_written_names_the_path_and_the_option(tmp_path):
    with tiny_tmpfs(tmp_path / "small", "64k") as disk:
        tier = DiskTier(disk, 1 << 30, KEY, URL)
        try:
            with pytest.raises(OSError) as raised:
                tier.keep("index.bfi", os.urandom(1 << 20))
            one_line(raised.value, os.path.join(str(disk), KEY, "index.bfi"), "--disk-cache")
        finally:
            tier.close()


def test_the_command_line_refuses_another_users_directory_in_one_line(s3, tmp_path):
    require(os.geteuid() == 0, "root (to give a directory to another user)")
    import sys

    import blockfs

    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "a.bin").write_bytes(b"a" * 100)
    url = f"s3://{s3.new_bucket()}/ds"
    blockfs.pack(tmp_path / "src", url, fsync=False)
    disk = tmp_path / "disk"
    disk.mkdir()
    os.chown(disk, NOBODY, NOBODY)
    done = subprocess.run(
        [sys.executable, "-m", "blockfs", "plan", url, "--disk-cache", str(disk)], capture_output=True, text=True
    )
    assert done.returncode == 2 and len(done.stderr.strip().splitlines()) == 1, done.stderr
    assert str(disk) in done.stderr and f"uid {NOBODY}" in done.stderr
    assert os.listdir(disk) == []
