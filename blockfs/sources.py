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

from .errors import PackError, SourceError
from .index import KIND_DIR, KIND_FILE, KIND_SYMLINK

log = logging.getLogger(__name__)


@dataclass
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
    """The packer's view of its input."""

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

    def entries(self) -> Iterator[SourceEntry]:
        st = self._root_stat
        yield SourceEntry(b"", KIND_DIR, st.st_mode, st.st_mtime_ns)
        # With --follow-symlinks a link may lead back to one of its own ancestors: refuse that cycle.
        stack = [(b"", ((st.st_dev, st.st_ino),))]
        while stack:
            rel, ancestors = stack.pop()
            try:
                with os.scandir(os.path.join(self.root, rel) if rel else self.root) as it:
                    names = sorted(e.name for e in it)
            except OSError as e:
                raise PackError(
                    f"cannot list directory {os.fsdecode(os.path.join(self.root, rel))!r}: {e.strerror}"
                ) from e
            subdirs = []
            for name in names:
                path = rel + b"/" + name if rel else name
                entry = self._entry(path)
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

    def _entry(self, path: bytes) -> SourceEntry | None:
        full = os.path.join(self.root, path)
        try:
            st = os.stat(full) if self.follow_symlinks else os.lstat(full)
        except FileNotFoundError:
            if self.follow_symlinks:  # a dangling link: keep it as a link
                st = os.lstat(full)
            else:
                raise PackError(f"{os.fsdecode(full)!r} vanished while packing") from None
        mode = st.st_mode
        if stat.S_ISREG(mode):
            key = (st.st_dev, st.st_ino) if st.st_nlink > 1 else None
            return SourceEntry(path, KIND_FILE, mode, st.st_mtime_ns, st.st_size, hardlink_key=key)
        if stat.S_ISDIR(mode):
            return SourceEntry(path, KIND_DIR, mode, st.st_mtime_ns, hardlink_key=(st.st_dev, st.st_ino))
        if stat.S_ISLNK(mode):
            return SourceEntry(path, KIND_SYMLINK, mode, st.st_mtime_ns, link_target=os.readlink(full))
        self._skipped.append(path)
        return None

    def read_into(self, entry: SourceEntry, buf: memoryview, offset: int = 0) -> int:
        flags = os.O_RDONLY | (0 if self.follow_symlinks else os.O_NOFOLLOW)
        fd = os.open(os.path.join(self.root, entry.path), flags)
        try:
            done = 0
            while done < len(buf):
                n = os.preadv(fd, [buf[done:]], offset + done)
                if n == 0:
                    break
                done += n
            return done
        finally:
            os.close(fd)

    def skipped(self) -> list[bytes]:
        return list(self._skipped)
