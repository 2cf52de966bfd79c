"""``BlockFiles``: the bytes of a dataset's block files, wherever they are — no checks, no format.

:class:`~blockfs.core.store.BlockStore` verifies every byte it is given; this layer only fetches them.  It
raises ``OSError`` for any failed read (the store turns that into a retriable ``BlockReadError``) and
never decides that a block is damaged.

The store's kinds: :class:`LocalBlockFiles` (block files in a directory, read with ``pread`` on pooled
descriptors) and :class:`~blockfs.storage.remote_blocks.RemoteBlockFiles` (ranged GETs); the tiers in front
of a store compose into one more, :class:`~blockfs.storage.chain.TierChain` (disk, peers, then the store).
The copy hooks at the end let the store hand a block it has verified whole to that chain, which decides
what to keep where; a plain store keeps nothing.
"""

from __future__ import annotations

import errno
import os
import stat
import threading
from collections.abc import Callable, Hashable

from ..openfiles import raise_open_files_limit


class BlockFiles:
    """Reads of block files by number.  ``names[b]`` says where block ``b`` lives (for messages).

    The contract every implementation keeps (``tests/test_blockfiles_contract.py`` runs it on each): a
    block number outside ``0 .. len(names) - 1`` is an ``IndexError`` (a caller's mistake, never a read of
    another block), a negative offset or size an ``OSError`` (EINVAL), and a read past the end an
    ``OSError`` (EIO) that leaves every kept copy and head as it was.
    """

    names: list[str]
    keeps_copies = False  # a tier that keeps copies of verified blocks (the disk tier)
    # Whether a block read in pieces costs what one read of it costs (local files: yes; ranged GETs: no, a
    # whole block is fetched as parallel parts), so the store may check each piece while the next is read.
    reads_in_pieces = False
    copies_memory_blocks = True  # whether that tier also copies blocks memory holds for good

    def size(self, block: int) -> int:
        """The block file's size in bytes."""
        raise NotImplementedError

    def pread(self, block: int, size: int, offset: int) -> bytes:
        """Exactly ``size`` bytes at ``offset``, or an OSError."""
        raise NotImplementedError

    def read_into(self, block: int, view: memoryview, offset: int) -> None:
        """Fill ``view`` with the bytes at ``offset``, or an OSError."""
        raise NotImplementedError

    def discard(self, block: int) -> None:
        """A read of ``block`` failed, or its bytes failed a check: forget any state (a descriptor, bytes
        kept from a fetch), so the next read starts afresh."""

    def version(self, block: int) -> Hashable | None:
        """What identifies the stored block now (hashable), so damage is remembered for that version only;
        None when it cannot be told (then the damage stays remembered)."""
        return None

    # --- tiers that keep copies (the defaults: none) --------------------------------------------------
    def wants_copy(self, block: int) -> bool:
        """Whether a tier would keep a copy of ``block`` if handed one (and has reserved room for it)."""
        return False

    def wants_whole(self, block: int) -> bool:
        """Whether a file read of ``block`` should fetch the block whole first, for a tier to keep."""
        return False

    def offer(self, block: int, header: Callable[[], bytes | None], data: memoryview, *, held_in_memory: bool) -> None:
        """A block the store verified whole; ``header()`` gives its header as stored (None: not this time)."""

    def keep_copy(self, block: int, header: bytes, data: memoryview) -> None:
        """Keep a copy of a block the store has verified whole (after :meth:`wants_copy` said yes)."""

    def drop_copy(self, block: int) -> bool:
        """A kept copy of ``block`` failed a check: delete it; whether there was one (then read again)."""
        return False

    def refuse_copy(self, block: int) -> None:
        """``block`` is damaged: stop asking for its copy (a whole fetch each read would cost the block)."""

    def allow_copy(self, block: int) -> None:
        """``block`` was replaced since :meth:`refuse_copy`: a copy may be asked for again."""

    def stats(self) -> dict:
        """Counters for ``stats.json`` (tiers and remote requests); empty for local files."""
        return {}

    def close(self) -> None:
        """Release descriptors and threads; idempotent.  A later read opens what it needs again (a read
        still in flight at teardown must not fail), so close once more after it."""

    def _check(self, block: int, offset: int = 0, size: int = 0) -> None:
        """Refuse what no block file holds: a list would read block -1 as the last one, and ``preadv``
        reads offset -1 as the file's current position."""
        if not 0 <= block < len(self.names):
            raise IndexError(f"block {block}: not a block of this dataset (0 to {len(self.names) - 1})")
        if offset < 0 or size < 0:
            raise OSError(errno.EINVAL, f"cannot read {size} bytes at offset {offset}: both must be >= 0")


def open_regular(path: str) -> int:
    """A descriptor to read ``path``, if it is a regular file.  A FIFO planted as a block file would block the
    open (and every read behind the descriptors' lock) until a writer came; a device would be read as data."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise OSError(errno.EINVAL, "not a regular file (a FIFO, a device or a directory)")
    return fd


class _Descriptor:
    __slots__ = ("fd", "stale", "users", "next", "run", "ahead")

    def __init__(self, fd: int) -> None:
        self.fd = fd
        self.users = 0
        self.stale = False
        # The stream of reads through the file (see LocalBlockFiles._read_ahead); racy by design, a hint.
        self.next = -1  # where the last read ended
        self.run = 0  # reads in a row that began where the one before ended
        self.ahead = 0  # how far the kernel was told the stream will read


class _Descriptors:
    """Open files, shared by concurrent reads.

    A descriptor is closed only once no read is using it: closing it under a read would fail that read,
    or, once the kernel reuses the number for another file, make it read the wrong file.
    """

    def __init__(self, paths: list[str], opener: Callable[[int], int] | None = None) -> None:
        self._paths = paths
        self._opener = opener or (lambda block: open_regular(paths[block]))
        self._open: dict[int, _Descriptor] = {}
        self._lock = threading.Lock()

    def acquire(self, block: int) -> _Descriptor:
        """The block's open descriptor, marked in use until :meth:`release`; raises OSError."""
        with self._lock:
            d = self._open.get(block)
            if d is None:
                d = self._open[block] = _Descriptor(self._open_file(block))
            d.users += 1
            return d

    def _open_file(self, block: int) -> int:
        try:
            fd = self._opener(block)
        except OSError as e:
            if e.errno != errno.EMFILE or not self._close_idle_locked():
                raise
            fd = self._opener(block)  # once more, with descriptors freed
        # No readahead of the kernel's own on this descriptor: a block file is read as its header, as files
        # alone, or as a whole data section asked for up front (WILLNEED).  Around a file read alone the
        # kernel's readahead fetches the neighbouring files once their neighbours are cached, and a
        # cache-once epoch never reads those from here (retained, or in a cached block): 20 % more bytes
        # from the disk than the mount served (issue 29, item 10).  A true stream is read ahead by
        # LocalBlockFiles._read_ahead instead.
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)
        except OSError:
            pass  # a file that takes no advice is read as before
        return fd

    def release(self, d: _Descriptor) -> None:
        with self._lock:
            d.users -= 1
            if d.stale and d.users == 0:
                os.close(d.fd)

    def discard(self, block: int) -> None:
        """Forget the block's descriptor (closed once its reads are done): the next read opens the file anew."""
        with self._lock:
            d = self._open.pop(block, None)
            if d is not None:
                self._retire_locked(d)

    def _close_idle_locked(self) -> bool:
        """Close every descriptor no read is using; whether any was closed."""
        idle = [block for block, d in self._open.items() if d.users == 0]
        for block in idle:
            self._retire_locked(self._open.pop(block))
        return bool(idle)

    @staticmethod
    def _retire_locked(d: _Descriptor) -> None:
        d.stale = True
        if d.users == 0:
            os.close(d.fd)

    def close(self) -> None:
        with self._lock:
            for d in self._open.values():
                self._retire_locked(d)
            self._open.clear()


def _phrased(what: str, e: OSError) -> OSError:
    """``e`` with a message that says what failed (the store adds which block)."""
    return OSError(e.errno, f"{what}: {e.strerror or e}")


WILLNEED_FROM = 1 << 20  # reads this big tell the kernel their whole range first
STREAM_RUN = 2  # reads in a row, each from where the one before ended, that make a stream
STREAM_AHEAD = 2 << 20  # how far ahead of a stream the kernel is asked to read


class LocalBlockFiles(BlockFiles):
    """Block files in a local directory (``paths[b]`` is block ``b``'s file).  ``opener(b)``, when given,
    opens block ``b`` instead of its path (the disk tier opens its copies relative to its directory)."""

    reads_in_pieces = True

    def __init__(self, paths: list[str], opener: Callable[[int], int] | None = None) -> None:
        self.names = paths
        self._fds = _Descriptors(paths, opener)
        raise_open_files_limit()  # one descriptor per block file

    def _acquire(self, block: int):
        try:
            return self._fds.acquire(block)
        except OSError as e:
            raise _phrased("cannot open", e) from e

    def size(self, block: int) -> int:
        self._check(block)
        d = self._acquire(block)
        try:
            return os.fstat(d.fd).st_size
        except OSError as e:
            raise _phrased("cannot stat", e) from e
        finally:
            self._fds.release(d)

    def pread(self, block: int, size: int, offset: int) -> bytes:
        self._check(block, offset, size)
        d = self._acquire(block)
        try:
            self._read_ahead(d, offset, size)
            data = os.pread(d.fd, size, offset)
        except OSError as e:
            raise _phrased("read failed", e) from e
        finally:
            self._fds.release(d)
        if len(data) == size:
            return data
        # Short: the end of the file, or a read past 2 GiB (Linux's most per call); the rest says which.
        whole = bytearray(size)
        whole[: len(data)] = data
        self.read_into(block, memoryview(whole)[len(data) :], offset + len(data))
        return bytes(whole)

    def read_into(self, block: int, view: memoryview, offset: int) -> None:
        self._check(block, offset)
        d = self._acquire(block)
        try:
            done, size = 0, len(view)
            if size >= WILLNEED_FROM:
                # Ask for the whole range up front.  After the small header reads at the file's start, the
                # kernel's readahead treats the block read as random and issues small requests, which an
                # IOPS-bound disk serves far below its bandwidth; told the range, it issues large ones
                # (README: Slow and remote storage).  And as much again after it: a data section read in
                # pieces (the store hashes one while it reads the next) has the next piece on its way, as
                # the kernel's own readahead did before the descriptor was POSIX_FADV_RANDOM (past the
                # file's end, the advice is cut there).
                os.posix_fadvise(d.fd, offset, 2 * size, os.POSIX_FADV_WILLNEED)
            while done < size:
                try:
                    n = os.preadv(d.fd, [view[done:]], offset + done)
                except OSError as e:
                    raise _phrased("read failed", e) from e
                if n == 0:
                    raise OSError(
                        errno.EIO,
                        f"the file ends at byte {offset + done}, before {offset + size} (did it change?)",
                    )
                done += n
        finally:
            self._fds.release(d)

    @staticmethod
    def _read_ahead(d: _Descriptor, offset: int, size: int) -> None:
        """Files read alone one after another in the block's order (a directory packed in order, read in
        order; a big file read in windows) are a stream: tell the kernel the next :data:`STREAM_AHEAD`
        bytes, as its readahead would, so a disk gets large requests.  Files read in any other order are
        read exactly (the descriptor is POSIX_FADV_RANDOM)."""
        if offset == d.next:
            d.run += 1
        else:
            d.run, d.ahead = 0, 0  # a new stream, maybe behind the last one: told nothing yet
        d.next = end = offset + size
        if d.run >= STREAM_RUN and end + STREAM_AHEAD // 2 > d.ahead:
            start, d.ahead = max(end, d.ahead), end + STREAM_AHEAD
            try:
                os.posix_fadvise(d.fd, start, d.ahead - start, os.POSIX_FADV_WILLNEED)
            except OSError:
                pass  # advice only

    def discard(self, block: int) -> None:
        self._fds.discard(block)

    def version(self, block: int) -> Hashable | None:
        self._check(block)
        try:
            st = os.stat(self.names[block])  # the path, not the descriptor: a rename puts a new file there
        except OSError:
            return None
        return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)

    def close(self) -> None:
        self._fds.close()
