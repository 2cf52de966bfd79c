"""Benchmark the memory plan (issue 4): datasets larger than the budget, read in a new random order per epoch.

    python tools/bench/bench_memory.py [--budget 64MiB] [--ratios 2 4] [--epochs 3] [--out results/bench_memory]

ImageNet-like files (tools/make_dataset.py, mode imagenet) packed in 4 MiB blocks, at dataset = 2x and 4x
the budget; each configuration is mounted with the same total budget and read ``--epochs`` times, one file
at a time (``open().read()``), a new shuffled order every epoch, with the page cache dropped before each
epoch (root) and ``--open-mode none`` so every read reaches blockfs.  Configurations: no cache, LRU,
cache-once blocks only, cache-once plus retention (most-files, and threshold auto).  Per epoch: files/s,
bytes read from storage (the mount's own counter), hit rate by files and by bytes (1 - storage / served),
and the bytes the mount's process read from the disk (``/proc/PID/io`` ``read_bytes``: the kernel's
readahead on the block files included, which the mount's counter does not see).  ``--evict`` drops only
this benchmark's files from the page cache (its block files; a shared machine keeps the rest) instead of
the whole page cache.

Then the kernel page cache on top of the plan (issue 4: "mark target files so the kernel keeps their pages
across opens ... where it pays"): the retention plan mounted with each ``--open-mode`` (``enosys``: the
kernel keeps every file's pages, no Python ``open``; ``targets``: a Python ``open`` per file that keeps
the pages of retained files only; ``none``: nothing kept), the page cache dropped once before epoch 1
only, and the reader confined to a memory cgroup of ``--page-cache`` bytes plus its own footprint, so
the page cache cannot hold the dataset either (as on a machine whose memory is smaller than the data).
Extra columns: FUSE ``read`` and ``open`` requests per file.  Skipped, and said so, without root.

Writes ``bench_memory.json``, ``bench_memory.txt`` (the table) and ``bench_memory.png``.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import helpers  # noqa: F401  (puts tools/ and the checkout on sys.path: make_dataset, blockfs)

# isort: split
import make_dataset as md
from helpers.benchutil import MemoryCgroup, drop_caches
from helpers.storage_emulation import evict

import blockfs
from blockfs.client import read_stats
from blockfs.serve.cache.memory_plan import parse_size
from blockfs.serve.daemon import unmount

CONFIGS = {
    "none": ["--policy", "none"],
    "lru": ["--policy", "lru", "--no-retain"],
    "cache-once": ["--policy", "cache-once", "--no-retain"],
    "retain most-files": ["--policy", "cache-once", "--retain-strategy", "most-files"],
    "retain threshold": ["--policy", "cache-once", "--retain-strategy", "threshold", "--retain-threshold", "auto"],
}
KERNEL_CONFIGS = {
    mode: ["--policy", "cache-once", "--retain-strategy", "most-files"] for mode in ("none", "enosys", "targets")
}  # keyed by --open-mode
MEAN_FILE = 110 << 10  # make_dataset's imagenet mean file size
READER_FOOTPRINT = 16 << 20  # the reader's own memory inside its cgroup: Python and the file list
# One epoch in a child process (so that it can sit in a cgroup): file names on stdin, seconds on stdout.
READER = """
import sys, time
names = sys.stdin.read().split("\\0")
started = time.perf_counter()
for name in names:
    with open(name, "rb") as f:
        f.read()
print(time.perf_counter() - started)
"""


def disk_read_bytes(pid: int) -> int:
    """Bytes process ``pid`` has read from block devices (its readahead included); 0 where not shown."""
    try:
        with open(f"/proc/{pid}/io") as f:
            return next(int(line.split()[1]) for line in f if line.startswith("read_bytes:"))
    except (OSError, StopIteration):
        return 0


def run_epochs(
    dest: Path,
    mnt: Path,
    budget: int,
    args: list[str],
    names: list[str],
    epochs: int,
    open_mode: str = "none",
    cgroup: MemoryCgroup | None = None,
    evict_only: bool = False,
) -> list[dict]:
    """Mount, read ``epochs`` shuffled epochs, unmount.  Without ``cgroup``: in this process, the page cache
    dropped before every epoch; with it: in a child confined to the cgroup, dropped before epoch 1 only."""
    subprocess.run(
        [
            sys.executable,
            "-m",
            "blockfs",
            "mount",
            str(dest),
            str(mnt),
            "--cache-size",
            str(budget),
            "--open-mode",
            open_mode,
            *args,
        ],
        check=True,
        capture_output=True,
    )
    rows = []
    try:
        for epoch in range(epochs):
            order = names[:]
            random.Random(epoch).shuffle(order)
            if cgroup is None or epoch == 0:
                if evict_only:
                    evict([dest])
                else:
                    drop_caches(1)
            before = read_stats(mnt)
            disk_before = disk_read_bytes(before["mount"]["pid"])
            if cgroup is None:
                started = time.perf_counter()
                for name in order:
                    with open(mnt / name, "rb") as f:
                        f.read()
                seconds = time.perf_counter() - started
            else:
                seconds = float(
                    subprocess.run(
                        [sys.executable, "-c", READER],
                        input="\0".join(str(mnt / n) for n in order),
                        capture_output=True,
                        text=True,
                        check=True,
                        preexec_fn=cgroup.enter,
                    ).stdout
                )
            stats = read_stats(mnt)
            disk = disk_read_bytes(stats["mount"]["pid"]) - disk_before
            after = stats["counters"]
            d = {
                k: after[k] - before["counters"][k]
                for k in ("files_served", "file_hits", "bytes_served", "bytes_from_storage")
            }
            requests = {k: stats["requests"].get(k, 0) - before["requests"].get(k, 0) for k in ("read", "open")}
            rows.append(
                {
                    "fuse_reads_per_file": requests["read"] / len(order),
                    "fuse_opens_per_file": requests["open"] / len(order),
                    "epoch": epoch + 1,
                    "files_per_s": len(order) / seconds,
                    "storage_bytes": d["bytes_from_storage"],
                    "disk_bytes": disk,
                    "file_hit_rate": d["file_hits"] / d["files_served"] if d["files_served"] else 0.0,
                    "byte_hit_rate": max(0.0, 1 - d["bytes_from_storage"] / d["bytes_served"])
                    if d["bytes_served"]
                    else 0.0,
                }
            )
        rows[-1]["final_stats"] = read_stats(mnt)
    finally:
        unmount(mnt)
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--budget", default="64MiB")
    p.add_argument("--ratios", type=float, nargs="+", default=[2.0, 4.0])
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--out", default="results/bench_memory")
    p.add_argument("--work", default=None, help="scratch directory (default: a temporary one)")
    p.add_argument(
        "--page-cache", default=None, help="page cache the reader may hold in the kernel runs (default: the budget)"
    )
    p.add_argument("--no-kernel", action="store_true", help="skip the kernel page cache runs")
    p.add_argument(
        "--evict",
        action="store_true",
        help="drop only the benchmark's block files from the page "
        "cache before an epoch (a shared machine), not the whole page cache",
    )
    a = p.parse_args(argv)
    budget = parse_size(a.budget)
    page_cache = parse_size(a.page_cache) if a.page_cache else budget
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    results: dict = {
        "budget_bytes": budget,
        "epochs": a.epochs,
        "runs": [],
        "page_cache_bytes": page_cache,
        "kernel_runs": [],
    }
    cgroup = None
    if not a.no_kernel:
        try:
            cgroup = MemoryCgroup(f"blockfs-bench-{os.getpid()}", page_cache + READER_FOOTPRINT)
        except OSError as e:
            print(f"skipping the kernel page cache runs: {e} (they need root and a memory cgroup)")
    try:
        _run_all(a, budget, results, cgroup)
    finally:
        if cgroup is not None:
            cgroup.close()
    table = _table(results, a.epochs)
    (out / "bench_memory.txt").write_text(table + "\n")
    (out / "bench_memory.json").write_text(json.dumps(results, indent=1))
    _plot(results, out / "bench_memory.png")
    print(table)
    return 0


def _run_all(a: argparse.Namespace, budget: int, results: dict, cgroup: MemoryCgroup | None) -> None:
    with tempfile.TemporaryDirectory(dir=a.work) as tmp:
        work = Path(tmp)
        for ratio in a.ratios:
            src, dest = work / f"src{ratio:g}", work / f"p{ratio:g}"
            md.make_dataset(src, "imagenet", files=int(ratio * budget / MEAN_FILE), classes=10, seed=1)
            blockfs.pack(src, dest, block_size=4 << 20, fsync=False)
            total = json.loads((dest / "blockfs.json").read_text())["file_bytes"]
            names = sorted(os.path.relpath(os.path.join(d, f), src) for d, _, fs in os.walk(src) for f in fs)
            mnt = work / "mnt"
            mnt.mkdir(exist_ok=True)
            for config, extra in CONFIGS.items():
                rows = run_epochs(dest, mnt, budget, extra, names, a.epochs, evict_only=a.evict)
                final = rows[-1].pop("final_stats")
                results["runs"].append(
                    {
                        "ratio": total / budget,
                        "dataset_bytes": total,
                        "files": len(names),
                        "config": config,
                        "epochs": rows,
                        "plan": final["plan"],
                        "retained": final.get("retained"),
                    }
                )
            for open_mode, extra in KERNEL_CONFIGS.items() if cgroup is not None else ():
                rows = run_epochs(dest, mnt, budget, extra, names, a.epochs, open_mode, cgroup, a.evict)
                rows[-1].pop("final_stats")
                results["kernel_runs"].append(
                    {
                        "ratio": total / budget,
                        "dataset_bytes": total,
                        "files": len(names),
                        "open_mode": open_mode,
                        "epochs": rows,
                    }
                )


def _table(results: dict, epochs: int) -> str:
    budget = results["budget_bytes"]
    lines = [
        f"budget {budget >> 20} MiB; per epoch: files/s, storage MiB (% of dataset), file hit %, byte hit %, "
        "disk read by the mount (% of dataset)",
        f"{'ratio':>5} {'config':<18} " + " | ".join(f"{'epoch ' + str(e + 1):^37}" for e in range(epochs)),
    ]
    for run in results["runs"]:
        cells = [
            f"{r['files_per_s']:6.0f} {r['storage_bytes'] / 2**20:6.1f} ({r['storage_bytes'] / run['dataset_bytes']:4.0%})"
            f" {r['file_hit_rate']:4.0%} {r['byte_hit_rate']:4.0%} {r['disk_bytes'] / run['dataset_bytes']:5.1%}"
            for r in run["epochs"]
        ]
        lines.append(f"{run['ratio']:5.2f} {run['config']:<18} " + " | ".join(cells))
    if results["kernel_runs"]:
        lines += [
            "",
            f"kernel page cache on top of retention (most-files), the reader limited to "
            f"{results['page_cache_bytes'] >> 20} MiB of page cache, dropped before epoch 1 only;",
            "per epoch: files/s, storage MiB (% of dataset), FUSE reads per file, FUSE opens per file",
            f"{'ratio':>5} {'open mode':<18} " + " | ".join(f"{'epoch ' + str(e + 1):^30}" for e in range(epochs)),
        ]
        for run in results["kernel_runs"]:
            cells = [
                f"{r['files_per_s']:6.0f} {r['storage_bytes'] / 2**20:6.1f} ({r['storage_bytes'] / run['dataset_bytes']:4.0%})"
                f" {r['fuse_reads_per_file']:4.2f} {r['fuse_opens_per_file']:4.2f}"
                for r in run["epochs"]
            ]
            lines.append(f"{run['ratio']:5.2f} {run['open_mode']:<18} " + " | ".join(cells))
    return "\n".join(lines)


def _plot(results: dict, path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    ratios = sorted({round(r["ratio"], 2) for r in results["runs"]})
    fig, axes = plt.subplots(2, len(ratios), figsize=(6 * len(ratios), 7), squeeze=False)
    for col, ratio in enumerate(ratios):
        for run in (r for r in results["runs"] if round(r["ratio"], 2) == ratio):
            epochs = [e["epoch"] for e in run["epochs"]]
            axes[0][col].plot(
                epochs, [e["storage_bytes"] / run["dataset_bytes"] for e in run["epochs"]], "o-", label=run["config"]
            )
            axes[1][col].plot(epochs, [e["files_per_s"] for e in run["epochs"]], "o-", label=run["config"])
        axes[0][col].set_title(f"dataset = {ratio:g} x budget")
        axes[0][col].set_ylabel("storage bytes / dataset")
        axes[1][col].set_ylabel("files/s")
        axes[1][col].set_xlabel("epoch")
        axes[0][col].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path)


if __name__ == "__main__":
    sys.exit(main())
