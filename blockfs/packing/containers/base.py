"""What every container source shares: building a tree from member names, damage reports, exact preads."""

from __future__ import annotations

import os
import stat
from abc import abstractmethod
from collections.abc import Callable, Iterator

from ...core.index import KIND_DIR, KIND_FILE
from ...errors import SourceError
from ..sources import Source, SourceEntry

DIR_MODE = stat.S_IFDIR | 0o755  # directories a container implies but does not list
FILE_MODE = stat.S_IFREG | 0o644  # files of containers that hold no modes (RecordIO)


def clean_member_name(raw: bytes) -> bytes | None:
    """A member name as ``tar x`` would place it: no leading "/", no "." or empty parts.

    Returns None for a name with a ".." part, which ``tar x`` refuses to extract.
    """
    parts = [p for p in raw.split(b"/") if p not in (b"", b".")]
    if b".." in parts:
        return None
    return b"/".join(parts)


def pread_into(fd: int, buf: memoryview, offset: int) -> int:
    """Fill ``buf`` from ``fd`` at ``offset`` (short only at end of file); thread-safe."""
    done = 0
    while done < len(buf):
        n = os.preadv(fd, [buf[done:]], offset + done)
        if n == 0:
            break
        done += n
    return done


class ListedOnce(Source):
    """A container source whose entries come from one pass over it (``_load``), kept for later calls.

    Every container source derives from this, and so is a :class:`~blockfs.packing.sources.Source`.

    The packer asks for the entries once, but a CLI progress bar or a test may ask again: the archive
    is not re-read.
    """

    _entries: list[SourceEntry] | None = None

    def entries(self) -> Iterator[SourceEntry]:
        if self._entries is None:
            self._entries = self._load()
        return iter(self._entries)

    @abstractmethod
    def _load(self) -> list[SourceEntry]:
        """The container's entries, from one pass over it."""


class WindowReader:
    """Small reads at mostly increasing offsets served from one large ``pread`` window, so listing a
    container is sequential I/O (kernel readahead works) instead of one small random read per header."""

    def __init__(self, fd: int, window: int = 4 << 20, available: Callable[[int], int] | None = None) -> None:
        self._fd, self._window = fd, window
        self._available = available  # a file still being written: wait for its first N bytes, say how many exist
        self._start, self._buf = 0, b""

    def read(self, offset: int, n: int) -> bytes:
        i = offset - self._start
        if i < 0 or i + n > len(self._buf):
            want = max(n, self._window)
            if self._available is not None:
                want = max(0, self._available(offset + want) - offset)
            self._start, self._buf = offset, os.pread(self._fd, want, offset)
            i = 0
        return self._buf[i : i + n]

    def fill(self, buf: memoryview, offset: int) -> int:
        data = self.read(offset, len(buf))
        buf[: len(data)] = data
        return len(data)


class DamageLog:
    """Damaged regions of a container: an error by default, a list of what was skipped with --skip-damaged."""

    def __init__(self, where: str, skip: bool) -> None:
        self.where = where
        self.skip = skip
        self.items: list[str] = []

    def report(self, offset: int, problem: str, resume: Callable[[], int] | None = None) -> int:
        """Raise :class:`SourceError` naming the byte offset, or (skipping) record it.

        ``resume`` finds where reading goes on; its result is returned and named in the record.
        """
        message = f"{self.where}: byte offset {offset}: {problem}"
        if not self.skip:
            raise SourceError(f"{message}; pass --skip-damaged to pack the rest and list what is skipped")
        if resume is None:
            self.items.append(message)
            return -1
        nxt = resume()
        self.items.append(f"{message} (skipped {nxt - offset} bytes, resumed at byte offset {nxt})")
        return nxt


class TreeBuilder:
    """Entries by path in first-seen order, parents first; parent directories nobody listed are made up.

    A later entry of the same path replaces the earlier one (``tar x`` overwrites), except that
    directories merge and, with ``unique=True``, a second file of one path is an error.
    """

    def __init__(self, where: str, root_mtime_ns: int = 0) -> None:
        self.where = where
        self._by_path: dict[bytes, SourceEntry] = {b"": SourceEntry(b"", KIND_DIR, DIR_MODE, root_mtime_ns)}
        self._root_listed = False
        self._parents_with_children: set[bytes] = set()

    def get(self, path: bytes) -> SourceEntry | None:
        return self._by_path.get(path)

    def add(self, entry: SourceEntry, *, unique: bool = False) -> None:
        by_path = self._by_path
        if entry.path == b"":
            self.set_root(entry.mode, entry.mtime_ns)
            return
        self._make_parents(entry.path, entry.mtime_ns)
        old = by_path.get(entry.path)
        if old is not None:
            if old.kind == KIND_DIR and entry.kind == KIND_DIR:
                old.mode, old.mtime_ns = entry.mode, entry.mtime_ns
                return
            if unique or (old.kind == KIND_DIR and entry.path in self._parents_with_children):
                raise SourceError(
                    f"{self.where}: {os.fsdecode(entry.path)!r} appears twice ({_kind_word(old)} and "
                    f"{_kind_word(entry)}); a packed tree holds one entry per path"
                )
            del by_path[entry.path]
        by_path[entry.path] = entry

    def set_root(self, mode: int, mtime_ns: int) -> None:
        root = self._by_path[b""]
        root.mode, root.mtime_ns = stat.S_IFDIR | (mode & 0o7777), mtime_ns
        self._root_listed = True

    def _make_parents(self, path: bytes, mtime_ns: int) -> None:
        parent = path.rpartition(b"/")[0]
        self._parents_with_children.add(parent)
        if not self._root_listed and len(self._by_path) == 1:
            self._by_path[b""].mtime_ns = mtime_ns  # no root member: date the root like its first child
        missing = []
        while parent not in self._by_path:
            missing.append(parent)
            parent = parent.rpartition(b"/")[0]
        if self._by_path[parent].kind != KIND_DIR:
            raise SourceError(
                f"{self.where}: {os.fsdecode(path)!r} lies under {os.fsdecode(parent)!r}, which is not a directory"
            )
        for p in reversed(missing):
            self._parents_with_children.add(p.rpartition(b"/")[0])
            self._by_path[p] = SourceEntry(p, KIND_DIR, DIR_MODE, mtime_ns)

    def entries(self) -> list[SourceEntry]:
        return list(self._by_path.values())


def _kind_word(entry: SourceEntry) -> str:
    return {KIND_DIR: "a directory", KIND_FILE: "a file"}.get(entry.kind, "a symlink")
