"""Open a path beneath a directory descriptor without following a symlink anywhere on the way.

``O_NOFOLLOW`` guards only the last component: a directory on the path swapped for a symlink after the
walk listed it would still be followed, and ``pack`` would read files from outside SRC.  Linux 5.6+ has
``openat2`` with ``RESOLVE_BENEATH | RESOLVE_NO_SYMLINKS``, which refuses that in one call (Python has
no binding yet: it is called through ``syscall``).  Where the kernel, the architecture or a seccomp
filter lacks it, the path is opened one component at a time, each with ``O_NOFOLLOW``.  Either way a
symlink on the path fails with ELOOP (or ENOTDIR/EXDEV), never reaches outside.
"""

from __future__ import annotations

import ctypes
import errno
import os
import platform
import sys

_RESOLVE_NO_SYMLINKS = 0x04  # from <linux/openat2.h>
_RESOLVE_BENEATH = 0x08
# openat2 has number 437 in the unified syscall table every one of these architectures uses.
_SYS_OPENAT2 = 437
_UNIFIED_TABLE = {"x86_64", "aarch64", "arm64", "i686", "i386", "armv7l", "armv8l", "riscv64", "ppc64le", "s390x"}
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


class _OpenHow(ctypes.Structure):
    _fields_ = [("flags", ctypes.c_uint64), ("mode", ctypes.c_uint64), ("resolve", ctypes.c_uint64)]


def _load_syscall():
    if sys.platform != "linux" or platform.machine() not in _UNIFIED_TABLE:
        return None
    try:
        call = ctypes.CDLL(None, use_errno=True).syscall
    except (OSError, AttributeError):
        return None
    call.restype = ctypes.c_long
    return call


_syscall = _load_syscall()


def openat2_beneath(dir_fd: int, path: bytes, flags: int) -> int:
    """``openat2(dir_fd, path, flags, RESOLVE_BENEATH | RESOLVE_NO_SYMLINKS)``; OSError on failure
    (ENOSYS where the kernel or this platform lacks it)."""
    if _syscall is None:
        raise OSError(errno.ENOSYS, os.strerror(errno.ENOSYS))
    how = _OpenHow(flags, 0, _RESOLVE_BENEATH | _RESOLVE_NO_SYMLINKS)
    fd = _syscall(
        ctypes.c_long(_SYS_OPENAT2),
        ctypes.c_long(dir_fd),
        ctypes.c_char_p(path),
        ctypes.byref(how),
        ctypes.c_size_t(ctypes.sizeof(how)),
    )
    if fd < 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err), os.fsdecode(path))
    return int(fd)


def has_openat2(dir_fd: int) -> bool:
    """Whether ``openat2`` works here (kernel, architecture, seccomp): tried once on ``dir_fd`` itself."""
    try:
        os.close(openat2_beneath(dir_fd, b".", os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC))
    except OSError:
        return False
    return True


def open_beneath(dir_fd: int, path: bytes, flags: int, use_openat2: bool) -> int:
    """Open ``path`` (relative, "/"-separated) beneath ``dir_fd``, following no symlink on the way.

    ``flags`` are ``os.open`` flags for the last component (``O_NOFOLLOW`` is added).  ``use_openat2``:
    the result of :func:`has_openat2`, asked once by the caller.
    """
    parts = path.split(b"/")
    if any(p in (b"", b".", b"..") for p in parts):
        raise OSError(errno.EINVAL, f"not a plain relative path: {path!r}")
    if use_openat2:
        return openat2_beneath(dir_fd, path, flags | os.O_NOFOLLOW)
    fd = dir_fd
    try:
        for part in parts[:-1]:
            child = os.open(part, _DIR_FLAGS, dir_fd=fd)
            if fd != dir_fd:
                os.close(fd)
            fd = child
        return os.open(parts[-1], flags | os.O_NOFOLLOW, dir_fd=fd)
    finally:
        if fd != dir_fd:
            os.close(fd)
