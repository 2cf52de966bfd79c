"""Pack sources for the containers datasets already live in: MXNet RecordIO, tar, WebDataset shards.

:func:`open_source` turns what a user names as SOURCE into a :class:`~blockfs.packing.sources.Source`, choosing
the reader from the file's first bytes (not its name): a directory, a RecordIO file, a tar (plain, gzip,
bzip2 or xz), or — for a list, a glob or a brace range of files — WebDataset shards.

Each is a :class:`~blockfs.packing.sources.Source` subclass (through :class:`.base.ListedOnce`) and
offers the optional features that base class declares: ``forkable`` (they only ``pread`` descriptors
opened before packing), ``provides_labels`` (RecordIO headers, WebDataset ``.cls``), ``damaged()`` (what
``--skip-damaged`` stepped over, each with its byte offset) and ``write_metadata()`` (side files such as
RecordIO's ``labels.json``, and the description ``blockfs.json`` records under ``"source"``).
"""

from __future__ import annotations

import os
from collections.abc import Sequence

from ...errors import SourceError
from ..sources import DirectorySource, Source
from .detect import sniff
from .recordio import RecordIOSource, read_record_labels
from .spool import spool_dir_for
from .tar import TarSource
from .webdataset import WebDatasetSource, expand_shards

__all__ = [
    "RecordIOSource",
    "TarSource",
    "WebDatasetSource",
    "open_source",
    "read_record_labels",
    "spool_dir_for",
]


def open_source(
    spec: str | bytes | os.PathLike | Sequence[str | os.PathLike],
    *,
    follow_symlinks: bool = False,
    skip_damaged: bool = False,
    spool_dir: str | None = None,
    workers: int | None = None,
) -> Source:
    """The source ``spec`` names.

    A path: a directory, a RecordIO ``.rec`` (its ``.idx`` beside it is used when present) or a tar.
    A glob or brace pattern (``shards/train-{000..009}.tar``), or a list of paths: WebDataset shards.
    Compressed tars are spooled, decompressed, into an unnamed file in ``spool_dir`` (default: the
    system temporary directory; ``pack`` passes the directory beside its destination).
    """
    if not isinstance(spec, (str, bytes, os.PathLike)):  # a list of shard paths
        shards = [name for s in spec for name in expand_shards(s)]
        return _webdataset(shards, skip_damaged, spool_dir, workers)
    path = os.fspath(spec)
    if isinstance(path, bytes):
        path = os.fsdecode(path)
    if os.path.isdir(path):
        return DirectorySource(path, follow_symlinks)
    if not os.path.exists(path):
        shards = expand_shards(path)
        if shards == [path]:
            raise SourceError(f"source {path!r} does not exist")
        if not shards:
            raise SourceError(f"source pattern {path!r} matches no files")
        return _webdataset(shards, skip_damaged, spool_dir, workers)
    kind, compression = sniff(path)
    if kind == "recordio":
        return RecordIOSource(path, skip_damaged=skip_damaged)
    return TarSource(path, compression, skip_damaged=skip_damaged, spool_dir=spool_dir)


def _webdataset(shards: list[str], skip_damaged: bool, spool_dir: str | None, workers: int | None) -> Source:
    compressions = []
    for shard in shards:
        if not os.path.exists(shard):
            raise SourceError(f"WebDataset shard {shard!r} does not exist")
        kind, compression = sniff(shard)
        if kind != "tar":
            raise SourceError(f"WebDataset shard {shard!r} is not a tar archive (it is {kind})")
        compressions.append(compression)
    return WebDatasetSource(shards, compressions, skip_damaged=skip_damaged, spool_dir=spool_dir, workers=workers)
