"""Directories a blockfs process writes in, checked as ssh's StrictModes checks ``~/.ssh``.

A directory blockfs writes or deletes in (the disk tier's ``--disk-cache DIR``, a mount's log directory)
must be one no other user can change under it: not a symbolic link, owned by this process's effective
user, writable by no one else, and reached through parents that no other user can rename or replace
(each owned by root or by this user, and writable by others only with the sticky bit, as ``/tmp`` is).
Everything inside is then opened relative to the directory's descriptor with ``O_NOFOLLOW``, so neither a
link planted inside nor a parent renamed after the check can send a write or a delete elsewhere.

Refusals are one line naming the path and the fix (:class:`UnsafeDirectoryError`).
"""

from __future__ import annotations

import errno
import os
import stat
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from typing import BinaryIO

from ..errors import BlockfsError

DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
# A directory the user named (a dataset, ``pack``'s DEST): followed if it is a link, as ``cp`` follows one;
# the names blockfs writes inside it never are.
USER_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC


class UnsafeDirectoryError(BlockfsError, PermissionError):
    """A directory blockfs would write in is not this user's alone."""

    errno = errno.EACCES

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.errno = errno.EACCES


def _refuse(path: str, what: str, why: str, fix: str) -> UnsafeDirectoryError:
    return UnsafeDirectoryError(f"{what} {path!r} {why}: {fix}")


def check_owned(st: os.stat_result, path: str, what: str, fix: str) -> None:
    """Raise unless ``st`` is a directory of this effective user that no one else may write in."""
    if stat.S_ISLNK(st.st_mode):
        raise _refuse(path, what, "is a symbolic link", f"use the directory itself, not a link to it; {fix}")
    if not stat.S_ISDIR(st.st_mode):
        raise _refuse(path, what, "is not a directory", fix)
    euid = os.geteuid()
    if st.st_uid != euid:
        raise _refuse(
            path, what, f"is owned by uid {st.st_uid}, not by this user (uid {euid})", f"chown {euid} it, or {fix}"
        )
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        raise _refuse(
            path, what, f"is writable by other users (mode {stat.S_IMODE(st.st_mode):04o})", f"chmod go-w it, or {fix}"
        )


def check_parents(path: str, what: str, fix: str) -> None:
    """Raise unless no other user can rename or replace ``path`` by changing one of its parents."""
    euid = os.geteuid()
    parent = os.path.dirname(path)
    while True:
        st = os.stat(parent)
        writable = st.st_mode & (stat.S_IWGRP | stat.S_IWOTH)
        if st.st_uid not in (0, euid) or (writable and not st.st_mode & stat.S_ISVTX):
            raise _refuse(
                path,
                what,
                f"lies in {parent!r}, which another user can change (uid {st.st_uid}, "
                f"mode {stat.S_IMODE(st.st_mode):04o})",
                fix,
            )
        up = os.path.dirname(parent)
        if up == parent:
            return
        parent = up


def user_cache_directory(env: str, name: str) -> str | None:
    """``$env`` (none when set empty), else ``$XDG_CACHE_HOME/blockfs/<name>``, else
    ``~/.cache/blockfs/<name>``: where a kind of per-user record or copy goes (opened by :func:`open_owned_dir`)."""
    chosen = os.environ.get(env)
    if chosen is not None:
        return chosen or None
    cache = os.environ.get("XDG_CACHE_HOME")
    if not cache or not os.path.isabs(cache):
        cache = os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(cache, "blockfs", name)


def open_owned_dir(path: str | os.PathLike, what: str, fix: str, *, create: bool = True) -> int:
    """A descriptor of the directory ``path`` once it passes the checks above; created 0700 if missing
    (with its parents) when ``create``.  The caller closes it."""
    path = os.path.abspath(os.fspath(path))
    # The parents by their real path (a parent may be a link, as /var/run is); the directory itself not.
    path = os.path.join(os.path.realpath(os.path.dirname(path)), os.path.basename(path))
    if create:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        try:
            os.mkdir(path, 0o700)
        except FileExistsError:
            pass
    check_parents(path, what, fix)
    try:
        fd = os.open(path, DIR_FLAGS)
    except OSError as e:
        if e.errno in (errno.ELOOP, errno.ENOTDIR):
            check_owned(os.lstat(path), path, what, fix)  # says which
        raise
    return _owned_or_closed(fd, path, what, fix)


def _owned_or_closed(fd: int, path: str, what: str, fix: str) -> int:
    """``fd`` if the directory it holds passes :func:`check_owned`; otherwise closed, and the refusal raised."""
    try:
        check_owned(os.fstat(fd), path, what, fix)
    except BaseException:
        os.close(fd)
        raise
    return fd


def open_owned_subdir(dir_fd: int, name: str, path: str, what: str, fix: str, *, create: bool = True) -> int:
    """A descriptor of the directory ``name`` in ``dir_fd`` (``path`` names it in messages), checked as
    :func:`open_owned_dir` checks; created 0700 if missing when ``create``."""
    if create:
        try:
            os.mkdir(name, 0o700, dir_fd=dir_fd)
        except FileExistsError:
            pass
    try:
        fd = os.open(name, DIR_FLAGS, dir_fd=dir_fd)
    except OSError as e:
        if e.errno in (errno.ELOOP, errno.ENOTDIR):
            check_owned(os.stat(name, dir_fd=dir_fd, follow_symlinks=False), path, what, fix)
        raise
    return _owned_or_closed(fd, path, what, fix)


NEW_FILE_FLAGS = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC


@contextmanager
def created_at(dir_fd: int, name: str, *, mode: int = 0o600, sync: bool = True) -> Iterator[BinaryIO]:
    """A new file to write ``name`` in ``dir_fd`` through: made under a temporary name (``O_EXCL|O_NOFOLLOW``),
    then flushed, ``fsync``ed if ``sync``, and renamed over ``name`` when the block ends; removed if it raises.
    Never seen half-written; a link or a hard link planted at ``name`` is replaced, never written through."""
    temp = temp_name(name)
    f = open(os.open(temp, NEW_FILE_FLAGS, mode, dir_fd=dir_fd), "wb")
    try:
        yield f
        f.flush()
        if sync:
            os.fsync(f.fileno())
    except BaseException:
        f.close()
        os.unlink(temp, dir_fd=dir_fd)
        raise
    f.close()
    os.rename(temp, name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)


def write_file_at(dir_fd: int, name: str, pieces: tuple, *, mode: int = 0o600, sync: bool = True) -> None:
    """Write ``pieces`` to ``name`` in ``dir_fd`` as :func:`created_at` does."""
    with created_at(dir_fd, name, mode=mode, sync=sync) as f:
        for piece in pieces:
            f.write(piece)


def remove_at(dir_fd: int, name: str) -> None:
    """Remove ``name`` in ``dir_fd`` whatever it is, a directory with all it holds included, following no
    link: a planted link is removed itself, never what it points to; nothing there is no error."""
    try:
        os.unlink(name, dir_fd=dir_fd)
        return
    except FileNotFoundError:
        return
    except IsADirectoryError:
        pass
    fd = os.open(name, DIR_FLAGS, dir_fd=dir_fd)
    try:
        for entry in os.scandir(fd):
            remove_at(fd, entry.name)
    finally:
        os.close(fd)
    os.rmdir(name, dir_fd=dir_fd)


TEMP_MARK = ".tmp-"


def temp_name(name: str) -> str:
    import threading

    return f"{name}{TEMP_MARK}{os.getpid()}-{threading.get_ident()}"


def is_temp_name(name: str) -> bool:
    """Whether ``name`` is one :func:`temp_name` makes (left behind by a crash)."""
    stem, mark, tail = name.rpartition(TEMP_MARK)
    pid, dash, tid = tail.partition("-")
    return bool(stem and mark and dash and pid.isdigit() and tid.isdigit())


def read_file_at(dir_fd: int, name: str, limit: int = 1 << 20) -> bytes:
    """The bytes of the regular file ``name`` in ``dir_fd`` (not a link, a FIFO or a device: OSError)."""
    fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=dir_fd)
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise OSError(errno.EINVAL, f"{name} is not a regular file")
        return os.read(fd, limit)
    finally:
        os.close(fd)


def read_regular_at(dir_fd: int, name: str) -> bytes | None:
    """All of the regular file ``name`` in ``dir_fd``, or None when there is none (or it is a link, a FIFO,
    a device, or unreadable): for files kept to be reused only if they prove right."""
    try:
        fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=dir_fd)
    except OSError:
        return None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return None
        pieces = []
        while chunk := os.read(fd, 16 << 20):
            pieces.append(chunk)
        return b"".join(pieces)
    except OSError:
        return None
    finally:
        os.close(fd)


def regular_files_at(dir_fd: int, names: Iterable[str]) -> list[tuple[int, str]]:
    """``(mtime_ns, name)`` of each of ``names`` under ``dir_fd`` that is a regular file, links never
    followed (a name that vanished or is anything else is left out): what an owned directory may age out."""
    found = []
    for name in names:
        try:
            st = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
        except OSError:
            continue
        if stat.S_ISREG(st.st_mode):
            found.append((st.st_mtime_ns, name))
    return found


def unlink_quietly_at(dir_fd: int, names: Iterable[str]) -> None:
    """Remove each of ``names`` under ``dir_fd``; one already gone (or refused) is left to the next sweep."""
    for name in names:
        try:
            os.unlink(name, dir_fd=dir_fd)
        except OSError:
            pass
