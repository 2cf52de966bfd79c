"""Reads from a list of paths, no listing first: blockfs served from memory beside the no-work server (the floor).

    python tools/bench/bench_lookup_read.py [--files 50000] [--threads 4] [--repeats 3] [--fuse kernel]
                                            [--before DIR] [--work DIR] [--json OUT]

A tree of ``--files`` files of 2-6 KiB (tools/make_dataset.py's ``tiny`` mode, ~4 KiB), packed; blockfs mounted
with every block prefilled into its memory, and tools/bench/helpers/null_fs.py (no work per request) on the
same tree and route.  Each repeat, the servers in turn: every kernel cache dropped (``drop_caches`` 3: pages,
dentries, inodes; needs root), then the list read in a shuffled order by ``--threads`` reader threads
(helpers/storage_reader.py, ``open().read()`` per file), so each file costs a LOOKUP and a READ (and, on
CPython < 3.14, the isatty ioctl).  ``--before DIR``: a checkout of another version of blockfs (``git archive``
of the commit before a change), mounted and read in the same repeats, so a change is measured against its
baseline in one run on a shared machine.

Reported per server: the median files/s, its ratio to the no-work server's, the server's CPU milliseconds per
1,000 files (``/proc/PID/stat``: what a request costs, steadier than a rate on a busy machine), and for blockfs
the requests it was sent and the files it pushed per file read.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import helpers  # noqa: F401  (puts tools/ and the checkout on sys.path: make_dataset, blockfs)

# isort: split
import make_dataset as md
from helpers import HELPERS, ROOT
from helpers.benchutil import drop_caches, run_storage_reader

import blockfs
from blockfs.client import read_stats
from blockfs.serve.daemon import start_background, unmount, wait_until_mounted


def cpu_seconds(pid: int) -> float:
    with open(f"/proc/{pid}/stat", "rb") as f:
        fields = f.read().rsplit(b")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def mount_blockfs(checkout: Path, packed: Path, mnt: Path, route: str) -> int:
    """A background ``blockfs mount`` of ``checkout``'s blockfs; its pid once every block is in memory."""
    mnt.mkdir(parents=True, exist_ok=True)
    env_before = dict(os.environ)
    os.environ["PYTHONPATH"] = str(checkout)
    os.environ["BLOCKFS_FUSE"] = route
    try:
        command = [sys.executable, "-m", "blockfs", "mount", str(packed), str(mnt), "--foreground"]
        pid = start_background(command, mnt, str(mnt.parent / f"{mnt.name}.log"), timeout=120)
    finally:
        os.environ.clear()
        os.environ.update(env_before)
    stats = read_stats(mnt)
    deadline = 600
    started = time.monotonic()
    while stats["cache"]["cached_blocks"] < stats["dataset"]["blocks"]:
        if time.monotonic() - started > deadline:
            raise SystemExit(f"{mnt}: prefill did not load every block in {deadline} s")
        time.sleep(0.1)
        stats = read_stats(mnt)
    return pid


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--files", type=int, default=50_000)
    parser.add_argument("--threads", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--fuse", default="kernel", choices=("kernel", "mfusepy"))
    parser.add_argument("--before", help="a checkout of the blockfs to compare with (measured in the same repeats)")
    parser.add_argument("--work", help="scratch directory (default: a new one in the temp dir)")
    parser.add_argument("--json", help="write every sample here")
    args = parser.parse_args()
    if not drop_caches(1):
        raise SystemExit("dropping the kernel's caches needs root: every pass must start with none")
    work = Path(args.work or tempfile.mkdtemp(prefix="bench-lookup-read-"))
    src, packed = work / "src", work / "packed"
    if not (packed / "blockfs.json").exists():
        md.make_dataset(src, "tiny", files=args.files, classes=100, seed=0, force=True)
        blockfs.pack(src, packed, block_size=16 << 20, force=True, fsync=False)
    names = sorted(os.path.relpath(os.path.join(d, f), src) for d, _, fs in os.walk(src) for f in fs)
    random.Random(0).shuffle(names)
    order_file = work / "order.txt"
    order_file.write_text("\n".join(names) + "\n")

    checkouts = {"blockfs": ROOT} | ({"blockfs before": Path(args.before).resolve()} if args.before else {})
    servers: dict[str, tuple[Path, int]] = {}
    null_proc = None
    try:
        for name, checkout in checkouts.items():
            mnt = work / f"mnt-{len(servers)}"
            servers[name] = (mnt, mount_blockfs(checkout, packed, mnt, args.fuse))
        null_mnt = work / "mnt-null"
        null_mnt.mkdir(exist_ok=True)
        log = open(work / "null.log", "ab")
        null_proc = subprocess.Popen(
            [sys.executable, str(HELPERS / "null_fs.py"), str(src), str(null_mnt), "--fuse", args.fuse],
            stdout=log,
            stderr=log,
            stdin=subprocess.DEVNULL,
        )
        wait_until_mounted(null_mnt, null_proc, 120)
        servers["null_fs (floor)"] = (null_mnt, null_proc.pid)
        samples: dict[str, list[dict]] = {name: [] for name in servers}
        for _ in range(args.repeats):
            for name, (mnt, pid) in servers.items():
                before = read_stats(mnt)["requests"] if name != "null_fs (floor)" else {}
                drop_caches(3)
                cpu = cpu_seconds(pid)
                got = run_storage_reader(mnt, order_file, args.threads)
                sample = {
                    "files_s": got["files"] / got["seconds"],
                    "cpu_ms_per_1k": (cpu_seconds(pid) - cpu) * 1e6 / got["files"],
                }
                if name != "null_fs (floor)":
                    s = read_stats(mnt)
                    sample["requests_per_file"] = {
                        k: (v - before.get(k, 0)) / got["files"]
                        for k, v in s["requests"].items()
                        if v != before.get(k, 0)
                    }
                    sample["files_pushed"] = (s.get("page_cache") or {}).get("files_pushed", 0)
                samples[name].append(sample)
    finally:
        for name, (mnt, _pid) in servers.items():
            if name != "null_fs (floor)":
                unmount(mnt)
        if null_proc is not None:
            unmount(work / "mnt-null")
            null_proc.wait(30)

    floor = statistics.median(s["files_s"] for s in samples["null_fs (floor)"])
    print(
        f"{len(names):,} files of 2-6 KiB read from a list, no listing, {args.threads} readers, every kernel "
        f"cache dropped first; route {args.fuse}; medians of {args.repeats}"
    )
    print(f"{'server':18} {'files/s':>9} {'x floor':>8} {'cpu ms/1k':>10}  requests per file (last repeat)")
    for name, rows in samples.items():
        rate = statistics.median(s["files_s"] for s in rows)
        cpu = statistics.median(s["cpu_ms_per_1k"] for s in rows)
        per_file = ", ".join(f"{k} {v:.2f}" for k, v in sorted(rows[-1].get("requests_per_file", {}).items()))
        print(f"{name:18} {rate:9,.0f} {rate / floor:8.2f} {cpu:10.1f}  {per_file}")
    if args.json:
        Path(args.json).write_text(
            json.dumps({"files": len(names), "threads": args.threads, "route": args.fuse, "samples": samples}, indent=2)
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
