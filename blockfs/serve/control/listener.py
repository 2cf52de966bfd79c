"""One thread per control socket, whatever its clients do: the base of the announcement and share servers.

Both sockets' names are public (``/proc/net/unix`` lists abstract addresses), so any process on the machine
can connect, as often and as slowly as it likes.  A thread or a blocking read per connection lets one
client stall the others (an idle connection held the announcement thread for its whole timeout) and lets
many clients exhaust threads; a log line per refused connection lets another user fill the disk.  So:

* one thread per socket waits on all its connections with a selector and reads each without blocking,
  into that connection's own buffer: a slow or idle client holds a buffer, never the thread;
* at most ``max_connections`` open at once: a new one past that closes the one idle the longest;
* refusals (another user's process) are logged at most once per ``REFUSAL_LOG_INTERVAL_S``, with the
  number refused since the last line;
* work that may wait (loading a block to share it) goes to a small fixed pool owned by the subclass, with
  the connection's reads paused until it is answered (:meth:`pause`, :meth:`resume`).
"""

from __future__ import annotations

import collections
import logging
import os
import secrets
import selectors
import socket
import struct
import threading
import time
from typing import cast

log = logging.getLogger(__name__)

REFUSAL_LOG_INTERVAL_S = 10.0
ACCEPTS_PER_ROUND = 64  # then the connections already open get their turn: a flood cannot starve them


class RefusalLog:
    """Logs a refused peer at most once per ``interval_s``, counting the refusals it did not log."""

    def __init__(self, what: str, interval_s: float = REFUSAL_LOG_INTERVAL_S) -> None:
        self.what = what
        self.interval_s = interval_s
        self.refused = 0  # in all
        self._unlogged = 0
        self._last = -float("inf")

    def refuse(self, pid: int, uid: int) -> None:
        self.refused += 1
        now = time.monotonic()
        if now - self._last < self.interval_s:
            self._unlogged += 1
            return
        more = f" ({self._unlogged} more refused since the last such line)" if self._unlogged else ""
        log.warning("%s refused: process %d of user %d is not this mount's user%s", self.what, pid, uid, more)
        self._last, self._unlogged = now, 0


def peer_credentials(conn: socket.socket) -> tuple[int, int]:
    """(pid, uid) of the process at the other end of a Unix socket."""
    pid, uid, _gid = struct.unpack("3i", conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12))
    return pid, uid


class Connection:
    """One accepted client: its socket, what it sent so far, and whether its reads wait on an answer."""

    __slots__ = ("sock", "buffer", "paused")

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.buffer = bytearray()
        self.paused = False


class SocketServer:
    """A listening Unix socket at a fresh abstract ``address``, served by one selector thread.

    Subclasses implement :meth:`on_readable` (read from ``conn.sock`` without blocking; return False to
    close the connection).
    """

    def __init__(self, kind: int, prefix: bytes, what: str, max_connections: int, name: str) -> None:
        self.what = what
        self.max_connections = max_connections
        self.refusals = RefusalLog(what)
        self.address = prefix + secrets.token_hex(12).encode()
        self._server = socket.socket(socket.AF_UNIX, kind | socket.SOCK_CLOEXEC)
        self._server.bind(self.address)
        self._server.listen(min(max_connections, 128))
        self._server.setblocking(False)
        self._selector = selectors.DefaultSelector()
        self._selector.register(self._server, selectors.EVENT_READ)
        self._wake_r, self._wake_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        self._wake_lock = threading.Lock()
        self._selector.register(self._wake_r, selectors.EVENT_READ)
        self._conns: collections.OrderedDict[socket.socket, Connection] = collections.OrderedDict()
        self._resumed: collections.deque[Connection] = collections.deque()
        self._closed = False
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    # --- for subclasses ---------------------------------------------------------------------------
    def on_readable(self, conn: Connection) -> bool:
        raise NotImplementedError

    def pause(self, conn: Connection) -> None:
        """Stop reading ``conn`` until :meth:`resume` (from the selector thread only)."""
        conn.paused = True
        self._selector.unregister(conn.sock)

    def resume(self, conn: Connection) -> None:
        """Read ``conn`` again; from any thread."""
        self._resumed.append(conn)
        self._wake()

    def open_connections(self) -> int:
        return len(self._conns)

    # --- the thread -------------------------------------------------------------------------------
    def _run(self) -> None:
        while not self._closed:
            for key, _events in self._selector.select():
                if key.fileobj is self._server:
                    self._accept()
                elif key.fileobj == self._wake_r:
                    self._drain_wake()
                else:
                    # the rest registered are connections' sockets (None: closed since)
                    self._serve(self._conns.get(cast(socket.socket, key.fileobj)))

    def _accept(self) -> None:
        for _ in range(ACCEPTS_PER_ROUND):
            try:
                sock, _ = self._server.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError:
                return  # closed, or out of descriptors: the next round tries again
            try:
                pid, uid = peer_credentials(sock)
            except OSError:
                sock.close()
                continue
            if uid not in (os.getuid(), 0):
                self.refusals.refuse(pid, uid)
                sock.close()
                continue
            sock.setblocking(False)
            if len(self._conns) >= self.max_connections:
                self._drop_oldest_idle()
            self._conns[sock] = Connection(sock)
            self._selector.register(sock, selectors.EVENT_READ)

    def _drop_oldest_idle(self) -> None:
        for conn in self._conns.values():  # oldest activity first
            if not conn.paused:
                log.debug("%s: %d connections open, closing the one idle longest", self.what, len(self._conns))
                self._close(conn)
                return

    def _serve(self, conn: Connection | None) -> None:
        if conn is None:
            return
        self._conns.move_to_end(conn.sock)
        try:
            keep = self.on_readable(conn)
        except (BlockingIOError, InterruptedError):
            keep = True
        except OSError as e:
            log.debug("%s connection ended: %s", self.what, e)
            keep = False
        if not keep:
            self._close(conn)

    def _close(self, conn: Connection) -> None:
        if self._conns.pop(conn.sock, None) is None:
            return
        if not conn.paused:
            self._selector.unregister(conn.sock)
        conn.sock.close()

    def _wake(self) -> None:
        with self._wake_lock:  # never write to the number of a pipe end closed (and maybe reused) since
            if self._wake_w < 0:
                return
            try:
                os.write(self._wake_w, b"\0")
            except BlockingIOError:
                pass  # the pipe is full: the thread wakes anyway

    def _drain_wake(self) -> None:
        try:
            while os.read(self._wake_r, 4096):
                pass
        except BlockingIOError:
            pass
        while self._resumed:
            conn = self._resumed.popleft()
            if conn.sock in self._conns and conn.paused:
                conn.paused = False
                self._selector.register(conn.sock, selectors.EVENT_READ)
            elif conn.sock not in self._conns:
                conn.sock.close()

    def close(self) -> None:
        """Stop listening, close every connection and join the thread."""
        self._closed = True
        self._wake()
        self._thread.join(timeout=5)
        for conn in list(self._conns.values()):
            self._close(conn)
        self._selector.close()
        self._server.close()
        with self._wake_lock:
            os.close(self._wake_r)
            os.close(self._wake_w)
            self._wake_w = -1
