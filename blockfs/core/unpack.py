"""``blockfs unpack``: write a packed dataset back out as the tree it was packed from."""

from __future__ import annotations

import os

from .dataset import PackedDataset
from ..errors import BlockfsError
from .index import KIND_DIR, KIND_FILE, KIND_SYMLINK


def unpack(ds: PackedDataset, out: str | os.PathLike, on_file=None) -> int:
    """Recreate the tree under ``out`` (which must be empty or absent); return the number of entries.

    Contents, modes, mtimes (ns), symlinks and hard links come back as packed.  Directory modes and
    times are set last, deepest first, so writing their children does not change them.
    """
    out = os.fsencode(out)
    if os.path.exists(out) and (not os.path.isdir(out) or os.listdir(out)):
        raise BlockfsError(f"output {os.fsdecode(out)!r} exists and is not an empty directory")
    os.makedirs(out, exist_ok=True)
    a = ds.index.arrays
    n = ds.index.n_entries
    written_by_ino: dict[int, bytes] = {}
    for e in range(1, n):
        path = os.path.join(out, ds.path_of(e))
        kind = int(a["kind"][e])
        if kind == KIND_DIR:
            os.mkdir(path, 0o700)
        elif kind == KIND_SYMLINK:
            os.symlink(ds.index.link_target(e), path)
            os.utime(path, ns=(int(a["mtime_ns"][e]),) * 2, follow_symlinks=False)
        elif kind == KIND_FILE:
            ino = int(a["ino"][e])
            if ino in written_by_ino:
                os.link(written_by_ino[ino], path)
            else:
                _write_file(ds, e, path)
                written_by_ino[ino] = path
            os.chmod(path, int(a["mode"][e]) & 0o7777)
            os.utime(path, ns=(int(a["mtime_ns"][e]),) * 2)
        if on_file is not None:
            on_file(e)
    for e in reversed(range(n)):
        if int(a["kind"][e]) == KIND_DIR:
            path = os.path.join(out, ds.path_of(e)) if e else out
            os.chmod(path, int(a["mode"][e]) & 0o7777)
            os.utime(path, ns=(int(a["mtime_ns"][e]),) * 2)
    return n - 1


def _write_file(ds: PackedDataset, e: int, path: bytes) -> None:
    with open(path, "wb") as f:
        for piece in ds.read_pieces(e):
            f.write(piece)
