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
import stat

import numpy as np

from ..errors import FormatError
from ..storage.owned import USER_DIR_FLAGS, created_at, write_file_at
from ..storage.urls import is_remote
from . import digest as dg
from . import format as fmt
from .dataset import PackedDataset
from .index_format import write_arrays
from .metadata import METADATA_VERSION, has_digests, metadata_bytes, read_metadata_bytes

BACKUP_NAME = fmt.INDEX_NAME + ".before-upgrade"


def upgrade(location: str | os.PathLike) -> tuple[str, bool]:
    """Add digests to the dataset at ``location`` (a directory); return (its name, whether it changed).

    Everything it writes, links or removes goes through the directory's descriptor, by name, following no
    link (``storage.owned``): a dataset received from someone else cannot send a write outside it.  A link
    where the dataset's own files or the upgrade's backup should be is refused (:func:`_regular_or_refused`):
    upgrade keeps a dataset, and one whose files are links elsewhere is not the one blockfs wrote.
    """
    root = os.fspath(location)
    if is_remote(root):
        raise FormatError(
            f"{root}: upgrade works on a local directory: copy the dataset, 'blockfs upgrade' it, and upload "
            "index.bfi and then blockfs.json (or pack it again to the URL)"
        )
    try:
        dir_fd = os.open(root, USER_DIR_FLAGS)
    except OSError:
        read_metadata_bytes(root)  # says what ``root`` is instead (missing, not a directory)
        raise
    try:
        return _upgrade(root, dir_fd)
    finally:
        os.close(dir_fd)


def _upgrade(root: str, dir_fd: int) -> tuple[str, bool]:
    _finish_interrupted(root, dir_fd)
    meta, raw = read_metadata_bytes(root)
    if has_digests(meta):
        return dg.name_of(raw), False
    for name in (fmt.METADATA_NAME, fmt.INDEX_NAME):
        _regular_or_refused(root, dir_fd, name)
    with PackedDataset(root) as ds:
        arrays = {name: np.array(arr) for name, arr in ds.index.arrays.items()}
        arrays.update(
            zip(("file_digest", "block_head_digest", "chunk_digest", "block_chunks"), _digests(ds), strict=True)
        )
    os.link(fmt.INDEX_NAME, BACKUP_NAME, src_dir_fd=dir_fd, dst_dir_fd=dir_fd, follow_symlinks=False)
    with created_at(dir_fd, fmt.INDEX_NAME, mode=0o644) as f:
        write_arrays(f, arrays)
    meta["format_version"] = METADATA_VERSION
    meta["index"] = dict(
        meta["index"],
        crc32=fmt.file_crc(_open_at(dir_fd, fmt.INDEX_NAME)),
        blake3=dg.file_digest(_open_at(dir_fd, fmt.INDEX_NAME)).hex(),
    )
    new = metadata_bytes(meta)
    write_file_at(dir_fd, fmt.METADATA_NAME, (new,), mode=0o644)
    os.unlink(BACKUP_NAME, dir_fd=dir_fd)
    return dg.name_of(new), True


def _open_at(dir_fd: int, name: str) -> int:
    """A descriptor to read ``name`` in ``dir_fd`` through, never through a link (the reader closes it)."""
    return os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dir_fd)


def _regular_or_refused(root: str, dir_fd: int, name: str) -> bool:
    """Whether ``name`` exists in ``dir_fd``; a refusal naming it if it is there but not a regular file."""
    try:
        st = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
    except FileNotFoundError:
        return False
    if not stat.S_ISREG(st.st_mode):
        what = "a symbolic link" if stat.S_ISLNK(st.st_mode) else "not a regular file"
        raise FormatError(
            f"{os.path.join(root, name)} is {what}: blockfs writes only regular files there; remove it (or copy "
            "the dataset with 'cp -rL' and upgrade the copy)"
        )
    return True


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


def _finish_interrupted(root: str, dir_fd: int) -> None:
    """Put back the index an interrupted upgrade replaced, if ``blockfs.json`` still names it; else the
    upgrade got as far as ``blockfs.json`` and the copy is only left over."""
    if not _regular_or_refused(root, dir_fd, BACKUP_NAME):
        return
    meta_crc = None
    try:
        meta, _ = read_metadata_bytes(root)
        meta_crc = meta["index"]["crc32"]
    except FormatError:
        pass
    if meta_crc is not None and fmt.file_crc(_open_at(dir_fd, BACKUP_NAME)) == meta_crc and not has_digests(meta):
        os.rename(BACKUP_NAME, fmt.INDEX_NAME, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
    else:
        os.unlink(BACKUP_NAME, dir_fd=dir_fd)
