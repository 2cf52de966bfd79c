"""A hostile neighbour against the mount's control sockets (issue 17, case 9); needs root.

    sudo python tools/flood_sockets.py [SECONDS]

For SECONDS (default 3) a child process of user nobody connects to a prefetch listener as fast as it can
while this process, holding an idle connection open, announces a block every 0.1 s; then 3,000
connections are opened to a share server.  It prints the refused connections, the log they produced, the
slowest announcement and the threads and open connections the share server ended with.  Timings depend on
the machine and its load.
"""

from __future__ import annotations

import io
import logging
import os
import resource
import socket
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from blockfs.serve.control.announce import PrefetchListener  # noqa: E402
from blockfs.serve.control.share import ShareServer  # noqa: E402


def flood(address: bytes, seconds: float) -> None:
    os.setuid(65534)
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
            s.connect(address)
            try:
                s.sendall(b"0\n")
            except OSError:
                pass  # refused and closed by the listener


def announcements_under_flood(seconds: float, log: io.StringIO) -> None:
    got: list[list[int]] = []
    server = PrefetchListener(got.append, 1000)
    child = os.fork()
    if child == 0:
        try:
            flood(server.address, seconds)
        finally:
            os._exit(0)
    idle = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    idle.connect(server.address)
    slowest, end = 0.0, time.monotonic() + seconds
    while time.monotonic() < end:
        before, started = len(got), time.monotonic()
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
            s.connect(server.address)
            s.sendall(b"1\n")
        while len(got) == before:
            time.sleep(0.0005)
        slowest = max(slowest, time.monotonic() - started)
        time.sleep(0.1)
    os.waitpid(child, 0)
    idle.close()
    server.close()
    text = log.getvalue()
    print(
        f"refused {server.refusals.refused:,} connections in {seconds:g} s: {text.count(chr(10))} log lines "
        f"({len(text)} bytes); slowest own-user announcement {slowest * 1000:.1f} ms"
    )


def share_connections(n: int = 3000) -> None:
    def refuse(block: int) -> int:
        raise RuntimeError("not cached")

    server = ShareServer(refuse, 10)
    before = threading.active_count()
    socks = []
    for _ in range(n):
        s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        s.connect(server.address)
        socks.append(s)
    for s in socks[-100:]:  # the newest are open and answered
        s.send(b"1")
        assert s.recv(100).startswith(b"no ")
    print(
        f"{n:,} share connections: {threading.active_count() - before} threads added, "
        f"{server.open_connections():,} kept open"
    )
    for s in socks:
        s.close()
    server.close()


def main() -> int:
    if os.geteuid() != 0:
        print("needs root (the flood runs as user nobody)", file=sys.stderr)
        return 2
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, min(hard, 10000)), hard))
    log = io.StringIO()
    logging.basicConfig(stream=log, level=logging.INFO)
    announcements_under_flood(float(sys.argv[1]) if len(sys.argv) > 1 else 3.0, log)
    share_connections()
    return 0


if __name__ == "__main__":
    sys.exit(main())
