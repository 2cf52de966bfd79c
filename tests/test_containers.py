"""Packing from containers: MXNet RecordIO, tar (plain, gzip, bzip2, xz) and WebDataset shards."""

from __future__ import annotations

import bz2
import filecmp
import gzip
import io
import json
import logging
import lzma
import os
import shutil
import struct
import subprocess
import tarfile

import numpy as np
import pytest
from fuzz.treesnap import tree_snapshot
from treeutil import make_edge_tree

import blockfs
from blockfs.cli import main
from blockfs.core.unpack import unpack
from blockfs.core.verify import verify
from blockfs.errors import FormatError, NotADatasetError, SourceError
from blockfs.packing.containers import RecordIOSource, TarSource, WebDatasetSource, open_source, read_record_labels

# --- a RecordIO writer, from the format's description (mxnet is not installable here) -------------------
MAGIC = 0xCED7230A
MAGIC_BYTES = struct.pack("<I", MAGIC)
JPEG, PNG = b"\xff\xd8\xff\xe0", b"\x89PNG\r\n\x1a\n"


def record_payload(label: float | list[float], rec_id: int, image: bytes, id2: int = 0) -> bytes:
    """IRHeader (flag, label, id, id2) + flag float32 labels when there are several + the image."""
    if isinstance(label, list):
        return struct.pack("<IfQQ", len(label), 0.0, rec_id, id2) + np.asarray(label, "<f4").tobytes() + image
    return struct.pack("<IfQQ", 0, label, rec_id, id2) + image


def encode_record(payload: bytes) -> bytes:
    """Cut the payload wherever the magic sits at a 4-aligned offset (dropping it); flag parts 1, 2, 3."""
    out, start = [], 0
    cuts = [i for i in range(0, len(payload) - len(payload) % 4, 4) if payload[i : i + 4] == MAGIC_BYTES]
    for i in cuts:
        out.append(struct.pack("<II", MAGIC, ((1 if start == 0 else 2) << 29) | (i - start)) + payload[start:i])
        start = i + 4
    rest = payload[start:]
    out.append(struct.pack("<II", MAGIC, ((3 if cuts else 0) << 29) | len(rest)) + rest + b"\0" * (-len(rest) % 4))
    return b"".join(out)


def write_recordio(path, payloads: list[bytes], with_idx: bool) -> list[int]:
    """Write the records (and ``.idx`` lines ``key<TAB>offset``); return each record's offset."""
    offsets, blob = [], bytearray()
    for p in payloads:
        offsets.append(len(blob))
        blob += encode_record(p)
    path.write_bytes(bytes(blob))
    if with_idx:
        path.with_suffix(".idx").write_text("".join(f"{k}\t{o}\n" for k, o in enumerate(offsets)))
    return offsets


def recordio_sample(rng: np.random.Generator):
    """(label(s), id, image, expected path) covering every case the reader must handle."""

    def image(head: bytes, n: int) -> bytes:
        return head + rng.bytes(n)

    # A magic at an aligned payload offset forces a multi-part record: header 24 bytes, so image
    # offsets 4k (flag 0) are aligned; two magics back to back make an empty middle part, one at
    # the very end an empty last part.
    split = image(JPEG, 96) + MAGIC_BYTES + rng.bytes(40) + MAGIC_BYTES + MAGIC_BYTES + rng.bytes(8) + MAGIC_BYTES
    multi_split = image(PNG, 4) + MAGIC_BYTES + rng.bytes(21)
    return [
        (0.0, 10, image(JPEG, 700), "0/10.jpg"),
        (1.0, 11, image(PNG, 300), "1/11.png"),
        (2.0, 12, rng.bytes(123), "2/12.bin"),
        (1.0, 13, split, "1/13.jpg"),
        ([3.0, 7.0, 9.5], 14, image(JPEG, 50), "3/14.jpg"),
        ([4.0, 1.0], 15, multi_split, "4/15.png"),
        (0.5, 16, image(JPEG, 10), "0.5/16.jpg"),
        (0.0, 10, image(JPEG, 33), "0/10_1.jpg"),  # a repeated id
        (1.0, 17, b"", "1/17.bin"),  # no image bytes at all
    ]


@pytest.mark.parametrize("with_idx", [True, False], ids=["idx", "scan"])
def test_recordio_round_trip(tmp_path, with_idx):
    sample = recordio_sample(np.random.default_rng(0))
    payloads = [record_payload(lab, i, img) for lab, i, img, _ in sample]
    assert sum(encode_record(p).count(MAGIC_BYTES) > 1 for p in payloads) == 2  # multi-part records exist
    write_recordio(tmp_path / "data.rec", payloads, with_idx)
    result = blockfs.pack(tmp_path / "data.rec", tmp_path / "p", block_size=1024)
    assert result.n_files == len(sample)
    with blockfs.open_dataset(tmp_path / "p") as ds:
        assert verify(ds) == []
        assert sorted(ds.listdir("")) == ["0", "0.5", "1", "2", "3", "4"]
        for label, _, img, path in sample:
            assert ds.read(path) == img, path
            first = label[0] if isinstance(label, list) else label
            assert ds.stat(path).label == (int(first) if first == int(first) else -1)
        full = read_record_labels(ds)
        assert full["3/14.jpg"] == [3.0, 7.0, 9.5] and full["4/15.png"] == [4.0, 1.0]
        assert full["0.5/16.jpg"] == [0.5] and full["2/12.bin"] == [2.0]
        assert ds.metadata["source"]["indexed"] is with_idx and ds.metadata["pack"]["labels"] == "source"
        assert set(json.loads((tmp_path / "p" / "labels.json").read_text())["labels"]) == {
            "3/14.jpg",
            "4/15.png",
            "0.5/16.jpg",
        }
    # Issue 23: the labels are the dataset's data too; blockfs.json names them by their digest.
    labels = tmp_path / "p" / "labels.json"
    labels.write_text(labels.read_text().replace("9.5", "9.25"))
    with blockfs.open_dataset(tmp_path / "p") as ds:
        with pytest.raises(FormatError, match="not the labels"):
            read_record_labels(ds)
    # Issue 29: a labels file that is a link (or a FIFO, which would block the read) is refused unread, and
    # blockfs.json may not name a file outside the dataset.
    labels.unlink()
    labels.symlink_to(tmp_path / "data.rec")
    with blockfs.open_dataset(tmp_path / "p") as ds:
        with pytest.raises(FormatError, match="not a regular file"):
            read_record_labels(ds)
        ds.metadata["source"]["labels_file"] = "../data.rec"
        with pytest.raises(FormatError, match="not a file of the dataset"):
            read_record_labels(ds)


def _recordio_file(tmp_path, n=6, with_idx=False):
    rng = np.random.default_rng(1)
    payloads = [record_payload(float(i % 2), i, JPEG + rng.bytes(200 + 8 * i)) for i in range(n)]
    offsets = write_recordio(tmp_path / "d.rec", payloads, with_idx)
    return tmp_path / "d.rec", offsets


def test_recordio_bad_magic_is_reported_and_skipped(tmp_path, caplog):
    rec, offsets = _recordio_file(tmp_path)
    with open(rec, "r+b") as f:
        f.seek(offsets[2])
        f.write(b"XXXX")
    with pytest.raises(SourceError, match=rf"byte offset {offsets[2]}: .*bad magic.*--skip-damaged"):
        blockfs.pack(rec, tmp_path / "p")
    assert not (tmp_path / "p").exists()
    with caplog.at_level(logging.WARNING):
        result = blockfs.pack(rec, tmp_path / "p", skip_damaged=True)
    assert result.n_files == 5 and len(result.skipped_damaged) == 1
    assert f"byte offset {offsets[2]}" in result.skipped_damaged[0]
    assert f"resumed at byte offset {offsets[3]}" in result.skipped_damaged[0]
    assert "skipped 1 damaged parts" in caplog.text
    with blockfs.open_dataset(tmp_path / "p") as ds:
        assert "2.jpg" not in ds.listdir("0") and "3.jpg" in ds.listdir("1") and verify(ds) == []


def test_recordio_truncated_file_and_bad_idx(tmp_path):
    rec, offsets = _recordio_file(tmp_path, with_idx=True)
    data = rec.read_bytes()
    rec.write_bytes(data[: offsets[5] + 20])  # the last record is cut
    with pytest.raises(SourceError, match=rf"byte offset {offsets[5]}: .*runs past the end of the file"):
        blockfs.pack(rec, tmp_path / "p")
    assert blockfs.pack(rec, tmp_path / "p", skip_damaged=True).n_files == 5
    (tmp_path / "d.idx").write_text("0\t0\nnonsense\n")
    with pytest.raises(SourceError, match="d.idx line 2: expected 'key<TAB>offset'"):
        blockfs.pack(rec, tmp_path / "q")
    (tmp_path / "d.idx").write_text(f"0\t0\n1\t{offsets[1] + 4}\n")
    with pytest.raises(SourceError, match=rf"byte offset {offsets[1] + 4}: .*bad magic.*key '1'"):
        blockfs.pack(rec, tmp_path / "q")


def test_recordio_bad_record_contents(tmp_path):
    """A record too short for its header, one claiming more labels than it holds, an orphan part."""
    good = record_payload(1.0, 1, JPEG + b"ok")
    short = encode_record(b"tiny")
    greedy = encode_record(struct.pack("<IfQQ", 1000, 0.0, 2, 0) + b"abcd")
    orphan = struct.pack("<II", MAGIC, (2 << 29) | 4) + b"mid!"
    blob = encode_record(good) + short + greedy + orphan + encode_record(good)
    (tmp_path / "b.rec").write_bytes(blob)
    starts = [0, len(encode_record(good)), len(encode_record(good)) + len(short)]
    with pytest.raises(SourceError, match=rf"byte offset {starts[1]}: a record of 4 bytes is too short"):
        blockfs.pack(tmp_path / "b.rec", tmp_path / "p")
    result = blockfs.pack(tmp_path / "b.rec", tmp_path / "p", skip_damaged=True)
    problems = "\n".join(result.skipped_damaged)
    assert "announces 1000 labels" in problems and "continuation flag 2 out of sequence" in problems
    assert result.n_files == 2  # the good record, twice (its repeated id gets "_1")
    with blockfs.open_dataset(tmp_path / "p") as ds:
        assert ds.listdir("1") == ["1.jpg", "1_1.jpg"] and ds.read("1/1_1.jpg") == JPEG + b"ok"


# --- tar ---------------------------------------------------------------------------------------------
COMPRESSIONS = {"": "", "gz": "z", "bz2": "j", "xz": "J"}
COMPRESSION_NAMES = {"": "none", "gz": "gzip", "bz2": "bzip2", "xz": "xz"}


def _gnu_tar(src, archive, compression: str, fmt: str) -> None:
    subprocess.run(
        [
            "tar",
            f"--format={fmt}",
            "-C",
            os.fsdecode(src),
            f"-c{COMPRESSIONS[compression]}f",
            os.fsdecode(archive),
            ".",
        ],
        check=True,
    )


@pytest.mark.parametrize("compression,fmt", [("", "pax"), ("gz", "gnu"), ("bz2", "pax"), ("xz", "gnu")])
def test_tar_unpacks_like_tar_x(tmp_path, compression, fmt):
    src = make_edge_tree(tmp_path / "src")
    long_dir = os.path.join(src, b"d" * 120)
    os.makedirs(long_dir)
    with open(os.path.join(long_dir, b"f" * 130), "wb") as f:  # names past ustar's 100/155 bytes
        f.write(b"long")
    os.utime(long_dir, ns=(1_500_000_000_000_000_001,) * 2)
    archive = tmp_path / f"a.tar{'.' + compression if compression else ''}"
    _gnu_tar(src, archive, compression, fmt)
    (tmp_path / "x").mkdir()
    subprocess.run(["tar", "-C", str(tmp_path / "x"), "-xf", str(archive)], check=True)

    result = blockfs.pack(archive, tmp_path / "p", block_size=4096)
    assert result.n_files == 12 and result.n_symlinks == 3
    with blockfs.open_dataset(tmp_path / "p") as ds:
        assert verify(ds) == []
        assert ds.metadata["source"]["compression"] == COMPRESSION_NAMES[compression]
        assert ds.stat("class_b/with space.txt").label == ds.classes.index("class_b")  # dirname labels
        unpack(ds, tmp_path / "out")
    assert tree_snapshot(tmp_path / "out") == tree_snapshot(tmp_path / "x")
    assert sorted(os.listdir(tmp_path)) == [archive.name, "out", "p", "src", "x"]  # no spool file left


def _tar_with(members: list[tuple[tarfile.TarInfo, bytes | None]], path, fmt=tarfile.PAX_FORMAT) -> None:
    with tarfile.open(path, "w", format=fmt) as tar:
        for info, data in members:
            tar.addfile(info, io.BytesIO(data) if data is not None else None)


def _info(name: str, data: bytes = b"", **kw) -> tuple[tarfile.TarInfo, bytes | None]:
    info = tarfile.TarInfo(name)
    info.size = len(data)
    info.mtime = 1_600_000_000
    for k, v in kw.items():
        setattr(info, k, v)
    return info, data or None


def test_tar_member_semantics(tmp_path, caplog):
    """What `tar x` does: later members win, ".." is refused, "/" dropped, parents made, hard links shared."""
    ns = _info("ns.txt", b"ns")
    ns[0].pax_headers = {"mtime": "1600000000.123456789"}
    _tar_with(
        [
            _info("a/b/c.txt", b"first"),
            _info("a/b/c.txt", b"second"),
            _info("../evil", b"x"),
            _info("/abs/file", b"abs", mode=0o4755),
            _info("a/hard", type=tarfile.LNKTYPE, linkname="a/b/c.txt"),
            _info("fifo", type=tarfile.FIFOTYPE),
            _info("weird", b"unknown type", type=b"Z"),
            ns,
        ],
        tmp_path / "t.tar",
    )
    result = blockfs.pack(tmp_path / "t.tar", tmp_path / "p")
    assert result.skipped_special == ["../evil", "fifo"]
    with blockfs.open_dataset(tmp_path / "p") as ds:
        assert ds.listdir("") == ["a", "abs", "ns.txt", "weird"]
        assert ds.read("a/b/c.txt") == b"second" and ds.read("a/hard") == b"second"
        assert ds.stat("a/hard").ino == ds.stat("a/b/c.txt").ino and ds.stat("a/hard").nlink == 2
        assert ds.stat("abs/file").mode == 0o104755 and ds.stat("a/b").kind_name == "dir"
        assert ds.stat("ns.txt").mtime_ns == 1_600_000_000_123_456_789
        assert ds.read("weird") == b"unknown type" and verify(ds) == []


@pytest.mark.parametrize("workers", [1, 2])
def test_sparse_members(tmp_path, workers):
    # With two workers, the four sparse members are read by two forked processes at the same time.
    (tmp_path / "src").mkdir()
    names = [f"sparse{i}" for i in range(4)]
    for i, name in enumerate(names):
        with open(tmp_path / "src" / name, "wb") as f:
            f.truncate(3 << 20)
            f.seek((1 << 20) + i)
            f.write(np.random.default_rng(i).bytes(100_000))
    subprocess.run(["tar", "--sparse", "-C", str(tmp_path / "src"), "-cf", str(tmp_path / "s.tar"), *names], check=True)
    blockfs.pack(tmp_path / "s.tar", tmp_path / "p", block_size=1 << 20, workers=workers, order="directory")
    with blockfs.open_dataset(tmp_path / "p") as ds:
        assert ds.n_blocks == 4
        for name in names:
            assert ds.read(name) == (tmp_path / "src" / name).read_bytes()


def _member_bytes(i: int) -> bytes:
    return np.random.default_rng(i).bytes(700 + i)


def _plain_tar(tmp_path, n=5) -> tuple[str, list[tarfile.TarInfo]]:
    members = [_info(f"dir/f{i}.bin", _member_bytes(i)) for i in range(n)]
    path = tmp_path / "d.tar"
    _tar_with(members, path, fmt=tarfile.USTAR_FORMAT)
    with tarfile.open(path) as tar:
        return str(path), tar.getmembers()


def test_tar_bad_header_is_reported_and_stepped_over(tmp_path):
    path, members = _plain_tar(tmp_path)
    with open(path, "r+b") as f:
        f.seek(members[2].offset + 148)  # the checksum field
        f.write(b"9999999\0")
    with pytest.raises(SourceError, match=rf"d.tar: byte offset {members[2].offset}: not a tar header"):
        blockfs.pack(path, tmp_path / "p")
    result = blockfs.pack(path, tmp_path / "p", skip_damaged=True)
    assert result.n_files == 4
    assert f"resumed at byte offset {members[3].offset}" in result.skipped_damaged[0]
    with blockfs.open_dataset(tmp_path / "p") as ds:
        assert ds.listdir("dir") == ["f0.bin", "f1.bin", "f3.bin", "f4.bin"] and verify(ds) == []
        assert ds.metadata["source"]["skipped_damaged"] == result.skipped_damaged


@pytest.mark.parametrize("compression", ["", "gz", "bz2", "xz"])
def test_truncated_tar(tmp_path, compression):
    path, members = _plain_tar(tmp_path)
    data = open(path, "rb").read()
    if compression:  # the compressed stream is cut: what decompressed before the cut is kept
        compress = {"gz": gzip.compress, "bz2": bz2.compress, "xz": lzma.compress}[compression]
        cut = compress(data)
        cut = cut[: len(cut) * 3 // 4]
        expected = f"{COMPRESSION_NAMES[compression]} stream damaged"
    else:  # cut inside the last member's data
        cut = data[: members[4].offset_data + 100]
        expected = "past the end of the archive"
    name = tmp_path / f"cut.tar{'.' + compression if compression else ''}"
    name.write_bytes(cut)
    with pytest.raises(SourceError, match=rf"cut.tar.*: byte offset \d+: .*{expected}"):
        blockfs.pack(name, tmp_path / "p")
    result = blockfs.pack(name, tmp_path / "p", skip_damaged=True)
    assert expected in result.skipped_damaged[0]
    # plain: the cut member goes; compressed: whatever decompressed whole before the cut stays
    assert result.n_files == 4 if not compression else result.n_files < 5
    with blockfs.open_dataset(tmp_path / "p") as ds:
        for e in ds.file_ids:
            i = int(ds.path_of(int(e))[-5:-4])
            assert ds.read_entry(int(e)) == _member_bytes(i)


def _children() -> set[int]:
    with open(f"/proc/self/task/{os.getpid()}/children") as f:
        return {int(p) for p in f.read().split()}


def test_an_error_while_decompressing_stops_the_decompressing_process(tmp_path):
    """The headers of a compressed tar are listed while a child process decompresses it: an error found
    early fails the pack at once, and the child is stopped and reaped, not left running."""
    members = [_info("a", b"x"), _info("a/b", b"y")]  # "a/b" under a file: refused when listed
    members += [_info(f"big{i}.bin", np.random.default_rng(i).bytes(4 << 20)) for i in range(4)]
    path = tmp_path / "d.tar"
    _tar_with(members, path, fmt=tarfile.USTAR_FORMAT)
    (tmp_path / "d.tar.gz").write_bytes(gzip.compress(path.read_bytes(), compresslevel=1))
    before = _children()
    with pytest.raises(SourceError, match=r"d.tar.gz: 'a/b' lies under 'a', which is not a directory"):
        blockfs.pack(tmp_path / "d.tar.gz", tmp_path / "p")
    assert _children() == before


def test_a_dead_decompressing_process_is_a_clear_error(tmp_path, monkeypatch):
    from blockfs.packing.containers import spool

    path, _ = _plain_tar(tmp_path)
    (tmp_path / "d.tar.gz").write_bytes(gzip.compress(open(path, "rb").read()))
    monkeypatch.setattr(spool, "_decompress_into", lambda *args: os.kill(os.getpid(), 9))  # runs in the child
    with pytest.raises(SourceError, match=r"the process decompressing .*d.tar.gz' died \(wait status 9\)"):
        blockfs.pack(tmp_path / "d.tar.gz", tmp_path / "p")
    with pytest.raises(NotADatasetError):
        blockfs.open_dataset(tmp_path / "p")


def test_failed_pack_of_a_container_leaves_no_dataset(tmp_path, monkeypatch):
    path, _ = _plain_tar(tmp_path)
    blockfs.pack(path, tmp_path / "p")

    def broken(self, entry, buf, offset=0):
        raise RuntimeError("disk on fire")

    monkeypatch.setattr(TarSource, "read_into", broken)
    with pytest.raises(RuntimeError):
        blockfs.pack(path, tmp_path / "p", force=True)
    with pytest.raises(NotADatasetError):
        blockfs.open_dataset(tmp_path / "p")


def test_not_a_container(tmp_path):
    (tmp_path / "junk").write_bytes(b"hello world, this is not an archive" * 20)
    with pytest.raises(SourceError, match="is not a directory, a tar archive"):
        blockfs.pack(tmp_path / "junk", tmp_path / "p")
    (tmp_path / "z.tar.zst").write_bytes(b"\x28\xb5\x2f\xfd" + b"\0" * 600)
    with pytest.raises(SourceError, match="zstd"):
        blockfs.pack(tmp_path / "z.tar.zst", tmp_path / "p")
    (tmp_path / "g.gz").write_bytes(gzip.compress(b"not a tar" * 100))
    with pytest.raises(SourceError, match="holds no tar archive"):
        blockfs.pack(tmp_path / "g.gz", tmp_path / "p")


def test_sniffing_goes_by_bytes_not_names(tmp_path):
    rec, _ = _recordio_file(tmp_path)
    shutil.copy(rec, tmp_path / "really_recordio.tar")
    path, _ = _plain_tar(tmp_path)
    shutil.copy(path, tmp_path / "really_tar.rec")
    assert isinstance(open_source(str(tmp_path / "really_recordio.tar")), RecordIOSource)
    assert isinstance(open_source(str(tmp_path / "really_tar.rec")), TarSource)


def test_same_source_and_seed_give_identical_packs(tmp_path):
    src = make_edge_tree(tmp_path / "src")
    _gnu_tar(src, tmp_path / "a.tar.gz", "gz", "pax")
    rec, _ = _recordio_file(tmp_path, n=40)
    for source in (tmp_path / "a.tar.gz", rec):
        for name, workers in (("one", 1), ("two", 2)):
            blockfs.pack(source, tmp_path / f"{source.name}-{name}", block_size=2048, workers=workers)
        cmp = filecmp.dircmp(tmp_path / f"{source.name}-one", tmp_path / f"{source.name}-two")
        assert not cmp.diff_files and not cmp.left_only and not cmp.right_only
        assert not cmp.subdirs["blocks"].diff_files


# --- WebDataset ----------------------------------------------------------------------------------------
def _shards(tmp_path, n_shards=3, per_shard=4):
    """Shards of samples ``<key>.jpg`` + ``.json`` (+ ``.cls`` for most); the last shard gzip-compressed."""
    rng = np.random.default_rng(2)
    expected: dict[str, tuple[bytes, int]] = {}
    paths = []
    for s in range(n_shards):
        members = []
        for i in range(per_shard):
            key = f"train/{s}/sample{i:03d}" if i % 2 else f"sample_{s}_{i}"
            label = -1 if i == 3 else (s + i) % 5
            files = {"jpg": JPEG + rng.bytes(300), "json": json.dumps({"i": i}).encode()}
            if label >= 0:
                files["cls"] = f"{label}\n".encode()
            for ext, data in files.items():
                members.append(_info(f"{key}.{ext}", data, mode=0o644))
                expected[f"{key}.{ext}"] = (data, label)
        path = tmp_path / f"shard-{s:03d}.tar"
        _tar_with(members, path)
        if s == n_shards - 1:
            with open(path, "rb") as f, gzip.open(f"{path}.gz", "wb") as g:
                g.write(f.read())
            path.unlink()
            path = tmp_path / f"shard-{s:03d}.tar.gz"
        paths.append(str(path))
    return paths, expected


@pytest.mark.parametrize("how", ["list", "glob", "braces", "cli"])
def test_webdataset_round_trip(tmp_path, how):
    paths, expected = _shards(tmp_path)
    dest = tmp_path / "p"
    if how == "cli":
        assert main(["pack", *paths, str(dest), "--block-size", "2KiB"]) == 0
    else:
        spec = {"list": paths, "glob": str(tmp_path / "shard-*"), "braces": str(tmp_path / "shard-{000..001}.tar")}[how]
        if how == "braces":
            expected = {k: v for k, v in expected.items() if "_2_" not in k and "/2/" not in k}
        assert isinstance(open_source(spec), WebDatasetSource)
        blockfs.pack(spec, dest, block_size=2048)
    with blockfs.open_dataset(dest) as ds:
        assert verify(ds) == []
        files = {os.fsdecode(ds.path_of(int(e))) for e in ds.file_ids}
        assert files == set(expected)
        for path, (data, label) in expected.items():
            assert ds.read(path) == data and ds.stat(path).label == label, path
        assert ds.stat("train/1").kind_name == "dir"
        assert ds.metadata["source"]["kind"] == "webdataset" and ds.metadata["pack"]["labels"] == "source"


def test_webdataset_errors(tmp_path, capsys):
    paths, _ = _shards(tmp_path, n_shards=2)
    shutil.copy(paths[0], tmp_path / "dup.tar")
    with pytest.raises(SourceError, match="is in more than one shard.*unique across shards"):
        blockfs.pack([paths[0], str(tmp_path / "dup.tar")], tmp_path / "p")
    with pytest.raises(SourceError, match="matches no files"):
        blockfs.pack(str(tmp_path / "nothing-*.tar"), tmp_path / "p")
    with tarfile.open(paths[0]) as tar:
        cut = tar.getmembers()[5].offset_data + 10  # inside a member's data
    (tmp_path / "cut.tar").write_bytes(open(paths[0], "rb").read()[:cut])
    capsys.readouterr()
    assert main(["pack", paths[1], str(tmp_path / "cut.tar"), str(tmp_path / "p")]) == 2
    err = capsys.readouterr().err
    assert "cut.tar: byte offset" in err and "--skip-damaged" in err
    assert main(["pack", paths[1], str(tmp_path / "cut.tar"), str(tmp_path / "p"), "--skip-damaged"]) == 0
