"""The block file format: one block holds N files back to back behind a small header.

The header is the seed layout — N, N offsets, N sizes, N labels — behind a fixed preamble that adds magic
bytes, a format version and CRC-32 checksums, so a wrong, truncated or damaged block is detected and named::

    offset  size  field
    ------  ----  -------------------------------------------------------------------
         0     8  magic            b"BLKFSBLK"
         8     2  version          u16, FORMAT_VERSION
        10     2  flags            u16, bit 0 = WIDE (offsets/sizes are u64 instead of u32)
        12     4  header_crc       u32, CRC-32 of bytes [0, 12) + [16, data_start)
        16     4  data_crc         u32, CRC-32 of the N files' CRC-32s (u32 LE, slot order)
        20     4  block_id         u32, this block's number (catches a misplaced file)
        24     8  data_size        u64, bytes in the data section
    --- seed header ------------------------------------------------------------------
        32     4  N                u32, files in this block
        36    wN  offsets[N]       u32 (u64 if WIDE), file i's start, relative to data_start
          ..  wN  sizes[N]         u32 (u64 if WIDE)
          ..  4N  labels[N]        i32, class label, -1 = none
    --- only if WIDE -------------------------------------------------------------------
          ..  4C  chunk_crcs[C]    u32, CRC-32 of each CHUNK_SIZE piece of the data section
    --- data ---------------------------------------------------------------------------
    data_start  data_size  the N files' bytes, back to back, in slot order

Everything is little-endian.  A block is WIDE only when its data section reaches 4 GiB (a single file that
large gets a block of its own); the narrow header costs exactly the seed's 12N+4 bytes plus the 32-byte
preamble.  WIDE blocks carry per-chunk checksums so a partial read of a huge file is still verified.
Each file's own CRC-32 is also in the index, so a read of one file from a block that is not cached is
verified without reading the whole block.  The block's data checksum is a CRC of those per-file CRCs:
the packer computes each file's CRC once and no second pass over the data is needed, and a reader that
checks a whole block gets every file's CRC to compare with the index on the way.

The CRCs guard against accidents only: anyone who can write a block can fix a CRC up.  What proves a block
is this dataset's is the chain of BLAKE3 digests that names the dataset (:mod:`.digest`)::

    dataset name = blake3(blockfs.json as stored)         <- what `--expect blake3:...` pins
        blockfs.json ── index.blake3 ──> index.bfi (its digest: the whole file)
            index.bfi ── block_head_digest[b] ──> bytes [0, data_start) of block b   (checked when parsed)
                      ── chunk_digest[k] ──────> each 1 MiB (CHUNK_SIZE) of block b's data section
                                                 (a whole-block read checks all, a piece of a big file
                                                  the chunks it covers)
                      ── file_digest[e] ───────> file e's bytes                      (a file read alone)

A reader checks each link against the one above it, so nothing a tier holds (a local block, a disk-tier
copy, a cached head of a remote object) is trusted for a digest of its own: where the index has digests,
a whole-block read hashes the data section once (chunk by chunk) instead of computing its CRCs, a file
read alone is hashed instead of its CRC computed, and a piece of a big file is served from the 1 MiB
chunks that cover it, each checked by its digest (never from bytes checked on an earlier read).  Datasets packed before the digests (format 1) are read by CRC.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

try:  # the same CRC-32 as zlib's, 5-8x faster (vectorised): it bounds how fast a block loads
    from zlib_ng.zlib_ng import crc32
except ImportError:  # pragma: no cover - zlib-ng is a dependency; a build without it still reads right
    from zlib import crc32  # noqa: F401

from ..errors import CorruptBlockError, UnsupportedVersionError

BLOCK_MAGIC = b"BLKFSBLK"
FORMAT_VERSION = 1
FLAG_WIDE = 1
KNOWN_FLAGS = FLAG_WIDE
PREAMBLE_SIZE = 32
CHUNK_SIZE = 1 << 20  # checksum granularity inside WIDE blocks
NARROW_LIMIT = 1 << 32  # a data section this large needs u64 offsets

# A packed dataset is a directory: DEST/blockfs.json (metadata, written last), DEST/index.bfi (see
# index.py) and DEST/blocks/NNNNNNNN.blk.  The marker exists while a pack is unfinished.
METADATA_NAME = "blockfs.json"
INDEX_NAME = "index.bfi"
BLOCKS_DIR = "blocks"
PACKING_MARKER = ".blockfs-packing"


def file_crc(path: str | os.PathLike | int) -> int:
    """The CRC-32 of a whole file (the index's, as ``blockfs.json`` records it), read in 16 MiB pieces; ``path``
    may be a descriptor (closed after)."""
    crc = 0
    with open(path, "rb") as f:
        while piece := f.read(16 << 20):
            crc = crc32(piece, crc)
    return crc


def block_name(block: int) -> str:
    """A block file's name in ``blocks/``."""
    return f"{block:08d}.blk"


def block_path(dest: str | os.PathLike, block: int) -> str:
    return os.path.join(os.fspath(dest), BLOCKS_DIR, block_name(block))


PREAMBLE_DTYPE = np.dtype(
    [
        ("magic", "S8"),
        ("version", "<u2"),
        ("flags", "<u2"),
        ("header_crc", "<u4"),
        ("data_crc", "<u4"),
        ("block_id", "<u4"),
        ("data_size", "<u8"),
    ]
)
assert PREAMBLE_DTYPE.itemsize == PREAMBLE_SIZE


@dataclass(frozen=True)
class BlockHeader:
    """A decoded, validated block header.  Arrays are read-only."""

    block_id: int
    flags: int
    data_crc: int
    data_start: int
    data_size: int
    offsets: np.ndarray
    sizes: np.ndarray
    labels: np.ndarray
    chunk_crcs: np.ndarray | None  # only for WIDE blocks
    digest: bytes | None = None  # BLAKE3 of the header bytes as read, where the index holds digests to check it by

    @property
    def count(self) -> int:
        return len(self.sizes)

    @property
    def total_size(self) -> int:
        """Bytes of the whole block file."""
        return self.data_start + self.data_size


def header_size(count: int, wide: bool, data_size: int = 0) -> int:
    """Bytes from the start of a block to its data section."""
    word = 8 if wide else 4
    size = PREAMBLE_SIZE + 4 + count * (2 * word + 4)
    if wide:
        size += 4 * n_chunks(data_size)
    return size


def n_chunks(data_size: int) -> int:
    return -(-data_size // CHUNK_SIZE)


def encode_header(
    block_id: int,
    sizes: np.ndarray,
    labels: np.ndarray,
    data_crc: int,
    chunk_crcs: np.ndarray | None = None,
) -> bytes:
    """The bytes before a block's data section, for files of ``sizes`` stored back to back."""
    sizes = np.asarray(sizes, dtype=np.uint64)
    labels = np.asarray(labels, dtype=np.int64)
    if sizes.shape != labels.shape:
        raise ValueError(f"{len(sizes)} sizes but {len(labels)} labels")
    if labels.size and (labels.min() < -1 or labels.max() > np.iinfo(np.int32).max):
        raise ValueError("labels must be in [-1, 2**31)")
    data_size = int(sizes.sum())
    wide = data_size >= NARROW_LIMIT
    word = "<u8" if wide else "<u4"
    offsets = np.zeros(len(sizes), dtype=np.uint64)
    if len(sizes):
        np.cumsum(sizes[:-1], out=offsets[1:])
    if wide:
        if chunk_crcs is None or len(chunk_crcs) != n_chunks(data_size):
            raise ValueError("a WIDE block needs one chunk CRC per CHUNK_SIZE of data")
    parts = [
        np.array([len(sizes)], dtype="<u4").tobytes(),
        offsets.astype(word).tobytes(),
        sizes.astype(word).tobytes(),
        labels.astype("<i4").tobytes(),
    ]
    if wide:
        parts.append(np.asarray(chunk_crcs, dtype="<u4").tobytes())
    body = b"".join(parts)
    preamble = np.zeros(1, dtype=PREAMBLE_DTYPE)
    preamble["magic"] = BLOCK_MAGIC
    preamble["version"] = FORMAT_VERSION
    preamble["flags"] = FLAG_WIDE if wide else 0
    preamble["data_crc"] = data_crc
    preamble["block_id"] = block_id
    preamble["data_size"] = data_size
    raw = bytearray(preamble.tobytes())
    crc = crc32(bytes(raw[16:]) + body, crc32(bytes(raw[:12])))
    raw[12:16] = crc.to_bytes(4, "little")
    return bytes(raw) + body


def preamble_fields(buf: bytes | memoryview, where: str) -> tuple[int, int, int]:
    """Check magic and version of a block's first bytes; return (flags, N, data_size).

    ``where`` names the block in messages (``"block 17 (/data/x/blocks/000017.blk)"``).
    """
    if len(buf) < PREAMBLE_SIZE + 4:
        raise CorruptBlockError(f"{where}: truncated: {len(buf)} bytes, shorter than a block header")
    pre = np.frombuffer(buf, dtype=PREAMBLE_DTYPE, count=1)[0]
    if bytes(pre["magic"]) != BLOCK_MAGIC:
        raise CorruptBlockError(f"{where}: not a blockfs block (magic {bytes(buf[:8])!r}, expected {BLOCK_MAGIC!r})")
    version = int(pre["version"])
    if version > FORMAT_VERSION:
        raise UnsupportedVersionError(
            f"{where}: written by block format version {version}; this blockfs reads up to version "
            f"{FORMAT_VERSION}: upgrade blockfs"
        )
    if version < 1:
        raise CorruptBlockError(f"{where}: invalid block format version {version}")
    flags = int(pre["flags"])
    if flags & ~KNOWN_FLAGS:
        raise CorruptBlockError(f"{where}: unknown flags 0x{flags:04x}")
    count = int(np.frombuffer(buf, dtype="<u4", count=1, offset=PREAMBLE_SIZE)[0])
    return flags, count, int(pre["data_size"])


def read_header(
    pread: Callable[[int, int], bytes],
    where: str,
    file_size: int | None = None,
    check_count: Callable[[int], None] | None = None,
) -> tuple[BlockHeader, bytes]:
    """The one reader of a block's header: its preamble, then exactly the header that announces, parsed and
    checked by :func:`decode_header`.  Returns the header and its bytes (a digest is taken over them).

    ``pread(size, offset)`` reads the block (a short read is reported as truncation).  ``file_size``, when
    known, refuses a header that claims more than the file holds before it is read (a damaged count must
    not cost a huge read); ``check_count(count)`` runs before the header is read, too (a store compares the
    count with its index's).
    """
    first = PREAMBLE_SIZE + 4
    if file_size is not None and file_size < first:
        raise CorruptBlockError(f"{where}: truncated: {file_size} bytes, shorter than a block header")
    flags, count, data_size = preamble_fields(pread(first, 0), where)
    length = header_size(count, bool(flags & FLAG_WIDE), data_size)
    if file_size is not None and length + data_size > file_size:
        raise CorruptBlockError(
            f"{where}: truncated or damaged header: it claims {count} files, {length} header and {data_size} "
            f"data bytes; the file has {file_size} bytes; run 'blockfs verify'"
        )
    if check_count is not None:
        check_count(count)
    raw = pread(length, 0)
    return decode_header(raw, where, file_size=file_size), raw


def decode_header(buf: bytes | memoryview, where: str, file_size: int | None = None) -> BlockHeader:
    """Parse and verify a block header from the start of ``buf``.

    ``buf`` must hold at least ``header_size(...)`` bytes (call :func:`preamble_fields` first to learn
    it).  ``file_size``, when given, is the block file's size on disk: a shorter file is reported as
    truncated.  Raises :class:`CorruptBlockError` naming ``where`` and the fault.
    """
    flags, count, data_size = preamble_fields(buf, where)
    wide = bool(flags & FLAG_WIDE)
    start = header_size(count, wide, data_size)
    if len(buf) < start:
        raise CorruptBlockError(f"{where}: truncated header: {len(buf)} of {start} bytes")
    crc = crc32(bytes(buf[16:start]), crc32(bytes(buf[:12])))
    stored = int.from_bytes(bytes(buf[12:16]), "little")
    if crc != stored:
        raise CorruptBlockError(
            f"{where}: header checksum mismatch (expected 0x{stored:08x}, got 0x{crc:08x}); run 'blockfs verify'"
        )
    pre = np.frombuffer(buf, dtype=PREAMBLE_DTYPE, count=1)[0]
    word = np.dtype("<u8" if wide else "<u4")
    pos = PREAMBLE_SIZE + 4
    offsets = np.frombuffer(buf, dtype=word, count=count, offset=pos).astype(np.uint64)
    pos += count * word.itemsize
    sizes = np.frombuffer(buf, dtype=word, count=count, offset=pos).astype(np.uint64)
    pos += count * word.itemsize
    labels = np.frombuffer(buf, dtype="<i4", count=count, offset=pos).astype(np.int32)
    pos += 4 * count
    chunk_crcs = None
    if wide:
        chunk_crcs = np.frombuffer(buf, dtype="<u4", count=n_chunks(data_size), offset=pos).copy()
    ends = offsets + sizes
    if count and (int(ends.max()) > data_size or np.any(offsets[1:] < ends[:-1])):
        raise CorruptBlockError(f"{where}: file offsets or sizes run outside the data section")
    if file_size is not None and file_size < start + data_size:
        raise CorruptBlockError(
            f"{where}: truncated: the file has {file_size} bytes, the header says {start + data_size}"
        )
    for arr in (offsets, sizes, labels):
        arr.flags.writeable = False
    return BlockHeader(
        block_id=int(pre["block_id"]),
        flags=flags,
        data_crc=int(pre["data_crc"]),
        data_start=start,
        data_size=data_size,
        offsets=offsets,
        sizes=sizes,
        labels=labels,
        chunk_crcs=chunk_crcs,
    )


def chunk_crcs_of(data: bytes | memoryview) -> np.ndarray:
    """CRC-32 of each CHUNK_SIZE piece of ``data`` (the WIDE block checksums)."""
    view = memoryview(data)
    return np.array([crc32(view[i : i + CHUNK_SIZE]) for i in range(0, len(view), CHUNK_SIZE)], dtype="<u4")


def crc_of_crcs(crcs: npt.ArrayLike) -> int:
    """The block data checksum: CRC-32 over the files' CRC-32s as little-endian u32, in slot order."""
    return crc32(np.asarray(crcs, dtype="<u4").tobytes())


def encode_block(block_id: int, files: list[bytes], labels: list[int] | np.ndarray) -> bytes:
    """A whole block in memory: header plus data (tests and small tools; the packer streams)."""
    data = b"".join(files)
    sizes = np.array([len(f) for f in files], dtype=np.uint64)
    chunk = chunk_crcs_of(data) if len(data) >= NARROW_LIMIT else None
    data_crc = crc_of_crcs([crc32(f) for f in files])
    return encode_header(block_id, sizes, np.asarray(labels), data_crc, chunk) + data


def file_crcs_of(header: BlockHeader, data: bytes | bytearray | memoryview) -> np.ndarray:
    """The CRC-32 of each file of a data section, by slot."""
    view = memoryview(data)
    return np.fromiter(
        (crc32(view[o : o + s]) for o, s in zip(header.offsets.tolist(), header.sizes.tolist(), strict=True)),
        dtype=np.uint32,
        count=header.count,
    )


def check_data(header: BlockHeader, data: bytes | memoryview, where: str) -> np.ndarray:
    """Verify a whole data section against the header's checksum; return each file's CRC-32."""
    if len(data) != header.data_size:
        raise CorruptBlockError(f"{where}: truncated: data section has {len(data)} of {header.data_size} bytes")
    file_crcs = file_crcs_of(header, data)
    crc = crc_of_crcs(file_crcs)
    if crc != header.data_crc:
        raise CorruptBlockError(
            f"{where}: data checksum mismatch (expected 0x{header.data_crc:08x}, got 0x{crc:08x}); "
            "run 'blockfs verify'",
            block=header.block_id,
        )
    return file_crcs
