#!/usr/bin/env python3
"""How fast a cold listing runs through the mount, beside the no-work server and the plain directory.

One run, one source tree of one-byte files on the local disk: ``flat/`` (one directory of ``--flat``
entries, what ``ls -f`` of a huge class directory does) and ``tree/`` (``--dirs`` directories of
``--per-dir`` files, what ``os.walk`` in ImageFolder's constructor does), packed once.  Each of
``--runs`` rounds measures, interleaved, each of:

* ``blockfs`` — ``blockfs mount`` of this checkout, a fresh mount each round (so the kernel knows nothing);
* ``before`` — the same from another checkout (``--before DIR``, e.g. ``git archive COMMIT | tar -x -C DIR``),
  for a change's before and after in the same run;
* ``null`` — ``tools/bench/helpers/null_fs.py`` over the source tree on the same route: the FUSE round
  trips and the kernel's own work with no server work (the floor);
* ``plain`` — the source tree itself, its dentries, inodes and pages dropped first (cold).

Reported: the median of the rounds and its ratio to the plain directory and to the floor, and for the
blockfs servers their anonymous memory after the listings (what a listing leaves in the server).  Run as
root (drop_caches, mounts); the machine's other load moves every figure, so compare ratios of one run.

    python tools/bench/bench_listing.py [--flat 120000] [--dirs 100 --per-dir 1000] [--runs 3]
                                        [--before DIR] [--route kernel] [--work DIR] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable

import helpers  # noqa: F401  (puts the checkout on sys.path, for blockfs)
from helpers import HELPERS, ROOT
from helpers.benchutil import drop_caches

import blockfs
from blockfs.serve.daemon import unmount, wait_until_mounted


def make_tree(src: Path, flat: int, dirs: int, per_dir: int) -> None:
    """``flat/`` of ``flat`` files and ``tree/`` of ``dirs`` x ``per_dir`` files, one byte each."""
    for d, count in [(src / "flat", flat)] + [(src / "tree" / f"d{k:04d}", per_dir) for k in range(dirs)]:
        d.mkdir(parents=True, exist_ok=True)
        for i in range(count):
            with open(d / f"{i:07d}.jpg", "wb") as f:
                f.write(b"x")


def timed_ls(directory: Path) -> float:
    """Seconds for ``ls -f`` (no sort, no stat: getdents only) to list ``directory``."""
    started = time.perf_counter()
    subprocess.run(["ls", "-f", str(directory)], stdout=subprocess.DEVNULL, check=True)
    return time.perf_counter() - started


def timed_walk(root: Path) -> tuple[float, int]:
    """Seconds for ``os.walk`` (scandir: names and types) over ``root``, and the files it found."""
    started = time.perf_counter()
    files = sum(len(names) for _, _, names in os.walk(root))
    return time.perf_counter() - started, files


def anon_bytes(pid: int) -> int:
    """The anonymous memory of process ``pid`` (its own: not mapped files, not the page cache)."""
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) * 1024
    return 0


def cpu_seconds(pid: int) -> float:
    """User + system CPU time process ``pid`` has used (all its threads)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def served(command: list[str], mnt: Path, log: Path, measure: Callable[[Path], dict], env: dict | None = None,
           cwd: Path | None = None) -> dict:  # fmt: skip
    """Start a server, wait until ``mnt`` serves, ``measure(mnt)`` (plus the server's CPU time during it
    and its anonymous memory after it: less moved by the machine's other load than wall time), and
    always unmount."""
    mnt.mkdir(parents=True, exist_ok=True)
    with open(log, "ab") as out:
        proc = subprocess.Popen(command, stdout=out, stderr=out, stdin=subprocess.DEVNULL, env=env, cwd=cwd)
    try:
        wait_until_mounted(mnt, proc, 300, str(log))
        cpu = cpu_seconds(proc.pid)
        result = measure(mnt)
        result["server_cpu_s"] = cpu_seconds(proc.pid) - cpu
        result["server_anon_bytes"] = anon_bytes(proc.pid)
        return result
    finally:
        unmount(mnt)
        proc.wait(60)


def measure_listings(root: Path, expect_flat: int, expect_tree: int) -> dict:
    ls_s = timed_ls(root / "flat")
    walk_s, files = timed_walk(root / "tree")
    if files != expect_tree or len(os.listdir(root / "flat")) != expect_flat:
        raise RuntimeError(f"{root}: listed {files} files in tree/, expected {expect_tree}")
    return {"ls_flat_s": ls_s, "walk_tree_s": walk_s}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--flat", type=int, default=120_000, help="entries of the one big directory")
    parser.add_argument("--dirs", type=int, default=100)
    parser.add_argument("--per-dir", type=int, default=1000)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--before", type=Path, help="another blockfs checkout to measure beside this one")
    parser.add_argument("--mount-arg", action="append", default=[], help="an extra `blockfs mount` argument "
                        "(repeat for several), e.g. --mount-arg=--no-prefill")
    parser.add_argument("--route", default="kernel", choices=("kernel", "mfusepy"), help="the FUSE route (BLOCKFS_FUSE)")
    parser.add_argument("--work", type=Path, help="where the trees go (default: a temporary directory, removed)")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    if os.geteuid() != 0:
        parser.error("run as root: the plain directory's cold runs drop the kernel's caches")

    work = args.work or Path(tempfile.mkdtemp(prefix="bench-listing-", dir="/var/tmp"))
    work.mkdir(parents=True, exist_ok=True)
    src, packed = work / "src", work / "packed"
    n_tree = args.dirs * args.per_dir
    try:
        if not (src / "tree").is_dir():
            print(f"making {args.flat} + {n_tree} files in {src}", file=sys.stderr)
            make_tree(src, args.flat, args.dirs, args.per_dir)
        if not (packed / "index.bfi").exists():
            started = time.perf_counter()
            blockfs.pack(src, packed, fsync=False, force=True)
            print(f"packed in {time.perf_counter() - started:.1f} s", file=sys.stderr)
        env = dict(os.environ, BLOCKFS_FUSE=args.route)

        def mount_command(checkout: Path) -> list[str]:
            return [sys.executable, "-c", "import sys; sys.path.insert(0, sys.argv.pop(1)); "
                    "from blockfs.cli import main; sys.exit(main())", str(checkout),
                    "mount", str(packed), str(work / "mnt"), "--foreground", *args.mount_arg]  # fmt: skip

        def measure(mnt: Path) -> dict:
            return measure_listings(mnt, args.flat, n_tree)

        variants: dict[str, Callable[[], dict]] = {
            "blockfs": lambda: served(mount_command(ROOT), work / "mnt", work / "blockfs.log", measure, env),
        }
        if args.before:
            before = args.before.resolve()
            variants["before"] = lambda: served(mount_command(before), work / "mnt", work / "before.log", measure,
                                                env, cwd=before)  # fmt: skip
        variants["null"] = lambda: served(
            [sys.executable, str(HELPERS / "null_fs.py"), str(src), str(work / "nullmnt"), "--fuse", args.route],
            work / "nullmnt", work / "null.log", measure)  # fmt: skip

        def plain() -> dict:
            drop_caches(3)
            return measure(src)

        variants["plain"] = plain
        samples: dict[str, list[dict]] = {name: [] for name in variants}
        failed: dict[str, str] = {}
        for r in range(args.runs):
            for name, run in variants.items():
                if name in failed:
                    continue
                try:
                    samples[name].append(run())
                except Exception as e:  # noqa: BLE001 - one server's failure leaves the others' figures
                    failed[name] = f"{type(e).__name__}: {e}"
                    print(f"round {r + 1} {name} failed, left out from now on: {failed[name]}", file=sys.stderr)
                    continue
                print(f"round {r + 1} {name}: {samples[name][-1]}", file=sys.stderr)
        if "plain" in failed or "null" in failed:
            raise SystemExit(f"the baselines failed: {failed}")
        results = {name: {key: statistics.median(s[key] for s in runs) for key in runs[0]}
                   for name, runs in samples.items() if name not in failed}  # fmt: skip
        out = {"flat": args.flat, "tree": n_tree, "runs": args.runs, "route": args.route, "median": results,
               "samples": samples, "failed": failed}  # fmt: skip
        print(table(results, args))
        if args.json:
            args.json.write_text(json.dumps(out, indent=2))
    finally:
        for mnt in (work / "mnt", work / "nullmnt"):
            if os.path.ismount(mnt):
                unmount(mnt)
        if args.work is None:
            shutil.rmtree(work, ignore_errors=True)
    return 0


def table(results: dict, args: argparse.Namespace) -> str:
    plain, floor = results["plain"], results["null"]
    lines = [f"cold listings, {args.route} route, median of {args.runs} (ratios: time / plain directory's, "
             f"time / no-work server's)",
             f"{'':10} {'ls -f of ' + format(args.flat, ',') + ' entries':>36} "
             f"{'os.walk of ' + format(args.dirs * args.per_dir, ',') + ' files':>36} {'server cpu':>12} "
             f"{'server anon':>12}"]  # fmt: skip
    for name, r in results.items():
        cells = []
        for key in ("ls_flat_s", "walk_tree_s"):
            cells.append(f"{r[key]:8.2f} s {r[key] / plain[key]:6.2f}x plain {r[key] / floor[key]:5.2f}x null")
        cpu = f"{r['server_cpu_s']:8.2f} s" if "server_cpu_s" in r else ""
        anon = f"{r['server_anon_bytes'] / 2**20:9.0f} MiB" if "server_anon_bytes" in r and name != "null" else ""
        lines.append(f"{name:10} {cells[0]:>36} {cells[1]:>36} {cpu:>12} {anon:>12}")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
