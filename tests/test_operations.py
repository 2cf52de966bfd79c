"""Where users run blockfs: ``mount -t fuse.blockfs``, an ``/etc/fstab`` line, a systemd ``Type=notify`` unit.

The mount(8) tests install the helper as /sbin/mount.fuse.blockfs for the test only (mount(8) looks for
helpers in /sbin alone) and always remove it and unmount.  systemd is not PID 1 on the test machines, so
the notify test plays systemd's part: a datagram socket in ``$NOTIFY_SOCKET``.
"""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
from pathlib import Path
from typing import Iterator

import pytest

import blockfs
from blockfs.cli.mount_helper import blockfs_argv
from blockfs.serve.process import is_mounted
from conftest import has_fuse, require
from mountutil import release, serve_command
from polling import wait_until

REPO = Path(__file__).resolve().parent.parent
HELPER = Path("/sbin/mount.fuse.blockfs")


def test_mount_options_become_blockfs_options():
    argv = blockfs_argv("/d", "/m", ["ro,_netdev,nofail,x-systemd.automount,cache_size=1GiB,allow_other",
                                     "storage.endpoint=http://h:9,max_read=131072,no_prefill,defaults"])  # fmt: skip
    assert argv == ["mount", "/d", "/m", "--cache-size", "1GiB", "--allow-other", "--storage-option",
                    "endpoint=http://h:9", "--no-prefill", "-o", "max_read=131072"]  # fmt: skip
    with pytest.raises(ValueError, match="write it as cache_size=VALUE"):
        blockfs_argv("/d", "/m", ["cache_size"])
    with pytest.raises(ValueError, match="foreground"):
        blockfs_argv("/d", "/m", ["foreground"])


@pytest.fixture
def dataset(tmp_path) -> Path:
    src = tmp_path / "src" / "cat"
    src.mkdir(parents=True)
    for i in range(30):
        (src / f"{i}.txt").write_text(f"file {i}\n")
    blockfs.pack(tmp_path / "src", tmp_path / "ds.blockfs", fsync=False)
    return tmp_path / "ds.blockfs"


@contextlib.contextmanager
def helper_installed(tmp_path: Path) -> Iterator[None]:
    """/sbin/mount.fuse.blockfs running this checkout's helper with this interpreter, for the test only."""
    require(has_fuse() and os.geteuid() == 0, "/dev/fuse and root (mount(8) and /sbin)")
    if HELPER.exists() or HELPER.is_symlink():
        pytest.fail(f"{HELPER} exists already: this test installs its own and would replace it")
    script = tmp_path / "mount.fuse.blockfs"
    script.write_text(f"#!/bin/sh\nPYTHONPATH={REPO} exec {sys.executable} -m blockfs.cli.mount_helper \"$@\"\n")
    script.chmod(0o755)
    HELPER.symlink_to(script)
    try:
        yield
    finally:
        HELPER.unlink()


@pytest.mark.fuse
def test_mount_t_fuse_blockfs_mounts_and_umount_unmounts(dataset, tmp_path):
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    with helper_installed(tmp_path):
        try:
            done = subprocess.run(["mount", "-t", "fuse.blockfs", str(dataset), str(mnt), "-o",
                                   "ro,cache_size=16MiB,_netdev"], capture_output=True, text=True, timeout=120)  # fmt: skip
            assert done.returncode == 0, done.stdout + done.stderr
            assert (mnt / "cat" / "7.txt").read_text() == "file 7\n"
            with open("/proc/self/mounts") as f:
                line = next(line for line in f if line.split()[1] == str(mnt))
            assert line.split()[2] == "fuse.blockfs" and line.split()[0] == str(dataset), line
            assert subprocess.run(["umount", str(mnt)], capture_output=True, timeout=60).returncode == 0
            assert not is_mounted(mnt)
        finally:
            release(mnt)


@pytest.mark.fuse
def test_the_readme_fstab_line_mounts(dataset, tmp_path):
    """The README's fstab line (local dataset), through mount --fstab as mount -a would read /etc/fstab."""
    readme = (REPO / "README.md").read_text()
    line = next(ln for ln in readme.splitlines() if "fuse.blockfs" in ln and ln.startswith("/data/"))
    mnt = tmp_path / "imagenet"
    mnt.mkdir()
    fstab = tmp_path / "fstab"
    fstab.write_text(line.replace("/data/imagenet.blockfs", str(dataset)).replace("/mnt/imagenet", str(mnt)) + "\n")
    with helper_installed(tmp_path):
        try:
            done = subprocess.run(["mount", "--fstab", str(fstab), str(mnt)], capture_output=True, text=True,
                                  timeout=120)  # fmt: skip
            assert done.returncode == 0, done.stdout + done.stderr
            assert sorted(os.listdir(mnt / "cat"))[:2] == ["0.txt", "1.txt"]
        finally:
            release(mnt)


@pytest.mark.fuse
def test_a_foreground_mount_tells_systemd_it_is_ready_once_it_answers(dataset, tmp_path):
    require(has_fuse(), "/dev/fuse")
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    address = str(tmp_path / "notify.sock")
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as systemd:
        systemd.bind(address)
        systemd.settimeout(60)
        log = tmp_path / "log"
        proc = subprocess.Popen(serve_command(dataset, mnt, log), env=dict(os.environ, NOTIFY_SOCKET=address),
                                stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)  # fmt: skip
        try:
            message = systemd.recv(4096).decode()
            assert message.splitlines()[0] == "READY=1", message
            # READY=1 only once the mount answers: at this instant it serves, no waiting.
            assert is_mounted(mnt) and (mnt / "cat" / "3.txt").read_text() == "file 3\n"
            subprocess.run(["fusermount3", "-u", str(mnt)], check=True, timeout=60)
            assert systemd.recv(4096).decode() == "STOPPING=1"
            assert proc.wait(30) == 0
        finally:
            release(mnt, proc)
    wait_until(lambda: not is_mounted(mnt), "the mount to go")
