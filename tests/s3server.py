"""A real S3-compatible server on loopback for the tests: moto in server mode, started once per session.

Credentials are fake but distinctive (:data:`SECRET`), so a test can prove they never reach a log line, an
error or a control file.  :meth:`S3Server.stop` and :meth:`S3Server.start` restart it on the same port with
its objects kept (moto keeps them in this process), which is how a test takes the store away mid-epoch.
"""

from __future__ import annotations

import contextlib
import http.server
import itertools
import os
import socket
import threading
from collections.abc import Iterator

from polling import wait_until

ACCESS_KEY = "AKIABLOCKFSTESTKEY01"
SECRET = "blockfs-test-secret-Zq7rW2xV9pL4"
REGION = "us-east-1"
_bucket_numbers = itertools.count()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _answers(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.5):
            return True
    except OSError:
        return False


class S3Server:
    def __init__(self) -> None:
        self.port = _free_port()
        self.endpoint = f"http://127.0.0.1:{self.port}"
        self._server = None

    def start(self) -> None:
        from moto.server import ThreadedMotoServer

        self._server = ThreadedMotoServer(ip_address="127.0.0.1", port=self.port, verbose=False)
        self._server.start()
        wait_until(lambda: _answers(self.port), timeout=20, what="the S3 test server to answer")

    def stop(self) -> None:
        if self._server is not None:
            self._server.stop()
            self._server = None
            wait_until(lambda: not _answers(self.port), timeout=20, what="the S3 test server to stop")

    @property
    def env(self) -> dict[str, str]:
        """What a process needs to reach the server through the standard AWS variables."""
        return {
            "AWS_ENDPOINT_URL": self.endpoint,
            "AWS_ACCESS_KEY_ID": ACCESS_KEY,
            "AWS_SECRET_ACCESS_KEY": SECRET,
            "AWS_REGION": REGION,
            "AWS_DEFAULT_REGION": REGION,
        }

    def client(self):
        import boto3

        return boto3.client(
            "s3",
            endpoint_url=self.endpoint,
            aws_access_key_id=ACCESS_KEY,
            aws_secret_access_key=SECRET,
            region_name=REGION,
        )

    def new_bucket(self) -> str:
        name = f"blockfs-test-{next(_bucket_numbers)}-{os.getpid()}"
        self.client().create_bucket(Bucket=name)
        return name

    def keys(self, bucket: str, prefix: str = "") -> list[str]:
        pages = self.client().get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix)
        return sorted(o["Key"] for page in pages for o in page.get("Contents", []))


def upload_tree(server: S3Server, bucket: str, prefix: str, root: str | os.PathLike) -> None:
    """Put every file under ``root`` at ``prefix/<relative path>`` (a packed dataset, copied as-is)."""
    client = server.client()
    for dirpath, _dirs, files in os.walk(root):
        for name in files:
            path = os.path.join(dirpath, name)
            key = f"{prefix}/{os.path.relpath(path, root)}".lstrip("/")
            client.upload_file(path, bucket, key)


class _RefusingHandler(http.server.BaseHTTPRequestHandler):
    """What S3 answers a key it does not know: 403 and its XML error, to every request."""

    BODY = (
        b'<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>InvalidAccessKeyId</Code><Message>The AWS '
        b"Access Key Id you provided does not exist in our records.</Message><AWSAccessKeyId>"
        + ACCESS_KEY.encode()
        + b"</AWSAccessKeyId><RequestId>0</RequestId></Error>"
    )

    def do_GET(self) -> None:
        self.send_response(403)
        self.send_header("Content-Type", "application/xml")
        self.send_header("Content-Length", str(len(self.BODY)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(self.BODY)

    do_HEAD = do_PUT = do_POST = do_DELETE = do_GET

    def log_message(self, *args: object) -> None:
        pass


@contextlib.contextmanager
def refusing_s3() -> Iterator[str]:
    """An S3 endpoint on loopback that refuses every credential (403 InvalidAccessKeyId); yields its URL."""
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _RefusingHandler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()
        thread.join()


def closed_port() -> int:
    """A loopback port nothing listens on: bound, then closed."""
    return _free_port()
