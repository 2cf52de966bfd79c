"""``blockfs mount`` waits for its serving process's word that it serves, or for its death: never a fixed
time, which a healthy server of ten million files outlived (issue 30: "was not mounted after 13.66 s").

The serving process here is a stand-in that speaks the report pipe as :func:`blockfs.serve.server.serve`'s
caller does (:class:`blockfs.serve.daemon.Reports`): a plan line, then ``ready``.  Real mounts on both routes
go through the same wait in tests/test_mount_plan.py."""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
import types

import pytest
from polling import wait_until

from blockfs import cli
from blockfs.errors import MountError
from blockfs.serve import daemon as process

# argv: MODE GO PIDFILE, then --report-fd FD (added by start_background).
_SERVER = r"""
import os, subprocess, sys, time
from blockfs.serve.daemon import Reports
mode, go, pidfile = sys.argv[1:4]
reports = Reports(int(sys.argv[sys.argv.index("--report-fd") + 1]))
reports.report(b'{"plan": "made"}')
if mode == "slow":
    while not os.path.exists(go):  # assembling a large dataset, alive, for as long as the test says
        time.sleep(0.01)
    reports.ready()
    while True:
        time.sleep(1)
fd = int(sys.argv[sys.argv.index("--report-fd") + 1])
if mode == "dies-leaving-a-child":  # a child that outlives it holds the pipe open (as a stuck helper could)
    os.set_inheritable(fd, True)
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)"], pass_fds=(fd,))
    open(pidfile, "w").write(str(child.pid))
print("blockfs mount: error: the index is damaged: pack the dataset again", file=sys.stderr, flush=True)
sys.exit(2)
"""


def _start(tmp_path, mode: str, reports: list[bytes], **kwargs) -> int:
    (tmp_path / "mnt").mkdir(exist_ok=True)
    command = [sys.executable, "-c", _SERVER, mode, str(tmp_path / "go"), str(tmp_path / "child.pid")]
    return process.start_background(
        command, tmp_path / "mnt", str(tmp_path / "log"), on_report=reports.append, **kwargs
    )


def _stop(pid: int) -> None:
    os.kill(pid, signal.SIGKILL)
    try:
        os.waitpid(pid, 0)
    except ChildProcessError:
        pass  # reaped by subprocess already


def test_a_server_slow_to_serve_but_alive_is_waited_for(tmp_path, monkeypatch):
    # A clock that runs a minute a reading: any fixed time the wait kept (it was 30 s) runs out at once.
    clock = iter(range(0, 10**9, 60))
    monkeypatch.setattr(process, "time", types.SimpleNamespace(monotonic=lambda: next(clock), sleep=time.sleep))
    reports: list[bytes] = []
    outcome: dict = {}

    def start() -> None:
        try:
            outcome["pid"] = _start(tmp_path, "slow", reports, timeout=None)
        except BaseException as e:  # noqa: BLE001 -- the test reports it
            outcome["error"] = e

    waiter = threading.Thread(target=start)
    waiter.start()
    try:
        wait_until(lambda: reports, "the plan reported")
        assert reports == [b'{"plan": "made"}']
        assert waiter.is_alive() and not outcome, outcome  # still waiting: the server has not said it serves
        (tmp_path / "go").touch()
        waiter.join(30)
        assert "pid" in outcome, outcome
    finally:
        (tmp_path / "go").touch()
        waiter.join(30)
        if "pid" in outcome:
            _stop(outcome["pid"])


@pytest.mark.parametrize("mode", ["dies", "dies-leaving-a-child"])
def test_a_server_that_dies_fails_the_wait_at_once_with_its_error(tmp_path, mode):
    reports: list[bytes] = []
    outcome: dict = {}

    def start() -> None:
        try:
            outcome["pid"] = _start(tmp_path, mode, reports, timeout=None)
        except MountError as e:
            outcome["error"] = str(e)

    waiter = threading.Thread(target=start, daemon=True)
    waiter.start()
    try:
        # Not a timing: without looking at the process itself the wait would last as long as the child (300 s).
        wait_until(lambda: not waiter.is_alive(), "the mount's wait to fail", timeout=60)
        assert "the index is damaged: pack the dataset again" in outcome.get("error", ""), outcome
        assert reports == [b'{"plan": "made"}']
    finally:
        if (tmp_path / "child.pid").exists():
            _stop(int((tmp_path / "child.pid").read_text()))


def test_a_signal_inside_popen_stops_the_server_it_started(tmp_path, monkeypatch):
    """start_background's ``stop_on``: a signal raised inside Popen (after the fork) lost the process it
    started, left running (a server given no handoff to lose); now it is recorded and acted on once Popen
    returns, and the process is stopped."""
    import subprocess

    assert threading.current_thread() is threading.main_thread()  # where signal handlers run
    real, started = subprocess.Popen, []

    def popen(args, *rest, **kwargs):
        proc = real(args, *rest, **kwargs)
        started.append(proc.pid)
        os.kill(os.getpid(), signal.SIGINT)  # lands before Popen returns
        return proc

    reports: list[bytes] = []
    before = signal.signal(signal.SIGINT, signal.default_int_handler)  # as a terminal gives it
    try:
        monkeypatch.setattr(subprocess, "Popen", popen)
        with pytest.raises(KeyboardInterrupt) as stopped:
            _start(tmp_path, "slow", reports, timeout=None, stop_on=(signal.SIGINT,))
        monkeypatch.undo()
        assert getattr(stopped.value, "signum", None) == signal.SIGINT
        wait_until(lambda: _gone(started[0]), "the process it started to be stopped")
    finally:
        monkeypatch.undo()
        signal.signal(signal.SIGINT, before)
        (tmp_path / "go").touch()
        for pid in started:
            if not _gone(pid):
                _stop(pid)


def test_a_given_timeout_still_bounds_the_wait(tmp_path):
    reports: list[bytes] = []
    with pytest.raises(MountError, match=r"was not serving after 0\.2 s \(--timeout\)"):
        _start(tmp_path, "slow", reports, timeout=0.2)  # the server is stopped on the way out


@pytest.mark.fuse  # the mount command itself (its checks of FUSE and the mount point), the server faked
def test_blockfs_mount_waits_without_a_time_limit_unless_given_one(tmp_path, monkeypatch):
    given: list = []

    def start_background(command, mountpoint, log_path, **kwargs):
        given.append(kwargs["timeout"])
        return 1

    monkeypatch.setattr(process, "start_background", start_background)
    (tmp_path / "mnt").mkdir()
    for extra, expected in (([], None), (["--timeout", "5"], 5.0)):
        assert cli.main(["mount", str(tmp_path / "ds"), str(tmp_path / "mnt"), "-q", *extra]) == 0
        assert given.pop() == expected


@pytest.mark.fuse
@pytest.mark.parametrize("binding", ["kernel", "mfusepy"])
def test_a_mount_point_given_as_a_symbolic_link_is_mounted_at_its_target(tmp_path, monkeypatch, capsys, binding):
    # The mount table names the link's target: a mount waited for by the link's name never served (its
    # server waited to see that name mounted before it said 'ready'; the command waited for that word forever).
    from capability import has_fuse, require
    from mountutil import release

    import blockfs

    require(has_fuse(), "/dev/fuse")
    monkeypatch.setenv("BLOCKFS_FUSE", binding)
    (tmp_path / "src" / "a").mkdir(parents=True)
    (tmp_path / "src" / "a" / "x.bin").write_bytes(b"symlinked mount point")
    blockfs.pack(tmp_path / "src", tmp_path / "packed", fsync=False)
    target, link = tmp_path / "target", tmp_path / "link"
    target.mkdir()
    link.symlink_to(target)
    try:
        # --timeout: the old code fails here after a minute instead of hanging the suite
        argv = ["mount", str(tmp_path / "packed"), str(link), "--log", str(tmp_path / "log"), "--timeout", "60"]
        assert cli.main(argv) == 0
        assert (target / "a" / "x.bin").read_bytes() == b"symlinked mount point"
        assert str(target) in capsys.readouterr().out
    finally:
        release(target)


# The command: ``blockfs mount`` as a user runs it, its serving process started as the stand-in below.
_COMMAND = r"""
import faulthandler, signal, sys
# SIGUSR1: every thread's stack to stderr, then the death SIGUSR1 brings (chain): what a test that timed out
# waiting for this command shows (_ended).
faulthandler.register(signal.SIGUSR1, all_threads=True, chain=True)
# Ctrl-C as in a terminal: a suite started as a background job inherits SIGINT ignored, which the command
# rightly leaves ignored (nohup) and this test would then wait on for nothing.
signal.signal(signal.SIGINT, signal.default_int_handler)
import os, subprocess
from blockfs.cli import main
from blockfs.serve import daemon
inject = sys.argv.pop(1)
start, server, server_args = daemon.start_background, sys.argv.pop(1), [sys.argv.pop(1), sys.argv.pop(1)]
def start_stand_in(command, *args, **kwargs):
    assert command[1:3] == ["-m", "blockfs"], command
    return start([command[0], "-c", server, *server_args, *command[3:]], *args, **kwargs)
daemon.start_background = start_stand_in
# A SIGTERM of this command's own, landing at a chosen point: "popen", inside the call that starts the
# server (its pid said in SAID.popen); "cleanup", inside the unmount of what a failed server left.
if inject == "popen":
    real_popen = subprocess.Popen
    def popen(args, *rest, **kwargs):
        proc = real_popen(args, *rest, **kwargs)
        if "--report-fd" in args:
            with open(server_args[0] + ".popen", "w") as f:
                f.write(str(proc.pid))
            os.kill(os.getpid(), signal.SIGTERM)
        return proc
    subprocess.Popen = popen
elif inject == "cleanup":
    real_unmount = daemon.unmount
    def unmount(*args, **kwargs):
        os.kill(os.getpid(), signal.SIGTERM)
        return real_unmount(*args, **kwargs)
    daemon.unmount = unmount
sys.exit(main(sys.argv[1:]))
"""

# The serving process: the real one (the real mount, either route), slow to say that it serves; argv[1] a
# file where it says so ("pid"), argv[2] how it goes on: "hold" (until unmounted) or "die" (SIGKILL, its
# mount left answering ENOTCONN).
_STAND_IN = r"""
import faulthandler, os, signal, sys, time
faulthandler.register(signal.SIGUSR1, all_threads=True, chain=True)  # as the command's: stacks into its log
from blockfs.cli import main
from blockfs.serve import daemon
said, then = sys.argv.pop(1), sys.argv.pop(1)
mountpoint = sys.argv[sys.argv.index("mount") + 2]
def slow_ready(reports):
    with open(said + ".tmp", "w") as f:
        f.write(str(os.getpid()))
    os.rename(said + ".tmp", said)
    if then == "die":
        os.kill(os.getpid(), signal.SIGKILL)
    while daemon.is_mounted(mountpoint):  # a server mounted and serving, not yet saying so
        time.sleep(0.01)
daemon.Reports.ready = slow_ready
sys.exit(main(sys.argv[1:]))
"""


def _gone(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].split()[0] in (b"Z", b"X")
    except OSError:
        return True


@pytest.fixture(scope="module")
def packed(tmp_path_factory):
    import blockfs

    root = tmp_path_factory.mktemp("wait")
    (root / "src").mkdir()
    (root / "src" / "a.txt").write_bytes(b"hello\n")
    blockfs.pack(root / "src", root / "packed", fsync=False)
    return root / "packed"


def _ended(command, server: int | None, log, timeout: float = 60) -> tuple[str, str]:
    """``command``'s output once it exits; if it has not within a minute, a failure that shows where it and
    its server were stuck: both dump every thread's stack (SIGUSR1, registered by _COMMAND and _STAND_IN)."""
    import subprocess

    try:
        return command.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        pass
    command.send_signal(signal.SIGUSR1)  # first: the server's end could let it go on
    out, err = command.communicate(timeout=30)
    if server is not None and not _gone(server):
        os.kill(server, signal.SIGUSR1)
        try:
            wait_until(lambda: _gone(server), "the server to dump its stacks and end", timeout=30)
        except AssertionError:
            pass  # stuck in the kernel (no handler runs): its log says so by the stacks it lacks
    served = log.read_text(errors="replace")[-6000:] if log.exists() else "(no log)"
    pytest.fail(
        f"'blockfs mount' did not exit within {timeout:g} s of the signal; its output and stacks:\n{out}\n{err}\n"
        f"its server's log (stacks at its end):\n{served}"
    )


def _mount_command(tmp_path, packed, then: str, inject: str = "none") -> tuple:
    import subprocess

    (tmp_path / "mnt").mkdir()
    said = tmp_path / "server.pid"
    argv = [sys.executable, "-c", _COMMAND, inject, _STAND_IN, said, then, "mount", packed, tmp_path / "mnt"]
    argv += ["--log", tmp_path / "log"]
    command = subprocess.Popen([str(a) for a in argv], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    return command, said


@pytest.mark.fuse
@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT, signal.SIGHUP], ids=lambda s: signal.Signals(s).name)
def test_a_signal_while_mount_waits_stops_its_server_and_leaves_no_mount(tmp_path, packed, signum):
    """SIGTERM killed 'blockfs mount' at once while it waited for its server's word, leaving the server (a
    new session: the signal never reached it) mounted or half-started.  Now the command stops it, and exits
    as the signal would, saying so in one line."""
    from capability import has_fuse, require
    from mountutil import release

    require(has_fuse(), "/dev/fuse")
    mnt = tmp_path / "mnt"
    command, said = _mount_command(tmp_path, packed, "hold")
    server = None
    try:
        wait_until(lambda: said.exists() and process.is_mounted(mnt), "the server to mount", timeout=60)
        server = int(said.read_text())
        command.send_signal(signum)
        out, err = _ended(command, server, tmp_path / "log")
        assert command.returncode == 128 + signum, (out, err)
        what = "interrupted" if signum == signal.SIGINT else f"stopped by {signal.Signals(signum).name}"
        assert err.strip() == (
            f"blockfs mount: {what}; the serving process it started was stopped, nothing is mounted at {mnt}"
        )
        assert not process.is_mounted(mnt)
        wait_until(lambda: _gone(server), "the serving process to end")
    finally:
        if command.poll() is None:
            command.kill()
            command.wait(10)
        if server is not None and not _gone(server):
            os.kill(server, signal.SIGKILL)
        release(mnt)


@pytest.mark.fuse
@pytest.mark.parametrize("inject", ["none", "cleanup"], ids=["dies", "signal-while-clearing"])
def test_a_server_that_dies_after_mounting_leaves_no_mount_behind(tmp_path, packed, inject):
    """The server dies after mounting: the command clears the dead mount it left (ENOTCONN).  ``cleanup``: a
    signal raised inside that unmount cut it short, leaving the dead mount; now the clearing finishes, and
    the server's failure is the error."""
    from capability import has_fuse, require
    from mountutil import release

    require(has_fuse(), "/dev/fuse")
    mnt = tmp_path / "mnt"
    command, _said = _mount_command(tmp_path, packed, "die", inject=inject)
    try:
        out, err = _ended(command, None, tmp_path / "log")
        assert command.returncode == 2 and "before serving" in err, (out, err)
        assert not process.is_mounted(mnt)
    finally:
        if command.poll() is None:
            command.kill()
            command.wait(10)
        release(mnt)


@pytest.mark.fuse
def test_a_signal_while_mount_starts_its_server_stops_that_server(tmp_path, packed):
    """A signal that lands inside the call that starts the server (Popen) is acted on once that call returns:
    the server is stopped.  (Before, the exception raised there lost the process; the command's server then
    died only because the pipe that was to hand it the storage options closed: test below.)"""
    from capability import has_fuse, require
    from mountutil import release

    require(has_fuse(), "/dev/fuse")
    mnt = tmp_path / "mnt"
    command, said = _mount_command(tmp_path, packed, "hold", inject="popen")
    started = tmp_path / "server.pid.popen"
    try:
        out, err = _ended(command, None, tmp_path / "log")
        assert command.returncode == 128 + signal.SIGTERM, (out, err)
        assert err.strip() == (
            f"blockfs mount: stopped by SIGTERM; the serving process it started was stopped, nothing is mounted at {mnt}"
        )
        server = int(started.read_text())
        wait_until(lambda: _gone(server), "the serving process to end")
        assert not said.exists() and not process.is_mounted(mnt)
    finally:
        if command.poll() is None:
            command.kill()
            command.wait(10)
        if started.exists() and not _gone(int(started.read_text())):
            os.kill(int(started.read_text()), signal.SIGKILL)
        release(mnt)
