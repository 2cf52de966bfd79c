"""The loader's end of the mount's block sharing: read-only maps of the mount's cached, verified blocks.

The mount end and the message formats are described in :mod:`blockfs.protocol`; a loader process asks for
each block once over its own connection and keeps the last few maps (address space only: the pages are
the mount's memory).
"""

from __future__ import annotations

import collections
import logging
import mmap
import os
import socket

from .. import protocol

log = logging.getLogger(__name__)

MAPS_KEPT = 64  # block maps a loader process keeps


class SharedBlocks:
    """Read-only maps of the mount's cached blocks, asked for once per process.

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
            try:
                view = self._ask(block)
            except (ConnectionResetError, BrokenPipeError):
                if self._conn is None:
                    raise
                # The mount closes the connection idle longest when it has too many open: ask again once.
                self._conn.close()
                self._conn = None
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
        self._conn.send(protocol.encode_share_request(block))
        answer, fds, _flags, _addr = socket.recv_fds(self._conn, protocol.SHARE_ANSWER_BYTES, 1)
        if not answer:
            raise ConnectionResetError("the mount closed the connection")
        if answer != protocol.SHARE_OK or len(fds) != 1:
            for fd in fds:
                os.close(fd)
            self.refused[block] = protocol.parse_share_refusal(answer)
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
