"""Hostile and damaged indexes and metadata: every one is a one-line error naming the field, found at open.

Most cases re-sign the index's CRC in blockfs.json after damaging it (see ``indexutil.resign``), as a
hostile writer who knows the format would: the CRC catches accidents, the schema and content checks
behind it must catch the rest.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys

import numpy as np
import pytest
from fuzz.indexutil import edit_metadata, patch_array, resign, rewrite_toc

import blockfs
from blockfs import cli
from blockfs.core.index import KIND_FILE, PackedIndex
from blockfs.core.verify import verify
from blockfs.errors import CorruptBlockError, FormatError, IndexFormatError, UnsupportedVersionError

# A hung read loop must fail the test, not hang the suite.
CLI_TIMEOUT_S = 120


@pytest.fixture
def packed(tmp_path, edge_tree):
    blockfs.pack(edge_tree, tmp_path / "p", block_size=2000)
    return tmp_path / "p"


def _cli(capsys, *argv) -> tuple[int, str]:
    rc = cli.main(list(map(os.fspath, argv)))
    return rc, capsys.readouterr().err


def _one_line_error(capsys, *argv) -> str:
    rc, err = _cli(capsys, *argv)
    assert rc == 2, err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err, err
    return err


def _first_file(packed) -> int:
    with blockfs.open_dataset(packed) as ds:
        return int(np.flatnonzero((ds.index.arrays["kind"] == KIND_FILE) & (ds.index.arrays["size"] > 0))[0])


# --- 17 #2: the index CRC ------------------------------------------------------------------------------
def test_a_flipped_size_bit_is_caught_by_the_index_crc_at_open(packed, capsys):
    e = _first_file(packed)
    patch_array(packed / "index.bfi", "size", lambda a: a.__setitem__(e, a[e] ^ 1))
    with pytest.raises(IndexFormatError, match=r"index\.bfi: checksum mismatch .*blockfs pack"):
        blockfs.open_dataset(packed)
    for command in ("info", "ls", "verify"):
        assert "checksum mismatch" in _one_line_error(capsys, command, packed)


def test_an_index_from_another_pack_is_refused(tmp_path, edge_tree):
    blockfs.pack(edge_tree, tmp_path / "a", block_size=2000, seed=0)
    blockfs.pack(edge_tree, tmp_path / "b", block_size=2000, seed=1)
    (tmp_path / "a" / "index.bfi").write_bytes((tmp_path / "b" / "index.bfi").read_bytes())
    with pytest.raises(IndexFormatError, match="not this dataset's"):
        blockfs.open_dataset(tmp_path / "a")


# --- 17 #6: the index lives in memory the process owns ------------------------------------------------
def test_truncating_or_replacing_the_index_file_does_not_reach_an_open_dataset(packed, edge_tree):
    index_file = packed / "index.bfi"
    good = index_file.read_bytes()
    with blockfs.open_dataset(packed) as ds:
        files = list(_all_files(edge_tree))
        os.truncate(index_file, 0)  # a file-backed map would SIGBUS on the next lookup
        for rel in files:
            assert ds.read(rel) == _source_bytes(edge_tree, rel), rel
        with open(index_file, "r+b") as f:  # overwritten in place with other bytes
            f.write(bytes(len(good)))
        for rel in files:
            assert ds.stat(rel).size == len(_source_bytes(edge_tree, rel))
            assert ds.read(rel) == _source_bytes(edge_tree, rel), rel
        assert ds.listdir("class_a") == sorted(os.listdir(os.path.join(edge_tree, b"class_a").decode()))


@pytest.mark.fuse
def test_a_live_mount_survives_its_index_file_being_truncated(packed, edge_tree, tmp_path):
    from capability import has_fuse, require
    from mountutil import mounted

    require(has_fuse(), "/dev/fuse")
    files = list(_all_files(edge_tree))
    with mounted(packed, tmp_path / "mnt", "--open-mode", "none") as m:
        os.truncate(packed / "index.bfi", 0)
        for rel in files:
            with open(os.path.join(os.fsencode(m.path), rel), "rb") as f:
                assert f.read() == _source_bytes(edge_tree, rel), rel
        assert m.proc.poll() is None, m.log_text()
        # The control directory serves the index the mount serves from, not the damaged file.
        index = PackedIndex(os.path.join(m.path, ".blockfs", "index.bfi"))
        assert index.n_entries > len(files)
        index.close()


def _all_files(root: bytes):
    for dirpath, _dirs, names in os.walk(root):
        for name in names:
            path = os.path.join(dirpath, name)
            if not os.path.islink(path):
                yield os.path.relpath(path, root)


def _source_bytes(root: bytes, rel: bytes) -> bytes:
    with open(os.path.join(root, rel), "rb") as f:
        return f.read()


# --- 17 #10 / 12: the table of contents against one schema --------------------------------------------
def _pop(*keys):
    """A mutation that deletes ``doc[k0][k1]...`` (and returns None: the document is changed in place)."""

    def mutate(doc):
        for k in keys[:-1]:
            doc = doc[k]
        doc.pop(keys[-1])

    return mutate


def _set_spec(name, index, value):
    return lambda toc: toc["arrays"][name].__setitem__(index, value)


TOC_MUTATIONS = {
    "dtype xyz": (_set_spec("size", 0, "xyz"), "'size' has dtype 'xyz'"),
    "dtype a number": (_set_spec("size", 0, 5), "'size' has dtype 5"),
    "object dtype": (_set_spec("mode", 0, "|O"), "'mode' has dtype '|O'"),
    "narrower size dtype": (_set_spec("size", 0, "<u4"), "'size' has dtype '<u4'"),
    "big-endian dtype": (_set_spec("block", 0, ">i4"), "'block' has dtype '>i4'"),
    "spec not a list": (lambda t: t["arrays"].__setitem__("crc", "x"), "'crc': spec must be"),
    "spec too short": (_pop("arrays", "crc", 2), "'crc': spec must be"),
    "count 1.5": (_set_spec("kind", 2, 1.5), "'kind': offset and count must be integers"),
    "count negative": (_set_spec("label", 2, -1), "'label': offset and count must be integers"),
    "offset a string": (_set_spec("ino", 1, "64"), "'ino': offset and count must be integers"),
    "offset unaligned": (lambda t: t["arrays"]["nlink"].__setitem__(1, t["arrays"]["nlink"][1] + 1), "'nlink': offset"),
    "offset in the header": (_set_spec("parent", 1, 0), "'parent': offset 0"),
    "runs past the end": (_set_spec("paths", 2, 1 << 40), "'paths' runs past the end"),
    "empty array list": (lambda t: t.__setitem__("arrays", {}), "no 'arrays'"),
    "array list missing": (_pop("arrays"), "no 'arrays'"),
    "array list a list": (lambda t: t.__setitem__("arrays", [1]), "no 'arrays'"),
    "toc a list": (lambda t: [t], "no 'arrays'"),
    "missing path_offsets": (_pop("arrays", "path_offsets"), "'path_offsets' is missing"),
    "missing block_counts": (_pop("arrays", "block_counts"), "'block_counts' is missing"),
    "missing block_files": (_pop("arrays", "block_files"), "'block_files' is missing"),
    "unknown array": (lambda t: t["arrays"].__setitem__("extra", ["u1", 64, 0]), "unknown arrays"),
    "n_entries wrong": (lambda t: t.__setitem__("n_entries", t["n_entries"] + 1), "'n_entries'"),
    "n_entries a float": (lambda t: t.__setitem__("n_entries", float(t["n_entries"])), "'n_entries'"),
    "a column too short": (_set_spec("mtime_ns", 2, 1), "column 'mtime_ns' has 1 rows"),
}


@pytest.mark.parametrize("case", sorted(TOC_MUTATIONS))
def test_a_table_of_contents_off_the_schema_is_an_index_format_error_naming_the_field(packed, capsys, case):
    mutate, message = TOC_MUTATIONS[case]
    rewrite_toc(packed / "index.bfi", mutate)
    with pytest.raises(IndexFormatError, match=re.escape(message)):
        PackedIndex(packed / "index.bfi")
    resign(packed)
    for command in ("info", "ls", "verify"):
        assert message in _one_line_error(capsys, command, packed)


def test_a_table_of_contents_that_is_not_json_is_named(packed):
    raw = bytearray((packed / "index.bfi").read_bytes())
    raw[16:20] = b"[[[["
    (packed / "index.bfi").write_bytes(bytes(raw))
    with pytest.raises(IndexFormatError, match="damaged table of contents"):
        PackedIndex(packed / "index.bfi")
    raw[12:16] = (1 << 31).to_bytes(4, "little")  # a length past the end of the file
    (packed / "index.bfi").write_bytes(bytes(raw))
    with pytest.raises(IndexFormatError, match="table of contents runs past the end"):
        PackedIndex(packed / "index.bfi")


def test_index_versions_other_than_this_one_name_the_fix(packed):
    raw = bytearray((packed / "index.bfi").read_bytes())
    raw[8:10] = (0).to_bytes(2, "little")
    (packed / "index.bfi").write_bytes(bytes(raw))
    with pytest.raises(
        IndexFormatError, match="older than this blockfs reads .*pack the source again with 'blockfs pack'"
    ):
        PackedIndex(packed / "index.bfi")
    raw[8:10] = (7).to_bytes(2, "little")
    (packed / "index.bfi").write_bytes(bytes(raw))
    with pytest.raises(UnsupportedVersionError, match="upgrade blockfs"):
        PackedIndex(packed / "index.bfi")


# --- 17 #10: array contents, block_offsets / block_files -----------------------------------------------
def _swap_first_two(a):
    a[[0, 1]] = a[[1, 0]]


ONCE = "'block_files' does not list every file exactly once"
CONTENT_MUTATIONS = {
    "block_files out of range": ("block_files", lambda a: a.__setitem__(0, 10**6), "'block_files'"),
    "block_files repeats a file": ("block_files", lambda a: a.__setitem__(1, a[0]), ONCE),
    "block_files out of slot order": ("block_files", _swap_first_two, "'block_files' is not in slot order"),
    "block_files names a directory": ("block_files", lambda a: a.__setitem__(0, 0), ONCE),
    "block_offsets decrease": ("block_offsets", lambda a: a.__setitem__(1, a[-1]), "'block_offsets' decreases"),
    "block_offsets start late": ("block_offsets", lambda a: a.__setitem__(0, 1), "'block_offsets' starts at 1"),
    "block_offsets shifted": ("block_offsets", lambda a: a.__setitem__(1, a[1] + 1), "'block_files' puts a file"),
    "block_offsets end short": ("block_offsets", lambda a: a.__setitem__(-1, a[-1] - 1), "'block_offsets' ends at"),
    "link_offsets past the table": ("link_offsets", lambda a: a.__setitem__(-1, a[-1] + 5), "'link_offsets' ends"),
    "hash_start decreases": ("hash_start", lambda a: a.__setitem__(1, a[-1]), "'hash_start' decreases"),
    "parent out of range": ("parent", lambda a: a.__setitem__(1, 10**6), "column 'parent'"),
    "label below -1": ("label", lambda a: a.__setitem__(1, -7), "column 'label'"),
    "size bit 62": ("size", lambda a: a.__setitem__(int(np.argmax(a)), a.max() | (1 << 62)), "column 'size'"),
    "unknown kind": ("kind", lambda a: a.__setitem__(1, 9), "column 'kind'"),
    # The mount sizes per-(block, slot) arrays by these counts (serve/cache/retain.py): a forged one is refused.
    "block_counts past the files": ("block_counts", lambda a: a.__setitem__(0, 2**32 - 1), "'block_counts' gives"),
}


@pytest.mark.parametrize("case", sorted(CONTENT_MUTATIONS))
def test_inconsistent_arrays_are_an_index_format_error_naming_the_array(packed, capsys, case):
    name, transform, message = CONTENT_MUTATIONS[case]
    patch_array(packed / "index.bfi", name, transform)
    with pytest.raises(IndexFormatError, match=re.escape(message)):
        PackedIndex(packed / "index.bfi")
    resign(packed)
    for command in ("info", "verify"):
        assert message in _one_line_error(capsys, command, packed)


@pytest.mark.parametrize("case", sorted(c for c in CONTENT_MUTATIONS if c.startswith("block_")))
def test_the_block_layout_is_checked_across_pieces(packed, monkeypatch, case):
    """The block layout's checks run in pieces: with a piece of one member, every pair that must be in
    order, and every member's block, lies across two pieces; each forgery is still found, and named."""
    from blockfs.core import index_checks

    monkeypatch.setattr(index_checks, "VALIDATE_PIECE", 1)
    name, transform, message = CONTENT_MUTATIONS[case]
    PackedIndex(packed / "index.bfi").close()  # the packed index passes in pieces of one
    patch_array(packed / "index.bfi", name, transform)
    with pytest.raises(IndexFormatError, match=re.escape(message)):
        PackedIndex(packed / "index.bfi")


# --- 17 #7: sizes the blocks do not hold: no read loop spins ------------------------------------------
def _run_cli(*argv) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "blockfs", *map(os.fspath, argv)], capture_output=True, text=True, timeout=CLI_TIMEOUT_S
    )


def test_a_size_with_bit_62_set_is_refused_at_open_by_cat_and_unpack(packed, tmp_path):
    e = _first_file(packed)
    with blockfs.open_dataset(packed) as ds:
        rel = ds.path_of(e)
    patch_array(packed / "index.bfi", "size", lambda a: a.__setitem__(e, a[e] | (1 << 62)))
    resign(packed)
    for argv in (("cat", packed, rel), ("unpack", packed, tmp_path / "out")):
        done = _run_cli(*argv)
        assert done.returncode == 2 and "column 'size'" in done.stderr, done.stderr
        assert len(done.stderr.strip().splitlines()) == 1, done.stderr


def test_a_size_larger_than_the_block_holds_stops_cat_and_unpack_with_one_line(packed, tmp_path):
    e = _first_file(packed)
    with blockfs.open_dataset(packed) as ds:
        rel = ds.path_of(e)
        size = int(ds.index.arrays["size"][e])
        assert size + 1 <= int(ds.index.arrays["block_sizes"][ds.index.arrays["block"][e]])
    patch_array(packed / "index.bfi", "size", lambda a: a.__setitem__(e, size + 1))
    resign(packed)
    # The block's own header disagrees with the index (the store's check), or the read comes up short.
    said = f"the index says {size + 1}|short read"
    with blockfs.open_dataset(packed) as ds, pytest.raises(CorruptBlockError, match=said):
        b"".join(ds.read_pieces(e))
    for argv in (("cat", packed, rel), ("unpack", packed, tmp_path / "out")):
        done = _run_cli(*argv)
        assert done.returncode == 2 and re.search(said, done.stderr), done.stderr
        assert len(done.stderr.strip().splitlines()) == 1, done.stderr


# --- 17 #13 / #8: verify lists what differs, and reports absurd headers -------------------------------
def test_verify_lists_only_the_files_that_differ(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    for i in range(20):
        (src / f"f{i:02d}").write_bytes(bytes([i]) * 100)
    blockfs.pack(src, tmp_path / "p", files_per_block=20)
    with blockfs.open_dataset(tmp_path / "p") as ds:
        e = ds.lookup("f07")
    patch_array(tmp_path / "p" / "index.bfi", "crc", lambda a: a.__setitem__(e, a[e] ^ 1))
    resign(tmp_path / "p")
    with blockfs.open_dataset(tmp_path / "p") as ds:
        problems = verify(ds)
    assert len(problems) == 1 and "1 files differ" in problems[0].message
    assert problems[0].files == ["f07"]


def test_verify_reports_a_block_whose_header_claims_absurd_sizes_and_goes_on(packed):
    with blockfs.open_dataset(packed) as ds:
        n_blocks = ds.n_blocks
        victim = ds.store.block_paths[0]
        lost = sorted(os.fsdecode(p) for p in ds.files_in_block(0))
    with open(victim, "r+b") as f:
        f.seek(32)  # N, the number of files: ~2**32 makes the header ~51 GB
        f.write((0xFFFFFFF0).to_bytes(4, "little"))
    seen = []
    with blockfs.open_dataset(packed) as ds:
        problems = verify(ds, on_block=seen.append)
    assert seen == list(range(n_blocks))
    assert [p.what for p in problems] == ["block 0"]
    assert sorted(problems[0].files) == lost


# --- 17 #11: blockfs.json against one schema -----------------------------------------------------------
META_MUTATIONS = {
    "n_blocks null": (lambda m: m.__setitem__("n_blocks", None), "'n_blocks' must be an integer"),
    "n_blocks a list": (lambda m: m.__setitem__("n_blocks", [1]), "'n_blocks' must be an integer"),
    "n_blocks missing": (_pop("n_blocks"), "'n_blocks' is missing"),
    "n_blocks 1.0": (lambda m: m.__setitem__("n_blocks", 1.0), "'n_blocks' must be an integer"),
    "index 0": (lambda m: m.__setitem__("index", 0), "'index' must be an object"),
    "index crc a string": (lambda m: m["index"].__setitem__("crc32", "0x1"), "'index.crc32' must be"),
    "index crc missing": (_pop("index", "crc32"), "'index.crc32' is missing"),
    "index file elsewhere": (lambda m: m["index"].__setitem__("file", "../x"), "'index.file' must be"),
    "classes a string": (lambda m: m.__setitem__("classes", "abc"), "'classes' must be null or a list"),
    "classes of numbers": (lambda m: m.__setitem__("classes", [1, 2]), "'classes' must be null or a list"),
    "pack missing": (_pop("pack"), "'pack' is missing"),
    "pack a list": (lambda m: m.__setitem__("pack", []), "'pack' must be an object"),
    "pack.block_size a string": (lambda m: m["pack"].__setitem__("block_size", "2k"), "'pack.block_size' must be"),
    "pack.seed missing": (_pop("pack", "seed"), "'pack.seed' is missing"),
    "n_dirs missing": (_pop("n_dirs"), "'n_dirs' is missing"),
    "file_bytes negative": (lambda m: m.__setitem__("file_bytes", -1), "'file_bytes' must be"),
    "format_version a string": (lambda m: m.__setitem__("format_version", "1"), "'format_version' must be an integer"),
    "source a string": (lambda m: m.__setitem__("source", "tar"), "'source' must be an object"),
    "not an object": (lambda m: [m], "not blockfs metadata"),
}


@pytest.mark.parametrize("case", sorted(META_MUTATIONS))
def test_metadata_off_the_schema_is_a_format_error_naming_the_field(packed, capsys, case):
    mutate, message = META_MUTATIONS[case]
    edit_metadata(packed, mutate)
    with pytest.raises(FormatError, match=re.escape(message)):
        blockfs.open_dataset(packed)
    for command in ("info", "ls", "verify"):
        assert message in _one_line_error(capsys, command, packed)


def test_an_older_format_version_says_how_to_repack(packed):
    edit_metadata(packed, lambda m: m.__setitem__("format_version", 0))
    with pytest.raises(UnsupportedVersionError, match="older than this blockfs reads.*blockfs pack SRC"):
        blockfs.open_dataset(packed)


def test_a_label_beyond_the_classes_is_refused_at_open_not_an_index_error_in_info(packed, capsys):
    edit_metadata(packed, lambda m: m.__setitem__("classes", m["classes"][:1]))
    with pytest.raises(IndexFormatError, match="beyond the 1 classes"):
        blockfs.open_dataset(packed)
    assert "column 'label'" in _one_line_error(capsys, "info", packed)


# --- issue 30: the checks run a few pieces at once; the error is still the first entry's -------------------
def test_pieces_checked_at_once_name_the_first_bad_entry(packed, monkeypatch):
    """Two forged sizes in different pieces, checked by threads: the message names the first, as a loop would."""
    from blockfs.core import index_checks, treecheck

    monkeypatch.setattr(os, "cpu_count", lambda: 4)
    monkeypatch.setattr(index_checks, "VALIDATE_PIECE", 2)
    monkeypatch.setattr(treecheck, "PIECE", 2)
    with blockfs.open_dataset(packed) as ds:
        a = ds.index.arrays
        files = np.flatnonzero(a["kind"] == KIND_FILE)
    first, last = int(files[0]), int(files[-1])
    assert last // 2 > first // 2  # different pieces
    patch_array(packed / "index.bfi", "size", lambda s: [s.__setitem__(e, s[e] | (1 << 62)) for e in (first, last)])
    with pytest.raises(IndexFormatError, match=rf"entry {first} has size"):
        PackedIndex(packed / "index.bfi")


def test_in_pieces_raises_the_first_pieces_error_even_when_a_later_one_fails_first(monkeypatch):
    import threading

    from blockfs.core import treecheck

    monkeypatch.setattr(os, "cpu_count", lambda: 4)
    later_failed = threading.Event()

    def check(lo: int) -> None:
        if lo == 5:
            later_failed.set()
            raise IndexFormatError("piece 5")
        if lo == 2:
            later_failed.wait(timeout=30)  # piece 5 has failed by now (or a serial loop reached us first)
            raise IndexFormatError("piece 2")

    with pytest.raises(IndexFormatError, match="piece 2"):
        treecheck.in_pieces(check, range(8))
