"""``MountView``: what a mounted dataset answers, by index entry — the layer both FUSE adapters translate.

It knows no FUSE binding and no node ids: attributes, listings, links, extended attributes, file bytes
and the mount's statistics, each asked by entry id (or, for the path adapter, by path), with blockfs
errors raised as they are.  :mod:`blockfs.serve.fuse.libfuse_adapter` (mfusepy/fusepy: paths) and
:mod:`blockfs.serve.fuse.kernel_adapter` (the kernel protocol: node ids) map these answers and errors for the kernel,
and add only what their route needs, so neither holds logic the other would need.
"""

from __future__ import annotations

import collections
import errno
import os
import time
from typing import Any, Callable, NamedTuple

import numpy as np
from .. import protocol
from ..core.dataset import PackedDataset
from ..core.index import KIND_DIR, KIND_FILE, KIND_SYMLINK
from ..errors import BlockfsError, BlockReadError, CorruptBlockError
from .cache.block_cache import BlockCache
from .control.control_dir import ControlDirectory, control_name_for
from .errorlog import ErrorLog
from .mount_options import MountOptions
from .cache.memory_plan import MemoryPlan
from .cache.retain import RetainingReader

ROOT = 0  # the root directory's entry id
# What :meth:`MountView.attrs` answers: one row per entry, the fields of :class:`Attr`
ATTRS = np.dtype([("ino", "u8"), ("size", "u8"), ("mode", "u4"), ("nlink", "u4"), ("mtime_ns", "i8")])


class Attr(NamedTuple):
    """What ``stat`` shows of an entry (times are the mtime; uid/gid are the mount's)."""

    ino: int
    size: int
    mode: int
    nlink: int
    mtime_ns: int


class MountView:
    """One mounted dataset's answers; ``adapter`` names the FUSE route in the statistics."""

    def __init__(
        self,
        ds: PackedDataset,
        cache: BlockCache,
        options: MountOptions,
        mountpoint: str = "",
        plan: MemoryPlan | None = None,
        retainer: RetainingReader | None = None,
    ) -> None:
        self.ds = ds
        self.cache = cache
        self.options = options
        self.plan = plan
        self.retainer = retainer
        self.mountpoint = mountpoint
        self.index = ds.index
        self._a = ds.index.arrays
        self._block = self._a["block"]
        self._slot = self._a["slot"]
        self.uid, self.gid = os.getuid(), os.getgid()
        self.error_log = ErrorLog()
        self.started = time.time()
        self.control = ControlDirectory(ds, control_name_for(ds, options.control_name), self.stats)
        self.control_name = os.fsencode(self.control.name)
        self.requests: collections.Counter[str] = collections.Counter()  # FUSE requests by kind
        self.adapter: dict[str, Any] = {}  # the adapter's own facts for the statistics (route, open mode...)
        self.extra_stats: Callable[[], dict[str, Any]] | None = None  # the adapter's counters (pushed pages)

    # --- entries ------------------------------------------------------------------------------------
    def lookup(self, raw: bytes) -> int:
        """The entry of a path inside the dataset (``b"/a/b"`` or ``b"a/b"``); EntryNotFoundError if none."""
        return self.index.lookup(raw.strip(b"/"))

    def child(self, parent: int, name: bytes) -> int:
        """The entry named ``name`` in directory entry ``parent``, or -1."""
        if parent == ROOT:
            return self.index.find(name)
        return self.index.find(self.index.path(parent) + b"/" + name)

    def attr(self, e: int) -> Attr:
        kind, mode, size, mtime_ns, ino, nlink, _label, _block = self.index.stat_fields(e)
        if kind == KIND_SYMLINK:
            size = len(self.index.link_target(e))
        return Attr(ino, size, mode, nlink, mtime_ns)

    def check_present(self, e: int, *, wait: bool = True) -> bool:
        """Called when the kernel first learns of ``e``: the kernel never reads a file whose size is 0, so
        check here that its block holds an empty file (a size zeroed in a forged index must fail EIO).
        ``wait=False``: check only from what is in memory, and say False (not checked) where checking
        would wait on storage — a caller that must never wait (a request thread) checks later elsewhere."""
        kind, _mode, size = self.index.stat_fields(e)[:3]
        if size or kind != KIND_FILE:
            return True
        if not wait:
            return self.ds.confirm_empty(e) is not None
        self.ds.read_entry(e)
        return True

    def is_dir(self, e: int) -> bool:
        return self.index.kind(e) == KIND_DIR

    def parent(self, e: int) -> int:
        return int(self._a["parent"][e])

    def children(self, e: int) -> range:
        """A directory's child entries, in the index's (name-sorted) order: one contiguous run of entries."""
        return self.index.children(e)

    def child_names(self, e: int) -> bytes:
        """The names of directory ``e``'s children in :meth:`children`'s order, each followed by a NUL."""
        return self.index.joined_names(e)

    def name_spans(self, e: int, first: int, stop: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(table, start, length): the names of directory ``e``'s children ``first..stop-1`` (entry ids) are
        ``table[start[i] : start[i] + length[i]]`` — the index's path table, nothing copied."""
        start, length = self.index.name_spans(e, first, stop)
        return self._a["paths"], start, length

    def attrs(self, first: int, stop: int) -> np.ndarray:
        """:meth:`attr` of entries ``first..stop-1`` at once, as an :data:`ATTRS` array."""
        a = self._a
        out = np.empty(stop - first, dtype=ATTRS)
        for name in ("ino", "size", "mode", "nlink", "mtime_ns"):
            out[name] = a[name][first:stop]
        links = np.flatnonzero(a["kind"][first:stop] == KIND_SYMLINK)
        if links.size:  # a symlink's size is its target's length
            slot = self._slot[first:stop][links].astype(np.int64)
            out["size"][links] = a["link_offsets"][slot + 1] - a["link_offsets"][slot]
        return out

    def readlink(self, e: int) -> bytes:
        if self.index.kind(e) != KIND_SYMLINK:
            raise OSError(errno.EINVAL, "not a symbolic link")
        return self.index.link_target(e)

    def xattrs(self, e: int) -> dict[str, bytes]:
        if e == ROOT:
            return {protocol.CONTROL_XATTR: self.control_name}
        if self.index.kind(e) != KIND_FILE:
            return {}
        label = int(self._a["label"][e])
        found = {}
        if label >= 0:
            found[protocol.LABEL_XATTR] = str(label).encode()
            classes = self.ds.classes
            if classes and label < len(classes):
                found[protocol.CLASS_XATTR] = os.fsencode(classes[label])
        found[protocol.BLOCK_XATTR] = str(int(self._block[e])).encode()
        return found

    def statfs(self) -> tuple[int, int]:
        """(4 KiB blocks of file data, entries)."""
        return -(-int(self.ds.metadata["file_bytes"]) // 4096), self.index.n_entries

    # --- data ---------------------------------------------------------------------------------------
    def read(self, e: int, offset: int, size: int) -> bytes:
        return self.ds.read_entry(e, offset, size)

    def block_of(self, entries: np.ndarray) -> np.ndarray:
        """The block of each file entry in ``entries``."""
        return self._block[entries]

    def block_slot(self, e: int) -> tuple[int, int]:
        _kind, block, slot, _size, _crc = self.index.read_fields(e)
        return block, slot

    def in_memory(self, e: int) -> bool:
        """Whether a read of file ``e`` is answered from memory now, without waiting on storage."""
        _kind, block, slot, _size, _crc = self.index.read_fields(e)  # Python ints: no NumPy scalar per read
        if self.retainer is not None and self.retainer.holds(block, slot):
            return True
        return self.cache.holds(block)

    def keeps(self, e: int) -> bool:
        """Whether the memory plan keeps entry ``e`` resident: a retained file, or anything when it all fits."""
        if self.retainer is not None:
            return self.retainer.is_target(int(self._block[e]), int(self._slot[e]))
        return self.plan is None or self.plan.fits

    def report(self, e: BaseException) -> int:
        """The errno a failed request answers, and the error counted and logged as the error log says."""
        if isinstance(e, (CorruptBlockError, BlockReadError)):
            self.error_log.report(e)
        if isinstance(e, BlockfsError):
            return e.errno
        if isinstance(e, OSError):
            return e.errno or errno.EIO
        return errno.EIO

    # --- statistics ---------------------------------------------------------------------------------
    def stats(self) -> dict[str, Any]:
        """Everything ``blockfs stats`` shows: the mount, the dataset, the memory plan and the cache."""
        meta = self.ds.metadata
        dataset_bytes = int(meta["file_bytes"])
        budget = self.cache.budget_bytes
        out = {
            "mount": {
                "dest": self.ds.location,
                "mountpoint": self.mountpoint,
                "pid": os.getpid(),
                **self.adapter,
                "threads": self.options.threads,
                "control": self.control.name,
                "started": self.started,
            },
            "dataset": {
                "digest": self.ds.digest,  # its name: what --expect and the loader's expect= pin
                "digests": self.ds.has_digests,  # False: checked against accidents (CRC-32) only
                "files": int(meta["n_files"]),
                "file_bytes": dataset_bytes,
                "blocks": int(meta["n_blocks"]),
                "block_bytes": int(meta["block_bytes"]),
            },
            "plan": self.plan.to_dict() if self.plan is not None else {
                "budget_bytes": budget,
                "dataset_bytes": dataset_bytes,
                "fits": dataset_bytes <= budget,
                "expected_hit_rate": min(1.0, budget / dataset_bytes) if dataset_bytes else 1.0,
            },
            "retained": self.retainer.stats() if self.retainer is not None else None,
            **self.cache.stats(),
            "requests": dict(self.requests),
            "errors": self.error_log.stats(),
            "storage": self.ds.store.files.stats(),  # remote requests and the disk tier; {} for a local dataset
        }
        if self.extra_stats is not None:
            out.update(self.extra_stats())
        return out
