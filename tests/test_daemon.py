"""A background mount's process under other users: its log goes to a private directory, never through a link
another user planted (in that directory or in the shared temp directory where logs used to go), old logs
are removed, and its secrets reach it through a pipe, never its command line."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
import time

import pytest
from capability import has_fuse, require
from mountutil import release
from polling import wait_until

import blockfs
from blockfs.errors import MountError
from blockfs.serve import daemon as process
from blockfs.serve import mount_files
from blockfs.storage.owned import UnsafeDirectoryError


@pytest.fixture
def private(tmp_path, monkeypatch):
    """``XDG_RUNTIME_DIR`` pointed at a fresh directory: where the default log directory goes."""
    runtime = tmp_path / "runtime"
    runtime.mkdir(mode=0o700)
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(runtime))
    return runtime


@pytest.fixture
def target(tmp_path):
    """A file a link will point at: it must stay as it is."""
    path = tmp_path / "victim"
    path.write_bytes(b"untouched\n")
    path.chmod(0o600)
    return path


def test_the_default_log_directory_is_private_and_a_planted_link_is_never_followed(tmp_path, private, target):
    mnt = tmp_path / "mnt"
    first = mount_files.default_log_path(mnt)
    directory = os.path.dirname(first)
    assert directory == str(private / "blockfs")
    assert stat.S_IMODE(os.stat(directory).st_mode) == 0o700
    os.symlink(target, first)
    path = mount_files.default_log_path(mnt)  # our own name in our own directory: the link is removed
    fd = mount_files.open_log(path)
    try:
        os.write(fd, b"a line\n")
        assert stat.S_IMODE(os.fstat(fd).st_mode) == 0o600
    finally:
        os.close(fd)
    assert not os.path.islink(path) and target.read_bytes() == b"untouched\n"


def test_a_log_path_that_is_a_link_is_refused_in_one_line(tmp_path, target):
    link = tmp_path / "given.log"
    os.symlink(target, link)
    with pytest.raises(MountError) as raised:
        mount_files.open_log(link)
    assert "symbolic link" in str(raised.value) and "\n" not in str(raised.value)
    assert target.read_bytes() == b"untouched\n"


def test_a_log_directory_of_another_user_is_refused(tmp_path, private):
    require(os.geteuid() == 0, "root (to give a directory to another user)")
    (private / "blockfs").mkdir()
    os.chown(private / "blockfs", 65534, 65534)
    with pytest.raises(UnsafeDirectoryError, match="uid 65534"):
        mount_files.default_log_path(tmp_path / "mnt")


def test_old_logs_are_removed(tmp_path, private):
    directory = private / "blockfs"
    directory.mkdir(mode=0o700)
    old, recent, other = directory / "blockfs-old.log", directory / "blockfs-recent.log", directory / "notes.txt"
    for path in (old, recent, other):
        path.write_text("x")
    long_ago = time.time() - (mount_files.LOG_KEEP_DAYS + 1) * 86400
    os.utime(old, (long_ago, long_ago))
    os.utime(other, (long_ago, long_ago))
    mount_files.default_log_path(tmp_path / "mnt")
    assert not old.exists() and recent.exists() and other.exists()


@pytest.mark.fuse
def test_a_background_mount_logs_in_private_and_not_through_the_old_temp_name(tmp_path, private, target):
    require(has_fuse(), "/dev/fuse")
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "a.txt").write_bytes(b"hello\n")
    blockfs.pack(tmp_path / "src", tmp_path / "packed", fsync=False)
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    temp = tmp_path / "tmp"
    temp.mkdir()
    tag = "".join(c if c.isalnum() else "_" for c in str(mnt).strip("/"))[-80:]
    os.symlink(target, temp / f"blockfs-{os.getuid()}-{tag}.log")  # where the log used to go, predictably
    env = dict(os.environ, TMPDIR=str(temp))
    done = subprocess.run(
        [sys.executable, "-m", "blockfs", "mount", str(tmp_path / "packed"), str(mnt)],
        capture_output=True,
        text=True,
        env=env,
    )
    try:
        assert done.returncode == 0, done.stderr
        assert (mnt / "a.txt").read_bytes() == b"hello\n"
        logs = os.listdir(private / "blockfs")
        assert len(logs) == 1 and f"log {private / 'blockfs' / logs[0]}" in done.stdout
        # Read while mounted: a clean unmount removes a log that holds no warning.
        wait_until(lambda: "serving" in (private / "blockfs" / logs[0]).read_text(), "the server's log line")
    finally:
        release(mnt)
    assert target.read_bytes() == b"untouched\n"


def test_umount_of_a_server_that_does_not_answer_stops_waiting_and_unmounts_lazily(tmp_path, monkeypatch, capsys):
    """Issue 29, 2: an unmount command stuck on a live server that does not answer was a traceback (its
    TimeoutExpired uncaught) and the lazy unmount never tried.  Stand-ins for the unmount tools: the plain
    ones never return, the lazy ones detach; ``blockfs umount`` says so in one line and exits 0."""
    from blockfs import cli

    calls, detached = tmp_path / "calls", tmp_path / "detached"
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for tool in ("fusermount3", "fusermount", "umount"):
        script = bin_dir / tool
        script.write_text(
            f'#!/bin/sh\necho "{tool} $1" >> "{calls}"\n'
            f'case "$1" in -uz|-l) touch "{detached}"; exit 0;; esac\nexec sleep 60\n'
        )
        script.chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}:{os.environ['PATH']}")
    monkeypatch.setattr(process, "UNMOUNT_WAIT_S", 0.5)
    monkeypatch.setattr(process, "serving_pid", lambda path: None)
    mnt = str(tmp_path / "mnt")
    live = {"fstype": "fuse.blockfs", "source": "/data/x.blockfs"}
    monkeypatch.setattr(process, "mount_entry", lambda path: None if detached.exists() else live)
    assert cli.main(["umount", mnt]) == 0
    out, err = capsys.readouterr()
    assert (
        out.strip().splitlines()
        == [
            f"unmounted {mnt} lazily: its serving process did not answer, so the mount "
            "is detached and goes once nothing uses it"
        ]
        and not err
    ), (out, err)
    # One plain unmount waited on; no other plain one after it; the lazy one last.
    assert calls.read_text().splitlines() == ["fusermount3 -u", "fusermount3 -uz"]


@pytest.mark.fuse
def test_umount_of_a_symbolic_link_unmounts_the_blockfs_mount_it_leads_to(tmp_path, capsys):
    """As ``blockfs mount`` resolves a linked mount point, ``blockfs umount LINK`` unmounts the mount the link
    leads to (the mount table names the target: the link's own name was 'not mounted')."""
    from mountutil import mounted

    from blockfs import cli

    require(has_fuse(), "/dev/fuse")
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "a.txt").write_bytes(b"hello\n")
    blockfs.pack(tmp_path / "src", tmp_path / "packed", fsync=False)
    mnt, link = tmp_path / "mnt", tmp_path / "link"
    link.symlink_to("mnt")  # relative, as a link often is
    with mounted(tmp_path / "packed", mnt) as m:
        assert cli.main(["umount", str(link)]) == 0, capsys.readouterr().err
        assert capsys.readouterr().out.strip() == f"unmounted {os.path.realpath(mnt)} (linked as {link})"
        assert not process.is_mounted(mnt)
        wait_until(lambda: m.proc.poll() is not None, "the serving process to exit")
    assert link.is_symlink() and mnt.is_dir()


@pytest.mark.fuse
def test_umount_of_a_symbolic_link_unmounts_a_blockfs_mount_of_another_subtype(tmp_path, capsys):
    """``-o subtype=bfs`` makes the mount's type fuse.bfs: ``umount LINK`` refused it as "not a blockfs one"."""
    from mountutil import mounted

    from blockfs import cli

    require(has_fuse(), "/dev/fuse")
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "a.txt").write_bytes(b"hello\n")
    blockfs.pack(tmp_path / "src", tmp_path / "packed", fsync=False)
    mnt, link = tmp_path / "mnt", tmp_path / "link"
    link.symlink_to("mnt")
    with mounted(tmp_path / "packed", mnt, "-o", "subtype=bfs") as m:
        assert process.mount_entry(mnt)["fstype"] == "fuse.bfs"
        assert cli.main(["umount", str(link)]) == 0, capsys.readouterr().err
        assert capsys.readouterr().out.strip() == f"unmounted {os.path.realpath(mnt)} (linked as {link})"
        assert not process.is_mounted(mnt)
        wait_until(lambda: m.proc.poll() is not None, "the serving process to exit")


# A FUSE filesystem that is not blockfs, of the same type as the mount above (fuse.bfs): an empty root.
_FOREIGN_FUSE = r"""
import sys, mfusepy
mfusepy.FUSE(mfusepy.Operations(), sys.argv[1], foreground=True, fsname="other", subtype="bfs")
"""


@pytest.mark.fuse
def test_umount_never_follows_a_symbolic_link_to_a_fuse_mount_that_is_not_blockfs(tmp_path, capsys):
    from blockfs import cli

    require(has_fuse(), "/dev/fuse")
    mnt, link = tmp_path / "mnt", tmp_path / "link"
    mnt.mkdir()
    link.symlink_to(mnt)
    foreign = subprocess.Popen([sys.executable, "-c", _FOREIGN_FUSE, str(mnt)], stderr=subprocess.PIPE, text=True)
    try:
        wait_until(lambda: process.is_mounted(mnt) or foreign.poll() is not None, "the other filesystem to mount")
        assert process.mount_entry(mnt) == {"fstype": "fuse.bfs", "source": "other"}, foreign.stderr
        assert cli.main(["umount", str(link)]) == 2
        err = capsys.readouterr().err.strip()
        assert err.startswith(
            f"blockfs umount: error: '{link}' is a symbolic link to '{mnt}', a fuse.bfs mount that does not answer "
            "as a blockfs one: blockfs umount unmounts only blockfs mounts through a link"
        ), err
        assert process.is_mounted(mnt) and foreign.poll() is None
    finally:
        release(mnt, foreign)


def test_umount_never_follows_a_symbolic_link_to_a_mount_blockfs_did_not_make(tmp_path, capsys):
    from blockfs import cli

    proc_mount = process.mount_entry("/proc")
    assert proc_mount is not None and proc_mount["fstype"] == "proc"
    (tmp_path / "to-proc").symlink_to("/proc")
    (tmp_path / "unmounted").mkdir()
    (tmp_path / "to-unmounted").symlink_to(tmp_path / "unmounted")
    assert cli.main(["umount", str(tmp_path / "to-proc")]) == 2
    err = capsys.readouterr().err.strip()
    assert err == (
        f"blockfs umount: error: '{tmp_path / 'to-proc'}' is a symbolic link to '/proc', a proc mount, not a "
        "blockfs one: blockfs umount unmounts only blockfs mounts"
    )
    assert process.mount_entry("/proc") == proc_mount
    assert cli.main(["umount", str(tmp_path / "to-unmounted")]) == 2
    assert "which is not mounted" in capsys.readouterr().err
