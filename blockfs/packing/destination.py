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

import os
import shutil
from abc import ABC, abstractmethod
from typing import Iterator

import numpy as np

from ..core import digest as dg
from ..core import format as fmt
from ..core.digest import file_digest
from ..core.metadata import METADATA_VERSION, metadata_bytes
from ..core.format import BLOCKS_DIR, INDEX_NAME, METADATA_NAME, PACKING_MARKER, block_path
from ..core.index import KIND_DIR, KIND_FILE, KIND_SYMLINK, IndexColumns, PreparedIndex
from ..errors import PackError
from ..storage.location import is_remote
from .options import PackOptions
from .parallel import Sums

DIGEST_PIECE = 1 << 14  # file digests gathered at a time: the pages of the spilled ones a piece touches

def prepare_dest(src: str | None, dest: str, force: bool) -> None:
    """Refuse a destination that would lose data, then mark it as a pack in progress."""
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
    # The marker goes down before anything is removed, so no moment exists where DEST looks complete.
    open(os.path.join(dest, PACKING_MARKER), "wb").close()
    for name in (METADATA_NAME, INDEX_NAME):
        if os.path.exists(os.path.join(dest, name)):
            os.unlink(os.path.join(dest, name))
    shutil.rmtree(os.path.join(dest, BLOCKS_DIR), ignore_errors=True)
    os.makedirs(os.path.join(dest, BLOCKS_DIR))


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class Destination(ABC):
    """Where a pack goes, as the packer sees it: the steps of :func:`blockfs.pack` that touch DEST.

    ``directory`` is the local directory the block writers, the index and a source's side files are
    written into; ``display`` names DEST in messages and in the result; ``fsync`` says whether files
    written there must be flushed (False where they are a staging copy: the upload is what lasts).
    """

    directory: str
    display: str
    fsync: bool

    @abstractmethod
    def claim(self, source_location: str | None, force: bool) -> None:
        """Refuse a DEST that would lose data, then mark it as a pack in progress.  ``source_location``:
        the directory or URL the source reads from (DEST must not be inside it), or None."""

    def block_written(self, block: int) -> None:
        """Block ``block``'s file in ``directory`` is complete (called in the packer's thread)."""

    def blocks_done(self) -> None:
        """Every block is written: return once they are all where they last (an upload's error is raised here)."""

    @abstractmethod
    def block_sizes(self, n_blocks: int) -> np.ndarray:
        """The size of every block file, for the index."""

    @abstractmethod
    def commit(self, metadata: dict) -> None:
        """Make DEST a dataset: whatever is still to go there first, ``blockfs.json`` last."""

    def close(self) -> None:
        """Release what the pack used, after a commit or a failure."""


class LocalDestination(Destination):
    """A local directory, written in place and committed by renaming ``blockfs.json`` into place."""

    def __init__(self, dest: str, fsync: bool) -> None:
        self.directory = self.display = dest
        self.fsync = fsync

    def claim(self, source_location: str | None, force: bool) -> None:
        inside = source_location if source_location is not None and not is_remote(source_location) else None
        prepare_dest(inside, self.directory, force)

    def block_sizes(self, n_blocks: int) -> np.ndarray:
        return np.array([os.path.getsize(block_path(self.directory, b)) for b in range(n_blocks)], dtype=np.uint64)

    def commit(self, metadata: dict) -> None:
        commit(self.directory, metadata, self.fsync)


def write_index(dest: str, index: PreparedIndex, plan_pos: np.ndarray, sums: Sums, block_sizes: np.ndarray) -> None:
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
    tmp_index = os.path.join(dest, INDEX_NAME + ".tmp")
    index.write(tmp_index, file_crcs, block_sizes, digests, release=True)
    os.replace(tmp_index, os.path.join(dest, INDEX_NAME))


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


def dataset_metadata(
    dest: str, counts: dict, block_sizes: np.ndarray, classes: list[str] | None, labels: str,
    options: PackOptions,
) -> dict:
    """What ``blockfs.json`` says of the dataset: counts, classes, the index's CRC and digest (the link
    to every digest in it) and how it was packed.  Nothing of when or where it was packed: the same files
    packed with the same options give the same ``blockfs.json``, so the same name."""
    index_path = os.path.join(dest, INDEX_NAME)
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
        "index": {"file": INDEX_NAME, "crc32": fmt.file_crc(index_path), "blake3": file_digest(index_path).hex()},
        "pack": {
            "block_size": options.block_bytes,
            "files_per_block": options.files_per_block,
            "labels": labels if labels in ("dirname", "none", "source") else "csv",
            "order": options.order,
            "seed": options.seed,
            "follow_symlinks": options.follow_symlinks,
        },
    }


def write_metadata_file(dest: str, metadata: dict, fsync: bool) -> None:
    """Write ``blockfs.json`` under its own name, through a temporary one (fsynced if ``fsync``)."""
    tmp_meta = os.path.join(dest, METADATA_NAME + ".tmp")
    with open(tmp_meta, "wb") as f:
        f.write(metadata_bytes(metadata))
        if fsync:
            f.flush()
            os.fsync(f.fileno())
    os.replace(tmp_meta, os.path.join(dest, METADATA_NAME))


def commit(dest: str, metadata: dict, fsync: bool) -> None:
    """Rename ``blockfs.json`` into place and remove the marker: from here on ``dest`` opens as a dataset.

    With ``fsync``, the blocks directory is made durable first, and ``dest`` itself after.
    """
    if fsync:
        _fsync_dir(os.path.join(dest, BLOCKS_DIR))
    write_metadata_file(dest, metadata, fsync)
    os.unlink(os.path.join(dest, PACKING_MARKER))
    if fsync:
        _fsync_dir(dest)
