#!/usr/bin/env python3
"""The whole pass through the mount — a cold listing, then reads — beside the no-work server and the plain directory.

One run, one source tree of one-byte files on the local disk: ``flat/`` (one directory of ``--flat``
entries, what ``ls -f`` of a huge class directory does) and ``tree/`` (``--dirs`` directories of
``--per-dir`` files, what ``os.walk`` in ImageFolder's constructor does), packed once.  Each of
``--runs`` rounds measures, interleaved, each of:

* ``blockfs MODE`` — ``blockfs mount --listing MODE`` of this checkout for each mode of ``--listing``
  (``default``: no flag), a fresh mount each round (so the kernel knows nothing), its prefill awaited;
* ``before`` — the same from another checkout (``--before DIR``, e.g. ``git archive COMMIT | tar -x -C DIR``),
  for a change's before and after in the same run;
* ``null MODE`` — ``tools/bench/helpers/null_fs.py`` over the source tree on the same route, for each mode
  of ``--null-listing``: the FUSE round trips and the kernel's own work with no server work (the floor);
* ``plain`` — the source tree itself, its dentries, inodes and pages dropped first (cold).

The pass: ``ls -f flat/``, ``os.walk(tree/)``, then a random ``--sample`` of the files of both read by
``--threads`` threads, then the same sample again (served by the kernel where it kept the pages).
Reported: the median of the rounds of each step and of the whole pass, with its ratio to the plain
directory and to the first no-work server; the server's CPU seconds and anonymous memory, the kernel's
slab growth over the listing (machine-wide: others' work moves it), and the requests the server was sent.
Run as root (drop_caches, mounts); the machine's other load moves every figure, so compare ratios of one run.

    python tools/bench/bench_listing.py [--flat 120000] [--dirs 100 --per-dir 1000] [--runs 3] [--sample 20000]
                                        [--listing plain,plus,auto] [--null-listing plus,plain]
                                        [--before DIR] [--route kernel] [--work DIR] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import helpers  # noqa: F401  (puts the checkout on sys.path, for blockfs)
from helpers import HELPERS, ROOT
from helpers.benchutil import cpu_seconds, drop_caches, read_files_threads

import blockfs
from blockfs.client import read_stats
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


def served(
    command: list[str],
    mnt: Path,
    log: Path,
    measure: Callable[[Path], dict],
    env: dict | None = None,
    cwd: Path | None = None,
) -> dict:
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


def slab_bytes() -> int:
    """The kernel's slab (dentries and inodes among it), machine-wide: moved by others' work too."""
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("Slab:"):
                return int(line.split()[1]) * 1024
    return 0


def measure_listings(root: Path, expect_flat: int, expect_tree: int) -> dict:
    ls_s = timed_ls(root / "flat")
    walk_s, files = timed_walk(root / "tree")
    if files != expect_tree or len(os.listdir(root / "flat")) != expect_flat:
        raise RuntimeError(f"{root}: listed {files} files in tree/, expected {expect_tree}")
    return {"ls_flat_s": ls_s, "walk_tree_s": walk_s}


def measure_pass(
    root: Path,
    expect_flat: int,
    expect_tree: int,
    sample: list[str],
    threads: int,
    stats: Callable[[Path], dict] | None = None,
) -> dict:
    """The whole pass: the listings, then ``sample`` (paths under ``root``) read by ``threads`` threads, then
    read again (what the kernel kept serves it); the kernel's slab growth over the listings, and the
    server's requests and pushes when ``stats`` reads them (a blockfs mount: then first wait until its prefill
    has loaded every block, so each mount starts the pass with the same memory)."""
    if stats is not None:
        deadline = time.monotonic() + 300
        while (s := stats(root))["cache"]["cached_blocks"] < s["dataset"]["blocks"]:
            if time.monotonic() > deadline:
                raise RuntimeError(f"{root}: the prefill did not load every block in 300 s")
            time.sleep(0.1)
    slab = slab_bytes()
    out = measure_listings(root, expect_flat, expect_tree)
    out["slab_listing_bytes"] = slab_bytes() - slab
    if sample:
        out["read_s"], nbytes = read_files_threads([str(root / p) for p in sample], threads)
        out["reread_s"], again = read_files_threads([str(root / p) for p in sample], threads)
        if nbytes != again or nbytes != len(sample):  # one byte a file
            raise RuntimeError(f"{root}: read {nbytes} then {again} bytes of {len(sample)} one-byte files")
    out["whole_s"] = sum(out.get(k, 0.0) for k in ("ls_flat_s", "walk_tree_s", "read_s", "reread_s"))
    if stats is not None:
        s = stats(root)
        for op in ("lookup", "readdirplus", "readdir", "read", "getattr"):
            out[f"n_{op}"] = s["requests"].get(op, 0)
        out["n_pushed"] = (s.get("page_cache") or {}).get("files_pushed", 0)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--flat", type=int, default=120_000, help="entries of the one big directory")
    parser.add_argument("--dirs", type=int, default=100)
    parser.add_argument("--per-dir", type=int, default=1000)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument(
        "--sample",
        type=int,
        default=20_000,
        help="files read (twice) after the listings, drawn from both trees (0: listings only)",
    )
    parser.add_argument("--threads", type=int, default=4, help="reader threads of the sample")
    parser.add_argument(
        "--listing",
        default="default",
        help="comma-separated `blockfs mount --listing` modes, "
        "each a server of this checkout (default: the mount's default only)",
    )
    parser.add_argument(
        "--null-listing", default="plus", help="comma-separated listing modes of the no-work server (plus, auto, plain)"
    )
    parser.add_argument("--before", type=Path, help="another blockfs checkout to measure beside this one")
    parser.add_argument(
        "--mount-arg",
        action="append",
        default=[],
        help="an extra `blockfs mount` argument (repeat for several), e.g. --mount-arg=--no-prefill",
    )
    parser.add_argument(
        "--route", default="kernel", choices=("kernel", "mfusepy"), help="the FUSE route (BLOCKFS_FUSE)"
    )
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
        everything = [f"flat/{i:07d}.jpg" for i in range(args.flat)] + [
            f"tree/d{k:04d}/{i:07d}.jpg" for k in range(args.dirs) for i in range(args.per_dir)
        ]
        sample = random.Random(0).sample(everything, min(args.sample, len(everything)))

        def mount_command(checkout: Path, extra: list[str]) -> list[str]:
            return [
                sys.executable,
                "-c",
                "import sys; sys.path.insert(0, sys.argv.pop(1)); from blockfs.cli import main; sys.exit(main())",
                str(checkout),
                "mount",
                str(packed),
                str(work / "mnt"),
                "--foreground",
                *args.mount_arg,
                *extra,
            ]

        def measure(mnt: Path, blockfs_stats: bool = True) -> dict:
            return measure_pass(mnt, args.flat, n_tree, sample, args.threads, read_stats if blockfs_stats else None)

        variants: dict[str, Callable[[], dict]] = {}
        for mode in args.listing.split(","):
            extra = [] if mode == "default" else ["--listing", mode]
            variants["blockfs" if mode == "default" else f"blockfs {mode}"] = lambda extra=extra: served(
                mount_command(ROOT, extra), work / "mnt", work / "blockfs.log", measure, env
            )
        if args.before:
            before = args.before.resolve()
            variants["before"] = lambda: served(
                mount_command(before, []), work / "mnt", work / "before.log", measure, env, cwd=before
            )
        for mode in args.null_listing.split(","):
            listing = ["--listing", mode] if args.route == "kernel" else []
            variants[f"null {mode}" if args.route == "kernel" else "null"] = lambda listing=listing: served(
                [
                    sys.executable,
                    str(HELPERS / "null_fs.py"),
                    str(src),
                    str(work / "nullmnt"),
                    "--fuse",
                    args.route,
                    *listing,
                ],
                work / "nullmnt",
                work / "null.log",
                lambda m: measure(m, False),
            )

        def plain() -> dict:
            drop_caches(3)
            return measure(src, False)

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
        nulls = [n for n in variants if n.startswith("null")]
        if "plain" in failed or all(n in failed for n in nulls):
            raise SystemExit(f"the baselines failed: {failed}")
        results = {
            name: {key: statistics.median(s[key] for s in runs) for key in runs[0]}
            for name, runs in samples.items()
            if name not in failed
        }
        out = {
            "flat": args.flat,
            "tree": n_tree,
            "sample": len(sample),
            "runs": args.runs,
            "route": args.route,
            "load": os.getloadavg(),
            "median": results,
            "samples": samples,
            "failed": failed,
        }
        print(table(results, args, next(n for n in nulls if n in results), len(sample)))
        if args.json:
            args.json.write_text(json.dumps(out, indent=2))
    finally:
        for mnt in (work / "mnt", work / "nullmnt"):
            if os.path.ismount(mnt):
                unmount(mnt)
        if args.work is None:
            shutil.rmtree(work, ignore_errors=True)
    return 0


def table(results: dict, args: argparse.Namespace, floor_name: str, n_sample: int) -> str:
    plain, floor = results["plain"], results[floor_name]
    keys = [("ls_flat_s", f"ls -f {args.flat:,}"), ("walk_tree_s", f"os.walk {args.dirs * args.per_dir:,}")]
    if n_sample:
        keys += [("read_s", f"read {n_sample:,}"), ("reread_s", "again")]
    keys.append(("whole_s", "whole pass"))
    lines = [
        f"{args.route} route, median of {args.runs}; each cell: seconds, x plain directory, x {floor_name}; "
        f"load average {os.getloadavg()[0]:.1f}",
        f"{'':18}"
        + "".join(f"{title:>26}" for _, title in keys)
        + f"{'server cpu':>12}{'anon':>9}{'slab':>9}  requests",
    ]
    for name, r in results.items():
        cells = "".join(f"{f'{r[k]:.2f} s {r[k] / plain[k]:.2f}x {r[k] / floor[k]:.2f}x':>26}" for k, _ in keys)
        cpu = f"{r['server_cpu_s']:.2f} s" if "server_cpu_s" in r and name != "plain" else ""
        anon = (
            f"{r['server_anon_bytes'] / 2**20:.0f} MiB"
            if "server_anon_bytes" in r and not name.startswith(("null", "plain"))
            else ""
        )
        slab = f"{r['slab_listing_bytes'] / 2**20:+.0f} MiB"
        ops = ", ".join(f"{k[2:]} {r[k]:,.0f}" for k in r if k.startswith("n_") and r[k])
        lines.append(f"{name:18}{cells}{cpu:>12}{anon:>9}{slab:>9}  {ops}")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
