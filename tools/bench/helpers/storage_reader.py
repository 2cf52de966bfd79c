"""Read a list of files as a training job would, and say how fast: the reader every system is measured with.

    python tools/bench/helpers/storage_reader.py ROOT LIST --threads 4 [--seconds 30]

``LIST`` holds one path per line, relative to ``ROOT``, already in the order to read (shuffled by the
caller).  ``--list`` first lists every directory under ``ROOT`` (``os.walk``, as ``ImageFolder`` does before its
first batch; timed apart, ``list_seconds``).  ``--threads T`` splits it as ``DataLoader`` workers split a sampler's order: thread ``i`` reads
items ``i, i + T, i + 2T, ...``.  Each file is read whole with ``open().read()``.  ``--seconds`` stops a slow
system early; the rate is then over the files read.  Prints one JSON line: files, bytes, seconds, errors,
cpu_ms, and ``timeline``: the files read in each :data:`TICK_S` of the pass (when they were read, so that the
benchmark can say how many were read while the storage was still delivering).

A separate process, so that the benchmark can start it inside a throttled cgroup.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import threading
import time

TICK_S = 0.05  # the timeline's resolution


def wait_for_mount(path: str, timeout: float = 600) -> None:
    """Say 'ready' and poll until ``path`` is a mount point: started before its server, a reader begins
    within milliseconds of the mount, so a server that loads ahead from its start gets no head start."""
    print("ready", flush=True)
    deadline = time.monotonic() + timeout
    while not os.path.ismount(path):
        if time.monotonic() > deadline:
            raise SystemExit(f"{path} was not mounted within {timeout:.0f} s")
        time.sleep(0.002)


def announce(root: str, payload: bytes) -> bool:
    """Send ``payload`` (block ids, one a line) to the prefetch socket of the blockfs mount at ``root``; False
    when it has none."""
    try:
        control = os.path.join(root, os.fsdecode(os.getxattr(root, "user.blockfs.control")))
        address = os.getxattr(control, "user.blockfs.prefetch")
    except OSError:
        return False
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as channel:
        channel.connect(address)
        channel.sendall(payload)
    return True


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("root")
    parser.add_argument("list")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--seconds", type=float, default=None, help="stop after this long (slow systems)")
    parser.add_argument(
        "--list", dest="list_first", action="store_true", help="list every directory first, as ImageFolder does"
    )
    parser.add_argument("--wait-mount", default=None, help="print 'ready', then start once this path is mounted")
    parser.add_argument(
        "--announce",
        default=None,
        metavar="BLOCKS",
        help="a file of block ids, one a line: announced to the mount first (as blockfs's loader does at an "
        "epoch's start; a mount without the prefetch socket is read anyway)",
    )
    args = parser.parse_args()
    with open(args.list) as f:
        names = [line.rstrip("\n") for line in f if line.strip()]
    totals = {"files": 0, "bytes": 0, "errors": 0}
    lock = threading.Lock()
    if args.wait_mount:
        wait_for_mount(args.wait_mount)
    if args.list_first:
        listed = time.monotonic()
        for _dir, _dirs, _files in os.walk(args.root):
            pass
        totals["list_seconds"] = time.monotonic() - listed
    started = time.monotonic()
    if args.announce:
        with open(args.announce) as f:
            totals["announced"] = announce(args.root, f.read().encode())
    deadline = started + args.seconds if args.seconds else None
    first_error: list[str] = []
    timeline: list[int] = []

    def read(part: list[str]) -> None:
        files = nbytes = errors = 0
        ticks: list[int] = []
        for name in part:
            if deadline is not None and time.monotonic() > deadline:
                break
            try:
                with open(os.path.join(args.root, name), "rb") as f:
                    nbytes += len(f.read())
                files += 1
                tick = int((time.monotonic() - started) / TICK_S)
                if tick >= len(ticks):
                    ticks.extend([0] * (tick + 1 - len(ticks)))
                ticks[tick] += 1
            except OSError as e:
                errors += 1
                if not first_error:
                    first_error.append(f"{name}: {e}")
        with lock:
            totals["files"] += files
            totals["bytes"] += nbytes
            totals["errors"] += errors
            if len(ticks) > len(timeline):
                timeline.extend([0] * (len(ticks) - len(timeline)))
            for i, n in enumerate(ticks):
                timeline[i] += n

    threads = [threading.Thread(target=read, args=(names[i :: args.threads],)) for i in range(args.threads)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    totals["seconds"] = time.monotonic() - started
    totals["cpu_ms"] = int(time.process_time() * 1000)  # this reader's CPU, all its threads
    totals["complete"] = totals["files"] == len(names)
    totals["timeline"] = timeline
    if first_error:
        totals["first_error"] = first_error[0]
    print(json.dumps(totals))
    return 0


if __name__ == "__main__":
    sys.exit(main())
