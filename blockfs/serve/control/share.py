"""Cached blocks shared with loaders on the same machine: the mount's end of the channel.

Through FUSE every file costs a round trip to the mount's Python server, whatever it serves it from.  A
loader on the same machine can skip that: it asks the mount for a block and gets a descriptor of the
sealed memory the mount's cache holds that block in (:meth:`blockfs.serve.cache.block_cache.BlockCache.share`), maps it
read-only, and copies its files out itself (:mod:`blockfs.loader.shared_blocks`).  The block is still read
from storage once, by the mount, whole and verified by its CRC, and counted in its statistics
(``blocks_shared``); only the per-file round trips go.  A block the mount does not share (its policy
evicts, its budget is full, the block is damaged) is answered with the reason, and the loader reads that
block's files through the mount as before, where damaged files fail with ``EIO`` one by one.

The message formats are in :mod:`blockfs.protocol`.  One selector thread reads every connection
(:mod:`blockfs.serve.control.listener`); answering may load a block from storage, so that runs on a small fixed
pool, one request per connection at a time: the threads stay few however many loaders connect, and a
block being loaded for one loader holds no other loader's answer.
"""

from __future__ import annotations

import concurrent.futures
import logging
import os
import socket
from collections.abc import Callable

from ... import protocol
from .listener import Connection, SocketServer

log = logging.getLogger(__name__)

MAX_CONNECTIONS = 1024  # one per loader process (ranks x workers); past that the longest idle is closed
ANSWER_THREADS = 4


class ShareServer(SocketServer):
    """Answers block requests on a fresh socket (``address``) with descriptors from ``share(block)``.

    ``share`` returns a descriptor (which the server closes once sent) or raises an exception whose text
    is the reason for the refusal.
    """

    def __init__(self, share: Callable[[int], int], n_blocks: int, max_connections: int = MAX_CONNECTIONS) -> None:
        self._share = share
        self._n_blocks = n_blocks
        self._pool = concurrent.futures.ThreadPoolExecutor(ANSWER_THREADS, thread_name_prefix="blockfs-share")
        super().__init__(
            socket.SOCK_SEQPACKET, protocol.SHARE_SOCKET_PREFIX, "block share", max_connections, "blockfs-share"
        )

    def on_readable(self, conn: Connection) -> bool:
        request = conn.sock.recv(protocol.SHARE_REQUEST_BYTES)
        if not request:
            return False  # the loader hung up
        self.pause(conn)  # one request at a time per connection: the next is read once this one is answered
        self._pool.submit(self._answer, conn, request)
        return True

    def _answer(self, conn: Connection, request: bytes) -> None:
        try:
            try:
                fd = self._share(protocol.parse_share_request(request, self._n_blocks))
            except ValueError as e:
                conn.sock.send(protocol.share_refusal(f"bad request: {e}"))
                return
            except Exception as e:
                conn.sock.send(protocol.share_refusal(str(e)))
                return
            try:
                socket.send_fds(conn.sock, [protocol.SHARE_OK], [fd])
            finally:
                os.close(fd)
        except OSError as e:  # gone, or not reading its answers (its queue is full): it is dropped
            log.debug("block share connection ended: %s", e)
            try:
                conn.sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        finally:
            self.resume(conn)  # an ended connection then reads EOF and is closed by the selector thread

    def close(self) -> None:
        """Stop answering; loaders that still hold maps keep them (they read the pages they mapped)."""
        super().close()
        self._pool.shutdown(wait=False, cancel_futures=True)
