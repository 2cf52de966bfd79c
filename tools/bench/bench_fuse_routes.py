"""Which FUSE route can a Python server take?  The no-work servers of tools/bench/helpers/null_fs.py, side by side.

    python tools/bench/bench_fuse_routes.py [--files 20000] [--size 4096] [--routes kernel,mfusepy,pyfuse3]
                                            [--pyfuse3-python PATH] [--repeats 3] [--json OUT]

Routes: ``kernel`` (blockfs.serve.fuse.session), ``lowlevel`` (libfuse 3's low-level API through ctypes),
``mfusepy`` (libfuse 3's high-level API: today's adapter), ``pyfuse3``; ``ROUTE:N`` runs it with N server
threads (``kernel:1``, ``lowlevel:1`` for libfuse's single-threaded loop).

For each route, a fresh mount of :mod:`helpers.null_fs` over one generated tree, read as an ImageFolder-style
script reads it: list every directory (``os.scandir``, what ``os.walk`` and ``ImageFolder`` do), then
open/read/close every file in a random order with 1 or 4 reader threads (:mod:`helpers.storage_reader`), then
the same order again (epoch 2, which the kernel may answer from its caches).  Reported per pass: files/s,
and the server's CPU seconds per 1,000 files (``/proc/PID/stat``: what a request costs the server).  Each
figure is the median of ``--repeats`` fresh mounts; the table also gives each route's ratio to mfusepy's
(today's adapter) from the same run.

``pyfuse3`` runs with ``--pyfuse3-python`` (an interpreter that has pyfuse3, e.g. a venv where
``pip install pyfuse3`` built it against ``libfuse3-dev``); it is left out when none is given.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path

from helpers import HELPERS
from helpers.benchutil import cpu_seconds, run_storage_reader, scratch_dir

ROUTES = ("kernel", "lowlevel", "mfusepy", "pyfuse3")


def make_tree(root: Path, files: int, size: int) -> list[str]:
    names = []
    for i in range(files):
        rel = f"c{i % 10:02d}/f{i:06d}.bin"
        path = root / rel
        if not path.exists():
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_bytes(os.urandom(size))
        names.append(rel)
    return names


def wait_mounted(path: Path, proc: subprocess.Popen, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while not os.path.ismount(path):
        if proc.poll() is not None or time.monotonic() > deadline:
            raise SystemExit(f"{path}: the server did not mount (exit {proc.poll()})")
        time.sleep(0.01)


def unmount(path: Path, proc: subprocess.Popen) -> None:
    subprocess.run(["fusermount3", "-u", str(path)], capture_output=True)
    try:
        proc.wait(10)
    except subprocess.TimeoutExpired:
        proc.kill()
        subprocess.run(["fusermount3", "-uz", str(path)], capture_output=True)


def listing(root: Path) -> float:
    started = time.perf_counter()
    stack = [str(root)]
    while stack:
        with os.scandir(stack.pop()) as it:
            for entry in it:
                if entry.is_dir():
                    stack.append(entry.path)
    return time.perf_counter() - started


def read_pass(root: Path, order_file: Path, threads: int) -> float:
    result = run_storage_reader(root, order_file, threads)
    return result["files"] / result["seconds"]


def one_mount(route: str, python: str, src: Path, mnt: Path, order_file: Path, n: int, threads: int) -> dict:
    route, _, server_threads = route.partition(":")  # "lowlevel:1": that route with that many server threads
    extra = ["--threads", server_threads] if server_threads else []
    proc = subprocess.Popen(
        [python, str(HELPERS / "null_fs.py"), str(src), str(mnt), "--fuse", route, *extra],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    try:
        wait_mounted(mnt, proc)
        out = {"list_s": listing(mnt)}
        for epoch in (1, 2):
            cpu = cpu_seconds(proc.pid)
            out[f"epoch{epoch}"] = read_pass(mnt, order_file, threads)
            out[f"epoch{epoch}_cpu_ms_per_1k"] = (cpu_seconds(proc.pid) - cpu) * 1e6 / n
        return out
    finally:
        unmount(mnt, proc)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--files", type=int, default=20000)
    parser.add_argument("--size", type=int, default=4096)
    parser.add_argument("--routes", default="kernel,lowlevel,mfusepy,pyfuse3")
    parser.add_argument("--pyfuse3-python", default=None)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--work", default=None)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    routes = [r for r in args.routes.split(",") if not r.startswith("pyfuse3") or args.pyfuse3_python]
    work = scratch_dir(args.work, "bench-routes-")  # removed at exit unless given
    src, mnt = work / "src", work / "mnt"
    mnt.mkdir(parents=True, exist_ok=True)
    names = make_tree(src, args.files, args.size)
    random.Random(0).shuffle(names)
    order_file = work / "order.txt"
    order_file.write_text("\n".join(names) + "\n")
    results: dict[str, dict] = {}
    for threads in (1, 4):
        for _repeat in range(args.repeats):
            for route in routes:  # interleaved, so drift on a shared machine hits every route alike
                python = args.pyfuse3_python if route.startswith("pyfuse3") else sys.executable
                got = one_mount(route, python, src, mnt, order_file, len(names), threads)
                for key, value in got.items():
                    results.setdefault(f"{route}/{threads}", {}).setdefault(key, []).append(value)
    table = {k: {m: statistics.median(v) for m, v in d.items()} for k, d in results.items()}
    print(
        f"{args.files} files of {args.size} bytes; medians of {args.repeats} mounts; ratio = to mfusepy, same readers"
    )
    print(
        f"{'route/readers':16} {'list s':>7} {'epoch 1 f/s':>12} {'ratio':>6} {'cpu ms/1k':>10} "
        f"{'epoch 2 f/s':>12} {'ratio':>6} {'cpu ms/1k':>10}"
    )
    for key, row in table.items():
        base = table.get(f"mfusepy/{key.split('/')[1]}")
        r1 = row["epoch1"] / base["epoch1"] if base else float("nan")
        r2 = row["epoch2"] / base["epoch2"] if base else float("nan")
        print(
            f"{key:16} {row['list_s']:7.2f} {row['epoch1']:12,.0f} {r1:6.2f} {row['epoch1_cpu_ms_per_1k']:10.1f} "
            f"{row['epoch2']:12,.0f} {r2:6.2f} {row['epoch2_cpu_ms_per_1k']:10.1f}"
        )
    if args.json:
        Path(args.json).write_text(json.dumps({"table": table, "runs": results}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
