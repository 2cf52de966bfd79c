"""``blockfs pack``: plan blocks (pure), write them in parallel, then the index and metadata, atomically.

Crash safety: a marker file ``.blockfs-packing`` exists from the first byte written until the metadata
file ``blockfs.json`` is renamed into place, and the metadata is what makes a directory open as a dataset.
A killed pack therefore never leaves anything that opens as complete, and a rerun recognises the marker
and starts over without ``--force``.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import shutil
import threading
import time
from concurrent.futures import FIRST_COMPLETED, BrokenExecutor, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from typing import Callable, TypeVar

import numpy as np

from ..core import format as fmt
from ..core.format import BLOCKS_DIR, INDEX_NAME, METADATA_NAME, PACKING_MARKER, block_path
from ..errors import PackError, SourceError
from .forking import forked_pool
from .writeback import start_writeback
from ..core.index import KIND_DIR, KIND_FILE, KIND_SYMLINK, IndexColumns, prepare_index
from .containers import open_source, spool_dir_for
from .labels import assign_labels
from .sources import DirectorySource, Source, SourceEntry

log = logging.getLogger(__name__)

# Blocks of several files use 32-bit offsets (the seed layout); a larger file still gets a block of its own.
MAX_BLOCK_SIZE = fmt.NARROW_LIMIT
STREAM_PIECE = 16 << 20  # huge files are copied in pieces of this size
# Small files are gathered into a buffer of this size (or of the largest file, if larger) and written
# out each time it fills: a reused buffer stays in memory, where a fresh block-sized one would cost a
# page fault every 4 KiB.
GATHER_SIZE = 8 << 20

# (files done, bytes done, files in all, bytes in all); called from the calling thread, first with zeros
ProgressCallback = Callable[[int, int, int, int], None]
T = TypeVar("T")
LISTING_STEP = 10_000  # entries between two listing(n) calls


@dataclass(frozen=True)
class PackOptions:
    """How to pack.  Every field has the CLI flag of the same name."""

    block_size: int = 64 << 20
    files_per_block: int | None = None
    labels: str = "dirname"  # "dirname", "none", "source", or the path of a CSV of path,label
    order: str = "shuffled"  # or "directory"
    seed: int = 0
    workers: int | None = None  # None: one per core
    force: bool = False
    follow_symlinks: bool = False
    skip_unreadable: bool = False
    skip_damaged: bool = False  # containers: pack around damaged records/members, listing them
    fsync: bool = True

    def __post_init__(self) -> None:
        if not 1 <= self.block_size < MAX_BLOCK_SIZE:
            raise ValueError(f"block_size must be between 1 byte and 4 GiB, got {self.block_size}")
        if self.files_per_block is not None and self.files_per_block < 1:
            raise ValueError(f"files_per_block must be positive, got {self.files_per_block}")
        if self.order not in ("shuffled", "directory"):
            raise ValueError(f"order must be 'shuffled' or 'directory', got {self.order!r}")
        if self.workers is not None and self.workers < 1:
            raise ValueError(f"workers must be positive, got {self.workers}")


@dataclass(frozen=True)
class PackResult:
    dest: str
    n_files: int
    n_dirs: int
    n_symlinks: int
    n_blocks: int
    file_bytes: int
    skipped_special: list[str]
    skipped_unreadable: list[str]
    seconds: float
    skipped_damaged: list[str] = dataclasses.field(default_factory=list)


def plan_blocks(sizes: np.ndarray, block_size: int, files_per_block: int | None = None) -> np.ndarray:
    """Cut files (in packing order) into blocks; return the boundaries, ``len == n_blocks + 1``.

    A block takes files while their total stays within ``block_size`` (and the count within
    ``files_per_block``); a file larger than ``block_size`` gets a block of its own.
    """
    sizes = np.asarray(sizes, dtype=np.int64)
    ends = np.concatenate([[0], np.cumsum(sizes)])
    bounds = [0]
    i, n = 0, len(sizes)
    while i < n:
        j = int(np.searchsorted(ends, ends[i] + block_size, side="right")) - 1
        j = max(j, i + 1)
        if files_per_block is not None:
            j = min(j, i + files_per_block)
        bounds.append(j)
        i = j
    return np.asarray(bounds, dtype=np.int64)


def _prepare_dest(src: str | None, dest: str, force: bool) -> None:
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


class _BlockWriter:
    """Writes one block at a time per thread; returns per-file CRCs.

    With fsync on, a written block is flushed by a separate thread while its writer goes on to the next
    block, so the disk's write time overlaps the reading and checksumming instead of adding to it;
    :meth:`wait_durable` returns once every block is on disk (the index is written only after that).
    """

    def __init__(self, source: Source, dest: str, options: PackOptions, flush_here: bool = True) -> None:
        self.source = source
        self.dest = dest
        self.options = options
        self._flush_here = options.fsync and flush_here  # False in a worker process: the parent flushes
        self.unreadable: list[bytes] = []
        self._lock = threading.Lock()
        self._local = threading.local()
        self._syncer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="blockfs-fsync")
        self._syncs: list[Future] = []

    def __enter__(self) -> "_BlockWriter":
        return self

    def __exit__(self, *exc: object) -> None:
        self._syncer.shutdown(wait=True, cancel_futures=True)

    def for_child(self) -> "_BlockWriter":
        """A writer for a forked worker process: it leaves fsync to this one (:meth:`written_elsewhere`)."""
        return _BlockWriter(self.source, self.dest, self.options, flush_here=False)

    def written_elsewhere(self, block: int, unreadable: list[bytes]) -> None:
        """Take over a block a worker process wrote: its unreadable files, and flushing it to disk."""
        self.unreadable.extend(unreadable)
        if self.options.fsync:
            self._sync_fd_later(os.open(block_path(self.dest, block), os.O_RDONLY | os.O_CLOEXEC))

    def _sync_later(self, f) -> None:
        """fsync ``f``'s file on the fsync thread (through a duplicate descriptor: ``f`` is about to close)."""
        if self._flush_here:
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

    def write(self, block: int, members: list[SourceEntry]) -> list[int]:
        tmp = block_path(self.dest, block) + ".tmp"
        if len(members) == 1 and members[0].size > STREAM_PIECE:
            crcs = self._write_streamed(block, members[0], tmp)
        else:
            crcs = self._write_buffered(block, members, tmp)
        os.replace(tmp, block_path(self.dest, block))
        return crcs

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
        if self.options.skip_unreadable:
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

    def _write_buffered(self, block: int, members: list[SourceEntry], tmp: str) -> list[int]:
        """Files gathered into the buffer, written each time it fills; the header last, at the front."""
        view = self._buffer(max(GATHER_SIZE, *(m.size for m in members)))
        pos = 0
        sizes, labels, crcs = [], [], []
        read_into, crc32 = self.source.read_into, fmt.crc32
        with open(tmp, "wb") as f:
            f.seek(fmt.header_size(len(members), wide=False))  # a buffered block is never WIDE
            # The hot loop of a pack of small files (about a third of a tiny-file pack's time): no
            # calls beyond the read and the CRC.
            for m in members:
                end = pos + m.size
                if end > len(view):
                    self._write_out(f, view[:pos])
                    pos, end = 0, m.size
                piece = view[pos:end]
                try:
                    n = read_into(m, piece)
                except OSError as e:
                    self._unreadable(m, e)  # raises unless --skip-unreadable
                    # Keep the slot so slot numbers stay as planned; it holds nothing.
                    crcs.append(0)
                    sizes.append(0)
                    labels.append(-1)
                    continue
                if n != m.size:
                    raise self._changed(m)
                crcs.append(crc32(piece))
                sizes.append(m.size)
                labels.append(m.label)
                pos = end
            self._write_out(f, view[:pos])
            f.seek(0)
            f.write(fmt.encode_header(block, np.array(sizes), np.array(labels), fmt.crc_of_crcs(crcs)))
            self._sync_later(f)
        return crcs

    def _write_out(self, f, data: memoryview) -> None:
        """Append ``data`` to the block file; with fsync on, its writeback starts now (see writeback.py)."""
        start = f.tell()
        f.write(data)
        if self.options.fsync:
            f.flush()
            start_writeback(f.fileno(), start, len(data))

    def _write_streamed(self, block: int, member: SourceEntry, tmp: str) -> list[int]:
        """One file larger than a block: copy it in pieces, header written last."""
        size = member.size
        wide = size >= fmt.NARROW_LIMIT
        head_len = fmt.header_size(1, wide, size)
        crc = 0
        chunk_crcs: list[int] = []
        buf = memoryview(bytearray(STREAM_PIECE))
        with open(tmp, "wb") as f:
            f.write(b"\0" * head_len)
            done = 0
            while done < size:
                piece = buf[: min(STREAM_PIECE, size - done)]
                if not self._read(member, piece, done):
                    size = done = 0
                    f.truncate(head_len)
                    break
                crc = fmt.crc32(piece, crc)
                if wide:
                    chunk_crcs.extend(int(c) for c in fmt.chunk_crcs_of(piece))
                self._write_out(f, piece)
                done += len(piece)
            header = fmt.encode_header(
                block, np.array([size]), np.array([member.label if size else -1]), fmt.crc_of_crcs([crc]),
                np.array(chunk_crcs, dtype=np.uint32) if wide else None,
            )
            if len(header) != head_len:  # the file was unreadable: rewrite as an empty block
                f.truncate(0)
            f.seek(0)
            f.write(header)
            self._sync_later(f)
        return [crc]


def pack(
    src: str | os.PathLike | Source,
    dest: str | os.PathLike,
    options: PackOptions | None = None,
    *,
    progress: ProgressCallback | None = None,
    listing: Callable[[int], None] | None = None,
    **overrides: object,
) -> PackResult:
    """Pack a directory tree, a tar, a RecordIO file or WebDataset shards (picked by
    :func:`~blockfs.packing.containers.open_source`), or any :class:`~blockfs.packing.sources.Source`, into ``dest``.

    ``overrides`` are :class:`PackOptions` fields, for ``pack(src, dest, block_size=1 << 20)``.
    ``listing(n)``: entries found so far while the source is listed (every 10,000, and the total last);
    ``progress``: see :data:`ProgressCallback`, while the blocks are written.
    """
    started = time.monotonic()
    options = dataclasses.replace(options or PackOptions(), **overrides)
    dest = os.fspath(dest)
    if hasattr(src, "entries"):
        source = src
    else:  # a directory, a tar, a RecordIO file or WebDataset shards: chosen by the bytes
        source = open_source(src, follow_symlinks=options.follow_symlinks, skip_damaged=options.skip_damaged,
                             spool_dir=spool_dir_for(dest), workers=options.workers)
    entries = _list_entries(source, listing)
    if not entries or entries[0].path != b"":
        entries.insert(0, SourceEntry(b"", KIND_DIR, 0o40755, 0))
    files = [e for e in entries if e.kind == KIND_FILE]
    labels = options.labels
    if labels == "dirname" and getattr(source, "provides_labels", False):
        labels = "source"  # RecordIO headers, WebDataset .cls: the container's own labels win by default
    # Before DEST is touched: a bad labels file leaves no unfinished DEST behind.
    classes = assign_labels(files, labels, entries) if labels and labels != "source" else None
    src_dir = os.fsdecode(source.root) if isinstance(source, DirectorySource) else None
    _prepare_dest(src_dir, dest, options.force)
    primary = _primaries(entries)
    stored_at = np.flatnonzero(primary == np.arange(len(entries)))  # the entries whose bytes are stored
    if options.order == "shuffled":
        stored_at = stored_at[np.random.default_rng(options.seed).permutation(len(stored_at))]
    stored = [entries[i] for i in stored_at]
    sizes = np.fromiter((f.size for f in stored), dtype=np.int64, count=len(stored))
    bounds = plan_blocks(sizes, options.block_size, options.files_per_block)
    n_blocks = len(bounds) - 1

    block_counts = np.diff(bounds).astype(np.uint32)

    def index_without_crcs(unreadable: frozenset[bytes] = frozenset()):
        cols, plan_pos = _index_columns(entries, primary, stored_at, bounds, unreadable)
        return cols, plan_pos, prepare_index(cols, block_counts)

    with _BlockWriter(source, dest, options) as writer:
        crcs, prepared = _write_blocks(
            writer, stored, sizes, bounds, options.workers or os.cpu_count() or 1, progress, meanwhile=index_without_crcs,
        )  # fmt: skip
        writer.wait_durable()

    unreadable = set(writer.unreadable)
    if unreadable:  # rare: the entries kept are not those the index was prepared with
        prepared = index_without_crcs(frozenset(unreadable))
    cols, plan_pos, index = prepared
    is_file = plan_pos >= 0
    file_crcs = np.zeros(len(plan_pos), dtype=np.uint32)
    file_crcs[is_file] = np.asarray(crcs, dtype=np.uint32)[plan_pos[is_file]]
    block_sizes = np.array([os.path.getsize(block_path(dest, b)) for b in range(n_blocks)], dtype=np.uint64)
    tmp_index = os.path.join(dest, INDEX_NAME + ".tmp")
    index.write(tmp_index, file_crcs, block_sizes)
    os.replace(tmp_index, os.path.join(dest, INDEX_NAME))

    kinds = np.asarray(cols.kind)
    n_files = int(np.sum(kinds == KIND_FILE))
    file_bytes = int(np.asarray(cols.size)[kinds == KIND_FILE].sum())
    metadata = {
        "format": "blockfs",
        "format_version": fmt.FORMAT_VERSION,
        "n_entries": len(cols.paths),
        "n_files": n_files,
        "n_dirs": int(np.sum(kinds == KIND_DIR)),
        "n_symlinks": int(np.sum(kinds == KIND_SYMLINK)),
        "n_blocks": n_blocks,
        "file_bytes": file_bytes,
        "block_bytes": int(block_sizes.sum()),
        "classes": classes,
        "index": {"file": INDEX_NAME, "crc32": _file_crc(os.path.join(dest, INDEX_NAME))},
        "pack": {
            "block_size": options.block_size,
            "files_per_block": options.files_per_block,
            "labels": labels if labels in ("dirname", "none", "source") else "csv",
            "order": options.order,
            "seed": options.seed,
            "follow_symlinks": options.follow_symlinks,
        },
    }
    if options.fsync:
        _fsync_dir(os.path.join(dest, BLOCKS_DIR))
    if hasattr(source, "write_metadata"):  # container sources: side files (labels.json) and a description
        metadata["source"] = source.write_metadata(dest, options.fsync)
    tmp_meta = os.path.join(dest, METADATA_NAME + ".tmp")
    with open(tmp_meta, "w", encoding="utf-8") as f:
        json.dump(metadata, f, indent=2, sort_keys=True)
        f.write("\n")
        if options.fsync:
            f.flush()
            os.fsync(f.fileno())
    os.replace(tmp_meta, os.path.join(dest, METADATA_NAME))
    os.unlink(os.path.join(dest, PACKING_MARKER))
    if options.fsync:
        _fsync_dir(dest)

    special = [os.fsdecode(p) for p in source.skipped()]
    if special:
        log.warning("skipped %d sockets, FIFOs or device files: %s", len(special), ", ".join(special))
    damaged = source.damaged() if hasattr(source, "damaged") else []
    if damaged:
        log.warning("skipped %d damaged parts of the source:\n  %s", len(damaged), "\n  ".join(damaged))
    if unreadable:
        log.warning("skipped %d unreadable files: %s", len(unreadable), ", ".join(sorted(map(os.fsdecode, unreadable))))
    return PackResult(
        dest=dest,
        n_files=n_files,
        n_dirs=metadata["n_dirs"],
        n_symlinks=metadata["n_symlinks"],
        n_blocks=n_blocks,
        file_bytes=file_bytes,
        skipped_special=special,
        skipped_unreadable=sorted(map(os.fsdecode, unreadable)),
        seconds=time.monotonic() - started,
        skipped_damaged=damaged,
    )


def _list_entries(source: Source, listing: Callable[[int], None] | None) -> list[SourceEntry]:
    if listing is None:
        return list(source.entries())
    entries: list[SourceEntry] = []
    for entry in source.entries():
        entries.append(entry)
        if len(entries) % LISTING_STEP == 0:
            listing(len(entries))
    listing(len(entries))
    return entries


def _write_blocks(
    writer: _BlockWriter, stored: list[SourceEntry], sizes: np.ndarray, bounds: np.ndarray, workers: int,
    progress: ProgressCallback | None, meanwhile: Callable[[], T],
) -> tuple[list[int], T]:
    """Write every block with ``workers`` processes or threads; return the CRC of each stored file, in
    order, and what ``meanwhile()`` returned.

    Forked processes where the source allows it (see :mod:`blockfs.packing.forking`), threads otherwise.  With
    processes, ``meanwhile`` runs on a thread of this otherwise idle process while they write; with
    threads it runs after them (on the GIL it would only slow them down).
    """
    crcs = [0] * len(stored)
    block_bytes = np.add.reduceat(sizes, bounds[:-1]).tolist() if len(stored) else []
    total_bytes = sum(block_bytes)
    done_files = done_bytes = 0
    n_blocks = len(bounds) - 1
    workers = max(1, min(workers, n_blocks))
    pool = None
    if workers > 1 and getattr(writer.source, "forkable", False):
        pool = forked_pool(workers, _start_forked_writer, (writer, stored, bounds))
    forked = pool is not None
    if pool is None:
        pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="blockfs-pack")
    if progress is not None:
        progress(0, 0, len(stored), total_bytes)
    # Created now, its thread only at the first submit: after the workers are forked.
    side = ThreadPoolExecutor(max_workers=1, thread_name_prefix="blockfs-meanwhile") if forked else None
    early: Future | None = None
    try:
        pending: dict[Future, int] = {}
        for b in range(n_blocks):
            if forked:
                pending[pool.submit(_write_forked, b)] = b
                if early is None:  # the workers are forked by now: no thread of ours is copied into them
                    assert side is not None
                    early = side.submit(meanwhile)
            else:
                pending[pool.submit(writer.write, b, stored[bounds[b] : bounds[b + 1]])] = b
            # Bound memory: at most two blocks in flight per worker; drain at the end.
            while pending and (len(pending) >= 2 * workers or b == n_blocks - 1):
                finished, _ = wait(pending, return_when=FIRST_COMPLETED)
                for fut in finished:
                    done = pending.pop(fut)
                    lo, hi = int(bounds[done]), int(bounds[done + 1])
                    if forked:
                        crcs[lo:hi], unreadable = fut.result()
                        writer.written_elsewhere(done, unreadable)
                    else:
                        crcs[lo:hi] = fut.result()
                    done_files += hi - lo
                    done_bytes += block_bytes[done]
                    if progress is not None:
                        progress(done_files, done_bytes, len(stored), total_bytes)
    except BrokenExecutor as e:  # a worker process died
        raise PackError(f"a pack worker process died ({e}); was it killed for memory? retry with --workers 1") from e
    finally:
        # On an error, wait for the blocks being written (so nothing writes into dest after we return),
        # and drop the rest.
        pool.shutdown(wait=True, cancel_futures=True)
        if side is not None:
            side.shutdown(wait=True)
    return crcs, (early.result() if early is not None else meanwhile())


# The forked worker's plan, inherited from the parent at fork: (its writer, stored entries, block bounds).
_forked_job: tuple[_BlockWriter, list[SourceEntry], np.ndarray] | None = None


def _start_forked_writer(writer: _BlockWriter, stored: list[SourceEntry], bounds: np.ndarray) -> None:
    global _forked_job
    _forked_job = (writer.for_child(), stored, bounds)


def _write_forked(block: int) -> tuple[list[int], list[bytes]]:
    """In a worker process: write ``block``; return its CRCs and the files found unreadable."""
    assert _forked_job is not None
    writer, stored, bounds = _forked_job
    seen = len(writer.unreadable)
    crcs = writer.write(block, stored[bounds[block] : bounds[block + 1]])
    return crcs, writer.unreadable[seen:]


def _primaries(entries: list[SourceEntry]) -> np.ndarray:
    """For each entry, the position of the entry that stores its bytes; -1 for what is not a file.

    Hard links: the first path of each inode holds the bytes, the others point at it.
    """
    primary = [-1] * len(entries)
    first_of: dict[object, int] = {}
    for i, e in enumerate(entries):
        if e.kind == KIND_FILE:
            primary[i] = i if e.hardlink_key is None else first_of.setdefault(e.hardlink_key, i)
    return np.array(primary, dtype=np.int64)


def _index_columns(
    entries: list[SourceEntry], primary: np.ndarray, stored_at: np.ndarray, bounds: np.ndarray,
    unreadable: frozenset[bytes],
) -> tuple[IndexColumns, np.ndarray]:
    """Index columns for every entry kept (unreadable files and their hard links are dropped), and for
    each kept entry the position in the block plan of the bytes it reads (-1: not a file).

    ``stored_at[k]`` is the entry whose bytes went to position k of the block plan ``bounds``.  The CRC
    column is left zero: the packer fills it in once the blocks are written.  Built with array
    operations: this runs once per pack over every entry.
    """
    n = len(entries)
    kept = np.ones(n, dtype=bool)
    if unreadable:
        kept = np.array([p < 0 or entries[p].path not in unreadable for p in primary.tolist()], dtype=bool)
    where = np.flatnonzero(kept)
    kept_entries = [entries[i] for i in where] if len(where) < n else entries
    primary = primary[where]
    is_file = primary >= 0

    stored_pos = np.full(n, -1, dtype=np.int64)
    stored_pos[stored_at] = np.arange(len(stored_at))
    pos = stored_pos[primary[is_file]]  # each kept file's position in the plan
    block = np.full(len(where), -1, dtype=np.int32)
    slot = np.zeros(len(where), dtype=np.uint32)
    plan_pos = np.full(len(where), -1, dtype=np.int64)
    plan_pos[is_file] = pos
    file_block = np.searchsorted(np.asarray(bounds), pos, side="right") - 1
    block[is_file] = file_block
    slot[is_file] = pos - np.asarray(bounds)[file_block]

    new_pos = np.cumsum(kept) - 1  # entry position -> position among the kept entries
    aliases = np.flatnonzero(is_file & (primary != where))
    hardlink_of = dict(zip(aliases.tolist(), new_pos[primary[aliases]].tolist()))
    links = {i: e.link_target for i, e in enumerate(kept_entries) if e.kind == KIND_SYMLINK}
    count = len(kept_entries)
    cols = IndexColumns(
        paths=[e.path for e in kept_entries],
        kind=np.fromiter((e.kind for e in kept_entries), dtype=np.uint8, count=count),
        mode=np.fromiter((e.mode for e in kept_entries), dtype=np.uint32, count=count),
        mtime_ns=np.fromiter((e.mtime_ns for e in kept_entries), dtype=np.int64, count=count),
        size=np.fromiter(
            (e.size if e.kind == KIND_FILE else len(e.link_target) for e in kept_entries), dtype=np.uint64,
            count=count,
        ),
        block=block,
        slot=slot,
        label=np.fromiter((e.label if e.kind == KIND_FILE else -1 for e in kept_entries), dtype=np.int32, count=count),
        crc=np.zeros(count, dtype=np.uint32),
        link_targets=links,
        hardlink_of=hardlink_of,
    )
    return cols, plan_pos


def _file_crc(path: str) -> int:
    crc = 0
    with open(path, "rb") as f:
        while piece := f.read(16 << 20):
            crc = fmt.crc32(piece, crc)
    return crc
