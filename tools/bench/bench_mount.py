"""Benchmark ``blockfs mount``: throughput against the raw directory and ratarmount, and cache hit rates.

    python tools/bench/bench_mount.py [--out results/bench_mount] [--imagenet-files 2000] [--tiny-files 20000]
                                [--repeats 2] [--no-ratarmount] [--no-variants] [--work DIR]

Everything runs in one go on the same generated trees (tools/make_dataset.py): ImageNet-like files (~110 KiB)
and tiny ones (~4 KiB).  One reader thread makes a per-file shuffled pass, ``open(path, "rb").read()`` per
file (what PIL and numpy do), a new order every epoch, over:

* the raw directory, cold (``drop_caches`` first; needs root) and warm (the page cache holds it);
* the mount: epoch 1 cold (blocks read from disk), epoch 2 warm (the kernel page cache serves it), then
  with the page cache dropped (every read served from blockfs memory) and with every kernel cache dropped
  (lookups too go through Python);
* tools/bench/helpers/null_fs.py, a FUSE server on the same route (``BLOCKFS_FUSE``, default kernel) that
  does no work per read, read the same ways as the mount's memory: the ceiling the FUSE round trips leave on
  this machine;
* ratarmount on a tar of the same tree (when it is installed), cold and warm;
* mount-option variants on the tiny tree (open ENOSYS / keep_cache / none, thread pool or single thread,
  fusepy on libfuse 2), which the defaults in blockfs/fs.py were chosen from.

Then the per-epoch hit rate of cache-once, LRU and FIFO at budget / dataset = 0.25, 0.5 and 0.75 with a new
random order each epoch: simulated with the real policy objects over each tree's block layout (cheap, so LRU's
block thrashing is affordable), and measured through the mount for cache-once.

Each throughput figure is the best of ``--repeats`` runs (the machine is shared; every run is in the JSON).
Writes ``bench_mount.json``, ``bench_mount.png`` and ``bench_mount.txt`` (the table) under ``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import helpers  # noqa: F401  (puts tools/ and the checkout on sys.path: make_dataset, blockfs)

# isort: split
import make_dataset as md
import numpy as np
from helpers import HELPERS
from helpers.benchutil import drop_caches, read_files_threads

import blockfs
from blockfs.client import read_stats
from blockfs.packing.packer import plan_blocks
from blockfs.serve.cache.memory_plan import parse_size
from blockfs.serve.cache.policies import make_policy
from blockfs.serve.daemon import start_background, unmount

RATIOS = (0.25, 0.5, 0.75)
POLICIES = ("cache-once", "lru", "fifo")
SIM_BLOCKS = 200  # blocks in the simulated layouts: enough for hit rates to be smooth
SIM_EPOCHS = 4


# --- helpers --------------------------------------------------------------------------------------


def file_list(root: Path) -> list[str]:
    return sorted(os.path.relpath(os.path.join(d, f), root) for d, _, fs in os.walk(root) for f in fs)


def read_pass(root: Path, names: list[str], seed: int, reader: str = "open") -> dict:
    """One shuffled pass, a file at a time; files/s and MB/s.

    ``reader="open"``: ``open(path, "rb").read()``, which on Python < 3.14 also asks ``isatty`` (an ioctl:
    one round trip to the FUSE server per open, answered by libfuse in C); ``"os"``: os.open/read/close.
    """
    order = list(names)
    random.Random(seed).shuffle(order)
    paths = [os.path.join(root, n) for n in order]
    nbytes = 0
    start = time.perf_counter()
    if reader == "open":
        for path in paths:
            with open(path, "rb") as f:
                nbytes += len(f.read())
    else:
        for path in paths:
            fd = os.open(path, os.O_RDONLY)
            while piece := os.read(fd, 1 << 20):
                nbytes += len(piece)
            os.close(fd)
    seconds = time.perf_counter() - start
    return {"files_s": len(paths) / seconds, "mb_s": nbytes / seconds / 1e6, "seconds": seconds, "files": len(paths)}


def read_pass_threads(root: Path, names: list[str], seed: int, threads: int) -> dict:
    """The same pass split over ``threads`` reader threads (a DataLoader with workers, roughly)."""
    order = list(names)
    random.Random(seed).shuffle(order)
    seconds, nbytes = read_files_threads([os.path.join(root, n) for n in order], threads)
    return {"files_s": len(order) / seconds, "mb_s": nbytes / seconds / 1e6, "seconds": seconds, "files": len(order)}


def best(samples: list[dict]) -> dict:
    out = dict(max(samples, key=lambda s: s["files_s"]))
    out["samples_files_s"] = [round(s["files_s"]) for s in samples]
    return out


class Mounted:
    """``blockfs mount`` in a background server for the duration of a ``with``."""

    def __init__(self, dest: Path, mnt: Path, *args: str, binding: str | None = None) -> None:
        self.dest, self.mnt, self.args, self.binding = dest, mnt, args, binding

    def __enter__(self) -> Mounted:
        self.mnt.mkdir(parents=True, exist_ok=True)
        env_before = os.environ.get("BLOCKFS_FUSE")
        if self.binding:
            os.environ["BLOCKFS_FUSE"] = self.binding
        try:
            command = [
                sys.executable,
                "-m",
                "blockfs",
                "mount",
                str(self.dest),
                str(self.mnt),
                "--foreground",
                *self.args,
            ]
            start_background(command, self.mnt, str(self.mnt.parent / f"{self.mnt.name}.log"))
        finally:
            if self.binding:
                if env_before is None:
                    os.environ.pop("BLOCKFS_FUSE", None)
                else:
                    os.environ["BLOCKFS_FUSE"] = env_before
        return self

    def stats(self) -> dict:
        return read_stats(self.mnt)

    def __exit__(self, *exc: object) -> None:
        unmount(self.mnt)


# --- the trees -------------------------------------------------------------------------------------
def make_trees(work: Path, imagenet_files: int, tiny_files: int) -> dict[str, dict]:
    trees = {}
    for name, mode, files, classes, block in (
        ("imagenet", "imagenet", imagenet_files, 20, "16MiB"),
        ("tiny", "tiny", tiny_files, 20, "16MiB"),
    ):
        src = work / name
        info = md.make_dataset(src, mode, files=files, classes=classes, seed=0, force=True)
        packed = work / f"{name}.blockfs"
        blockfs.pack(src, packed, block_size=parse_size(block), force=True, fsync=False)
        trees[name] = {"src": src, "packed": packed, "files": files, "bytes": info["bytes"], "names": file_list(src)}
    return trees


# --- throughput ------------------------------------------------------------------------------------
def bench_raw(tree: dict, repeats: int) -> dict:
    cold, warm, warm_os = [], [], []
    for r in range(repeats):
        drop_caches(3)
        cold.append(read_pass(tree["src"], tree["names"], seed=10 + r))
        warm.append(read_pass(tree["src"], tree["names"], seed=20 + r))
        warm_os.append(read_pass(tree["src"], tree["names"], seed=25 + r, reader="os"))
    return {"cold": best(cold), "warm": best(warm), "warm_os": best(warm_os)}


def bench_blockfs(tree: dict, work: Path, repeats: int) -> dict:
    keys = ("epoch1_cold", "epoch2_warm", "warm_os", "memory", "memory_no_kernel_cache", "memory_4_threads")
    out: dict[str, list] = {k: [] for k in keys}
    for r in range(repeats):
        drop_caches(3)
        with Mounted(tree["packed"], work / "mnt") as m:
            out["epoch1_cold"].append(read_pass(m.mnt, tree["names"], seed=30 + r))
            out["epoch2_warm"].append(read_pass(m.mnt, tree["names"], seed=40 + r))
            out["warm_os"].append(read_pass(m.mnt, tree["names"], seed=45 + r, reader="os"))
            drop_caches(1)
            out["memory"].append(read_pass(m.mnt, tree["names"], seed=50 + r))
            drop_caches(3)
            out["memory_no_kernel_cache"].append(read_pass(m.mnt, tree["names"], seed=60 + r))
            drop_caches(1)
            out["memory_4_threads"].append(read_pass_threads(m.mnt, tree["names"], seed=70 + r, threads=4))
            stats = m.stats()
    result = {k: best(v) for k, v in out.items()}
    result["storage_bytes_read"] = stats["counters"]["bytes_from_storage"]
    result["requests"] = stats["requests"]
    return result


def bench_null(tree: dict, work: Path, repeats: int) -> dict:
    """The same reads from tools/bench/helpers/null_fs.py, a FUSE server that does no work: what the round trips cost."""
    from blockfs.serve.daemon import wait_until_mounted

    keys = ("memory", "memory_no_kernel_cache", "memory_4_threads")
    out: dict[str, list] = {k: [] for k in keys}
    mnt = work / "nullmnt"
    mnt.mkdir(parents=True, exist_ok=True)
    with open(work / "nullmnt.log", "ab") as log:
        route = os.environ.get("BLOCKFS_FUSE") or "kernel"  # the route the mount rows are served by
        proc = subprocess.Popen(
            [sys.executable, str(HELPERS / "null_fs.py"), str(tree["src"]), str(mnt), "--fuse", route],
            stdout=log,
            stderr=log,
            stdin=subprocess.DEVNULL,
        )
    try:
        wait_until_mounted(mnt, proc, 60, str(work / "nullmnt.log"))
        read_pass(mnt, tree["names"], seed=0)  # every entry looked up once, as before blockfs's "memory" runs
        for r in range(repeats):
            drop_caches(1)
            out["memory"].append(read_pass(mnt, tree["names"], seed=50 + r))
            drop_caches(3)
            out["memory_no_kernel_cache"].append(read_pass(mnt, tree["names"], seed=60 + r))
            drop_caches(1)
            out["memory_4_threads"].append(read_pass_threads(mnt, tree["names"], seed=70 + r, threads=4))
    finally:
        unmount(mnt)
        proc.wait(30)
    return {k: best(v) for k, v in out.items()}


def bench_ratarmount(tree: dict, work: Path, repeats: int) -> dict | None:
    exe = shutil.which("ratarmount")
    if exe is None:
        return None
    tar = work / f"{tree['src'].name}.tar"
    if not tar.exists():
        subprocess.run(["tar", "cf", str(tar), "-C", str(tree["src"]), "."], check=True)
    mnt = work / "mnt-ratar"
    mnt.mkdir(exist_ok=True)

    def mount() -> subprocess.Popen:
        proc = subprocess.Popen([exe, "-f", str(tar), str(mnt)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 300
        while not os.path.ismount(mnt):
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("ratarmount did not mount")
            time.sleep(0.05)
        return proc

    def umount(proc: subprocess.Popen) -> None:
        subprocess.run(["fusermount", "-u", str(mnt)], capture_output=True)
        proc.wait(30)

    umount(mount())  # builds the index next to the tar, outside the timed runs
    cold, warm = [], []
    for r in range(min(repeats, 1)):  # the slow baseline: one run (best-of would only favour it)
        drop_caches(3)
        proc = mount()
        try:
            cold.append(read_pass(mnt, tree["names"], seed=80 + r))
            warm.append(read_pass(mnt, tree["names"], seed=90 + r))
        finally:
            umount(proc)
    return {"epoch1_cold": best(cold), "epoch2_warm": best(warm)}


VARIANTS = (
    ("kernel route, enosys, 2 reader threads (default)", ("--open-mode", "enosys"), "kernel"),
    ("kernel route, enosys, 1 reader thread", ("--open-mode", "enosys", "--single-threaded"), "kernel"),
    ("mfusepy/libfuse 3, enosys, thread pool", ("--open-mode", "enosys"), "mfusepy"),
    ("mfusepy/libfuse 3, enosys, single thread", ("--open-mode", "enosys", "--single-threaded"), "mfusepy"),
    ("mfusepy/libfuse 3, keep_cache per open", ("--open-mode", "keep_cache"), "mfusepy"),
    ("mfusepy/libfuse 3, no page-cache reuse", ("--open-mode", "none"), "mfusepy"),
    ("fusepy/libfuse 2, keep_cache (default)", ("--open-mode", "keep_cache"), "fusepy"),
    ("fusepy/libfuse 2, enosys", ("--open-mode", "enosys"), "fusepy"),
)


def bench_variants(tree: dict, work: Path, files: int = 8000) -> list[dict]:
    """Each variant once, on the first ``files`` files: warm (two readers) and served from memory."""
    names = tree["names"][:files]
    rows = []
    for label, args, binding in VARIANTS:
        with Mounted(tree["packed"], work / "mnt", *args, binding=binding) as m:
            read_pass(m.mnt, names, seed=100)  # fill blockfs memory and the page cache
            before = m.stats()["requests"]
            warm = read_pass(m.mnt, names, seed=110)
            after = m.stats()["requests"]
            warm_os = read_pass(m.mnt, names, seed=115, reader="os")
            drop_caches(1)
            memory = read_pass(m.mnt, names, seed=120)
        calls = {k: round((v - before.get(k, 0)) / len(names), 2) for k, v in after.items() if v - before.get(k, 0)}
        calls.pop("getxattr", None)  # the statistics themselves
        rows.append(
            {"variant": label, "warm": warm, "warm_os": warm_os, "memory": memory, "python_calls_per_file_warm": calls}
        )
    return rows


# --- hit rates -------------------------------------------------------------------------------------
def simulate(sizes: np.ndarray, ratio: float, policy_name: str, epochs: int, seed: int) -> dict:
    """Drive a policy exactly as BlockCache does, over a layout of ~SIM_BLOCKS random blocks."""
    rng = np.random.default_rng(seed)
    order = rng.permutation(len(sizes))
    bounds = plan_blocks(sizes[order], max(1, int(sizes.sum() // SIM_BLOCKS)))
    block_of = np.empty(len(sizes), dtype=np.int64)
    block_bytes = np.add.reduceat(sizes[order], bounds[:-1])
    for b in range(len(bounds) - 1):
        block_of[order[bounds[b] : bounds[b + 1]]] = b
    total = int(sizes.sum())
    policy = make_policy(policy_name, int(ratio * total))
    rates, storage = [], []
    block_of_l, block_bytes_l, sizes_l = block_of.tolist(), block_bytes.tolist(), sizes.tolist()
    for _ in range(epochs):
        hits, read = 0, 0
        for f in rng.permutation(len(sizes)).tolist():
            b = block_of_l[f]
            if b in policy:
                hits += 1
                policy.touch(b)
            elif policy.admit(b, block_bytes_l[b]) is not None:
                read += block_bytes_l[b]
            else:
                read += sizes_l[f]
        rates.append(hits / len(sizes))
        storage.append(read / total)
    return {"hit_rate": rates, "storage_per_epoch": storage, "blocks": len(bounds) - 1}


def file_sizes(tree: dict) -> np.ndarray:
    return np.array([os.path.getsize(tree["src"] / n) for n in tree["names"]], dtype=np.int64)


def bench_hit_rates(trees: dict) -> dict:
    out = {}
    for name, tree in trees.items():
        sizes = file_sizes(tree)
        out[name] = {
            policy: {str(ratio): simulate(sizes, ratio, policy, SIM_EPOCHS, seed=7) for ratio in RATIOS}
            for policy in POLICIES
        }
    return out


def measured_cache_once(tree: dict, work: Path) -> dict:
    """Cache-once through the mount (page-cache reuse off, so every read reaches blockfs), per epoch.

    Blocks only (``--no-retain``): with retention, the memory plan would spend these budgets on the tiny
    tree's smallest files instead (tools/bench/bench_memory.py measures that)."""
    packed = work / "tiny-1m.blockfs"
    blockfs.pack(tree["src"], packed, block_size=1 << 20, force=True, fsync=False)
    total = tree["bytes"]
    out = {}
    for ratio in RATIOS:
        rates = []
        with Mounted(
            packed, work / "mnt", "--cache-size", str(int(ratio * total)), "--open-mode", "none", "--no-retain"
        ) as m:
            for epoch in range(2):
                before = m.stats()["counters"]
                read_pass(m.mnt, tree["names"], seed=200 + epoch)
                after = m.stats()["counters"]
                served = after["files_served"] - before["files_served"]
                rates.append((after["file_hits"] - before["file_hits"]) / max(1, served))
            used = m.stats()["cache"]["used_bytes"]
        out[str(ratio)] = {"hit_rate": rates, "cached_share": used / total}
    return out


# --- report ----------------------------------------------------------------------------------------
def table(results: dict) -> str:
    lines = []
    tp = results["throughput"]
    lines.append(f"{'tree':9} {'reader over':44} {'files/s':>9} {'MB/s':>8}")
    for name in tp:
        raw, bf = tp[name]["raw"], tp[name]["blockfs"]
        rows = [
            ("raw directory, cold", raw["cold"]),
            ("raw directory, warm", raw["warm"]),
            ("raw directory, warm, os.open reader", raw["warm_os"]),
        ]
        rows += [
            ("blockfs, epoch 1 (cold)", bf["epoch1_cold"]),
            ("blockfs, epoch 2 (warm: kernel page cache)", bf["epoch2_warm"]),
            ("blockfs, warm, os.open reader", bf["warm_os"]),
            ("blockfs memory (page cache dropped)", bf["memory"]),
            ("blockfs memory (all kernel caches dropped)", bf["memory_no_kernel_cache"]),
            ("blockfs memory, 4 reader threads", bf["memory_4_threads"]),
        ]
        if tp[name].get("null_fuse"):
            null = tp[name]["null_fuse"]
            rows += [
                ("null FUSE server (page cache dropped)", null["memory"]),
                ("null FUSE server (all kernel caches dropped)", null["memory_no_kernel_cache"]),
                ("null FUSE server, 4 reader threads", null["memory_4_threads"]),
            ]
        if tp[name].get("ratarmount"):
            rows += [
                ("ratarmount, epoch 1 (cold)", tp[name]["ratarmount"]["epoch1_cold"]),
                ("ratarmount, epoch 2 (warm)", tp[name]["ratarmount"]["epoch2_warm"]),
            ]
        for label, r in rows:
            lines.append(f"{name:9} {label:44} {r['files_s']:>9,.0f} {r['mb_s']:>8,.1f}")
        lines.append("")
    if results.get("variants"):
        head = f"{'mount variants (tiny tree, files/s)':50} {'warm':>8} {'warm os':>8} {'memory':>8}"
        lines.append(head + "  Python calls per file, warm")
        for v in results["variants"]:
            lines.append(
                f"  {v['variant']:48} {v['warm']['files_s']:>8,.0f} {v['warm_os']['files_s']:>8,.0f} "
                f"{v['memory']['files_s']:>8,.0f}  {v['python_calls_per_file_warm']}"
            )
        lines.append("")
    lines.append(
        f"hit rate per epoch (simulated; epochs 1..{SIM_EPOCHS}), storage read per epoch / dataset in the last epoch"
    )
    for name, per_policy in results["hit_rates"]["simulated"].items():
        for policy, per_ratio in per_policy.items():
            for ratio, sim in per_ratio.items():
                rates = " ".join(f"{x:.3f}" for x in sim["hit_rate"])
                lines.append(
                    f"  {name:9} {policy:10} budget/dataset {ratio:>4}: {rates}   storage {sim['storage_per_epoch'][-1]:.2f}x"
                )
    meas = results["hit_rates"].get("measured_cache_once")
    if meas:
        lines.append("hit rate per epoch through the mount (cache-once, tiny tree, 1 MiB blocks)")
        for ratio, m in meas.items():
            lines.append(
                f"  budget/dataset {ratio:>4} (cached {m['cached_share']:.3f}): "
                + " ".join(f"{x:.3f}" for x in m["hit_rate"])
            )
    lines.append("")
    lines += [f"{'PASS' if ok else 'MISS'}  {what}" for what, ok in results["checks"]]
    return "\n".join(lines)


def checks(results: dict) -> list[tuple[str, bool]]:
    tp = results["throughput"]
    out = []
    for name in tp:
        raw, bf, rat = tp[name]["raw"], tp[name]["blockfs"], tp[name].get("ratarmount")
        ratio = bf["epoch1_cold"]["files_s"] / raw["cold"]["files_s"]
        out.append((f"{name}: epoch 1 through the mount / raw cold = {ratio:.2f} (>= 2)", ratio >= 2))
        ratio = bf["epoch2_warm"]["files_s"] / raw["warm"]["files_s"]
        ratio_os = bf["warm_os"]["files_s"] / raw["warm_os"]["files_s"]
        out.append(
            (
                f"{name}: kernel-served re-read / raw warm = {ratio:.2f} (>= 0.7); "
                f"{ratio_os:.2f} with an os.open reader (no isatty ioctl)",
                ratio >= 0.7,
            )
        )
        need = 25_000 if name == "tiny" else 8_000
        got, got4 = bf["memory"]["files_s"], bf["memory_4_threads"]["files_s"]
        null = tp[name].get("null_fuse")
        ceiling = (
            f"; a FUSE server doing no work: {null['memory']['files_s']:,.0f} / "
            f"{null['memory_4_threads']['files_s']:,.0f}"
            if null
            else ""
        )
        out.append(
            (
                f"{name}: served from blockfs memory {got:,.0f} files/s with 1 reader, {got4:,.0f} with 4 "
                f"(>= {need:,}){ceiling}",
                max(got, got4) >= need,
            )
        )
        if rat:
            for epoch, key in (("1", "epoch1_cold"), ("2", "epoch2_warm")):
                ratio = bf[key]["files_s"] / rat[key]["files_s"]
                out.append((f"{name}: epoch {epoch} blockfs / ratarmount = {ratio:.1f} (>= 3)", ratio >= 3))
    for name, per_policy in results["hit_rates"]["simulated"].items():
        for ratio in map(str, RATIOS):
            once = per_policy["cache-once"][ratio]["hit_rate"][1:]
            lru = per_policy["lru"][ratio]["hit_rate"][1:]
            near = max(abs(x - float(ratio)) for x in once)
            out.append(
                (
                    f"{name}: cache-once at {ratio} within {near * 100:.1f} points of budget/dataset from epoch 2 "
                    f"(<= 2), LRU {min(lru):.3f}..{max(lru):.3f}",
                    near <= 0.02 and min(once) > max(lru),
                )
            )
    return out


def plot(results: dict, path: Path) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    tp = results["throughput"]
    fig, axes = plt.subplots(1, 3, figsize=(18, 5))
    for ax, name in zip(axes[:2], tp, strict=False):
        rows = {"raw cold": tp[name]["raw"]["cold"], "raw warm": tp[name]["raw"]["warm"]}
        bf = tp[name]["blockfs"]
        rows |= {
            "blockfs ep1": bf["epoch1_cold"],
            "blockfs ep2": bf["epoch2_warm"],
            "blockfs mem": bf["memory"],
            "blockfs mem\nno kcache": bf["memory_no_kernel_cache"],
            "blockfs mem\n4 threads": bf["memory_4_threads"],
        }
        if tp[name].get("null_fuse"):
            rows |= {
                "null FUSE\nmem": tp[name]["null_fuse"]["memory"],
                "null FUSE\n4 threads": tp[name]["null_fuse"]["memory_4_threads"],
            }
        if tp[name].get("ratarmount"):
            rows |= {
                "ratar ep1": tp[name]["ratarmount"]["epoch1_cold"],
                "ratar ep2": tp[name]["ratarmount"]["epoch2_warm"],
            }
        ax.bar(range(len(rows)), [r["files_s"] for r in rows.values()], color="tab:blue")
        ax.set_xticks(range(len(rows)), list(rows), rotation=60, ha="right", fontsize=8)
        ax.set_ylabel("files/s")
        ax.set_title(f"{name} tree ({tree_desc(results, name)})")
    ax = axes[2]
    sim = results["hit_rates"]["simulated"]["tiny"]  # the tree the measured points come from
    styles = {"cache-once": "-", "lru": "--", "fifo": ":"}
    for policy, per_ratio in sim.items():
        for ratio, s in per_ratio.items():
            ax.plot(
                range(1, len(s["hit_rate"]) + 1), s["hit_rate"], styles[policy], marker="o", label=f"{policy} {ratio}"
            )
    meas = results["hit_rates"].get("measured_cache_once") or {}
    for ratio, m in meas.items():
        ax.plot(
            range(1, len(m["hit_rate"]) + 1),
            m["hit_rate"],
            "kx",
            markersize=9,
            label="measured cache-once" if ratio == "0.25" else None,
        )
    ax.set_xlabel("epoch")
    ax.set_ylabel("file hit rate")
    ax.set_title("tiny tree: hit rate per epoch, random order (lines simulated, x measured)")
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return True


def tree_desc(results: dict, name: str) -> str:
    t = results["trees"][name]
    return f"{t['files']:,} files, {t['bytes'] / 2**20:.0f} MiB"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="results/bench_mount", help="directory for the JSON, PNG and table")
    parser.add_argument("--work", help="scratch directory for the trees (default: a new one in the temp dir)")
    parser.add_argument("--imagenet-files", type=int, default=2000)
    parser.add_argument("--tiny-files", type=int, default=20000)
    parser.add_argument("--repeats", type=int, default=2, help="runs per throughput figure; the best counts")
    parser.add_argument("--no-ratarmount", action="store_true")
    parser.add_argument("--no-variants", action="store_true")
    args = parser.parse_args(argv)

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    work = Path(args.work) if args.work else Path(tempfile.mkdtemp(prefix="bench_mount-"))
    work.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    if not drop_caches(1):
        print("note: cannot drop caches (not root): 'cold' runs are warm", file=sys.stderr)
    try:
        trees = make_trees(work, args.imagenet_files, args.tiny_files)
        results: dict = {
            "command": " ".join([sys.executable, *sys.argv]),
            "machine": {
                "cpus": os.cpu_count(),
                "kernel": platform.release(),
                "python": platform.python_version(),
                "loadavg_start": os.getloadavg(),
            },
            "trees": {n: {"files": t["files"], "bytes": t["bytes"]} for n, t in trees.items()},
            "throughput": {},
        }
        for name, tree in trees.items():
            print(f"[{time.monotonic() - started:5.0f} s] {name}: raw, blockfs, ratarmount", file=sys.stderr)
            results["throughput"][name] = {
                "raw": bench_raw(tree, args.repeats),
                "blockfs": bench_blockfs(tree, work, args.repeats),
                "null_fuse": bench_null(tree, work, args.repeats),
                "ratarmount": None if args.no_ratarmount else bench_ratarmount(tree, work, args.repeats),
            }
        if not args.no_variants:
            print(f"[{time.monotonic() - started:5.0f} s] mount variants", file=sys.stderr)
            results["variants"] = bench_variants(trees["tiny"], work)
        print(f"[{time.monotonic() - started:5.0f} s] hit rates", file=sys.stderr)
        results["hit_rates"] = {
            "simulated": bench_hit_rates(trees),
            "measured_cache_once": measured_cache_once(trees["tiny"], work),
        }
        results["checks"] = checks(results)
        results["machine"]["loadavg_end"] = os.getloadavg()
        results["seconds"] = time.monotonic() - started
    finally:
        if not args.work:
            shutil.rmtree(work, ignore_errors=True)
    text = table(results)
    (out / "bench_mount.txt").write_text(text + "\n")
    (out / "bench_mount.json").write_text(json.dumps(results, indent=1, default=str) + "\n")
    has_plot = plot(results, out / "bench_mount.png")
    print(text)
    print(
        f"\n{results['seconds']:.0f} s; wrote {out}/bench_mount.json, .txt"
        + (", .png" if has_plot else " (no matplotlib: no plot)")
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
