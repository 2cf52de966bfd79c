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
import re
import socket
import threading
import time

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
HEADERS_MAX = 32  # and one of more header lines than this (a request needs 3 or 4, an answer 2 to 4)
HEAD_S = 10.0  # a head begun must end within this (bytes dribbled within each wait's timeout would not)
_TOKEN = re.compile(r"[!#$%&'*+.^_`|~0-9A-Za-z-]+")  # a header's name (RFC 9110's token)
_ALLOWED = bytes(range(0x20, 0x7F)) + b"\t\r\n"  # the bytes of a head (its values: visible ASCII, spaces, tabs)


def read_head(sock: socket.socket, pending: bytearray) -> tuple[str, dict[str, str]] | None:
    """The next HTTP/1.1 head on ``sock``: its first line and its headers (names lower-case); what came
    after it stays in ``pending`` (bytes already received).  None when the stream ends before a byte of
    it.  OSError (EPROTO) for a head cut short, longer than :data:`HEAD_LIMIT`, of more than
    :data:`HEADERS_MAX` headers, with a header that is not ``token: visible ASCII`` or that comes twice;
    TimeoutError for a head not whole :data:`HEAD_S` after its first byte (and, as for every wait, for no
    byte within the socket's timeout).

    HTTP framed by hand (``tools/bench/bench_peer_http.py``, docs/benchmarks.md): ``http.server`` +
    ``http.client`` and ``h11`` cost 2-3x its CPU per ranged GET; ``httptools`` (llhttp) about the same, but
    has no limit on a head's size or header count, takes repeated headers, bytes past ASCII and an empty
    chunked body, so every check here would be written around it all the same.  A peer's head has no
    business with folded lines, bare LFs, repeated headers or bytes that are not ASCII: refused."""
    searched, started, deadline, idle = 0, False, 0.0, sock.gettimeout()
    try:
        while (end := pending.find(b"\r\n\r\n", searched)) < 0:
            if len(pending) > HEAD_LIMIT:
                raise OSError(errno.EPROTO, f"an HTTP head longer than {HEAD_LIMIT} bytes")
            if pending:  # part of a head: the rest within HEAD_S of its first byte, however it dribbles
                if b"\n\n" in pending or b"\n\r\n" in pending:  # an empty line, but not CRLF: refused, not waited on
                    raise OSError(errno.EPROTO, "an HTTP head whose lines end in a bare LF, not CRLF")
                searched = max(len(pending) - 3, 0)
                now = time.monotonic()
                if not started:
                    started, deadline = True, now + HEAD_S
                if now >= deadline:
                    raise TimeoutError(errno.ETIMEDOUT, f"an HTTP head not whole within {HEAD_S:g} s")
                sock.settimeout(deadline - now if idle is None else min(idle, deadline - now))
            chunk = sock.recv(1 << 16)
            if not chunk:
                if pending:
                    raise OSError(errno.EPROTO, "the connection closed in the middle of an HTTP head")
                return None
            pending += chunk
    finally:
        if started:
            sock.settimeout(idle)
    if end > HEAD_LIMIT:
        raise OSError(errno.EPROTO, f"an HTTP head longer than {HEAD_LIMIT} bytes")
    raw = bytes(pending[:end])
    del pending[: end + 4]
    text = raw.decode("latin-1")
    lines = text.split("\r\n")
    # Visible ASCII, spaces and tabs, lines ending in CRLF: no other byte, no CR or LF alone (at C speed).
    if raw.translate(None, _ALLOWED) or not len(lines) - 1 == text.count("\r") == text.count("\n"):
        raise OSError(errno.EPROTO, "an HTTP head with a byte that is not visible ASCII, or a CR or LF alone")
    if len(lines) > HEADERS_MAX + 1:
        raise OSError(errno.EPROTO, f"an HTTP head of more than {HEADERS_MAX} headers")
    headers: dict[str, str] = {}
    for line in lines[1:]:
        name, sep, value = line.partition(":")
        if not sep or _TOKEN.fullmatch(name) is None:
            raise OSError(errno.EPROTO, "an HTTP header that is not 'name: value'")
        name = name.lower()
        if name in headers:
            raise OSError(errno.EPROTO, f"the HTTP header {name!r} twice")
        headers[name] = value.strip(" \t")
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
        self._signed: dict[str, str] = {}  # path -> its signature: one HMAC per block, not per request

    def get_into(self, path: str, view: memoryview, offset: int, total: int) -> None:
        """Fill ``view`` with bytes ``[offset, offset + len(view))`` of the block at ``path`` (``total``
        bytes long), or raise OSError: no answer in time, or an answer that is not exactly that range."""
        lo, hi = offset, offset + len(view)
        auth = self._signed.get(path)
        if auth is None:
            auth = self._signed[path] = sign(self._secret, path)
        lines = [f"GET {path} HTTP/1.1", f"Host: {self.address}", f"{AUTH_HEADER}: {auth}"]
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
        if done:
            with memoryview(conn.pending) as got:  # the body's first bytes, copied once (a slice copies twice)
                view[:done] = got[:done]
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
