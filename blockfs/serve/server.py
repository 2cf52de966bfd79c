"""A running mount, assembled: dataset, memory plan, caches, control sockets, the view and the FUSE adapter.

:class:`MountOptions` (:mod:`blockfs.serve.mount_options`) imports without a FUSE binding; the adapters
(:mod:`blockfs.serve.fuse`: the kernel protocol, or mfusepy/fusepy) are imported only to build a mount of
the route :func:`choose_route` picks, and serve through one interface (:class:`blockfs.serve.fuse.Adapter`).

:func:`serve` is what ``blockfs mount --foreground`` runs.  The assembly is :func:`assembled`, a context
manager that builds every layer, each given what it needs when it is made, and closes them in order, so
the tests drive the same mount in-process (calling the adapter's methods, no kernel involved) that
:func:`serve` mounts.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import shutil
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np

from ..core import kept_copies
from ..core.checked_indexes import CheckedIndexes
from ..core.dataset import PackedDataset
from ..core.heap import give_back, one_arena
from ..core.index import KIND_FILE, PackedIndex
from ..core.index_copy import IndexCopies
from ..core.location import StorageOptions
from ..errors import MountError
from ..openfiles import raise_open_files_limit
from ..storage.urls import absolute, is_remote, redact
from .cache.block_cache import BlockCache
from .cache.memory_plan import MemoryPlan
from .cache.mount_plan import make_mount_plan, node_part
from .cache.retain import RetainingReader
from .control.announce import PrefetchListener
from .control.share import ShareServer
from .daemon import is_mounted
from .fuse import Adapter, make_adapter
from .mount_options import FUSE_ROUTES, MountOptions
from .notify import notify
from .peers import OwnedFirst, owned_blocks, peer_options, start_endpoint, window_bytes
from .view import MountView, Route

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
        crcs = {
            (int(b), int(s)): int(c)
            for b, s, c in zip(a["block"][files], a["slot"][files], a["crc"][files], strict=True)
        }
        retainer.preload(crcs, step)
    log.info("preloaded %d bytes in %.1f s", done[0], time.monotonic() - started)


def index_opened(index: PackedIndex, seconds: float) -> str:
    """The log's line on the dataset's open: how long it took, and whether the index's checks ran (most of a
    first mount's time at millions of files) or were skipped, and why."""
    if index.checks_skipped:
        how = "its checks skipped: it passed them on this machine before"
    elif index.directory_checks is not None:
        how = "every check of its contents run but its paths', checked as each directory is first used and whole " + (
            "once the mount serves, then recorded: the next mount of it here skips them"
            if index.records_checks
            else "once the mount serves (recorded nowhere: every mount of it runs them)"
        )
    elif index.checks_recorded:
        how = "every check of its contents run, and recorded: the next mount of it here skips them"
    else:
        how = "every check of its contents run (recorded nowhere: every mount of it runs them)"
    return f"dataset opened in {seconds:.2f} s ({index.n_entries:,} entries); {how}"


@contextlib.contextmanager
def assembled(
    dest: str | os.PathLike,
    mountpoint: str | os.PathLike,
    options: MountOptions,
    on_progress: Callable[[int, int], None] | None = None,
    route: str | None = None,
    on_plan: Callable[[dict[str, Any]], None] | None = None,
) -> Iterator[Adapter]:
    """Every layer of a mount of ``dest`` at ``mountpoint`` (not mounted): the adapter of ``route`` (by
    default :func:`choose_route`'s) over its view, with its control directory's sockets listening; everything
    is closed on the way out.  ``on_plan(report)``: the plan (:meth:`MountPlan.report`), as soon as it is made."""
    route = route or choose_route(options)
    dest, mountpoint = absolute(dest), os.path.abspath(os.fspath(mountpoint))
    one_arena()  # what the index checks' threads free goes back to the system with the rest (core/heap.py)
    with contextlib.ExitStack() as stack:
        peers = peer_options(options)  # the storage chain asks them before the store
        storage = (
            options.storage if peers is None else dataclasses.replace(options.storage or StorageOptions(), peers=peers)
        )
        # A re-mount of an index that passed every check of this code skips them (its digest is still checked).
        # The index is copied into an unnamed file of the mount's and mapped: page cache, not anonymous memory.
        started = time.monotonic()
        ds = PackedDataset(
            dest,
            storage=storage,
            expect=options.expect,
            checked=CheckedIndexes.default(),
            copies=IndexCopies.default(),
            defer_tree_checks=True,  # the paths' checks run per directory before use, and whole once serving
        )
        stack.callback(ds.close)
        log.info("%s", index_opened(ds.index, time.monotonic() - started))
        if options.share:
            raise_open_files_limit()  # a shared block holds a descriptor (a memfd) for as long as it is cached
        planned = make_mount_plan(
            ds,
            options.cache_bytes,
            strategy=options.retain_strategy,
            threshold=options.retain_threshold,
            retain=options.retain,
            policy=options.policy,
            nodes=options.nodes,
            partition_seed=options.partition_seed,
        )
        if on_plan is not None:
            on_plan(planned.report())  # the command that started this server prints it
        plan, retain = planned.memory, planned.retains
        # Only the retained files' (block, slot, size) are kept: the plan's arrays over every file are not
        # held for the mount's life (24 bytes a file), and what planning freed goes back to the system.
        targets: tuple[np.ndarray, ...] | None = None
        if retain and plan.retained_files and plan.retained is not None:
            mask = plan.retained
            targets = tuple(column[mask] for column in planned.files)
        del planned
        give_back()
        log.debug("memory plan:\n%s", plan.describe())

        def build(given: Route) -> MountView:
            """The memory tier, the control sockets and the view, given what the adapter's route brings."""
            tier = owned = admits = None
            budget = plan.block_cache_bytes if retain else options.cache_bytes
            window = 0
            if peers is not None:  # memory keeps the blocks this node owns first
                tier, owned = owned_blocks(ds, peers, options)
                block_sizes = [int(n) for n in ds.index.arrays["block_sizes"]]
                admits = OwnedFirst(owned, block_sizes)
                window = window_bytes(budget, owned, block_sizes, options.policy)
            cache = BlockCache(
                ds.store,
                budget,
                options.policy,
                readahead=options.readahead,
                lock_memory=options.lock_memory,
                n_files=plan.n_files,
                share=options.share,
                on_load=given.on_load,
                admits=admits,
                window_bytes=window,
                window_for=tier.holds if tier is not None else None,
            )
            stack.callback(cache.close)
            if options.nodes > 1:
                cache.keep_to(node_part(ds, options.nodes, options.node_rank, options.partition_seed))
            if tier is not None and owned is not None and peers is not None:
                cache.keep_to(owned)  # prefill and read-ahead load this node's own blocks
                stack.callback(start_endpoint(ds, cache, tier, peers).close)  # served to the other nodes
            retainer = None
            if targets is not None:
                blocks, slots, sizes = targets
                retainer = RetainingReader(
                    cache,
                    blocks,
                    slots,
                    sizes,
                    lock_memory=options.lock_memory,
                    slots_per_block=ds.index.arrays["block_counts"],
                )
                stack.callback(retainer.close)
            prefetch = share = None
            if options.policy != "none":
                prefetch = stack.enter_context(
                    contextlib.closing(PrefetchListener(cache.prefetch, ds.n_blocks))
                ).address
            if cache.shares:
                share = stack.enter_context(contextlib.closing(ShareServer(cache.share, ds.n_blocks))).address
            view = MountView(
                ds.reading_through(retainer if retainer is not None else cache),
                cache,
                options,
                given,
                mountpoint=mountpoint,
                plan=plan,
                retainer=retainer,
                prefetch_address=prefetch,
                share_address=share,
            )
            stack.callback(view.close)
            if options.preload:
                preload(ds, cache, retainer, plan, on_progress)
            return view

        fs = make_adapter(route, options, build)
        stack.callback(fs.stopped.set)
        yield fs


def serve(
    dest: str | os.PathLike,
    mountpoint: str | os.PathLike,
    options: MountOptions,
    on_progress: Callable[[int, int], None] | None = None,
    on_plan: Callable[[dict[str, Any]], None] | None = None,
    on_ready: Callable[[], None] | None = None,
) -> None:
    """Mount ``dest`` at ``mountpoint`` and serve it until unmounted (or SIGINT/SIGTERM); blocks.

    ``on_progress(done, total)``: bytes read so far by ``options.preload``, before mounting.
    ``on_plan(report)``: the mount's plan, made once, before anything is read or mounted.
    ``on_ready()``: once the mount serves (when systemd is told READY=1)."""
    # Absolute paths: libfuse 3 changes the working directory to / once mounted.
    dest, mountpoint = absolute(dest), os.path.abspath(os.fspath(mountpoint))

    def ready() -> None:
        kept_copies.allow_syncs()
        if on_ready is not None:
            on_ready()

    kept_copies.defer_syncs()  # the index copy kept for the next mount is written back once this one serves
    try:
        with assembled(dest, mountpoint, options, on_progress, on_plan=on_plan) as fs:
            watcher = threading.Thread(target=_when_serving, args=(fs, mountpoint, ready), daemon=True)
            watcher.start()
            try:
                fs.run(mountpoint, mount_source(dest))
            finally:
                fs.stopped.set()
                watcher.join()
    finally:
        kept_copies.allow_syncs()
    notify("STOPPING=1")
    log.info("unmounted %s", mountpoint)


def _when_serving(fs: Adapter, mountpoint: str, on_ready: Callable[[], None] | None = None) -> None:
    """Once the mount answers: READY=1 to systemd (Type=notify), and ``on_ready()``.

    "Answers" is the kernel's INIT answered (``fs.served``) and the mount in the mount table, never a
    ``stat`` of the mount point: that would be a request to this very process, and a server killed while
    one of its own requests is in flight cannot exit (the kernel waits for the answer uninterruptibly, and
    the device closes only when every thread is gone), so the mount hangs until aborted."""
    while not fs.stopped.wait(0.01):
        if fs.served and is_mounted(mountpoint):
            notify(f"READY=1\nSTATUS=serving {mountpoint}")
            if on_ready is not None:
                on_ready()
            return
