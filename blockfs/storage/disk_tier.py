"""``DiskTier``: copies of a remote dataset's blocks on a local disk, kept across mounts, cache-once.

* **Keyed by the dataset's identity.**  Each dataset gets ``DIR/<key>/``, where the key is a hash of its
  ``blockfs.json`` — which records the index's CRC, and the index records every file's CRC — so another
  dataset, or the same URL packed again, never meets this one's blocks.  When a URL is opened under a new
  key, the directories of its older keys are removed: they can never be used again.
* **Cache-once within a byte budget.**  A block is kept on its first verified whole fetch while the budget
  (for the whole of ``DIR``) has room, and never replaced: under shuffled access, evicting one block for
  another only trades which misses are paid, while a fixed set serves every epoch.
* **Never visible half-written.**  A copy is written under a temporary name, ``fsync``-ed, then renamed:
  after a crash a block's name holds the whole block or nothing.  The directory is not ``fsync``-ed — a
  lost rename only costs fetching the block again.  Left-over temporary files are removed at open.
* **Trusted only after a check.**  The block store checks a copy like any block (header against the
  index, then every byte by CRC); a copy that fails is deleted and the block read from the remote.

The budget is counted per process: two mounts sharing one ``DIR`` may together exceed it.
"""

from __future__ import annotations

import logging
import os
import re
import shutil
import threading

log = logging.getLogger(__name__)

BLOCKS = "blocks"
SOURCE_FILE = "source"  # the redacted URL this key's dataset came from
_BLOCK_NAME = re.compile(r"^(\d{8})\.blk$")


def _tree_bytes(path: str) -> int:
    total = 0
    for dirpath, _dirs, files in os.walk(path):
        for name in files:
            try:
                total += os.lstat(os.path.join(dirpath, name)).st_size
            except OSError:
                pass
    return total


def write_atomically(path: str, pieces: tuple) -> None:
    """Write ``pieces`` to ``path`` under a temporary name, ``fsync``, rename: never seen half-written."""
    temp = f"{path}.tmp-{os.getpid()}-{threading.get_ident()}"
    fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
    try:
        for piece in pieces:
            view = memoryview(piece)
            while view:
                view = view[os.write(fd, view) :]
        os.fsync(fd)
    except BaseException:
        os.close(fd)
        os.unlink(temp)
        raise
    os.close(fd)
    os.rename(temp, path)


class DiskTier:
    """Block copies of one dataset under ``directory/key``, within ``budget`` bytes for all of ``directory``."""

    def __init__(self, directory: str | os.PathLike, budget: int, key: str, source: str) -> None:
        self.directory = os.path.abspath(os.fspath(directory))
        self.budget = budget
        self.root = os.path.join(self.directory, key)
        self._blocks_dir = os.path.join(self.root, BLOCKS)
        os.makedirs(self._blocks_dir, exist_ok=True)
        self._forget_older_packs(key, source)
        with open(os.path.join(self.root, SOURCE_FILE), "w", encoding="utf-8") as f:
            f.write(source)
        self._lock = threading.Lock()
        self._present: set[int] = set()
        for name in os.listdir(self._blocks_dir):
            m = _BLOCK_NAME.match(name)
            if m:
                self._present.add(int(m.group(1)))
            else:  # a copy a crash left half-written
                try:
                    os.unlink(os.path.join(self._blocks_dir, name))
                except OSError:
                    pass
        self._used = _tree_bytes(self.directory)
        self._counts = {"copies_written": 0, "bytes_written": 0, "copies_dropped": 0, "write_failures": 0}

    def _forget_older_packs(self, key: str, source: str) -> None:
        for other in os.listdir(self.directory):
            path = os.path.join(self.directory, other)
            if other == key or not os.path.isdir(path):
                continue
            try:
                with open(os.path.join(path, SOURCE_FILE), encoding="utf-8") as f:
                    same = f.read() == source
            except OSError:
                continue
            if same:
                log.info("disk tier: removing %s, an older pack of %s", path, source)
                shutil.rmtree(path, ignore_errors=True)

    def path(self, block: int) -> str:
        return os.path.join(self._blocks_dir, f"{block:08d}.blk")

    def has(self, block: int) -> bool:
        return block in self._present

    def room_for(self, size: int) -> bool:
        with self._lock:
            return self._used + size <= self.budget

    def put_block(self, block: int, header: bytes, data: memoryview) -> bool:
        """Keep a verified block if the budget has room; whether it was kept.  A failed write (a full
        disk) is logged and costs nothing but the copy."""
        size = len(header) + len(data)
        with self._lock:
            if block in self._present or self._used + size > self.budget:
                return False
            self._used += size  # reserved before writing, so concurrent copies cannot overshoot
        try:
            write_atomically(self.path(block), (header, data))
        except OSError as e:
            with self._lock:
                self._used -= size
                self._counts["write_failures"] += 1
            log.warning("disk tier: cannot keep block %d in %s: %s", block, self.root, e.strerror or e)
            return False
        with self._lock:
            self._present.add(block)
            self._counts["copies_written"] += 1
            self._counts["bytes_written"] += size
        return True

    def remove(self, block: int) -> None:
        """Delete a copy that failed a check (the budget it held is freed)."""
        path = self.path(block)
        try:
            size = os.path.getsize(path)
            os.unlink(path)
        except OSError:
            size = 0
        with self._lock:
            self._present.discard(block)
            self._used -= size
            self._counts["copies_dropped"] += 1

    def stats(self) -> dict:
        with self._lock:
            return {
                "directory": self.root,
                "budget": self.budget,
                "used": self._used,
                "blocks": len(self._present),
                **self._counts,
            }
