"""Check that an index's entries form one tree, before anything is served or unpacked from it.

The index stores each entry's full path *and* its parent, and different readers trust different columns:
lookups hash the full path, listings use the parent's child range, ``unpack`` creates names inside their
parent.  If the two disagree, a hostile index can make a path resolve through a symlink or name one file
twice (``a -> /elsewhere`` plus ``a/x``; a symlink ``s`` plus a file ``s``).  So at open every entry must
satisfy, exactly (byte for byte, not by hash):

- its path is its parent's path + ``/`` + a name without ``/`` (the root's children: just the name);
- its parent is a directory, and the directories' child ranges tile entries 1..n-1 in parent order;
- the names in each directory are strictly increasing (the writer sorts them), hence unique;
- an entry that shares another's inode number is a file stored at the same (block, slot) as it.

Everything is vectorised NumPy over entries, in pieces so temporaries stay small at any index size: a
Python loop over a million entries would cost more than the whole open may take.  Paths are compared
eight bytes at a time through an unaligned ``uint64`` view of the path table.  A mount runs the first and
third rules (:meth:`TreeChecks.check_names`, the ones that read the paths) a directory at a time before it
answers about it, and the rest at open (:func:`check_tree_shape`; :mod:`.directory_checks`).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Mapping
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from ..errors import IndexFormatError

KIND_FILE, KIND_DIR = 0, 1  # as in .index (not imported: index imports this module)
PIECE = 1 << 18  # entries checked at a time
THREADS = 4  # pieces checked at once, at most (NumPy lets go of the GIL inside each step)

_ONES = np.uint64(0x0101010101010101)
_HIGHS = np.uint64(0x8080808080808080)
_ALL = np.uint64(0xFFFFFFFFFFFFFFFF)
_ONE = np.uint64(1)
_SLASH = 47

WordLoader = Callable[[np.ndarray], np.ndarray]
Release = Callable[[], None]  # drops the pages the checks touched from the process's map (see in_pieces)


def check_tree(arrays: Mapping[str, np.ndarray], where: str, release: Release | None = None) -> None:
    """Raise :class:`IndexFormatError` naming the first entry that breaks the tree (see the module doc).

    ``arrays`` are the index's columns (``kind``, ``parent``, ``child_start``, ``child_count``, ``ino``,
    ``block``, ``slot``, ``path_offsets``, ``paths``); ``where`` starts every message (``index PATH``);
    ``release``: called after each piece (see :func:`in_pieces`).
    """
    tree = TreeChecks(arrays, where)
    n = tree.n

    def parents(lo: int) -> None:
        hi = min(n, lo + PIECE)
        tree.check_parent_kinds(lo, hi)
        tree.check_paths_in_parents(lo, hi)

    in_pieces(parents, range(1, n, PIECE), release)
    tree.check_child_ranges()
    if release is not None:
        release()
    in_pieces(lambda lo: tree.check_sibling_order(lo, min(n - 1, lo + PIECE)), range(1, n - 1, PIECE), release)
    in_pieces(lambda lo: tree.check_hard_links(lo, min(n, lo + PIECE)), range(0, n, PIECE), release)


def check_tree_shape(arrays: Mapping[str, np.ndarray], where: str, release: Release | None = None) -> TreeChecks:
    """Every check of :func:`check_tree` but those that read the paths' bytes: parents that are directories,
    child ranges that tile the entries, hard links.  Cheap; the rest (most of the time at millions of
    entries) is the returned object's :meth:`TreeChecks.check_names`, for all entries or one directory's."""
    tree = TreeChecks(arrays, where)
    n = tree.n
    in_pieces(lambda lo: tree.check_parent_kinds(lo, min(n, lo + PIECE)), range(1, n, PIECE), release)
    tree.check_child_ranges()
    if release is not None:
        release()
    in_pieces(lambda lo: tree.check_hard_links(lo, min(n, lo + PIECE)), range(0, n, PIECE), release)
    return tree


def in_pieces(check: Callable[[int], None], starts: Iterable[int], release: Release | None = None) -> None:
    """``check(lo)`` for every piece's start, up to :data:`THREADS` pieces at once; the error raised is the
    first piece's in order, as a loop would raise it (the pieces after it run too: a forged index is rare).
    Opening a million-entry index spends most of its time in these checks; on two cores the threads cut the
    tree's share from ~0.8 s to ~0.55 s.  Memory: ``THREADS`` pieces' temporaries at once, still bounded.
    ``release``, if given, is called after each piece: a pack drops the pages of the index it checks from
    its map there (their bytes stay in the page cache), so its resident memory holds a few pieces' pages,
    not the whole index's."""
    starts = list(starts)

    def run(lo: int) -> None:
        check(lo)
        if release is not None:
            release()

    threads = min(THREADS, len(starts), os.cpu_count() or 1)
    if threads <= 1:
        for lo in starts:
            run(lo)
        return
    with ThreadPoolExecutor(threads, thread_name_prefix="blockfs-check") as pool:
        for _ in pool.map(run, starts):  # results in order: the first failing piece's error is raised
            pass


class TreeChecks:
    """The columns the tree's checks read, and how to name an entry in a message."""

    def __init__(self, arrays: Mapping[str, np.ndarray], where: str) -> None:
        """Check the path table's own frame: one offset per entry and one more, the root's path empty."""
        n = int(arrays["kind"].size)
        off = arrays["path_offsets"]
        blob = arrays["paths"]
        if off.size != n + 1 or n == 0 or int(off[0]) < 1 or int(off[-1]) != blob.size:
            raise IndexFormatError(f"{where}: path table is inconsistent")
        if int(off[1]) - int(off[0]) != 1:
            raise IndexFormatError(f"{where}: the root entry has a non-empty path")
        self.a = arrays
        self.n = n
        self.where = where
        self.off = off
        self.load = _word_loader(blob)

    def fail(self, entry: int, problem: str) -> None:
        start, end = int(self.off[entry]), int(self.off[entry + 1]) - 1
        path = os.fsdecode(self.a["paths"][start:end].tobytes())
        raise IndexFormatError(f"{self.where}: entry {entry} ({path!r}) {problem}; the index is damaged or forged")

    def check_names(self, lo: int, hi: int, release: Release | None = None) -> None:
        """Entries lo..hi-1 (after :func:`check_tree_shape`): each path is its parent's path, "/" and a name
        without "/", and each name sorts strictly after its previous sibling's when that is in lo..hi-1 too
        (a directory's children are one such range).  In pieces, a few at once."""
        in_pieces(lambda s: self.check_paths_in_parents(s, min(hi, s + PIECE)), range(lo, hi, PIECE), release)
        last = hi - 1  # pairs (e, e + 1) with both in lo..hi-1
        in_pieces(lambda s: self.check_sibling_order(s, min(last, s + PIECE)), range(lo, last, PIECE), release)

    def check_parent_kinds(self, lo: int, hi: int) -> None:
        """Entries lo..hi-1: a parent in range that is a directory."""
        a = self.a
        parent = a["parent"][lo:hi].astype(np.int64)
        out = np.flatnonzero(parent >= self.n)
        if out.size:
            self.fail(lo + int(out[0]), f"names parent {int(parent[out[0]])}, out of range")
        not_dir = np.flatnonzero(a["kind"][parent] != KIND_DIR)
        if not_dir.size:
            self.fail(lo + int(not_dir[0]), f"has parent entry {int(parent[not_dir[0]])}, which is not a directory")

    def check_paths_in_parents(self, lo: int, hi: int) -> None:
        """Entries lo..hi-1 (parents checked by :meth:`check_parent_kinds`): path == parent's path + "/" + a
        name without "/"."""
        a, off = self.a, self.off
        parent = a["parent"][lo:hi].astype(np.int64)
        start = off[lo:hi].astype(np.int64)
        end = off[lo + 1 : hi + 1].astype(np.int64) - 1  # each path's NUL
        p_start = off[parent].astype(np.int64)
        p_len = off[parent + 1].astype(np.int64) - p_start - 1
        # The last "/" of each path must be the one right after the parent's path (none under the root).
        last = self._last_slashes(int(start[0]) - 1, end)
        under_root = p_len == 0  # only the root has an empty path (index checks that)
        bad = np.where(under_root, last >= start, last != start + p_len)
        bad |= end - start < p_len + 2 - under_root  # an empty name
        bad |= _differs(self.load, start, p_start, np.where(bad, 0, p_len))
        first = np.flatnonzero(bad)
        if first.size:
            e = lo + int(first[0])
            self.fail(e, f"is not a name inside its parent directory entry {int(a['parent'][e])}")

    def _last_slashes(self, first: int, ends: np.ndarray) -> np.ndarray:
        """Position of the last "/" of each path ending (NUL) at ``ends``, or -1; ``first``: the NUL
        just before the first of these paths.  One pass finds every NUL and "/", in order: the mark
        before each path's NUL is its last "/" or, if it has none, the previous path's NUL."""
        seg = self.a["paths"][first : int(ends[-1]) + 1]
        marks = np.flatnonzero((seg == 0) | (seg == _SLASH))
        nuls = np.flatnonzero(seg[marks] == 0)
        if nuls.size != ends.size + 1 or np.any(marks[nuls[1:]] != ends - first):
            raise IndexFormatError(f"{self.where}: path table is inconsistent")
        before = marks[nuls[1:] - 1]
        return np.where(seg[before] == _SLASH, before + first, -1)

    def check_child_ranges(self) -> None:
        """Every directory's child range holds exactly the entries whose parent it is, and only those."""
        a, n = self.a, self.n
        counts = a["child_count"]
        holders = np.flatnonzero(counts)
        not_dir = holders[a["kind"][holders] != KIND_DIR]
        if not_dir.size:
            self.fail(int(not_dir[0]), "is not a directory but lists children")
        holders = holders[np.argsort(a["child_start"][holders], kind="stable")]
        starts = a["child_start"][holders].astype(np.int64)
        ends = starts + counts[holders]
        tiled = n == 1 or (
            holders.size > 0 and starts[0] == 1 and ends[-1] == n and bool(np.all(starts[1:] == ends[:-1]))
        )
        if not tiled:
            raise IndexFormatError(f"{self.where}: directory child ranges do not cover the entries once each")
        expected = np.repeat(holders, counts[holders])
        wrong = np.flatnonzero(expected != a["parent"][1:])
        if wrong.size:
            e = 1 + int(wrong[0])
            self.fail(e, f"is listed in directory entry {int(expected[wrong[0]])}, not in its parent")

    def check_sibling_order(self, lo: int, hi: int) -> None:
        """Entries e in lo..hi-1 and e+1 with one parent: e's name sorts strictly before e+1's."""
        a, off = self.a, self.off
        parent = a["parent"][lo : hi + 1].astype(np.int64)
        pairs = np.flatnonzero(parent[:-1] == parent[1:])  # e - lo for each pair (e, e + 1)
        if not pairs.size:
            return
        skip = off[parent + 1].astype(np.int64) - off[parent].astype(np.int64)  # parent's path and "/"
        skip -= skip == 1  # under the root: nothing to skip
        names = off[lo : hi + 1].astype(np.int64) + skip
        first = np.flatnonzero(_not_before(self.load, names, pairs))
        if first.size:
            e = lo + int(pairs[first[0]])
            self.fail(e + 1, f"repeats or is out of order after its sibling entry {e}")

    def check_hard_links(self, lo: int, hi: int) -> None:
        """An inode number other than the entry's own names a file entry stored at the same place."""
        a = self.a
        ino = a["ino"][lo:hi].astype(np.uint64)
        own = ino == np.arange(lo + 1, hi + 1, dtype=np.uint64)
        shared = np.flatnonzero(~own)
        if not shared.size:
            return
        e = lo + shared
        first = ino[shared].astype(np.int64) - 1
        valid = (ino[shared] >= 1) & (ino[shared] <= self.n)
        first = np.where(valid, first, 0)
        ok = valid & (a["kind"][e] == KIND_FILE) & (a["kind"][first] == KIND_FILE)
        ok &= a["ino"][first] == first.astype(np.uint64) + 1
        ok &= (a["block"][first] == a["block"][e]) & (a["slot"][first] == a["slot"][e])
        bad = np.flatnonzero(~ok)
        if bad.size:
            self.fail(int(e[bad[0]]), f"claims inode {int(ino[shared[bad[0]]])}, which is not a file stored with it")


def _word_loader(blob: np.ndarray) -> WordLoader:
    """``load(pos)``: the 8 bytes at each byte offset ``pos`` as little-endian ``uint64`` (zeros past the end)."""
    if blob.size < 8:
        blob = np.concatenate([blob, np.zeros(8, dtype=np.uint8)])
    words = np.ndarray(shape=(blob.size - 7,), dtype="<u8", buffer=blob, strides=(1,))
    last = words.size - 1

    def load(pos: np.ndarray) -> np.ndarray:
        if not pos.size or int(pos.max()) <= last:
            return words[pos]
        at = np.minimum(pos, last)
        return words[at] >> ((pos - at) * 8).astype(np.uint64)

    return load


def _differs(load: WordLoader, a: np.ndarray, b: np.ndarray, length: np.ndarray) -> np.ndarray:
    """For each i: do the ``length[i]`` bytes at ``a[i]`` and at ``b[i]`` differ?"""
    differs = np.zeros(a.size, dtype=bool)
    which = np.flatnonzero(length > 0)  # the pairs still being compared, eight bytes further each round
    a, b, left = a[which], b[which], length[which]
    while which.size:
        keep = np.left_shift(_ONE, (8 * np.minimum(left, 7)).astype(np.uint64)) - _ONE
        diff = (load(a) ^ load(b)) & np.where(left >= 8, _ALL, keep)
        differs[which[diff != 0]] = True
        go = (left > 8) & (diff == 0)
        which, a, b, left = which[go], a[go] + 8, b[go] + 8, left[go] - 8
    return differs


def _not_before(load: WordLoader, names: np.ndarray, pairs: np.ndarray) -> np.ndarray:
    """For each i, the NUL-terminated names at ``names[pairs[i]]`` and ``names[pairs[i] + 1]``: is the
    first not strictly less than the second?  Neighbours share words: while most pairs are still being
    compared, each round reads every name's next word once instead of twice."""
    result = np.zeros(pairs.size, dtype=bool)
    which = np.arange(pairs.size)  # the pairs still being compared, eight bytes further each round
    at = names.copy()
    while which.size:
        first = pairs[which]
        if 2 * which.size > at.size:
            words = load(at)
            wa, wb = words[first], words[first + 1]
        else:
            wa, wb = load(at[first]), load(at[first + 1])
        nul = (wa - _ONES) & ~wa & _HIGHS  # lowest set bit: the first name's first NUL byte, if any
        keep = ((nul & (~nul + _ONE)) << _ONE) - _ONE  # bytes up to that NUL; every byte if none
        wa, wb = wa & keep, wb & keep  # what follows the first name's end cannot matter
        same = wa == wb
        ended = nul != 0
        # Big-endian, the words compare as the byte strings do.
        result[which[np.where(same, ended, wa.byteswap() > wb.byteswap())]] = True
        which = which[same & ~ended]
        at += 8
    return result
