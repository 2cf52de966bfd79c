"""How long the loader takes to open a mount's index (``BlockfsMount``: every process that reads the mount,
each worker that reopens it included): before a change, on the first open on a machine, and once the
record of checked indexes holds it (``blockfs/core/checked_indexes.py``).

    python tools/bench/bench_loader_open.py DS [--before CHECKOUT] [--rounds 3] [--json OUT]

``DS`` is a packed dataset (``bench_scale.py --files 1000000 --pack-only --no-plain --no-tools --work W``
makes one at ``W/ds``).  It is mounted once; then each round opens the mount's index in a fresh process per
case, in turn: with ``--before`` (``git archive REV blockfs | tar -x -C CHECKOUT``, run on ``PYTHONPATH``),
with an empty record (the first open here: every check run, then recorded), and with the record that
holds the index (an open after that).  Wall and CPU seconds of the open alone (the imports before it are
not counted), medians and ranges.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile

import helpers  # noqa: F401  (puts the checkout on sys.path, for blockfs)
from helpers.benchutil import before_after_parser, compile_timed

OPEN = (
    "import sys, time; from blockfs.loader.mount_client import BlockfsMount; "
    "w, c = time.perf_counter(), time.process_time(); m = BlockfsMount(sys.argv[1]); "
    "print(time.perf_counter() - w, time.process_time() - c); m.close()"
)


def open_once(mnt: str, record: str, before: str | None) -> tuple[float, float]:
    """(wall, CPU) seconds of one ``BlockfsMount(mnt)`` in a fresh process with ``record`` as its record."""
    env = dict(os.environ, BLOCKFS_CHECKED_DIR=record)
    if before:
        env["PYTHONPATH"] = before
    out = subprocess.run(
        [sys.executable, "-c", OPEN, mnt], check=True, env=env, cwd="/", capture_output=True, text=True
    ).stdout
    wall, cpu = (float(x) for x in out.split())
    return wall, cpu


def main() -> None:
    parser = before_after_parser(__doc__, 3, "where the mount and the records go (default: the temporary directory's)")
    args = parser.parse_args()
    ds = os.path.abspath(args.ds)
    compile_timed(args.before)
    with tempfile.TemporaryDirectory(prefix="bench_loader_open-", dir=args.work) as work:
        mnt, kept = os.path.join(work, "mnt"), os.path.join(work, "kept")
        os.makedirs(mnt)
        env = dict(os.environ, BLOCKFS_CHECKED_DIR=os.path.join(work, "mount-record"))
        command = [sys.executable, "-m", "blockfs"]
        subprocess.run([*command, "mount", ds, mnt, "-q"], check=True, env=env, cwd="/")
        try:
            open_once(mnt, kept, None)  # the record the "recorded" case opens with
            cases: dict[str, tuple[str | None, str | None]] = {
                "first open here": (None, None),
                "an open after it (recorded)": (kept, None),
            }
            if args.before:
                cases = {"before": (os.path.join(work, "before-record"), os.path.abspath(args.before)), **cases}
            runs: dict[str, list[tuple[float, float]]] = {name: [] for name in cases}
            for r in range(args.rounds):
                for v, (name, (record, before)) in enumerate(cases.items()):
                    runs[name].append(open_once(mnt, record or os.path.join(work, f"fresh-{r}-{v}"), before))
                print(r, {name: got[-1] for name, got in runs.items()}, flush=True)
        finally:
            subprocess.run([*command, "umount", mnt], check=True, stdout=subprocess.DEVNULL, env=env, cwd="/")
    for name, got in runs.items():
        walls, cpus = [w for w, _ in got], [c for _, c in got]
        print(
            f"{name:28s} wall median {statistics.median(walls):.2f} s ({min(walls):.2f}-{max(walls):.2f}); "
            f"CPU median {statistics.median(cpus):.2f} s ({min(cpus):.2f}-{max(cpus):.2f})"
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"ds": ds, "runs": runs}, f, indent=2)


if __name__ == "__main__":
    main()
