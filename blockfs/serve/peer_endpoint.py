"""``PeerEndpoint``: this node's verified blocks, served to the other nodes of the job over HTTP.

The asking side and the protocol are :mod:`blockfs.storage.peer_tier`'s.  What this side promises:

* **Only verified blocks of the dataset mounted**, whole or one range of each, named by the dataset's name
  and a block number: from memory (the block cache holds verified data only), or, on the node that owns the
  block, loaded through the cache (single flight with the node's own loads, so a block asked for while it
  loads is fetched once) or read through the verifier when memory does not admit it (then kept for the
  next few requests, which ask for its other files: :data:`KEPT_BLOCKS`).  A block this node neither holds
  in memory nor owns is refused (404): nothing is fetched for another node's part.
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

import hmac
import http.server
import logging
import re
import socket
import threading
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

from ..core import digest as dg
from ..core import format as fmt
from ..core.store import BlockStore
from ..errors import BlockReadError, CorruptBlockError
from ..storage.peer_protocol import AUTH_HEADER, FETCHING_HEADER, sign, split_address
from ..storage.peer_tier import ServedCounts
from .cache.block_cache import BlockCache

log = logging.getLogger(__name__)

_PATH = re.compile(r"/blockfs/v1/([0-9a-f]{1,128})/([0-9]{1,12})")
_RANGE = re.compile(r"bytes=([0-9]{1,20})-([0-9]{0,20})")
IDLE_S = 30.0  # a kept connection idle this long is closed
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
    ) -> None:
        self._dataset = dataset.removeprefix("blake3:")
        self._secret = secret
        self._store = store
        self._cache = cache
        self._owns = owns
        self._lock = threading.Lock()
        self._reading: dict[int, Future] = {}  # blocks read for peers outside memory (single flight)
        self._kept: OrderedDict[int, memoryview] = OrderedDict()  # and the last few of them
        self._kept_bytes = 0
        self._headers: dict[int, bytes] = {}
        self._connections: set[socket.socket] = set()  # open ones, shut when the endpoint closes
        self.counts = counts
        host, port = split_address(address)
        self._server = http.server.ThreadingHTTPServer((host, port), _Handler, bind_and_activate=True)
        self._server.daemon_threads = True
        self._server.endpoint = self  # type: ignore[attr-defined]  # the handler's way back here
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
        if auth is None or not hmac.compare_digest(
            auth.encode("latin-1", "replace"), sign(self._secret, path).encode()
        ):
            raise _Refused(401, "no valid " + AUTH_HEADER)
        m = _PATH.fullmatch(path)
        if m is None:
            raise _Refused(404, "not a block's path")
        if m.group(1) != self._dataset:
            raise _Refused(404, "not the dataset this node mounted")
        block = int(m.group(2))
        if block >= self._store.n_blocks:
            raise _Refused(404, f"no block {block}")
        return block

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
        with self._lock:
            kept = self._kept.get(block)
            if kept is not None:
                self._kept.move_to_end(block)
                return kept
            future = self._reading.get(block)
            mine = future is None
            if mine:
                future = self._reading[block] = Future()
        assert future is not None
        if not mine:
            return future.result()
        try:
            head = self._store.header(block)
            buf = bytearray(head.data_size)
            self._store.read_data_into(block, head, buf)
        except BaseException as e:
            with self._lock:
                self._reading.pop(block, None)
            future.set_exception(e)
            raise
        data = memoryview(buf)
        with self._lock:
            self._reading.pop(block, None)
            self._kept[block] = data
            self._kept_bytes += len(data)
            while (self._kept_bytes > KEPT_BYTES or len(self._kept) > KEPT_BLOCKS) and len(self._kept) > 1:
                self._kept_bytes -= len(self._kept.popitem(last=False)[1])
        self.count("fetched_for_peers")
        future.set_result(data)
        return data

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
        with self._lock:
            self._kept.clear()
            self._kept_bytes = 0


class _Handler(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server_version = "blockfs-peer"
    sys_version = ""
    timeout = IDLE_S  # a kept connection's wait for the next request
    disable_nagle_algorithm = True  # an answer's last small segment must not wait for the asker's ACK

    def setup(self) -> None:
        super().setup()
        self.server.endpoint.opened(self.connection)  # type: ignore[attr-defined]

    def finish(self) -> None:
        self.server.endpoint.closed(self.connection)  # type: ignore[attr-defined]
        super().finish()

    def do_GET(self) -> None:  # noqa: N802 - http.server's name
        ep: PeerEndpoint = self.server.endpoint  # type: ignore[attr-defined]
        ep.count("requests")
        self.close_connection = True  # until the whole answer is sent
        try:
            block = ep.check(self.path, self.headers.get(AUTH_HEADER))
            size = int(ep._store.files.size(block))
            lo, hi = self._range(size)
            held = ep.held(block)
        except _Refused as e:
            ep.count("refused")
            log.debug("peer request refused (%d): %s", e.status, e)
            self.send_error(e.status, str(e))
            return
        except (OSError, CorruptBlockError, BlockReadError):
            self.send_error(503, "cannot serve it now")
            return
        self.send_response(200 if (lo, hi) == (0, size) else 206)
        self.send_header("Content-Length", str(hi - lo))
        if (lo, hi) != (0, size):
            self.send_header("Content-Range", f"bytes {lo}-{hi - 1}/{size}")
        if not held:
            self.send_header(FETCHING_HEADER, "1")  # the asker waits for this node's fetch, not its store
        self.end_headers()
        try:
            header = ep.header_bytes(block)
            data = ep.data(block)
        except (OSError, CorruptBlockError, BlockReadError) as e:
            log.debug("peer request for block %d: %s", block, e)
            return  # the connection closes short: the asker reads the block elsewhere
        if len(header) + len(data) != size:
            return
        h = len(header)
        if lo < h:
            self.wfile.write(header[lo : min(hi, h)])
        if hi > h:
            self.wfile.write(data[max(lo - h, 0) : hi - h])
        ep.count("ranges_served")
        ep.count("bytes_served", hi - lo)
        self.close_connection = self.headers.get("Connection", "").lower() == "close"

    def _range(self, size: int) -> tuple[int, int]:
        text = self.headers.get("Range")
        if text is None:
            return 0, size
        m = _RANGE.fullmatch(text.strip())
        if m is None:
            raise _Refused(416, "only one range, bytes=a-b")
        lo, hi = int(m.group(1)), (int(m.group(2)) + 1 if m.group(2) else size)
        if not lo < hi <= size:
            raise _Refused(416, f"a range past the block's {size} bytes")
        return lo, hi

    def _refuse_method(self) -> None:
        self.close_connection = True
        self.send_error(405, "GET only")

    do_HEAD = do_POST = do_PUT = do_DELETE = _refuse_method  # noqa: N815

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - http.server's signature
        pass  # a request line names only a dataset and a block; nothing is logged per request
