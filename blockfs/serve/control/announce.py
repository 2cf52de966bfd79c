"""The mount's end of the loader's prefetch announcements: a Unix socket that takes block ids.

A loader that knows which blocks it reads next (its epoch's order, or only the blocks of the samples an
importance-aware epoch selected) connects to the socket named by the control directory's
:data:`~blockfs.protocol.PREFETCH_XATTR` attribute, sends the block ids (the format is in
:mod:`blockfs.protocol`) and closes the connection.  The mount hands the list to its cache, which loads
those blocks in that order in the background as far as its budget holds them without evicting anything.
It is a hint: a malformed announcement is logged and dropped, and nothing is answered.

Connections are read without blocking by one thread (:mod:`blockfs.serve.control.listener`), so a client that
connects and sends nothing delays no other client's announcement.
"""

from __future__ import annotations

import logging
import socket
from collections.abc import Callable

from ... import protocol
from .listener import Connection, SocketServer

log = logging.getLogger(__name__)

MAX_CONNECTIONS = 64  # announcements in progress at once (one per loader rank per epoch is the usual)
RECV_BYTES = 1 << 16


class PrefetchListener(SocketServer):
    """Accepts announcements on a fresh socket (``address``) and passes each id list to ``on_blocks``."""

    def __init__(self, on_blocks: Callable[[list[int]], None], n_blocks: int) -> None:
        self._on_blocks = on_blocks
        self._n_blocks = n_blocks
        self._limit = protocol.announcement_limit(n_blocks)
        super().__init__(
            socket.SOCK_STREAM,
            protocol.PREFETCH_SOCKET_PREFIX,
            "prefetch announcement",
            MAX_CONNECTIONS,
            "blockfs-prefetch",
        )

    def on_readable(self, conn: Connection) -> bool:
        """Collect the announcement; at its end (the client closed, or the limit) hand it to the cache."""
        chunk = conn.sock.recv(min(RECV_BYTES, self._limit - len(conn.buffer)))
        conn.buffer += chunk
        if chunk and len(conn.buffer) < self._limit:
            return True
        self._announce(bytes(conn.buffer))
        return False

    def _announce(self, data: bytes) -> None:
        try:
            blocks = protocol.parse_announcement(data, self._n_blocks)
        except ValueError as e:
            log.warning("prefetch announcement dropped: %s", e)
            return
        if blocks:
            self._on_blocks(blocks)
