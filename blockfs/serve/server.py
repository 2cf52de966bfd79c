"""A running mount, assembled: dataset, memory plan, caches, control sockets and the FUSE adapter.

:class:`MountOptions` and :data:`OPEN_MODES` import without a FUSE binding (the command line takes its
choices from here); the adapter, :mod:`blockfs.serve.fs`, is imported only to build or run a mount.

:func:`serve` is what ``blockfs mount --foreground`` runs.  The assembly is :func:`assembled`, a context
manager that builds every layer and closes them in order, so the tests drive the same mount in-process
(calling the adapter's methods, no kernel involved) that :func:`serve` hands to libfuse.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import resource
import time
from typing import TYPE_CHECKING, Any, Callable, Iterator

import numpy as np

from .. import protocol
from ..core.dataset import PackedDataset
from ..core.location import StorageOptions
from ..core.partition import partition_blocks
from ..storage.location import absolute, is_remote, redact
from ..core.index import KIND_FILE
from .announce import PrefetchListener
from .cache import READAHEAD_BLOCKS, BlockCache
from .plan import MemoryPlan
from .policies import DEFAULT_POLICY
from .retain import RetainingReader, plan_dataset
from .share import ShareServer

if TYPE_CHECKING:
    from .fs import BlockFS

log = logging.getLogger(__name__)

OPEN_MODES = ("auto", "enosys", "keep_cache", "targets", "none")


@dataclasses.dataclass(frozen=True)
class MountOptions:
    """How to serve a packed dataset.  ``fuse_options`` are extra ``-o`` options, ``"name"`` or ``"name=value"``."""

    cache_bytes: int
    policy: str = DEFAULT_POLICY
    allow_other: bool = False
    fuse_options: tuple[str, ...] = ()
    threads: bool = True  # libfuse's thread pool: a cached file never waits behind another file's disk read
    # enosys with libfuse 3, keep_cache with libfuse 2; "targets": keep pages of the plan's retained files
    # only (measured by tools/bench_memory.py --kernel); "none": no page-cache reuse.
    open_mode: str = "auto"
    timeout_s: float = 86400.0  # entry / attribute / negative lookup timeouts: the data never changes
    readahead: int = READAHEAD_BLOCKS
    prefill: bool = True  # load the blocks the budget will hold in the background, from mount on
    lock_memory: bool = True
    share: bool = True  # hand cached blocks to loaders on this machine as sealed memory (share.py)
    control_name: str = protocol.DEFAULT_CONTROL
    # The memory plan: ``cache_bytes`` is the whole budget, split between retained files and blocks.
    retain: bool = True
    retain_strategy: str | None = None  # plan.DEFAULT_STRATEGY
    retain_threshold: int | str | None = None  # bytes, "auto" or None (threshold strategy only)
    preload: bool = False  # read what the plan keeps before serving
    storage: StorageOptions | None = None  # a remote dataset's options and its disk tier
    # partition="node": this mount serves node ``node_rank`` of ``nodes``, whose loaders read only the part
    # core.partition gives it for ``partition_seed`` (the loaders' seed): prefill and read-ahead keep to it.
    nodes: int = 1
    node_rank: int = 0
    partition_seed: int = 0
    expect: str | None = None  # the pinned dataset name ("blake3:..."): another dataset is refused

    def __post_init__(self) -> None:
        if self.open_mode not in OPEN_MODES:
            raise ValueError(f"open_mode {self.open_mode!r} is not one of {', '.join(OPEN_MODES)}")
        if self.cache_bytes < 0:
            raise ValueError(f"cache size must be >= 0 bytes, not {self.cache_bytes}")
        if self.nodes < 1 or not 0 <= self.node_rank < self.nodes:
            raise ValueError(f"node rank {self.node_rank} is not one of {self.nodes} nodes (0 to {self.nodes - 1})")

    def open_mode_for(self, libfuse_major: int) -> str:
        """The open mode to use with this libfuse: ``auto`` is enosys with libfuse 3, keep_cache with 2
        (libfuse 2 cannot drop pages from the kernel's cache, which enosys relies on for old snapshots)."""
        if self.open_mode != "auto":
            return self.open_mode
        return "enosys" if libfuse_major >= 3 else "keep_cache"


def fuse_kwargs(options: MountOptions, dest: str) -> dict[str, Any]:
    """The binding's keyword options for this mount (``-o`` options plus foreground/nothreads)."""
    from .fs import ENCODING
    source = redact(dest) if is_remote(dest) else os.path.abspath(dest)  # /proc/mounts shows it to everyone
    fsname = "".join(c if c.isprintable() and c not in ",\\=" else "_" for c in source)
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


def raise_open_files_limit() -> None:
    """Lift this process's soft limit on open descriptors to the hard limit (often 1024 -> 1M)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != hard:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
        except (ValueError, OSError) as e:
            log.debug("cannot raise RLIMIT_NOFILE from %d to %d: %s", soft, hard, e)


def preload(
    ds: PackedDataset,
    cache: BlockCache,
    retainer: RetainingReader | None,
    plan: MemoryPlan,
    on_progress: Callable[[int, int], None] | None = None,
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


def node_part(ds: PackedDataset, nodes: int, node_rank: int, seed: int) -> list[int]:
    """The blocks of node ``node_rank`` under ``partition="node"`` (the loaders' split: same inputs)."""
    a = ds.index.arrays
    node_of = partition_blocks(np.diff(a["block_offsets"]), nodes, seed=seed, block_bytes=a["block_sizes"])
    return np.flatnonzero(node_of == node_rank).tolist()


@contextlib.contextmanager
def assembled(
    dest: str | os.PathLike,
    mountpoint: str | os.PathLike,
    options: MountOptions,
    on_progress: Callable[[int, int], None] | None = None,
) -> Iterator[BlockFS]:
    """Every layer of a mount of ``dest`` at ``mountpoint`` (not mounted): the adapter, with its control
    directory's sockets listening; everything is closed on the way out."""
    from .fs import BlockFS
    dest, mountpoint = absolute(dest), os.path.abspath(os.fspath(mountpoint))
    with contextlib.ExitStack() as stack:
        ds = PackedDataset(dest, storage=options.storage, expect=options.expect)
        stack.callback(ds.close)
        if options.share:
            raise_open_files_limit()  # a shared block holds a descriptor (a memfd) for as long as it is cached
        retain = options.retain and options.policy != "none"
        plan, (blocks, slots, sizes) = plan_dataset(
            ds.index.arrays, options.cache_bytes, strategy=options.retain_strategy,
            threshold=options.retain_threshold, retain=retain,
        )  # fmt: skip
        log.info("memory plan:\n%s", plan.describe())
        cache = BlockCache(
            ds.store, plan.block_cache_bytes if retain else options.cache_bytes, options.policy,
            readahead=options.readahead, lock_memory=options.lock_memory, n_files=len(sizes), share=options.share,
        )  # fmt: skip
        stack.callback(cache.close)
        if options.nodes > 1:
            cache.keep_to(node_part(ds, options.nodes, options.node_rank, options.partition_seed))
        retainer = None
        if retain and plan.retained_files:
            mask = plan.retained
            retainer = RetainingReader(cache, blocks[mask], slots[mask], sizes[mask], lock_memory=options.lock_memory)
            stack.callback(retainer.close)
        ds.reader = retainer if retainer is not None else cache
        fs = BlockFS(ds, cache, options, mountpoint, plan, retainer)
        stack.callback(fs.control.close)
        stack.callback(fs.stopped.set)
        if options.policy != "none":
            listener = stack.enter_context(contextlib.closing(PrefetchListener(cache.prefetch, ds.n_blocks)))
            fs.control.prefetch_address = listener.address
        if cache.shares:
            sharer = stack.enter_context(contextlib.closing(ShareServer(cache.share, ds.n_blocks)))
            fs.control.share_address = sharer.address
        if options.preload:
            preload(ds, cache, retainer, plan, on_progress)
        yield fs


def serve(
    dest: str | os.PathLike,
    mountpoint: str | os.PathLike,
    options: MountOptions,
    on_progress: Callable[[int, int], None] | None = None,
) -> None:
    """Mount ``dest`` at ``mountpoint`` and serve it until unmounted (or SIGINT/SIGTERM); blocks.

    ``on_progress(done, total)``: bytes read so far by ``options.preload``, before mounting."""
    from .fs import run

    # Absolute paths: libfuse 3 changes the working directory to / once mounted.
    dest, mountpoint = absolute(dest), os.path.abspath(os.fspath(mountpoint))
    with assembled(dest, mountpoint, options, on_progress) as fs:
        run(fs, mountpoint, fuse_kwargs(options, dest))
    log.info("unmounted %s", mountpoint)
