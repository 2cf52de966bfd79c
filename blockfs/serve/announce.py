"""The mount's end of the loader's prefetch announcements: a Unix socket that takes block ids.

A loader that knows which blocks it reads next (its epoch's order, or only the blocks of the samples an
importance-aware epoch selected) connects to the socket named by the control directory's
``user.blockfs.prefetch`` attribute, sends the block ids as ASCII decimal numbers, one per line, first
needed first, and closes the connection. The mount hands the list to its cache, which loads those blocks
in that order in the background as far as its budget holds them without evicting anything. It is a hint:
a malformed announcement is logged and dropped, and nothing is answered.

The socket lives in Linux's abstract namespace (its address starts with a NUL byte), so nothing is left in
the filesystem when a mount is killed; only processes of the mount's own user (or root) are heard, checked
with ``SO_PEERCRED``.
"""

from __future__ import annotations

import logging
import os
import secrets
import socket
import struct
import threading
from typing import Callable

log = logging.getLogger(__name__)

BYTES_PER_ID = 12  # ten digits, a newline and slack: an announcement longer than every block twice is cut


class PrefetchListener:
    """Accepts announcements on a fresh socket (``address``) and passes each id list to ``on_blocks``."""

    def __init__(self, on_blocks: Callable[[list[int]], None], n_blocks: int) -> None:
        self._on_blocks = on_blocks
        self._n_blocks = n_blocks
        self.address = b"\0blockfs-prefetch-" + secrets.token_hex(12).encode()
        self._server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._server.bind(self.address)
        self._server.listen(16)
        self._thread = threading.Thread(target=self._serve, name="blockfs-prefetch", daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        limit = max(1, 2 * self._n_blocks) * BYTES_PER_ID
        while True:
            try:
                conn, _ = self._server.accept()
            except OSError:
                return  # closed
            with conn:
                if not from_own_user(conn, "prefetch announcement"):
                    continue
                conn.settimeout(5.0)
                data = bytearray()
                try:
                    while len(data) < limit and (chunk := conn.recv(min(1 << 20, limit - len(data)))):
                        data += chunk
                except OSError as e:
                    log.warning("prefetch announcement dropped: %s", e)
                    continue
            blocks = self._parse(bytes(data))
            if blocks:
                self._on_blocks(blocks)

    def _parse(self, data: bytes) -> list[int] | None:
        try:
            blocks = [int(line) for line in data.split()]
        except ValueError:
            log.warning("prefetch announcement dropped: not one decimal block id per line (%r...)", data[:40])
            return None
        return [b for b in blocks if 0 <= b < self._n_blocks]

    def close(self) -> None:
        close_listener(self._server, self._thread)


def from_own_user(conn: socket.socket, what: str) -> bool:
    """Whether the peer of ``conn`` runs as this process's user (or root); logs a refusal of ``what``."""
    pid, uid, _gid = struct.unpack("3i", conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12))
    if uid in (os.getuid(), 0):
        return True
    log.warning("%s refused: process %d of user %d is not this mount's user", what, pid, uid)
    return False


def close_listener(server: socket.socket, thread: threading.Thread) -> None:
    """Stop a listening socket and join the thread accepting on it."""
    try:
        server.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
    server.close()
    thread.join(timeout=5)
