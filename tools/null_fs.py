"""A FUSE filesystem that does no work: the ceiling of a Python FUSE server on this machine.

    python tools/null_fs.py SRC MOUNTPOINT      # serves in the foreground until unmounted

It shows SRC's tree (names, sizes, modes, taken once at start) through the same binding, the same mount
options and the same per-thread trick as ``blockfs mount`` (:mod:`blockfs.serve.fs`, :mod:`blockfs.serve.server`), and answers every read with
zero bytes from one preallocated buffer: no index, no cache, no copy of file data in Python.  Whatever a
reader gets from it per second is what the FUSE round trip and the binding cost; ``tools/bench_mount.py``
reads it side by side with the mount so the served-from-memory figures have their ceiling in the same run.
"""

from __future__ import annotations

import errno
import os
import stat
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from blockfs.serve.fs import ENCODING, binding, keep_thread_state  # noqa: E402
from blockfs.serve.server import MountOptions, fuse_kwargs  # noqa: E402

ZEROS = bytes(1 << 20)


class NullFS(binding.Operations):
    use_ns = True
    flush = release = opendir = releasedir = access = ioctl = None

    def __init__(self, src: str) -> None:
        self.attrs: dict[str, dict] = {}
        self.children: dict[str, list[str]] = {}
        for parent, dirs, files in os.walk(src):
            rel = "/" + os.path.relpath(parent, src).removeprefix(".").lstrip("/")
            self.attrs[rel] = self._attr(os.lstat(parent))
            self.children[rel] = dirs + files
            for name in files:
                self.attrs[os.path.join(rel, name)] = self._attr(os.lstat(os.path.join(parent, name)))

    @staticmethod
    def _attr(st: os.stat_result) -> dict:
        return {"st_mode": st.st_mode & ~0o222, "st_size": st.st_size, "st_nlink": st.st_nlink,
                "st_ino": st.st_ino, "st_mtime": st.st_mtime_ns, "st_uid": 0, "st_gid": 0}  # fmt: skip

    def getattr(self, path: str, fh: object = None) -> dict:
        keep_thread_state()
        try:
            return self.attrs[path]
        except KeyError:
            raise binding.FuseOSError(errno.ENOENT) from None

    def readdir(self, path: str, fh: object) -> list[str]:
        return [".", "..", *self.children[path]]

    def open(self, path: str, fi: object) -> int:
        raise binding.FuseOSError(errno.ENOSYS)  # as blockfs does by default: no open/release per file

    def read(self, path: str, size: int, offset: int, fh: object) -> bytes:
        keep_thread_state()
        end = min(offset + size, self.attrs[path]["st_size"])
        return ZEROS[: max(0, end - offset)]

    def statfs(self, path: str) -> dict:
        return {"f_bsize": 4096, "f_frsize": 4096, "f_blocks": 1, "f_namemax": 255}


def main() -> int:
    if len(sys.argv) != 3 or not stat.S_ISDIR(os.stat(sys.argv[1]).st_mode):
        print(__doc__.strip().splitlines()[2], file=sys.stderr)
        return 2
    src, mountpoint = (os.path.abspath(a) for a in sys.argv[1:])
    binding.FUSE(NullFS(src), mountpoint, raw_fi=False, encoding=ENCODING, **fuse_kwargs(MountOptions(cache_bytes=0), src))
    return 0


if __name__ == "__main__":
    sys.exit(main())
