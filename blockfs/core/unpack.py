"""``blockfs unpack``: write a packed dataset back out as the tree it was packed from.

The index is input, and a forged one must not make ``unpack`` write outside OUT.  Opening the index checks
that its entries form a tree (:mod:`.treecheck`); this module does not rely on that.  Every entry is
created by name inside a descriptor of its parent directory, reached from OUT one component at a time
with ``O_NOFOLLOW | O_DIRECTORY``; files are created with ``O_CREAT | O_EXCL | O_NOFOLLOW``; and symlinks
are created after everything else, so no symlink the unpack makes can redirect a later step, and a name
the index lists twice is an error, never an overwrite.

Hard links are made only between entries stored at the same (block, slot) with the same inode number:
the inode column alone is one damaged byte away from linking two different files.
"""

from __future__ import annotations

import errno
import os
from collections.abc import Callable

from ..errors import BlockfsError
from .dataset import PackedDataset
from .index import KIND_DIR, KIND_FILE, KIND_SYMLINK

_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_NEW_FILE_FLAGS = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC


class UnpackError(BlockfsError, OSError):
    """An entry cannot be created under OUT as the index describes it (the message names it)."""

    errno = errno.EIO  # BlockfsError's, restated: OSError's would be None (made with a message alone)


def unpack(ds: PackedDataset, out: str | os.PathLike, on_file: Callable[[int], object] | None = None) -> int:
    """Recreate the tree under ``out`` (which must be empty or absent); return the number of entries.

    Contents, modes, mtimes (ns), symlinks and hard links come back as packed.  Directory modes and
    times are set last, deepest first, so writing their children does not change them.
    """
    out_name = os.fsencode(out)
    if os.path.exists(out_name) and (not os.path.isdir(out_name) or os.listdir(out_name)):
        raise BlockfsError(f"output {os.fsdecode(out_name)!r} exists and is not an empty directory")
    os.makedirs(out_name, exist_ok=True)
    with _Tree(ds, os.fsdecode(out_name)) as tree:
        kind = ds.index.arrays["kind"]
        symlinks = []
        for e in range(1, ds.index.n_entries):
            k = int(kind[e])
            if k == KIND_SYMLINK:
                symlinks.append(e)  # last: nothing may be created through a symlink this unpack made
                continue
            if k == KIND_DIR:
                tree.make_dir(e)
            elif k == KIND_FILE:
                tree.make_file(e)
            if on_file is not None:
                on_file(e)
        for e in symlinks:
            tree.make_symlink(e)
            if on_file is not None:
                on_file(e)
        for e in reversed(range(ds.index.n_entries)):
            if int(kind[e]) == KIND_DIR:
                tree.finish_dir(e)
    return ds.index.n_entries - 1


class _Tree:
    """OUT's descriptor, the parent directory descriptor in use, and the files written so far."""

    def __init__(self, ds: PackedDataset, out: str) -> None:
        self.ds = ds
        self.out = out
        self.a = ds.index.arrays
        self.root_fd = os.open(out, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        # The directory in use (path, descriptor): the index lists siblings together.
        self._dir: tuple[bytes, int] = (b"", self.root_fd)
        self._written: dict[tuple[int, int, int], tuple[bytes, bytes]] = {}  # (block, slot, ino) -> (dir, name)

    def __enter__(self) -> _Tree:
        return self

    def __exit__(self, *exc: object) -> None:
        self._close_dir()
        os.close(self.root_fd)

    # --- creating entries ----------------------------------------------------------------------
    def make_dir(self, e: int) -> None:
        parent, name = self._where(e)
        self._do(e, lambda: os.mkdir(name, 0o700, dir_fd=parent))

    def make_symlink(self, e: int) -> None:
        parent, name = self._where(e)
        target = self.ds.index.link_target(e)
        mtime = int(self.a["mtime_ns"][e])

        def create() -> None:
            os.symlink(target, name, dir_fd=parent)
            os.utime(name, ns=(mtime, mtime), dir_fd=parent, follow_symlinks=False)

        self._do(e, create)

    def make_file(self, e: int) -> None:
        parent, name = self._where(e)
        # Only files the index says are linked are remembered: a million files need no million keys.
        linked = int(self.a["nlink"][e]) > 1
        key = (int(self.a["block"][e]), int(self.a["slot"][e]), int(self.a["ino"][e]))
        first = self._written.get(key) if linked else None
        if first is not None:
            self._do(e, lambda: self._link(first, parent, name))
            return
        fd = self._do(e, lambda: os.open(name, _NEW_FILE_FLAGS, 0o600, dir_fd=parent))
        with open(fd, "wb") as f:
            self._write_contents(e, f)
            f.flush()
            mtime = int(self.a["mtime_ns"][e])
            os.fchmod(fd, int(self.a["mode"][e]) & 0o7777)
            os.utime(fd, ns=(mtime, mtime))
        if linked:
            self._written[key] = (self._dir[0], name)

    def finish_dir(self, e: int) -> None:
        """Set a directory's mode and times (after its children: creating them changes the times)."""
        fd = self.root_fd if e == 0 else self._do(e, lambda: self._open_dir(self.ds.path_of(e)))
        try:
            mtime = int(self.a["mtime_ns"][e])
            os.fchmod(fd, int(self.a["mode"][e]) & 0o7777)
            os.utime(fd, ns=(mtime, mtime))
        finally:
            if fd != self.root_fd:
                os.close(fd)

    def _link(self, first: tuple[bytes, bytes], parent: int, name: bytes) -> None:
        source_fd = self._open_dir(first[0])
        try:
            os.link(first[1], name, src_dir_fd=source_fd, dst_dir_fd=parent, follow_symlinks=False)
        finally:
            if source_fd != self.root_fd:
                os.close(source_fd)

    def _write_contents(self, e: int, f) -> None:
        for data in self.ds.read_pieces(e):  # stops on a short read: never loops, never writes less
            f.write(data)

    # --- finding the parent --------------------------------------------------------------------
    def _where(self, e: int) -> tuple[int, bytes]:
        """The descriptor of entry ``e``'s parent directory (reached without following links), and its name."""
        directory, name = self._split(e)
        if self._dir[0] != directory:
            self._close_dir()
            self._dir = (directory, self._do(e, lambda: self._open_dir(directory)))
        return self._dir[1], name

    def _split(self, e: int) -> tuple[bytes, bytes]:
        path = self.ds.path_of(e)
        parts = path.split(b"/")
        if any(p in (b"", b".", b"..") or b"\0" in p for p in parts):
            raise UnpackError(f"refusing to unpack {os.fsdecode(path)!r}: not a plain relative path")
        directory, _, name = path.rpartition(b"/")
        return directory, name

    def _open_dir(self, directory: bytes) -> int:
        """A new descriptor of ``directory`` under OUT (OUT's own for b""), one component at a time."""
        if not directory:
            return self.root_fd
        fd = self.root_fd
        for part in directory.split(b"/"):
            try:
                child = os.open(part, _DIR_FLAGS, dir_fd=fd)
            finally:
                if fd != self.root_fd:
                    os.close(fd)
            fd = child
        return fd

    def _close_dir(self) -> None:
        if self._dir[1] != self.root_fd:
            os.close(self._dir[1])
        self._dir = (b"", self.root_fd)

    def _do(self, e: int, step: Callable[[], object]):
        """Run a step that creates or opens entry ``e`` (or its parent); an OSError names the entry."""
        try:
            return step()
        except OSError as err:
            path = os.fsdecode(self.ds.path_of(e))
            why = _FORGED.get(err.errno) if err.errno is not None else None
            detail = f"{why}; the dataset's index is damaged or forged" if why else err.strerror
            raise UnpackError(f"cannot unpack {path!r} into {self.out!r}: {detail}") from err


_FORGED = {  # what these errors mean when OUT started empty and only this unpack writes to it
    errno.EEXIST: "it already exists (the index names it twice, or another process made it meanwhile)",
    errno.ENOTDIR: "a directory on its path is not a directory",
    errno.ELOOP: "a directory on its path is a symlink",
    errno.ENOENT: "its parent directory does not exist (or is a symlink, made last)",
}
