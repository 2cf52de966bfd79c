"""The storage tiers under the memory tier, as one chain: local disk → the peer that owns the block → the store.

Every tier has one shape (:class:`Tier`): a block's bytes out (``pread``, ``read_into``), what it holds
(``holds``), what it admits (``admits``) and a block's bytes in (``put``).  :class:`TierChain` composes
them, and it is the one place that decides:

* **where a read goes**: the first tier that holds the block, then the next, then the store.  A tier that
  fails a read (a copy gone, a peer slow or gone) is told (:meth:`Tier.failed`) and the next one asked; only
  the store's own failure reaches the caller.
* **what is copied where** (the copy policy): a block the verifier has checked whole is offered here
  (:meth:`TierChain.offer`) and kept by every tier that admits it — except, when the disk tier is smaller
  than the dataset, blocks memory holds for good (the two tiers together then hold more than either);
  a file read of a block a tier wants is fetched whole first (:meth:`TierChain.wants_whole`).
* **which tier a failed check blames**: the one that served the block last (:meth:`TierChain.drop_copy`).

Nothing here checks a byte: :class:`~blockfs.core.store.BlockStore` verifies whatever the chain returns,
wherever it came from, and calls :meth:`drop_copy` when a check fails.

The whole read path, top to bottom (memory is the mount's, above the verifier)::

    memory (serve/cache: block cache, retained files)
      -> BlockStore (verifies every byte)
         -> TierChain: disk tier (DiskCopies) -> peers (PeerTier) -> the store (local files or ranged GETs)
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Hashable

from .blockfiles import BlockFiles


class Tier:
    """One storage tier: holds some blocks, serves their bytes, maybe admits copies.

    ``pread``/``read_into`` raise ``OSError`` when the tier cannot serve (then the chain asks the next
    tier); the chain only asks for a block the tier :meth:`holds` and for a range inside the block."""

    name = "tier"
    keeps_copies = False  # whether put() keeps anything (the disk tier)

    def holds(self, block: int) -> bool:
        raise NotImplementedError

    def pread(self, block: int, size: int, offset: int) -> bytes:
        raise NotImplementedError

    def read_into(self, block: int, view: memoryview, offset: int) -> None:
        raise NotImplementedError

    def admits(self, block: int, size: int) -> bool:
        """Whether :meth:`put` would keep ``block`` (``size`` bytes) now."""
        return False

    def put(self, block: int, header: bytes, data: memoryview) -> None:
        """Keep a block the verifier checked whole."""

    def failed(self, block: int, error: OSError) -> None:
        """A read of ``block`` from this tier failed: what it holds of it is not to be asked for again soon."""

    def drop(self, block: int) -> bool:
        """What this tier served of ``block`` failed a check: forget it; whether there was anything to drop."""
        return False

    def discard(self, block: int) -> None:
        """Forget any per-read state of ``block`` (a descriptor, bytes kept from a fetch)."""

    def stats(self) -> dict:
        return {}

    def close(self) -> None:
        """Release descriptors; idempotent, and a later read opens what it needs again."""


class TierChain(BlockFiles):
    """``tiers`` (in order) in front of ``store`` (where the dataset lives), as one :class:`BlockFiles`."""

    def __init__(self, tiers: list[Tier], store: BlockFiles, *, copies_memory_blocks: bool = True) -> None:
        self.tiers = tiers
        self.store = store
        self.names = store.names
        self.reads_in_pieces = store.reads_in_pieces
        self.keeps_copies = any(t.keeps_copies for t in tiers)
        self.copies_memory_blocks = copies_memory_blocks
        self._lock = threading.Lock()
        self._served: dict[int, Tier] = {}  # the tier that last served each block (not the store)
        self._refused: set[int] = set()  # damaged blocks: never fetched whole for a copy
        self._store_counts = {"reads": 0, "bytes": 0}  # what the store served (stats: what the tiers did not)

    # --- reads: the first tier that holds the block, then the next, then the store --------------------
    def _read(self, block: int, size: int, offset: int, read: Callable[[BlockFiles | Tier], object]) -> object:
        self._check(block, offset, size)
        if offset + size <= self.store.size(block):  # a range past the end is the store's to refuse
            for tier in self.tiers:
                if not tier.holds(block):
                    continue
                try:
                    out = read(tier)
                except OSError as e:
                    tier.failed(block, e)
                    continue
                with self._lock:
                    self._served[block] = tier
                return out
        with self._lock:
            self._served.pop(block, None)
        out = read(self.store)
        with self._lock:
            self._store_counts["reads"] += 1
            self._store_counts["bytes"] += size
        return out

    def pread(self, block: int, size: int, offset: int) -> bytes:
        return self._read(block, size, offset, lambda t: t.pread(block, size, offset))  # type: ignore[return-value]

    def read_into(self, block: int, view: memoryview, offset: int) -> None:
        self._read(block, len(view), offset, lambda t: t.read_into(block, view, offset))

    def size(self, block: int) -> int:
        return self.store.size(block)

    def version(self, block: int) -> Hashable | None:
        return self.store.version(block)  # a tier's copy that fails a check is dropped: the store's block decides

    def discard(self, block: int) -> None:
        for tier in self.tiers:
            tier.discard(block)
        self.store.discard(block)

    # --- the copy policy ------------------------------------------------------------------------------
    def wants_copy(self, block: int) -> bool:
        if block in self._refused:
            return False
        size = self.store.size(block)
        return any(t.admits(block, size) for t in self.tiers)

    def wants_whole(self, block: int) -> bool:
        """Whether a file read of ``block`` should fetch the block whole first (a tier would keep it)."""
        return self.keeps_copies and self.wants_copy(block)

    def offer(self, block: int, header: Callable[[], bytes | None], data: memoryview, *, held_in_memory: bool) -> None:
        """A block verified whole (``header()``: its header as stored, checked again; None when that
        fetch failed): kept by the tiers that admit it.  ``held_in_memory``: memory keeps it for good."""
        if (held_in_memory and not self.copies_memory_blocks) or not self.wants_copy(block):
            return
        raw = header()
        if raw is not None:
            self.keep_copy(block, raw, data)

    def keep_copy(self, block: int, header: bytes, data: memoryview) -> None:
        size = len(header) + len(data)
        for tier in self.tiers:
            if tier.admits(block, size):
                tier.put(block, header, data)

    def drop_copy(self, block: int) -> bool:
        """What a tier served of ``block`` failed a check: that tier (the last to serve it, else one that
        keeps a copy) forgets it; whether one did (then the block is read again, from further down)."""
        with self._lock:
            tier = self._served.pop(block, None)
        if tier is not None and tier.drop(block):
            return True
        return any(t.drop(block) for t in self.tiers if t.keeps_copies and t.holds(block))

    def refuse_copy(self, block: int) -> None:
        with self._lock:
            self._refused.add(block)

    def allow_copy(self, block: int) -> None:
        with self._lock:
            self._refused.discard(block)

    def tier(self, name: str) -> Tier | None:
        """The tier called ``name`` ("disk", "peers"), or None."""
        return next((t for t in self.tiers if t.name == name), None)

    def stats(self) -> dict:
        """The store's counters and each tier's section; the disk tier's also says what reached the store."""
        out = dict(self.store.stats())
        for tier in self.tiers:
            out.update(tier.stats())
        if "disk_tier" in out:
            with self._lock:
                out["disk_tier"] = {
                    **out["disk_tier"],
                    "remote_reads": self._store_counts["reads"],
                    "remote_bytes": self._store_counts["bytes"],
                }
        return out

    def close(self) -> None:
        for tier in self.tiers:
            tier.close()
        self.store.close()


def compose(
    store: BlockFiles, *, disk: Tier | None = None, peers: Tier | None = None, copies_memory_blocks: bool = True
) -> BlockFiles:
    """The one composition of the tiers under memory, top to bottom: the local disk, then the peer that owns
    the block, then ``store`` (where the dataset lives).  With neither tier, the store alone."""
    tiers = [t for t in (disk, peers) if t is not None]
    return TierChain(tiers, store, copies_memory_blocks=copies_memory_blocks) if tiers else store
