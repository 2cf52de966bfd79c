"""Mount and unmount processes: start a serving process, wait until it serves, unmount (dead mounts too).

The serving process itself is ``blockfs mount --foreground`` (:func:`blockfs.serve.server.serve`); this
module starts it in the background, checks a mount point before and after, clears mounts (also one left behind by a
serving process killed with SIGKILL, whose mount point then answers ENOTCONN), and reads the live
statistics a mount publishes (:mod:`blockfs.client`).  No FUSE binding is imported here.
"""

from __future__ import annotations

import errno
import hashlib
import logging
import os
import select
import shutil
import stat
import subprocess
import tempfile
import threading
import time
from collections.abc import Callable, Sequence

from ..client import read_stats
from ..errors import BlockfsError, MountError
from ..storage.owned import open_owned_dir, regular_files_at, unlink_quietly_at

__all__ = [
    "check_mountpoint",
    "default_log_path",
    "fetched_directory",
    "is_mounted",
    "log_directory",
    "mount_entry",
    "open_log",
    "remove_fetched",
    "serving_pid",
    "start_background",
    "unmount",
    "wait_until_mounted",
]

log = logging.getLogger(__name__)

LOG_KEEP_DAYS = 14  # a default log not written for this long is removed when the next mount starts
LOGS_KEPT = 64  # and only this many, the most recently written, are kept


def _unescape(field: str) -> str:
    """A /proc/self/mountinfo path field: spaces, tabs, newlines and backslashes are octal escapes."""
    out, i = [], 0
    while i < len(field):
        if field[i] == "\\" and i + 4 <= len(field) and field[i + 1 : i + 4].isdigit():
            out.append(chr(int(field[i + 1 : i + 4], 8)))
            i += 4
        else:
            out.append(field[i])
            i += 1
    return "".join(out)


def _canonical(path: str | os.PathLike) -> str:
    """An absolute path with the parent resolved, without touching the last component (maybe a dead mount)."""
    path = os.path.abspath(os.fspath(path))
    parent, leaf = os.path.split(path)
    return os.path.join(os.path.realpath(parent), leaf)


def mount_entry(mountpoint: str | os.PathLike) -> dict[str, str] | None:
    """The mount table's entry for ``mountpoint`` (fstype, source), or None; works on dead FUSE mounts."""
    target = _canonical(mountpoint)
    with open("/proc/self/mountinfo", "rb") as f:
        lines = f.read().decode("utf-8", "surrogateescape").splitlines()
    found = None
    for line in lines:
        fields = line.split(" ")
        try:
            sep = fields.index("-")
        except ValueError:
            continue
        if _unescape(fields[4]) == target:
            found = {"fstype": fields[sep + 1], "source": _unescape(fields[sep + 2])}
    return found  # the last one wins: it is the mount on top


def is_mounted(mountpoint: str | os.PathLike) -> bool:
    return mount_entry(mountpoint) is not None


def check_mountpoint(mountpoint: str | os.PathLike) -> None:
    """Refuse, with the reason, a mount point that is missing, not a directory, mounted, or not empty."""
    path = os.fspath(mountpoint)
    if is_mounted(path):
        raise MountError(f"mount point {path!r} is already mounted: run 'blockfs umount {path}' first")
    if not os.path.exists(path):
        raise MountError(f"mount point {path!r} does not exist: create an empty directory there")
    if not os.path.isdir(path):
        raise MountError(f"mount point {path!r} is not a directory")
    if os.listdir(path):
        raise MountError(f"mount point {path!r} is not empty: mounting would hide its files")


def wait_until_mounted(
    mountpoint: str | os.PathLike,
    proc: subprocess.Popen | None = None,
    timeout: float = 30.0,
    log_path: str | None = None,
    log_offset: int = 0,
) -> None:
    """Poll until ``mountpoint`` serves; raise MountError with the server's last words if it exits or stalls.

    ``log_offset``: where this server's part of ``log_path`` starts (the file may hold earlier runs)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if os.path.ismount(mountpoint) and is_mounted(mountpoint):
            return
        if proc is not None and proc.poll() is not None:
            said = _error_line(log_path, log_offset)
            if said:  # the server's own one-line error: the reason and the fix
                raise MountError(f"{said} (log: {log_path})")
            raise MountError(f"the serving process exited with status {proc.returncode}{_tail(log_path, log_offset)}")
        time.sleep(0.02)
    raise MountError(f"{os.fspath(mountpoint)!r} was not mounted after {timeout:g} s{_tail(log_path, log_offset)}")


def _error_line(log_path: str | None, offset: int = 0) -> str | None:
    """The last ``blockfs mount: error: ...`` line the server wrote to its log, without that prefix."""
    prefix = "blockfs mount: error: "
    lines = [line for line in _tail(log_path, offset, lines=50).splitlines() if line.strip().startswith(prefix)]
    return lines[-1].strip()[len(prefix) :] if lines else None


def _tail(log_path: str | None, offset: int = 0, lines: int = 15) -> str:
    if not log_path:
        return ""
    try:
        with open(log_path, "rb") as f:
            f.seek(offset)
            text = f.read().decode("utf-8", "replace").strip().splitlines()[-lines:]
    except OSError:
        return ""
    return (":\n  " + "\n  ".join(text)) if text else ""


def start_background(
    command: Sequence[str],
    mountpoint: str | os.PathLike,
    log_path: str,
    timeout: float = 30.0,
    handoff: bytes | None = None,
    handoff_option: str = "--handoff-fd",
    on_report: Callable[[bytes], None] | None = None,
    report_option: str = "--report-fd",
) -> int:
    """Run ``command`` (a foreground serving process) detached, logging to ``log_path``; return its pid once
    ``mountpoint`` serves.  On failure the process is stopped and the error carries its log's tail.

    ``handoff``: bytes (secrets) the process reads from an inherited pipe named by ``handoff_option FD``, so
    they appear in no command line or environment another user can read (``/proc/PID/cmdline``).
    ``on_report(bytes)``: called with what the process writes to the pipe named by ``report_option FD``
    (its plan, :func:`send_report`) once it closes it, before waiting for the mount; not called when the
    process exits or the timeout passes without writing anything."""
    command = list(command)
    read_end = report_read = report_write = None
    passed: list[int] = []
    if handoff is not None:
        read_end, write_end = os.pipe()
        end = command.index("--") if "--" in command else len(command)  # options go before the positionals
        command[end:end] = [handoff_option, str(read_end)]
        passed.append(read_end)
    if on_report is not None:
        report_read, report_write = os.pipe()
        end = command.index("--") if "--" in command else len(command)
        command[end:end] = [report_option, str(report_write)]
        passed.append(report_write)
    log_fd = open_log(log_path)
    try:
        offset = os.lseek(log_fd, 0, os.SEEK_END)
        proc = subprocess.Popen(
            command,
            stdin=subprocess.DEVNULL,
            stdout=log_fd,
            stderr=log_fd,
            start_new_session=True,
            pass_fds=tuple(passed),
        )
    except BaseException:
        for fd in (read_end, report_read, report_write):
            if fd is not None:
                os.close(fd)
        if read_end is not None:
            os.close(write_end)
        raise
    finally:
        os.close(log_fd)
    if read_end is not None:
        os.close(read_end)
        # Written from a thread: a handoff bigger than the pipe's buffer must not block before the child reads.
        threading.Thread(target=_write_all, args=(write_end, handoff), daemon=True).start()
    deadline = time.monotonic() + timeout
    try:
        if report_read is not None and report_write is not None:
            os.close(report_write)
            report = _read_until_closed(report_read, deadline)
            if report and on_report is not None:
                on_report(report)
        wait_until_mounted(mountpoint, proc, max(0.0, deadline - time.monotonic()), log_path, offset)
    except MountError:
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(5)
            except subprocess.TimeoutExpired:
                proc.kill()
        raise
    return proc.pid


def _read_until_closed(fd: int, deadline: float) -> bytes:
    """Everything written to the pipe ``fd`` until its writer closes it (or exits), or until ``deadline``
    (then b""); ``fd`` is closed."""
    chunks: list[bytes] = []
    try:
        while (left := deadline - time.monotonic()) > 0:
            if not select.select([fd], [], [], left)[0]:
                break
            chunk = os.read(fd, 1 << 16)
            if not chunk:
                return b"".join(chunks)
            chunks.append(chunk)
        return b""
    finally:
        os.close(fd)


def send_report(fd: int, data: bytes) -> None:
    """In a serving process: write ``data`` to the pipe :func:`start_background` named, and close it; quiet
    when the command that started it is gone."""
    try:
        _write_all(fd, data)
    except OSError:
        pass


def _write_all(fd: int, data: bytes) -> None:
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view) :]
    except OSError:
        pass  # the child died before reading: its exit is reported by wait_until_mounted
    finally:
        os.close(fd)


def read_handoff(fd: int) -> bytes:
    """What :func:`start_background` handed this process through the pipe ``fd`` (closed afterwards)."""
    chunks: list[bytes] = []
    try:
        while chunk := os.read(fd, 1 << 16):
            chunks.append(chunk)
    finally:
        os.close(fd)
    return b"".join(chunks)


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
    tag = "".join(c if c.isalnum() else "_" for c in _canonical(mountpoint).strip("/"))[-80:]
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
    return f"{FETCHED_PREFIX}{hashlib.sha256(os.fsencode(_canonical(mountpoint))).hexdigest()[:16]}-"


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


def serving_pid(mountpoint: str | os.PathLike, timeout: float = 2.0) -> int | None:
    """The pid of the process serving a live mount (None if dead or not answering within ``timeout``)."""
    result: list[int | None] = [None]

    def ask() -> None:
        try:
            result[0] = int(read_stats(mountpoint)["mount"]["pid"])
        except (OSError, ValueError, KeyError, BlockfsError):
            pass  # dead, or another FUSE filesystem: no pid to wait for

    import threading

    thread = threading.Thread(target=ask, daemon=True)  # a hung server must not hang umount
    thread.start()
    thread.join(timeout)
    return result[0]


UNMOUNT_WAIT_S = 30.0  # how long one unmount command may take before the next is tried


class _Stuck(Exception):
    """An unmount command that did not return: the serving process is alive but does not answer."""


def _run(command: list[str]) -> tuple[bool, str]:
    if shutil.which(command[0]) is None:
        return False, f"{command[0]}: not installed"
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=UNMOUNT_WAIT_S)
    except subprocess.TimeoutExpired:
        raise _Stuck(f"no answer after {UNMOUNT_WAIT_S:g} s") from None
    return done.returncode == 0, (done.stderr or done.stdout).strip()


def unmount(mountpoint: str | os.PathLike, timeout: float = 10.0) -> bool:
    """Unmount a blockfs (or any FUSE) mount, live or dead; wait for its serving process to exit.

    Plain unmounts first, lazy ones last.  A command that does not return within :data:`UNMOUNT_WAIT_S`
    (a live server that does not answer) is stopped, and the lazy unmounts are tried next; True when the
    mount was detached lazily for that reason (it goes once nothing uses it)."""
    path = _canonical(mountpoint)
    entry = mount_entry(path)
    if entry is None:
        raise MountError(f"{os.fspath(mountpoint)!r} is not mounted")
    if not entry["fstype"].startswith("fuse"):
        raise MountError(f"{os.fspath(mountpoint)!r} is a {entry['fstype']} mount, not a blockfs one")
    pid = serving_pid(path)
    reasons: list[str] = []
    stuck = False
    attempts = (
        ["fusermount3", "-u", path],
        ["fusermount", "-u", path],
        ["umount", path],
        ["fusermount3", "-uz", path],
        ["fusermount", "-uz", path],
        ["umount", "-l", path],
    )
    for command in attempts:
        lazy = command[1] in ("-uz", "-l")
        if stuck and not lazy:
            continue  # another plain unmount would wait on the same server
        try:
            ok, why = _run(command)
        except _Stuck as e:
            ok, why, stuck = False, str(e), True
        if ok and not is_mounted(path):
            break
        reasons.append(f"{' '.join(command[:-1])}: {why or 'failed'}")
    else:
        raise MountError(f"cannot unmount {path!r}: " + "; ".join(reasons))
    if pid is not None:
        _wait_exit(pid, timeout)
    remove_fetched(path)  # a live server removed its own; a killed one could not
    return stuck


def _wait_exit(pid: int, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with open(f"/proc/{pid}/stat", "rb") as f:
                state = f.read().rsplit(b")", 1)[1].split()[0]
        except OSError:
            return
        if state in (b"Z", b"X"):
            return
        time.sleep(0.02)
