"""What a mount's memory budget is decided from, in the standard library alone: the memory available now,
a share of it, and the names of the retain strategies.  The command line decides the budget before it
starts a server, and importing NumPy (:mod:`.plan`) for that would cost ``blockfs mount`` a good part of
its time."""

from __future__ import annotations

import os

STRATEGIES = ("most-files", "threshold")  # how blockfs.serve.cache.memory_plan chooses the files it retains


def read_mem_available(meminfo: str | os.PathLike[str] = "/proc/meminfo") -> int:
    """Bytes of memory the kernel says are available now (``MemAvailable``, Linux >= 3.14)."""
    with open(meminfo, "rb") as lines:  # bytes: no codec to import (a mount may run as another user by then)
        for line in lines:
            if line.startswith(b"MemAvailable:"):
                return int(line.split()[1]) * 1024  # the kernel writes "kB" and means KiB
    raise OSError(f"{os.fspath(meminfo)} has no MemAvailable line; give the memory budget in bytes instead")


def budget_from_memory_fraction(fraction: float, meminfo: str | os.PathLike[str] = "/proc/meminfo") -> int:
    """``fraction`` of the memory available at this moment, in bytes."""
    if not 0 < fraction <= 1:
        raise ValueError(f"memory fraction must be in (0, 1], not {fraction!r}")
    return int(fraction * read_mem_available(meminfo))
