"""The control directory of a mount: live statistics, the dataset's metadata, index and block files.

It lives at the mount root under a name that is no entry of the dataset (:func:`control_name_for`) and is
left out of the root's listing, so ``find`` and ``diff -r`` see only the dataset.  Its files and attributes
are the mount↔loader contract (:mod:`blockfs.protocol`).  This class knows nothing of FUSE: it answers
with plain values and raises blockfs errors (or ``OSError`` with an errno), so it runs and is tested
in-process; :class:`blockfs.serve.view.MountView` composes it into the mount's one namespace (by node: see
:meth:`ControlDirectory.node_of`), which the FUSE adapters translate.

**One snapshot per open of stats.json.**  The kernel caches what a FUSE file returns and may fetch it in
several reads; a file whose bytes change between those reads is served torn (half of one snapshot, half of
the next, or a size from one and bytes from another).  So ``stats.json`` is a symbolic link, resolved by
the server on every open (the kernel does not cache FUSE link targets unless told to), to
``stats/G.json``: a new G, and a new file, for every resolution.  The bytes of G never change; every read
of a handle opened through the link reads the snapshot it was opened on, whatever the open mode (with
``open`` answered ENOSYS the server never sees the open, but it always sees the link resolved).  A
snapshot is dropped once it is not among the :data:`SNAPSHOTS_KEPT` most recently read and has not been
read for :data:`SNAPSHOT_IDLE_S` (or past :data:`SNAPSHOTS_MAX`); a read of it then fails with ENOENT,
never with other bytes, and its path is handed to the adapter to drop from the kernel's cache.

**No more than the tree's own permissions allow.**  ``blocks/*`` hold every file's bytes and ``index.bfi``
every path: under ``--allow-other`` (with ``default_permissions``, so the kernel checks modes), another user
who may not read a 0600 file by its path must not read its bytes out of its block, nor the names inside a
0700 directory out of the index.  So they are readable by the mount's owner only (``blocks/`` 0500, its
files and the index 0400) unless every file and directory of the tree grants the same read to the group
or to everyone (:func:`reveal_mode`).  The statistics and metadata reveal no file's bytes or path and stay
readable by all.
"""

from __future__ import annotations

import collections
import errno
import json
import os
import stat
import threading
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from ... import protocol
from ...core.dataset import PackedDataset
from ...core.index import KIND_DIR, KIND_FILE
from ...errors import EntryNotFoundError, IsADirectoryEntryError, NotADirectoryEntryError
from ..node_attr import Attr

SNAPSHOTS_KEPT = 64  # kept however idle; past that, a snapshot unread for SNAPSHOT_IDLE_S goes
SNAPSHOT_IDLE_S = 30.0
SNAPSHOTS_MAX = 1024  # and past this many (a few MB), the least recently read goes whatever its age
SNAPSHOT_DIGITS = 12  # a fixed-width name: the link's size never changes

STATS = os.fsencode(protocol.STATS_FILE)
SNAPSHOTS = os.fsencode(protocol.STATS_SNAPSHOTS_DIR)
METADATA = os.fsencode(protocol.METADATA_FILE)
INDEX = os.fsencode(protocol.INDEX_FILE)
BLOCKS = os.fsencode(protocol.BLOCKS_DIR)
LISTED_FILES = (BLOCKS, INDEX, METADATA, STATS)  # the snapshots' directory is reached through the link only


def reveal_mode(arrays: dict) -> int:
    """The permission bits of files that reveal the whole tree (block files, the index): the owner's read,
    plus the group's or everyone's where every file of the tree grants them read (every directory, read
    and search) — then the control files tell them nothing they could not read by path."""
    kind, mode = arrays["kind"], arrays["mode"].astype(np.uint32)
    files, dirs = kind == KIND_FILE, kind == KIND_DIR
    bits = 0o400
    for read, search in ((0o040, 0o010), (0o004, 0o001)):
        if np.all(mode[files] & read) and np.all(mode[dirs] & (read | search) == (read | search)):
            bits |= read
    return bits


def control_name_for(ds: PackedDataset, preferred: str = protocol.DEFAULT_CONTROL) -> str:
    """``preferred``, or it with a suffix, so that it names no entry of the dataset's root."""
    name, k = preferred, 0
    while ds.index.find(os.fsencode(name)) >= 0:
        k += 1
        name = f"{preferred}-{k}"
    return name


class ControlDirectory:
    """The control directory ``/<name>`` of a mount of ``ds``; ``stats()`` gives the live statistics.

    Paths are the bytes the kernel gives, absolute in the mount (``b"/.blockfs/stats.json"``).
    """

    def __init__(
        self,
        ds: PackedDataset,
        name: str,
        stats: Callable[[], dict[str, Any]],
        prefetch_address: bytes | None = None,
        share_address: bytes | None = None,
    ) -> None:
        self.name = name
        self.path = b"/" + os.fsencode(name)
        self._ds = ds
        self._stats = stats
        self._metadata = ds.metadata_bytes  # the bytes that name the dataset served, not DEST's file now
        self._index: memoryview | bytes = (
            ds.index.raw
        )  # the bytes the mount serves from, not DEST's file (which may change)
        arrays = ds.index.arrays
        self._block_sizes = arrays["block_sizes"]
        self._root_ino = int(arrays["ino"][0])
        # Inodes after every entry's: the directory, its files, the block files, then the snapshots.
        self._ino = int(arrays["ino"].max(initial=0)) + 1
        self._file_inos = {STATS: 1, METADATA: 2, INDEX: 3, BLOCKS: 4, SNAPSHOTS: 5}
        self._first_block_ino = self._ino + 6
        self._first_snapshot_ino = self._first_block_ino + len(self._block_sizes)
        self._mtime_ns = time.time_ns()
        self._reveal = reveal_mode(arrays)  # of blocks/* and index.bfi; blocks/ adds search where read is given
        # generation -> (bytes, when last read), least recently read first
        self._snapshots: collections.OrderedDict[int, tuple[bytes, float]] = collections.OrderedDict()
        self._generation = 0
        self._evicted: list[bytes] = []
        self._lock = threading.Lock()
        self.prefetch_address = prefetch_address  # the socket that takes loaders' block announcements
        self.share_address = share_address  # the socket that hands loaders cached blocks
        self._named = {v: k for k, v in self._file_inos.items()}  # inode offset -> name

    def owns(self, raw: bytes) -> bool:
        return raw.startswith(self.path) and (len(raw) == len(self.path) or raw[len(self.path)] == 0x2F)

    # --- paths ----------------------------------------------------------------------------------
    def _leaf(self, raw: bytes) -> bytes:
        """The path inside the directory (b"" for the directory itself); ENOENT for a name it lacks."""
        leaf = raw[len(self.path) + 1 :]
        if leaf and leaf not in self._file_inos and self._block_of(leaf) is None and self._snapshot_of(leaf) is None:
            raise EntryNotFoundError(f"{os.fsdecode(raw)}: no such control file")
        return leaf

    def _block_of(self, leaf: bytes) -> int | None:
        """The block a ``blocks/NNNNNNNN`` path names (exactly that spelling), else None."""
        head, _, name = leaf.partition(b"/")
        block = protocol.parse_block_file_name(name) if head == BLOCKS else None
        return block if block is not None and block < len(self._block_sizes) else None

    def _snapshot_of(self, leaf: bytes) -> int | None:
        """The generation a ``stats/G.json`` path names, if that snapshot is still kept."""
        head, _, name = leaf.partition(b"/")
        stem = name.removesuffix(b".json")
        if head != SNAPSHOTS or len(stem) != SNAPSHOT_DIGITS or not stem.isdigit() or stem == name:
            return None
        generation = int(stem)
        with self._lock:
            return generation if generation in self._snapshots else None

    @staticmethod
    def _snapshot_name(generation: int) -> bytes:
        return SNAPSHOTS + b"/%0*d.json" % (SNAPSHOT_DIGITS, generation)

    # --- operations -----------------------------------------------------------------------------
    def getattr(self, raw: bytes) -> Attr:
        leaf = self._leaf(raw)
        if leaf in (b"", BLOCKS, SNAPSHOTS):
            ino = self._ino if not leaf else self._ino + self._file_inos[leaf]
            perm = self._reveal | self._reveal >> 2 if leaf == BLOCKS else 0o555  # r -> r-x
            return Attr(ino, 0, stat.S_IFDIR | perm, 2, self._mtime_ns)
        if leaf == STATS:
            return Attr(self._ino + 1, len(self._snapshot_name(0)), stat.S_IFLNK | 0o777, 1, self._mtime_ns)
        block = self._block_of(leaf)
        if block is not None:
            return self._file_attr(self._first_block_ino + block, int(self._block_sizes[block]), self._reveal)
        generation = self._snapshot_of(leaf)
        if generation is not None:
            with self._lock:
                size = len(self._snapshots.get(generation, (b"", 0.0))[0])
            return self._file_attr(self._first_snapshot_ino + generation, size)
        if leaf == METADATA:
            return self._file_attr(self._ino + self._file_inos[leaf], len(self._metadata))
        return self._file_attr(self._ino + self._file_inos[leaf], len(self._index), self._reveal)

    def _file_attr(self, ino: int, size: int, perm: int = 0o444) -> Attr:
        return Attr(ino, size, stat.S_IFREG | perm, 1, self._mtime_ns)

    # --- nodes: the directory's files by their place among its inode numbers ---------------------
    def node_of(self, raw: bytes) -> int:
        """The node of a control path: 0 for the directory, then its files in inode order."""
        return self.getattr(raw).ino - self._ino

    def path_of(self, node: int) -> bytes:
        """The path of :meth:`node_of`'s ``node`` (a snapshot's, even once dropped: its reads say ENOENT)."""
        n_blocks = len(self._block_sizes)
        if node == 0:
            return self.path
        if node in self._named:
            return self.path + b"/" + self._named[node]
        if 6 <= node < 6 + n_blocks:
            return self.path + b"/" + BLOCKS + b"/" + os.fsencode(protocol.block_file_name(node - 6))
        if node >= 6 + n_blocks:
            return self.path + b"/" + self._snapshot_name(node - 6 - n_blocks)
        raise OSError(errno.ESTALE, "no such control node")

    def children(self, raw: bytes) -> list[tuple[bytes, int]]:
        """(name, node) of each entry of a control directory, without "." and ".."."""
        return [(os.fsencode(name), ino - self._ino) for name, _mode, ino in self.readdir(raw)[2:]]

    def readdir(self, raw: bytes) -> list[tuple[str, int, int]]:
        """(name, mode, inode) of each entry, ``.`` and ``..`` first."""
        leaf = self._leaf(raw)
        here = self.getattr(raw)
        if not stat.S_ISDIR(here.mode):
            raise NotADirectoryEntryError(f"{os.fsdecode(raw)}: not a directory")
        parent = self._root_ino if not leaf else self._ino
        entries = [(".", stat.S_IFDIR, here.ino), ("..", stat.S_IFDIR, parent)]
        if leaf == BLOCKS:
            return entries + [
                (protocol.block_file_name(b), stat.S_IFREG, self._first_block_ino + b)
                for b in range(len(self._block_sizes))
            ]
        if leaf == SNAPSHOTS:
            with self._lock:
                kept = list(self._snapshots)
            return entries + [
                (os.fsdecode(self._snapshot_name(g)).partition("/")[2], stat.S_IFREG, self._first_snapshot_ino + g)
                for g in kept
            ]
        return entries + [
            (
                os.fsdecode(name),
                stat.S_IFMT(self.getattr(self.path + b"/" + name).mode),
                self._ino + self._file_inos[name],
            )
            for name in LISTED_FILES
        ]

    def is_block_file(self, raw: bytes) -> bool:
        """Whether ``raw`` is a ``blocks/NNNNNNNN`` file (its reads go through the cache to storage)."""
        return self.owns(raw) and self._block_of(raw[len(self.path) + 1 :]) is not None

    def readlink(self, raw: bytes) -> bytes:
        """``stats.json``'s target: a new snapshot of the statistics, taken now."""
        if self._leaf(raw) != STATS:
            raise OSError(errno.EINVAL, "not a symbolic link", os.fsdecode(raw))
        return self.snapshot()

    def snapshot(self) -> bytes:
        """Take a snapshot of the statistics; its path relative to the control directory."""
        data = self.stats_bytes()
        now = time.monotonic()
        with self._lock:
            self._generation += 1
            generation = self._generation
            self._snapshots[generation] = (data, now)
            while len(self._snapshots) > SNAPSHOTS_KEPT:
                old, (_data, used) = next(iter(self._snapshots.items()))
                if len(self._snapshots) <= SNAPSHOTS_MAX and now - used < SNAPSHOT_IDLE_S:
                    break
                del self._snapshots[old]
                self._evicted.append(self.path + b"/" + self._snapshot_name(old))
        return self._snapshot_name(generation)

    def read(self, raw: bytes, size: int, offset: int) -> bytes:
        leaf = self._leaf(raw)
        if leaf in (b"", BLOCKS, SNAPSHOTS):
            raise IsADirectoryEntryError(f"{os.fsdecode(raw)}: is a directory")
        if leaf == STATS:  # a reader reaches the snapshot through the link; this is the link itself
            raise OSError(errno.EINVAL, "a symbolic link", os.fsdecode(raw))
        block = self._block_of(leaf)
        if block is not None:
            return self._ds.read_block_range(block, offset, size)
        if leaf == INDEX:
            return bytes(self._index[offset : offset + size])
        if leaf == METADATA:
            return self._metadata[offset : offset + size]
        generation = self._snapshot_of(leaf)
        with self._lock:
            kept = self._snapshots.get(generation) if generation is not None else None
            if generation is not None and kept is not None:
                data = kept[0]
                self._snapshots[generation] = (data, time.monotonic())
                self._snapshots.move_to_end(generation)
        if kept is None:
            raise EntryNotFoundError(f"{os.fsdecode(raw)}: snapshot no longer kept; open stats.json again")
        return data[offset : offset + size]

    def getxattr(self, raw: bytes, name: str) -> bytes:
        if not self._leaf(raw):
            value = self._xattrs().get(name)
            if value is not None:
                return value() if callable(value) else value
        raise OSError(errno.ENODATA, f"no attribute {name}", os.fsdecode(raw))

    def listxattr(self, raw: bytes) -> list[str]:
        return [] if self._leaf(raw) else list(self._xattrs())

    def _xattrs(self) -> dict[str, bytes | Callable[[], bytes]]:
        found: dict[str, bytes | Callable[[], bytes]] = {protocol.STATS_XATTR: self.stats_bytes}
        if self.prefetch_address is not None:
            found[protocol.PREFETCH_XATTR] = self.prefetch_address
        if self.share_address is not None:
            found[protocol.SHARE_XATTR] = self.share_address
        return found

    def stats_bytes(self) -> bytes:
        return json.dumps(self._stats(), indent=1).encode() + b"\n"

    def take_evicted(self) -> list[bytes]:
        """The paths of snapshots dropped since the last call (for the kernel to forget)."""
        with self._lock:
            evicted, self._evicted = self._evicted, []
        return evicted

    def close(self) -> None:
        self._index = b""  # the bytes belong to the dataset's index, which releases them
