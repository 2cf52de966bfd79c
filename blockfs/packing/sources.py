"""What ``pack`` reads from: a source lists entries (metadata only) and reads a file's bytes on demand.

A source is anything with ``entries()`` and ``read_into()``; the packer never looks inside it otherwise.
:class:`DirectorySource` walks a directory tree.  Container formats (tar, RecordIO, ...) are other sources
with the same two methods.
"""

from __future__ import annotations

import logging
import os
import stat
from dataclasses import dataclass
from typing import Iterator, Protocol

from ..errors import PackError, SourceError
from ..core.index import KIND_DIR, KIND_FILE, KIND_SYMLINK

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


class Source(Protocol):
    """The packer's view of its input.

    A source may also set ``forkable = True`` when ``read_into`` works in forked copies of it at once
    (it only ``pread``s descriptors it opened earlier: no shared file offsets, no locks); the packer then
    writes blocks in worker processes instead of threads.
    """

    description: str

    def entries(self) -> Iterator[SourceEntry]:
        """Every entry, parents before children (the root may be omitted)."""

    def read_into(self, entry: SourceEntry, buf: memoryview, offset: int = 0) -> int:
        """Read ``len(buf)`` bytes of the file from ``offset`` into ``buf``; return how many were read.

        Thread-safe: the packer calls it from several writer threads.  Raises OSError when unreadable.
        """

    def skipped(self) -> list[bytes]:
        """Paths seen but not packed (sockets, FIFOs, devices), for one warning."""


class DirectorySource:
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
        self._root_stat = st
        self._root_fd = os.open(self.root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        self._open_flags = os.O_RDONLY | os.O_CLOEXEC | (0 if follow_symlinks else os.O_NOFOLLOW)

    def __del__(self) -> None:
        fd = getattr(self, "_root_fd", None)
        if fd is not None:
            os.close(fd)

    def entries(self) -> Iterator[SourceEntry]:
        st = self._root_stat
        yield SourceEntry(b"", KIND_DIR, st.st_mode, st.st_mtime_ns)
        # With --follow-symlinks a link may lead back to one of its own ancestors: refuse that cycle.
        stack = [(b"", ((st.st_dev, st.st_ino),))]
        while stack:
            rel, ancestors = stack.pop()
            where = os.path.join(self.root, rel) if rel else self.root
            try:
                with os.scandir(where) as it:
                    found = sorted(it, key=lambda d: d.name)
            except OSError as e:
                raise PackError(f"cannot list directory {os.fsdecode(where)!r}: {e.strerror}") from e
            subdirs = []
            for dirent in found:
                path = rel + b"/" + dirent.name if rel else dirent.name
                entry = self._entry(path, dirent)
                if entry is None:
                    continue
                yield entry
                if entry.kind == KIND_DIR:
                    if entry.hardlink_key in ancestors:
                        raise PackError(
                            f"directory cycle through a symlink at {os.fsdecode(path)!r}: "
                            "pack without --follow-symlinks"
                        )
                    subdirs.append((path, ancestors + (entry.hardlink_key,)))
            # Depth-first, in sorted order (the stack pops the last pushed first).
            stack.extend(reversed(subdirs))

    def _entry(self, path: bytes, dirent: os.DirEntry) -> SourceEntry | None:
        try:
            st = dirent.stat(follow_symlinks=self.follow_symlinks)
        except FileNotFoundError:
            if not self.follow_symlinks:
                raise PackError(f"{os.fsdecode(dirent.path)!r} vanished while packing") from None
            st = dirent.stat(follow_symlinks=False)  # a dangling link: keep it as a link
        mode = st.st_mode
        if stat.S_ISREG(mode):
            key = (st.st_dev, st.st_ino) if st.st_nlink > 1 else None
            return SourceEntry(path, KIND_FILE, mode, st.st_mtime_ns, st.st_size, hardlink_key=key)
        if stat.S_ISDIR(mode):
            return SourceEntry(path, KIND_DIR, mode, st.st_mtime_ns, hardlink_key=(st.st_dev, st.st_ino))
        if stat.S_ISLNK(mode):
            return SourceEntry(path, KIND_SYMLINK, mode, st.st_mtime_ns, link_target=os.readlink(dirent.path))
        self._skipped.append(path)
        return None

    def read_into(self, entry: SourceEntry, buf: memoryview, offset: int = 0) -> int:
        # Relative to the root's descriptor: no path joining, and a shorter lookup in the kernel.
        fd = os.open(entry.path, self._open_flags, dir_fd=self._root_fd)
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

    def skipped(self) -> list[bytes]:
        return list(self._skipped)
