"""How a mount could hold its index, side by side: the cost to hold and BLAKE3 it, the memory it then counts
as, and whether writing the dataset's ``index.bfi`` in place afterwards changes the held bytes.

    python tools/bench/bench_index_hold.py INDEX [--rounds 3] [--copy-dir DIR]

``INDEX`` is an ``index.bfi`` (copy it first: the last step writes it in place and back).  Each mode runs
in a fresh process, the modes interleaved in each round: ``anon`` (read into anonymous memory, what every
reader but a mount does), ``map-dataset`` (a map of INDEX itself), ``tmpfile-cfr`` / ``tmpfile-sendfile``
(a copy into an unnamed ``O_TMPFILE`` in ``--copy-dir``, mapped: what a mount does, ``core/index_copy.py``),
``memfd`` (a sealed memfd, for comparison).  Wall and CPU seconds to hold and hash, the RssAnon / RssFile /
RssShmem it adds, and ``changed`` (an in-place write of INDEX seen through the held bytes).
"""

from __future__ import annotations

import argparse
import fcntl
import json
import mmap
import os
import subprocess
import sys
import time

MODES = ("anon", "map-dataset", "tmpfile-cfr", "tmpfile-sendfile", "memfd")


def status() -> dict[str, int]:
    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(("RssAnon", "RssFile", "RssShmem")):
                key, value = line.split(":")
                out[key] = int(value.split()[0]) // 1024
    return out


def hold(mode: str, path: str, copy_dir: str) -> mmap.mmap:
    if mode == "anon":
        from blockfs.core.index_format import read_index_file

        return read_index_file(path, "index")
    src = os.open(path, os.O_RDONLY)
    size = os.fstat(src).st_size
    try:
        if mode == "map-dataset":
            return mmap.mmap(src, size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ)
        if mode == "memfd":
            dst = os.memfd_create("index", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
            os.ftruncate(dst, size)
        else:
            os.makedirs(copy_dir, mode=0o700, exist_ok=True)
            dst = os.open(copy_dir, os.O_TMPFILE | os.O_EXCL | os.O_RDWR, 0o600)
        done = 0
        while done < size:
            if mode == "tmpfile-cfr":
                done += os.copy_file_range(src, dst, size - done, done, done)
            else:
                os.lseek(dst, done, os.SEEK_SET)
                done += os.sendfile(dst, src, done, size - done)
        if mode == "memfd":
            seals = fcntl.F_SEAL_WRITE | fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL
            fcntl.fcntl(dst, fcntl.F_ADD_SEALS, seals)
        held = mmap.mmap(dst, size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ)
        os.close(dst)
        return held
    finally:
        os.close(src)


def one(mode: str, path: str, copy_dir: str) -> dict:
    """In this process: hold INDEX the ``mode`` way, hash it, then write INDEX in place and look again."""
    from blake3 import blake3

    before = status()
    wall, cpu = time.perf_counter(), time.process_time()
    held = hold(mode, path, copy_dir)
    blake3(held).digest()
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    after = status()
    seen = bytes(held[1000:1008])
    with open(path, "r+b") as f:
        f.seek(1000)
        f.write(bytes(b ^ 0xFF for b in seen))
    changed = bytes(held[1000:1008]) != seen
    with open(path, "r+b") as f:
        f.seek(1000)
        f.write(seen)
    grown = {key: after[key] - before[key] for key in after}
    return {"mode": mode, "wall_s": round(wall, 3), "cpu_s": round(cpu, 3), **grown, "changed": changed}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("index")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--copy-dir", default=os.path.expanduser("~/.cache/blockfs/index-copies"))
    parser.add_argument("--one", choices=MODES, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:
        print(json.dumps(one(args.one, args.index, args.copy_dir)))
        return
    for _ in range(args.rounds):
        for mode in MODES:
            command = [sys.executable, __file__, args.index, "--copy-dir", args.copy_dir, "--one", mode]
            print(subprocess.run(command, check=True, capture_output=True, text=True).stdout.strip(), flush=True)


if __name__ == "__main__":
    main()
