"""``BlockFS``: a packed dataset as a read-only FUSE filesystem — the adapter between the kernel and blockfs.

The only module that imports a FUSE binding (so nothing else needs one to import): ``BLOCKFS_FUSE=mfusepy``
(the default; the maintained fork, bound to libfuse 3 where it is installed) or ``BLOCKFS_FUSE=fusepy``
(libfuse 2) picks it; mfusepy falls back to fusepy when it cannot be imported.  Each operation looks its
path up in the layer below (the dataset, or the control directory, :mod:`blockfs.serve.control.control_dir`) and
turns blockfs errors into errno values; the assembly of a running mount is :mod:`blockfs.serve.server`.

Paths cross the binding as ``str`` decoded as latin-1, which maps every byte to one code point and back,
so any name a Linux filesystem allows (non-UTF-8 bytes included) reaches the index as the exact bytes
``os.fsencode`` gives, with either binding.

Errors: every :class:`BlockfsError` carries the errno the kernel gets; a damaged block is logged once,
naming the block and the file being read; anything unexpected is logged with its traceback and becomes
``EIO`` (never the bindings' default ``EINVAL``).

Open modes (the data never changes, so the kernel may keep what it read; the README gives the figures
``tools/bench/bench_mount.py`` measures for each):

* ``enosys`` (the default with libfuse 3): ``open`` answers ENOSYS, the kernel stops sending open/release
  and keeps file pages across opens, so a re-read costs no Python call;
* ``keep_cache`` (the default with libfuse 2): one Python ``open`` per file that sets ``keep_cache``;
* ``targets``: a Python ``open`` per file that keeps the pages of the memory plan's retained files only;
* ``none``: pages dropped at every open, every read reaches Python.

The thread pool serves a cached file while another waits on storage, and holds enough threads that
lookups, attributes, listings and the control files never wait behind reads waiting on a slow store
(:mod:`blockfs.serve.fuse.libfuse_threads`); each libfuse thread keeps its Python thread state
(:func:`keep_thread_state`), which otherwise costs more than most requests.
"""

from __future__ import annotations

import ctypes
import errno
import functools
import importlib
import logging
import os
import stat
import threading
from ctypes.util import find_library
from types import ModuleType
from typing import Any, Callable, ClassVar, Literal

from ...errors import BlockfsError, BlockReadError, CorruptBlockError, MountError
from .libfuse_threads import MAX_THREADS, max_threads_applied
from ..view import MountView

log = logging.getLogger(__name__)

BINDING_ENV = "BLOCKFS_FUSE"
ENCODING = "latin-1"
FORGET_INTERVAL_S = 0.5  # how often snapshots the control directory dropped are dropped from the kernel's cache


def load_binding(name: str | None = None) -> ModuleType:
    """The FUSE binding module: ``mfusepy`` (libfuse 3 when installed) or ``fusepy`` (imported as ``fuse``)."""
    name = name or os.environ.get(BINDING_ENV) or "mfusepy"
    if name in ("kernel", "auto"):  # BLOCKFS_FUSE names the route; this module serves the binding routes
        name = "mfusepy"
    if name not in ("mfusepy", "fusepy"):
        raise MountError(f"{BINDING_ENV}={name!r}: choose 'mfusepy' (libfuse 3) or 'fusepy' (libfuse 2)")
    if name == "mfusepy":
        # mfusepy looks for libfuse 2 first; libfuse 3 is what it is maintained for and what distributions ship.
        if not os.environ.get("FUSE_LIBRARY_PATH") and not os.environ.get("FUSE_LIBRARY_NAME"):
            if find_library("fuse3"):
                os.environ["FUSE_LIBRARY_NAME"] = "fuse3"
        try:
            return importlib.import_module("mfusepy")
        except (ImportError, OSError) as e:
            log.debug("mfusepy unavailable (%s); trying fusepy", e)
    try:
        return importlib.import_module("fuse")
    except (ImportError, OSError) as e:
        raise MountError(f"no FUSE binding: install mfusepy (libfuse 3) or fusepy (libfuse 2): {e}") from e


binding = load_binding()
FuseOSError = binding.FuseOSError
BINDING_NAME: Literal["mfusepy", "fusepy"] = "mfusepy" if binding.__name__ == "mfusepy" else "fusepy"
LIBFUSE_MAJOR = int(getattr(binding, "fuse_version_major", 2))


_local = threading.local()


def keep_thread_state() -> None:
    """Give a libfuse worker thread a Python thread state for good.

    ctypes runs each callback from a foreign thread in a thread state it creates and destroys around the
    call, which costs more than most requests here (allocations and an mmap/munmap per request).  One
    extra PyGILState_Ensure, never released, keeps the first state alive for the thread's lifetime.
    """
    if not getattr(_local, "kept", False):
        ctypes.pythonapi.PyGILState_Ensure()
        _local.kept = True


def fuse_call(method: Callable) -> Callable:
    """Turn blockfs errors into their errno, anything unexpected into a logged EIO."""

    name = method.__name__

    @functools.wraps(method)
    def call(self: "BlockFS", *args: Any) -> Any:
        self.requests[name] += 1  # unlocked: a rare lost count is cheaper than a lock per request
        keep_thread_state()
        try:
            return method(self, *args)
        except FuseOSError:
            raise
        except BlockfsError as e:
            if isinstance(e, (CorruptBlockError, BlockReadError)):
                self.error_log.report(e)
            raise FuseOSError(e.errno) from None
        except OSError as e:
            raise FuseOSError(e.errno or errno.EIO) from None
        except Exception:
            log.exception("unexpected error in %s%r; answering EIO", method.__name__, args)
            raise FuseOSError(errno.EIO) from None

    return call


def _refuse(self: Any, *args: Any) -> None:
    raise FuseOSError(errno.EROFS)


class BlockFS(binding.Operations):  # type: ignore[name-defined]  # a base chosen at import: mypy cannot follow it
    """The FUSE operations of one mounted dataset, by path, over :class:`blockfs.serve.view.MountView`."""

    route: ClassVar[Literal["mfusepy", "fusepy"]] = BINDING_NAME
    use_ns = True  # times are integer nanoseconds, so ns mtimes survive
    # Not implemented on purpose: libfuse answers these in C (or the kernel stops asking), no Python call.
    flush = release = opendir = releasedir = access = fsync = fsyncdir = lock = ioctl = None
    # Read-only: the mount is "ro" so the kernel refuses most writes first; these answer EROFS regardless.
    chmod = chown = create = link = mkdir = mknod = rename = rmdir = symlink = unlink = write = _refuse
    truncate = utimens = setxattr = removexattr = _refuse

    def __init__(self, view: MountView) -> None:
        self.view = view
        self._ds = view.ds
        self.control = view.control
        self.error_log = view.error_log
        self.requests = view.requests
        self.open_mode = view.options.open_mode_for(LIBFUSE_MAJOR)
        view.adapter = {"binding": BINDING_NAME, "libfuse": LIBFUSE_MAJOR, "open_mode": self.open_mode}
        self.served = False  # set once libfuse has mounted and called init
        self.stopped = threading.Event()

    def stats(self) -> dict[str, Any]:
        return self.view.stats()

    # --- life cycle -----------------------------------------------------------------------------
    def init(self, path: str) -> None:
        self.served = True
        view = self.view
        log.info(
            "serving %s at %s (%s, libfuse %d, open %s, cache %d bytes %s)",
            self._ds.location, view.mountpoint, BINDING_NAME, LIBFUSE_MAJOR, self.open_mode,
            view.cache.budget_bytes, view.cache.policy_name,
        )  # fmt: skip
        self._start_forgetting()
        if view.options.prefill:
            view.cache.start_prefill()

    def destroy(self, path: str) -> None:
        self.stopped.set()

    def _start_forgetting(self) -> None:
        """Drop the stats snapshots the control directory no longer keeps from the kernel's cache."""
        try:
            lib = binding._libfuse
            fuse = lib.fuse_get_context().contents.fuse
            invalidate = lib.fuse_invalidate_path
        except AttributeError as e:
            log.debug("no fuse_invalidate_path (%s): the kernel forgets old stats snapshots itself", e)
            return
        invalidate.argtypes = (ctypes.c_void_p, ctypes.c_char_p)

        def run() -> None:
            while not self.stopped.wait(FORGET_INTERVAL_S):
                for path in self.control.take_evicted():
                    invalidate(fuse, path)

        threading.Thread(target=run, name="blockfs-forget", daemon=True).start()

    # --- metadata -------------------------------------------------------------------------------
    @fuse_call
    def getattr(self, path: str, fh: Any = None) -> dict[str, Any]:
        raw = path.encode(ENCODING)
        if self.control.owns(raw):
            return self.control.getattr(raw)
        e = self.view.lookup(raw)
        self.view.check_present(e)
        a = self.view.attr(e)
        return {
            "st_mode": a.mode,
            "st_ino": a.ino,
            "st_nlink": a.nlink,
            "st_size": a.size,
            "st_blocks": (a.size + 511) // 512 if stat.S_ISREG(a.mode) else 0,
            "st_uid": self.view.uid,
            "st_gid": self.view.gid,
            "st_mtime": a.mtime_ns,
            "st_atime": a.mtime_ns,
            "st_ctime": a.mtime_ns,
        }

    @fuse_call
    def readdir(self, path: str, fh: Any) -> list:
        # Every name comes with its inode number: with use_ino, a bare name would reach the kernel as
        # inode 0, which readdir(3) skips.  The mode gives it a d_type, so os.scandir needs no stat.
        raw = path.encode(ENCODING)
        if self.control.owns(raw):
            return [(name, {"st_mode": mode, "st_ino": ino}, 0) for name, mode, ino in self.control.readdir(raw)]
        view = self.view
        e = view.lookup(raw)
        kids = view.children(e)
        # From the index's columns a directory at a time: the names decoded and split once, the modes and
        # inode numbers as two lists; the binding makes its own object per entry from these tuples.
        names = view.child_names(e).decode(ENCODING).split("\0")[:-1]  # each name ends in a NUL
        a = view.attrs(kids.start, kids.stop)
        out = [(".", {"st_mode": stat.S_IFDIR, "st_ino": view.attr(e).ino}, 0),
               ("..", {"st_mode": stat.S_IFDIR, "st_ino": view.attr(view.parent(e)).ino}, 0)]  # fmt: skip
        out += [(name, {"st_mode": mode, "st_ino": ino}, 0)
                for name, mode, ino in zip(names, a["mode"].tolist(), a["ino"].tolist())]  # fmt: skip
        return out

    @fuse_call
    def readlink(self, path: str) -> str:
        raw = path.encode(ENCODING)
        if self.control.owns(raw):
            return self.control.readlink(raw).decode(ENCODING)
        return self.view.readlink(self.view.lookup(raw)).decode(ENCODING)

    @fuse_call
    def statfs(self, path: str) -> dict[str, int]:
        blocks, files = self.view.statfs()
        return {"f_bsize": 4096, "f_frsize": 4096, "f_blocks": blocks, "f_bfree": 0, "f_bavail": 0,
                "f_files": files, "f_ffree": 0, "f_favail": 0, "f_namemax": 255}  # fmt: skip

    @fuse_call
    def getxattr(self, path: str, name: str, position: int = 0) -> bytes:
        raw = path.encode(ENCODING)
        if self.control.owns(raw):
            return self.control.getxattr(raw, name)
        value = self.view.xattrs(self.view.lookup(raw)).get(name)
        if value is None:
            raise FuseOSError(errno.ENODATA)
        return value

    @fuse_call
    def listxattr(self, path: str) -> list[str]:
        raw = path.encode(ENCODING)
        if self.control.owns(raw):
            return self.control.listxattr(raw)
        return list(self.view.xattrs(self.view.lookup(raw)))

    # --- data -----------------------------------------------------------------------------------
    @fuse_call
    def open(self, path: str, fi: Any) -> int:
        if self.open_mode == "enosys":
            # The kernel then stops sending open/release for the whole mount and keeps page cache
            # across opens (it acts as if keep_cache were set).  The mount is read-only, so the VFS
            # already refused any open for writing.
            raise FuseOSError(errno.ENOSYS)
        raw = path.encode(ENCODING)
        if fi.flags & os.O_ACCMODE != os.O_RDONLY:
            raise FuseOSError(errno.EROFS)
        if self.control.owns(raw):
            fi.keep_cache = True  # every control file's bytes are fixed (stats.json leads to a snapshot)
        elif self.open_mode == "targets":
            fi.keep_cache = self.view.keeps(self.view.lookup(raw))
        else:
            fi.keep_cache = self.open_mode == "keep_cache"
        return 0

    @fuse_call
    def read(self, path: str, size: int, offset: int, fh: Any) -> bytes:
        raw = path.encode(ENCODING)
        if self.control.owns(raw):
            return self.control.read(raw, size, offset)
        return self.view.read(self.view.lookup(raw), offset, size)


def run(fs: BlockFS, mountpoint: str, fuse_options: dict[str, Any]) -> None:
    """Mount ``fs`` at ``mountpoint`` with libfuse and serve until unmounted (or SIGINT/SIGTERM)."""
    try:
        with max_threads_applied(binding) as applied:
            options = dict(fuse_options)
            if applied and not options.get("nothreads"):  # metadata must not wait behind reads (libfuse_threads.py)
                options.setdefault("max_threads", str(MAX_THREADS))
            binding.FUSE(
                fs,
                os.fsencode(mountpoint).decode(ENCODING),
                raw_fi=fs.open_mode != "enosys",
                encoding=ENCODING,
                **options,
            )
    except RuntimeError as e:
        if not fs.served:
            raise MountError(f"libfuse could not mount {mountpoint!r} (status {e}); see the messages above") from e
        # libfuse 3 reports a loop ended by SIGINT/SIGTERM as an error status; it unmounted cleanly.
        log.debug("libfuse returned status %s after serving", e)
    finally:
        fs.stopped.set()
