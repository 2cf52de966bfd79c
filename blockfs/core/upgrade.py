"""``blockfs upgrade``: add the chain of digests to a dataset packed before them, without rewriting a block.

Every block is read once and checked as today (its header against the index, its data by CRC-32: the
digests bless only what the accident checks pass), then hashed: its header, its data section, each file.
The index is rewritten with the digests (version 2) and ``blockfs.json`` with the index's digest
(format 2), each atomically.  Two renames cannot be one, so the old index is first kept under
:data:`BACKUP_NAME`; an upgrade cut between them leaves that copy, which the next ``blockfs upgrade``
puts back (the old ``blockfs.json`` still names it) before starting again.
"""

from __future__ import annotations

import os

import numpy as np

from . import digest as dg
from . import format as fmt
from .dataset import PackedDataset
from .index_format import write_arrays
from .metadata import METADATA_VERSION, has_digests, metadata_bytes, read_metadata_bytes
from ..errors import FormatError
from ..storage.owned import DIR_FLAGS, write_file_at
from ..storage.location import is_remote

BACKUP_NAME = fmt.INDEX_NAME + ".before-upgrade"


def upgrade(location: str | os.PathLike) -> tuple[str, bool]:
    """Add digests to the dataset at ``location`` (a directory); return (its name, whether it changed)."""
    root = os.fspath(location)
    if is_remote(root):
        raise FormatError(
            f"{root}: upgrade works on a local directory: copy the dataset, 'blockfs upgrade' it, and upload "
            "index.bfi and then blockfs.json (or pack it again to the URL)"
        )
    _finish_interrupted(root)
    meta, raw = read_metadata_bytes(root)
    if has_digests(meta):
        return dg.name_of(raw), False
    with PackedDataset(root) as ds:
        arrays = {name: np.array(arr) for name, arr in ds.index.arrays.items()}
        arrays.update(zip(("file_digest", "block_head_digest", "chunk_digest", "block_chunks"), _digests(ds)))
    index = os.path.join(root, fmt.INDEX_NAME)
    backup = os.path.join(root, BACKUP_NAME)
    os.link(index, backup)
    temp = index + ".upgrade"
    write_arrays(temp, arrays)
    os.replace(temp, index)
    meta["format_version"] = METADATA_VERSION
    meta["index"] = dict(meta["index"], crc32=fmt.file_crc(index), blake3=dg.file_digest(index).hex())
    new = metadata_bytes(meta)
    write_atomically(os.path.join(root, fmt.METADATA_NAME), (new,))
    os.unlink(backup)
    return dg.name_of(new), True


def write_atomically(path: str, pieces: tuple) -> None:
    """Write ``path`` whole or not at all, through its directory's descriptor (never through a link)."""
    fd = os.open(os.path.dirname(path) or ".", DIR_FLAGS)
    try:
        write_file_at(fd, os.path.basename(path), pieces, mode=0o644)
    finally:
        os.close(fd)


def _digests(ds: PackedDataset) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """(file digests by entry, header digests by block, chunk digests, where each block's chunks start),
    from blocks that pass every check of the dataset's own format."""
    a = ds.index.arrays
    files = np.zeros((ds.index.n_entries, dg.DIGEST_SIZE), dtype=np.uint8)
    heads = np.zeros((ds.n_blocks, dg.DIGEST_SIZE), dtype=np.uint8)
    chunks: list[bytes] = []
    block_chunks = np.zeros(ds.n_blocks + 1, dtype=np.uint64)
    row = lambda d: np.frombuffer(d, dtype=np.uint8)  # noqa: E731
    for b in range(ds.n_blocks):
        head = ds.store.header(b)
        data = bytearray(head.data_size)
        ds.store.read_data_into(b, head, data)
        heads[b] = row(dg.digest(ds.store.header_bytes(b)))
        chunks.append(dg.chunk_digests(data, fmt.CHUNK_SIZE))
        block_chunks[b + 1] = block_chunks[b] + fmt.n_chunks(len(data))
        view = memoryview(data)
        off, members = ds.layout
        for e in members[int(off[b]) : int(off[b + 1])].tolist():  # hard links share their slot's bytes
            slot = int(a["slot"][e])
            start, size = int(head.offsets[slot]), int(head.sizes[slot])
            files[e] = row(dg.digest(view[start : start + size]))
        view.release()
    return files, heads, row(b"".join(chunks)).reshape(-1, dg.DIGEST_SIZE), block_chunks


def _finish_interrupted(root: str) -> None:
    """Put back the index an interrupted upgrade replaced, if ``blockfs.json`` still names it; else the
    upgrade got as far as ``blockfs.json`` and the copy is only left over."""
    backup = os.path.join(root, BACKUP_NAME)
    if not os.path.exists(backup):
        return
    meta_crc = None
    try:
        meta, _ = read_metadata_bytes(root)
        meta_crc = meta["index"]["crc32"]
    except FormatError:
        pass
    if meta_crc is not None and fmt.file_crc(backup) == meta_crc and not has_digests(meta):
        os.replace(backup, os.path.join(root, fmt.INDEX_NAME))
    else:
        os.unlink(backup)
