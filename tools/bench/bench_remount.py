"""How long ``blockfs mount`` takes to return on a large dataset: before a change, and after it on a first
mount and a re-mount (the record of checked indexes, ``blockfs/core/checked_indexes.py``, and the index
copy kept for the next mount, ``blockfs/core/kept_copies.py``).

    python tools/bench/bench_remount.py DS [--before CHECKOUT] [--rounds 4] [--cold] [--json OUT]

``DS`` is a packed dataset (``bench_scale.py --files 1000000 --pack-only --no-plain --no-tools --work W``
makes one at ``W/ds``).  Each round mounts it, in turn: with ``--before`` (``git archive REV blockfs | tar
-x -C CHECKOUT``, run on ``PYTHONPATH``), with no record, with an empty record and no kept copy (a first
mount), with an empty record and the kept copy (the copy kept, its checks not recorded: a first mount
after a pack whose record was elsewhere), with the record that holds this index and its kept copy (a
re-mount, and a first mount after ``blockfs pack`` on this machine, which keeps the copy it hashes and
records its checks), and with that record but
keeping no copy (``BLOCKFS_KEPT_INDEX_COPIES=0``: a re-mount that copies and hashes the index), each to
its return and unmounted again; with ``--before``, that checkout with no record and with its own record
(its re-mount).  Wall time, and CPU: the command's and its serving process's own up to the return
(steadier than wall time on a shared machine); and of the wall time, the dataset's open (the index read,
copied or mapped, and checked or not) as the server's log says it.  Medians and ranges; root not needed beyond what a mount
needs (``--cold``, every kernel cache dropped before each mount, needs root).  A first mount's copy is
removed after it (1.5 GB at ten million files).  A first mount leaves its paths' checks to run once it
serves (``blockfs/core/directory_checks.py``) and records the index when they pass: the mount that makes
the re-mounts' record waits for that, and says how long the checks took.
"""

from __future__ import annotations

import json
import os
import re
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

import helpers  # noqa: F401  (puts the checkout on sys.path, for blockfs)
from helpers.benchutil import before_after_parser, compile_timed, drop_caches

from blockfs.serve.daemon import serving_pid

OPENED = re.compile(rb"dataset opened in ([0-9.]+) s")  # the server's log line (blockfs.serve.server.index_opened)
# Its line once the paths' checks a first mount defers have passed (blockfs.serve.server.finish_checks_once_serving).
FINISHED = re.compile(rb"entries checked in ([0-9.]+) s")
SETTLE_S = 600.0  # how long a mount that must leave its record is given to finish its checks


def mount_once(
    ds: str,
    work: str,
    record: str,
    copies: str,
    before: str | None,
    kept: str = "",
    cold: bool = False,
    settle: bool = False,
) -> tuple[float, float, float | None]:
    """(wall seconds, CPU seconds, the server's own "dataset opened in" seconds: the index read and checked,
    or None from a blockfs that does not log it) of one ``blockfs mount`` to its return, its index copies in
    ``copies`` (``kept``: ``BLOCKFS_KEPT_INDEX_COPIES``, "" for the default; ``cold``: every kernel cache
    dropped first); unmounted after, or with ``settle`` once the checks a first mount leaves to run while it
    serves have passed (and been recorded), as a mount in use for more than a moment has them."""
    env = dict(os.environ, BLOCKFS_CHECKED_DIR=record, BLOCKFS_INDEX_COPY_DIR=copies, BLOCKFS_KEPT_INDEX_COPIES=kept)
    if before:
        env["PYTHONPATH"] = before
    mnt = os.path.join(work, "mnt")
    os.makedirs(mnt, exist_ok=True)
    command = [sys.executable, "-m", "blockfs"]
    if cold and not drop_caches(3):
        raise SystemExit("--cold: dropping the kernel's caches needs root")
    log = os.path.join(work, "log")
    logged = os.path.getsize(log) if os.path.exists(log) else 0
    r0 = resource.getrusage(resource.RUSAGE_CHILDREN)
    started = time.monotonic()
    # Started outside any checkout: `python -m` puts the working directory first on sys.path, which would
    # shadow PYTHONPATH's blockfs (--before).  -q: no plan printed; the log still at info, for the open's line.
    mount = [*command, "mount", ds, mnt, "-q", "--log-level", "info", "--log", log]
    subprocess.run(mount, check=True, env=env, cwd="/")
    wall = time.monotonic() - started
    with open(log, "rb") as f:
        f.seek(logged)
        found = OPENED.findall(f.read())
    opened = float(found[-1]) if found else None
    r1 = resource.getrusage(resource.RUSAGE_CHILDREN)
    try:
        with open(f"/proc/{serving_pid(mnt)}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        server = (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
        if settle:
            _wait_for_checks(log, logged)
    finally:
        subprocess.run([*command, "umount", mnt], check=True, stdout=subprocess.DEVNULL, env=env, cwd="/")
    return wall, r1.ru_utime + r1.ru_stime - r0.ru_utime - r0.ru_stime + server, opened


def _wait_for_checks(log: str, logged: int) -> None:
    """Until the server's log (past ``logged`` bytes) says its deferred checks passed, or its open ran or
    skipped every check itself (a blockfs before the deferral, or an index already recorded)."""
    deadline = time.monotonic() + SETTLE_S
    while time.monotonic() < deadline:
        with open(log, "rb") as f:
            f.seek(logged)
            text = f.read()
        finished = FINISHED.search(text)
        if finished or (OPENED.search(text) and b"checked as each directory is first used" not in text):
            if finished:
                print(f"(the mount's deferred checks passed in {float(finished.group(1)):.2f} s)", flush=True)
            return
        time.sleep(0.05)
    raise SystemExit(f"the mount's deferred checks did not pass within {SETTLE_S:.0f} s; see {log}")


def main() -> None:
    parser = before_after_parser(__doc__, 4, "where the records and copies go (default: the temporary directory's)")
    parser.add_argument(
        "--cold",
        action="store_true",
        help="drop every kernel cache before each mount (root): Python, NumPy, blockfs and the index from the disk",
    )
    args = parser.parse_args()
    ds = os.path.abspath(args.ds)
    compile_timed(args.before)
    with tempfile.TemporaryDirectory(prefix="bench_remount-", dir=args.work) as work:
        kept, kept_copies = os.path.join(work, "kept"), os.path.join(work, "kept-copies")
        mount_once(ds, work, kept, kept_copies, None, settle=True)  # the re-mounts' record and copy hold this index
        # name: (record, copies, checkout, BLOCKFS_KEPT_INDEX_COPIES); None: a fresh one each round
        variants: dict[str, tuple[str | None, str | None, str | None, str]] = {
            "no record": ("", None, None, ""),
            "first mount": (None, None, None, ""),
            "first mount, copy kept": (None, kept_copies, None, ""),
            "re-mount": (kept, kept_copies, None, ""),
            "re-mount, no copy kept": (kept, kept_copies, None, "0"),
        }
        if args.before:
            before = os.path.abspath(args.before)
            kept_before = os.path.join(work, "kept-before")  # its own record: the check code differs
            mount_once(ds, work, kept_before, kept_copies, before, settle=True)
            variants = {
                "before": ("", None, before, ""),
                "before, re-mount": (kept_before, kept_copies, before, ""),
                **variants,
            }
        runs: dict[str, list[tuple[float, float, float | None]]] = {name: [] for name in variants}
        for r in range(args.rounds):
            for v, (name, (record, copies, before, keep)) in enumerate(variants.items()):
                if record is None:  # a first mount: an empty record
                    record = os.path.join(work, f"fresh-{r}-{v}")
                fresh = copies is None
                if fresh:  # no copy kept
                    copies = os.path.join(work, f"fresh-copies-{r}-{v}")
                assert copies is not None
                runs[name].append(mount_once(ds, work, record, copies, before, keep, args.cold))
                if fresh:
                    shutil.rmtree(copies)
            print(
                r,
                {name: tuple(x if x is None else round(x, 2) for x in got[-1]) for name, got in runs.items()},
                flush=True,
            )
    for name, got in runs.items():
        wall, cpu = [w for w, _, _ in got], [c for _, c, _ in got]
        opened = [o for _, _, o in got if o is not None]
        of_it = (
            f"; of it the dataset's open median {statistics.median(opened):.2f} s ({min(opened):.2f}-{max(opened):.2f})"
            if opened
            else ""
        )
        print(
            f"{name:24} wall median {statistics.median(wall):.2f} s ({min(wall):.2f}-{max(wall):.2f}); "
            f"CPU median {statistics.median(cpu):.2f} s ({min(cpu):.2f}-{max(cpu):.2f}){of_it}"
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"dataset": ds, "rounds": args.rounds, "runs": runs}, f, indent=1)


if __name__ == "__main__":
    main()
