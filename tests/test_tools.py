"""tools/ in its three groups: what a user or CI runs (tools/), the benchmarks (tools/bench/) and what they
import or start (tools/bench/helpers/).  Every benchmark, and every helper a benchmark starts by path, gets
past its imports when run as docs/benchmarks.md writes it (``python tools/bench/bench_NAME.py``) from any
directory; nothing is left at an old flat path."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

TOOLS = Path(__file__).resolve().parent.parent / "tools"
BENCH = TOOLS / "bench"
HELPERS = BENCH / "helpers"
# The helpers a benchmark starts as child processes and that parse arguments (range_server takes ROOT PORT).
HELPER_SCRIPTS = ("null_fs", "delay_proxy", "storage_reader", "storage_loaders")


@pytest.mark.slow
def test_every_benchmark_and_started_helper_answers_help_from_another_directory(tmp_path):
    scripts = [*sorted(BENCH.glob("bench_*.py")), *(HELPERS / f"{name}.py" for name in HELPER_SCRIPTS)]
    assert len(scripts) > len(HELPER_SCRIPTS), f"no benchmarks found in {BENCH}"
    started = {
        script: subprocess.Popen(
            [sys.executable, str(script), "--help"],
            cwd=tmp_path,
            text=True,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
        )
        for script in scripts
    }
    failed = {}
    for script, proc in started.items():
        out, _ = proc.communicate(timeout=300)
        if proc.returncode != 0 or "usage:" not in out:
            failed[script.relative_to(TOOLS.parent).as_posix()] = out[-400:]
    assert not failed, f"these do not start: {failed}"


def test_the_helpers_package_names_the_layout_and_puts_tools_and_the_checkout_on_sys_path():
    probe = (
        "import sys; import helpers; "
        "print(helpers.TOOLS, helpers.ROOT, str(helpers.TOOLS) in sys.path, str(helpers.ROOT) in sys.path); "
        "import make_dataset, blockfs; print(make_dataset.__file__, blockfs.__file__)"
    )
    done = subprocess.run([sys.executable, "-c", probe], cwd=BENCH, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    paths, modules = done.stdout.splitlines()
    assert paths == f"{TOOLS} {TOOLS.parent} True True"
    assert modules.split() == [str(TOOLS / "make_dataset.py"), str(TOOLS.parent / "blockfs" / "__init__.py")]


def test_no_benchmark_or_helper_is_left_at_the_top_of_tools():
    helpers = {p.name for p in HELPERS.glob("*.py")} - {"__init__.py"}
    assert helpers, f"no helpers found in {HELPERS}"
    stray = sorted(p.name for p in TOOLS.iterdir() if p.name.startswith("bench") or p.name in helpers)
    assert stray == ["bench"], f"benchmarks or their helpers at the top of tools/: {stray}"


def test_tools_import_nothing_from_tests():
    """The fuzzer's families live in tools/fuzz/ (the tests import them, never the reverse): no module under
    tools/ imports a module of tests/ or puts tests/ on its path."""
    import ast

    test_modules = {p.stem for p in (TOOLS.parent / "tests").glob("*.py")}
    offenders = []
    for path in sorted(TOOLS.rglob("*.py")):
        text = path.read_text()
        if '"tests"' in text or "'tests'" in text:
            offenders.append(f"{path.relative_to(TOOLS.parent)}: names the tests directory")
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.Import):
                names = [a.name.split(".")[0] for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0:
                names = [(node.module or "").split(".")[0]]
            else:
                continue
            offenders += [
                f"{path.relative_to(TOOLS.parent)}:{node.lineno} imports {n}" for n in names if n in test_modules
            ]
    assert offenders == [], "\n".join(offenders)


def test_the_fuzzer_answers_help_from_another_directory(tmp_path):
    command = [sys.executable, str(TOOLS / "fuzz_dataset.py"), "--help"]
    done = subprocess.run(command, cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and "usage:" in done.stdout, done.stdout + done.stderr
