"""Property tests (issue 17): under any mutation of a small pack, every reader gives the source's exact
bytes or a one-line error, writes nothing outside OUT, never hangs; the mount answers EIO and stays up.

The mutation families and the invariant are in ``mutations.py`` and ``invariant.py``, shared with
``tools/fuzz_dataset.py``, which runs thousands of them; here each family gets a few examples
(derandomized under the CI profile, see conftest.py), each on a fresh copy of one pristine pack.
"""

from __future__ import annotations

import concurrent.futures
import errno
import logging
import os
import random
import tempfile
from pathlib import Path

import pytest
from capability import has_fuse, require
from fuzz.indexutil import entry_of, rewrite_index
from fuzz.invariant import TIER_CASES, check_readers
from fuzz.mutations import (
    FAMILIES,
    Pristine,
    fresh_copy,
    make_pristine,
    mutate_block_data,
    mutate_block_foreign,
    mutate_block_header,
    mutate_block_length,
    remove_tree,
)
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from mountutil import mounted

from blockfs import cli
from blockfs.core import digest as dg
from blockfs.core import format as fmt
from blockfs.core.dataset import PackedDataset
from blockfs.errors import CorruptBlockError

# ~0.1-0.2 s each here (39 reader runs), 14 families: 20 keep this file near a minute of the suite's CPU;
# depth is tools/fuzz_dataset.py's job, which runs thousands.
EXAMPLES_PER_FAMILY = 20


@pytest.fixture(scope="module")
def pristine(tmp_path_factory) -> Pristine:
    return make_pristine(tmp_path_factory.mktemp("mutations"))


def _scratch(p: Pristine) -> Path:
    return Path(tempfile.mkdtemp(dir=p.pack.parent))


@pytest.mark.parametrize("family", sorted(FAMILIES))
@settings(max_examples=EXAMPLES_PER_FAMILY, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(rnd=st.randoms(use_true_random=False))
def test_every_reader_keeps_the_invariant_under_mutation(pristine, family, rnd):
    work = _scratch(pristine)
    try:
        dest = fresh_copy(pristine, work)
        steps = FAMILIES[family].mutate(dest, rnd, pristine)
        problems, tally = check_readers(pristine, dest, work, FAMILIES[family].authentic)
        assert not problems, f"{family}: {'; '.join(steps)}\n" + "\n".join(problems)
        assert sum(tally.values()) == pristine.readers  # every reader ran and was judged
    finally:
        remove_tree(work)


@pytest.mark.parametrize("family", sorted(FAMILIES))
@settings(max_examples=EXAMPLES_PER_FAMILY // 4, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(rnd=st.randoms(use_true_random=False))
def test_under_a_pinned_name_no_reader_serves_a_forged_byte(pristine, family, rnd):
    """Issue 23: with ``--expect`` the pristine pack's name, any mutation (a re-signed index and a block
    forged with its CRC kept included) gives the source exactly or a one-line error, never other bytes."""
    name = dg.name_of((pristine.pack / fmt.METADATA_NAME).read_bytes())
    work = _scratch(pristine)
    try:
        dest = fresh_copy(pristine, work)
        steps = FAMILIES[family].mutate(dest, rnd, pristine)
        problems, tally = check_readers(pristine, dest, work, authentic=True, expect=name)
        assert not problems, f"{family} (pinned): {'; '.join(steps)}\n" + "\n".join(problems)
        assert sum(tally.values()) == pristine.readers
    finally:
        remove_tree(work)


def test_the_invariant_sees_wrong_bytes_tracebacks_and_writes_outside_out(pristine, monkeypatch):
    """The checker itself: a reader that serves a flipped byte, one that raises, and an unpack that writes
    next to OUT must each be reported."""
    work = _scratch(pristine)
    try:
        dest = fresh_copy(pristine, work)
        assert check_readers(pristine, dest, work, authentic=True)[0] == []
        real_pieces = PackedDataset.read_pieces

        def flipped(self, e):
            for piece in real_pieces(self, e):
                yield bytes([piece[0] ^ 1]) + piece[1:]

        monkeypatch.setattr(PackedDataset, "read_pieces", flipped)
        problems = check_readers(pristine, dest, _fresh_work(work, "a"), authentic=True)[0]
        assert any("wrong bytes" in p for p in problems) and any("unpack wrote wrong bytes" in p for p in problems)

        def raises(self, e):
            raise KeyError("slot")

        monkeypatch.setattr(PackedDataset, "read_pieces", raises)
        problems = check_readers(pristine, dest, _fresh_work(work, "b"), authentic=True)[0]
        assert any("exit status -1" in p and "Traceback" in p for p in problems), problems

        def escapes(self, e):
            (Path(work) / "b" / "escaped").write_bytes(b"")
            return real_pieces(self, e)

        monkeypatch.setattr(PackedDataset, "read_pieces", escapes)
        problems = check_readers(pristine, dest, _fresh_work(work, "c"), authentic=True)[0]
        assert not any("outside OUT" in p for p in problems)  # b is not next to c's OUT
        monkeypatch.setattr(
            PackedDataset,
            "read_pieces",
            lambda self, e: ((work / "d" / "sentinel" / "x").write_bytes(b""), real_pieces(self, e))[1],
        )
        problems = check_readers(pristine, dest, _fresh_work(work, "d"), authentic=True)[0]
        assert any("outside OUT" in p for p in problems), problems
    finally:
        remove_tree(work)


def _fresh_work(work: Path, name: str) -> Path:
    (work / name).mkdir()
    return work / name


# --- the mount ---------------------------------------------------------------------------------------
def _damage_blocks(p: Pristine, dest: Path, seed: int) -> tuple[set[int], list[str]]:
    """Damage the header of one block, data of another, the length of a third, replace a fourth by a
    foreign one; return the blocks that now differ from the pristine pack, and what was done."""
    rnd = random.Random(seed)
    steps = []
    for mutate in (mutate_block_header, mutate_block_data, mutate_block_length):
        steps += mutate(dest, rnd)
    steps += mutate_block_foreign(dest, rnd, p.other)
    damaged = set()
    for name in sorted(os.listdir(p.pack / fmt.BLOCKS_DIR)):
        path = dest / fmt.BLOCKS_DIR / name
        if not path.exists() or path.read_bytes() != (p.pack / fmt.BLOCKS_DIR / name).read_bytes():
            damaged.add(int(name.split(".")[0]))
    return damaged, steps


def _intact_file(p: Pristine, damaged: set[int]) -> bytes:
    with PackedDataset(p.pack) as ds:
        for rel in sorted(p.files):
            e = ds.lookup(rel)
            if int(ds.index.arrays["block"][e]) not in damaged and p.files[rel]:
                return rel
    raise AssertionError(f"every block is damaged: {damaged}")


def _read_all_in_threads(p: Pristine, read, threads: int = 8, passes: int = 3) -> dict[str, int]:
    """Read every file ``passes`` times from ``threads`` threads: each read is the exact bytes or EIO."""

    def one(rel: bytes) -> str:
        try:
            data = read(rel)
        except OSError as e:
            assert e.errno == errno.EIO, (rel, e)
            return "eio"
        assert data == p.files[rel], f"{rel!r}: wrong bytes ({len(data)} of {len(p.files[rel])})"
        return "exact"

    with concurrent.futures.ThreadPoolExecutor(threads) as pool:
        results = list(pool.map(one, sorted(p.files) * passes))
    return {k: results.count(k) for k in ("exact", "eio")}


def _eio_lines(log: str, damaged: set[int]) -> None:
    assert "Traceback" not in log, log
    lines = [line for line in log.splitlines() if "EIO" in line]
    assert 1 <= len(lines) <= len(damaged), log
    for line in lines:
        assert any(f"block {b} " in line for b in damaged), line


@pytest.mark.parametrize("route", ["kernel", "mfusepy"])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_the_assembled_mount_answers_exact_bytes_or_eio_under_block_damage(pristine, tmp_path, seed, route, caplog):
    """Both adapters, called as the kernel calls them: every file's exact bytes or EIO, one log line a block."""
    from kernelcalls import KernelCalls

    from blockfs.serve.mount_options import MountOptions
    from blockfs.serve.server import assembled

    dest = fresh_copy(pristine, tmp_path)
    damaged, steps = _damage_blocks(pristine, dest, seed)
    intact = _intact_file(pristine, damaged)

    def read(rel: bytes) -> bytes:
        if route == "kernel":
            return calls.read(rel)
        try:
            return fs.read("/" + rel.decode(fs_module.ENCODING), 1 << 20, 0, None)
        except fs.FuseOSError as e:
            raise OSError(e.errno, os.strerror(e.errno)) from None

    options = MountOptions(cache_bytes=1 << 20, prefill=False, lock_memory=False)
    with caplog.at_level(logging.INFO), assembled(dest, tmp_path / "mnt", options, route=route) as fs:
        if route == "kernel":
            calls = KernelCalls(fs)
        else:
            fs_module = pytest.importorskip("blockfs.serve.fuse.libfuse_adapter", exc_type=ImportError)
        counts = _read_all_in_threads(pristine, read)
        assert read(intact) == pristine.files[intact]  # still serving
    assert counts["eio"] > 0 and counts["exact"] > 0, (steps, counts)
    assert not any(r.exc_info for r in caplog.records), steps
    _eio_lines("\n".join(r.getMessage() for r in caplog.records), damaged)


INDEX_FAMILIES = sorted(f for f in FAMILIES if not f.startswith("block-"))


@pytest.mark.parametrize("route", ["kernel", "mfusepy"])
@pytest.mark.parametrize("family", INDEX_FAMILIES)
@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(rnd=st.randoms(use_true_random=False))
def test_the_assembled_mount_refuses_or_serves_a_damaged_index_right(pristine, family, route, rnd):
    """A damaged or forged index or metadata: the mount refuses to start with a BlockfsError, or every
    operation on the tree answers the source's bytes or an errno, never another exception."""
    fs_module = pytest.importorskip("blockfs.serve.fuse.libfuse_adapter", exc_type=ImportError)
    from blockfs.errors import BlockfsError
    from blockfs.serve.mount_options import MountOptions
    from blockfs.serve.server import assembled

    work = _scratch(pristine)
    try:
        dest = fresh_copy(pristine, work)
        steps = FAMILIES[family].mutate(dest, rnd, pristine)
        options = MountOptions(cache_bytes=1 << 20, prefill=False, lock_memory=False)
        try:
            with assembled(dest, work / "mnt", options, route=route) as fs:
                if route == "kernel":
                    _walk_kernel(fs, pristine, FAMILIES[family].authentic, steps)
                else:
                    _walk_mount(fs, fs_module, pristine, FAMILIES[family].authentic, steps)
        except BlockfsError as e:
            assert len(str(e).splitlines()) == 1, (steps, str(e))
    finally:
        remove_tree(work)


def _walk_mount(fs, fs_module, p: Pristine, authentic: bool, steps: list[str]) -> None:
    """Every directory listed, every name stat'ed, every source file read, through the adapter's operations."""
    enc = fs_module.ENCODING

    def answer(op, *args):
        try:
            return op(*args)
        except fs.FuseOSError as e:
            return e.errno

    pending = ["/"]
    while pending:
        path = pending.pop()
        listing = answer(fs.readdir, path, None)
        if isinstance(listing, int):
            continue
        for name, _attr, _off in listing:
            if name in (".", "..") or (path == "/" and name == fs.view.control.name):
                continue
            child = path.rstrip("/") + "/" + name
            attr = answer(fs.getattr, child)
            if isinstance(attr, dict) and attr["st_mode"] & 0o170000 == 0o040000:
                pending.append(child)
    for rel, data in sorted(p.files.items()):
        got = answer(fs.read, "/" + rel.decode(enc), 1 << 20, 0, None)
        if authentic:
            assert got == data or got == errno.EIO, (rel, steps, got if isinstance(got, int) else len(got))
        else:
            assert got == data or isinstance(got, int), (rel, steps, len(got))


def _walk_kernel(fs, p: Pristine, authentic: bool, steps: list[str]) -> None:
    """What :func:`_walk_mount` does, through the kernel-route adapter's requests (by node id)."""
    from kernelcalls import KernelCalls

    calls = KernelCalls(fs)
    pending = [1]
    while pending:
        err, listing = calls.listdir(pending.pop())
        for _name, child, mode in listing:
            if child and mode & 0o170000 == 0o040000:
                pending.append(child)
    for rel, data in sorted(p.files.items()):
        try:
            got = calls.read(rel)
        except OSError as e:
            got = e.errno
        if authentic:
            assert got == data or got == errno.EIO, (rel, steps, got if isinstance(got, int) else len(got))
        else:
            assert got == data or isinstance(got, int), (rel, steps, len(got))


@pytest.mark.fuse
def test_a_real_mount_answers_exact_bytes_or_eio_under_block_damage_and_stays_up(pristine, tmp_path):
    require(has_fuse(), "/dev/fuse")
    from blockfs.serve.daemon import is_mounted

    dest = fresh_copy(pristine, tmp_path)
    damaged, steps = _damage_blocks(pristine, dest, seed=3)
    intact = _intact_file(pristine, damaged)
    with mounted(dest, tmp_path / "mnt", "--open-mode", "none") as m:
        mnt = os.fsencode(m.path)

        def read(rel: bytes) -> bytes:
            with open(os.path.join(mnt, rel), "rb") as f:
                return f.read()

        counts = _read_all_in_threads(pristine, read)
        assert read(intact) == pristine.files[intact] and is_mounted(m.path) and m.proc.poll() is None
        log = m.log_text()
    assert counts["eio"] > 0 and counts["exact"] > 0, (steps, counts)
    _eio_lines(log, damaged)


# --- the disk tier and fetched bytes (issue 21) --------------------------------------------------------
@pytest.mark.parametrize("case", sorted(TIER_CASES))
@settings(max_examples=EXAMPLES_PER_FAMILY, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(rnd=st.randoms(use_true_random=False))
def test_the_disk_tier_and_fetched_bytes_keep_the_invariant(pristine, case, rnd):
    """fetched-bytes: bits flipped in transit never serve wrong bytes, never reach a tier's copy and never
    outlive the flaky store; tier-copies: rotten, cut, foreign, linked or FIFO copies never fail a read
    while the dataset's blocks are healthy, and nothing outside the tier is touched (invariant.py)."""
    work = _scratch(pristine)
    try:
        problems = TIER_CASES[case](pristine, work, rnd)
        assert not problems, "\n".join(problems)
    finally:
        remove_tree(work)


# --- regressions the mutations found -------------------------------------------------------------------
def test_a_forged_zero_size_is_checked_against_the_block_by_cat_and_unpack(pristine, tmp_path, capsys):
    """index-arrays-resigned #307 (seed 0): a file's size set to 0 in a re-signed index made ``cat`` print
    nothing and exit 0 (and ``unpack`` write an empty file): a read of no bytes never looked at the block."""

    dest = fresh_copy(pristine, tmp_path)
    rel = next(r for r, data in sorted(pristine.files.items()) if data)
    rewrite_index(dest, lambda a: a["size"].__setitem__(entry_of(a, rel), 0))
    with PackedDataset(dest) as ds:
        with pytest.raises(CorruptBlockError, match="the index says 0"):
            list(ds.read_pieces(ds.lookup(rel)))
        empty = next(r for r, data in sorted(pristine.files.items()) if not data)
        assert list(ds.read_pieces(ds.lookup(empty))) == []  # a file that is empty still reads as empty
    for argv in (["cat", dest, rel], ["unpack", dest, tmp_path / "out"]):
        assert cli.main([os.fsdecode(a) for a in argv]) == 2
        err = capsys.readouterr().err
        assert len(err.strip().splitlines()) == 1 and "the index says 0" in err, err


def test_mutation_index_arrays_resigned_307_keeps_the_invariant(pristine, tmp_path):
    dest = fresh_copy(pristine, tmp_path)
    steps = FAMILIES["index-arrays-resigned"].mutate(dest, random.Random("0:index-arrays-resigned:307"), pristine)
    assert steps[0] == "size[12] 450 -> 0", steps  # the mutation that found it
    assert check_readers(pristine, dest, tmp_path, authentic=False)[0] == []


@pytest.mark.fuse
@pytest.mark.parametrize("prefill", [(), ("--no-prefill",)], ids=["prefill", "no-prefill"])
def test_a_forged_zero_size_fails_through_the_mount(pristine, tmp_path, prefill):
    """The same forged size through a real mount: the kernel never reads a file of size 0, so the size
    is checked against the block when the file is looked up; a file that is empty still opens empty.
    Without prefill no header is in memory when the directory is listed: the kernel route lists both
    files without attributes and checks them at the lookup, on a data thread (issue 29, 1)."""
    require(has_fuse(), "/dev/fuse")
    dest = fresh_copy(pristine, tmp_path)
    rel = next(r for r, data in sorted(pristine.files.items()) if data)
    empty = next(r for r, data in sorted(pristine.files.items()) if not data)
    rewrite_index(dest, lambda a: a["size"].__setitem__(entry_of(a, rel), 0))
    with mounted(dest, tmp_path / "mnt", "--open-mode", "none", *prefill) as m:
        mnt = os.fsencode(m.path)
        os.listdir(os.path.join(mnt, os.path.dirname(rel)))  # a listing first: its attributes must not count
        with pytest.raises(OSError) as raised, open(os.path.join(mnt, rel), "rb") as f:
            f.read()
        assert raised.value.errno == errno.EIO
        with open(os.path.join(mnt, empty), "rb") as f:
            assert f.read() == b""
        log = m.log_text()
    assert "Traceback" not in log and len([x for x in log.splitlines() if "EIO" in x]) == 1, log
