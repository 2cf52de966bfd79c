"""``BlockFS``: a packed dataset as a read-only FUSE filesystem — the adapter between the kernel and blockfs.

The only module that imports a FUSE binding (so nothing else needs one to import): ``BLOCKFS_FUSE=mfusepy``
(the default; the maintained fork, bound to libfuse 3 where it is installed) or ``BLOCKFS_FUSE=fusepy``
(libfuse 2) picks it; mfusepy falls back to fusepy when it cannot be imported.  Each operation looks its
path up in the layer below (the dataset, or the control directory, :mod:`blockfs.serve.control`) and
turns blockfs errors into errno values; the assembly of a running mount is :mod:`blockfs.serve.server`.

Paths cross the binding as ``str`` decoded as latin-1, which maps every byte to one code point and back,
so any name a Linux filesystem allows (non-UTF-8 bytes included) reaches the index as the exact bytes
``os.fsencode`` gives, with either binding.

Errors: every :class:`BlockfsError` carries the errno the kernel gets; a damaged block is logged once,
naming the block and the file being read; anything unexpected is logged with its traceback and becomes
``EIO`` (never the bindings' default ``EINVAL``).

Open modes (the data never changes, so the kernel may keep what it read; the README gives the figures
``tools/bench_mount.py`` measures for each):

* ``enosys`` (the default with libfuse 3): ``open`` answers ENOSYS, the kernel stops sending open/release
  and keeps file pages across opens, so a re-read costs no Python call;
* ``keep_cache`` (the default with libfuse 2): one Python ``open`` per file that sets ``keep_cache``;
* ``targets``: a Python ``open`` per file that keeps the pages of the memory plan's retained files only;
* ``none``: pages dropped at every open, every read reaches Python.

The thread pool serves a cached file while another waits on storage; each libfuse thread keeps its Python
thread state (:func:`keep_thread_state`), which otherwise costs more than most requests.
"""

from __future__ import annotations

import collections
import ctypes
import errno
import functools
import importlib
import logging
import os
import stat
import threading
import time
from ctypes.util import find_library
from types import ModuleType
from typing import TYPE_CHECKING, Any, Callable

from .. import protocol
from ..core.dataset import PackedDataset
from ..core.index import KIND_FILE, KIND_SYMLINK
from ..errors import BlockfsError, BlockReadError, CorruptBlockError, MountError
from .cache import BlockCache
from .control import ControlDirectory, control_name_for
from .errorlog import ErrorLog
from .plan import MemoryPlan
from .retain import RetainingReader

if TYPE_CHECKING:
    from .server import MountOptions

log = logging.getLogger(__name__)

BINDING_ENV = "BLOCKFS_FUSE"
ENCODING = "latin-1"
FORGET_INTERVAL_S = 0.5  # how often snapshots the control directory dropped are dropped from the kernel's cache


def load_binding(name: str | None = None) -> ModuleType:
    """The FUSE binding module: ``mfusepy`` (libfuse 3 when installed) or ``fusepy`` (imported as ``fuse``)."""
    name = name or os.environ.get(BINDING_ENV) or "mfusepy"
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
BINDING_NAME = "mfusepy" if binding.__name__ == "mfusepy" else "fusepy"
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


class BlockFS(binding.Operations):
    """The FUSE operations of one mounted dataset."""

    use_ns = True  # times are integer nanoseconds, so ns mtimes survive
    # Not implemented on purpose: libfuse answers these in C (or the kernel stops asking), no Python call.
    flush = release = opendir = releasedir = access = fsync = fsyncdir = lock = ioctl = None
    # Read-only: the mount is "ro" so the kernel refuses most writes first; these answer EROFS regardless.
    chmod = chown = create = link = mkdir = mknod = rename = rmdir = symlink = unlink = write = _refuse
    truncate = utimens = setxattr = removexattr = _refuse

    def __init__(
        self,
        ds: PackedDataset,
        cache: BlockCache,
        options: "MountOptions",
        mountpoint: str = "",
        plan: MemoryPlan | None = None,
        retainer: RetainingReader | None = None,
    ) -> None:
        self._ds = ds
        self._cache = cache
        self._plan = plan
        self._retainer = retainer
        self._a = ds.index.arrays
        self.open_mode = options.open_mode_for(LIBFUSE_MAJOR)
        self._threads = options.threads
        self._prefill = options.prefill
        self._uid, self._gid = os.getuid(), os.getgid()
        self.error_log = ErrorLog()
        self._started = time.time()
        self._mountpoint = mountpoint
        self.control = ControlDirectory(ds, control_name_for(ds, options.control_name), self.stats)
        self.served = False  # set once libfuse has mounted and called init
        self.requests: collections.Counter[str] = collections.Counter()
        self.stopped = threading.Event()

    # --- life cycle -----------------------------------------------------------------------------
    def init(self, path: str) -> None:
        self.served = True
        log.info(
            "serving %s at %s (%s, libfuse %d, open %s, cache %d bytes %s)",
            self._ds.location, self._mountpoint, BINDING_NAME, LIBFUSE_MAJOR, self.open_mode,
            self._cache.budget_bytes, self._cache.policy_name,
        )  # fmt: skip
        self._start_forgetting()
        if self._prefill:
            self._cache.start_prefill()

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
        e = self._ds.lookup(raw)
        if self._a["size"][e] == 0 and self._a["kind"][e] == KIND_FILE:
            # The kernel never asks to read a file whose size is 0, so check here that its block holds an
            # empty file: a size zeroed in a forged index must fail with EIO, not serve an empty file.
            self._ds.read_entry(e)
        return self._attr(e)

    def _attr(self, e: int) -> dict[str, Any]:
        a = self._a
        kind = int(a["kind"][e])
        size = int(a["size"][e])
        if kind == KIND_SYMLINK:
            size = len(self._ds.index.link_target(e))
        mtime = int(a["mtime_ns"][e])
        return {
            "st_mode": int(a["mode"][e]),
            "st_ino": int(a["ino"][e]),
            "st_nlink": int(a["nlink"][e]),
            "st_size": size,
            "st_blocks": (size + 511) // 512 if kind == KIND_FILE else 0,
            "st_uid": self._uid,
            "st_gid": self._gid,
            "st_mtime": mtime,
            "st_atime": mtime,
            "st_ctime": mtime,
        }

    @fuse_call
    def readdir(self, path: str, fh: Any) -> list:
        # Every name comes with its inode number: with use_ino, a bare name would reach the kernel as
        # inode 0, which readdir(3) skips.  The mode gives it a d_type, so os.scandir needs no stat.
        raw = path.encode(ENCODING)
        if self.control.owns(raw):
            return [(name, {"st_mode": mode, "st_ino": ino}, 0) for name, mode, ino in self.control.readdir(raw)]
        e = self._ds.lookup(raw)
        children = self._ds.index.children(e)
        modes = self._a["mode"][children.start : children.stop].tolist()
        inos = self._a["ino"][children.start : children.stop].tolist()
        names = self._ds.index.names(e)
        parent = int(self._a["parent"][e])
        return [
            (".", {"st_mode": stat.S_IFDIR, "st_ino": int(self._a["ino"][e])}, 0),
            ("..", {"st_mode": stat.S_IFDIR, "st_ino": int(self._a["ino"][parent])}, 0),
        ] + [
            (name.decode(ENCODING), {"st_mode": mode, "st_ino": ino}, 0) for name, mode, ino in zip(names, modes, inos)
        ]

    @fuse_call
    def readlink(self, path: str) -> str:
        raw = path.encode(ENCODING)
        if self.control.owns(raw):
            return self.control.readlink(raw).decode(ENCODING)
        return self._ds.readlink(raw).decode(ENCODING)

    @fuse_call
    def statfs(self, path: str) -> dict[str, int]:
        meta = self._ds.metadata
        bsize = 4096
        return {
            "f_bsize": bsize,
            "f_frsize": bsize,
            "f_blocks": -(-int(meta["file_bytes"]) // bsize),
            "f_bfree": 0,
            "f_bavail": 0,
            "f_files": self._ds.index.n_entries,
            "f_ffree": 0,
            "f_favail": 0,
            "f_namemax": 255,
        }

    @fuse_call
    def getxattr(self, path: str, name: str, position: int = 0) -> bytes:
        raw = path.encode(ENCODING)
        if self.control.owns(raw):
            return self.control.getxattr(raw, name)
        value = self._xattrs(self._ds.lookup(raw)).get(name)
        if value is None:
            raise FuseOSError(errno.ENODATA)
        return value

    @fuse_call
    def listxattr(self, path: str) -> list[str]:
        raw = path.encode(ENCODING)
        if self.control.owns(raw):
            return self.control.listxattr(raw)
        return list(self._xattrs(self._ds.lookup(raw)))

    def _xattrs(self, e: int) -> dict[str, bytes]:
        if e == 0:
            return {protocol.CONTROL_XATTR: self.control.name.encode()}
        if int(self._a["kind"][e]) != KIND_FILE:
            return {}
        label = int(self._a["label"][e])
        found = {}
        if label >= 0:
            found[protocol.LABEL_XATTR] = str(label).encode()
            classes = self._ds.classes
            if classes and label < len(classes):
                found[protocol.CLASS_XATTR] = os.fsencode(classes[label])
        found[protocol.BLOCK_XATTR] = str(int(self._a["block"][e])).encode()
        return found

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
            fi.keep_cache = self._keeps(self._ds.lookup(raw))
        else:
            fi.keep_cache = self.open_mode == "keep_cache"
        return 0

    def _keeps(self, e: int) -> bool:
        """Whether the memory plan keeps entry ``e`` resident: a retained file, or anything when it all fits."""
        if self._retainer is not None:
            return self._retainer.is_target(int(self._a["block"][e]), int(self._a["slot"][e]))
        return self._plan is None or self._plan.fits

    @fuse_call
    def read(self, path: str, size: int, offset: int, fh: Any) -> bytes:
        raw = path.encode(ENCODING)
        if self.control.owns(raw):
            return self.control.read(raw, size, offset)
        return self._ds.read(raw, offset, size)

    # --- statistics -----------------------------------------------------------------------------
    def stats(self) -> dict[str, Any]:
        """Everything ``blockfs stats`` shows: the mount, the dataset, the memory plan and the cache."""
        meta = self._ds.metadata
        dataset_bytes = int(meta["file_bytes"])
        budget = self._cache.budget_bytes
        return {
            "mount": {
                "dest": self._ds.location,
                "mountpoint": self._mountpoint,
                "pid": os.getpid(),
                "binding": BINDING_NAME,
                "libfuse": LIBFUSE_MAJOR,
                "open_mode": self.open_mode,
                "threads": self._threads,
                "control": self.control.name,
                "started": self._started,
            },
            "dataset": {
                "digest": self._ds.digest,  # its name: what --expect and the loader's expect= pin
                "digests": self._ds.has_digests,  # False: checked against accidents (CRC-32) only
                "files": int(meta["n_files"]),
                "file_bytes": dataset_bytes,
                "blocks": int(meta["n_blocks"]),
                "block_bytes": int(meta["block_bytes"]),
            },
            "plan": self._plan.to_dict() if self._plan is not None else {
                "budget_bytes": budget,
                "dataset_bytes": dataset_bytes,
                "fits": dataset_bytes <= budget,
                "expected_hit_rate": min(1.0, budget / dataset_bytes) if dataset_bytes else 1.0,
            },
            "retained": self._retainer.stats() if self._retainer is not None else None,
            **self._cache.stats(),
            "requests": dict(self.requests),
            "errors": self.error_log.stats(),
            "storage": self._ds.store.files.stats(),  # remote requests and the disk tier; {} for a local dataset
        }


def run(fs: BlockFS, mountpoint: str, fuse_options: dict[str, Any]) -> None:
    """Mount ``fs`` at ``mountpoint`` with libfuse and serve until unmounted (or SIGINT/SIGTERM)."""
    try:
        binding.FUSE(
            fs,
            os.fsencode(mountpoint).decode(ENCODING),
            raw_fi=fs.open_mode != "enosys",
            encoding=ENCODING,
            **fuse_options,
        )
    except RuntimeError as e:
        if not fs.served:
            raise MountError(f"libfuse could not mount {mountpoint!r} (status {e}); see the messages above") from e
        # libfuse 3 reports a loop ended by SIGINT/SIGTERM as an error status; it unmounted cleanly.
        log.debug("libfuse returned status %s after serving", e)
    finally:
        fs.stopped.set()
