"""What ``pack`` reads from: a source lists entries (metadata only) and reads a file's bytes on demand.

A source is a :class:`Source`: it implements ``entries()`` and ``read_into()``, and declares the optional
features the packer uses; the packer never looks inside it otherwise.  :class:`DirectorySource` walks a
directory tree.  Container formats (tar, RecordIO, ...) are other subclasses (:mod:`.containers`).

SRC may change while it is packed, by accident or by someone racing the pack.  Without
``--follow-symlinks`` nothing outside SRC may be read: the walk lists each directory through a descriptor
opened beneath SRC's with no symlink followed (:mod:`.beneath`), files are opened the same way, and each
opened directory or file must be the one the walk saw (same device and inode), or it is refused.
"""

from __future__ import annotations

import errno
import logging
import os
import stat
from abc import ABC, abstractmethod
from collections.abc import Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass

from ..core.index import KIND_DIR, KIND_FILE, KIND_SYMLINK
from ..errors import PackError, SourceError
from .beneath import has_openat2, open_beneath

log = logging.getLogger(__name__)


@dataclass(slots=True)
class SourceEntry:
    """One node of the tree to pack.  ``path`` is relative, "/"-separated bytes; b"" is the root."""

    path: bytes
    kind: int  # KIND_FILE, KIND_DIR or KIND_SYMLINK
    mode: int  # full st_mode, type bits included
    mtime_ns: int
    size: int = 0
    link_target: bytes = b""
    hardlink_key: object = None  # entries with the same key share one stored copy
    label: int = -1  # a label the source itself knows (RecordIO headers); -1 = none
    identity: tuple[int, int] | None = None  # (st_dev, st_ino) the walk saw; the file read must be it


class SourceChangedError(SourceError, OSError):
    """A file or directory of SRC is not the one the walk listed (swapped, or a symlink on its path)."""

    errno = errno.EIO  # BlockfsError's, restated: OSError's would be None (made with a message alone)


class Source(ABC):
    """The packer's view of its input: what every source must do, and what it may offer.

    A subclass must implement :meth:`entries` and :meth:`read_into`, and should set ``description`` (it
    names the source in error messages).  Everything else has a default that means "not offered", so
    ``pack`` asks every source the same way instead of probing for attributes:

    - ``forkable = True`` when ``read_into`` works in forked copies of the source at once (it only
      ``pread``s descriptors it opened earlier, or opens files itself: no shared file offsets, no locks);
      the packer then writes blocks in worker processes instead of threads.
    - ``provides_labels = True`` when the entries carry their own labels (RecordIO headers, WebDataset
      ``.cls``); ``pack`` then keeps them unless told ``--labels none`` or a CSV.
    - :meth:`reading`: the order the files will be read in, for a source that fetches ahead.
    - :meth:`skipped`, :meth:`damaged`: what was left out, for one warning each.
    - :meth:`write_metadata`: side files written into the dataset, and what ``blockfs.json`` records.

    A base class rather than a Protocol so that these defaults live in one place; a class that only
    has the two methods is refused by ``pack`` with a TypeError that says to subclass this.
    """

    description: str = "a custom source"
    forkable: bool = False
    provides_labels: bool = False

    @abstractmethod
    def entries(self) -> Iterator[SourceEntry]:
        """Every entry, parents before children (the root may be omitted)."""

    @abstractmethod
    def read_into(self, entry: SourceEntry, buf: memoryview, offset: int = 0) -> int:
        """Read ``len(buf)`` bytes of the file from ``offset`` into ``buf``; return how many were read.

        Thread-safe: the packer calls it from several writer threads.  Raises OSError when unreadable.
        """

    def reading(self, order: Sequence[SourceEntry]) -> AbstractContextManager[object]:
        """While the context is open, files are read about in ``order``: each once (a large one in pieces),
        a block's files in order, several blocks at once, blocks started in order.  A source whose reads have latency (objects in a store) may fetch
        ahead; by default nothing happens."""
        return nullcontext()

    def skipped(self) -> list[bytes]:
        """Paths seen but not packed (sockets, FIFOs, devices), for one warning."""
        return []

    def damaged(self) -> list[str]:
        """Damaged parts stepped over (``--skip-damaged``), each naming where, for one warning."""
        return []

    def write_metadata(self, dest: str, fsync: bool) -> dict | None:
        """Write side files into ``dest`` before its metadata (fsynced if ``fsync``); return what
        ``blockfs.json`` records under ``"source"``, or None to record nothing."""
        return None


class DirectorySource(Source):
    """A directory tree on a local filesystem, walked in sorted (byte) order."""

    forkable = True  # read_into opens each file itself, relative to a descriptor of the root

    def __init__(self, root: str | os.PathLike, follow_symlinks: bool = False) -> None:
        self.root = os.fsencode(root)
        self.follow_symlinks = follow_symlinks
        self.description = os.fsdecode(self.root)
        self._skipped: list[bytes] = []
        try:
            st = os.stat(self.root)
        except FileNotFoundError:
            raise SourceError(f"source {self.description!r} does not exist") from None
        if not stat.S_ISDIR(st.st_mode):
            raise SourceError(
                f"source {self.description!r} is not a directory (tar, RecordIO and WebDataset "
                "sources are not supported by this version)"
            )
        self._root_fd = os.open(self.root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        self._root_stat = os.fstat(self._root_fd)  # the directory opened, whatever the path means later
        self._open_flags = os.O_RDONLY | os.O_CLOEXEC | (0 if follow_symlinks else os.O_NOFOLLOW)
        self._openat2 = not follow_symlinks and has_openat2(self._root_fd)  # asked once, before any fork

    def __del__(self) -> None:
        fd = getattr(self, "_root_fd", None)
        if fd is not None:
            os.close(fd)

    def entries(self) -> Iterator[SourceEntry]:
        st = self._root_stat
        yield SourceEntry(b"", KIND_DIR, st.st_mode, st.st_mtime_ns, identity=(st.st_dev, st.st_ino))
        # With --follow-symlinks a link may lead back to one of its own ancestors: refuse that cycle.
        stack: list[tuple[bytes, tuple[tuple[int, int], ...]]] = [(b"", ((st.st_dev, st.st_ino),))]
        while stack:
            rel, ancestors = stack.pop()
            subdirs: list[tuple[bytes, tuple[tuple[int, int], ...]]] = []
            with self._listing(rel, ancestors[-1]) as (found, dir_fd):
                for dirent in found:
                    name = os.fsencode(dirent.name)  # str when listed through a descriptor
                    path = rel + b"/" + name if rel else name
                    entry = self._entry(path, dirent, dir_fd)
                    if entry is None:
                        continue
                    yield entry
                    if entry.kind == KIND_DIR:
                        assert entry.identity is not None  # _entry gives every directory its identity
                        if entry.identity in ancestors:
                            raise PackError(
                                f"directory cycle through a symlink at {os.fsdecode(path)!r}: "
                                "pack without --follow-symlinks"
                            )
                        subdirs.append((path, ancestors + (entry.identity,)))
            # Depth-first, in sorted order (the stack pops the last pushed first).
            stack.extend(reversed(subdirs))

    @contextmanager
    def _listing(self, rel: bytes, identity: tuple[int, int]) -> Iterator[tuple[list[os.DirEntry], int | None]]:
        """The sorted entries of directory ``rel``, and a descriptor they are relative to (None: by path).

        Without --follow-symlinks the directory is opened beneath the root and must be the one its
        parent's listing showed: a directory swapped for a symlink since is refused, not followed.
        """
        if self.follow_symlinks:
            where = os.path.join(self.root, rel) if rel else self.root
            try:
                with os.scandir(where) as it:
                    found: list[os.DirEntry] = sorted(it, key=lambda d: d.name)
            except OSError as e:
                raise PackError(f"cannot list directory {os.fsdecode(where)!r}: {e.strerror}") from e
            yield found, None
            return
        try:
            fd = (
                open_beneath(self._root_fd, rel, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC, self._openat2)
                if rel
                else os.dup(self._root_fd)
            )
        except OSError as e:
            raise self._changed(rel, e) from e
        try:
            st = os.fstat(fd)
            if (st.st_dev, st.st_ino) != identity:
                raise self._changed(rel)
            try:
                with os.scandir(fd) as it:
                    found = sorted(it, key=lambda d: os.fsencode(d.name))  # byte order, as by path
            except OSError as e:
                raise PackError(
                    f"cannot list directory {os.fsdecode(os.path.join(self.root, rel))!r}: {e.strerror}"
                ) from e
            yield found, fd
        finally:
            os.close(fd)

    def _entry(self, path: bytes, dirent: os.DirEntry, dir_fd: int | None) -> SourceEntry | None:
        try:
            st = dirent.stat(follow_symlinks=self.follow_symlinks)
        except FileNotFoundError:
            if not self.follow_symlinks:
                raise PackError(f"{os.fsdecode(os.path.join(self.root, path))!r} vanished while packing") from None
            st = dirent.stat(follow_symlinks=False)  # a dangling link: keep it as a link
        mode = st.st_mode
        identity = (st.st_dev, st.st_ino)
        if stat.S_ISREG(mode):
            key = identity if st.st_nlink > 1 else None
            return SourceEntry(path, KIND_FILE, mode, st.st_mtime_ns, st.st_size, hardlink_key=key, identity=identity)
        if stat.S_ISDIR(mode):
            return SourceEntry(path, KIND_DIR, mode, st.st_mtime_ns, hardlink_key=identity, identity=identity)
        if stat.S_ISLNK(mode):
            target = (
                os.readlink(os.fsencode(dirent.name), dir_fd=dir_fd) if dir_fd is not None else os.readlink(dirent.path)
            )
            return SourceEntry(path, KIND_SYMLINK, mode, st.st_mtime_ns, link_target=target)
        self._skipped.append(path)
        return None

    def read_into(self, entry: SourceEntry, buf: memoryview, offset: int = 0) -> int:
        fd = self._open(entry)
        try:
            done = os.preadv(fd, [buf], offset)
            while 0 < done < len(buf):
                n = os.preadv(fd, [buf[done:]], offset + done)
                if n == 0:
                    break
                done += n
            return done
        finally:
            os.close(fd)

    def _open(self, entry: SourceEntry) -> int:
        """Open the file ``entry`` names, and check it is the file the walk saw."""
        if self.follow_symlinks:
            # Relative to the root's descriptor: no path joining, and a shorter lookup in the kernel.
            fd = os.open(entry.path, self._open_flags, dir_fd=self._root_fd)
        else:
            try:
                fd = open_beneath(self._root_fd, entry.path, self._open_flags, self._openat2)
            except OSError as e:
                if e.errno in _SWAPPED:
                    raise self._changed(entry.path, e) from e
                raise
        if entry.identity is not None:
            st = os.fstat(fd)
            if (st.st_dev, st.st_ino) != entry.identity:
                os.close(fd)
                raise self._changed(entry.path)
        return fd

    def _changed(self, path: bytes, error: OSError | None = None) -> SourceChangedError:
        why = f" ({error.strerror})" if error is not None and error.strerror else ""
        return SourceChangedError(
            f"{os.fsdecode(path)!r} in {self.description!r} is not what the walk listed{why}: it was "
            "replaced, or a directory on its path became a symlink; pack a tree that is not being changed "
            "(or pass --skip-unreadable to leave such files out)"
        )

    def skipped(self) -> list[bytes]:
        return list(self._skipped)


# What opening beneath the root reports when a directory on the path is a symlink or not a directory.
_SWAPPED = {errno.ELOOP, errno.ENOTDIR, errno.EXDEV}
