"""One client over either FUSE adapter, called in-process as the kernel would call it (no /dev/fuse): the
kernel adapter through :mod:`kernelcalls` (node ids, wire bodies), the libfuse adapter through its
``Operations`` methods (paths).  Paths are bytes relative to the mount root; an error is an ``OSError``
with the errno the kernel would get.  What :mod:`test_adapter_contract` runs against both."""

from __future__ import annotations

import os
import struct
from typing import NamedTuple

from kernelcalls import KernelCalls

from blockfs.serve.fuse import wire


class Stat(NamedTuple):
    ino: int
    size: int
    mode: int
    nlink: int
    mtime_ns: int


def _fail(err: int) -> None:
    if err:
        raise OSError(err, os.strerror(err))


class KernelClient:
    """Requests to a :class:`blockfs.serve.fuse.kernel_adapter.KernelFS` by node id."""

    def __init__(self, fs) -> None:
        self.fs = fs
        self.calls = KernelCalls(fs)

    def _node(self, rel: bytes) -> int:
        err, node = self.calls.lookup_path(rel)
        _fail(err)
        return node

    def _call(self, handler, rel: bytes, body: bytes) -> bytes:
        err, data = self.calls.call(handler, self._node(rel), body)
        _fail(err)
        return data

    def stat(self, rel: bytes) -> Stat:
        f = wire.ATTR.unpack_from(self._call(self.fs.getattr, rel, bytes(16)), wire.ATTR_OUT_HEAD.size)
        return Stat(f[0], f[1], f[9], f[10], f[3] * 1_000_000_000 + f[6])

    def listdir(self, rel: bytes) -> list[bytes]:
        err, entries = self.calls.listdir(self._node(rel))
        _fail(err)
        return [name for name, _node, _mode in entries]

    def read(self, rel: bytes, size: int = 1 << 20, offset: int = 0) -> bytes:
        return self._call(self.fs.read, rel, wire.READ_IN.pack(0, offset, size, 0) + bytes(16))

    def readlink(self, rel: bytes) -> bytes:
        return self._call(self.fs.readlink, rel, b"")

    def getxattr(self, rel: bytes, name: str) -> bytes:
        return self._call(self.fs.getxattr, rel, wire.GETXATTR_IN.pack(1 << 16, 0) + name.encode() + b"\0")

    def listxattr(self, rel: bytes) -> list[str]:
        data = self._call(self.fs.listxattr, rel, wire.GETXATTR_IN.pack(1 << 16, 0))
        return [n.decode() for n in data.split(b"\0")[:-1]]

    def statfs(self) -> tuple[int, int]:
        data = self._call(self.fs.statfs, b"", b"")
        blocks, _bfree, _bavail, files = struct.unpack_from("=QQQQ", data)
        return blocks, files


class LibfuseClient:
    """Calls to a :class:`blockfs.serve.fuse.libfuse_adapter.BlockFS`'s operations by path."""

    def __init__(self, fs) -> None:
        from blockfs.serve.fuse.libfuse_adapter import ENCODING

        self.fs = fs
        self._enc = ENCODING

    def _path(self, rel: bytes) -> str:
        return "/" + rel.decode(self._enc)

    def _do(self, op, *args):
        try:
            return op(*args)
        except self.fs.FuseOSError as e:
            raise OSError(e.errno, os.strerror(e.errno)) from None

    def stat(self, rel: bytes) -> Stat:
        st = self._do(self.fs.getattr, self._path(rel))
        return Stat(st["st_ino"], st["st_size"], st["st_mode"], st["st_nlink"], st["st_mtime"])

    def listdir(self, rel: bytes) -> list[bytes]:
        return [name.encode(self._enc) for name, _a, _o in self._do(self.fs.readdir, self._path(rel), None)[2:]]

    def read(self, rel: bytes, size: int = 1 << 20, offset: int = 0) -> bytes:
        return self._do(self.fs.read, self._path(rel), size, offset, None)

    def readlink(self, rel: bytes) -> bytes:
        return self._do(self.fs.readlink, self._path(rel)).encode(self._enc)

    def getxattr(self, rel: bytes, name: str) -> bytes:
        return self._do(self.fs.getxattr, self._path(rel), name)

    def listxattr(self, rel: bytes) -> list[str]:
        return self._do(self.fs.listxattr, self._path(rel))

    def statfs(self) -> tuple[int, int]:
        st = self._do(self.fs.statfs, "/")
        return st["f_blocks"], st["f_files"]
