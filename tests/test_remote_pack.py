"""``blockfs pack`` to and from an S3-compatible store (moto on loopback): the same dataset as a local pack,
crash-safe commits, refusals that lose nothing, and no credential in any output."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading

import pytest

import blockfs
from blockfs.errors import NotADatasetError, PackError, SourceError
from blockfs.packing.remote_source import _ReadAhead
from blockfs.packing.sources import SourceEntry
from conftest import make_class_tree, make_edge_tree
from polling import wait_until
from s3server import SECRET


def run_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "blockfs", *args], capture_output=True, text=True)


def snapshot(ds) -> dict[str, tuple]:
    """Every entry: kind, mode, size, mtime, label, and a file's bytes or a link's target."""
    out = {}
    for e in range(ds.index.n_entries):
        st = ds.stat_entry(e)
        path = os.fsdecode(ds.path_of(e))
        body = ds.read_entry(e) if st.kind_name == "file" else (ds.index.link_target(e) if st.kind_name == "symlink" else b"")
        out[path] = (st.kind, st.mode, st.size, st.mtime_ns, st.label, st.nlink, body)
    return out


def test_a_pack_to_s3_is_the_local_pack_and_unpacks_to_the_tree(s3, tmp_path):
    src = tmp_path / "src"
    make_edge_tree(src)
    bucket = s3.new_bucket()
    url = f"s3://{bucket}/edge"
    result = blockfs.pack(src, url, block_size=4096, fsync=False)
    assert result.dest == url and result.n_blocks >= 2
    keys = s3.keys(bucket, "edge/")
    assert "edge/blockfs.json" in keys and "edge/index.bfi" in keys and "edge/.blockfs-packing" not in keys
    blockfs.pack(src, tmp_path / "local", block_size=4096, fsync=False)
    with blockfs.open_dataset(url) as remote, blockfs.open_dataset(tmp_path / "local") as local:
        assert snapshot(remote) == snapshot(local)
    done = run_cli("unpack", url, str(tmp_path / "out"))
    assert done.returncode == 0, done.stderr
    diff = subprocess.run(["diff", "-r", "--no-dereference", src, tmp_path / "out"], capture_output=True)
    assert diff.returncode == 0, diff.stdout + diff.stderr


def files_and_labels(ds) -> dict[str, tuple[bytes, int]]:
    return {os.fsdecode(ds.path_of(e)): (ds.read_entry(e), int(ds.labels[e])) for e in ds.file_ids}


def upload_tree(s3, bucket: str, prefix: str, root) -> None:
    client = s3.client()
    for dirpath, _dirs, files in os.walk(root):
        for name in files:
            path = os.path.join(dirpath, name)
            client.upload_file(path, bucket, prefix + os.path.relpath(path, root))


def test_a_prefix_of_objects_packs_as_the_tree_it_describes(s3, tmp_path):
    src = tmp_path / "src"
    make_class_tree(src, files=45, seed=3, sizes=(10, 3000))
    (src / "c1" / "empty.bin").write_bytes(b"")  # an empty file: a zero-byte object that is not a folder
    (src / "c3" / "deeper").mkdir(parents=True)  # an empty folder: a placeholder key "c3/deeper/"
    bucket = s3.new_bucket()
    upload_tree(s3, bucket, "raw/train/", src)
    client = s3.client()
    for key in ("raw/train/", "raw/train/c0/", "raw/train/c3/deeper/"):  # folder placeholders
        client.put_object(Bucket=bucket, Key=key, Body=b"")
    client.put_object(Bucket=bucket, Key="raw/trainer/x.bin", Body=b"beside the prefix, not under it")

    blockfs.pack(f"s3://{bucket}/raw/train/", tmp_path / "from-s3", files_per_block=10, fsync=False)
    blockfs.pack(f"s3://{bucket}/raw/train/", f"s3://{bucket}/packed", files_per_block=10)  # store to store
    blockfs.pack(src, tmp_path / "from-disk", files_per_block=10, fsync=False)
    with (
        blockfs.open_dataset(tmp_path / "from-s3") as a,
        blockfs.open_dataset(tmp_path / "from-disk") as b,
        blockfs.open_dataset(f"s3://{bucket}/packed") as c,
    ):
        assert a.classes == b.classes == c.classes == ["c0", "c1", "c2", "c3"]
        assert files_and_labels(a) == files_and_labels(b) == files_and_labels(c)
        dirs = {os.fsdecode(a.path_of(e)) for e in range(a.index.n_entries) if a.stat_entry(e).kind == 1}
        assert dirs == {"", "c0", "c1", "c2", "c3", "c3/deeper"}
        assert a.stat("c1/empty.bin").size == 0 and a.stat("c1/empty.bin").mode == 0o100644
        assert a.stat("c3/deeper").mode == 0o040755
        mtime = client.head_object(Bucket=bucket, Key="raw/train/c2/f002.bin")["LastModified"].timestamp()
        assert a.stat("c2/f002.bin").mtime_ns == int(mtime * 1e9)


def test_a_prefix_that_cannot_be_a_tree_is_refused_with_the_key(s3, tmp_path):
    bucket = s3.new_bucket()
    client = s3.client()
    client.put_object(Bucket=bucket, Key="raw/a", Body=b"an object")
    client.put_object(Bucket=bucket, Key="raw/a/b", Body=b"and a key beneath it")
    with pytest.raises(SourceError, match=rf"s3://{bucket}/raw/a is both an object and a folder"):
        blockfs.pack(f"s3://{bucket}/raw", tmp_path / "p")
    with pytest.raises(SourceError, match="holds no objects"):
        blockfs.pack(f"s3://{bucket}/nothing/", tmp_path / "p")
    assert not (tmp_path / "p").exists()  # refused before DEST was touched


def test_the_read_ahead_keeps_to_its_budget_and_fetches_each_object_once():
    entries = [SourceEntry(f"f{i:03d}".encode(), 0, 0o100644, 0, size=100 + i % 7) for i in range(300)]
    fetched: list[bytes] = []
    lock = threading.Lock()
    ahead: _ReadAhead | None = None
    peak = 0

    def fetch(entry: SourceEntry) -> bytes:
        nonlocal peak
        with lock:
            fetched.append(entry.path)
            peak = max(peak, ahead.held if ahead is not None else 0)
        return entry.path * entry.size

    def read(entry: SourceEntry) -> None:  # what RemotePrefixSource.read_into does
        future = ahead.take(entry)
        if future is None:
            data = fetch(entry)
        else:
            data = future.result()
            ahead.taken(entry)
        assert data == entry.path * entry.size

    ahead = _ReadAhead(fetch, entries, budget=1000, requests=4)
    try:
        read(entries[250])  # far past the budget's reach: read by the writer, and skipped by the read-ahead
        for entry in entries[:250] + entries[251:]:
            read(entry)
    finally:
        ahead.stop()
    assert sorted(fetched) == [e.path for e in entries]  # each once, by one side or the other
    assert 0 < peak <= 1000 and ahead.held == 0


def test_a_killed_pack_leaves_no_dataset_and_a_rerun_replaces_it(s3, tmp_path):
    big, small = tmp_path / "big", tmp_path / "small"
    for i in range(200):
        (big / f"c{i % 2}").mkdir(parents=True, exist_ok=True)
        (big / f"c{i % 2}" / f"{i:03d}").write_bytes(os.urandom(100))
    make_class_tree(small, files=20, seed=1, sizes=(10, 100))
    bucket = s3.new_bucket()
    url = f"s3://{bucket}/ds"
    blockfs.pack(big, url, files_per_block=10, fsync=False)  # a complete dataset of 20 blocks
    command = [sys.executable, "-m", "blockfs", "pack", str(big), url, "--files-per-block", "1", "--force",
               "--workers", "1"]  # fmt: skip
    proc = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        wait_until(lambda: "ds/blocks/00000030.blk" in s3.keys(bucket, "ds/blocks/"), timeout=60,
                   what="the second pack to upload its 31st block")  # fmt: skip
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)
    assert "ds/blockfs.json" not in s3.keys(bucket, "ds/")
    with pytest.raises(NotADatasetError, match="unfinished pack"):
        blockfs.open_dataset(url)
    blockfs.pack(small, url, files_per_block=10, fsync=False)  # the marker says ours: no --force needed
    keys = s3.keys(bucket, "ds/")
    assert [k for k in keys if k.startswith("ds/blocks/")] == ["ds/blocks/00000000.blk", "ds/blocks/00000001.blk"]
    with blockfs.open_dataset(url) as ds, blockfs.open_dataset(blockfs.pack(small, tmp_path / "l").dest) as local:
        assert snapshot(ds) == snapshot(local)


def test_refusals_lose_nothing(s3, tmp_path):
    src = tmp_path / "src"
    make_class_tree(src, files=10, seed=2, sizes=(10, 100))
    bucket = s3.new_bucket()
    s3.client().put_object(Bucket=bucket, Key="other/data.txt", Body=b"precious")
    with pytest.raises(PackError, match="not empty and holds no blockfs dataset"):
        blockfs.pack(src, f"s3://{bucket}/other", fsync=False)
    assert s3.keys(bucket, "other/") == ["other/data.txt"]
    blockfs.pack(src, f"s3://{bucket}/ds", fsync=False)
    with pytest.raises(PackError, match="--force"):
        blockfs.pack(src, f"s3://{bucket}/ds", fsync=False)
    blockfs.pack(src, f"s3://{bucket}/ds", fsync=False, force=True)
    with blockfs.open_dataset(f"s3://{bucket}/ds") as ds:
        assert len(ds.file_ids) == 10


def test_pack_output_and_errors_carry_no_secret(s3, tmp_path):
    src = tmp_path / "src"
    make_class_tree(src, files=5, seed=2, sizes=(10, 100))
    bucket = s3.new_bucket()
    done = run_cli("pack", str(src), f"s3://{bucket}/ds", "--no-fsync")
    assert done.returncode == 0 and f"s3://{bucket}/ds" in done.stdout, done.stderr
    secret = ("--storage-option", f"secret={SECRET}", "--storage-option", "key=AKIABLOCKFSTESTKEY01")
    missing = run_cli("pack", str(src), "s3://no-such-bucket-blockfs/ds", "--no-fsync", *secret)
    assert missing.returncode != 0 and "no-such-bucket-blockfs" in missing.stderr
    given = run_cli("pack", str(src), f"s3://{bucket}/x", "--no-fsync", *secret)  # moto takes any key
    assert given.returncode == 0, given.stderr
    for out in (done, missing, given):
        assert SECRET not in out.stdout + out.stderr
    http = run_cli("pack", str(src), "http://127.0.0.1:9/ds")
    assert http.returncode != 0 and "read-only" in http.stderr


def test_a_failed_upload_stops_the_pack_and_commits_nothing(s3, tmp_path, monkeypatch):
    import errno

    from blockfs.storage.remote import RemoteError, RemoteStore

    src = tmp_path / "src"
    make_class_tree(src, files=60, seed=4, sizes=(10, 100))
    bucket = s3.new_bucket()
    real_put = RemoteStore.put_file

    def put_file(self, name, path):
        if name == "blocks/00000003.blk":
            raise RemoteError(errno.EIO, f"{self.where(name)}: PUT failed: simulated")
        return real_put(self, name, path)

    monkeypatch.setattr(RemoteStore, "put_file", put_file)
    (tmp_path / "stage").mkdir()
    with pytest.raises(PackError, match="00000003.blk: PUT failed"):
        blockfs.pack(src, f"s3://{bucket}/ds", files_per_block=5, fsync=False, workers=1, staging=str(tmp_path / "stage"))
    keys = s3.keys(bucket, "ds/")
    assert "ds/blockfs.json" not in keys and "ds/.blockfs-packing" in keys
    assert os.listdir(tmp_path / "stage") == []  # the staging directory is gone
