"""``TieredBlockFiles``: a remote dataset's blocks read from the local-disk tier when it holds them, from the
remote otherwise; blocks the store has verified whole are offered to the tier.

The memory tier sits above this one (the mount's block cache and retained files), so a read reaches
here only when memory does not hold its bytes: memory → local disk → remote.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Hashable

from .blockfiles import BlockFiles, LocalBlockFiles
from .disk_tier import DiskTier
from .remote_blocks import RemoteBlockFiles

log = logging.getLogger(__name__)


class TieredBlockFiles(BlockFiles):
    keeps_copies = True

    def __init__(self, remote: RemoteBlockFiles, tier: DiskTier) -> None:
        self.remote = remote
        self.tier = tier
        self.names = remote.names
        self._local = LocalBlockFiles([tier.path(b) for b in range(len(remote.names))], tier.open_copy)
        self._lock = threading.Lock()
        self._refused: set[int] = set()  # damaged blocks: fetched file by file, never whole for a copy
        self._counts = {"disk_reads": 0, "disk_bytes": 0, "remote_reads": 0, "remote_bytes": 0}
        # A tier that holds the whole dataset copies every block, so a remount reads nothing remote.  A
        # smaller one leaves out blocks memory holds for good: their copies would never be read in this
        # mount, and the two tiers together would hold no more than the larger alone.
        self.copies_memory_blocks = tier.budget >= sum(remote.size(b) for b in range(len(remote.names)))

    def _count(self, where: str, n: int) -> None:
        with self._lock:
            self._counts[f"{where}_reads"] += 1
            self._counts[f"{where}_bytes"] += n

    def size(self, block: int) -> int:
        return self.remote.size(block)

    def _on_disk(self, block: int, size: int, offset: int, read):
        """``read(files)`` from the disk copy if there is one and it reads; else None.  A copy that cannot
        be read (deleted under us, an I/O error) is forgotten: the remote still has the block.  A range past
        the block's end is left to the remote to refuse (EIO): the copy is not to blame for it."""
        self._check(block, offset, size)
        if not self.tier.has(block) or offset + size > self.remote.size(block):
            return None
        try:
            return read(self._local)
        except OSError as e:
            log.warning("disk tier: %s unreadable (%s): reading block %d from the remote", self.tier.path(block),
                        e.strerror or e, block)  # fmt: skip
            self._local.discard(block)
            self.tier.remove(block)
            return None

    def pread(self, block: int, size: int, offset: int) -> bytes:
        data = self._on_disk(block, size, offset, lambda files: files.pread(block, size, offset))
        if data is not None:
            self._count("disk", size)
            return data
        data = self.remote.pread(block, size, offset)
        self._count("remote", size)
        return data

    def read_into(self, block: int, view: memoryview, offset: int) -> None:
        if self._on_disk(block, len(view), offset, lambda files: files.read_into(block, view, offset) or True):
            self._count("disk", len(view))
            return
        self.remote.read_into(block, view, offset)
        self._count("remote", len(view))

    def discard(self, block: int) -> None:
        self._local.discard(block)
        self.remote.discard(block)

    def version(self, block: int) -> Hashable | None:
        return self.remote.version(block)  # a copy that fails a check is deleted: the remote's block decides

    def wants_copy(self, block: int) -> bool:
        return block not in self._refused and not self.tier.has(block) and self.tier.room_for(self.remote.size(block))

    def refuse_copy(self, block: int) -> None:
        with self._lock:
            self._refused.add(block)

    def allow_copy(self, block: int) -> None:
        with self._lock:
            self._refused.discard(block)

    def keep_copy(self, block: int, header: bytes, data: memoryview) -> None:
        self.tier.put_block(block, header, data)

    def drop_copy(self, block: int) -> bool:
        if not self.tier.has(block):
            return False
        log.warning("disk tier: the copy of block %d failed its check: deleted, reading the remote's", block)
        self._local.discard(block)
        self.tier.remove(block)
        return True

    def stats(self) -> dict:
        with self._lock:
            reads = dict(self._counts)
        return {**self.remote.stats(), "disk_tier": {**self.tier.stats(), **reads}}

    def close(self) -> None:
        self._local.close()
        self.remote.close()
