"""``BlockStore``: every read of a block file goes through here, verified, and only from blocks of this index.

One place for block reads, so every reader (the mount's cache, ``cat``, ``unpack``, ``verify``) gets the
same checks and the same messages, wherever the bytes come from: the store reads through
:class:`~blockfs.storage.blockfiles.BlockFiles` (local files, ranged GETs, or a local-disk tier in front of
them) and trusts none of them.

* **A block proves it belongs to this index** when its header is first read: its number, its file count,
  each file's size and label, and its data checksum must be the index's.  The format defines the data
  checksum as the CRC-32 of the block's per-file CRC-32s, and the index holds every file's CRC-32, so this
  binds each file's bytes to the index with no extra field: a block file copied from another pack is
  refused, never served.
* **Sizes are checked before they are trusted**: the header's claimed length is compared with the file's
  size (``fstat``) before the rest of the header is read, so a damaged count cannot make the store read or
  allocate more than the file holds.
* **Every byte returned is verified**: a whole data section by the block's data CRC, one file by its own
  CRC-32 from the index (so a file is never served by reading its whole block and throwing the rest away),
  a range of a huge file by its chunk CRCs (WIDE blocks) or by one streamed pass over the file first.
* **Two kinds of failure, kept apart**: :class:`CorruptBlockError` says the block is damaged or foreign,
  which stays true until the file is replaced (a new :meth:`~BlockStore.version`); :class:`BlockReadError` says this read failed (a missing
  file, a short read, EMFILE, EIO, a remote request that failed after its retries): the store drops the
  block's descriptor, so the next read opens the file afresh and tries again.
* **A tier's copy is not the block, one fetch is not the block**: a copy kept on a local disk that fails a
  check is deleted and the block read again from where the dataset lives; a fetch that fails its check is
  dropped whole (descriptor, remote head) and fetched once more; only then is the block called damaged,
  and only for its current :meth:`~BlockStore.version`.  A block verified whole is offered to the tiers,
  and a file read of a block they want whole fetches it whole first (if that fails its check the file is
  read alone, and no tier asks for that block again): what is copied where is the storage chain's to
  decide (:mod:`blockfs.storage.chain`), never the verifier's.  The checks themselves are
  :class:`~blockfs.core.block_checks.IndexChecks`.

Headers are parsed once per block and kept (12 bytes per file).

* **Digests, where the index has them** (the chain drawn in :mod:`.format`): a header's bytes are checked by
  its BLAKE3 digest when it is adopted (and whenever they are read again), a whole data section by the
  digests of its 1 MiB chunks *instead of* its CRCs (one pass, as before), a file read alone by its own
  digest instead of its CRC, and a piece of a big file by the chunks that cover it, on every read.  The index's digests are the only
  ones compared against: nothing is trusted for a digest computed from what a tier holds.  A local block is
  read in pieces and each piece hashed on another thread while the next is read, so the hash (BLAKE3, ~4 GB/s
  a core) overlaps the read instead of following it (:func:`blockfs.core.digest.chunk_digests_later`).
"""

from __future__ import annotations

import dataclasses
import threading
from collections import OrderedDict
from collections.abc import Hashable, Mapping
from typing import TYPE_CHECKING

import numpy as np

from ..errors import BlockReadError, CorruptBlockError, UnsupportedVersionError
from ..storage.blockfiles import BlockFiles, LocalBlockFiles
from . import digest as dg
from . import format as fmt
from .block_checks import IndexChecks

if TYPE_CHECKING:
    from _typeshed import WriteableBuffer  # bytearray, memoryview, a writable mmap

VERIFY_PIECE = 16 << 20  # a big file in a narrow block is verified in pieces of this size
READ_PIECE = 4 * fmt.CHUNK_SIZE  # a local block's data is read, and hashed behind the read, in pieces of this size
VERIFIED_KEPT = 64  # big narrow files remembered as verified, so reading one in pieces checks it once
COPIES_AT_ONCE = 4  # whole blocks being fetched into a tier at once (each holds a block-sized buffer)


class BlockStore:
    """Verified reads from the block files of one packed dataset, checked against its index.

    ``index`` holds the index's arrays (:attr:`blockfs.core.index.PackedIndex.arrays`): the per-block
    counts and sizes, the block layout and the per-file columns the blocks are checked against.
    """

    def __init__(self, files: BlockFiles | list[str], index: Mapping[str, np.ndarray]) -> None:
        self._files = files if isinstance(files, BlockFiles) else LocalBlockFiles(list(files))
        self._index = index
        self._headers: dict[int, fmt.BlockHeader] = {}
        self._sizes: dict[int, memoryview] = {}  # each checked header's file sizes, for file_size
        self._verified: OrderedDict[tuple[int, int, int], None] = OrderedDict()
        self._verified_lock = threading.Lock()
        self._copying: dict[int, threading.Lock] = {}  # blocks being fetched whole into a tier
        self._copying_lock = threading.Lock()
        self._copy_slots = threading.BoundedSemaphore(COPIES_AT_ONCE)
        self.checks = IndexChecks(index, self.where, self._pread)  # the bytes against the index
        self._head_digest = self.checks.head_digest

    @property
    def files(self) -> BlockFiles:
        return self._files

    @property
    def block_paths(self) -> list[str]:
        """Where each block lives: a path, or a (redacted) URL."""
        return self._files.names

    @property
    def n_blocks(self) -> int:
        return len(self._files.names)

    def where(self, block: int) -> str:
        return f"block {block} ({self._files.names[block]})"

    # --- raw I/O: every read of a block file, and the one translation of its errors ------------------
    def _failed(self, block: int, e: OSError) -> BlockReadError:
        """A failed read (``e`` says what failed): drop the block's descriptor, so the next read opens the
        file afresh.  A header already checked is kept: every block file that belongs to this index has
        exactly that header."""
        self._files.discard(block)
        return BlockReadError(f"{self.where(block)}: {e.strerror or e}", block=block)

    def _io(self, block: int, call, *args):
        """``call(*args)``, a read of ``block`` through the tiers; its OSError as a BlockReadError."""
        try:
            return call(*args)
        except OSError as e:
            raise self._failed(block, e) from e

    def _file_size(self, block: int) -> int:
        return self._io(block, self._files.size, block)

    def _pread(self, block: int, size: int, offset: int) -> bytes:
        """Exactly ``size`` bytes at ``offset``, or a BlockReadError."""
        return self._io(block, self._files.pread, block, size, offset)

    def _read_into(self, block: int, view: memoryview, offset: int) -> None:
        """Fill ``view`` with the file's bytes from ``offset`` (``preadv``: no copy), or a BlockReadError."""
        self._io(block, self._files.read_into, block, view, offset)

    def _checked(self, block: int, read):
        """``read()``; after a failed check, ``read()`` again from a fresh fetch before the block is called
        damaged.  A failed check drops every piece of what was fetched (a remote head kept from that fetch,
        the descriptor of a file since replaced): a bit flipped in transit, a file replaced by rename or a
        tier's rotten copy (deleted, then the dataset's own block read) is not the block's damage.  Only a
        second failure is, and only for this version of the block (:meth:`version`)."""
        retried = False
        while True:
            try:
                return read()
            except CorruptBlockError:
                self._files.discard(block)
                if self._files.drop_copy(block):
                    self._headers.pop(block, None)
                    self._sizes.pop(block, None)
                    continue  # a tier's copy can rot: the dataset's own block decides
                if retried:
                    self._files.refuse_copy(block)  # damaged: no tier fetches it whole again
                    raise
                retried = True

    def version(self, block: int) -> Hashable | None:
        """What identifies the stored block now (a file's device, inode, size and mtime; an object's ETag
        and size), so that damage is remembered for that version only; None when it cannot be told."""
        return self._files.version(block)

    def renew(self, block: int) -> None:
        """The block was replaced since it was found damaged: forget every state of the old one."""
        self._files.discard(block)
        self._files.allow_copy(block)
        self._headers.pop(block, None)
        self._sizes.pop(block, None)

    # --- headers, checked against the file and the index ---------------------------------------------
    def header(self, block: int) -> fmt.BlockHeader:
        """The block's parsed header, once it is shown to be this index's block ``block``."""
        head = self._headers.get(block)
        if head is None:
            head = self._checked(block, lambda: self.adopt_header(block, self.unchecked_header(block)))
        return head

    def adopt_header(self, block: int, head: fmt.BlockHeader) -> fmt.BlockHeader:
        """Check a header :meth:`unchecked_header` gave against the index, and keep it for :meth:`header`."""
        try:
            self.checks.belongs(block, head)
            if self._head_digest is not None:
                self.checks.check_digest(block, "header", self._head_digest[block].tobytes(), head.digest)
                if len(self.checks.chunks_of(block)) != fmt.n_chunks(head.data_size):
                    raise CorruptBlockError(self.checks.foreign(block, "its data section is not the index's length"))
        except CorruptBlockError as e:
            e.block = block
            raise
        self._sizes[block] = head.sizes.data  # a memoryview: indexes to Python ints faster than numpy
        self._headers[block] = head
        return head

    def unchecked_header(self, block: int) -> fmt.BlockHeader:
        """The block's header checked against its own file but not yet against the index: ``verify`` reads
        the data under it and compares file by file, to name exactly the files that differ."""
        try:
            return self._read_header(block)
        except CorruptBlockError as e:
            e.block = block
            raise
        except UnsupportedVersionError:
            # The index, which this blockfs reads, was written with its blocks: a block claiming a newer
            # format is damaged (one flipped bit in its version field) or not this dataset's.
            raise CorruptBlockError(
                f"{self.where(block)}: damaged or not this dataset's: its header claims a block format this "
                "blockfs does not read, while the dataset's index is one it reads; run 'blockfs verify'",
                block=block,
            ) from None

    def file_size(self, block: int, slot: int) -> int:
        """The size of the file in ``slot`` as the block's checked header gives it (a read's own check)."""
        sizes = self._sizes.get(block)
        if sizes is None:
            self.header(block)
            sizes = self._sizes[block]
        return sizes[slot]

    def known_file_size(self, block: int, slot: int) -> int | None:
        """:meth:`file_size` without reading anything: None while the block's header is not checked yet."""
        sizes = self._sizes.get(block)  # one look: a header dropped meanwhile (renew) is read by no one here
        return None if sizes is None else sizes[slot]

    def _read_header(self, block: int) -> fmt.BlockHeader:
        expected = int(self._index["block_counts"][block])

        def check_count(count: int) -> None:
            if count != expected:
                raise CorruptBlockError(
                    self.checks.foreign(block, f"it holds {count} files, the index's block {expected}")
                )

        head, raw = fmt.read_header(
            lambda size, offset: self._pread(block, size, offset),
            self.where(block),
            file_size=self._file_size(block),
            check_count=check_count,
        )
        return head if self._head_digest is None else dataclasses.replace(head, digest=dg.digest(raw))

    def index_crcs(self, block: int) -> np.ndarray:
        """The index's CRC-32 of each slot of ``block`` (0 for a slot no entry names)."""
        return self.checks.index_crcs(block)

    def _verified_header_bytes(self, block: int, head: fmt.BlockHeader) -> bytes | None:
        """The header as stored, for a tier's copy: fetched again, so checked again (its CRC, and that it
        is the header already checked); None when this fetch fails (no copy is kept this time)."""
        raw = self.header_bytes(block)
        try:
            again: fmt.BlockHeader | None = fmt.decode_header(raw, self.where(block))
        except (CorruptBlockError, UnsupportedVersionError):
            again = None
        if again is None or again.data_crc != head.data_crc or again.data_start != head.data_start:
            self._files.discard(block)
            return None
        return raw

    def header_bytes(self, block: int) -> bytes:
        """The block's header as stored, up to where its data starts (it decodes to :meth:`header`)."""
        raw = self._pread(block, self.header(block).data_start, 0)
        if self._head_digest is not None:  # read again: checked again, never trusted for the earlier read's sake
            self.checks.check_digest(block, "header", self._head_digest[block].tobytes(), dg.digest(raw))
        return raw

    # --- whole blocks ---------------------------------------------------------------------------------
    def read_data_into(
        self, block: int, head: fmt.BlockHeader, buf: WriteableBuffer, *, held_in_memory: bool = False
    ) -> np.ndarray:
        """Read ``block``'s data section into ``buf`` (writable, ``head.data_size`` bytes: the caller's
        memory, filled with ``preadv`` and no copy) and verify it; return each file's CRC-32 by slot.

        ``head`` is :meth:`header`'s answer the caller sized ``buf`` by.  A block verified whole is
        offered to the storage tiers (:meth:`BlockFiles.offer`: they decide what to keep); ``held_in_memory``
        says the caller keeps the block for good."""
        view = memoryview(buf)
        try:
            if len(view) != head.data_size:
                raise ValueError(f"a buffer of {len(view)} bytes for {head.data_size} bytes of data")

            def read() -> np.ndarray:
                if self.checks.has_chunk_digests and self._files.reads_in_pieces and len(view) > READ_PIECE:
                    return self.checks.read_checking_pieces(block, head, view, self._read_into, READ_PIECE)
                self._read_into(block, view, head.data_start)
                return self.checks.check_data(block, head, view)

            crcs = self._checked(block, read)
            self._files.offer(
                block, lambda: self._verified_header_bytes(block, head), view, held_in_memory=held_in_memory
            )  # the chain's copy policy decides
            return crcs
        finally:
            view.release()

    @property
    def checks_pieces(self) -> bool:
        """Whether a piece of a big file is checked on its own (by the digests of the chunks it covers), so
        a reader need not stream the whole file through a checksum first."""
        return self.checks.has_chunk_digests

    def copy_into_tier(self, block: int) -> None:
        """Fetch ``block`` whole and verified for the tier that wants it, once however many readers ask."""
        with self._copying_lock:
            lock = self._copying.setdefault(block, threading.Lock())
        with lock, self._copy_slots:
            if self._files.wants_whole(block):  # not already copied by the reader this one waited for
                head = self.header(block)
                self.read_data_into(block, head, bytearray(head.data_size))

    def verified_crcs(self, block: int) -> np.ndarray:
        """Read and verify a whole block; return its files' CRC-32s by slot (for ``verify``)."""
        head = self.header(block)
        return self.read_data_into(block, head, bytearray(head.data_size))

    # --- single files -----------------------------------------------------------------------------------
    def read_file(self, block: int, slot: int, crc: int, offset: int = 0, size: int = -1) -> bytes:
        """Bytes ``[offset, offset + size)`` of one file, verified before they are returned.

        A block the tiers want whole (:meth:`BlockFiles.wants_whole`) is fetched whole first (then read from
        there); if that fetch fails its check, the file is read alone, so only damaged files fail."""
        if self._files.wants_whole(block):
            try:
                self.copy_into_tier(block)
            except CorruptBlockError:
                pass  # the tier no longer asks for this block (see _checked); the file's own read decides
        return self._checked(block, lambda: self._read_file(block, slot, crc, offset, size))

    def _read_file(self, block: int, slot: int, crc: int, offset: int, size: int) -> bytes:
        head = self.header(block)
        start, length = int(head.offsets[slot]), int(head.sizes[slot])
        if size < 0 or offset + size > length:
            size = max(0, length - offset)
        if self.checks.has_chunk_digests and (
            (length > VERIFY_PIECE and size < length) or (head.chunk_crcs is not None and length > fmt.CHUNK_SIZE)
        ):  # a piece of a big file (any read of a huge one): the chunks that cover it, checked now
            return self.checks.read_digested(block, head, start + offset, size)
        if head.chunk_crcs is not None and length > fmt.CHUNK_SIZE:
            # Chunk CRCs come from the block itself; the file's own CRC is the index's, so it binds the
            # bytes to this dataset (checked once per file, as for a big file in a narrow block).
            self._verify_file(block, slot, crc)
            return self.checks.read_chunked(block, head, start + offset, size)
        if length > VERIFY_PIECE and size < length:  # a piece of a big file: verify it once, then read pieces
            self._verify_file(block, slot, crc)
            return self._pread(block, size, head.data_start + start + offset)
        data = self._pread(block, length, head.data_start + start)
        if self.checks.has_file_digests:
            self.checks.check_file_digest(block, slot, crc, dg.digest(data))
        else:
            self.checks.check_file(block, slot, crc, fmt.crc32(data))
        return data if (offset == 0 and size == length) else data[offset : offset + size]

    def verify_file(self, block: int, slot: int, crc: int) -> int:
        """Stream one file through its CRC-32 in pieces (remembered for the last few files, so a file read
        in pieces is checked once); return the bytes read for it (0 when it was already verified)."""
        return self._checked(block, lambda: self._verify_file(block, slot, crc))

    def _verify_file(self, block: int, slot: int, crc: int) -> int:
        key = (block, slot, crc)
        with self._verified_lock:
            if key in self._verified:
                self._verified.move_to_end(key)
                return 0
        head = self.header(block)
        base, length = head.data_start + int(head.offsets[slot]), int(head.sizes[slot])
        check, hasher = 0, dg.hasher() if self.checks.has_file_digests else None
        for pos in range(0, length, VERIFY_PIECE):
            piece = self._pread(block, min(VERIFY_PIECE, length - pos), base + pos)
            if hasher is not None:
                hasher.update(piece)
            else:
                check = fmt.crc32(piece, check)
        if hasher is not None:
            self.checks.check_file_digest(block, slot, crc, hasher.digest())
        else:
            self.checks.check_file(block, slot, crc, check)
        with self._verified_lock:
            self._verified[key] = None
            while len(self._verified) > VERIFIED_KEPT:
                self._verified.popitem(last=False)
        return length

    def close(self) -> None:
        self._files.close()
