"""``KernelFS``: the mount on the FUSE kernel protocol (:mod:`blockfs.serve.fuse.session`) — the default adapter.

A translation of :class:`blockfs.serve.view.MountView`'s namespace into node ids and wire structures,
plus the three things only this route can do:

* **Node ids are the view's nodes** (node ``n`` is node id ``n + 1``; the root is 1), so a request needs no
  path resolution, and a READ knows its file although ``open`` is never sent (answered ENOSYS, the kernel
  stops asking and keeps pages across opens; ``opendir`` likewise, so listings are cached too).
* **Listings are names only by default** (READDIR: ``--listing plain``): the kernel makes no inode for a
  listed entry, so a listing costs what a plain directory's does, and each file is looked up when first
  opened.  ``--listing plus`` answers READDIRPLUS instead: the kernel creates the inode of every listed
  entry, so a script that lists before it reads or stats (``os.walk`` then every file, ``ls -l``, ``du``)
  sends no LOOKUP at all, and listed files whose block is in memory are pushed (below); ``auto`` leaves
  the choice to the kernel.  Chosen by the whole pass, listing and reads (docs/benchmarks.md).  Either
  reply is packed from the index's columns for the slice of the directory it covers (NumPy rows, names
  from the path table): its cost is its own, at any offset of a directory of any size.
* **The node table is arrays** sized by the view's entries (lookup counts, pushed flags): nothing per
  node, and a FORGET never takes a count below zero.
* **Loaded blocks are pushed into the page cache** (``FUSE_NOTIFY_STORE``): when a block is cached, every
  file of it whose node the kernel holds is written into that node's pages by one pusher thread, so the
  reads of those files never reach this process.  Files listed after their block loaded are pushed as
  they are listed, and a file opened by CPython < 3.14's ``open()`` at its isatty ioctl, answered only once
  its pages are in, so its first read is not sent (:mod:`blockfs.serve.fuse.page_pusher`); retained files
  are pushed as block files are.  Only bytes the store verified are pushed, and
  a push to a node the kernel has dropped is skipped.  Pushed pages are ordinary page cache: under memory
  pressure the kernel drops them and the reads come back here, served as before.

Reads whose bytes are in memory are answered by the reader thread that took them; any other read is
answered from a data thread, and so is the lookup of an empty file whose block's header is not in memory
(its only check: see :meth:`blockfs.serve.fuse.dir_replies.DirReplies.listable`), so no reader thread ever
waits on storage and lookups and listings never wait behind it.  The listing replies are packed by
:mod:`blockfs.serve.fuse.dir_replies`.
"""

from __future__ import annotations

import errno
import functools
import logging
import queue
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, ClassVar, Literal

import numpy as np

from ...errors import MountError
from ..mount_options import MountOptions
from ..view import MountView, Route
from . import wire
from .dir_replies import LOOKUP_MAX, DirReplies
from .page_pusher import PagePusher
from .session import DEFERRED, NO_REPLY, Session

log = logging.getLogger(__name__)

# One reader thread: every request is answered from memory or handed to a data thread (none waits on storage),
# so a second reader only passes the GIL back and forth with the first (and the pusher) at every request: one
# cost less server CPU per file in most runs, up to a third (docs/benchmarks.md, "The GIL's hand-offs").
READER_THREADS = 1
DATA_THREADS = 64  # wait on storage for reads not in memory, one read each
INIT_FLAGS = wire.ASYNC_READ | wire.NO_OPEN_SUPPORT | wire.NO_OPENDIR_SUPPORT | wire.PARALLEL_DIROPS | wire.MAX_PAGES
# --listing (MountOptions.listing): the INIT flags that make the kernel send READDIR (plain), READDIRPLUS
# (plus) or READDIRPLUS for a directory's first request and after lookups in it (auto, the kernel's heuristic).
LISTING_FLAGS = {"plain": 0, "plus": wire.DO_READDIRPLUS, "auto": wire.DO_READDIRPLUS | wire.READDIRPLUS_AUTO}
# Not CACHE_SYMLINKS: a link of the view may lead somewhere new at every open (the statistics' snapshots).


def answers(method: Callable) -> Callable:
    """Turn blockfs errors into their errno (logged and counted as the view's error mapping says)."""

    @functools.wraps(method)
    def call(self: KernelFS, nodeid: int, body: memoryview, unique: int) -> Any:
        try:
            return method(self, nodeid, body, unique)
        except Exception as e:
            raise OSError(self.view.report(e, f"{method.__name__} of node {nodeid}"), str(e)) from None

    return call


class KernelFS:
    """The kernel-protocol adapter of one mount: ``build`` makes the mount's view, given what this route
    brings (:class:`blockfs.serve.view.Route`)."""

    route: ClassVar[Literal["kernel"]] = "kernel"

    def __init__(self, options: MountOptions, build: Callable[[Route], MountView]) -> None:
        self.options = options
        self._valid = int(options.timeout_s)
        # enosys (the default): no OPEN at all, pages kept across opens.  The other modes answer OPEN to
        # say per file whether the kernel may keep its pages (--open-mode, as on the libfuse routes).
        self.open_mode = options.open_mode_for(3)
        self.stopped = threading.Event()
        self.served = False
        pushes: queue.SimpleQueue = queue.SimpleQueue()
        pushing = self.open_mode in ("enosys", "keep_cache")  # pages kept: pushing them pays off
        self.view = build(
            Route(
                {"binding": "kernel", "open_mode": self.open_mode, "listing": options.listing},
                self.open_mode,
                stats=self._stats,
                on_load=(lambda block: pushes.put(("block", block))) if pushing else None,
            )
        )
        # The node table: arrays sized by the view's entries, nothing per node (node id = node + 1); the
        # view's nodes past them carry no per-node state.
        self._n = self.view.n_entries
        # The kernel's lookup count of each node: 32 bits (4 bytes a file of the server's own memory, not 8),
        # held at LOOKUP_MAX rather than wrapped; a count held there only keeps its node's pages believed
        # cached (the kernel's own count is 64-bit: 2**31 lookups of one name without a FORGET do not come).
        self._lookups = np.zeros(self._n, dtype=np.int32)
        self._lookup_counts = self._lookups.data  # the same counts, one at a time: no NumPy scalar
        self._nodes = threading.Lock()  # lookup counts move in the reader thread and the data threads
        self._negative = wire.negative_entry(self._valid)  # "no such name": the same bytes every time
        self._uid, self._gid = self.view.uid, self.view.gid
        self._data = ThreadPoolExecutor(max_workers=DATA_THREADS, thread_name_prefix="blockfs-data")
        self.pusher = PagePusher(
            self.view,
            pushes,
            self._lookups,
            self._store,
            self.stopped,
            enabled=pushing,
            answer_ioctl=lambda unique: self.session.fail(unique, errno.ENOTTY),
        )
        self._pushed_flags = self.pusher.pushed.data  # the same flags, one at a time: no NumPy scalar
        self._replies = DirReplies(self.view, self._valid, self._lookups, self._nodes, self.pusher)
        flags = INIT_FLAGS if self.open_mode == "enosys" else INIT_FLAGS & ~wire.NO_OPEN_SUPPORT
        self.listing = options.listing
        flags |= LISTING_FLAGS[self.listing]
        # A file's isatty ioctl at open goes to the pusher while its pages are not in the kernel: pushed, then
        # answered, so the read that follows is not sent (page_pusher).
        self.session = Session(self._handlers(), on_init=lambda minor, kernel_flags: flags, on_ioctl=self.pusher.opened)

    # --- life cycle ----------------------------------------------------------------------------------
    def run(self, mountpoint: str, fsname: str) -> None:
        """Mount and serve until unmounted (or SIGINT/SIGTERM); blocks.  MountError if it cannot mount."""
        fuse_options = [item for opt in self.options.fuse_options for item in filter(None, opt.split(","))]
        if self.options.allow_other:
            fuse_options.append("allow_other")
        try:
            self.session.mount(mountpoint, fsname, "blockfs", fuse_options)
            threading.Thread(target=self.pusher.run, name="blockfs-push", daemon=True).start()
            self.session.serve(READER_THREADS, on_ready=self._ready)
        except OSError as e:
            if not self.served:
                raise MountError(f"cannot mount {mountpoint!r}: {e.strerror or e}") from e
            raise
        finally:
            self.stopped.set()
            self.pusher.jobs.put(None)
            self._data.shutdown(wait=False, cancel_futures=True)

    def _ready(self) -> None:
        self.served = True
        self.view.start_serving(f"kernel protocol 7.{self.session.minor}", self._forget_name)

    def _forget_name(self, parent: int, name: bytes, path: bytes) -> None:
        self.session.forget_name(parent + 1, name)

    def _store(self, nodeid: int, data: Any) -> bool:
        return self.session.store(nodeid, data)

    def _handlers(self) -> dict[int, Callable]:
        refuse = self._refuse
        return {
            wire.LOOKUP: self.lookup,
            wire.GETATTR: self.getattr,
            wire.READDIRPLUS: self.readdirplus,
            wire.READDIR: self.readdir,
            wire.READ: self.read,
            wire.READLINK: self.readlink,
            wire.GETXATTR: self.getxattr,
            wire.LISTXATTR: self.listxattr,
            wire.STATFS: self.statfs,
            wire.FORGET: self.forget,
            wire.BATCH_FORGET: self.batch_forget,
            wire.SETATTR: refuse,
            wire.DESTROY: self.destroy,
            **({wire.OPEN: self.open} if self.open_mode != "enosys" else {}),
        }
        # Everything else (OPEN, OPENDIR, FLUSH, RELEASE, ACCESS, INTERRUPT, LSEEK, locks) is answered
        # ENOSYS by the session, which the kernel remembers: it stops sending them.

    # --- nodes -----------------------------------------------------------------------------------------
    def _attr(self, node: int) -> bytes:
        a = self.view.attr(node)
        return wire.attr(a.ino, a.size, a.mode, a.nlink, a.mtime_ns, self.view.uid, self.view.gid)

    def lookups(self, nodeid: int) -> int:
        """The kernel's lookup count of a node, as this server keeps it (0: the kernel holds no inode)."""
        return int(self._lookups[nodeid - 1]) if 0 < nodeid <= self._n else 0

    def _entry(self, node: int) -> bytes:
        """The entry of ``node``, counted as a lookup by the kernel."""
        if node < self._n:
            with self._nodes:
                counts = self._lookup_counts
                if counts[node] < LOOKUP_MAX:
                    counts[node] += 1
        a = self.view.attr(node)
        return wire.entry(
            node + 1, self._valid, a.ino, a.size, a.mode, a.nlink, a.mtime_ns, self.view.uid, self.view.gid
        )

    # --- metadata ---------------------------------------------------------------------------------------
    def lookup(self, nodeid: int, body: memoryview, unique: int) -> Any:
        # The hottest request with READ (a file read from a list is one of each): one call for the node, one
        # for its attributes, the reply packed straight from them (errors mapped as @answers maps them).
        try:
            node = self.view.child(nodeid - 1, bytes(body[: len(body) - 1]))  # NUL-terminated
            if node < 0:
                return self._negative
            a = self.view.entry_attr(node)
        except Exception as e:
            raise OSError(self.view.report(e, f"lookup of node {nodeid}"), str(e)) from None
        if a is None:  # an empty file whose block's header is not in memory: checked on a data thread
            self._data.submit(self._answer_later, unique, self._checked_entry, node)
            return DEFERRED
        if node < self._n:
            with self._nodes:
                counts = self._lookup_counts
                if counts[node] < LOOKUP_MAX:  # held at the most, never wrapped (as _entry and listings hold it)
                    counts[node] += 1
        ino, size, mode, nlink, mtime_ns = a
        return wire.entry(node + 1, self._valid, ino, size, mode, nlink, mtime_ns, self._uid, self._gid)

    def _checked_entry(self, node: int) -> bytes:
        """The lookup's answer for ``node``, checked present first (on a data thread: that waits on storage)."""
        self.view.check_present(node)
        # No push here: the READ that follows a lookup reaches this process before a push from another thread
        # could land (measured: 97-99 % of them did), so pushing would only add work to every lookup.
        return self._entry(node)

    @answers
    def getattr(self, nodeid: int, body: memoryview, unique: int) -> bytes:
        return wire.attr_out(self._attr(nodeid - 1), self._valid)

    @answers
    def readdirplus(self, nodeid: int, body: memoryview, unique: int) -> bytes:
        return self._replies.reply(nodeid, body, plus=True)

    @answers
    def readdir(self, nodeid: int, body: memoryview, unique: int) -> bytes:
        return self._replies.reply(nodeid, body, plus=False)

    @answers
    def readlink(self, nodeid: int, body: memoryview, unique: int) -> bytes:
        return self.view.readlink(nodeid - 1)

    @answers
    def getxattr(self, nodeid: int, body: memoryview, unique: int) -> bytes:
        size, _ = wire.GETXATTR_IN.unpack_from(body)
        name = bytes(body[wire.GETXATTR_IN.size :]).split(b"\0", 1)[0].decode("utf-8", "surrogateescape")
        return self._sized(self.view.getxattr(nodeid - 1, name), size)

    @answers
    def listxattr(self, nodeid: int, body: memoryview, unique: int) -> bytes:
        size, _ = wire.GETXATTR_IN.unpack_from(body)
        names = self.view.listxattr(nodeid - 1)
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
        if 0 < nodeid <= self._n:
            e = nodeid - 1
            with self._nodes:
                left = max(0, self._lookup_counts[e] - count)  # never below 0, whatever the kernel sends
                self._lookup_counts[e] = left
                if not left:
                    self._pushed_flags[e] = 0  # the kernel dropped the inode, and its pages with it
        return NO_REPLY

    def batch_forget(self, nodeid: int, body: memoryview, unique: int) -> object:
        rows = wire.forgets(body)
        node, count = rows["nodeid"], rows["nlookup"]
        mine = (node >= 1) & (node <= self._n)
        e, twice = np.unique(node[mine].astype(np.int64) - 1, return_inverse=True)
        dropped = np.zeros(e.size, dtype=np.int64)
        np.add.at(dropped, twice, np.minimum(count[mine], LOOKUP_MAX).astype(np.int64))  # a node twice loses both
        with self._nodes:
            left = np.maximum(self._lookups[e] - dropped, 0)  # in 64 bits, never below 0
            self._lookups[e] = left
            gone = e[left == 0]
            self.pusher.pushed[gone] = 0
        return NO_REPLY

    # --- data -------------------------------------------------------------------------------------------
    @answers
    def open(self, nodeid: int, body: memoryview, unique: int) -> bytes:
        """Only with ``--open-mode`` other than enosys: whether the kernel keeps this file's pages."""
        keep = self.view.keep_pages(nodeid - 1)
        return wire.OPEN_OUT.pack(0, wire.FOPEN_KEEP_CACHE if keep else 0, 0)

    def read(self, nodeid: int, body: memoryview, unique: int) -> Any:
        _fh, offset, size, _flags = wire.READ_IN.unpack_from(body)
        node = nodeid - 1
        try:
            data = self.view.read_now(node, offset, size)
        except Exception as e:
            raise OSError(self.view.report(e, f"read of node {nodeid}"), str(e)) from None
        if data is None:  # not in memory: a data thread waits on storage for it
            self._data.submit(self._answer_later, unique, self.view.read, node, offset, size)
            return DEFERRED
        if not offset and len(data) < size and node < self._n:
            # The whole file went to the kernel's pages with this answer: a push when its block loads would
            # only copy it there again.
            self._pushed_flags[node] = 1
        return data

    def _answer_later(self, unique: int, answer: Callable, *args: Any) -> None:
        try:
            data = answer(*args)
        except Exception as e:
            self.session.fail(unique, self.view.report(e, f"{answer.__name__}{args!r}"))
            return
        self.session.reply(unique, data)

    # --- statistics -------------------------------------------------------------------------------------
    def _stats(self) -> dict[str, Any]:
        requests = {wire.OPCODE_NAMES.get(op, str(op)): n for op, n in list(self.session.requests.items())}
        return {"requests": requests, "page_cache": dict(self.pusher.counts)}
