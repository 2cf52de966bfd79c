"""The peer protocol, both sides' share of it, and :class:`PeerClient`: ranged GETs of one peer's blocks.

``GET /blockfs/v1/<dataset>/<block>``, where ``<dataset>`` is the hex of the dataset's name
(``blake3:<hex>``) and ``<block>`` a decimal block number, with the header ``X-Blockfs-Auth: <HMAC-SHA256 of
"GET <path>" under the job's secret>`` (the secret itself never crosses the network) and, for part of the
block, ``Range: bytes=a-b``.  The answer is exactly that range (206 with its ``Content-Range``) or the whole
block (200, when the whole block was asked for).  An owner that must fetch the block first answers its
headers at once with ``X-Blockfs-Fetching: 1`` and the body when the block is verified; the asker then waits
:data:`OWNER_FETCH_S` for it, not its own store (one fetch per block for the whole cluster).  The server is
:mod:`blockfs.serve.peer_endpoint`.

A reader asks for what it needs — one file's bytes, a header, a whole data section — so a request costs a
round trip, not a block: :class:`PeerClient` keeps a few connections to its peer open between requests
(HTTP/1.1 keep-alive), and a kept connection the peer has closed meanwhile is replaced once, at once.  Both
sides frame HTTP with :func:`read_head` (plain HTTP/1.1: ``curl`` can ask an endpoint).  Any
answer but the range asked for is an ``OSError``; what it does send is trusted for nothing (the verifier
checks it before a byte is used).
"""

from __future__ import annotations

import errno
import hashlib
import hmac
import socket
import threading

PATH_PREFIX = "/blockfs/v1/"
AUTH_HEADER = "X-Blockfs-Auth"
FETCHING_HEADER = "X-Blockfs-Fetching"  # the owner is fetching the block: wait for it, not the store
OWNER_FETCH_S = 30.0  # how long an owner may take to fetch a block it said it is fetching
IDLE_KEPT = 8  # connections kept open to one peer between requests (one per reader thread, about)


def block_path(dataset: str, block: int) -> str:
    """The request path of ``block`` of the dataset named ``dataset`` (``blake3:<hex>`` or the hex)."""
    return f"{PATH_PREFIX}{dataset.removeprefix('blake3:')}/{block}"


def sign(secret: bytes, path: str) -> str:
    """The value of :data:`AUTH_HEADER` for a GET of ``path``."""
    return hmac.new(secret, b"GET " + path.encode(), hashlib.sha256).hexdigest()


def split_address(address: str) -> tuple[str, int]:
    """``HOST:PORT`` (``[v6]:PORT`` too) as (host, port); ValueError naming it otherwise."""
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"peer address {address!r} is not HOST:PORT")
    return host.strip("[]"), int(port)


HEAD_LIMIT = 16 << 10  # a request's or an answer's head (its line and headers) longer than this is refused


def read_head(sock: socket.socket, pending: bytearray) -> tuple[str, dict[str, str]] | None:
    """The next HTTP/1.1 head on ``sock``: its first line and its headers (names lower-case); what came
    after it stays in ``pending`` (bytes already received).  None when the stream ends before a byte of
    it; OSError for a head cut short, longer than :data:`HEAD_LIMIT` or not made of ``name: value`` lines.

    HTTP framed by hand, not by ``http.server``/``http.client``: their header parsing (the ``email``
    package) costs several times the rest of a request's round trip, and a file read from a peer is one
    round trip."""
    while (end := pending.find(b"\r\n\r\n")) < 0:
        if len(pending) > HEAD_LIMIT:
            raise OSError(errno.EPROTO, f"an HTTP head longer than {HEAD_LIMIT} bytes")
        chunk = sock.recv(1 << 16)
        if not chunk:
            if pending:
                raise OSError(errno.EPROTO, "the connection closed in the middle of an HTTP head")
            return None
        pending += chunk
    if end > HEAD_LIMIT:
        raise OSError(errno.EPROTO, f"an HTTP head longer than {HEAD_LIMIT} bytes")
    lines = bytes(pending[:end]).decode("latin-1").split("\r\n")
    del pending[: end + 4]
    headers = {}
    for line in lines[1:]:
        name, sep, value = line.partition(":")
        if not sep or not name or name != name.strip():
            raise OSError(errno.EPROTO, "an HTTP header that is not 'name: value'")
        headers[name.lower()] = value.strip()
    return lines[0], headers


class _Connection:
    """A socket to the peer and the bytes received on it past the last answer's head."""

    __slots__ = ("sock", "pending", "reused")

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.pending = bytearray()
        self.reused = False

    def close(self) -> None:
        self.sock.close()


class PeerClient:
    """Ranged GETs from the peer at ``address``, signed with ``secret``; ``timeout`` bounds every wait."""

    def __init__(self, address: str, secret: bytes, timeout: float) -> None:
        self.address = address
        self.host, self.port = split_address(address)
        self._secret = secret
        self.timeout = timeout
        self._idle: list[_Connection] = []
        self._lock = threading.Lock()

    def get_into(self, path: str, view: memoryview, offset: int, total: int) -> None:
        """Fill ``view`` with bytes ``[offset, offset + len(view))`` of the block at ``path`` (``total``
        bytes long), or raise OSError: no answer in time, or an answer that is not exactly that range."""
        lo, hi = offset, offset + len(view)
        lines = [f"GET {path} HTTP/1.1", f"Host: {self.address}", f"{AUTH_HEADER}: {sign(self._secret, path)}"]
        if (lo, hi) != (0, total):
            lines.append(f"Range: bytes={lo}-{hi - 1}")
        request = ("\r\n".join(lines) + "\r\n\r\n").encode()
        for fresh in (False, True):
            conn = self._connection(fresh)
            try:
                try:
                    conn.sock.sendall(request)
                    head = read_head(conn.sock, conn.pending)
                except (ConnectionResetError, BrokenPipeError, ConnectionAbortedError):
                    head = None
                if head is None:
                    if conn.reused:  # closed by the peer while it was kept: once more, on a new connection
                        conn.close()
                        continue
                    raise OSError(errno.EIO, f"peer {self.address} closed the connection unanswered")
                keep = self._receive(conn, head, view, lo, hi, total)
            except BaseException:
                conn.close()
                raise
            self._release(conn, keep)
            return

    def _receive(
        self, conn: _Connection, head: tuple[str, dict[str, str]], view: memoryview, lo: int, hi: int, total: int
    ) -> bool:
        """Check the answer's head says it is exactly ``[lo, hi)``, and read its body into ``view``; whether
        the connection may be kept."""
        line, headers = head
        parts = line.split(" ", 2)
        status = parts[1] if len(parts) > 1 and parts[0].startswith("HTTP/1.") else ""
        whole = (lo, hi) == (0, total)
        if status != ("200" if whole else "206"):
            raise OSError(errno.EIO, f"peer {self.address} answered {line[:80]!r}, not {200 if whole else 206}")
        if headers.get("content-length") != str(hi - lo):
            raise OSError(
                errno.EIO, f"peer {self.address} offered {headers.get('content-length')} bytes, not {hi - lo}"
            )
        if not whole and headers.get("content-range") != f"bytes {lo}-{hi - 1}/{total}":
            raise OSError(
                errno.EIO,
                f"peer {self.address} sent range {headers.get('content-range')!r}, not bytes {lo}-{hi - 1}/{total}",
            )
        if headers.get(FETCHING_HEADER.lower()):
            conn.sock.settimeout(max(self.timeout, OWNER_FETCH_S))  # the owner fetches it once for all
        done = min(len(conn.pending), len(view))
        view[:done] = conn.pending[:done]
        del conn.pending[:done]
        while done < len(view):
            n = conn.sock.recv_into(view[done:])
            if not n:
                raise OSError(errno.EIO, f"peer {self.address} sent {done} of the {len(view)} bytes asked")
            done += n
        if conn.pending:  # bytes past the answer: the stream is out of step
            raise OSError(errno.EPROTO, f"peer {self.address} sent more than its answer")
        return headers.get("connection", "").lower() != "close"

    def _connection(self, fresh: bool) -> _Connection:
        """A kept connection, or a new one."""
        if not fresh:
            with self._lock:
                kept = self._idle.pop() if self._idle else None
            if kept is not None:
                kept.sock.settimeout(self.timeout)
                kept.reused = True
                return kept
        sock = socket.create_connection((self.host, self.port), timeout=self.timeout)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)  # a request is one small segment
        return _Connection(sock)

    def _release(self, conn: _Connection, keep: bool) -> None:
        """Keep ``conn`` for the next request, if the peer keeps it open and there is room."""
        if keep:
            with self._lock:
                if len(self._idle) < IDLE_KEPT:
                    self._idle.append(conn)
                    return
        conn.close()

    def close(self) -> None:
        with self._lock:
            idle, self._idle = self._idle, []
        for conn in idle:
            conn.close()
