"""How the peer endpoint and PeerClient should frame HTTP/1.1: by hand, h11, the standard library, httptools.

    python tools/bench/bench_peer_http.py [--requests 2000] [--rounds 9] [--ranges 4096,262144] [--json out.json]

One verified block of a small dataset packed into a temporary directory, held in a ``BlockCache``, served
on loopback by :class:`~blockfs.serve.peer_endpoint.PeerEndpoint`'s logic (its checks: the HMAC, the path,
the range, held or owned) behind each candidate's framing, and asked for ``--requests`` ranged GETs of
``--ranges`` bytes (at offsets that walk the block) over one kept connection by each candidate's client:

* ``hand``: the endpoint and :class:`~blockfs.storage.peer_protocol.PeerClient` as they are (``read_head``);
* ``hand, minimal``: ``read_head`` in the same minimal server and client as the libraries below (so the
  framing alone differs between it and them; what ``hand`` costs beyond it is the endpoint's and
  PeerClient's own work: counters, the kept-connection pool, timeouts);
* ``h11``: python-hyper's sans-IO HTTP/1.1 state machines on both sides (pure Python);
* ``stdlib``: ``http.server.BaseHTTPRequestHandler`` (HTTP/1.1, kept) and ``http.client.HTTPConnection``
  (the code before 493efc8);
* ``httptools``: llhttp's parsers (C) on both sides, heads written by hand (httptools only parses).

Client and server run in this one process (a thread each), so ``time.process_time`` over a round of
requests is both sides' CPU.  The candidates run in turn within each round, in an order rotated every
round; the figures are the medians over ``--rounds`` of µs per round trip (wall and CPU), and each one's
median ratio to ``hand`` within the same round.  A candidate whose package is missing is left out.

Then every candidate's server is sent the same hostile requests (``PROBES``) and what it does is reported:
the status it answers, ``closed`` (the connection closed without an answer), or ``waits`` (nothing within
``--probe-wait`` seconds: the server holds the connection until its idle timeout), and whether a block's
bytes came back where they should not.
"""

from __future__ import annotations

import argparse
import hashlib
import http.client
import http.server
import json
import os
import socket
import socketserver
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import blockfs
from blockfs.serve import peer_endpoint
from blockfs.serve.cache.block_cache import BlockCache
from blockfs.serve.peer_endpoint import PeerEndpoint, _range, _Refused
from blockfs.storage.peer_protocol import AUTH_HEADER, HEAD_LIMIT, PeerClient, block_path, read_head, sign
from blockfs.storage.peer_tier import ServedCounts

SECRET = b"bench-peer-http-secret"
TIMEOUT = 600.0  # every wait, and a kept connection's idle time: the candidates wait for each other's turns

# --- the endpoint's answer, apart from its framing ----------------------------------------------------


class Answer:
    """What the endpoint answers a request: a status, its headers and body pieces, and whether to keep."""

    __slots__ = ("status", "headers", "body", "keep")

    def __init__(self, status: int, headers: list[tuple[str, str]], body: list[Any], keep: bool) -> None:
        self.status, self.headers, self.body, self.keep = status, headers, body, keep


def plan(ep: PeerEndpoint, method: str, target: str, headers: dict[str, str]) -> Answer:
    """PeerEndpoint.answer's checks and bytes, for a framing that parsed the request itself."""
    try:
        if method != "GET":
            raise _Refused(405, "GET only")
        block = ep.check(target, headers.get(AUTH_HEADER.lower()))
        size = int(ep._store.files.size(block))
        lo, hi = _range(headers.get("range"), size)
        ep.held(block)
    except _Refused as e:
        body = f"{e.status}: {e}\n".encode()
        return Answer(e.status, [("Content-Length", str(len(body))), ("Connection", "close")], [body], False)
    whole = (lo, hi) == (0, size)
    out = [("Content-Length", str(hi - lo))]
    if not whole:
        out.append(("Content-Range", f"bytes {lo}-{hi - 1}/{size}"))
    header, data = ep.header_bytes(block), ep.data(block)
    h = len(header)
    pieces: list[Any] = []
    if lo < h:
        pieces.append(header[lo : min(hi, h)])
    if hi > h:
        pieces.append(data[max(lo - h, 0) : hi - h])
    return Answer(200 if whole else 206, out, pieces, headers.get("connection", "").lower() != "close")


def head_bytes(answer: Answer) -> bytes:
    reason = http.HTTPStatus(answer.status).phrase
    lines = [f"HTTP/1.1 {answer.status} {reason}", *(f"{k}: {v}" for k, v in answer.headers)]
    return ("\r\n".join(lines) + "\r\n\r\n").encode()


class _Server(socketserver.ThreadingTCPServer):
    daemon_threads = True
    allow_reuse_address = True

    def __init__(self, handler: type, ep: PeerEndpoint) -> None:
        self.ep = ep
        super().__init__(("127.0.0.1", 0), handler)
        threading.Thread(target=self.serve_forever, daemon=True).start()

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.server_address[1]}"


# --- read_head in the same minimal handler and client as the libraries (the framing alone compared) ----------


class HandHandler(socketserver.BaseRequestHandler):
    server: _Server

    def handle(self) -> None:
        sock = self.request
        sock.settimeout(TIMEOUT)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        pending = bytearray()
        while True:
            try:
                head = read_head(sock, pending)
            except OSError:
                with _quiet():
                    sock.sendall(b"HTTP/1.1 400 Bad Request\r\nContent-Length: 0\r\nConnection: close\r\n\r\n")
                return
            if head is None:
                return
            line, headers = head
            parts = line.split(" ")
            if (
                len(parts) != 3
                or parts[2] not in ("HTTP/1.1", "HTTP/1.0")
                or "transfer-encoding" in headers
                or headers.get("content-length", "0") != "0"
            ):
                sock.sendall(b"HTTP/1.1 400 Bad Request\r\nContent-Length: 0\r\nConnection: close\r\n\r\n")
                return
            answer = plan(self.server.ep, parts[0], parts[1], headers)
            sock.sendmsg([head_bytes(answer), *answer.body])
            if not answer.keep:
                return


class HandClient:
    def __init__(self, address: str) -> None:
        host, port = address.rsplit(":", 1)
        self.address = address
        self.sock = socket.create_connection((host, int(port)), timeout=TIMEOUT)
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.pending = bytearray()

    def get_into(self, path: str, view: memoryview, offset: int, total: int) -> None:
        lo, hi = offset, offset + len(view)
        request = (
            f"GET {path} HTTP/1.1\r\nHost: {self.address}\r\n{AUTH_HEADER}: {sign(SECRET, path)}\r\n"
            f"Range: bytes={lo}-{hi - 1}\r\n\r\n"
        )
        self.sock.sendall(request.encode())
        head = read_head(self.sock, self.pending)
        if head is None or head[0].split(" ", 2)[1] != "206" or head[1].get("content-length") != str(hi - lo):
            raise OSError(f"hand client: {head}")
        if head[1].get("content-range") != f"bytes {lo}-{hi - 1}/{total}":
            raise OSError("hand client: wrong range")
        done = min(len(self.pending), len(view))
        view[:done] = self.pending[:done]
        del self.pending[:done]
        while done < len(view):
            n = self.sock.recv_into(view[done:])
            if not n:
                raise OSError("hand client: short")
            done += n

    def close(self) -> None:
        self.sock.close()


# --- h11 -------------------------------------------------------------------------------------------------


class H11Handler(socketserver.BaseRequestHandler):
    server: _Server

    def handle(self) -> None:
        import h11

        sock = self.request
        sock.settimeout(TIMEOUT)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        conn = h11.Connection(h11.SERVER, max_incomplete_event_size=HEAD_LIMIT)
        request = None
        while True:
            try:
                event = conn.next_event()
            except h11.RemoteProtocolError as e:
                with _quiet():
                    sock.sendall(
                        b"HTTP/1.1 %d Bad\r\nContent-Length: 0\r\nConnection: close\r\n\r\n" % e.error_status_hint
                    )
                return
            if event is h11.NEED_DATA:
                try:
                    chunk = sock.recv(1 << 16)
                except OSError:
                    return
                conn.receive_data(chunk)
                continue
            if isinstance(event, h11.Request):
                request = event
            elif isinstance(event, h11.Data):
                answer = Answer(400, [("Content-Length", "0"), ("Connection", "close")], [], False)
                sock.sendall(head_bytes(answer))  # a GET with a body
                return
            elif isinstance(event, h11.EndOfMessage) and request is not None:
                headers = {k.decode(): v.decode("latin-1") for k, v in request.headers}
                answer = plan(self.server.ep, request.method.decode(), request.target.decode("latin-1"), headers)
                out = [conn.send(h11.Response(status_code=answer.status, headers=answer.headers))]
                out += [conn.send(h11.Data(data=piece)) for piece in answer.body]
                out.append(conn.send(h11.EndOfMessage()))
                sock.sendall(b"".join(x for x in out if x))
                if not answer.keep or conn.our_state is h11.MUST_CLOSE:
                    return
                conn.start_next_cycle()
            elif isinstance(event, h11.ConnectionClosed) or event is h11.PAUSED:
                return


class H11Client:
    def __init__(self, address: str) -> None:
        import h11

        self.h11, self.address = h11, address
        host, port = address.rsplit(":", 1)
        self.sock = socket.create_connection((host, int(port)), timeout=TIMEOUT)
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.conn = h11.Connection(h11.CLIENT)

    def get_into(self, path: str, view: memoryview, offset: int, total: int) -> None:
        h11, conn = self.h11, self.conn
        lo, hi = offset, offset + len(view)
        headers = [("Host", self.address), (AUTH_HEADER, sign(SECRET, path)), ("Range", f"bytes={lo}-{hi - 1}")]
        self.sock.sendall(
            conn.send(h11.Request(method="GET", target=path, headers=headers)) + conn.send(h11.EndOfMessage())
        )
        done = 0
        while True:
            event = conn.next_event()
            if event is h11.NEED_DATA:
                conn.receive_data(self.sock.recv(1 << 16))
            elif isinstance(event, h11.Response):
                got = dict(event.headers)
                if event.status_code != 206 or got.get(b"content-length") != str(hi - lo).encode():
                    raise OSError(f"h11 client: {event.status_code}")
                if got.get(b"content-range") != f"bytes {lo}-{hi - 1}/{total}".encode():
                    raise OSError("h11 client: wrong range")
            elif isinstance(event, h11.Data):
                n = len(event.data)
                view[done : done + n] = event.data
                done += n
            elif isinstance(event, h11.EndOfMessage):
                conn.start_next_cycle()
                return
            else:
                raise OSError(f"h11 client: {event!r}")

    def close(self) -> None:
        self.sock.close()


# --- http.server / http.client ---------------------------------------------------------------------------


class StdlibHandler(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    timeout = TIMEOUT
    disable_nagle_algorithm = True
    server: _Server  # type: ignore[assignment]

    def do_GET(self) -> None:  # noqa: N802
        headers = {k.lower(): v for k, v in self.headers.items()}
        answer = plan(self.server.ep, "GET", self.path, headers)
        if answer.status >= 400:
            self.close_connection = True
            self.send_error(answer.status)
            return
        self.send_response(answer.status)
        for k, v in answer.headers:
            self.send_header(k, v)
        self.end_headers()
        for piece in answer.body:
            self.wfile.write(piece)
        self.close_connection = not answer.keep

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002
        pass


class StdlibClient:
    def __init__(self, address: str) -> None:
        host, port = address.rsplit(":", 1)
        self.conn = http.client.HTTPConnection(host, int(port), timeout=TIMEOUT)

    def get_into(self, path: str, view: memoryview, offset: int, total: int) -> None:
        lo, hi = offset, offset + len(view)
        self.conn.request("GET", path, headers={AUTH_HEADER: sign(SECRET, path), "Range": f"bytes={lo}-{hi - 1}"})
        resp = self.conn.getresponse()
        if resp.status != 206 or resp.getheader("Content-Length") != str(hi - lo):
            raise OSError(f"stdlib client: {resp.status}")
        if resp.getheader("Content-Range") != f"bytes {lo}-{hi - 1}/{total}":
            raise OSError("stdlib client: wrong range")
        done = 0
        while done < len(view):
            n = resp.readinto(view[done:])
            if not n:
                raise OSError("stdlib client: short")
            done += n

    def close(self) -> None:
        self.conn.close()


# --- httptools --------------------------------------------------------------------------------------------


class _Request:
    def __init__(self) -> None:
        self.url = b""
        self.headers: dict[str, str] = {}
        self.done: list[tuple[bytes, dict[str, str], bool]] = []
        self.body = False
        self.parser: Any = None

    def on_url(self, url: bytes) -> None:
        self.url += url

    def on_header(self, name: bytes, value: bytes) -> None:
        self.headers[name.decode("latin-1").lower()] = value.decode("latin-1")

    def on_body(self, body: bytes) -> None:
        self.body = True

    def on_message_complete(self) -> None:
        self.done.append((self.url, self.headers, self.body))
        self.url, self.headers, self.body = b"", {}, False


class HttptoolsHandler(socketserver.BaseRequestHandler):
    server: _Server

    def handle(self) -> None:
        import httptools

        sock = self.request
        sock.settimeout(TIMEOUT)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        proto = _Request()
        parser = httptools.HttpRequestParser(proto)
        head_bytes_seen = 0
        while True:
            try:
                chunk = sock.recv(1 << 16)
            except OSError:
                return
            if not chunk:
                return
            head_bytes_seen += len(chunk)
            try:
                parser.feed_data(chunk)
            except httptools.HttpParserError:
                with _quiet():
                    sock.sendall(b"HTTP/1.1 400 Bad Request\r\nContent-Length: 0\r\nConnection: close\r\n\r\n")
                return
            if not proto.done and head_bytes_seen > HEAD_LIMIT:  # llhttp has no limit of its own
                with _quiet():
                    sock.sendall(b"HTTP/1.1 431 Too Large\r\nContent-Length: 0\r\nConnection: close\r\n\r\n")
                return
            for url, headers, body in proto.done:
                head_bytes_seen = 0
                if body:
                    sock.sendall(b"HTTP/1.1 400 Bad Request\r\nContent-Length: 0\r\nConnection: close\r\n\r\n")
                    return
                answer = plan(self.server.ep, parser.get_method().decode(), url.decode("latin-1"), headers)
                sock.sendall(b"".join([head_bytes(answer), *answer.body]))
                if not answer.keep or not parser.should_keep_alive():
                    return
            proto.done.clear()


class _Response:
    def __init__(self, view: memoryview) -> None:
        self.view, self.done, self.complete = view, 0, False
        self.headers: dict[bytes, bytes] = {}

    def on_header(self, name: bytes, value: bytes) -> None:
        self.headers[name.lower()] = value

    def on_body(self, body: bytes) -> None:
        n = len(body)
        if self.done + n > len(self.view):
            raise OSError("httptools client: more than asked")
        self.view[self.done : self.done + n] = body
        self.done += n

    def on_message_complete(self) -> None:
        self.complete = True


class HttptoolsClient:
    def __init__(self, address: str) -> None:
        import httptools

        self.httptools, self.address = httptools, address
        host, port = address.rsplit(":", 1)
        self.sock = socket.create_connection((host, int(port)), timeout=TIMEOUT)
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def get_into(self, path: str, view: memoryview, offset: int, total: int) -> None:
        lo, hi = offset, offset + len(view)
        request = (
            f"GET {path} HTTP/1.1\r\nHost: {self.address}\r\n{AUTH_HEADER}: {sign(SECRET, path)}\r\n"
            f"Range: bytes={lo}-{hi - 1}\r\n\r\n"
        )
        self.sock.sendall(request.encode())
        proto = _Response(view)
        parser = self.httptools.HttpResponseParser(proto)
        while not proto.complete:
            chunk = self.sock.recv(1 << 16)
            if not chunk:
                raise OSError("httptools client: closed")
            parser.feed_data(chunk)
            if proto.headers and parser.get_status_code() != 206:
                raise OSError(f"httptools client: {parser.get_status_code()}")
        if proto.headers.get(b"content-length") != str(hi - lo).encode() or proto.done != hi - lo:
            raise OSError("httptools client: length")
        if proto.headers.get(b"content-range") != f"bytes {lo}-{hi - 1}/{total}".encode():
            raise OSError("httptools client: wrong range")

    def close(self) -> None:
        self.sock.close()


class _quiet:
    def __enter__(self) -> None:
        pass

    def __exit__(self, *exc: object) -> bool:
        return exc[0] is not None and issubclass(exc[0], OSError)  # type: ignore[arg-type]


# --- the run ------------------------------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def make_dataset(root: Path) -> Path:
    """A few hundred files of 1-12 KiB in 1 MiB blocks: block 0 is the one served."""
    src = root / "src"
    for i in range(300):
        d = src / f"c{i % 4}"
        d.mkdir(parents=True, exist_ok=True)
        (d / f"{i:04}.bin").write_bytes(hashlib.shake_256(str(i).encode()).digest(1024 + (i * 397) % 11264))
    blockfs.pack(src, root / "packed", block_size="1MiB", fsync=False)
    return root / "packed"


def candidates(ep: PeerEndpoint) -> dict[str, tuple[str, Callable[[str], Any]]]:
    """Each candidate's server address and the maker of its client."""
    out: dict[str, tuple[str, Callable[[str], Any]]] = {"hand": (ep.address, lambda a: PeerClient(a, SECRET, TIMEOUT))}
    out["hand, minimal"] = (_Server(HandHandler, ep).address, HandClient)
    try:
        import h11  # noqa: F401

        out["h11"] = (_Server(H11Handler, ep).address, H11Client)
    except ImportError:
        print("h11 not installed: left out", file=sys.stderr)
    out["stdlib"] = (_Server(StdlibHandler, ep).address, StdlibClient)
    try:
        import httptools  # noqa: F401

        out["httptools"] = (_Server(HttptoolsHandler, ep).address, HttptoolsClient)
    except ImportError:
        print("httptools not installed: left out", file=sys.stderr)
    return out


def one_round(client: Any, path: str, want: bytes, size: int, n: int, length: int) -> tuple[float, float]:
    """µs of wall time and of this process's CPU per ranged GET, over ``n`` of them."""
    buf = bytearray(length)
    view = memoryview(buf)
    span = size - length
    wall0, cpu0 = time.perf_counter(), time.process_time()
    for i in range(n):
        lo = (i * 7919) % span
        client.get_into(path, view, lo, size)
    wall, cpu = time.perf_counter() - wall0, time.process_time() - cpu0
    lo = ((n - 1) * 7919) % span
    if buf != want[lo : lo + length]:
        raise SystemExit("wrong bytes: the benchmark is broken")
    return wall / n * 1e6, cpu / n * 1e6


# Hostile requests: (name, bytes).  {path} and {auth} are a real block's path and its valid signature, so
# only the framing stands between the bytes and the block.
PROBES: list[tuple[str, str]] = [
    ("valid", "GET {path} HTTP/1.1\r\nHost: x\r\n{auth}\r\nRange: bytes=0-9\r\n\r\n"),
    ("head over 16 KiB", "GET {path} HTTP/1.1\r\nHost: x\r\n{auth}\r\nX-Pad: " + "a" * 20000 + "\r\n\r\n"),
    (
        "200 headers (8 KiB)",
        "GET {path} HTTP/1.1\r\nHost: x\r\n{auth}\r\n" + "X-P: 1234567890123456789012345678\r\n" * 200 + "\r\n",
    ),
    ("request line of 2 parts", "GET {path}\r\nHost: x\r\n{auth}\r\n\r\n"),
    ("request line of 4 parts", "GET {path} HTTP/1.1 x\r\nHost: x\r\n{auth}\r\n\r\n"),
    ("HTTP/0.9 line", "GET {path}\r\n\r\n"),
    ("bare LF line ends", "GET {path} HTTP/1.1\nHost: x\n{auth}\n\n"),
    ("CR inside a value", "GET {path} HTTP/1.1\r\nHost: x\r\n{auth}\r\nX-A: a\rb\r\n\r\n"),
    ("LF inside a value (folded header)", "GET {path} HTTP/1.1\r\nHost: x\r\n{auth}\r\nX-A: a\n b\r\n\r\n"),
    ("non-ASCII value", "GET {path} HTTP/1.1\r\nHost: x\r\n{auth}\r\nX-A: \xe9\r\n\r\n"),
    ("space inside a name", "GET {path} HTTP/1.1\r\nHost: x\r\n{auth}\r\nX A: 1\r\n\r\n"),
    ("NUL in a name", "GET {path} HTTP/1.1\r\nHost: x\r\n{auth}\r\nX\x00A: 1\r\n\r\n"),
    ("body on a GET (Content-Length)", "GET {path} HTTP/1.1\r\nHost: x\r\n{auth}\r\nContent-Length: 5\r\n\r\nhello"),
    (
        "body on a GET (chunked)",
        "GET {path} HTTP/1.1\r\nHost: x\r\n{auth}\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n",
    ),
    (
        "two Content-Lengths (5, 0)",
        "GET {path} HTTP/1.1\r\nHost: x\r\n{auth}\r\nContent-Length: 5\r\nContent-Length: 0\r\n\r\n",
    ),
    ("two Range headers", "GET {path} HTTP/1.1\r\nHost: x\r\n{auth}\r\nRange: bytes=0-9\r\nRange: bytes=0-99\r\n\r\n"),
    ("no Host header", "GET {path} HTTP/1.1\r\n{auth}\r\nRange: bytes=0-9\r\n\r\n"),
    (
        "pipelined: 2 valid",
        "GET {path} HTTP/1.1\r\nHost: x\r\n{auth}\r\nRange: bytes=0-9\r\n\r\nGET {path} HTTP/1.1\r\nHost: x\r\n{auth}\r\nRange: bytes=0-9\r\n\r\n",
    ),
    (
        "pipelined: bad auth, then valid",
        "GET {path} HTTP/1.1\r\nHost: x\r\nX-Blockfs-Auth: 00\r\n\r\nGET {path} HTTP/1.1\r\nHost: x\r\n{auth}\r\n\r\n",
    ),
    ("head never ends", "GET {path} HTTP/1.1\r\nHost: x\r\n"),
]


def probe(address: str, text: str, wait: float) -> str:
    """What the server at ``address`` does with ``text``: its statuses in order, then closed / waits."""
    host, port = address.rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=wait) as sock:
        try:
            sock.sendall(text.encode("latin-1"))
        except OSError:
            return "reset"
        got = b""
        ended = "waits"
        deadline = time.monotonic() + wait
        while time.monotonic() < deadline:
            sock.settimeout(max(deadline - time.monotonic(), 0.01))
            try:
                chunk = sock.recv(1 << 16)
            except TimeoutError:
                ended = "kept" if got else "waits"
                break
            except OSError:
                ended = "reset"
                break
            if not chunk:
                ended = "closed"
                break
            got += chunk
    statuses = [line.split(b" ")[1].decode() for line in got.split(b"\r\n") if line.startswith(b"HTTP/1.")]
    if got and not statuses:
        statuses = ["body without a head"]
    return ", ".join([*statuses, ended])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=2000, help="ranged GETs per candidate, range and round")
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--ranges", default="4096,262144", help="bytes per GET, comma-separated")
    ap.add_argument("--probe-wait", type=float, default=1.0, help="seconds a probe waits for an answer")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)
    lengths = [int(x) for x in args.ranges.split(",")]
    peer_endpoint.IDLE_S = TIMEOUT
    with (
        tempfile.TemporaryDirectory(prefix="bench-peer-http-") as tmp,
        blockfs.open_dataset(make_dataset(Path(tmp))) as ds,
    ):
        cache = BlockCache(ds.store, 64 << 20, lock_memory=False)
        cache.load(0)
        ep = PeerEndpoint(
            f"127.0.0.1:{free_port()}", ds.digest, SECRET, ds.store, cache, lambda b: True, ServedCounts("bench")
        )
        try:
            size = int(ds.store.files.size(0))
            want = ep.header_bytes(0) + bytes(ep.data(0))
            path = block_path(ds.digest, 0)
            cands = candidates(ep)
            clients = {name: make(address) for name, (address, make) in cands.items()}
            for client in clients.values():  # warm: connections open, code paths taken
                for length in lengths:
                    one_round(client, path, want, size, 50, length)
            names = list(clients)
            keys = [(n, length) for length in lengths for n in names]
            wall: dict[tuple[str, int], list[float]] = {k: [] for k in keys}
            cpu: dict[tuple[str, int], list[float]] = {k: [] for k in keys}
            ratio: dict[tuple[str, int], list[float]] = {k: [] for k in keys}
            for r in range(args.rounds):
                order = names[r % len(names) :] + names[: r % len(names)]
                for length in lengths:
                    got = {n: one_round(clients[n], path, want, size, args.requests, length) for n in order}
                    for n in names:
                        wall[n, length].append(got[n][0])
                        cpu[n, length].append(got[n][1])
                        ratio[n, length].append(got[n][1] / got["hand"][1])
                    print(
                        f"round {r + 1}, {length} B: " + ", ".join(f"{n} {got[n][1]:.0f}" for n in names),
                        file=sys.stderr,
                    )
            auth = f"{AUTH_HEADER}: {sign(SECRET, path)}"
            probes = {
                name: {
                    c: probe(address, text.format(path=path, auth=auth), args.probe_wait)
                    for c, (address, _) in cands.items()
                }
                for name, text in PROBES
            }
            for client in clients.values():
                client.close()
        finally:
            ep.close()
            cache.close()
    med = statistics.median
    load = os.getloadavg()[0]
    print(
        f"\n{args.requests} ranged GETs per candidate, range and round, {args.rounds} rounds, one kept connection, "
        f"loopback; load average {load:.1f} at the end (shared machine)\n"
    )
    print(
        "| framing | range | wall µs per GET (median) | CPU µs per GET, both sides (median) | CPU × hand (median of rounds) |"
    )
    print("|---|---|---|---|---|")
    for n, length in keys:
        k = (n, length)
        print(f"| {n} | {length // 1024} KiB | {med(wall[k]):.0f} | {med(cpu[k]):.0f} | {med(ratio[k]):.2f}× |")
    print("\n| probe | " + " | ".join(names) + " |")
    print("|---|" + "---|" * len(names))
    for name, row in probes.items():
        print(f"| {name} | " + " | ".join(row[c] for c in names) + " |")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        flat = {
            f"{n} {length}": {"wall_us": wall[n, length], "cpu_us": cpu[n, length], "ratio": ratio[n, length]}
            for n, length in keys
        }
        args.json.write_text(json.dumps({"runs": flat, "probes": probes, "load": load}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
