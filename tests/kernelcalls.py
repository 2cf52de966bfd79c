"""Call the kernel-route adapter (blockfs.serve.fuse.kernel_adapter) in-process, as the kernel would: by node id, with
request bodies in the wire format, answers collected from a stand-in for the session (no /dev/fuse)."""

from __future__ import annotations

import os
import struct
import threading

from blockfs.serve.fuse import wire
from blockfs.serve.fuse.session import DEFERRED


class RecordingSession:
    """What KernelFS writes back: replies and errors by request id, and (refused) pushes."""

    def __init__(self) -> None:
        self._answers: dict[int, tuple[int, bytes]] = {}
        self._cond = threading.Condition()
        self.requests: dict = {}
        self.minor = wire.KERNEL_MINOR

    def reply(self, unique: int, body) -> None:
        parts = list(body) if isinstance(body, (list, tuple)) else [body]
        self._put(unique, 0, b"".join(bytes(p) for p in parts))

    def fail(self, unique: int, err: int) -> None:
        self._put(unique, err, b"")

    def _put(self, unique: int, err: int, data: bytes) -> None:
        with self._cond:
            self._answers[unique] = (err, data)
            self._cond.notify_all()

    def wait(self, unique: int, timeout: float = 30.0) -> tuple[int, bytes]:
        with self._cond:
            if not self._cond.wait_for(lambda: unique in self._answers, timeout):
                raise AssertionError(f"request {unique} was never answered")
            return self._answers.pop(unique)

    def store(self, nodeid: int, data, offset: int = 0) -> bool:
        return False  # no kernel: every node is unknown

    def forget_name(self, parent: int, name: bytes) -> None:
        pass


class KernelCalls:
    """Requests to one KernelFS, answered as (errno, bytes)."""

    def __init__(self, fs) -> None:
        self.fs = fs
        self.session = fs.session = RecordingSession()
        self._unique = 0
        self._lock = threading.Lock()

    def call(self, handler, nodeid: int, body: bytes) -> tuple[int, bytes]:
        with self._lock:
            self._unique += 1
            unique = self._unique
        try:
            out = handler(nodeid, memoryview(body), unique)
        except OSError as e:
            return e.errno, b""
        if out is DEFERRED:
            return self.session.wait(unique)
        return 0, bytes(out) if not isinstance(out, (list, tuple)) else b"".join(bytes(p) for p in out)

    def lookup_path(self, rel: bytes) -> tuple[int, int]:
        """(errno, node id) of a path relative to the root, one LOOKUP per component."""
        node = wire.ROOT_ID
        for name in filter(None, rel.split(b"/")):
            err, entry = self.call(self.fs.lookup, node, name + b"\0")
            if err:
                return err, 0
            node = struct.unpack_from("=Q", entry)[0]
            if node == 0:
                return 2, 0  # a negative entry: ENOENT
        return 0, node

    def read(self, rel: bytes, size: int = 1 << 20, offset: int = 0) -> bytes:
        """A file's bytes, or OSError with the errno the kernel would get."""
        err, node = self.lookup_path(rel)
        if not err:
            err, data = self.call(self.fs.read, node, wire.READ_IN.pack(0, offset, size, 0) + bytes(16))
        if err:
            raise OSError(err, os.strerror(err))
        return data

    def listdir(self, node: int) -> tuple[int, list[tuple[bytes, int, int]]]:
        """(errno, [(name, node id, mode)]) of a directory node, READDIRPLUS until the end; "." and ".."
        left out."""
        out: list[tuple[bytes, int, int]] = []
        offset = 0
        while True:
            err, data = self.call(self.fs.readdirplus, node, wire.READ_IN.pack(0, offset, 4096, 0) + bytes(16))
            if err:
                return err, out
            if not data:
                return 0, out
            pos = 0
            while pos < len(data):
                child = struct.unpack_from("=Q", data, pos)[0]
                mode = wire.ATTR.unpack_from(data, pos + wire.ENTRY_OUT_HEAD.size)[9]
                _ino, offset, namelen, dtype = wire.DIRENT_HEAD.unpack_from(data, pos + wire.ENTRY_OUT_SIZE)
                start = pos + wire.DIRENTPLUS_FIXED
                name = data[start : start + namelen]
                if name not in (b".", b".."):
                    out.append((name, child, mode if child else dtype << 12))
                pos += wire.DIRENTPLUS_FIXED + namelen + (-(wire.DIRENTPLUS_FIXED + namelen) & 7)
