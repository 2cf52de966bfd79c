"""The FUSE kernel protocol as bytes: the request header, the structures a read-only filesystem answers
with, and the notifications it sends.  Pure: no I/O, no FUSE library.

The layouts are ``<linux/fuse.h>``'s (protocol 7.38 here; the kernel and the server agree on the lower of
the two minors at ``FUSE_INIT``).  Everything is native-endian, as the kernel writes it, and 8-byte
aligned where the header says so.  A request is a :data:`IN_HEADER` followed by the operation's own
structure; a reply is an :data:`OUT_HEADER` (its ``error`` is ``-errno`` or 0) followed by the answer::

    request  | len u32 | opcode u32 | unique u64 | nodeid u64 | uid u32 | gid u32 | pid u32 | extlen u16 | pad u16 | body...
    reply    | len u32 | error i32  | unique u64 | body...
    notify   | len u32 | code  i32  | 0      u64 | body...       (unique 0: the server speaks first)

Only :mod:`blockfs.serve.session` and the low-level adapter use this module.
"""

from __future__ import annotations

import stat
import struct

KERNEL_MAJOR = 7
KERNEL_MINOR = 38  # what these layouts are; older kernels (>= MIN_MINOR) get the same bytes they understand
MIN_MINOR = 31  # FUSE_MAX_PAGES, NO_OPEN(DIR)_SUPPORT, CACHE_SYMLINKS: Linux 5.1 and later
ROOT_ID = 1

# opcodes
LOOKUP, FORGET, GETATTR, SETATTR, READLINK = 1, 2, 3, 4, 5
OPEN, READ, STATFS, RELEASE = 14, 15, 17, 18
GETXATTR, LISTXATTR, FLUSH, INIT = 22, 23, 25, 26
OPENDIR, READDIR, RELEASEDIR, ACCESS = 27, 28, 29, 34
INTERRUPT, DESTROY, IOCTL, POLL = 36, 38, 39, 40
BATCH_FORGET, READDIRPLUS, LSEEK, STATX = 42, 44, 46, 52

OPCODE_NAMES = {
    LOOKUP: "lookup", FORGET: "forget", GETATTR: "getattr", SETATTR: "setattr", READLINK: "readlink",
    OPEN: "open", READ: "read", STATFS: "statfs", RELEASE: "release", GETXATTR: "getxattr",
    LISTXATTR: "listxattr", FLUSH: "flush", INIT: "init", OPENDIR: "opendir", READDIR: "readdir",
    RELEASEDIR: "releasedir", ACCESS: "access", INTERRUPT: "interrupt", DESTROY: "destroy", IOCTL: "ioctl",
    POLL: "poll", BATCH_FORGET: "batch_forget", READDIRPLUS: "readdirplus", LSEEK: "lseek", STATX: "statx",
}  # fmt: skip

# FUSE_INIT flags (the first word; bit 30 says a second word follows)
ASYNC_READ = 1 << 0
EXPORT_SUPPORT = 1 << 4
DO_READDIRPLUS = 1 << 13
READDIRPLUS_AUTO = 1 << 14
NO_OPEN_SUPPORT = 1 << 17
PARALLEL_DIROPS = 1 << 18
MAX_PAGES = 1 << 22
CACHE_SYMLINKS = 1 << 23
NO_OPENDIR_SUPPORT = 1 << 24
INIT_EXT = 1 << 30

# open flags in replies
FOPEN_KEEP_CACHE = 1 << 1
FOPEN_CACHE_DIR = 1 << 3

NOTIFY_INVAL_ENTRY = 3
NOTIFY_STORE = 4
# The most one FUSE_NOTIFY_STORE carries.  The kernel takes any size whose message arrives whole, but the
# size is a u32 and write(2) moves at most MAX_RW_COUNT (2 GiB - 4 KiB) bytes, so a bigger file is stored
# in pieces; a multiple of every page size, so each page but a file's last is stored whole.
STORE_PIECE = 4 << 20

IN_HEADER = struct.Struct("=IIQQIIIHH")  # len, opcode, unique, nodeid, uid, gid, pid, total_extlen, padding
OUT_HEADER = struct.Struct("=IiQ")  # len, error, unique
INIT_IN = struct.Struct("=IIII")  # major, minor, max_readahead, flags (flags2 follows when INIT_EXT)
INIT_OUT = struct.Struct("=IIIIHHIIHHI28x")  # ... max_pages, map_alignment, flags2, unused[7]
ATTR = struct.Struct("=QQQQQQIIIIIIIIII")  # fuse_attr: 88 bytes
ENTRY_OUT_HEAD = struct.Struct("=QQQQII")  # nodeid, generation, entry_valid, attr_valid, their nsec
ATTR_OUT_HEAD = struct.Struct("=QII")  # attr_valid, attr_valid_nsec, dummy
READ_IN = struct.Struct("=QQII")  # fh, offset, size, read_flags (lock_owner, flags follow)
GETXATTR_IN = struct.Struct("=II")  # size, padding
GETXATTR_OUT = struct.Struct("=II")
FORGET_IN = struct.Struct("=Q")  # nlookup
FORGET_ONE = struct.Struct("=QQ")  # nodeid, nlookup
BATCH_FORGET_IN = struct.Struct("=II")  # count, dummy
OPEN_OUT = struct.Struct("=QII")  # fh, open_flags, padding
KSTATFS = struct.Struct("=QQQQQIIII24x")
DIRENT_HEAD = struct.Struct("=QQII")  # ino, off, namelen, type
NOTIFY_STORE_OUT = struct.Struct("=QQII")  # nodeid, offset, size, padding
NOTIFY_INVAL_ENTRY_OUT = struct.Struct("=QII")  # parent, namelen, flags (the name and a NUL follow)

ENTRY_OUT_SIZE = ENTRY_OUT_HEAD.size + ATTR.size  # 128
DIRENTPLUS_FIXED = ENTRY_OUT_SIZE + DIRENT_HEAD.size


def attr(ino: int, size: int, mode: int, nlink: int, mtime_ns: int, uid: int, gid: int) -> bytes:
    """A ``fuse_attr`` for a read-only entry: every time is the mtime, 512-byte ``blocks`` of the size."""
    sec, nsec = divmod(mtime_ns, 1_000_000_000)
    blocks = (size + 511) // 512 if stat.S_ISREG(mode) else 0
    return ATTR.pack(ino, size, blocks, sec, sec, sec, nsec, nsec, nsec, mode, nlink, uid, gid, 0, 4096, 0)


def entry_out(nodeid: int, attr_bytes: bytes, valid_s: int) -> bytes:
    """A ``fuse_entry_out``: the name and the attributes are both valid for ``valid_s`` seconds."""
    return ENTRY_OUT_HEAD.pack(nodeid, 0, valid_s, valid_s, 0, 0) + attr_bytes


def negative_entry(valid_s: int) -> bytes:
    """A lookup answer of node id 0: "no such name", remembered by the kernel for ``valid_s`` seconds."""
    return ENTRY_OUT_HEAD.pack(0, 0, valid_s, 0, 0, 0) + bytes(ATTR.size)


def attr_out(attr_bytes: bytes, valid_s: int) -> bytes:
    return ATTR_OUT_HEAD.pack(valid_s, 0, 0) + attr_bytes


def dirent_type(mode: int) -> int:
    """The ``d_type`` of a mode: its file-type bits shifted down, as ``IFTODT`` does."""
    return (mode & 0o170000) >> 12


def _padding(n: int) -> bytes:
    return b"\0" * (-n & 7)


def direntplus(entry: bytes, ino: int, next_offset: int, name: bytes, mode: int) -> bytes:
    """One ``fuse_direntplus``: the entry (node id 0 for "." and "..", which the kernel does not look up),
    then the dirent; ``next_offset`` is where a later READDIRPLUS resumes, never 0 (libfuse < 3.17.1 and
    some kernels treat 0 as the start)."""
    head = DIRENT_HEAD.pack(ino, next_offset, len(name), dirent_type(mode))
    return entry + head + name + _padding(DIRENTPLUS_FIXED + len(name))


def dirent(ino: int, next_offset: int, name: bytes, mode: int) -> bytes:
    head = DIRENT_HEAD.pack(ino, next_offset, len(name), dirent_type(mode))
    return head + name + _padding(DIRENT_HEAD.size + len(name))


def notify_store_header(nodeid: int, offset: int, size: int) -> bytes:
    """The bytes before the data of a ``FUSE_NOTIFY_STORE``: put ``size`` bytes at ``offset`` of
    ``nodeid``'s page cache (the kernel answers ENOENT for a node it does not hold).  ``size`` is at most
    :data:`STORE_PIECE`: a bigger store is sent in pieces (:meth:`blockfs.serve.session.Session.store`)."""
    if not 0 <= size <= STORE_PIECE:
        raise ValueError(f"a FUSE_NOTIFY_STORE of {size} bytes: store at most {STORE_PIECE} bytes a message")
    body = NOTIFY_STORE_OUT.pack(nodeid, offset, size, 0)
    return OUT_HEADER.pack(OUT_HEADER.size + len(body) + size, NOTIFY_STORE, 0) + body


def notify_inval_entry(parent: int, name: bytes) -> bytes:
    """Drop the name ``name`` in directory ``parent`` from the kernel's cache (a later lookup asks again)."""
    body = NOTIFY_INVAL_ENTRY_OUT.pack(parent, len(name), 0) + name + b"\0"
    return OUT_HEADER.pack(OUT_HEADER.size + len(body), NOTIFY_INVAL_ENTRY, 0) + body


def kstatfs(blocks: int, files: int, bsize: int = 4096, namelen: int = 255) -> bytes:
    return KSTATFS.pack(blocks, 0, 0, files, 0, bsize, namelen, bsize, 0)
