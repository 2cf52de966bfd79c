"""The block plan: which entries' bytes are stored, in what order, cut into which blocks, and the index
columns that follow from it.

Pure functions of the listed entries and the options, with no I/O: separate from the writing so the
plan can be tested on its own and so what ends up where is decided in one place (the writers only
carry it out, in any order, in any process).  Built with array operations where it runs once per entry.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..core.index import KIND_FILE, KIND_SYMLINK, IndexColumns, PreparedIndex, prepare_index
from .options import PackOptions
from .sources import SourceEntry


def plan_blocks(sizes: np.ndarray, block_size: int, files_per_block: int | None = None) -> np.ndarray:
    """Cut files (in packing order) into blocks; return the boundaries, ``len == n_blocks + 1``.

    A block takes files while their total stays within ``block_size`` (and the count within
    ``files_per_block``); a file larger than ``block_size`` gets a block of its own.
    """
    sizes = np.asarray(sizes, dtype=np.int64)
    ends = np.concatenate([[0], np.cumsum(sizes)])
    bounds = [0]
    i, n = 0, len(sizes)
    while i < n:
        j = int(np.searchsorted(ends, ends[i] + block_size, side="right")) - 1
        j = max(j, i + 1)
        if files_per_block is not None:
            j = min(j, i + files_per_block)
        bounds.append(j)
        i = j
    return np.asarray(bounds, dtype=np.int64)


@dataclass(frozen=True)
class BlockPlan:
    """Where every stored file goes: ``stored[bounds[b]:bounds[b + 1]]`` are the files of block ``b``.

    ``entries`` is every listed entry (the root first); ``primary[i]`` the entry that stores entry i's
    bytes (-1: not a file); ``stored_at[k]`` the entry whose bytes are at position k of the plan, and
    ``stored``/``sizes`` those entries and their sizes, in that order.
    """

    entries: list[SourceEntry]
    primary: np.ndarray
    stored_at: np.ndarray
    stored: list[SourceEntry]
    sizes: np.ndarray
    bounds: np.ndarray

    @property
    def n_blocks(self) -> int:
        return len(self.bounds) - 1

    def files_of(self, block: int) -> list[SourceEntry]:
        """The files stored in ``block``, in slot order."""
        return self.stored[self.bounds[block] : self.bounds[block + 1]]

    def index_without_crcs(
        self, unreadable: frozenset[bytes] = frozenset()
    ) -> tuple[IndexColumns, np.ndarray, PreparedIndex]:
        """The index columns of the entries kept (see :func:`index_columns`), each kept entry's position
        in the plan, and the index prepared from them, waiting for the file CRCs and block sizes."""
        cols, plan_pos = index_columns(self.entries, self.primary, self.stored_at, self.bounds, unreadable)
        return cols, plan_pos, prepare_index(cols, np.diff(self.bounds).astype(np.uint32))


def make_plan(entries: list[SourceEntry], options: PackOptions) -> BlockPlan:
    """Store each inode's bytes once, in ``options.order`` (shuffled by ``options.seed``), cut into blocks."""
    primary = primaries(entries)
    stored_at = np.flatnonzero(primary == np.arange(len(entries)))  # the entries whose bytes are stored
    if options.order == "shuffled":
        stored_at = stored_at[np.random.default_rng(options.seed).permutation(len(stored_at))]
    stored = [entries[i] for i in stored_at]
    sizes = np.fromiter((f.size for f in stored), dtype=np.int64, count=len(stored))
    bounds = plan_blocks(sizes, options.block_bytes, options.files_per_block)
    return BlockPlan(entries, primary, stored_at, stored, sizes, bounds)


def primaries(entries: list[SourceEntry]) -> np.ndarray:
    """For each entry, the position of the entry that stores its bytes; -1 for what is not a file.

    Hard links: the first path of each inode holds the bytes, the others point at it.
    """
    primary = [-1] * len(entries)
    first_of: dict[object, int] = {}
    for i, e in enumerate(entries):
        if e.kind == KIND_FILE:
            primary[i] = i if e.hardlink_key is None else first_of.setdefault(e.hardlink_key, i)
    return np.array(primary, dtype=np.int64)


def index_columns(
    entries: list[SourceEntry], primary: np.ndarray, stored_at: np.ndarray, bounds: np.ndarray,
    unreadable: frozenset[bytes],
) -> tuple[IndexColumns, np.ndarray]:
    """Index columns for every entry kept (unreadable files and their hard links are dropped), and for
    each kept entry the position in the block plan of the bytes it reads (-1: not a file).

    ``stored_at[k]`` is the entry whose bytes went to position k of the block plan ``bounds``.  The CRC
    column is left zero: the packer fills it in once the blocks are written.  Built with array
    operations: this runs once per pack over every entry.
    """
    n = len(entries)
    kept = np.ones(n, dtype=bool)
    if unreadable:
        kept = np.array([p < 0 or entries[p].path not in unreadable for p in primary.tolist()], dtype=bool)
    where = np.flatnonzero(kept)
    kept_entries = [entries[i] for i in where] if len(where) < n else entries
    primary = primary[where]
    is_file = primary >= 0

    stored_pos = np.full(n, -1, dtype=np.int64)
    stored_pos[stored_at] = np.arange(len(stored_at))
    pos = stored_pos[primary[is_file]]  # each kept file's position in the plan
    block = np.full(len(where), -1, dtype=np.int32)
    slot = np.zeros(len(where), dtype=np.uint32)
    plan_pos = np.full(len(where), -1, dtype=np.int64)
    plan_pos[is_file] = pos
    file_block = np.searchsorted(np.asarray(bounds), pos, side="right") - 1
    block[is_file] = file_block
    slot[is_file] = pos - np.asarray(bounds)[file_block]

    new_pos = np.cumsum(kept) - 1  # entry position -> position among the kept entries
    aliases = np.flatnonzero(is_file & (primary != where))
    hardlink_of = dict(zip(aliases.tolist(), new_pos[primary[aliases]].tolist()))
    links = {i: e.link_target for i, e in enumerate(kept_entries) if e.kind == KIND_SYMLINK}
    count = len(kept_entries)
    cols = IndexColumns(
        paths=[e.path for e in kept_entries],
        kind=np.fromiter((e.kind for e in kept_entries), dtype=np.uint8, count=count),
        mode=np.fromiter((e.mode for e in kept_entries), dtype=np.uint32, count=count),
        mtime_ns=np.fromiter((e.mtime_ns for e in kept_entries), dtype=np.int64, count=count),
        size=np.fromiter(
            (e.size if e.kind == KIND_FILE else len(e.link_target) for e in kept_entries), dtype=np.uint64,
            count=count,
        ),
        block=block,
        slot=slot,
        label=np.fromiter((e.label if e.kind == KIND_FILE else -1 for e in kept_entries), dtype=np.int32, count=count),
        crc=np.zeros(count, dtype=np.uint32),
        link_targets=links,
        hardlink_of=hardlink_of,
    )
    return cols, plan_pos
