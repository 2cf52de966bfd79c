"""tools/suite_cpu.py: each test's CPU, its own and its children's, recorded by the plugin and reported."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

TOOLS = Path(__file__).resolve().parent.parent / "tools"

PROBE = """
import subprocess, sys

def test_spends_cpu_in_a_child():
    subprocess.run([sys.executable, "-c", "import time\\nt = time.process_time()\\nwhile time.process_time() - t < 0.3: pass"], check=True)

def test_spends_nothing():
    pass
"""


def test_each_tests_cpu_is_recorded_with_its_childrens_and_reported_largest_first(tmp_path):
    (tmp_path / "test_probe.py").write_text(PROBE)
    record = tmp_path / "cpu"
    record.mkdir()
    env = dict(os.environ, PYTHONPATH=str(TOOLS), SUITE_CPU_DIR=str(record))
    command = [sys.executable, "-m", "pytest", "-q", "-p", "suite_cpu", "-p", "no:cacheprovider", "test_probe.py"]
    done = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    rows = {
        line.split("\t")[0]: [float(x) for x in line.split("\t")[1:]]
        for tsv in record.glob("cpu-*.tsv")
        for line in tsv.read_text().splitlines()
    }
    assert set(rows) == {"test_probe.py::test_spends_cpu_in_a_child", "test_probe.py::test_spends_nothing"}
    assert rows["test_probe.py::test_spends_cpu_in_a_child"][1] >= 0.25  # the child's CPU, counted to its test
    assert rows["test_probe.py::test_spends_nothing"][1] < 0.25
    shown = subprocess.run(
        [sys.executable, str(TOOLS / "suite_cpu.py"), str(record), "--top", "1"], capture_output=True, text=True
    )
    assert shown.returncode == 0, shown.stderr
    assert "test_spends_cpu_in_a_child" in shown.stdout and "test_spends_nothing" not in shown.stdout
    empty = subprocess.run([sys.executable, str(TOOLS / "suite_cpu.py"), str(tmp_path)], capture_output=True, text=True)
    assert empty.returncode == 2 and len(empty.stderr.splitlines()) == 1
