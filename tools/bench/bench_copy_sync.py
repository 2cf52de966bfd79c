"""What syncing a kept index copy costs beside making it: a copy and its BLAKE3 hash
(``IndexCopies.hold``, hashed, as a mount and a pack's seed make it) against ``os.fdatasync`` of the same
copy (what ``core/kept_copies.py`` waits for, on a thread of its own, before it names the copy).

    flock /work/timing.lock python tools/bench/bench_copy_sync.py [--sizes 147e6 1.48e9] [--rounds 3] [--work DIR]

A file of random bytes of each size (a 1 M-file index is ~147 MB, a 10 M one ~1.48 GB) is written in
``--work`` and read once (in the page cache, as a pack's index is when it is seeded); each round copies and
hashes it, then copies it again and times the copy's ``fdatasync`` alone.  Medians, and their ratio.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import time

import helpers  # noqa: F401  (puts the checkout on sys.path, for blockfs)

from blockfs.core.index_copy import IndexCopies, _copy


def source(work: str, size: int) -> int:
    path = os.path.join(work, f"index-{size}")
    if not os.path.exists(path) or os.path.getsize(path) != size:
        with open(path, "wb") as f:
            for start in range(0, size, 64 << 20):
                f.write(os.urandom(min(64 << 20, size - start)))
    fd = os.open(path, os.O_RDONLY)
    with open(path, "rb") as f:
        while f.read(64 << 20):
            pass
    return fd


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", type=float, nargs="+", default=[147e6, 1.48e9])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--work", default=None, help="a directory on the disk to measure (default: a temp one)")
    args = parser.parse_args()
    work = args.work or tempfile.mkdtemp(prefix="bench-copy-sync-")
    try:
        measure(work, args.sizes, args.rounds)
    finally:
        if args.work is None:
            shutil.rmtree(work)


def measure(work: str, sizes: list[float], rounds: int) -> None:
    copies_dir = os.path.join(work, "copies")
    os.makedirs(copies_dir, mode=0o700, exist_ok=True)
    for size in (int(s) for s in sizes):
        fd = source(work, size)
        copies = IndexCopies(copies_dir, kept=0)
        made, synced = [], []
        for _ in range(rounds):
            start = time.perf_counter()
            held = copies.hold(fd, size, hashed=True)
            made.append(time.perf_counter() - start)
            assert held is not None, "no copy could be made in --work"
            held[0].close()
            dir_fd = os.open(copies_dir, os.O_RDONLY | os.O_DIRECTORY)
            copy = os.open(".", os.O_TMPFILE | os.O_RDWR, 0o400, dir_fd=dir_fd)
            _copy(fd, copy, size)
            start = time.perf_counter()
            os.fdatasync(copy)
            synced.append(time.perf_counter() - start)
            os.close(copy)
            os.close(dir_fd)
        os.close(fd)
        m, s = statistics.median(made), statistics.median(synced)
        print(
            f"{size / 1e6:,.0f} MB: copy and hash {m:.3f} s {[round(x, 3) for x in made]}; "
            f"fdatasync of the copy {s:.3f} s {[round(x, 3) for x in synced]}; sync / copy-and-hash {s / m:.2f}"
        )


if __name__ == "__main__":
    main()
