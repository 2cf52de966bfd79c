"""``KernelFS``: the mount on the FUSE kernel protocol (:mod:`blockfs.serve.fuse.session`) — the default adapter.

A thin translation of :class:`blockfs.serve.view.MountView`'s answers into node ids and wire structures,
plus the three things only this route can do:

* **Node ids are index entries** (entry ``e`` is node ``e + 1``; the root is 1), so a request needs no path
  resolution, and a READ knows its file although ``open`` is never sent (answered ENOSYS, the kernel
  stops asking and keeps pages across opens; ``opendir`` likewise, so listings are cached too).
* **Listings are names only by default** (READDIR: ``--listing plain``): the kernel makes no inode for a
  listed entry, so a listing costs what a plain directory's does, and each file is looked up when first
  opened.  ``--listing plus`` answers READDIRPLUS instead: the kernel creates the inode of every listed
  entry, so a script that lists before it reads or stats (``os.walk`` then every file, ``ls -l``, ``du``)
  sends no LOOKUP at all, and listed files whose block is in memory are pushed (below); ``auto`` leaves
  the choice to the kernel.  Chosen by the whole pass, listing and reads (docs/benchmarks.md).  Either
  reply is packed from the index's columns for the slice of the directory it covers (NumPy rows, names
  from the path table): its cost is its own, at any offset of a directory of any size.
* **The node table is arrays** sized by the index (lookup counts, pushed flags): nothing per node, and a
  FORGET never takes a count below zero.
* **Loaded blocks are pushed into the page cache** (``FUSE_NOTIFY_STORE``): when a block is cached, every
  file of it whose node the kernel holds is written into that node's pages by one pusher thread, so the
  reads of those files never reach this process.  Files listed with attributes after their block loaded
  are pushed as they are listed (a listing comes long before the reads); a file merely looked up is not pushed, as its
  READ follows at once and would win the race.  Only bytes the store verified are pushed (the cache holds nothing else), and a push
  to a node the kernel has dropped is skipped.  Pushed pages are ordinary page cache: under memory
  pressure the kernel drops them and the reads come back here, served as before.

Reads whose bytes are in memory are answered by the reader thread that took them; any other read is
answered from a data thread, and so is the lookup of an empty file whose block's header is not in memory
(its only check: see ``_listable``), so no reader thread ever waits on storage and lookups, listings and the
control files never wait behind it.
"""

from __future__ import annotations

import errno
import functools
import logging
import os
import queue
import stat
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, ClassVar, Literal

import numpy as np

from ...errors import BlockfsError
from . import wire
from .session import DEFERRED, NO_REPLY, Session
from ..view import ROOT, MountView

log = logging.getLogger(__name__)

READER_THREADS = 2  # answer requests; measured by tools/bench/bench_fuse_routes.py (2 cores: more only contend)
DATA_THREADS = 64  # wait on storage for reads not in memory, one read each
CONTROL_NODES = 1 << 48  # control-directory nodes: this plus the control file's inode number
PUSH_RETRY_S = 0.05
FORGET_INTERVAL_S = 0.5  # how often dropped stats snapshots are dropped from the kernel's cache
INIT_FLAGS = (wire.ASYNC_READ | wire.NO_OPEN_SUPPORT | wire.NO_OPENDIR_SUPPORT
              | wire.PARALLEL_DIROPS | wire.MAX_PAGES)  # fmt: skip
# --listing (MountOptions.listing): the INIT flags that make the kernel send READDIR (plain), READDIRPLUS
# (plus) or READDIRPLUS for a directory's first request and after lookups in it (auto, the kernel's heuristic).
LISTING_FLAGS = {"plain": 0, "plus": wire.DO_READDIRPLUS, "auto": wire.DO_READDIRPLUS | wire.READDIRPLUS_AUTO}
# Not CACHE_SYMLINKS: stats.json is a link resolved anew at every open (serve/control/control_dir.py).


def answers(method: Callable) -> Callable:
    """Turn blockfs errors into their errno (logged and counted as the error log says)."""

    @functools.wraps(method)
    def call(self: "KernelFS", nodeid: int, body: memoryview, unique: int) -> Any:
        try:
            return method(self, nodeid, body, unique)
        except Exception as e:
            if not isinstance(e, (OSError, BlockfsError)):
                log.exception("unexpected error in %s of node %d; answering EIO", method.__name__, nodeid)
            raise OSError(self.view.report(e), str(e)) from None

    return call


class KernelFS:
    """The kernel-protocol adapter of one mounted dataset."""

    route: ClassVar[Literal["kernel"]] = "kernel"

    def __init__(self, view: MountView) -> None:
        self.view = view
        self.control = view.control
        self._valid = int(view.options.timeout_s)
        # The node table: arrays sized by the index, nothing per node (node id = entry + 1).
        n = view.index.n_entries
        self._lookups = np.zeros(n, dtype=np.int64)  # the kernel's lookup count of each entry's node
        self._lookup_counts = self._lookups.data  # the same counts, one at a time: no NumPy scalar
        self._pushed = np.zeros(n, dtype=np.uint8)  # 1: this entry's pages were pushed and the kernel may still hold them
        self._nodes = threading.Lock()  # lookup counts move in several reader threads
        self._control_nodes: dict[int, list] = {}  # node -> [path, lookups]
        self._control_lock = threading.Lock()
        self._data = ThreadPoolExecutor(max_workers=DATA_THREADS, thread_name_prefix="blockfs-data")
        self._pushes: queue.SimpleQueue = queue.SimpleQueue()
        self.pushed = {"files_pushed": 0, "bytes_pushed": 0, "pushes_skipped": 0, "push_errors": 0}
        self.stopped = threading.Event()
        self.served = False
        # enosys (the default): no OPEN at all, pages kept across opens.  The other modes answer OPEN to
        # say per file whether the kernel may keep its pages (--open-mode, as on the libfuse routes).
        self.open_mode = view.options.open_mode_for(3)
        flags = INIT_FLAGS if self.open_mode == "enosys" else INIT_FLAGS & ~wire.NO_OPEN_SUPPORT
        self.listing = view.options.listing
        flags |= LISTING_FLAGS[self.listing]
        self.session = Session(self._handlers(), on_init=lambda minor, kernel_flags: flags)
        view.adapter = {"binding": "kernel", "open_mode": self.open_mode, "listing": self.listing}
        view.extra_stats = self._stats
        self._pushing = self.open_mode in ("enosys", "keep_cache")  # pages kept: pushing them pays off
        if self._pushing:
            view.cache.on_load = lambda block, cached: self._pushes.put(("block", block))
        layout_off, layout_files = view.ds.layout
        self._block_off, self._block_files = layout_off, layout_files
        self._size = view.index.arrays["size"]

    # --- life cycle ----------------------------------------------------------------------------------
    def run(self, mountpoint: str, fsname: str, fuse_options: list[str]) -> None:
        """Mount and serve until unmounted (or SIGINT/SIGTERM); blocks."""
        if self.view.options.allow_other:
            fuse_options = [*fuse_options, "allow_other"]
        self.session.mount(mountpoint, fsname, "blockfs", fuse_options)
        threading.Thread(target=self._push_loop, name="blockfs-push", daemon=True).start()
        try:
            self.session.serve(READER_THREADS if self.view.options.threads else 1, on_ready=self._ready)
        finally:
            self.stopped.set()
            self._pushes.put(None)
            self._data.shutdown(wait=False, cancel_futures=True)

    def _ready(self) -> None:
        self.served = True
        view = self.view
        log.info("serving %s at %s (kernel protocol 7.%d, open %s, cache %d bytes %s)", view.ds.location,
                 view.mountpoint, self.session.minor, self.open_mode, view.cache.budget_bytes,
                 view.cache.policy_name)  # fmt: skip
        threading.Thread(target=self._forget_loop, name="blockfs-forget", daemon=True).start()
        if view.options.prefill:
            view.cache.start_prefill()

    def _handlers(self) -> dict[int, Callable]:
        refuse = self._refuse
        return {
            wire.LOOKUP: self.lookup, wire.GETATTR: self.getattr, wire.READDIRPLUS: self.readdirplus,
            wire.READDIR: self.readdir, wire.READ: self.read, wire.READLINK: self.readlink,
            wire.GETXATTR: self.getxattr, wire.LISTXATTR: self.listxattr, wire.STATFS: self.statfs,
            wire.FORGET: self.forget, wire.BATCH_FORGET: self.batch_forget, wire.SETATTR: refuse,
            wire.DESTROY: self.destroy, **({wire.OPEN: self.open} if self.open_mode != "enosys" else {}),
        }  # fmt: skip
        # Everything else (OPEN, OPENDIR, FLUSH, RELEASE, ACCESS, INTERRUPT, LSEEK, locks) is answered
        # ENOSYS by the session, which the kernel remembers: it stops sending them.

    # --- nodes -----------------------------------------------------------------------------------------
    def _control_path(self, nodeid: int) -> bytes:
        with self._control_lock:
            known = self._control_nodes.get(nodeid)
        if known is None:
            raise OSError(errno.ESTALE, "unknown control node")
        return known[0]

    def _control_entry(self, path: bytes) -> bytes:
        """The entry of a control path, its node remembered (one more lookup by the kernel)."""
        st = self.control.getattr(path)
        node = CONTROL_NODES + st["st_ino"]
        with self._control_lock:
            known = self._control_nodes.setdefault(node, [path, 0])
            known[1] += 1
        return wire.entry_out(node, self._control_attr(st), self._valid)

    def _control_attr(self, st: dict) -> bytes:
        return wire.attr(st["st_ino"], st["st_size"], st["st_mode"], st["st_nlink"], st["st_mtime"],
                         self.view.uid, self.view.gid)  # fmt: skip

    def _attr(self, e: int) -> bytes:
        a = self.view.attr(e)
        return wire.attr(a.ino, a.size, a.mode, a.nlink, a.mtime_ns, self.view.uid, self.view.gid)

    def lookups(self, nodeid: int) -> int:
        """The kernel's lookup count of a dataset node, as this server keeps it (0: the kernel holds no inode)."""
        return int(self._lookups[nodeid - 1]) if 0 < nodeid <= len(self._lookups) else 0

    def _entry(self, e: int) -> bytes:
        """The entry of dataset entry ``e``, counted as a lookup by the kernel."""
        with self._nodes:
            self._lookup_counts[e] += 1
        a = self.view.attr(e)
        return wire.entry(e + 1, self._valid, a.ino, a.size, a.mode, a.nlink, a.mtime_ns, self.view.uid, self.view.gid)

    # --- metadata ---------------------------------------------------------------------------------------
    @answers
    def lookup(self, nodeid: int, body: memoryview, unique: int) -> Any:
        name = bytes(body[: len(body) - 1])  # NUL-terminated
        if nodeid >= CONTROL_NODES:
            return self._control_entry(self._control_path(nodeid) + b"/" + name)
        parent = nodeid - 1
        if parent == ROOT and name == self.view.control_name:
            return self._control_entry(self.control.path)
        e = self.view.child(parent, name)
        if e < 0:
            return wire.negative_entry(self._valid)
        if not self.view.check_present(e, wait=False):  # an empty file whose block's header is not in memory
            self._data.submit(self._answer_later, unique, self._checked_entry, e)
            return DEFERRED
        return self._checked_entry(e, checked=True)

    def _checked_entry(self, e: int, checked: bool = False) -> bytes:
        """The lookup's answer for ``e``, checked present first (on a data thread when that waits on storage)."""
        if not checked:
            self.view.check_present(e)
        # No push here: the READ that follows a lookup reaches this process before a push from another thread
        # could land (measured: 97-99 % of them did), so pushing would only add work to every lookup.
        return self._entry(e)

    @answers
    def getattr(self, nodeid: int, body: memoryview, unique: int) -> bytes:
        if nodeid >= CONTROL_NODES:
            return wire.attr_out(self._control_attr(self.control.getattr(self._control_path(nodeid))), self._valid)
        return wire.attr_out(self._attr(nodeid - 1), self._valid)

    @answers
    def readdirplus(self, nodeid: int, body: memoryview, unique: int) -> bytes:
        return self._list(nodeid, body, plus=True)

    @answers
    def readdir(self, nodeid: int, body: memoryview, unique: int) -> bytes:
        return self._list(nodeid, body, plus=False)

    def _list(self, nodeid: int, body: memoryview, plus: bool) -> bytes:
        """Entries from the request's offset on, as many as fit: "." and ".." are offsets 0 and 1, the
        children follow; each entry's offset is the next one's (never 0).

        The children's records are packed from the index's columns for just the slice this request
        covers (a directory's children are one run of entries): a reply costs the same at any offset of
        any directory, and no Python object is made per entry."""
        _fh, offset, size, _flags = wire.READ_IN.unpack_from(body)
        if nodeid >= CONTROL_NODES:
            return self._list_control(self._control_path(nodeid), offset, size, plus)
        e = nodeid - 1
        if not self.view.is_dir(e):
            raise OSError(errno.ENOTDIR, "not a directory")
        kids = self.view.children(e)
        head = self._dots(e, offset, size, plus)
        if offset + len(head) < 2:
            return b"".join(head)  # not even "." and ".." fit
        first = kids.start + max(0, offset - 2)  # the first child entry to send
        room = size - sum(map(len, head))
        stop = min(kids.stop, first + room // (wire.record_width(plus) + 8))
        if stop <= first:
            return b"".join(head)
        table, start, length = self.view.name_spans(e, first, stop)
        stop = first + int(np.searchsorted(wire.record_ends(length, plus), room, side="right"))
        start, length = start[: stop - first], length[: stop - first]
        a = self.view.attrs(first, stop)
        next_offset = np.arange(first - kids.start + 3, stop - kids.start + 3, dtype=np.uint64)
        if not plus:
            dirents = wire.dirent_rows(a["ino"], next_offset, length, a["mode"])
            return b"".join(head) + wire.records(dirents, table, start, length)
        rows = np.zeros(stop - first, dtype=wire.DIRENTPLUS_ROW)
        wire.dirent_rows(a["ino"], next_offset, length, a["mode"], out=rows["dirent"])
        entry = rows["entry"]  # a view: the fields below are written into rows
        wire.attr_rows(a["ino"], a["size"], a["mode"], a["nlink"], a["mtime_ns"], self.view.uid, self.view.gid,
                       out=entry["attr"])  # fmt: skip
        entry["nodeid"] = np.arange(first + 1, stop + 1, dtype=np.uint64)
        entry["entry_valid"] = entry["attr_valid"] = self._valid
        linked = self._linkable(first, a)
        if not linked.all():
            # Node id 0 and no attributes where the check of an empty file failed: the kernel counts no
            # lookup for that entry and will LOOKUP it, and the lookup answers the error.
            entry[~linked] = np.zeros((), dtype=wire.ENTRY_OUT_ROW)
        reply = b"".join(head) + wire.records(rows, table, start, length)
        with self._nodes:
            self._lookups[first:stop] += linked
        self._push_listed(first, stop, linked)
        return reply

    def _dots(self, e: int, offset: int, size: int, plus: bool) -> list[bytes]:
        """The records of "." and ".." from ``offset`` on that fit in ``size`` (node id 0 in a listing
        with attributes: the kernel looks neither up)."""
        out: list[bytes] = []
        used = 0
        for i in range(offset, 2):
            a = self.view.attr(e if i == 0 else self.view.parent(e))
            name = b"." if i == 0 else b".."
            one = (wire.direntplus(wire.negative_entry(0), a.ino, i + 1, name, a.mode) if plus
                   else wire.dirent(a.ino, i + 1, name, a.mode))  # fmt: skip
            if used + len(one) > size:
                break
            out.append(one)
            used += len(one)
        return out

    def _linkable(self, first: int, a: np.ndarray) -> np.ndarray:
        """Which of entries ``first``, ``first + 1``... (``a``: their :meth:`MountView.attrs`) a listing may
        give with attributes: all but the empty files :meth:`_listable` refuses."""
        linked = np.ones(len(a), dtype=bool)
        empty = np.flatnonzero((a["size"] == 0) & ((a["mode"] & 0o170000) == stat.S_IFREG))
        for i in empty.tolist():
            linked[i] = self._listable(first + i, 0)
        return linked

    def _listable(self, e: int, size: int) -> bool:
        """Whether a listing may give ``e``'s attributes: an empty file only once its block confirms it
        (the kernel never reads a file of size 0, so a size zeroed in a forged index must not get there).
        Confirmed from memory only: where that would wait on storage the entry goes without attributes, and
        the kernel's LOOKUP of it checks it on a data thread (a listing never waits on a store)."""
        if size:
            return True
        try:
            return self.view.check_present(e, wait=False)
        except Exception as err:  # noqa: BLE001 - answered by the lookup the kernel will send instead
            self.view.report(err)
            return False

    def _list_control(self, path: bytes, offset: int, size: int, plus: bool) -> bytes:
        out: list[bytes] = []
        used = 0
        entries = self.control.readdir(path)
        for i in range(offset, len(entries)):
            name, mode, ino = entries[i]
            raw = os.fsencode(name)
            if plus:
                entry = wire.negative_entry(0) if i < 2 else self._control_entry(path + b"/" + raw)
                one = wire.direntplus(entry, ino, i + 1, raw, mode)
            else:
                one = wire.dirent(ino, i + 1, raw, mode)
            if used + len(one) > size:
                if plus and i >= 2:  # taken back: this entry is not sent, so the kernel counts no lookup
                    self._forget_control(CONTROL_NODES + ino, 1)
                break
            out.append(one)
            used += len(one)
        return b"".join(out)

    @answers
    def readlink(self, nodeid: int, body: memoryview, unique: int) -> bytes:
        if nodeid >= CONTROL_NODES:
            return self.control.readlink(self._control_path(nodeid))
        return self.view.readlink(nodeid - 1)

    @answers
    def getxattr(self, nodeid: int, body: memoryview, unique: int) -> bytes:
        size, _ = wire.GETXATTR_IN.unpack_from(body)
        name = bytes(body[wire.GETXATTR_IN.size :]).split(b"\0", 1)[0].decode("utf-8", "surrogateescape")
        value: bytes | None
        if nodeid >= CONTROL_NODES:
            value = self.control.getxattr(self._control_path(nodeid), name)
        else:
            value = self.view.xattrs(nodeid - 1).get(name)
            if value is None:
                raise OSError(errno.ENODATA, "no such attribute")
        return self._sized(value, size)

    @answers
    def listxattr(self, nodeid: int, body: memoryview, unique: int) -> bytes:
        size, _ = wire.GETXATTR_IN.unpack_from(body)
        if nodeid >= CONTROL_NODES:
            names = self.control.listxattr(self._control_path(nodeid))
        else:
            names = list(self.view.xattrs(nodeid - 1))
        return self._sized(b"".join(n.encode() + b"\0" for n in names), size)

    @staticmethod
    def _sized(value: bytes, size: int) -> bytes:
        """An xattr answer: its length when asked with size 0, ERANGE when it does not fit."""
        if size == 0:
            return wire.GETXATTR_OUT.pack(len(value), 0)
        if len(value) > size:
            raise OSError(errno.ERANGE, "attribute larger than the buffer")
        return value

    @answers
    def statfs(self, nodeid: int, body: memoryview, unique: int) -> bytes:
        blocks, files = self.view.statfs()
        return wire.kstatfs(blocks, files)

    def _refuse(self, nodeid: int, body: memoryview, unique: int) -> bytes:
        raise OSError(errno.EROFS, "read-only")

    def destroy(self, nodeid: int, body: memoryview, unique: int) -> bytes:
        self.stopped.set()
        return b""

    # --- forgetting -------------------------------------------------------------------------------------
    def forget(self, nodeid: int, body: memoryview, unique: int) -> object:
        (count,) = wire.FORGET_IN.unpack_from(body)
        if nodeid >= CONTROL_NODES:
            self._forget_control(nodeid, count)
        elif 0 < nodeid <= len(self._lookups):
            e = nodeid - 1
            with self._nodes:
                left = max(0, int(self._lookups[e]) - count)  # never below 0, whatever the kernel sends
                self._lookups[e] = left
                if not left:
                    self._pushed[e] = 0  # the kernel dropped the inode, and its pages with it
        return NO_REPLY

    def batch_forget(self, nodeid: int, body: memoryview, unique: int) -> object:
        rows = wire.forgets(body)
        node, count = rows["nodeid"], rows["nlookup"]
        control = node >= CONTROL_NODES
        for one, n in zip(node[control].tolist(), count[control].tolist()):
            self._forget_control(one, n)
        mine = (node >= 1) & (node <= len(self._lookups))
        e = node[mine].astype(np.int64) - 1
        dropped = np.minimum(count[mine], 1 << 62).astype(np.int64)
        with self._nodes:
            np.subtract.at(self._lookups, e, dropped)  # .at: a node twice in one batch loses both counts
            gone = e[self._lookups[e] <= 0]
            self._lookups[gone] = 0
            self._pushed[gone] = 0
        return NO_REPLY

    def _forget_control(self, node: int, count: int) -> None:
        with self._control_lock:
            known = self._control_nodes.get(node)
            if known is not None:
                known[1] -= count
                if known[1] <= 0:
                    del self._control_nodes[node]

    def _forget_loop(self) -> None:
        """Drop the stats snapshots the control directory no longer keeps from the kernel's cache."""
        while not self.stopped.wait(FORGET_INTERVAL_S):
            for path in self.control.take_evicted():
                parent, _, name = path.rpartition(b"/")
                with self._control_lock:
                    nodes = [n for n, (p, _c) in self._control_nodes.items() if p == parent]
                for node in nodes:
                    self.session.forget_name(node, name)

    # --- data -------------------------------------------------------------------------------------------
    @answers
    def open(self, nodeid: int, body: memoryview, unique: int) -> bytes:
        """Only with ``--open-mode`` other than enosys: whether the kernel keeps this file's pages."""
        if nodeid >= CONTROL_NODES or self.open_mode == "keep_cache":
            keep = True  # every control file's bytes are fixed (stats.json leads to a snapshot)
        elif self.open_mode == "targets":
            keep = self.view.keeps(nodeid - 1)
        else:
            keep = False
        return wire.OPEN_OUT.pack(0, wire.FOPEN_KEEP_CACHE if keep else 0, 0)

    @answers
    def read(self, nodeid: int, body: memoryview, unique: int) -> Any:
        _fh, offset, size, _flags = wire.READ_IN.unpack_from(body)
        if nodeid >= CONTROL_NODES:
            path = self._control_path(nodeid)
            if self.control.is_block_file(path):  # read through the cache: may wait on storage
                self._data.submit(self._answer_later, unique, self.control.read, path, size, offset)
                return DEFERRED
            return self.control.read(path, size, offset)
        e = nodeid - 1
        if self.view.in_memory(e):
            data = self.view.read(e, offset, size)
            if not offset and len(data) < size:
                # The whole file went to the kernel's pages with this answer: a push when its block loads
                # would only copy it there again.
                self._pushed[e] = 1
            return data
        self._data.submit(self._answer_later, unique, self.view.read, e, offset, size)
        return DEFERRED

    def _answer_later(self, unique: int, read: Callable, *args: Any) -> None:
        try:
            data = read(*args)
        except Exception as e:
            if not isinstance(e, (OSError, BlockfsError)):
                log.exception("unexpected error reading %r; answering EIO", args)
            self.session.fail(unique, self.view.report(e))
            return
        self.session.reply(unique, data)

    # --- pushing pages ------------------------------------------------------------------------------------
    def _push_listed(self, first: int, stop: int, linked: np.ndarray) -> None:
        """Queue pushes of the entries ``first..stop-1`` a listing with attributes gave (``linked``) whose
        blocks are already in memory (a listing comes long before the reads; with ``--listing plus`` only)."""
        if not self._pushing:
            return
        wanted = first + np.flatnonzero(linked & (self._pushed[first:stop] == 0) & (self._size[first:stop] > 0))
        if not wanted.size:
            return
        blocks = self.view.block_of(wanted)
        held = [b for b in np.unique(blocks).tolist() if self.view.cache.holds(b)]
        wanted = wanted[np.isin(blocks, held)]
        if wanted.size:
            self._pushes.put(("entries", wanted.tolist()))

    def _push_loop(self) -> None:
        """The one thread that writes into the kernel's page cache (never a reader thread: see session).

        A push can reach the kernel before the answer that told it of the node (the lookup or listing is
        answered after it queued the push): the kernel then says ENOENT, and the push is tried once more
        :data:`PUSH_RETRY_S` later."""
        retry: list[int] = []
        while True:
            try:
                job = self._pushes.get(timeout=PUSH_RETRY_S if retry else None)
            except queue.Empty:
                job, retry = ("again", retry), []
            if job is None or self.stopped.is_set():
                return
            kind, what = job
            try:
                if kind == "block":
                    lo, hi = int(self._block_off[what]), int(self._block_off[what + 1])
                    retry += self._push(self._block_files[lo:hi].tolist())
                elif kind == "entries":
                    retry += self._push(what)
                else:
                    self.pushed["pushes_skipped"] += len(self._push(what))
            except Exception:
                self.pushed["push_errors"] += 1
                log.exception("pushing pages into the kernel's cache failed; reads are served as usual")

    def _push(self, entries: list[int]) -> list[int]:
        """Push each entry the kernel holds and has not been pushed; the ones the kernel refused."""
        refused = []
        cache, counts = self.view.cache, self.pushed
        lookups, pushed, store = self._lookups, self._pushed, self.session.store
        for e in entries:
            if pushed[e] or lookups[e] <= 0:
                continue
            block, slot = self.view.block_slot(e)
            cached = cache.cached(block)
            if cached is None:
                continue
            data = cached.view(slot)
            if not len(data):
                continue
            try:
                stored = store(e + 1, data)
            except Exception as err:  # noqa: BLE001 - this file only: the others of the job are still pushed
                pushed[e] = 1  # not tried again while the kernel holds the node: its reads come here
                self._push_failed(e, err)
                continue
            if stored:
                pushed[e] = 1
                counts["files_pushed"] += 1
                counts["bytes_pushed"] += len(data)
            else:
                refused.append(e)
        return refused

    def _push_failed(self, e: int, err: Exception) -> None:
        """Count a file the kernel would not take; say so once a mount (its reads are served as usual)."""
        self.pushed["push_errors"] += 1
        if self.pushed["push_errors"] == 1:
            path = os.fsdecode(self.view.ds.path_of(e))
            log.warning("pushing %s into the page cache failed: %s; its reads are served as usual (later "
                        "failures are counted in page_cache.push_errors)", path, err)  # fmt: skip
        else:
            log.debug("pushing entry %d into the page cache failed: %s", e, err)

    # --- statistics -------------------------------------------------------------------------------------
    def _stats(self) -> dict[str, Any]:
        requests = {wire.OPCODE_NAMES.get(op, str(op)): n for op, n in list(self.session.requests.items())}
        return {"requests": requests, "page_cache": dict(self.pushed)}
