"""What the index's tree check (blockfs/core/treecheck.py) adds to opening a million-entry index.

Builds the synthetic 1,001,001-entry index of ``tools/bench_pack.py`` (reused if ``--dest`` already holds
one), then opens it ``--repeat`` times with the check and as many times with it switched off, alternating,
and prints the minimum and median of each (minimum: the least disturbed by other work on the machine).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from bench_pack import synthetic_million  # noqa: E402

import blockfs.core.index as index_module  # noqa: E402
from blockfs.core.treecheck import check_tree  # noqa: E402


def time_open(path: str, checked: bool) -> float:
    index_module.check_tree = check_tree if checked else (lambda arrays, where: None)
    started = time.perf_counter()
    index_module.PackedIndex(path).close()
    return time.perf_counter() - started


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dest", help="a directory for the synthetic index (default: a temporary one)")
    ap.add_argument("--repeat", type=int, default=9)
    args = ap.parse_args(argv)
    dest = args.dest or tempfile.mkdtemp(prefix="blockfs-bench-treecheck-", dir="/var/tmp")
    path = os.path.join(dest, "index.bfi")
    if not os.path.exists(path):
        synthetic_million(dest)
    runs: dict[str, list[float]] = {"with_check_s": [], "without_check_s": []}
    for _ in range(args.repeat):
        runs["with_check_s"].append(time_open(path, True))
        runs["without_check_s"].append(time_open(path, False))
    result = {k: {"min": min(v), "median": statistics.median(v)} for k, v in runs.items()}
    result["check_s"] = {k: result["with_check_s"][k] - result["without_check_s"][k] for k in ("min", "median")}
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
