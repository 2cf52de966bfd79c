"""The columnar index of a packed dataset: one file, memory-mapped, no per-entry Python objects at open.

Entries are the tree's nodes; entry 0 is the root directory.  Entries are sorted by (parent path, name),
so the children of every directory are contiguous and sorted by name: listing a directory is a slice.
A path lookup hashes the full path (CRC-32) into a bucket table — O(1) — and confirms by comparing bytes.

File layout (little-endian)::

    0   8  magic b"BLKFSIDX"
    8   2  version u16
    10  2  reserved
    12  4  toc_len u32
    16  .  table of contents, JSON: {"arrays": {name: [dtype, offset, count]}, ...}
    ..     the arrays, each starting at a 64-byte aligned offset

Paths are raw bytes (``os.fsencode``), stored NUL-terminated back to back after one leading NUL, so every
path ``p`` appears as ``\\0p\\0`` and forbidden forms (``..``, ``.``, ``//``, a leading ``/``) can be
found with a few byte searches at open time instead of a Python loop over entries.
"""

from __future__ import annotations

import json
import mmap
import os
import zlib
from dataclasses import dataclass
import numpy as np

from ..errors import (
    EntryNotFoundError,
    IndexFormatError,
    NotADirectoryEntryError,
    UnsupportedVersionError,
)
from .treecheck import check_tree

INDEX_MAGIC = b"BLKFSIDX"
INDEX_VERSION = 1
ALIGN = 64
VALIDATE_PIECE = 1 << 18  # entries checked at a time when an index is opened

KIND_FILE = 0
KIND_DIR = 1
KIND_SYMLINK = 2
KIND_NAMES = {KIND_FILE: "file", KIND_DIR: "dir", KIND_SYMLINK: "symlink"}

# name -> dtype of every per-entry column
ENTRY_COLUMNS = {
    "kind": "u1",
    "mode": "<u4",
    "mtime_ns": "<i8",
    "size": "<u8",
    "block": "<i4",  # -1 for directories and symlinks
    "slot": "<u4",  # file: slot in its block; symlink: index into the link table
    "label": "<i4",
    "crc": "<u4",  # CRC-32 of the file's bytes
    "ino": "<u8",  # inode number; hard links share their first entry's
    "nlink": "<u4",
    "parent": "<u4",
    "child_start": "<u4",
    "child_count": "<u4",
}


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


def _pad(n: int) -> int:
    return -n % ALIGN


def write_index(
    path: str | os.PathLike,
    cols: IndexColumns,
    block_counts: np.ndarray,
    block_sizes: np.ndarray,
) -> None:
    """Sort the entries into tree order, build the lookup tables and write the index file at ``path``.

    ``block_counts[b]`` is the number of slots in block b, ``block_sizes[b]`` its file size in bytes.
    Writes ``path`` directly: the packer writes to a temporary name and renames.
    """
    prepare_index(cols, block_counts).write(path, cols.crc, block_sizes)


@dataclass
class PreparedIndex:
    """An index with everything but the file CRCs and block sizes, which the packer knows last."""

    arrays: dict[str, np.ndarray | None]
    order: np.ndarray  # index position -> position in the IndexColumns it was prepared from

    def write(self, path: str | os.PathLike, crc: np.ndarray, block_sizes: np.ndarray) -> None:
        """Write the index file at ``path``; ``crc`` is in the order of the prepared columns."""
        arrays = dict(self.arrays, crc=np.asarray(crc)[self.order], block_sizes=np.asarray(block_sizes))
        dtypes = dict(ENTRY_COLUMNS)
        dtypes.update(
            path_offsets="<u8", paths="u1", link_offsets="<u8", links="u1", hash_start="<u4",
            hash_order="<u4", block_counts="<u4", block_sizes="<u8", block_offsets="<u8",
            block_files="<u4",
        )
        _write_arrays(path, {k: np.ascontiguousarray(v, dtype=dtypes[k]) for k, v in arrays.items()})


def prepare_index(cols: IndexColumns, block_counts: np.ndarray) -> PreparedIndex:
    """Sort the entries into tree order and build the lookup tables (``cols.crc`` is not read)."""
    n = len(cols.paths)
    if n == 0 or cols.paths.count(b"") != 1:
        raise ValueError("the entries must include the root (path b'') exactly once")
    # Sorting by (parent, name) makes every directory's children one contiguous, name-sorted run; the
    # root's key (b"", b"") sorts before every other.
    keys = [(p.rpartition(b"/")[0], p) for p in cols.paths]
    order = sorted(range(n), key=keys.__getitem__)
    paths = [cols.paths[i] for i in order]
    new_id = np.empty(n, dtype=np.int64)
    new_id[np.asarray(order, dtype=np.int64)] = np.arange(n)
    id_of = {p: i for i, p in enumerate(paths)}

    kind = np.asarray(cols.kind)[order].astype(np.uint8)
    parent_ids = [id_of.get(keys[i][0], -1) for i in order[1:]]
    parent = np.array([0, *parent_ids], dtype=np.int64)
    orphans = np.flatnonzero((parent[1:] < 0) | (kind[parent[1:]] != KIND_DIR))
    if len(orphans):
        raise ValueError(f"entry {paths[orphans[0] + 1]!r} has no parent directory in the index")
    child_count = np.bincount(parent[1:], minlength=n).astype(np.uint32)
    child_start = np.zeros(n, dtype=np.uint32)
    parents, first_child = np.unique(parent[1:], return_index=True)  # each run of children is contiguous
    child_start[parents] = first_child + 1
    parent = parent.astype(np.uint32)

    ino = np.arange(1, n + 1, dtype=np.uint64)
    nlink = np.ones(n, dtype=np.uint32)
    for alias, primary in cols.hardlink_of.items():
        ino[new_id[alias]] = new_id[primary] + 1
    if cols.hardlink_of:
        uniq, counts = np.unique(ino, return_counts=True)
        nlink = counts[np.searchsorted(uniq, ino)].astype(np.uint32)
    subdirs = np.bincount(parent[1:][kind[1:] == KIND_DIR], minlength=n)
    nlink[kind == KIND_DIR] = 2 + subdirs[kind == KIND_DIR]

    link_items = sorted((new_id[pos], target) for pos, target in cols.link_targets.items())
    slot = np.asarray(cols.slot)[order].astype(np.uint32)
    for k, (entry, _target) in enumerate(link_items):
        slot[entry] = k
    links_blob = b"".join(t for _, t in link_items)
    link_offsets = np.zeros(len(link_items) + 1, dtype=np.uint64)
    np.cumsum([len(t) for _, t in link_items], out=link_offsets[1:])

    blob = b"\0" + b"".join(p + b"\0" for p in paths)
    path_offsets = np.empty(n + 1, dtype=np.uint64)
    path_offsets[0] = 1
    np.cumsum(np.fromiter(map(len, paths), dtype=np.uint64, count=n) + 1, out=path_offsets[1:])
    path_offsets[1:] += 1

    n_buckets = 1 << max(0, (n - 1).bit_length())
    bucket = np.fromiter(map(zlib.crc32, paths), dtype=np.uint64, count=n) & (n_buckets - 1)
    hash_order = np.argsort(bucket, kind="stable").astype(np.uint32)
    hash_start = np.searchsorted(bucket[hash_order], np.arange(n_buckets + 1)).astype(np.uint32)

    block = np.asarray(cols.block)[order].astype(np.int32)
    files = np.flatnonzero(block >= 0)
    by_block = files[np.lexsort((files, slot[files], block[files]))]
    block_offsets = np.zeros(len(block_counts) + 1, dtype=np.uint64)
    np.cumsum(np.bincount(block[by_block], minlength=len(block_counts)), out=block_offsets[1:])

    arrays: dict[str, np.ndarray] = {
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
        "paths": np.frombuffer(blob, dtype=np.uint8),
        "link_offsets": link_offsets,
        "links": np.frombuffer(links_blob, dtype=np.uint8),
        "hash_start": hash_start,
        "hash_order": hash_order,
        "block_counts": np.asarray(block_counts),
        "block_sizes": None,  # filled in by PreparedIndex.write
        "block_offsets": block_offsets,
        "block_files": by_block.astype(np.uint32),
    }
    return PreparedIndex(arrays, np.asarray(order, dtype=np.int64))


def _write_arrays(path: str | os.PathLike, arrays: dict[str, np.ndarray]) -> None:
    # Two passes: the table of contents holds offsets, which depend on its own length.
    toc_len = 0
    while True:
        pos = 16 + toc_len
        pos += _pad(pos)
        toc: dict[str, list] = {}
        for name, arr in arrays.items():
            toc[name] = [arr.dtype.str, pos, int(arr.size)]
            pos += arr.nbytes + _pad(arr.nbytes)
        raw = json.dumps({"arrays": toc, "n_entries": int(arrays["kind"].size)}).encode()
        if len(raw) <= toc_len:
            break
        toc_len = len(raw) + 64
    raw = raw.ljust(toc_len)
    with open(path, "wb") as f:
        f.write(INDEX_MAGIC + INDEX_VERSION.to_bytes(2, "little") + b"\0\0" + toc_len.to_bytes(4, "little"))
        f.write(raw)
        for name, arr in arrays.items():
            f.write(b"\0" * (toc[name][1] - f.tell()))
            f.write(arr.tobytes())
        f.write(b"\0" * _pad(f.tell()))
        f.flush()
        os.fsync(f.fileno())


def _find_forbidden_component(blob: np.ndarray, piece: int = 1 << 20) -> int:
    """Offset of the first empty, "." or ".." component in a NUL-separated path table, or -1.

    Every path p is stored as \\0p\\0 (the root, first, as \\0\\0).  Works in pieces so the
    temporary masks stay small whatever the table's size.
    """
    n = blob.size
    for lo in range(0, n, piece):
        b = blob[lo : min(n, lo + piece + 3)]
        slash = b == 47
        boundary = slash | (b == 0)
        dot = b == 46
        empty = boundary[:-1] & boundary[1:] & (slash[:-1] | slash[1:])  # "//", "\\0/", "/\\0"
        hits = [np.flatnonzero(empty)]
        if b.size >= 3:
            hits.append(np.flatnonzero(boundary[:-2] & dot[1:-1] & boundary[2:]))
        if b.size >= 4:
            hits.append(np.flatnonzero(boundary[:-3] & dot[1:-2] & dot[2:-1] & boundary[3:]))
        first = min((int(h[0]) for h in hits if h.size), default=-1)
        if first >= 0:
            return lo + first
    return -1


def _mv(mm: mmap.mmap, offset: int, nbytes: int, fmt: str) -> memoryview:
    """A typed memoryview over the map: scalar indexing far cheaper than numpy's."""
    return memoryview(mm)[offset : offset + nbytes].cast(fmt)


class PackedIndex:
    """A memory-mapped index.  Opening maps the file and validates it; nothing per entry is built."""

    def __init__(self, path: str | os.PathLike, n_blocks: int | None = None) -> None:
        self.file = os.fspath(path)
        where = f"index {self.file}"
        try:
            fd = os.open(self.file, os.O_RDONLY)
        except OSError as e:
            raise IndexFormatError(f"{where}: cannot open: {e.strerror}") from e
        try:
            size = os.fstat(fd).st_size
            if size < 16:
                raise IndexFormatError(f"{where}: truncated ({size} bytes)")
            self._mm = mmap.mmap(fd, 0, access=mmap.ACCESS_READ)
        finally:
            os.close(fd)
        head = self._mm[:16]
        if head[:8] != INDEX_MAGIC:
            raise IndexFormatError(f"{where}: not a blockfs index (magic {head[:8]!r})")
        version = int.from_bytes(head[8:10], "little")
        if version > INDEX_VERSION:
            raise UnsupportedVersionError(
                f"{where}: written by index version {version}; this blockfs reads up to "
                f"{INDEX_VERSION}: upgrade blockfs"
            )
        toc_len = int.from_bytes(head[12:16], "little")
        try:
            toc = json.loads(self._mm[16 : 16 + toc_len])
            specs = toc["arrays"]
        except (ValueError, KeyError) as e:
            raise IndexFormatError(f"{where}: damaged table of contents") from e
        self.arrays: dict[str, np.ndarray] = {}
        self._offsets = {name: int(spec[1]) for name, spec in specs.items()}
        for name, (dtype, offset, count) in specs.items():
            dt = np.dtype(dtype)
            if offset + count * dt.itemsize > size:
                raise IndexFormatError(f"{where}: array {name!r} runs past the end of the file")
            arr = np.frombuffer(self._mm, dtype=dt, count=count, offset=offset)
            self.arrays[name] = arr
        missing = set(ENTRY_COLUMNS) - set(self.arrays)
        if missing:
            raise IndexFormatError(f"{where}: missing arrays {sorted(missing)}")
        a = self.arrays
        self.n_entries = int(a["kind"].size)
        self.n_blocks = int(a["block_counts"].size)
        self._validate(where, n_blocks)

        # Hot-path views: plain memoryview indexing returns Python ints quickly.
        def view(name: str, fmt: str) -> memoryview:
            _, off, count = specs[name]
            return _mv(self._mm, off, count * np.dtype(specs[name][0]).itemsize, fmt)

        self._path_off = view("path_offsets", "Q")
        self._hash_start = view("hash_start", "I")
        self._hash_order = view("hash_order", "I")
        self._kind = view("kind", "B")
        self._child_start = view("child_start", "I")
        self._child_count = view("child_count", "I")
        self._mask = int(a["hash_start"].size) - 2
        self._paths_start = self._offsets["paths"]

    def _validate(self, where: str, n_blocks: int | None) -> None:
        a = self.arrays
        n = self.n_entries
        for name in ENTRY_COLUMNS:
            if a[name].size != n:
                raise IndexFormatError(f"{where}: column {name!r} has {a[name].size} rows, not {n}")
        if n == 0 or a["kind"][0] != KIND_DIR:
            raise IndexFormatError(f"{where}: entry 0 is not the root directory")
        if n_blocks is not None and n_blocks != self.n_blocks:
            raise IndexFormatError(f"{where}: lists {self.n_blocks} blocks, the metadata {n_blocks}")
        off = a["path_offsets"]
        if off.size != n + 1 or int(off[-1]) != a["paths"].size or int(off[0]) != 1:
            raise IndexFormatError(f"{where}: path table is inconsistent")
        hs, ho = a["hash_start"], a["hash_order"]
        if hs.size < 2 or (hs.size - 1) & (hs.size - 2) or int(hs[-1]) != n:
            raise IndexFormatError(f"{where}: lookup table is inconsistent")
        # Entry checks run in pieces so their temporary arrays stay small at any index size.
        for lo in range(0, n, VALIDATE_PIECE):
            self._validate_entries(where, lo, min(n, lo + VALIDATE_PIECE))
        for lo in range(0, hs.size - 1, VALIDATE_PIECE):
            piece = hs[lo : lo + VALIDATE_PIECE + 1]
            if np.any(piece[1:] < piece[:-1]):
                raise IndexFormatError(f"{where}: lookup table is inconsistent")
        bad = _find_forbidden_component(a["paths"])
        if bad >= 0:
            raise IndexFormatError(
                f"{where}: a path has a forbidden form near byte {bad} of the path table: absolute "
                "paths, '.', '..' and empty components are rejected"
            )
        check_tree(self.arrays, where)
        # Validation read the whole file; drop those pages from this process (they stay in the page
        # cache) so an open index costs memory only for what lookups touch.
        self._mm.madvise(mmap.MADV_DONTNEED)

    def _validate_entries(self, where: str, lo: int, hi: int) -> None:
        a = self.arrays
        n = self.n_entries
        kind, block, slot = a["kind"][lo:hi], a["block"][lo:hi], a["slot"][lo:hi]
        if np.any(kind > KIND_SYMLINK):
            raise IndexFormatError(f"{where}: unknown entry kind")
        is_file = kind == KIND_FILE
        fb = block[is_file]
        if fb.size and (fb.min() < 0 or fb.max() >= self.n_blocks):
            bad = lo + int(np.flatnonzero(is_file)[(fb < 0) | (fb >= self.n_blocks)][0])
            raise IndexFormatError(
                f"{where}: entry {bad} names block {int(a['block'][bad])}, outside 0..{self.n_blocks - 1}"
            )
        over = slot[is_file] >= a["block_counts"][fb]
        if np.any(over):
            bad = lo + int(np.flatnonzero(is_file)[over][0])
            raise IndexFormatError(
                f"{where}: entry {bad} names slot {int(a['slot'][bad])} of block {int(a['block'][bad])}, "
                f"which has {int(a['block_counts'][a['block'][bad]])} slots"
            )
        if np.any(slot[kind == KIND_SYMLINK] >= a["link_offsets"].size - 1):
            raise IndexFormatError(f"{where}: a symlink names a target out of range")
        ends = a["child_start"][lo:hi].astype(np.uint64) + a["child_count"][lo:hi]
        if np.any(ends > n) or np.any(a["parent"][lo:hi] >= n) or np.any(a["hash_order"][lo:hi] >= n):
            raise IndexFormatError(f"{where}: directory or lookup ranges out of range")
        off = a["path_offsets"][lo : hi + 1].astype(np.int64)
        steps = off[1:] - off[:-1]
        if np.any(steps < 1) or np.any(a["paths"][off[1:] - 1] != 0):
            raise IndexFormatError(f"{where}: path table is inconsistent")
        if np.any(steps[(1 if lo == 0 else 0) :] == 1):
            raise IndexFormatError(f"{where}: an entry other than the root has an empty path")
        # Every NUL in the table must end a path, or a path could hide a NUL-separated one.
        nul = np.count_nonzero(a["paths"][off[0] : off[-1]] == 0)
        if nul != hi - lo:
            raise IndexFormatError(f"{where}: path table is inconsistent")

    # --- lookups -----------------------------------------------------------------------------
    def path(self, entry: int) -> bytes:
        """The entry's relative path (b"" for the root)."""
        start = self._paths_start + self._path_off[entry]
        return self._mm[start : self._paths_start + self._path_off[entry + 1] - 1]

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
            raise EntryNotFoundError(f"no such file or directory in the packed dataset: {path!r}")
        return entry

    def kind(self, entry: int) -> int:
        return self._kind[entry]

    def children(self, entry: int) -> range:
        if self._kind[entry] != KIND_DIR:
            raise NotADirectoryEntryError(f"not a directory: {self.path(entry)!r}")
        start = self._child_start[entry]
        return range(start, start + self._child_count[entry])

    def names(self, entry: int) -> list[bytes]:
        """Names of a directory's children, sorted."""
        return [self.path(c).rpartition(b"/")[2] for c in self.children(entry)]

    def link_target(self, entry: int) -> bytes:
        k = int(self.arrays["slot"][entry])
        off = self.arrays["link_offsets"]
        return self.arrays["links"][int(off[k]) : int(off[k + 1])].tobytes()

    def close(self) -> None:
        self.arrays.clear()
        for name in ("_path_off", "_hash_start", "_hash_order", "_kind", "_child_start", "_child_count"):
            view = self.__dict__.pop(name, None)
            if view is not None:
                view.release()
        try:
            self._mm.close()
        except BufferError:
            pass  # a caller still holds an array view; the map goes when it does

