"""A mount's index held in a private, unnamed file: page cache the kernel can reclaim, bytes no one can change.

A mount reads its index once, checks it, and answers from it for as long as it runs; at a million entries
the index is ~147 MB, ten million ~1.5 GB.  Where those bytes live was measured three ways
(``docs/benchmarks.md``, "The mount's own memory"):

1. a private anonymous copy (what every other reader of an index does, :func:`.index_format.read_index_file`):
   safe, but anonymous memory that no swap-less machine can reclaim, counted against the server;
2. a map of the dataset's own ``index.bfi``: free to make and reclaimable, but not ours: ``cp other.bfi
   index.bfi`` or any writer that opens it in place changes the bytes after they were checked (served
   unproven), and a truncation turns every later touch of the map into SIGBUS;
3. **this**: a copy into a file made with ``O_TMPFILE | O_EXCL`` in a directory of this user's alone, mapped
   read-only, its descriptor closed.  The file has no name: no writer of ``index.bfi`` reaches it, and it
   cannot be linked into the tree (``O_EXCL``), so the bytes checked are the bytes served until the mount
   ends.  Its pages are page cache, written back and reclaimed like any file's under memory pressure
   (re-read from this disk when touched again).  What can still reach it: on Python < 3.13 the map keeps
   a duplicate descriptor, which ``/proc/PID/fd`` opens for a process allowed to read this one's ``/proc``
   entries (the same user; root): the file's mode is 0400, so only root may then write it.  Anonymous
   memory is reached by the same users through ``/proc/PID/mem`` (given ptrace rights).  Cost: one in-kernel copy at
   mount (``copy_file_range``: a reflink where the filesystem shares extents), no more than the read into
   anonymous memory it replaces.

A copy directory on tmpfs would only move the same unreclaimable memory to shared memory: there, and
wherever the copy cannot be made (no directory, no ``O_TMPFILE``, a full disk), :meth:`IndexCopies.hold`
answers None and the index is read into anonymous memory as before.
"""

from __future__ import annotations

import ctypes
import errno
import logging
import mmap
import os
import struct
import sys
from collections.abc import Callable

from ..storage.owned import open_owned_dir, user_cache_directory
from . import digest as dg

log = logging.getLogger(__name__)

DIRECTORY_ENV = "BLOCKFS_INDEX_COPY_DIR"  # where a mount's index copy goes, if not the default; "" for none
# Filesystems whose pages are memory however they are named (statfs f_type): tmpfs, ramfs.
_MEMORY_FS = {0x01021994, 0x858458F6}
# CPython's map keeps a duplicate of the descriptor unless told not to (3.13's trackfd): without one, only
# /proc/PID/map_files (CAP_SYS_ADMIN) reaches the file; with one, /proc/PID/fd does for whoever may read
# this process's /proc entries (the same user), and the file's mode 0400 then still refuses a writer but root.
_NO_FD: dict[str, bool] = {"trackfd": False} if sys.version_info >= (3, 13) else {}
# copy_file_range's answers that mean "not between these two files": fall back to sendfile.
_NO_RANGE_COPY = {errno.EXDEV, errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP, errno.EBADF}


def default_directory() -> str | None:
    """``$BLOCKFS_INDEX_COPY_DIR``, else ``~/.cache/blockfs/index-copies`` (a disk, not the runtime directory: tmpfs): :func:`blockfs.storage.owned.user_cache_directory`."""
    return user_cache_directory(DIRECTORY_ENV, "index-copies")


class IndexCopies:
    """Where a mount's index is copied: :meth:`hold` makes the copy and maps it."""

    FIX = f"set {DIRECTORY_ENV} to a private directory on a disk (or to nothing, to hold the index in memory)"

    def __init__(self, directory: str | os.PathLike) -> None:
        self.directory = os.fspath(directory)

    @classmethod
    def default(cls) -> IndexCopies | None:
        directory = default_directory()
        return cls(directory) if directory else None

    def hold(self, fd: int, size: int, hashed: bool = False) -> tuple[mmap.mmap, bytes | None] | None:
        """A read-only map of a private copy of the first ``size`` bytes of the open file ``fd`` and, if
        ``hashed``, the copy's BLAKE3 digest (hashed piece by piece behind the copy); None where no copy
        can be made here (the reason logged once).  ``IndexChanged`` if ``fd`` ends before ``size`` bytes
        (the file shrank while it was copied)."""
        try:
            dir_fd = open_owned_dir(self.directory, "index copy directory", self.FIX)
        except OSError as e:
            log.warning("the index is held in memory: %s", e)
            return None
        try:
            if _on_memory_fs(dir_fd):
                log.info("the index is held in memory: %s is in memory itself (tmpfs)", self.directory)
                return None
            try:
                copy = os.open(".", os.O_TMPFILE | os.O_EXCL | os.O_RDWR | os.O_CLOEXEC, 0o600, dir_fd=dir_fd)
            except OSError as e:  # no O_TMPFILE on this filesystem (EOPNOTSUPP, EISDIR on old kernels)
                log.info("the index is held in memory: no unnamed file in %s (%s)", self.directory, e.strerror)
                return None
        finally:
            os.close(dir_fd)
        held = hashing = None
        try:
            if not size:
                return None
            os.ftruncate(copy, size)  # mapped before it is filled, so each piece is hashed as soon as it is copied
            held = mmap.mmap(copy, size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ, **_NO_FD)
            hashing = dg.FillingDigest(held) if hashed else None
            _copy(fd, copy, size, hashing.filled if hashing is not None else None)
            os.fchmod(copy, 0o400)  # reopened through /proc/PID/fd, it is not writable (but by root)
            got = hashing.digest() if hashing is not None else None
            hashing = None
            return held, got
        except OSError as e:  # ENOSPC, EIO, EDQUOT...: no copy, the index is read into memory instead
            log.warning("the index is held in memory: cannot copy it to %s: %s", self.directory, e.strerror or e)
            return None
        finally:
            if hashing is not None:  # failed: nothing may hash the map once it is closed
                hashing.abandon()
                if held is not None:
                    held.close()
            os.close(copy)  # the map keeps the file; with no descriptor and no name, nothing else reaches it


class IndexChanged(Exception):
    """The index file ended before the size it had when opened (``got`` bytes)."""

    def __init__(self, got: int) -> None:
        super().__init__(got)
        self.got = got


PIECE = 32 << 20  # bytes copied at a time: the hash of one piece runs while the next is copied


def _copy(src: int, dst: int, size: int, on_copied: Callable[[int], None] | None = None) -> None:
    """``size`` bytes of ``src`` from its start into ``dst`` at its start, in the kernel, in pieces;
    ``on_copied(end)`` after each: ``dst`` is final up to ``end``."""
    done, ranged = 0, True
    while done < size:
        if ranged:
            try:
                n = os.copy_file_range(src, dst, min(PIECE, size - done), done, done)
            except OSError as e:
                if e.errno not in _NO_RANGE_COPY or done:
                    raise
                ranged = False
                continue
        else:
            os.lseek(dst, done, os.SEEK_SET)
            n = os.sendfile(dst, src, done, min(PIECE, size - done))
        if n == 0:
            raise IndexChanged(done)
        done += n
        if on_copied is not None:
            on_copied(done)


_statfs = None
try:
    _statfs = ctypes.CDLL(None, use_errno=True).fstatfs
except (OSError, AttributeError):  # pragma: no cover (not Linux's libc)
    _statfs = None


def _on_memory_fs(fd: int) -> bool:
    """Whether the directory ``fd`` is on tmpfs or ramfs (f_type, the first field of ``struct statfs``)."""
    if _statfs is None:  # pragma: no cover
        return False
    buf = ctypes.create_string_buffer(256)
    if _statfs(fd, buf) != 0:
        return False
    return struct.unpack_from("l", buf.raw)[0] in _MEMORY_FS
