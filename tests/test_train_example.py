"""examples/train_imagefolder.py: bit-reproducible wherever the tree lies, and it learns."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tools"))

import make_dataset as md  # noqa: E402

pytestmark = [pytest.mark.torch, pytest.mark.slow]

SCRIPT = REPO / "examples" / "train_imagefolder.py"


def train(root: Path, out: Path, *extra: str) -> dict:
    command = [sys.executable, str(SCRIPT), str(root), "--epochs", "3", "--seed", "1", "--out", str(out)]
    result = subprocess.run(command + list(extra), capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    assert "images/s" in result.stdout and "final accuracy" in result.stdout
    return json.loads(out.read_text())


def test_same_tree_at_two_paths_gives_identical_losses_and_learns(tmp_path: Path, torch_module) -> None:
    source = tmp_path / "source" / "train"
    md.make_dataset(source, "learnable", files=256, classes=4, seed=1)
    # A copy at another, longer path, with other mtimes: only the tree's names and bytes may matter.
    copy = tmp_path / "elsewhere" / "deeper" / "train"
    shutil.copytree(source, copy, copy_function=shutil.copyfile)

    first = train(source, tmp_path / "first.json")
    second = train(copy, tmp_path / "second.json")

    assert first["losses"] == second["losses"]
    assert first["final_accuracy"] == second["final_accuracy"]
    losses = first["losses"]
    assert len(losses) == first["steps"] == 3 * 256 // 32
    assert all(isinstance(loss, float) for loss in losses)
    assert sum(losses[-5:]) / 5 < sum(losses[:5]) / 5
    # 4 classes: chance is 0.25.
    assert first["final_accuracy"] > 0.4


def test_max_steps_stops_early(tmp_path: Path, torch_module) -> None:
    root = tmp_path / "train"
    md.make_dataset(root, "learnable", files=64, classes=2, seed=2)
    result = train(root, tmp_path / "losses.json", "--max-steps", "3", "--batch-size", "8")
    assert result["steps"] == len(result["losses"]) == 3
