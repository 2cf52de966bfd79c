"""What a read that is not in memory costs the mount's CPU, beside a read that is: one mount each, same run.

    python tools/bench/bench_miss_read.py [--files 2000] [--threads 4] [--repeats 5] [--fuse kernel]
                                          [--before DIR] [--variant LABEL=VAR=VALUE[,...]] [--work DIR] [--json OUT]

A tree of ``--files`` files of 10-100 KiB (bench_nodes' sizes), packed in 1 MiB blocks, mounted twice with
``--open-mode none --no-retain`` (every open's reads reach the server):

* **memory**: every block in memory (``--preload``): each READ is answered by the reader thread that took it;
* **miss**: ``--cache-size 0``: each READ reads its file alone from the (local) store, verified, on a data
  thread (the kernel route's deferred read; on mfusepy, on libfuse's worker thread).

``--before [LABEL=]DIR`` (repeatable): a checkout of another version of blockfs (``git archive`` of the commit
before a change), mounted the same two ways and read in the same repeats.  Each repeat reads every mount in
turn, the whole list in a shuffled order over ``--threads`` reader threads (helpers/storage_reader.py).
``--variant LABEL=VAR=VALUE[,VAR=VALUE]`` (repeatable): this blockfs mounted the same two ways again with those
environment variables added (a spike's switches compared in one run).
Reported per mount: median files/s, and the server's CPU microseconds per file (``/proc/PID/stat``: user +
system, every thread; steadier than a rate on a busy machine), and miss - memory: what the miss path adds.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

import helpers  # noqa: F401  (puts tools/ and the checkout on sys.path)

# isort: split
import bench_remote as br
from helpers import ROOT
from helpers.benchutil import (
    add_variant_options,
    cpu_seconds,
    mount_checkout,
    run_storage_reader,
    scratch_dir,
    shuffled_order,
    variant_checkouts,
)

import blockfs
from blockfs.client import read_stats
from blockfs.serve.daemon import unmount

KINDS = {
    "memory": ["--preload", "--cache-size", "1GiB"],
    "miss": ["--cache-size", "0"],
}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--files", type=int, default=2000)
    parser.add_argument("--threads", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--fuse", default="kernel", choices=("kernel", "mfusepy"))
    parser.add_argument(
        "--before",
        action="append",
        default=[],
        metavar="[LABEL=]DIR",
        help="a checkout of the blockfs to compare with (measured in the same repeats); repeatable",
    )
    add_variant_options(parser)
    args = parser.parse_args()
    work = scratch_dir(args.work, "bench-miss-read-")  # removed at exit unless given
    src, packed = work / "src", work / "packed"
    if not (packed / "blockfs.json").exists():
        br.make_tree(src, args.files, 10 << 10, 100 << 10, 20, 0)
        blockfs.pack(src, packed, block_size=1 << 20, force=True, fsync=False)
    order_file = work / "order.txt"
    names = shuffled_order(src, order_file)

    checkouts: dict[str, tuple[Path, dict[str, str]]] = {"this": (ROOT, {})}
    for given in args.before:
        label, sep, path = given.rpartition("=")
        checkouts[label if sep else "before" if len(args.before) == 1 else path] = (Path(path).resolve(), {})
    checkouts.update(variant_checkouts(args.variant, ROOT))
    servers: dict[str, tuple[Path, int]] = {}
    try:
        for version, (checkout, env) in checkouts.items():
            for kind, extra in KINDS.items():
                mnt = work / f"mnt-{len(servers)}"
                servers[f"{version} {kind}"] = (
                    mnt,
                    mount_checkout(
                        checkout,
                        packed,
                        mnt,
                        args.fuse,
                        ["--open-mode", "none", "--no-retain", *extra],
                        timeout=300,
                        env=env,
                    ),
                )
        for name, (mnt, _pid) in servers.items():  # --preload answers once loaded; check, and warm every mount
            stats = read_stats(mnt)
            if name.endswith("memory") and stats["cache"]["cached_blocks"] < stats["dataset"]["blocks"]:
                raise SystemExit(f"{name}: not every block is in memory after --preload")
            run_storage_reader(mnt, order_file, args.threads)
        samples: dict[str, list[dict]] = {name: [] for name in servers}
        for _ in range(args.repeats):
            for name, (mnt, pid) in servers.items():
                cpu = cpu_seconds(pid)
                got = run_storage_reader(mnt, order_file, args.threads)
                samples[name].append(
                    {"files_s": got["files"] / got["seconds"], "cpu_us": (cpu_seconds(pid) - cpu) * 1e6 / got["files"]}
                )
    finally:
        for mnt, _pid in servers.values():
            unmount(mnt)

    print(
        f"{len(names):,} files of 10-100 KiB, --open-mode none, {args.threads} readers, route {args.fuse}; "
        f"medians of {args.repeats} (a shared machine: read ratios within the run)"
    )
    width = max(len(n) for n in servers) + 1
    print(f"{'mount':{width}} {'files/s':>8} {'cpu us/file':>11}")
    med = {n: {k: statistics.median(s[k] for s in rows) for k in ("files_s", "cpu_us")} for n, rows in samples.items()}
    for name, m in med.items():
        print(f"{name:{width}} {m['files_s']:8,.0f} {m['cpu_us']:11.0f}")
    for version in checkouts:
        extra = med[f"{version} miss"]["cpu_us"] - med[f"{version} memory"]["cpu_us"]
        print(f"{version}: a miss costs {extra:.0f} us of CPU more than a memory hit")
    if args.json:
        Path(args.json).write_text(json.dumps({"files": len(names), "route": args.fuse, "samples": samples}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
