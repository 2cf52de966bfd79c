"""``pip install`` as a user does it: build the wheel from a copy of the checkout, install it in a fresh virtual
environment (no system site-packages, nothing from this checkout), and run pack -> mount -> read -> umount
with that environment's ``blockfs``.  The dependencies come through pip's configured indexes (its cache
makes that quick after the first run); the wheel itself never touches an index."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
from capability import has_fuse, require
from mountutil import release

REPO = Path(__file__).resolve().parent.parent


def run(*command: object, **kw) -> subprocess.CompletedProcess:
    done = subprocess.run([os.fspath(c) for c in command], capture_output=True, text=True, timeout=600, **kw)
    assert done.returncode == 0, f"{' '.join(map(str, command))}:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    return done


def checkout_copy(dest: Path) -> Path:
    """The files a source distribution holds (pyproject, README, LICENSE, the package), where the build
    may write its build/ and egg-info without touching the checkout."""
    for name in ("pyproject.toml", "README.md", "LICENSE"):
        shutil.copy(REPO / name, dest / name)
    shutil.copytree(REPO / "blockfs", dest / "blockfs", ignore=shutil.ignore_patterns("__pycache__"))
    return dest


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    src = checkout_copy(tmp_path_factory.mktemp("checkout"))
    out = tmp_path_factory.mktemp("dist")
    run(sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", out, src)
    (built,) = out.glob("blockfs-*.whl")
    return built


def test_the_wheel_declares_its_license_scripts_and_extras(wheel):
    with zipfile.ZipFile(wheel) as z:
        names = z.namelist()
        info = next(n for n in names if n.endswith(".dist-info/METADATA"))
        metadata = z.read(info).decode()
        entry_points = z.read(info.replace("METADATA", "entry_points.txt")).decode()
    assert "License-Expression: Apache-2.0" in metadata and "License-File: LICENSE" in metadata
    assert any(n.endswith("licenses/LICENSE") for n in names)
    assert "Requires-Python: >=3.10" in metadata and "Classifier: Operating System :: POSIX :: Linux" in metadata
    for extra in ("torch", "remote", "test"):
        assert f"Provides-Extra: {extra}" in metadata
    assert "blockfs = blockfs.cli:main" in entry_points
    assert "mount.fuse.blockfs = blockfs.cli.mount_helper:main" in entry_points
    assert not [n for n in names if n.startswith(("tests/", "tools/"))]


@pytest.mark.slow
@pytest.mark.fuse
@pytest.mark.any_route  # the wheel's install: one file read through the mount, on whichever route
def test_pip_install_of_the_wheel_in_a_fresh_venv_runs_the_quick_start(wheel, tmp_path):
    require(has_fuse(), "/dev/fuse")
    venv = tmp_path / "venv"
    run(getattr(sys, "_base_executable", sys.executable), "-m", "venv", venv)
    # --no-compile: pip would byte-compile every module of every dependency (numpy's hundreds) first.
    run(venv / "bin" / "python", "-m", "pip", "install", "-q", "--no-compile", wheel)
    where = run(venv / "bin" / "python", "-c", "import blockfs; print(blockfs.__file__)", cwd=tmp_path).stdout
    assert where.startswith(str(venv)), where  # the installed copy, not this checkout
    (tmp_path / "src" / "cats").mkdir(parents=True)
    (tmp_path / "src" / "cats" / "tom.txt").write_text("meow\n")
    blockfs_cmd = venv / "bin" / "blockfs"
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    run(blockfs_cmd, "pack", tmp_path / "src", tmp_path / "ds.blockfs", cwd=tmp_path, env=env)
    (tmp_path / "mnt").mkdir()
    try:
        run(
            blockfs_cmd,
            "mount",
            tmp_path / "ds.blockfs",
            tmp_path / "mnt",
            "--log",
            tmp_path / "log",
            cwd=tmp_path,
            env=env,
        )
        assert (tmp_path / "mnt" / "cats" / "tom.txt").read_text() == "meow\n"
        assert "files served" in run(blockfs_cmd, "stats", tmp_path / "mnt", env=env).stdout
        run(blockfs_cmd, "umount", tmp_path / "mnt", env=env)
    finally:
        release(tmp_path / "mnt")
