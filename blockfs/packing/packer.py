"""``blockfs pack``: list the source, plan the blocks (pure), write them in parallel, then the index and
the metadata, atomically.

:func:`pack` is the sequence of steps and nothing else; each step is carried out by a module with one job,
so each can be read, tested and changed alone:

- :mod:`.sources` / :mod:`.containers` / :mod:`.remote_source`: what is packed (listing, and reading a
  file's bytes);
- :mod:`.labels`: each file's class, decided before DEST is touched;
- :mod:`.destination`: DEST's life — claimed with a marker, the index written once the blocks are on disk,
  ``blockfs.json`` renamed into place last as the commit (crash safety is argued there);
  :mod:`.remote_destination` the same for a URL, through a staging directory, block by block;
- :mod:`.plan`: which bytes go into which block, and the index columns that follow (pure);
- :mod:`.parallel`: the workers (forked processes or threads) and progress;
- :mod:`.writer`: one block file, its CRCs and its durability.
"""

from __future__ import annotations

import dataclasses
import errno
import logging
import os
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from ..core.digest import name_of
from ..core.heap import give_back
from ..core.metadata import metadata_bytes
from ..errors import PackError
from ..sizes import format_size
from ..storage.urls import check_scheme, is_remote
from .containers import open_source, spool_dir_for
from .destination import (
    Destination,
    LocalDestination,
    dataset_metadata,
    index_counts,
    record_checks,
    write_index,
)
from .entry_table import EntryTable, collect
from .labels import assign_labels
from .options import PackOptions, PackResult, ProgressCallback
from .parallel import Sums, write_blocks
from .plan import BlockPlan, make_plan, plan_blocks
from .remote_destination import RemoteDestination
from .remote_source import RemotePrefixSource
from .sources import DirectorySource, Source
from .writer import BlockWriter

__all__ = ["PackOptions", "PackResult", "ProgressCallback", "pack", "plan_blocks"]

log = logging.getLogger(__name__)

LISTING_STEP = 10_000  # entries between two listing(n) calls
NAME_MAX = 255  # bytes in one path component: what Linux filesystems allow, so what unpack can write


def pack(
    src: str | os.PathLike | Source,
    dest: str | os.PathLike,
    options: PackOptions | None = None,
    *,
    storage_options: dict | None = None,
    progress: ProgressCallback | None = None,
    listing: Callable[[int], None] | None = None,
    **overrides: Any,
) -> PackResult:
    """Pack a directory tree, a tar, a RecordIO file or WebDataset shards (picked by
    :func:`~blockfs.packing.containers.open_source`), the objects under a URL prefix (``s3://bucket/raw/``)
    or any :class:`~blockfs.packing.sources.Source`, into ``dest``: a directory, or a URL (``s3://``,
    ``gs://``, ``az://``) the blocks are uploaded to as they are written.

    ``storage_options`` reach a URL (``endpoint``, ``region``, keys; fsspec's spellings work), as for
    :func:`~blockfs.open_dataset`.  ``overrides`` are :class:`PackOptions` fields, for
    ``pack(src, dest, block_size=1 << 20)``.
    ``listing(n)``: entries found so far while the source is listed (every 10,000, and the total last);
    ``progress``: see :data:`ProgressCallback`, while the blocks are written.
    """
    started = time.monotonic()
    options = dataclasses.replace(options or PackOptions(), **overrides)
    target = _destination(os.fspath(dest), options, storage_options)
    claimed, free, needed = False, None, None
    try:
        source = _open(src, target.directory, options, storage_options)
        entries, too_long = _names_that_fit(
            collect(source.entries(), listing, LISTING_STEP), source, options.skip_unreadable
        )
        labels, classes = _choose_labels(source, entries, options.labels)  # before DEST is touched
        claimed = True  # from the first step of the claim on, a failure has something to remove
        target.claim(_source_location(source), options.force)
        free = target.free_bytes()
        plan = make_plan(entries, options)
        needed = int(plan.sizes.sum())  # what a full disk's error says
        del entries  # the plan holds them
        give_back()
        sums, tree, unreadable = _write_blocks(source, target, plan, options, progress)
        cols, plan_pos, index = plan.index_without_crcs(unreadable, tree)
        unreadable |= too_long
        block_sizes = target.block_sizes(plan.n_blocks)
        del plan, tree  # from here the index's columns are the only copy: written and dropped one by one
        counts = index_counts(cols)
        del cols
        give_back()
        try:
            write_index(target.dir_fd, index, plan_pos, sums, block_sizes, target.fsync)
        finally:
            sums.close()
        del index, plan_pos, sums
        give_back()
        metadata = dataset_metadata(target.dir_fd, counts, block_sizes, classes, labels, options)
        described = source.write_metadata(target.directory, target.fsync)  # containers: side files (labels.json)
        if described is not None:
            metadata["source"] = described
        target.commit(metadata)
    except BaseException as e:
        if not claimed:
            raise
        raise _failed(e, target, needed, free)  # noqa: B904 - _failed chains e itself
    finally:
        target.close()
    if isinstance(target, LocalDestination):
        give_back()
        record_checks(target.directory, metadata)  # the first mount here then skips them
    result = _report(source, target.display, metadata, unreadable, time.monotonic() - started)
    return dataclasses.replace(result, digest=name_of(metadata_bytes(metadata)))


def _failed(error: BaseException, target: Destination, needed: int | None, free: int | None) -> BaseException:
    """The exception a failed pack raises once what it wrote is removed (:meth:`Destination.abandon`): a
    full disk in one line naming DEST, the bytes needed and free, and the fix; Ctrl-C saying what it
    left; anything else as it was, with what is left appended when something is."""
    full = _out_of_space(error)
    if isinstance(error, KeyboardInterrupt):
        reason = "interrupted (Ctrl-C)"
    elif full is not None:
        reason = f"no space left on the device ({full.filename or target.directory})"
    else:
        reason = str(error) or type(error).__name__
    done = target.abandon(reason)
    if isinstance(error, KeyboardInterrupt):
        return KeyboardInterrupt(done) if done else error
    if full is not None:
        if target.directory == target.display:
            need = (
                f"the pack needs about {format_size(needed)}" if needed is not None else "the pack could not even start"
            )
            had = f", and {format_size(free)} was free there when it started" if free is not None else ""
            message = (
                f"no space left on the device of {target.display!r}: {need}{had}; "
                + (f"{done}; " if done else "")
                + "free some space there or pack to a disk with room"
            )
        else:  # a URL: the staging directory filled up, which holds only a few blocks at a time
            message = (
                f"no space left in the staging directory {target.directory!r} of the pack to "
                f"{target.display}: pass --staging DIR on a disk with room for a few blocks"
            )
        packed = PackError(message)
        packed.__cause__ = error
        return packed
    if done and not done.startswith("removed"):  # something is left: the error says what
        error.args = (f"{error}; the failed pack {done}",) if isinstance(error, PackError) else error.args
    return error


def _out_of_space(error: BaseException) -> OSError | None:
    """The ENOSPC or EDQUOT error behind ``error`` (itself, or what it was raised from), or None."""
    seen: BaseException | None = error
    for _ in range(8):
        if seen is None:
            return None
        if isinstance(seen, OSError) and seen.errno in (errno.ENOSPC, errno.EDQUOT):
            return seen
        seen = seen.__cause__ or seen.__context__
    return None


def _destination(dest: str, options: PackOptions, storage_options: dict | None) -> Destination:
    """A local directory, written in place; or a URL, written to a staging directory and uploaded."""
    check_scheme(dest)
    if is_remote(dest):
        return RemoteDestination(dest, storage_options, options.staging)
    return LocalDestination(dest, options.fsync)


def _open(src: object, dest: str, options: PackOptions, storage_options: dict | None) -> Source:
    """``src`` itself if it is a :class:`Source`; the objects under it if it is a URL; else the directory,
    tar, RecordIO file or WebDataset shards it names, chosen by the bytes."""
    if isinstance(src, Source):
        return src
    if isinstance(src, str):
        check_scheme(src)
    if isinstance(src, str) and is_remote(src):
        return RemotePrefixSource(src, storage_options)
    if isinstance(src, (str, bytes, os.PathLike, list, tuple)):
        return open_source(
            src,
            follow_symlinks=options.follow_symlinks,
            skip_damaged=options.skip_damaged,
            spool_dir=spool_dir_for(dest),
            workers=options.workers,
        )
    raise TypeError(
        f"cannot pack a {type(src).__name__}: pass a path, a URL, a list of WebDataset shard paths, or a source "
        "whose class subclasses blockfs.packing.sources.Source (implementing entries() and read_into())"
    )


def _names_that_fit(entries: EntryTable, source: Source, skip: bool) -> tuple[EntryTable, frozenset]:
    """``entries`` without those whose path has a name over :data:`NAME_MAX` bytes (an object key or an
    archive member may; no filesystem can hold it, so unpack could not write it): an error naming the
    first, or with --skip-unreadable, left out (with everything beneath) and returned to be listed."""
    paths = entries.paths
    maybe = np.flatnonzero(paths.lengths() > NAME_MAX).tolist()  # only a path this long can hold such a name
    long = [paths[i] for i in maybe if any(len(part) > NAME_MAX for part in paths[i].split(b"/"))]
    if not long:
        return entries, frozenset()
    if not skip:
        name = next(part for part in long[0].split(b"/") if len(part) > NAME_MAX)
        raise PackError(
            f"{os.fsdecode(long[0])!r} in {source.description!r} has a name of {len(name)} bytes, over the "
            f"{NAME_MAX} a filesystem allows (unpack could not write it): rename it, or pass --skip-unreadable "
            "to leave it out"
        )
    cut = tuple(p + b"/" for p in long)
    left = frozenset(long)
    kept = [
        i
        for start, chunk in paths.chunks()
        for i, p in enumerate(chunk, start)
        if p not in left and not p.startswith(cut)
    ]
    return entries.keep(np.asarray(kept, dtype=np.int64)), left


def _choose_labels(source: Source, entries: EntryTable, labels: str) -> tuple[str, list[str] | None]:
    """Label every file (a bad labels file fails here, before DEST is touched); return the labelling
    used and the class names (None when the labels are the source's own, or none)."""
    if labels == "dirname" and source.provides_labels:
        labels = "source"  # RecordIO headers, WebDataset .cls: the container's own labels win by default
    if not labels or labels == "source":
        return labels, None
    return labels, assign_labels(entries, labels)


def _source_location(source: Source) -> str | None:
    """The directory or URL prefix a source reads from, which DEST must not be inside; None for a file."""
    if isinstance(source, DirectorySource):
        return os.fsdecode(source.root)
    if isinstance(source, RemotePrefixSource):
        return source.url
    return None


def _write_blocks(
    source: Source, target: Destination, plan: BlockPlan, options: PackOptions, progress: ProgressCallback | None
) -> tuple[Sums, tuple[np.ndarray, np.ndarray], frozenset[bytes]]:
    """Write every block and wait until they are where they last (on disk, or uploaded); return the file
    CRCs and digests in plan order with the blocks' digests, the entries' order in the index (made
    meanwhile), and the paths found unreadable (skipped with --skip-unreadable)."""
    with (
        source.reading(plan.stored),
        BlockWriter(source, target.blocks_fd, fsync=target.fsync, skip_unreadable=options.skip_unreadable) as writer,
    ):
        workers = options.workers or os.cpu_count() or 1
        sums, tree = write_blocks(
            writer,
            plan,
            workers,
            progress,
            meanwhile=plan.tree_order,
            on_written=target.block_written,
            spill_dir=target.directory,
        )
        writer.wait_durable()
    target.blocks_done()
    return sums, tree, frozenset(writer.unreadable)


def _report(source: Source, dest: str, metadata: dict, unreadable: frozenset[bytes], seconds: float) -> PackResult:
    """Warn once for each kind of thing left out, and sum the pack up."""
    special = [os.fsdecode(p) for p in source.skipped()]
    if special:
        log.warning("skipped %d sockets, FIFOs or device files: %s", len(special), ", ".join(special))
    damaged = source.damaged()
    if damaged:
        log.warning("skipped %d damaged parts of the source:\n  %s", len(damaged), "\n  ".join(damaged))
    skipped_unreadable = sorted(map(os.fsdecode, unreadable))
    if skipped_unreadable:
        log.warning("skipped %d unreadable files: %s", len(skipped_unreadable), ", ".join(skipped_unreadable))
    return PackResult(
        dest=dest,
        n_files=metadata["n_files"],
        n_dirs=metadata["n_dirs"],
        n_symlinks=metadata["n_symlinks"],
        n_blocks=metadata["n_blocks"],
        file_bytes=metadata["file_bytes"],
        skipped_special=special,
        skipped_unreadable=skipped_unreadable,
        seconds=seconds,
        skipped_damaged=damaged,
    )
