"""Mount and unmount processes: start a serving process, wait until it serves, unmount (dead mounts too).

The serving process itself is ``blockfs mount --foreground`` (:func:`blockfs.serve.server.serve`); this
module starts it in the background, checks a mount point before and after, clears mounts (also one left behind by a
serving process killed with SIGKILL, whose mount point then answers ENOTCONN), and reads the live
statistics a mount publishes (:mod:`blockfs.client`).  No FUSE binding is imported here.
"""

from __future__ import annotations

import contextlib
import logging
import os
import select
import shutil
import signal
import subprocess
import threading
import time
from collections.abc import Callable, Collection, Iterator, Sequence

from ..client import read_stats
from ..errors import BlockfsError, MountError
from .mount_files import canonical, open_log, remove_fetched

__all__ = [
    "check_mountpoint",
    "is_mounted",
    "Reports",
    "mount_entry",
    "mount_point",
    "mount_points",
    "serving_pid",
    "start_background",
    "Stopped",
    "unmount",
    "wait_until_mounted",
]

log = logging.getLogger(__name__)


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


def _mount_table() -> Iterator[tuple[str, str, str]]:
    """(mount point, fstype, source) of every mount of this process's namespace, in the table's order (a mount
    on top of another comes after it); ``/proc/self/mountinfo``, which lists dead FUSE mounts too."""
    with open("/proc/self/mountinfo", "rb") as f:
        lines = f.read().decode("utf-8", "surrogateescape").splitlines()
    for line in lines:
        fields = line.split(" ")
        try:
            sep = fields.index("-")
        except ValueError:
            continue
        yield _unescape(fields[4]), fields[sep + 1], _unescape(fields[sep + 2])


def mount_points() -> list[str]:
    """Every mount point of this process's namespace."""
    return [point for point, _fstype, _source in _mount_table()]


def mount_entry(mountpoint: str | os.PathLike) -> dict[str, str] | None:
    """The mount table's entry for ``mountpoint`` (fstype, source), or None; works on dead FUSE mounts."""
    target = canonical(mountpoint)
    found = None
    for point, fstype, source in _mount_table():
        if point == target:
            found = {"fstype": fstype, "source": source}
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
    check: Callable[[], None] | None = None,
) -> None:
    """Poll until ``mountpoint`` serves; raise MountError with the server's last words if it exits or stalls.

    ``log_offset``: where this server's part of ``log_path`` starts (the file may hold earlier runs).
    ``check()``: called at each poll, to raise what should end the wait (:meth:`_Signals.check`)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if check is not None:
            check()
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
    timeout: float | None = 30.0,
    handoff: bytes | None = None,
    handoff_option: str = "--handoff-fd",
    on_report: Callable[[bytes], None] | None = None,
    report_option: str = "--report-fd",
    stop_on: Collection[int] = (),
) -> int:
    """Run ``command`` (a foreground serving process) detached, logging to ``log_path``; return its pid once
    ``mountpoint`` serves.  On failure the process is stopped and the error carries its log's tail.

    ``handoff``: bytes (secrets) the process reads from an inherited pipe named by ``handoff_option FD``, so
    they appear in no command line or environment another user can read (``/proc/PID/cmdline``).
    ``on_report(bytes)``: called with each report the process writes to the pipe named by ``report_option
    FD`` (its plan, :meth:`Reports.report`) as it arrives.  With that pipe, the wait is for the process's
    word that it serves (:meth:`Reports.ready`) or its death, however long a large dataset takes to
    assemble (``timeout`` None: no limit); without it, the mount point is polled for ``timeout`` seconds.
    However the wait ends without serving (an error, a timeout, an exception such as KeyboardInterrupt
    raised in it), the process is stopped and a mount it left at ``mountpoint`` is unmounted.

    ``stop_on``: signals (SIGINT, SIGTERM, SIGHUP; those the process ignores stay ignored) that stop the
    start, called from the main thread: :class:`Stopped` is raised once the process is stopped.  They are
    recorded where they land and acted on where the start looks (:class:`_Signals`), never raised inside
    ``Popen`` (which would lose the process it started) or inside the stopping of a failed start (which
    would leave it running or mounted): a signal there lets that stopping finish, and its error stands."""
    with _Signals(stop_on) as signals:
        signals.check()
        mounted_before = is_mounted(mountpoint)  # before the process may mount it
        proc, offset, report_read, write_end = _spawn(
            command, log_path, handoff, handoff_option, on_report, report_option
        )
        try:
            signals.check()  # one that came while the process was started
            if write_end is not None:
                # Written from a thread: a handoff bigger than the pipe's buffer must not block before the
                # child reads.
                threading.Thread(target=_write_all, args=(write_end, handoff), daemon=True).start()
                write_end = None
            if report_read is not None and on_report is not None:
                fd, report_read = report_read, None
                _follow_reports(fd, proc, timeout, on_report, mountpoint, log_path, offset, signals)
            else:
                timeout = 30.0 if timeout is None else timeout
                wait_until_mounted(mountpoint, proc, timeout, log_path, offset, signals.check)
        except BaseException:  # a failure, or the wait stopped (a signal): no half-started server is left
            for end in (report_read, write_end):
                if end is not None:
                    os.close(end)
            _stop_half_started(proc, mountpoint, mounted_before)
            raise
        return proc.pid


def _spawn(
    command: Sequence[str],
    log_path: str,
    handoff: bytes | None,
    handoff_option: str,
    on_report: Callable[[bytes], None] | None,
    report_option: str,
) -> tuple[subprocess.Popen, int, int | None, int | None]:
    """:func:`start_background`'s process started, the pipes it is given made (their child ends closed
    here once it has them): (the process, where its part of the log starts, the report pipe's read end,
    the handoff pipe's write end)."""
    command = list(command)
    opened: list[int] = []
    passed: list[int] = []
    read_end = write_end = report_read = report_write = None
    try:
        if handoff is not None:
            read_end, write_end = os.pipe()
            opened += [read_end, write_end]
            end = command.index("--") if "--" in command else len(command)  # options go before the positionals
            command[end:end] = [handoff_option, str(read_end)]
            passed.append(read_end)
        if on_report is not None:
            report_read, report_write = os.pipe()
            opened += [report_read, report_write]
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
        finally:
            os.close(log_fd)
    except BaseException:
        for fd in opened:
            os.close(fd)
        raise
    for fd in passed:  # the child's ends: it has them now
        os.close(fd)
    return proc, offset, report_read, write_end


class Stopped(KeyboardInterrupt):
    """A start stopped by ``signum`` (SIGINT, SIGTERM, SIGHUP): :func:`start_background` stopped the process
    it started.  The CLI says ``text`` in one line and exits 128 + ``signum``, as a process killed by that
    signal would."""

    def __init__(self, signum: int, text: str = "") -> None:
        super().__init__(*([text] if text else []))
        self.signum = signum


class _Signals:
    """While a start runs in the main thread: each of ``signums`` the process does not ignore (nohup) is
    recorded by its handler, not raised where it lands, and wakes the wait's ``select`` (the wakeup
    descriptor: whichever thread the kernel gave the signal to).  :meth:`check` raises :class:`Stopped` for
    the first one, where the start chooses.  A later signal changes nothing: the stopping must finish."""

    def __init__(self, signums: Collection[int]) -> None:
        self.signums = signums
        self.signum: int | None = None
        self.wakeup: int | None = None  # readable once a signal came
        self._stack = contextlib.ExitStack()

    def __enter__(self) -> _Signals:
        if not self.signums or threading.current_thread() is not threading.main_thread():
            return self
        with contextlib.ExitStack() as stack:
            read_end, write_end = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
            stack.callback(os.close, read_end)
            stack.callback(os.close, write_end)
            for signum in self.signums:
                if signal.getsignal(signum) != signal.SIG_IGN:
                    before = signal.signal(signum, self._record)  # None: one set outside Python
                    stack.callback(signal.signal, signum, signal.SIG_DFL if before is None else before)
            stack.callback(signal.set_wakeup_fd, signal.set_wakeup_fd(write_end, warn_on_full_buffer=False))
            self.wakeup = read_end
            self._stack = stack.pop_all()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stack.close()  # the handlers and the wakeup descriptor as they were, then the pipe closed

    def _record(self, signum: int, frame: object) -> None:
        if self.signum is None:
            self.signum = signum

    def check(self) -> None:
        """Raise :class:`Stopped` if one of the signals came; empty the wakeup descriptor (a signal another
        handler of this process took writes to it too, and must not keep the wait awake)."""
        if self.wakeup is not None:
            try:
                os.read(self.wakeup, 512)
            except BlockingIOError:
                pass
        if self.signum is not None:
            raise Stopped(self.signum)


STOP_WAIT_S = 5.0  # how long a half-started server has to stop (and unmount) after SIGTERM, before SIGKILL


def _stop_half_started(proc: subprocess.Popen, mountpoint: str | os.PathLike, mounted_before: bool) -> None:
    """Stop a serving process that did not say it serves, and unmount what it left mounted: a server
    stopped after mounting unmounts itself, but one killed (SIGKILL after :data:`STOP_WAIT_S`, or a
    SIGTERM before its handlers were set) or dead of its own leaves a mount that answers ENOTCONN."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(STOP_WAIT_S)
        except subprocess.TimeoutExpired:
            proc.kill()
            try:
                proc.wait(STOP_WAIT_S)
            except subprocess.TimeoutExpired:
                pass  # stuck in the kernel (a request of its own in flight): the unmount below frees it
    if not mounted_before and is_mounted(mountpoint):  # the mount point was free: what is there is its
        try:
            unmount(mountpoint)
        except MountError as e:
            log.warning("%s: run 'blockfs umount %s'", e, os.fspath(mountpoint))


READY = b"ready"  # the last line a serving process writes to its report pipe: it serves


def _follow_reports(
    fd: int,
    proc: subprocess.Popen,
    timeout: float | None,
    on_report: Callable[[bytes], None],
    mountpoint: str | os.PathLike,
    log_path: str,
    log_offset: int,
    signals: _Signals | None = None,
) -> None:
    """Read the serving process's report pipe ``fd`` (closed afterwards): each line before :data:`READY` is a
    report for ``on_report``; return at that line.  Raise MountError, with the server's own error, when the
    process exits or closes the pipe first, and after ``timeout`` seconds (None: never); :class:`Stopped`
    once one of ``signals`` came."""
    deadline = None if timeout is None else time.monotonic() + timeout
    buffered = b""
    watched = [fd] + ([signals.wakeup] if signals is not None and signals.wakeup is not None else [])
    try:
        while True:
            if signals is not None:
                signals.check()
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                raise MountError(
                    f"{os.fspath(mountpoint)!r} was not serving after {timeout:g} s (--timeout)"
                    f"{_tail(log_path, log_offset)}"
                )
            # Woken by a line, by the pipe's end (the process exited), by a signal, and every second to look
            # at the process itself: a child it started could hold the pipe open after its death.
            ready = select.select(watched, [], [], 1.0 if left is None else min(left, 1.0))[0]
            if signals is not None:
                signals.check()
            if fd in ready:
                chunk = os.read(fd, 1 << 16)
                buffered += chunk
                *lines, buffered = buffered.split(b"\n")
                for line in lines:
                    if line == READY:
                        return
                    on_report(line)
                if chunk:
                    continue
            elif proc.poll() is None:
                continue
            # The pipe ended, or the process is gone, without the word that it serves: it failed.
            try:
                proc.wait(UNMOUNT_WAIT_S)
            except subprocess.TimeoutExpired:
                pass  # start_background stops it; the error says what its log says
            said = _error_line(log_path, log_offset)
            if said:  # the server's own one-line error: the reason and the fix
                raise MountError(f"{said} (log: {log_path})")
            raise MountError(
                f"the serving process exited with status {proc.returncode} before serving{_tail(log_path, log_offset)}"
            )
    finally:
        os.close(fd)


class Reports:
    """In a serving process: the pipe to the command that started it (:func:`start_background`).  One line
    per report (its plan), then :data:`READY` once it serves, and the pipe is closed.  Quiet when that
    command is gone."""

    def __init__(self, fd: int) -> None:
        os.set_inheritable(fd, False)  # a child (fusermount3) must not hold it open after this process dies
        self._fd: int | None = fd
        self._lock = threading.Lock()

    def report(self, data: bytes) -> None:
        """One report, one line (JSON holds no raw newline; any other is made a space)."""
        self._send(data.replace(b"\n", b" ") + b"\n")

    def ready(self) -> None:
        """The mount serves: say so and close the pipe."""
        self._send(READY + b"\n", last=True)

    def _send(self, data: bytes, last: bool = False) -> None:
        with self._lock:
            if self._fd is None:
                return
            try:
                view = memoryview(data)
                while view:
                    view = view[os.write(self._fd, view) :]
            except OSError:
                last = True  # the command is gone: nothing more to say
            if last:
                os.close(self._fd)
                self._fd = None


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


def serving_pid(mountpoint: str | os.PathLike, timeout: float = 2.0) -> int | None:
    """The pid of the process serving a live mount (None if dead or not answering within ``timeout``)."""
    result: list[int | None] = [None]

    def ask() -> None:
        try:
            result[0] = int(read_stats(mountpoint)["mount"]["pid"])
        except (OSError, ValueError, KeyError, BlockfsError):
            pass  # dead, or another FUSE filesystem: no pid to wait for

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


BLOCKFS_FSTYPE = "fuse.blockfs"  # a blockfs mount in the mount table, on every route, unless -o subtype= renames it
MAX_LINKS = 40  # symbolic links followed to a mount point, as the kernel's own limit


def mount_point(path: str | os.PathLike) -> str:
    """The mount point ``path`` names: itself (canonical) when mounted or not a symbolic link, else the
    blockfs mount its link leads to, as ``blockfs mount`` resolves a linked mount point (the mount table
    names the target, never the link).  A link to anything but a blockfs mount is refused: ``umount``
    must never unmount another filesystem because a link pointed there.  A blockfs mount is one of type
    :data:`BLOCKFS_FSTYPE`, or a FUSE mount of another type (``-o subtype=``) whose server answers blockfs's
    statistics (:func:`serving_pid`: in a thread, given up after its timeout, so a server that does not
    answer cannot hang the call); no other mounted path is touched, and only links are read."""
    given = os.fspath(path)
    point = first = canonical(path)
    for _ in range(MAX_LINKS):
        if mount_entry(point) is not None or not os.path.islink(point):
            break
        point = canonical(os.path.join(os.path.dirname(point), os.readlink(point)))
    else:
        raise MountError(f"{given!r}: more than {MAX_LINKS} symbolic links in a row: give the mount point itself")
    if point == first:
        return point
    entry = mount_entry(point)
    if entry is None:
        raise MountError(f"{given!r} is a symbolic link to {point!r}, which is not mounted")
    fstype = entry["fstype"]
    if fstype == BLOCKFS_FSTYPE:
        return point
    if fstype != "fuse" and not fstype.startswith("fuse."):
        raise MountError(
            f"{given!r} is a symbolic link to {point!r}, a {fstype} mount, not a blockfs one: "
            "blockfs umount unmounts only blockfs mounts"
        )
    if serving_pid(point) is None:  # another FUSE filesystem, or a blockfs one whose server is gone
        raise MountError(
            f"{given!r} is a symbolic link to {point!r}, a {fstype} mount that does not answer as a blockfs one: "
            "blockfs umount unmounts only blockfs mounts through a link; if it is one whose server was killed, "
            f"give the mount point itself: blockfs umount {point}"
        )
    return point


def unmount(mountpoint: str | os.PathLike, timeout: float = 10.0) -> bool:
    """Unmount a blockfs (or any FUSE) mount, live or dead; wait for its serving process to exit.
    ``mountpoint`` may be a symbolic link to a blockfs mount (:func:`mount_point`).

    Plain unmounts first, lazy ones last.  A command that does not return within :data:`UNMOUNT_WAIT_S`
    (a live server that does not answer) is stopped, and the lazy unmounts are tried next; True when the
    mount was detached lazily for that reason (it goes once nothing uses it)."""
    path = mount_point(mountpoint)
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
