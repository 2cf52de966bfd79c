"""A mount's index held in a private file: page cache the kernel can reclaim, bytes no one else can change.

A mount reads its index once, checks it, and answers from it for as long as it runs; at a million entries
the index is ~147 MB, ten million ~1.5 GB.  Where those bytes live was measured three ways
(``docs/benchmarks.md``, "The mount's own memory"):

1. a private anonymous copy (what every other reader of an index does, :func:`.index_format.read_index_file`):
   safe, but anonymous memory that no swap-less machine can reclaim, counted against the server;
2. a map of the dataset's own ``index.bfi``: free to make and reclaimable, but not ours: ``cp other.bfi
   index.bfi`` or any writer that opens it in place changes the bytes after they were checked (served
   unproven), and a truncation turns every later touch of the map into SIGBUS;
3. **this**: a copy into a file made with ``O_TMPFILE`` in a directory of this user's alone, mode 0400,
   mapped read-only, its descriptor closed.  No writer of ``index.bfi`` reaches it.  Its pages are page
   cache, written back and reclaimed like any file's under memory pressure (re-read from this disk when
   touched again).  Cost: one in-kernel copy at mount (``copy_file_range``: a reflink where the filesystem
   shares extents), no more than the read into anonymous memory it replaces, and its BLAKE3 hash, made
   piece by piece behind the copy.

Copying and hashing 1.5 GB is most of a re-mount's time at ten million files, so a copy whose digest is the
one ``blockfs.json`` records is kept for the next mount of the same index (:mod:`.kept_copies`): named
under its digest in this directory, its identity recorded; a re-mount that finds it as recorded maps it,
neither copying nor hashing.  ``BLOCKFS_KEPT_INDEX_COPIES=0`` keeps none: the copy is then made with
``O_EXCL`` and can never be linked anywhere.

Who can change the bytes a mount serves (the threat model):

* another user: no one.  The directory is this user's alone (0700, checked), the file 0400, and an
  unnamed copy has no path at all.
* a writer of the dataset (``index.bfi`` written, truncated or replaced): no one; the copy is the bytes
  hashed.  A re-mount maps the kept copy of the digest ``blockfs.json`` names and does not read
  ``index.bfi`` again (``blockfs verify`` does).
* this user, or root, deliberately: an unnamed copy is reached only through ``/proc/PID/fd`` (on Python
  < 3.13 the map keeps a duplicate descriptor; 3.13's ``trackfd=False`` does not) and refuses a writer but
  root there (mode 0400).  A kept copy newly has a path while it is kept: a ``chmod u+w`` and a write, or a
  truncation, reaches the map of every live mount of it (shared page cache: bytes served unchecked, or
  SIGBUS) and is detected by the next mount (mode, size, modification time, ctime: :mod:`.kept_copies`),
  which copies and hashes again.  The same users can trace the server (``/proc/PID/mem``) or change
  blockfs's own code, so this defends against accidents and other users, not against them.

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

from ..storage.owned import open_owned_dir, open_owned_subdir, user_cache_directory
from . import digest as dg
from . import kept_copies as kc

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
    """Where a mount's index is copied: :meth:`hold` makes the copy and maps it (and keeps it for the next
    mount, :mod:`.kept_copies`), or maps a copy kept by an earlier one."""

    FIX = f"set {DIRECTORY_ENV} to a private directory on a disk (or to nothing, to hold the index in memory)"

    def __init__(self, directory: str | os.PathLike, kept: int = kc.KEPT, kept_bytes: int = kc.KEPT_BYTES) -> None:
        self.directory = os.fspath(directory)
        self.kept_count = kept  # copies kept for re-mounts at most (0: none)
        self.kept_bytes = kept_bytes

    @classmethod
    def default(cls) -> IndexCopies | None:
        directory = default_directory()
        return cls(directory, kc.kept_count()) if directory else None

    def _kept_dir(self, dir_fd: int, create: bool) -> int | None:
        """blockfs's own subdirectory of the copy directory (:data:`.kept_copies.SUBDIR`), where copies are
        kept; None where there is none yet or it is refused (a link, another user's: said once)."""
        path = os.path.join(self.directory, kc.SUBDIR)
        try:
            return open_owned_subdir(dir_fd, kc.SUBDIR, path, "kept index copies directory", self.FIX, create=create)
        except FileNotFoundError:
            return None
        except OSError as e:
            log.warning("the index copy is not kept for the next mount: %s", e)
            return None

    def _kept_map(self, dir_fd: int, digest: str) -> mmap.mmap | None:
        """A read-only map of the copy an earlier mount kept in ``dir_fd`` (the copy directory) of the index
        whose BLAKE3 digest is ``digest`` (hex), if it is there as it was kept (:func:`.kept_copies.find`);
        None otherwise."""
        if self.kept_count <= 0:
            return None
        kept_fd = self._kept_dir(dir_fd, create=False)
        if kept_fd is None:
            return None
        try:
            fd = kc.find(kept_fd, digest)
        finally:
            os.close(kept_fd)
        if fd is None:
            return None
        try:
            return mmap.mmap(fd, os.fstat(fd).st_size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ, **_NO_FD)
        except OSError as e:
            log.info("not using the kept index copy %s: %s", digest, e.strerror or e)
            return None
        finally:
            os.close(fd)

    def kept(self, digest: str) -> mmap.mmap | None:
        """A read-only map of the copy kept here of the index whose BLAKE3 digest is ``digest`` (hex), if it
        is here as it was kept; None otherwise, and nothing copied (a pack's, checking the copy it kept)."""
        try:
            dir_fd = open_owned_dir(self.directory, "index copy directory", self.FIX, create=False)
        except OSError:  # none, or refused: the pack's seed said why when it copied
            return None
        try:
            return self._kept_map(dir_fd, digest)
        finally:
            os.close(dir_fd)

    def seed(self, fd: int) -> bytes | None:
        """The BLAKE3 digest of the index file ``fd`` (a pack's, which is to record it), hashed from a copy
        kept for this machine's next mount of it; None, and nothing said, where no copy is kept here (the
        caller hashes the file itself).  Costs the copy, in the kernel, over the read it replaces, and its
        sync, waited for: a mount that follows finds it kept."""
        if self.kept_count <= 0:
            return None
        held = self.hold(fd, os.fstat(fd).st_size, hashed=True, keep=True, quiet=True, release=True)
        if held is None:
            return None
        buf, digest = held
        buf.close()
        kc.wait_kept()
        return digest

    def hold(
        self,
        fd: int,
        size: int,
        hashed: bool = False,
        keep: str | bool = False,
        quiet: bool = False,
        release: bool = False,
        reuse: str | None = None,
    ) -> tuple[mmap.mmap, bytes | None] | None:
        """A read-only map of a private copy of the first ``size`` bytes of the open file ``fd`` and, if
        ``hashed``, the copy's BLAKE3 digest (hashed piece by piece behind the copy); None where no copy
        can be made here (the reason logged once).  ``IndexChanged`` if ``fd`` ends before ``size`` bytes
        (the file shrank while it was copied).  ``keep`` (with ``hashed``): the digest (hex) that
        ``blockfs.json`` records: the copy is kept for the next mount if it is that; True: kept under its
        own digest (a pack's, which is making that record).  ``quiet``: why no copy was made is logged for
        debugging only (a pack's seed: nothing is held in memory instead).  ``release``: each piece's pages
        leave this process's map once hashed (a pack's seed, which closes the map unread).  ``reuse``: a
        BLAKE3 digest (hex, the one ``blockfs.json`` records): a copy an earlier mount kept of that index is
        mapped instead, neither copied nor hashed (its identity is what was recorded once it had that
        digest), and the digest returned with it; the copy directory is opened once either way."""
        keep = keep if hashed and self.kept_count > 0 else False
        warn, say = (log.debug, log.debug) if quiet else (log.warning, log.info)
        try:
            dir_fd = open_owned_dir(self.directory, "index copy directory", self.FIX)
        except OSError as e:
            warn("the index is held in memory: %s", e)
            return None
        copy = -1
        try:
            if reuse is not None and (kept := self._kept_map(dir_fd, reuse)) is not None:
                return kept, bytes.fromhex(reuse)
            if _on_memory_fs(dir_fd):
                say("the index is held in memory: %s is in memory itself (tmpfs)", self.directory)
                return None
            # O_EXCL: never to be linked, unless it is to be kept.  Mode 0400 from the start: reopened through
            # /proc/PID/fd, it is not writable (but by root); this descriptor is.
            unlinkable = 0 if keep else os.O_EXCL
            try:
                copy = os.open(".", os.O_TMPFILE | unlinkable | os.O_RDWR | os.O_CLOEXEC, 0o400, dir_fd=dir_fd)
            except OSError as e:  # no O_TMPFILE on this filesystem (EOPNOTSUPP, EISDIR on old kernels)
                say("the index is held in memory: no unnamed file in %s (%s)", self.directory, e.strerror)
                return None
            held = hashing = None
            try:
                if not size:
                    return None
                os.fchmod(copy, 0o400)  # whatever the umask made of it
                os.ftruncate(copy, size)  # mapped before it is filled, so each piece is hashed as soon as it is copied
                held = mmap.mmap(copy, size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ, **_NO_FD)
                hashing = dg.FillingDigest(held, _unmapper(held) if release else None) if hashed else None
                _copy(fd, copy, size, hashing.filled if hashing is not None else None)
                got = hashing.digest() if hashing is not None else None
                hashing = None
                if got is not None and keep and (keep is True or got.hex() == keep):
                    kept_fd = self._kept_dir(dir_fd, create=True)
                    if kept_fd is not None:
                        try:
                            kc.keep(kept_fd, copy, got.hex(), self.kept_count, self.kept_bytes)
                        except OSError as e:  # the copy serves this mount all the same
                            log.info("the index copy is not kept for the next mount: %s", e.strerror or e)
                        finally:
                            os.close(kept_fd)
                return held, got
            except OSError as e:  # ENOSPC, EIO, EDQUOT...: no copy, the index is read into memory instead
                warn("the index is held in memory: cannot copy it to %s: %s", self.directory, e.strerror or e)
                return None
            finally:
                if hashing is not None:  # failed: nothing may hash the map once it is closed
                    hashing.abandon()
                    if held is not None:
                        held.close()
        finally:
            # The map keeps the file; with no descriptor (and no name unless kept), nothing else reaches it.
            if copy >= 0:
                os.close(copy)
            os.close(dir_fd)


def _unmapper(held: mmap.mmap) -> Callable[[int, int], None]:
    """Drops a hashed piece's pages from this process's map (a pack's seed, which only hashes it): the
    page cache keeps them, but a map's touched pages count in the process's resident memory, and a 10 M
    index's 1.5 GB would be most of the pack's peak."""

    def drop(start: int, end: int) -> None:
        start -= start % mmap.PAGESIZE  # a piece may end mid-page: that page is dropped twice, harmlessly
        held.madvise(mmap.MADV_DONTNEED, start, end - start)

    return drop


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
