"""A TCP relay that delays each direction by half a round trip: a distant server on loopback.

    python tools/bench/helpers/delay_proxy.py LISTEN_HOST:PORT TARGET_HOST:PORT --rtt-ms 10 [--stats FILE]

Each chunk read from one side is sent to the other ``rtt/2`` after it arrived, by a sender thread per
direction, so a connection carries many chunks in flight, as a long link does, and a request's answer
arrives one round trip (plus the server's time) after it was sent.  Threads with ``time.sleep`` keep the
delay within ~0.7 ms of the setting; asyncio's timers round up further.  Bandwidth is not limited here: put
the relay behind a capped link (:class:`storage_emulation.NetworkLink`).

On SIGUSR1 it writes its counters (bytes each way, connections, HTTP requests seen) to ``--stats``
atomically, then touches nothing else; SIGTERM stops it.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import socket
import sys
import threading
import time
from collections import deque

CHUNK = 256 << 10
REQUEST_LINE = re.compile(rb"(?:GET|HEAD|PUT|POST|DELETE) \S+ HTTP/1\.[01]\r\n")


class Counters:
    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.values = {"bytes_down": 0, "bytes_up": 0, "connections": 0, "requests": 0}

    def add(self, **kw: int) -> None:
        with self.lock:
            for k, v in kw.items():
                self.values[k] += v

    def dump(self, path: str) -> None:
        with self.lock:
            text = json.dumps(self.values)
        with open(path + ".tmp", "w") as f:
            f.write(text)
        os.replace(path + ".tmp", path)


def _half_duplex(src: socket.socket, dst: socket.socket, delay: float, counters: Counters, up: bool) -> None:
    """Relay src -> dst, each chunk ``delay`` seconds after it arrived; close dst's write side at EOF."""
    queue: deque = deque()
    ready = threading.Condition()
    done = [False]

    def send() -> None:
        while True:
            with ready:
                while not queue and not done[0]:
                    ready.wait()
                if not queue:
                    break
                due, chunk = queue.popleft()
            pause = due - time.monotonic()
            if pause > 0:
                time.sleep(pause)
            try:
                dst.sendall(chunk)
            except OSError:
                break
        try:
            dst.shutdown(socket.SHUT_WR)
        except OSError:
            pass

    sender = threading.Thread(target=send, daemon=True)
    sender.start()
    tail = b""
    while True:
        try:
            chunk = src.recv(CHUNK)
        except OSError:
            chunk = b""
        if not chunk:
            break
        if up:
            seen = tail + chunk  # a request line split across two reads is still counted once
            counters.add(
                bytes_up=len(chunk), requests=len(REQUEST_LINE.findall(seen)) - len(REQUEST_LINE.findall(tail))
            )
            tail = seen[-64:]
        else:
            counters.add(bytes_down=len(chunk))
        with ready:
            queue.append((time.monotonic() + delay, chunk))
            ready.notify()
    with ready:
        done[0] = True
        ready.notify()
    sender.join()


def _serve(client: socket.socket, target: tuple[str, int], delay: float, counters: Counters) -> None:
    try:
        server = socket.create_connection(target)
    except OSError:
        client.close()
        return
    for s in (client, server):
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    counters.add(connections=1)
    down = threading.Thread(target=_half_duplex, args=(server, client, delay, counters, False), daemon=True)
    down.start()
    _half_duplex(client, server, delay, counters, True)
    down.join()
    client.close()
    server.close()


def _address(text: str) -> tuple[str, int]:
    host, _, port = text.rpartition(":")
    return host, int(port)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("listen", type=_address)
    parser.add_argument("target", type=_address)
    parser.add_argument("--rtt-ms", type=float, required=True)
    parser.add_argument("--stats", default=None)
    args = parser.parse_args()
    counters = Counters()
    if args.stats:
        signal.signal(signal.SIGUSR1, lambda *_: counters.dump(args.stats))
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    listener = socket.create_server(args.listen, backlog=256, reuse_port=False)
    print("listening", flush=True)
    delay = args.rtt_ms / 2000
    while True:
        client, _ = listener.accept()
        threading.Thread(target=_serve, args=(client, args.target, delay, counters), daemon=True).start()


if __name__ == "__main__":
    sys.exit(main())
