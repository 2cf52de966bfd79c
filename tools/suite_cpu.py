#!/usr/bin/env python3
"""Where the suite's CPU goes: a pytest plugin that records each test's CPU, and a report of the largest.

    PYTHONPATH=tools SUITE_CPU_DIR=DIR bash tools/test.sh -p suite_cpu   # every worker, both steps
    .venv/bin/python tools/suite_cpu.py DIR [--top 30]                    # the largest, by test and by file

On two cores the suite is bound by CPU, not by any one test's wall time, so this is what to trim to keep CI
inside its budget.  A test's CPU is its process's (``getrusage(RUSAGE_SELF)``) plus that of the child
processes it waited for (``RUSAGE_CHILDREN``: servers, examples, benchmarks it ran) over its setup, call and
teardown; a process left running past the test and the kernel's own work (FUSE requests) are not counted.
Each process writes ``DIR/cpu-PID.tsv``: node id, own CPU s, children's CPU s, wall s.
"""

from __future__ import annotations

import argparse
import collections
import os
import re
import resource
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

DIR_ENV = "SUITE_CPU_DIR"


def _cpu() -> tuple[float, float]:
    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime, children.ru_utime + children.ru_stime


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Iterator[None]:
    directory = os.environ.get(DIR_ENV)
    (own, children), started = _cpu(), time.monotonic()
    yield
    if not directory:
        return
    (own_after, children_after), wall = _cpu(), time.monotonic() - started
    with open(os.path.join(directory, f"cpu-{os.getpid()}.tsv"), "a") as f:
        f.write(f"{item.nodeid}\t{own_after - own:.3f}\t{children_after - children:.3f}\t{wall:.3f}\n")


def report(directory: Path, top: int) -> str:
    """The ``top`` largest CPU costs by test (parameters summed) and by file, and the total."""
    by_test: collections.Counter[str] = collections.Counter()
    by_file: collections.Counter[str] = collections.Counter()
    for tsv in sorted(directory.glob("cpu-*.tsv")):
        for line in tsv.read_text().splitlines():
            node, own, children, _wall = line.split("\t")
            cpu = float(own) + float(children)
            by_test[re.sub(r"\[.*", "", node)] += cpu
            by_file[node.split("::")[0]] += cpu
    lines = [f"{sum(by_file.values()):.0f} s of CPU in {len(by_file)} files"]
    for title, counts in (("by test", by_test), ("by file", by_file)):
        lines.append(f"-- {title}")
        lines += [f"{cpu:8.1f} s  {name}" for name, cpu in counts.most_common(top)]
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("dir", type=Path, help=f"the {DIR_ENV} the suite ran with")
    parser.add_argument("--top", type=int, default=30)
    args = parser.parse_args()
    if not any(args.dir.glob("cpu-*.tsv")):
        print(f"{args.dir}: no cpu-*.tsv here: run the suite with {DIR_ENV}={args.dir} first", file=sys.stderr)
        return 2
    print(report(args.dir, args.top))
    return 0


if __name__ == "__main__":
    sys.exit(main())
