"""``pack --labels FILE.csv`` (blockfs/packing/labels.py): every label checked while the CSV is read,
errors that name the file and line, and DEST untouched when the labels are refused (issue 17 #12)."""

from __future__ import annotations

import os

import pytest

from blockfs import open_dataset
from blockfs.cli import main
from blockfs.errors import PackError
from blockfs.packing.packer import pack


@pytest.fixture
def src(tmp_path):
    for rel in ("cat/a.jpg", "cat/b.jpg", "dog/c.jpg"):
        path = tmp_path / "src" / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(rel.encode())
    return tmp_path / "src"


def _csv(tmp_path, label: str) -> str:
    path = tmp_path / "labels.csv"
    path.write_text(f"path,label\ncat/a.jpg,1\ncat/b.jpg,{label}\n")
    return str(path)


@pytest.mark.parametrize("label", ["99999999999999999999", "3000000000", "2147483648", "-2", "-99999999999999999999"])
def test_a_label_outside_int32_is_refused_with_file_and_line_before_dest_exists(tmp_path, src, label):
    labels = _csv(tmp_path, label)
    with pytest.raises(PackError, match=rf"labels\.csv'?, line 3: label {label} is out of range"):
        pack(src, tmp_path / "ds", labels=labels, fsync=False)
    assert not os.path.exists(tmp_path / "ds")


def test_the_cli_says_one_line_and_leaves_an_existing_dataset_as_it_was(tmp_path, src, capsys):
    assert main(["pack", str(src), str(tmp_path / "ds"), "--no-fsync"]) == 0
    capsys.readouterr()
    labels = _csv(tmp_path, "99999999999999999999")
    assert main(["pack", str(src), str(tmp_path / "ds"), "--labels", labels, "--force", "--no-fsync"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "line 3" in err and labels in err
    assert "Traceback" not in err and "OverflowError" not in err
    with open_dataset(tmp_path / "ds") as ds:  # --force did not start replacing it
        assert ds.read_entry(ds.lookup("dog/c.jpg")) == b"dog/c.jpg"


@pytest.mark.parametrize("label", ["-1", "0", "2147483647"])
def test_labels_at_the_ends_of_the_range_are_kept(tmp_path, src, label):
    pack(src, tmp_path / "ds", labels=_csv(tmp_path, label), fsync=False)
    with open_dataset(tmp_path / "ds") as ds:
        assert ds.stat("cat/b.jpg").label == int(label)
        assert ds.stat("cat/a.jpg").label == 1 and ds.stat("dog/c.jpg").label == -1


def test_a_malformed_row_names_its_line(tmp_path, src):
    path = tmp_path / "labels.csv"
    path.write_text("cat/a.jpg,1\n\ncat/b.jpg,2,extra\n")
    with pytest.raises(PackError, match=r"line 3: each row must be 'path,label'"):
        pack(src, tmp_path / "ds", labels=str(path), fsync=False)
    assert not os.path.exists(tmp_path / "ds")


def test_a_path_not_in_the_source_names_its_line(tmp_path, src):
    path = tmp_path / "labels.csv"
    path.write_text("cat/a.jpg,1\nbird/x.jpg,2\n")
    with pytest.raises(PackError, match=r"'bird/x\.jpg' on line 2"):
        pack(src, tmp_path / "ds", labels=str(path), fsync=False)
    assert not os.path.exists(tmp_path / "ds")
