"""Benchmark ``blockfs pack`` against ``tar cf`` of the same tree, and the index at a million entries.

Everything is measured side by side in one run: each repetition runs tar and pack back to back on the
same tree, cold (page cache dropped before each, when root) and warm, and the table reports medians and
the ratio pack/tar of throughput.  Pack fsyncs its blocks by default and ``tar cf`` does not, so both are
also run the other way: ``tar cf`` followed by ``sync``, and ``pack --no-fsync`` (like for like: pack vs
tar + sync, pack --no-fsync vs tar).  Nothing is dirty when a run starts (``sync`` before each).  Then a synthetic 1,000,000-entry index is written and opened in a fresh
process to measure open time (reading the index, its CRC against blockfs.json and every check at open),
resident memory added, and ``PackedDataset.stat`` lookups per second (targets: open <= 0.5 s, >= 100k lookups/s).

    python tools/bench/bench_pack.py --files 3000 --tiny-files 20000 --repeat 3 --out results/bench_pack.json
    python tools/bench/bench_pack.py --only index --repeat 5   # the million-entry index alone
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

import numpy as np
from helpers.benchutil import drop_caches
from make_dataset import make_dataset

import blockfs
from blockfs.core.format import FORMAT_VERSION, METADATA_NAME, crc32
from blockfs.core.index import KIND_DIR, KIND_FILE, IndexColumns, write_index
from blockfs.core.verify import summary


def tree_bytes(root: str) -> int:
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(root) for f in fs)


def time_tar(src: str, out: str, then_sync: bool = False) -> float:
    t = time.perf_counter()
    subprocess.run(["tar", "cf", out, "-C", src, "."], check=True)
    if then_sync:
        os.sync()
    return time.perf_counter() - t


def time_pack(src: str, dest: str, fsync: bool) -> float:
    t = time.perf_counter()
    blockfs.pack(src, dest, force=True, fsync=fsync)
    return time.perf_counter() - t


def bench_tree(name: str, src: str, work: str, repeat: int) -> dict:
    nbytes = tree_bytes(src)
    nfiles = sum(len(fs) for _, _, fs in os.walk(src))
    rows = {}
    can_drop = drop_caches()
    for cache in ("cold", "warm") if can_drop else ("warm",):
        times: dict[str, list[float]] = {"tar cf": [], "tar cf + sync": [], "pack": [], "pack --no-fsync": []}
        if cache == "warm":
            time_tar(src, os.path.join(work, "warmup.tar"))
        for _ in range(repeat):
            for label in times:
                out = os.path.join(work, "out.tar" if label.startswith("tar") else "packed")
                os.sync()  # each run starts with nothing dirty: no run pays for an earlier one's writes
                if cache == "cold":
                    drop_caches()
                if label.startswith("tar"):
                    times[label].append(time_tar(src, out, then_sync=label.endswith("sync")))
                else:
                    times[label].append(time_pack(src, out, fsync=label == "pack"))
        med = {k: statistics.median(v) for k, v in times.items()}
        for label, secs in med.items():
            rows[f"{cache} {label}"] = {
                "seconds": secs,
                "files_per_s": nfiles / secs,
                "MB_per_s": nbytes / secs / 1e6,
                "vs_tar": med["tar cf"] / secs,
                "vs_tar_sync": med["tar cf + sync"] / secs,
            }
    with blockfs.open_dataset(os.path.join(work, "packed")) as ds:
        info = summary(ds)
    n_blocks = info["blocks"]
    return {
        "tree": name,
        "files": nfiles,
        "bytes": nbytes,
        "rows": rows,
        "header_bytes_per_file": info["header_bytes"] / max(nfiles, 1),
        "header_bytes_per_block_beyond_12n_plus_4": (info["header_bytes"] - 12 * nfiles - 4 * n_blocks)
        / max(n_blocks, 1),
    }


def synthetic_million(dest: str, n_dirs: int = 1000, per_dir: int = 1000) -> None:
    """A 1,000,000-file index (ImageNet-like names) with metadata; block files are not needed for stat."""
    paths = [b""]
    for d in range(n_dirs):
        paths.append(b"n%08d" % d)
    for d in range(n_dirs):
        paths.extend(b"n%08d/n%08d_%06d.JPEG" % (d, d, i) for i in range(per_dir))
    n = len(paths)
    kind = np.full(n, KIND_FILE, dtype=np.uint8)
    kind[: n_dirs + 1] = KIND_DIR
    n_files = n_dirs * per_dir
    files_per_block = 600
    n_blocks = -(-n_files // files_per_block)
    block = np.full(n, -1, dtype=np.int32)
    slot = np.zeros(n, dtype=np.uint32)
    perm = np.random.default_rng(0).permutation(n_files)
    block[n_dirs + 1 :] = perm // files_per_block
    slot[n_dirs + 1 :] = perm % files_per_block
    cols = IndexColumns(
        paths=paths,
        kind=kind,
        mode=np.where(kind == KIND_DIR, 0o40755, 0o100644).astype(np.uint32),
        mtime_ns=np.full(n, 1_600_000_000 * 10**9, dtype=np.int64),
        size=np.where(kind == KIND_FILE, 110_000, 0).astype(np.uint64),
        block=block,
        slot=slot,
        label=np.where(kind == KIND_FILE, np.arange(n) % n_dirs, -1).astype(np.int32),
        crc=np.zeros(n, dtype=np.uint32),
        link_targets={},
        hardlink_of={},
    )
    counts = np.bincount(block[block >= 0], minlength=n_blocks).astype(np.uint32)
    os.makedirs(dest, exist_ok=True)
    with open(os.path.join(dest, "index.bfi"), "wb") as f:
        write_index(f, cols, counts, counts.astype(np.uint64) * 110_000)
    with open(os.path.join(dest, "index.bfi"), "rb") as f:
        index_crc = crc32(f.read())
    meta = {
        "format": "blockfs",
        "format_version": FORMAT_VERSION,
        "n_entries": n,
        "n_blocks": n_blocks,
        "n_files": n_files,
        "n_dirs": n_dirs + 1,
        "n_symlinks": 0,
        "file_bytes": n_files * 110_000,
        "block_bytes": n_files * 110_000,
        "classes": [f"n{d:08d}" for d in range(n_dirs)],
        "index": {"file": "index.bfi", "crc32": index_crc},
        "pack": {
            "block_size": 64 << 20,
            "files_per_block": files_per_block,
            "labels": "dirname",
            "order": "random",
            "seed": 0,
            "follow_symlinks": False,
        },
    }
    with open(os.path.join(dest, METADATA_NAME), "w") as f:
        json.dump(meta, f)


# Runs in a fresh interpreter so its resident memory is not mixed with the writer's.
_OPEN_PROBE = r"""
import json, os, sys, time, random
import numpy as np
def rss(kind="VmRSS"):
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith(kind + ":"))
import blockfs
rng = random.Random(0)
paths = [b"n%08d/n%08d_%06d.JPEG" % (d, d, i) for d, i in ((rng.randrange(1000), rng.randrange(1000)) for _ in range(200_000))]
paths = [p.decode() for p in paths]
before, before_anon = rss(), rss("RssAnon")
t = time.perf_counter()
ds = blockfs.open_dataset(sys.argv[1])
open_s = time.perf_counter() - t
after_open = rss()
t = time.perf_counter()
for p in paths:
    ds.stat(p)
stat_s = time.perf_counter() - t
print(json.dumps({"open_s": open_s, "rss_added_by_open_MB": (after_open - before) / 1e6,
                  "rss_added_after_200k_stats_MB": (rss() - before) / 1e6,
                  "anon_added_after_200k_stats_MB": (rss("RssAnon") - before_anon) / 1e6,
                  "stat_per_s": len(paths) / stat_s}))
"""


def bench_index(work: str, repeat: int) -> dict:
    dest = os.path.join(work, "million")
    t = time.perf_counter()
    synthetic_million(dest)
    build_s = time.perf_counter() - t
    runs = []
    for _ in range(repeat):
        drop_caches()
        out = subprocess.run([sys.executable, "-c", _OPEN_PROBE, dest], capture_output=True, text=True)
        if out.returncode:
            raise SystemExit(f"the index probe failed:\n{out.stderr}")
        runs.append(json.loads(out.stdout))
    result = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
    result["entries"] = 1_001_001
    result["index_file_MB"] = os.path.getsize(os.path.join(dest, "index.bfi")) / 1e6
    result["build_s"] = build_s
    return result


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--files", type=int, default=3000, help="ImageNet-like files (~110 KiB each)")
    ap.add_argument("--tiny-files", type=int, default=20000, help="tiny files (~4 KiB each)")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--workdir", default=None, help="where trees are generated (default: a temp dir on /var/tmp)")
    ap.add_argument("--out", default="results/bench_pack.json")
    ap.add_argument("--only", choices=("trees", "index"), help="run only the pack-vs-tar trees or only the index")
    args = ap.parse_args(argv)

    work = tempfile.mkdtemp(prefix="blockfs-bench-pack-", dir=args.workdir or "/var/tmp")
    try:
        results = {"trees": [], "cores": os.cpu_count()}
        trees = (("imagenet-like", "imagenet", args.files), ("tiny", "tiny", args.tiny_files))
        for name, mode, count in trees if args.only != "index" else ():
            src = os.path.join(work, f"src-{mode}")
            make_dataset(src, mode, count, 10, seed=0)
            results["trees"].append(bench_tree(name, src, work, args.repeat))
            shutil.rmtree(src)
        if args.only != "trees":
            results["index"] = bench_index(work, args.repeat)
    finally:
        shutil.rmtree(work, ignore_errors=True)

    for tree in results["trees"]:
        print(
            f"\n{tree['tree']}: {tree['files']} files, {tree['bytes'] / 1e6:.0f} MB; header {tree['header_bytes_per_file']:.2f} B/file "
            f"(+{tree['header_bytes_per_block_beyond_12n_plus_4']:.0f} B/block beyond 12N+4)"
        )
        print(f"  {'run':<24}{'seconds':>9}{'files/s':>11}{'MB/s':>9}{'vs tar':>8}{'vs tar+sync':>13}")
        for label, row in tree["rows"].items():
            print(
                f"  {label:<24}{row['seconds']:>9.2f}{row['files_per_s']:>11,.0f}{row['MB_per_s']:>9.1f}"
                f"{row['vs_tar']:>7.2f}x{row['vs_tar_sync']:>12.2f}x"
            )
    ix = results.get("index")
    if ix:
        print(
            f"\nindex of {ix['entries']:,} entries ({ix['index_file_MB']:.0f} MB file, built in {ix['build_s']:.1f} s): "
            f"open {ix['open_s'] * 1000:.1f} ms (read, CRC and every check), +{ix['rss_added_by_open_MB']:.1f} MB RSS "
            f"at open (the index is held in the process's own memory), +{ix['rss_added_after_200k_stats_MB']:.1f} MB "
            f"after 200k random stats (of which {ix['anon_added_after_200k_stats_MB']:.1f} MB anonymous), "
            f"{ix['stat_per_s']:,.0f} stat/s (lookup + stat)"
        )
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(results, f, indent=2)
    print(f"\nwrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
