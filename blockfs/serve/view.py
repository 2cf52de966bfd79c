"""``MountView``: the mount's one namespace — what a mounted dataset answers, by node — the layer both FUSE
adapters translate.

A *node* is an int: the dataset's index entries are nodes ``0..n-1`` (0 is the root), and the control
directory (:mod:`blockfs.serve.control.control_dir`) is composed in as a second layer, nodes ``n`` on, reached
from the root by its name and left out of the root's listing.  Every question — lookups, attributes (one
:class:`Attr` type), listings in bulk, links, extended attributes, bytes, errors as errno values, the
keep-pages decision, the statistics, the start of serving — is asked of this class, which alone knows which
layer answers.  :mod:`blockfs.serve.fuse.libfuse_adapter` (paths) and :mod:`blockfs.serve.fuse.kernel_adapter`
(node ids) only translate requests into these calls; the kernel adapter's page pushing reaches the memory
tier through three narrow methods (:meth:`files_of_block`, :meth:`held`, :meth:`pages`).
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from .. import protocol
from ..core.dataset import PackedDataset
from ..core.index import KIND_DIR, KIND_FILE, KIND_SYMLINK
from ..errors import BlockfsError, BlockReadError, CorruptBlockError
from .cache.block_cache import BlockCache
from .cache.memory_plan import MemoryPlan
from .cache.retain import RetainingReader
from .control.control_dir import ControlDirectory, control_name_for
from .errorlog import ErrorLog
from .mount_options import MountOptions
from .node_attr import ATTRS, Attr, Listing, attr_rows

__all__ = ["ATTRS", "ROOT", "Attr", "Listing", "MountView", "Route"]

log = logging.getLogger(__name__)

ROOT = 0  # the root directory's node
FORGET_INTERVAL_S = 0.5  # how often stats snapshots the control directory dropped are dropped from the kernel's cache


@dataclass(frozen=True)
class Route:
    """What the FUSE adapter brings to its mount, given to the view (and the cache) when they are made."""

    facts: dict[str, Any]  # shown under "mount" in the statistics: the binding, the open mode...
    open_mode: str  # enosys, keep_cache, targets or none (MountOptions.open_mode_for)
    stats: Callable[[], dict[str, Any]] | None = None  # the adapter's own counters, merged into the statistics
    on_load: Callable[[int], None] | None = None  # a block just loaded (the kernel adapter pushes its pages)


class MountView:
    """One mounted dataset's namespace: the dataset's entries and the control directory, by node."""

    def __init__(
        self,
        ds: PackedDataset,
        cache: BlockCache,
        options: MountOptions,
        route: Route,
        *,
        mountpoint: str = "",
        plan: MemoryPlan | None = None,
        retainer: RetainingReader | None = None,
        prefetch_address: bytes | None = None,
        share_address: bytes | None = None,
    ) -> None:
        self.ds = ds
        self.cache = cache
        self.options = options
        self.route = route
        self.plan = plan
        self.retainer = retainer
        self.mountpoint = mountpoint
        self.index = ds.index
        self._a = ds.index.arrays
        self._block = self._a["block"]
        self._slot = self._a["slot"]
        self._size = self._a["size"]
        self.n_entries = self.index.n_entries  # nodes below this are the dataset's entries (per-node state fits)
        self.uid, self.gid = os.getuid(), os.getgid()
        self.error_log = ErrorLog()
        self.started = time.time()
        self.control = ControlDirectory(
            ds, control_name_for(ds, options.control_name), self.stats, prefetch_address, share_address
        )
        self.control_name = os.fsencode(self.control.name)
        self._stopped = threading.Event()
        self._checker: threading.Thread | None = None

    def _ctl(self, node: int) -> bytes:
        """The control path of a node of the control layer."""
        return self.control.path_of(node - self.n_entries)

    # --- nodes ----------------------------------------------------------------------------------------
    def lookup(self, raw: bytes) -> int:
        """The node of an absolute path in the mount (``b"/a/b"``); EntryNotFoundError if none."""
        if self.control.owns(raw):
            return self.n_entries + self.control.node_of(raw)
        return self.index.lookup(raw.strip(b"/"))

    def child(self, parent: int, name: bytes) -> int:
        """The node named ``name`` in directory ``parent``: -1 for a name the dataset lacks; a name the
        control directory lacks is an error (never a negative entry: its snapshots come and go)."""
        if parent >= self.n_entries:
            return self.n_entries + self.control.node_of(self._ctl(parent) + b"/" + name)
        if parent == ROOT and name == self.control_name:
            return self.n_entries
        return self.index.find_child(parent, name)  # no path built: the index hashes the name from the parent's

    def attr(self, node: int) -> Attr:
        if node >= self.n_entries:
            return self.control.getattr(self._ctl(node))
        _kind, ino, size, mode, nlink, mtime_ns = self.index.attr_fields(node)  # a symlink's size: its target's
        return Attr(ino, size, mode, nlink, mtime_ns)

    def entry_attr(self, node: int) -> tuple[int, int, int, int, int] | None:
        """:meth:`attr` of a node the kernel learns of by a lookup, as (ino, size, mode, nlink, mtime_ns), with
        :meth:`check_present` (``wait=False``) done from the same read of the index; None where that check
        would wait on storage.  A lookup's whole question, in one call and no object but the tuple."""
        if node >= self.n_entries:
            return self.control.getattr(self._ctl(node))
        kind, ino, size, mode, nlink, mtime_ns = self.index.attr_fields(node)  # as attr() has it
        if not size and kind == KIND_FILE and self.ds.confirm_empty(node) is None:
            return None
        return ino, size, mode, nlink, mtime_ns

    def check_present(self, node: int, *, wait: bool = True) -> bool:
        """Called when the kernel first learns of ``node``: the kernel never reads a file whose size is 0, so
        check here that its block holds an empty file (a size zeroed in a forged index must fail EIO).
        ``wait=False``: check only from what is in memory, and say False (not checked) where checking
        would wait on storage — a caller that must never wait (a request thread) checks later elsewhere."""
        if node >= self.n_entries:
            return True
        kind, _mode, size = self.index.stat_fields(node)[:3]
        if size or kind != KIND_FILE:
            return True
        if not wait:
            return self.ds.confirm_empty(node) is not None
        self.ds.read_entry(node)
        return True

    def is_dir(self, node: int) -> bool:
        if node >= self.n_entries:
            return self.attr(node).mode & 0o170000 == 0o040000
        return self.index.kind(node) == KIND_DIR

    def parent(self, node: int) -> int:
        if node == self.n_entries:
            return ROOT
        if node > self.n_entries:
            return self.n_entries + self.control.node_of(self._ctl(node).rpartition(b"/")[0])
        return int(self._a["parent"][node])

    # --- listings -------------------------------------------------------------------------------------
    def n_children(self, node: int) -> int:
        """How many entries directory ``node`` lists ("." and ".." aside); ENOTDIR for any other node."""
        if node >= self.n_entries:
            return len(self.control.children(self._ctl(node)))
        return len(self.index.children(node))

    def listing(self, node: int, first: int = 0, stop: int | None = None) -> Listing:
        """Children ``first..stop-1`` (places in the listing, 0 the first child) of directory ``node``."""
        if node >= self.n_entries:
            return self._control_listing(node, first, stop)
        kids = self.index.children(node)
        lo, hi = kids.start + first, kids.start + (len(kids) if stop is None else min(stop, len(kids)))
        table, start, length = self.name_spans(node, lo, hi)
        return Listing(np.arange(lo, hi, dtype=np.int64), table, start, length, self.attrs(lo, hi))

    def _control_listing(self, node: int, first: int, stop: int | None) -> Listing:
        path = self._ctl(node)
        kids = self.control.children(path)[first:stop]
        names = [name for name, _k in kids]
        length = np.array([len(name) for name in names], dtype=np.int64)
        return Listing(
            np.array([self.n_entries + k for _name, k in kids], dtype=np.int64),
            np.frombuffer(b"".join(names), dtype=np.uint8),
            np.cumsum(length) - length,
            length,
            attr_rows([self.control.getattr(path + b"/" + name) for name in names]),
        )

    def child_names(self, node: int) -> bytes:
        """The names of directory ``node``'s children in :meth:`listing`'s order, each followed by a NUL."""
        if node >= self.n_entries:
            return b"".join(name + b"\0" for name, _k in self.control.children(self._ctl(node)))
        return self.index.joined_names(node)

    def children(self, e: int) -> range:
        """A dataset directory's child entries, in the index's (name-sorted) order: one contiguous run."""
        return self.index.children(e)

    def name_spans(self, e: int, first: int, stop: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(table, start, length): the names of dataset directory ``e``'s children ``first..stop-1`` (entry
        ids) are ``table[start[i] : start[i] + length[i]]`` — the index's path table, nothing copied."""
        start, length = self.index.name_spans(e, first, stop)
        return self._a["paths"], start, length

    def attrs(self, first: int, stop: int) -> np.ndarray:
        """:meth:`attr` of dataset entries ``first..stop-1`` at once, as an :data:`ATTRS` array."""
        a = self._a
        out = np.empty(stop - first, dtype=ATTRS)
        for name in ("ino", "size", "mode", "nlink", "mtime_ns"):
            out[name] = a[name][first:stop]
        links = np.flatnonzero(a["kind"][first:stop] == KIND_SYMLINK)
        if links.size:  # a symlink's size is its target's length
            slot = self._slot[first:stop][links].astype(np.int64)
            out["size"][links] = a["link_offsets"][slot + 1] - a["link_offsets"][slot]
        return out

    # --- links and extended attributes ----------------------------------------------------------------
    def readlink(self, node: int) -> bytes:
        if node >= self.n_entries:
            return self.control.readlink(self._ctl(node))
        if self.index.kind(node) != KIND_SYMLINK:
            raise OSError(errno.EINVAL, "not a symbolic link")
        return self.index.link_target(node)

    def getxattr(self, node: int, name: str) -> bytes:
        if node >= self.n_entries:
            return self.control.getxattr(self._ctl(node), name)
        value = self._xattrs(node).get(name)
        if value is None:
            raise OSError(errno.ENODATA, f"no attribute {name}")
        return value

    def listxattr(self, node: int) -> list[str]:
        if node >= self.n_entries:
            return self.control.listxattr(self._ctl(node))
        return list(self._xattrs(node))

    def _xattrs(self, e: int) -> dict[str, bytes]:
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

    # --- data -----------------------------------------------------------------------------------------
    def read(self, node: int, offset: int, size: int) -> bytes:
        if node >= self.n_entries:
            return self.control.read(self._ctl(node), size, offset)
        return self.ds.read_entry(node, offset, size)

    def read_now(self, node: int, offset: int, size: int) -> bytes | memoryview | None:
        """:meth:`read` where the bytes are in memory now, else None (read it where waiting is allowed).

        A file's read is answered here from the first of: the retained files (a copy out of their arena:
        the file's first read checked it whole, its size included), a cached block (a view of the block's
        memory, valid while held: an answer written at once is copied only by the kernel; served only where
        the block's own checked header gives the index's size, the check :meth:`read` makes) — each counted
        as its tier counts a hit, without the layers between: one read of the index's columns, no lock but
        the counters'.  Anything else (an error to raise, a read past the end, a size the block disagrees
        with, the control files) takes :meth:`read`'s own way where it is in memory."""
        if node < self.n_entries:
            kind, block, slot, length, _crc = self.index.read_fields(node)
            if kind == KIND_FILE and 0 <= offset < length and size > 0:
                retainer = self.retainer
                if retainer is not None:
                    held = retainer.read_held(block, slot, offset, size)
                    if held is not None:
                        return held
                cached = self.cache.cached(block)
                if cached is None:
                    return None
                if cached.sizes[slot] == length:
                    data = cached.piece(slot, offset, size)
                    self.cache.count_hit(block, slot, offset, len(data))
                    return data
        if not self.in_memory(node):
            return None
        return self.read(node, offset, size)  # answers or raises as every read does

    def in_memory(self, node: int) -> bool:
        """Whether a read of ``node`` is answered from memory now, without waiting on storage."""
        if node >= self.n_entries:
            return not self.control.is_block_file(self._ctl(node))  # a block file reads through the cache
        _kind, block, slot, _size, _crc = self.index.read_fields(node)  # Python ints: no NumPy scalar per read
        if self.retainer is not None and self.retainer.holds(block, slot):
            return True
        return self.cache.holds(block)

    def keep_pages(self, node: int) -> bool:
        """Whether the kernel may keep ``node``'s pages across opens, by the route's open mode: the control
        files always (their bytes are fixed; stats.json leads to a snapshot), the rest as the mode says."""
        mode = self.route.open_mode
        if node >= self.n_entries or mode in ("enosys", "keep_cache"):
            return True
        return mode == "targets" and self.keeps(node)

    def keeps(self, e: int) -> bool:
        """Whether the memory plan keeps entry ``e`` resident: a retained file, or anything when it all fits."""
        if self.retainer is not None:
            return self.retainer.is_target(int(self._block[e]), int(self._slot[e]))
        return self.plan is None or self.plan.fits

    def block_slot(self, e: int) -> tuple[int, int]:
        _kind, block, slot, _size, _crc = self.index.read_fields(e)
        return block, slot

    def block_of(self, entries: np.ndarray) -> np.ndarray:
        """The block of each file entry in ``entries``."""
        return self._block[entries]

    # --- the page-pushing hook (the kernel adapter's) ---------------------------------------------------
    def files_of_block(self, block: int) -> list[int]:
        """The file entries block ``block`` holds, in slot order."""
        off, files = self.ds.layout
        return files[int(off[block]) : int(off[block + 1])].tolist()

    def held(self, entries: np.ndarray) -> np.ndarray:
        """Those of dataset ``entries`` that have bytes and whose block is in memory now."""
        entries = entries[self._size[entries] > 0]
        blocks = self._block[entries]
        held = [b for b in np.unique(blocks).tolist() if self.cache.holds(b)]
        return entries[np.isin(blocks, held)]

    def pages(self, e: int) -> bytes | memoryview | None:
        """File ``e``'s bytes where they are in memory (verified): a view of its cached block (valid while held),
        else a copy of it from the retained files; None where neither holds it."""
        block, slot = self.block_slot(e)
        cached = self.cache.cached(block)
        if cached is not None:
            self.cache.note_pushed(block, slot)
            return cached.view(slot)
        return None if self.retainer is None else self.retainer.read_held(block, slot, count=False)

    def path_of(self, e: int) -> str:
        """A dataset entry's path, for messages."""
        return os.fsdecode(self.ds.path_of(e))

    # --- errors, serving, statistics ------------------------------------------------------------------
    def report(self, e: BaseException, doing: str = "a request") -> int:
        """The errno a failed request answers, and the error counted and logged as the error log says
        (anything unexpected logged with its traceback, then EIO)."""
        if isinstance(e, (CorruptBlockError, BlockReadError)):
            self.error_log.report(e)
        if isinstance(e, BlockfsError):
            return e.errno
        if isinstance(e, OSError):
            return e.errno or errno.EIO
        log.error("unexpected error in %s; answering EIO", doing, exc_info=e)
        return errno.EIO

    def start_serving(self, how: str, forget: Callable[[int, bytes, bytes], None] | None) -> None:
        """The mount answers requests now: say so, start dropping the stats snapshots the control directory
        no longer keeps from the kernel's cache (``forget(parent node, name, path)``, the route's way), and
        start the prefill."""
        log.info(
            "serving %s at %s (%s, open %s, cache %d bytes %s)",
            self.ds.location,
            self.mountpoint,
            how,
            self.route.open_mode,
            self.cache.budget_bytes,
            self.cache.policy_name,
        )
        threading.Thread(target=self._forget_loop, args=(forget,), name="blockfs-forget", daemon=True).start()
        if self.options.prefill:
            self.cache.start_prefill()
        if self.index.directory_checks is not None:  # the paths' checks a first mount left (core/directory_checks.py)
            self._checker = threading.Thread(target=self._finish_checks, name="blockfs-index-check", daemon=True)
            self._checker.start()

    def _finish_checks(self) -> None:
        """The index's deferred checks, whole, on this thread at the lowest priority (a training job's first
        requests come first), until the view closes; the index is recorded as checked once they pass."""
        with contextlib.suppress(OSError):  # Linux: this thread's own niceness
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)
        started = time.monotonic()
        if self.index.finish_checks(self._stopped):
            log.info(
                "the paths of the dataset's %s entries checked in %.2f s: every check of its contents passed%s",
                f"{self.n_entries:,}",
                time.monotonic() - started,
                ", and recorded: the next mount of it here skips them" if self.index.checks_recorded else "",
            )

    def _forget_loop(self, forget: Callable[[int, bytes, bytes], None] | None) -> None:
        while not self._stopped.wait(FORGET_INTERVAL_S):
            for path in self.control.take_evicted():
                parent, _, name = path.rpartition(b"/")
                if forget is not None:
                    forget(self.n_entries + self.control.node_of(parent), name, path)

    def close(self) -> None:
        self._stopped.set()
        if self._checker is not None:
            self._checker.join()  # before the dataset closes: it reads the index
        self.control.close()

    def stats(self) -> dict[str, Any]:
        """Everything ``blockfs stats`` shows: the mount, the dataset, the memory plan and the cache."""
        return mount_stats(self)


def mount_stats(view: MountView) -> dict[str, Any]:
    """:meth:`MountView.stats`, assembled from the view's parts and its route's counters."""
    ds, cache = view.ds, view.cache
    meta = ds.metadata
    dataset_bytes = int(meta["file_bytes"])
    budget = cache.budget_bytes
    out = {
        "mount": {
            "dest": ds.location,
            "mountpoint": view.mountpoint,
            "pid": os.getpid(),
            **view.route.facts,
            "threads": view.options.threads,
            "control": view.control.name,
            "started": view.started,
        },
        "dataset": {
            "digest": ds.digest,  # its name: what --expect and the loader's expect= pin
            "digests": ds.has_digests,  # False: checked against accidents (CRC-32) only
            "files": int(meta["n_files"]),
            "file_bytes": dataset_bytes,
            "blocks": int(meta["n_blocks"]),
            "block_bytes": int(meta["block_bytes"]),
            "paths_checked": _paths_checked(ds),
        },
        "plan": view.plan.to_dict()
        if view.plan is not None
        else {
            "budget_bytes": budget,
            "dataset_bytes": dataset_bytes,
            "fits": dataset_bytes <= budget,
            "expected_hit_rate": min(1.0, budget / dataset_bytes) if dataset_bytes else 1.0,
        },
        "retained": view.retainer.stats() if view.retainer is not None else None,
        **cache.stats(),
        "requests": {},
        "errors": view.error_log.stats(),
        "storage": ds.store.files.stats(),  # remote requests and the disk tier; {} for a local dataset
    }
    if view.route.stats is not None:
        out.update(view.route.stats())
    return out


def _paths_checked(ds: PackedDataset) -> str | dict[str, int]:
    """ "all" once every path passed (at open, or since: core/directory_checks.py), else how many directories
    passed on first use so far and how many were refused."""
    checks = ds.index.directory_checks
    if checks is None:
        return "all"
    return {"directories_passed": checks.checked_directories(), "directories_refused": checks.refused_directories()}
