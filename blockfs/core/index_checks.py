"""Checks of an index's contents at open: everything a reader later trusts, vectorised, in bounded memory.

The table of contents was checked by :mod:`.index_format`, so every array here has its schema dtype.
These checks make the arrays agree with each other: sizes that fit, offsets that grow, entries, blocks and
slots in range, a block layout that lists every file once in slot order, and paths without ``..``, ``.``,
empty components or a leading ``/``.  Each failure is an :class:`IndexFormatError` naming the array.
Per-entry checks run over pieces of :data:`VALIDATE_PIECE` entries so their temporary arrays stay small
at any index size, a few pieces at once (:func:`.treecheck.in_pieces`); nothing loops over entries in Python.
"""

from __future__ import annotations

import numpy as np

from ..errors import IndexFormatError
from .index_format import ENTRY_COLUMNS, KIND_DIR, KIND_FILE, KIND_SYMLINK, REPACK
from .treecheck import Release, TreeChecks, check_tree, check_tree_shape, in_pieces

VALIDATE_PIECE = 1 << 18  # entries checked at a time
RELEASE_EVERY = 1 << 25  # bytes of the path table searched between two calls of a ``release``


def validate_arrays(
    a: dict[str, np.ndarray],
    where: str,
    n_blocks: int | None = None,
    release: Release | None = None,
    *,
    defer_names: bool = False,
) -> TreeChecks | None:
    """Run every check, in order; ``n_blocks`` is the metadata's block count, when known.  ``release``:
    called after each piece and each whole-array check (:func:`.treecheck.in_pieces`: a pack drops the
    pages the checks touched from its map there).  ``defer_names``: all but the paths' own bytes (see
    :func:`.treecheck.check_tree_shape`), and the tree's checks of them returned for the caller to run (a
    mount's, :mod:`.directory_checks`); None when nothing is left to run."""
    released = release or (lambda: None)
    check_lengths(a, where, n_blocks)
    check_offsets_grow(a, where)
    released()
    n = a["kind"].size

    def piece(lo: int) -> None:
        hi = min(n, lo + VALIDATE_PIECE)
        check_entries(a, where, lo, hi)
        check_paths(a, where, lo, hi)

    in_pieces(piece, range(0, n, VALIDATE_PIECE), release)
    check_forbidden_components(a, where, release)
    check_block_layout(a, where, release)
    # Last: the tree's shape (each path = its parent's path + its name, the parent a directory, names
    # unique in a directory), once every array above is known to be in range.
    if defer_names:
        return check_tree_shape(a, where, release)
    check_tree(a, where, release)
    return None


def _fail(where: str, what: str) -> IndexFormatError:
    return IndexFormatError(f"{where}: {what}; {REPACK}")


def check_lengths(a: dict[str, np.ndarray], where: str, n_blocks: int | None) -> None:
    """Every array's length agrees with the entry and block counts."""
    n = a["kind"].size
    if n == 0 or a["kind"][0] != KIND_DIR:
        raise _fail(where, "entry 0 is not the root directory")
    for name in ENTRY_COLUMNS:
        if a[name].size != n:
            raise _fail(where, f"column {name!r} has {a[name].size} rows, not {n}")
    nb = a["block_counts"].size
    if n_blocks is not None and n_blocks != nb:
        raise IndexFormatError(
            f"{where}: lists {nb} blocks, the metadata {n_blocks}: index and blockfs.json are not one pack's; {REPACK}"
        )
    expected = {
        "path_offsets": n + 1,
        "hash_order": n,
        "block_sizes": nb,
        "block_offsets": nb + 1,
    }
    for name, size in expected.items():
        if a[name].size != size:
            raise _fail(where, f"array {name!r} has {a[name].size} values, not {size}")
    hs = a["hash_start"].size
    if hs < 2 or (hs - 1) & (hs - 2):
        raise _fail(where, f"array 'hash_start' has {hs} values, not a power of two plus one")
    if a["link_offsets"].size < 1:
        raise _fail(where, "array 'link_offsets' is empty")
    ends = {
        "path_offsets": ("paths", a["path_offsets"]),
        "link_offsets": ("links", a["link_offsets"]),
        "block_offsets": ("block_files", a["block_offsets"]),
        "hash_start": ("hash_order", a["hash_start"]),
    }
    for name, (target, offsets) in ends.items():
        if int(offsets[-1]) != a[target].size:
            raise _fail(where, f"array {name!r} ends at {int(offsets[-1])}, but {target!r} has {a[target].size}")


def check_offsets_grow(a: dict[str, np.ndarray], where: str) -> None:
    """Offset arrays start where they must and never decrease (so every slice they give is valid)."""
    for name, first in (("path_offsets", 1), ("link_offsets", 0), ("block_offsets", 0), ("hash_start", 0)):
        off = a[name]
        if int(off[0]) != first:
            raise _fail(where, f"array {name!r} starts at {int(off[0])}, not {first}")
        for lo in range(0, off.size - 1, VALIDATE_PIECE):
            piece = off[lo : lo + VALIDATE_PIECE + 1]
            if np.any(piece[1:] < piece[:-1]):
                raise _fail(where, f"array {name!r} decreases near value {lo}")


def check_entries(a: dict[str, np.ndarray], where: str, lo: int, hi: int) -> None:
    """Kinds, blocks, slots, sizes, labels, links and directory ranges of entries ``lo:hi``."""
    n = a["kind"].size
    n_blocks = a["block_counts"].size
    kind, block, slot = a["kind"][lo:hi], a["block"][lo:hi], a["slot"][lo:hi]
    if np.any(kind > KIND_SYMLINK):
        raise _fail(where, f"unknown entry kind in column 'kind' (entry {lo + int(np.argmax(kind > KIND_SYMLINK))})")
    is_file = kind == KIND_FILE
    files = lo + np.flatnonzero(is_file)
    fb = block[is_file]
    out = (fb < 0) | (fb >= n_blocks)
    if np.any(out):
        bad = int(files[out][0])
        raise _fail(where, f"entry {bad} names block {int(a['block'][bad])}, outside 0..{n_blocks - 1}")
    over = slot[is_file] >= a["block_counts"][fb]
    if np.any(over):
        bad = int(files[over][0])
        raise _fail(
            where,
            f"entry {bad} names slot {int(a['slot'][bad])} of block {int(a['block'][bad])}, which has "
            f"{int(a['block_counts'][a['block'][bad]])} slots",
        )
    # A file cannot be larger than its whole block file: a flipped high bit in 'size' is caught here,
    # before any reader loops towards it.
    too_big = a["size"][lo:hi][is_file] > a["block_sizes"][fb]
    if np.any(too_big):
        bad = int(files[too_big][0])
        raise _fail(
            where,
            f"entry {bad} has size {int(a['size'][bad])}, more than its block's "
            f"{int(a['block_sizes'][a['block'][bad]])} bytes (column 'size')",
        )
    if np.any(a["label"][lo:hi] < -1):
        raise _fail(where, "a label below -1 (column 'label')")
    if np.any(slot[kind == KIND_SYMLINK] >= a["link_offsets"].size - 1):
        raise _fail(where, "a symlink names a target out of range (column 'slot')")
    ends = a["child_start"][lo:hi].astype(np.uint64) + a["child_count"][lo:hi]
    if np.any(ends > n):
        raise _fail(where, "a directory's children run past the last entry (columns 'child_start', 'child_count')")
    if np.any(a["parent"][lo:hi] >= n):
        raise _fail(where, "a parent out of range (column 'parent')")
    if np.any(a["hash_order"][lo:hi] >= n):
        raise _fail(where, "an entry out of range in array 'hash_order'")


def check_paths(a: dict[str, np.ndarray], where: str, lo: int, hi: int) -> None:
    """Entries ``lo:hi`` each own one non-empty, NUL-terminated path (the root's is empty)."""
    off = a["path_offsets"][lo : hi + 1].astype(np.int64)
    steps = off[1:] - off[:-1]
    if np.any(steps < 1) or np.any(a["paths"][off[1:] - 1] != 0):
        raise _fail(where, "path table is inconsistent (array 'path_offsets')")
    if np.any(steps[(1 if lo == 0 else 0) :] == 1):
        raise _fail(where, "an entry other than the root has an empty path")
    # Every NUL in the table must end a path, or a path could hide a NUL-separated one.
    if np.count_nonzero(a["paths"][off[0] : off[-1]] == 0) != hi - lo:
        raise _fail(where, "path table is inconsistent (a path holds a NUL byte)")


def check_forbidden_components(a: dict[str, np.ndarray], where: str, release: Release | None = None) -> None:
    bad = find_forbidden_component(a["paths"], release=release)
    if bad >= 0:
        raise _fail(
            where,
            f"a path has a forbidden form near byte {bad} of the path table: absolute paths, '.', '..' and "
            "empty components are rejected",
        )


def find_forbidden_component(blob: np.ndarray, piece: int = 1 << 20, release: Release | None = None) -> int:
    """Offset of the first empty, "." or ".." component in a NUL-separated path table, or -1.

    Every path p is stored as \\0p\\0 (the root, first, as \\0\\0).  A forbidden component is two
    separators in a row (one of them "/"), or a separator, one or two dots and a separator; both start
    where a separator is followed by a separator or a dot, which is rare, so only those few places are
    looked at closely.  Works in pieces (overlapping by 3 bytes) so the temporary masks stay small; ``release``
    is called every :data:`RELEASE_EVERY` bytes of the table.
    """
    n = blob.size
    for lo in range(0, n, piece):
        b = blob[lo : min(n, lo + piece + 3)]
        slash = b == 47
        boundary = slash | (b == 0)
        adjacent = np.flatnonzero(boundary[:-1] & boundary[1:])
        empty = adjacent[slash[adjacent] | slash[adjacent + 1]]
        dots = np.flatnonzero(boundary[:-1] & (b[1:] == 46))  # a component that starts with "."
        one = dots[dots + 2 < b.size]
        one = one[boundary[one + 2]]
        two = dots[dots + 3 < b.size]
        two = two[(b[two + 2] == 46) & boundary[two + 3]]
        first = min((int(h[0]) for h in (empty, one, two) if h.size), default=-1)
        if first >= 0:
            return lo + first
        if release is not None and (lo + piece) % RELEASE_EVERY < piece:
            release()
    return -1


def check_block_layout(a: dict[str, np.ndarray], where: str, release: Release | None = None) -> None:
    """``block_files[block_offsets[b]:block_offsets[b + 1]]`` are exactly block b's files, in slot order.

    Run after :func:`check_entries`, so every file's block and slot are in range.  In pieces, a few at once
    (the gathers of each member's block and slot are most of it: ~1.3 s at ten million files on one thread).
    """
    n = a["kind"].size
    members = a["block_files"]
    total = int(members.size)
    listed = np.zeros(n, dtype=bool)

    def mark(lo: int) -> None:
        piece = members[lo : lo + VALIDATE_PIECE]
        if int(piece.max()) >= n:
            raise _fail(where, "an entry out of range in array 'block_files'")
        listed[piece] = True  # pieces may mark one entry at once (a forged repeat): both write True

    in_pieces(mark, range(0, total, VALIDATE_PIECE), release)
    is_file = a["kind"] == KIND_FILE
    # As many members as files, all of them files and none twice: each file exactly once.
    if total != int(np.count_nonzero(is_file)) or int(np.count_nonzero(listed & is_file)) != total:
        raise _fail(where, "array 'block_files' does not list every file exactly once")
    # A slot costs its block at least a u32 offset, a u32 size and an i32 label in the header, so a block
    # holds at most a twelfth of its size in slots (a slot may hold no file: one skipped as unreadable).  The
    # mount sizes arrays by the slots (serve/cache/retain.py), so a forged count must not be believed.
    too_many = a["block_counts"].astype(np.uint64) * np.uint64(12) > a["block_sizes"].astype(np.uint64)
    if np.any(too_many):
        b = int(np.flatnonzero(too_many)[0])
        raise _fail(
            where,
            f"column 'block_counts' gives block {b} {int(a['block_counts'][b])} slots, more than "
            f"its {int(a['block_sizes'][b])} bytes can hold",
        )
    offsets = a["block_offsets"]  # checked to grow from 0 to the members' count

    def in_order(lo: int) -> None:
        piece = members[lo : lo + VALIDATE_PIECE + 1]  # and the next piece's first: the pair across
        blocks = a["block"][piece]
        # Position p lies in block b's range exactly when b is the last block whose range starts at or
        # before p: the members' blocks must be those, which also makes each block's count its range's.
        end = lo + piece.size
        first, last = (int(b) for b in np.searchsorted(offsets, [lo, end - 1], side="right") - 1)
        starts = np.clip(offsets[first : last + 2].astype(np.int64), lo, end)
        expected = np.repeat(np.arange(first, last + 1), np.diff(starts))
        if np.any(blocks != expected):
            raise _fail(
                where, "array 'block_files' puts a file in another block than column 'block' (see 'block_offsets')"
            )
        slots = a["slot"][piece]
        same = blocks[1:] == blocks[:-1]
        if np.any(slots[1:][same] < slots[:-1][same]):
            raise _fail(where, "array 'block_files' is not in slot order")

    in_pieces(in_order, range(0, total, VALIDATE_PIECE), release)
