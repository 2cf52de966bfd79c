"""``CachedBlock``: one block's data section in memory, as :class:`~blockfs.serve.cache.block_cache.BlockCache`
holds it."""

from __future__ import annotations

import mmap

from ...core import format as fmt

__all__ = ["CachedBlock"]


class CachedBlock:
    """One block's data section in memory, with its file table."""

    __slots__ = ("buf", "fd", "offsets", "sizes", "nbytes", "locked")

    def __init__(self, buf: mmap.mmap | bytes | bytearray, fd: int | None, head: fmt.BlockHeader, locked: bool) -> None:
        self.buf = buf
        self.fd = fd  # the sealed memfd behind ``buf``, or None (not shareable)
        self.nbytes = head.data_size
        self.locked = locked
        # memoryviews (ndarray.data) index to Python ints several times faster than numpy arrays do.
        self.offsets = head.offsets.data
        self.sizes = head.sizes.data

    def view(self, slot: int) -> memoryview:
        """One file's bytes without a copy (they stay valid while the view is held)."""
        start = self.offsets[slot]
        return memoryview(self.buf)[start : start + self.sizes[slot]]

    def piece(self, slot: int, offset: int, size: int) -> memoryview:
        """:meth:`read` without a copy: the bytes stay in the block (valid while the view is held), so an
        answer written at once to the kernel is copied once, by the kernel."""
        start, length = self.offsets[slot], self.sizes[slot]
        if size < 0 or offset + size > length:
            size = max(0, length - offset)
        start += offset
        return memoryview(self.buf)[start : start + size]

    def read(self, slot: int, offset: int, size: int) -> bytes:
        start, length = self.offsets[slot], self.sizes[slot]
        if size < 0 or offset + size > length:
            size = max(0, length - offset)
        start += offset
        data = self.buf[start : start + size]
        return data if type(data) is bytes else bytes(data)  # a bytearray's slice (the window's blocks): bytes
