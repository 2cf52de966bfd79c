"""The kernel adapter's page pushing (``FUSE_NOTIFY_STORE``): the files of a block just loaded, the files
a listing just gave whose block is in memory, and a file just opened (below), written into the kernel's page
cache by one thread, so their reads never reach this process.

**At open.**  CPython < 3.14's ``open()`` asks ``isatty`` (a TCGETS ioctl, which the kernel forwards for every
FUSE file) between the open and the first read.  For a file whose bytes are in memory and not yet in the
kernel's pages, the session hands that ioctl here: the file is pushed, *then* the ioctl is answered (ENOTTY),
so the reader's first read finds the pages filled and no READ is sent — a push that cannot lose its race to
the READ (a push after the LOOKUP answer lost it 97-99 % of the time: the READ follows at once).  Safe for
the same reason every push is: only this thread stores, never a reader thread, so a store waiting on a page
lock never keeps a READ from being answered.

**At unmount** the pusher may still be inside a push when the session lets go of ``/dev/fuse``: it is not
joined first, and need not be, since the session keeps that descriptor's number for an inert descriptor
(:meth:`~blockfs.serve.fuse.session.Session._retire_fd`), so a late push fails (EBADF: not stored) instead of
writing a FUSE message into whatever file took the number since.

It reaches the memory tier only through :class:`blockfs.serve.view.MountView`'s narrow hook
(:meth:`~MountView.files_of_block`, :meth:`~MountView.held`, :meth:`~MountView.pages`); what the kernel
holds (lookup counts) is the adapter's node table, read here, never written.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable
from typing import Any

import numpy as np

from ..view import MountView

log = logging.getLogger(__name__)

PUSH_RETRY_S = 0.05


class PagePusher:
    """Pushes of one mount: ``jobs`` takes ("block", block), ("entries", [entry...]) and ("open", (entry,
    unique)); :meth:`run` is the pusher thread; ``store(nodeid, bytes)`` is the session's, True when the kernel
    took the pages; ``answer_ioctl(unique)`` answers a taken ioctl (ENOTTY)."""

    def __init__(
        self,
        view: MountView,
        jobs: queue.SimpleQueue,
        lookups: np.ndarray,
        store: Callable[[int, Any], bool],
        stopped: threading.Event,
        *,
        enabled: bool,
        answer_ioctl: Callable[[int], None] | None = None,
    ) -> None:
        self.view = view
        self.jobs = jobs
        self.enabled = enabled  # pages kept across opens: pushing them pays off
        self._lookups = lookups
        self._store = store
        self._stopped = stopped
        self._answer_ioctl = answer_ioctl
        self.pushed = np.zeros(len(lookups), dtype=np.uint8)  # 1: pushed, and the kernel may still hold them
        self._pushed = self.pushed.data  # the same flags, one at a time: no NumPy scalar
        self.counts = {
            "files_pushed": 0,
            "bytes_pushed": 0,
            "pushed_at_open": 0,
            "pushes_skipped": 0,
            "push_errors": 0,
        }

    def opened(self, nodeid: int, unique: int) -> bool:
        """The session's ioctl hook (a request thread): take the ioctl of a file not pushed yet whose bytes are
        in memory now, to push it before answering (:meth:`run`); False (answer it now) for any other node
        (a file whose bytes are not in memory, whose open would only wait behind every push queued; a
        directory; the control files), with pushing off, or once the pusher thread has ended."""
        e = nodeid - 1
        if not self.enabled or not 0 <= e < len(self._pushed) or self._pushed[e] or not self.view.in_memory(e):
            return False
        self.jobs.put(("open", (e, unique)))
        # The pusher may have ended meanwhile (its drain done): answered now as well (a second answer to
        # one request is refused by the kernel, ENOENT, and ignored).
        return self.enabled

    def listed(self, entries: np.ndarray, linked: np.ndarray) -> None:
        """Queue pushes of the ``entries`` a listing gave with attributes (``linked``) whose blocks are in
        memory: a listing comes long before the reads.  (A file merely looked up is not pushed: its READ
        follows at once and would win the race.)"""
        if not self.enabled:
            return
        wanted = entries[linked & (self.pushed[entries] == 0)]
        if wanted.size:
            wanted = self.view.held(wanted)
        if wanted.size:
            self.jobs.put(("entries", wanted.tolist()))

    def run(self) -> None:
        """The one thread that writes into the kernel's page cache (never a reader thread: see session).

        A push can reach the kernel before the answer that told it of the node (the lookup or listing is
        answered after it queued the push): the kernel then says ENOENT, and the push is tried once more
        :data:`PUSH_RETRY_S` later."""
        try:
            self._serve_jobs()
        finally:
            # Ended (stopped, or an error past the handlers): no ioctl taken from now on, and every one taken
            # is answered, or its opener would wait for as long as the mount lives.
            self.enabled = False
            self._answer_taken()

    def _answer_taken(self) -> None:
        """Answer the ioctls still queued (the pusher has ended); drop the other jobs."""
        while True:
            try:
                job = self.jobs.get_nowait()
            except queue.Empty:
                return
            if job is not None and job[0] == "open" and self._answer_ioctl is not None:
                self._answer_ioctl(job[1][1])

    def _serve_jobs(self) -> None:
        retry: list[int] = []
        while True:
            try:
                job = self.jobs.get(timeout=PUSH_RETRY_S if retry else None)
            except queue.Empty:
                job, retry = ("again", retry), []
            if job is None or self._stopped.is_set():
                return
            kind, what = job
            if kind == "open":
                self._push_opened(*what)
                continue
            try:
                if kind == "block":
                    retry += self.push(self.view.files_of_block(what))
                elif kind == "entries":
                    retry += self.push(what)
                else:
                    self.counts["pushes_skipped"] += len(self.push(what))
            except Exception:
                self.counts["push_errors"] += 1
                log.exception("pushing pages into the kernel's cache failed; reads are served as usual")

    def _push_opened(self, e: int, unique: int) -> None:
        """Push a file just opened, if its bytes are in memory, then answer the ioctl that brought it: the
        answer comes after the pages, so the reader's first read finds them (whatever happens here).  The
        kernel holds the node (the file is open): no lookup count to check, no retry."""
        try:
            data = None if self._pushed[e] else self.view.pages(e)
            if data is not None and len(data):
                stored = self._store(e + 1, data)
                if stored:
                    self._pushed[e] = 1
                    counts = self.counts
                    counts["files_pushed"] += 1
                    counts["bytes_pushed"] += len(data)
                    counts["pushed_at_open"] += 1
        except Exception as err:  # noqa: BLE001 - its reads are served as usual
            self._pushed[e] = 1  # not tried again while the kernel holds the node
            self._failed(e, err)
        finally:
            if self._answer_ioctl is not None:
                self._answer_ioctl(unique)

    def push(self, entries: list[int]) -> list[int]:
        """Push each entry the kernel holds and has not been pushed; the ones the kernel refused."""
        refused = []
        counts, lookups, pushed, store = self.counts, self._lookups, self.pushed, self._store
        for e in entries:
            if pushed[e] or lookups[e] <= 0:
                continue
            data = self.view.pages(e)
            if data is None or not len(data):
                continue
            try:
                stored = store(e + 1, data)
            except Exception as err:  # noqa: BLE001 - this file only: the others of the job are still pushed
                pushed[e] = 1  # not tried again while the kernel holds the node: its reads come here
                self._failed(e, err)
                continue
            if stored:
                pushed[e] = 1
                counts["files_pushed"] += 1
                counts["bytes_pushed"] += len(data)
            else:
                refused.append(e)
        return refused

    def _failed(self, e: int, err: Exception) -> None:
        """Count a file the kernel would not take; say so once a mount (its reads are served as usual)."""
        self.counts["push_errors"] += 1
        if self.counts["push_errors"] == 1:
            log.warning(
                "pushing %s into the page cache failed: %s; its reads are served as usual (later "
                "failures are counted in page_cache.push_errors)",
                self.view.path_of(e),
                err,
            )
        else:
            log.debug("pushing entry %d into the page cache failed: %s", e, err)
