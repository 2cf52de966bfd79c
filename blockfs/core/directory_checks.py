"""The tree's costliest checks, deferred by a mount: a directory's children are checked before the first
answer that involves them, and the whole tree after the mount serves.

At open every check of an index runs but one (:func:`.treecheck.check_tree_shape`): that each path is its
parent's path, "/" and a name, and that names in a directory sort strictly.  That one reads every path's bytes
(most of a first mount's time at millions of entries: ~0.3 s a million on two cores), so a mount leaves it
out of its start and checks instead, before it answers:

- a lookup in a directory, or any part of its listing: that directory's children (:meth:`ensure`);
- an entry found by its whole path: each directory above it, from its parent up, each before the next (so a
  chain of parents that loops, which only these checks rule out, is never walked past a failure).

Every other reader goes through a directory's children first, so no answer rests on a path not yet checked.
Meanwhile :meth:`check_all` checks every entry on a background thread; once it passes, the gate is off and
the index can be recorded as checked.  A directory that fails is remembered: its requests answer the error
(EIO) and the rest of the tree is served, as a damaged block fails only its own files.
"""

from __future__ import annotations

import logging
import threading

import numpy as np

from ..errors import IndexFormatError
from .heap import give_back
from .treecheck import PIECE, TreeChecks

log = logging.getLogger(__name__)

UNCHECKED, PASSED, FAILED = 0, 1, 2
BACKGROUND_PIECE = PIECE // 4  # entries checked at a time by check_all: its temporaries stay a few MB


class DirectoryChecks:
    """Which directories' children passed :meth:`.TreeChecks.check_names`, checking each on first use."""

    def __init__(self, tree: TreeChecks) -> None:
        self.tree = tree
        self._child_start = tree.a["child_start"]
        self._child_count = tree.a["child_count"]
        self._parent = tree.a["parent"]
        # By entry, as a memoryview (a Python int per look, fast) of calloc'ed zeros: no page is touched
        # until a directory on it is checked (a bytearray would write all n bytes up front).
        self._state = np.zeros(tree.n, dtype=np.uint8).data
        self._errors: dict[int, IndexFormatError] = {}
        self._lock = threading.Lock()
        self.all_passed = False

    def ensure(self, directory: int) -> None:
        """Return once ``directory``'s children passed; raise the :class:`IndexFormatError` they fail with."""
        if self.all_passed or self._state[directory] == PASSED:
            return
        with self._lock:  # one check of a directory at a time; a second asker waits for the first's verdict
            state = self._state[directory]
            if state == FAILED:
                raise self._errors[directory]
            if state == PASSED:
                return
            lo = int(self._child_start[directory])
            hi = lo + int(self._child_count[directory])
            try:
                if hi > lo:
                    self.tree.check_names(lo, hi)
            except IndexFormatError as e:
                self._state[directory] = FAILED
                self._errors[directory] = e
                log.error("%s: answering EIO for the entries of that directory", e)
                raise
            finally:
                if hi - lo > PIECE:  # a few pieces' temporaries at once: returned, not kept by the heap
                    give_back()
            self._state[directory] = PASSED

    def ensure_above(self, entry: int) -> None:
        """:meth:`ensure` every directory above ``entry``, its parent first: each pass proves the path below
        it longer than its own, so the walk ends at the root."""
        while entry and not self.all_passed:
            entry = int(self._parent[entry])
            self.ensure(entry)

    def check_all(self, stop: threading.Event) -> bool:
        """Check every entry, a piece at a time, on the calling thread (meant for a background one); True
        once all passed (the gate is off from then on), False if stopped first.  A failure is logged and
        returned as False too: the failing directory is found again, and refused, when it is first used."""
        try:
            return self._check_all(stop)
        finally:
            give_back()  # what the pieces freed: the mount's own memory stays what it holds

    def _check_all(self, stop: threading.Event) -> bool:
        n = self.tree.n
        for lo in range(1, n, BACKGROUND_PIECE):
            if stop.is_set():
                return False
            hi = min(n, lo + BACKGROUND_PIECE)
            try:  # on this thread alone, not check_names's few at once: requests come first
                self.tree.check_paths_in_parents(lo, hi)
                if lo < n - 1:
                    self.tree.check_sibling_order(lo, min(n - 1, hi))  # and the pair across into the next piece
            except IndexFormatError as e:
                log.error("%s: the directory holding it answers EIO; the rest of the tree is served", e)
                return False
        self.all_passed = True
        return True

    def checked_directories(self) -> int:
        """How many directories passed on first use (for tests and statistics)."""
        return int(np.count_nonzero(np.frombuffer(self._state, dtype=np.uint8) == PASSED))

    def refused_directories(self) -> int:
        """How many directories failed, and answer EIO for their entries."""
        with self._lock:
            return len(self._errors)
