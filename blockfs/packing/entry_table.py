"""The listed entries of a pack as columns: what ``pack`` holds of every entry from the listing to the index.

A :class:`~.sources.SourceEntry` object per entry costs about 350 bytes beyond its path (the object, its
ints, its identity tuple); at ten million files that is gigabytes.  Here an entry costs its path (one
array, :class:`~blockfs.core.pathtable.PathTable`) and a few bytes in NumPy columns; the rare parts
(symlink targets, hard-link keys) are dicts.  The block writers still get a ``SourceEntry`` per file,
made from the columns for the one block they write (:meth:`EntryTable.entry`).

Sources whose entries are subclasses carrying their own fields (a tar member's offset, a RecordIO
record's position) keep their objects (``objects``): they are built by the container in memory anyway.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import numpy as np

from ..core.heap import give_back
from ..core.index import KIND_DIR, KIND_FILE, KIND_SYMLINK
from ..core.pathtable import CHUNK, PathTable, PathTableBuilder
from .sources import SourceEntry

NO_IDENTITY = np.iinfo(np.uint64).max  # st_dev of an entry the source gave no identity


class EntryTable:
    """Every listed entry, the root first: ``paths``, the columns, and the rare parts by position."""

    def __init__(
        self,
        paths: PathTable,
        kind: np.ndarray,
        mode: np.ndarray,
        mtime_ns: np.ndarray,
        size: np.ndarray,
        label: np.ndarray,
        identity: np.ndarray | None,
        link_targets: dict[int, bytes],
        hardlink_keys: dict[int, object],
        objects: list[SourceEntry | None] | None,
    ) -> None:
        self.paths = paths
        self.kind = kind  # u1
        self.mode = mode  # u4
        self.mtime_ns = mtime_ns  # i8
        self.size = size  # u8: a file's bytes, a symlink's target length, 0 for a directory
        self.label = label  # i4
        self.identity = identity  # (n, 2) u8 (st_dev, st_ino), or None when no entry has one
        self.link_targets = link_targets
        self.hardlink_keys = hardlink_keys  # files only
        self.objects = objects  # entries of a subclass, kept; None where a plain one is rebuilt

    def __len__(self) -> int:
        return len(self.paths)

    def entry(self, i: int) -> SourceEntry:
        """Entry ``i`` as the source listed it (the label as assigned since)."""
        label = int(self.label[i])
        kept = self.objects[i] if self.objects is not None else None
        if kept is not None:
            kept.label = label
            return kept
        identity = None
        if self.identity is not None and self.identity[i, 0] != NO_IDENTITY:
            identity = (int(self.identity[i, 0]), int(self.identity[i, 1]))
        kind = int(self.kind[i])
        return SourceEntry(
            self.paths[i],
            kind,
            int(self.mode[i]),
            int(self.mtime_ns[i]),
            int(self.size[i]) if kind == KIND_FILE else 0,
            self.link_targets.get(i, b""),
            self.hardlink_keys.get(i),
            label,
            identity,
        )

    def files(self) -> np.ndarray:
        """Positions of the file entries."""
        return np.flatnonzero(self.kind == KIND_FILE)

    def keep(self, kept: np.ndarray) -> EntryTable:
        """A table of the entries at positions ``kept`` (ascending), in the same order."""
        kept = np.asarray(kept, dtype=np.int64)
        new_pos = (
            {int(old): new for new, old in enumerate(kept.tolist())}
            if (self.link_targets or self.hardlink_keys)
            else {}
        )
        return EntryTable(
            self.paths.take(kept),
            self.kind[kept],
            self.mode[kept],
            self.mtime_ns[kept],
            self.size[kept],
            self.label[kept],
            None if self.identity is None else self.identity[kept],
            {new_pos[i]: t for i, t in self.link_targets.items() if i in new_pos},
            {new_pos[i]: k for i, k in self.hardlink_keys.items() if i in new_pos},
            None if self.objects is None else [self.objects[i] for i in kept.tolist()],
        )


def collect(
    entries: Iterable[SourceEntry], listing: Callable[[int], None] | None = None, step: int = 10_000
) -> EntryTable:
    """Every entry of ``entries`` into columns, the root first (made up if the source does not list one).
    ``listing(n)``: called every ``step`` entries, and with the total last."""
    builder = _Builder()
    for entry in entries:
        if len(builder) == 0 and entry.path != b"":
            builder.add(SourceEntry(b"", KIND_DIR, 0o40755, 0))
        builder.add(entry)
        if listing is not None and len(builder) % step == 0:
            listing(len(builder))
    if len(builder) == 0:
        builder.add(SourceEntry(b"", KIND_DIR, 0o40755, 0))
    if listing is not None:
        listing(len(builder))
    return builder.finish()


_COLUMNS = {"kind": "u1", "mode": "<u4", "mtime_ns": "<i8", "size": "<u8", "label": "<i4"}


class _Builder:
    """Entries appended one at a time; each full chunk becomes arrays, so Python lists stay chunk-sized."""

    def __init__(self) -> None:
        self._paths = PathTableBuilder()
        self._rows: list[tuple[int, int, int, int, int]] = []
        self._identities: list[tuple[int, int]] = []
        self._chunks: dict[str, list[np.ndarray]] = {name: [] for name in _COLUMNS}
        self._identity_chunks: list[np.ndarray | None] = []
        self._links: dict[int, bytes] = {}
        self._keys: dict[int, object] = {}
        self._objects: list[SourceEntry | None] | None = None  # from the first subclass entry on
        self._n = 0

    def __len__(self) -> int:
        return self._n

    def add(self, e: SourceEntry) -> None:
        i = self._n
        self._paths.add(e.path)
        size = e.size if e.kind == KIND_FILE else len(e.link_target)
        self._rows.append((e.kind, e.mode, e.mtime_ns, size, e.label if e.kind == KIND_FILE else -1))
        self._identities.append(e.identity if e.identity is not None else _NONE)
        if e.kind == KIND_SYMLINK:
            self._links[i] = e.link_target
        elif e.kind == KIND_FILE and e.hardlink_key is not None:
            self._keys[i] = e.hardlink_key
        if type(e) is not SourceEntry:  # a subclass with fields of its own: kept as it is
            if self._objects is None:
                self._objects = [None] * i
            self._objects.append(e)
        elif self._objects is not None:
            self._objects.append(None)  # rebuilt from the columns when needed
        self._n += 1
        if len(self._rows) >= CHUNK:
            self._flush()

    def _flush(self) -> None:
        if not self._rows:
            return
        for name, values in zip(_COLUMNS, zip(*self._rows, strict=True), strict=True):
            self._chunks[name].append(np.array(values, dtype=_COLUMNS[name]))
        self._rows = []
        identity = np.array(self._identities, dtype=np.uint64)
        self._identity_chunks.append(None if np.all(identity[:, 0] == NO_IDENTITY) else identity)
        self._identities = []

    def finish(self) -> EntryTable:
        self._flush()
        columns = {}
        for name, dtype in _COLUMNS.items():  # one column at a time, its chunks freed as it is joined
            chunks = self._chunks.pop(name)
            columns[name] = np.concatenate(chunks) if chunks else np.zeros(0, dtype=dtype)
            del chunks
            give_back()
        identity = None
        if any(c is not None for c in self._identity_chunks):
            lengths = [len(c) for c in self._chunks_lengths()]
            identity = np.concatenate(
                [
                    c if c is not None else np.full((n, 2), NO_IDENTITY, dtype=np.uint64)
                    for c, n in zip(self._identity_chunks, lengths, strict=True)
                ]
            )
        self._identity_chunks = []
        return EntryTable(
            self._paths.finish(),
            columns["kind"],
            columns["mode"],
            columns["mtime_ns"],
            columns["size"],
            columns["label"],
            identity,
            self._links,
            self._keys,
            self._objects,
        )

    def _chunks_lengths(self) -> list[range]:
        """The entries of each chunk (every chunk is full but the last)."""
        return [range(start, min(self._n, start + CHUNK)) for start in range(0, self._n, CHUNK)]


_NONE = (int(NO_IDENTITY), 0)
