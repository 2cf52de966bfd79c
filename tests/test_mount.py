"""``blockfs mount``: the packed dataset served back through FUSE as the original tree, with both bindings.

Every mount is served by a child process and always unmounted (tests/mountutil.py), also when a test
fails.  Tests that only need one binding use the default (mfusepy on libfuse 3).
"""

from __future__ import annotations

import errno
import hashlib
import json
import mmap
import multiprocessing
import os
import random
import shutil
import signal
import stat
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
from capability import has_fuse, has_torch, require
from mountutil import BINDINGS, mounted, release
from polling import wait_until
from treeutil import make_edge_tree

import blockfs
from blockfs import cli
from blockfs.cli.output import human
from blockfs.client import control_dir, read_stats
from blockfs.core import format as fmt
from blockfs.core.dataset import PackedDataset
from blockfs.core.index import PackedIndex
from blockfs.serve.daemon import is_mounted

pytestmark = pytest.mark.fuse
REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tools"))

import make_dataset as md  # noqa: E402


@pytest.fixture(scope="module", autouse=True)
def _needs_fuse_and_leaves_no_mount(tmp_path_factory):
    require(has_fuse(), "/dev/fuse")
    yield
    # Torn down after every other fixture of this module: no mount of ours may outlive the tests.
    base = str(tmp_path_factory.getbasetemp())
    with open("/proc/self/mounts") as f:
        leftovers = [line for line in f if "fuse" in line and base in line]
    for line in leftovers:
        release(line.split()[1])
    assert leftovers == []


def run(*command, **kw) -> subprocess.CompletedProcess:
    return subprocess.run([os.fspath(c) for c in command], capture_output=True, timeout=120, **kw)


def walk(root: bytes) -> list[bytes]:
    """Every path under ``root``, relative, sorted (bytes: names need not be UTF-8)."""
    out = []
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            out.append(os.path.relpath(os.path.join(dirpath, name), root))
    return sorted(out)


# --- the edge-case tree, through each binding --------------------------------------------------------
@pytest.fixture(scope="module")
def edge(tmp_path_factory):
    root = tmp_path_factory.mktemp("edge")
    src = make_edge_tree(root / "src")
    blockfs.pack(src, root / "packed", block_size=4096, fsync=False)  # several blocks
    return root, src


@pytest.fixture(scope="module", params=BINDINGS)
def edge_mount(request, edge):
    root, src = edge
    with mounted(root / "packed", root / f"mnt-{request.param}", binding=request.param) as m:
        yield src, os.fsencode(m.path), m


def test_diff_r_finds_no_difference(edge_mount):
    src, mnt, _ = edge_mount
    done = run("diff", "-r", "--no-dereference", src, mnt)
    assert done.returncode == 0 and done.stdout == b"", done.stdout + done.stderr
    # Plain diff -r follows links: the same verdicts on both sides (the dangling link fails on both).
    plain = run("diff", "-r", src, mnt)
    assert plain.stdout == b""


def test_stat_of_every_entry_matches_the_source(edge_mount):
    src, mnt, m = edge_mount
    paths = walk(src)
    assert walk(mnt) == paths
    inodes_src: dict[int, list] = {}
    inodes_mnt: dict[int, list] = {}
    for rel in paths:
        a, b = os.lstat(os.path.join(src, rel)), os.lstat(os.path.join(mnt, rel))
        assert (a.st_mode, a.st_mtime_ns) == (b.st_mode, b.st_mtime_ns), rel
        if stat.S_ISREG(a.st_mode) or stat.S_ISLNK(a.st_mode):
            assert a.st_size == b.st_size, rel
        if stat.S_ISLNK(a.st_mode):
            assert os.readlink(os.path.join(src, rel)) == os.readlink(os.path.join(mnt, rel))
        if stat.S_ISREG(a.st_mode):
            assert a.st_nlink == b.st_nlink, rel
            inodes_src.setdefault(a.st_ino, []).append(rel)
            inodes_mnt.setdefault(b.st_ino, []).append(rel)
        assert os.lstat(os.path.join(mnt, rel)).st_ino == b.st_ino  # stable
    assert sorted(inodes_src.values()) == sorted(inodes_mnt.values())  # hard links share an inode


def test_reads_at_any_offset_and_length(edge_mount):
    src, mnt, _ = edge_mount
    rel = b"class_a/big.bin"
    data = open(os.path.join(src, rel), "rb").read()
    rng = random.Random(0)
    fd = os.open(os.path.join(mnt, rel), os.O_RDONLY)
    try:
        for _ in range(200):
            offset = rng.randrange(len(data) + 100)
            size = rng.choice([0, 1, 7, 4096, 65536, 200_000, rng.randrange(300_000)])
            assert os.pread(fd, size, offset) == data[offset : offset + size]
        assert os.pread(fd, 10, len(data)) == b"" and os.pread(fd, 10, 10**12) == b""
    finally:
        os.close(fd)
    with open(os.path.join(mnt, rel), "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mm:
        assert mm[:] == data and mm[12345:12400] == data[12345:12400]
    assert open(os.path.join(mnt, b"class_a/empty.bin"), "rb").read() == b""


def test_find_du_cp_tar_sha256sum_and_scandir(edge_mount, tmp_path):
    src, mnt, _ = edge_mount
    # A directory's own size belongs to the host filesystem (4096 on ext4); everything else must match.
    fmt = "%P|%y|%m|%T@|%n|%l"
    find = [run("find", r, "-type", "d", "-printf", fmt + "\\n", "-o", "-printf", fmt + "|%s\\n") for r in (src, mnt)]
    assert find[0].returncode == find[1].returncode == 0
    assert sorted(find[0].stdout.splitlines()) == sorted(find[1].stdout.splitlines())

    def du(root):  # files and links only: a directory's own size is the host filesystem's business
        lines = run("du", "--apparent-size", "-ab0", root).stdout.split(b"\0")[:-1]
        sizes = {}
        for line in lines:
            size, path = line.split(b"\t", 1)
            if not os.path.isdir(path) or os.path.islink(path):
                sizes[os.path.relpath(path, root)] = int(size)
        return sizes

    assert du(src) == du(mnt)

    copy = os.fsencode(tmp_path / "copy")
    assert run("cp", "-a", mnt, copy).returncode == 0
    assert run("diff", "-r", "--no-dereference", src, copy).returncode == 0
    a, b = os.stat(os.path.join(copy, b"class_a/one.txt")), os.stat(os.path.join(copy, b"class_c/hardlink_to_one"))
    assert a.st_ino == b.st_ino and a.st_mtime_ns == os.stat(os.path.join(src, b"class_a/one.txt")).st_mtime_ns

    untar = os.fsencode(tmp_path / "untar")
    os.mkdir(untar)
    tar = run("tar", "cf", "-", "-C", mnt, ".")
    assert tar.returncode == 0, tar.stderr
    assert subprocess.run(["tar", "xf", "-", "-C", untar], input=tar.stdout).returncode == 0
    assert run("diff", "-r", "--no-dereference", src, untar).returncode == 0

    files = [p for p in walk(src) if os.path.isfile(os.path.join(src, p)) and not os.path.islink(os.path.join(src, p))]
    sums = b"".join(
        hashlib.sha256(open(os.path.join(src, p), "rb").read()).hexdigest().encode() + b"  " + p + b"\n"
        for p in files
        if b"\n" not in p and b"\\" not in p
    )
    check = subprocess.run(["sha256sum", "-c", "--quiet", "-"], input=sums, cwd=mnt, capture_output=True)
    assert check.returncode == 0, check.stdout + check.stderr

    with os.scandir(mnt) as it:
        entries = {e.name: (e.is_dir(follow_symlinks=False), e.is_symlink(), e.inode()) for e in it}
    with os.scandir(src) as it:
        expected = {e.name: (e.is_dir(follow_symlinks=False), e.is_symlink()) for e in it}
    assert {k: v[:2] for k, v in entries.items()} == expected
    assert all(ino > 0 for *_, ino in entries.values())


def test_extended_attributes_carry_labels_and_blocks(edge_mount, edge):
    root, src = edge
    _, mnt, _ = edge_mount
    with PackedDataset(root / "packed") as ds:
        for e in ds.file_ids:
            path = os.path.join(mnt, ds.path_of(int(e)))
            st = ds.stat_entry(int(e))
            assert os.getxattr(path, "user.blockfs.block") == str(st.block).encode()
            if st.label >= 0:
                assert os.getxattr(path, "user.blockfs.label") == str(st.label).encode()
                assert os.getxattr(path, "user.blockfs.class") == os.fsencode(ds.classes[st.label])
    assert os.getxattr(mnt, "user.blockfs.control") == b".blockfs"
    with pytest.raises(OSError) as raised:
        os.getxattr(os.path.join(mnt, b"class_a/one.txt"), "user.other")
    assert raised.value.errno == errno.ENODATA


def test_control_files_are_hidden_and_carry_index_metadata_and_live_stats(edge_mount, edge):
    root, src = edge
    _, mnt, m = edge_mount
    assert b".blockfs" not in os.listdir(mnt)
    ctl = control_dir(m.path)
    assert sorted(os.listdir(ctl)) == ["blocks", "index.bfi", "metadata.json", "stats.json"]
    index_bytes = (root / "packed" / "index.bfi").read_bytes()
    assert Path(ctl, "index.bfi").read_bytes() == index_bytes
    index = PackedIndex(os.path.join(ctl, "index.bfi"))
    assert index.n_entries == PackedDataset(root / "packed").index.n_entries
    index.close()
    metadata = json.loads((root / "packed" / "blockfs.json").read_text())
    assert json.loads(Path(ctl, "metadata.json").read_text()) == metadata

    before = read_stats(m.path)
    for rel in walk(src):
        if os.path.isfile(os.path.join(mnt, rel)):
            with open(os.path.join(mnt, rel), "rb") as f:
                f.read()
    after = read_stats(m.path)
    assert after["mount"]["pid"] == m.pid and after["mount"]["binding"] == m.path.name.split("-")[1]
    assert after["counters"]["reads"] >= before["counters"]["reads"]
    text = json.loads(Path(ctl, "stats.json").read_text())
    assert text["dataset"]["files"] == after["dataset"]["files"]
    # The file is live too: every open reads a new snapshot.
    first = json.loads(Path(ctl, "stats.json").read_text())["uptime_s"]
    wait_until(lambda: json.loads(Path(ctl, "stats.json").read_text())["uptime_s"] > first, "a newer snapshot")


def test_concurrent_stats_readers_each_read_one_whole_snapshot(edge_mount):
    # stats.json changes with every request; each reader reads it in small pieces while others read files
    # and open it again: every read must be one whole snapshot (issue 17: it tore once in 6,400 reads).
    src, mnt, m = edge_mount
    stats_path = os.path.join(control_dir(m.path), "stats.json")
    files = [os.path.join(mnt, rel) for rel in walk(src) if os.path.isfile(os.path.join(mnt, rel))]
    failures: list[str] = []
    stop = threading.Event()

    def churn() -> None:  # moves the counters
        while not stop.is_set():
            for path in files:
                with open(path, "rb") as f:
                    f.read()

    def reader() -> None:
        for _ in range(60):
            fd = os.open(stats_path, os.O_RDONLY)
            try:
                size, chunks = os.fstat(fd).st_size, []
                while chunk := os.read(fd, 50):
                    chunks.append(chunk)
            finally:
                os.close(fd)
            data = b"".join(chunks)
            try:
                assert len(data) == size, (len(data), size)
                json.loads(data)
            except (ValueError, AssertionError) as e:
                failures.append(repr(e))

    churner = threading.Thread(target=churn)
    churner.start()
    readers = [threading.Thread(target=reader) for _ in range(6)]
    try:
        for t in readers:
            t.start()
        for t in readers:
            t.join()
    finally:
        stop.set()
        churner.join()
    assert not failures, failures[:3]


def test_writes_are_refused_with_erofs(edge_mount):
    _, mnt, _ = edge_mount
    f = os.path.join(mnt, b"class_a/one.txt")
    attempts = [
        lambda: open(f, "r+b"),
        lambda: open(os.path.join(mnt, b"new.txt"), "wb"),
        lambda: os.mkdir(os.path.join(mnt, b"newdir")),
        lambda: os.rename(f, os.path.join(mnt, b"moved")),
        lambda: os.chmod(f, 0o600),
        lambda: os.unlink(f),
        lambda: os.rmdir(os.path.join(mnt, b"empty_dir")),
        lambda: os.utime(f, ns=(0, 0)),
        lambda: os.truncate(f, 0),
        lambda: os.symlink(b"x", os.path.join(mnt, b"newlink")),
        lambda: os.link(f, os.path.join(mnt, b"newhard")),
        lambda: os.setxattr(f, "user.x", b"1"),
    ]
    for attempt in attempts:
        with pytest.raises(OSError) as raised:
            attempt()
        assert raised.value.errno == errno.EROFS


def test_statfs_reports_the_dataset_size(edge_mount, edge):
    root, _ = edge
    _, mnt, _ = edge_mount
    st = os.statvfs(mnt)
    total = json.loads((root / "packed" / "blockfs.json").read_text())["file_bytes"]
    assert total <= st.f_blocks * st.f_frsize < total + st.f_frsize
    assert st.f_bfree == 0 and st.f_files > 0


def test_a_root_entry_named_like_the_control_dir_is_not_shadowed(tmp_path):
    (tmp_path / "src" / ".blockfs").mkdir(parents=True)
    (tmp_path / "src" / ".blockfs" / "mine.txt").write_bytes(b"data")
    blockfs.pack(tmp_path / "src", tmp_path / "p", fsync=False)
    with mounted(tmp_path / "p", tmp_path / "mnt") as m:
        assert os.getxattr(m.path, "user.blockfs.control") == b".blockfs-1"
        assert (m.path / ".blockfs" / "mine.txt").read_bytes() == b"data"
        assert os.listdir(m.path) == [".blockfs"]
        assert "counters" in read_stats(m.path)


def test_a_non_ascii_dataset_path_keeps_the_mount_table_utf8(tmp_path):
    # libfuse writes the fsname into /proc/mounts byte for byte: a latin-1 'ü' (0xFC) there made every
    # reader of the mount table raise UnicodeDecodeError for as long as the mount lived.
    (tmp_path / "src" / "c").mkdir(parents=True)
    (tmp_path / "src" / "c" / "a.txt").write_bytes(b"a")
    dest = tmp_path / "d ü" / "x.blockfs"
    blockfs.pack(tmp_path / "src", dest, fsync=False)
    with mounted(dest, tmp_path / "mnt") as m:
        with open("/proc/mounts", "rb") as f:
            table = f.read().decode("utf-8")  # strict: fails on the bug
        mine = [line for line in table.splitlines() if line.split(" ")[1] == str(m.path)]
        assert len(mine) == 1 and mine[0].split(" ")[0] == str(dest).replace(" ", "\\040"), mine


# --- concurrency, memory, hit rates -----------------------------------------------------------------
@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """~4 KiB files in 16 blocks of ~128 KiB."""
    root = tmp_path_factory.mktemp("tiny")
    md.make_dataset(root / "src", "tiny", files=600, classes=6, seed=3)
    blockfs.pack(root / "src", root / "packed", block_size=160 << 10, fsync=False)
    return root


def _read_random(mnt: str, src: str, names: list[str], seconds: float, seed: int) -> int:
    rng = random.Random(seed)
    done = 0
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        name = rng.choice(names)
        with open(os.path.join(mnt, name), "rb") as f:
            got = f.read()
        with open(os.path.join(src, name), "rb") as f:
            if got != f.read():
                raise AssertionError(f"{name}: bytes differ")
        done += 1
    return done


@pytest.mark.parametrize("binding", BINDINGS)
def test_eight_threads_and_two_processes_read_random_files(tiny, binding):
    src = str(tiny / "src")
    names = [os.path.relpath(os.path.join(d, f), src) for d, _, fs in os.walk(src) for f in fs]
    ds_bytes = json.loads((tiny / "packed" / "blockfs.json").read_text())["file_bytes"]
    # Half the dataset cached, no page-cache reuse: reads hit the cache and storage alike.
    # Block caching only (--no-retain): retained files would take the whole budget and load no block.
    args = ("--cache-size", str(ds_bytes // 2), "--open-mode", "none", "--no-retain")
    with mounted(tiny / "packed", tiny / f"mnt-rw-{binding}", *args, binding=binding) as m:
        errors: list[BaseException] = []
        counts: list[int] = []

        def worker(seed: int) -> None:
            try:
                counts.append(_read_random(str(m.path), src, names, 3.0, seed))
            except BaseException as e:  # noqa: BLE001 - reported below
                errors.append(e)

        ctx = multiprocessing.get_context("spawn")
        with ctx.Pool(2) as pool:
            procs = [pool.apply_async(_read_random, (str(m.path), src, names, 3.0, 100 + k)) for k in range(2)]
            threads = [threading.Thread(target=worker, args=(k,)) for k in range(8)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            counts += [p.get(timeout=60) for p in procs]
        assert not errors, errors
        assert min(counts) > 20, counts
        stats = read_stats(m.path)
        assert stats["counters"]["block_loads"] > 0 and stats["counters"]["file_reads"] > 0


def test_memory_stays_within_budget_and_cache_once_hits_budget_over_dataset(tmp_path):
    md.make_dataset(tmp_path / "src", "tiny", files=9000, classes=10, seed=5)  # ~36 MiB
    blockfs.pack(tmp_path / "src", tmp_path / "p", block_size=256 << 10, fsync=False)
    total = json.loads((tmp_path / "p" / "blockfs.json").read_text())["file_bytes"]
    budget = total // 3
    src = str(tmp_path / "src")
    names = sorted(os.path.relpath(os.path.join(d, f), src) for d, _, fs in os.walk(src) for f in fs)
    with mounted(
        tmp_path / "p", tmp_path / "mnt", "--cache-size", str(budget), "--open-mode", "none", "--no-retain"
    ) as m:  # (blocks only; tests/test_retain.py covers retention)
        for name in names[:50]:  # warm up the interpreter's own allocations
            (m.path / name).read_bytes()
        baseline = m.rss_bytes()
        rates = []
        for epoch in range(2):
            random.Random(epoch).shuffle(names)
            before = read_stats(m.path)["counters"]
            for name in names:
                with open(m.path / name, "rb") as f:
                    f.read()
            after = read_stats(m.path)["counters"]
            rates.append((after["file_hits"] - before["file_hits"]) / (after["files_served"] - before["files_served"]))
        growth = m.rss_bytes() - baseline
        stats = read_stats(m.path)
    used = stats["cache"]["used_bytes"]
    assert used <= budget
    # RSS grows by the cached blocks plus a small fixed overhead (the file buffer, allocator slack).
    assert growth <= budget + (24 << 20), (growth, budget)
    expected = used / total
    assert rates[1] == pytest.approx(expected, abs=0.03), (rates, expected)
    assert stats["cache"]["evictions"] == 0 and stats["cache"]["refusals"] > 0


# --- faults -------------------------------------------------------------------------------------------
def _damage(dest: Path) -> dict[str, list[bytes]]:
    """Damage four blocks four ways; return which files each way should make unreadable."""
    with PackedDataset(dest) as ds:
        head = ds.store.header(1)
        with open(ds.store.block_paths[1], "r+b") as f:  # one byte inside the first file's data
            pos = head.data_start + int(head.offsets[0])
            f.seek(pos)
            byte = f.read(1)
            f.seek(pos)
            f.write(bytes([byte[0] ^ 0x55]))
        with open(ds.store.block_paths[2], "r+b") as f:  # the header
            f.seek(40)
            f.write(b"\xff\xff\xff\xff")
        with open(ds.store.block_paths[3], "r+b") as f:  # truncated
            f.truncate(os.path.getsize(ds.store.block_paths[3]) - 100)
        os.unlink(ds.store.block_paths[4])  # missing
        return {
            "data": ds.files_in_block(1)[:1],
            "header": ds.files_in_block(2),
            "truncated": ds.files_in_block(3),
            "missing": ds.files_in_block(4),
        }


@pytest.mark.parametrize("policy", ["cache-once", "none"])
def test_damaged_blocks_fail_their_files_with_eio_and_the_mount_stays_up(tmp_path, policy):
    md.make_dataset(tmp_path / "src", "tiny", files=300, classes=3, seed=7)
    blockfs.pack(tmp_path / "src", tmp_path / "p", block_size=64 << 10, fsync=False)
    bad = _damage(tmp_path / "p")
    bad_files = {p for files in bad.values() for p in files}
    src = os.fsencode(tmp_path / "src")
    with mounted(tmp_path / "p", tmp_path / "mnt", "--policy", policy, "--open-mode", "none") as m:
        mnt = os.fsencode(m.path)
        for _ in range(2):  # twice: the second time must neither succeed nor log again
            for rel in walk(src):
                path = os.path.join(mnt, rel)
                if os.path.isdir(path):
                    continue
                if rel in bad_files:
                    with pytest.raises(OSError) as raised:
                        open(path, "rb").read()
                    assert raised.value.errno == errno.EIO, rel
                else:
                    assert open(path, "rb").read() == open(os.path.join(src, rel), "rb").read(), rel
        assert is_mounted(m.path)
        # The server logs from its own threads: wait for the four lines, then check there is no fifth.
        log = wait_until(lambda: (t := m.log_text()).count("EIO") >= 4 and t, "four EIO log lines")
    lines = [line for line in log.splitlines() if "EIO" in line]
    assert len(lines) == 4, log
    for block, kind in zip((1, 2, 3, 4), ("data", "header", "truncated", "missing"), strict=True):
        (line,) = [x for x in lines if f"block {block} " in x]
        assert any(f"(reading {os.fsdecode(p)!r})" in line for p in bad[kind]), (kind, line)


def _read_everything(mnt: bytes, src: bytes, bad: set[bytes], passes: int = 2) -> None:
    """Read every file ``passes`` times: those in ``bad`` must fail with EIO, the rest give the source's bytes."""
    for _ in range(passes):
        for rel in walk(src):
            path = os.path.join(mnt, rel)
            if os.path.isdir(path):
                continue
            if rel in bad:
                with pytest.raises(OSError) as raised:
                    open(path, "rb").read()
                assert raised.value.errno == errno.EIO, rel
            else:
                assert open(path, "rb").read() == open(os.path.join(src, rel), "rb").read(), rel


def test_a_foreign_block_and_a_header_bomb_fail_their_files_with_one_log_line_each(tmp_path):
    """Issue 17: a block copied from another pack is never served; a header claiming 2**32 files costs no
    huge read and no traceback per read: each block is one log line and counts in the statistics."""
    md.make_dataset(tmp_path / "src", "tiny", files=400, classes=4, seed=7)
    for name, seed in (("A", 0), ("B", 1)):
        blockfs.pack(tmp_path / "src", tmp_path / name, files_per_block=100, seed=seed, fsync=False)
    (tmp_path / "A" / "blocks" / "00000000.blk").write_bytes((tmp_path / "B" / "blocks" / "00000000.blk").read_bytes())
    with open(tmp_path / "A" / "blocks" / "00000001.blk", "r+b") as f:
        f.seek(fmt.PREAMBLE_SIZE)
        f.write((2**32 - 1).to_bytes(4, "little"))
    with PackedDataset(tmp_path / "A") as ds:
        bad = set(ds.files_in_block(0)) | set(ds.files_in_block(1))
    with mounted(tmp_path / "A", tmp_path / "mnt", "--open-mode", "none") as m:
        _read_everything(os.fsencode(m.path), os.fsencode(tmp_path / "src"), bad)
        stats = read_stats(m.path)
        log = m.log_text()
    lines = [line for line in log.splitlines() if "EIO" in line]
    assert len(lines) == 2 and "Traceback" not in log, log
    (foreign,) = [x for x in lines if "block 0 " in x]
    (bomb,) = [x for x in lines if "block 1 " in x]
    assert "does not belong to this dataset" in foreign and "damaged header" in bomb
    assert stats["errors"]["damaged_blocks_reported"] == [0, 1]
    assert stats["errors"]["damaged_files_read"] >= 2 * len(bad) and stats["counters"]["damaged_blocks"] == 2


def test_a_block_file_missing_for_a_while_fails_its_reads_then_serves_them(tmp_path):
    """Issue 12: a failed read is not a damaged block: EIO and one log line, then the next read tries again."""
    md.make_dataset(tmp_path / "src", "tiny", files=300, classes=3, seed=7)
    blockfs.pack(tmp_path / "src", tmp_path / "p", block_size=64 << 10, fsync=False)
    path = fmt.block_path(tmp_path / "p", 2)
    with PackedDataset(tmp_path / "p") as ds:
        bad = set(ds.files_in_block(2))
    src = os.fsencode(tmp_path / "src")
    os.rename(path, path + ".away")  # before mounting: no prefill can have loaded it
    with mounted(tmp_path / "p", tmp_path / "mnt", "--open-mode", "none") as m:
        mnt = os.fsencode(m.path)
        _read_everything(mnt, src, bad)
        os.rename(path + ".away", path)
        _read_everything(mnt, src, set(), passes=1)
        stats = read_stats(m.path)
        log = m.log_text()
    lines = [line for line in log.splitlines() if "EIO" in line]
    assert len(lines) == 1 and "block 2 " in lines[0] and "the next read tries again" in lines[0], log
    assert "cannot open" in lines[0] and "(reading " in lines[0]
    assert stats["errors"]["damaged_blocks_reported"] == [] and stats["counters"]["damaged_blocks"] == 0
    assert stats["errors"]["failed_reads"] >= 2 * len(bad) and stats["counters"]["read_errors"] >= 2 * len(bad)
    shown = cli.mount_commands._stats_text(stats, None, 1.0)
    assert f"failed     {stats['errors']['failed_reads']:,} reads failed on I/O errors" in shown, shown


def test_block_files_read_through_the_control_directory(tmp_path):
    # blocks/NNNNNNNN is each block file byte for byte, served through the cache; a damaged one fails
    # with EIO only in the ranges it damages, and a log line names the block and a file.
    md.make_dataset(tmp_path / "src", "tiny", files=300, classes=3, seed=7)
    blockfs.pack(tmp_path / "src", tmp_path / "p", block_size=64 << 10, fsync=False)
    ds = PackedDataset(tmp_path / "p")
    raw = [Path(p).read_bytes() for p in ds.store.block_paths]
    ds.close()
    bad = _damage(tmp_path / "p")
    with mounted(tmp_path / "p", tmp_path / "mnt") as m:
        blocks = os.path.join(control_dir(m.path), "blocks")
        names = sorted(os.listdir(blocks))
        assert names == [f"{b:08d}" for b in range(len(raw))]
        for b in [0] + list(range(5, len(raw))):
            path = os.path.join(blocks, names[b])
            assert os.stat(path).st_size == len(raw[b])
            assert Path(path).read_bytes() == raw[b]
            with open(path, "rb") as f:  # any offset and length, past the end included
                for offset, size in ((0, 7), (33, 4000), (len(raw[b]) - 5, 100), (len(raw[b]) + 10, 10)):
                    f.seek(offset)
                    assert f.read(size) == raw[b][offset : offset + size]
        for b in (1, 2, 3, 4):
            with pytest.raises(OSError) as raised:
                Path(blocks, names[b]).read_bytes()
            assert raised.value.errno == errno.EIO, b
        head = fmt.decode_header(raw[1], "block 1")  # its last file is far from the damaged first one
        assert head.count > 4 and bad["data"][0] == PackedDataset(tmp_path / "p").files_in_block(1)[0]
        start = head.data_start + int(head.offsets[-1])
        with open(os.path.join(blocks, names[1]), "rb") as f:
            f.seek(start)
            assert f.read() == raw[1][start:]
        for name in ("0", "00000000x", f"{len(raw):08d}"):
            assert not os.path.exists(os.path.join(blocks, name)), name
        assert is_mounted(m.path)
        # The server logs from its own threads: wait for the four lines, then check there is no fifth.
        log = wait_until(lambda: (t := m.log_text()).count("EIO") >= 4 and t, "four EIO log lines")
    lines = [line for line in log.splitlines() if "EIO" in line]
    assert len(lines) == 4, log
    data_line = next(x for x in lines if "block 1 " in x)
    assert f"(reading {os.fsdecode(bad['data'][0])!r})" in data_line
    header_line = next(x for x in lines if "block 2 " in x)
    assert "other files of the block" in header_line


def test_announced_blocks_are_loaded_in_the_announced_order(tmp_path):
    # The prefetch socket named by user.blockfs.prefetch: announced blocks are loaded in the background,
    # in order, into free room only; a malformed announcement is dropped and the mount stays up.
    from blockfs.loader.mount_client import BlockfsMount

    md.make_dataset(tmp_path / "src", "tiny", files=300, classes=3, seed=7)
    blockfs.pack(tmp_path / "src", tmp_path / "p", block_size=64 << 10, fsync=False)
    block_bytes = [os.path.getsize(p) for p in PackedDataset(tmp_path / "p").store.block_paths]
    budget = sum(block_bytes[b] for b in (5, 2, 7)) + 100  # room for the first three announced
    with mounted(
        tmp_path / "p", tmp_path / "mnt", "--cache-size", str(budget), "--no-prefill", "--readahead", "0", "--no-retain"
    ) as m:
        view = BlockfsMount(m.path)
        try:
            address = os.getxattr(control_dir(m.path), "user.blockfs.prefetch")
            import socket

            assert address.startswith(b"\0")  # abstract: a killed mount leaves no socket file behind
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
                s.connect(address)
                s.sendall(b"5\nnot a block\n")
            if os.geteuid() == 0:  # another user's process is not heard
                child = os.fork()
                if child == 0:
                    status = 1
                    try:
                        os.setuid(65534)
                        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
                            s.connect(address)
                            try:
                                s.sendall(b"0\n1\n")
                            except (BrokenPipeError, ConnectionResetError):
                                pass  # the mount refused it and closed the connection first: expected
                        status = 0
                    finally:
                        os._exit(status)
                assert os.waitstatus_to_exitcode(os.waitpid(child, 0)[1]) == 0
            assert view.announce(np.array([5, 2, 7, 0, 1]))

            def settled() -> bool:
                # A prefetch load is counted when its room is claimed, before it starts: wait until the three
                # are cached and nothing is loading.  The budget is then full, and a load needs room claimed
                # first, so no wrong fourth load can start later: no sleep is needed to give it time to show.
                s = read_stats(m.path)
                return s["cache"]["cached_blocks"] >= 3 and s["cache"]["loading_blocks"] == 0

            wait_until(settled, "the three announced blocks to be cached")
            counters = read_stats(m.path)["counters"]
            assert counters["announcements"] == 1  # the malformed one was dropped
            assert counters["prefetch_loads"] == 3 and counters["block_loads"] == 3  # 0 and 1 did not fit
            before = counters["block_bytes_read"]
            for rel in PackedDataset(tmp_path / "p").files_in_block(2):  # served from memory now
                assert (Path(m.path) / os.fsdecode(rel)).read_bytes() == (
                    tmp_path / "src" / os.fsdecode(rel)
                ).read_bytes()
            after = read_stats(m.path)["counters"]
            assert after["block_bytes_read"] == before and after["file_reads"] == counters["file_reads"]
        finally:
            view.close()
        log = m.log_text()
    assert "prefetch announcement dropped" in log
    if os.geteuid() == 0:
        assert "prefetch announcement refused: process" in log and "of user 65534" in log


# --- processes and the command line ------------------------------------------------------------------
def test_cli_mount_stats_umount_and_refusals(tiny, tmp_path, capsys):
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    try:
        args = ["mount", str(tiny / "packed"), str(mnt), "--cache-size", "1MiB", "--log", str(tmp_path / "log")]
        assert cli.main(args) == 0
        out = capsys.readouterr().out
        assert "memory plan: cache 1.0 MiB" in out and "mounted" in out
        assert is_mounted(mnt)
        (mnt / "class_000" / sorted(os.listdir(mnt / "class_000"))[0]).read_bytes()
        assert cli.main(["mount", str(tiny / "packed"), str(mnt)]) == 2
        assert "already mounted" in capsys.readouterr().err
        assert cli.main(["stats", str(mnt)]) == 0
        text = capsys.readouterr().out
        assert "cache-once" in text and "files served" in text
        assert cli.main(["stats", str(mnt), "--json"]) == 0
        assert json.loads(capsys.readouterr().out)["counters"]["files_served"] >= 1
    finally:
        if is_mounted(mnt):
            assert cli.main(["umount", str(mnt)]) == 0
    assert not is_mounted(mnt)
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("x")
    assert cli.main(["mount", str(tiny / "packed"), str(tmp_path / "full")]) == 2
    assert "not empty" in capsys.readouterr().err
    assert cli.main(["mount", str(tiny / "src"), str(mnt)]) == 2
    assert "not a packed dataset" in capsys.readouterr().err
    assert cli.main(["mount", str(tiny / "packed"), str(tmp_path / "nowhere")]) == 2
    assert "does not exist" in capsys.readouterr().err
    assert cli.main(["umount", str(mnt)]) == 2


def test_a_background_mount_serves_with_the_options_given(tiny, tmp_path, monkeypatch, capsys):
    # The serving process re-runs the user's own command line (relative paths included) plus
    # --foreground, with the budget this process chose: every option reaches it without being listed.
    monkeypatch.chdir(tmp_path)
    shutil.copytree(tiny / "packed", tmp_path / "packed")
    (tmp_path / "mnt").mkdir()
    try:
        args = [
            "mount",
            "packed",
            "mnt",
            "--memory-fraction",
            "0.01",
            "--open-mode",
            "keep_cache",
            "--no-share",
            "--readahead",
            "0",
            "--log",
            "mount.log",
        ]
        assert cli.main(args) == 0
        budget = capsys.readouterr().out.split("memory plan: cache ")[1].split(" (")[0]
        stats = read_stats(tmp_path / "mnt")
        assert stats["mount"]["open_mode"] == "keep_cache" and stats["mount"]["dest"] == str(tmp_path / "packed")
        assert human(stats["plan"]["budget_bytes"]) == budget
        with pytest.raises(OSError):  # --no-share: no share socket
            os.getxattr(control_dir(tmp_path / "mnt"), "user.blockfs.share")
        assert "open keep_cache" in (tmp_path / "mount.log").read_text()
    finally:
        release(tmp_path / "mnt")


def test_a_clean_background_mount_leaves_no_log_behind(tiny, tmp_path, monkeypatch, capsys):
    from blockfs.serve.mount_files import default_log_path

    runtime = tmp_path / "runtime"  # where the default log goes (serve/daemon.log_directory), this test's own
    runtime.mkdir(mode=0o700)
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(runtime))
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    try:
        assert cli.main(["mount", str(tiny / "packed"), str(mnt), "--cache-size", "1MiB"]) == 0
        log = Path(default_log_path(mnt))
        assert log.parent == runtime / "blockfs" and log.exists() and str(log) in capsys.readouterr().out
        assert cli.main(["umount", str(mnt)]) == 0
        wait_until(lambda: not log.exists(), "the clean mount's log to be removed")
    finally:
        release(mnt)


@pytest.mark.parametrize("binding", BINDINGS)
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_sigterm_and_sigint_unmount_cleanly(tiny, tmp_path, sig, binding):
    with mounted(tiny / "packed", tmp_path / "mnt", binding=binding) as m:
        (m.path / "class_000" / sorted(os.listdir(m.path / "class_000"))[0]).read_bytes()
        m.proc.send_signal(sig)
        assert m.proc.wait(15) == 0, m.log_text()
        assert not is_mounted(m.path)
        assert "unmounted" in m.log_text()


@pytest.mark.parametrize("binding", BINDINGS)
def test_umount_clears_the_dead_mount_of_a_killed_server(tiny, tmp_path, binding):
    with mounted(tiny / "packed", tmp_path / "mnt", binding=binding) as m:
        m.proc.send_signal(signal.SIGKILL)
        m.proc.wait(10)
        with pytest.raises(OSError) as raised:
            os.listdir(m.path)
        assert raised.value.errno == errno.ENOTCONN
        assert is_mounted(m.path)
        done = run(sys.executable, "-m", "blockfs", "umount", m.path)
        assert done.returncode == 0, done.stderr
        assert not is_mounted(m.path) and os.listdir(m.path) == []


# --- an unmodified training script -------------------------------------------------------------------
@pytest.mark.torch
def test_training_script_gives_identical_losses_on_the_mount(tmp_path):
    require(has_torch(), "PyTorch")
    src = tmp_path / "train"
    md.make_dataset(src, "learnable", files=192, classes=4, seed=1)
    blockfs.pack(src, tmp_path / "p", block_size=64 << 10, fsync=False)
    script = REPO / "examples" / "train_imagefolder.py"

    def train(root: Path, out: Path) -> dict:
        cmd = [sys.executable, str(script), str(root), "--epochs", "1", "--seed", "0", "--out", str(out)]
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stderr
        return json.loads(out.read_text())

    expected = train(src, tmp_path / "src.json")
    with mounted(tmp_path / "p", tmp_path / "mnt", "--cache-size", "64MiB") as m:
        got = train(m.path, tmp_path / "mnt.json")
        stats = read_stats(m.path)
    assert got["losses"] == expected["losses"] and len(got["losses"]) == 6
    # Every file's bytes reached the kernel from the mount: answered to a read, or pushed into its page cache
    # before the script read it (the kernel route; which of the two wins for a file is a race).
    pushed = stats.get("page_cache", {}).get("files_pushed", 0)
    assert stats["counters"]["files_served"] + pushed >= 192
