"""``BlockCache``: whole blocks held in memory under one byte budget, in front of a :class:`BlockStore`.

What it promises (the mount's serving rules):

* A block the policy admits is read whole, in one sequential read, into anonymous memory
  (``mmap(-1, n)``, ``mlock``-ed where the process may; never a file-backed map, which the kernel would
  reclaim like page cache), verified by its CRC; every later read of a file in it is a memory copy.
* Concurrent misses of one block read it once (single flight: the first reader loads, the others wait
  on its future).  The bytes are reserved with the policy *before* the read, so two loads can never both
  count on the same room.
* A block the policy would refuse (cache-once with a full budget, ``none``) is never read whole to serve
  one file: the file alone is read and verified by its own CRC.  A small "current file" buffer holds the
  file (or, for huge files, a window of it) so a file read in 128 KiB FUSE pieces costs one storage read.
* When reads move through blocks in order, the next blocks are loaded ahead on background threads.
* A block whose data checksum fails is never cached; its files are then read one by one, each verified
  by its own CRC, so only the files whose bytes are damaged fail.
* A cached block's memory is a sealed memfd where the process has descriptors to spare, so that
  :meth:`BlockCache.share` can hand a loader on this machine a descriptor of it: the loader then maps the
  verified block and copies its files out with no FUSE round trip per file (:mod:`blockfs.serve.share`).  The
  seals forbid writing through any new descriptor or map, and growing or shrinking the memory, so a
  loader can read the cache but never change it.  Only policies that never evict share: a loader's map
  keeps a block's pages alive, which must not hold memory the budget has given back.

The cache holds blocks only.  Retained small files (the memory plan's other half) sit in a store of their
own (:mod:`blockfs.serve.retain`), consulted before the blocks and funded from the same budget by the plan.
"""

from __future__ import annotations

import ctypes
import errno
import fcntl
import logging
import mmap
import os
import resource
import threading
import time
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Callable, Iterator

from ..core import format as fmt
from ..errors import CorruptBlockError, MissingBlockError
from .policies import DEFAULT_POLICY, make_policy
from ..core.store import BlockStore

log = logging.getLogger(__name__)

READAHEAD_BLOCKS = 2  # blocks loaded ahead once reads move through blocks in order
SEQUENTIAL_STEPS = 2  # consecutive next-block steps that count as "in order"
LOADER_THREADS = 2  # background read-ahead loaders
FILE_BUFFER_BYTES = 16 << 20  # the current-file buffer (outside the budget: a small fixed overhead)
# Files in it at once: one per reader mid-file, with room to spare.  Without a count, 16 MiB of small
# files read alone would act as an LRU cache of the last files and hit across epochs.
FILE_BUFFER_FILES = 8
FILE_WINDOW = 4 << 20  # piece of a file too big for that buffer read at a time
VERIFY_PIECE = 16 << 20  # streaming verification of a big file in a narrow block
EPOCHS_KEPT = 64  # per-epoch hit rates kept in the statistics
FDS_KEPT_FREE = 512  # descriptors left to libfuse and the rest when blocks are held in memfds
FDS_PER_MEMFD = 2
# F_SEAL_FUTURE_WRITE (Linux 5.1; not in Python's fcntl): no new writable map or write(), while the
# cache's own map, made before the seal, still takes the block's bytes once.
F_SEAL_FUTURE_WRITE = 0x0010
SHARE_SEALS = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL


class NotShared(Exception):
    """Why :meth:`BlockCache.share` hands out no descriptor for a block (the caller reads it otherwise)."""


class _CachedBlock:
    """One block's data section in memory, with its file table."""

    __slots__ = ("buf", "fd", "offsets", "sizes", "nbytes", "locked")

    def __init__(self, buf: mmap.mmap | bytes, fd: int | None, head: fmt.BlockHeader, locked: bool) -> None:
        self.buf = buf
        self.fd = fd  # the sealed memfd behind ``buf``, or None (not shareable)
        self.nbytes = head.data_size
        self.locked = locked
        # memoryviews index to Python ints several times faster than numpy arrays do.
        self.offsets = memoryview(head.offsets)
        self.sizes = memoryview(head.sizes)

    def read(self, slot: int, offset: int, size: int) -> bytes:
        start, length = self.offsets[slot], self.sizes[slot]
        if size < 0 or offset + size > length:
            size = max(0, length - offset)
        start += offset
        return self.buf[start : start + size]


class _MemoryLock:
    """``mlock`` of cache buffers while the process may; one warning the first time it may not."""

    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled
        self.locked_bytes = 0
        self.failure: str | None = None
        self._mlock = None
        if enabled:
            try:
                self._mlock = ctypes.CDLL(None, use_errno=True).mlock
                self._mlock.argtypes = (ctypes.c_void_p, ctypes.c_size_t)
            except (OSError, AttributeError) as e:
                self._give_up(f"mlock is unavailable ({e})")

    def lock(self, buf: mmap.mmap | bytes) -> bool:
        """Try to lock ``buf`` in memory; whether it is locked."""
        if self._mlock is None or self.failure is not None or not isinstance(buf, mmap.mmap):
            return False
        # from_buffer exports the map only for this statement; the map can still be freed later.
        address = ctypes.addressof(ctypes.c_char.from_buffer(buf))
        if self._mlock(address, len(buf)) == 0:
            self.locked_bytes += len(buf)
            return True
        code = ctypes.get_errno()
        soft, _hard = resource.getrlimit(resource.RLIMIT_MEMLOCK)
        limit = "unlimited" if soft == resource.RLIM_INFINITY else f"{soft >> 20} MiB"
        self._give_up(
            f"mlock failed ({errno.errorcode.get(code, code)}; RLIMIT_MEMLOCK is {limit}, "
            f"{self.locked_bytes >> 20} MiB locked so far)"
        )
        return False

    def unlocked(self, nbytes: int) -> None:
        self.locked_bytes = max(0, self.locked_bytes - nbytes)

    def _give_up(self, why: str) -> None:
        self.failure = why
        log.warning(
            "cannot pin the block cache in memory: %s; cached blocks stay in anonymous memory, which is "
            "only paged out under memory pressure when there is swap (raise 'ulimit -l' or grant "
            "CAP_IPC_LOCK to pin them)",
            why,
        )


class _Memfds:
    """Memfds for cached blocks while the process has descriptors to spare (beyond that, plain anonymous maps).

    Each costs two descriptors: the one kept to share and the copy Python's ``mmap`` keeps (before 3.13).
    """

    def __init__(self, enabled: bool) -> None:
        soft, _hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        self._left = max(0, soft - FDS_KEPT_FREE) if enabled and hasattr(os, "memfd_create") else 0
        self._lock = threading.Lock()

    def create(self, block: int, size: int) -> int | None:
        """A new memfd of ``size`` bytes, or None when none is to be had (the block is then not shared)."""
        with self._lock:
            if self._left < FDS_PER_MEMFD:
                return None
            self._left -= FDS_PER_MEMFD
        try:
            fd = os.memfd_create(f"blockfs-block-{block}", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        except OSError as e:
            log.debug("no memfd for block %d (%s): it will not be shared", block, e)
            self._give_back()
            return None
        try:
            os.ftruncate(fd, size)
        except OSError:
            self.close(fd)
            raise
        return fd

    def seal(self, fd: int) -> int | None:
        """Seal ``fd`` against writes and resizing once its bytes are in; None (fd closed) where it cannot be."""
        try:
            fcntl.fcntl(fd, fcntl.F_ADD_SEALS, SHARE_SEALS | F_SEAL_FUTURE_WRITE)
        except OSError as e:  # a kernel before 5.1: an unsealed block is kept, not shared
            log.debug("cannot seal a block's memfd (%s): it will not be shared", e)
            self.close(fd)
            return None
        return fd

    def close(self, fd: int | None) -> None:
        if fd is not None:
            os.close(fd)
            self._give_back()

    def _give_back(self) -> None:
        with self._lock:
            self._left += FDS_PER_MEMFD


class BlockCache:
    """Serves ``read_file`` from whole cached blocks, or file by file from the store.

    ``budget_bytes`` bounds the bytes of cached block data; ``policy`` is a name from
    :data:`blockfs.serve.policies.POLICIES`.  ``n_files`` (the dataset's file count) lets the statistics cut
    reads into epochs.  Thread-safe; call :meth:`close` to stop the loaders.
    """

    def __init__(
        self,
        store: BlockStore,
        budget_bytes: int,
        policy: str = DEFAULT_POLICY,
        *,
        readahead: int = READAHEAD_BLOCKS,
        loaders: int = LOADER_THREADS,
        lock_memory: bool = True,
        n_files: int = 0,
        share: bool = True,
    ) -> None:
        self._store = store
        self._policy = make_policy(policy, budget_bytes)
        self._touch = self._policy.name == "lru"  # only recency-ordered policies care about hits
        self._readahead = max(0, readahead)
        # Background loaders for read-ahead and prefill; their threads start on first use.
        self._loaders = max(1, loaders)
        self._pool = ThreadPoolExecutor(self._loaders, thread_name_prefix="blockfs-load")
        self._memlock = _MemoryLock(lock_memory)
        # Only a policy that never evicts shares: a loader's map would keep an evicted block's pages alive.
        self.shares = share and not self._policy.evicts and self._policy.name != "none"
        self._memfds = _Memfds(self.shares)
        self._lock = threading.Lock()
        self._blocks: dict[int, _CachedBlock] = {}
        self._loading: dict[int, Future] = {}
        self._damaged: set[int] = set()  # data checksum failed: never cached, files served one by one
        self._last_block = -2
        self._run = 0
        self._files = _FileBuffer(FILE_BUFFER_BYTES, FILE_BUFFER_FILES)
        self._verified: OrderedDict[tuple[int, int], None] = OrderedDict()  # big narrow files checked once
        self._n_files = n_files
        self._started = time.time()
        self._closed = False
        self._announced = 0  # generation of the latest prefetch announcement
        # statistics (updated under self._lock)
        self._c = dict.fromkeys(
            (
                "reads", "bytes_served", "files_served", "file_hits", "file_misses", "block_hits",
                "block_misses", "block_loads", "readahead_loads", "prefill_loads", "load_waits",
                "block_bytes_read", "file_reads", "file_bytes_read", "buffer_hits", "damaged_blocks",
                "load_errors", "announcements", "prefetch_loads", "blocks_shared",
            ),
            0,
        )  # fmt: skip
        self._epochs: list[list[int]] = [[0, 0]]  # [files served, file hits] per epoch

    # --- the reader interface ---------------------------------------------------------------------
    def read_file(self, block: int, slot: int, crc: int, offset: int = 0, size: int = -1) -> bytes:
        """Bytes ``[offset, offset + size)`` of one file (all of it by default), verified."""
        cached = self._blocks.get(block)
        if cached is not None:
            data = cached.read(slot, offset, size)
            with self._lock:
                self._count(block, offset, len(data), hit=True)
            return data
        return self._read_miss(block, slot, crc, offset, size)

    def note_hit(self, offset: int, nbytes: int) -> None:
        """Count a read served from memory outside the blocks (a retained file) in the same statistics."""
        with self._lock:
            c = self._c
            c["reads"] += 1
            c["bytes_served"] += nbytes
            c["block_hits"] += 1
            if offset == 0:
                c["files_served"] += 1
                c["file_hits"] += 1
                self._epoch_file(hit=True)

    def _epoch_file(self, hit: bool) -> None:
        epoch = self._epochs[-1]
        if self._n_files and epoch[0] >= self._n_files:
            epoch = [0, 0]
            self._epochs.append(epoch)
            del self._epochs[:-EPOCHS_KEPT]
        epoch[0] += 1
        epoch[1] += hit

    def _read_miss(self, block: int, slot: int, crc: int, offset: int, size: int) -> bytes:
        head = self._store.header(block)  # small; raises for a missing, truncated or damaged header
        with self._lock:
            cached = self._blocks.get(block)
            if cached is None:
                future, mine = self._claim(block, head)
                self._count(block, offset, 0, hit=False)
        if cached is not None:
            data = cached.read(slot, offset, size)
            with self._lock:
                self._count(block, offset, len(data), hit=True)
            return data
        if future is not None:
            try:
                data = self._await(block, head, future, mine).read(slot, offset, size)
            except CorruptBlockError:
                pass  # the block is damaged: fall through and read (and verify) this file alone
            else:
                with self._lock:
                    self._c["bytes_served"] += len(data)
                return data
        data = self._read_alone(block, slot, crc, offset, size, head)
        with self._lock:
            self._c["bytes_served"] += len(data)
        return data

    def _count(self, block: int, offset: int, nbytes: int, hit: bool) -> None:
        """Statistics for one read (under the lock); also where read-ahead notices reads in block order."""
        c = self._c
        c["reads"] += 1
        c["bytes_served"] += nbytes
        if hit:
            c["block_hits"] += 1
            if self._touch and block in self._policy:
                self._policy.touch(block)
        else:
            c["block_misses"] += 1
        if offset == 0:  # a file's first read: count it once as a file served
            c["files_served"] += 1
            c["file_hits" if hit else "file_misses"] += 1
            self._epoch_file(hit)
        if block != self._last_block:
            # Two steps forward in a row mean reads in block order (one step is often chance).
            self._run = self._run + 1 if block == self._last_block + 1 else 0
            if self._run >= SEQUENTIAL_STEPS:
                self._read_ahead_locked(block)
            self._last_block = block

    def share(self, block: int) -> int:
        """A new descriptor of the sealed memory holding ``block``'s verified data (the caller closes it).

        Loads the block first, as a read's miss would, if the policy admits it.  Raises :class:`NotShared`
        saying why when there is none to give: the policy evicts (or caches nothing), the budget is full,
        the block is damaged or missing, or its memory could not be made shareable.
        """
        if not self.shares:
            raise NotShared(f"the {self._policy.name} policy does not share blocks")
        cached = self._blocks.get(block)
        if cached is None:
            try:
                cached = self._cached_or_loaded(block)
            except (CorruptBlockError, MissingBlockError) as e:
                raise NotShared(str(e)) from None
        with self._lock:
            fd = cached.fd
            if fd is None:
                raise NotShared(f"block {block} is held in memory that cannot be shared")
            self._c["blocks_shared"] += 1
            return os.dup(fd)  # under the lock: a drop cannot close fd in between

    def _cached_or_loaded(self, block: int) -> _CachedBlock:
        """``block`` in the cache, loaded (or waited for) now if need be; NotShared if it is not admitted."""
        head = self._store.header(block)  # small; raises for a missing, truncated or damaged header
        with self._lock:
            cached = self._blocks.get(block)
            if cached is not None:
                return cached
            future, mine = self._claim(block, head)
        if future is None:
            why = "damaged (its data checksum failed or it is truncated)" if block in self._damaged else (
                "not admitted: the cache budget is full")  # fmt: skip
            raise NotShared(f"block {block} is {why}")
        return self._await(block, head, future, mine)

    # --- loading whole blocks ---------------------------------------------------------------------
    def _await(self, block: int, head: fmt.BlockHeader, future: Future, mine: bool) -> _CachedBlock:
        """The claimed block: loaded here if this caller claimed it, else waited for (single flight)."""
        if mine:
            self._load(block, head, future)
        else:
            with self._lock:
                self._c["load_waits"] += 1
        return future.result()

    def _claim(self, block: int, head: fmt.BlockHeader) -> tuple[Future | None, bool]:
        """Under the lock: the load to wait for (and whether this caller must run it), or None."""
        future = self._loading.get(block)
        if future is not None:
            return future, False
        if block in self._damaged or self._closed:
            return None, False
        evicted = self._policy.admit(block, head.data_size)  # reserves the room before any byte is read
        if evicted is None:
            return None, False
        for victim in evicted:
            self._drop(self._blocks.pop(victim, None))
        future = Future()
        self._loading[block] = future
        return future, True

    def _drop(self, cached: _CachedBlock | None) -> None:
        # Readers still holding the block keep it alive; the map goes when the last reference does.
        if cached is not None:
            if cached.locked:
                self._memlock.unlocked(cached.nbytes)
            self._memfds.close(cached.fd)
            cached.fd = None

    def _load(self, block: int, head: fmt.BlockHeader, future: Future) -> None:
        """Read a claimed block whole, verify it, and publish it (or the error) to every waiter."""
        try:
            buf, fd = self._read_block(block, head)
        except BaseException as e:
            with self._lock:
                self._loading.pop(block, None)
                self._policy.discard(block)
                self._c["load_errors"] += 1
                if isinstance(e, CorruptBlockError) and block not in self._damaged:
                    self._damaged.add(block)
                    self._c["damaged_blocks"] += 1
            log.debug("loading block %d failed: %s", block, e)
            future.set_exception(e)
            return
        cached = _CachedBlock(buf, fd, head, self._memlock.lock(buf))
        with self._lock:
            self._loading.pop(block, None)
            self._c["block_loads"] += 1
            self._c["block_bytes_read"] += head.data_size
            if block in self._policy:  # not evicted (LRU/FIFO) while it was loading
                self._blocks[block] = cached
            else:
                self._drop(cached)
        future.set_result(cached)

    def _read_block(self, block: int, head: fmt.BlockHeader) -> tuple[mmap.mmap | bytes, int | None]:
        """The data section in fresh anonymous memory, in one sequential read, checked by its CRC; and the
        sealed memfd behind that memory (None where the block is not to be shared)."""
        size = head.data_size
        if size == 0:
            return b"", None
        where = self._store.where(block)
        memfd = self._memfds.create(block, size)
        try:
            buf = mmap.mmap(-1 if memfd is None else memfd, size)
            try:
                fd = os.open(self._store.block_paths[block], os.O_RDONLY | os.O_CLOEXEC)
            except OSError as e:
                raise MissingBlockError(f"{where}: cannot open: {e.strerror}", block=block) from e
            try:
                view = memoryview(buf)
                done = 0
                while done < size:
                    try:
                        n = os.preadv(fd, [view[done:]], head.data_start + done)
                    except OSError as e:
                        raise MissingBlockError(f"{where}: read failed: {e.strerror}", block=block) from e
                    if n == 0:
                        raise CorruptBlockError(
                            f"{where}: truncated: data ends after {done} of {size} bytes", block=block
                        )
                    done += n
                view.release()
            finally:
                os.close(fd)
            fmt.check_data(head, buf, where)
        except BaseException:
            self._memfds.close(memfd)
            raise
        return buf, None if memfd is None else self._memfds.seal(memfd)

    def start_prefill(self) -> None:
        """Load blocks in the background, in order, while they fit without evicting anything.

        The blocks a cache-once budget will hold are then read sequentially at disk speed while the first
        epoch runs, instead of each on its first miss; a miss of a block not loaded yet loads it at once
        in the reading thread, so prefill never delays a read.
        """
        if not self._closed:
            self._pool.submit(self._prefill)

    def preload(self, on_block: Callable[[int], None] | None = None) -> None:
        """What :meth:`start_prefill` does, now, in this thread (``on_block(bytes)`` after each block)."""
        self._prefill(on_block)

    def _prefill(self, on_block: Callable[[int], None] | None = None) -> None:
        for block in range(self._store.n_blocks):
            if self._closed:
                return
            with self._lock:
                if block in self._policy or block in self._loading or block in self._damaged:
                    continue
                if self._policy.used_bytes >= self._policy.budget_bytes:
                    return
            try:
                head = self._store.header(block)
            except CorruptBlockError:
                continue  # reported when a file of it is read
            with self._lock:
                if block in self._policy or block in self._loading or self._closed:
                    continue
                room = self._policy.budget_bytes - self._policy.used_bytes
                if head.data_size > room or not self._policy.would_admit(block, head.data_size):
                    continue  # a smaller block further on may still fit
                future, _mine = self._claim(block, head)
                self._c["prefill_loads"] += 1
            self._load(block, head, future)
            if on_block is not None:
                on_block(head.data_size)

    def prefetch(self, blocks: list[int]) -> None:
        """Load ``blocks`` in the background, in this order, as far as they fit without evicting anything
        (a loader's announcement of what it reads next); a new call replaces the one before."""
        with self._lock:
            if self._closed:
                return
            self._announced += 1
            self._c["announcements"] += 1
            generation = self._announced
        # Every loader thread takes the next block from the one list: reading a block and checking its
        # CRC overlap across threads (both release the GIL), and the blocks still arrive in order.
        queue = iter(list(blocks))
        for _ in range(self._loaders):
            self._pool.submit(self._prefetch, queue, generation)

    def _prefetch(self, blocks: Iterator[int], generation: int) -> None:
        while True:
            with self._lock:
                if self._closed or self._announced != generation:
                    return
                if self._policy.used_bytes >= self._policy.budget_bytes:
                    return  # full: nothing more is admitted without evicting
                block = next(blocks, None)  # under the lock: the threads share the iterator
            if block is None:
                return
            self._read_ahead(block, announced=True)

    def _read_ahead_locked(self, block: int) -> None:
        if self._closed:
            return
        for ahead in range(block + 1, min(block + 1 + self._readahead, self._store.n_blocks)):
            if ahead not in self._blocks and ahead not in self._loading and ahead not in self._damaged:
                self._pool.submit(self._read_ahead, ahead)

    def _read_ahead(self, block: int, *, announced: bool = False) -> None:
        try:
            head = self._store.header(block)
        except CorruptBlockError:
            return  # reported when a file of it is read
        with self._lock:
            if block in self._policy or block in self._loading or block in self._damaged or self._closed:
                return  # cached, loading, or known bad
            if announced and head.data_size > self._policy.budget_bytes - self._policy.used_bytes:
                return  # an announcement fills free room only: it must not evict a block being read
            if not self._policy.would_admit(block, head.data_size):
                return  # a guess that does not fit is not a refusal of a read
            future, _mine = self._claim(block, head)  # new, so ours to load
            self._c["prefetch_loads" if announced else "readahead_loads"] += 1
        self._load(block, head, future)

    # --- files read alone -------------------------------------------------------------------------
    def _read_alone(self, block: int, slot: int, crc: int, offset: int, size: int, head: fmt.BlockHeader) -> bytes:
        """One file (or a range of it) from storage, verified, without reading its whole block."""
        length = int(head.sizes[slot])
        if size < 0 or offset + size > length:
            size = max(0, length - offset)
        if offset == 0 and size == length:  # the whole file in one request: no need to buffer it
            return self._store_read(block, slot, crc, 0, length)
        key = (block, slot)
        data = self._files.get(key, offset, size)
        if data is not None:
            with self._lock:
                self._c["buffer_hits"] += 1
            return data
        if length <= FILE_BUFFER_BYTES:
            start, window = 0, self._store_read(block, slot, crc, 0, length)
        else:
            start = offset - offset % FILE_WINDOW
            span = min(max(FILE_WINDOW, offset + size - start), length - start)
            if head.chunk_crcs is not None:  # WIDE: the store verifies the chunks it reads
                window = self._store_read(block, slot, crc, start, span)
            else:
                window = self._read_verified_range(block, slot, crc, head, start, span)
        self._files.put(key, start, window)
        return window[offset - start : offset - start + size]

    def _store_read(self, block: int, slot: int, crc: int, offset: int, size: int) -> bytes:
        data = self._store.read_file(block, slot, crc, offset, size)
        with self._lock:
            self._c["file_reads"] += 1
            self._c["file_bytes_read"] += len(data)
        return data

    def _read_verified_range(
        self, block: int, slot: int, crc: int, head: fmt.BlockHeader, start: int, span: int
    ) -> bytes:
        """A range of a big file in a narrow block (one CRC for the whole file): verify it once, streaming."""
        key = (block, slot)
        where = self._store.where(block)
        base = head.data_start + int(head.offsets[slot])
        length = int(head.sizes[slot])
        try:
            fd = os.open(self._store.block_paths[block], os.O_RDONLY | os.O_CLOEXEC)
        except OSError as e:
            raise MissingBlockError(f"{where}: cannot open: {e.strerror}", block=block) from e
        try:
            with self._lock:
                verified = key in self._verified
            if not verified:
                check = 0
                for pos in range(0, length, VERIFY_PIECE):
                    piece = os.pread(fd, min(VERIFY_PIECE, length - pos), base + pos)
                    check = fmt.crc32(piece, check)
                    with self._lock:
                        self._c["file_bytes_read"] += len(piece)
                if check != crc:
                    raise CorruptBlockError(
                        f"{where}: slot {slot}: checksum mismatch (expected 0x{crc:08x}, got 0x{check:08x}); "
                        "run 'blockfs verify'",
                        block=block,
                    )
                with self._lock:
                    self._verified[key] = None
                    while len(self._verified) > 64:
                        self._verified.popitem(last=False)
            data = os.pread(fd, span, base + start)
        except OSError as e:
            raise MissingBlockError(f"{where}: read failed: {e.strerror}", block=block) from e
        finally:
            os.close(fd)
        with self._lock:
            self._c["file_reads"] += 1
            self._c["file_bytes_read"] += len(data)
        if len(data) != span:
            raise CorruptBlockError(f"{where}: truncated inside slot {slot}", block=block)
        return data

    # --- statistics and life cycle ----------------------------------------------------------------
    @property
    def policy_name(self) -> str:
        return self._policy.name

    @property
    def budget_bytes(self) -> int:
        return self._policy.budget_bytes

    def stats(self) -> dict[str, Any]:
        """Counters, cache fill and per-epoch hit rates, as plain JSON-ready values."""
        with self._lock:
            c = dict(self._c)
            policy = self._policy.stats()
            epochs = [
                {"files": files, "hits": hits, "hit_rate": hits / files if files else 0.0}
                for files, hits in self._epochs
            ]
            cached_blocks = len(self._blocks)
            loading = len(self._loading)
        c["bytes_from_storage"] = c["block_bytes_read"] + c["file_bytes_read"]
        c["file_hit_rate"] = c["file_hits"] / c["files_served"] if c["files_served"] else 0.0
        c["block_hit_rate"] = c["block_hits"] / c["reads"] if c["reads"] else 0.0
        return {
            "counters": c,
            "cache": {
                "policy": self._policy.name,
                **policy,
                "cached_blocks": cached_blocks,
                "loading_blocks": loading,
                "fill": policy["used_bytes"] / policy["budget_bytes"] if policy["budget_bytes"] else 0.0,
                "locked_bytes": self._memlock.locked_bytes,
                "mlock": "off" if not self._memlock.enabled else (self._memlock.failure or "locked"),
                "file_buffer_bytes": self._files.nbytes,
            },
            "epochs": epochs,
            "uptime_s": time.time() - self._started,
        }

    def close(self) -> None:
        """Stop the loaders and drop every cached block."""
        with self._lock:
            self._closed = True
        self._pool.shutdown(wait=True, cancel_futures=True)
        with self._lock:
            for cached in self._blocks.values():
                self._drop(cached)
            self._blocks.clear()
        self._files.clear()


class _FileBuffer:
    """The current-file buffer: recently read windows of files, at most ``capacity`` bytes and ``files``."""

    def __init__(self, capacity: int, files: int) -> None:
        self._capacity = capacity
        self._max_files = files
        self._items: OrderedDict[tuple[int, int], tuple[int, bytes]] = OrderedDict()
        self._lock = threading.Lock()
        self.nbytes = 0

    def get(self, key: tuple[int, int], offset: int, size: int) -> bytes | None:
        with self._lock:
            item = self._items.get(key)
            if item is None:
                return None
            start, data = item
            if not (start <= offset and offset + size <= start + len(data)):
                return None
            self._items.move_to_end(key)
        return data[offset - start : offset - start + size]

    def put(self, key: tuple[int, int], start: int, data: bytes) -> None:
        with self._lock:
            old = self._items.pop(key, None)
            if old is not None:
                self.nbytes -= len(old[1])
            self._items[key] = (start, data)
            self.nbytes += len(data)
            while len(self._items) > 1 and (self.nbytes > self._capacity or len(self._items) > self._max_files):
                _key, (_start, dropped) = self._items.popitem(last=False)
                self.nbytes -= len(dropped)

    def clear(self) -> None:
        with self._lock:
            self._items.clear()
            self.nbytes = 0
