"""Helpers shared by the benchmarks in tools/."""

from __future__ import annotations

import os


def drop_caches(level: int = 3) -> bool:
    """Drop the kernel's page cache (1), dentries and inodes (2) or both (3); False when not permitted.

    Needs root.  The benchmarks use it for "cold" runs: the next reads come from the disk.
    """
    os.sync()
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write(f"{level}\n")
        return True
    except OSError:
        return False


def evict_file(path: str) -> None:
    """Drop one file's pages from the page cache (written back first), leaving every other file cached.

    For "this input is cold, the programs reading it are not": a global drop also evicts the
    interpreter and its libraries, which costs a Python tool far more to load again than a C one.
    """
    os.sync()
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)
