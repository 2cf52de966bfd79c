"""Whole-dataset checks and summaries: ``blockfs verify`` and ``blockfs info``."""

from __future__ import annotations

import errno
import os
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import numpy as np

from ..errors import BlockfsError, CorruptBlockError
from ..storage.remote import RangeNotServedError, RemoteError
from . import digest as dg
from . import format as fmt
from .dataset import PackedDataset
from .index import KIND_FILE


@dataclass
class Problem:
    """One damaged thing: a block (with the files it takes down) or the index."""

    what: str
    message: str
    files: list[str] = field(default_factory=list)


def verify(ds: PackedDataset, on_block: Callable[[int], object] | None = None) -> list[Problem]:
    """Check every checksum: each block's header and data, and each file's CRC and size against the index.

    The index itself was checked when ``ds`` was opened (its CRC against ``blockfs.json``, its schema and
    contents), so a dataset whose index is damaged does not get this far.  ``on_block(block)`` is called
    after each block (for a progress bar).  Returns the problems found; an empty list means every byte is
    as packed.
    """
    problems: list[Problem] = []
    for b in range(ds.n_blocks):
        problem = _verify_block(ds, b)
        if problem is not None:
            problems.append(problem)
        if on_block is not None:
            on_block(b)
    return problems


def _verify_block(ds: PackedDataset, b: int) -> Problem | None:
    a = ds.index.arrays
    off, members = ds.layout
    entries = members[int(off[b]) : int(off[b + 1])].astype(np.int64)
    try:  # the header against its own file, then the data against the header
        head = ds.store.unchecked_header(b)
        data = bytearray(head.data_size)
        try:
            file_crcs = ds.store.read_data_into(b, head, data)
        except CorruptBlockError as err:
            if not ds.has_digests or err.block != b or "data checksum" not in str(err):
                raise
            return Problem(f"block {b}", str(err), _names(ds, _differing(ds, b, head, data, entries) or entries))
        if ds.has_digests:  # the digests proved the data; the index's CRCs are compared with it too
            file_crcs = fmt.file_crcs_of(head, data)
    except BlockfsError as err:  # the block as a whole is lost: every file in it
        cause = _store_cannot_answer(err)
        if cause is not None:
            raise cause from None
        return Problem(f"block {b}", str(err), _names(ds, entries))
    slots = a["slot"][entries]
    bad = entries[(file_crcs[slots] != a["crc"][entries]) | (head.sizes[slots] != a["size"][entries])]
    if bad.size:  # intact, but some files are not the index's: name those
        return Problem(f"block {b}", f"{ds.store.where(b)}: {bad.size} files differ from the index", _names(ds, bad))
    try:  # every file matches; what is left to prove is the rest of the header (number, labels)
        ds.store.adopt_header(b, head)
    except BlockfsError as err:
        return Problem(f"block {b}", str(err), _names(ds, entries))
    return None


def _store_cannot_answer(err: BaseException) -> RemoteError | None:
    """The store's error behind a failed block read when it is about the store, whatever the block holds: a
    server that cannot serve byte ranges, or credentials refused.  Then verify stops with that error
    instead of calling every block damaged."""
    cause: BaseException | None = err
    while cause is not None:
        if isinstance(cause, RangeNotServedError) or (isinstance(cause, RemoteError) and cause.errno == errno.EACCES):
            return cause
        cause = cause.__cause__ or cause.__context__
    return None


def _differing(ds: PackedDataset, b: int, head, data: bytearray, entries: np.ndarray) -> list[int]:
    """The files of block ``b`` whose bytes in ``data`` are not their index digest's (to name them)."""
    view = memoryview(data)
    a = ds.index.arrays
    bad = []
    for e in entries.tolist():
        slot = int(a["slot"][e])
        start, size = int(head.offsets[slot]), int(head.sizes[slot])
        if dg.digest(view[start : start + size]) != a["file_digest"][e].tobytes():
            bad.append(e)
    return bad


def _names(ds: PackedDataset, entries: Iterable[int]) -> list[str]:
    return [os.fsdecode(ds.path_of(int(e))) for e in entries]


def summary(ds: PackedDataset) -> dict:
    """Counts, bytes, block-size spread and label counts, as plain data."""
    meta = ds.metadata
    a = ds.index.arrays
    sizes = a["block_sizes"].astype(np.int64)
    files = a["kind"] == KIND_FILE
    labels, counts = np.unique(a["label"][files], return_counts=True)
    classes = ds.classes
    n_files = int(files.sum())
    header_bytes = int(sizes.sum()) - int(a["size"][files][_stored(a, files)].sum()) if n_files else 0
    return {
        "path": ds.location,
        "digest": ds.digest,
        "digests": ds.has_digests,
        "files": n_files,
        "directories": meta["n_dirs"],
        "symlinks": meta["n_symlinks"],
        "file_bytes": meta["file_bytes"],
        "blocks": ds.n_blocks,
        "block_bytes": int(sizes.sum()),
        "header_bytes": header_bytes,
        "block_size_min": int(sizes.min()) if sizes.size else 0,
        "block_size_median": int(np.median(sizes)) if sizes.size else 0,
        "block_size_max": int(sizes.max()) if sizes.size else 0,
        "files_per_block_median": int(np.median(a["block_counts"])) if sizes.size else 0,
        "labels": {
            (classes[int(lab)] if classes and lab >= 0 else str(int(lab))): int(c)
            for lab, c in zip(labels, counts, strict=True)
        },
        "pack": meta["pack"],
    }


def _stored(a: dict, files: np.ndarray) -> np.ndarray:
    """Mask over files of those that hold their own bytes (hard links share their first path's)."""
    ids = np.flatnonzero(files)
    return a["ino"][ids] == ids + 1
