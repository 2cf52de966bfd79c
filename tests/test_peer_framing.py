"""The peer endpoint's HTTP framing against hostile bytes, and PeerClient's against a hostile peer.

Each request below carries a valid signature for a block the endpoint holds, so nothing but the framing
check under test stands between the bytes and that block: a test fails if its check is removed (the block's
bytes come back).  Every refusal is an error answer and a closed connection within the socket timeout;
nothing is served after it.  No FUSE: the endpoint serves a dataset packed into ``tmp_path``.
"""

from __future__ import annotations

import contextlib
import select
import socket
import threading
import time
from pathlib import Path

import pytest
from treeutil import make_class_tree

import blockfs
from blockfs.serve.cache.block_cache import BlockCache
from blockfs.serve.peer_endpoint import PeerEndpoint
from blockfs.storage import peer_protocol
from blockfs.storage.peer_protocol import AUTH_HEADER, HEAD_LIMIT, PeerClient, block_path, sign
from blockfs.storage.peer_tier import ServedCounts

SECRET = b"framing-test-secret"
WAIT_S = 10.0  # a socket's timeout here: only reached when the endpoint hangs, which fails the test


class Endpoint:
    """An endpoint holding block 0 of a small dataset; ``block`` is its bytes, ``path``/``auth`` ask for it."""

    def __init__(self, ep: PeerEndpoint, block: bytes, path: str, counts: ServedCounts) -> None:
        self.ep, self.block, self.path, self.counts = ep, block, path, counts
        self.auth = f"{AUTH_HEADER}: {sign(SECRET, path)}"

    def request(self, *headers: str, line: str | None = None) -> bytes:
        """A GET of bytes 0-99 of the block, signed, with ``headers`` added (``line``: another request line)."""
        lines = [line or f"GET {self.path} HTTP/1.1", "Host: peer", self.auth, "Range: bytes=0-99", *headers]
        return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def packed(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("framing")
    make_class_tree(root / "src", 12, seed=7, sizes=(2048, 6144))
    blockfs.pack(root / "src", root / "packed", block_size="16KiB", fsync=False)
    return root / "packed"


@pytest.fixture
def endpoint(packed):
    with blockfs.open_dataset(packed) as ds:
        cache = BlockCache(ds.store, 1 << 20, lock_memory=False)
        assert cache.load(0) is not None
        counts = ServedCounts("test")
        ep = PeerEndpoint(f"127.0.0.1:{free_port()}", ds.digest, SECRET, ds.store, cache, lambda b: False, counts)
        try:
            block = ep.header_bytes(0) + bytes(ep.data(0))
            yield Endpoint(ep, block, block_path(ds.digest, 0), counts)
        finally:
            ep.close()
            cache.close()


def exchange(ep: Endpoint, raw: bytes, answers: int = 1) -> tuple[list[tuple[int, bytes]], bool]:
    """Send ``raw``; read up to ``answers`` answers (status, body), and whether the endpoint then closed the
    connection (False: it keeps it open for a next request)."""
    host, port = ep.ep.address.rsplit(":", 1)
    got: list[tuple[int, bytes]] = []
    with socket.create_connection((host, int(port)), timeout=WAIT_S) as sock:
        with contextlib.suppress(ConnectionResetError, BrokenPipeError):
            sock.sendall(raw)
        f = sock.makefile("rb")
        try:
            for _ in range(answers):
                status = f.readline()
                if not status:
                    return got, True
                length = 0
                while (line := f.readline()) not in (b"\r\n", b""):
                    name, _, value = line.decode("latin-1").partition(":")
                    if name.lower() == "content-length":
                        length = int(value)
                got.append((int(status.split()[1]), f.read(length)))
            sock.settimeout(0.5)  # a kept connection: the next byte would be the endpoint's own, never sent
            try:
                return got, f.read(1) == b""
            except TimeoutError:
                return got, False
        except ConnectionResetError:
            return got, True
        finally:
            f.close()


def refused(ep: Endpoint, raw: bytes, status: int = 400) -> None:
    """``raw`` gets ``status`` and a closed connection, and none of the block's bytes."""
    got, closed = exchange(ep, raw, answers=2)
    assert [s for s, _ in got] == [status], got
    assert ep.block[:100] not in got[0][1]
    assert closed


def test_a_signed_request_is_served_and_the_connection_kept(endpoint):
    got, closed = exchange(endpoint, endpoint.request())
    assert got == [(206, endpoint.block[:100])] and not closed


def test_pipelined_requests_are_answered_in_order(endpoint):
    second = endpoint.request().replace(b"bytes=0-99", b"bytes=100-149")
    got, closed = exchange(endpoint, endpoint.request() + second, answers=2)
    assert got == [(206, endpoint.block[:100]), (206, endpoint.block[100:150])] and not closed


def test_nothing_pipelined_after_a_refusal_is_served(endpoint):
    bad = endpoint.request().replace(endpoint.auth.encode(), f"{AUTH_HEADER}: 00".encode())
    refused(endpoint, bad + endpoint.request(), status=401)
    assert endpoint.counts.snapshot()["ranges_served"] == 0


def test_a_path_served_before_is_still_refused_without_its_signature(endpoint):
    """The endpoint keeps each served path's signature (one HMAC per block): a kept one must still be
    compared with what the request carries, every time, and a path refused is never kept."""
    bad = endpoint.request().replace(endpoint.auth.encode(), f"{AUTH_HEADER}: {'0' * 64}".encode())
    refused(endpoint, bad, status=401)
    assert exchange(endpoint, endpoint.request())[0] == [(206, endpoint.block[:100])]
    for _ in range(2):  # kept now: a wrong one, then none at all, still refused
        refused(endpoint, bad, status=401)
    no_auth = endpoint.request().replace(endpoint.auth.encode() + b"\r\n", b"")
    refused(endpoint, no_auth, status=401)
    assert exchange(endpoint, endpoint.request())[0] == [(206, endpoint.block[:100])]
    assert endpoint.counts.snapshot()["ranges_served"] == 2


def test_a_head_over_the_limit_is_refused(endpoint):
    refused(endpoint, endpoint.request("X-Pad: " + "a" * HEAD_LIMIT))


def test_a_head_that_never_ends_is_closed_within_the_head_timeout(endpoint, monkeypatch):
    """A head dribbled a byte at a time, each within the idle timeout: closed once HEAD_S has passed, not
    held while the bytes keep coming (a thread per connection: slow heads must not pin them)."""
    monkeypatch.setattr(peer_protocol, "HEAD_S", 0.3)
    host, port = endpoint.ep.address.rsplit(":", 1)
    raw = endpoint.request("X-Pad: " + "a" * 400)[:-4]  # never ends
    with socket.create_connection((host, int(port)), timeout=WAIT_S) as sock:
        for i in range(len(raw)):
            try:
                sock.sendall(raw[i : i + 1])
            except (BrokenPipeError, ConnectionResetError):
                break
            ready, _, _ = select.select([sock], [], [], 0.05)  # the pace, and the endpoint's answer if any
            if ready:
                break
        else:
            pytest.fail(f"the endpoint still waited for a head after {len(raw)} bytes over {len(raw) * 0.05:.0f} s")
        with contextlib.suppress(ConnectionResetError):
            assert endpoint.block[:100] not in sock.recv(1 << 16)


def test_too_many_headers_are_refused(endpoint):
    many = [f"X-H{i}: 1" for i in range(peer_protocol.HEADERS_MAX + 1)]
    assert len(endpoint.request(*many)) < HEAD_LIMIT  # the count is refused, not the size
    refused(endpoint, endpoint.request(*many))


@pytest.mark.parametrize(
    "line",
    [
        "GET {path}",  # 2 parts (HTTP/0.9)
        "GET {path} HTTP/1.1 more",  # 4 parts
        "GET  {path} HTTP/1.1",  # an empty part
        "GET {path} HTTP/2.0",
        "GET {path} http/1.1",
    ],
)
def test_a_request_line_not_method_target_http1_is_refused(endpoint, line):
    refused(endpoint, endpoint.request(line=line.format(path=endpoint.path)))


@pytest.mark.parametrize(
    "header",
    [
        "X-A: a\rb",  # a CR inside a value
        "X-A: a\n b",  # a LF inside one (a folded header: obsolete, refused)
        "X-A: \xe9t\xe9",  # not ASCII
        "X-A: a\x00b",  # a NUL
        "X A: 1",  # a space inside a name
        "X-A : 1",  # a space before the colon (a smuggling classic)
        " X-A: 1",  # a line that continues the one before
        "X\x00A: 1",
        "no colon",
        ": 1",
    ],
)
def test_a_header_that_is_not_a_token_and_visible_ascii_is_refused(endpoint, header):
    refused(endpoint, endpoint.request(header))


@pytest.mark.parametrize(
    ("headers", "body"),
    [
        (["Content-Length: 5"], "hello"),
        (["Transfer-Encoding: chunked"], "0\r\n\r\n"),
        (["Content-Length: 5", "Content-Length: 0"], "hello"),  # the last one would say no body
        (["Range: bytes=0-9"], ""),  # a second Range: which one was signed for?
    ],
)
def test_a_body_or_a_header_twice_is_refused(endpoint, headers, body):
    refused(endpoint, endpoint.request(*headers) + body.encode())


def test_a_bare_lf_head_is_refused_at_once_not_waited_on(endpoint, monkeypatch):
    """Lines ending in LF alone never make a CRLF head: refused when seen, not held until the head timeout."""
    monkeypatch.setattr(peer_protocol, "HEAD_S", 3600.0)
    refused(endpoint, endpoint.request().replace(b"\r\n", b"\n"))


# --- the asking side: a peer's hostile answer is an OSError, not bytes used --------------------------------


@contextlib.contextmanager
def answering(raw: bytes):
    """A one-connection peer on loopback that reads a request and answers ``raw``."""
    listener = socket.create_server(("127.0.0.1", 0))

    def serve() -> None:
        with contextlib.suppress(OSError):
            conn, _ = listener.accept()
            with conn:
                conn.recv(1 << 16)
                conn.sendall(raw)
                conn.recv(1)  # until the client closes

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        yield f"127.0.0.1:{listener.getsockname()[1]}"
    finally:
        listener.close()
        thread.join(WAIT_S)


RANGE_HEAD = "HTTP/1.1 206 Partial Content\r\nContent-Length: 4\r\nContent-Range: bytes 0-3/100\r\n"


@pytest.mark.parametrize(
    "answer",
    [
        RANGE_HEAD + "X-Pad: " + "a" * HEAD_LIMIT + "\r\n\r\nabcd",
        RANGE_HEAD + "".join(f"X-H{i}: 1\r\n" for i in range(64)) + "\r\nabcd",
        RANGE_HEAD + "Content-Length: 2\r\n\r\nabcd",
        RANGE_HEAD + "X-A: a\rb\r\n\r\nabcd",
    ],
)
def test_a_peer_answer_that_is_not_well_framed_is_an_error(answer):
    with answering(answer.encode("latin-1")) as address:
        client = PeerClient(address, SECRET, timeout=WAIT_S)
        try:
            with pytest.raises(OSError):
                client.get_into("/blockfs/v1/ab/0", memoryview(bytearray(4)), 0, 100)
        finally:
            client.close()


def test_a_well_framed_peer_answer_is_read(tmp_path):
    with answering((RANGE_HEAD + "\r\nabcd").encode()) as address:
        client = PeerClient(address, SECRET, timeout=WAIT_S)
        buf = bytearray(4)
        client.get_into("/blockfs/v1/ab/0", memoryview(buf), 0, 100)
        client.close()
    assert buf == b"abcd"


def test_connections_past_the_cap_are_closed_unanswered_and_room_comes_back(packed):
    """Anyone who can reach the address can open connections before a request is checked: past the cap
    one is closed unanswered (counted refused), while those admitted are served; one closed makes room."""
    with blockfs.open_dataset(packed) as ds:
        cache = BlockCache(ds.store, 1 << 20, lock_memory=False)
        assert cache.load(0) is not None
        counts = ServedCounts("test")
        ep = PeerEndpoint(
            f"127.0.0.1:{free_port()}", ds.digest, SECRET, ds.store, cache, lambda b: False, counts, max_connections=2
        )
        path = block_path(ds.digest, 0)
        request = (
            f"GET {path} HTTP/1.1\r\nHost: peer\r\n{AUTH_HEADER}: {sign(SECRET, path)}\r\nRange: bytes=0-99\r\n\r\n"
        ).encode()
        host, port = ep.address.rsplit(":", 1)

        def served(sock: socket.socket) -> bool:
            """Whether a request on ``sock`` gets its 206 (False: closed unanswered)."""
            with contextlib.suppress(ConnectionResetError, BrokenPipeError):
                sock.sendall(request)
            try:
                return sock.recv(12).startswith(b"HTTP/1.1 206")
            except ConnectionResetError:
                return False

        try:
            first, second = (socket.create_connection((host, int(port)), timeout=WAIT_S) for _ in range(2))
            assert served(first) and served(second)  # both admitted, and held open (kept connections)
            with socket.create_connection((host, int(port)), timeout=WAIT_S) as third:
                assert not served(third)
            assert counts.snapshot()["refused"] >= 1
            first.close()
            deadline = time.monotonic() + WAIT_S  # the endpoint frees the slot once it sees the close
            while True:
                with socket.create_connection((host, int(port)), timeout=WAIT_S) as again:
                    if served(again):
                        break
                assert time.monotonic() < deadline, "a closed connection's room never came back"
            second.close()
        finally:
            ep.close()
            cache.close()
