"""The commands around a mount: ``plan``, ``mount``, ``umount`` and ``stats``.  The memory budget is
decided here, once, from the options or the machine, so ``plan`` and ``mount`` print and use the same one."""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import sys
import tempfile
import time

import numpy as np

from ..storage.location import absolute, is_remote
from .locations import open_from_args, storage_options
from ..serve.plan import parse_size
from .output import human, progress_bar


log = logging.getLogger("blockfs")


AUTO_CACHE_FRACTION = 0.5  # --cache-size auto: this share of MemAvailable


def _cache_size(text: str) -> tuple[int, str]:
    """(bytes, how they were chosen) for --cache-size."""
    if text == "auto":
        from ..serve.plan import read_mem_available

        available = read_mem_available()
        return int(AUTO_CACHE_FRACTION * available), f"auto: {AUTO_CACHE_FRACTION:.0%} of {human(available)} available"
    return parse_size(text), "given"


def _budget(args: argparse.Namespace) -> tuple[int, str]:
    """(bytes, how they were chosen) from --memory-fraction or --cache-size."""
    if getattr(args, "budget_bytes", None) is not None:
        return args.budget_bytes, "chosen by the command that started this server"
    if getattr(args, "memory_fraction", None) is not None:
        from ..serve.plan import budget_from_memory_fraction, read_mem_available

        size = budget_from_memory_fraction(args.memory_fraction)
        return size, f"{args.memory_fraction:g} of {human(read_mem_available())} available"
    return _cache_size(args.cache_size)


def _threshold(text: str | None) -> int | str | None:
    return None if text is None else ("auto" if text == "auto" else parse_size(text))


def _memory_plan(args: argparse.Namespace, size: int, ds):
    """The plan ``blockfs plan`` prints and the mount uses (the same function: blockfs.serve.retain.plan_dataset),
    and for a remote dataset the disk tier's part (None for a local one)."""
    from ..serve.plan import disk_tier_plan
    from ..serve.retain import plan_dataset

    plan, _files = plan_dataset(
        ds.index.arrays, size, strategy=args.retain_strategy, threshold=_threshold(args.retain_threshold),
        retain=not args.no_retain and getattr(args, "policy", "cache-once") != "none",
    )  # fmt: skip
    tier, disk = ds.disk_tier, None
    if tier is not None:
        disk = disk_tier_plan(plan, int(ds.metadata["block_bytes"]), tier.budget, tier.stats()["used"], tier.root)
    return plan, ds.is_remote, disk


def _describe(plan, remote: bool, disk: dict | None, nodes: str = "") -> str:
    from ..serve.plan import describe_disk_tier

    return plan.describe() + ("\n" + describe_disk_tier(disk) if remote else "") + nodes


def _check_nodes(args: argparse.Namespace) -> None:
    if args.nodes < 1 or not 0 <= args.node_rank < args.nodes:
        raise ValueError(f"--node-rank {args.node_rank} is not one of --nodes {args.nodes} (0 to {args.nodes - 1})")


def _node_lines(args: argparse.Namespace, size: int, ds) -> str:
    """With --nodes N: each node's part, and the hit rate a node's budget gives on its own part."""
    _check_nodes(args)
    if args.nodes <= 1:
        return ""
    from ..serve.server import node_part

    from ..core.index import KIND_FILE

    a = ds.index.arrays
    files = a["kind"] == KIND_FILE
    file_bytes = np.bincount(a["block"][files].astype(np.int64), weights=a["size"][files], minlength=ds.n_blocks)
    parts = [file_bytes[node_part(ds, args.nodes, k, args.partition_seed)].sum() for k in range(args.nodes)]
    rates = [min(1.0, size / p) if p else 1.0 for p in parts]
    return (
        f"\nnodes:            {args.nodes} (partition='node', seed {args.partition_seed}): each node's part "
        f"{human(min(parts))} to {human(max(parts))}; this budget keeps {min(rates):.1%} to {max(rates):.1%} of a part"
        f"\nexpected hits per epoch on a node (from the 2nd): {rates[args.node_rank]:.1%} of node "
        f"{args.node_rank}'s bytes (partition='global': {min(1.0, size / max(1, sum(parts))):.1%})"
    )


def cmd_plan(args: argparse.Namespace) -> int:
    size, why = _budget(args)
    with open_from_args(args) as ds:
        plan, remote, disk = _memory_plan(args, size, ds)
        nodes = _node_lines(args, size, ds)
    if args.json:
        print(json.dumps(plan.to_dict() | {"budget_from": why, "disk_tier": disk}, indent=2))
    else:
        print(f"budget from:      {why}")
        print(_describe(plan, remote, disk, nodes))
    return 0


def _plan_line(meta: dict, size: int, why: str, policy: str) -> str:
    dataset = int(meta["file_bytes"])
    head = (f"memory plan: cache {human(size)} ({why}), policy {policy}; dataset {human(dataset)} in "
            f"{int(meta['n_files']):,} files, {int(meta['n_blocks']):,} blocks: ")
    if policy == "none":
        return head + "no caching, every read goes to storage"
    if dataset <= size:
        return head + "fits, every block stays in memory after its first read"
    return head + f"about {size / dataset:.0%} of it stays in memory (the hit rate to expect from the 2nd epoch)"


def cmd_mount(args: argparse.Namespace) -> int:
    from ..serve import process as mnt

    # Absolute before anything: libfuse 3 changes the working directory to / once mounted.
    args.dest, args.mountpoint = absolute(args.dest), os.path.abspath(args.mountpoint)
    mnt.check_mountpoint(args.mountpoint)
    _check_nodes(args)
    size, why = _budget(args)
    # A remote dataset's metadata and index are fetched once: here, into the disk tier or into a directory
    # handed to the serving process (which removes it).
    fetched = None
    if is_remote(args.dest) and not args.foreground and not args.disk_cache:
        fetched = tempfile.mkdtemp(prefix="blockfs-fetched-")
    try:
        with open_from_args(args, keep_fetched_in=fetched or args.fetched_dir) as ds:  # serving removes it
            print(_plan_line(ds.metadata, size, why, args.policy), flush=True)
            if args.policy != "none":
                print(_describe(*_memory_plan(args, size, ds), _node_lines(args, size, ds)), flush=True)
        if args.foreground:
            return _serve_here(args, size)
        log_path = os.path.abspath(args.log) if args.log else mnt.default_log_path(args.mountpoint)
        # The serving process gets the user's own command line: every option is declared once, in the parser.
        # Only what this process decided is added: the budget (MemAvailable changes) and the log file.
        command = [sys.executable, "-m", "blockfs", *args.argv, "--foreground", "--budget-bytes", str(size)]
        command += [] if args.log else ["--log", log_path]
        command += ["--fetched-dir", fetched] if fetched else []
        # A preload reads before mounting: wait for it as long as the server lives (it logs its progress).
        timeout = args.timeout if not args.preload else max(args.timeout, 86400.0)
        pid = mnt.start_background(command, args.mountpoint, log_path, timeout=timeout)
    except BaseException:
        if fetched:
            shutil.rmtree(fetched, ignore_errors=True)
        raise
    print(f"mounted {args.dest} at {args.mountpoint} (pid {pid}, log {log_path}); "
          f"stop with: {_program()} umount {args.mountpoint}")  # fmt: skip
    return 0


def _mount_options(args: argparse.Namespace, size: int):
    """The parsed ``mount`` command line as :class:`~blockfs.serve.server.MountOptions`."""
    from ..serve.server import MountOptions

    return MountOptions(
        cache_bytes=size,
        policy=args.policy,
        allow_other=args.allow_other,
        fuse_options=tuple(args.o or ()),
        threads=not args.single_threaded,
        open_mode=args.open_mode,
        readahead=args.readahead,
        prefill=not args.no_prefill,
        lock_memory=not args.no_mlock,
        share=not args.no_share,
        retain=not args.no_retain,
        retain_strategy=args.retain_strategy,
        retain_threshold=_threshold(args.retain_threshold),
        preload=args.preload,
        storage=storage_options(args),
        nodes=args.nodes,
        node_rank=args.node_rank,
        partition_seed=args.partition_seed,
        expect=args.expect,
    )


def _serve_here(args: argparse.Namespace, size: int) -> int:
    """Serve in this process until unmounted (``--foreground``)."""
    from ..serve.server import serve

    if args.log:
        logging.basicConfig(
            filename=args.log, level=logging.DEBUG if args.verbose else logging.INFO, force=True,
            format="%(asctime)s blockfs[%(process)d]: %(levelname)s: %(message)s",
        )  # fmt: skip
    options = _mount_options(args, size)
    bar = progress_bar(1, "B", "preload") if args.preload else None

    def progress(done: int, total: int) -> None:
        bar.total = total
        bar.update(done - bar.n)

    serve(args.dest, args.mountpoint, options, progress if bar else None)
    if bar:
        bar.close()
    return 0


def cmd_umount(args: argparse.Namespace) -> int:
    from ..serve.process import unmount

    unmount(args.mountpoint)
    print(f"unmounted {args.mountpoint}")
    return 0


def _stats_text(s: dict, previous: dict | None, seconds: float) -> str:
    m, d, c, k = s["mount"], s["dataset"], s["cache"], s["counters"]
    lines = [
        f"mount      {m['dest']} at {m['mountpoint']} (pid {m['pid']}, {m['binding']}/libfuse {m['libfuse']}, "
        f"open {m['open_mode']}, up {s['uptime_s']:.0f} s)",
        f"dataset    {d['files']:,} files ({human(d['file_bytes'])}) in {d['blocks']:,} blocks; "
        f"{d.get('digest', '-')}" + ("" if d.get("digests", True) else " (checked against accidents only: no digests)"),
        f"cache      {c['policy']}: {human(c['used_bytes'])} of {human(c['budget_bytes'])} ({c['fill']:.1%}), "
        f"{c['cached_blocks']:,} blocks; {c['admissions']:,} admitted, {c['refusals']:,} refused, "
        f"{c['evictions']:,} evicted; mlock: {c['mlock']}",
        f"reads      {k['reads']:,} reads, {k['files_served']:,} files served, {human(k['bytes_served'])}; "
        f"{k.get('blocks_shared', 0):,} blocks shared with loaders (their files are not counted here)",
        f"hits       files {k['file_hit_rate']:.1%} ({k['file_hits']:,} hit, {k['file_misses']:,} missed); "
        f"reads {k['block_hit_rate']:.1%} ({k['block_hits']:,} hit, {k['block_misses']:,} missed)",
        f"storage    {human(k['bytes_from_storage'])} read: {k['block_loads']:,} whole blocks "
        f"({k['readahead_loads']:,} ahead), {k['file_reads']:,} files alone; {k['buffer_hits']:,} file-buffer hits",
        "epochs     " + ("  ".join(f"{e['hit_rate']:.1%} of {e['files']:,}" for e in s["epochs"][-8:]) or "-"),
    ]
    r = s.get("retained")
    if r:
        lines.append(
            f"retained   {r['retained_files']:,} of {r['target_files']:,} target files, {human(r['retained_bytes'])} "
            f"of {human(r['target_bytes'])}; {r['retained_hits']:,} hits, "
            f"{human(r['storage_bytes_avoided'])} not read again; mlock: {r['mlock']}"
        )
    storage = s.get("storage") or {}
    remote = storage.get("remote")
    if remote:
        lines.append(f"remote     {remote['requests']:,} requests, {human(remote['bytes'])} fetched; "
                     f"{remote['retries']:,} retried, {remote['failures']:,} failed")  # fmt: skip
    tier = storage.get("disk_tier")
    if tier:
        lines.append(
            f"disk tier  {human(tier['used'])} of {human(tier['budget'])}, {tier['blocks']:,} blocks; reads "
            f"{tier['disk_reads']:,} from disk ({human(tier['disk_bytes'])}), {tier['remote_reads']:,} from the "
            f"remote ({human(tier['remote_bytes'])}); {tier['copies_written']:,} copies written, "
            f"{tier['copies_dropped']:,} dropped after a failed check"
        )
    errors = s.get("errors", {})
    if errors.get("damaged_files_read"):
        lines.append(f"errors     {errors['damaged_files_read']:,} reads failed (EIO); damaged blocks "
                     f"{errors['damaged_blocks_reported']}")  # fmt: skip
    if errors.get("failed_reads"):
        lines.append(f"failed     {errors['failed_reads']:,} reads failed on I/O errors (EIO, retried by the "
                     "next read; not damage)")  # fmt: skip
    if previous is not None and seconds > 0:
        p = previous["counters"]
        files = (k["files_served"] - p["files_served"]) / seconds
        mbs = (k["bytes_served"] - p["bytes_served"]) / seconds / 1e6
        lines.append(f"rate       {files:,.0f} files/s, {mbs:,.1f} MB/s served")
    return "\n".join(lines)


def cmd_stats(args: argparse.Namespace) -> int:
    from ..client import read_stats

    previous, last = None, time.monotonic()
    while True:
        s = read_stats(args.mountpoint)
        now = time.monotonic()
        if args.json:
            print(json.dumps(s, indent=None if args.watch else 2), flush=True)
        else:
            if args.watch and sys.stdout.isatty():
                print("\033[H\033[2J", end="")
            print(_stats_text(s, previous, now - last), flush=True)
        if not args.watch:
            return 0
        previous, last = s, now
        time.sleep(args.interval)




def _program() -> str:
    """How the user ran blockfs, for a command to copy: ``.venv/bin/blockfs`` when not activated."""
    argv0 = sys.argv[0] if sys.argv and sys.argv[0] else "blockfs"
    if os.path.basename(argv0) == "blockfs" and os.path.dirname(argv0) and not shutil.which("blockfs"):
        return argv0
    return "blockfs"
