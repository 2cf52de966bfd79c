"""A running mount, assembled: dataset, memory plan, caches, control sockets and the FUSE adapter.

:class:`MountOptions` (:mod:`blockfs.serve.mount_options`) imports without a FUSE binding; the adapters,
:mod:`blockfs.serve.fuse.kernel_adapter` (the kernel protocol) and :mod:`blockfs.serve.fuse.libfuse_adapter` (mfusepy/fusepy), are
imported only to build or run a mount, the one :func:`choose_route` picks.

:func:`serve` is what ``blockfs mount --foreground`` runs.  The assembly is :func:`assembled`, a context
manager that builds every layer and closes them in order, so the tests drive the same mount in-process
(calling the adapter's methods, no kernel involved) that :func:`serve` hands to libfuse.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import shutil
import threading
import time
from typing import TYPE_CHECKING, Any, Callable, Iterator

import numpy as np

from ..core.checked_indexes import CheckedIndexes
from ..core.dataset import PackedDataset
from ..core.location import StorageOptions
from ..errors import MountError
from ..openfiles import raise_open_files_limit
from ..storage.urls import absolute, is_remote, redact
from ..core.index import KIND_FILE
from .control.announce import PrefetchListener
from .cache.block_cache import BlockCache
from .fuse.libfuse_messages import StderrCapture, distill
from .notify import notify
from .mount_options import FUSE_ROUTES, MountOptions
from .cache.mount_plan import make_mount_plan, node_part
from .cache.memory_plan import MemoryPlan
from .daemon import is_mounted
from .cache.retain import RetainingReader
from .control.share import ShareServer
from .view import MountView
from .peers import peer_options, start_peers

if TYPE_CHECKING:
    from .fuse.libfuse_adapter import BlockFS
    from .fuse.kernel_adapter import KernelFS

    Adapter = BlockFS | KernelFS

log = logging.getLogger(__name__)

ROUTE_ENV = "BLOCKFS_FUSE"  # the route when --fuse is not given: kernel, mfusepy or fusepy

def kernel_route_problem() -> str | None:
    """Why the kernel-protocol route cannot run here (None when it can)."""
    if not os.path.exists("/dev/fuse"):
        return "/dev/fuse does not exist"
    if not os.access("/dev/fuse", os.R_OK | os.W_OK):
        return "/dev/fuse is not readable and writable by this user"
    if os.geteuid() != 0 and not (shutil.which("fusermount3") or shutil.which("fusermount")):
        return "fusermount3 is not installed (package fuse3)"
    return None


def choose_route(options: MountOptions) -> str:
    """The FUSE route to serve with: the option, else ``BLOCKFS_FUSE``, else the kernel protocol where it
    can run here and mfusepy where it cannot (said in one log line)."""
    route = options.fuse
    if route == "auto":
        route = os.environ.get(ROUTE_ENV) or "auto"
        if route not in FUSE_ROUTES:
            raise MountError(f"{ROUTE_ENV}={route!r}: choose one of {', '.join(FUSE_ROUTES)}")
    if route == "auto":
        problem = kernel_route_problem()
        if problem is None:
            return "kernel"
        log.info("serving through mfusepy (libfuse): the kernel-protocol route cannot run here: %s", problem)
        return "mfusepy"
    return route


def mount_source(dest: str) -> str:
    """What /proc/mounts shows as the source (to every user): the dataset, a URL redacted, with the
    characters mount options cannot hold replaced."""
    source = redact(dest) if is_remote(dest) else os.path.abspath(dest)
    return "".join(c if c.isprintable() and c not in ",\\=" else "_" for c in source)


def fuse_kwargs(options: MountOptions, dest: str) -> dict[str, Any]:
    """The binding's keyword options for this mount (``-o`` options plus foreground/nothreads)."""
    from .fuse.libfuse_adapter import ENCODING
    # The binding hands str options to libfuse as latin-1, one byte per character: give it the path's own
    # bytes (UTF-8 for 'ü') through that channel, so the mount table holds the name as the file system does.
    fsname = os.fsencode(mount_source(dest)).decode(ENCODING)
    timeout = f"{options.timeout_s:g}"
    kwargs: dict[str, Any] = {
        "foreground": True,
        "nothreads": not options.threads,
        "ro": True,
        "default_permissions": True,
        "use_ino": True,
        "fsname": fsname,
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


@contextlib.contextmanager
def assembled(
    dest: str | os.PathLike,
    mountpoint: str | os.PathLike,
    options: MountOptions,
    on_progress: Callable[[int, int], None] | None = None,
    route: str | None = None,
    on_plan: Callable[[dict[str, Any]], None] | None = None,
) -> Iterator["Adapter"]:
    """Every layer of a mount of ``dest`` at ``mountpoint`` (not mounted): the adapter of ``route`` (by
    default :func:`choose_route`'s), with its control directory's sockets listening; everything is closed
    on the way out.  ``on_plan(report)``: the plan (:meth:`MountPlan.report`), as soon as it is made."""
    route = route or choose_route(options)
    if route == "kernel":
        from .fuse.kernel_adapter import KernelFS as make_adapter
    else:
        os.environ[ROUTE_ENV] = route  # the binding blockfs.serve.fuse.libfuse_adapter loads on import
        from .fuse.libfuse_adapter import BlockFS as make_adapter
    dest, mountpoint = absolute(dest), os.path.abspath(os.fspath(mountpoint))
    with contextlib.ExitStack() as stack:
        peers = peer_options(options)  # the storage chain asks them before the store
        storage = options.storage if peers is None else dataclasses.replace(options.storage or StorageOptions(), peers=peers)
        # A re-mount of an index that passed every check of this code skips them (its digest is still checked).
        ds = PackedDataset(dest, storage=storage, expect=options.expect, checked=CheckedIndexes.default())
        stack.callback(ds.close)
        if options.share:
            raise_open_files_limit()  # a shared block holds a descriptor (a memfd) for as long as it is cached
        planned = make_mount_plan(
            ds, options.cache_bytes, strategy=options.retain_strategy, threshold=options.retain_threshold,
            retain=options.retain, policy=options.policy, nodes=options.nodes, partition_seed=options.partition_seed,
        )  # fmt: skip
        if on_plan is not None:
            on_plan(planned.report())  # the command that started this server prints it
        plan, (blocks, slots, sizes), retain = planned.memory, planned.files, planned.retains
        log.debug("memory plan:\n%s", plan.describe())
        cache = BlockCache(
            ds.store, plan.block_cache_bytes if retain else options.cache_bytes, options.policy,
            readahead=options.readahead, lock_memory=options.lock_memory, n_files=len(sizes), share=options.share,
        )  # fmt: skip
        stack.callback(cache.close)
        if options.nodes > 1:
            cache.keep_to(node_part(ds, options.nodes, options.node_rank, options.partition_seed))
        if peers is not None:  # this node's blocks served to the others; memory keeps the owned ones first
            stack.callback(start_peers(ds, cache, peers, options).close)
        retainer = None
        if retain and plan.retained_files:
            mask = plan.retained
            retainer = RetainingReader(cache, blocks[mask], slots[mask], sizes[mask],
                                       lock_memory=options.lock_memory)  # fmt: skip
            stack.callback(retainer.close)
        ds.reader = retainer if retainer is not None else cache
        view = MountView(ds, cache, options, mountpoint, plan, retainer)
        fs = make_adapter(view)
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
    on_plan: Callable[[dict[str, Any]], None] | None = None,
) -> None:
    """Mount ``dest`` at ``mountpoint`` and serve it until unmounted (or SIGINT/SIGTERM); blocks.

    ``on_progress(done, total)``: bytes read so far by ``options.preload``, before mounting.
    ``on_plan(report)``: the mount's plan, made once, before anything is read or mounted."""
    # Absolute paths: libfuse 3 changes the working directory to / once mounted.
    dest, mountpoint = absolute(dest), os.path.abspath(os.fspath(mountpoint))
    with assembled(dest, mountpoint, options, on_progress, on_plan=on_plan) as fs:
        watcher = threading.Thread(target=_when_serving, args=(fs, mountpoint), daemon=True)
        if fs.route == "kernel":
            watcher.start()
            try:
                fs.run(mountpoint, mount_source(dest), list(_split_options(options.fuse_options)))
            except OSError as e:
                if not fs.served:
                    raise MountError(f"cannot mount {mountpoint!r}: {e.strerror or e}") from e
                raise
            finally:
                fs.stopped.set()
                watcher.join()
        else:
            _serve_libfuse(fs, dest, mountpoint, options, watcher)
    notify("STOPPING=1")
    log.info("unmounted %s", mountpoint)


def _serve_libfuse(fs: "BlockFS", dest: str, mountpoint: str, options: MountOptions, watcher: threading.Thread) -> None:
    """The libfuse routes: what libfuse prints while mounting is captured and distilled into one line."""
    from .fuse.libfuse_adapter import run

    with StderrCapture() as libfuse_said:
        fs.libfuse_said = libfuse_said
        watcher.start()
        try:
            run(fs, mountpoint, fuse_kwargs(options, dest))
        except MountError as e:
            if fs.served:
                raise
            libfuse_said.release(replay=False)
            text = libfuse_said.text()
            log.debug("libfuse wrote:\n%s", text.rstrip())
            why = distill(text)
            if why is None:
                os.write(2, text.encode())
                raise
            raise MountError(f"cannot mount {mountpoint!r}: {why}") from e
        finally:
            fs.stopped.set()
            watcher.join()


def _split_options(fuse_options: tuple[str, ...]) -> Iterator[str]:
    for opt in fuse_options:
        yield from filter(None, opt.split(","))


def _when_serving(fs: "Adapter", mountpoint: str) -> None:
    """Once the mount answers: stderr back from libfuse's capture (libfuse routes), and READY=1 to systemd
    (Type=notify).

    "Answers" is the kernel's INIT answered (``fs.served``) and the mount in the mount table, never a
    ``stat`` of the mount point: that would be a request to this very process, and a server killed while
    one of its own requests is in flight cannot exit (the kernel waits for the answer uninterruptibly, and
    the device closes only when every thread is gone), so the mount hangs until aborted."""
    said = getattr(fs, "libfuse_said", None)
    while not fs.stopped.wait(0.01):
        if fs.served and is_mounted(mountpoint):
            if said is not None:
                said.release()
            notify(f"READY=1\nSTATUS=serving {mountpoint}")
            return
    if said is not None:
        said.release(replay=False)  # the caller reads it
