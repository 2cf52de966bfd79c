"""``BlockCache``: whole blocks held in memory under one byte budget, in front of a :class:`BlockStore`.

What it promises (the mount's serving rules):

* A block the policy admits is read whole, in one sequential read, into anonymous memory
  (:mod:`blockfs.serve.cache.block_memory`: never a file-backed map, which the kernel would reclaim like page cache),
  verified by the store; every later read of a file in it is a memory copy.
* Concurrent misses of one block read it once (single flight: the first reader loads, the others wait on
  its future).  The bytes are reserved with the policy *before* the read, so two loads can never both count
  on the same room.
* A block the policy would refuse (cache-once with a full budget, ``none``) is never read whole to serve
  one file: the file alone is read and verified by its own CRC (:mod:`blockfs.serve.cache.uncached`).
* Blocks are also loaded before they are asked for (:mod:`blockfs.serve.cache.background_loads`): prefill, read-ahead
  when reads move through blocks in order, and the blocks a loader announces.
* A damaged block — its data checksum fails, its header is wrong, or it is not this dataset's, on two
  fetches (:meth:`BlockStore._checked`) — is never cached, and that is remembered for its stored version;
  its files are then read one by one, each verified by its own CRC, so only the files whose bytes are
  damaged fail.  Once the stored block is another version (replaced, restored), it is read and cached anew:
  a read of a damaged block also has its version looked at again :data:`DAMAGE_RECHECK_S` later, in the
  background, since the reads that follow a replacement may never come here (the kernel keeps the pages
  of the files just read alone).  A *failed read* (missing file, EMFILE, EIO) is not damage: it fails the
  reads waiting on it and nothing is remembered, so the next read tries again.
* A cached block's memory is a sealed memfd where the process has descriptors to spare, so that
  :meth:`BlockCache.share` can hand a loader on this machine a descriptor of it (:mod:`blockfs.serve.control.share`).
  Only policies that never evict share: a loader's map keeps a block's pages alive, which must not hold
  memory the budget has given back.

The cache holds blocks only.  Retained small files (the memory plan's other half) sit in a store of their
own (:mod:`blockfs.serve.cache.retain`), consulted before the blocks and funded from the same budget by the plan.
"""

from __future__ import annotations

import logging
import mmap
import os
import threading
import time
import weakref
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

from ...core import format as fmt
from ...core.store import BlockStore
from ...errors import BlockReadError, CorruptBlockError
from .background_loads import LOADER_THREADS, READAHEAD_BLOCKS, BackgroundLoads
from .block_memory import BlockMemory
from .cache_stats import CacheCounters
from .policies import DEFAULT_POLICY, make_policy
from .readahead import SequentialReads
from .uncached import UncachedFiles

log = logging.getLogger(__name__)

__all__ = ["READAHEAD_BLOCKS", "BlockCache", "NotShared"]

DAMAGE_RECHECK_S = 2.0  # how often a damaged block's stored version is looked at again (a stat, or a HEAD)


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
        # memoryviews (ndarray.data) index to Python ints several times faster than numpy arrays do.
        self.offsets = head.offsets.data
        self.sizes = head.sizes.data

    def view(self, slot: int) -> memoryview:
        """One file's bytes without a copy (they stay valid while the view is held)."""
        start = self.offsets[slot]
        return memoryview(self.buf)[start : start + self.sizes[slot]]

    def read(self, slot: int, offset: int, size: int) -> bytes:
        start, length = self.offsets[slot], self.sizes[slot]
        if size < 0 or offset + size > length:
            size = max(0, length - offset)
        start += offset
        return self.buf[start : start + size]


class BlockCache:
    """Serves ``read_file`` from whole cached blocks, or file by file from the store.

    ``budget_bytes`` bounds the bytes of cached block data; ``policy`` is a name from
    :data:`blockfs.serve.cache.policies.POLICIES`.  ``n_files`` (the dataset's file count) lets the statistics cut
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
        on_load: Callable[[int], None] | None = None,
        admits: Callable[[BlockCache, int, int], bool] | None = None,
    ) -> None:
        self._store = store
        self._policy = make_policy(policy, budget_bytes)
        self._touch = self._policy.name == "lru"  # only recency-ordered policies care about hits
        # Only a policy that never evicts shares: a loader's map would keep an evicted block's pages alive.
        self.shares = share and not self._policy.evicts and self._policy.name != "none"
        self._memory = BlockMemory(lock=lock_memory, memfds=self.shares)
        self._lock = threading.Lock()
        self._blocks: dict[int, _CachedBlock] = {}
        self._loading: dict[int, Future] = {}
        # Damaged blocks -> (the stored version found damaged, when it was last looked at): never cached,
        # their files served one by one, until the stored block is another version (replaced, restored).
        self._damaged: dict[int, tuple[object, float]] = {}
        self._looks: dict[int, threading.Timer] = {}  # damaged blocks read since: a look at their version due
        self.closed = False
        # Called with the block each time a block is published; the kernel adapter pushes its files into
        # the page cache from there.  Runs in the loading thread: it must only queue work.
        self._on_load = on_load
        # Asked (this cache, block, data bytes) before the policy, under the lock: False keeps the block out of
        # memory (with peers, room is kept for the blocks this node owns; serve/peers.py).  It must not block.
        self._admits = admits
        self._counters = CacheCounters(n_files)
        self._files = UncachedFiles(store, self._counters)
        self._sequence = SequentialReads()
        # A proxy, not a reference: a cycle would keep an unclosed cache's memory until the cycle collector ran.
        self._background = BackgroundLoads(
            weakref.proxy(self), store.n_blocks, readahead=readahead, threads=loaders, to_disk=store.files.keeps_copies
        )

    # --- the reader interface ---------------------------------------------------------------------
    def read_file(self, block: int, slot: int, crc: int, offset: int = 0, size: int = -1) -> bytes:
        """Bytes ``[offset, offset + size)`` of one file (all of it by default), verified."""
        cached = self._blocks.get(block)
        if cached is not None:
            data = cached.read(slot, offset, size)
            self._served(block, offset, len(data), hit=True)
            return data
        try:
            return self._read_miss(block, slot, crc, offset, size)
        except BlockReadError:
            self._counters.add("read_errors")
            raise

    def holds(self, block: int) -> bool:
        """Whether ``block`` is cached now (a read of it will not wait on storage)."""
        return block in self._blocks

    def cached(self, block: int) -> _CachedBlock | None:
        """The cached block, or None; what it holds stays valid for as long as the caller keeps it."""
        return self._blocks.get(block)

    def note_hit(self, offset: int, nbytes: int) -> None:
        """Count a read served from memory outside the blocks (a retained file) in the same statistics."""
        self._counters.read(offset, nbytes, hit=True)

    def _served(self, block: int, offset: int, nbytes: int, hit: bool) -> None:
        """Count one read; keep LRU's order; read ahead when reads move through blocks in order."""
        self._counters.read(offset, nbytes, hit)
        if hit and self._touch:
            with self._lock:
                if block in self._policy:
                    self._policy.touch(block)
        if self._sequence.step(block):
            self._background.read_ahead(block)

    def _read_miss(self, block: int, slot: int, crc: int, offset: int, size: int) -> bytes:
        if self._is_damaged(block):  # a damaged block replaced since is forgotten here, before its header is read
            self._look_again_later(block)
        head = self._header(block)  # small; raises for a missing, foreign or damaged header
        with self._lock:
            cached = self._blocks.get(block)
            if cached is None:
                future, mine = self._claim(block, head)
        if cached is not None:
            data = cached.read(slot, offset, size)
            self._served(block, offset, len(data), hit=True)
            return data
        self._served(block, offset, 0, hit=False)
        loaded: bytes | None = None
        if future is not None:
            try:
                loaded = self._await(block, head, future, mine).read(slot, offset, size)
            except CorruptBlockError:
                pass  # the block is damaged: read (and verify) this file alone
        if loaded is None:
            loaded = self._files.read(block, slot, crc, offset, size, head)
        self._counters.add("bytes_served", len(loaded))
        return loaded

    def _header(self, block: int) -> fmt.BlockHeader:
        """The store's header of ``block``; a damaged or foreign one is remembered and counted once."""
        try:
            return self._store.header(block)
        except CorruptBlockError:
            self._mark_damaged(block)
            raise

    def _mark_damaged(self, block: int) -> None:
        version = self._store.version(block)
        with self._lock:
            if block in self._damaged:
                return
            self._damaged[block] = (version, time.monotonic())
        self._counters.add("damaged_blocks")

    def _is_damaged(self, block: int) -> bool:
        """Whether ``block`` is known damaged.  At most every :data:`DAMAGE_RECHECK_S` the stored block's
        version is looked at again: a block replaced since (a file renamed over it, an object restored) is
        forgotten as damaged and read anew."""
        with self._lock:
            known = self._damaged.get(block)
        if known is None:
            return False
        version, checked = known
        now = time.monotonic()
        if now - checked < DAMAGE_RECHECK_S:
            return True
        current = self._store.version(block)
        with self._lock:
            if current is None or current == version:
                self._damaged[block] = (version, now)
                return True
            self._damaged.pop(block, None)
        self._store.renew(block)
        log.info("block %d was replaced since it was found damaged: reading it anew", block)
        return False

    def _look_again_later(self, block: int) -> None:
        """Once :data:`DAMAGE_RECHECK_S` have passed since the last look, look at damaged ``block``'s version
        again and load it if it was replaced, whether or not another read comes (at most one look due)."""
        with self._lock:
            known = self._damaged.get(block)
            if self.closed or known is None or block in self._looks:
                return
            delay = max(0.0, known[1] + DAMAGE_RECHECK_S - time.monotonic()) + 0.01
            timer = self._looks[block] = threading.Timer(delay, self._look_again, (block,))
        timer.name = f"blockfs-look-{block}"
        timer.daemon = True
        timer.start()

    def _look_again(self, block: int) -> None:
        with self._lock:
            self._looks.pop(block, None)
        try:
            if not self.closed and self.wanted(block):  # wanted() looks at the version: replaced, not damaged
                self._background.load_soon(block, "replaced_loads")
        except Exception as e:  # noqa: BLE001 - a look that failed (closing, a store gone): the next read looks
            log.debug("looking at damaged block %d again failed: %s", block, e)

    # --- sharing ----------------------------------------------------------------------------------
    def share(self, block: int) -> int:
        """A new descriptor of the sealed memory holding ``block``'s verified data (the caller closes it).

        Loads the block first, as a read's miss would, if the policy admits it.  Raises :class:`NotShared`
        saying why when there is none to give: the policy evicts (or caches nothing), the budget is full,
        the block is damaged or cannot be read, or its memory could not be made shareable.
        """
        if not self.shares:
            raise NotShared(f"the {self._policy.name} policy does not share blocks")
        cached = self._blocks.get(block)
        if cached is None:
            try:
                cached = self._cached_or_loaded(block)
            except (CorruptBlockError, BlockReadError) as e:
                raise NotShared(str(e)) from None
        with self._lock:
            fd = cached.fd
            if fd is None:
                raise NotShared(f"block {block} is held in memory that cannot be shared")
            self._counters.add("blocks_shared")
            return os.dup(fd)  # under the lock: a drop cannot close fd in between

    def _cached_or_loaded(self, block: int) -> _CachedBlock:
        """``block`` in the cache, loaded (or waited for) now if need be; NotShared if it is not admitted."""
        cached = self.load(block)
        if cached is None:
            why = (
                "damaged (its checksum or header is wrong, or it is not this dataset's)"
                if (block in self._damaged)
                else "not admitted: the cache budget is full"
            )
            raise NotShared(f"block {block} is {why}")
        return cached

    def load(self, block: int) -> _CachedBlock | None:
        """``block`` from memory, loaded now (or waited for: single flight with every other load) if the
        policy admits it; None when it does not.  Raises CorruptBlockError / BlockReadError."""
        cached = self._blocks.get(block)
        if cached is not None:
            return cached
        head = self._header(block)
        with self._lock:
            cached = self._blocks.get(block)
            if cached is not None:
                return cached
            future, mine = self._claim(block, head)
        return None if future is None else self._await(block, head, future, mine)

    # --- admission and single flight ----------------------------------------------------------------
    def _claim(self, block: int, head: fmt.BlockHeader) -> tuple[Future | None, bool]:
        """Under the lock: the load to wait for (and whether this caller must run it), or None."""
        future = self._loading.get(block)
        if future is not None:
            return future, False
        if self.closed or self._is_damaged_locked(block):
            return None, False
        if self._admits is not None and not self._admits(self, block, head.data_size):
            return None, False
        evicted = self._policy.admit(block, head.data_size)  # reserves the room before any byte is read
        if evicted is None:
            return None, False
        for victim in evicted:
            self._drop(self._blocks.pop(victim, None))
        future = Future()
        self._loading[block] = future
        return future, True

    def _await(self, block: int, head: fmt.BlockHeader, future: Future, mine: bool) -> _CachedBlock:
        """The claimed block: loaded here if this caller claimed it, else waited for (single flight)."""
        if mine:
            self._load(block, head, future)
        else:
            self._counters.add("load_waits")
        return future.result()

    def _is_damaged_locked(self, block: int) -> bool:
        """:meth:`_is_damaged` from under the lock: without a new look at the version (that is I/O)."""
        return block in self._damaged

    def wanted(self, block: int) -> bool:
        """Whether a background load of ``block`` could help: not cached, loading or known damaged."""
        return block not in self._blocks and block not in self._loading and not self._is_damaged(block)

    @property
    def full(self) -> bool:
        return self._policy.used_bytes >= self._policy.budget_bytes

    def count(self, name: str) -> None:
        self._counters.add(name)

    def copy_ahead(self, block: int) -> bool:
        """Fetch ``block`` into the disk tier before a read needs it (a loader announced it, and memory
        will not hold it); whether it was copied.  A failure is left for the read to report."""
        if self._is_damaged(block) or not self._store.files.wants_copy(block):
            return False
        try:
            self._store.copy_into_tier(block)
        except (CorruptBlockError, BlockReadError) as e:
            log.debug("copying block %d ahead failed: %s", block, e)
            return False
        self._counters.add("disk_copies_ahead")
        return True

    def load_ahead(self, block: int, counter: str, *, fill_only: bool) -> int | None:
        """Load ``block`` before any read asks for it, if :meth:`claim_ahead` lets it.  Returns the block's
        data bytes when this call loaded it (or failed to), None when it declined."""
        load = self.claim_ahead(block, counter, fill_only=fill_only)
        return None if load is None else load()

    def claim_ahead(self, block: int, counter: str, *, fill_only: bool) -> Callable[[], int] | None:
        """Claim ``block``'s room for a background load, if the guard every background load passes lets it:
        not cached, loading or damaged; the policy would admit it (a guess that does not fit is not a
        refusal of a read); with ``fill_only``, only into free room, evicting nothing.  Returns the load to
        run (it returns the data bytes), None when it declined.  Claiming apart from loading lets a caller
        claim blocks in a chosen order and still load them side by side."""
        try:
            head = self._header(block)
        except (CorruptBlockError, BlockReadError):
            return None  # reported when a file of it is read
        damaged = self._is_damaged(block)  # outside the lock: it may look at the stored version
        with self._lock:
            wanted = block not in self._blocks and block not in self._loading and not damaged
            if not wanted or block in self._policy or self.closed:
                return None
            room = self._policy.budget_bytes - self._policy.used_bytes
            if (fill_only and head.data_size > room) or not self._policy.would_admit(block, head.data_size):
                return None
            future, mine = self._claim(block, head)
            if future is None or not mine:  # marked damaged since the look above, outside the lock
                return None
        self._counters.add(counter)

        def load() -> int:
            self._load(block, head, future)
            return head.data_size

        return load

    def _load(self, block: int, head: fmt.BlockHeader, future: Future) -> None:
        """Read a claimed block whole, verify it, and publish it (or the error) to every waiter."""
        try:
            cached = self._read_block(block, head)
        except BaseException as e:
            with self._lock:
                self._loading.pop(block, None)
                self._policy.discard(block)
            self._counters.add("load_errors")
            if isinstance(e, CorruptBlockError):
                self._mark_damaged(block)
            log.debug("loading block %d failed: %s", block, e)
            future.set_exception(e)
            return
        with self._lock:
            self._loading.pop(block, None)
            kept = block in self._policy  # not evicted (LRU/FIFO) while it was loading
            if kept:
                self._blocks[block] = cached
            else:
                self._drop(cached)
        self._counters.add("block_loads")
        self._counters.add("block_bytes_read", head.data_size)
        future.set_result(cached)
        if kept and self._on_load is not None:
            self._on_load(block)

    def _read_block(self, block: int, head: fmt.BlockHeader) -> _CachedBlock:
        """The data section in fresh anonymous memory, read by the store and verified, with the sealed
        memfd behind it (None where the block is not to be shared)."""
        if head.data_size == 0:
            return _CachedBlock(b"", None, head, False)
        buf, memfd = self._memory.allocate(block, head.data_size)
        try:
            # A policy that never evicts keeps the block for the mount's life (an evicting one may drop it).
            self._store.read_data_into(block, head, buf, held_in_memory=not self._policy.evicts)
        except BaseException:
            self._memory.release(memfd)  # the map goes with the last reference (a traceback may hold one)
            raise
        return _CachedBlock(buf, self._memory.seal(memfd), head, self._memory.memlock.lock(buf))

    def _drop(self, cached: _CachedBlock | None) -> None:
        # Readers still holding the block keep it alive; the map goes when the last reference does.
        if cached is not None:
            self._memory.release(cached.fd, cached.nbytes if cached.locked else 0)
            cached.fd = None

    # --- loading ahead ----------------------------------------------------------------------------
    def keep_to(self, blocks: list[int]) -> None:
        """Load ahead only ``blocks``, this node's part (see :meth:`BackgroundLoads.keep_to`)."""
        self._background.keep_to(blocks)

    def start_prefill(self) -> None:
        """Load blocks in the background, in order, while they fit without evicting anything.

        The blocks a cache-once budget will hold are then read sequentially at disk speed while the first
        epoch runs, instead of each on its first miss; a miss of a block not loaded yet loads it at once
        in the reading thread, so prefill never delays a read.
        """
        self._background.start_prefill()

    def preload(self, on_block: Callable[[int], None] | None = None) -> None:
        """What :meth:`start_prefill` does, now, in this thread (``on_block(bytes)`` after each block)."""
        self._background.prefill(on_block)

    def prefetch(self, blocks: list[int]) -> None:
        """Load ``blocks`` in the background, in this order, as far as they fit without evicting anything
        (a loader's announcement of what it reads next); a new call replaces the one before."""
        self._background.prefetch(blocks)

    # --- statistics and life cycle ----------------------------------------------------------------
    @property
    def policy_name(self) -> str:
        return self._policy.name

    @property
    def budget_bytes(self) -> int:
        return self._policy.budget_bytes

    @property
    def used_bytes(self) -> int:
        """Bytes the policy has given to blocks (loaded or loading)."""
        return self._policy.used_bytes

    def stats(self) -> dict[str, Any]:
        """Counters, cache fill and per-epoch hit rates, as plain JSON-ready values."""
        counters, epochs = self._counters.snapshot()
        with self._lock:
            policy = self._policy.stats()
            cached_blocks = len(self._blocks)
            loading = len(self._loading)
        memlock = self._memory.memlock
        return {
            "counters": counters,
            "cache": {
                "policy": self._policy.name,
                **policy,
                "cached_blocks": cached_blocks,
                "loading_blocks": loading,
                "fill": policy["used_bytes"] / policy["budget_bytes"] if policy["budget_bytes"] else 0.0,
                "locked_bytes": memlock.locked_bytes,
                "mlock": memlock.describe(),
                "file_buffer_bytes": self._files.buffer.nbytes,
            },
            "epochs": epochs,
            "uptime_s": self._counters.uptime_s,
        }

    def close(self) -> None:
        """Stop the loaders and drop every cached block."""
        with self._lock:
            self.closed = True
            looks, self._looks = list(self._looks.values()), {}
        for timer in looks:
            timer.cancel()
        self._background.close()
        with self._lock:
            for cached in self._blocks.values():
                self._drop(cached)
            self._blocks.clear()
        self._files.buffer.clear()
