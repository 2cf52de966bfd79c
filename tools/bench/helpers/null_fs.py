"""A FUSE filesystem that does no work: the ceiling of a Python FUSE server on this machine, per route.

    python tools/bench/helpers/null_fs.py SRC MOUNTPOINT [--fuse kernel|c|mfusepy|pyfuse3] [--threads N] [--clone]

It shows SRC's tree (names, sizes, modes, taken once at start) and answers every read with zero bytes from
one preallocated buffer: no index, no cache, no copy of file data in Python.  Whatever a reader gets from it
per second is what the FUSE round trip and the route cost; ``tools/bench/bench_mount.py``
and ``tools/bench/bench_fuse_routes.py`` read it side by side with the mount.  The routes:

* ``kernel`` — :mod:`blockfs.serve.fuse.session`, the kernel protocol spoken on ``/dev/fuse`` directly, with what
  ``blockfs mount`` asks of it: READDIRPLUS listings with attributes, no OPEN/OPENDIR round trips;
* ``mfusepy`` — libfuse 3's high-level API through mfusepy, with the same options and per-thread trick as the
  mfusepy adapter (:mod:`blockfs.serve.fuse.libfuse_adapter`): open answered ENOSYS, a LOOKUP per file;
* ``c`` — the kernel route's protocol, tree and answers in C (``null_fs_c.c``, built here with the machine's
  compiler): what the same requests cost with no Python in the request loop;
* ``lowlevel`` — libfuse 3's low-level API through a ctypes binding written here: node ids in every callback,
  READDIRPLUS and no open (what the kernel route does), but each request still a ctypes callback;
* ``pyfuse3`` — libfuse 3's low-level API through pyfuse3 (when installed): readdir with attributes, but it
  must implement ``open`` (its ``read`` sees only a file handle), so an OPEN and a RELEASE per file.
"""

from __future__ import annotations

import errno
import os
import shutil
import stat
import struct
import subprocess
import sys
from pathlib import Path
from types import ModuleType

# The checkout, for blockfs: a child script, started by path, perhaps by another venv's interpreter
# (bench_fuse_routes.py --pyfuse3-python), so the helpers package's path set-up does not reach it.
sys.path.insert(0, str(Path(__file__).resolve().parents[3]))

ZEROS = bytes(1 << 20)


def walk(src: str) -> tuple[dict[bytes, os.stat_result], dict[bytes, list[bytes]]]:
    """Every path of SRC (b"" the root) with its lstat, and each directory's names."""
    stats: dict[bytes, os.stat_result] = {}
    children: dict[bytes, list[bytes]] = {}
    root = os.fsencode(src)
    for parent, dirs, files in os.walk(root):
        rel = os.path.relpath(parent, root).removeprefix(b".").lstrip(b"/")
        stats[rel] = os.lstat(parent)
        children[rel] = sorted(dirs + files)
        for name in files:
            stats[os.path.join(rel, name)] = os.lstat(os.path.join(parent, name))
    return stats, children


def serve_kernel(src: str, mountpoint: str, threads: int, listing: str = "plus", counts: str | None = None) -> None:
    """The no-work server on the kernel protocol (blockfs.serve.fuse.session); ``listing`` as blockfs
    mount's ``--listing``: READDIRPLUS always (plus), when the kernel asks (auto) or never (plain).
    ``counts``: a file the requests received so far (by opcode name) are written to, as JSON, at each SIGUSR1
    (how a benchmark counts what each pass sent it, as blockfs's statistics do)."""
    import json
    import signal

    from blockfs.serve.fuse import wire
    from blockfs.serve.fuse.session import NO_REPLY, Session

    stats, children = walk(src)
    paths = sorted(stats)  # node id = position + 1: the root (b"") first
    node_of = {p: i + 1 for i, p in enumerate(paths)}
    attrs = [
        wire.attr(node_of[p], st.st_size, st.st_mode & ~0o222, st.st_nlink, st.st_mtime_ns, 0, 0)
        for p, st in ((p, stats[p]) for p in paths)
    ]
    sizes = [stats[p].st_size for p in paths]
    valid = 86400

    def lookup(nodeid: int, body: memoryview, unique: int) -> bytes:
        parent = paths[nodeid - 1]
        name = bytes(body[: len(body) - 1])
        child = node_of.get(os.path.join(parent, name) if parent else name)
        if child is None:
            return wire.negative_entry(valid)
        return wire.entry_out(child, attrs[child - 1], valid)

    def getattr_(nodeid: int, body: memoryview, unique: int) -> bytes:
        return wire.attr_out(attrs[nodeid - 1], valid)

    def entries(nodeid: int, body: memoryview, dirent) -> bytes:
        """Entries from the request's offset on, as many as fit, each made by ``dirent(child, index, name)``."""
        _fh, offset, size, _flags = wire.READ_IN.unpack_from(body)
        parent = paths[nodeid - 1]
        names = children[parent]
        out, used = [], 0
        for i in range(offset, len(names)):
            child = node_of[os.path.join(parent, names[i]) if parent else names[i]]
            one = dirent(child, i, names[i])
            if used + len(one) > size:
                break
            out.append(one)
            used += len(one)
        return b"".join(out)

    def readdirplus(nodeid: int, body: memoryview, unique: int) -> bytes:
        return entries(
            nodeid,
            body,
            lambda child, i, name: wire.direntplus(
                wire.entry_out(child, attrs[child - 1], valid), child, i + 1, name, stats[paths[child - 1]].st_mode
            ),
        )

    def readdir(nodeid: int, body: memoryview, unique: int) -> bytes:
        return entries(
            nodeid, body, lambda child, i, name: wire.dirent(child, i + 1, name, stats[paths[child - 1]].st_mode)
        )

    def read(nodeid: int, body: memoryview, unique: int) -> memoryview:
        _fh, offset, size, _flags = wire.READ_IN.unpack_from(body)
        end = min(offset + size, sizes[nodeid - 1])
        return memoryview(ZEROS)[: max(0, end - offset)]

    def statfs(nodeid: int, body: memoryview, unique: int) -> bytes:
        return wire.kstatfs(1, len(paths))

    def enosys(nodeid: int, body: memoryview, unique: int) -> bytes:
        raise OSError(errno.ENOSYS, "not implemented")

    handlers = {
        wire.LOOKUP: lookup,
        wire.GETATTR: getattr_,
        wire.READDIRPLUS: readdirplus,
        wire.READ: read,
        wire.READDIR: readdir,
        wire.STATFS: statfs,
        wire.OPEN: enosys,
        wire.OPENDIR: enosys,
        wire.INTERRUPT: enosys,
        wire.FORGET: lambda *a: NO_REPLY,
        wire.BATCH_FORGET: lambda *a: NO_REPLY,
    }
    flags = kernel_flags(listing)
    session = Session(handlers, on_init=lambda minor, kernel: flags)
    if counts is not None:

        def write_counts(signum: int, frame: object) -> None:
            sent = {wire.OPCODE_NAMES.get(k, str(k)): v for k, v in list(session.requests.items())}
            with open(f"{counts}.tmp", "w") as f:
                json.dump(sent, f)
            os.replace(f"{counts}.tmp", counts)

        signal.signal(signal.SIGUSR1, write_counts)
    session.mount(mountpoint, src.replace(",", "_"), "nullfs")
    session.serve(threads)
    print({wire.OPCODE_NAMES.get(k, k): v for k, v in session.requests.items()}, file=sys.stderr)


C_SOURCE = Path(__file__).with_name("null_fs_c.c")
TABLE_NODE = struct.Struct("=QQIIQ")  # parent, name offset, name length, child count, first child; fuse_attr follows


def compiler() -> str | None:
    """The C compiler ``--fuse c`` builds with: ``$CC``, else cc or gcc on the PATH (None: there is none)."""
    for name in (os.environ.get("CC"), "cc", "gcc"):
        if name and shutil.which(name):
            return shutil.which(name)
    return None


def build_c(out_dir: str) -> str:
    """null_fs_c.c compiled with -O2 into ``out_dir``; the program's path.  One line and exit without a compiler."""
    cc = compiler()
    if cc is None:
        raise SystemExit("null_fs.py --fuse c: no C compiler found (cc, gcc or $CC): install one (apt-get install gcc)")
    binary = os.path.join(out_dir, "null_fs_c")
    done = subprocess.run(
        [cc, "-O2", "-pthread", "-o", binary, str(C_SOURCE)], capture_output=True, text=True, stdin=subprocess.DEVNULL
    )
    if done.returncode != 0:
        why = (done.stderr or done.stdout).strip().splitlines()
        raise SystemExit(f"null_fs.py --fuse c: {cc} could not build {C_SOURCE.name}: {why[0] if why else 'failed'}")
    return binary


def write_table(src: str, path: str) -> None:
    """SRC's tree as null_fs_c reads it (the format in null_fs_c.c's header): the same node ids, attributes and
    listing order as the kernel route's."""
    from blockfs.serve.fuse import wire

    stats, children = walk(src)
    paths = sorted(stats)
    node_of = {p: i + 1 for i, p in enumerate(paths)}
    name_blob = bytearray()
    kids: list[int] = []
    records = []
    for p in paths:
        st = stats[p]
        name = os.path.basename(p)
        parent = node_of[os.path.dirname(p)] if p else 0
        names = children.get(p, [])
        record = TABLE_NODE.pack(parent, len(name_blob), len(name), len(names), len(kids))
        records.append(
            record + wire.attr(node_of[p], st.st_size, st.st_mode & ~0o222, st.st_nlink, st.st_mtime_ns, 0, 0)
        )
        name_blob += name
        kids.extend(node_of[os.path.join(p, n) if p else n] for n in names)
    with open(path, "wb") as f:
        f.write(b"NULLFSC1" + struct.pack("=QQQ", len(paths), len(kids), len(name_blob)))
        f.write(b"".join(records))
        f.write(struct.pack(f"={len(kids)}Q", *kids))
        f.write(name_blob)


URING_PARAMETER = "/sys/module/fuse/parameters/enable_uring"
OVER_IO_URING = 1 << 9  # FUSE_OVER_IO_URING (1 << 41): the INIT flags' second word


def uring_init(request: bytes, answer: bytes) -> bytes:
    """``answer`` (the session's INIT answer) asking also for FUSE_OVER_IO_URING, which ``request`` (the
    kernel's INIT) must offer; one line and exit where it does not."""
    from blockfs.serve.fuse import wire

    _major, _minor, _readahead, flags = wire.INIT_IN.unpack_from(request, wire.IN_HEADER.size)
    flags2 = struct.unpack_from("=I", request, wire.IN_HEADER.size + wire.INIT_IN.size)[0]
    if not (flags & wire.INIT_EXT and flags2 & OVER_IO_URING):
        raise SystemExit(f"null_fs.py --uring: this kernel offers no FUSE over io_uring (root sets {URING_PARAMETER})")
    fields = list(wire.INIT_OUT.unpack(answer))
    fields[3] |= wire.INIT_EXT
    fields[10] |= OVER_IO_URING
    return wire.INIT_OUT.pack(*fields)


def serve_c(
    src: str,
    mountpoint: str,
    threads: int,
    listing: str = "plus",
    counts: str | None = None,
    clone: bool = False,
    uring: bool = False,
) -> None:
    """The no-work server with no Python in its request loop: null_fs_c.c, built here, serving the mount this
    process makes as the kernel route does (blockfs's session mounts and answers INIT with the same flags), with
    ``threads`` workers (``clone``: a FUSE_DEV_IOC_CLONE descriptor each).  This process stays as its
    supervisor: SIGUSR1 is passed on (the counts), and the mount is always taken down when either ends."""
    import signal
    import tempfile

    from blockfs.serve.fuse import wire
    from blockfs.serve.fuse.session import BUFFER_BYTES, Session

    work = tempfile.mkdtemp(prefix="null-fs-c-")  # private (0700): the program and the table
    child = None
    session = Session({}, on_init=lambda minor, kernel: kernel_flags(listing))
    stop = []

    def stopping(signum: int, frame: object) -> None:
        stop.append(signum)

    def pass_on(signum: int, frame: object) -> None:
        if child is not None:
            child.send_signal(signum)

    old = {s: signal.signal(s, stopping) for s in (signal.SIGINT, signal.SIGTERM)}
    old[signal.SIGUSR1] = signal.signal(signal.SIGUSR1, pass_on)
    try:
        binary = build_c(work)
        table = os.path.join(work, "tree")
        write_table(src, table)
        switched = False
        if uring:  # offered at INIT only while the module's switch is on; on just for this mount's INIT
            with open(URING_PARAMETER) as f:
                switched = f.read().strip() != "Y"
            if switched:
                with open(URING_PARAMETER, "w") as f:
                    f.write("Y")
        try:  # the switch is read when the kernel sends INIT and again when it takes the answer
            session.mount(mountpoint, src.replace(",", "_"), "nullfs")
            request = os.read(session.fd, BUFFER_BYTES)  # the kernel's first request is always INIT
            _len, opcode, unique, *_ = wire.IN_HEADER.unpack_from(request)
            if opcode != wire.INIT:
                raise SystemExit(f"null_fs.py --fuse c: the kernel's first request was opcode {opcode}, not INIT")
            answer = session.init_answer(memoryview(request)[wire.IN_HEADER.size :])
            if answer is None:
                raise SystemExit("null_fs.py --fuse c: the kernel's FUSE protocol is too old")
            session.reply(unique, uring_init(request, answer) if uring else answer)
        finally:
            if switched:
                with open(URING_PARAMETER, "w") as f:
                    f.write("N")
        mode = "2" if uring else "1" if clone else "0"
        command = [binary, table, str(session.fd), str(threads), mode, counts or ""]
        child = subprocess.Popen(command, pass_fds=(session.fd,), stdin=subprocess.DEVNULL)
        while not stop and child.poll() is None:
            try:
                child.wait(0.2)
            except subprocess.TimeoutExpired:
                pass
    finally:
        for s, handler in old.items():
            signal.signal(s, handler)
        session.unmount()  # the workers then read ENODEV and the program ends
        if child is not None:
            try:
                child.wait(10)
            except subprocess.TimeoutExpired:
                child.kill()
                child.wait()
        if session.fd >= 0:
            os.close(session.fd)
        shutil.rmtree(work, ignore_errors=True)


def kernel_flags(listing: str) -> int:
    """The INIT flags ``blockfs mount`` asks for on the kernel route, with ``listing``'s READDIR or READDIRPLUS,
    and CACHE_SYMLINKS (which blockfs leaves out: its statistics links move; this tree's never do)."""
    from blockfs.serve.fuse import wire
    from blockfs.serve.fuse.kernel_adapter import INIT_FLAGS, LISTING_FLAGS

    return INIT_FLAGS | LISTING_FLAGS[listing] | wire.CACHE_SYMLINKS


def serve_lowlevel(src: str, mountpoint: str, threads: int) -> None:
    """The no-work server on libfuse 3's low-level API through ctypes (a binding of our own): node ids in
    every callback, READDIRPLUS, open and opendir left to libfuse (ENOSYS with NO_OPEN_SUPPORT), libfuse's
    multi-threaded loop (``--threads 1``: its single-threaded one); each callback is a ctypes call into Python,
    as in mfusepy."""
    import ctypes
    import ctypes.util

    from blockfs.serve.fuse.libfuse_adapter import keep_thread_state

    lib = ctypes.CDLL(ctypes.util.find_library("fuse3"))
    stats, children = walk(src)
    paths = sorted(stats)
    node_of = {p: i + 1 for i, p in enumerate(paths)}

    class Stat(ctypes.Structure):  # x86_64 struct stat
        _fields_ = [
            ("st_dev", ctypes.c_uint64),
            ("st_ino", ctypes.c_uint64),
            ("st_nlink", ctypes.c_uint64),
            ("st_mode", ctypes.c_uint32),
            ("st_uid", ctypes.c_uint32),
            ("st_gid", ctypes.c_uint32),
            ("pad0", ctypes.c_int),
            ("st_rdev", ctypes.c_uint64),
            ("st_size", ctypes.c_int64),
            ("st_blksize", ctypes.c_int64),
            ("st_blocks", ctypes.c_int64),
            ("st_atime", ctypes.c_int64),
            ("st_atime_ns", ctypes.c_int64),
            ("st_mtime", ctypes.c_int64),
            ("st_mtime_ns", ctypes.c_int64),
            ("st_ctime", ctypes.c_int64),
            ("st_ctime_ns", ctypes.c_int64),
            ("reserved", ctypes.c_int64 * 3),
        ]

    class EntryParam(ctypes.Structure):
        _fields_ = [
            ("ino", ctypes.c_uint64),
            ("generation", ctypes.c_uint64),
            ("attr", Stat),
            ("attr_timeout", ctypes.c_double),
            ("entry_timeout", ctypes.c_double),
        ]

    def entry(node: int) -> EntryParam:
        st = stats[paths[node - 1]]
        e = EntryParam()
        e.ino, e.attr.st_ino, e.attr.st_mode = node, node, st.st_mode & ~0o222
        e.attr.st_nlink, e.attr.st_size, e.attr.st_mtime = st.st_nlink, st.st_size, st.st_mtime_ns // 10**9
        e.attr_timeout = e.entry_timeout = 86400.0
        return e

    entries = [entry(n) for n in range(1, len(paths) + 1)]
    req, ino_t, vp = ctypes.c_void_p, ctypes.c_uint64, ctypes.c_void_p
    lib.fuse_reply_entry.argtypes = (req, ctypes.POINTER(EntryParam))
    lib.fuse_reply_attr.argtypes = (req, ctypes.POINTER(Stat), ctypes.c_double)
    lib.fuse_reply_buf.argtypes = (req, ctypes.c_char_p, ctypes.c_size_t)
    lib.fuse_reply_err.argtypes = (req, ctypes.c_int)
    lib.fuse_add_direntry_plus.argtypes = (
        req,
        ctypes.c_void_p,
        ctypes.c_size_t,
        ctypes.c_char_p,
        ctypes.POINTER(EntryParam),
        ctypes.c_int64,
    )
    lib.fuse_add_direntry_plus.restype = ctypes.c_size_t

    def lookup(r, parent, name):
        keep_thread_state()
        p = paths[parent - 1]
        node = node_of.get(os.path.join(p, name) if p else name)
        if node is None:
            lib.fuse_reply_err(r, errno.ENOENT)
        else:
            lib.fuse_reply_entry(r, ctypes.byref(entries[node - 1]))

    def getattr_(r, ino, fi):
        keep_thread_state()
        lib.fuse_reply_attr(r, ctypes.byref(entries[ino - 1].attr), 86400.0)

    def read(r, ino, size, off, fi):
        keep_thread_state()
        end = min(off + size, entries[ino - 1].attr.st_size)
        lib.fuse_reply_buf(r, ZEROS, max(0, end - off))

    def readdirplus(r, ino, size, off, fi):
        keep_thread_state()
        p = paths[ino - 1]
        names = children[p]
        buf = ctypes.create_string_buffer(size)
        base = ctypes.addressof(buf)
        used = 0
        for i in range(off, len(names)):
            node = node_of[os.path.join(p, names[i]) if p else names[i]]
            n = lib.fuse_add_direntry_plus(
                r, base + used, size - used, names[i], ctypes.byref(entries[node - 1]), i + 1
            )
            if n > size - used:
                break
            used += n
        lib.fuse_reply_buf(r, buf, used)

    def init(userdata, conn):
        want = ctypes.cast(conn, ctypes.POINTER(ctypes.c_uint * 10)).contents
        want[6] = (want[6] | (1 << 17) | (1 << 24) | (1 << 13)) & ~(1 << 14)  # no open/opendir, always plus

    names = (
        "init destroy lookup forget getattr setattr readlink mknod mkdir unlink rmdir symlink rename link "
        "open read write flush release fsync opendir readdir releasedir fsyncdir statfs setxattr getxattr "
        "listxattr removexattr access create getlk setlk bmap ioctl poll write_buf retrieve_reply "
        "forget_multi flock fallocate readdirplus copy_file_range lseek"
    ).split()
    types = {
        "init": ctypes.CFUNCTYPE(None, vp, vp),
        "lookup": ctypes.CFUNCTYPE(None, req, ino_t, ctypes.c_char_p),
        "getattr": ctypes.CFUNCTYPE(None, req, ino_t, vp),
        "read": ctypes.CFUNCTYPE(None, req, ino_t, ctypes.c_size_t, ctypes.c_int64, vp),
        "readdirplus": ctypes.CFUNCTYPE(None, req, ino_t, ctypes.c_size_t, ctypes.c_int64, vp),
    }
    funcs = {"init": init, "lookup": lookup, "getattr": getattr_, "read": read, "readdirplus": readdirplus}

    class Ops(ctypes.Structure):
        _fields_ = [(n, types.get(n, ctypes.c_void_p)) for n in names]

    ops = Ops(**{n: types[n](f) for n, f in funcs.items()})
    argv = (ctypes.c_char_p * 4)(b"nullfs", b"-o", b"ro,fsname=nullfs,subtype=nullfs", None)

    class Args(ctypes.Structure):
        _fields_ = [("argc", ctypes.c_int), ("argv", ctypes.POINTER(ctypes.c_char_p)), ("allocated", ctypes.c_int)]

    args = Args(3, argv, 0)
    lib.fuse_session_new.restype = vp
    lib.fuse_session_new.argtypes = (ctypes.POINTER(Args), ctypes.POINTER(Ops), ctypes.c_size_t, vp)
    se = lib.fuse_session_new(ctypes.byref(args), ctypes.byref(ops), ctypes.sizeof(ops), None)
    lib.fuse_session_mount.argtypes = (vp, ctypes.c_char_p)
    if not se or lib.fuse_session_mount(se, os.fsencode(mountpoint)) != 0:
        raise SystemExit("libfuse could not mount")
    lib.fuse_set_signal_handlers.argtypes = (vp,)
    lib.fuse_set_signal_handlers(se)
    lib.fuse_loop_cfg_create.restype = vp
    lib.fuse_session_loop_mt_32.argtypes = (vp, vp)
    lib.fuse_session_loop.argtypes = (vp,)
    try:
        if threads == 1:
            lib.fuse_session_loop(se)
        else:
            lib.fuse_session_loop_mt_32(se, lib.fuse_loop_cfg_create())
    finally:
        lib.fuse_session_unmount.argtypes = (vp,)
        lib.fuse_session_unmount(se)


def serve_pyfuse3(src: str, mountpoint: str) -> None:
    """The no-work server on pyfuse3 (libfuse 3's low-level API): open/release implemented, since its read
    sees only the file handle."""
    import pyfuse3
    import trio

    stats, children = walk(src)
    paths = sorted(stats)
    node_of = {p: i + 1 for i, p in enumerate(paths)}

    def entry(node: int) -> pyfuse3.EntryAttributes:
        st = stats[paths[node - 1]]
        e = pyfuse3.EntryAttributes()
        e.st_ino, e.st_mode, e.st_size, e.st_nlink = node, st.st_mode & ~0o222, st.st_size, st.st_nlink
        e.st_mtime_ns = e.st_ctime_ns = e.st_atime_ns = st.st_mtime_ns
        e.entry_timeout = e.attr_timeout = 86400
        return e

    class Ops(pyfuse3.Operations):
        async def lookup(self, parent, name, ctx=None):
            p = paths[parent - 1]
            node = node_of.get(os.path.join(p, name) if p else name)
            if node is None:
                raise pyfuse3.FUSEError(errno.ENOENT)
            return entry(node)

        async def getattr(self, inode, ctx=None):
            return entry(inode)

        async def opendir(self, inode, ctx):
            return inode

        async def readdir(self, fh, start_id, token):
            p = paths[fh - 1]
            names = children[p]
            for i in range(start_id, len(names)):
                node = node_of[os.path.join(p, names[i]) if p else names[i]]
                if not pyfuse3.readdir_reply(token, names[i], entry(node), i + 1):
                    break

        async def open(self, inode, flags, ctx):
            return pyfuse3.FileInfo(fh=inode, keep_cache=True)

        async def read(self, fh, off, size):
            end = min(off + size, stats[paths[fh - 1]].st_size)
            return ZEROS[: max(0, end - off)]

        async def release(self, fh):
            pass

    opts = set(pyfuse3.default_options)
    opts.update({"fsname=nullfs", "ro"})
    opts.discard("default_permissions")
    pyfuse3.init(Ops(), mountpoint, opts)
    try:
        trio.run(pyfuse3.main)
    finally:
        pyfuse3.close()


def serve_mfusepy(src: str, mountpoint: str) -> None:
    from blockfs.serve.fuse.libfuse_adapter import ENCODING, fuse_kwargs, load_binding
    from blockfs.serve.mount_options import MountOptions
    from blockfs.serve.server import mount_source

    binding = load_binding("mfusepy")
    fs = make_mfusepy_null(binding)(src)
    binding.FUSE(
        fs, mountpoint, raw_fi=False, encoding=ENCODING, **fuse_kwargs(MountOptions(cache_bytes=0), mount_source(src))
    )


def make_mfusepy_null(binding: ModuleType) -> type:
    """The no-work server class on the mfusepy/fusepy binding ``binding``."""
    from blockfs.serve.fuse.libfuse_adapter import keep_thread_state

    class NullFS(binding.Operations):
        use_ns = True
        flush = release = opendir = releasedir = access = ioctl = None

        def __init__(self, src: str) -> None:
            self.attrs: dict[str, dict] = {}
            self.children: dict[str, list[str]] = {}
            for parent, dirs, files in os.walk(src):
                rel = "/" + os.path.relpath(parent, src).removeprefix(".").lstrip("/")
                self.attrs[rel] = self._attr(os.lstat(parent))
                self.children[rel] = dirs + files
                for name in files:
                    self.attrs[os.path.join(rel, name)] = self._attr(os.lstat(os.path.join(parent, name)))

        @staticmethod
        def _attr(st: os.stat_result) -> dict:
            return {
                "st_mode": st.st_mode & ~0o222,
                "st_size": st.st_size,
                "st_nlink": st.st_nlink,
                "st_ino": st.st_ino,
                "st_mtime": st.st_mtime_ns,
                "st_uid": 0,
                "st_gid": 0,
            }

        def getattr(self, path: str, fh: object = None) -> dict:
            keep_thread_state()
            try:
                return self.attrs[path]
            except KeyError:
                raise binding.FuseOSError(errno.ENOENT) from None

        def readdir(self, path: str, fh: object) -> list[str]:
            return [".", "..", *self.children[path]]

        def open(self, path: str, fi: object) -> int:
            raise binding.FuseOSError(errno.ENOSYS)  # as blockfs does by default: no open/release per file

        def read(self, path: str, size: int, offset: int, fh: object) -> bytes:
            keep_thread_state()
            end = min(offset + size, self.attrs[path]["st_size"])
            return ZEROS[: max(0, end - offset)]

        def statfs(self, path: str) -> dict:
            return {"f_bsize": 4096, "f_frsize": 4096, "f_blocks": 1, "f_namemax": 255}

    return NullFS


def main() -> int:
    import argparse

    parser = argparse.ArgumentParser(description="a FUSE server that does no work")
    parser.add_argument("src")
    parser.add_argument("mountpoint")
    parser.add_argument("--fuse", choices=("kernel", "c", "mfusepy", "lowlevel", "pyfuse3"), default="mfusepy")
    parser.add_argument(
        "--threads",
        type=int,
        default=2,
        help="threads of the kernel and c routes (lowlevel: 1 = libfuse's single-threaded loop)",
    )
    parser.add_argument(
        "--listing",
        choices=("plus", "auto", "plain"),
        default="plus",
        help="kernel route: READDIRPLUS always, when the kernel asks, or never (READDIR)",
    )
    parser.add_argument(
        "--counts", help="kernel and c routes: write the requests received to this file at each SIGUSR1"
    )
    parser.add_argument(
        "--clone", action="store_true", help="c route: a /dev/fuse descriptor per thread (FUSE_DEV_IOC_CLONE)"
    )
    parser.add_argument(
        "--uring",
        action="store_true",
        help="c route: FUSE over io_uring (root; a ring per CPU, --threads entries each)",
    )
    args = parser.parse_args()
    if not stat.S_ISDIR(os.stat(args.src).st_mode):
        parser.error(f"{args.src} is not a directory")
    src, mountpoint = os.path.abspath(args.src), os.path.abspath(args.mountpoint)
    if args.fuse == "kernel":
        serve_kernel(src, mountpoint, args.threads, args.listing, args.counts)
    elif args.fuse == "c":
        serve_c(src, mountpoint, args.threads, args.listing, args.counts, args.clone, args.uring)
    elif args.fuse == "pyfuse3":
        serve_pyfuse3(src, mountpoint)
    elif args.fuse == "lowlevel":
        serve_lowlevel(src, mountpoint, args.threads)
    else:
        serve_mfusepy(src, mountpoint)
    return 0


if __name__ == "__main__":
    sys.exit(main())
