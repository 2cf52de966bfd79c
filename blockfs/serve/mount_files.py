"""The files a mount keeps beside it: its private log directory (the default log of each mount point, old
logs aged out) and the fetched directory of a remote mount (its index and metadata, removed at unmount).

Both live in directories of this user's alone (:mod:`blockfs.storage.owned`), and every name is opened or
removed through a directory descriptor, never through a link.
"""

from __future__ import annotations

import errno
import hashlib
import logging
import os
import stat
import tempfile
import time

from ..errors import MountError
from ..storage.owned import open_owned_dir, regular_files_at, unlink_quietly_at

__all__ = ["default_log_path", "fetched_directory", "log_directory", "open_log", "remove_fetched"]

log = logging.getLogger(__name__)

LOG_KEEP_DAYS = 14  # a default log not written for this long is removed when the next mount starts
LOGS_KEPT = 64  # and only this many, the most recently written, are kept


def canonical(path: str | os.PathLike) -> str:
    """An absolute path with the parent resolved, without touching the last component (maybe a dead mount)."""
    path = os.path.abspath(os.fspath(path))
    parent, leaf = os.path.split(path)
    return os.path.join(os.path.realpath(parent), leaf)


def open_log(path: str | os.PathLike) -> int:
    """A descriptor to append to the log file ``path``: created 0600, never through a symbolic link."""
    path = os.fspath(path)
    try:
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise MountError(
                f"log file {path!r} is a symbolic link: give the file itself with --log, or remove the link"
            ) from None
        raise MountError(f"cannot open the log file {path!r}: {e.strerror or e}") from None
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise MountError(f"log file {path!r} is not a regular file: give another with --log")
    return fd


def log_directory() -> str:
    """Where background mounts log unless told: a directory of this user's alone, never the shared temp
    directory (where another user could plant a link at a predictable name)."""
    runtime = os.environ.get("XDG_RUNTIME_DIR")
    if runtime and os.path.isabs(runtime):
        return os.path.join(runtime, "blockfs")
    if os.geteuid() == 0:
        return "/run/blockfs"
    return os.path.join(os.path.expanduser("~"), ".cache", "blockfs", "logs")


def default_log_path(mountpoint: str | os.PathLike) -> str:
    """The log file of a background mount of ``mountpoint``: one per mount point, in :func:`log_directory`
    (created 0700 and checked: this user's, not a link, writable by no one else).  Logs not written for
    :data:`LOG_KEEP_DAYS` days, and all but the newest :data:`LOGS_KEPT`, are removed."""
    directory = log_directory()
    fd = open_owned_dir(directory, "log directory", "set XDG_RUNTIME_DIR to a private directory, or pass --log FILE")
    tag = "".join(c if c.isalnum() else "_" for c in canonical(mountpoint).strip("/"))[-80:]
    name = f"blockfs-{tag}.log"
    try:
        _remove_old_logs(fd)
        try:
            if stat.S_ISLNK(os.stat(name, dir_fd=fd, follow_symlinks=False).st_mode):
                os.unlink(name, dir_fd=fd)  # our own name in our own directory: the link goes, never its target
        except FileNotFoundError:
            pass
    finally:
        os.close(fd)
    return os.path.join(directory, name)


def _remove_old_logs(dir_fd: int) -> None:
    logs = regular_files_at(dir_fd, [n for n in os.listdir(dir_fd) if n.startswith("blockfs-") and n.endswith(".log")])
    logs.sort(reverse=True)
    cutoff = time.time_ns() - LOG_KEEP_DAYS * 86400 * 10**9
    unlink_quietly_at(dir_fd, [name for k, (mtime, name) in enumerate(logs) if k >= LOGS_KEPT or mtime < cutoff])


FETCHED_PREFIX = "blockfs-fetched-"
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


def _fetched_prefix(mountpoint: str | os.PathLike) -> str:
    """The start of the names of ``mountpoint``'s fetched directories: the mount point's hash in them."""
    return f"{FETCHED_PREFIX}{hashlib.sha256(os.fsencode(canonical(mountpoint))).hexdigest()[:16]}-"


def fetched_directory(mountpoint: str | os.PathLike) -> str:
    """A new private directory (0700, a random name) in the temporary directory for what a mount of a remote
    dataset fetched (its ``blockfs.json`` and index), named after ``mountpoint``: the serving process
    removes it when it ends, and :func:`remove_fetched` finds it when that process was killed."""
    return tempfile.mkdtemp(prefix=_fetched_prefix(mountpoint))


def remove_fetched(mountpoint: str | os.PathLike) -> int:
    """Remove the fetched directories of mounts of ``mountpoint`` (see :func:`fetched_directory`) that a
    killed serving process left in the temporary directory: only directories of this user's with that
    name (never a link, never another user's), and in them only files; how many were removed."""
    prefix, removed = _fetched_prefix(mountpoint), 0
    try:
        tmp = os.open(tempfile.gettempdir(), _DIR_FLAGS)
    except OSError:
        return 0
    try:
        for name in os.listdir(tmp):
            if name.startswith(prefix) and _remove_own_dir(tmp, name):
                removed += 1
    finally:
        os.close(tmp)
    return removed


def _remove_own_dir(parent: int, name: str) -> bool:
    try:
        fd = os.open(name, _DIR_FLAGS, dir_fd=parent)  # O_NOFOLLOW: a link there is not ours to follow
    except OSError:
        return False
    try:
        if os.fstat(fd).st_uid != os.getuid():
            return False
        for entry in os.listdir(fd):
            try:
                if not stat.S_ISDIR(os.stat(entry, dir_fd=fd, follow_symlinks=False).st_mode):
                    os.unlink(entry, dir_fd=fd)  # a link inside goes, never what it points at
            except OSError:
                pass
    finally:
        os.close(fd)
    try:
        os.rmdir(name, dir_fd=parent)
    except OSError as e:
        log.warning("cannot remove %s: %s", os.path.join(tempfile.gettempdir(), name), e.strerror or e)
        return False
    return True
