"""A live mount read from outside: find its control directory and read its statistics.

The command line (``blockfs stats``, ``umount``), the serving-process helpers and the loader all read a
mount this way; it sits beside :mod:`blockfs.protocol` (not in ``serve`` or ``loader``) so each of them can
use it without the mount and the loader importing each other.
"""

from __future__ import annotations

import errno
import json
import os
from typing import Any

from . import protocol
from .errors import NotADatasetError


def control_dir(mountpoint: str | os.PathLike) -> str:
    """The path of the mount's control directory; NotADatasetError saying why ``mountpoint`` is not a mount."""
    root = os.path.abspath(os.fspath(mountpoint))
    hint = f"mount a packed dataset there first: blockfs mount DATASET {root}"
    gone = NotADatasetError(
        f"{root!r} is a mount whose server is gone (transport endpoint is not connected): "
        f"run 'blockfs umount {root}', then mount the dataset again"
    )
    try:
        os.stat(root)  # may answer from the kernel's cache of a dead mount: the getxattr below does not
    except OSError as e:
        if e.errno == errno.ENOTCONN:
            raise gone from None
    if not os.path.isdir(root):
        raise NotADatasetError(f"{root!r} is not a blockfs mount: it is not a directory ({hint})")
    try:
        name = os.fsdecode(os.getxattr(root, protocol.CONTROL_XATTR))
    except OSError as e:
        if e.errno == errno.ENOTCONN:
            raise gone from None
        if os.path.exists(os.path.join(root, "blockfs.json")):
            hint = f"it is a packed dataset, not its mount: blockfs mount {root} MOUNTPOINT"
        raise NotADatasetError(
            f"{root!r} is not a blockfs mount: it has no {protocol.CONTROL_XATTR!r} attribute ({e.strerror}); {hint}"
        ) from None
    if not name or "/" in name or name in (".", ".."):
        raise NotADatasetError(f"{root!r}: {protocol.CONTROL_XATTR}={name!r} is not the name of a control directory")
    return os.path.join(root, name)


def read_stats(mountpoint: str | os.PathLike) -> dict[str, Any]:
    """The live statistics of a mount (exact: read from an extended attribute the kernel never caches)."""
    return json.loads(os.getxattr(control_dir(mountpoint), protocol.STATS_XATTR))
