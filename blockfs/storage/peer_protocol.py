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
(HTTP/1.1 keep-alive), and a kept connection the peer has closed meanwhile is replaced once, at once.  Any
answer but the range asked for is an ``OSError``; what it does send is trusted for nothing (the verifier
checks it before a byte is used).
"""

from __future__ import annotations

import errno
import hashlib
import hmac
import http.client
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


_STALE = (http.client.RemoteDisconnected, ConnectionResetError, BrokenPipeError, ConnectionAbortedError)


class PeerClient:
    """Ranged GETs from the peer at ``address``, signed with ``secret``; ``timeout`` bounds every wait."""

    def __init__(self, address: str, secret: bytes, timeout: float) -> None:
        self.address = address
        self.host, self.port = split_address(address)
        self._secret = secret
        self.timeout = timeout
        self._idle: list[http.client.HTTPConnection] = []
        self._lock = threading.Lock()

    def get_into(self, path: str, view: memoryview, offset: int, total: int) -> None:
        """Fill ``view`` with bytes ``[offset, offset + len(view))`` of the block at ``path`` (``total``
        bytes long), or raise OSError: no answer in time, or an answer that is not exactly that range."""
        lo, hi = offset, offset + len(view)
        headers = {AUTH_HEADER: sign(self._secret, path)}
        if (lo, hi) != (0, total):
            headers["Range"] = f"bytes={lo}-{hi - 1}"
        for fresh in (False, True):
            conn, reused = self._connection(fresh)
            try:
                try:
                    conn.request("GET", path, headers=headers)
                    resp = conn.getresponse()
                except _STALE:
                    if reused:  # closed by the peer while it was kept: once more, on a new connection
                        conn.close()
                        continue
                    raise
                self._check(resp, lo, hi, total)
                if resp.getheader(FETCHING_HEADER) and conn.sock is not None:
                    conn.sock.settimeout(max(self.timeout, OWNER_FETCH_S))  # the owner fetches it once for all
                done = 0
                while done < len(view):
                    n = resp.readinto(view[done:])
                    if not n:
                        raise OSError(errno.EIO, f"peer {self.address} sent {done} of the {len(view)} bytes asked")
                    done += n
            except (OSError, http.client.HTTPException) as e:
                conn.close()
                raise e if isinstance(e, OSError) else OSError(errno.EIO, f"peer {self.address}: {e!r}") from e
            except BaseException:
                conn.close()
                raise
            self._release(conn, resp)
            return

    def _check(self, resp: http.client.HTTPResponse, lo: int, hi: int, total: int) -> None:
        """The answer's status and headers say it is exactly ``[lo, hi)`` of a block ``total`` bytes long."""
        whole = (lo, hi) == (0, total)
        status = 200 if whole else 206
        if resp.status != status:
            raise OSError(errno.EIO, f"peer {self.address} answered {resp.status} {resp.reason}, not {status}")
        if resp.getheader("Content-Length") != str(hi - lo):
            raise OSError(
                errno.EIO, f"peer {self.address} offered {resp.getheader('Content-Length')} bytes, not {hi - lo}"
            )
        if not whole and resp.getheader("Content-Range") != f"bytes {lo}-{hi - 1}/{total}":
            raise OSError(
                errno.EIO,
                f"peer {self.address} sent range {resp.getheader('Content-Range')!r}, not bytes {lo}-{hi - 1}/{total}",
            )

    def _connection(self, fresh: bool) -> tuple[http.client.HTTPConnection, bool]:
        """A kept connection (and True), or a new one."""
        if not fresh:
            with self._lock:
                conn = self._idle.pop() if self._idle else None
            if conn is not None:
                if conn.sock is not None:
                    conn.sock.settimeout(self.timeout)
                return conn, True
        return http.client.HTTPConnection(self.host, self.port, timeout=self.timeout), False

    def _release(self, conn: http.client.HTTPConnection, resp: http.client.HTTPResponse) -> None:
        """Keep ``conn`` for the next request, if the peer keeps it open and there is room."""
        if resp.will_close or conn.sock is None:
            conn.close()
            return
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
