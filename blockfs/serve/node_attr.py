"""``Attr``: what ``stat`` shows of a node of the mount — the one attribute type of the dataset's entries and
the control directory's files alike, so each adapter maps attributes once (:mod:`blockfs.serve.view`) — and
``Listing``, a directory's children in bulk with their attributes as :data:`ATTRS` rows."""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

# Attributes in bulk (a listing's slice): one row per node, the fields of Attr
ATTRS = np.dtype([("ino", "u8"), ("size", "u8"), ("mode", "u4"), ("nlink", "u4"), ("mtime_ns", "i8")])


class Attr(NamedTuple):
    """What ``stat`` shows of a node (times are the mtime; uid/gid are the mount's)."""

    ino: int
    size: int
    mode: int
    nlink: int
    mtime_ns: int


def attr_rows(attrs: list[Attr]) -> np.ndarray:
    """``attrs`` as an :data:`ATTRS` array."""
    return np.array([tuple(a) for a in attrs], dtype=ATTRS)


class Listing(NamedTuple):
    """Children ``first..stop-1`` of a directory: their nodes, their names (name ``i`` is
    ``table[start[i] : start[i] + length[i]]``, a uint8 array) and their attributes (:data:`ATTRS` rows)."""

    nodes: np.ndarray
    table: np.ndarray
    start: np.ndarray
    length: np.ndarray
    attrs: np.ndarray
