"""``PeerEndpoint``: this node's verified blocks, served to the other nodes of the job over HTTP.

The asking side and the protocol are :mod:`blockfs.storage.peer_tier`'s.  What this side promises:

* **Only verified blocks of the dataset mounted**, whole or one range of each, named by the dataset's name
  and a block number: from memory (the block cache holds verified data only), or, on the node that owns the
  block, loaded through the cache (single flight with the node's own loads, so a block asked for while it
  loads is fetched once) or read through the verifier when memory does not admit it (then kept for the
  next few requests, which ask for its other files: :data:`KEPT_BLOCKS`).  A block this node neither holds
  in memory nor owns is refused (404): nothing is fetched for another node's part.
* **Plain HTTP/1.1, framed by hand** (:func:`~blockfs.storage.peer_protocol.read_head`: a head of at most
  16 KiB and 32 ``token: visible ASCII`` headers, none twice, whole within ``HEAD_S`` of its first byte;
  ``METHOD TARGET HTTP/1.x``; no body), stricter than ``http.server``, ``h11`` or ``httptools`` and as cheap
  as the cheapest (``tools/bench/bench_peer_http.py``; docs/benchmarks.md).  An answer leaves in one
  ``sendmsg`` (head and bytes, not copied).
* **Only to the job**: every request must carry the HMAC of its request line under the job's secret,
  compared in constant time, before anything else about it is looked at (401 otherwise).  Any path but
  ``/blockfs/v1/<dataset>/<block>``, another dataset, a block out of range: 404; a range past the block
  or not ``bytes=a-b``: 416; any method but GET: 405.
* **On the address the user chose** (``--peer-listen``, by default this node's entry in ``--peers``), in
  daemon threads, closed with the mount.  A connection stays open for the asker's next request (HTTP/1.1
  keep-alive: a file's read costs a round trip, not a connection) until it is idle :data:`IDLE_S` or the
  mount closes; any answer cut short closes it.
* **Counted** into the :class:`~blockfs.storage.peer_tier.ServedCounts` the peer tier was made with, so
  ``blockfs stats`` shows what this node served beside what it fetched.
"""

from __future__ import annotations

import contextlib
import errno
import hmac
import logging
import re
import socket
import socketserver
import threading
from collections.abc import Callable
from http import HTTPStatus

from ..core import digest as dg
from ..core import format as fmt
from ..core.store import BlockStore
from ..errors import BlockReadError, CorruptBlockError
from ..storage.kept_pieces import KeptPieces
from ..storage.peer_protocol import AUTH_HEADER, FETCHING_HEADER, read_head, sign, split_address
from ..storage.peer_tier import ServedCounts
from .cache.block_cache import BlockCache

log = logging.getLogger(__name__)

_PATH = re.compile(r"/blockfs/v1/([0-9a-f]{1,128})/([0-9]{1,12})")
_RANGE = re.compile(r"bytes=([0-9]{1,20})-([0-9]{0,20})")
IDLE_S = 30.0  # a kept connection idle this long is closed
# Connections served at once (a thread each); one more is closed unanswered.  Askers keep a few each
# (peer_protocol.IDLE_KEPT per peer), so this is room for a large job, and a bound on what anyone who can
# reach the address may make the node hold open before a single request is checked.
MAX_CONNECTIONS = 1024
# Owned blocks read for peers outside memory, kept for the requests for their other files that follow: a
# window outside the memory plan (the owner's budget normally holds what it owns), so a small one.
KEPT_BLOCKS = 4
KEPT_BYTES = 64 << 20


class _Refused(Exception):
    def __init__(self, status: int, why: str) -> None:
        super().__init__(why)
        self.status = status


class PeerEndpoint:
    """Serves ``store``'s blocks that ``cache`` holds, or that this node ``owns``, at ``address``; counts
    what it does in ``counts``."""

    def __init__(
        self,
        address: str,
        dataset: str,
        secret: bytes,
        store: BlockStore,
        cache: BlockCache,
        owns: Callable[[int], bool],
        counts: ServedCounts,
        *,
        max_connections: int = MAX_CONNECTIONS,
    ) -> None:
        self._dataset = dataset.removeprefix("blake3:")
        self._secret = secret
        self._store = store
        self._cache = cache
        self._owns = owns
        self._lock = threading.Lock()
        self._kept = KeptPieces(KEPT_BLOCKS, KEPT_BYTES)  # blocks read for peers outside memory, the last few
        self._headers: dict[int, bytes] = {}
        self._sizes: dict[int, int] = {}  # a block's size, asked of the store once (an fstat or a request)
        self._signed: dict[str, bytes] = {}  # a checked path's signature: one HMAC per block, not per request
        self._connections: set[socket.socket] = set()  # open ones, shut when the endpoint closes
        self.counts = counts
        host, port = split_address(address)
        self._server = _Server((host, port), self, max_connections)
        self.address = f"{host}:{self._server.server_address[1]}"
        self._thread = threading.Thread(target=self._server.serve_forever, name="blockfs-peers", daemon=True)
        self._thread.start()

    def count(self, name: str, n: int = 1) -> None:
        self.counts.add(name, n)

    def opened(self, conn: socket.socket) -> None:
        with self._lock:
            self._connections.add(conn)

    def closed(self, conn: socket.socket) -> None:
        with self._lock:
            self._connections.discard(conn)

    # --- a request, checked ---------------------------------------------------------------------------
    def check(self, path: str, auth: str | None) -> int:
        """The block ``path`` asks for, or _Refused."""
        expected = self._signed.get(path)
        if expected is None:
            expected = sign(self._secret, path).encode()
        if auth is None or not hmac.compare_digest(auth.encode("latin-1", "replace"), expected):
            raise _Refused(401, "no valid " + AUTH_HEADER)
        m = _PATH.fullmatch(path)
        if m is None:
            raise _Refused(404, "not a block's path")
        if m.group(1) != self._dataset:
            raise _Refused(404, "not the dataset this node mounted")
        block = int(m.group(2))
        if block >= self._store.n_blocks:
            raise _Refused(404, f"no block {block}")
        if len(self._signed) < 2 * self._store.n_blocks:  # only valid block paths, so bounded (a few spellings)
            self._signed[path] = expected
        return block

    def size(self, block: int) -> int:
        size = self._sizes.get(block)
        if size is None:
            size = self._sizes[block] = int(self._store.files.size(block))
        return size

    def held(self, block: int) -> bool:
        """Whether ``block`` is in memory now; else this node serves it only if it owns it (after a fetch)."""
        if self._cache.holds(block):
            return True
        if not self._owns(block):
            raise _Refused(404, f"block {block} is neither held here nor this node's")
        return False

    # --- a block's bytes ------------------------------------------------------------------------------
    def header_bytes(self, block: int) -> bytes:
        """The block's header as stored: encoded again from the checked header when that gives the bytes the
        index's digest names (no request), else read (and checked) through the verifier."""
        raw = self._headers.get(block)
        if raw is None:
            head = self._store.header(block)
            raw = fmt.encode_header(block, head.sizes, head.labels, head.data_crc, head.chunk_crcs)
            if head.digest is None or dg.digest(raw) != head.digest or len(raw) != head.data_start:
                raw = self._store.header_bytes(block)
            self._headers[block] = raw  # 12 bytes a file, as the store keeps
        return raw

    def data(self, block: int) -> memoryview:
        """The block's verified data section: from memory, loaded into it, or read for this request."""
        cached = self._cache.cached(block) or self._cache.load(block)
        if cached is not None:
            return memoryview(cached.buf)

        def read() -> memoryview:
            head = self._store.header(block)
            buf = bytearray(head.data_size)
            self._store.read_data_into(block, head, buf)
            self.count("fetched_for_peers")
            return memoryview(buf)

        return self._kept.get(block, read)

    # --- one request, answered ----------------------------------------------------------------------
    def answer(self, sock: socket.socket, line: str, headers: dict[str, str]) -> bool:
        """Answer the request whose head is ``line`` and ``headers`` on ``sock``; whether the connection
        stays open for the next one (any refusal, any answer cut short closes it)."""
        self.count("requests")
        parts = line.split(" ")
        method, target, version = parts if len(parts) == 3 else ("", "", "")
        try:
            if version not in ("HTTP/1.1", "HTTP/1.0") or not method or not target:
                raise _Refused(400, "not an HTTP/1 request line (METHOD TARGET HTTP/1.1)")
            if method != "GET":
                raise _Refused(405, "GET only")
            if headers.get("content-length", "0") != "0" or "transfer-encoding" in headers:
                raise _Refused(400, "a GET with a body")
            block = self.check(target, headers.get(AUTH_HEADER.lower()))
            size = self.size(block)
            lo, hi = _range(headers.get("range"), size)
            held = self.held(block)
        except _Refused as e:
            self.count("refused")
            log.debug("peer request refused (%d): %s", e.status, e)
            _send_error(sock, e.status, str(e))
            return False
        except (OSError, CorruptBlockError, BlockReadError):
            _send_error(sock, 503, "cannot serve it now")
            return False
        whole = (lo, hi) == (0, size)
        head = [
            f"HTTP/1.1 {200 if whole else 206} {'OK' if whole else 'Partial Content'}",
            f"Content-Length: {hi - lo}",
        ]
        if not whole:
            head.append(f"Content-Range: bytes {lo}-{hi - 1}/{size}")
        if not held:
            head.append(f"{FETCHING_HEADER}: 1")  # the asker waits for this node's fetch, not its store
        out: list[bytes | memoryview] = [("\r\n".join(head) + "\r\n\r\n").encode()]
        if not held:  # the asker learns at once to wait for this node's fetch
            sock.sendall(out.pop())
        try:
            header = self.header_bytes(block)
            data = self.data(block)
            if len(header) + len(data) != size:
                raise OSError(errno.EIO, f"block {block} is not its index's {size} bytes")
        except (OSError, CorruptBlockError, BlockReadError) as e:
            log.debug("peer request for block %d: %s", block, e)
            if out:  # nothing sent yet
                _send_error(sock, 503, "cannot serve it now")
            return False  # else the connection closes short: the asker reads the block elsewhere
        h = len(header)
        if lo < h:
            out.append(header[lo : min(hi, h)])
        if hi > h:
            out.append(data[max(lo - h, 0) : hi - h])
        _send_all(sock, out)
        self.counts.add_all(ranges_served=1, bytes_served=hi - lo)  # one lock for both
        return version == "HTTP/1.1" and headers.get("connection", "").lower() != "close"

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        with self._lock:
            open_now = list(self._connections)
        for conn in open_now:  # kept-alive connections wait in their threads for a next request
            try:
                conn.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        self._thread.join(timeout=5)
        self._kept.clear()


class _Server(socketserver.ThreadingTCPServer):
    """Accepts connections on ``address`` (IPv4 or IPv6), one daemon thread each, for ``endpoint``."""

    daemon_threads = True
    allow_reuse_address = True

    def __init__(self, address: tuple[str, int], endpoint: PeerEndpoint, max_connections: int) -> None:
        self.endpoint = endpoint
        self.address_family = socket.AF_INET6 if ":" in address[0] else socket.AF_INET
        self._open: set[socket.socket] = set()
        self._open_lock = threading.Lock()
        self._max_connections = max_connections
        super().__init__(address, _Connection)

    def verify_request(self, request, client_address) -> bool:
        """Admit a connection while fewer than ``max_connections`` are open; close it unanswered otherwise."""
        with self._open_lock:
            admitted = len(self._open) < self._max_connections
            if admitted:
                self._open.add(request)
        if not admitted:
            self.endpoint.count("refused")
        return admitted

    def shutdown_request(self, request) -> None:
        with self._open_lock:
            self._open.discard(request)
        super().shutdown_request(request)


class _Connection(socketserver.BaseRequestHandler):
    """One asker's connection: its requests answered in turn, until it closes, idles :data:`IDLE_S` or
    sends anything but a GET the endpoint can answer whole."""

    server: _Server

    def setup(self) -> None:
        self.request.settimeout(IDLE_S)
        self.request.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)  # an answer's tail must not wait for an ACK
        self.server.endpoint.opened(self.request)

    def handle(self) -> None:
        pending = bytearray()
        while True:
            try:
                head = read_head(self.request, pending)
            except OSError as e:  # a timeout, a reset, a head too long or not HTTP
                if e.errno == errno.EPROTO:
                    _send_error(self.request, 400, str(e))
                return
            if head is None:
                return
            try:
                if not self.server.endpoint.answer(self.request, *head):
                    return
            except OSError:  # the asker went away mid-answer
                return

    def finish(self) -> None:
        self.server.endpoint.closed(self.request)


def _send_all(sock: socket.socket, pieces: list[bytes | memoryview]) -> None:
    """``pieces`` in one ``sendmsg`` where they fit (an answer's head and its bytes leave as one segment,
    not a head the asker wakes for alone), without joining them (no copy of the block's bytes)."""
    views = [memoryview(p) for p in pieces if len(p)]
    while views:
        sent = sock.sendmsg(views)
        while views and sent >= len(views[0]):
            sent -= len(views.pop(0))
        if sent:
            views[0] = views[0][sent:]


def _send_error(sock: socket.socket, status: int, why: str) -> None:
    """An error answer, and the connection to be closed after it."""
    body = f"{status} {HTTPStatus(status).phrase}: {why}\n".encode()
    head = (
        f"HTTP/1.1 {status} {HTTPStatus(status).phrase}\r\nContent-Type: text/plain\r\n"
        f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n"
    )
    with contextlib.suppress(OSError):
        sock.sendall(head.encode() + body)


def _range(text: str | None, size: int) -> tuple[int, int]:
    """The one range ``Range: bytes=a-b`` asks for (the whole block without one), or _Refused (416)."""
    if text is None:
        return 0, size
    m = _RANGE.fullmatch(text.strip())
    if m is None:
        raise _Refused(416, "only one range, bytes=a-b")
    lo, hi = int(m.group(1)), (int(m.group(2)) + 1 if m.group(2) else size)
    if not lo < hi <= size:
        raise _Refused(416, f"a range past the block's {size} bytes")
    return lo, hi
