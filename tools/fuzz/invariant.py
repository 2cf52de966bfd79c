"""The invariant every reader of a damaged or forged dataset must keep (issue 17).

For ``info``, ``plan``, ``ls`` (every directory), ``cat`` (every file), ``verify`` and ``unpack``, run
in-process through ``blockfs.cli.main``: the command succeeds and what it gives is the source's (exact
bytes), or it fails with exit status 1 or 2 and one line on stderr, no traceback; ``unpack`` writes
nothing outside OUT; no reader runs longer than :data:`READER_LIMIT_S`. When the index is authentic (see
:mod:`fuzz.mutations`), a success must give back the source exactly, modes, times and links included, and
``verify`` saying ok means every file reads back.
"""

from __future__ import annotations

import contextlib
import functools
import io
import logging
import os
import signal
import stat
import sys
import traceback
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

from blockfs import cli

from .mutations import Pristine

READER_LIMIT_S = 20  # a reader of this tiny pack taking longer is hung (issue 17 #7)


# --- the invariant -----------------------------------------------------------------------------------
class Hung(BaseException):
    """A reader ran past READER_LIMIT_S (BaseException: the CLI must not turn it into a clean error)."""


@contextlib.contextmanager
def _time_limit(seconds: float) -> Iterator[None]:
    def expire(signum, frame):
        raise Hung(f"no answer in {seconds} s")

    old = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


@dataclass
class Outcome:
    rc: int
    out: bytes
    err: str


@functools.cache
def _parser():
    return _build_parser()


_build_parser = cli.build_parser


def run_cli(*argv: str | os.PathLike) -> Outcome:
    return _run_cli(*argv)


def _run_cli(*argv: str | os.PathLike) -> Outcome:
    """``blockfs.cli.main(argv)`` in this process, its stdout and stderr (log records included) captured."""
    out, err = io.BytesIO(), io.StringIO()
    stdout = io.TextIOWrapper(out, write_through=True)
    handler = logging.StreamHandler(err)
    handler.setFormatter(logging.Formatter("blockfs: %(message)s"))
    root = logging.getLogger()
    saved = sys.stdout, sys.stderr, root.handlers[:], root.level
    sys.stdout, sys.stderr = stdout, err
    root.handlers[:] = [handler]  # the CLI's basicConfig is then a no-op; what it would log is on err
    root.setLevel(logging.INFO)
    cli.build_parser = _parser  # argparse's set-up costs more than a read of this tiny pack; parsing is pure
    try:
        with _time_limit(READER_LIMIT_S):
            rc = cli.main([os.fsdecode(a) for a in argv])
    except SystemExit as e:  # argparse
        rc = e.code if isinstance(e.code, int) else 2
    except Exception:  # noqa: BLE001 - escaped the CLI: the traceback a user would see, reported as a violation
        rc = -1
        err.write(traceback.format_exc())
    finally:
        sys.stdout, sys.stderr, root.handlers[:], level = saved
        cli.build_parser = _build_parser
        root.setLevel(level)
    return Outcome(rc, out.getvalue(), err.getvalue())


def _clean_failure(what: str, o: Outcome) -> list[str]:
    lines = o.err.strip().splitlines()
    if o.rc not in (1, 2):
        return [f"{what}: exit status {o.rc}: {o.err.strip()[:300]!r}"]
    if "Traceback" in o.err or (o.rc == 2 and len(lines) != 1) or len(lines) > 1:
        return [f"{what}: exit {o.rc} without a one-line error: {o.err[:600]!r}"]
    return []


def _walk(root: Path) -> dict[bytes, tuple[str, object]]:
    """Relative path -> (kind, bytes or link target) of everything under root."""
    found = {}
    top = os.fsencode(root)
    for dirpath, dirnames, filenames in os.walk(top):
        for name in dirnames + filenames:
            path = os.path.join(dirpath, name)
            st = os.lstat(path)
            rel = os.path.relpath(path, top)
            if stat.S_ISLNK(st.st_mode):
                found[rel] = ("link", os.readlink(path))
            elif stat.S_ISREG(st.st_mode):
                with open(path, "rb") as f:
                    found[rel] = ("file", f.read())
            else:
                found[rel] = ("dir" if stat.S_ISDIR(st.st_mode) else "other", None)
    return found


class _Judge:
    """Collects violations and outcomes: a success is checked by ``ok``, a failure must be clean."""

    def __init__(self) -> None:
        self.problems: list[str] = []
        self.tally = {"exact": 0, "error": 0}

    def __call__(self, what: str, o: Outcome, ok: Callable[[Outcome], list[str]] = lambda o: []) -> bool:
        if o.rc != 0:
            self.problems.extend(_clean_failure(what, o))
            self.tally["error"] += 1
            return False
        found = ok(o)
        self.problems.extend(found)
        key = "wrong" if found else "exact"
        self.tally[key] = self.tally.get(key, 0) + 1
        return not found


def check_readers(
    p: Pristine, dest: Path, work: Path, authentic: bool, expect: str | None = None
) -> tuple[list[str], dict[str, int]]:
    """Run every reader (:attr:`Pristine.readers` runs) on ``dest``; return the invariant's violations and a count of outcomes.

    ``expect``: every reader pins the pristine pack's name (``--expect``): whatever was mutated, a success
    must then give the source exactly, as for an authentic index (issue 23)."""
    judge = _Judge()
    pin = ("--expect", expect) if expect else ()
    authentic = authentic or expect is not None

    def run_cli(command: str, *args: str | os.PathLike) -> Outcome:
        return _run_cli(command, *pin, *args)

    judge("info", run_cli("info", dest))
    judge("plan", run_cli("plan", dest))
    for directory in p.dirs:
        judge(f"ls {directory!r}", run_cli("ls", dest, directory))
    cats_ok = True
    for rel, data in sorted(p.files.items()):

        def same(o: Outcome, rel: bytes = rel, data: bytes = data) -> list[str]:
            return [] if o.out == data else [f"cat {rel!r}: exit 0, {len(o.out)} wrong bytes ({len(data)} expected)"]

        cats_ok &= judge(f"cat {rel!r}", run_cli("cat", dest, rel), same)
    verified = judge("verify", run_cli("verify", dest))
    unpacked = _check_unpack(p, dest, work, authentic, judge, pin)
    if authentic and verified and not (cats_ok and unpacked):
        judge.problems.append("verify said ok, but a file did not read back")
    return judge.problems, judge.tally


def _check_unpack(p: Pristine, dest: Path, work: Path, authentic: bool, judge: _Judge, pin: tuple = ()) -> bool:
    """Unpack into ``work/out`` next to a sentinel directory: nothing may change outside OUT, and no file
    under a source path may hold other bytes (a failed unpack may leave one it had just created empty)."""
    from .treesnap import tree_snapshot

    out, sentinel = work / "out", work / "sentinel"
    sentinel.mkdir()
    (sentinel / "victim").write_bytes(b"keep")
    before = sorted(os.listdir(work))
    o = run_cli("unpack", *pin, dest, out)
    if sorted(set(os.listdir(work)) - {"out"}) != before or _walk(sentinel) != {b"victim": ("file", b"keep")}:
        judge.problems.append(f"unpack wrote outside OUT: {sorted(os.listdir(work))}, {_walk(sentinel)}")
    for rel, (kind, data) in (_walk(out) if out.exists() else {}).items():
        source = p.files.get(rel)
        if kind == "file" and source is not None and data != source and not (o.rc != 0 and data == b""):
            judge.problems.append(f"unpack wrote wrong bytes to {rel!r}")
        if authentic and rel not in p.snapshot:
            judge.problems.append(f"unpack made {rel!r}, which the source does not have")
    return judge(
        "unpack",
        o,
        lambda o: (
            []
            if not authentic or tree_snapshot(out) == p.snapshot
            else ["unpack: exit 0 but the tree differs from the source"]
        ),
    )


# --- reads through a disk tier and flaky fetches (issue 21) -------------------------------------------
def read_through(p: Pristine, store, *, cached: bool) -> tuple[list[str], dict[str, int]]:
    """Read every file of the tree through ``store`` (alone, or through a cache-once BlockCache as the
    mount does): each gives the source's exact bytes or a CorruptBlockError / BlockReadError, nothing
    else.  Returns the violations and a count of outcomes."""
    from blockfs.core.dataset import PackedDataset
    from blockfs.errors import BlockReadError, CorruptBlockError
    from blockfs.serve.cache.block_cache import BlockCache

    reader = store
    if cached:
        reader = BlockCache(store, 1 << 20, "cache-once", readahead=0, loaders=1, lock_memory=False, share=False)
    problems, tally = [], {"exact": 0, "error": 0}
    try:
        with PackedDataset(p.pack) as ds:
            a = ds.index.arrays
            where = {
                rel: (int(a["block"][e]), int(a["slot"][e]), int(a["crc"][e]))
                for rel in sorted(p.files)
                for e in (ds.lookup(rel),)
            }
        for rel, (block, slot, crc) in where.items():
            try:
                data = reader.read_file(block, slot, crc)
            except (CorruptBlockError, BlockReadError):
                tally["error"] += 1
                continue
            except Exception as e:  # noqa: BLE001 - anything else is a violation, named
                problems.append(f"{rel!r}: {type(e).__name__}: {e}")
                continue
            if data != p.files[rel]:
                problems.append(f"{rel!r}: wrong bytes ({len(data)} of {len(p.files[rel])})")
            else:
                tally["exact"] += 1
    finally:
        if cached:
            reader.close()
    return problems, tally


def wrong_copies(p: Pristine, tier_root: Path) -> list[str]:
    """The tier's copies that are not their block byte for byte (a copy must be written from verified bytes)."""
    from blockfs.core import format as fmt

    blocks = tier_root / fmt.BLOCKS_DIR
    return [
        name
        for name in sorted(os.listdir(blocks))
        if (blocks / name).read_bytes() != (p.pack / fmt.BLOCKS_DIR / name).read_bytes()
    ]


def check_flaky_fetches(p: Pristine, work: Path, rnd) -> list[str]:
    """Fetches flip bits at random (rate drawn from ``rnd``), through a disk tier, read alone or through a
    cache: every read is exact or an error, the tier keeps only exact copies, and once the store is
    healthy every file reads back exactly through the same store (transient is not damaged)."""
    from .mutations import tiered_store

    rate, cached = rnd.choice((0.05, 0.2, 0.5, 0.8)), rnd.random() < 0.5
    case = f"rate {rate}, {'cached' if cached else 'alone'}"
    store, fetches, tier = tiered_store(p, work / "disk", rnd, rate)
    try:
        problems, _ = read_through(p, store, cached=cached)
        problems += [f"a wrong copy in the tier: {name}" for name in wrong_copies(p, Path(tier.root))]
        fetches.rate = 0.0
        healthy_problems, healthy = read_through(p, store, cached=cached)
        problems += healthy_problems
        if healthy["error"]:
            problems.append(f"{healthy['error']} files still fail once the store is healthy")
    finally:
        store.close()
        tier.close()
    return [f"{case}: {line}" for line in problems]


def check_damaged_copies(p: Pristine, work: Path, rnd) -> list[str]:
    """The tier's copies damaged after a healthy fill (``mutations.mutate_tier_copies``): with the dataset's
    own blocks healthy every file still reads exactly, and the file a planted link points to is untouched."""
    from .mutations import mutate_tier_copies, tiered_store

    outside = work / "outside"
    outside.write_bytes(b"not the tier's")
    store, _, tier = tiered_store(p, work / "disk", rnd, 0.0)
    try:
        problems, tally = read_through(p, store, cached=False)
    finally:
        store.close()
        tier.close()
    if problems or tally["error"]:
        return [f"the healthy fill failed: {problems} {tally}"]
    steps = mutate_tier_copies(Path(tier.root), rnd, p, outside)
    store, _, tier = tiered_store(p, work / "disk", rnd, 0.0)
    try:
        problems, tally = read_through(p, store, cached=rnd.random() < 0.5)
    finally:
        store.close()
        tier.close()
    if tally["error"]:
        problems.append(f"{tally['error']} files failed though the dataset's blocks are healthy")
    if outside.read_bytes() != b"not the tier's":
        problems.append("the file a planted link points to was changed")
    return [f"{'; '.join(steps)}: {line}" for line in problems]


TIER_CASES = {"fetched-bytes": check_flaky_fetches, "tier-copies": check_damaged_copies}
