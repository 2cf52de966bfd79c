"""Reads from a list of paths, no listing first: blockfs served from memory beside the no-work server (the floor).

    python tools/bench/bench_lookup_read.py [--files 50000] [--threads 4] [--repeats 3] [--fuse kernel]
                                            [--null-c 2[,4,4clone,2uring]] [--before DIR]
                                            [--variant LABEL=VAR=VALUE[,...]] [--work DIR] [--json OUT]

A tree of ``--files`` files of 2-6 KiB (tools/make_dataset.py's ``tiny`` mode, ~4 KiB), packed; blockfs mounted
with every block prefilled into its memory, and tools/bench/helpers/null_fs.py (no work per request) on the
same tree and route, and on the kernel route the same no-work server compiled (``null_fs.py --fuse c``:
null_fs_c.c, no Python in the request loop; ``--null-c`` its worker threads, one row each, ``Nclone`` for a
/dev/fuse clone per worker, ``Nuring`` for FUSE over io_uring with N entries a CPU, ``none`` for no row):
what of the floor is Python's.  Each repeat, the servers in turn, two passes each (helpers/storage_reader.py,
``open().read()`` per file, the list in a shuffled order split over ``--threads`` reader threads):

* **cold**: every kernel cache dropped first (``drop_caches`` 3: pages, dentries, inodes; needs root), so each
  file costs a LOOKUP and a READ (and, on CPython < 3.14, the isatty ioctl);
* **kernel-served**: the same list again at once, pages and dentries cached: what each open still sends.

The plain directory (the tree the dataset was packed from) is read the same two ways, for the goals
"kernel-served ≥ 0.9× the plain directory warm".  ``--before DIR``: a checkout of another version of blockfs
(``git archive`` of the commit before a change), mounted and read in the same repeats, so a change is
measured against its baseline in one run on a shared machine.  ``--variant LABEL=VAR=VALUE[,VAR=VALUE]``
(repeatable): this blockfs mounted again with those environment variables added, read in the same repeats (a
spike's switches compared in one run).

Reported per server and pass: the median files/s, its ratio to the no-work server's (cold) or to the plain
directory's (kernel-served), the server's CPU microseconds per file (``/proc/PID/stat``: what a file costs the
server, steadier than a rate on a busy machine), the reader's (its process's CPU, the kernel's work in its
system calls included: with the server's, what a file costs the machine), and the requests it was sent per
file (null_fs's counted through its ``--counts`` file, blockfs's from its statistics).
"""

from __future__ import annotations

import argparse
import json
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

import helpers  # noqa: F401  (puts tools/ and the checkout on sys.path: make_dataset, blockfs)

# isort: split
import make_dataset as md
from helpers import HELPERS, ROOT, null_fs
from helpers.benchutil import (
    add_variant_options,
    cpu_seconds,
    drop_caches,
    mount_checkout,
    run_storage_reader,
    scratch_dir,
    shuffled_order,
    variant_checkouts,
)

import blockfs
from blockfs.client import read_stats
from blockfs.serve.daemon import MountError, unmount, wait_until_mounted

NULL, PLAIN = "null_fs (floor)", "plain directory"


def c_rows(spec: str) -> dict[str, tuple[int, str]]:
    """``--null-c``'s rows: label -> (worker threads, "" / "clone" / "uring")."""
    rows: dict[str, tuple[int, str]] = {}
    for item in filter(None, spec.split(",")):
        if item == "none":
            continue
        how = next((h for h in ("clone", "uring") if item.endswith(h)), "")
        threads = item.removesuffix(how)
        if not threads.isdigit() or int(threads) < 1:
            raise SystemExit(f"--null-c {item!r}: give worker threads as N, Nclone or Nuring (e.g. 2,4clone), or none")
        label = f"null_fs_c {threads}t" if how != "uring" else f"null_fs_c uring {threads}e"
        rows[label + (" clone" if how == "clone" else "")] = (int(threads), how)
    return rows


def c_server_pid(proc: subprocess.Popen, timeout: float = 30) -> int:
    """The pid of null_fs_c under ``null_fs.py --fuse c`` (``proc``: the Python supervisor), whose CPU is the
    server's."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with open(f"/proc/{proc.pid}/task/{proc.pid}/children") as f:
            kids = f.read().split()
        if kids:
            return int(kids[0])
        if proc.poll() is not None:
            break
        time.sleep(0.01)
    raise SystemExit(f"null_fs.py --fuse c (pid {proc.pid}) started no server in {timeout:.0f} s")


def null_counts(proc: subprocess.Popen, counts_file: Path, timeout: float = 30) -> dict[str, int]:
    """The requests null_fs has received so far: it writes them to ``counts_file`` at SIGUSR1."""
    counts_file.unlink(missing_ok=True)
    proc.send_signal(signal.SIGUSR1)
    deadline = time.monotonic() + timeout
    while not counts_file.exists():
        if time.monotonic() > deadline:
            raise SystemExit(f"null_fs wrote no request counts to {counts_file} in {timeout:.0f} s")
        time.sleep(0.01)
    return json.loads(counts_file.read_text())


def mount_blockfs(checkout: Path, packed: Path, mnt: Path, route: str, env: dict[str, str] | None = None) -> int:
    """A background ``blockfs mount`` of ``checkout``'s blockfs (``env`` added to its environment); its pid once
    every block is in memory."""
    pid = mount_checkout(checkout, packed, mnt, route, env=env)
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
    parser.add_argument(
        "--null-c",
        default="2",
        help="the compiled no-work server's rows (kernel route), comma-separated: N worker threads, Nclone (a "
        "/dev/fuse clone each), Nuring (FUSE over io_uring, N entries a CPU; root); none",
    )
    parser.add_argument("--before", help="a checkout of the blockfs to compare with (measured in the same repeats)")
    add_variant_options(parser)
    args = parser.parse_args()
    if not drop_caches(1):
        raise SystemExit("dropping the kernel's caches needs root: every pass must start with none")
    work = scratch_dir(args.work, "bench-lookup-read-")  # removed at exit unless given
    src, packed = work / "src", work / "packed"
    if not (packed / "blockfs.json").exists():
        md.make_dataset(src, "tiny", files=args.files, classes=100, seed=0, force=True)
        blockfs.pack(src, packed, block_size=16 << 20, force=True, fsync=False)
    order_file = work / "order.txt"
    names = shuffled_order(src, order_file)

    checkouts: dict[str, tuple[Path, dict[str, str]]] = {"blockfs": (ROOT, {})}
    if args.before:
        checkouts["blockfs before"] = (Path(args.before).resolve(), {})
    checkouts.update(variant_checkouts(args.variant, ROOT))
    servers: dict[str, tuple[Path, int | None]] = {}
    nulls: dict[str, tuple[subprocess.Popen, Path]] = {}  # the no-work servers: their supervisor, counts file
    compiled = c_rows(args.null_c) if args.fuse == "kernel" else {}
    if compiled and null_fs.compiler() is None:
        print("no C compiler (cc, gcc or $CC): the compiled no-work server's rows are left out", file=sys.stderr)
        compiled = {}
    log = open(work / "null.log", "ab")  # every no-work server's output, one after another
    try:
        for name, (checkout, env) in checkouts.items():
            mnt = work / f"mnt-{len(servers)}"
            servers[name] = (mnt, mount_blockfs(checkout, packed, mnt, args.fuse, env))
        starts = {NULL: ["--fuse", args.fuse]}
        for name, (threads, how) in compiled.items():
            starts[name] = ["--fuse", "c", "--threads", str(threads)] + ([f"--{how}"] if how else [])
        for name, how in starts.items():
            null_mnt = work / f"mnt-null-{len(nulls)}"
            null_mnt.mkdir(exist_ok=True)
            counts_file = work / f"null-counts-{len(nulls)}.json"
            proc = subprocess.Popen(
                [sys.executable, str(HELPERS / "null_fs.py"), str(src), str(null_mnt), *how]
                + (["--counts", str(counts_file)] if args.fuse == "kernel" else []),
                stdout=log,
                stderr=log,
                stdin=subprocess.DEVNULL,
            )
            nulls[name] = (proc, counts_file)
            wait_until_mounted(null_mnt, proc, 120)
            servers[name] = (null_mnt, c_server_pid(proc) if name in compiled else proc.pid)
        servers[PLAIN] = (src, None)

        def requests(name: str) -> dict[str, int]:
            if name == PLAIN or (name in nulls and args.fuse != "kernel"):
                return {}
            if name in nulls:
                return null_counts(*nulls[name])
            return read_stats(servers[name][0])["requests"]

        samples: dict[str, dict[str, list[dict]]] = {name: {"cold": [], "warm": []} for name in servers}
        for _ in range(args.repeats):
            for name, (mnt, pid) in servers.items():
                drop_caches(3)
                for kind in ("cold", "warm"):  # warm: the same list at once, everything the kernel keeps kept
                    before = requests(name)
                    cpu = cpu_seconds(pid) if pid else 0.0
                    got = run_storage_reader(mnt, order_file, args.threads)
                    after = requests(name)
                    sample = {
                        "files_s": got["files"] / got["seconds"],
                        "cpu_us_per_file": (cpu_seconds(pid) - cpu) * 1e6 / got["files"] if pid else 0.0,
                        "reader_cpu_us_per_file": got["cpu_ms"] * 1e3 / got["files"],
                        "requests_per_file": {
                            k: (v - before.get(k, 0)) / got["files"]
                            for k, v in after.items()
                            if v != before.get(k, 0) and k != "getxattr"  # getxattr: the statistics read
                        },
                    }
                    samples[name][kind].append(sample)
    finally:
        for name, (mnt, _pid) in servers.items():
            if name not in nulls and name != PLAIN:
                unmount(mnt)
        for i, (proc, _counts) in enumerate(nulls.values()):
            try:  # live or not: a supervisor killed outright leaves its mount behind
                unmount(work / f"mnt-null-{i}")
            except MountError:
                pass  # not mounted (its server took it down)
            proc.wait(30)
        log.close()

    print(
        f"{len(names):,} files of 2-6 KiB read from a list, no listing, {args.threads} readers; route {args.fuse}; "
        f"medians of {args.repeats}; cold: every kernel cache dropped first; kernel-served: the same list again"
    )
    print(
        f"{'pass':13} {'server':18} {'files/s':>9} {'ratio':>6} {'cpu us/file':>11} {'reader us':>9}"
        "  requests per file (median)"
    )
    for kind, reference in (("cold", NULL), ("warm", PLAIN)):
        base = statistics.median(s["files_s"] for s in samples[reference][kind])
        for name, by_kind in samples.items():
            rows = by_kind[kind]
            rate = statistics.median(s["files_s"] for s in rows)
            cpu = statistics.median(s["cpu_us_per_file"] for s in rows)
            reader = statistics.median(s["reader_cpu_us_per_file"] for s in rows)
            ops = sorted({k for s in rows for k in s["requests_per_file"]})
            per_file = ", ".join(
                f"{k} {statistics.median(s['requests_per_file'].get(k, 0.0) for s in rows):.2f}" for k in ops
            )
            label = "cold" if kind == "cold" else "kernel-served"
            print(f"{label:13} {name:18} {rate:9,.0f} {rate / base:6.2f} {cpu:11.1f} {reader:9.1f}  {per_file}")
    print(f"ratio: to {NULL}'s files/s for the cold pass, to the {PLAIN}'s for the kernel-served pass")
    if args.json:
        Path(args.json).write_text(
            json.dumps({"files": len(names), "threads": args.threads, "route": args.fuse, "samples": samples}, indent=2)
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
