"""``PackedDataset``: a packed dataset read by path — stat, listdir, read, readlink — without mounting.

The one API under the FUSE adapter, the CLI, the tools and the tests.  Paths may be ``str`` or ``bytes``,
relative or with a leading ``/``; the root is ``""`` or ``"/"``.  Reads go through a *reader*: the
:class:`~blockfs.core.store.BlockStore` itself by default, or a cache in front of it (the mount's).
"""

from __future__ import annotations

import copy
import logging
import os
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import numpy as np

from ..errors import (
    BlockReadError,
    CorruptBlockError,
    EntryNotFoundError,
    IndexFormatError,
    IsADirectoryEntryError,
    NotASymlinkError,
)
from . import digest as dg
from .format import INDEX_NAME, METADATA_NAME, NARROW_LIMIT
from .index import KIND_DIR, KIND_FILE, KIND_NAMES, KIND_SYMLINK, PackedIndex
from .index_format import DIGEST_ARRAYS, REPACK
from .location import StorageOptions, locate

if TYPE_CHECKING:
    from ..storage.disk_tier import DiskTier
    from .checked_indexes import CheckedIndexes
    from .index_copy import IndexCopies
from ..errors import IdentityError
from .metadata import has_digests, read_metadata, read_metadata_bytes  # noqa: F401  (read_metadata: this module's API)
from .store import BlockStore

log = logging.getLogger(__name__)

PathLike = str | bytes | os.PathLike
READ_PIECE = 16 << 20  # bytes per read of a file in a WIDE block (narrow ones are verified, so read, whole)
SYMLINK_HOPS = 40  # links followed in one path before it is a loop (Linux's MAXSYMLINKS)


class FileReader(Protocol):
    """What serves file bytes: the store, or a cache in front of it."""

    def read_file(self, block: int, slot: int, crc: int, offset: int = 0, size: int = -1) -> bytes: ...


@dataclass(frozen=True)
class EntryStat:
    """What ``stat`` returns for one entry."""

    entry: int
    kind: int
    mode: int
    size: int
    mtime_ns: int
    ino: int
    nlink: int
    label: int
    block: int

    @property
    def kind_name(self) -> str:
        return KIND_NAMES[self.kind]


def _to_bytes(path: PathLike) -> bytes:
    """A path in the dataset as the index spells it: no leading, trailing or doubled ``/``, no ``.``
    components (``./-four`` is ``-four``, as in a shell).  ``..`` is left for the lookup to refuse."""
    return b"/".join(part for part in os.fsencode(path).split(b"/") if part not in (b"", b"."))


def _check_labels(labels: np.ndarray, classes: list[str] | None, where: str) -> None:
    """A label must name one of the metadata's classes: one beyond them means index and metadata are not
    one pack's, and every consumer (``info``, the loader's targets) would index past the class list."""
    if classes is not None and labels.size and int(labels.max()) >= len(classes):
        raise IndexFormatError(
            f"index {where}: label {int(labels.max())} is beyond the {len(classes)} classes in "
            f"{METADATA_NAME} (column 'label'): index and metadata are not one pack's; {REPACK}"
        )


class PackedDataset:
    """A packed dataset opened for reading.  Opening is O(1) in the number of files.

    ``location`` is a directory or a URL (``s3://``, ``gs://``, ``az://``, ``http(s)://``); ``storage``
    says how to reach and cache a remote one.  ``root`` is always a local directory holding the metadata
    and the index (for a URL, fetched there once); ``location`` is what messages show (a URL redacted).

    ``digest`` is the dataset's name (``blake3:<hex>`` of its ``blockfs.json``); ``expect`` pins it: a dataset
    with another name is refused, and every byte read is then checked along the chain of digests that
    starts there.  Without ``expect`` the chain starts at the ``blockfs.json`` just read.  ``checked``: the
    record of indexes that passed every check (:mod:`.checked_indexes`; a mount's), or None to check always.
    ``copies``: where a mount's index is copied and mapped (:mod:`.index_copy`), or None to read it into
    anonymous memory.  ``defer_tree_checks``: a mount's; the index's costliest check runs a directory at a
    time as it is used and whole by ``index.finish_checks`` (:mod:`.directory_checks`)."""

    def __init__(
        self,
        location: str | os.PathLike,
        reader: FileReader | None = None,
        storage: StorageOptions | None = None,
        expect: str | None = None,
        checked: CheckedIndexes | None = None,
        copies: IndexCopies | None = None,
        defer_tree_checks: bool = False,
    ) -> None:
        self._location = locate(location, storage)
        try:
            self._open(reader, expect, record=checked, copies=copies, defer_tree_checks=defer_tree_checks)
        except BaseException:
            self._location.close()
            raise

    def _open(
        self,
        reader: FileReader | None,
        expect: str | None = None,
        *,
        record: CheckedIndexes | None = None,
        copies: IndexCopies | None = None,
        defer_tree_checks: bool = False,
    ) -> None:
        self.root = self._location.root
        self.location = self._location.display
        self.metadata, raw = read_metadata_bytes(self.root, expect, self.location)
        self.metadata_bytes = raw
        self.digest = dg.name_of(raw)
        self.has_digests = has_digests(self.metadata)
        if not self.has_digests:
            if expect is not None:
                raise IdentityError(
                    f"dataset {self.location} was packed before digests (checked against accidents only, by CRC-32): "
                    f"it cannot be pinned; run 'blockfs upgrade {self.location}' to add them"
                )
            log.warning(
                "dataset %s is checked against accidents only (CRC-32, no digests): 'blockfs upgrade %s' "
                "adds the digests that prove every byte is this dataset's",
                self.location,
                self.location,
            )
        n_blocks = self.metadata["n_blocks"]
        self.index = PackedIndex(
            os.path.join(self.root, INDEX_NAME),
            n_blocks=n_blocks,
            crc32=self.metadata["index"]["crc32"],
            digest=self.metadata["index"].get("blake3"),
            checked=record,
            copies=copies,
            defer_tree_checks=defer_tree_checks,
        )
        a = self.index.arrays
        _check_labels(a["label"], self.metadata["classes"], self.index.file)
        # An index's digests count only when blockfs.json, the start of the chain, vouches for the index.
        checked = a if self.has_digests else {k: v for k, v in a.items() if k not in DIGEST_ARRAYS}
        self.store = BlockStore(self._location.block_files([int(n) for n in a["block_sizes"]]), checked)
        self.reader: FileReader = reader or self.store
        self._a = a
        self._crcs_by_block: dict[int, np.ndarray] = {}

    # --- metadata ------------------------------------------------------------------------------
    @property
    def classes(self) -> list[str] | None:
        return self.metadata.get("classes")

    @property
    def n_blocks(self) -> int:
        return self.index.n_blocks

    @property
    def labels(self) -> np.ndarray:
        """Label of every entry (by entry id); -1 for directories, links and unlabelled files."""
        return self._a["label"]

    @property
    def file_ids(self) -> np.ndarray:
        """Entry ids of the regular files."""
        return np.flatnonzero(self._a["kind"] == KIND_FILE)

    @property
    def layout(self) -> tuple[np.ndarray, np.ndarray]:
        """(block_offsets, block_files): block b holds entries ``block_files[off[b]:off[b + 1]]`` in slot order."""
        return self._a["block_offsets"], self._a["block_files"]

    def path_of(self, entry: int) -> bytes:
        return self.index.path(entry)

    # --- by path -------------------------------------------------------------------------------
    def lookup(self, path: PathLike) -> int:
        return self.index.lookup(_to_bytes(path))

    def resolve(self, path: PathLike) -> int:
        """The entry ``path`` names with its symbolic links followed inside the dataset, as the mount
        resolves them (``cat`` follows a link as cat(1) does).  A link that leads out of the dataset (an
        absolute target, or ``..`` above the root) or round in a loop is an error naming it."""
        todo = [part for part in _to_bytes(path).split(b"/") if part]
        done: list[bytes] = []
        hops = 0
        while todo:
            name = todo.pop(0)
            if name == b"..":
                if not done:
                    raise EntryNotFoundError(f"{os.fsdecode(_to_bytes(path))!r} leads out of the packed dataset")
                done.pop()
                continue
            e = self.index.lookup(b"/".join([*done, name]))
            if self.index.kind(e) != KIND_SYMLINK:
                done.append(name)
                continue
            target = self.index.link_target(e)
            hops += 1
            if target.startswith(b"/") or hops > SYMLINK_HOPS:
                why = "an absolute link, out of the packed dataset" if hops <= SYMLINK_HOPS else "links in a loop"
                raise EntryNotFoundError(f"{os.fsdecode(self.path_of(e))!r} -> {os.fsdecode(target)!r}: {why}")
            todo[:0] = [part for part in target.split(b"/") if part not in (b"", b".")]
        return self.index.lookup(b"/".join(done))

    def stat(self, path: PathLike) -> EntryStat:
        return self.stat_entry(self.lookup(path))

    def stat_entry(self, e: int) -> EntryStat:
        kind, mode, size, mtime_ns, ino, nlink, label, block = self.index.stat_fields(e)
        return EntryStat(e, kind, mode, size, mtime_ns, ino, nlink, label, block)

    def listdir(self, path: PathLike = "") -> list:
        """Names in a directory, sorted, as ``str`` or ``bytes`` like the path given (as ``os.listdir``)."""
        names = self.index.names(self.lookup(path))
        return names if isinstance(path, bytes) else [os.fsdecode(n) for n in names]

    def readlink(self, path: PathLike) -> str | bytes:
        e = self.lookup(path)
        if self.index.kind(e) != KIND_SYMLINK:
            raise NotASymlinkError(f"not a symbolic link: {os.fsdecode(_to_bytes(path))!r}")
        target = self.index.link_target(e)
        return target if isinstance(path, bytes) else os.fsdecode(target)

    def read(self, path: PathLike, offset: int = 0, size: int = -1) -> bytes:
        """``size`` bytes of a file from ``offset`` (all of it by default); short at the end of the file."""
        return self.read_entry(self.lookup(path), offset, size)

    def read_entry(self, e: int, offset: int = 0, size: int = -1) -> bytes:
        kind, block, slot, length, crc = self.index.read_fields(e)  # Python ints from memoryviews: no NumPy scalars
        if kind == KIND_DIR:
            raise IsADirectoryEntryError(f"is a directory: {os.fsdecode(self.path_of(e))!r}")
        if kind != KIND_FILE:
            raise EntryNotFoundError(f"not a regular file: {os.fsdecode(self.path_of(e))!r}")
        try:
            data = b""
            if offset < length and size != 0:
                if size < 0 or offset + size > length:
                    size = length - offset
                data = self.reader.read_file(block, slot, crc, offset, size)
            # The index's size decides where the file ends: it must be the block's, or the file comes out
            # cut.  Checked after the read, whose reader (a cache) sees the header's faults first and has
            # left the header with the store.
            self._check_size(block, slot, length, self.store.file_size(block, slot))
            return data
        except (CorruptBlockError, BlockReadError) as err:
            raise _naming(err, f"{os.fsdecode(self.path_of(e))!r}") from err

    def confirm_empty(self, e: int) -> bool | None:
        """For an empty file (the kernel never reads one, so this is its only check): whether its block's
        header, if already in memory, says so too — None when it is not (confirming would wait on storage:
        :meth:`read_entry` confirms it then).  A header that disagrees raises as :meth:`read_entry` does."""
        block, slot = int(self._a["block"][e]), int(self._a["slot"][e])
        stored = self.store.known_file_size(block, slot)
        if stored is None:
            return None
        try:
            self._check_size(block, slot, int(self._a["size"][e]), stored)
        except CorruptBlockError as err:
            raise _naming(err, f"{os.fsdecode(self.path_of(e))!r}") from err
        return True

    def _check_size(self, block: int, slot: int, length: int, stored: int) -> None:
        if stored != length:
            raise CorruptBlockError(
                f"{self.store.where(block)}: slot {slot} holds {stored} bytes, the index says {length}: "
                "the index or the block is damaged; run 'blockfs verify'",
                block=block,
            )

    def read_pieces(self, e: int) -> Iterator[bytes]:
        """All of a file's bytes, in pieces (``cat``, ``unpack``): a file in a narrow block whole, since
        one CRC covers it; one in a WIDE block :data:`READ_PIECE` at a time.

        A read shorter than asked ends it with a :class:`CorruptBlockError`: the index promised bytes the
        block does not hold, and a caller must never loop on empty reads towards a size it will not reach.
        """
        size = int(self._a["size"][e])
        if size == 0:  # reads nothing, but checks the block holds an empty file: a zeroed size must not serve ""
            self.read_entry(e)
            return
        piece = READ_PIECE if size >= NARROW_LIMIT else max(size, 1)
        offset = 0
        while offset < size:
            want = min(piece, size - offset)
            data = self.read_entry(e, offset, want)
            if len(data) != want:
                raise CorruptBlockError(
                    f"{os.fsdecode(self.path_of(e))!r}: short read, {len(data)} of {want} bytes at offset "
                    f"{offset} (the index says {size} bytes): index and block disagree; run 'blockfs verify'",
                    block=int(self._a["block"][e]),
                )
            yield data
            offset += want

    def read_block_range(self, block: int, offset: int, size: int) -> bytes:
        """Bytes ``[offset, offset + size)`` of block ``block``'s file as stored, header included.

        The header comes from storage (whoever decodes it checks its CRC); file bytes come through the
        reader, each file verified as in :meth:`read_entry`, so a block read this way is served from the
        cache, counted and retained exactly like the same files read by path. A damaged file fails the
        range that touches it (naming the file); the bytes between files, if a writer left any, are zeros.
        """
        store = self.store
        try:
            head = store.header(block)
        except (CorruptBlockError, BlockReadError) as err:  # every file of the block is lost: name the first
            names = self.files_in_block(block)
            what = f"{os.fsdecode(names[0])!r} and the {len(names) - 1} other files of the block" if names else "it"
            raise _naming(err, what) from err
        end = min(offset + size, head.total_size)
        if offset >= end:
            return b""
        parts: list[bytes] = []
        if offset < head.data_start:
            parts.append(store.header_bytes(block)[offset : min(end, head.data_start)])
            offset = head.data_start
        starts, sizes = head.offsets, head.sizes
        rel, rel_end = offset - head.data_start, end - head.data_start
        slot = max(0, int(np.searchsorted(starts, rel, side="right")) - 1)
        crcs = self._slot_crcs(block)
        while rel < rel_end:
            if slot >= head.count:
                parts.append(bytes(rel_end - rel))
                break
            start, length = int(starts[slot]), int(sizes[slot])
            if rel < start:  # a gap before this file
                gap = min(start, rel_end) - rel
                parts.append(bytes(gap))
                rel += gap
                continue
            n = min(rel_end, start + length) - rel
            if n > 0:
                try:
                    parts.append(self.reader.read_file(block, slot, int(crcs[slot]), rel - start, n))
                except (CorruptBlockError, BlockReadError) as err:
                    name = os.fsdecode(self.path_of(self._entry_at(block, slot)))
                    raise _naming(err, f"{name!r}") from err
                rel += n
            slot += 1
        return b"".join(parts)

    def _slot_crcs(self, block: int) -> np.ndarray:
        """The index's CRC-32 of each slot of ``block`` (hard-link aliases share their slot's); kept, 4 bytes
        a file, since a block is read in many pieces."""
        crcs = self._crcs_by_block.get(block)
        if crcs is None:
            crcs = self._crcs_by_block[block] = self.store.index_crcs(block)  # a race only computes it twice
        return crcs

    def _block_entries(self, block: int) -> np.ndarray:
        off, files = self.layout
        return files[int(off[block]) : int(off[block + 1])].astype(np.int64)

    def _entry_at(self, block: int, slot: int) -> int:
        ids = self._block_entries(block)
        return int(ids[self._a["slot"][ids] == slot][0])

    def files_in_block(self, block: int) -> list[bytes]:
        off, files = self.layout
        return [self.path_of(int(e)) for e in files[int(off[block]) : int(off[block + 1])]]

    @property
    def is_remote(self) -> bool:
        return self._location.is_remote

    @property
    def disk_tier(self) -> DiskTier | None:
        """The local-disk tier of a remote dataset (:class:`blockfs.storage.disk_tier.DiskTier`), or None."""
        return self._location.tier

    def reading_through(self, reader: FileReader) -> PackedDataset:
        """This open dataset, its files read through ``reader`` (a cache over :attr:`store`, which can only be
        made once the dataset is open): the same index, store and location, closed by this one's
        :meth:`close` (close one of the two, not both)."""
        other = copy.copy(self)
        other.reader = reader
        return other

    def close(self) -> None:
        self.store.close()
        self.index.close()
        self._location.close()

    def __enter__(self) -> PackedDataset:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _naming(err: CorruptBlockError | BlockReadError, what: str) -> CorruptBlockError | BlockReadError:
    """The same error, its message naming what was being read."""
    return type(err)(f"{err} (reading {what})", block=err.block)


def open_dataset(
    location: str | os.PathLike,
    reader: FileReader | None = None,
    *,
    storage_options: dict | None = None,
    disk_cache: str | os.PathLike | None = None,
    disk_cache_size: int = 0,
    expect: str | None = None,
) -> PackedDataset:
    """Open the packed dataset at ``location``: a directory written by :func:`blockfs.pack`, or its URL in
    an object store.  For a URL, ``storage_options`` reach it (``endpoint``, ``region``, keys; fsspec's
    spellings work) and ``disk_cache`` keeps fetched blocks on a local disk, up to ``disk_cache_size`` bytes.
    ``expect`` (``"blake3:<hex>"``, as ``blockfs info`` prints) pins the dataset: another is refused, and
    every byte read is checked against the chain of digests that name it."""
    storage = StorageOptions(
        dict(storage_options or {}), os.fspath(disk_cache) if disk_cache else None, disk_cache_size
    )
    return PackedDataset(location, reader, storage, expect)
