"""``IndexChecks``: the checks that bind a block's bytes to one dataset's index — no I/O of their own.

:class:`~blockfs.core.store.BlockStore` reads (through the storage tiers) and calls these on whatever came
back, from any tier: a header against the index (its number, file count, sizes, labels, CRCs, digest), a
whole data section by its chunk digests or its CRCs, one file by its own digest or CRC-32, a piece of a big
file by the chunks that cover it.  Every mismatch is a :class:`CorruptBlockError` naming the block.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping

import numpy as np

from ..errors import CorruptBlockError, IndexFormatError
from . import digest as dg
from . import format as fmt


class IndexChecks:
    """Checks against ``index`` (the index's arrays; digests where the dataset has them).  ``where(b)`` names
    block ``b`` in messages; ``pread(b, size, offset)`` reads for the checks of a piece of a file."""

    def __init__(
        self, index: Mapping[str, np.ndarray], where: Callable[[int], str], pread: Callable[[int, int, int], bytes]
    ) -> None:
        self._index = index
        self.where = where
        self._pread = pread
        # The digests to check by (arrays of 32-byte rows), or None: a dataset checked by CRC-32 only.
        self._file_digest = index.get("file_digest")
        self.head_digest = index.get("block_head_digest")
        self._chunk_digest = index.get("chunk_digest")  # block b's: rows block_chunks[b] .. block_chunks[b + 1]
        self._block_chunks = index.get("block_chunks")
        self._slot_entries: dict[int, np.ndarray] = {}  # block -> entry of each slot (-1: empty), for file digests

    @property
    def has_file_digests(self) -> bool:
        return self._file_digest is not None

    @property
    def has_chunk_digests(self) -> bool:
        return self._chunk_digest is not None

    def belongs(self, block: int, head: fmt.BlockHeader) -> None:
        """Raise CorruptBlockError unless ``head`` is the block this index describes (see the module notes)."""
        a = self._index
        if head.block_id != block:
            raise CorruptBlockError(self.foreign(block, f"its header says it is block {head.block_id}"))
        if head.total_size != int(a["block_sizes"][block]):
            raise CorruptBlockError(
                self.foreign(block, f"it is {head.total_size} bytes, the index's block {int(a['block_sizes'][block])}")
            )
        ids, slots = self.entries(block)
        sizes = head.sizes[slots]
        wrong = np.flatnonzero(sizes != a["size"][ids])
        if wrong.size:
            k = int(wrong[0])
            raise CorruptBlockError(
                self.foreign(
                    block,
                    f"slot {int(slots[k])} holds {int(sizes[k])} bytes, the index says {int(a['size'][ids[k]])} "
                    f"for {self.path(int(ids[k]))}",
                )
            )
        empty = np.ones(head.count, dtype=bool)
        empty[slots] = False  # a slot no entry names held a file the packer could not read: it is empty
        if np.any(head.sizes[empty] != 0):
            raise CorruptBlockError(self.foreign(block, "it holds a file the index does not list"))
        # A hard link's label is its own directory's; the block holds the first path's.
        own = a["ino"][ids] == (ids + 1).astype(np.uint64)
        if np.any(head.labels[slots[own]] != a["label"][ids[own]]):
            raise CorruptBlockError(self.foreign(block, "its labels differ from the index's"))
        crcs = self.index_crcs(block)
        if np.any(crcs[slots] != a["crc"][ids]) or fmt.crc_of_crcs(crcs) != head.data_crc:
            raise CorruptBlockError(self.foreign(block, "its files' checksums differ from the index's"))

    def foreign(self, block: int, why: str) -> str:
        return (
            f"{self.where(block)}: does not belong to this dataset ({why}): copy the right block file back "
            "from where the dataset came from, or pack it again"
        )

    def entries(self, block: int) -> tuple[np.ndarray, np.ndarray]:
        """(entry ids, their slots) of the files the index places in ``block``."""
        a = self._index
        lo, hi = int(a["block_offsets"][block]), int(a["block_offsets"][block + 1])
        ids = a["block_files"][lo:hi].astype(np.int64)
        if not 0 <= lo <= hi <= a["block_files"].size or (ids.size and ids.max() >= a["slot"].size):
            raise IndexFormatError(f"the index's layout of {self.where(block)} runs outside its arrays")
        slots = a["slot"][ids].astype(np.int64)
        if slots.size and slots.max() >= int(a["block_counts"][block]):
            raise IndexFormatError(f"the index places a file of {self.where(block)} outside its slots")
        return ids, slots

    def path(self, entry: int) -> str:
        a = self._index
        start, end = int(a["path_offsets"][entry]), int(a["path_offsets"][entry + 1]) - 1
        return repr(os.fsdecode(a["paths"][start:end].tobytes()))

    def index_crcs(self, block: int) -> np.ndarray:
        """The index's CRC-32 of each slot of ``block`` (0 for a slot no entry names)."""
        ids, slots = self.entries(block)
        crcs = np.zeros(int(self._index["block_counts"][block]), dtype=np.uint32)
        crcs[slots] = self._index["crc"][ids]
        return crcs

    def check_data(self, block: int, head: fmt.BlockHeader, view: memoryview) -> np.ndarray:
        """Verify a whole data section (its digest where the index has one, else its CRCs: one pass over the
        bytes either way); return each file's CRC-32 by slot."""
        if self._chunk_digest is None:
            return fmt.check_data(head, view, self.where(block))
        if len(view) != head.data_size:
            raise CorruptBlockError(
                f"{self.where(block)}: truncated: data section has {len(view)} of {head.data_size} bytes", block=block
            )
        self.chunk_count_matches(block, view)
        self.check_chunks(block, 0, view)
        return self.index_crcs(block)  # the digests prove the bytes are the packed ones, so are their CRCs

    def chunks_of(self, block: int) -> np.ndarray:
        """The index's digests of block ``block``'s data chunks, one 32-byte row each."""
        assert self._chunk_digest is not None and self._block_chunks is not None  # asked only where they are
        return self._chunk_digest[int(self._block_chunks[block]) : int(self._block_chunks[block + 1])]

    def check_chunks(self, block: int, first: int, data) -> None:
        """``data``, the data section from chunk ``first`` on, is what the index's chunk digests say."""
        self.compare_chunks(block, first, dg.chunk_digests(data, fmt.CHUNK_SIZE))

    def chunk_count_matches(self, block: int, data) -> None:
        """A whole data section has as many chunks as the index has digests for it."""
        if len(self.chunks_of(block)) != fmt.n_chunks(len(data)):  # an unchecked header (verify's) may claim any length
            raise CorruptBlockError(self.foreign(block, "its data section is not the index's length"), block=block)

    def compare_chunks(self, block: int, first: int, got: bytes) -> None:
        """``got``, the digests of chunks ``first`` on, are the index's."""
        want = self.chunks_of(block)[first : first + len(got) // dg.DIGEST_SIZE]
        if len(want) * dg.DIGEST_SIZE != len(got):
            raise CorruptBlockError(self.foreign(block, "its data section is not the index's length"), block=block)
        if got != want.tobytes():
            k = next(k for k in range(len(want)) if got[32 * k : 32 * k + 32] != want[k].tobytes())
            self.check_digest(block, "data", want[k].tobytes(), got[32 * k : 32 * k + 32], f" of chunk {first + k}")

    def check_digest(self, block: int, what: str, want: bytes, got: bytes | None, part: str = "") -> None:
        if got != want:
            raise CorruptBlockError(
                f"{self.where(block)}: {what} checksum mismatch (the index's BLAKE3 digest{part} is {want.hex()[:16]}..., the "
                f"block's {got.hex()[:16] if got else 'unknown'}...): not the bytes packed; run 'blockfs verify'",
                block=block,
            )

    def file_digest(self, block: int, slot: int) -> bytes:
        """The index's digest of the file in ``slot`` of ``block`` (hard links share their slot's)."""
        return self.slot_sums(block, slot)[0]

    def slot_sums(self, block: int, slot: int) -> tuple[bytes, int]:
        """(the index's digest, its CRC-32) of the file in ``slot`` of ``block``."""
        entries = self._slot_entries.get(block)
        if entries is None:
            ids, slots = self.entries(block)
            entries = np.full(int(self._index["block_counts"][block]), -1, dtype=np.int64)
            entries[slots] = ids
            self._slot_entries[block] = entries  # a race only computes it twice
        e = int(entries[slot])
        if e < 0:  # a slot no entry names is empty (checked with the header)
            return dg.digest(b""), 0
        assert self._file_digest is not None  # asked only of a dataset with digests
        return self._file_digest[e].tobytes(), int(self._index["crc"][e])

    def check_file(self, block: int, slot: int, expected: int, got: int) -> None:
        if got != expected:
            raise CorruptBlockError(
                f"{self.where(block)}: slot {slot}: checksum mismatch (expected 0x{expected:08x}, got "
                f"0x{got:08x}); run 'blockfs verify'",
                block=block,
            )

    def check_file_digest(self, block: int, slot: int, crc: int, got: bytes) -> None:
        """The file's digest is the index's (and ``crc``, the caller's idea of the file, is the index's too)."""
        want, index_crc = self.slot_sums(block, slot)
        if crc != index_crc:
            self.check_file(block, slot, index_crc, crc)
        if got != want:
            raise CorruptBlockError(
                f"{self.where(block)}: slot {slot}: checksum mismatch (the index's BLAKE3 digest is {want.hex()[:16]}..., "
                f"the file's {got.hex()[:16]}...): not the bytes packed; run 'blockfs verify'",
                block=block,
            )

    def read_digested(self, block: int, head: fmt.BlockHeader, start: int, size: int) -> bytes:
        """Bytes ``[start, start + size)`` of the data section, read as the whole chunks that cover them and
        checked by their digests (so what is served was checked now, not on an earlier read)."""
        if size == 0:
            return b""
        first, last = start // fmt.CHUNK_SIZE, (start + size - 1) // fmt.CHUNK_SIZE
        lo, hi = first * fmt.CHUNK_SIZE, min((last + 1) * fmt.CHUNK_SIZE, head.data_size)
        data = self._pread(block, hi - lo, head.data_start + lo)
        self.check_chunks(block, first, data)
        return data[start - lo : start - lo + size]

    def read_chunked(self, block: int, head: fmt.BlockHeader, start: int, size: int) -> bytes:
        """A range of a WIDE block, verified chunk by chunk."""
        assert head.chunk_crcs is not None  # a WIDE block's header has them
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

    def read_checking_pieces(
        self,
        block: int,
        head: fmt.BlockHeader,
        view: memoryview,
        read_into: Callable[[int, memoryview, int], None],
        piece: int,
    ) -> np.ndarray:
        """:meth:`check_data` for a data section read (``read_into``) in pieces of ``piece`` bytes: each is
        hashed on a hashing thread while the next is read, and nothing is returned (or raised) before every
        hash has finished with the caller's buffer."""
        self.chunk_count_matches(block, view)
        pending = []
        try:
            for start in range(0, len(view), piece):
                part = view[start : start + piece]
                read_into(block, part, head.data_start + start)
                pending.append(dg.chunk_digests_later(part, fmt.CHUNK_SIZE))
        finally:
            got = [p.result() for p in pending]  # waits for every hash, also when a read failed
        self.compare_chunks(block, 0, b"".join(got))
        return self.index_crcs(block)
