"""``DirReplies``: the READDIR and READDIRPLUS replies of the kernel-protocol adapter
(:mod:`blockfs.serve.fuse.kernel_adapter`).

Each reply is packed from the view's columns for just the slice of the directory it covers (NumPy rows,
names from the path table); a READDIRPLUS reply counts a kernel lookup for each node it gives with
attributes and has the listed files whose block is in memory pushed (:mod:`blockfs.serve.fuse.page_pusher`).
"""

from __future__ import annotations

import errno
import stat
import threading

import numpy as np

from ..view import Listing, MountView
from . import wire
from .page_pusher import PagePusher

LOOKUP_MAX = 2**31 - 1  # a node's lookup count (int32, the node table's) is held here, never wrapped

__all__ = ["DirReplies"]


class DirReplies:
    """Listing replies for one mount: ``lookups`` is the adapter's node table of kernel lookup counts
    (guarded by ``nodes``), ``valid`` the entries' and attributes' validity in seconds."""

    def __init__(
        self, view: MountView, valid: int, lookups: np.ndarray, nodes: threading.Lock, pusher: PagePusher
    ) -> None:
        self._view = view
        self._valid = valid
        self._lookups = lookups
        self._n = len(lookups)  # the nodes with per-node state
        self._nodes = nodes
        self._pusher = pusher

    def reply(self, nodeid: int, body: memoryview, plus: bool) -> bytes:
        """Entries from the request's offset on, as many as fit: "." and ".." are offsets 0 and 1, the
        children follow; each entry's offset is the next one's (never 0).

        The children's records are packed from the view's arrays for just the slice this request covers
        (:meth:`MountView.listing`): a reply costs the same at any offset of any directory, and no Python
        object is made per entry."""
        _fh, offset, size, _flags = wire.READ_IN.unpack_from(body)
        node = nodeid - 1
        if not self._view.is_dir(node):
            raise OSError(errno.ENOTDIR, "not a directory")
        count = self._view.n_children(node)
        head = self._dots(node, offset, size, plus)
        if offset + len(head) < 2:
            return b"".join(head)  # not even "." and ".." fit
        first = max(0, offset - 2)  # the first child to send, by its place in the listing
        room = size - sum(map(len, head))
        stop = min(count, first + room // (wire.record_width(plus) + 8))
        if stop <= first:
            return b"".join(head)
        nodes, table, start, length, a = self._view.listing(node, first, stop)
        fit = int(np.searchsorted(wire.record_ends(length, plus), room, side="right"))
        nodes, start, length, a = nodes[:fit], start[:fit], length[:fit], a[:fit]
        next_offset = np.arange(first + 3, first + fit + 3, dtype=np.uint64)
        if not plus:
            dirents = wire.dirent_rows(a["ino"], next_offset, length, a["mode"])
            return b"".join(head) + wire.records(dirents, table, start, length)
        rows = np.zeros(fit, dtype=wire.DIRENTPLUS_ROW)
        wire.dirent_rows(a["ino"], next_offset, length, a["mode"], out=rows["dirent"])
        entry = rows["entry"]  # a view: the fields below are written into rows
        wire.attr_rows(
            a["ino"], a["size"], a["mode"], a["nlink"], a["mtime_ns"], self._view.uid, self._view.gid, out=entry["attr"]
        )
        entry["nodeid"] = nodes.astype(np.uint64) + 1
        entry["entry_valid"] = entry["attr_valid"] = self._valid
        linked = self._linkable(Listing(nodes, table, start, length, a))
        if not linked.all():
            # Node id 0 and no attributes where the check of an empty file failed: the kernel counts no
            # lookup for that entry and will LOOKUP it, and the lookup answers the error.
            entry[~linked] = np.zeros((), dtype=wire.ENTRY_OUT_ROW)
        reply = b"".join(head) + wire.records(rows, table, start, length)
        counted = nodes < self._n  # the nodes with per-node state
        with self._nodes:
            looked = nodes[counted][linked[counted]]
            now = self._lookups[looked]
            self._lookups[looked] = now + (now < LOOKUP_MAX)  # held at the most, never wrapped
        self._pusher.listed(nodes[counted], linked[counted])
        return reply

    def _dots(self, node: int, offset: int, size: int, plus: bool) -> list[bytes]:
        """The records of "." and ".." from ``offset`` on that fit in ``size`` (node id 0 in a listing
        with attributes: the kernel looks neither up)."""
        out: list[bytes] = []
        used = 0
        for i in range(offset, 2):
            a = self._view.attr(node if i == 0 else self._view.parent(node))
            name = b"." if i == 0 else b".."
            one = (
                wire.direntplus(wire.negative_entry(0), a.ino, i + 1, name, a.mode)
                if plus
                else wire.dirent(a.ino, i + 1, name, a.mode)
            )
            if used + len(one) > size:
                break
            out.append(one)
            used += len(one)
        return out

    def _linkable(self, listed: Listing) -> np.ndarray:
        """Which of a listing's nodes it may give with attributes: all but the empty files
        :meth:`listable` refuses."""
        a = listed.attrs
        linked = np.ones(len(a), dtype=bool)
        empty = np.flatnonzero((a["size"] == 0) & ((a["mode"] & 0o170000) == stat.S_IFREG))
        for i in empty.tolist():
            linked[i] = self.listable(int(listed.nodes[i]))
        return linked

    def listable(self, node: int) -> bool:
        """Whether a listing may give an empty file's attributes: only once its block confirms it (the
        kernel never reads a file of size 0, so a size zeroed in a forged index must not get there).
        Confirmed from memory only: where that would wait on storage the entry goes without attributes, and
        the kernel's LOOKUP of it checks it on a data thread (a listing never waits on a store)."""
        try:
            return self._view.check_present(node, wait=False)
        except Exception as err:  # noqa: BLE001 - answered by the lookup the kernel will send instead
            self._view.report(err, f"the listing of node {node + 1}")
            return False
