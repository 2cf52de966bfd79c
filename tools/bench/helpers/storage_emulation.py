"""Slow storage on a fast machine, for ``tools/bench/bench_storage.py``: a throttled disk and a distant object store.

The kernel here has no ``netem`` and no device-mapper, so the two storages are built from what it has:

* :class:`ThrottledDisk` — a cgroup v1 ``blkio`` group whose reads of the disk are capped in IOPS and bytes
  per second.  Only reads that reach the disk count, so a benchmark evicts its own files from the page
  cache (:func:`evict`) rather than dropping every cache; every process that reads (a FUSE server, a
  reader, a loader's workers) must be started inside the group.  The group's own counters give the bytes
  and requests that reached the disk.
* :class:`NetworkLink` — a network namespace joined to this one by a veth pair, with a ``tbf`` qdisc on the
  namespace's end: everything the store sends shares one capped link, as a NIC would (a per-connection
  cap would let parallel GETs exceed it).  The store and a :mod:`delay_proxy` run inside; clients connect
  to :attr:`NetworkLink.address`.

Both need root; each raises :class:`Unavailable` saying what is missing, and each is torn down by
``close()`` (they are context managers), leaving nothing behind.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

from typing_extensions import Self

BLKIO = Path("/sys/fs/cgroup/blkio")


class Unavailable(RuntimeError):
    """This machine cannot emulate the storage (not root, no blkio controller, no ``ip``/``tc``)."""


def evict(paths) -> int:
    """Drop the page-cache pages of every file under ``paths`` (files or directories); bytes of files seen.

    The next read of them reaches the disk (and its throttle); nothing else loses its cache.
    """
    os.sync()
    seen = 0
    for top in paths:
        top = str(top)
        walk = [(top, [], [""])] if os.path.isfile(top) else os.walk(top)
        for parent, _dirs, files in walk:
            for name in files:
                path = os.path.join(parent, name) if name else parent
                try:
                    fd = os.open(path, os.O_RDONLY)
                except OSError:
                    continue
                try:
                    seen += os.fstat(fd).st_size
                    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                finally:
                    os.close(fd)
    return seen


def disk_of(path: str) -> str:
    """``MAJ:MIN`` of the whole disk holding ``path`` (blkio throttles disks, not partitions)."""
    dev = os.stat(path).st_dev
    node = Path(f"/sys/dev/block/{os.major(dev)}:{os.minor(dev)}")
    if not node.exists():
        raise Unavailable(
            f"{path} is not on a block device (its filesystem has device {os.major(dev)}:{os.minor(dev)})"
        )
    if (node / "partition").exists():
        node = node.resolve().parent  # the partition's directory sits inside its disk's
    return (node / "dev").read_text().strip()


class ThrottledDisk:
    """A blkio cgroup capping reads of the disk under ``path`` to ``read_iops`` and ``read_bps`` (None: no cap).

    ``enter`` is a ``preexec_fn`` that starts a child inside the group.  :meth:`counters` reads the bytes and
    requests that reached the disk from the group's processes so far.
    """

    def __init__(self, name: str, path: str, *, read_iops: int | None = None, read_bps: int | None = None) -> None:
        if os.geteuid() != 0:
            raise Unavailable("throttling a disk needs root (cgroup v1 blkio)")
        if not (BLKIO / "blkio.throttle.read_iops_device").exists():
            raise Unavailable(f"no cgroup v1 blkio controller with throttling at {BLKIO}")
        self.device = disk_of(path)
        self.path = BLKIO / name
        self.path.mkdir(exist_ok=True)
        self.read_iops, self.read_bps = read_iops, read_bps
        self._write("blkio.throttle.read_iops_device", f"{self.device} {read_iops or 0}")
        self._write("blkio.throttle.read_bps_device", f"{self.device} {read_bps or 0}")

    def _write(self, name: str, value: str) -> None:
        (self.path / name).write_text(value + "\n")

    def enter(self) -> None:
        """Move the calling process into the group (use as ``preexec_fn``)."""
        (self.path / "cgroup.procs").write_text(f"{os.getpid()}\n")

    def add(self, pid: int) -> None:
        (self.path / "cgroup.procs").write_text(f"{pid}\n")

    def _read_counter(self, name: str) -> int:
        for line in (self.path / name).read_text().splitlines():
            parts = line.split()
            if len(parts) == 3 and parts[0] == self.device and parts[1] == "Read":
                return int(parts[2])
        return 0

    def counters(self) -> dict[str, int]:
        """Bytes and requests read from the disk by the group's processes since it was made."""
        return {
            "bytes": self._read_counter("blkio.throttle.io_service_bytes"),
            "requests": self._read_counter("blkio.throttle.io_serviced"),
        }

    def close(self) -> None:
        """Move any process left in the group back to the root group, then remove it."""
        if not self.path.exists():
            return
        for pid in (self.path / "cgroup.procs").read_text().split():
            try:
                (BLKIO / "cgroup.procs").write_text(f"{pid}\n")
            except OSError:
                pass  # gone meanwhile
        try:
            self.path.rmdir()
        except OSError:
            pass

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _run(*cmd: str) -> None:
    done = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise Unavailable(f"`{' '.join(cmd)}` failed: {done.stderr.strip() or done.stdout.strip()}")


class NetworkLink:
    """A namespace ``name`` behind a veth pair whose store-to-client direction is capped at ``rate_mbit``.

    Run a server inside with :meth:`command` (``ip netns exec NAME ...``); clients here connect to
    :attr:`address`.  The cap is a ``tbf`` on the namespace's end of the pair, so all connections share it.
    """

    def __init__(self, name: str = "bfsstore", rate_mbit: int = 1000, subnet: str = "10.213.7") -> None:
        if os.geteuid() != 0:
            raise Unavailable("a network namespace needs root")
        for tool in ("ip", "tc"):
            if subprocess.run(["which", tool], capture_output=True, check=False).returncode != 0:
                raise Unavailable(f"`{tool}` is missing (Debian: iproute2)")
        self.name, self.rate_mbit = name, rate_mbit
        self.host_end, self.store_end = f"{name[:10]}h", f"{name[:10]}s"
        self.client_address, self.address = f"{subnet}.1", f"{subnet}.2"
        self.close()  # a previous run's leftovers
        try:
            _run("ip", "netns", "add", name)
            _run("ip", "link", "add", self.host_end, "type", "veth", "peer", "name", self.store_end, "netns", name)
            _run("ip", "addr", "add", f"{self.client_address}/30", "dev", self.host_end)
            _run("ip", "link", "set", self.host_end, "up")
            _run("ip", "-n", name, "addr", "add", f"{self.address}/30", "dev", self.store_end)
            _run("ip", "-n", name, "link", "set", self.store_end, "up")
            _run("ip", "-n", name, "link", "set", "lo", "up")
            # burst: a few packets' worth at this rate; latency bounds the queue (as a NIC's ring would).
            _run(
                "ip",
                "netns",
                "exec",
                name,
                "tc",
                "qdisc",
                "replace",
                "dev",
                self.store_end,
                "root",
                "tbf",
                "rate",
                f"{rate_mbit}mbit",
                "burst",
                "256kb",
                "latency",
                "20ms",
            )
        except Unavailable:
            self.close()
            raise

    def command(self, *cmd: str) -> list[str]:
        """``cmd`` run inside the namespace."""
        return ["ip", "netns", "exec", self.name, *cmd]

    def close(self) -> None:
        subprocess.run(["ip", "link", "del", self.host_end], capture_output=True, check=False)
        subprocess.run(["ip", "netns", "del", self.name], capture_output=True, check=False)

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
