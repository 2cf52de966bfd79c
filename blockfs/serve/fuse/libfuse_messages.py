"""libfuse's reasons, as one line: libfuse (and fusermount3) write why a mount failed to the process's
stderr and return a bare status; :class:`StderrCapture` holds file descriptor 2 in a temporary file while
libfuse mounts, and :func:`distill` turns what it wrote into one line naming the cause and the fix."""

from __future__ import annotations

import os
import re
import sys
import tempfile
import threading

__all__ = ["StderrCapture", "distill"]

FUSE_CONF = "/etc/fuse.conf"

# (what libfuse or fusermount3 writes, the line to show); the first that matches wins.
_KNOWN: tuple[tuple[re.Pattern[str], str], ...] = (
    (
        re.compile(r"unknown option\(s\): `-o ([^']*)'"),
        "libfuse does not know the option '{0}' (given with -o or in fstab): remove it; "
        "'blockfs mount --help' lists blockfs's own options",
    ),
    (
        re.compile(r"user_allow_other"),
        "--allow-other (allow_other) needs the line 'user_allow_other' in "
        + FUSE_CONF
        + ": add it as root, or mount as root, or mount without --allow-other",
    ),
    (
        re.compile(r"device not found|No such file or directory.*/dev/fuse|/dev/fuse.*No such file"),
        "there is no /dev/fuse: load the module (modprobe fuse), or in a container run it with "
        "--device /dev/fuse --cap-add SYS_ADMIN",
    ),
    (
        re.compile(r"/dev/fuse.*(Permission denied|Operation not permitted)"),
        "/dev/fuse is not accessible to this user: give the user access to it (ls -l /dev/fuse), or in a "
        "container run it with --device /dev/fuse --cap-add SYS_ADMIN",
    ),
    (
        re.compile(r"mount failed: (Permission denied|Operation not permitted)"),
        "the kernel refused the mount (no CAP_SYS_ADMIN): in a container run it with --device /dev/fuse "
        "--cap-add SYS_ADMIN (and --security-opt apparmor:unconfined where AppArmor applies)",
    ),
)


def distill(text: str) -> str | None:
    """One line for what libfuse wrote (None when it wrote nothing recognisable as its own)."""
    for pattern, line in _KNOWN:
        match = pattern.search(text)
        if match:
            return line.format(*match.groups())
    own = [line.strip() for line in text.splitlines() if line.lstrip().startswith(("fuse:", "fusermount"))]
    return own[-1] if own else None


class StderrCapture:
    """File descriptor 2 in a temporary file until :meth:`release`, which puts it back and replays what was
    captured (unless told not to).  Safe to release from another thread, and more than once."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._saved: int | None = None
        self._file = tempfile.TemporaryFile()

    def __enter__(self) -> StderrCapture:
        sys.stderr.flush()
        try:
            self._saved = os.dup(2)
        except OSError:  # no stderr at all (closed by whoever started us): nothing to capture or restore
            return self
        os.dup2(self._file.fileno(), 2)
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()
        self._file.close()

    def text(self) -> str:
        self._file.flush()
        return os.pread(self._file.fileno(), 1 << 20, 0).decode("utf-8", "replace")

    def release(self, replay: bool = True) -> None:
        with self._lock:
            if self._saved is None:
                return
            sys.stderr.flush()
            os.dup2(self._saved, 2)
            os.close(self._saved)
            self._saved = None
            captured = self.text()
        if replay and captured:
            os.write(2, captured.encode())
