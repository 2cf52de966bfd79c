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
