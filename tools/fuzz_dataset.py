#!/usr/bin/env python3
"""Fuzz every reader of a packed dataset with thousands of mutations (issue 17).

The mutation families and the invariant are ``tools/fuzz/mutations.py`` and ``tools/fuzz/invariant.py``, the same
the property tests run a derandomized handful of: this runs many more. Mutation ``i`` of a family is
drawn from ``random.Random(f"{seed}:{family}:{i}")`` and applied to a fresh copy of one pristine pack, so a violation is
reproduced by its family and number alone::

    python3 tools/fuzz_dataset.py --mutations 3000 --seed 0
    python3 tools/fuzz_dataset.py --seed 0 --family block-header --only 123   # one mutation, verbosely
    python3 tools/fuzz_dataset.py --tier --mutations 2000    # the disk tier's copies and fetched bytes
    python3 tools/fuzz_dataset.py --mutations 3000 --pinned   # every reader with --expect (issue 23)

Exits 1 when any mutation broke the invariant.
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from fuzz.invariant import TIER_CASES, check_readers  # noqa: E402
from fuzz.mutations import (  # noqa: E402
    FAMILIES,
    Pristine,
    fresh_copy,
    make_pristine,
    remove_tree,
)

from blockfs.core.digest import name_of  # noqa: E402


def one(
    p: Pristine, family: str, seed: int, i: int, scratch: Path, expect: str | None = None
) -> tuple[list[str], list[str], dict[str, int]]:
    """Apply mutation ``i`` of ``family`` to a fresh copy and run the readers: (steps, violations, tally)."""
    work = Path(tempfile.mkdtemp(dir=scratch))
    try:
        dest = fresh_copy(p, work)
        fam = FAMILIES[family]
        steps = fam.mutate(dest, random.Random(f"{seed}:{family}:{i}"), p)
        problems, tally = check_readers(p, dest, work, fam.authentic, expect)
        return steps, problems, tally
    finally:
        remove_tree(work)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mutations", type=int, default=3000, help="in all, shared evenly by the families")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--family", choices=sorted(FAMILIES), action="append", help="only these (repeatable)")
    ap.add_argument("--only", type=int, help="run only mutation number ONLY (of each chosen family), verbosely")
    ap.add_argument(
        "--tier",
        action="store_true",
        help="fuzz the disk tier and fetched bytes instead: bits "
        f"flipped in transit, damaged or replaced tier copies ({', '.join(TIER_CASES)})",
    )
    ap.add_argument(
        "--pinned",
        action="store_true",
        help="every reader pins the pristine pack's name (--expect): any success must be exact",
    )
    args = ap.parse_args()
    if args.tier:
        return _run_tier(args)
    families = args.family or list(FAMILIES)
    with tempfile.TemporaryDirectory(prefix="blockfs-fuzz-") as tmp:
        scratch = Path(tmp)
        p = make_pristine(scratch / "pristine")
        args.expect = name_of((p.pack / "blockfs.json").read_bytes()) if args.pinned else None
        if args.only is not None:
            bad = False
            for family in families:
                steps, problems, tally = one(p, family, args.seed, args.only, scratch, args.expect)
                print(f"{family} #{args.only}: {'; '.join(steps)}\n  outcomes {tally}")
                for line in problems:
                    print(f"  VIOLATION {line}")
                bad |= bool(problems)
            return 1 if bad else 0
        return _run(p, families, args, scratch)


def _run(p: Pristine, families: list[str], args: argparse.Namespace, scratch: Path) -> int:
    per_family = max(1, args.mutations // len(families))
    started = time.monotonic()
    violations = 0
    print(
        f"{per_family} mutations per family, seed {args.seed}; {p.readers} reader runs per mutation: info, plan, "
        f"ls x{len(p.dirs)}, cat x{len(p.files)}, verify, unpack"
    )
    print(f"{'family':<22} {'mutations':>9} {'exact/ok':>9} {'errors':>8} {'violations':>10} {'seconds':>8}")
    for family in families:
        t0 = time.monotonic()
        totals = {"exact": 0, "error": 0}
        bad = 0
        for i in range(per_family):
            steps, problems, tally = one(p, family, args.seed, i, scratch, args.expect)
            for k, v in tally.items():
                totals[k] = totals.get(k, 0) + v
            if problems:
                bad += 1
                print(
                    f"VIOLATION {family} #{i} (reproduce: --seed {args.seed} --family {family} --only {i}): "
                    f"{'; '.join(steps)}\n    " + "\n    ".join(problems[:5]),
                    flush=True,
                )
        violations += bad
        print(
            f"{family:<22} {per_family:>9} {totals['exact']:>9} {totals['error']:>8} {bad:>10} "
            f"{time.monotonic() - t0:>8.1f}",
            flush=True,
        )
    total = per_family * len(families)
    print(f"{total} mutations, {violations} broke the invariant, {time.monotonic() - started:.0f} s")
    return 1 if violations else 0


def _run_tier(args: argparse.Namespace) -> int:
    """Each case of :data:`invariant.TIER_CASES` ``--mutations / 2`` times, case ``i`` drawn from
    ``random.Random(f"{seed}:{case}:{i}")`` (``--only i`` runs one)."""
    import logging

    logging.getLogger("blockfs").setLevel(logging.ERROR)  # a dropped copy is expected here, and said once each
    per_case = max(1, args.mutations // len(TIER_CASES))
    started, violations = time.monotonic(), 0
    with tempfile.TemporaryDirectory(prefix="blockfs-fuzz-") as tmp:
        scratch = Path(tmp)
        p = make_pristine(scratch / "pristine")
        for case, check in TIER_CASES.items():
            t0, bad = time.monotonic(), 0
            for i in [args.only] if args.only is not None else range(per_case):
                work = Path(tempfile.mkdtemp(dir=scratch))
                try:
                    problems = check(p, work, random.Random(f"{args.seed}:{case}:{i}"))
                finally:
                    remove_tree(work)
                if problems:
                    bad += 1
                    print(
                        f"VIOLATION {case} #{i} (reproduce: --tier --seed {args.seed} --only {i}):\n    "
                        + "\n    ".join(problems[:5]),
                        flush=True,
                    )
            violations += bad
            print(
                f"{case:<16} {per_case if args.only is None else 1:>7} cases {bad:>5} violations "
                f"{time.monotonic() - t0:>7.1f} s",
                flush=True,
            )
    print(f"{violations} cases broke the invariant, {time.monotonic() - started:.0f} s")
    return 1 if violations else 0


if __name__ == "__main__":
    sys.exit(main())
