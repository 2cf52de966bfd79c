"""Benchmark the memory plan's selection (``make_memory_plan``) at a million files and more.

The plan is computed when a mount starts, so it must stay a handful of vectorised passes over the file
sizes, never a Python loop per file.  Reported as a ratio to one ``np.argsort`` of the same sizes (the
cost floor of choosing by size), so the figure means the same on a fast or a slow machine: a per-file
Python loop would show as a ratio in the hundreds.  Moved here from the test suite, which checks what
the plan chooses, not how fast.

    python tools/bench/bench_plan.py [--files 1000000 4000000] [--repeat 5] [--out results/bench_plan.json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import helpers  # noqa: F401  (puts the checkout on sys.path, for blockfs)
import numpy as np

from blockfs.serve.cache.memory_plan import STRATEGIES, make_memory_plan


def median_seconds(run, repeat: int) -> float:
    times = []
    for _ in range(repeat):
        started = time.perf_counter()
        run()
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def measure(n_files: int, repeat: int) -> list[dict]:
    sizes = np.random.default_rng(0).lognormal(11, 1.5, n_files).astype(np.int64)
    budget = int(sizes.sum()) // 3
    floor = median_seconds(lambda: np.argsort(sizes, kind="stable"), repeat)
    rows = []
    for strategy in STRATEGIES:
        seconds = median_seconds(lambda strategy=strategy: make_memory_plan(sizes, budget, strategy=strategy), repeat)
        rows.append(
            {"files": n_files, "strategy": strategy, "plan_s": seconds, "argsort_s": floor, "ratio": seconds / floor}
        )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--files", type=int, nargs="+", default=[1_000_000, 4_000_000])
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--out", help="also write the rows as JSON here")
    args = parser.parse_args()
    rows = [row for n in args.files for row in measure(n, args.repeat)]
    print(f"{'files':>10} {'strategy':>11} {'plan':>9} {'argsort':>9} {'plan/argsort':>13}")
    for r in rows:
        print(
            f"{r['files']:>10,} {r['strategy']:>11} {r['plan_s'] * 1e3:>7.1f}ms {r['argsort_s'] * 1e3:>7.1f}ms"
            f" {r['ratio']:>12.1f}x"
        )
    if args.out:
        os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
