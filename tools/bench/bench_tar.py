"""Benchmark ``blockfs pack ARCHIVE`` against ``tar x`` of the same archive to disk, side by side.

A seeded ImageNet-like tree (~110 KiB files; ``--mode tiny``: ~4 KiB files) is made and archived with
``tar c`` (plain, and each compression asked for).  Each repetition then runs, back to back on the same archive: ``tar xf`` into an
empty directory, ``tar xf`` followed by ``sync`` (the same durability as pack's fsync of every block),
``blockfs pack`` (default: fsync) and ``blockfs pack --no-fsync``, each as the command a user would type
(a fresh process).  Before every run the archive is made cold: with ``--cold archive`` (default) only its
pages are dropped from the page cache, so the disk serves it while the programs themselves (``tar``, the
Python interpreter and numpy) stay loaded, as on a machine in use; with ``--cold all`` the whole page cache
is dropped (root only), which also makes each run load its program from disk again, a fixed cost that is
~0.2-0.4 s for the interpreter here and next to nothing for ``tar``.  The table gives medians and the speed
of each relative to ``tar x``.

Both write to a new ext4 filesystem made for the run (``--scratch fresh-ext4``, the default: a sparse
image in the workdir, loop-mounted; needs root), and every ``tar x`` extracts into a new directory; the
extracted trees are deleted only at the very end.  Both matter on these VMs: ext4 without a journal skips
inodes freed in the last ~30 s when it creates files (``recently_deleted`` in ``perf``), so after any
mass delete on the same filesystem (the previous run's tree, another benchmark's clean-up) ``tar x`` ran
3-17x slower, and the measurement was of inode allocation, not of ``tar``.
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

from helpers.benchutil import drop_caches, evict_file
from make_dataset import make_dataset

TAR_FLAG = {"none": "", "gz": "z", "bz2": "j", "xz": "J"}


def timed(cmd: list[str], then_sync: bool = False) -> float:
    t = time.perf_counter()
    done = subprocess.run(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    if then_sync:
        os.sync()
    seconds = time.perf_counter() - t
    if done.returncode:
        raise SystemExit(f"{' '.join(cmd)} failed ({done.returncode}): {done.stderr.strip()}")
    return seconds


def fresh_ext4(work: str, nbytes: int) -> str:
    """A new ext4 filesystem (sparse image in ``work``, loop-mounted at ``work/scratch``); its mount point."""
    image, mountpoint = os.path.join(work, "scratch.img"), os.path.join(work, "scratch")
    with open(image, "wb") as f:
        f.truncate(nbytes)
    subprocess.run(["mkfs.ext4", "-q", "-F", image], check=True)
    os.mkdir(mountpoint)
    done = subprocess.run(["mount", "-o", "loop", image, mountpoint], capture_output=True, text=True)
    if done.returncode:
        raise SystemExit(f"cannot loop-mount a scratch ext4 ({done.stderr.strip()}); use --scratch workdir")
    return mountpoint


def bench_archive(archive: str, work: str, repeat: int, cold: str) -> dict:
    dest = os.path.join(work, "packed")
    pack = [sys.executable, "-m", "blockfs", "pack", archive, dest]
    runs: dict[str, list[float]] = {"tar x": [], "tar x + sync": [], "pack": [], "pack --no-fsync": []}
    extracted = 0
    for _ in range(repeat):
        for label in runs:
            shutil.rmtree(dest, ignore_errors=True)  # a handful of block files: no inode churn
            os.sync()  # each run starts with nothing dirty, so no run pays for an earlier one's writes
            if cold == "all":
                drop_caches()
            else:
                evict_file(archive)
            if label.startswith("tar"):
                # A fresh directory each time, deleted only at the very end: see the module docstring.
                out = os.path.join(work, f"x-{os.path.basename(archive)}-{extracted}")
                extracted += 1
                os.mkdir(out)
                runs[label].append(timed(["tar", "xf", archive, "-C", out], then_sync=label.endswith("sync")))
            else:
                runs[label].append(timed(pack + (["--no-fsync"] if "no-fsync" in label else [])))
    med = {k: statistics.median(v) for k, v in runs.items()}
    return {
        k: {
            "seconds": s,
            "vs_tar_x": med["tar x"] / s,
            "vs_tar_x_sync": med["tar x + sync"] / s,
            "all_seconds": runs[k],
        }
        for k, s in med.items()
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--files", type=int, default=3000, help="files in the tree")
    ap.add_argument(
        "--mode",
        choices=("imagenet", "tiny"),
        default="imagenet",
        help="ImageNet-like files (~110 KiB each) or tiny ones (~4 KiB)",
    )
    ap.add_argument("--classes", type=int, default=10)
    ap.add_argument("--compressions", default="none,gz", help="comma list of none, gz, bz2, xz")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument(
        "--cold",
        choices=("archive", "all"),
        default="archive",
        help="drop only the archive from the page cache before each run, or the whole cache (root)",
    )
    ap.add_argument("--workdir", default=None, help="where trees and archives go (default: a temp dir in /var/tmp)")
    ap.add_argument(
        "--scratch",
        choices=("fresh-ext4", "workdir"),
        default="fresh-ext4",
        help="where tar x and pack write: a new ext4 filesystem in a loop-mounted image in the "
        "workdir (root; the default), or the workdir itself",
    )
    ap.add_argument("--out", default=None, help="also write the results as JSON here")
    args = ap.parse_args(argv)

    work = tempfile.mkdtemp(prefix="blockfs-bench-tar-", dir=args.workdir or "/var/tmp")
    cold = args.cold
    if cold == "all" and not drop_caches():
        raise SystemExit("--cold all drops the whole page cache, which needs root; use --cold archive")
    results: dict = {
        "files": args.files,
        "cores": os.cpu_count(),
        "cache": "archive cold" if cold == "archive" else "all cold",
        "archives": {},
    }
    compressions = args.compressions.split(",")
    results["scratch"] = args.scratch
    scratch = work
    try:
        src = os.path.join(work, "src")
        made = make_dataset(src, args.mode, args.files, args.classes, seed=0)
        results["bytes"] = made["bytes"]
        if args.scratch == "fresh-ext4":
            # Room for every extracted tree (kept to the end) and a packed copy, with slack for metadata.
            need = 3 * made["bytes"] * (2 * args.repeat * len(compressions) + 2) + (1 << 30)
            scratch = fresh_ext4(work, need)
        for comp in compressions:
            archive = os.path.join(work, "data.tar" + ("" if comp == "none" else "." + comp))
            subprocess.run(["tar", f"-c{TAR_FLAG[comp]}f", archive, "-C", src, "."], check=True)
            rows = bench_archive(archive, scratch, args.repeat, cold)
            results["archives"][comp] = {"archive_bytes": os.path.getsize(archive), "rows": rows}
            os.unlink(archive)
    finally:
        if scratch != work:
            subprocess.run(["umount", scratch], check=False)
        shutil.rmtree(work, ignore_errors=True)

    print(
        f"{args.files} {args.mode} files, {results['bytes'] / 1e6:.0f} MB, {results['cores']} cores, {results['cache']} cache, "
        f"written to {'a fresh ext4' if args.scratch == 'fresh-ext4' else 'the workdir'}, "
        f"median of {args.repeat}"
    )
    for comp, res in results["archives"].items():
        print(f"\narchive: tar{'' if comp == 'none' else ' + ' + comp} ({res['archive_bytes'] / 1e6:.0f} MB)")
        print(f"  {'command':<18} {'seconds':>8} {'MB/s':>7} {'vs tar x':>9} {'vs tar x + sync':>16}")
        for label, row in res["rows"].items():
            print(
                f"  {label:<18} {row['seconds']:>8.2f} {results['bytes'] / row['seconds'] / 1e6:>7.0f} "
                f"{row['vs_tar_x']:>8.2f}x {row['vs_tar_x_sync']:>15.2f}x"
            )
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            json.dump(results, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
