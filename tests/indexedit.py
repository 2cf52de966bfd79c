"""Forge a packed dataset's index the way a hostile or unlucky user would: change its arrays, rewrite the
file, and update the index CRC in ``blockfs.json`` so that only the tree checks can notice."""

from __future__ import annotations

import json
import os
from typing import Callable

import numpy as np

from blockfs.core import format as fmt
from blockfs.core.format import INDEX_NAME, METADATA_NAME
from blockfs.core.index import PackedIndex, _write_arrays

Arrays = dict[str, np.ndarray]


def index_arrays(dest: str | os.PathLike) -> Arrays:
    """Writable copies of every array of ``dest``'s index."""
    index = PackedIndex(os.path.join(dest, INDEX_NAME))
    try:
        return {name: np.array(arr) for name, arr in index.arrays.items()}
    finally:
        index.close()


def rewrite_index(dest: str | os.PathLike, mutate: Callable[[Arrays], None]) -> None:
    """Apply ``mutate`` to the index's arrays, write them back, and make the metadata's CRC match."""
    arrays = index_arrays(dest)
    mutate(arrays)
    path = os.path.join(dest, INDEX_NAME)
    _write_arrays(path, arrays)
    with open(path, "rb") as f:
        crc = fmt.crc32(f.read())
    meta_path = os.path.join(dest, METADATA_NAME)
    with open(meta_path, encoding="utf-8") as f:
        meta = json.load(f)
    meta["index"]["crc32"] = crc
    with open(meta_path, "w", encoding="utf-8") as f:
        json.dump(meta, f)


def entry_of(arrays: Arrays, path: bytes) -> int:
    """The entry id of ``path`` (by scanning the path table: the forged index's hash table may lie)."""
    off = arrays["path_offsets"]
    for e in range(arrays["kind"].size):
        if arrays["paths"][int(off[e]) : int(off[e + 1]) - 1].tobytes() == path:
            return e
    raise KeyError(path)


def rename_entry(arrays: Arrays, path: bytes, new_path: bytes) -> None:
    """Give entry ``path`` another path of the same length, in place in the path table."""
    assert len(new_path) == len(path)
    start = int(arrays["path_offsets"][entry_of(arrays, path)])
    arrays["paths"][start : start + len(path)] = np.frombuffer(new_path, dtype=np.uint8)
