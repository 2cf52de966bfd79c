"""blockfs.serve.fuse.session: mounting (mount(2) and fusermount3), answering, deferring and unmounting, with a
two-entry filesystem of handlers written here — no blockfs dataset involved."""

from __future__ import annotations

import errno
import os
import stat
import subprocess
import sys
import threading

import pytest
from capability import has_fuse, require
from polling import wait_until

from blockfs.serve.fuse import wire
from blockfs.serve.fuse.session import DEFERRED, MountFailed, Session

pytestmark = [pytest.mark.fuse, pytest.mark.any_route]  # the kernel protocol's own session: no other route

DATA = b"hello from the kernel protocol\n"


def tiny_fs(session_box: list, slow: threading.Event) -> dict:
    """/ (node 1) holding "f" (node 2, DATA) and "slow" (node 3, answered once ``slow`` is set)."""
    attrs = {
        1: wire.attr(1, 0, stat.S_IFDIR | 0o555, 2, 0, 0, 0),
        2: wire.attr(2, len(DATA), stat.S_IFREG | 0o444, 1, 0, 0, 0),
        3: wire.attr(3, len(DATA), stat.S_IFREG | 0o444, 1, 0, 0, 0),
    }
    names = {b"f": 2, b"slow": 3}

    def lookup(nodeid, body, unique):
        node = names.get(bytes(body[:-1])) if nodeid == 1 else None
        if node is None:
            raise OSError(errno.ENOENT, "no such name")
        return wire.entry_out(node, attrs[node], 1)

    def getattr_(nodeid, body, unique):
        return wire.attr_out(attrs[nodeid], 1)

    def read(nodeid, body, unique):
        _fh, offset, size, _ = wire.READ_IN.unpack_from(body)
        if nodeid == 3:  # answered later, from another thread, once the test says so
            threading.Thread(
                target=lambda: (slow.wait(30), session_box[0].reply(unique, DATA[offset : offset + size]))
            ).start()
            return DEFERRED
        return DATA[offset : offset + size]

    return {wire.LOOKUP: lookup, wire.GETATTR: getattr_, wire.READ: read}


@pytest.mark.parametrize("via", ["mount(2)", "fusermount3"])
def test_a_session_mounts_answers_defers_and_unmounts(tmp_path, via):
    require(has_fuse(), "/dev/fuse")
    require(os.geteuid() == 0 or via == "fusermount3", "root (mount(2))")
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    box: list = []
    slow = threading.Event()
    session = Session(tiny_fs(box, slow), on_init=lambda minor, flags: wire.ASYNC_READ)
    box.append(session)
    session.mount(str(mnt), "tiny-test", "tinytest", fusermount=(via == "fusermount3"))
    server = threading.Thread(target=session.serve, args=(2,), daemon=True)
    server.start()
    try:
        assert (mnt / "f").read_bytes() == DATA
        got: list = []
        reader = threading.Thread(target=lambda: got.append((mnt / "slow").read_bytes()))
        reader.start()
        # The other reader thread answers lookups while the slow read waits for its deferred answer.
        wait_until(lambda: session.requests[wire.READ] >= 2, "the slow read to reach the server")
        assert os.stat(mnt / "f").st_size == len(DATA) and not got
        slow.set()
        reader.join(10)
        assert got == [DATA]
        with open("/proc/self/mounts") as f:
            line = next(line for line in f if str(mnt) in line)
        assert "fuse.tinytest" in line and line.startswith("tiny-test ") and " ro," in line
    finally:
        session.unmount()
        server.join(10)
    assert not server.is_alive() and not os.path.ismount(mnt)


def test_an_option_the_kernel_route_cannot_honour_is_refused_in_one_line(tmp_path):
    session = Session({})
    try:
        with pytest.raises(MountFailed) as raised:
            session.mount(str(tmp_path), "x", "x", ["max_threads=4", "uid=0"])  # ignored, refused
    finally:
        session.unmount()  # had it mounted, never left behind
    assert "'uid=0'" in str(raised.value) and "--fuse mfusepy" in str(raised.value)
    assert "max_threads" not in str(raised.value).split("(")[0] and len(str(raised.value).splitlines()) == 1


class Span:
    """``n`` bytes of data at ``start`` without holding them (len() and slices only): a file of 5 GiB
    without the memory."""

    def __init__(self, start: int, n: int) -> None:
        self.start, self.n = start, n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, part: slice) -> Span:
        lo, hi, _ = part.indices(self.n)
        return Span(self.start + lo, max(0, hi - lo))


def stores_written(monkeypatch, fail_at: int | None = None) -> list[tuple[int, int, int, int]]:
    """Replace os.writev with one that parses each FUSE_NOTIFY_STORE as the kernel would: a list of
    (node, offset, size, the data's start) that fills as messages arrive; the ``fail_at``-th answers ENOENT."""
    sent: list[tuple[int, int, int, int]] = []

    def writev(fd: int, parts: list) -> int:
        head, data = parts
        length, code, unique = wire.OUT_HEADER.unpack_from(head)
        node, offset, size, _ = wire.NOTIFY_STORE_OUT.unpack_from(head, wire.OUT_HEADER.size)
        assert (code, unique) == (wire.NOTIFY_STORE, 0) and size == len(data) and length == len(head) + size
        if len(sent) == fail_at:
            raise OSError(errno.ENOENT, "no such node")
        sent.append((node, offset, size, data.start))
        return length

    monkeypatch.setattr(os, "writev", writev)
    return sent


@pytest.mark.parametrize("size", [5, wire.STORE_PIECE, 3 * wire.STORE_PIECE + 5, (2 << 30) + 7, (5 << 30) + 3])
def test_a_store_of_any_size_goes_in_pieces_the_kernel_takes(monkeypatch, size):
    """Each message at most STORE_PIECE bytes (under the u32 size and write(2)'s 2 GiB), the offsets
    advancing over the whole file, the data in order: files of 2 GiB and more reach the page cache too."""
    sent = stores_written(monkeypatch)
    assert Session({}).store(7, Span(0, size), offset=0)
    assert all(node == 7 and 0 < n <= wire.STORE_PIECE for node, _, n, _ in sent)
    assert [off for _, off, _, _ in sent] == [start for *_, start in sent] == list(range(0, size, wire.STORE_PIECE))
    assert sum(n for _, _, n, _ in sent) == size


def test_a_store_refused_midway_says_so_and_sends_no_more(monkeypatch):
    sent = stores_written(monkeypatch, fail_at=2)
    assert not Session({}).store(7, Span(0, 5 * wire.STORE_PIECE))  # the node was forgotten meanwhile
    assert len(sent) == 2


def test_serving_finds_libc_without_running_ldconfig():
    """``ctypes.util.find_library`` runs ``/sbin/ldconfig -p`` (a process, and a parse of every library the
    machine has) on each call: three of them were ~50 ms of every mount.  libc is the process's own."""
    probe = (
        "import ctypes.util\n"
        "def refuse(name): raise AssertionError(f'find_library({name!r}) runs ldconfig')\n"
        "ctypes.util.find_library = refuse\n"
        "import blockfs.serve.server, blockfs.core.heap, blockfs.core.index_copy\n"
        "from blockfs.serve.fuse import session\n"
        "assert session._libc().umount2 and blockfs.core.heap._trim is not None\n"
    )
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr


def test_a_write_that_outlives_the_session_never_lands_in_a_file_opened_since(tmp_path, monkeypatch):
    """A push (or a late answer) that has read the session's descriptor number when the mount ends writes
    after the session let go of /dev/fuse.  Closed, the number went to the next file opened, and the FUSE
    message into that file; now the number is kept for a descriptor that refuses the write."""
    import fcntl

    require(has_fuse(), "/dev/fuse")
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    box: list = []
    session = Session(tiny_fs(box, threading.Event()))
    box.append(session)
    session.mount(str(mnt), "tiny-test", "tinytest")
    server = threading.Thread(target=session.serve, args=(2,), daemon=True)
    server.start()
    real_writev, inside, go = os.writev, threading.Event(), threading.Event()

    def writev(fd: int, parts: list) -> int:
        if threading.current_thread().name == "late-push":  # the number read, the GIL dropped: held here
            inside.set()
            go.wait(30)
        return real_writev(fd, parts)

    monkeypatch.setattr(os, "writev", writev)
    stored: list = []
    late = threading.Thread(target=lambda: stored.append(session.store(2, b"FUSE message")), name="late-push")
    victim = None
    try:
        wait_until(lambda: session.requests[wire.INIT], "the kernel's INIT")
        late.start()
        assert inside.wait(10)
        number = session.fd
    finally:
        session.unmount()
        server.join(10)
    try:
        assert not server.is_alive() and not os.path.ismount(mnt)
        victim = os.open(tmp_path / "victim", os.O_WRONLY | os.O_CREAT | os.O_CLOEXEC, 0o600)
        if victim != number:  # moved to the lowest free number from it on: that one, once it is free
            first, victim = victim, fcntl.fcntl(victim, fcntl.F_DUPFD_CLOEXEC, number)
            os.close(first)
    finally:
        go.set()
        if late.ident is not None:
            late.join(10)
        if victim is not None:
            os.close(victim)
    assert (tmp_path / "victim").read_bytes() == b""
    assert stored == [False]  # refused: not stored


def test_the_descriptor_is_retired_once_and_closed_when_no_spare_one_can_be_opened(tmp_path, monkeypatch):
    """_retire_fd again (a second serve's end) registers no second close of the number, which by then could
    be another file's; with no descriptor to spare for the inert one, the connection is still closed."""
    import gc

    real_close, closed = os.close, []

    def counted_close(fd: int) -> None:
        closed.append(fd)
        real_close(fd)

    monkeypatch.setattr(os, "close", counted_close)
    session = Session({})
    session.fd = os.open(tmp_path / "stand-in", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    session._retire_fd()
    session._retire_fd()
    number = session.fd
    with pytest.raises(OSError):
        os.write(number, b"x")  # refused: the inert descriptor
    assert number not in closed
    del session
    gc.collect()
    assert closed.count(number) == 1  # by the one finalizer
    monkeypatch.undo()

    real_open = os.open
    session = Session({})
    session.fd = real_open(tmp_path / "stand-in", os.O_RDWR | os.O_CLOEXEC)
    number = session.fd

    def no_spare(path, flags, *args, **kwargs):
        if flags & os.O_PATH:
            raise OSError(24, "Too many open files")
        return real_open(path, flags, *args, **kwargs)

    monkeypatch.setattr(os, "open", no_spare)
    session._retire_fd()
    monkeypatch.undo()
    with pytest.raises(OSError):
        os.fstat(number)  # closed
