"""Writing one block file: the member files gathered (or, for one huge file, streamed) behind a header.

Separate from the packer's steps because it is the one part that runs in every worker, thread or forked
process, and because it is the hot loop of a pack: it owns the reused gather buffer, the per-file CRCs,
what an unreadable or changed file means, and the durability of each block (writeback started as each
piece is written, fsync on a thread of the calling process, :meth:`BlockWriter.wait_durable` before the
index is written).  It knows the block format (:mod:`blockfs.core.format`) and a
:class:`~blockfs.packing.sources.Source`, nothing of the plan or the destination's other files.
"""

from __future__ import annotations

import os
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import BinaryIO

import numpy as np

from ..core import digest as dg
from ..core import format as fmt
from ..errors import PackError, SourceError
from ..storage.owned import created_at
from .sources import Source, SourceEntry
from .writeback import start_writeback

STREAM_PIECE = 16 << 20  # huge files are copied in pieces of this size
# Small files are gathered into a buffer of this size (or of the largest file, if larger) and written
# out each time it fills: a reused buffer stays in memory, where a fresh block-sized one would cost a
# page fault every 4 KiB.
GATHER_SIZE = 8 << 20


@dataclass(frozen=True)
class WrittenBlock:
    """What the index records of a block just written: per-file CRC-32s and digests (slot order), the
    digest of the block's header and of each 1 MiB chunk of its data section, back to back (the chain
    drawn in :mod:`blockfs.core.format`)."""

    crcs: list[int]
    file_digests: list[bytes]
    head_digest: bytes
    chunk_digests: bytes


class BlockWriter:
    """Writes one block at a time per thread; returns its checksums and digests (:class:`WrittenBlock`).

    With fsync on, a written block is flushed by a separate thread while its writer goes on to the next
    block, so the disk's write time overlaps the reading and checksumming instead of adding to it;
    :meth:`wait_durable` returns once every block is on disk (the index is written only after that).
    """

    def __init__(
        self, source: Source, blocks_fd: int, *, fsync: bool, skip_unreadable: bool, flush_here: bool = True
    ) -> None:
        self.source = source
        self.blocks_fd = blocks_fd  # DEST's blocks/: every block file is made in it by name (storage.owned)
        self.fsync = fsync
        self.skip_unreadable = skip_unreadable
        self._flush_here = fsync and flush_here  # False in a worker process: the parent flushes
        self.unreadable: list[bytes] = []
        self._lock = threading.Lock()
        self._local = threading.local()
        self._syncer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="blockfs-fsync")
        self._syncs: list[Future] = []

    def __enter__(self) -> BlockWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self._syncer.shutdown(wait=True, cancel_futures=True)

    def for_child(self) -> BlockWriter:
        """A writer for a forked worker process: it leaves fsync to this one (:meth:`written_elsewhere`)."""
        return BlockWriter(
            self.source, self.blocks_fd, fsync=self.fsync, skip_unreadable=self.skip_unreadable, flush_here=False
        )

    def written_elsewhere(self, block: int, unreadable: list[bytes]) -> None:
        """Take over a block a worker process wrote: its unreadable files, and flushing it to disk."""
        self.unreadable.extend(unreadable)
        if self.fsync:
            name = fmt.block_name(block)
            self._sync_fd_later(os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=self.blocks_fd))

    def _sync_later(self, f) -> None:
        """fsync ``f``'s file on the fsync thread (through a duplicate descriptor: ``f`` is about to close)."""
        if self._flush_here:
            f.flush()  # what the file object still holds must be in the file before the fsync
            self._sync_fd_later(os.dup(f.fileno()))

    def _sync_fd_later(self, fd: int) -> None:
        """fsync and close ``fd`` on the fsync thread."""

        def sync() -> None:
            try:
                os.fsync(fd)
            finally:
                os.close(fd)

        with self._lock:
            self._syncs.append(self._syncer.submit(sync))

    def wait_durable(self) -> None:
        """Block until every block written so far is on disk; an fsync error is raised here."""
        with self._lock:
            syncs, self._syncs = self._syncs, []
        for fut in syncs:
            fut.result()

    def write(self, block: int, members: list[SourceEntry]) -> WrittenBlock:
        """Write block ``block`` under a temporary name and rename it into place (:func:`created_at`)."""
        with created_at(self.blocks_fd, fmt.block_name(block), mode=0o666, sync=False) as f:
            if len(members) == 1 and members[0].size > STREAM_PIECE:
                return self._write_streamed(block, members[0], f)
            return self._write_buffered(block, members, f)

    def _read(self, entry: SourceEntry, buf: memoryview, offset: int = 0) -> bool:
        """Fill ``buf`` from the file; False if it is unreadable and --skip-unreadable allows that."""
        try:
            n = self.source.read_into(entry, buf, offset)
        except OSError as e:
            return self._unreadable(entry, e)
        if n != len(buf):
            raise self._changed(entry)
        return True

    def _unreadable(self, entry: SourceEntry, error: OSError) -> bool:
        """Note ``entry`` as skipped (returns False) if --skip-unreadable allows it; raise otherwise."""
        if self.skip_unreadable:
            with self._lock:
                self.unreadable.append(entry.path)
            return False
        if isinstance(error, SourceError):  # it names the path and the fix itself
            raise error
        raise PackError(
            f"cannot read {os.fsdecode(entry.path)!r} in {self.source.description!r}: {error.strerror}; "
            "fix its permissions or pass --skip-unreadable"
        ) from error

    def _changed(self, entry: SourceEntry) -> PackError:
        return PackError(
            f"{os.fsdecode(entry.path)!r} in {self.source.description!r} changed while packing "
            f"(expected {entry.size} bytes); pack a tree that is not being written to"
        )

    def _buffer(self, size: int) -> memoryview:
        """This thread's gather buffer, reused from block to block."""
        buf = getattr(self._local, "buf", None)
        if buf is None or len(buf) < size:
            buf = self._local.buf = bytearray(size)
        return memoryview(buf)

    def _write_buffered(self, block: int, members: list[SourceEntry], f: BinaryIO) -> WrittenBlock:
        """Files gathered into the buffer, written each time it fills; the header last, at the front."""
        view = self._buffer(max(GATHER_SIZE, *(m.size for m in members)))
        pos = 0
        sizes, labels, crcs, digests = [], [], [], []
        read_into, crc32, digest = self.source.read_into, fmt.crc32, dg.digest
        data_hash = dg.ChunkHasher(fmt.CHUNK_SIZE)
        f.seek(fmt.header_size(len(members), wide=False))  # a buffered block is never WIDE
        # The hot loop of a pack of small files (about a third of a tiny-file pack's time): no
        # calls beyond the read and the CRC.
        for m in members:
            end = pos + m.size
            if end > len(view):
                self._write_out(f, view[:pos], data_hash)
                pos, end = 0, m.size
            piece = view[pos:end]
            try:
                n = read_into(m, piece)
            except OSError as e:
                self._unreadable(m, e)  # raises unless --skip-unreadable
                # Keep the slot so slot numbers stay as planned; it holds nothing.
                crcs.append(0)
                digests.append(digest(b""))
                sizes.append(0)
                labels.append(-1)
                continue
            if n != m.size:
                raise self._changed(m)
            crcs.append(crc32(piece))
            digests.append(digest(piece))
            sizes.append(m.size)
            labels.append(m.label)
            pos = end
        self._write_out(f, view[:pos], data_hash)
        f.seek(0)
        header = fmt.encode_header(block, np.array(sizes), np.array(labels), fmt.crc_of_crcs(crcs))
        f.write(header)
        self._sync_later(f)
        return WrittenBlock(crcs, digests, digest(header), data_hash.digests())

    def _write_out(self, f, data: memoryview, data_hash=None) -> None:
        """Append ``data`` to the block file (and to ``data_hash``, the digests of its 1 MiB chunks); with
        fsync on, its writeback starts now (see writeback.py)."""
        if data_hash is not None:
            data_hash.update(data)
        start = f.tell()
        f.write(data)
        if self.fsync:
            f.flush()
            start_writeback(f.fileno(), start, len(data))

    def _write_streamed(self, block: int, member: SourceEntry, f: BinaryIO) -> WrittenBlock:
        """One file larger than a block: copy it in pieces, header written last."""
        size = member.size
        wide = size >= fmt.NARROW_LIMIT
        head_len = fmt.header_size(1, wide, size)
        crc = 0
        chunk_crcs: list[int] = []
        data_hash, file_hash = dg.ChunkHasher(fmt.CHUNK_SIZE), dg.hasher()
        buf = memoryview(bytearray(STREAM_PIECE))
        f.write(b"\0" * head_len)
        done = 0
        while done < size:
            piece = buf[: min(STREAM_PIECE, size - done)]
            if not self._read(member, piece, done):
                size = done = 0
                f.truncate(head_len)
                data_hash, file_hash = dg.ChunkHasher(fmt.CHUNK_SIZE), dg.hasher()
                break
            crc = fmt.crc32(piece, crc)
            if wide:
                chunk_crcs.extend(int(c) for c in fmt.chunk_crcs_of(piece))
            file_hash.update(piece)
            self._write_out(f, piece, data_hash)
            done += len(piece)
        header = fmt.encode_header(
            block,
            np.array([size]),
            np.array([member.label if size else -1]),
            fmt.crc_of_crcs([crc]),
            np.array(chunk_crcs, dtype=np.uint32) if wide else None,
        )
        if len(header) != head_len:  # the file was unreadable: rewrite as an empty block
            f.truncate(0)
        f.seek(0)
        f.write(header)
        self._sync_later(f)
        return WrittenBlock([crc], [file_hash.digest()], dg.digest(header), data_hash.digests())
