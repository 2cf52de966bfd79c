"""tools/bench/helpers/benchutil.py's scratch directory: a benchmark's own working directory goes with it."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parent.parent / "tools" / "bench"
sys.path.insert(0, str(BENCH))

from helpers import benchutil  # noqa: E402

MAKE = """
import sys
sys.path.insert(0, {bench!r})
from helpers.benchutil import scratch_dir
work = scratch_dir(None, "test-scratch-")
(work / "data").write_bytes(b"x" * 1000)
print(work, flush=True)
if sys.argv[1] == "raise":
    raise RuntimeError("the benchmark failed")
"""


@pytest.mark.parametrize("how", ["return", "raise"])
def test_a_benchmarks_own_scratch_directory_is_removed_when_it_exits(how):
    done = subprocess.run(
        [sys.executable, "-c", MAKE.format(bench=str(BENCH)), how], capture_output=True, text=True, timeout=60
    )
    assert (done.returncode == 0) == (how == "return"), done.stderr
    work = Path(done.stdout.strip())
    assert work.name.startswith("test-scratch-") and not work.exists()


def test_a_given_work_directory_is_kept(tmp_path):
    assert benchutil.scratch_dir(str(tmp_path), "unused-") == tmp_path.resolve()
    assert tmp_path.exists()


def test_a_scratch_directory_with_a_mount_below_it_is_left_saying_so(tmp_path, monkeypatch, capsys):
    (tmp_path / "mnt").mkdir()
    monkeypatch.setattr(benchutil, "mount_points", lambda: ["/", str(tmp_path / "mnt")])
    benchutil.remove_scratch(tmp_path)
    assert (tmp_path / "mnt").is_dir()
    assert "still mounted" in capsys.readouterr().err
    monkeypatch.setattr(benchutil, "mount_points", lambda: ["/", str(tmp_path) + "-other"])
    benchutil.remove_scratch(tmp_path)
    assert not tmp_path.exists()


def test_mount_points_are_this_namespaces():
    points = benchutil.mount_points()
    assert "/" in points and "/proc" in points
