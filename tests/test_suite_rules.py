"""The suite's own rules: under CI (BLOCKFS_REQUIRE_ALL=1) nothing skips and property tests are
derandomized; waiting polls with a timeout (tests/polling.py)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import threading
from pathlib import Path

import pytest
from polling import wait_until

HERE = Path(__file__).resolve().parent

PROBE = """
import pytest
from hypothesis import given, settings, strategies as st

@pytest.mark.skipif(True, reason="a capability this machine lacks")
def test_marked_skip():
    pass

def test_skip_in_the_body():
    pytest.skip("no such device")

@pytest.mark.gpu
def test_gpu_only():
    pytest.skip("no CUDA GPU here")

@settings(max_examples=5)
@given(st.integers())
def test_profile(x):
    print("derandomize", settings.default.derandomize, "deadline", settings.default.deadline)
    assert settings().deadline is None and settings().derandomize == (__import__("os").environ.get("BLOCKFS_REQUIRE_ALL") == "1")
"""


def run_probe(
    tmp_path: Path, require_all: bool, ci: bool = False, require_gpu: bool = False
) -> subprocess.CompletedProcess:
    for name in ("conftest.py", "capability.py", "treeutil.py"):  # the hooks and the plain modules they import
        shutil.copy(HERE / name, tmp_path / name)
    (tmp_path / "test_probe.py").write_text(PROBE)
    (tmp_path / "pytest.ini").write_text("[pytest]\nmarkers =\n    gpu: needs a CUDA GPU\n")  # as pyproject.toml
    env = {k: v for k, v in os.environ.items() if k not in ("BLOCKFS_REQUIRE_ALL", "BLOCKFS_REQUIRE_GPU", "CI")}
    if require_all:
        env["BLOCKFS_REQUIRE_ALL"] = "1"
    if require_gpu:
        env["BLOCKFS_REQUIRE_GPU"] = "1"
    # Hypothesis changes its own defaults when it sees CI=true; the profiles must not depend on that.
    if ci:
        env["CI"] = "true"
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rA", str(tmp_path)]
    return subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("ci", [False, True], ids=["outside-ci", "ci-variable-set"])
def test_without_require_all_capability_skips_skip(tmp_path, ci):
    done = run_probe(tmp_path, require_all=False, ci=ci)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "1 passed, 3 skipped" in done.stdout


def test_require_all_turns_every_skip_into_a_failure_and_derandomizes(tmp_path):
    done = run_probe(tmp_path, require_all=True)
    assert done.returncode == 1, done.stdout + done.stderr
    # A skipif mark skips in setup, so it shows as an error; a skip in the body as a failure.
    # CI has no GPU: a test marked gpu is the one skip it allows.
    assert "1 failed, 1 passed, 1 skipped, 1 error" in done.stdout
    assert "a capability this machine lacks" in done.stdout and "no such device" in done.stdout


def test_require_gpu_makes_the_gpu_tests_skip_a_failure_too(tmp_path):
    done = run_probe(tmp_path, require_all=True, require_gpu=True)
    assert done.returncode == 1, done.stdout + done.stderr
    assert "2 failed, 1 passed, 1 error" in done.stdout and "no CUDA GPU here" in done.stdout


def test_wait_until_returns_the_first_true_value_as_soon_as_it_comes():
    ready = threading.Event()
    threading.Timer(0.05, ready.set).start()
    assert wait_until(lambda: ready.is_set() and "ready", "the timer") == "ready"


def test_wait_until_fails_naming_what_never_happened():
    with pytest.raises(AssertionError, match="timed out after 0.05 s waiting for the impossible"):
        wait_until(lambda: False, "the impossible", timeout=0.05)


def _marks(decorators: list) -> set[str]:
    """The ``pytest.mark.NAME`` names among a function's (or a module's ``pytestmark``) decorators."""
    import ast

    names = set()
    for node in decorators:
        for sub in ast.walk(node):
            if isinstance(sub, ast.Attribute) and isinstance(sub.value, ast.Attribute) and sub.value.attr == "mark":
                names.add(sub.attr)
    return names


def test_every_test_that_mounts_is_marked_fuse():
    """``pytest -m 'not fuse'`` must run where there is no /dev/fuse: a test that mounts (``mounted(``,
    ``has_fuse()``, a mount command) carries the ``fuse`` mark, itself or through its module."""
    import ast

    unmarked = []
    for path in sorted(HERE.glob("test_*.py")):
        if path.name == "test_suite_rules.py":
            continue
        text = path.read_text()
        lines = text.splitlines(keepends=True)  # each test's source sliced from these: no pass over the file per test
        tree = ast.parse(text)
        module_marks: set[str] = set()
        for node in tree.body:
            if isinstance(node, ast.Assign) and any(getattr(t, "id", "") == "pytestmark" for t in node.targets):
                module_marks |= _marks([node.value])
        for node in ast.walk(tree):
            if isinstance(node, ast.FunctionDef) and node.name.startswith("test_"):
                body = "".join(lines[node.lineno - 1 : node.end_lineno])
                mounts = any(
                    s in body for s in ("mounted(", "has_fuse()", "fuse_ok", '"blockfs", "mount"', 'main(["mount"')
                )
                if mounts and "fuse" not in module_marks | _marks(node.decorator_list):
                    unmarked.append(f"{path.name}::{node.name}")
    assert unmarked == [], "\n".join(unmarked)


def test_no_module_imports_conftest():
    """conftest.py holds fixtures and hooks, which pytest loads itself; a helper a test imports lives in a
    plain module (capability, treeutil, mountutil, tools/fuzz/...), so nothing imports conftest by name."""
    import ast

    offenders = []
    for path in sorted([*HERE.glob("*.py"), *(HERE.parent / "tools").rglob("*.py")]):
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
            if isinstance(node, ast.ImportFrom) and node.level == 0:
                names = [node.module or ""]
            if "conftest" in names:
                offenders.append(f"{path.relative_to(HERE.parent)}:{node.lineno}")
    assert offenders == [], "imports conftest: " + ", ".join(offenders)


# The one-way order inside blockfs/serve (README, Development): the running mount (server, daemon) on top,
# then the FUSE adapters, the view they translate, the control directory, the plain modules, the memory tier.
SERVE_LAYERS = {
    "server": "mount",
    "daemon": "mount",
    "fuse": "fuse",
    "view": "view",
    "control": "control",
    "cache": "cache",
    "errorlog": "base",
    "mount_options": "base",
    "notify": "base",
    "node_attr": "base",
    "mount_files": "mount",
    "peers": "mount",
    "peer_endpoint": "mount",
}
SERVE_MAY_IMPORT = {
    "mount": {"fuse", "view", "control", "cache", "base"},
    "fuse": {"view", "base"},
    "view": {"control", "cache", "base"},
    "control": {"base"},
    "base": {"cache"},  # mount_options names the cache's policies and defaults
    "cache": set(),
}


def serve_import_violations(serve: Path) -> list[str]:
    """Every import (top-level, in a function or under TYPE_CHECKING) in the ``serve`` package at ``serve``
    that crosses an edge :data:`SERVE_MAY_IMPORT` does not allow, as ``path:line: from -> to``."""
    import ast

    def layer(parts: list[str]) -> str | None:  # parts: the module's path inside blockfs.serve
        return SERVE_LAYERS.get(parts[0]) if parts and parts[0] != "__init__" else None

    found = []
    for path in sorted(serve.rglob("*.py")):
        rel = list(path.relative_to(serve).with_suffix("").parts)
        here = layer(rel)
        if here is None:
            if rel != ["__init__"]:  # a new module must be given its layer, or it escapes the rule
                found.append(f"{path}: not placed in SERVE_LAYERS")
            continue
        package = rel[:-1]  # the module's own package inside blockfs.serve
        for node in ast.walk(ast.parse(path.read_text())):
            targets: list[list[str]] = []
            if isinstance(node, ast.ImportFrom) and node.level:
                base = package[: len(package) - (node.level - 1)] if node.level > 1 else package
                if node.level - 1 > len(package):
                    continue  # above blockfs.serve: core, errors, protocol...
                mod = base + (node.module.split(".") if node.module else [])
                targets = [mod + [a.name] if not node.module else mod for a in node.names]
            elif isinstance(node, (ast.Import, ast.ImportFrom)):
                names = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module or ""]
                targets = [n.split(".")[2:] for n in names if n.startswith("blockfs.serve.")]
            for target in targets:
                there = layer(target)
                if there is not None and there != here and there not in SERVE_MAY_IMPORT[here]:
                    found.append(f"{path.relative_to(serve.parent)}:{node.lineno}: {here} -> {there}")
    return found


def test_serve_imports_go_one_way():
    assert serve_import_violations(HERE.parent / "blockfs" / "serve") == []


def test_an_import_across_a_forbidden_edge_is_found(tmp_path):
    serve = tmp_path / "serve"
    shutil.copytree(HERE.parent / "blockfs" / "serve", serve, ignore=shutil.ignore_patterns("__pycache__"))
    for rel, line in [
        ("cache/budget.py", "from ..fuse import wire"),
        ("control/share.py", "from .. import view"),
        ("view.py", "import blockfs.serve.fuse.session"),
        ("fuse/wire.py", "from ..cache import policies"),
    ]:
        with open(serve / rel, "a") as f:
            f.write(f"\n{line}\n")
    found = serve_import_violations(serve)
    assert [f.split(": ")[1] for f in found] == ["cache -> fuse", "control -> view", "fuse -> cache", "view -> fuse"], (
        found
    )
