"""A static HTTP server on loopback for the tests, with byte ranges, and faults on demand: ignoring ``Range``
(as ``python -m http.server`` does), answering the next requests with an error status, flipping a bit of
chosen answers in transit (``corrupt(path, nth)``: the ``nth`` GET of ``path``), and holding answers
until released (``hold(path)``: a store trickling nothing).  It counts requests and body bytes, and
answers with an ETag (inode, size, mtime) like a real server, so a replaced file is a new version."""

from __future__ import annotations

import contextlib
import email.utils
import http.server
import os
import re
import threading
from collections.abc import Iterator

_RANGE = re.compile(r"bytes=(\d+)-(\d+)?$")


class Faults:
    def __init__(self) -> None:
        self.ignore_range = False
        self.fail_next = 0
        self.fail_status = 503
        self.requests = 0
        self.bytes = 0
        self.gets: dict[str, int] = {}  # path -> GETs answered with a body
        self.corrupt = None  # (path, nth GET of it) -> whether to flip a bit of this answer's last byte
        self.hold = None  # path -> whether to hold this answer until ``released`` is set
        self.released = threading.Event()
        self.held = 0  # answers being held now
        self.lock = threading.Lock()


def _handler(root: str, faults: Faults):
    class Handler(http.server.BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args) -> None:
            pass

        def do_HEAD(self) -> None:
            self.do_GET(body=False)

        def do_GET(self, body: bool = True) -> None:
            with faults.lock:
                faults.requests += 1
                fail = faults.fail_next > 0
                faults.fail_next -= fail
            if fail:
                self.send_response(faults.fail_status)
                self.send_header("Content-Length", "0")
                self.end_headers()
                return
            rel = self.path.split("?")[0].lstrip("/")
            path = os.path.join(root, rel)
            if body and faults.hold is not None and faults.hold(rel):
                with faults.lock:
                    faults.held += 1
                faults.released.wait(120)
                with faults.lock:
                    faults.held -= 1
            if not os.path.isfile(path):
                self.send_response(404)
                self.send_header("Content-Length", "0")
                self.end_headers()
                return
            with open(path, "rb") as f:
                data = f.read()
                st = os.fstat(f.fileno())
            etag = f'"{st.st_ino:x}-{st.st_size:x}-{st.st_mtime_ns:x}"'
            m = _RANGE.match(self.headers.get("Range", "") or "")
            if m and not faults.ignore_range:
                start = int(m.group(1))
                end = min(int(m.group(2)) if m.group(2) else len(data) - 1, len(data) - 1)
                self.send_response(206)
                self.send_header("Content-Range", f"bytes {start}-{end}/{len(data)}")
                data = data[start : end + 1]
            else:
                self.send_response(200)
            if body:
                with faults.lock:
                    nth = faults.gets[rel] = faults.gets.get(rel, 0) + 1
                    faults.bytes += len(data)
                if data and faults.corrupt is not None and faults.corrupt(rel, nth):
                    data = data[:-1] + bytes([data[-1] ^ 0x01])
            self.send_header("Content-Length", str(len(data)))
            self.send_header("Accept-Ranges", "bytes")
            self.send_header("ETag", etag)
            self.send_header("Last-Modified", email.utils.formatdate(st.st_mtime, usegmt=True))
            self.end_headers()
            if body:
                self.wfile.write(data)

    return Handler


@contextlib.contextmanager
def serving(root: str | os.PathLike) -> Iterator[tuple[str, Faults]]:
    """Serve ``root`` at the yielded URL until the block ends (always stopped)."""
    faults = Faults()
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _handler(os.fspath(root), faults))
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}", faults
    finally:
        faults.released.set()  # no answer held past the test
        server.shutdown()
        server.server_close()
        thread.join(timeout=10)
