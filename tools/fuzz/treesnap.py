"""What a pack must keep of a source tree, as one comparable value: the fuzzer's invariant and the tests
of pack and unpack compare trees with it."""

from __future__ import annotations

import os
import stat


def tree_snapshot(root: str | os.PathLike) -> dict:
    """Everything pack must keep, per relative path: type, mode, mtime, content or link target, and
    which paths share an inode."""
    root = os.fsencode(root)
    snap: dict = {}
    inodes: dict = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in sorted(dirnames + filenames):
            path = os.path.join(dirpath, name)
            rel = os.path.relpath(path, root)
            st = os.lstat(path)
            if stat.S_ISREG(st.st_mode):
                with open(path, "rb") as f:
                    what = ("file", f.read())
                inodes.setdefault(st.st_ino, []).append(rel)
            elif stat.S_ISLNK(st.st_mode):
                what = ("link", os.readlink(path))
            elif stat.S_ISDIR(st.st_mode):
                what = ("dir", None)
            else:
                continue
            mode = st.st_mode if not stat.S_ISLNK(st.st_mode) else None
            snap[rel] = (what, mode, st.st_mtime_ns)
    snap["hardlink groups"] = sorted(sorted(v) for v in inodes.values() if len(v) > 1)
    return snap
