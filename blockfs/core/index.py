"""The columnar index of a packed dataset: one file, read once, no per-entry Python objects at open.

Entries are the tree's nodes; entry 0 is the root directory.  Entries are sorted by (parent path, name),
so the children of every directory are contiguous and sorted by name: listing a directory is a slice.
A path lookup hashes the full path (CRC-32) into a bucket table — O(1) — and confirms by comparing bytes;
a lookup by name in a directory (the mount's) continues the directory's hash with the name, and confirms by
the parent column and the name, so no path is built per lookup.

Paths are raw bytes (``os.fsencode``), stored NUL-terminated back to back after one leading NUL, so every
path ``p`` appears as ``\\0p\\0`` and forbidden forms (``..``, ``.``, ``//``, a leading ``/``) can be
found with a few byte searches at open time instead of a Python loop over entries.

The file layout, its schema and how it is read are in :mod:`.index_format`; the checks an index passes
before it is used are in :mod:`.index_checks`.  This module builds an index (:func:`prepare_index`) and
answers lookups (:class:`PackedIndex`).
"""

from __future__ import annotations

import itertools
import os
import threading
import zlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, BinaryIO, Literal

import numpy as np

from ..errors import EntryNotFoundError, IndexFormatError, NotADirectoryEntryError
from . import digest as dg
from .directory_checks import DirectoryChecks
from .heap import give_back
from .index_checks import check_lengths, validate_arrays
from .index_format import (  # noqa: F401  (KIND_* and ENTRY_COLUMNS are imported from here by others)
    DIGEST_ARRAYS,
    ENTRY_COLUMNS,
    INDEX_MAGIC,
    INDEX_VERSION,
    KIND_DIR,
    KIND_FILE,
    KIND_NAMES,
    KIND_SYMLINK,
    REPACK,
    Deferred,
    array_views,
    check_chunk_table,
    check_crc,
    check_digest,
    check_header,
    read_index_file_hashed,
    read_toc,
    write_arrays,
)
from .pathtable import CHUNK, PathTable
from .treecheck import Release, TreeChecks

if TYPE_CHECKING:
    from .checked_indexes import CheckedIndexes
    from .index_copy import IndexCopies

_IntFormat = Literal["B", "I", "Q", "i", "q"]  # memoryview.cast formats of the index's integer columns
DIR_SEEDS_KEPT = 1 << 16  # directories whose path hash PackedIndex.find_child keeps (then it starts afresh)


@dataclass
class IndexColumns:
    """What the packer knows about each entry, in any order; :func:`write_index` sorts it."""

    paths: list[bytes] | PathTable  # relative, "/"-separated, no leading "/"; b"" is the root
    kind: np.ndarray
    mode: np.ndarray
    mtime_ns: np.ndarray
    size: np.ndarray
    block: np.ndarray
    slot: np.ndarray
    label: np.ndarray
    crc: np.ndarray
    link_targets: dict[int, bytes]  # position in ``paths`` -> symlink target
    hardlink_of: dict[int, int]  # position -> position of the entry whose inode it shares


def write_index(
    f: BinaryIO,
    cols: IndexColumns,
    block_counts: np.ndarray,
    block_sizes: np.ndarray,
) -> None:
    """Sort the entries into tree order, build the lookup tables and write the index file into ``f`` (a new
    binary file, as :func:`~blockfs.core.index_format.write_arrays` takes).

    ``block_counts[b]`` is the number of slots in block b, ``block_sizes[b]`` its file size in bytes.
    """
    prepare_index(cols, block_counts).write(f, cols.crc, block_sizes)


# The digests of an index: file digests (rows of 32 bytes in the order of the prepared columns; or a
# function called when their turn comes that yields them in the index's order, piece by piece), block
# header digests, chunk digests, and where each block's chunks start (n_blocks + 1).
Digests = tuple["np.ndarray | Callable[[], Iterator[np.ndarray]]", np.ndarray, np.ndarray, np.ndarray]


class PreparedIndex:
    """An index sorted into tree order, waiting for the file CRCs and block sizes, which the packer knows
    last.  Only the order and the parent table are held; every other array is made from the columns when
    :meth:`write` reaches it and dropped once written, so a pack of ten million files never holds the
    whole index in memory."""

    def __init__(self, cols: IndexColumns, block_counts: np.ndarray, order: np.ndarray, parent: np.ndarray) -> None:
        self.cols = cols
        self.block_counts = np.asarray(block_counts)
        self.order = order  # index position -> position in the IndexColumns it was prepared from
        self.parent = parent  # index position -> index position of its parent directory

    def write(
        self,
        f: BinaryIO,
        crc: np.ndarray | Callable[[], np.ndarray],
        block_sizes: np.ndarray,
        digests: Digests | None = None,
        *,
        release: bool = False,
    ) -> None:
        """Write the index file into ``f`` (a new binary file); ``crc`` is in the order of the prepared columns (or what makes
        it, called at its turn).  Without
        ``digests`` the index is version 1 (tests of the old format).  ``release``: each column of the
        IndexColumns is dropped from it once its array is written (the packer's, used once)."""
        write_arrays(f, self.arrays(crc, block_sizes, digests, release=release))

    def arrays(
        self,
        crc: np.ndarray | Callable[[], np.ndarray],
        block_sizes: np.ndarray,
        digests: Digests | None = None,
        *,
        release: bool = False,
    ) -> dict[str, np.ndarray | Deferred]:
        """Every array of the index file, most made only when written (:class:`Deferred`, in the schema's
        order), each column of ``cols`` dropped once used when ``release``."""
        cols, order, n = self.cols, self.order, int(self.order.size)
        paths = cols.paths if isinstance(cols.paths, PathTable) else PathTable.from_list(cols.paths)
        memo: dict[str, object] = {"listed": paths}  # popped once sorted, so that release frees them
        n_path_bytes = int(paths.blob.size)
        del paths

        def column(name: str, dtype: str, drop: bool = True) -> Deferred:
            def make() -> np.ndarray:
                values = np.asarray(getattr(cols, name))[order].astype(dtype, copy=False)
                if release and drop:
                    setattr(cols, name, None)
                return values

            return Deferred(n, make)

        # The schema's order (index_format.SCHEMA) is the file's: path_offsets, then paths, then the hash
        # table made from the sorted paths before they go.
        # The sorted paths are never made whole: their offsets first, then the blob written piece by piece
        # straight from the listing's table (its CRCs gathered on the way, for the hash table), so the pack
        # holds one copy of the paths, not two, at its peak.
        def path_offsets() -> np.ndarray:
            listed = memo["listed"]
            assert isinstance(listed, PathTable)
            return listed.take_offsets(order)

        def path_blob() -> Iterator[np.ndarray]:
            held = [memo.pop("listed")]

            def pieces() -> Iterator[np.ndarray]:
                listed = held.pop()
                assert isinstance(listed, PathTable)
                crcs = np.empty(n, dtype=np.uint32)
                yield from listed.take_pieces(order, crcs)
                del listed
                if release:
                    cols.paths = []
                memo["hash"] = _hash_table(crcs)

            return pieces()

        def hash_part(k: int) -> Callable[[], np.ndarray]:
            def make() -> np.ndarray:
                parts = memo.pop("hash") if k == 1 else memo["hash"]  # hash_order is written last
                assert isinstance(parts, tuple)
                return parts[k]

            return make

        hardlinks, targets = self._renumbered()
        links, link_offsets, link_slots = _link_table(targets)
        n_buckets = 1 << max(0, (n - 1).bit_length())

        def slot() -> np.ndarray:
            values = np.asarray(cols.slot)[order].astype(np.uint32, copy=False)  # a new array already
            for entry, k in link_slots:  # a symlink's slot is its place in the link table
                values[entry] = k
            return values

        def tree_tables(k: int) -> Callable[[], np.ndarray]:
            def make() -> np.ndarray:
                if "tree" not in memo:
                    kind = np.asarray(cols.kind)[order].astype(np.uint8)
                    child_start, child_count = _child_tables(self.parent, n)
                    ino, nlink = _inodes(kind, self.parent, hardlinks)
                    memo["tree"] = (self.parent, child_start, child_count, ino, nlink)
                    if release:
                        cols.kind = None  # type: ignore[assignment]  # read last here
                tables = memo.pop("tree") if k == 2 else memo["tree"]  # child_count is written last
                assert isinstance(tables, tuple)
                return tables[k]

            return make

        def block_column() -> np.ndarray:
            block = np.asarray(cols.block)[order].astype(np.int32, copy=False)
            # The block layout now, while block and slot are at hand: then neither is held to the end.
            memo["block_offsets"], memo["block_files"] = _block_layout(block, slot(), len(self.block_counts))
            if release:
                cols.block = None  # type: ignore[assignment]
            return block

        def slot_column() -> np.ndarray:
            values = slot()
            if release:
                cols.slot = None  # type: ignore[assignment]
            return values

        def block_offsets() -> np.ndarray:
            offsets = memo.pop("block_offsets")
            assert isinstance(offsets, np.ndarray)
            return offsets

        def block_files() -> np.ndarray:
            files = memo.pop("block_files")
            assert isinstance(files, np.ndarray)
            return files

        n_block_files = int(np.count_nonzero(np.asarray(cols.block) >= 0))
        arrays: dict[str, np.ndarray | Deferred] = {
            "path_offsets": Deferred(n + 1, path_offsets),
            "paths": Deferred(n_path_bytes, path_blob),
            "hash_order": Deferred(n, hash_part(1)),
            "hash_start": Deferred(n_buckets + 1, hash_part(0)),
            "kind": column("kind", "u1", drop=False),  # the tree tables read it
            "parent": Deferred(n, tree_tables(0)),
            "child_start": Deferred(n, tree_tables(1)),
            "child_count": Deferred(n, tree_tables(2)),
            "ino": Deferred(n, tree_tables(3)),
            "nlink": Deferred(n, tree_tables(4)),
            "block_counts": self.block_counts,
            "block_sizes": np.asarray(block_sizes),
            "block_offsets": Deferred(len(self.block_counts) + 1, block_offsets),
            "block_files": Deferred(n_block_files, block_files),
            "slot": Deferred(n, slot_column),
            "block": Deferred(n, block_column),
            "mode": column("mode", "u4"),
            "mtime_ns": column("mtime_ns", "i8"),
            "size": column("size", "u8"),
            "label": column("label", "i4"),
            "links": links,
            "link_offsets": link_offsets,
            "crc": Deferred(n, lambda: np.asarray(crc() if callable(crc) else crc)[order]),
        }
        if digests is not None:
            files, heads, chunks, block_chunks = digests

            def file_digests() -> np.ndarray | Iterator[np.ndarray]:
                memo.clear()
                return files() if callable(files) else np.asarray(files)[order]

            arrays.update(
                file_digest=Deferred(n * dg.DIGEST_SIZE, file_digests),
                block_head_digest=heads,
                chunk_digest=chunks,
                block_chunks=block_chunks,
            )
        return arrays

    def _renumbered(self) -> tuple[dict[int, int], dict[int, bytes]]:
        """The hard links and symlink targets, keyed by index position (few: a dict is fine)."""
        cols = self.cols
        if not cols.hardlink_of and not cols.link_targets:
            return {}, {}
        new_id = np.empty(self.order.size, dtype=np.int64)
        new_id[self.order] = np.arange(self.order.size)
        hardlinks = {int(new_id[a]): int(new_id[p]) for a, p in cols.hardlink_of.items()}
        targets = {int(new_id[pos]): t for pos, t in cols.link_targets.items()}
        return hardlinks, targets


# --- building an index: one step per table ----------------------------------------------------------
def prepare_index(
    cols: IndexColumns, block_counts: np.ndarray, tree: tuple[np.ndarray, np.ndarray] | None = None
) -> PreparedIndex:
    """Sort the entries into tree order and find each one's parent (``cols.crc`` is not read), unless
    ``tree`` is :func:`tree_order`'s answer for them already; the other tables are built as the file is
    written."""
    if not isinstance(cols.paths, PathTable):
        cols.paths = PathTable.from_list(cols.paths)
    order, parent = tree if tree is not None else tree_order(cols.paths, np.asarray(cols.kind))
    return PreparedIndex(cols, block_counts, order, parent)


def tree_order(paths: PathTable, kind: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(order, parent): ``order`` sorts the entries by (parent path, name), so every directory's children
    are one contiguous, name-sorted run, the root first; ``parent[i]`` is the position, in that order, of
    the parent of entry ``order[i]`` (0 for the root).

    Array operations and one pass over the paths in chunks: the parents are found through a dict of the
    directories only, sorted by the rank of their parent's path; children arrive in name order from every
    source that lists sorted directories, which is checked (and mended per directory where not).
    """
    n = len(paths)
    roots = np.flatnonzero(np.diff(paths.offsets) == 1)  # an empty path: just its NUL
    if n == 0 or roots.size != 1:
        raise ValueError("the entries must include the root (path b'') exactly once")
    root = int(roots[0])
    dirs = np.flatnonzero(kind == KIND_DIR)
    dir_paths = [paths[i] for i in dirs.tolist()]
    position = dict(zip(dir_paths, dirs.tolist(), strict=True))
    if len(position) != len(dir_paths):
        raise ValueError("a directory path appears twice among the entries")
    rank = np.empty(len(dir_paths), dtype=np.int32)  # int32 below: half the memory, and 2**31 entries is far
    rank[sorted(range(len(dir_paths)), key=dir_paths.__getitem__)] = np.arange(len(dir_paths))
    del dir_paths
    parent_pos = np.empty(n, dtype=np.int32)
    for start, chunk in paths.chunks():
        parent_pos[start : start + len(chunk)] = [position.get(p.rpartition(b"/")[0], -1) for p in chunk]
    del position
    parent_pos[root] = root
    orphans = np.flatnonzero(parent_pos < 0)
    if orphans.size:
        raise ValueError(f"entry {os.fsdecode(paths[int(orphans[0])])!r} has no parent directory in the index")
    key = np.empty(n, dtype=np.int32)  # the rank of each entry's parent's path
    for start in range(0, n, CHUNK):
        key[start : start + CHUNK] = rank[np.searchsorted(dirs, parent_pos[start : start + CHUNK])]
    key[root] = -1
    order = np.argsort(key, kind="stable").astype(np.uint32)  # half the memory, held to the end
    key = key[order]
    _mend_names(order, key, paths)
    del key
    new_id = np.empty(n, dtype=np.uint32)
    new_id[order] = np.arange(n, dtype=np.uint32)
    parent = new_id[parent_pos[order]]
    del new_id, parent_pos
    give_back()
    return order, parent


def _mend_names(order: np.ndarray, key: np.ndarray, paths: PathTable) -> None:
    """Within each run of ``order`` with one ``key`` (one directory's children), put the paths in byte
    order where the source did not list them so; a path listed twice is refused."""
    same = key[1:] == key[:-1]
    for _ in range(2):  # the second pass only confirms (or finds a path listed twice)
        unsorted: set[int] = set()
        prev: bytes | None = None
        for start in range(0, order.size, CHUNK):
            chunk = [paths[i] for i in order[start : start + CHUNK].tolist()]
            if prev is not None:
                chunk.insert(0, prev)
            base = start - (prev is not None)
            for k, (a, b) in enumerate(itertools.pairwise(chunk)):
                if not a < b and same[base + k]:
                    if a == b:
                        raise ValueError(f"entry {os.fsdecode(a)!r} is listed twice")
                    unsorted.add(int(key[base + k]))
            prev = chunk[-1]
        if not unsorted:
            return
        for group in unsorted:
            lo, hi = np.searchsorted(key, [group, group + 1])
            order[lo:hi] = sorted(order[lo:hi].tolist(), key=paths.__getitem__)
    raise AssertionError("directory children still unsorted after mending")  # pragma: no cover


def _child_tables(parent: np.ndarray, n: int) -> tuple[np.ndarray, np.ndarray]:
    """(child_start, child_count) of entries in tree order, from their parents."""
    child_count = np.bincount(parent[1:], minlength=n).astype(np.uint32)
    child_start = np.zeros(n, dtype=np.uint32)
    parents, first_child = np.unique(parent[1:], return_index=True)  # each run of children is contiguous
    child_start[parents] = first_child + 1
    return child_start, child_count


def _inodes(kind: np.ndarray, parent: np.ndarray, hardlink_of: dict[int, int]) -> tuple[np.ndarray, np.ndarray]:
    """(ino, nlink): entry e's inode is e + 1, a hard link's its primary's; a directory's nlink counts
    its subdirectories' '..' as a filesystem does."""
    n = kind.size
    ino = np.arange(1, n + 1, dtype=np.uint64)
    nlink = np.ones(n, dtype=np.uint32)
    for alias, primary in hardlink_of.items():
        ino[alias] = primary + 1
    if hardlink_of:
        uniq, counts = np.unique(ino, return_counts=True)
        nlink = counts[np.searchsorted(uniq, ino)].astype(np.uint32)
    is_dir = kind == KIND_DIR
    subdirs = np.bincount(parent[1:][is_dir[1:]], minlength=n)
    nlink[is_dir] = 2 + subdirs[is_dir]
    return ino, nlink


def _link_table(targets: dict[int, bytes]) -> tuple[np.ndarray, np.ndarray, list[tuple[int, int]]]:
    """(links, link_offsets, (entry, slot) of each symlink): a symlink's slot is its place in the table."""
    items = sorted(targets.items())
    link_offsets = np.zeros(len(items) + 1, dtype=np.uint64)
    np.cumsum([len(t) for _, t in items], out=link_offsets[1:])
    links = np.frombuffer(b"".join(t for _, t in items), dtype=np.uint8)
    return links, link_offsets, [(entry, k) for k, (entry, _t) in enumerate(items)]


def _hash_table(crcs: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(hash_start, hash_order) of the paths whose CRC-32s (in entry order) are ``crcs``, which become
    their buckets in place: bucket k holds entries hash_order[hash_start[k] : hash_start[k + 1]]."""
    n = int(crcs.size)
    n_buckets = 1 << max(0, (n - 1).bit_length())
    bucket = crcs
    bucket &= np.uint32(n_buckets - 1)
    hash_order = np.argsort(bucket, kind="stable").astype(np.uint32)
    hash_start = np.searchsorted(bucket[hash_order], np.arange(n_buckets + 1)).astype(np.uint32)
    return hash_start, hash_order


def _block_layout(block: np.ndarray, slot: np.ndarray, n_blocks: int) -> tuple[np.ndarray, np.ndarray]:
    """(block_offsets, block_files): the file entries of each block, in slot order (ties in entry order:
    lexsort is stable).  Positions as u4 from the start: this runs near the pack's peak."""
    files = np.flatnonzero(block >= 0).astype(np.uint32)
    by_block = files[np.lexsort((slot[files], block[files]))]
    del files
    block_offsets = np.zeros(n_blocks + 1, dtype=np.uint64)
    np.cumsum(np.bincount(block[by_block], minlength=n_blocks), out=block_offsets[1:])
    return block_offsets, by_block


# --- reading an index ---------------------------------------------------------------------------------
def check_contents(
    arrays: dict[str, np.ndarray],
    where: str,
    n_blocks: int | None,
    release: Release | None = None,
    *,
    defer_names: bool = False,
) -> TreeChecks | None:
    """Every check of an index's contents once its table of contents is read: what a record of
    :mod:`.checked_indexes` stands for (a mount of a recorded index skips exactly these).  ``release``:
    see :func:`.index_checks.validate_arrays` (a pack's, checking a map of the copy it kept).
    ``defer_names``: the tree's checks of the paths' bytes are left out and returned (a mount's)."""
    tree = validate_arrays(arrays, where, n_blocks, release, defer_names=defer_names)
    if all(name in arrays for name in DIGEST_ARRAYS):
        check_chunk_table(arrays, where)
    return tree


class PackedIndex:
    """An index held in memory this process owns.  Opening reads the file once, checks its CRC (when the
    metadata's is given), its table of contents and its contents; nothing per entry is built.

    Changing or truncating the file afterwards cannot reach this object: it never maps the file (with
    ``copies``, a mount's, it maps a private unnamed copy of it: :mod:`.index_copy`).
    """

    def __init__(
        self,
        path: str | os.PathLike,
        n_blocks: int | None = None,
        crc32: int | None = None,
        digest: str | None = None,
        checked: CheckedIndexes | None = None,
        copies: IndexCopies | None = None,
        defer_tree_checks: bool = False,
    ) -> None:
        self.file = os.fspath(path)
        where = f"index {self.file}"
        # Hashed as it is read (on a thread, piece by piece), when blockfs.json gives a digest to compare with.
        # With ``copies`` (a mount's), a copy kept by an earlier mount of this digest is mapped instead.
        self._buf, hashed = read_index_file_hashed(self.file, where, copies, digest is not None, expected=digest)
        toc_len, self.version = check_header(self._buf, where)  # before the CRC: "not an index" or "upgrade" say more
        if digest is not None:  # the chain: blockfs.json names this file's digest, and with it every digest inside
            if self.version < 2:
                raise IndexFormatError(
                    f"{where}: blockfs.json records its digest, but it is a version {self.version} "
                    f"index, which holds none; {REPACK}"
                )
            try:
                check_digest(self._buf, where, digest, hashed)
            except IndexFormatError:
                if crc32 is not None:  # damage by accident is named as it always was
                    check_crc(self._buf, where, crc32)
                raise
        elif crc32 is not None:  # the digest, where there is one, proves all the CRC-32 would, and more
            check_crc(self._buf, where, crc32)
        placed = read_toc(self._buf, toc_len, where, self.version)
        self.arrays: dict[str, np.ndarray] = array_views(self._buf, placed)
        self.has_digests = all(name in self.arrays for name in DIGEST_ARRAYS)
        # ``checked``: the record of indexes whose contents passed every check of this code, by digest; only
        # an index whose digest blockfs.json vouches for (just checked above) is looked up or recorded.
        recorded = digest is not None and checked is not None and checked.has(digest)
        newly_recorded = False
        # ``defer_tree_checks`` (a mount's): the paths' bytes are checked a directory at a time before they
        # are answered, and whole by finish_checks (.directory_checks), which records the index then.
        self.directory_checks: DirectoryChecks | None = None
        self._record = checked if digest is not None else None
        self._digest = digest
        if recorded:
            check_lengths(self.arrays, where, n_blocks)  # the metadata's block count is not in the digest
        else:
            tree = check_contents(self.arrays, where, n_blocks, defer_names=defer_tree_checks)
            if tree is not None:
                self.directory_checks = DirectoryChecks(tree)
            elif digest is not None and checked is not None:
                newly_recorded = checked.add(digest)
        self.checks_skipped = recorded
        self.checks_recorded = newly_recorded  # checked now, and the next open here with the record skips it
        self.n_entries = int(self.arrays["kind"].size)
        self.n_blocks = int(self.arrays["block_counts"].size)
        self.raw = memoryview(self._buf).toreadonly()  # the file's bytes as read and checked

        # Hot-path views: plain memoryview indexing returns Python ints far faster than NumPy's.
        def view(name: str, fmt: _IntFormat) -> memoryview:
            offset, count = placed[name]
            return self.raw[offset : offset + count * self.arrays[name].itemsize].cast(fmt)

        self._path_off = view("path_offsets", "Q")
        self._hash_start = view("hash_start", "I")
        self._hash_order = view("hash_order", "I")
        self._kind = view("kind", "B")
        self._child_start = view("child_start", "I")
        self._child_count = view("child_count", "I")
        self._parent = view("parent", "I")
        # Each directory looked up in: (the CRC-32 of its path and "/", that prefix's length), so a lookup by
        # name hashes the name alone, from there (a cache, bounded: DIR_SEEDS_KEPT directories, then renewed).
        self._dir_seeds: dict[int, tuple[int, int]] = {}
        # What stat needs, one view per column: a stat reads eight of them.
        stat_columns: tuple[tuple[str, _IntFormat], ...] = (
            ("kind", "B"),
            ("mode", "I"),
            ("size", "Q"),
            ("mtime_ns", "q"),
            ("ino", "Q"),
            ("nlink", "I"),
            ("label", "i"),
            ("block", "i"),
        )
        self._stat_views = tuple(view(name, fmt) for name, fmt in stat_columns)
        # What a read needs: (kind, block, slot, size, crc).
        read_columns: tuple[tuple[str, _IntFormat], ...] = (
            ("kind", "B"),
            ("block", "i"),
            ("slot", "I"),
            ("size", "Q"),
            ("crc", "I"),
        )
        self._read_views = tuple(view(name, fmt) for name, fmt in read_columns)
        self._mask = int(self.arrays["hash_start"].size) - 2
        self._paths_start = placed["paths"][0]

    @property
    def records_checks(self) -> bool:
        """Whether passing every check is recorded for the next open here (a record given, a digest to key it)."""
        return self._record is not None and self._digest is not None

    def finish_checks(self, stop: threading.Event) -> bool:
        """Run the checks :meth:`__init__` deferred, on the calling thread, and record the index as checked
        when they pass (``checks_recorded`` says whether that record was kept); True once nothing is
        deferred, False if stopped or failed (failing directories are refused as they are used)."""
        pending = self.directory_checks
        if pending is None:
            return True
        if not pending.check_all(stop):
            return False
        self.directory_checks = None
        if self._record is not None and self._digest is not None:
            self.checks_recorded = self._record.add(self._digest)
        return True

    # --- lookups -----------------------------------------------------------------------------
    def path(self, entry: int) -> bytes:
        """The entry's relative path (b"" for the root)."""
        start = self._paths_start + self._path_off[entry]
        return self._buf[start : self._paths_start + self._path_off[entry + 1] - 1]

    def find(self, path: bytes) -> int:
        """The entry id of a relative path, or -1."""
        bucket = zlib.crc32(path) & self._mask
        order = self._hash_order
        for i in range(self._hash_start[bucket], self._hash_start[bucket + 1]):
            entry = order[i]
            if self.path(entry) == path:
                pending = self.directory_checks
                if pending is not None:
                    pending.ensure_above(entry)
                return entry
        return -1

    def find_child(self, parent: int, name: bytes) -> int:
        """The entry named ``name`` in directory ``parent``, or -1: :meth:`find` of the child's path, without
        building it — the path's hash continues from the directory's, and a candidate matches by its parent
        and the last component of its path (a child's path is its parent's, "/" and its name)."""
        pending = self.directory_checks
        if pending is not None:
            pending.ensure(parent)
        seeds = self._dir_seeds
        seed = seeds.get(parent)
        if seed is None:
            prefix = self.path(parent) + b"/" if parent else b""
            if len(seeds) >= DIR_SEEDS_KEPT:
                seeds.clear()
            seed = seeds[parent] = (zlib.crc32(prefix), len(prefix))
        crc, skip = seed
        bucket = zlib.crc32(name, crc) & self._mask
        order, parents, off, buf = self._hash_order, self._parent, self._path_off, self._buf
        base = self._paths_start + skip
        for i in range(self._hash_start[bucket], self._hash_start[bucket + 1]):
            entry = order[i]
            if entry and parents[entry] == parent:  # the root (entry 0) is no one's child
                start, stop = base + off[entry], self._paths_start + off[entry + 1] - 1
                if stop - start == len(name) and buf[start:stop] == name:
                    return entry
        return -1

    def lookup(self, path: bytes) -> int:
        entry = self.find(path)
        if entry < 0:
            raise EntryNotFoundError(f"no such file or directory in the packed dataset: {os.fsdecode(path)!r}")
        return entry

    def kind(self, entry: int) -> int:
        return self._kind[entry]

    def stat_fields(self, entry: int) -> tuple[int, ...]:
        """(kind, mode, size, mtime_ns, ino, nlink, label, block) of an entry, as Python ints."""
        kind, mode, size, mtime_ns, ino, nlink, label, block = self._stat_views  # no generator: one per request
        return (
            kind[entry],
            mode[entry],
            size[entry],
            mtime_ns[entry],
            ino[entry],
            nlink[entry],
            label[entry],
            block[entry],
        )

    def attr_fields(self, entry: int) -> tuple[int, int, int, int, int, int]:
        """(kind, ino, size, mode, nlink, mtime_ns) of an entry as a stat shows it, as Python ints: a symlink's
        size is its target's length (the one rule; :meth:`link_length`)."""
        kind, mode, size, mtime_ns, ino, nlink, _label, _block = self._stat_views
        k = kind[entry]
        return (
            k,
            ino[entry],
            self.link_length(entry) if k == KIND_SYMLINK else size[entry],
            mode[entry],
            nlink[entry],
            mtime_ns[entry],
        )

    def link_length(self, entry: int) -> int:
        """The length of a symlink's target, without building it."""
        k = int(self.arrays["slot"][entry])
        off = self.arrays["link_offsets"]
        return int(off[k + 1]) - int(off[k])

    def read_fields(self, entry: int) -> tuple[int, int, int, int, int]:
        """(kind, block, slot, size, crc) of an entry, as Python ints: what a read needs, one call per read."""
        kind, block, slot, size, crc = self._read_views
        return kind[entry], block[entry], slot[entry], size[entry], crc[entry]

    def children(self, entry: int) -> range:
        if self._kind[entry] != KIND_DIR:
            raise NotADirectoryEntryError(f"not a directory: {os.fsdecode(self.path(entry))!r}")
        pending = self.directory_checks
        if pending is not None:
            pending.ensure(entry)
        start = self._child_start[entry]
        return range(start, start + self._child_count[entry])

    def names(self, entry: int) -> list[bytes]:
        """Names of a directory's children, sorted."""
        return self.joined_names(entry).split(b"\0")[:-1]

    def joined_names(self, entry: int) -> bytes:
        """The names of a directory's children, sorted, each followed by a NUL, from one slice of the path
        table: the children's paths lie back to back there, each its parent's path + "/" + its name
        (checked at open), so one ``replace`` drops the shared prefix and no path is built or split."""
        kids = self.children(entry)
        table = self._buf[
            self._paths_start + self._path_off[kids.start] : self._paths_start + self._path_off[kids.stop]
        ]
        if entry == 0 or not table:
            return table
        prefix = self.path(entry) + b"/"  # NUL then prefix starts every path: names hold neither NUL nor "/"
        return (b"\0" + table).replace(b"\0" + prefix, b"\0")[1:]

    def name_spans(self, entry: int, first: int, stop: int) -> tuple[np.ndarray, np.ndarray]:
        """(start, length) in ``arrays["paths"]`` of the names of directory ``entry``'s children
        ``first..stop-1`` (entry ids, within :meth:`children`), as int64 arrays: each name is its path
        past the parent's path and "/"."""
        pending = self.directory_checks
        if pending is not None:
            pending.ensure(entry)
        off = self.arrays["path_offsets"][first : stop + 1].astype(np.int64)
        skip = 0 if entry == 0 else self._path_off[entry + 1] - self._path_off[entry]  # the path, "/" for its NUL
        return off[:-1] + skip, off[1:] - off[:-1] - 1 - skip

    def link_target(self, entry: int) -> bytes:
        k = int(self.arrays["slot"][entry])
        off = self.arrays["link_offsets"]
        return self.arrays["links"][int(off[k]) : int(off[k + 1])].tobytes()

    def close(self) -> None:
        self.arrays.clear()
        for view in (*self.__dict__.pop("_stat_views", ()), *self.__dict__.pop("_read_views", ())):
            view.release()
        for name in (
            "_path_off",
            "_hash_start",
            "_hash_order",
            "_kind",
            "_child_start",
            "_child_count",
            "_parent",
            "raw",
        ):
            view = self.__dict__.pop(name, None)
            if view is not None:
                view.release()
        try:
            self._buf.close()
        except BufferError:
            pass  # a caller still holds an array view; the memory goes when it does
