"""The FUSE kernel protocol as bytes: the request header, the structures a read-only filesystem answers
with, and the notifications it sends.  Pure: no I/O, no FUSE library.

The layouts are ``<linux/fuse.h>``'s (protocol 7.38 here; the kernel and the server agree on the lower of
the two minors at ``FUSE_INIT``).  Everything is native-endian, as the kernel writes it, and 8-byte
aligned where the header says so.  A request is a :data:`IN_HEADER` followed by the operation's own
structure; a reply is an :data:`OUT_HEADER` (its ``error`` is ``-errno`` or 0) followed by the answer::

    request  | len u32 | opcode u32 | unique u64 | nodeid u64 | uid u32 | gid u32 | pid u32 | extlen u16 | pad u16 | body...
    reply    | len u32 | error i32  | unique u64 | body...
    notify   | len u32 | code  i32  | 0      u64 | body...       (unique 0: the server speaks first)

Only :mod:`blockfs.serve.fuse.session` and the low-level adapter use this module.
"""

from __future__ import annotations

import stat
import struct

import numpy as np

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
    LOOKUP: "lookup",
    FORGET: "forget",
    GETATTR: "getattr",
    SETATTR: "setattr",
    READLINK: "readlink",
    OPEN: "open",
    READ: "read",
    STATFS: "statfs",
    RELEASE: "release",
    GETXATTR: "getxattr",
    LISTXATTR: "listxattr",
    FLUSH: "flush",
    INIT: "init",
    OPENDIR: "opendir",
    READDIR: "readdir",
    RELEASEDIR: "releasedir",
    ACCESS: "access",
    INTERRUPT: "interrupt",
    DESTROY: "destroy",
    IOCTL: "ioctl",
    POLL: "poll",
    BATCH_FORGET: "batch_forget",
    READDIRPLUS: "readdirplus",
    LSEEK: "lseek",
    STATX: "statx",
}

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
ATTR = struct.Struct("=QQQqqqIIIIIIIIII")  # fuse_attr: 88 bytes; times signed, as ATTR_ROW says
ENTRY_OUT_HEAD = struct.Struct("=QQQQII")  # nodeid, generation, entry_valid, attr_valid, their nsec
ATTR_OUT_HEAD = struct.Struct("=QII")  # attr_valid, attr_valid_nsec, dummy
READ_IN = struct.Struct("=QQII")  # fh, offset, size, read_flags (lock_owner, flags follow)
GETXATTR_IN = struct.Struct("=II")  # size, padding
GETXATTR_OUT = struct.Struct("=II")
FORGET_IN = struct.Struct("=Q")  # nlookup
FORGET_ONE = struct.Struct("=QQ")  # nodeid, nlookup
FORGET_ROW = np.dtype([("nodeid", "=u8"), ("nlookup", "=u8")])
BATCH_FORGET_IN = struct.Struct("=II")  # count, dummy
OPEN_OUT = struct.Struct("=QII")  # fh, open_flags, padding
KSTATFS = struct.Struct("=QQQQQIIII24x")
DIRENT_HEAD = struct.Struct("=QQII")  # ino, off, namelen, type
NOTIFY_STORE_OUT = struct.Struct("=QQII")  # nodeid, offset, size, padding
NOTIFY_INVAL_ENTRY_OUT = struct.Struct("=QII")  # parent, namelen, flags (the name and a NUL follow)

ENTRY_OUT = struct.Struct(ENTRY_OUT_HEAD.format + ATTR.format[1:])  # the head and the attributes, one pack
ENTRY_OUT_SIZE = ENTRY_OUT.size  # 128
DIRENTPLUS_FIXED = ENTRY_OUT_SIZE + DIRENT_HEAD.size

# The same structures as NumPy rows, for listings packed a whole reply at a time (times as signed
# integers: the kernel reads the u64 as time64_t, so a time before 1970 is its two's complement).
ATTR_ROW = np.dtype(
    [
        ("ino", "=u8"),
        ("size", "=u8"),
        ("blocks", "=u8"),
        ("atime", "=i8"),
        ("mtime", "=i8"),
        ("ctime", "=i8"),
        ("atimensec", "=u4"),
        ("mtimensec", "=u4"),
        ("ctimensec", "=u4"),
        ("mode", "=u4"),
        ("nlink", "=u4"),
        ("uid", "=u4"),
        ("gid", "=u4"),
        ("rdev", "=u4"),
        ("blksize", "=u4"),
        ("flags", "=u4"),
    ]
)
ENTRY_OUT_ROW = np.dtype(
    [
        ("nodeid", "=u8"),
        ("generation", "=u8"),
        ("entry_valid", "=u8"),
        ("attr_valid", "=u8"),
        ("entry_valid_nsec", "=u4"),
        ("attr_valid_nsec", "=u4"),
        ("attr", ATTR_ROW),
    ]
)
DIRENT_ROW = np.dtype([("ino", "=u8"), ("off", "=u8"), ("namelen", "=u4"), ("type", "=u4")])
DIRENTPLUS_ROW = np.dtype([("entry", ENTRY_OUT_ROW), ("dirent", DIRENT_ROW)])


def attr(ino: int, size: int, mode: int, nlink: int, mtime_ns: int, uid: int, gid: int) -> bytes:
    """A ``fuse_attr`` for a read-only entry: every time is the mtime, 512-byte ``blocks`` of the size."""
    sec, nsec = divmod(mtime_ns, 1_000_000_000)
    blocks = (size + 511) // 512 if stat.S_ISREG(mode) else 0
    return ATTR.pack(ino, size, blocks, sec, sec, sec, nsec, nsec, nsec, mode, nlink, uid, gid, 0, 4096, 0)


def entry_out(nodeid: int, attr_bytes: bytes, valid_s: int) -> bytes:
    """A ``fuse_entry_out``: the name and the attributes are both valid for ``valid_s`` seconds."""
    return ENTRY_OUT_HEAD.pack(nodeid, 0, valid_s, valid_s, 0, 0) + attr_bytes


def entry(
    nodeid: int, valid_s: int, ino: int, size: int, mode: int, nlink: int, mtime_ns: int, uid: int, gid: int
) -> bytes:
    """:func:`entry_out` of :func:`attr` in one pack: a LOOKUP's answer, built once per request."""
    sec, nsec = divmod(mtime_ns, 1_000_000_000)
    blocks = (size + 511) >> 9 if mode & 0o170000 == 0o100000 else 0
    return ENTRY_OUT.pack(
        nodeid,
        0,
        valid_s,
        valid_s,
        0,
        0,
        ino,
        size,
        blocks,
        sec,
        sec,
        sec,
        nsec,
        nsec,
        nsec,
        mode,
        nlink,
        uid,
        gid,
        0,
        4096,
        0,
    )


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


def attr_rows(
    ino: np.ndarray,
    size: np.ndarray,
    mode: np.ndarray,
    nlink: np.ndarray,
    mtime_ns: np.ndarray,
    uid: int,
    gid: int,
    out: np.ndarray | None = None,
) -> np.ndarray:
    """:func:`attr` of many entries at once: an :data:`ATTR_ROW` array (written into ``out``, zeroed,
    when given: a field of a larger row)."""
    if out is None:
        out = np.zeros(len(ino), dtype=ATTR_ROW)
    sec, nsec = np.divmod(np.asarray(mtime_ns, dtype=np.int64), 1_000_000_000)
    mode = np.asarray(mode, dtype=np.uint32)
    out["ino"], out["size"], out["mode"], out["nlink"] = ino, size, mode, nlink
    out["blocks"] = (np.asarray(size, dtype=np.uint64) + 511) // 512
    out["blocks"][(mode & 0o170000) != stat.S_IFREG] = 0  # a directory's or a link's size is not data
    out["atime"] = out["mtime"] = out["ctime"] = sec
    out["atimensec"] = out["mtimensec"] = out["ctimensec"] = nsec
    out["uid"], out["gid"], out["blksize"] = uid, gid, 4096
    return out


def dirent_rows(
    ino: np.ndarray, next_offset: np.ndarray, name_length: np.ndarray, mode: np.ndarray, out: np.ndarray | None = None
) -> np.ndarray:
    """The fixed part of many ``fuse_dirent`` at once (each record's name follows it: :func:`records`),
    written into ``out`` when given."""
    if out is None:
        out = np.empty(len(ino), dtype=DIRENT_ROW)
    out["ino"], out["off"], out["namelen"] = ino, next_offset, name_length
    out["type"] = (np.asarray(mode, dtype=np.uint32) & 0o170000) >> 12
    return out


def records(fixed: np.ndarray, table: np.ndarray, start: np.ndarray, length: np.ndarray) -> bytes:
    """Rows of ``fixed`` (:data:`DIRENT_ROW` or :data:`DIRENTPLUS_ROW`), each followed by its name —
    ``table[start[i] : start[i] + length[i]]`` — and zeros to a multiple of 8 bytes: a READDIR(PLUS)
    reply, packed without a Python object per entry.  Built as one row per record as wide as the widest
    (names are at most 255 bytes), then cut to each record's length."""
    n, width = len(fixed), fixed.dtype.itemsize
    if not n:
        return b""
    widest = int(length.max())
    cols = np.arange(widest)
    rows = np.zeros((n, (width + widest + 7) & ~7), dtype=np.uint8)
    rows[:, :width] = fixed.view(np.uint8).reshape(n, width)
    inside = cols < length[:, None]
    rows[:, width : width + widest][inside] = table[(start[:, None] + cols)[inside]]
    keep = np.arange(rows.shape[1]) < ((width + length + 7) & ~7)[:, None]
    return rows[keep].tobytes()


def record_ends(length: np.ndarray, plus: bool) -> np.ndarray:
    """Where each of a run of records ends, from the first one's start, for names of these lengths (a
    record is at least its fixed part + 8 bytes: names are never empty, records 8-byte aligned)."""
    return np.cumsum((record_width(plus) + length + 7) & ~7)


def record_width(plus: bool) -> int:
    """The fixed part of a READDIRPLUS (``plus``) or READDIR record, in bytes (a multiple of 8)."""
    return DIRENTPLUS_ROW.itemsize if plus else DIRENT_ROW.itemsize


def forgets(body: memoryview) -> np.ndarray:
    """The (nodeid, nlookup) rows of a BATCH_FORGET request, as one array."""
    count, _ = BATCH_FORGET_IN.unpack_from(body)
    return np.frombuffer(body, dtype=FORGET_ROW, count=count, offset=BATCH_FORGET_IN.size)


def notify_store_header(nodeid: int, offset: int, size: int) -> bytes:
    """The bytes before the data of a ``FUSE_NOTIFY_STORE``: put ``size`` bytes at ``offset`` of
    ``nodeid``'s page cache (the kernel answers ENOENT for a node it does not hold).  ``size`` is at most
    :data:`STORE_PIECE`: a bigger store is sent in pieces (:meth:`blockfs.serve.fuse.session.Session.store`)."""
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
