"""tools/make_dataset.py: determinism, layout, size distributions, real images, refusal of a non-empty OUT."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

TOOLS = Path(__file__).resolve().parent.parent / "tools"
sys.path.insert(0, str(TOOLS))

import make_dataset as md  # noqa: E402


def snapshot(root: Path) -> dict[str, tuple]:
    """Every path under ``root`` (root itself as ".") -> (mode, mtime_ns, content or None for directories)."""
    result = {}
    for dirpath, _, filenames in os.walk(root):
        for path in [Path(dirpath)] + [Path(dirpath) / name for name in filenames]:
            st = path.lstat()
            content = None if path.is_dir() else path.read_bytes()
            result[path.relative_to(root).as_posix()] = (st.st_mode, st.st_mtime_ns, content)
    return result


def sizes(root: Path) -> list[int]:
    return [path.stat().st_size for path in root.rglob("*") if path.is_file()]


@pytest.mark.parametrize("mode", md.MODES)
def test_same_arguments_give_an_identical_tree(tmp_path: Path, mode: str) -> None:
    first = md.make_dataset(tmp_path / "a", mode, files=25, classes=3, seed=7)
    second = md.make_dataset(tmp_path / "b", mode, files=25, classes=3, seed=7)
    assert first["bytes"] == second["bytes"]
    a, b = snapshot(tmp_path / "a"), snapshot(tmp_path / "b")
    assert a == b
    # 25 files, 3 class directories and the root, each with a nanosecond mtime of its own.
    assert len(a) == 29
    assert len({mtime for _, mtime, _ in a.values()}) == 29
    assert any(mtime % 1000 for _, mtime, _ in a.values())


@pytest.mark.parametrize("mode", md.MODES)
def test_another_seed_gives_other_contents(tmp_path: Path, mode: str) -> None:
    md.make_dataset(tmp_path / "a", mode, files=6, classes=2, seed=1)
    md.make_dataset(tmp_path / "b", mode, files=6, classes=2, seed=2)
    a = [path.read_bytes() for path in sorted((tmp_path / "a").rglob("*")) if path.is_file()]
    b = [path.read_bytes() for path in sorted((tmp_path / "b").rglob("*")) if path.is_file()]
    assert a != b


@pytest.mark.parametrize(
    ("mode", "class_pattern", "extension"),
    [("imagenet", r"n\d{8}", "JPEG"), ("tiny", r"class_\d{3}", "bin"), ("learnable", r"class_\d{3}", "png")],
)
def test_layout(tmp_path: Path, mode: str, class_pattern: str, extension: str) -> None:
    summary = md.make_dataset(tmp_path / "out", mode, files=11, classes=4)
    assert summary["files"] == 11 and summary["classes"] == 4
    assert summary["bytes"] == sum(sizes(tmp_path / "out"))
    classes = sorted(os.listdir(tmp_path / "out"))
    assert classes == md.class_names(mode, 4)
    counts = []
    for name in classes:
        assert re.fullmatch(class_pattern, name)
        files = sorted(os.listdir(tmp_path / "out" / name))
        assert files == [f"{name}_{index:06d}.{extension}" for index in range(len(files))]
        counts.append(len(files))
    assert counts == [3, 3, 3, 2]


def test_imagenet_sizes_and_jpeg_markers(tmp_path: Path) -> None:
    md.make_dataset(tmp_path / "out", "imagenet", files=500, classes=10, seed=3)
    paths = [path for path in (tmp_path / "out").rglob("*.JPEG")]
    found = [path.stat().st_size for path in paths]
    mean = sum(found) / len(found)
    median = sorted(found)[len(found) // 2]
    assert abs(mean - 110 * 1024) < 0.15 * 110 * 1024, mean
    assert 80 * 1024 < median < 110 * 1024, median
    for path in paths[:50]:
        data = path.read_bytes()
        assert data.startswith(b"\xff\xd8\xff") and data.endswith(b"\xff\xd9")


def test_tiny_sizes(tmp_path: Path) -> None:
    md.make_dataset(tmp_path / "out", "tiny", files=500, classes=5, seed=3)
    found = sizes(tmp_path / "out")
    assert len(found) == 500
    assert abs(sum(found) / len(found) - 4096) < 0.1 * 4096
    assert 2048 <= min(found) and max(found) <= 6144


@pytest.mark.parametrize("classes", [4, 12])
def test_learnable_images_are_rgb_pngs_of_the_requested_size(tmp_path: Path, classes: int) -> None:
    from PIL import Image

    md.make_dataset(tmp_path / "out", "learnable", files=2 * classes, classes=classes, image_size=24)
    paths = sorted((tmp_path / "out").rglob("*.png"))
    assert len(paths) == 2 * classes
    for path in paths:
        with Image.open(path) as image:
            assert image.format == "PNG"
            assert image.size == (24, 24)
            assert image.mode == "RGB"


def test_non_empty_out_is_refused_unless_forced(tmp_path: Path) -> None:
    out = tmp_path / "out"
    out.mkdir()
    (out / "stale").write_text("keep me")
    with pytest.raises(FileExistsError, match="--force"):
        md.make_dataset(out, "tiny", files=2, classes=1)
    assert os.listdir(out) == ["stale"]

    md.make_dataset(out, "tiny", files=2, classes=1, force=True)
    assert os.listdir(out) == ["class_000"]


def test_empty_or_missing_out_is_accepted(tmp_path: Path) -> None:
    (tmp_path / "empty").mkdir()
    md.make_dataset(tmp_path / "empty", "tiny", files=1, classes=1)
    md.make_dataset(tmp_path / "missing" / "deep", "tiny", files=1, classes=1)
    assert os.listdir(tmp_path / "missing" / "deep") == ["class_000"]


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"mode": "jpeg"}, "mode 'jpeg'"),
        ({"classes": 0}, "got 0"),
        ({"files": 2, "classes": 3}, r"files \(2\)"),
        ({"mode": "learnable", "image_size": 4}, "got 4"),
    ],
)
def test_bad_arguments_name_the_value(tmp_path: Path, kwargs: dict, message: str) -> None:
    arguments = {"mode": "tiny", "files": 4, "classes": 2} | kwargs
    with pytest.raises(ValueError, match=message):
        md.make_dataset(tmp_path / "out", **arguments)
    assert not (tmp_path / "out").exists()


def test_import_prints_nothing_and_main_prints_one_line(tmp_path: Path, capsys) -> None:
    md.make_dataset(tmp_path / "quiet", "tiny", files=2, classes=1)
    assert capsys.readouterr() == ("", "")

    assert md.main([str(tmp_path / "loud"), "--mode", "tiny", "--files", "3", "--classes", "1"]) == 0
    captured = capsys.readouterr()
    assert captured.err == ""
    assert len(captured.out.splitlines()) == 1 and "3 tiny files" in captured.out


def test_script_refuses_a_non_empty_out_with_one_line_and_exit_2(tmp_path: Path) -> None:
    out = tmp_path / "out"
    command = [sys.executable, str(TOOLS / "make_dataset.py"), str(out), "--mode", "tiny", "--files", "3"]
    command += ["--classes", "1", "--seed", "5"]
    first = subprocess.run(command, capture_output=True, text=True, check=True)
    assert len(first.stdout.splitlines()) == 1

    refused = subprocess.run(command, capture_output=True, text=True)
    assert refused.returncode == 2
    assert refused.stdout == ""
    assert len(refused.stderr.splitlines()) == 1
    assert str(out) in refused.stderr and "--force" in refused.stderr

    forced = subprocess.run(command + ["--force"], capture_output=True, text=True, check=True)
    assert len(forced.stdout.splitlines()) == 1
