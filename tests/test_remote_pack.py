"""``blockfs pack`` to and from an S3-compatible store (moto on loopback): the objects are a local pack's
files, a prefix of objects packs as the tree it describes, a killed pack leaves nothing that opens, the
refusals lose nothing, and no credential reaches any output."""

from __future__ import annotations

import errno
import json
import os
import signal
import subprocess
import sys
import threading

import numpy as np
import pytest
from fuzz.treesnap import tree_snapshot
from polling import wait_until
from s3server import SECRET
from test_containers import record_payload, recordio_sample, write_recordio
from treeutil import make_class_tree

import blockfs
from blockfs.core import format as fmt
from blockfs.core.unpack import unpack
from blockfs.errors import NotADatasetError, PackError, SourceError
from blockfs.packing.remote_destination import UPLOADS, WAITING
from blockfs.packing.remote_source import _ReadAhead
from blockfs.packing.sources import SourceEntry
from blockfs.storage.remote import RemoteError, RemoteStore


def run_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "blockfs", *args], capture_output=True, text=True, timeout=120, check=False
    )


def download(s3, bucket: str, prefix: str, to) -> dict[str, bytes]:
    """Every object under ``prefix/``, written below ``to`` by its relative name; their bytes by name."""
    client, found = s3.client(), {}
    for key in s3.keys(bucket, prefix + "/"):
        rel = key[len(prefix) + 1 :]
        os.makedirs(os.path.dirname(os.path.join(to, rel)) or to, exist_ok=True)
        client.download_file(bucket, key, os.path.join(to, rel))
        with open(os.path.join(to, rel), "rb") as f:
            found[rel] = f.read()
    return found


def local_files(root) -> dict[str, bytes]:
    out = {}
    for dirpath, _dirs, files in os.walk(root):
        for name in files:
            with open(os.path.join(dirpath, name), "rb") as f:
                out[os.path.relpath(os.path.join(dirpath, name), root)] = f.read()
    return out


def snapshot(ds) -> dict[str, tuple]:
    """Every entry: kind, mode, size, mtime, label, and a file's bytes or a link's target."""
    out = {}
    for e in range(ds.index.n_entries):
        st = ds.stat_entry(e)
        path = os.fsdecode(ds.path_of(e))
        body = (
            ds.read_entry(e)
            if st.kind_name == "file"
            else (ds.index.link_target(e) if st.kind_name == "symlink" else b"")
        )
        out[path] = (st.kind, st.mode, st.size, st.mtime_ns, st.label, st.nlink, body)
    return out


def files_and_labels(ds) -> dict[str, tuple[bytes, int]]:
    return {os.fsdecode(ds.path_of(e)): (ds.read_entry(e), int(ds.labels[e])) for e in ds.file_ids}


def test_a_pack_to_s3_is_a_local_pack_object_for_object(s3, tmp_path, edge_tree):
    bucket = s3.new_bucket()
    staging = tmp_path / "staging"
    result = blockfs.pack(edge_tree, f"s3://{bucket}/ds", block_size=4096, staging=str(staging))
    assert result.dest == f"s3://{bucket}/ds" and result.n_blocks >= 2
    assert os.listdir(staging) == []  # the staging directory is gone, blocks and all
    uploaded = download(s3, bucket, "ds", tmp_path / "copy")
    blockfs.pack(edge_tree, tmp_path / "local", block_size=4096)
    assert uploaded == local_files(tmp_path / "local")  # same names, same bytes; no marker
    with blockfs.open_dataset(tmp_path / "copy") as ds:
        unpack(ds, tmp_path / "out")
    assert tree_snapshot(tmp_path / "out") == tree_snapshot(edge_tree)
    with blockfs.open_dataset(f"s3://{bucket}/ds") as remote, blockfs.open_dataset(tmp_path / "local") as local:
        assert snapshot(remote) == snapshot(local)  # and read in place, through ranged GETs


def test_side_files_are_uploaded_before_the_commit(s3, tmp_path):
    sample = recordio_sample(np.random.default_rng(0))
    write_recordio(tmp_path / "data.rec", [record_payload(lab, i, img) for lab, i, img, _ in sample], True)
    bucket = s3.new_bucket()
    blockfs.pack(tmp_path / "data.rec", f"s3://{bucket}/rec", block_size=1024, fsync=False)
    blockfs.pack(tmp_path / "data.rec", tmp_path / "local", block_size=1024, fsync=False)
    assert download(s3, bucket, "rec", tmp_path / "copy") == local_files(tmp_path / "local")
    assert "labels.json" in local_files(tmp_path / "local")


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


def test_a_failed_upload_stops_the_pack_and_leaves_no_dataset(s3, tmp_path, monkeypatch):
    src = tmp_path / "src"
    make_class_tree(src, files=30, seed=4, sizes=(10, 100))
    bucket = s3.new_bucket()
    real = RemoteStore.put_file

    def failing(self, name, path):
        if name == fmt.block_path("", 2):
            raise RemoteError(errno.EIO, f"{self.where(name)}: PUT failed: the network is on fire")
        return real(self, name, path)

    monkeypatch.setattr(RemoteStore, "put_file", failing)
    with pytest.raises(PackError, match=f"cannot pack to s3://{bucket}/ds: s3://{bucket}/ds/blocks/00000002.blk: PUT"):
        blockfs.pack(src, f"s3://{bucket}/ds", files_per_block=3, staging=str(tmp_path / "staging"))
    keys = s3.keys(bucket, "ds/")
    assert "ds/.blockfs-packing" in keys and "ds/blockfs.json" not in keys and "ds/index.bfi" not in keys
    assert os.listdir(tmp_path / "staging") == []
    with pytest.raises(NotADatasetError, match="unfinished pack"):
        blockfs.open_dataset(f"s3://{bucket}/ds")


def test_the_staging_directory_holds_a_few_blocks_at_a_time(s3, tmp_path, monkeypatch):
    src = tmp_path / "src"
    make_class_tree(src, files=60, seed=5, sizes=(10, 100))
    bucket = s3.new_bucket()
    real, staged = RemoteStore.put_file, []

    def counting(self, name, path):
        blocks = os.path.join(os.path.dirname(path), "") if name.startswith("blocks/") else None
        if blocks is not None:
            staged.append(len(os.listdir(blocks)))
        return real(self, name, path)

    monkeypatch.setattr(RemoteStore, "put_file", counting)
    blockfs.pack(src, f"s3://{bucket}/ds", files_per_block=1, workers=2, staging=str(tmp_path / "staging"))
    # Waiting or uploading, plus two blocks per writer in flight (each may be a .tmp and its rename).
    assert len(staged) == 60 and max(staged) <= UPLOADS + WAITING + 2 * 2 * 2


def _slow_tree(root, files: int) -> None:
    """``files`` small files: one block each, so a pack takes many PUTs and can be caught halfway."""
    for i in range(files):
        (root / f"c{i % 2}").mkdir(parents=True, exist_ok=True)
        (root / f"c{i % 2}" / f"{i:03d}.bin").write_bytes(os.urandom(64))


def _kill_once(command: list[str], uploaded, what: str) -> None:
    proc = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        wait_until(lambda: uploaded() or proc.poll() is not None, what, timeout=60)
        assert proc.poll() is None, f"the pack finished before it could be killed: {proc.stderr.read()!r}"
        proc.send_signal(signal.SIGKILL)
    finally:
        proc.wait(30)
        proc.stderr.close()


def test_a_killed_pack_leaves_nothing_that_opens_and_a_rerun_replaces_it(s3, tmp_path):
    big, small = tmp_path / "big", tmp_path / "small"
    _slow_tree(big, 150)
    make_class_tree(small, files=12, seed=1, sizes=(10, 100))
    bucket = s3.new_bucket()
    client = s3.client()
    staging = tmp_path / "staging"  # a killed pack cannot remove its staging directory: keep it in tmp_path
    pack = [
        sys.executable,
        "-m",
        "blockfs",
        "pack",
        str(big),
        "--files-per-block",
        "1",
        "--workers",
        "1",
        "--staging",
        str(staging),
    ]

    # A pack into a new prefix, killed once its first block is up.
    _kill_once([*pack, f"s3://{bucket}/fresh"], lambda: s3.keys(bucket, "fresh/blocks/"), "a first block")
    assert "fresh/blockfs.json" not in s3.keys(bucket, "fresh/")
    assert len(os.listdir(staging)) == 1  # what a SIGKILL leaves: one staging directory, a few blocks at most
    with pytest.raises(NotADatasetError, match="unfinished pack"):
        blockfs.open_dataset(f"s3://{bucket}/fresh")

    # A complete dataset, then a --force pack over it killed once a new block has replaced an old one.
    url = f"s3://{bucket}/ds"
    blockfs.pack(small, url, files_per_block=1, seed=7)

    def first() -> str:
        return client.head_object(Bucket=bucket, Key="ds/blocks/00000000.blk")["ETag"]

    old = first()
    assert len(s3.keys(bucket, "ds/blocks/")) == 12
    _kill_once([*pack, url, "--force"], lambda: first() != old, "the first block to be replaced")
    assert "ds/blockfs.json" not in s3.keys(bucket, "ds/")
    with pytest.raises(NotADatasetError, match="unfinished pack"):
        blockfs.open_dataset(url)

    # The rerun needs no --force (the marker says the pack is ours), and leaves only its own blocks.
    blockfs.pack(small, url, files_per_block=5)
    keys = s3.keys(bucket, "ds/")
    assert keys == [
        "ds/blockfs.json",
        "ds/blocks/00000000.blk",
        "ds/blocks/00000001.blk",
        "ds/blocks/00000002.blk",
        "ds/index.bfi",
    ]
    with blockfs.open_dataset(url) as ds:
        files = {path: data for path, (data, _label) in files_and_labels(ds).items()}
    assert files == local_files(small)


def test_refusals_lose_nothing(s3, tmp_path):
    src = tmp_path / "src"
    make_class_tree(src, files=6, seed=2, sizes=(10, 100))
    bucket = s3.new_bucket()
    client = s3.client()
    client.put_object(Bucket=bucket, Key="other/data.txt", Body=b"precious")
    for force in (False, True):
        with pytest.raises(PackError, match="not empty and holds no blockfs dataset"):
            blockfs.pack(src, f"s3://{bucket}/other", force=force)
    assert s3.keys(bucket, "other/") == ["other/data.txt"]

    blockfs.pack(src, f"s3://{bucket}/ds")
    before = {k: client.head_object(Bucket=bucket, Key=k)["ETag"] for k in s3.keys(bucket, "ds/")}
    with pytest.raises(PackError, match="already holds a packed dataset: pass --force"):
        blockfs.pack(src, f"s3://{bucket}/ds", seed=1)
    assert {k: client.head_object(Bucket=bucket, Key=k)["ETag"] for k in s3.keys(bucket, "ds/")} == before
    blockfs.pack(src, f"s3://{bucket}/ds", force=True, seed=1)
    with blockfs.open_dataset(f"s3://{bucket}/ds") as ds:
        assert ds.metadata["pack"]["seed"] == 1 and len(ds.file_ids) == 6

    upload_tree(s3, bucket, "raw/", src)
    with pytest.raises(PackError, match="inside the source"):
        blockfs.pack(f"s3://{bucket}/raw/", f"s3://{bucket}/raw/packed")
    with pytest.raises(PackError, match="read-only"):
        blockfs.pack(src, "https://example.invalid/ds")  # refused before any request
    assert not any(k.startswith("raw/packed") for k in s3.keys(bucket))


def test_no_secret_in_any_output_even_on_errors(s3, tmp_path):
    src = tmp_path / "src"
    make_class_tree(src, files=4, seed=2, sizes=(10, 100))
    bucket = s3.new_bucket()
    given = ("--storage-option", f"secret={SECRET}", "--storage-option", "key=AKIABLOCKFSTESTKEY01")
    runs = {
        "pack": run_cli("pack", str(src), f"s3://{bucket}/ds", *given),
        "pack from": run_cli("pack", f"s3://{bucket}/ds/", str(tmp_path / "back"), *given),
        "no bucket": run_cli("-v", "pack", str(src), "s3://no-such-bucket-blockfs/ds", *given),
        "no source": run_cli("-v", "pack", "s3://no-such-bucket-blockfs/raw/", str(tmp_path / "p"), *given),
        "http": run_cli("pack", str(src), "http://127.0.0.1:9/ds"),
    }
    assert runs["pack"].returncode == 0, runs["pack"].stderr
    assert f"1 block at s3://{bucket}/ds in" in runs["pack"].stdout
    assert runs["pack from"].returncode == 0, runs["pack from"].stderr  # a dataset's own objects, as files
    for name in ("no bucket", "no source"):
        assert runs[name].returncode == 2 and "s3://no-such-bucket-blockfs/" in runs[name].stderr, name
    assert runs["http"].returncode == 2 and "read-only" in runs["http"].stderr
    for name, run in runs.items():
        assert SECRET not in run.stdout + run.stderr, name
    assert json.loads(s3.client().get_object(Bucket=bucket, Key="ds/blockfs.json")["Body"].read())["n_files"] == 4


def test_a_key_ending_in_a_slash_that_holds_bytes_is_named_plainly(s3, tmp_path):
    bucket = s3.new_bucket()
    s3.client().put_object(Bucket=bucket, Key="raw/a/", Body=b"xyz")
    s3.client().put_object(Bucket=bucket, Key="raw/b.txt", Body=b"hello")
    with pytest.raises(PackError) as raised:
        blockfs.pack(f"s3://{bucket}/raw", tmp_path / "out", fsync=False)
    text = str(raised.value)
    assert "raw/a/ is a key ending in '/' that holds 3 bytes" in text and "--skip-unreadable" in text, text
    assert "permissions" not in text and "\n" not in text
    result = blockfs.pack(f"s3://{bucket}/raw", tmp_path / "out", fsync=False, skip_unreadable=True)
    assert result.skipped_unreadable == ["a"] and result.n_files == 1


def test_a_name_longer_than_name_max_is_refused_or_listed_and_skipped(s3, tmp_path):
    bucket = s3.new_bucket()
    long = "n" * 256
    s3.client().put_object(Bucket=bucket, Key=f"raw/{long}", Body=b"long")
    s3.client().put_object(Bucket=bucket, Key=f"raw/d{long}/under.txt", Body=b"beneath")
    s3.client().put_object(Bucket=bucket, Key="raw/ok.txt", Body=b"ok")
    with pytest.raises(PackError) as raised:
        blockfs.pack(f"s3://{bucket}/raw", tmp_path / "out", fsync=False)
    assert "bytes, over the 255" in str(raised.value) and "--skip-unreadable" in str(raised.value)
    assert not (tmp_path / "out").exists()
    result = blockfs.pack(f"s3://{bucket}/raw", tmp_path / "out", fsync=False, skip_unreadable=True)
    assert sorted(result.skipped_unreadable) == sorted([long, f"d{long}", f"d{long}/under.txt"])
    assert result.n_files == 1
    with blockfs.open_dataset(tmp_path / "out") as ds:
        unpack(ds, tmp_path / "back")
    assert os.listdir(tmp_path / "back") == ["ok.txt"]


def test_a_tar_member_name_longer_than_name_max_is_refused(tmp_path):
    import io
    import tarfile

    with tarfile.open(tmp_path / "src.tar", "w", format=tarfile.PAX_FORMAT) as tar:
        for name, data in ((f"d/{'m' * 300}.bin", b"long"), ("d/ok.bin", b"ok")):
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    with pytest.raises(PackError, match="304 bytes, over the 255"):
        blockfs.pack(tmp_path / "src.tar", tmp_path / "out", fsync=False)
    result = blockfs.pack(tmp_path / "src.tar", tmp_path / "out", fsync=False, skip_unreadable=True)
    assert result.n_files == 1 and len(result.skipped_unreadable) == 1
