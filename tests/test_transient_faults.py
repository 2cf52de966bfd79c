"""Transient is not damaged: a bit flipped in transit, a block file cut short and then replaced, a full disk
tier — each costs at most the reads it touches, never the mount's life, and never more than one log line.
Real mounts over a real HTTP server (:mod:`httpserver`, which flips bits on demand) and a local dataset."""

from __future__ import annotations

import errno
import os
import random
import shutil

import pytest
from capability import has_fuse, require
from httpserver import serving
from mountutil import mounted
from polling import wait_until

import blockfs
from blockfs.client import read_stats
from blockfs.errors import CorruptBlockError

FILES = 120

pytestmark = pytest.mark.fuse  # every test here mounts


@pytest.fixture(autouse=True)
def _fuse():
    require(has_fuse(), "/dev/fuse")


@pytest.fixture(params=[(), ("--no-prefill", "--open-mode", "none")], ids=["defaults", "no-prefill-open-none"])
def mode(request) -> tuple[str, ...]:
    """Every test runs with the defaults (prefill on; the kernel keeps pages, so a file read right once is
    not read here again) and with every read reaching the server and nothing loaded before it is read."""
    return request.param


@pytest.fixture(scope="module")
def tree(tmp_path_factory):
    """(root, {relative path: bytes}): a tree packed into 6 blocks of 20 files, each block under 64 KiB."""
    root = tmp_path_factory.mktemp("transient")
    rng = random.Random(21)
    contents = {}
    for i in range(FILES):
        rel = f"c{i % 3}/f{i:03d}.bin"
        (root / "src" / f"c{i % 3}").mkdir(parents=True, exist_ok=True)
        contents[rel] = rng.randbytes(rng.randint(300, 2500))
        (root / "src" / rel).write_bytes(contents[rel])
    blockfs.pack(root / "src", root / "packed", files_per_block=20, fsync=False)
    return root, contents


def read_every_file(mnt, contents) -> dict[str, int]:
    """Read each file once: {path: errno} of those that failed; a wrong byte fails the test."""
    failed = {}
    for rel, data in contents.items():
        try:
            with open(os.path.join(mnt, rel), "rb") as f:
                assert f.read() == data, rel
        except OSError as e:
            failed[rel] = e.errno
    return failed


def served_copy(tree, tmp_path):
    """A copy of the packed dataset for an HTTP server to serve (a test may damage or replace its files)."""
    shutil.copytree(tree[0] / "packed", tmp_path / "www" / "packed")
    return tmp_path / "www"


def is_block(path: str) -> bool:
    return "/blocks/" in path


def test_a_bit_flipped_in_transit_once_per_block_fails_no_file(tree, tmp_path, mode):
    _, contents = tree
    with serving(served_copy(tree, tmp_path)) as (base, faults):
        faults.corrupt = lambda path, nth: is_block(path) and nth == 1  # every block's first answer
        with mounted(f"{base}/packed", tmp_path / "mnt", "--cache-size", "0", *mode) as m:
            assert read_every_file(m.path, contents) == {}
            errors = read_stats(m.path)["errors"]
            assert not errors["damaged_blocks_reported"] and not errors["damaged_files_read"]
        assert faults.gets and all(n >= 2 for p, n in faults.gets.items() if is_block(p))  # each fetched again


def test_after_the_store_flips_bits_for_a_while_every_file_reads_right_once_it_is_healthy(tree, tmp_path, mode):
    _, contents = tree
    with serving(served_copy(tree, tmp_path)) as (base, faults):
        faults.corrupt = lambda path, nth: is_block(path)
        with mounted(f"{base}/packed", tmp_path / "mnt", "--cache-size", "64MiB", *mode) as m:
            failed = read_every_file(m.path, contents)
            assert failed and set(failed.values()) == {errno.EIO}
            faults.corrupt = None
            assert read_every_file(m.path, contents) == {}


def test_with_a_disk_tier_a_damaged_block_fails_only_its_damaged_file_with_bounded_traffic(tree, tmp_path, mode):
    contents = tree[1]
    www = served_copy(tree, tmp_path)
    path = www / "packed" / "blocks" / "00000001.blk"
    body = bytearray(path.read_bytes())
    body[-1] ^= 0x40  # the last byte of block 1: one file's
    path.write_bytes(bytes(body))
    with blockfs.open_dataset(www / "packed") as ds:
        in_block = [os.fsdecode(p) for p in ds.files_in_block(1)]
        damaged = []
        for rel in in_block:
            try:
                ds.read(rel)
            except CorruptBlockError:
                damaged.append(rel)
    assert len(damaged) == 1 and len(in_block) > 1
    victim = damaged[0]
    with serving(www) as (base, faults):
        args = ("--cache-size", "0", *mode, "--disk-cache", str(tmp_path / "disk"), "--disk-cache-size", "1GiB")
        with mounted(f"{base}/packed", tmp_path / "mnt", *args) as m:
            for _ in range(3):
                assert read_every_file(m.path, contents) == {victim: errno.EIO}
            tier = read_stats(m.path)["storage"]["disk_tier"]
    # The damaged block is fetched a few times per pass (its damaged file's reads), not once or twice per
    # file of it; every other block once into the tier, then read from there.
    assert faults.gets["packed/blocks/00000001.blk"] < len(in_block), faults.gets
    assert all(n <= 2 for p, n in faults.gets.items() if is_block(p) and not p.endswith("01.blk")), faults.gets
    assert tier["blocks"] == 5 and tier["write_failures"] == 0, tier


def test_a_local_block_cut_short_then_replaced_by_rename_reads_right_and_is_cached_again(tree, tmp_path, mode):
    """With the defaults, prefill finds the block damaged at mount, and after the replacement the kernel
    keeps the pages of its files read alone, so no read comes back: the mount looks at the block again by
    itself."""
    _, contents = tree
    packed = tmp_path / "packed"
    shutil.copytree(tree[0] / "packed", packed)
    block = packed / "blocks" / "00000001.blk"
    whole = block.read_bytes()
    os.truncate(block, len(whole) // 2)  # as a copy in progress leaves it
    with mounted(packed, tmp_path / "mnt", "--cache-size", "64MiB", *mode) as m:
        failed = read_every_file(m.path, contents)
        with blockfs.open_dataset(tree[0] / "packed") as ds:
            in_block = {os.fsdecode(p) for p in ds.files_in_block(1)}
        assert set(failed) == in_block and set(failed.values()) == {errno.EIO}
        temp = block.with_name("00000001.blk.partial")
        temp.write_bytes(whole)
        os.rename(temp, block)  # what rsync and cp + mv do
        assert read_every_file(m.path, contents) == {}  # at once: the failed reads kept no descriptor
        # and, once the mount looks at the replaced file again, its block is cached like the others
        wait_until(
            lambda: read_every_file(m.path, contents) == {} and read_stats(m.path)["cache"]["cached_blocks"] == 6,
            "the replaced block to be cached",
        )


def test_a_damaged_object_restored_in_the_store_is_read_and_cached_anew(tree, tmp_path, mode):
    """Damage is remembered for the object's version (ETag): once the object is restored, its block is
    loaded and cached again, not served file by file for the mount's life."""
    _, contents = tree
    www = served_copy(tree, tmp_path)
    path = www / "packed" / "blocks" / "00000001.blk"
    whole = path.read_bytes()
    damaged = bytearray(whole)
    damaged[-1] ^= 0x40
    path.write_bytes(bytes(damaged))
    with serving(www) as (base, faults):
        with mounted(f"{base}/packed", tmp_path / "mnt", "--cache-size", "64MiB", *mode) as m:
            failed = read_every_file(m.path, contents)
            assert len(failed) == 1 and read_stats(m.path)["cache"]["cached_blocks"] == 5
            temp = path.with_name("restored")
            temp.write_bytes(whole)
            os.rename(temp, path)  # a new version: another ETag
            wait_until(
                lambda: read_every_file(m.path, contents) == {} and read_stats(m.path)["cache"]["cached_blocks"] == 6,
                "the restored block to be cached",
            )


def test_a_full_disk_tier_stops_copying_with_one_log_line_and_bounded_traffic(tree, tmp_path, mode):
    require(os.geteuid() == 0, "root (to mount a tmpfs)")
    import subprocess

    _, contents = tree
    disk = tmp_path / "small"
    disk.mkdir()
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=96k,mode=0700", "tmpfs", str(disk)], capture_output=True, text=True
    )
    require(done.returncode == 0, f"mount -t tmpfs ({done.stderr.strip()})")
    try:
        with serving(served_copy(tree, tmp_path)) as (base, faults):
            args = ("--cache-size", "0", *mode, "--disk-cache", str(disk), "--disk-cache-size", "1GiB")
            with mounted(f"{base}/packed", tmp_path / "mnt", *args) as m:
                for _ in range(2):
                    assert read_every_file(m.path, contents) == {}
                tier = read_stats(m.path)["storage"]["disk_tier"]
                log = m.log_text()
            fetched = faults.bytes
        dataset_bytes = sum(len(d) for d in contents.values())
        assert 0 < tier["blocks"] < 6 and tier["budget"] == tier["used"], tier
        full_lines = [line for line in log.splitlines() if "is full" in line]
        assert len(full_lines) == 1 and str(disk) in full_lines[0], log
        assert fetched < 4 * dataset_bytes, (fetched, dataset_bytes)
    finally:
        subprocess.run(["umount", "-l", str(disk)], capture_output=True)


@pytest.mark.serial  # a timed answer: alone, so other tests' load on the machine is not what it measures
def test_metadata_answers_within_a_second_while_40_reads_wait_on_a_store_that_sends_nothing(tree, tmp_path, mode):
    """Lookups, attributes, listings and the control files never wait behind data reads (F9): 40 readers
    wait on a store holding every block answer; ``stat``, ``ls`` and ``stats.json`` still answer.

    The readers' files are spread over every block, and a block's head is fetched once however many
    readers ask for it at once: the store holds one answer per block (6), every reader waiting on one."""
    import threading
    import time

    root, contents = tree
    names = sorted(contents)
    readers = names[::3]
    later = [n for n in names if n not in readers]
    with blockfs.open_dataset(root / "packed") as ds:
        blocks = ds.n_blocks
        assert all(any(os.fsdecode(p) in readers for p in ds.files_in_block(b)) for b in range(blocks))
    with serving(served_copy(tree, tmp_path)) as (base, faults):
        faults.hold = is_block
        with mounted(f"{base}/packed", tmp_path / "mnt", "--cache-size", "0", *mode) as m:
            threads = [
                threading.Thread(target=read_every_file, args=(m.path, {rel: contents[rel]}), daemon=True)
                for rel in readers
            ]
            try:
                for t in threads:
                    t.start()
                wait_until(lambda: faults.held >= blocks, "a read of every block to be waiting on the store")
                timings = {}

                def metadata() -> None:
                    for what, op in (
                        ("stat", lambda: os.stat(os.path.join(m.path, later[0]))),
                        ("ls", lambda: os.listdir(os.path.join(m.path, "c1"))),
                        ("lstat", lambda: os.lstat(os.path.join(m.path, later[1]))),
                        ("stats.json", lambda: read_stats(m.path)),
                    ):
                        started = time.monotonic()
                        op()
                        timings[what] = time.monotonic() - started

                worker = threading.Thread(target=metadata, daemon=True)
                worker.start()
                worker.join(15)
                held = faults.held
            finally:
                faults.released.set()
                for t in threads:
                    t.join(30)
        assert held >= blocks and len(timings) == 4, (held, timings)
        assert max(timings.values()) < 1.0, timings


@pytest.fixture(scope="module")
def empties(tmp_path_factory):
    """A dataset whose ``d`` holds three empty files and a 100 KB one, and whose ``other`` holds one file,
    one file per block (so each empty file's check fetches its own block's header)."""
    root = tmp_path_factory.mktemp("empties")
    for rel, size in (("d/empty0", 0), ("d/empty1", 0), ("d/empty2", 0), ("d/big", 100_000), ("other/x", 10)):
        (root / "src" / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / "src" / rel).write_bytes(b"b" * size)
    blockfs.pack(root / "src", root / "www" / "packed", files_per_block=1, fsync=False)
    return root / "www"


def test_a_store_that_sends_nothing_never_freezes_lookups_or_listings_of_empty_files(empties, tmp_path):
    """Issue 29, 1: the kernel never reads an empty file, so its only check (its block's header says it is
    empty) runs when it is looked up or listed.  With a store that sends nothing, three ``stat``s of empty
    files wait for it; meanwhile another directory, the control files and (kernel route: the checks wait on
    data threads, never on a reader) the empty files' own directory all answer.  On the libfuse routes a
    lookup waits on one of libfuse's threads and holds its directory until it ends (up to the store's request
    timeout): other directories answer.  Once the store answers, the empty files stat as empty."""
    import threading

    www = tmp_path / "www"
    shutil.copytree(empties, www)
    with serving(www) as (base, faults):
        faults.hold = is_block
        with mounted(f"{base}/packed", tmp_path / "mnt", "--no-prefill") as m:
            kernel_route = read_stats(m.path)["mount"]["binding"] == "kernel"
            d = os.path.join(m.path, "d")
            sizes: dict[str, int] = {}
            waiting = [
                threading.Thread(
                    target=lambda n=n: sizes.__setitem__(n, os.stat(os.path.join(d, n)).st_size), daemon=True
                )
                for n in ("empty0", "empty1", "empty2")
            ]
            answers: dict[str, object] = {}
            try:
                for t in waiting:
                    t.start()
                wait_until(lambda: faults.held >= 1, "an empty file's check to wait on the store")

                def others() -> None:  # each would wait forever behind a reader thread held by a check
                    answers["stat other/x"] = os.stat(os.path.join(m.path, "other", "x")).st_size
                    answers["ls other"] = os.listdir(os.path.join(m.path, "other"))
                    answers["stats.json"] = read_stats(m.path)["dataset"]["files"]
                    if kernel_route:
                        answers["ls d"] = sorted(os.listdir(d))
                        answers["stat d/big"] = os.stat(os.path.join(d, "big")).st_size

                probe = threading.Thread(target=others, daemon=True)
                probe.start()
                probe.join(20)  # a bound on a hang, not a timing: none of these needs the store
                held = faults.held
            finally:
                faults.released.set()
                for t in waiting:
                    t.join(60)
            expected = {"stat other/x": 10, "ls other": ["x"], "stats.json": 5}
            if kernel_route:
                expected |= {"ls d": ["big", "empty0", "empty1", "empty2"], "stat d/big": 100_000}
            assert held >= 1 and answers == expected, (held, answers)
            assert sizes == {"empty0": 0, "empty1": 0, "empty2": 0}, sizes
