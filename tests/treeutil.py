"""Source trees to pack: every kind of thing the packer must keep, or a few classes of random files."""

from __future__ import annotations

import os

EDGE_MTIME_NS = 1_600_000_000_123_456_789


def make_edge_tree(root: str | os.PathLike, *, special: bool = False) -> bytes:
    """A tree with every kind of thing the packer must keep: returns its path as bytes.

    Empty files and directories, nested directories, relative/absolute/dangling symlinks, hard links,
    names that are not UTF-8 or hold spaces, newlines and leading dashes, odd modes, nanosecond mtimes.
    With ``special``, also a FIFO and a socket (which the packer skips).
    """
    import socket

    root = os.fsencode(root)
    os.makedirs(root, exist_ok=True)

    def put(rel: bytes, data: bytes, mode: int = 0o644) -> None:
        path = os.path.join(root, rel)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "wb") as f:
            f.write(data)
        os.chmod(path, mode)

    put(b"class_a/one.txt", b"hello\n")
    put(b"class_a/empty.bin", b"")
    put(b"class_a/big.bin", bytes(range(256)) * 700)
    put(b"class_b/\xff\xfe not utf8.bin", b"bytes\x00\xff")
    put(b"class_b/with space.txt", b"space")
    put(b"class_b/new\nline.txt", b"newline")
    put(b"class_b/-leading-dash", b"dash", 0o600)
    put("class_b/日本語.txt".encode(), b"unicode")
    put(b"class_b/deep/er/est/file.dat", os.urandom(3000), 0o755)
    put(b"top_level_file", b"no class", 0o444)
    os.makedirs(os.path.join(root, b"empty_dir"))
    os.makedirs(os.path.join(root, b"class_c/empty_sub"))
    os.chmod(os.path.join(root, b"class_c/empty_sub"), 0o700)
    os.symlink(b"one.txt", os.path.join(root, b"class_a/link_rel"))
    os.symlink(b"/nonexistent/target", os.path.join(root, b"dangling_abs"))
    os.symlink(b"class_b/deep", os.path.join(root, b"link_to_dir"))
    os.link(os.path.join(root, b"class_a/one.txt"), os.path.join(root, b"class_c/hardlink_to_one"))
    if special:
        os.mkfifo(os.path.join(root, b"a_fifo"))
        sock = socket.socket(socket.AF_UNIX)
        sock.bind(os.path.join(root, b"a_socket"))
        sock.close()
    # mtimes last (deepest first), so creating children does not move a directory's mtime.
    for dirpath, dirnames, filenames in os.walk(root, topdown=False):
        for name in filenames + dirnames:
            os.utime(os.path.join(dirpath, name), ns=(EDGE_MTIME_NS, EDGE_MTIME_NS), follow_symlinks=False)
    os.utime(root, ns=(EDGE_MTIME_NS, EDGE_MTIME_NS))
    return root


def make_class_tree(src, files: int, seed: int, sizes: tuple[int, int]) -> None:
    """``files`` files of random bytes (sizes in the closed range ``sizes``) in three class directories."""
    import random
    from pathlib import Path

    rng = random.Random(seed)
    for i in range(files):
        path = Path(src) / f"c{i % 3}" / f"f{i:03d}.bin"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(rng.randbytes(rng.randint(*sizes)))
