"""``RemoteBlockFiles``: block files read from an object store with ranged GETs.

Sizes come from the index (``block_sizes``), so opening and reading never send a HEAD and a mount never
lists the bucket.  A block's first bytes are fetched once as a *head* of :data:`HEAD_BYTES` and kept for
the last :data:`HEADS_KEPT` blocks: the store reads a header in two steps (preamble, then the whole header)
and, for the disk tier, once more as stored — one GET instead of three, however many readers ask for it at
once.  A whole data section read after its header takes the part of it the head holds from there, so a
block read whole costs its size from the store, not its size and a head more.
"""

from __future__ import annotations

from collections.abc import Hashable

from .blockfiles import BlockFiles
from .kept_pieces import KeptPieces
from .remote import RemoteError, RemoteStore

HEAD_BYTES = 64 << 10  # a header of 12 bytes per file: 64 KiB covers ~5,000 files
HEADS_KEPT = 256  # 16 MiB at most


class RemoteBlockFiles(BlockFiles):
    """Block ``b`` is the object ``object_names[b]`` under ``remote``'s prefix, ``sizes[b]`` bytes long."""

    def __init__(self, remote: RemoteStore, object_names: list[str], sizes: list[int]) -> None:
        self.remote = remote
        self._objects = object_names
        self._sizes = sizes
        self.names = [remote.where(name) for name in object_names]
        self._heads = KeptPieces(HEADS_KEPT)

    def size(self, block: int) -> int:
        self._check(block)
        return self._sizes[block]

    def _get(self, block: int, start: int, length: int) -> memoryview:
        try:
            return self.remote.get_range(self._objects[block], start, length)
        except RemoteError as e:
            raise self._phrased(block, e) from None

    def _phrased(self, block: int, e: RemoteError) -> OSError:
        """The remote's error without the object's URL, which the store's message already names."""
        text, prefix = str(e), self.names[block] + ": "
        return OSError(e.errno, text.removeprefix(prefix))

    def _head(self, block: int) -> memoryview:
        return self._heads.get(block, lambda: self._get(block, 0, min(HEAD_BYTES, self._sizes[block])))

    def pread(self, block: int, size: int, offset: int) -> bytes:
        self._check(block, offset, size)
        if offset + size <= min(HEAD_BYTES, self._sizes[block]):
            return bytes(self._head(block)[offset : offset + size])
        return bytes(self._get(block, offset, size))

    def read_into(self, block: int, view: memoryview, offset: int) -> None:
        self._check(block, offset)
        done = 0
        if offset + len(view) <= self._sizes[block]:  # (a read past the end is the remote's to refuse)
            head = self._heads.peek(block)
            if head is not None and offset < len(head):  # the head holds its start: not fetched twice
                done = min(len(view), len(head) - offset)
                view[:done] = head[offset : offset + done]
        if done == len(view) and done:
            return
        try:
            self.remote.get_into(self._objects[block], offset + done, view[done:])
        except RemoteError as e:
            raise self._phrased(block, e) from None

    def discard(self, block: int) -> None:
        self._heads.drop(block)

    def version(self, block: int) -> Hashable | None:
        """The object's ETag and size (one HEAD); None when the store does not answer."""
        self._check(block)
        try:
            return self.remote.version(self._objects[block])
        except RemoteError:
            return None

    def stats(self) -> dict:
        return {"remote": self.remote.counters.snapshot()}

    def close(self) -> None:
        self.remote.close()
