"""A pack source that makes up an ImageNet-shaped tree from a seed: millions of files without a tree on disk.

    blockfs.pack(SyntheticSource(files=10_000_000, dirs=1_000, seed=0), dest)

``dirs`` class directories ``n00000000 ..`` under the root, the files dealt among them in order
(``n00000000/n00000000_00000000.JPEG``, names zero-padded so a directory's names come in byte order, as a
directory walk lists them), each of 512–3,584 bytes drawn from the seed.  A file's bytes are a slice of one
1 MiB random pattern, chosen by its path: cheap to make, the same on every read, different between files.

:func:`write_tree` writes the same tree (same paths, sizes and bytes) as plain files, for the plain-directory
side of ``bench_scale.py``.  A benchmark helper, not a ``blockfs pack`` source: users pack their data.
"""

from __future__ import annotations

import os
import zlib
from collections.abc import Iterator

import numpy as np

from blockfs.core.index import KIND_DIR, KIND_FILE
from blockfs.packing.sources import Source, SourceEntry

MIN_SIZE, MAX_SIZE = 512, 3_584
MTIME_NS = 1_700_000_000 * 10**9
PATTERN_SIZE = 1 << 20


class SyntheticSource(Source):
    """``files`` files in ``dirs`` directories, sizes and bytes from ``seed``."""

    forkable = True  # read_into only slices an immutable pattern

    def __init__(self, files: int, dirs: int, seed: int = 0) -> None:
        if files < 0 or dirs < 1:
            raise ValueError("need files >= 0 and dirs >= 1")
        self.files, self.dirs, self.seed = files, dirs, seed
        self.description = f"synthetic:{files}x{dirs}:seed={seed}"
        self._pattern = (
            np.random.default_rng([seed, 1]).integers(0, 256, PATTERN_SIZE + MAX_SIZE, dtype=np.uint8).tobytes()
        )
        self._view = memoryview(self._pattern)

    def per_dir(self, d: int) -> int:
        """How many files directory ``d`` holds (the remainder goes to the first ones)."""
        base, extra = divmod(self.files, self.dirs)
        return base + (d < extra)

    def path_of(self, g: int) -> bytes:
        """The path of file number ``g`` (in listing order), without listing."""
        base, extra = divmod(self.files, self.dirs)
        if g < extra * (base + 1):
            d, k = divmod(g, base + 1)
        else:
            d, k = divmod(g - extra * (base + 1), base)
            d += extra
        return b"n%08d/n%08d_%08d.JPEG" % (d, d, k)

    def sizes(self, d: int) -> np.ndarray:
        return np.random.default_rng([self.seed, 2, d]).integers(MIN_SIZE, MAX_SIZE + 1, self.per_dir(d))

    def entries(self) -> Iterator[SourceEntry]:
        yield SourceEntry(b"", KIND_DIR, 0o40755, MTIME_NS)
        for d in range(self.dirs):
            name = b"n%08d" % d
            yield SourceEntry(name, KIND_DIR, 0o40755, MTIME_NS)
            for k, size in enumerate(self.sizes(d).tolist()):
                yield SourceEntry(b"%s/%s_%08d.JPEG" % (name, name, k), KIND_FILE, 0o100644, MTIME_NS, size)

    def content(self, path: bytes, size: int) -> memoryview:
        start = zlib.crc32(path) % PATTERN_SIZE
        return self._view[start : start + size]

    def read_into(self, entry: SourceEntry, buf: memoryview, offset: int = 0) -> int:
        data = self.content(entry.path, entry.size)[offset : offset + len(buf)]
        buf[: len(data)] = data
        return len(data)


def write_tree(source: SyntheticSource, root: str) -> int:
    """Write ``source``'s tree as plain files under ``root`` (made); return the number of files."""
    n = 0
    for entry in source.entries():
        path = os.path.join(root, os.fsdecode(entry.path))
        if entry.kind == KIND_DIR:
            os.makedirs(path, exist_ok=True)
            continue
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            os.write(fd, source.content(entry.path, entry.size))
        finally:
            os.close(fd)
        os.utime(path, ns=(MTIME_NS, MTIME_NS))
        n += 1
    return n
