"""The destination directory's life: claimed with a marker before the first block, the index written
once every block is on disk, and the metadata file renamed into place last, as the commit.

Crash safety lives here, in one place: the marker ``.blockfs-packing`` exists from the first byte written
until ``blockfs.json`` is renamed into place, and ``blockfs.json`` is what makes a directory open as a
dataset.  A killed pack therefore never leaves anything that opens as complete, and a rerun recognises
the marker and starts over without ``--force``.

The packer sees a destination through :class:`Destination`: a local directory
(:class:`LocalDestination`, written in place) or a URL
(:class:`~blockfs.packing.remote_destination.RemoteDestination`, written to a staging directory and
uploaded block by block, with the same steps and the same argument for crash safety).
"""

from __future__ import annotations

import logging
import mmap
import os
from abc import ABC, abstractmethod
from collections.abc import Iterator

import numpy as np

from ..core import digest as dg
from ..core import format as fmt
from ..core.checked_indexes import CheckedIndexes
from ..core.digest import file_digest
from ..core.format import BLOCKS_DIR, INDEX_NAME, METADATA_NAME, PACKING_MARKER, block_name
from ..core.index import KIND_DIR, KIND_FILE, KIND_SYMLINK, IndexColumns, PreparedIndex, check_contents
from ..core.index_copy import IndexCopies
from ..core.index_format import array_views, check_header, read_toc
from ..core.metadata import METADATA_VERSION, metadata_bytes
from ..errors import BlockfsError, PackError
from ..storage.owned import DIR_FLAGS, USER_DIR_FLAGS, created_at, remove_at, write_file_at
from ..storage.urls import is_remote
from .containers.recordio import LABELS_FILE
from .options import PackOptions
from .parallel import Sums

FILE_MODE = 0o666  # as open() makes files: the umask decides
log = logging.getLogger(__name__)

DIGEST_PIECE = 1 << 14  # file digests gathered at a time: the pages of the spilled ones a piece touches


def prepare_dest(src: str | None, dest: str, force: bool) -> int:
    """Refuse a destination that would lose data, then mark it as a pack in progress; return a descriptor
    of it (the caller closes it).

    From here on every file of DEST is written or removed through that descriptor, by name, following no
    link (``storage.owned``): an old dataset's file that is a link (``--force`` over a dataset received from
    someone else) is removed itself, never what it points to, and a link planted at a name the pack writes
    is replaced, never written through.
    """
    if src is not None:
        real_src, real_dest = os.path.realpath(src), os.path.realpath(dest)
        if real_dest == real_src or real_dest.startswith(real_src.rstrip("/") + "/"):
            raise PackError(f"destination {dest!r} is inside the source {src!r}: choose a path outside it")
    if os.path.exists(dest) and not os.path.isdir(dest):
        raise PackError(f"destination {dest!r} exists and is not a directory")
    if os.path.isdir(dest) and os.listdir(dest):
        ours = os.path.exists(os.path.join(dest, PACKING_MARKER))
        dataset = os.path.exists(os.path.join(dest, METADATA_NAME))
        if not ours and not dataset:
            raise PackError(
                f"destination {dest!r} is not empty and holds no blockfs dataset: choose an empty or new "
                "directory (--force only replaces an existing blockfs dataset)"
            )
        if dataset and not ours and not force:
            raise PackError(f"destination {dest!r} already holds a packed dataset: pass --force to replace it")
    os.makedirs(dest, exist_ok=True)
    fd = os.open(dest, USER_DIR_FLAGS)
    try:
        # The marker goes down before anything is removed, so no moment exists where DEST looks complete.
        write_file_at(fd, PACKING_MARKER, (), mode=FILE_MODE, sync=False)
        for name in (METADATA_NAME, INDEX_NAME, BLOCKS_DIR):
            remove_at(fd, name)
        os.mkdir(BLOCKS_DIR, 0o777, dir_fd=fd)
    except BaseException:
        os.close(fd)
        raise
    return fd


def open_blocks_dir(dir_fd: int) -> int:
    """A descriptor of ``blocks/`` in DEST, the directory every block file is written into by name."""
    return os.open(BLOCKS_DIR, DIR_FLAGS, dir_fd=dir_fd)


def read_at(dir_fd: int, name: str) -> int:
    """A descriptor to read ``name`` in ``dir_fd`` through, never through a link (the reader closes it)."""
    return os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dir_fd)


class Destination(ABC):
    """Where a pack goes, as the packer sees it: the steps of :func:`blockfs.pack` that touch DEST.

    ``directory`` is the local directory the block writers, the index and a source's side files are
    written into, and ``dir_fd`` / ``blocks_fd`` its descriptor and that of its ``blocks/`` (set by
    :meth:`claim`: everything is written through them); ``display`` names DEST in messages and in the
    result; ``fsync`` says whether files written there must be flushed (False where they are a staging
    copy: the upload is what lasts).
    """

    directory: str
    display: str
    fsync: bool
    dir_fd: int = -1
    blocks_fd: int = -1

    @abstractmethod
    def claim(self, source_location: str | None, force: bool) -> None:
        """Refuse a DEST that would lose data, then mark it as a pack in progress.  ``source_location``:
        the directory or URL the source reads from (DEST must not be inside it), or None."""

    def block_written(self, block: int) -> None:  # noqa: B027 (a hook: by default nothing to do)
        """Block ``block``'s file in ``directory`` is complete (called in the packer's thread)."""

    def blocks_done(self) -> None:  # noqa: B027 (a hook: by default nothing to do)
        """Every block is written: return once they are all where they last (an upload's error is raised here)."""

    @abstractmethod
    def block_sizes(self, n_blocks: int) -> np.ndarray:
        """The size of every block file, for the index."""

    @abstractmethod
    def commit(self, metadata: dict) -> None:
        """Make DEST a dataset: whatever is still to go there first, ``blockfs.json`` last."""

    def free_bytes(self) -> int | None:
        """Bytes free where the blocks are written (measured once DEST is claimed), or None if unknown."""
        return None

    def abandon(self, reason: str) -> str:
        """After a failure past :meth:`claim`: remove what the pack wrote where that is safe; return what
        was done in words for the error ("removed ...", or what is left and how to remove it)."""
        return ""

    def close(self) -> None:
        """Release what the pack used, after a commit or a failure."""
        for fd in (self.blocks_fd, self.dir_fd):
            if fd >= 0:
                os.close(fd)
        self.dir_fd = self.blocks_fd = -1


class LocalDestination(Destination):
    """A local directory, written in place and committed by renaming ``blockfs.json`` into place."""

    # What a pack may write beside blocks/ (made afresh by the claim): removed after a failure unless
    # DEST held the name before the pack.
    WRITTEN = (INDEX_NAME, INDEX_NAME + ".tmp", METADATA_NAME + ".tmp", LABELS_FILE, LABELS_FILE + ".tmp")

    def __init__(self, dest: str, fsync: bool) -> None:
        self.directory = self.display = dest
        self.fsync = fsync
        self._claimed = self._created = False
        self._before: set[str] = set()

    def claim(self, source_location: str | None, force: bool) -> None:
        inside = source_location if source_location is not None and not is_remote(source_location) else None
        self._created = not os.path.lexists(self.directory)
        self.dir_fd = prepare_dest(inside, self.directory, force)
        self.blocks_fd = open_blocks_dir(self.dir_fd)
        self._claimed = True
        self._before = set(os.listdir(self.dir_fd)) - {PACKING_MARKER, BLOCKS_DIR}

    def free_bytes(self) -> int | None:
        vfs = os.statvfs(self.dir_fd)
        return vfs.f_bavail * vfs.f_frsize

    def abandon(self, reason: str) -> str:
        # Everything by name through DEST's descriptor, following no link (storage.owned), as it was written.
        dest, fd = self.directory, self.dir_fd
        marker = os.path.join(dest, PACKING_MARKER)
        if not self._claimed or fd < 0 or _exists_at(fd, METADATA_NAME) or not _exists_at(fd, PACKING_MARKER):
            return ""  # never claimed, or already committed: nothing here is a failed pack's
        _write_reason(fd, reason)  # first, so that whatever stays behind says why
        try:
            remove_at(fd, BLOCKS_DIR)
        except OSError as e:
            return (
                f"could not remove its blocks ({e.strerror}): remove {os.path.join(dest, BLOCKS_DIR)!r} and {marker!r}"
            )
        for name in self.WRITTEN:
            if name not in self._before:
                try:
                    remove_at(fd, name)
                except OSError as e:
                    return f"could not remove {os.path.join(dest, name)!r} ({e.strerror}): remove it and {marker!r}"
        try:
            if set(os.listdir(fd)) - {PACKING_MARKER}:
                _write_reason(fd, reason)  # again: on a disk that was full, it fits only now
                return (
                    f"left its marker {marker!r}, saying why it failed, beside what {dest!r} held before, and "
                    "removed the rest it wrote (the next pack there replaces the marker)"
                )
            os.unlink(PACKING_MARKER, dir_fd=fd)
            if self._created:
                os.rmdir(dest)  # empty by now; rmdir follows no link
                return f"removed {dest!r}, which it had created"
        except OSError as e:
            return f"could not remove {marker!r} or {dest!r} ({e.strerror}): remove them"
        return f"removed what it wrote in {dest!r}"

    def block_sizes(self, n_blocks: int) -> np.ndarray:
        return np.array(
            [os.stat(block_name(b), dir_fd=self.blocks_fd, follow_symlinks=False).st_size for b in range(n_blocks)],
            dtype=np.uint64,
        )

    def commit(self, metadata: dict) -> None:
        commit(self.dir_fd, self.blocks_fd, metadata, self.fsync)


def _exists_at(dir_fd: int, name: str) -> bool:
    try:
        os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
    except FileNotFoundError:
        return False
    return True


def _write_reason(dir_fd: int, reason: str) -> None:
    """Write why the pack failed into its marker, one line (for ``blockfs info``); quietly not if it cannot."""
    line = (reason.replace("\n", " ") + "\n").encode("utf-8", "backslashreplace")
    try:
        fd = os.open(
            PACKING_MARKER, os.O_WRONLY | os.O_TRUNC | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=dir_fd
        )
    except OSError:
        return
    try:
        os.write(fd, line)
    except OSError:
        pass
    finally:
        os.close(fd)


def write_index(
    dir_fd: int, index: PreparedIndex, plan_pos: np.ndarray, sums: Sums, block_sizes: np.ndarray, fsync: bool = True
) -> None:
    """Write the index, now that the file CRCs and digests (``sums``, in plan order), the blocks' digests
    and the block sizes are known.

    ``plan_pos`` maps each entry of the index to its position in the plan (-1: not a file).  Called once
    every block is on disk: an index never names a block that a crash could lose.  The index's columns
    are dropped as they are written (the packer's last use of them).
    """

    def file_crcs() -> np.ndarray:  # made at its turn: one column fewer held meanwhile
        is_file = plan_pos >= 0
        crcs = np.zeros(len(plan_pos), dtype=np.uint32)
        crcs[is_file] = sums.crcs[plan_pos[is_file]]
        sums.crcs = np.zeros(0, dtype=np.uint32)  # read once: not held while the paths are sorted
        return crcs

    def file_digests() -> Iterator[np.ndarray]:  # in index order, a piece at a time, once the columns are gone
        with sums.file_digest_rows() as stored:
            for start in range(0, len(plan_pos), DIGEST_PIECE):
                at = plan_pos[index.order[start : start + DIGEST_PIECE]]
                rows = np.zeros((len(at), dg.DIGEST_SIZE), dtype=np.uint8)
                rows[at >= 0] = stored(at[at >= 0])
                yield rows

    block_chunks = np.zeros(len(sums.chunk_digests) + 1, dtype=np.uint64)
    np.cumsum([len(c) // dg.DIGEST_SIZE for c in sums.chunk_digests], out=block_chunks[1:])
    digests = (file_digests, _rows(sums.head_digests), _rows(sums.chunk_digests), block_chunks)
    with created_at(dir_fd, INDEX_NAME, mode=FILE_MODE, sync=fsync) as f:
        index.write(f, file_crcs, block_sizes, digests, release=True)


def _rows(digests: list[bytes]) -> np.ndarray:
    """32-byte digests as the rows of a (n, 32) array."""
    return np.frombuffer(b"".join(digests), dtype=np.uint8).reshape(-1, dg.DIGEST_SIZE)


def index_counts(cols: IndexColumns) -> dict:
    """What ``blockfs.json`` counts of the entries, taken before the index is written (which drops them)."""
    kinds = np.asarray(cols.kind)
    return {
        "n_entries": int(kinds.size),
        "n_files": int(np.sum(kinds == KIND_FILE)),
        "n_dirs": int(np.sum(kinds == KIND_DIR)),
        "n_symlinks": int(np.sum(kinds == KIND_SYMLINK)),
        "file_bytes": int(np.asarray(cols.size)[kinds == KIND_FILE].sum()),
    }


def index_digest(dir_fd: int) -> bytes:
    """The digest of the index just written, hashed from a copy kept for this machine's next mount of it
    (:mod:`blockfs.core.kept_copies`: that mount then neither copies nor hashes it), or from the file where
    no copy is kept (``BLOCKFS_KEPT_INDEX_COPIES=0``, no copy directory, no room)."""
    copies = IndexCopies.default()
    if copies is not None:
        fd = read_at(dir_fd, INDEX_NAME)
        try:
            digest = copies.seed(fd)
        finally:
            os.close(fd)
        if digest is not None:
            return digest
    return file_digest(read_at(dir_fd, INDEX_NAME))


def record_checks(directory: str, metadata: dict) -> bool:
    """Run a mount's checks of the index just packed on the copy of it kept here (:func:`index_digest`)
    and record that it passed (:mod:`blockfs.core.checked_indexes`): the first mount of it on this machine
    then neither copies, hashes nor checks it, as a re-mount.  The checks read the copy through a map whose
    touched pages are dropped after each piece (the page cache keeps them), so the pack's resident memory
    holds a few pieces of the index, never all of it (1.5 GB at ten million files).  Nothing where no copy
    is kept or no record is (``BLOCKFS_KEPT_INDEX_COPIES=0``, ``BLOCKFS_CHECKED_DIR=``): the first mount
    checks.  An index that fails is said in a warning (a mount checks it again and refuses it); the pack
    stands.  True where a record was made."""
    checked, copies = CheckedIndexes.default(), IndexCopies.default()
    digest = metadata["index"]["blake3"]
    if checked is None or copies is None or checked.has(digest):
        return False
    held = copies.kept(digest)  # the copy as kept: its identity vouches for the digest, as at a mount
    if held is None:
        return False
    try:
        failure = _failed_checks(held, f"index {os.path.join(directory, INDEX_NAME)}", metadata["n_blocks"])
    finally:
        try:
            held.close()
        except BufferError:  # a view of it still held somewhere: the map goes with the last one
            pass
    if failure is not None:
        log.warning("the index just packed fails a mount's checks (a mount will refuse it): %s", failure)
        return False
    checked.add(digest)
    return True


def _failed_checks(held: mmap.mmap, where: str, n_blocks: int) -> str | None:
    """Why the index mapped in ``held`` fails a mount's checks (its pages dropped from the map after each
    piece), or None where it passes.  A message, not the error: its traceback would hold views of the map."""
    try:
        toc_len, version = check_header(held, where)
        arrays = array_views(held, read_toc(held, toc_len, where, version))
        check_contents(arrays, where, n_blocks, lambda: held.madvise(mmap.MADV_DONTNEED))
    except BlockfsError as e:
        return str(e)
    return None


def dataset_metadata(
    dir_fd: int,
    counts: dict,
    block_sizes: np.ndarray,
    classes: list[str] | None,
    labels: str,
    options: PackOptions,
) -> dict:
    """What ``blockfs.json`` says of the dataset: counts, classes, the index's CRC and digest (the link
    to every digest in it) and how it was packed.  Nothing of when or where it was packed: the same files
    packed with the same options give the same ``blockfs.json``, so the same name."""
    return {
        "format": "blockfs",
        "format_version": METADATA_VERSION,
        "n_entries": counts["n_entries"],
        "n_files": counts["n_files"],
        "n_dirs": counts["n_dirs"],
        "n_symlinks": counts["n_symlinks"],
        "n_blocks": len(block_sizes),
        "file_bytes": counts["file_bytes"],
        "block_bytes": int(block_sizes.sum()),
        "classes": classes,
        "index": {
            "file": INDEX_NAME,
            "crc32": fmt.file_crc(read_at(dir_fd, INDEX_NAME)),
            "blake3": index_digest(dir_fd).hex(),
        },
        "pack": {
            "block_size": options.block_bytes,
            "files_per_block": options.files_per_block,
            "labels": labels if labels in ("dirname", "none", "source") else "csv",
            "order": options.order,
            "seed": options.seed,
            "follow_symlinks": options.follow_symlinks,
        },
    }


def write_metadata_file(dir_fd: int, metadata: dict, fsync: bool) -> None:
    """Write ``blockfs.json`` under its own name, through a temporary one (fsynced if ``fsync``)."""
    write_file_at(dir_fd, METADATA_NAME, (metadata_bytes(metadata),), mode=FILE_MODE, sync=fsync)


def commit(dir_fd: int, blocks_fd: int, metadata: dict, fsync: bool) -> None:
    """Rename ``blockfs.json`` into place and remove the marker: from here on DEST opens as a dataset.

    With ``fsync``, the blocks directory is made durable first, and DEST itself after.
    """
    if fsync:
        os.fsync(blocks_fd)
    write_metadata_file(dir_fd, metadata, fsync)
    os.unlink(PACKING_MARKER, dir_fd=dir_fd)
    if fsync:
        os.fsync(dir_fd)
