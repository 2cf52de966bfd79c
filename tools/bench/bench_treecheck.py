"""What the index's tree check (blockfs/core/treecheck.py) adds to opening a million-entry index.

Builds the synthetic 1,001,001-entry index of ``tools/bench/bench_pack.py`` (reused if ``--dest`` already holds
one), then opens it ``--repeat`` times with the check and as many times with it switched off, alternating,
and prints the minimum and median of each, in wall-clock and in CPU seconds of this process (minimum,
and CPU time: the least disturbed by other work on a shared machine).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

import helpers  # noqa: F401  (puts the checkout on sys.path, for blockfs)
from bench_pack import synthetic_million

import blockfs.core.index as index_module
import blockfs.core.index_checks as checks_module
from blockfs.core.treecheck import check_tree


def time_open(path: str, checked: bool) -> tuple[float, float]:
    """(wall, CPU) seconds to open the index, with or without the tree check.  The check is switched where
    the index's checks call it; an open that did not call it there means this benchmark would measure nothing
    (the call moved), so it stops saying so."""
    calls = []

    def switched(*args) -> None:
        calls.append(1)
        if checked:
            check_tree(*args)

    checks_module.check_tree = switched
    try:
        wall, cpu = time.perf_counter(), time.process_time()
        index_module.PackedIndex(path).close()
        wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    finally:
        checks_module.check_tree = check_tree
    if not calls:
        raise SystemExit(
            "opening the index no longer calls blockfs.core.index_checks.check_tree: switch it where it is"
        )
    return wall, cpu


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dest", help="a directory for the synthetic index (default: a temporary one)")
    ap.add_argument("--repeat", type=int, default=9)
    args = ap.parse_args(argv)
    dest = args.dest or tempfile.mkdtemp(prefix="blockfs-bench-treecheck-", dir="/var/tmp")
    path = os.path.join(dest, "index.bfi")
    if not os.path.exists(path):
        synthetic_million(dest)
    runs: dict[str, list[float]] = {}
    for _ in range(args.repeat):
        for checked in (True, False):
            name = "with_check" if checked else "without_check"
            wall, cpu = time_open(path, checked)
            runs.setdefault(f"{name}_wall_s", []).append(wall)
            runs.setdefault(f"{name}_cpu_s", []).append(cpu)
    result = {k: {"min": round(min(v), 4), "median": round(statistics.median(v), 4)} for k, v in runs.items()}
    for clock in ("wall", "cpu"):
        result[f"check_{clock}_s"] = {
            k: round(result[f"with_check_{clock}_s"][k] - result[f"without_check_{clock}_s"][k], 4)
            for k in ("min", "median")
        }
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
