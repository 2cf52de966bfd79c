"""Helpers for tests that damage an index or its metadata as a hostile or unlucky writer would."""

from __future__ import annotations

import json
import os
import zlib
from collections.abc import Callable
from pathlib import Path

import numpy as np

from blockfs.core import format as fmt
from blockfs.core.dataset import PackedDataset
from blockfs.core.digest import digest
from blockfs.core.format import INDEX_NAME, crc32
from blockfs.core.index import PackedIndex
from blockfs.core.index_format import DIGEST_ARRAYS, write_arrays

Arrays = dict[str, np.ndarray]


def read_toc(index_file: Path) -> tuple[dict, int]:
    raw = index_file.read_bytes()
    toc_len = int.from_bytes(raw[12:16], "little")
    return json.loads(raw[16 : 16 + toc_len]), toc_len


def rewrite_toc(index_file: Path, mutate: Callable[[dict], object]) -> None:
    """Replace the table of contents by ``mutate(toc)`` (or the toc mutated in place, when it returns None)."""
    toc, toc_len = read_toc(index_file)
    new = mutate(toc)
    text = json.dumps(toc if new is None else new).encode()
    assert len(text) <= toc_len, "the new table of contents must fit in the old one's room"
    raw = bytearray(index_file.read_bytes())
    raw[16 : 16 + toc_len] = text.ljust(toc_len)
    index_file.write_bytes(bytes(raw))


def patch_array(index_file: Path, name: str, transform: Callable[[np.ndarray], object]) -> None:
    """Rewrite one array of an index file in place (as damage or a hostile writer would)."""
    raw = bytearray(index_file.read_bytes())
    toc, _ = read_toc(index_file)
    dtype, offset, count = toc["arrays"][name]
    arr = np.frombuffer(raw, dtype=dtype, count=count, offset=offset).copy()
    transform(arr)
    raw[offset : offset + arr.nbytes] = arr.tobytes()
    index_file.write_bytes(bytes(raw))


def resign(dest: Path) -> None:
    """Record the index's current CRC (and digest, where the metadata has one) in blockfs.json, as a hostile
    writer who knows the format and may write blockfs.json would: what the CRC and the digest no longer
    catch, the checks behind them must.  (Only a pinned name, --expect, stands against such a writer.)"""
    meta_path = dest / "blockfs.json"
    meta = json.loads(meta_path.read_text())
    meta["index"]["crc32"] = crc32((dest / "index.bfi").read_bytes())
    if "blake3" in meta["index"]:
        meta["index"]["blake3"] = digest((dest / "index.bfi").read_bytes()).hex()
    meta_path.write_text(json.dumps(meta))


def edit_metadata(dest: Path, mutate: Callable[[dict], object]) -> None:
    meta_path = dest / "blockfs.json"
    meta = json.loads(meta_path.read_text())
    new = mutate(meta)
    meta_path.write_text(json.dumps(meta if new is None else new))


def index_arrays(dest: str | os.PathLike) -> Arrays:
    """Writable copies of every array of ``dest``'s index."""
    index = PackedIndex(os.path.join(dest, INDEX_NAME))
    try:
        return {name: np.array(arr) for name, arr in index.arrays.items()}
    finally:
        index.close()


def rewrite_index(dest: str | os.PathLike, mutate: Callable[[Arrays], None]) -> None:
    """Apply ``mutate`` to the index's arrays, write them back, and re-sign the metadata's CRC, so that only
    the checks behind the CRC can notice."""
    arrays = index_arrays(dest)
    mutate(arrays)
    with open(os.path.join(dest, INDEX_NAME), "wb") as f:
        write_arrays(f, arrays)
    resign(Path(dest))


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


def strip_digests(dest: Path) -> None:
    """Turn a pack into today's format 1: an index with no digests, blockfs.json with none (as written
    by blockfs before issue 23)."""
    index = dest / fmt.INDEX_NAME
    with PackedDataset(dest) as ds:
        arrays = {k: np.array(v) for k, v in ds.index.arrays.items() if k not in DIGEST_ARRAYS}
    with open(index, "wb") as f:
        write_arrays(f, arrays)
    meta = json.loads((dest / fmt.METADATA_NAME).read_text())
    meta["format_version"] = 1
    meta["index"] = {"file": fmt.INDEX_NAME, "crc32": zlib.crc32(index.read_bytes())}
    (dest / fmt.METADATA_NAME).write_text(json.dumps(meta, indent=2, sort_keys=True) + "\n")
