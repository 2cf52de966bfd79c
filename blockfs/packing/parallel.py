"""Running the block writers side by side: forked worker processes where the source allows it, threads
otherwise, with memory bounded, progress reported and the CRCs and digests gathered in plan order.

Apart from :mod:`.writer` (what one block is) because this is about scheduling only: which pool, how many
blocks in flight, what a dead worker means, and what the calling process does meanwhile (with processes
it is idle, so it prepares the index then; see :func:`write_blocks`).
"""

from __future__ import annotations

import mmap
import os
import tempfile
from collections.abc import Callable, Iterator
from concurrent.futures import FIRST_COMPLETED, BrokenExecutor, Executor, Future, ThreadPoolExecutor, wait
from contextlib import contextmanager
from typing import BinaryIO, TypeVar

import numpy as np

from ..core import digest as dg
from ..errors import PackError
from .forking import forked_pool
from .options import ProgressCallback
from .plan import BlockPlan
from .writer import BlockWriter, WrittenBlock

T = TypeVar("T")


def write_blocks(
    writer: BlockWriter,
    plan: BlockPlan,
    workers: int,
    progress: ProgressCallback | None,
    meanwhile: Callable[[], T],
    on_written: Callable[[int], None] | None = None,
    spill_dir: str | None = None,
) -> tuple[Sums, T]:
    """Write every block of ``plan`` with ``workers`` processes or threads; return the CRC and digest of
    each stored file, in plan order, with each block's digests (:class:`Sums`), and what ``meanwhile()``
    returned.  ``on_written(block)`` is called in this
    thread as each block's file is complete (a remote destination uploads it).  ``spill_dir``: where
    the file digests wait for the index, in an unnamed file (None: in memory).

    Forked processes where the source allows it (see :mod:`blockfs.packing.forking`), threads otherwise.
    With processes, ``meanwhile`` runs on a thread of this otherwise idle process while they write; with
    threads it runs after them (on the GIL it would only slow them down).
    """
    workers = max(1, min(workers, plan.n_blocks))
    pool = None
    if workers > 1 and writer.source.forkable:
        pool = forked_pool(workers, _start_forked_writer, (writer, plan))
    tally = _Tally(plan, progress, on_written, spill_dir)
    if pool is None:
        threads = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="blockfs-pack")
        _run(threads, workers, plan.n_blocks, lambda b: threads.submit(writer.write, b, plan.files_of(b)), tally.add)
        return tally, meanwhile()
    # Created now, its thread only at the first submit: after the workers are forked.
    side = ThreadPoolExecutor(max_workers=1, thread_name_prefix="blockfs-meanwhile")
    early: list[Future] = []

    def submit(block: int) -> Future[tuple[WrittenBlock, list[bytes]]]:
        written = pool.submit(_write_forked, block)
        if not early:  # the workers are forked by now: no thread of ours is copied into them
            early.append(side.submit(meanwhile))
        return written

    def finished(block: int, result: tuple[WrittenBlock, list[bytes]]) -> None:
        written, unreadable = result
        writer.written_elsewhere(block, unreadable)
        tally.add(block, written)

    try:
        _run(pool, workers, plan.n_blocks, submit, finished)
    finally:
        side.shutdown(wait=True)
    return tally, early[0].result()


class Sums:
    """The CRCs and digests of the blocks written so far: per stored file in plan order, per block.

    The file digests (32 bytes a file) go to an unnamed temporary file beside the blocks as they come,
    not into memory: at ten million files they are 320 MB, needed only once the index is written."""

    crcs: np.ndarray  # u4, per stored file
    n_stored: int
    head_digests: list[bytes]
    chunk_digests: list[bytes]  # per block: its chunks' digests, back to back
    _digests: BinaryIO | None
    _digest_rows: np.ndarray | None

    @contextmanager
    def file_digest_rows(self) -> Iterator[Callable[[np.ndarray], np.ndarray]]:
        """A function giving the digests of the stored files at plan positions ``at`` (rows of 32 bytes).
        The spilled digests are read through a map whose pages are let go after each call, so that only
        one call's pieces are ever resident, however the positions are scattered."""
        if self._digests is None:
            assert self._digest_rows is not None
            yield self._digest_rows.__getitem__
            return
        size = self.n_stored * dg.DIGEST_SIZE
        if size == 0:
            yield lambda at: np.zeros((len(at), dg.DIGEST_SIZE), dtype=np.uint8)
            return
        with mmap.mmap(self._digests.fileno(), size, prot=mmap.PROT_READ) as mm:
            reader = _MappedRows(mm)
            try:
                yield reader.take
            finally:
                reader.release()

    def close(self) -> None:
        """Let the spilled digests go (the unnamed file is freed with its descriptor)."""
        if self._digests is not None:
            self._digests.close()


class _MappedRows:
    """Rows of 32 bytes in a map, gathered by position; the map's pages dropped from memory after each."""

    def __init__(self, mm: mmap.mmap) -> None:
        self._mm = mm
        self._rows: np.ndarray | None = np.frombuffer(mm, dtype=np.uint8).reshape(-1, dg.DIGEST_SIZE)

    def take(self, at: np.ndarray) -> np.ndarray:
        assert self._rows is not None
        out = self._rows[at]  # a copy
        self._mm.madvise(mmap.MADV_DONTNEED)  # a shared file map: the pages stay cached, not resident here
        return out

    def release(self) -> None:
        self._rows = None  # the map cannot close while an array views it


class _Tally(Sums):
    """The sums of the blocks written so far, in plan order, and the progress reports as blocks finish."""

    def __init__(
        self,
        plan: BlockPlan,
        progress: ProgressCallback | None,
        on_written: Callable[[int], None] | None = None,
        spill_dir: str | None = None,
    ) -> None:
        n = len(plan.stored_at)
        self.crcs = np.zeros(n, dtype=np.uint32)
        self.n_stored = n
        self._digests = tempfile.TemporaryFile(dir=spill_dir, buffering=0) if spill_dir is not None else None
        self._digest_rows = np.zeros((n, dg.DIGEST_SIZE), dtype=np.uint8) if spill_dir is None else None
        self.head_digests = [b""] * plan.n_blocks
        self.chunk_digests = [b""] * plan.n_blocks
        self._on_written = on_written
        self._bounds = plan.bounds
        self._block_bytes = np.add.reduceat(plan.sizes, plan.bounds[:-1]).tolist() if n else []
        self._total_bytes = sum(self._block_bytes)
        self._progress = progress
        self._files = self._bytes = 0
        if progress is not None:
            progress(0, 0, n, self._total_bytes)

    def add(self, block: int, written: WrittenBlock) -> None:
        lo, hi = int(self._bounds[block]), int(self._bounds[block + 1])
        self.crcs[lo:hi] = written.crcs
        rows = b"".join(written.file_digests)
        if self._digests is not None:
            os.pwrite(self._digests.fileno(), rows, lo * dg.DIGEST_SIZE)
        else:
            assert self._digest_rows is not None
            self._digest_rows[lo:hi] = np.frombuffer(rows, dtype=np.uint8).reshape(-1, dg.DIGEST_SIZE)
        self.head_digests[block] = written.head_digest
        self.chunk_digests[block] = written.chunk_digests
        self._files += hi - lo
        self._bytes += self._block_bytes[block]
        if self._progress is not None:
            self._progress(self._files, self._bytes, self.n_stored, self._total_bytes)
        if self._on_written is not None:
            self._on_written(block)


def _run(
    pool: Executor,
    workers: int,
    n_blocks: int,
    submit: Callable[[int], Future[T]],
    finished: Callable[[int, T], None],
) -> None:
    """Submit blocks 0..n_blocks-1 in order, at most two in flight per worker, and hand each result to
    ``finished`` as it comes; shut ``pool`` down whatever happens."""
    try:
        pending: dict[Future[T], int] = {}
        for b in range(n_blocks):
            pending[submit(b)] = b
            # Bound memory: at most two blocks in flight per worker; drain at the end.
            while pending and (len(pending) >= 2 * workers or b == n_blocks - 1):
                done, _ = wait(pending, return_when=FIRST_COMPLETED)
                for fut in done:
                    block = pending.pop(fut)
                    finished(block, fut.result())
    except BrokenExecutor as e:  # a worker process died
        raise PackError(f"a pack worker process died ({e}); was it killed for memory? retry with --workers 1") from e
    finally:
        # On an error, wait for the blocks being written (so nothing writes into dest after we return),
        # and drop the rest.
        pool.shutdown(wait=True, cancel_futures=True)


# The forked worker's job, inherited from the parent at fork: (its writer, the plan).
_forked_job: tuple[BlockWriter, BlockPlan] | None = None


def _start_forked_writer(writer: BlockWriter, plan: BlockPlan) -> None:
    global _forked_job
    _forked_job = (writer.for_child(), plan)


def _write_forked(block: int) -> tuple[WrittenBlock, list[bytes]]:
    """In a worker process: write ``block``; return its sums and the files found unreadable."""
    assert _forked_job is not None
    writer, plan = _forked_job
    seen = len(writer.unreadable)
    written = writer.write(block, plan.files_of(block))
    return written, writer.unreadable[seen:]
