"""``BlockFS``: a packed dataset as a read-only FUSE filesystem — a thin adapter over :class:`PackedDataset`.

The only module that imports a FUSE binding.  ``BLOCKFS_FUSE=mfusepy`` (the default; the maintained fork,
bound to libfuse 3 where it is installed) or ``BLOCKFS_FUSE=fusepy`` (libfuse 2) picks it; mfusepy falls
back to fusepy when it cannot be imported.

Paths cross the binding as ``str`` decoded as latin-1, which maps every byte to one code point and back,
so any name a Linux filesystem allows (non-UTF-8 bytes included) reaches the index as the exact bytes
``os.fsencode`` gives, with either binding.

Errors: every :class:`BlockfsError` carries the errno the kernel gets; a damaged block is logged once,
naming the block and the file being read; anything unexpected is logged with its traceback and becomes
``EIO`` (never the bindings' default ``EINVAL``).

Kernel caching (the data never changes; chosen from ``tools/bench_mount.py``, tiny files, warm, on a
shared 2-core VM: files/s with ``open().read()`` / with an os.open reader):

* entry, attribute and negative timeouts of a day: a path is looked up and stat'ed once per mount;
* ``open_mode="enosys"`` (the default with libfuse 3): ``open`` answers ENOSYS, the kernel stops sending
  open/release and keeps file pages across opens, so a re-read costs no Python call (12.6k / 100k);
  ``stats.json`` is then kept live by invalidating it (``fuse_invalidate_path``, libfuse 3 only);
* ``open_mode="keep_cache"`` (the default with libfuse 2): one Python ``open`` per file that sets
  ``keep_cache``, and ``direct_io`` on ``stats.json`` (7.7k / 20k).  ENOSYS works with libfuse 2 as well
  (13.4k / 103k), but libfuse 2 has no way to invalidate ``stats.json``, which would then go stale;
* ``open_mode="targets"``: a Python ``open`` per file that keeps the pages of the memory plan's retained
  files only (issue 4).  It did not pay in ``tools/bench_memory.py`` with the page cache limited by a
  cgroup: the open per file costs more than the reads it saves, and ``enosys`` turned the pages it lets go
  into fewer storage reads (5.2k vs 3.8k files/s, 36 % vs 49 % of the dataset read, epoch 3 at 2x);
* ``none``: pages dropped at every open, every read reaches Python (5.1k / 7.5k);
* the thread pool beats a single-threaded loop (12.6k vs 9.7k warm, 5.8k vs 3.5k from memory) once each
  libfuse thread keeps its Python thread state (:func:`keep_thread_state`), and a cached file never waits
  behind another file's disk read.

The rest of a request's cost is the kernel's: Python ``open()`` (before 3.14) asks ``isatty``, an ioctl
that reaches the server on every open (libfuse answers it in C), and each FUSE round trip costs tens of
microseconds on these VMs (``perf``: ~70 % of the server's CPU time is kernel FUSE queueing and wake-ups).
"""

from __future__ import annotations

import collections
import ctypes
import dataclasses
import errno
import functools
import importlib
import json
import logging
import os
import resource
import stat
import threading
import time
from ctypes.util import find_library
from types import ModuleType
from typing import Any, Callable

import numpy as np

from .cache import READAHEAD_BLOCKS, BlockCache
from ..core.dataset import PackedDataset
from ..errors import BlockfsError, BlockReadError, CorruptBlockError, MountError
from ..core.format import METADATA_NAME
from ..core.index import KIND_FILE, KIND_SYMLINK
from .plan import MemoryPlan
from .policies import DEFAULT_POLICY
from .announce import PrefetchListener
from .retain import RetainingReader, plan_dataset
from .share import SHARE_XATTR, ShareServer

log = logging.getLogger(__name__)

BINDING_ENV = "BLOCKFS_FUSE"
ENCODING = "latin-1"
DEFAULT_CONTROL = ".blockfs"
PREFETCH_XATTR = "user.blockfs.prefetch"  # on the control directory: the announcement socket (announce.py)
BLOCKS_LEAF = b"blocks"  # <control>/blocks/NNNNNNNN: the block files, read through the mount
CONTROL_XATTR = "user.blockfs.control"
STATS_XATTR = "user.blockfs.stats"
FILE_XATTRS = ("user.blockfs.label", "user.blockfs.class", "user.blockfs.block")
OPEN_MODES = ("auto", "enosys", "keep_cache", "targets", "none")
FAILED_READ_LOG_S = 60.0  # a block whose reads keep failing (not damaged: retried) is logged this often
STATS_REFRESH_S = 0.5  # how stale ``stats.json`` may be in enosys mode (the xattr is always live)


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


@dataclasses.dataclass(frozen=True)
class MountOptions:
    """How to serve a packed dataset.  ``fuse_options`` are extra ``-o`` options, ``"name"`` or ``"name=value"``."""

    cache_bytes: int
    policy: str = DEFAULT_POLICY
    allow_other: bool = False
    fuse_options: tuple[str, ...] = ()
    threads: bool = True  # libfuse's thread pool: a cached file never waits behind another file's disk read
    # enosys with libfuse 3, keep_cache with libfuse 2; "targets": keep pages of the plan's retained files
    # only (issue 4; measured by tools/bench_memory.py --kernel); "none": no page-cache reuse.
    open_mode: str = "auto"
    timeout_s: float = 86400.0  # entry / attribute / negative lookup timeouts: the data never changes
    readahead: int = READAHEAD_BLOCKS
    prefill: bool = True  # load the blocks the budget will hold in the background, from mount on
    lock_memory: bool = True
    share: bool = True  # hand cached blocks to loaders on this machine as sealed memory (share.py)
    control_name: str = DEFAULT_CONTROL
    # The memory plan: ``cache_bytes`` is the whole budget, split between retained files and blocks.
    retain: bool = True
    retain_strategy: str | None = None  # plan.DEFAULT_STRATEGY
    retain_threshold: int | str | None = None  # bytes, "auto" or None (threshold strategy only)
    preload: bool = False  # read what the plan keeps before serving

    def __post_init__(self) -> None:
        if self.open_mode not in OPEN_MODES:
            raise ValueError(f"open_mode {self.open_mode!r} is not one of {', '.join(OPEN_MODES)}")
        if self.cache_bytes < 0:
            raise ValueError(f"cache size must be >= 0 bytes, not {self.cache_bytes}")

    @property
    def resolved_open_mode(self) -> str:
        if self.open_mode != "auto":
            return self.open_mode
        return "enosys" if LIBFUSE_MAJOR >= 3 else "keep_cache"


def control_name_for(ds: PackedDataset, preferred: str = DEFAULT_CONTROL) -> str:
    """``preferred``, or it with a suffix, so that it names no entry of the dataset's root."""
    name, k = preferred, 0
    while ds.index.find(os.fsencode(name)) >= 0:
        k += 1
        name = f"{preferred}-{k}"
    return name


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
                self._report(e)
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
        options: MountOptions,
        mountpoint: str = "",
        plan: MemoryPlan | None = None,
        retainer: RetainingReader | None = None,
    ) -> None:
        self._ds = ds
        self._cache = cache
        self._plan = plan
        self._retainer = retainer
        self._a = ds.index.arrays
        self._open_mode = options.resolved_open_mode
        self._options = options
        self._uid, self._gid = os.getuid(), os.getgid()
        self._reported: set[int | None] = set()
        self._report_lock = threading.Lock()
        self._errors = 0
        self._failed_reads = 0
        self._failed_logged: dict[int | None, float] = {}  # block -> when a failed read of it was last logged
        self._started = time.time()
        self._mountpoint = mountpoint
        self.control = _Control(self, control_name_for(ds, options.control_name))
        self.served = False  # set once libfuse has mounted and called init
        self.requests: collections.Counter[str] = collections.Counter()
        self._ticker: threading.Thread | None = None
        self._stop = threading.Event()

    # --- life cycle -----------------------------------------------------------------------------
    def init(self, path: str) -> None:
        self.served = True
        log.info(
            "serving %s at %s (%s, libfuse %d, open %s, cache %d bytes %s)",
            self._ds.root, self._mountpoint, BINDING_NAME, LIBFUSE_MAJOR, self._open_mode,
            self._cache.budget_bytes, self._cache.policy_name,
        )  # fmt: skip
        if self._open_mode == "enosys":
            self._ticker = self.control.start_invalidation(self._stop)
        if self._options.prefill:
            self._cache.start_prefill()

    def destroy(self, path: str) -> None:
        self._stop.set()

    def _report(self, e: CorruptBlockError | BlockReadError) -> None:
        """One log line per damaged block, naming the block and the first file read from it; a failed read
        (the next read tries again) one line per block a minute at most."""
        damaged = isinstance(e, CorruptBlockError)
        now = time.monotonic()
        with self._report_lock:
            if damaged:
                self._errors += 1
                first = e.block not in self._reported
                self._reported.add(e.block)
            else:
                self._failed_reads += 1
                first = now - self._failed_logged.get(e.block, -FAILED_READ_LOG_S) >= FAILED_READ_LOG_S
                if first:
                    self._failed_logged[e.block] = now
        if first:
            log.error("%s: answering EIO %s", e, "for the files it damages" if damaged else
                      "for this read; the next read tries again")  # fmt: skip

    # --- metadata -------------------------------------------------------------------------------
    @fuse_call
    def getattr(self, path: str, fh: Any = None) -> dict[str, Any]:
        raw = path.encode(ENCODING)
        if self.control.owns(raw):
            return self.control.getattr(raw)
        return self._attr(self._ds.lookup(raw))

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
            return self.control.readdir(raw)
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
        return self._ds.readlink(path.encode(ENCODING)).decode(ENCODING)

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
        e = self._ds.lookup(raw)
        value = self._xattrs(e).get(name)
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
            return {CONTROL_XATTR: self.control.name.encode()}
        if int(self._a["kind"][e]) != KIND_FILE:
            return {}
        label = int(self._a["label"][e])
        found = {}
        if label >= 0:
            found["user.blockfs.label"] = str(label).encode()
            classes = self._ds.classes
            if classes and label < len(classes):
                found["user.blockfs.class"] = os.fsencode(classes[label])
        found["user.blockfs.block"] = str(int(self._a["block"][e])).encode()
        return found

    # --- data -----------------------------------------------------------------------------------
    @fuse_call
    def open(self, path: str, fi: Any) -> int:
        if self._open_mode == "enosys":
            # The kernel then stops sending open/release for the whole mount and keeps page cache
            # across opens (it acts as if keep_cache were set).  The mount is read-only, so the VFS
            # already refused any open for writing.
            raise FuseOSError(errno.ENOSYS)
        raw = path.encode(ENCODING)
        if fi.flags & os.O_ACCMODE != os.O_RDONLY:
            raise FuseOSError(errno.EROFS)
        if self.control.owns(raw):
            fi.direct_io = self.control.is_live(raw)
            fi.keep_cache = not fi.direct_io
        elif self._open_mode == "targets":
            fi.keep_cache = self._keeps(self._ds.lookup(raw))
        else:
            fi.keep_cache = self._open_mode == "keep_cache"
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
                "dest": os.path.abspath(self._ds.root),
                "mountpoint": self._mountpoint,
                "pid": os.getpid(),
                "binding": BINDING_NAME,
                "libfuse": LIBFUSE_MAJOR,
                "open_mode": self._open_mode,
                "threads": self._options.threads,
                "control": self.control.name,
                "started": self._started,
            },
            "dataset": {
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
            "errors": {"damaged_files_read": self._errors, "damaged_blocks_reported": sorted(
                b for b in self._reported if b is not None), "failed_reads": self._failed_reads},
        }


class _Control:
    """The control directory: live statistics and the dataset's metadata and index, outside its tree,
    and ``blocks/NNNNNNNN``, each block file as stored (see :meth:`PackedDataset.read_block_range`): a
    loader that knows the layout reads a file as one ``pread`` of an already open block, with no path
    lookup and no open per file, and still gets the mount's cache, verification and statistics."""

    def __init__(self, fs: BlockFS, name: str) -> None:
        self.fs = fs
        self.name = name
        self.path = b"/" + os.fsencode(name)
        root = fs._ds.root
        with open(os.path.join(root, METADATA_NAME), "rb") as f:
            self._metadata = f.read()
        self._index = fs._ds.index.raw  # the bytes the mount serves from, not the file (which may change)
        self._ino = int(fs._a["ino"].max(initial=0)) + 1  # after every entry's inode
        self._files = {b"stats.json": 1, b"metadata.json": 2, b"index.bfi": 3}
        self._blocks_ino = self._ino + 4  # then one inode per block file
        self._block_sizes = fs._a["block_sizes"]
        self._snapshot = b""
        self._served = threading.Event()
        self.prefetch_address: bytes | None = None  # the socket that takes loaders' block announcements
        self.share_address: bytes | None = None  # the socket that hands loaders cached blocks

    def owns(self, raw: bytes) -> bool:
        return raw.startswith(self.path) and (len(raw) == len(self.path) or raw[len(self.path)] == 0x2F)

    def readdir(self, raw: bytes) -> list:
        leaf = self._leaf(raw)
        if leaf == BLOCKS_LEAF:
            return [
                (".", {"st_mode": stat.S_IFDIR, "st_ino": self._blocks_ino}, 0),
                ("..", {"st_mode": stat.S_IFDIR, "st_ino": self._ino}, 0),
            ] + [(f"{b:08d}", {"st_mode": stat.S_IFREG, "st_ino": self._blocks_ino + 1 + b}, 0)
                 for b in range(len(self._block_sizes))]
        if leaf is not None:
            raise FuseOSError(errno.ENOTDIR)
        return [
            (".", {"st_mode": stat.S_IFDIR, "st_ino": self._ino}, 0),
            ("..", {"st_mode": stat.S_IFDIR, "st_ino": int(self.fs._a["ino"][0])}, 0),
            (BLOCKS_LEAF.decode(), {"st_mode": stat.S_IFDIR, "st_ino": self._blocks_ino}, 0),
        ] + [(n.decode(), {"st_mode": stat.S_IFREG, "st_ino": self._ino + k}, 0) for n, k in self._files.items()]

    def is_live(self, raw: bytes) -> bool:
        return raw.endswith(b"/stats.json")

    def _leaf(self, raw: bytes) -> bytes | None:
        """The path inside the directory (``blocks/NNNNNNNN`` for a block); None for the directory itself."""
        rest = raw[len(self.path) + 1 :]
        if not rest:
            return None
        if rest not in self._files and rest != BLOCKS_LEAF and self._block_of(rest) is None:
            raise FuseOSError(errno.ENOENT)
        return rest

    def _block_of(self, leaf: bytes) -> int | None:
        """The block a ``blocks/NNNNNNNN`` path names (exactly that spelling), else None."""
        name = leaf[len(BLOCKS_LEAF) + 1 :]
        if not leaf.startswith(BLOCKS_LEAF + b"/") or len(name) != 8 or not name.isdigit():
            return None
        block = int(name)
        return block if block < len(self._block_sizes) else None

    def getattr(self, raw: bytes) -> dict[str, Any]:
        leaf = self._leaf(raw)
        now = int(self.fs._started * 1e9)
        common = {"st_uid": self.fs._uid, "st_gid": self.fs._gid, "st_atime": now, "st_ctime": now}
        if leaf is None or leaf == BLOCKS_LEAF:
            return {**common, "st_mode": stat.S_IFDIR | 0o555, "st_nlink": 2, "st_size": 0, "st_mtime": now,
                    "st_ino": self._ino if leaf is None else self._blocks_ino}
        block = self._block_of(leaf)
        if block is not None:
            size = int(self._block_sizes[block])
            return {**common, "st_mode": stat.S_IFREG | 0o444, "st_ino": self._blocks_ino + 1 + block,
                    "st_nlink": 1, "st_size": size, "st_blocks": (size + 511) // 512, "st_mtime": now}
        if leaf == b"stats.json":
            self._snapshot = self._stats_bytes()
            size, now = len(self._snapshot), time.time_ns()
        elif leaf == b"metadata.json":
            size = len(self._metadata)
        else:
            size = len(self._index)
        return {**common, "st_mode": stat.S_IFREG | 0o444, "st_ino": self._ino + self._files[leaf],
                "st_nlink": 1, "st_size": size, "st_blocks": (size + 511) // 512, "st_mtime": now}

    def read(self, raw: bytes, size: int, offset: int) -> bytes:
        leaf = self._leaf(raw)
        if leaf is None or leaf == BLOCKS_LEAF:
            raise FuseOSError(errno.EISDIR)
        block = self._block_of(leaf)
        if block is not None:
            return self.fs._ds.read_block_range(block, offset, size)
        if leaf == b"index.bfi":
            return bytes(self._index[offset : offset + size])
        if leaf == b"metadata.json":
            return self._metadata[offset : offset + size]
        # stats.json: enosys mode serves the snapshot its size was stat'ed from; direct_io mode (no
        # size the kernel trusts) takes a fresh one at every first read.
        if not self._snapshot or (offset == 0 and self.fs._open_mode != "enosys"):
            self._snapshot = self._stats_bytes()
        self._served.set()
        return self._snapshot[offset : offset + size]

    def getxattr(self, raw: bytes, name: str) -> bytes:
        if self._leaf(raw) is None:
            if name == STATS_XATTR:
                return self._stats_bytes()
            if name == PREFETCH_XATTR and self.prefetch_address is not None:
                return self.prefetch_address
            if name == SHARE_XATTR and self.share_address is not None:
                return self.share_address
        raise FuseOSError(errno.ENODATA)

    def listxattr(self, raw: bytes) -> list[str]:
        if self._leaf(raw) is not None:
            return []
        return (
            [STATS_XATTR]
            + [PREFETCH_XATTR] * (self.prefetch_address is not None)
            + [SHARE_XATTR] * (self.share_address is not None)
        )

    def _stats_bytes(self) -> bytes:
        return json.dumps(self.fs.stats(), indent=1).encode() + b"\n"

    def start_invalidation(self, stop: threading.Event) -> threading.Thread | None:
        """In enosys mode the kernel caches stats.json like any file: drop its pages after each read."""
        try:
            lib = binding._libfuse
            fuse = lib.fuse_get_context().contents.fuse
            invalidate = lib.fuse_invalidate_path
        except AttributeError as e:
            log.debug("no fuse_invalidate_path (%s): stats.json may be stale; the %s xattr is live", e, STATS_XATTR)
            return None
        invalidate.argtypes = (ctypes.c_void_p, ctypes.c_char_p)
        path = self.path + b"/stats.json"

        def run() -> None:
            while not stop.wait(STATS_REFRESH_S):
                if self._served.is_set():
                    self._served.clear()
                    invalidate(fuse, path)

        thread = threading.Thread(target=run, name="blockfs-stats", daemon=True)
        thread.start()
        return thread

    def close(self) -> None:
        self._index = b""  # the bytes belong to the dataset's index, which closes them


def fuse_kwargs(options: MountOptions, dest: str) -> dict[str, Any]:
    """The binding's keyword options for this mount (``-o`` options plus foreground/nothreads)."""
    fsname = "".join(c if c.isprintable() and c not in ",\\=" else "_" for c in os.path.abspath(dest))
    timeout = f"{options.timeout_s:g}"
    kwargs: dict[str, Any] = {
        "foreground": True,
        "nothreads": not options.threads,
        "ro": True,
        "default_permissions": True,
        "use_ino": True,
        "fsname": fsname.encode(ENCODING, "replace").decode(ENCODING),
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


def _raise_open_files_limit() -> None:
    """Lift this process's soft limit on open descriptors to the hard limit (often 1024 -> 1M)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != hard:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
        except (ValueError, OSError) as e:
            log.debug("cannot raise RLIMIT_NOFILE from %d to %d: %s", soft, hard, e)


def _preload(
    ds: PackedDataset,
    cache: BlockCache,
    retainer: RetainingReader | None,
    plan: MemoryPlan,
    on_progress: Callable[[int, int], None] | None,
) -> None:
    """Read what the plan keeps before serving: the blocks the cache holds, then the retained files."""
    total = plan.dataset_bytes if plan.fits else plan.block_cache_bytes + plan.retained_bytes
    done = [0]

    def step(nbytes: int) -> None:
        done[0] += nbytes
        if on_progress is not None:
            on_progress(done[0], total)

    started = time.monotonic()
    cache.preload(step)
    if retainer is not None:
        a = ds.index.arrays
        files = np.flatnonzero(a["kind"] == KIND_FILE)
        crcs = {(int(b), int(s)): int(c) for b, s, c in zip(a["block"][files], a["slot"][files], a["crc"][files])}
        retainer.preload(crcs, step)
    log.info("preloaded %d bytes in %.1f s", done[0], time.monotonic() - started)


def serve(
    dest: str | os.PathLike,
    mountpoint: str | os.PathLike,
    options: MountOptions,
    on_progress: Callable[[int, int], None] | None = None,
) -> None:
    """Mount ``dest`` at ``mountpoint`` and serve it until unmounted (or SIGINT/SIGTERM); blocks.

    ``on_progress(done, total)``: bytes read so far by ``options.preload``, before mounting."""
    # Absolute paths: libfuse 3 changes the working directory to / once mounted.
    dest, mountpoint = os.path.abspath(os.fspath(dest)), os.path.abspath(os.fspath(mountpoint))
    ds = PackedDataset(dest)
    if options.share:
        _raise_open_files_limit()  # a shared block holds a descriptor (a memfd) for as long as it is cached
    retain = options.retain and options.policy != "none"
    plan, (blocks, slots, sizes) = plan_dataset(
        ds.index.arrays, options.cache_bytes, strategy=options.retain_strategy,
        threshold=options.retain_threshold, retain=retain,
    )  # fmt: skip
    log.info("memory plan:\n%s", plan.describe())
    cache = BlockCache(
        ds.store,
        plan.block_cache_bytes if retain else options.cache_bytes,
        options.policy,
        readahead=options.readahead,
        lock_memory=options.lock_memory,
        n_files=len(sizes),
        share=options.share,
    )
    retainer = None
    if retain and plan.retained_files:
        mask = plan.retained
        retainer = RetainingReader(cache, blocks[mask], slots[mask], sizes[mask], lock_memory=options.lock_memory)
        ds.reader = retainer
    else:
        ds.reader = cache
    fs = BlockFS(ds, cache, options, mountpoint, plan, retainer)
    listener = sharer = None
    try:
        if options.policy != "none":
            listener = PrefetchListener(cache.prefetch, ds.n_blocks)
            fs.control.prefetch_address = listener.address
        if cache.shares:
            sharer = ShareServer(cache.share, ds.n_blocks)
            fs.control.share_address = sharer.address
        if options.preload:
            _preload(ds, cache, retainer, plan, on_progress)
        binding.FUSE(
            fs,
            os.fsencode(mountpoint).decode(ENCODING),
            raw_fi=fs._open_mode != "enosys",
            encoding=ENCODING,
            **fuse_kwargs(options, dest),
        )
    except RuntimeError as e:
        if not fs.served:
            raise MountError(f"libfuse could not mount {mountpoint!r} (status {e}); see the messages above") from e
        # libfuse 3 reports a loop ended by SIGINT/SIGTERM as an error status; it unmounted cleanly.
        log.debug("libfuse returned status %s after serving", e)
    finally:
        fs._stop.set()
        if listener is not None:
            listener.close()
        if sharer is not None:
            sharer.close()
        cache.close()
        if retainer is not None:
            retainer.close()
        fs.control.close()
        ds.close()
    log.info("unmounted %s", mountpoint)
