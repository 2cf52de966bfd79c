"""``DiskCopies``: the local-disk tier as a :class:`~blockfs.storage.chain.Tier` — a remote dataset's blocks
kept on a local disk (:class:`~blockfs.storage.disk_tier.DiskTier`), read with ``pread``.

:func:`TieredBlockFiles` is the chain of this tier alone in front of the remote (no peers).  When to copy a
block here is the chain's to decide (:mod:`blockfs.storage.chain`); this tier says what it holds and admits.
"""

from __future__ import annotations

import logging
import threading

from .blockfiles import BlockFiles, LocalBlockFiles
from .chain import Tier, TierChain, compose
from .disk_tier import DiskTier

log = logging.getLogger(__name__)


class DiskCopies(Tier):
    name = "disk"
    keeps_copies = True

    def __init__(self, tier: DiskTier, n_blocks: int) -> None:
        self.tier = tier
        self._local = LocalBlockFiles([tier.path(b) for b in range(n_blocks)], tier.open_copy)
        self._lock = threading.Lock()
        self._counts = {"disk_reads": 0, "disk_bytes": 0}

    def _count(self, n: int) -> None:
        with self._lock:
            self._counts["disk_reads"] += 1
            self._counts["disk_bytes"] += n

    def holds(self, block: int) -> bool:
        return self.tier.has(block)

    def pread(self, block: int, size: int, offset: int) -> bytes:
        data = self._local.pread(block, size, offset)
        self._count(size)
        return data

    def read_into(self, block: int, view: memoryview, offset: int) -> None:
        self._local.read_into(block, view, offset)
        self._count(len(view))

    def admits(self, block: int, size: int) -> bool:
        return not self.tier.has(block) and self.tier.room_for(size)

    def put(self, block: int, header: bytes, data: memoryview) -> None:
        self.tier.put_block(block, header, data)

    def failed(self, block: int, error: OSError) -> None:
        """A copy that cannot be read (deleted under us, an I/O error) is forgotten: the remote has the block."""
        log.warning(
            "disk tier: %s unreadable (%s): reading block %d from further down",
            self.tier.path(block),
            error.strerror or error,
            block,
        )
        self._local.discard(block)
        self.tier.remove(block)

    def drop(self, block: int) -> bool:
        if not self.tier.has(block):
            return False
        log.warning("disk tier: the copy of block %d failed its check: deleted, reading it from further down", block)
        self._local.discard(block)
        self.tier.remove(block)
        return True

    def discard(self, block: int) -> None:
        self._local.discard(block)

    def stats(self) -> dict:
        with self._lock:
            reads = dict(self._counts)
        return {"disk_tier": {**self.tier.stats(), **reads}}

    def close(self) -> None:
        self._local.close()


def copies_memory_blocks(tier: DiskTier, remote: BlockFiles) -> bool:
    """The copy policy's one choice: a disk tier that holds the whole dataset copies every block, so a
    remount reads nothing remote; a smaller one leaves out blocks memory holds for good (their copies would
    never be read in this mount, and the two tiers together would hold no more than the larger alone)."""
    return tier.budget >= sum(remote.size(b) for b in range(len(remote.names)))


def TieredBlockFiles(remote: BlockFiles, tier: DiskTier) -> TierChain:  # noqa: N802 - the chain's old name
    """The disk tier in front of ``remote``, without peers (the tests' and tools' spelling of :func:`compose`)."""
    chain = compose(
        remote, disk=DiskCopies(tier, len(remote.names)), copies_memory_blocks=copies_memory_blocks(tier, remote)
    )
    assert isinstance(chain, TierChain)
    return chain
