"""Helpers for tests that mount: serve a packed dataset in a child process and always unmount.

:func:`mounted` starts ``blockfs mount --foreground`` as a child process (so a test owns its pid: it can
read its memory or kill it), polls until the mount point serves, and on the way out — also when the test
failed — unmounts, lazily if it must, and reaps the process, so a failing test never leaves a mount behind.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

from blockfs.errors import MountError
from blockfs.serve.daemon import is_mounted, unmount, wait_until_mounted

BINDINGS = ("kernel", "mfusepy", "fusepy")  # the FUSE routes (BLOCKFS_FUSE): the kernel protocol, libfuse 3, libfuse 2


class Mount:
    """A running mount: its point, serving process and log."""

    def __init__(self, mountpoint: Path, proc: subprocess.Popen, log: Path) -> None:
        self.path = mountpoint
        self.proc = proc
        self.log = log

    @property
    def pid(self) -> int:
        return self.proc.pid

    def log_text(self) -> str:
        return self.log.read_text(errors="replace") if self.log.exists() else ""

    def rss_bytes(self) -> int:
        """Resident memory of the serving process."""
        with open(f"/proc/{self.pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
        raise RuntimeError("no VmRSS")


def serve_command(dest: os.PathLike, mountpoint: os.PathLike, log: os.PathLike, *args: str) -> list[str]:
    return [
        sys.executable,
        "-m",
        "blockfs",
        "mount",
        os.fspath(dest),
        os.fspath(mountpoint),
        "--foreground",
        "--log",
        os.fspath(log),
        *args,
    ]


@contextlib.contextmanager
def mounted(
    dest: os.PathLike, mountpoint: os.PathLike, *args: str, binding: str | None = None, timeout: float = 30.0
) -> Iterator[Mount]:
    """Serve ``dest`` at ``mountpoint`` (created if missing) with extra ``blockfs mount`` arguments."""
    mountpoint = Path(mountpoint)
    mountpoint.mkdir(parents=True, exist_ok=True)
    log = mountpoint.parent / f"{mountpoint.name}.log"
    env = dict(os.environ)
    if binding:
        env["BLOCKFS_FUSE"] = binding
    with open(log, "ab") as out:
        proc = subprocess.Popen(
            serve_command(dest, mountpoint, log, *args), stdin=subprocess.DEVNULL, stdout=out, stderr=out, env=env
        )
    try:
        try:
            wait_until_mounted(mountpoint, proc, timeout, os.fspath(log))
        except MountError as e:
            raise AssertionError(f"mount failed: {e}\n{_mount_table()}") from None
        yield Mount(mountpoint, proc, log)
    finally:
        release(mountpoint, proc)


def plain_unmount(mountpoint: os.PathLike, check: bool = False) -> subprocess.CompletedProcess:
    """A plain (not lazy) unmount as a user runs one: umount(8) as root, fusermount3 -u otherwise (a
    machine where only root mounts may have no fusermount3 at all)."""
    path = os.fspath(mountpoint)
    if os.geteuid() == 0:
        command = ["umount", path]
    else:
        command = [shutil.which("fusermount3") or "fusermount", "-u", path]
    return subprocess.run(command, capture_output=True, text=True, timeout=60, check=check)


def release(mountpoint: os.PathLike, proc: subprocess.Popen | None = None) -> None:
    """Unmount (lazily if need be) and reap the serving process; never raises for a mount already gone."""
    if is_mounted(mountpoint):
        try:
            unmount(mountpoint)
        except MountError:
            subprocess.run(["umount", "-l", os.fspath(mountpoint)], capture_output=True)
    if proc is not None:
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.send_signal(signal.SIGKILL)
            proc.wait(10)
        if is_mounted(mountpoint):  # killed before it could unmount
            subprocess.run(["umount", "-l", os.fspath(mountpoint)], capture_output=True)


def _mount_table() -> str:
    with open("/proc/self/mounts") as f:
        return "".join(line for line in f if "fuse" in line) or "(no FUSE mounts)"


def mapped_file(buf) -> str | None:
    """The file this process maps ``buf`` from (``/proc/self/maps``: a path, "... (deleted)" for an unnamed
    or removed one), None for anonymous memory: where an index is held."""
    import numpy as np

    address = np.frombuffer(buf, dtype=np.uint8, count=1).ctypes.data
    with open("/proc/self/maps") as f:
        for line in f:
            head = line.split()
            start, end = (int(x, 16) for x in head[0].split("-"))
            if start <= address < end:
                return " ".join(head[5:]) or None
    return None
