"""Memory the mount holds data in: anonymous, ``mlock``-ed where the process may, and shareable as sealed memfds.

Cached bytes live in anonymous memory (``mmap(-1, n)`` or a memfd), never in a file-backed map of a block
file: the kernel reclaims file-backed pages like page cache, which would silently turn cache hits into disk
reads.  With no swap, anonymous memory stays resident; ``mlock`` pins it where ``RLIMIT_MEMLOCK`` allows
(often it does not: the mount then says so once and goes on unpinned).

A block held in a memfd can be handed to a loader on this machine as a descriptor
(:meth:`blockfs.serve.cache.block_cache.BlockCache.share`).  Seals forbid writing through any new descriptor or map and
growing or shrinking the memory, so a loader can read the cache but never change it.  Each memfd costs
descriptors, so memfds are made only while the process has descriptors to spare; beyond that a block gets
a plain anonymous map and is not shared.
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
from collections.abc import Callable
from typing import Any

log = logging.getLogger(__name__)

FDS_KEPT_FREE = 512  # descriptors left to libfuse, block files and the rest when blocks are held in memfds
# Each memfd costs two: the one kept to share and the copy Python's ``mmap`` keeps (before 3.13).
FDS_PER_MEMFD = 2
# F_SEAL_FUTURE_WRITE (Linux 5.1; not in Python's fcntl): no new writable map or write(), while the
# cache's own map, made before the seal, still takes the block's bytes once.
F_SEAL_FUTURE_WRITE = 0x0010
MLOCK_ONFAULT = 1  # mlock2's flag (not in Python's os module)
SHARE_SEALS = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL


class MemoryLock:
    """``mlock`` of buffers while the process may; one warning the first time it may not."""

    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled
        self.locked_bytes = 0
        self.failure: str | None = None
        self._mlock: Callable[[int, int], int] | None = None  # (address, length) -> 0, or -1 with errno
        if enabled:
            try:
                libc = ctypes.CDLL(None, use_errno=True)
                plain = libc.mlock
                plain.argtypes = (ctypes.c_void_p, ctypes.c_size_t)
            except (OSError, AttributeError) as e:
                self._give_up(f"mlock is unavailable ({e})")
            else:
                self._mlock = _on_fault(getattr(libc, "mlock2", None), plain)

    def lock(self, buf: mmap.mmap | bytes) -> bool:
        """Try to lock ``buf`` in memory; whether it is locked."""
        if self._mlock is None or self.failure is not None or not isinstance(buf, mmap.mmap):
            return False
        done = self._mlock(_address_of(buf), len(buf))
        if done == 0:
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
        """Account for ``nbytes`` of locked memory given back (unmapping a map unlocks it)."""
        self.locked_bytes = max(0, self.locked_bytes - nbytes)

    def describe(self) -> str:
        """``off``, ``locked``, or why memory could not be locked (for the statistics)."""
        return "off" if not self.enabled else (self.failure or "locked")

    def _give_up(self, why: str) -> None:
        self.failure = why
        log.warning(
            "cannot pin the block cache in memory: %s; cached blocks stay in anonymous memory, which is "
            "only paged out under memory pressure when there is swap (raise 'ulimit -l' or grant "
            "CAP_IPC_LOCK to pin them)",
            why,
        )


def _on_fault(mlock2: Any, plain: Callable[[int, int], int]) -> Callable[[int, int], int]:
    """A lock of a range that locks its pages as they are first written (``MLOCK_ONFAULT``: Linux 4.4,
    glibc 2.27) rather than faulting them all in first, as ``mlock`` does: the 11.5 GiB arena of 10 M
    retained files took a mount 16.5 s to lock before it served (docs/benchmarks.md).  ``mlock`` where the C
    library has no ``mlock2`` or the kernel refuses the flag."""
    if mlock2 is None:
        return plain
    mlock2.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)

    def lock(address: int, length: int) -> int:
        done = mlock2(address, length, MLOCK_ONFAULT)
        if done != 0 and ctypes.get_errno() in (errno.EINVAL, errno.ENOSYS):
            return plain(address, length)
        return done

    return lock


def _address_of(buf: mmap.mmap) -> int:
    """The address a map starts at (``from_buffer`` exports the map only for this call, so it can still be
    closed later)."""
    return ctypes.addressof(ctypes.c_char.from_buffer(buf))


class Memfds:
    """Memfds for cached blocks while the process has descriptors to spare (beyond that, None)."""

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


class BlockMemory:
    """Fresh memory for blocks: a memfd's map where one is to be had, else an anonymous map; locked where
    the process may."""

    def __init__(self, *, lock: bool, memfds: bool) -> None:
        self.memlock = MemoryLock(lock)
        self._memfds = Memfds(memfds)

    def allocate(self, block: int, size: int) -> tuple[mmap.mmap, int | None]:
        """A writable map of ``size`` bytes (> 0) and the memfd behind it (None: a plain anonymous map)."""
        memfd = self._memfds.create(block, size)
        try:
            return mmap.mmap(-1 if memfd is None else memfd, size), memfd
        except BaseException:
            self._memfds.close(memfd)
            raise

    def seal(self, memfd: int | None) -> int | None:
        """Seal a filled block's memfd for sharing; None where there is none or it cannot be sealed."""
        return None if memfd is None else self._memfds.seal(memfd)

    def release(self, memfd: int | None, locked_bytes: int = 0) -> None:
        """Give back what a block held: its memfd and its locked bytes (the map goes with its last reader)."""
        self._memfds.close(memfd)
        if locked_bytes:
            self.memlock.unlocked(locked_bytes)
