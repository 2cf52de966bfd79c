"""Time ``blockfs mount`` to its return, and the serving process's CPU then, for checkouts side by side.

    python tools/bench/bench_mount_time.py W1M/ds W10M/ds [--before DIR] [--rounds 3] [--json OUT]

Each DATASET (made by ``tools/bench/bench_scale.py --pack-only --work W``) is mounted the way a user mounts
it (``blockfs mount DS MNT --timeout 600 --log L``, the default budget), timed until the command returns
(it returns once the mount serves), then the server's utime + stime is read from ``/proc/PID/stat`` and
the mount is unmounted.  With ``--before DIR`` (a checkout, e.g. ``git worktree`` or ``git archive`` of
the commit before) the two are interleaved, one warm-up mount each per dataset first (the checked-index
record, the page cache), so the ratio holds on a shared machine.  Medians and ranges are printed.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time

from helpers import ROOT


def mount_once(code: str, dataset: str, work: str) -> tuple[float, float]:
    """(seconds until ``blockfs mount`` returned, the server's CPU seconds then)."""
    mnt = tempfile.mkdtemp(prefix="mnt-", dir=work)
    env = dict(os.environ, PYTHONPATH=code)
    started = time.perf_counter()
    done = subprocess.run(
        [sys.executable, "-m", "blockfs", "mount", dataset, mnt, "--timeout", "600", "--log", mnt + ".log"],
        env=env,
        cwd="/",
        capture_output=True,
        text=True,
    )
    seconds = time.perf_counter() - started
    if done.returncode:
        raise SystemExit(f"blockfs mount failed: {done.stderr.strip()}")
    found = re.search(r"\(pid (\d+),", done.stdout)
    if found is None:
        raise SystemExit(f"blockfs mount said no pid: {done.stdout!r}")
    with open(f"/proc/{found.group(1)}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    cpu = (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    subprocess.run([sys.executable, "-m", "blockfs", "umount", mnt], env=env, cwd="/", check=True, capture_output=True)
    os.rmdir(mnt)
    return seconds, cpu


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("datasets", nargs="+", help="packed datasets (bench_scale.py --pack-only --work W: W/ds)")
    parser.add_argument("--before", help="another checkout, timed interleaved with this one")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--json", help="write every figure here")
    args = parser.parse_args()
    codes = {"after": str(ROOT)} if not args.before else {"before": os.path.abspath(args.before), "after": str(ROOT)}
    results: dict[str, list[tuple[float, float]]] = {}
    with tempfile.TemporaryDirectory(prefix="bench_mount_time-") as work:
        for dataset in args.datasets:
            for code in codes.values():
                mount_once(code, dataset, work)  # warm-up, not counted
            for _ in range(args.rounds):
                for label, code in codes.items():
                    seconds, cpu = mount_once(code, dataset, work)
                    results.setdefault(f"{dataset} {label}", []).append((seconds, cpu))
                    print(f"{dataset} {label}: returned in {seconds:.2f} s, server CPU {cpu:.2f} s", flush=True)
    print()
    for key, runs in results.items():
        walls, cpus = [r[0] for r in runs], [r[1] for r in runs]
        print(
            f"{key}: returned in {statistics.median(walls):.2f} s ({min(walls):.2f}-{max(walls):.2f}), "
            f"server CPU {statistics.median(cpus):.2f} s ({min(cpus):.2f}-{max(cpus):.2f})"
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
