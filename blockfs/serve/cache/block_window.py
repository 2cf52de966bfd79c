"""``BlockWindow``: the last few blocks another node owns, read whole for the reads that follow, within the budget.

With peers, memory keeps the blocks this node owns; a file of a block another node owns is read alone, one
ranged request to its owner each.  But the loader's block-shuffled order deals blocks to ranks whole, a few
at a time: once a node has read two files of such a block, it will read most of the rest soon.  So the second
miss of a block (among the last :data:`RECENT_MISSES`; its first, once the blocks before it were read out,
:data:`READ_OUT_STREAK`; its third, once they were dropped mostly unread, :data:`WASTED_STREAK`: a random
order, where a block fetched whole serves one file or two) fetches its data section once, verified by the store
like every whole block (the chunk digests; a failed check drops the peer's bytes and reads the store's), and
keeps it here; the files that follow are memory reads, answered where the cache's are (no request each).

A loader that announces the blocks it reads next (:mod:`blockfs.serve.control.announce`) lets the window fetch
them *ahead* of the reader instead (:meth:`BlockWindow.claim_ahead`, from the cache's background loads): in the
announced order, each as soon as room is made for it, so the reads find it in memory.  A block fetched ahead
counts as read lately for :data:`AHEAD_GRACE` more file reads, so a reader still a few blocks behind finds it
there, and no later fetch ahead drops it before its first read (it is needed sooner); a block dropped read
out since the announcement is not fetched again; a block held that the announcement does not name counts as
idle (the last epoch's).

The window holds at most ``capacity`` bytes (loads in flight included); the mount takes that room out of the
cache's budget (``BlockCache(window_bytes=...)``), so memory never holds more than the budget the user set.
It never drops a block still being read to load another (that would fetch blocks again and again): room is
made from a block whose files have all been read (each file once, as the loader's order reads them), else
from the one read least lately if no file of it was read in the last :data:`IDLE_READS`; with neither, the
file is read alone.  A block is loaded here once however many readers ask (single flight);
a load that fails leaves nothing behind, and its readers read their files alone (which decides the error).
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future

import numpy as np

from ...core import format as fmt
from ...core.store import BlockStore
from ...errors import BlockReadError, CorruptBlockError
from .cache_stats import CacheCounters
from .cached_block import CachedBlock

__all__ = ["AHEAD_GRACE", "BlockWindow", "RECENT_MISSES", "WINDOW_BLOCKS"]

WINDOW_BLOCKS = 8  # blocks the window is sized for (the loader has 6 in flight per reader by default)
RECENT_MISSES = 8  # a block's second miss among this many fetches it whole (a random order rarely repeats so soon)
READ_OUT_STREAK = 2  # after this many blocks in a row read out, a block's first miss fetches it whole
WASTED_STREAK = 2  # after this many in a row dropped with less than half their files read, its third miss
ALONE_BLOCKS = 64  # blocks whose files read alone are remembered (for when the block is loaded), at most
IDLE_READS = 64  # a block none of whose files was read in this many file reads may be dropped before it is read out
AHEAD_GRACE = 4 * IDLE_READS  # a block fetched ahead is idle only once this many more files were read with none of it
ROOM_WAIT_S = 0.1  # a fetch ahead waiting for room looks again at least this often
WAKE_READS = 8  # and after every this many files read (a block held may have gone idle)


class _Use:
    """What was read of one block: which files (their slots), the window's clock at the last read, how many
    non-empty files it has (all read: read out)."""

    __slots__ = ("slots", "last", "files", "ahead", "unnamed")

    def __init__(self, head: fmt.BlockHeader) -> None:
        self.slots: set[int] = set()
        self.last = 0
        self.files = int(np.count_nonzero(head.sizes))
        self.ahead = False  # fetched ahead of its reads (announced) and none of its files read yet
        self.unnamed = False  # held when an announcement did not name it: its drop says nothing of the order

    @property
    def read_out(self) -> bool:
        return len(self.slots) >= self.files

    def add(self, slot: int) -> bool:
        """Count file ``slot`` read; whether that made the block read out."""
        if slot in self.slots:
            return False
        self.slots.add(slot)
        self.ahead = False
        return len(self.slots) == self.files


class BlockWindow:
    """Whole blocks that ``eligible(block)`` says to window (another node's, not avoided), read from ``store``,
    at most ``capacity`` bytes; counted in ``counters``."""

    def __init__(
        self, store: BlockStore, capacity: int, eligible: Callable[[int], bool], counters: CacheCounters
    ) -> None:
        self.capacity = capacity
        self._store = store
        self._eligible = eligible
        self._counters = counters
        self._lock = threading.Lock()
        self._room = threading.Condition(self._lock)  # a fetch ahead waits on it for a block to be read out
        self._blocks: dict[int, CachedBlock] = {}
        # Per held block: which of its files were read, the clock at its last read, its non-empty files.  Updated
        # without the lock (note_read): a lost update only moves when the block is dropped.
        self._use: dict[int, _Use] = {}
        # Per block missed lately: which of its files were read alone, and when last (counted once it is loaded,
        # unless none was in the last IDLE_READS: a random order reads a block's files far apart, each pass anew).
        self._alone: dict[int, _Use] = {}
        self._reads = 0  # files read (first reads) while the window was asked or hit: its clock
        self._loading: dict[int, Future] = {}
        self._bytes = 0  # held and being loaded
        self._recent: deque[int] = deque(maxlen=RECENT_MISSES)  # blocks whose files were read alone lately
        self._streak = 0  # blocks dropped read out in a row
        self._wasted = 0  # blocks dropped with less than half their files read, in a row
        self._done: set[int] = set()  # blocks dropped read out since the last announcement: not fetched ahead again
        self._waiting = 0  # fetches ahead waiting for room
        self.closed = False

    def eligible(self, block: int) -> bool:
        """Whether ``block`` is one the window holds: another node's, not avoided."""
        return self._eligible(block)

    def get(self, block: int) -> CachedBlock | None:
        """The block if the window holds it now (no lock: one dict lookup, as the cache's)."""
        return self._blocks.get(block)

    def note_read(self, block: int, slot: int, offset: int) -> None:
        """A read served from memory: a file's first read (``offset`` 0) of a held block counts toward it."""
        if offset == 0:
            self._reads += 1
            use = self._use.get(block)
            if use is not None:
                use.last = self._reads
                if use.add(slot) and self._waiting:  # read out: its room may go to a block fetched ahead
                    self._wake()
            if self._waiting and self._reads % WAKE_READS == 0:
                self._wake()

    def _wake(self) -> None:
        with self._room:
            self._room.notify_all()

    def _make_room(self, size: int, ahead: bool = False) -> bool:
        """Under the lock: drop blocks read out (else idle) until ``size`` more bytes fit; whether they do.
        For a block fetched ``ahead``, never one fetched ahead and not read yet: it comes before it."""
        while self._bytes + size > self.capacity:
            victim, oldest = None, self._reads - IDLE_READS
            for block in self._blocks:
                use = self._use[block]
                if use.read_out:
                    victim = block
                    break
                if use.last < oldest and not (ahead and use.ahead):
                    victim, oldest = block, use.last
            if victim is None:
                return False
            use = self._use[victim]
            read, files = len(use.slots), use.files
            if not use.unnamed:
                self._streak = min(self._streak + 1, READ_OUT_STREAK) if read >= files else 0
                self._wasted = min(self._wasted + 1, WASTED_STREAK) if 2 * read < files else 0
            self._bytes -= self._blocks.pop(victim).nbytes
            del self._use[victim]
            if read >= files:
                self._done.add(victim)
        return True

    def _misses_to_load(self) -> int:
        """A block's misses among the last few that fetch it whole: its first while blocks are read out (a
        block-shuffled order), its third while they are dropped mostly unread (a random order), else its
        second."""
        if self._streak >= READ_OUT_STREAK:
            return 1
        return 3 if self._wasted >= WASTED_STREAK else 2

    def read(self, block: int, slot: int, head: fmt.BlockHeader) -> CachedBlock | None:
        """``block`` from the window (for its file ``slot``): held, being loaded (waited for), or loaded now when
        this is its second miss lately and it fits; None when the file is to be read alone."""
        size = head.data_size
        self._reads += 1  # the clock counts every file read alone (without the lock: it only ages blocks)
        if size == 0 or size > self.capacity or not self._eligible(block):
            return None
        with self._lock:
            cached = self._blocks.get(block)
            if cached is not None:
                use = self._use[block]
                use.last = self._reads
                use.add(slot)
                return cached
            future = self._loading.get(block)
            mine = future is None
            if mine:
                if self.closed or self._recent.count(block) + 1 < self._misses_to_load():
                    self._recent.append(block)
                    self._read_alone(block, slot, head)
                    return None
                if not self._make_room(size):  # every block held is still being read: this file alone
                    self._read_alone(block, slot, head)
                    return None
                self._bytes += size
                future = self._loading[block] = Future()
        assert future is not None
        if not mine:
            self._counters.add("load_waits")
            try:
                cached = future.result()
            except (CorruptBlockError, BlockReadError):
                return None
            waited = self._use.get(block)
            if waited is not None:
                waited.add(slot)
            return cached
        return self._load(block, head, future, slot)

    def _read_alone(self, block: int, slot: int, head: fmt.BlockHeader) -> None:
        """Under the lock: ``slot`` of ``block`` is read alone (it counts as read once the block is loaded)."""
        alone = self._alone.get(block)
        if alone is not None and alone.last < self._reads - IDLE_READS:
            alone.slots.clear()  # read alone long ago (a random order, or an epoch before): not this pass's reads
        if alone is None:
            if len(self._alone) >= ALONE_BLOCKS:  # forget the blocks missed least lately
                for old in sorted(self._alone, key=lambda b: self._alone[b].last)[: ALONE_BLOCKS // 2]:
                    del self._alone[old]
            alone = self._alone[block] = _Use(head)
        alone.last = self._reads
        alone.add(slot)

    def announced(self, blocks: list[int]) -> None:
        """A loader announced its next ``blocks`` (a new pass: blockfs's loader reads them block by block).
        Blocks read out before may be fetched ahead again; a block held that it names is to be read anew (not
        read out: recent now), one it does not name counts as idle now (a later read makes it recent again),
        and dropping it says nothing of the order; a block's first miss fetches it whole."""
        named = set(blocks)
        with self._room:
            self._done.clear()
            self._alone.clear()  # an epoch's reads alone say nothing of the next one's
            self._streak, self._wasted = READ_OUT_STREAK, 0
            for block, use in self._use.items():
                if block in named:  # to be read anew; idle as any block if its reads do not come soon
                    use.slots.clear()
                    use.last, use.ahead, use.unnamed = self._reads, False, False
                else:
                    use.last, use.ahead, use.unnamed = self._reads - IDLE_READS - 1, False, True
            self._room.notify_all()  # a fetch ahead for the last announcement looks whether it still runs

    def claim_ahead(
        self, block: int, head: fmt.BlockHeader, current: Callable[[], bool]
    ) -> Callable[[], CachedBlock | None] | None:
        """Claim room for ``block`` (announced: the reader comes to it soon) before any read asks for it,
        waiting while every block held is still being read, as long as ``current()`` (the announcement is
        the latest, the cache open).  Returns the load to run (single flight with the reads' loads), or None:
        not another node's, held, being loaded, read out since the announcement, or no longer wanted."""
        size = head.data_size
        if size == 0 or size > self.capacity or not self._eligible(block):
            return None
        with self._room:
            while True:
                if self.closed or block in self._blocks or block in self._loading or block in self._done:
                    return None
                if not current():
                    return None
                if self._make_room(size, ahead=True):
                    break
                self._waiting += 1
                try:
                    self._room.wait(ROOM_WAIT_S)
                finally:
                    self._waiting -= 1
            self._bytes += size
            future: Future = Future()
            self._loading[block] = future
        return lambda: self._load(block, head, future, None)

    def _load(self, block: int, head: fmt.BlockHeader, future: Future, slot: int | None) -> CachedBlock | None:
        """Load ``block`` whole into the room claimed for it: for a read of its file ``slot``, or ahead (None)."""
        ahead = slot is None
        try:
            # The heap's memory, reused block after block: a fresh map would cost a page fault a page (about
            # 1 ms a MiB, 20x malloc's); given back when the last reader lets go, held in the room meanwhile.
            buf = bytearray(head.data_size)
            self._store.read_data_into(block, head, buf)  # verified: a peer's bad bytes are dropped, the store's read
            cached = CachedBlock(buf, None, head, False)
        except BaseException as e:
            with self._lock:
                self._loading.pop(block, None)
                self._bytes -= head.data_size
            self._counters.add("load_errors")
            future.set_exception(e)
            if isinstance(e, (CorruptBlockError, BlockReadError)):
                return None  # the file's own read decides
            raise
        with self._lock:
            self._loading.pop(block, None)
            if self.closed:
                self._bytes -= head.data_size
            else:
                self._blocks[block] = cached
                # the files read alone before, and the one this load is for
                use = self._alone.pop(block, None)
                if use is None or use.last < self._reads - IDLE_READS:  # none lately: this pass reads it anew
                    use = _Use(head)
                use.last = self._reads + (AHEAD_GRACE - IDLE_READS if ahead else 0)
                use.ahead = ahead and not use.slots
                self._use[block] = use
                if (slot is not None and use.add(slot)) or use.read_out:
                    self._room.notify_all()
        self._counters.add_many(window_loads=1, window_ahead_loads=int(ahead), block_bytes_read=head.data_size)
        future.set_result(cached)
        return cached

    def stats(self) -> dict[str, int]:
        with self._lock:
            return {"capacity_bytes": self.capacity, "held_bytes": self._bytes, "blocks": len(self._blocks)}

    def close(self) -> None:
        with self._lock:
            self.closed = True
            self._bytes -= sum(b.nbytes for b in self._blocks.values())  # loads in flight give theirs back as they end
            self._blocks.clear()
            self._use.clear()
            self._alone.clear()
            self._room.notify_all()
