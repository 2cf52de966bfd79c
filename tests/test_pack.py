"""pack + unpack: fidelity, determinism, labels, order, crash safety and refusals."""

from __future__ import annotations

import errno
import filecmp
import json
import logging
import os
import re
import shutil
import signal
import subprocess
import sys
import threading

import numpy as np
import pytest

import blockfs
import blockfs.packing.packer  # noqa: F401  (the package's `pack` attribute is the function)
from blockfs.core import format as fmt
from blockfs.core.index import KIND_DIR, KIND_FILE
from blockfs.core.unpack import unpack
from blockfs.core.verify import summary, verify
from blockfs.errors import CorruptBlockError, NotADatasetError, PackError, SourceError, UnsupportedVersionError
from blockfs.packing import writer as writer_module
from blockfs.packing.destination import LocalDestination
from blockfs.packing.plan import plan_blocks
from blockfs.packing.sources import DirectorySource, Source, SourceEntry

pack_module = sys.modules["blockfs.packing.packer"]

from capability import has_fuse, require
from fuzz.treesnap import tree_snapshot
from mountutil import mounted
from polling import wait_until
from treeutil import make_edge_tree


def _imagefolder_tree(root, classes=("cat", "dog", "eel"), per_class=30, size=500):
    rng = np.random.default_rng(1)
    for c in classes:
        os.makedirs(root / c, exist_ok=True)
        for i in range(per_class):
            (root / c / f"{c}_{i:03d}.jpg").write_bytes(rng.bytes(size))
    return root


def test_edge_tree_round_trips_exactly(tmp_path, caplog):
    src = make_edge_tree(tmp_path / "src", special=True)
    with caplog.at_level(logging.WARNING):
        result = blockfs.pack(src, tmp_path / "packed", block_size=4096)
    assert sorted(result.skipped_special) == ["a_fifo", "a_socket"]
    assert "skipped 2 sockets, FIFOs or device files" in caplog.text
    with blockfs.open_dataset(tmp_path / "packed") as ds:
        assert verify(ds) == []
        unpack(ds, tmp_path / "out")
    os.unlink(os.path.join(src, b"a_fifo"))
    os.unlink(os.path.join(src, b"a_socket"))
    assert tree_snapshot(tmp_path / "out") == tree_snapshot(src)


def test_dataset_api_on_edge_tree(tmp_path, edge_tree):
    blockfs.pack(edge_tree, tmp_path / "packed")
    ds = blockfs.open_dataset(tmp_path / "packed")
    assert ds.listdir("") == sorted(os.listdir(os.fsdecode(edge_tree)))
    assert ds.listdir(b"/class_b") == sorted(os.listdir(edge_tree + b"/class_b"))
    assert ds.read(b"class_b/\xff\xfe not utf8.bin") == b"bytes\x00\xff"
    assert ds.read("class_a/big.bin", 250, 10) == (bytes(range(256)) * 700)[250:260]
    assert ds.read("class_a/one.txt", 100) == b""
    assert ds.readlink("class_a/link_rel") == "one.txt"
    st = ds.stat("class_b/-leading-dash")
    assert st.mode & 0o7777 == 0o600 and st.size == 4
    assert ds.stat("class_a/one.txt").ino == ds.stat("class_c/hardlink_to_one").ino
    assert ds.stat("class_a/one.txt").nlink == 2
    with pytest.raises(FileNotFoundError):
        ds.stat("nope")
    with pytest.raises(IsADirectoryError):
        ds.read("class_a")
    with pytest.raises(NotADirectoryError):
        ds.listdir("class_a/one.txt")
    ds.close()


def test_same_seed_gives_byte_identical_output(tmp_path):
    src = _imagefolder_tree(tmp_path / "src")
    for name in ("a", "b"):
        blockfs.pack(src, tmp_path / name, block_size=5000, workers=2 if name == "a" else 1)
    cmp = filecmp.dircmp(tmp_path / "a", tmp_path / "b")
    assert not cmp.diff_files and not cmp.left_only and not cmp.right_only
    blocks = os.listdir(tmp_path / "a" / "blocks")
    assert len(blocks) > 5
    _, mismatch, errors = filecmp.cmpfiles(tmp_path / "a/blocks", tmp_path / "b/blocks", blocks, shallow=False)
    assert mismatch == [] and errors == []
    blockfs.pack(src, tmp_path / "c", block_size=5000, seed=1)
    assert (tmp_path / "a/blocks" / blocks[0]).read_bytes() != (tmp_path / "c/blocks" / blocks[0]).read_bytes()


def imagefolder_labels(root) -> dict[str, int]:
    """torchvision.datasets.ImageFolder's rule, written out (torchvision is not installable here)."""
    classes = sorted(e.name for e in os.scandir(root) if e.is_dir())
    index = {c: i for i, c in enumerate(classes)}
    out = {}
    for c in classes:
        for dirpath, _, files in os.walk(os.path.join(root, c)):
            for f in files:
                out[os.path.relpath(os.path.join(dirpath, f), root)] = index[c]
    return out


def test_dirname_labels_match_imagefolder(tmp_path):
    src = _imagefolder_tree(tmp_path / "src", classes=("zebra", "Apple", "mango", "_under"), per_class=5)
    (src / "mango" / "sub").mkdir()
    (src / "mango" / "sub" / "x.jpg").write_bytes(b"x")
    blockfs.pack(src, tmp_path / "p")
    ds = blockfs.open_dataset(tmp_path / "p")
    expected = imagefolder_labels(src)
    assert {p: ds.stat(p).label for p in expected} == expected
    assert ds.classes == sorted(["zebra", "Apple", "mango", "_under"])
    # labels are in the block headers too
    for path, label in expected.items():
        st = ds.stat(path)
        head = ds.store.header(st.block)
        assert head.labels[ds.index.arrays["slot"][st.entry]] == label


def test_csv_labels_by_number_and_by_name(tmp_path):
    src = _imagefolder_tree(tmp_path / "src", per_class=2)
    (tmp_path / "n.csv").write_text("path,label\ncat/cat_000.jpg,7\ndog/dog_001.jpg,3\n")
    blockfs.pack(src, tmp_path / "p1", labels=str(tmp_path / "n.csv"))
    ds = blockfs.open_dataset(tmp_path / "p1")
    assert ds.stat("cat/cat_000.jpg").label == 7 and ds.stat("dog/dog_001.jpg").label == 3
    assert ds.stat("eel/eel_000.jpg").label == -1
    (tmp_path / "s.csv").write_text("cat/cat_000.jpg,tabby\ndog/dog_000.jpg,beagle\n")
    blockfs.pack(src, tmp_path / "p2", labels=str(tmp_path / "s.csv"))
    ds = blockfs.open_dataset(tmp_path / "p2")
    assert ds.classes == ["beagle", "tabby"] and ds.stat("cat/cat_000.jpg").label == 1
    (tmp_path / "bad.csv").write_text("cat/missing.jpg,1\n")
    with pytest.raises(PackError, match="not files in the source.*cat/missing.jpg"):
        blockfs.pack(src, tmp_path / "p3", labels=str(tmp_path / "bad.csv"))
    blockfs.pack(src, tmp_path / "p4", labels="none")
    assert blockfs.open_dataset(tmp_path / "p4").stat("cat/cat_000.jpg").label == -1


def _classes_per_block(ds) -> list[int]:
    off, files = ds.layout
    labels = ds.labels
    return [len(set(labels[files[off[b] : off[b + 1]]].tolist())) for b in range(ds.n_blocks)]


def test_shuffled_order_mixes_classes_and_directory_order_does_not(tmp_path):
    src = _imagefolder_tree(tmp_path / "src", classes=tuple("abcdef"), per_class=40)
    blockfs.pack(src, tmp_path / "s", files_per_block=40)
    blockfs.pack(src, tmp_path / "d", files_per_block=40, order="directory")
    assert min(_classes_per_block(blockfs.open_dataset(tmp_path / "s"))) >= 3
    assert _classes_per_block(blockfs.open_dataset(tmp_path / "d")) == [1] * 6


def test_plan_blocks():
    sizes = np.array([10, 10, 10, 100, 0, 5, 5])
    assert plan_blocks(sizes, 25).tolist() == [0, 2, 3, 4, 7]
    assert plan_blocks(sizes, 1000, files_per_block=3).tolist() == [0, 3, 6, 7]
    assert plan_blocks(np.array([], dtype=np.int64), 10).tolist() == [0]


def test_empty_source(tmp_path):
    (tmp_path / "src").mkdir()
    r = blockfs.pack(tmp_path / "src", tmp_path / "p")
    assert r.n_files == 0 and r.n_blocks == 0
    ds = blockfs.open_dataset(tmp_path / "p")
    assert ds.listdir("") == [] and verify(ds) == [] and summary(ds)["files"] == 0


def _big_file_for_a_wide_block(tmp_path, monkeypatch) -> bytes:
    """A 3 MiB file under SRC, with limits lowered so it gets a WIDE block of 64 KiB chunks."""
    monkeypatch.setattr(fmt, "NARROW_LIMIT", 1 << 20)
    monkeypatch.setattr(fmt, "CHUNK_SIZE", 1 << 16)
    monkeypatch.setattr(writer_module, "STREAM_PIECE", 1 << 18)
    data = np.random.default_rng(0).bytes(3 << 20)
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "big").write_bytes(data)
    return data


def test_wide_block_for_a_file_over_the_narrow_limit(tmp_path, monkeypatch):
    data = _big_file_for_a_wide_block(tmp_path, monkeypatch)
    (tmp_path / "src" / "small").write_bytes(b"s")
    blockfs.pack(tmp_path / "src", tmp_path / "p", block_size=1 << 20)
    ds = blockfs.open_dataset(tmp_path / "p")
    assert ds.store.header(ds.stat("big").block).flags & fmt.FLAG_WIDE
    for offset, size in ((0, 10), ((1 << 16) - 3, 7), (len(data) - 5, 100), (123_456, 400_000)):
        assert ds.read("big", offset, size) == data[offset : offset + size]
    assert verify(ds) == []


# --- a file over 4 GiB: one pack (sparse source, 4 GiB of blocks) read directly and through a mount ----------
HUGE_SIZE = (4 << 30) + 12345
HUGE_MARKS = {0: b"head", (1 << 32) - 3: b"across4G", (1 << 31) + 7: b"middle", HUGE_SIZE - 4: b"tail"}


@pytest.fixture(scope="module")
def huge_pack(tmp_path_factory):
    """A pack of ``huge.bin`` (HUGE_SIZE bytes, zeros but for HUGE_MARKS) and ``small.txt``, made once for
    the module (writing 4 GiB of blocks is the costly part) and removed after it."""
    root = tmp_path_factory.mktemp("huge")
    (root / "src").mkdir()
    with open(root / "src" / "huge.bin", "wb") as f:  # sparse: cheap to make; recognisable bytes at the edges
        for offset, data in HUGE_MARKS.items():
            f.seek(offset)
            f.write(data)
    (root / "src" / "small.txt").write_bytes(b"small")
    blockfs.pack(root / "src", root / "p", fsync=False)
    yield root / "p"
    shutil.rmtree(root)


@pytest.mark.slow
def test_file_over_4_gib(huge_pack):
    with blockfs.open_dataset(huge_pack) as ds:
        assert ds.stat("huge.bin").size == HUGE_SIZE
        for offset, data in HUGE_MARKS.items():
            assert ds.read("huge.bin", offset, len(data)) == data, offset
        assert ds.read("huge.bin", HUGE_SIZE - 6, 100) == b"\0\0tail"
        assert ds.read("huge.bin", (1 << 32) - 5, 2) == b"\0" * 2
        assert ds.read("small.txt") == b"small"


@pytest.mark.slow
@pytest.mark.fuse
def test_files_over_4_gib_read_at_any_offset_through_a_mount(huge_pack, tmp_path):
    require(has_fuse(), "/dev/fuse")
    with mounted(huge_pack, tmp_path / "mnt", "--cache-size", "64MiB") as m:
        path = m.path / "huge.bin"
        assert path.stat().st_size == HUGE_SIZE
        with open(path, "rb") as f:
            for offset, data in HUGE_MARKS.items():
                f.seek(offset - 2 if offset >= 2 else 0)
                piece = f.read(len(data) + 4)
                lo = 2 if offset >= 2 else 0
                assert piece[lo : lo + len(data)] == data, offset
            f.seek(HUGE_SIZE - 2)
            assert f.read(100) == b"il"
        assert (m.path / "small.txt").read_bytes() == b"small"


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"  # a zombie has stopped for good
    except FileNotFoundError:
        return False


@pytest.mark.parametrize("workers", [1, 2])
def test_killed_pack_leaves_nothing_that_opens_and_a_rerun_succeeds(tmp_path, workers):
    # With two workers the blocks are written by forked processes: they must die with the pack, not
    # finish the block in hand (three seconds each here).
    src = _imagefolder_tree(tmp_path / "src", per_class=200, size=2000)
    dest = tmp_path / "p"
    (tmp_path / "pids").mkdir()
    slow = (
        "import os, sys, time, blockfs\n"
        "from blockfs.packing.sources import DirectorySource\n"
        "class Slow(DirectorySource):\n"
        "    def read_into(self, e, buf, offset=0):\n"
        "        open(os.path.join(sys.argv[3], str(os.getpid())), 'w').close()\n"
        f"        time.sleep({0.01 if workers == 1 else 0.3})\n"
        "        return super().read_into(e, buf, offset)\n"
        f"blockfs.pack(Slow(sys.argv[1]), sys.argv[2], block_size=20000, workers={workers})\n"
    )
    proc = subprocess.Popen([sys.executable, "-c", slow, str(src), str(dest), str(tmp_path / "pids")])
    try:

        def started() -> bool:
            if workers > 1:  # every worker is inside a block
                return len(os.listdir(tmp_path / "pids")) == workers
            return len(os.listdir(dest / "blocks") if (dest / "blocks").exists() else []) >= 3

        wait_until(lambda: started() or proc.poll() is not None, "the pack to get going", timeout=30)
        assert proc.poll() is None, "the pack finished before it could be killed"
        proc.send_signal(signal.SIGKILL)
    finally:
        proc.wait()
    readers = {int(p) for p in os.listdir(tmp_path / "pids")}
    assert len(readers) == workers and (workers == 1) == (readers == {proc.pid})
    # Within 1 s, well under the 3 s a worker needs to finish its block: a worker that finishes first fails.
    wait_until(lambda: not any(map(_alive, readers)), "every pack worker to die with the killed pack", timeout=1)
    with pytest.raises(NotADatasetError, match="unfinished pack"):
        blockfs.open_dataset(dest)
    blockfs.pack(src, dest, block_size=20000)  # no --force needed for our own unfinished pack
    assert verify(blockfs.open_dataset(dest)) == []


def test_failed_pack_over_an_old_dataset_does_not_leave_it_looking_complete(tmp_path, monkeypatch):
    src = _imagefolder_tree(tmp_path / "src", per_class=3)
    blockfs.pack(src, tmp_path / "p")

    def broken(self, entry, buf, offset=0):
        raise RuntimeError("disk on fire")

    monkeypatch.setattr(DirectorySource, "read_into", broken)
    with pytest.raises(RuntimeError):
        blockfs.pack(src, tmp_path / "p", force=True)
    with pytest.raises(NotADatasetError):
        blockfs.open_dataset(tmp_path / "p")


@pytest.mark.parametrize("workers", [1, 2])
def test_every_block_is_flushed_and_a_failed_flush_fails_the_pack_before_the_index(tmp_path, monkeypatch, workers):
    # Blocks are flushed on a separate thread of the calling process (also those written by worker
    # processes); an error there must still reach the caller, and the dataset must not look complete
    # (the index and metadata come only after every block is on disk).
    src = _imagefolder_tree(tmp_path / "src", per_class=20)
    real_fsync = os.fsync
    block_syncs = []
    fail = False

    def recording_fsync(fd):
        if threading.current_thread().name.startswith("blockfs-fsync"):
            block_syncs.append(os.fstat(fd).st_ino)
            if fail:
                raise OSError(errno.EIO, "Input/output error")
        real_fsync(fd)

    monkeypatch.setattr(pack_module.os, "fsync", recording_fsync)
    r = blockfs.pack(src, tmp_path / "ok", block_size=4000, workers=workers)
    assert sorted(block_syncs) == sorted(os.stat(fmt.block_path(tmp_path / "ok", b)).st_ino for b in range(r.n_blocks))
    fail = True
    real_abandon, left = LocalDestination.abandon, []

    def watched(self, reason):  # what the failed pack had written, before it removes it
        left.extend(os.listdir(self.directory))
        return real_abandon(self, reason)

    monkeypatch.setattr(LocalDestination, "abandon", watched)
    with pytest.raises(OSError, match="Input/output error"):
        blockfs.pack(src, tmp_path / "p", block_size=4000, workers=workers)
    assert block_syncs, "no block was flushed on the fsync thread"
    assert fmt.BLOCKS_DIR in left and fmt.INDEX_NAME not in left and fmt.METADATA_NAME not in left
    assert not (tmp_path / "p").exists()  # the failed pack removed the directory it had created


def test_refusals(tmp_path):
    src = _imagefolder_tree(tmp_path / "src", per_class=1)
    with pytest.raises(SourceError, match="does not exist"):
        blockfs.pack(tmp_path / "missing", tmp_path / "p")
    with pytest.raises(PackError, match="inside the source"):
        blockfs.pack(src, src / "packed")
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "precious.txt").write_text("keep me")
    for force in (False, True):
        with pytest.raises(PackError, match="not empty and holds no blockfs dataset"):
            blockfs.pack(src, tmp_path / "full", force=force)
    assert (tmp_path / "full" / "precious.txt").read_text() == "keep me"
    blockfs.pack(src, tmp_path / "p")
    with pytest.raises(PackError, match="--force"):
        blockfs.pack(src, tmp_path / "p")
    blockfs.pack(src, tmp_path / "p", force=True)
    with pytest.raises(ValueError, match="block_size"):
        blockfs.pack(src, tmp_path / "q", block_size=0)
    with pytest.raises(ValueError, match="block_size must be between 1 byte and 4 GiB"):
        blockfs.pack(src, tmp_path / "q", block_size=4 << 30)


def test_block_size_takes_the_sizes_the_cli_takes(tmp_path):
    src = _imagefolder_tree(tmp_path / "src", per_class=4)
    result = blockfs.pack(src, tmp_path / "p", block_size="1MiB", fsync=False)
    with blockfs.open_dataset(tmp_path / "p") as ds:
        assert ds.metadata["pack"]["block_size"] == 1 << 20 and result.n_files == ds.metadata["n_files"]
    with pytest.raises(ValueError, match="cannot read '1 parsec' as a size"):
        blockfs.pack(src, tmp_path / "q", block_size="1 parsec")
    with pytest.raises(TypeError, match="block_size must be a number of bytes or a size such as '64MiB'"):
        blockfs.pack(src, tmp_path / "q", block_size=1.5)


def test_a_worker_process_that_dies_fails_the_pack_with_a_clear_error(tmp_path, monkeypatch):
    # As if the kernel killed a worker for memory: the pack stops with an error saying so, and what it
    # left behind does not open as a dataset.
    src = _imagefolder_tree(tmp_path / "src", per_class=10)
    parent = os.getpid()
    original = DirectorySource.read_into

    def dying(self, entry, buf, offset=0):
        if os.getpid() != parent and entry.path == b"dog/dog_005.jpg":
            os._exit(9)
        return original(self, entry, buf, offset)

    monkeypatch.setattr(DirectorySource, "read_into", dying)
    with pytest.raises(PackError, match="a pack worker process died.*--workers 1"):
        blockfs.pack(src, tmp_path / "p", block_size=2000, workers=2, fsync=False)
    with pytest.raises(NotADatasetError):
        blockfs.open_dataset(tmp_path / "p")


def test_listing_reports_the_entries_found_so_far(tmp_path, monkeypatch):
    monkeypatch.setattr(pack_module, "LISTING_STEP", 25)
    src = _imagefolder_tree(tmp_path / "src", per_class=30)  # the root, 3 directories, 90 files
    seen = []
    blockfs.pack(src, tmp_path / "p", listing=seen.append, fsync=False)
    assert seen == [25, 50, 75, 94]


def test_blocks_larger_than_the_gather_buffer_keep_every_byte(tmp_path, monkeypatch):
    # The buffer is written out each time it fills, and grows for a file larger than itself.
    monkeypatch.setattr(writer_module, "GATHER_SIZE", 1500)
    src = _imagefolder_tree(tmp_path / "src", per_class=20, size=700)
    (src / "cat" / "large.bin").write_bytes(np.random.default_rng(2).bytes(5000))
    blockfs.pack(src, tmp_path / "p", block_size=30000, fsync=False)
    with blockfs.open_dataset(tmp_path / "p") as ds:
        assert verify(ds) == []
        unpack(ds, tmp_path / "out")
    assert tree_snapshot(tmp_path / "out") == tree_snapshot(src)


def test_newer_dataset_version_is_refused(tmp_path):
    src = _imagefolder_tree(tmp_path / "src", per_class=1)
    blockfs.pack(src, tmp_path / "p")
    meta = (tmp_path / "p" / "blockfs.json").read_text()
    (tmp_path / "p" / "blockfs.json").write_text(re.sub(r'"format_version": \d+', '"format_version": 99', meta))
    with pytest.raises(UnsupportedVersionError, match="version 99.*upgrade blockfs"):
        blockfs.open_dataset(tmp_path / "p")


@pytest.mark.parametrize("workers", [1, 2])
def test_unreadable_file_stops_the_pack_or_is_skipped(tmp_path, monkeypatch, workers):
    # With two workers and several blocks, the error and the skipped path come back from a worker process.
    src = _imagefolder_tree(tmp_path / "src", per_class=4)
    original = DirectorySource.read_into

    def read_into(self, entry, buf, offset=0):
        if entry.path == b"dog/dog_002.jpg":
            raise PermissionError(13, "Permission denied")
        return original(self, entry, buf, offset)

    monkeypatch.setattr(DirectorySource, "read_into", read_into)
    with pytest.raises(PackError, match="dog/dog_002.jpg.*--skip-unreadable"):
        blockfs.pack(src, tmp_path / "p", workers=workers, block_size=1200)
    r = blockfs.pack(src, tmp_path / "q", skip_unreadable=True, workers=workers, block_size=1200)
    assert r.skipped_unreadable == ["dog/dog_002.jpg"] and r.n_files == 11 and r.n_blocks == 6
    ds = blockfs.open_dataset(tmp_path / "q")
    assert "dog_002.jpg" not in ds.listdir("dog") and verify(ds) == []
    assert ds.read("dog/dog_003.jpg") == (src / "dog" / "dog_003.jpg").read_bytes()


def test_follow_symlinks(tmp_path, edge_tree):
    os.unlink(edge_tree + b"/dangling_abs")
    blockfs.pack(edge_tree, tmp_path / "p", follow_symlinks=True)
    ds = blockfs.open_dataset(tmp_path / "p")
    assert ds.read("class_a/link_rel") == b"hello\n"
    assert ds.listdir("link_to_dir") == ["er"]


class _InMemorySource(Source):
    """A custom source declaring only what a source must: no forkable, no labels, no side files."""

    description = "in-memory test source"

    def __init__(self, files: dict[bytes, bytes]) -> None:
        self.files = files
        self.reader_pids: set[int] = set()

    def entries(self):
        yield SourceEntry(b"", KIND_DIR, 0o40755, 0)
        for path, data in sorted(self.files.items()):
            yield SourceEntry(path, KIND_FILE, 0o100644, 1_600_000_000_000_000_000, len(data))

    def read_into(self, entry, buf, offset=0):
        self.reader_pids.add(os.getpid())
        data = self.files[entry.path][offset : offset + len(buf)]
        buf[: len(data)] = data
        return len(data)


def test_a_custom_source_gets_the_base_class_defaults_and_threads(tmp_path, caplog):
    # Only entries() and read_into() are written; skipped(), damaged(), write_metadata(), forkable and
    # provides_labels come from Source.  Not forkable: the blocks are written by threads of this process.
    files = {f"f{i:02d}.bin".encode(): np.random.default_rng(i).bytes(300 + i) for i in range(40)}
    source = _InMemorySource(files)
    assert source.forkable is False and source.provides_labels is False
    with caplog.at_level(logging.WARNING):
        r = blockfs.pack(source, tmp_path / "p", block_size=1000, workers=4, labels="none")
    assert source.reader_pids == {os.getpid()}
    assert r.n_files == 40 and r.n_blocks > 4 and r.skipped_special == [] and r.skipped_damaged == []
    assert "skipped" not in caplog.text
    assert "source" not in json.loads((tmp_path / "p" / fmt.METADATA_NAME).read_text())
    with blockfs.open_dataset(tmp_path / "p") as ds:
        assert verify(ds) == []
        assert {p: ds.read(p) for p in files} == files


def test_a_source_that_does_not_subclass_source_is_refused_with_the_fix(tmp_path):
    class DuckSource:  # the two methods, but not a Source
        description = "duck"

        def entries(self):
            return iter([])

        def read_into(self, entry, buf, offset=0):
            return 0

    with pytest.raises(TypeError, match="cannot pack a DuckSource.*subclasses blockfs.packing.sources.Source"):
        blockfs.pack(DuckSource(), tmp_path / "p")
    assert not (tmp_path / "p").exists()
    with pytest.raises(TypeError, match="entries"):  # an incomplete subclass fails where it is made
        type("Half", (Source,), {"read_into": lambda self, e, b, o=0: 0})()


def test_a_forkable_custom_source_is_read_in_worker_processes(tmp_path):
    # The README's contract: a custom source that declares forkable = True gets worker processes.
    files = {f"f{i:02d}.bin".encode(): bytes([i]) * 500 for i in range(40)}

    pids_dir = tmp_path / "pids"
    pids_dir.mkdir()

    class ForkableSource(_InMemorySource):
        forkable = True

        def read_into(self, entry, buf, offset=0):
            (pids_dir / str(os.getpid())).touch()  # a child's set would not reach the parent
            return super().read_into(entry, buf, offset)

    source = ForkableSource(files)
    blockfs.pack(source, tmp_path / "p", block_size=1000, workers=2, labels="none", fsync=False)
    readers = {int(p) for p in os.listdir(pids_dir)}
    assert readers and os.getpid() not in readers
    with blockfs.open_dataset(tmp_path / "p") as ds:
        assert {p: ds.read(p) for p in files} == files


def test_a_wide_block_forged_with_matching_chunk_checksums_is_refused(tmp_path, monkeypatch):
    """Chunk CRCs are the block's own: a forger who rewrites a chunk, its CRC and the header CRC passes
    them, so a read of the file must also hold it to the index's CRC of the file."""
    _big_file_for_a_wide_block(tmp_path, monkeypatch)
    blockfs.pack(tmp_path / "src", tmp_path / "p", block_size=1 << 20)
    with blockfs.open_dataset(tmp_path / "p") as ds:
        block = ds.stat("big").block
        path, head = ds.store.block_paths[block], ds.store.header(block)
    raw = bytearray(open(path, "rb").read())
    start = head.data_start + 5 * fmt.CHUNK_SIZE
    raw[start : start + 4] = b"FAKE"
    chunks = fmt.chunk_crcs_of(bytes(raw[head.data_start :]))
    chunk_at = head.data_start - 4 * chunks.size
    raw[chunk_at : head.data_start] = chunks.astype("<u4").tobytes()
    raw[12:16] = fmt.crc32(bytes(raw[16 : head.data_start]), fmt.crc32(bytes(raw[:12]))).to_bytes(4, "little")
    open(path, "wb").write(bytes(raw))
    with blockfs.open_dataset(tmp_path / "p") as ds:
        assert ds.store.unchecked_header(block).chunk_crcs is not None  # the forged header passes its own checks
        with pytest.raises(CorruptBlockError, match="checksum mismatch"):
            ds.read("big", 5 * fmt.CHUNK_SIZE, 10)
