"""Start writing a file range to disk without waiting for it (Linux ``sync_file_range``).

The packer writes blocks through the page cache and fsyncs each one.  Left alone, the kernel writes
nothing back until the fsync, so the last block's fsync waits for the whole block to reach the disk.
Starting writeback as each piece is written keeps the disk busy while the packer reads and checksums,
and the final fsync waits only for the last piece.  Durability still comes from fsync alone.
"""

from __future__ import annotations

import ctypes
import sys

_SYNC_FILE_RANGE_WRITE = 2  # from <fcntl.h>: start writeback of dirty pages, do not wait


def _load():
    if sys.platform != "linux":
        return None
    try:
        fn = ctypes.CDLL(None, use_errno=True).sync_file_range
    except (OSError, AttributeError):
        return None
    fn.argtypes = (ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint)
    fn.restype = ctypes.c_int
    return fn


_sync_file_range = _load()


def start_writeback(fd: int, offset: int, length: int) -> None:
    """Ask the kernel to start writing ``length`` bytes of ``fd`` from ``offset`` to disk; a hint only."""
    if _sync_file_range is not None and length > 0:
        _sync_file_range(fd, offset, length, _SYNC_FILE_RANGE_WRITE)  # an error here is left to fsync
