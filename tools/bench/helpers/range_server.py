"""A static HTTP server for benchmarks on loopback: byte ranges sent with ``sendfile``, no log.

    python tools/bench/helpers/range_server.py ROOT PORT

Serves the files under ROOT (GET and HEAD, one ``bytes=START-END`` range or the whole file) until killed.
A ranged GET costs it in proportion to the range, not to the object — unlike moto, which reads an object's
whole value for every GET — so ``tools/bench/bench_remote.py --parts`` uses it to show what part size and
concurrency cost the client where the server's cost per GET is the range's.
"""

from __future__ import annotations

import email.utils
import http.server
import os
import re
import sys
from urllib.parse import unquote

_RANGE = re.compile(r"bytes=(\d+)-(\d*)$")


def handler(root: str) -> type[http.server.BaseHTTPRequestHandler]:
    root = os.path.realpath(root)

    class Handler(http.server.BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args: object) -> None:
            pass

        def do_HEAD(self) -> None:
            self.do_GET(body=False)

        def do_GET(self, body: bool = True) -> None:
            path = os.path.realpath(os.path.join(root, unquote(self.path.split("?")[0]).lstrip("/")))
            if not path.startswith(root + os.sep) or not os.path.isfile(path):
                self._empty(404)
                return
            fd = os.open(path, os.O_RDONLY)
            try:
                st = os.fstat(fd)
                start, length = 0, st.st_size
                m = _RANGE.match(self.headers.get("Range") or "")
                if m:
                    start = int(m.group(1))
                    end = min(int(m.group(2)) if m.group(2) else st.st_size - 1, st.st_size - 1)
                    if start > end:
                        self._empty(416)
                        return
                    length = end - start + 1
                    self.send_response(206)
                    self.send_header("Content-Range", f"bytes {start}-{end}/{st.st_size}")
                else:
                    self.send_response(200)
                self.send_header("Content-Length", str(length))
                self.send_header("Accept-Ranges", "bytes")
                self.send_header("Last-Modified", email.utils.formatdate(st.st_mtime, usegmt=True))
                self.send_header("ETag", f'"{st.st_ino:x}-{st.st_mtime_ns:x}-{st.st_size:x}"')
                self.end_headers()
                out = self.connection.fileno()
                while body and length > 0:
                    sent = os.sendfile(out, fd, start, length)
                    if sent == 0:
                        break
                    start, length = start + sent, length - sent
            finally:
                os.close(fd)

        def _empty(self, status: int) -> None:
            self.send_response(status)
            self.send_header("Content-Length", "0")
            self.end_headers()

    return Handler


def main(argv: list[str] | None = None) -> int:
    root, port = (argv if argv is not None else sys.argv[1:])[:2]
    server = http.server.ThreadingHTTPServer(("127.0.0.1", int(port)), handler(root))
    server.daemon_threads = True
    server.serve_forever()
    return 0


if __name__ == "__main__":
    sys.exit(main())
