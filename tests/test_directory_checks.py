"""A mount's index checks of the paths, deferred (``blockfs/core/directory_checks.py``): a directory's children
are checked before anything about them is answered, the whole tree once the mount serves (then recorded), and a
forged directory fails alone, remembered, while the rest of the tree is served."""

from __future__ import annotations

import errno
import json
import logging
import os
import threading
import time

import pytest
from capability import has_fuse, require
from fuzz.indexutil import rename_entry, rewrite_index
from mountutil import mounted

from blockfs import open_dataset
from blockfs.cli.mount_commands import _stats_text
from blockfs.client import read_stats
from blockfs.core.checked_indexes import CheckedIndexes
from blockfs.core.dataset import PackedDataset
from blockfs.errors import IndexFormatError
from blockfs.packing.packer import pack

FILES = {b"a/x": b"inside a", b"b/y": b"inside b", b"c/d/z": b"deep", b"s": b"plain s"}


def _pack(tmp_path, forged: bool):
    src = tmp_path / "src"
    for rel, data in FILES.items():
        path = os.path.join(os.fsencode(src), rel)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "wb") as f:
            f.write(data)
    pack(src, tmp_path / "ds", labels="none", fsync=False, workers=1)
    if forged:  # b's one child claims a path inside a; parents, listings and digests all agree with it
        rewrite_index(tmp_path / "ds", lambda arrays: rename_entry(arrays, b"b/y", b"a/y"))
    return tmp_path / "ds"


def _deferred(dest, record) -> PackedDataset:
    return PackedDataset(dest, checked=CheckedIndexes(record), defer_tree_checks=True)


def test_a_forged_directory_is_refused_alone_and_remembered(tmp_path, caplog):
    dest = _pack(tmp_path, forged=True)
    with pytest.raises(IndexFormatError, match=r"'a/y'\) is not a name inside its parent"):
        open_dataset(dest)  # every other reader checks the whole tree at open
    with _deferred(dest, tmp_path / "record") as ds:
        index = ds.index
        assert index.directory_checks is not None
        a, b = index.find_child(0, b"a"), index.find_child(0, b"b")
        assert ds.read_entry(index.find_child(a, b"x")) == b"inside a"
        assert index.names(a) == [b"x"]
        assert ds.read_entry(index.find(b"c/d/z")) == b"deep"  # through c and c/d, each checked on the way
        with caplog.at_level(logging.ERROR, logger="blockfs.core.directory_checks"):
            for ask in (lambda: index.children(b), lambda: index.find_child(b, b"y"), lambda: index.names(b)):
                with pytest.raises(IndexFormatError, match=r"'a/y'\) is not a name inside its parent"):
                    ask()
        refusals = [r for r in caplog.records if r.name == "blockfs.core.directory_checks"]
        assert len(refusals) == 1 and "answering EIO for the entries of that directory" in refusals[0].getMessage()
        assert not index.finish_checks(threading.Event())  # the whole tree fails: nothing recorded
        assert index.directory_checks is not None and not index.checks_recorded
        assert not CheckedIndexes(tmp_path / "record").has(ds.metadata["index"]["blake3"])


def test_a_directory_is_checked_when_first_used_and_the_whole_tree_then_recorded(tmp_path):
    dest = _pack(tmp_path, forged=False)
    record = tmp_path / "record"
    with _deferred(dest, record) as ds:
        checks = ds.index.directory_checks
        assert checks is not None and checks.checked_directories() == 0
        ds.index.find_child(0, b"a")
        assert checks.checked_directories() == 1  # the root's children, no more
        ds.index.names(ds.index.find_child(0, b"c"))
        assert checks.checked_directories() == 2
        assert ds.index.finish_checks(threading.Event())
        assert ds.index.directory_checks is None and ds.index.checks_recorded
    with _deferred(dest, record) as ds:  # the next open skips every check, the deferred ones too
        assert ds.index.checks_skipped and ds.index.directory_checks is None


def test_threads_asking_while_the_whole_tree_is_checked_get_every_answer_right(tmp_path):
    """Eight threads look up every file and list every directory while ``finish_checks`` runs on another:
    each answer is the right entry (by its path), nothing raises, and the gate ends open."""
    src = tmp_path / "src"
    for d in range(40):
        (src / f"d{d:02}").mkdir(parents=True)
        for f in range(40):
            (src / f"d{d:02}" / f"f{f:02}").write_bytes(b"%d/%d" % (d, f))
    pack(src, tmp_path / "ds", labels="none", fsync=False, workers=1)
    with _deferred(tmp_path / "ds", tmp_path / "record") as ds:
        index, failures = ds.index, []
        start = threading.Barrier(9)

        def ask(seed: int) -> None:
            start.wait()
            try:
                for d in range(40) if seed % 2 else reversed(range(40)):
                    directory = index.find_child(0, b"d%02d" % d)
                    assert index.names(directory) == [b"f%02d" % f for f in range(40)]
                    for f in range(40):
                        name = b"d%02d/f%02d" % (d, f)
                        found = index.find(name) if (d + f + seed) % 2 else index.find_child(directory, name[4:])
                        assert index.path(found) == name
            except BaseException as e:  # reported below, whatever it is
                failures.append(e)

        threads = [threading.Thread(target=ask, args=(i,)) for i in range(8)]
        for t in threads:
            t.start()
        start.wait()
        assert index.finish_checks(threading.Event())
        for t in threads:
            t.join()
        assert not failures, failures
        assert index.directory_checks is None and index.checks_recorded


def test_finishing_stops_when_told(tmp_path):
    dest = _pack(tmp_path, forged=False)
    stop = threading.Event()
    stop.set()
    with _deferred(dest, tmp_path / "record") as ds:
        assert not ds.index.finish_checks(stop)
        assert ds.index.directory_checks is not None and not ds.index.checks_recorded


@pytest.mark.fuse
@pytest.mark.parametrize("binding", ["kernel", "mfusepy"])
def test_a_real_mount_of_a_forged_directory_serves_the_rest_and_answers_eio_there(tmp_path, binding, monkeypatch):
    require(has_fuse(), "needs FUSE")
    monkeypatch.setenv("BLOCKFS_CHECKED_DIR", str(tmp_path / "record"))
    dest = _pack(tmp_path, forged=True)
    with mounted(dest, tmp_path / "mnt", binding=binding) as m:
        root = m.path
        assert sorted(n for n in os.listdir(root) if not n.startswith(".")) == ["a", "b", "c", "s"]
        assert os.listdir(root / "a") == ["x"] and (root / "a" / "x").read_bytes() == b"inside a"
        assert (root / "c" / "d" / "z").read_bytes() == b"deep"
        with pytest.raises(OSError) as failed:
            os.listdir(root / "b")
        assert failed.value.errno == errno.EIO
        with pytest.raises(OSError) as failed:
            (root / "b" / "y").read_bytes()
        # By node (kernel), the lookup in b fails; by path (mfusepy), no entry's path is "b/y" byte for byte.
        assert failed.value.errno == (errno.EIO if binding == "kernel" else errno.ENOENT)
        deadline = time.monotonic() + 30  # the whole tree's check, on its own thread once serving
        while "the rest of the tree is served" not in m.log_text() and time.monotonic() < deadline:
            time.sleep(0.02)
        log = m.log_text()
        assert "'a/y') is not a name inside its parent" in log and "the rest of the tree is served" in log, log
        checked = read_stats(root)["dataset"]["paths_checked"]  # the root, a, c, c/d passed; b refused
        assert checked == {"directories_passed": 4, "directories_refused": 1}, checked
        shown = _stats_text(read_stats(root), None, 1.0)
        assert "paths checked so far in 4 directories, 1 refused (their entries answer EIO: see the log)" in shown
        assert (root / "s").read_bytes() == b"plain s" and m.proc.poll() is None
    assert not CheckedIndexes(tmp_path / "record").has(
        json.loads((dest / "blockfs.json").read_text())["index"]["blake3"]
    )
