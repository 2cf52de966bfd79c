"""Where a packed dataset is: a local directory, or a URL whose metadata and index are fetched once.

Everything above the block store reads a dataset from a local directory holding ``blockfs.json`` and
``index.bfi``.  For a remote dataset that directory is the disk tier's (``DIR/<key>/``, so a remount
fetches the index only if the dataset changed) or, without a disk tier, a private temporary directory
removed at close.  Blocks are then read through :mod:`blockfs.storage`: ranged GETs, with the disk tier
in front when there is one.  Opening sends one GET for the metadata (and one for the index when it is not
already on disk); it never lists the bucket.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import shutil
import tempfile
import zlib
from dataclasses import dataclass, field

from ..errors import NotADatasetError
from ..storage.blockfiles import BlockFiles, LocalBlockFiles
from ..storage.chain import compose
from ..storage.disk_tier import DiskTier
from ..storage.owned import DIR_FLAGS, read_regular_at, write_file_at
from ..storage.peer_tier import PeerOptions, PeerTier
from ..storage.remote import RemoteConfigError, RemoteError, RemoteStore
from ..storage.remote_blocks import RemoteBlockFiles
from ..storage.tiered import DiskCopies, copies_memory_blocks
from ..storage.urls import check_scheme, is_remote, join
from . import digest as dg
from .format import (
    BLOCKS_DIR,
    INDEX_NAME,
    METADATA_NAME,
    PACKING_MARKER,
    block_path,
)


@dataclass
class StorageOptions:
    """How to reach and cache a remote dataset (ignored for a local one)."""

    # the client's (endpoint, region, keys ...) and blockfs's; never in a repr (a log line), keys and all
    options: dict = field(default_factory=dict, repr=False)
    disk_cache: str | None = None  # the disk tier's directory
    disk_cache_size: int = 0  # its byte budget
    # Without a disk tier: a directory for the fetched metadata and index (so ``blockfs mount`` hands what
    # it fetched to its serving process instead of both fetching), and whether closing removes it.
    fetched_dir: str | None = None
    remove_fetched: bool = True
    peers: PeerOptions | None = None  # the other nodes of the job, asked before the store (serve/peers.py)


class DatasetLocation:
    """A dataset's local directory (``root``) and its blocks' files; ``display`` is what messages show."""

    def __init__(
        self,
        display: str,
        root: str,
        remote: RemoteStore | None = None,
        tier: DiskTier | None = None,
        temporary: bool = False,
        peers: PeerOptions | None = None,
        name: str = "",
    ) -> None:
        self.display = display
        self.root = root
        self.remote = remote
        self.tier = tier
        self.peers = peers
        self.name = name  # the dataset's name (blake3 of its blockfs.json): what peers ask for
        self._temporary = temporary

    @property
    def is_remote(self) -> bool:
        return self.remote is not None

    def block_files(self, block_sizes: list[int]) -> BlockFiles:
        n = len(block_sizes)
        if self.remote is None:
            return LocalBlockFiles([block_path(self.root, b) for b in range(n)])
        objects = [block_path("", b) for b in range(n)]  # "blocks/00000000.blk"
        store = RemoteBlockFiles(self.remote, objects, block_sizes)
        disk = None if self.tier is None else DiskCopies(self.tier, n)
        peers = None if self.peers is None else PeerTier(self.peers, self.name, block_sizes)
        return compose(
            store,
            disk=disk,
            peers=peers,
            copies_memory_blocks=self.tier is None or copies_memory_blocks(self.tier, store),
        )

    def close(self) -> None:
        if self.tier is not None:
            self.tier.close()
        if self._temporary:
            shutil.rmtree(self.root, ignore_errors=True)
            self._temporary = False


def locate(location: str | os.PathLike, storage: StorageOptions | None = None) -> DatasetLocation:
    """Find the dataset at ``location`` (a path or a URL) and, for a URL, fetch what opening it needs."""
    check_scheme(location)
    if not is_remote(location):
        if storage is not None and storage.disk_cache:
            raise RemoteConfigError(
                f"--disk-cache keeps copies of a remote dataset's blocks; {os.fspath(location)!r} is a local "
                "directory, read directly: leave --disk-cache out"
            )
        if storage is not None and storage.peers is not None:
            raise RemoteConfigError(
                f"--peers shares the blocks of a dataset in an object store; {os.fspath(location)!r} is a local "
                "directory, which every node reads directly: leave --peers out"
            )
        root = os.fspath(location)
        return DatasetLocation(root, root)
    storage = storage or StorageOptions()
    remote = RemoteStore(os.fspath(location), storage.options)
    try:
        return _fetch(remote, storage)
    except BaseException:
        remote.close()
        raise


def _fetch(remote: RemoteStore, storage: StorageOptions) -> DatasetLocation:
    try:
        meta_bytes = remote.get(METADATA_NAME)
    except RemoteError as e:
        if e.errno != errno.ENOENT:
            raise
        if remote.exists(PACKING_MARKER):
            raise NotADatasetError(
                f"{remote.display} is an unfinished pack (it was interrupted): run 'blockfs pack' again"
            ) from None
        raise NotADatasetError(
            f"{remote.display} is not a packed dataset (no {join(remote.display, METADATA_NAME)}): check the URL, "
            "or run 'blockfs pack' first"
        ) from None
    key = hashlib.sha256(meta_bytes).hexdigest()[:20]
    tier = None
    if storage.disk_cache:
        tier = DiskTier(storage.disk_cache, storage.disk_cache_size, key, remote.display)
        root, temporary = tier.root, False
    elif storage.fetched_dir:
        root, temporary = storage.fetched_dir, storage.remove_fetched
    else:
        root, temporary = tempfile.mkdtemp(prefix="blockfs-remote-"), True
    located = DatasetLocation(remote.display, root, remote, tier, temporary, storage.peers, dg.name_of(meta_bytes))
    files = _TierFiles(tier) if tier is not None else _DirFiles(root)
    try:
        files.keep(METADATA_NAME, meta_bytes)
        try:
            meta = json.loads(meta_bytes)
            expected_crc = meta["index"]["crc32"]
            expected_digest = meta["index"].get("blake3")
            source = meta.get("source") or {}
            side_files = [(source["labels_file"], source.get("labels_blake3"))] if "labels_file" in source else []
        except (ValueError, KeyError, TypeError):
            return located  # read_metadata names what is wrong with it
        # The index kept from an earlier mount is reused only if it is the one blockfs.json names: by its
        # digest where there is one (a CRC can be forged), by its CRC in a dataset packed before digests.
        if not _names_match(files.read(INDEX_NAME), expected_digest, expected_crc):
            files.keep(INDEX_NAME, remote.get(INDEX_NAME))
        for name, digest in side_files:
            plain = isinstance(name, str) and "/" not in name and name not in (METADATA_NAME, INDEX_NAME, BLOCKS_DIR)
            if not plain:
                continue
            kept = files.read(name)
            if kept is None or (digest is not None and dg.digest(kept).hex() != digest):
                files.keep(name, remote.get(name))
        return located
    except BaseException:
        located.close()
        raise


class _TierFiles:
    """The dataset's own files in the disk tier's key directory (written through its descriptor)."""

    def __init__(self, tier: DiskTier) -> None:
        self.keep, self.read = tier.keep, tier.read_file


class _DirFiles:
    """The dataset's own files in a private directory of this process's (a temporary one)."""

    def __init__(self, root: str) -> None:
        self.root = root

    def keep(self, name: str, data: bytes) -> None:
        fd = os.open(self.root, DIR_FLAGS)
        try:
            write_file_at(fd, name, (data,), mode=0o644)
        finally:
            os.close(fd)

    def read(self, name: str) -> bytes | None:
        """The bytes of the regular file ``name`` kept there, or None when there is none to reuse."""
        fd = os.open(self.root, DIR_FLAGS)
        try:
            return read_regular_at(fd, name)
        finally:
            os.close(fd)


def _names_match(kept: bytes | None, digest: str | None, crc: int) -> bool:
    """Whether a kept file is the one blockfs.json names (its digest, or its CRC before digests)."""
    if kept is None:
        return False
    return dg.digest(kept).hex() == digest if digest is not None else zlib.crc32(kept) == crc
