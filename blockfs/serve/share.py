"""Cached blocks shared with loaders on the same machine: both ends of the channel.

Through FUSE every file costs a round trip to the mount's Python server, whatever it serves it from.  A
loader on the same machine can skip that: it asks the mount for a block and gets a descriptor of the
sealed memory the mount's cache holds that block in (:meth:`blockfs.serve.cache.BlockCache.share`), maps it
read-only, and copies its files out itself.  The block is still read from storage once, by the mount,
whole and verified by its CRC, and counted in its statistics (``blocks_shared``); only the per-file round
trips go.  A block the mount does not share (its policy evicts, its budget is full, the block is damaged)
is answered with the reason, and the loader reads that block's files through the mount as before, where
damaged files fail with ``EIO`` one by one.

Protocol: a Unix ``SOCK_SEQPACKET`` socket in Linux's abstract namespace, named by the control
directory's ``user.blockfs.share`` attribute; one connection per loader process.  Each request is one
packet, a block id in ASCII decimal; each answer is one packet: ``ok`` with the descriptor attached
(``SCM_RIGHTS``; its size is the block's data size), or ``no `` and the reason.  Only processes of the
mount's own user (or root) are answered, checked with ``SO_PEERCRED``.
"""

from __future__ import annotations

import collections
import logging
import mmap
import os
import secrets
import socket
import threading
from typing import Callable

from .announce import close_listener, from_own_user

log = logging.getLogger(__name__)

SHARE_XATTR = "user.blockfs.share"  # on the control directory: the socket's address
MAPS_KEPT = 64  # block maps a loader process keeps (address space only: the pages are the mount's)
REQUEST_BYTES = 32
ANSWER_BYTES = 4096


class ShareServer:
    """Answers block requests on a fresh socket (``address``) with descriptors from ``share(block)``.

    ``share`` returns a descriptor (which the server closes once sent) or raises an exception whose text
    is the reason for the refusal.
    """

    def __init__(self, share: Callable[[int], int], n_blocks: int) -> None:
        self._share = share
        self._n_blocks = n_blocks
        self.address = b"\0blockfs-share-" + secrets.token_hex(12).encode()
        self._server = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_CLOEXEC)
        self._server.bind(self.address)
        self._server.listen(64)
        self._conns: set[socket.socket] = set()
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._accept, name="blockfs-share", daemon=True)
        self._thread.start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self._server.accept()
            except OSError:
                return  # closed
            if not from_own_user(conn, "block share"):
                conn.close()
                continue
            with self._lock:
                self._conns.add(conn)
            threading.Thread(target=self._answer, args=(conn,), name="blockfs-share-conn", daemon=True).start()

    def _answer(self, conn: socket.socket) -> None:
        """Answer one loader process's requests, one at a time, until it hangs up."""
        try:
            while request := conn.recv(REQUEST_BYTES):
                try:
                    block = int(request)
                    if not 0 <= block < self._n_blocks:
                        raise ValueError(f"block {block} out of range (0..{self._n_blocks - 1})")
                except ValueError as e:
                    conn.send(f"no bad request: {e}".encode()[:ANSWER_BYTES])
                    continue
                try:
                    fd = self._share(block)
                except Exception as e:
                    conn.send(f"no {e}".encode()[:ANSWER_BYTES])
                    continue
                try:
                    socket.send_fds(conn, [b"ok"], [fd])
                finally:
                    os.close(fd)
        except OSError as e:
            log.debug("block share connection ended: %s", e)
        finally:
            with self._lock:
                self._conns.discard(conn)
            conn.close()

    def close(self) -> None:
        """Stop answering; loaders that still hold maps keep them (they read the pages they mapped)."""
        close_listener(self._server, self._thread)
        with self._lock:
            conns = list(self._conns)
        for conn in conns:
            try:
                conn.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass


class SharedBlocks:
    """The loader's end: read-only maps of the mount's cached blocks, asked for once per process.

    :meth:`get` returns a block's data as a read-only ``memoryview``, or None when the mount does not
    share it (the reason is kept in ``refused``).  After a ``fork`` the child opens its own connection.
    If the channel fails, sharing is off for the process and every block is read through the mount.
    """

    def __init__(self, address: bytes, keep: int = MAPS_KEPT) -> None:
        self.address = address
        self.refused: dict[int, str] = {}
        self._keep = keep
        self._maps: collections.OrderedDict[int, memoryview] = collections.OrderedDict()
        self._conn: socket.socket | None = None
        self._pid = 0
        self.failed: str | None = None

    def get(self, block: int) -> memoryview | None:
        view = self._maps.get(block)
        if view is not None:
            self._maps.move_to_end(block)
            return view
        if self.failed is not None or block in self.refused:
            return None
        try:
            view = self._ask(block)
        except OSError as e:
            self.failed = f"the mount's block share at {self.address!r} failed: {e}"
            log.warning("%s; reading blocks through the mount instead", self.failed)
            self.close()
            return None
        if view is not None:
            self._maps[block] = view
            if len(self._maps) > self._keep:
                self._maps.popitem(last=False)  # unmapped once no batch slice refers to it
        return view

    def _ask(self, block: int) -> memoryview | None:
        if self._conn is None or self._pid != os.getpid():
            self._conn = None  # a forked child must not talk on its parent's connection
            conn = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_CLOEXEC)
            try:
                conn.connect(self.address)
            except OSError:
                conn.close()
                raise
            self._conn, self._pid = conn, os.getpid()
        self._conn.send(b"%d" % block)
        answer, fds, _flags, _addr = socket.recv_fds(self._conn, ANSWER_BYTES, 1)
        if not answer:
            raise ConnectionResetError("the mount closed the connection")
        if answer != b"ok" or len(fds) != 1:
            for fd in fds:
                os.close(fd)
            self.refused[block] = answer.removeprefix(b"no ").decode(errors="replace")
            return None
        try:
            size = os.fstat(fds[0]).st_size
            mapped = mmap.mmap(fds[0], size, prot=mmap.PROT_READ) if size else b""
        finally:
            os.close(fds[0])
        return memoryview(mapped)

    def close(self) -> None:
        """Hang up and forget the maps (each goes when the last view of it does)."""
        if self._conn is not None and self._pid == os.getpid():
            self._conn.close()
        self._conn = None
        self._maps.clear()
