"""Measure the hashes blockfs could verify blocks with, per core, side by side in one run.

    python tools/bench/bench_hash.py [--sizes 4K,110K,1M,64M] [--repeats 7] [--json results/bench_hash.json]

Candidates: zlib-ng's CRC-32 (what blocks are checked with against accidents), hashlib's SHA-256 and
BLAKE2b, and BLAKE3 (the ``blake3`` package) on one thread and, for comparison, with its own thread pool
(``max_threads=AUTO``: every core, so not a per-core figure).  Each figure is GB/s (10^9 bytes a second)
over one buffer of each size, hashed back to back for at least ``--min-seconds`` per repeat; the median of
``--repeats`` repeats is reported, and each hash's ratio to CRC-32 beside it (medians and ratios hold up
on a shared, noisy machine better than any one run).  A small buffer's figure includes the call and
digest overhead a reader pays per file.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import statistics
import time
from collections.abc import Callable

UNITS = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}


def parse_size(text: str) -> int:
    text = text.strip().upper().rstrip("IB")
    return int(float(text[:-1]) * UNITS[text[-1]]) if text[-1] in UNITS else int(text)


def candidates() -> dict[str, Callable[[memoryview], object]]:
    from zlib_ng.zlib_ng import crc32

    hashes: dict[str, Callable[[memoryview], object]] = {
        "crc32 (zlib-ng)": crc32,
        "sha256 (hashlib)": lambda b: hashlib.sha256(b).digest(),
        "blake2b (hashlib)": lambda b: hashlib.blake2b(b).digest(),
    }
    try:
        from blake3 import blake3
    except ImportError:
        return hashes
    hashes["blake3 (1 thread)"] = lambda b: blake3(b).digest()
    hashes["blake3 (all cores)"] = lambda b: blake3(b, max_threads=blake3.AUTO).digest()
    return hashes


def rate(fn: Callable[[memoryview], object], buf: memoryview, min_seconds: float) -> float:
    """GB/s of ``fn`` over ``buf``, hashed back to back for at least ``min_seconds``."""
    n, start = 0, time.perf_counter()
    while True:
        fn(buf)
        n += 1
        elapsed = time.perf_counter() - start
        if elapsed >= min_seconds:
            return n * len(buf) / elapsed / 1e9


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="4K,110K,1M,64M")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--min-seconds", type=float, default=0.2)
    parser.add_argument("--json", help="write the medians here")
    args = parser.parse_args(argv)
    sizes = [parse_size(s) for s in args.sizes.split(",")]
    hashes = candidates()
    buffers = {size: memoryview(os.urandom(size)) for size in sizes}
    results: dict[str, dict[int, float]] = {name: {} for name in hashes}
    for size in sizes:
        runs: dict[str, list[float]] = {name: [] for name in hashes}
        for _ in range(args.repeats):  # interleaved, so drift in the machine's load hits every hash alike
            for name, fn in hashes.items():
                runs[name].append(rate(fn, buffers[size], args.min_seconds))
        for name in hashes:
            results[name][size] = statistics.median(runs[name])
    labels = [args.sizes.split(",")[i] for i in range(len(sizes))]
    print(f"GB/s per call, median of {args.repeats} (ratio to CRC-32 in brackets)")
    print(f"{'hash':<20}" + "".join(f"{label:>18}" for label in labels))
    base = results["crc32 (zlib-ng)"]
    for name, by_size in results.items():
        cells = "".join(f"{by_size[s]:>9.2f} ({by_size[s] / base[s]:5.2f}x)" for s in sizes)
        print(f"{name:<20}{cells}")
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump({name: {str(s): v for s, v in by.items()} for name, by in results.items()}, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
