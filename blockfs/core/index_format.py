"""The index file on disk: its layout, the one schema its table of contents must match, writing and reading.

File layout (little-endian)::

    0   8  magic b"BLKFSIDX"
    8   2  version u16: 2 holds the digest arrays below; 1 (before digests) is still read
    10  2  reserved
    12  4  toc_len u32
    16  .  table of contents, JSON: {"arrays": {name: [dtype, offset, count]}, "n_entries": n}
    ..     the arrays, each starting at a 64-byte aligned offset

The table of contents is data from disk, so it is checked against :data:`SCHEMA` before any array is
built: every array present, no other, each with exactly its schema dtype (an ``object`` or mistyped
column would otherwise be served as numbers), integer offsets and counts that stay inside the file.

Version 2 adds the BLAKE3 digests (32 bytes each, stored flat as ``u1``), the index's links in the chain
that names a dataset::

    blake3(blockfs.json) = the dataset's name          ("blake3:<hex>", what --expect pins)
      blockfs.json  "index": {"blake3": digest of index.bfi}
        index.bfi   block_head_digest[b]  digest of block b's header bytes  [0, data_start)
                    chunk_digest[k]       digest of one CHUNK_SIZE (1 MiB) piece of a data section;
                                          block b's are rows block_chunks[b] .. block_chunks[b + 1]
                                          (a whole-block read checks them all, a piece of a big file
                                          the ones it covers)
                    file_digest[e]        digest of file e's bytes           (a file read alone)

The file is read once into memory the process owns, never mapped from the file: a map of ``index.bfi``
turns a truncated or replaced file into SIGBUS in every reader, and an in-place write into bytes served
unchecked, while a private copy cannot change under them.  Every reader but a mount reads it into anonymous
memory; a mount copies it into an unnamed file of its own and maps that (:mod:`.index_copy`: reclaimable
page cache, not anonymous memory).
"""

from __future__ import annotations

import json
import mmap
import os
import stat
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import BinaryIO

import numpy as np

from ..errors import IndexFormatError, UnsupportedVersionError
from . import digest as dg
from .format import crc32
from .heap import give_back
from .index_copy import IndexChanged, IndexCopies

INDEX_MAGIC = b"BLKFSIDX"
INDEX_VERSION = 2
OLDEST_INDEX_VERSION = 1  # no digests: checked against accidents (CRC-32) only
HEAD_SIZE = 16
ALIGN = 64

KIND_FILE = 0
KIND_DIR = 1
KIND_SYMLINK = 2
KIND_NAMES = {KIND_FILE: "file", KIND_DIR: "dir", KIND_SYMLINK: "symlink"}

# The fix every "damaged index" message names.
REPACK = "restore the dataset from a good copy or pack it again with 'blockfs pack'"

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

# Every array of the file, with the one dtype it may have.
SCHEMA: dict[str, np.dtype] = {
    name: np.dtype(dt)
    for name, dt in {
        **ENTRY_COLUMNS,
        "path_offsets": "<u8",  # n + 1: entry e's path is paths[off[e] : off[e + 1] - 1]
        "paths": "u1",  # \0, then every path NUL-terminated
        "link_offsets": "<u8",  # n_links + 1
        "links": "u1",  # symlink targets back to back
        "hash_start": "<u4",  # n_buckets + 1 (n_buckets a power of two)
        "hash_order": "<u4",  # n: entries by bucket
        "block_counts": "<u4",  # n_blocks: slots per block
        "block_sizes": "<u8",  # n_blocks: bytes of each block file
        "block_offsets": "<u8",  # n_blocks + 1
        "block_files": "<u4",  # file entries by (block, slot)
    }.items()
}
SCHEMA_V1 = dict(SCHEMA)
# Version 2: the digests (DIGEST_SIZE bytes per entry / per block, flat).
DIGEST_ROWS = ("file_digest", "block_head_digest", "chunk_digest")
DIGEST_ARRAYS = (*DIGEST_ROWS, "block_chunks")
SCHEMA.update({name: np.dtype("u1") for name in DIGEST_ROWS})
SCHEMA["block_chunks"] = np.dtype("<u8")  # n_blocks + 1


def schema_of(version: int) -> dict[str, np.dtype]:
    return SCHEMA if version >= 2 else SCHEMA_V1


def _pad(n: int) -> int:
    return -n % ALIGN


@dataclass(frozen=True)
class Deferred:
    """An array made only when its turn to be written comes (and dropped once written), so that a large
    index is never in memory whole: ``count`` elements of its schema dtype, from ``make()`` — the array,
    or its pieces one after another (each dropped before the next is made)."""

    count: int
    make: Callable[[], np.ndarray | Iterator[np.ndarray]]


def write_arrays(f: BinaryIO, arrays: Mapping[str, np.ndarray | Deferred | None]) -> None:
    """Write an index file holding ``arrays`` (converted to their schema dtypes) into ``f``, a new binary file
    at its start (``storage.owned.created_at``: it also flushes and fsyncs): version 2 when the digest arrays
    are given, version 1 (no digests) otherwise.  The arrays are written in the schema's order, one at a
    time: the table of contents needs only each array's length, so a :class:`Deferred` one is made only
    when its turn comes."""
    version = INDEX_VERSION if all(arrays.get(name) is not None for name in DIGEST_ARRAYS) else OLDEST_INDEX_VERSION
    schema = schema_of(version)
    missing = sorted(set(schema) - {name for name, value in arrays.items() if value is not None})
    if missing:
        raise ValueError(f"no array given for {missing}")
    names = list(schema)  # the file's order is the schema's, whatever the mapping's
    counts = {name: _count(arrays[name]) for name in names}
    # Two passes: the table of contents holds offsets, which depend on its own length.
    toc_len = 0
    while True:
        pos = HEAD_SIZE + toc_len
        pos += _pad(pos)
        toc: dict[str, list] = {}
        for name in names:
            toc[name] = [schema[name].str, pos, counts[name]]
            nbytes = counts[name] * schema[name].itemsize
            pos += nbytes + _pad(nbytes)
        raw = json.dumps({"arrays": toc, "n_entries": counts["kind"]}).encode()
        if len(raw) <= toc_len:
            break
        toc_len = len(raw) + 64
    raw = raw.ljust(toc_len)
    f.write(INDEX_MAGIC + version.to_bytes(2, "little") + b"\0\0" + toc_len.to_bytes(4, "little"))
    f.write(raw)
    written = HEAD_SIZE + toc_len
    for name in names:
        value = arrays[name]
        made = value.make() if isinstance(value, Deferred) else value
        f.write(b"\0" * (toc[name][1] - written))
        written = toc[name][1]
        size = 0
        for piece in [made] if isinstance(made, np.ndarray) or not isinstance(made, Iterator) else made:
            arr = np.ascontiguousarray(piece, dtype=schema[name]).reshape(-1)
            del piece
            f.write(arr.data.cast("B"))
            size += arr.size
            written += arr.nbytes
            del arr  # before the next is made
        del made
        give_back()  # what making it freed, before the next is made
        if size != counts[name]:
            raise ValueError(f"array {name!r} has {size} elements, {counts[name]} were announced")
    f.write(b"\0" * _pad(written))


def _count(value: np.ndarray | Deferred | None) -> int:
    if isinstance(value, Deferred):
        return value.count
    return int(np.asarray(value).size)


READ_PIECE = 32 << 20  # bytes read at a time: the hash of one piece runs while the next is read


def read_index_file(path: str, where: str, copies: IndexCopies | None = None) -> mmap.mmap:
    """The whole index file, read into anonymous memory; with ``copies``, copied into a private unnamed file
    and mapped read-only instead, where one can be made (:mod:`.index_copy`)."""
    return read_index_file_hashed(path, where, copies, hashed=False)[0]


def read_index_file_hashed(
    path: str, where: str, copies: IndexCopies | None = None, hashed: bool = True, expected: str | None = None
) -> tuple[mmap.mmap, bytes | None]:
    """:func:`read_index_file`, and the BLAKE3 digest of the bytes held (with ``hashed``), each piece hashed
    on a thread while the next is read: the digest costs no time beyond the read.  ``expected``: the digest
    ``blockfs.json`` records (hex); with ``copies``, a copy an earlier mount kept of that index is mapped
    instead (neither copied nor hashed: its identity is what was recorded once it had that digest), and a
    new copy whose digest is that is kept for the next mount (:mod:`.kept_copies`)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)  # a planted FIFO must not block
    except OSError as e:
        raise IndexFormatError(f"{where}: cannot open: {e.strerror}") from e
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise IndexFormatError(f"{where}: not a regular file (a FIFO, a device or a directory); {REPACK}")
        size = st.st_size
        if size < HEAD_SIZE:
            raise IndexFormatError(f"{where}: truncated ({size} bytes); {REPACK}")
        if copies is not None:
            try:
                keep = expected if expected is not None else False
                held = copies.hold(fd, size, hashed, keep=keep, reuse=expected)
            except IndexChanged as e:
                raise IndexFormatError(f"{where}: changed while it was read ({e.got} of {size} bytes)") from None
            if held is not None:
                return held
        # Private anonymous memory, page-aligned (so every 64-byte aligned array is aligned too).  In huge
        # pages where the kernel allows (THP "madvise" or "always"): reading a 147 MB index then faults 2 MiB
        # at a time, 0.06 s instead of 0.24 s with MAP_POPULATE's 4 KiB pages (docs/benchmarks.md); where it
        # cannot, MAP_POPULATE faults every page in at once, half the cost of faulting them as read.
        huge = getattr(mmap, "MADV_HUGEPAGE", None)
        buf = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | (0 if huge else getattr(mmap, "MAP_POPULATE", 0)))
        if huge is not None:
            try:
                buf.madvise(huge)
            except OSError:  # a kernel built without transparent huge pages: 4 KiB pages, faulted as read
                pass
        hashing = dg.FillingDigest(buf) if hashed else None
        try:
            with memoryview(buf) as view:
                got = 0
                while got < size:
                    try:
                        n = os.preadv(fd, [view[got : got + READ_PIECE]], got)
                    except OSError as e:
                        raise IndexFormatError(f"{where}: read failed: {e.strerror}") from e
                    if n == 0:  # the file shrank while it was read
                        raise IndexFormatError(f"{where}: changed while it was read ({got} of {size} bytes)")
                    got += n
                    if hashing is not None:
                        hashing.filled(got)
            digest = hashing.digest() if hashing is not None else None
            hashing = None
        finally:
            if hashing is not None:
                hashing.abandon()
    finally:
        os.close(fd)
    return buf, digest


def short_repr(value: object) -> str:
    """``repr(value)``, cut to fit in a one-line message (the value may be hostile and huge)."""
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _is_count(value: object) -> bool:
    return type(value) is int and value >= 0  # not bool, not 1.5, not "3"


def check_header(buf: mmap.mmap, where: str) -> tuple[int, int]:
    """Check magic and version; return (the table of contents' length, the version)."""
    head = buf[:HEAD_SIZE]
    if head[:8] != INDEX_MAGIC:
        raise IndexFormatError(f"{where}: not a blockfs index (magic {head[:8]!r})")
    version = int.from_bytes(head[8:10], "little")
    if version > INDEX_VERSION:
        raise UnsupportedVersionError(
            f"{where}: written by index version {version}; this blockfs reads up to {INDEX_VERSION}: upgrade blockfs"
        )
    if version < OLDEST_INDEX_VERSION:
        raise IndexFormatError(
            f"{where}: written by index version {version}, older than this blockfs reads "
            f"({OLDEST_INDEX_VERSION}): pack the source again with 'blockfs pack'"
        )
    toc_len = int.from_bytes(head[12:16], "little")
    if HEAD_SIZE + toc_len > len(buf):
        raise IndexFormatError(f"{where}: table of contents runs past the end of the file; {REPACK}")
    return toc_len, version


def check_crc(buf: mmap.mmap, where: str, expected: int) -> None:
    """The whole file's CRC-32 is the one ``blockfs.json`` records."""
    crc = crc32(buf)
    if crc != expected:
        raise IndexFormatError(
            f"{where}: checksum mismatch (blockfs.json records 0x{expected:08x}, the file has 0x{crc:08x}): "
            f"the index is damaged or not this dataset's; {REPACK}"
        )


def check_digest(buf: mmap.mmap, where: str, expected: str, hashed: bytes | None = None) -> None:
    """The whole file's BLAKE3 digest (``hashed``, if given: :func:`read_index_file_hashed`'s) is the one
    ``blockfs.json`` records (hex)."""
    got = (hashed if hashed is not None else dg.digest(buf)).hex()
    if got != expected:
        raise IndexFormatError(
            f"{where}: checksum mismatch (blockfs.json records the BLAKE3 digest {expected}, the file has {got}): "
            f"the index is damaged or not this dataset's; {REPACK}"
        )


def read_toc(buf: mmap.mmap, toc_len: int, where: str, version: int = INDEX_VERSION) -> dict[str, tuple[int, int]]:
    """The table of contents (``toc_len`` bytes, from :func:`check_header`) checked against the schema
    of ``version``: array name -> (offset, count)."""
    schema = schema_of(version)
    try:
        toc = json.loads(buf[HEAD_SIZE : HEAD_SIZE + toc_len])
    except (ValueError, RecursionError) as e:
        raise IndexFormatError(f"{where}: damaged table of contents ({type(e).__name__}); {REPACK}") from None
    specs = toc.get("arrays") if isinstance(toc, dict) else None
    if not isinstance(specs, dict) or not specs:
        raise IndexFormatError(f"{where}: table of contents has no 'arrays' object; {REPACK}")
    unknown = sorted(set(specs) - set(schema))
    if unknown:
        raise IndexFormatError(f"{where}: table of contents lists unknown arrays {short_repr(unknown)}; {REPACK}")
    placed: dict[str, tuple[int, int]] = {}
    for name, dtype in schema.items():
        placed[name] = _check_spec(name, specs.get(name), dtype, HEAD_SIZE + toc_len, len(buf), where)
    n = toc.get("n_entries")
    if not _is_count(n) or n != placed["kind"][1]:
        raise IndexFormatError(
            f"{where}: field 'n_entries' is {short_repr(n)}, the 'kind' column has {placed['kind'][1]} rows; {REPACK}"
        )
    if version >= 2:
        n_blocks = placed["block_counts"][1]
        n_chunks = placed["chunk_digest"][1] // dg.DIGEST_SIZE
        for name, rows in (("file_digest", n), ("block_head_digest", n_blocks), ("chunk_digest", n_chunks)):
            if placed[name][1] != rows * dg.DIGEST_SIZE:
                raise IndexFormatError(
                    f"{where}: array {name!r} holds {placed[name][1]} bytes, not {dg.DIGEST_SIZE} for each of {rows}; {REPACK}"
                )
        if placed["block_chunks"][1] != n_blocks + 1:
            raise IndexFormatError(f"{where}: array 'block_chunks' must have {n_blocks + 1} rows; {REPACK}")
    return placed


def check_chunk_table(arrays: dict[str, np.ndarray], where: str) -> None:
    """``block_chunks`` runs from 0 to the number of chunk digests, never backwards."""
    starts = arrays["block_chunks"]
    if int(starts[0]) != 0 or int(starts[-1]) != len(arrays["chunk_digest"]) or np.any(starts[1:] < starts[:-1]):
        raise IndexFormatError(
            f"{where}: array 'block_chunks' does not divide the chunk digests among the blocks; {REPACK}"
        )


def _check_spec(name: str, spec: object, dtype: np.dtype, data_start: int, size: int, where: str) -> tuple[int, int]:
    what = f"{where}: array {name!r}"
    if spec is None:
        raise IndexFormatError(f"{what} is missing from the table of contents; {REPACK}")
    if not isinstance(spec, list) or len(spec) != 3:
        raise IndexFormatError(f"{what}: spec must be [dtype, offset, count], got {short_repr(spec)}; {REPACK}")
    dt, offset, count = spec
    if dt != dtype.str:
        raise IndexFormatError(f"{what} has dtype {short_repr(dt)}; the format says {dtype.str!r}; {REPACK}")
    if not _is_count(offset) or not _is_count(count):
        raise IndexFormatError(f"{what}: offset and count must be integers >= 0, got {short_repr(spec)}; {REPACK}")
    if offset < data_start or offset % ALIGN:
        raise IndexFormatError(f"{what}: offset {offset} is not an aligned place after the header; {REPACK}")
    if offset + count * dtype.itemsize > size:
        raise IndexFormatError(f"{what} runs past the end of the file; {REPACK}")
    return offset, count


def array_views(buf: mmap.mmap, placed: dict[str, tuple[int, int]]) -> dict[str, np.ndarray]:
    """Read-only NumPy views of every array in ``buf`` (no copies)."""
    arrays = {}
    for name, (offset, count) in placed.items():
        arr = np.frombuffer(buf, dtype=SCHEMA[name], count=count, offset=offset)
        if name in DIGEST_ROWS:
            arr = arr.reshape(-1, dg.DIGEST_SIZE)  # one row per entry / block / chunk
        arr.flags.writeable = False
        arrays[name] = arr
    return arrays
