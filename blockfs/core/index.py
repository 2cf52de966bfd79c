"""The columnar index of a packed dataset: one file, read once, no per-entry Python objects at open.

Entries are the tree's nodes; entry 0 is the root directory.  Entries are sorted by (parent path, name),
so the children of every directory are contiguous and sorted by name: listing a directory is a slice.
A path lookup hashes the full path (CRC-32) into a bucket table — O(1) — and confirms by comparing bytes.

Paths are raw bytes (``os.fsencode``), stored NUL-terminated back to back after one leading NUL, so every
path ``p`` appears as ``\\0p\\0`` and forbidden forms (``..``, ``.``, ``//``, a leading ``/``) can be
found with a few byte searches at open time instead of a Python loop over entries.

The file layout, its schema and how it is read are in :mod:`.index_format`; the checks an index passes
before it is used are in :mod:`.index_checks`.  This module builds an index (:func:`prepare_index`) and
answers lookups (:class:`PackedIndex`).
"""

from __future__ import annotations

import os
import zlib
from dataclasses import dataclass
from typing import BinaryIO, Literal

import numpy as np

from ..errors import EntryNotFoundError, IndexFormatError, NotADirectoryEntryError
from .index_checks import validate_arrays
from .index_format import REPACK
from .index_format import (  # noqa: F401  (KIND_* and ENTRY_COLUMNS are imported from here by others)
    ENTRY_COLUMNS,
    INDEX_MAGIC,
    INDEX_VERSION,
    KIND_DIR,
    KIND_FILE,
    KIND_NAMES,
    KIND_SYMLINK,
    DIGEST_ARRAYS,
    array_views,
    check_crc,
    check_chunk_table,
    check_digest,
    check_header,
    read_index_file,
    read_toc,
    write_arrays,
)

_IntFormat = Literal["B", "I", "Q", "i", "q"]  # memoryview.cast formats of the index's integer columns


@dataclass
class IndexColumns:
    """What the packer knows about each entry, in any order; :func:`write_index` sorts it."""

    paths: list[bytes]  # relative, "/"-separated, no leading "/"; b"" is the root
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


@dataclass
class PreparedIndex:
    """An index with everything but the file CRCs and block sizes, which the packer knows last."""

    arrays: dict[str, np.ndarray | None]
    order: np.ndarray  # index position -> position in the IndexColumns it was prepared from

    def write(self, f: BinaryIO, crc: np.ndarray, block_sizes: np.ndarray,
              digests: tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray] | None = None) -> None:  # fmt: skip
        """Write the index file into ``f`` (a new binary file); ``crc`` is in the order of the prepared columns.  ``digests``:
        (file digests in the order of the prepared columns, block header digests, chunk digests: rows of
        32 bytes; and where each block's chunks start, n_blocks + 1); without them the index is version 1
        (tests of the old format)."""
        arrays = dict(self.arrays, crc=np.asarray(crc)[self.order], block_sizes=np.asarray(block_sizes))
        if digests is not None:
            files, heads, chunks, block_chunks = digests
            arrays.update(file_digest=np.asarray(files)[self.order], block_head_digest=heads, chunk_digest=chunks,
                          block_chunks=block_chunks)  # fmt: skip
        write_arrays(f, arrays)


# --- building an index: one step per table ----------------------------------------------------------
def prepare_index(cols: IndexColumns, block_counts: np.ndarray) -> PreparedIndex:
    """Sort the entries into tree order and build the lookup tables (``cols.crc`` is not read)."""
    order, paths = _tree_order(cols.paths)
    new_id = np.empty(len(order), dtype=np.int64)
    new_id[order] = np.arange(len(order))
    kind = np.asarray(cols.kind)[order].astype(np.uint8)
    parent, child_start, child_count = _directory_tables(paths, kind)
    ino, nlink = _inodes(kind, parent, {int(new_id[a]): int(new_id[p]) for a, p in cols.hardlink_of.items()})
    slot = np.asarray(cols.slot)[order].astype(np.uint32)
    links, link_offsets = _link_table(slot, {int(new_id[pos]): t for pos, t in cols.link_targets.items()})
    blob, path_offsets = _path_table(paths)
    hash_start, hash_order = _hash_table(paths)
    block = np.asarray(cols.block)[order].astype(np.int32)
    block_offsets, block_files = _block_layout(block, slot, len(block_counts))
    arrays: dict[str, np.ndarray | None] = {
        "kind": kind,
        "mode": np.asarray(cols.mode)[order],
        "mtime_ns": np.asarray(cols.mtime_ns)[order],
        "size": np.asarray(cols.size)[order],
        "block": block,
        "slot": slot,
        "label": np.asarray(cols.label)[order],
        "crc": None,  # filled in by PreparedIndex.write
        "ino": ino,
        "nlink": nlink,
        "parent": parent,
        "child_start": child_start,
        "child_count": child_count,
        "path_offsets": path_offsets,
        "paths": blob,
        "link_offsets": link_offsets,
        "links": links,
        "hash_start": hash_start,
        "hash_order": hash_order,
        "block_counts": np.asarray(block_counts),
        "block_sizes": None,  # filled in by PreparedIndex.write
        "block_offsets": block_offsets,
        "block_files": block_files,
    }
    return PreparedIndex(arrays, order)


def _tree_order(all_paths: list[bytes]) -> tuple[np.ndarray, list[bytes]]:
    """(order, paths in that order): sorted by (parent, name), so every directory's children are one
    contiguous, name-sorted run; the root's key (b"", b"") sorts before every other."""
    n = len(all_paths)
    if n == 0 or all_paths.count(b"") != 1:
        raise ValueError("the entries must include the root (path b'') exactly once")
    keys = [(p.rpartition(b"/")[0], p) for p in all_paths]
    order = sorted(range(n), key=keys.__getitem__)
    return np.asarray(order, dtype=np.int64), [all_paths[i] for i in order]


def _directory_tables(paths: list[bytes], kind: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(parent, child_start, child_count) of entries in tree order."""
    n = len(paths)
    id_of = {p: i for i, p in enumerate(paths)}
    parent = np.array([0, *(id_of.get(p.rpartition(b"/")[0], -1) for p in paths[1:])], dtype=np.int64)
    orphans = np.flatnonzero((parent[1:] < 0) | (kind[parent[1:]] != KIND_DIR))
    if len(orphans):
        raise ValueError(f"entry {os.fsdecode(paths[orphans[0] + 1])!r} has no parent directory in the index")
    child_count = np.bincount(parent[1:], minlength=n).astype(np.uint32)
    child_start = np.zeros(n, dtype=np.uint32)
    parents, first_child = np.unique(parent[1:], return_index=True)  # each run of children is contiguous
    child_start[parents] = first_child + 1
    return parent.astype(np.uint32), child_start, child_count


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


def _link_table(slot: np.ndarray, targets: dict[int, bytes]) -> tuple[np.ndarray, np.ndarray]:
    """(links, link_offsets); each symlink's slot becomes its place in the table (``slot`` is updated)."""
    items = sorted(targets.items())
    for k, (entry, _target) in enumerate(items):
        slot[entry] = k
    link_offsets = np.zeros(len(items) + 1, dtype=np.uint64)
    np.cumsum([len(t) for _, t in items], out=link_offsets[1:])
    return np.frombuffer(b"".join(t for _, t in items), dtype=np.uint8), link_offsets


def _path_table(paths: list[bytes]) -> tuple[np.ndarray, np.ndarray]:
    """(blob, path_offsets): \\0 then every path NUL-terminated; path e is blob[off[e] : off[e + 1] - 1]."""
    n = len(paths)
    blob = b"\0" + b"".join(p + b"\0" for p in paths)
    path_offsets = np.empty(n + 1, dtype=np.uint64)
    path_offsets[0] = 1
    np.cumsum(np.fromiter(map(len, paths), dtype=np.uint64, count=n) + 1, out=path_offsets[1:])
    path_offsets[1:] += 1
    return np.frombuffer(blob, dtype=np.uint8), path_offsets


def _hash_table(paths: list[bytes]) -> tuple[np.ndarray, np.ndarray]:
    """(hash_start, hash_order): bucket k holds entries hash_order[hash_start[k] : hash_start[k + 1]]."""
    n = len(paths)
    n_buckets = 1 << max(0, (n - 1).bit_length())
    bucket = np.fromiter(map(zlib.crc32, paths), dtype=np.uint64, count=n) & (n_buckets - 1)
    hash_order = np.argsort(bucket, kind="stable").astype(np.uint32)
    hash_start = np.searchsorted(bucket[hash_order], np.arange(n_buckets + 1)).astype(np.uint32)
    return hash_start, hash_order


def _block_layout(block: np.ndarray, slot: np.ndarray, n_blocks: int) -> tuple[np.ndarray, np.ndarray]:
    """(block_offsets, block_files): the file entries of each block, in slot order."""
    files = np.flatnonzero(block >= 0)
    by_block = files[np.lexsort((files, slot[files], block[files]))]
    block_offsets = np.zeros(n_blocks + 1, dtype=np.uint64)
    np.cumsum(np.bincount(block[by_block], minlength=n_blocks), out=block_offsets[1:])
    return block_offsets, by_block.astype(np.uint32)


# --- reading an index ---------------------------------------------------------------------------------
class PackedIndex:
    """An index held in memory this process owns.  Opening reads the file once, checks its CRC (when the
    metadata's is given), its table of contents and its contents; nothing per entry is built.

    Changing or truncating the file afterwards cannot reach this object: it never maps the file.
    """

    def __init__(self, path: str | os.PathLike, n_blocks: int | None = None, crc32: int | None = None,
                 digest: str | None = None) -> None:  # fmt: skip
        self.file = os.fspath(path)
        where = f"index {self.file}"
        self._buf = read_index_file(self.file, where)
        toc_len, self.version = check_header(self._buf, where)  # before the CRC: "not an index" or "upgrade" say more
        if crc32 is not None:  # first: damage by accident is named as before
            check_crc(self._buf, where, crc32)
        if digest is not None:  # the chain: blockfs.json names this file's digest, and with it every digest inside
            if self.version < 2:
                raise IndexFormatError(f"{where}: blockfs.json records its digest, but it is a version {self.version} "
                                       f"index, which holds none; {REPACK}")  # fmt: skip
            check_digest(self._buf, where, digest)
        placed = read_toc(self._buf, toc_len, where, self.version)
        self.arrays: dict[str, np.ndarray] = array_views(self._buf, placed)
        validate_arrays(self.arrays, where, n_blocks)
        self.has_digests = all(name in self.arrays for name in DIGEST_ARRAYS)
        if self.has_digests:
            check_chunk_table(self.arrays, where)
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
        # What stat needs, one view per column: a stat reads eight of them.
        stat_columns: tuple[tuple[str, _IntFormat], ...] = (
            ("kind", "B"), ("mode", "I"), ("size", "Q"), ("mtime_ns", "q"), ("ino", "Q"), ("nlink", "I"),
            ("label", "i"), ("block", "i"),
        )  # fmt: skip
        self._stat_views = tuple(view(name, fmt) for name, fmt in stat_columns)
        # What a read needs: (kind, block, slot, size, crc).
        read_columns: tuple[tuple[str, _IntFormat], ...] = (
            ("kind", "B"), ("block", "i"), ("slot", "I"), ("size", "Q"), ("crc", "I"),
        )  # fmt: skip
        self._read_views = tuple(view(name, fmt) for name, fmt in read_columns)
        self._mask = int(self.arrays["hash_start"].size) - 2
        self._paths_start = placed["paths"][0]

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
        return kind[entry], mode[entry], size[entry], mtime_ns[entry], ino[entry], nlink[entry], label[entry], block[entry]

    def read_fields(self, entry: int) -> tuple[int, int, int, int, int]:
        """(kind, block, slot, size, crc) of an entry, as Python ints: what a read needs, one call per read."""
        kind, block, slot, size, crc = self._read_views
        return kind[entry], block[entry], slot[entry], size[entry], crc[entry]

    def children(self, entry: int) -> range:
        if self._kind[entry] != KIND_DIR:
            raise NotADirectoryEntryError(f"not a directory: {os.fsdecode(self.path(entry))!r}")
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
        table = self._buf[self._paths_start + self._path_off[kids.start] : self._paths_start + self._path_off[kids.stop]]
        if entry == 0 or not table:
            return table
        prefix = self.path(entry) + b"/"  # NUL then prefix starts every path: names hold neither NUL nor "/"
        return (b"\0" + table).replace(b"\0" + prefix, b"\0")[1:]

    def name_spans(self, entry: int, first: int, stop: int) -> tuple[np.ndarray, np.ndarray]:
        """(start, length) in ``arrays["paths"]`` of the names of directory ``entry``'s children
        ``first..stop-1`` (entry ids, within :meth:`children`), as int64 arrays: each name is its path
        past the parent's path and "/"."""
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
        for name in ("_path_off", "_hash_start", "_hash_order", "_kind", "_child_start", "_child_count", "raw"):
            view = self.__dict__.pop(name, None)
            if view is not None:
                view.release()
        try:
            self._buf.close()
        except BufferError:
            pass  # a caller still holds an array view; the memory goes when it does
