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
* **Nothing outside DIR is touched.**  ``DIR`` and each key directory must be this user's alone
  (:mod:`blockfs.storage.owned`: not a link, owned by the effective user, writable by no one else); every
  file is opened relative to a directory descriptor with ``O_NOFOLLOW``, and only names the tier makes
  (block copies, its temporary files, its metadata files) are ever deleted.
* **A full disk stops copying** (the budget shrinks to what the tier holds), said once, naming ``DIR``.

The budget is counted per process: two mounts sharing one ``DIR`` may together exceed it.
"""

from __future__ import annotations

import errno
import logging
import os
import re
import stat
import threading

from .owned import (
    is_temp_name,
    open_owned_dir,
    open_owned_subdir,
    read_file_at,
    read_regular_at,
    write_file_at,
)

log = logging.getLogger(__name__)

BLOCKS = "blocks"
SOURCE_FILE = "source"  # the redacted URL this key's dataset came from
_BLOCK_NAME = re.compile(r"^(\d{8})\.blk$")
_KEY_NAME = re.compile(r"^[0-9a-f]{20}$")
WHAT = "--disk-cache directory"
FIX = "choose another --disk-cache DIR"
_OPEN_COPY = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC  # NONBLOCK: a FIFO cannot hang an open


def _tree_bytes(dir_fd: int) -> int:
    """Bytes of the regular files under ``dir_fd``, links never followed."""
    total = 0
    for _root, _dirs, files, root_fd in os.fwalk(".", dir_fd=dir_fd, follow_symlinks=False):
        for name in files:
            try:
                st = os.stat(name, dir_fd=root_fd, follow_symlinks=False)
            except OSError:
                continue
            if stat.S_ISREG(st.st_mode):
                total += st.st_size
    return total


def _remove_ours(dir_fd: int, keep=lambda name: False) -> bool:
    """Delete, in ``dir_fd``, the block copies and temporary files the tier made; whether it is now empty.
    An entry of another kind (a link, a directory) is left where it is: it is not the tier's."""
    empty = True
    for name in os.listdir(dir_fd):
        if keep(name):
            empty = False
            continue
        if _BLOCK_NAME.match(name) or is_temp_name(name):
            try:
                os.unlink(name, dir_fd=dir_fd)
                continue
            except OSError:
                pass
        empty = False
    return empty


class DiskTier:
    """Block copies of one dataset under ``directory/key``, within ``budget`` bytes for all of ``directory``."""

    def __init__(self, directory: str | os.PathLike, budget: int, key: str, source: str) -> None:
        self.directory = os.path.abspath(os.fspath(directory))
        self.budget = budget
        self.root = os.path.join(self.directory, key)
        self._blocks_path = os.path.join(self.root, BLOCKS)
        self._lock = threading.Lock()
        self._present: set[int] = set()
        self._counts = {"copies_written": 0, "bytes_written": 0, "copies_dropped": 0, "write_failures": 0}
        self._failures_said: set[int | None] = set()  # each kind of failed write is logged once
        self._dir_fd = self._root_fd = self._blocks_fd = -1
        try:
            self._dir_fd = open_owned_dir(self.directory, WHAT, FIX)
            self._root_fd = open_owned_subdir(self._dir_fd, key, self.root, WHAT, f"remove it, or {FIX}")
            self._blocks_fd = open_owned_subdir(self._root_fd, BLOCKS, self._blocks_path, WHAT, f"remove it, or {FIX}")
            self._forget_older_packs(key, source)
            self.keep(SOURCE_FILE, source.encode())
            for name in os.listdir(self._blocks_fd):
                m = _BLOCK_NAME.match(name)
                if m:
                    self._present.add(int(m.group(1)))
            _remove_ours(self._blocks_fd, keep=lambda name: bool(_BLOCK_NAME.match(name)))  # crashed writes
            _remove_ours(self._root_fd, keep=lambda name: not is_temp_name(name))
            self._used = _tree_bytes(self._dir_fd)
        except BaseException:
            self.close()
            raise

    def _forget_older_packs(self, key: str, source: str) -> None:
        for other in os.listdir(self._dir_fd):
            if other == key or not _KEY_NAME.match(other):
                continue
            try:
                fd = os.open(other, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=self._dir_fd)
            except OSError:
                continue  # not a directory (a link is never followed)
            try:
                st = os.fstat(fd)
                if st.st_uid != os.geteuid():
                    continue
                try:
                    same = read_file_at(fd, SOURCE_FILE).decode("utf-8", "replace") == source
                except OSError:
                    continue
                if same:
                    log.info("disk tier: removing %s, an older pack of %s", os.path.join(self.directory, other), source)
                    self._remove_pack(fd, other)
            finally:
                os.close(fd)

    def _remove_pack(self, fd: int, name: str) -> None:
        """Delete an older key directory: its copies and the files the tier wrote there, then itself."""
        try:
            blocks = os.open(BLOCKS, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=fd)
        except OSError:
            blocks = None
        if blocks is not None:
            try:
                if _remove_ours(blocks):
                    os.rmdir(BLOCKS, dir_fd=fd)
            except OSError:
                pass
            finally:
                os.close(blocks)
        for entry in os.listdir(fd):
            try:
                if stat.S_ISREG(os.stat(entry, dir_fd=fd, follow_symlinks=False).st_mode):
                    os.unlink(entry, dir_fd=fd)  # the metadata, index and side files the tier fetched
            except OSError:
                pass
        try:
            os.rmdir(name, dir_fd=self._dir_fd)
        except OSError as e:
            log.info("disk tier: left %s in place (%s)", os.path.join(self.directory, name), e.strerror or e)

    # --- the dataset's own files in the key directory (metadata, index) -------------------------------
    def keep(self, name: str, data: bytes) -> None:
        """Write ``name`` (a plain name) into the key directory, atomically, never through a link."""
        try:
            write_file_at(self._root_fd, name, (data,), mode=0o644)
        except OSError as e:
            raise self._phrased(e, os.path.join(self.root, name)) from None

    def read_file(self, name: str) -> bytes | None:
        """The key directory's regular file ``name`` (never through a link); None when there is none."""
        return read_regular_at(self._root_fd, name)

    @staticmethod
    def _phrased(e: OSError, path: str) -> OSError:
        if e.errno in (errno.ENOSPC, errno.EDQUOT):
            return OSError(e.errno, f"{path}: {e.strerror}: free space there, or point --disk-cache elsewhere")
        return OSError(e.errno, f"{path}: {e.strerror or e}")

    # --- block copies ---------------------------------------------------------------------------------
    def path(self, block: int) -> str:
        return os.path.join(self._blocks_path, self.name(block))

    @staticmethod
    def name(block: int) -> str:
        return f"{block:08d}.blk"

    def open_copy(self, block: int) -> int:
        """A read descriptor of the block's copy: a regular file in the tier's own directory, never a link."""
        fd = os.open(self.name(block), _OPEN_COPY, dir_fd=self._blocks_fd)
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            os.close(fd)
            raise OSError(errno.EINVAL, "not a regular file")
        return fd

    def has(self, block: int) -> bool:
        return block in self._present

    def room_for(self, size: int) -> bool:
        with self._lock:
            return self._used + size <= self.budget

    def put_block(self, block: int, header: bytes, data: memoryview) -> bool:
        """Keep a verified block if the budget has room; whether it was kept.  A failed write costs nothing
        but the copy; a full disk shrinks the budget to what the tier holds, so copying stops (said once)."""
        size = len(header) + len(data)
        with self._lock:
            if block in self._present or self._used + size > self.budget:
                return False
            self._used += size  # reserved before writing, so concurrent copies cannot overshoot
        try:
            write_file_at(self._blocks_fd, self.name(block), (header, data))
        except OSError as e:
            full = e.errno in (errno.ENOSPC, errno.EDQUOT)
            with self._lock:
                self._used -= size
                self._counts["write_failures"] += 1
                if full:  # what fits is what the tier holds now: no copy more, and no line more
                    self.budget = min(self.budget, self._used)
                first = e.errno not in self._failures_said
                self._failures_said.add(e.errno)
            if full and first:
                log.warning(
                    "disk tier: %s is full (%s): keeping the %d bytes it holds and copying no more; free "
                    "space there or lower --disk-cache-size",
                    self.directory,
                    e.strerror,
                    self._used,
                )
            elif first:
                log.warning("disk tier: cannot keep block %d in %s: %s (said once)", block, self.root, e.strerror or e)
            return False
        with self._lock:
            self._present.add(block)
            self._counts["copies_written"] += 1
            self._counts["bytes_written"] += size
        return True

    def remove(self, block: int) -> None:
        """Delete a copy that failed a check (the budget it held is freed)."""
        name = self.name(block)
        try:
            st = os.stat(name, dir_fd=self._blocks_fd, follow_symlinks=False)
            os.unlink(name, dir_fd=self._blocks_fd)
            size = st.st_size if stat.S_ISREG(st.st_mode) else 0
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

    def close(self) -> None:
        for attr in ("_blocks_fd", "_root_fd", "_dir_fd"):
            fd = getattr(self, attr)
            if fd >= 0:
                os.close(fd)
                setattr(self, attr, -1)
