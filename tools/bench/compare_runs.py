"""Two sets of ``bench_storage.py --json`` runs side by side: the medians of each goal ratio and of each row's
files/s and server CPU per file, before and after a change.

    python tools/bench/compare_runs.py --before 'runs/pre-*.json' --after 'runs/post-*.json'

Run the two commits' benchmarks interleaved (before, after, before, after, ...) so that the machine's drift
falls on both sides alike; medians, because one run on a shared disk can be far off.
"""

from __future__ import annotations

import argparse
import glob
import json
import statistics
import sys


def _load(pattern: str) -> list[dict]:
    runs = [json.load(open(path)) for path in sorted(glob.glob(pattern))]
    if not runs:
        raise SystemExit(f"compare_runs: no file matches {pattern!r}")
    return runs


def _median(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


def goal_table(before: list[dict], after: list[dict]) -> list[str]:
    ratios: dict[str, tuple[list[float], list[float]]] = {}
    for side, runs in ((0, before), (1, after)):
        for run in runs:
            for what, value, _goal, _met in run["goals"]:
                ratios.setdefault(what, ([], []))[side].append(value)
    lines = ["| ratio (bench_storage's goals) | before | after | after / before |", "|---|---|---|---|"]
    for what, (b, a) in ratios.items():
        if b and a:
            lines.append(f"| {what} | {_median(b):.2f} | {_median(a):.2f} | {_median(a) / _median(b):.3f} |")
    return lines


def row_table(before: list[dict], after: list[dict]) -> list[str]:
    rows: dict[tuple, tuple[list[dict], list[dict]]] = {}
    for side, runs in ((0, before), (1, after)):
        for run in runs:
            for r in run["results"]:
                key = (r["storage"], r["dataset"], r["system"], r["readers"], r["epoch"])
                rows.setdefault(key, ([], []))[side].append(r)
    lines = [
        "| storage | dataset | system | readers | epoch | files/s before | after | after / before "
        "| server CPU ms/file before | after |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for key, (b, a) in rows.items():
        if not (b and a):
            continue
        fb, fa = _median([r["files_per_s"] for r in b]), _median([r["files_per_s"] for r in a])
        cb = [r["daemon_cpu_s_per_file"] for r in b if r.get("daemon_cpu_s_per_file") is not None]
        ca = [r["daemon_cpu_s_per_file"] for r in a if r.get("daemon_cpu_s_per_file") is not None]
        cpu = f"{1000 * _median(cb):.3f} | {1000 * _median(ca):.3f}" if cb and ca else " | "
        lines.append("| " + " | ".join(map(str, key)) + f" | {fb:,.0f} | {fa:,.0f} | {fa / fb:.3f} | {cpu} |")
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--before", required=True, help="a glob of bench_storage --json files")
    parser.add_argument("--after", required=True, help="a glob of bench_storage --json files")
    args = parser.parse_args(argv)
    before, after = _load(args.before), _load(args.after)
    print(f"runs: {len(before)} before, {len(after)} after (medians)\n")
    print("\n".join(goal_table(before, after)))
    print()
    print("\n".join(row_table(before, after)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
