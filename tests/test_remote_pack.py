"""``blockfs pack`` to and from an S3-compatible store (moto on loopback): the same dataset as a local pack,
crash-safe commits, refusals that lose nothing, and no credential in any output."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest

import blockfs
from blockfs.errors import NotADatasetError, PackError
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


def test_a_pack_from_a_prefix_of_objects_is_the_pack_of_the_tree(s3, tmp_path):
    src = tmp_path / "src"
    make_class_tree(src, files=90, seed=3, sizes=(10, 3000))
    bucket = s3.new_bucket()
    client = s3.client()
    client.put_object(Bucket=bucket, Key="raw/train/", Body=b"")  # a folder placeholder is a directory
    for dirpath, _dirs, files in os.walk(src):
        for name in files:
            path = os.path.join(dirpath, name)
            client.upload_file(path, bucket, "raw/train/" + os.path.relpath(path, src))
    client.put_object(Bucket=bucket, Key="raw/trainer/other.bin", Body=b"not under the prefix")
    blockfs.pack(f"s3://{bucket}/raw/train/", tmp_path / "from-s3", files_per_block=20, fsync=False)
    blockfs.pack(src, tmp_path / "from-disk", files_per_block=20, fsync=False)
    with blockfs.open_dataset(tmp_path / "from-s3") as a, blockfs.open_dataset(tmp_path / "from-disk") as b:
        assert a.classes == b.classes and a.classes
        files = {os.fsdecode(a.path_of(e)): (a.read_entry(e), int(a.labels[e])) for e in a.file_ids}
        expected = {os.fsdecode(b.path_of(e)): (b.read_entry(e), int(b.labels[e])) for e in b.file_ids}
    assert files == expected


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
