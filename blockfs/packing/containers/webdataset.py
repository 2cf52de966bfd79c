"""WebDataset shards (a list, a glob or a brace range of tar files) as one pack source.

The packed tree is the union of the shards' member trees, so a sample keeps its key and shows as
``<key>.<ext>`` files; a key holding "/" makes directories.  As in WebDataset, a member's key is its
path up to the first "." of its last component.  A sample's ``.cls`` member (an integer as text) gives
every file of the sample its label, and stays in the tree; samples without one get -1.  Shards may be
compressed; each is read as :class:`~blockfs.packing.containers.tar.TarSource` reads a tar, several at once.
"""

from __future__ import annotations

import glob
import logging
import os
import re
from concurrent.futures import ThreadPoolExecutor

from ...core.index import KIND_DIR, KIND_FILE
from ...errors import SourceError
from ..sources import SourceEntry
from .base import ListedOnce, TreeBuilder
from .tar import TarEntry, TarSource

log = logging.getLogger(__name__)

KEY_RE = re.compile(rb"^((?:.*/|)[^./]+)\.([^/]*)$")  # WebDataset's base_plus_ext
BRACE_RE = re.compile(r"\{([^{}]*)\}")
MAX_CLS_BYTES = 64


def expand_braces(pattern: str) -> list[str]:
    """``shard-{000..002}.tar`` -> three names (zero padding kept); ``{a,b}`` -> two."""
    m = BRACE_RE.search(pattern)
    if m is None:
        return [pattern]
    body = m.group(1)
    numeric = re.fullmatch(r"(\d+)\.\.(\d+)", body)
    if numeric:
        lo, hi = numeric.groups()
        width = len(lo) if lo.startswith("0") else 0
        choices = [str(i).zfill(width) for i in range(int(lo), int(hi) + 1)]
    else:
        choices = body.split(",")
    head, tail = pattern[: m.start()], pattern[m.end() :]
    return [name for choice in choices for name in expand_braces(head + choice + tail)]


def expand_shards(spec: str | os.PathLike) -> list[str]:
    """The shard files a name, a glob or a brace pattern stands for, in sorted order within each glob."""
    spec = os.fspath(spec)
    if os.path.exists(spec):
        return [spec]
    names = []
    for pattern in expand_braces(spec):
        if any(c in pattern for c in "*?["):
            names.extend(sorted(glob.glob(pattern)))
        else:
            names.append(pattern)
    return names


class WebDatasetSource(ListedOnce):
    """Several tar shards, one tree; samples labelled from their ``.cls`` members."""

    forkable = True  # read_into only preads descriptors opened before packing starts

    provides_labels = True

    def __init__(
        self,
        shards: list[str],
        compressions: list[str | None],
        *,
        skip_damaged: bool = False,
        spool_dir: str | None = None,
        workers: int | None = None,
    ) -> None:
        if not shards:
            raise SourceError("no WebDataset shards given")
        self.shards = [
            TarSource(s, c, skip_damaged=skip_damaged, spool_dir=spool_dir, shard=i)
            for i, (s, c) in enumerate(zip(shards, compressions, strict=True))
        ]
        self.description = f"{len(shards)} WebDataset shards ({shards[0]} ...)" if len(shards) > 1 else shards[0]
        self._workers = workers or os.cpu_count() or 1

    def read_into(self, entry: SourceEntry, buf: memoryview, offset: int = 0) -> int:
        assert isinstance(entry, TarEntry)
        return self.shards[entry.shard].read_into(entry, buf, offset)

    def skipped(self) -> list[bytes]:
        return [p for s in self.shards for p in s.skipped()]

    def damaged(self) -> list[str]:
        return [d for s in self.shards for d in s.damaged()]

    def write_metadata(self, dest: str, fsync: bool) -> dict:
        return {
            "kind": "webdataset",
            "shards": [os.path.basename(s.path) for s in self.shards],
            "compression": sorted({s.compression or "none" for s in self.shards}),
            "skipped_damaged": self.damaged(),
        }

    def close(self) -> None:
        for s in self.shards:
            s.close()

    def _load(self) -> list[SourceEntry]:
        # Decompression (zlib, bz2, lzma) and reads release the GIL: list the shards in parallel.
        with ThreadPoolExecutor(max_workers=min(self._workers, len(self.shards))) as pool:
            listings = list(pool.map(lambda s: list(s.entries()), self.shards))
        tree = TreeBuilder(self.description)
        root = listings[0][0]  # a TarSource lists its root first
        tree.set_root(root.mode, root.mtime_ns)
        for shard, entries in zip(self.shards, listings, strict=True):
            _label_samples(shard, entries)
            for e in entries:
                if e.path:
                    if e.kind != KIND_DIR and tree.get(e.path) is not None:
                        raise SourceError(
                            f"{os.fsdecode(e.path)!r} is in more than one shard (again in {shard.path!r}): "
                            "WebDataset keys must be unique across shards"
                        )
                    tree.add(e, unique=True)
        return tree.entries()


def _label_samples(shard: TarSource, entries: list[SourceEntry]) -> None:
    """Give each file the label of its sample's ``.cls`` member (-1 without one)."""
    keys: dict[bytes, list[SourceEntry]] = {}
    labels: dict[bytes, int] = {}
    for e in entries:
        if e.kind != KIND_FILE:
            continue
        m = KEY_RE.match(e.path)
        if m is None:
            e.label = -1
            continue
        key, ext = m.groups()
        keys.setdefault(key, []).append(e)
        if ext.lower() == b"cls":
            labels[key] = _read_cls(shard, e)
    for key, members in keys.items():
        for e in members:
            e.label = labels.get(key, -1)


def _read_cls(shard: TarSource, entry: SourceEntry) -> int:
    buf = bytearray(min(entry.size, MAX_CLS_BYTES))
    n = shard.read_into(entry, memoryview(buf))
    try:
        value = int(bytes(buf[:n]).strip())
    except ValueError:
        value = -2
    if value < -1 or value >= 2**31 or entry.size > MAX_CLS_BYTES:
        log.warning(
            "%s: %s does not hold an integer label; its sample gets label -1", shard.path, os.fsdecode(entry.path)
        )
        return -1
    return value
