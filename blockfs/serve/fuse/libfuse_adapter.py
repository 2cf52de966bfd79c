"""``BlockFS``: the mount through a libfuse binding (mfusepy or fusepy) — the adapter the route names.

The only module that imports a FUSE binding (so nothing else needs one to import), and only when a mount
of its route is made (:func:`load_binding`: ``mfusepy``, the maintained fork, bound to libfuse 3 where it
is installed, falling back to fusepy when it cannot be imported; or ``fusepy``, libfuse 2).  Each operation
looks its path up in :class:`blockfs.serve.view.MountView` (the mount's one namespace) and translates the
answer; errors become errno values as the view maps them.  The assembly of a running mount is
:mod:`blockfs.serve.server`.

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
lookups, attributes and listings never wait behind reads waiting on a slow store
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
from collections import Counter
from collections.abc import Callable
from ctypes.util import find_library
from types import ModuleType
from typing import Any

from ...errors import MountError
from ..mount_options import MountOptions
from ..view import MountView, Route
from .libfuse_messages import StderrCapture, distill
from .libfuse_threads import MAX_THREADS, max_threads_applied

log = logging.getLogger(__name__)

ENCODING = "latin-1"
BINDINGS = ("mfusepy", "fusepy")


@functools.cache
def load_binding(name: str = "mfusepy") -> ModuleType:
    """The FUSE binding module: ``mfusepy`` (libfuse 3 when installed) or ``fusepy`` (imported as ``fuse``)."""
    if name not in BINDINGS:
        raise MountError(f"FUSE binding {name!r}: choose 'mfusepy' (libfuse 3) or 'fusepy' (libfuse 2)")
    if name == "mfusepy":
        # mfusepy looks for libfuse 2 first; libfuse 3 is what it is maintained for and what distributions ship.
        if not os.environ.get("FUSE_LIBRARY_PATH") and not os.environ.get("FUSE_LIBRARY_NAME"):
            if find_library("fuse3"):
                os.environ["FUSE_LIBRARY_NAME"] = "fuse3"  # the binding's own setting, read as it loads
        try:
            return importlib.import_module("mfusepy")
        except (ImportError, OSError) as e:
            log.debug("mfusepy unavailable (%s); trying fusepy", e)
    try:
        return importlib.import_module("fuse")
    except (ImportError, OSError) as e:
        raise MountError(f"no FUSE binding: install mfusepy (libfuse 3) or fusepy (libfuse 2): {e}") from e


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
    """Count the request, and turn any error into the binding's FuseOSError with the view's errno."""

    name = method.__name__

    @functools.wraps(method)
    def call(self: BlockFS, *args: Any) -> Any:
        self.requests[name] += 1  # unlocked: a rare lost count is cheaper than a lock per request
        keep_thread_state()
        try:
            return method(self, *args)
        except Exception as e:
            raise self.FuseOSError(self.view.report(e, f"{name}{args!r}")) from None

    return call


def _refuse(self: Any, *args: Any) -> None:
    raise self.FuseOSError(errno.EROFS)


def fuse_kwargs(options: MountOptions, fsname: str) -> dict[str, Any]:
    """The binding's keyword options for a mount (``-o`` options plus foreground/nothreads); ``fsname``: what
    the mount table shows as its source."""
    # The binding hands str options to libfuse as latin-1, one byte per character: give it the name's own
    # bytes (UTF-8 for 'ü') through that channel, so the mount table holds the name as the file system does.
    timeout = f"{options.timeout_s:g}"
    kwargs: dict[str, Any] = {
        "foreground": True,
        "nothreads": not options.threads,
        "ro": True,
        "default_permissions": True,
        "use_ino": True,
        "fsname": os.fsencode(fsname).decode(ENCODING),
        "subtype": "blockfs",
        "entry_timeout": timeout,
        "attr_timeout": timeout,
        "negative_timeout": timeout,
    }
    if options.allow_other:
        kwargs["allow_other"] = True
    for opt in options.fuse_options:
        for item in filter(None, opt.split(",")):
            key, eq, value = item.partition("=")
            kwargs[key] = value if eq else True
    return kwargs


class BlockFS:
    """The FUSE operations of one mount, by path, over :class:`blockfs.serve.view.MountView`; made with
    :func:`make_adapter` (which adds the binding's ``Operations`` base)."""

    binding: ModuleType
    FuseOSError: type[Exception]
    use_ns = True  # times are integer nanoseconds, so ns mtimes survive
    # Not implemented on purpose: libfuse answers these in C (or the kernel stops asking), no Python call.
    flush = release = opendir = releasedir = access = fsync = fsyncdir = lock = ioctl = None
    # Read-only: the mount is "ro" so the kernel refuses most writes first; these answer EROFS regardless.
    chmod = chown = create = link = mkdir = mknod = rename = rmdir = symlink = unlink = write = _refuse
    truncate = utimens = setxattr = removexattr = _refuse

    def __init__(self, options: MountOptions, build: Callable[[Route], MountView]) -> None:
        self.options = options
        self.route = "mfusepy" if self.binding.__name__ == "mfusepy" else "fusepy"
        self.libfuse = int(getattr(self.binding, "fuse_version_major", 2))
        self.open_mode = options.open_mode_for(self.libfuse)
        self.requests: Counter[str] = Counter()
        self.served = False  # set once libfuse has mounted and called init
        self.stopped = threading.Event()
        self._said: StderrCapture | None = None  # what libfuse prints while mounting (run)
        self.view = build(
            Route(
                {"binding": self.route, "libfuse": self.libfuse, "open_mode": self.open_mode},
                self.open_mode,
                stats=lambda: {"requests": dict(self.requests)},
            )
        )

    # --- life cycle -----------------------------------------------------------------------------
    def run(self, mountpoint: str, fsname: str) -> None:
        """Mount with libfuse and serve until unmounted (or SIGINT/SIGTERM); blocks.  What libfuse prints
        while mounting is captured and, if the mount fails, distilled into one MountError line."""
        with StderrCapture() as said:
            self._said = said
            try:
                self._run(mountpoint, fsname)
            except MountError as e:
                if self.served:
                    raise
                said.release(replay=False)
                text = said.text()
                log.debug("libfuse wrote:\n%s", text.rstrip())
                why = distill(text)
                if why is None:
                    os.write(2, text.encode())
                    raise
                raise MountError(f"cannot mount {mountpoint!r}: {why}") from e
            finally:
                self.stopped.set()

    def _run(self, mountpoint: str, fsname: str) -> None:
        try:
            with max_threads_applied(self.binding) as applied:
                options = fuse_kwargs(self.options, fsname)
                if applied and not options.get("nothreads"):  # metadata must not wait behind reads (libfuse_threads.py)
                    options.setdefault("max_threads", str(MAX_THREADS))
                self.binding.FUSE(
                    self,
                    os.fsencode(mountpoint).decode(ENCODING),
                    raw_fi=self.open_mode != "enosys",
                    encoding=ENCODING,
                    **options,
                )
        except RuntimeError as e:
            if not self.served:
                raise MountError(f"libfuse could not mount {mountpoint!r} (status {e}); see the messages above") from e
            # libfuse 3 reports a loop ended by SIGINT/SIGTERM as an error status; it unmounted cleanly.
            log.debug("libfuse returned status %s after serving", e)

    def init(self, path: str) -> None:
        self.served = True
        if self._said is not None:
            self._said.release()  # mounted: what libfuse said goes to stderr as it was
        self.view.start_serving(f"{self.route}, libfuse {self.libfuse}", self._forgetting())

    def destroy(self, path: str) -> None:
        self.stopped.set()

    def _forgetting(self) -> Callable[[int, bytes, bytes], None] | None:
        """How a dropped stats snapshot is dropped from the kernel's cache: by path, with libfuse."""
        try:
            lib = self.binding._libfuse
            fuse = lib.fuse_get_context().contents.fuse
            invalidate = lib.fuse_invalidate_path
        except AttributeError as e:
            log.debug("no fuse_invalidate_path (%s): the kernel forgets old stats snapshots itself", e)
            return None
        invalidate.argtypes = (ctypes.c_void_p, ctypes.c_char_p)
        return lambda parent, name, path: invalidate(fuse, path)

    # --- metadata -------------------------------------------------------------------------------
    def _node(self, path: str) -> int:
        return self.view.lookup(path.encode(ENCODING))

    @fuse_call
    def getattr(self, path: str, fh: Any = None) -> dict[str, Any]:
        node = self._node(path)
        self.view.check_present(node)
        a = self.view.attr(node)
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
        view = self.view
        node = self._node(path)
        # From the view's arrays a directory at a time: the names decoded and split once, the modes and
        # inode numbers as two lists; the binding makes its own object per entry from these tuples.
        names = view.child_names(node).decode(ENCODING).split("\0")[:-1]  # each name ends in a NUL
        a = view.listing(node).attrs
        out = [
            (".", {"st_mode": stat.S_IFDIR, "st_ino": view.attr(node).ino}, 0),
            ("..", {"st_mode": stat.S_IFDIR, "st_ino": view.attr(view.parent(node)).ino}, 0),
        ]
        out += [
            (name, {"st_mode": mode, "st_ino": ino}, 0)
            for name, mode, ino in zip(names, a["mode"].tolist(), a["ino"].tolist(), strict=True)
        ]
        return out

    @fuse_call
    def readlink(self, path: str) -> str:
        return self.view.readlink(self._node(path)).decode(ENCODING)

    @fuse_call
    def statfs(self, path: str) -> dict[str, int]:
        blocks, files = self.view.statfs()
        return {
            "f_bsize": 4096,
            "f_frsize": 4096,
            "f_blocks": blocks,
            "f_bfree": 0,
            "f_bavail": 0,
            "f_files": files,
            "f_ffree": 0,
            "f_favail": 0,
            "f_namemax": 255,
        }

    @fuse_call
    def getxattr(self, path: str, name: str, position: int = 0) -> bytes:
        return self.view.getxattr(self._node(path), name)

    @fuse_call
    def listxattr(self, path: str) -> list[str]:
        return self.view.listxattr(self._node(path))

    # --- data -----------------------------------------------------------------------------------
    @fuse_call
    def open(self, path: str, fi: Any) -> int:
        if self.open_mode == "enosys":
            # The kernel then stops sending open/release for the whole mount and keeps page cache
            # across opens (it acts as if keep_cache were set).  The mount is read-only, so the VFS
            # already refused any open for writing.
            raise OSError(errno.ENOSYS, "no open")
        if fi.flags & os.O_ACCMODE != os.O_RDONLY:
            raise OSError(errno.EROFS, "read-only")
        fi.keep_cache = self.view.keep_pages(self._node(path))
        return 0

    @fuse_call
    def read(self, path: str, size: int, offset: int, fh: Any) -> bytes:
        return self.view.read(self._node(path), offset, size)


@functools.cache
def _operations(binding_name: str) -> type[BlockFS]:
    """:class:`BlockFS` with the binding's ``Operations`` as its base (the binding dispatches through it)."""
    binding = load_binding(binding_name)
    return type("BlockFS", (BlockFS, binding.Operations), {"binding": binding, "FuseOSError": binding.FuseOSError})


def make_adapter(route: str, options: MountOptions, build: Callable[[Route], MountView]) -> BlockFS:
    """The adapter of ``route`` (``mfusepy`` or ``fusepy``: the binding it loads) for a mount of ``options``."""
    return _operations(route)(options, build)
