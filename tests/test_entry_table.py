"""The pack's entries as columns (blockfs/packing/entry_table.py) and the index built from them in bounded
memory: no Python object per entry from the listing to the index file."""

from __future__ import annotations

import tracemalloc
import zlib
from collections.abc import Iterator

import numpy as np
import pytest

import blockfs
from blockfs.core.index import KIND_DIR, KIND_FILE, KIND_SYMLINK, IndexColumns, write_index
from blockfs.core.pathtable import PathTable
from blockfs.core.unpack import unpack
from blockfs.core.verify import summary, verify
from blockfs.packing.entry_table import collect
from blockfs.packing.sources import Source, SourceEntry

MTIME = 1_600_000_000 * 10**9


class GeneratedSource(Source):
    """``files`` tiny files in ``dirs`` directories, made up as they are listed (no list of them)."""

    def __init__(self, files: int, dirs: int = 10, reverse: bool = False) -> None:
        self.files, self.dirs, self.reverse = files, dirs, reverse
        self.description = f"generated {files}"

    def entries(self) -> Iterator[SourceEntry]:
        yield SourceEntry(b"", KIND_DIR, 0o40755, MTIME)
        for d in range(self.dirs):
            yield SourceEntry(b"d%03d" % d, KIND_DIR, 0o40755, MTIME)
            ks = range(d, self.files, self.dirs)
            for k in reversed(ks) if self.reverse else ks:
                yield SourceEntry(b"d%03d/f%09d" % (d, k), KIND_FILE, 0o100644, MTIME + k, 1 + k % 7)

    def read_into(self, entry: SourceEntry, buf: memoryview, offset: int = 0) -> int:
        data = (entry.path * 2)[offset : offset + len(buf)]
        buf[: len(data)] = data
        return len(data)


def _pack_peak(tmp_path, files: int) -> int:
    """tracemalloc's peak while packing ``files`` generated files (in this process: one worker)."""
    tracemalloc.start()
    try:
        tracemalloc.reset_peak()
        base = tracemalloc.get_traced_memory()[0]
        blockfs.pack(GeneratedSource(files), tmp_path / f"ds{files}", workers=1, fsync=False, files_per_block=4096)
        return tracemalloc.get_traced_memory()[1] - base
    finally:
        tracemalloc.stop()


def test_pack_memory_grows_by_columns_not_by_objects(tmp_path):
    """Twice the entries cost at most ~200 bytes more each at the peak (NumPy columns, one path array,
    the index made array by array); a list of SourceEntry objects, a list of path tuples for the sort, a
    dict of every path or the whole index in memory at once each cost more than that alone."""
    # Fixed costs cancel in the difference, so n only has to make a per-entry cost stand out: keeping the
    # SourceEntry objects measures ~280 bytes an entry at 30,000 as at 60,000 (the honest pack ~80, ~100).
    n = 30_000
    small, large = _pack_peak(tmp_path, n), _pack_peak(tmp_path, 2 * n)
    per_entry = (large - small) / n
    assert per_entry < 200, f"the pack's peak grows by {per_entry:.0f} bytes an entry"


def test_a_generated_pack_reads_back(tmp_path):
    blockfs.pack(GeneratedSource(5_000, dirs=7), tmp_path / "ds", block_size=4096)
    with blockfs.open_dataset(tmp_path / "ds") as ds:
        assert verify(ds) == []
        assert summary(ds)["files"] == 5_000
        assert ds.read("d003/f000000010") == b"d003/f000000010"[: 1 + 10 % 7]
        unpack(ds, tmp_path / "out")
    assert (tmp_path / "out" / "d001" / "f000004999").read_bytes() == b"d001/f000004999"[: 1 + 4999 % 7]


def test_children_listed_out_of_order_are_sorted(tmp_path):
    """A source that lists a directory's children out of byte order packs the same tree as one in order
    (only where the bytes went differs: the plan follows the listing)."""
    blockfs.pack(GeneratedSource(3_000, dirs=3), tmp_path / "in_order")
    blockfs.pack(GeneratedSource(3_000, dirs=3, reverse=True), tmp_path / "reversed")
    with blockfs.open_dataset(tmp_path / "in_order") as a, blockfs.open_dataset(tmp_path / "reversed") as b:
        assert verify(b) == []
        for name in ("paths", "path_offsets", "parent", "child_start", "child_count", "mtime_ns", "size", "crc"):
            assert np.array_equal(a.index.arrays[name], b.index.arrays[name]), name
        assert b.listdir("d002")[:2] == ["f000000002", "f000000005"]


def test_a_path_listed_twice_is_refused(tmp_path):
    cols = IndexColumns(
        paths=[b"", b"a", b"a"],
        kind=np.array([KIND_DIR, KIND_FILE, KIND_FILE]),
        mode=np.zeros(3),
        mtime_ns=np.zeros(3),
        size=np.zeros(3),
        block=np.array([-1, 0, 0]),
        slot=np.array([0, 0, 1]),
        label=np.full(3, -1),
        crc=np.zeros(3),
        link_targets={},
        hardlink_of={},
    )
    with pytest.raises(ValueError, match="listed twice"):
        write_index(tmp_path / "index.bfi", cols, np.array([2]), np.array([100]))


def test_collect_keeps_what_the_entries_said():
    class Tagged(SourceEntry):
        pass

    listed = [
        SourceEntry(b"d", KIND_DIR, 0o40700, 5, identity=(1, 2)),
        Tagged(b"d/f", KIND_FILE, 0o100600, 6, 10, hardlink_key="k", label=3, identity=(1, 3)),
        SourceEntry(b"d/l", KIND_SYMLINK, 0o120777, 7, link_target=b"f"),
    ]
    table = collect(iter(listed))
    assert len(table) == 4 and table.paths[0] == b""  # the root, made up first
    assert table.entry(2) is listed[1]  # a subclass entry is kept as it is (its own fields)
    assert table.entry(1) == listed[0]
    link = table.entry(3)
    assert (link.path, link.kind, link.link_target, link.mtime_ns) == (b"d/l", KIND_SYMLINK, b"f", 7)
    assert table.size.tolist() == [0, 0, 10, 1]  # a symlink's size is its target's length, as the index says
    assert table.hardlink_keys == {2: "k"}


def test_path_table_chunks_and_take():
    paths = [b"", b"a", b"b/c", b"dd"] * 3
    table = PathTable.from_list(paths)
    assert [table[i] for i in range(len(table))] == paths
    assert [p for _, chunk in table.chunks(5) for p in chunk] == paths
    order = np.array([3, 0, 2, 11])
    taken = table.take(order)
    assert [taken[i] for i in range(4)] == [paths[i] for i in order]
    assert taken.blob.tobytes() == b"\0" + b"".join(paths[i] + b"\0" for i in order)
    with pytest.raises(ValueError, match="NUL"):
        PathTable.from_list([b"a\0b"])


def test_path_table_take_pieces_are_the_taken_blob_and_its_crcs():
    rng = np.random.default_rng(4)
    paths = [b""] + [b"d%d/%s" % (i % 7, b"x" * int(rng.integers(1, 40))) for i in range(1, 5000)]
    table = PathTable.from_list(paths)
    order = rng.permutation(len(paths))
    crcs = np.empty(order.size, dtype=np.uint32)
    pieces = list(table.take_pieces(order, crcs))
    assert b"".join(p.tobytes() for p in pieces) == table.take(order).blob.tobytes()
    assert np.array_equal(table.take_offsets(order), table.take(order).offsets)
    assert crcs.tolist() == [zlib.crc32(paths[i]) for i in order]


def test_the_pack_never_holds_the_sorted_paths_whole(tmp_path, monkeypatch):
    """Issue 30 (10 M files in 1.5 GB): the index's paths are written piece by piece from the listing's
    table, in tree order, never gathered into a second table (that copy was the pack's largest at its peak)."""

    def whole(*args):
        raise AssertionError("the pack built the sorted path table whole")

    monkeypatch.setattr(PathTable, "take", whole)
    blockfs.pack(GeneratedSource(3000, reverse=True), tmp_path / "ds", workers=1, fsync=False, files_per_block=512)
    with blockfs.open_dataset(tmp_path / "ds") as ds:  # opening checks the tree, paths and hash table
        assert verify(ds) == []
        assert ds.read("d004/f000002994") == b"d004/f000002994"[: 1 + 2994 % 7]
        assert ds.index.find(b"d009/f000000019") >= 0


def test_the_index_columns_cost_few_bytes_an_entry_beyond_what_they_make(monkeypatch):
    """Turning the plan into index columns runs at the pack's peak (issue 30: 10 M files under 1.5 GB), with
    the listing and the tree order held: its temporaries must stay near its outputs (block, slot, label and
    plan position, 16 bytes an entry).  The old code held 64-bit positions of every entry several times at
    once (~50 bytes an entry beyond its outputs); now 32-bit ones, and (block, slot) made a piece at a time."""
    from blockfs.packing import plan as plan_module
    from blockfs.packing.options import PackOptions

    monkeypatch.setattr(plan_module, "PIECE", 4096, raising=False)
    entries = collect(GeneratedSource(200_000).entries())
    plan = plan_module.make_plan(entries, PackOptions(files_per_block=4096))
    n = len(entries)
    tracemalloc.start()
    try:
        base = tracemalloc.get_traced_memory()[0]
        cols, plan_pos = plan_module.index_columns(
            plan.entries, plan_module.primaries(plan.entries), plan.stored_at, plan.bounds, frozenset()
        )
        peak = tracemalloc.get_traced_memory()[1] - base
    finally:
        tracemalloc.stop()
    made = sum(a.nbytes for a in (cols.block, cols.slot, cols.label, plan_pos))
    beyond = (peak - made) / n
    assert beyond < 16, f"index_columns held {beyond:.0f} bytes an entry beyond its outputs at its peak"
    files = np.flatnonzero(cols.kind == KIND_FILE)  # and they are right: each file's (block, slot) is its plan place
    assert np.array_equal(plan.bounds[cols.block[files]] + cols.slot[files], plan_pos[files])
    assert np.array_equal(plan.stored_at[plan_pos[files]], files)
