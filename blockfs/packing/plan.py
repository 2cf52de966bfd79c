"""The block plan: which entries' bytes are stored, in what order, cut into which blocks, and the index
columns that follow from it.

Pure functions of the listed entries and the options, with no I/O: separate from the writing so the
plan can be tested on its own and so what ends up where is decided in one place (the writers only
carry it out, in any order, in any process).  Built with array operations where it runs once per entry.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import overload

import numpy as np

from ..core.index import KIND_FILE, IndexColumns, PreparedIndex, prepare_index, tree_order
from .entry_table import EntryTable
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


class StoredFiles(Sequence[SourceEntry]):
    """The stored files in plan order, each made from the entry table when asked for (no list of them)."""

    def __init__(self, table: EntryTable, stored_at: np.ndarray) -> None:
        self._table = table
        self._stored_at = stored_at

    def __len__(self) -> int:
        return int(self._stored_at.size)

    @overload
    def __getitem__(self, k: int) -> SourceEntry: ...
    @overload
    def __getitem__(self, k: slice) -> list[SourceEntry]: ...
    def __getitem__(self, k: int | slice) -> SourceEntry | list[SourceEntry]:
        if isinstance(k, slice):
            return [self._table.entry(i) for i in self._stored_at[k].tolist()]
        return self._table.entry(int(self._stored_at[k]))

    def __iter__(self) -> Iterator[SourceEntry]:
        for start in range(0, len(self), 1 << 12):
            yield from self[start : start + (1 << 12)]


@dataclass(frozen=True)
class BlockPlan:
    """Where every stored file goes: ``stored[bounds[b]:bounds[b + 1]]`` are the files of block ``b``.

    ``entries`` is every listed entry (the root first); ``stored_at[k]`` the entry whose bytes are at
    position k of the plan, and ``stored``/``sizes`` those entries and their sizes, in that order.
    """

    entries: EntryTable
    stored_at: np.ndarray
    bounds: np.ndarray

    @property
    def stored(self) -> StoredFiles:
        return StoredFiles(self.entries, self.stored_at)

    @property
    def sizes(self) -> np.ndarray:
        return self.entries.size[self.stored_at].astype(np.int64)

    @property
    def n_blocks(self) -> int:
        return len(self.bounds) - 1

    def files_of(self, block: int) -> list[SourceEntry]:
        """The files stored in ``block``, in slot order."""
        return self.stored[int(self.bounds[block]) : int(self.bounds[block + 1])]

    def tree_order(self) -> tuple[np.ndarray, np.ndarray]:
        """The entries' order in the index and each one's parent there (see :func:`tree_order`): the
        costly part of the index, made while the blocks are written."""
        return tree_order(self.entries.paths, self.entries.kind)

    def index_without_crcs(
        self, unreadable: frozenset[bytes] = frozenset(), tree: tuple[np.ndarray, np.ndarray] | None = None
    ) -> tuple[IndexColumns, np.ndarray, PreparedIndex]:
        """The index columns of the entries kept (see :func:`index_columns`), each kept entry's position
        in the plan, and the index prepared from them, waiting for the file CRCs and block sizes.
        ``tree``: :meth:`tree_order`'s answer, made earlier (used unless entries were dropped)."""
        cols, plan_pos = index_columns(self.entries, primaries(self.entries), self.stored_at, self.bounds, unreadable)
        if len(plan_pos) != len(self.entries):
            tree = None  # entries were dropped: their order is another
        return cols, plan_pos, prepare_index(cols, np.diff(self.bounds).astype(np.uint32), tree)


def make_plan(entries: EntryTable, options: PackOptions) -> BlockPlan:
    """Store each inode's bytes once, in ``options.order`` (shuffled by ``options.seed``), cut into blocks."""
    primary = primaries(entries)
    stored_at = np.flatnonzero(primary == np.arange(len(entries)))  # the entries whose bytes are stored
    del primary
    if len(entries) < 2**31:
        stored_at = stored_at.astype(np.int32)  # held while the blocks are written: half the memory
    if options.order == "shuffled":
        stored_at = stored_at[np.random.default_rng(options.seed).permutation(len(stored_at))]
    bounds = plan_blocks(entries.size[stored_at].astype(np.int64), options.block_bytes, options.files_per_block)
    return BlockPlan(entries, stored_at, bounds)


def primaries(entries: EntryTable) -> np.ndarray:
    """For each entry, the position of the entry that stores its bytes; -1 for what is not a file
    (32-bit below 2**31 entries: this array is live at the pack's peak).

    Hard links: the first path of each inode holds the bytes, the others point at it.
    """
    n = len(entries)
    pos = _position_dtype(n)
    primary = np.where(entries.kind == KIND_FILE, np.arange(n, dtype=pos), pos.type(-1))
    first_of: dict[object, int] = {}
    for i, key in sorted(entries.hardlink_keys.items()):
        primary[i] = first_of.setdefault(key, i)
    return primary


def _position_dtype(n: int) -> np.dtype:
    """The narrowest signed type holding positions among ``n`` entries and -1."""
    return np.dtype(np.int32 if n < 2**31 else np.int64)


PIECE = 1 << 20  # entries turned into (block, slot) at a time: the temporaries stay small at any size


def index_columns(
    entries: EntryTable,
    primary: np.ndarray,
    stored_at: np.ndarray,
    bounds: np.ndarray,
    unreadable: frozenset[bytes],
) -> tuple[IndexColumns, np.ndarray]:
    """Index columns for every entry kept (unreadable files and their hard links are dropped), and for
    each kept entry the position in the block plan of the bytes it reads (-1: not a file).

    ``stored_at[k]`` is the entry whose bytes went to position k of the block plan ``bounds``.  The CRC
    column is left zero: the packer fills it in once the blocks are written.  Built with array
    operations: this runs once per pack over every entry.
    """
    n = len(entries)
    kept = None  # every entry is kept (the common case): no mask and no positions of the kept
    if unreadable:
        kept = np.ones(n, dtype=bool)
        for i in np.flatnonzero(primary >= 0).tolist():
            kept[i] = entries.paths[int(primary[i])] not in unreadable
        if kept.all():
            kept = None
    table = entries
    if kept is not None:
        where = np.flatnonzero(kept)
        table = entries.keep(where)
        primary = primary[where]
    m = len(primary)
    # 32-bit positions and (block, slot) made a piece at a time: this runs at the pack's peak, while the
    # listing's columns and the tree order are all held, so every byte per entry here counts 10 M times.
    pos = _position_dtype(max(n, len(stored_at)))
    stored_pos = np.full(n, -1, dtype=pos)
    stored_pos[stored_at] = np.arange(len(stored_at), dtype=pos)
    plan_pos = np.full(m, -1, dtype=pos)  # each kept file's position in the plan
    bounds = np.asarray(bounds)
    block = np.full(m, -1, dtype=np.int32)
    slot = np.zeros(m, dtype=np.uint32)
    for lo in range(0, m, PIECE):
        hi = min(m, lo + PIECE)
        here = primary[lo:hi]
        files = np.flatnonzero(here >= 0)
        at = stored_pos[here[files]]
        plan_pos[lo:hi][files] = at
        file_block = np.searchsorted(bounds, at, side="right") - 1
        block[lo:hi][files] = file_block
        slot[lo:hi][files] = at - bounds[file_block]
    del stored_pos
    hardlink_of: dict[int, int] = {}
    if entries.hardlink_keys:  # only then can an entry's bytes be another's
        own = np.arange(n, dtype=pos) if kept is None else where
        aliases = np.flatnonzero((primary >= 0) & (primary != own))
        new_pos = primary[aliases] if kept is None else np.cumsum(kept)[primary[aliases]] - 1
        hardlink_of = dict(zip(aliases.tolist(), new_pos.tolist(), strict=True))
    del primary, kept
    cols = IndexColumns(
        paths=table.paths,
        kind=table.kind,
        mode=table.mode,
        mtime_ns=table.mtime_ns,
        size=table.size,
        block=block,
        slot=slot,
        label=np.where(table.kind == KIND_FILE, table.label, np.int32(-1)).astype(np.int32, copy=False),
        crc=np.zeros(0, dtype=np.uint32),  # filled in by the packer (index order: PreparedIndex.write's crc)
        link_targets=dict(table.link_targets),
        hardlink_of=hardlink_of,
    )
    return cols, plan_pos
