"""Reading block bytes from a packed dataset's block files, verified, with ``os.pread``.

Two kinds of read, both checksummed before any byte is returned:

* a whole block's data section (one sequential read; verified by the block's data CRC) — what a cache
  loads;
* one file (verified by its CRC-32 from the index) — what a reader gets when the block is not cached, so
  a file is never served by reading its whole block and throwing the rest away.

Headers are parsed once per block and kept (they are 12 bytes per file).
"""

from __future__ import annotations

import errno
import os
import resource
import threading

import numpy as np

from . import format as fmt
from ..errors import CorruptBlockError, MissingBlockError


def raise_open_file_limit() -> None:
    """Lift the soft limit on open files to the hard one: a store keeps one descriptor per block."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != hard:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
        except (ValueError, OSError):
            pass  # keep the soft limit; EMFILE is handled by closing descriptors


class BlockStore:
    """Verified reads from the block files of one packed dataset."""

    def __init__(self, block_paths: list[str], block_counts: np.ndarray, block_sizes: np.ndarray) -> None:
        self.block_paths = block_paths
        self._counts = block_counts
        self._sizes = block_sizes
        self._fds: dict[int, int] = {}
        self._headers: dict[int, fmt.BlockHeader] = {}
        self._lock = threading.Lock()
        self.bytes_read = 0  # from storage, for statistics
        raise_open_file_limit()

    @property
    def n_blocks(self) -> int:
        return len(self.block_paths)

    def where(self, block: int) -> str:
        return f"block {block} ({self.block_paths[block]})"

    def _fd(self, block: int) -> int:
        fd = self._fds.get(block)
        if fd is not None:
            return fd
        with self._lock:
            fd = self._fds.get(block)
            if fd is None:
                fd = self._open(block)
                self._fds[block] = fd
            return fd

    def _open(self, block: int) -> int:
        try:
            return os.open(self.block_paths[block], os.O_RDONLY | os.O_CLOEXEC)
        except OSError as e:
            if e.errno == errno.EMFILE and self._fds:
                self._close_all_locked()
                return self._open(block)
            raise MissingBlockError(f"{self.where(block)}: cannot open: {e.strerror}", block=block) from e

    def _pread(self, block: int, size: int, offset: int) -> bytes:
        try:
            data = os.pread(self._fd(block), size, offset)
        except OSError as e:
            raise MissingBlockError(f"{self.where(block)}: read failed: {e.strerror}", block=block) from e
        self.bytes_read += len(data)
        if len(data) != size:
            raise CorruptBlockError(
                f"{self.where(block)}: truncated: {len(data)} of {size} bytes at offset {offset}", block=block
            )
        return data

    def header(self, block: int) -> fmt.BlockHeader:
        """The block's parsed header, checked against the index's view of the block."""
        head = self._headers.get(block)
        if head is not None:
            return head
        where = self.where(block)
        expected = int(self._counts[block])
        first = self._pread_header(block, fmt.PREAMBLE_SIZE + 4)
        flags, count, data_size = fmt.preamble_fields(first, where)
        length = fmt.header_size(count, bool(flags & fmt.FLAG_WIDE), data_size)
        try:
            disk_size = os.fstat(self._fd(block)).st_size
        except OSError as e:
            raise MissingBlockError(f"{where}: cannot stat: {e.strerror}", block=block) from e
        try:
            head = fmt.decode_header(self._pread_header(block, length), where, file_size=disk_size)
        except CorruptBlockError as e:
            e.block = block
            raise
        if head.block_id != block or head.count != expected:
            raise CorruptBlockError(
                f"{where}: header says block {head.block_id} with {head.count} files; the index expects "
                f"block {block} with {expected}: the block file is misplaced or from another dataset",
                block=block,
            )
        self._headers[block] = head
        return head

    def _pread_header(self, block: int, size: int) -> bytes:
        try:
            return self._pread(block, size, 0)
        except CorruptBlockError as e:
            raise CorruptBlockError(f"{self.where(block)}: truncated header ({e})", block=block) from None

    def header_bytes(self, block: int) -> bytes:
        """The block's header as stored, up to where its data starts (it decodes to :meth:`header`)."""
        return self._pread_header(block, self.header(block).data_start)

    def read_block(self, block: int) -> bytes:
        """The whole data section of a block, verified by its CRC."""
        return self._read_verified(block)[0]

    def verified_crcs(self, block: int) -> np.ndarray:
        """Read and verify a whole block; return its files' CRC-32s by slot (for ``verify``)."""
        return self._read_verified(block)[1]

    def _read_verified(self, block: int) -> tuple[bytes, np.ndarray]:
        head = self.header(block)
        data = self._pread(block, head.data_size, head.data_start)
        return data, fmt.check_data(head, data, self.where(block))

    def file_range(self, block: int, slot: int) -> tuple[int, int]:
        """(offset inside the data section, size) of the file in ``slot``."""
        head = self.header(block)
        return int(head.offsets[slot]), int(head.sizes[slot])

    def read_file(self, block: int, slot: int, crc: int, offset: int = 0, size: int = -1) -> bytes:
        """Bytes ``[offset, offset + size)`` of one file, verified before they are returned."""
        head = self.header(block)
        start, length = int(head.offsets[slot]), int(head.sizes[slot])
        if size < 0 or offset + size > length:
            size = max(0, length - offset)
        if head.chunk_crcs is not None and length > fmt.CHUNK_SIZE:
            return self._read_chunked(block, head, start + offset, size)
        data = self._pread(block, length, head.data_start + start)
        if fmt.crc32(data) != crc:
            raise CorruptBlockError(
                f"{self.where(block)}: slot {slot}: checksum mismatch (expected 0x{crc:08x}, got "
                f"0x{fmt.crc32(data):08x}); run 'blockfs verify'",
                block=block,
            )
        return data if (offset == 0 and size == length) else data[offset : offset + size]

    def _read_chunked(self, block: int, head: fmt.BlockHeader, start: int, size: int) -> bytes:
        """A range of a WIDE block, verified chunk by chunk."""
        if size == 0:
            return b""
        first, last = start // fmt.CHUNK_SIZE, (start + size - 1) // fmt.CHUNK_SIZE
        lo = first * fmt.CHUNK_SIZE
        hi = min((last + 1) * fmt.CHUNK_SIZE, head.data_size)
        data = self._pread(block, hi - lo, head.data_start + lo)
        view = memoryview(data)
        for k in range(first, last + 1):
            piece = view[(k - first) * fmt.CHUNK_SIZE : (k - first + 1) * fmt.CHUNK_SIZE]
            if fmt.crc32(piece) != int(head.chunk_crcs[k]):
                raise CorruptBlockError(
                    f"{self.where(block)}: chunk {k} checksum mismatch; run 'blockfs verify'", block=block
                )
        return bytes(view[start - lo : start - lo + size])

    def _close_all_locked(self) -> None:
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()

    def close(self) -> None:
        with self._lock:
            self._close_all_locked()
