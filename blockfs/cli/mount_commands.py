"""The commands around a mount: ``plan``, ``mount``, ``umount`` and ``stats``.  The memory budget is
decided here, once, from the options or the machine, so ``plan`` and ``mount`` print and use the same one."""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import signal
import sys
import time
from typing import Any

from ..serve.mount_options import MountOptions
from ..sizes import parse_size
from ..storage.urls import absolute, is_remote, redact
from .dataset_args import open_from_args, storage_options
from .mount_flags import flag_value, mount_options
from .output import human, log_level, plural, progress_bar

log = logging.getLogger("blockfs")


AUTO_CACHE_FRACTION = 0.5  # --cache-size auto: this share of MemAvailable


def _cache_size(text: str) -> tuple[int, str]:
    """(bytes, how they were chosen) for --cache-size."""
    if text == "auto":
        from ..serve.cache.budget import read_mem_available

        available = read_mem_available()
        return int(AUTO_CACHE_FRACTION * available), f"auto: {AUTO_CACHE_FRACTION:.0%} of {human(available)} available"
    return parse_size(text), "given"


def _budget(args: argparse.Namespace) -> tuple[int, str]:
    """(bytes, how they were chosen) from --memory-fraction or --cache-size."""
    if getattr(args, "budget_bytes", None) is not None:
        return args.budget_bytes, "chosen by the command that started this server"
    if getattr(args, "memory_fraction", None) is not None:
        from ..serve.cache.budget import budget_from_memory_fraction, read_mem_available

        size = budget_from_memory_fraction(args.memory_fraction)
        return size, f"{args.memory_fraction:g} of {human(read_mem_available())} available"
    return _cache_size(args.cache_size)


def _mount_plan(args: argparse.Namespace, size: int, ds) -> Any:
    """The plan ``blockfs plan`` prints, made as a mount's server makes it (blockfs.serve.cache.mount_plan)."""
    from ..serve.cache.mount_plan import make_mount_plan

    return make_mount_plan(
        ds,
        size,
        strategy=args.retain_strategy,
        threshold=flag_value(args, "retain_threshold"),
        retain=args.retain,
        policy=getattr(args, "policy", "cache-once"),
        nodes=args.nodes,
        partition_seed=args.partition_seed,
    )


def _warnings(size: int, why: str, plan, disk: dict | None, policy: str) -> list[str]:
    """One line per budget that will not do what it seems to (``plan`` prints them, ``mount`` warns):
    more than the memory available, a block cache or a disk tier smaller than one block.  What happens,
    and the fix."""
    from ..serve.cache.budget import read_mem_available

    said = []
    if why == "given":  # auto and --memory-fraction are shares of what is available
        try:
            available = read_mem_available()
        except OSError:
            available = None
        if available is not None and size > available:
            said.append(
                f"--cache-size {human(size)} is more than the {human(available)} of memory available now: as the "
                "cache fills, the machine will swap or kill a process for memory (the mount, or your training); "
                f"give --cache-size auto (half of what is available) or at most {human(available)}"
            )
    if policy != "none" and not plan.fits and 0 < size < plan.block_bytes:  # 0: no memory cache, as asked
        said.append(
            f"--cache-size {human(size)} is smaller than one block ({human(plan.block_bytes)}): no block can be "
            "cached, so every file is read from storage alone, one request per file"
            + (
                f" (from the 2nd epoch, the {plan.retained_files:,} retained files excepted)"
                if plan.retained_files
                else ""
            )
            + f"; give --cache-size of at least {human(plan.block_bytes)}, or pack with a smaller --block-size"
        )
    if disk is not None and disk["budget_bytes"] < disk["one_block_bytes"]:
        said.append(
            f"--disk-cache-size {human(disk['budget_bytes'])} is smaller than one block "
            f"({human(disk['one_block_bytes'])}): the disk tier at {disk['directory']} will hold nothing; give at "
            "least one block's size, or leave --disk-cache-size out (auto: half the free space there)"
        )
    return said


def _plan_of(report: dict[str, Any]) -> Any:
    from ..serve.cache.memory_plan import MemoryPlan

    return MemoryPlan.from_dict(report["plan"])


def _describe(report: dict[str, Any], nodes: str = "") -> str:
    """A plan report (:meth:`blockfs.serve.cache.mount_plan.MountPlan.report`) for people."""
    from ..serve.cache.memory_plan import MemoryPlan, describe_disk_tier

    text = MemoryPlan.from_dict(report["plan"]).describe()
    return text + ("\n" + describe_disk_tier(report["disk_tier"]) if report["remote"] else "") + nodes


def _check_nodes(args: argparse.Namespace) -> None:
    if args.nodes < 1 or not 0 <= args.node_rank < args.nodes:
        raise ValueError(f"--node-rank {args.node_rank} is not one of --nodes {args.nodes} (0 to {args.nodes - 1})")


def _node_lines(args: argparse.Namespace, size: int, report: dict[str, Any]) -> str:
    """With --nodes N: each node's part, and the hit rate a node's budget gives on its own part."""
    nodes = report.get("nodes")
    if not nodes:
        return ""
    parts = nodes["part_bytes"]
    rates = [min(1.0, size / p) if p else 1.0 for p in parts]
    return (
        f"\nnodes:            {nodes['nodes']} (partition='node', seed {nodes['partition_seed']}): each node's part "
        f"{human(min(parts))} to {human(max(parts))}; this budget keeps {min(rates):.1%} to {max(rates):.1%} of a part"
        f"\nexpected hits per epoch on a node (from the 2nd): {rates[args.node_rank]:.1%} of node "
        f"{args.node_rank}'s bytes (partition='global': {min(1.0, size / max(1, sum(parts))):.1%})"
    )


def _peer_lines(args: argparse.Namespace, report: dict[str, Any]) -> str:
    """With --peers (or $BLOCKFS_PEERS): what the nodes' memory holds together, and what the store serves."""
    text = getattr(args, "peers", None) or os.environ.get("BLOCKFS_PEERS")
    if not text:
        return ""
    n = len([a for a in text.split(",") if a.strip()])
    dataset = int(report["dataset"]["file_bytes"])
    plan = _plan_of(report)
    per_node = 0 if plan.per_file_requests else plan.block_cache_bytes  # blocks are shared; retained files not
    held = min(dataset, n * per_node)
    return (
        f"\npeers:            {n} nodes hold {human(held)} of the dataset's {human(dataset)} in memory together "
        f"({held / max(1, dataset):.0%}); the store serves about {human(dataset)} in epoch 1 (each block once "
        f"for the cluster) and {human(dataset - held)} per epoch after"
    )


def cmd_plan(args: argparse.Namespace) -> int:
    _check_nodes(args)
    size, why = _budget(args)
    with open_from_args(args, remembered=True) as ds:
        report = _mount_plan(args, size, ds).report()
    plan = _plan_of(report)
    warnings = _warnings(size, why, plan, report["disk_tier"], getattr(args, "policy", "cache-once"))
    if args.json:
        print(
            json.dumps(
                report["plan"] | {"budget_from": why, "disk_tier": report["disk_tier"], "warnings": warnings}, indent=2
            )
        )
    else:
        print(f"budget from:      {why}")
        print(_describe(report, _node_lines(args, size, report) + _peer_lines(args, report)))
        for line in warnings:
            print(f"warning: {line}")
    return 0


def _print_plan(args: argparse.Namespace, size: int, why: str, report: dict[str, Any]) -> None:
    """What ``blockfs mount`` says of the plan its server made and reported: the plan (unless -q), and a
    warning line for each budget that will not do what it seems to (even with -q)."""
    plan = _plan_of(report)
    if not args.quiet:
        print(_plan_line(report["dataset"], size, why, args.policy, plan.n_files), flush=True)
        if args.policy != "none":
            print(_describe(report, _node_lines(args, size, report)), flush=True)
    for line in _warnings(size, why, plan, report["disk_tier"], args.policy):
        log.warning("%s", line)


def _plan_line(meta: dict, size: int, why: str, policy: str, distinct: int | None = None) -> str:
    """The mount's one-line plan.  ``distinct``: the files the plan counts (hard links once), said beside
    the paths when they differ, so this line and the plan's table below agree."""
    dataset, files = int(meta["file_bytes"]), int(meta["n_files"])
    counted = f"{files:,} files" + (
        f" ({distinct:,} distinct: hard links share one)" if distinct is not None and distinct != files else ""
    )
    head = (
        f"memory plan: cache {human(size)} ({why}), policy {policy}; dataset {human(dataset)} in "
        f"{counted}, {plural(int(meta['n_blocks']), 'block')}: "
    )
    if policy == "none":
        return head + "no caching, every read goes to storage"
    if dataset <= size:
        return head + "fits, every block stays in memory after its first read"
    return head + f"about {size / dataset:.0%} of it stays in memory (the hit rate to expect from the 2nd epoch)"


def _secret_free(argv: list[str], dest: str) -> list[str]:
    """``argv`` without its ``--storage-option`` values (argparse's abbreviations included) and with the
    dataset's URL redacted: what a serving process may show in ``/proc/PID/cmdline`` to every user."""
    out, skip, options = [], False, True
    for token in argv:
        if skip:
            skip = False
            continue
        if options and token == "--":
            options = False
        name = token.partition("=")[0]
        if options and len(name) > 2 and name.startswith("--") and "--storage-option".startswith(name):
            skip = "=" not in token  # the value is the next token
            continue
        out.append(redact(token) if token == dest and is_remote(dest) else token)
    return out


def _handoff(args: argparse.Namespace) -> bytes:
    """What a serving process gets through a pipe instead of its command line: the storage options and the
    dataset's URL as given (it may carry a user and a token)."""
    return json.dumps({"storage_option": list(args.storage_option or []), "dest": args.dest}).encode()


def _take_handoff(args: argparse.Namespace) -> None:
    """In a serving process: put back what :func:`_handoff` sent through ``--handoff-fd``."""
    from ..serve.daemon import read_handoff

    given = json.loads(read_handoff(args.handoff_fd))
    args.storage_option, args.dest, args.handoff_fd = given["storage_option"], given["dest"], None


def cmd_mount(args: argparse.Namespace) -> int:
    from ..serve import daemon as mnt
    from ..serve import mount_files

    if args.handoff_fd is not None:
        _take_handoff(args)
    # Absolute before anything: libfuse 3 changes the working directory to / once mounted.
    args.dest, args.mountpoint = absolute(args.dest), os.path.abspath(args.mountpoint)
    mnt.check_mountpoint(args.mountpoint)
    if os.path.islink(args.mountpoint):
        # The mount table names the link's target, never the link: waited for by the link's name, the mount
        # would never be seen to serve (its server never says 'ready', and 'blockfs mount' waits forever).
        args.mountpoint = os.path.realpath(args.mountpoint)
        mnt.check_mountpoint(args.mountpoint)
    _check_nodes(args)
    size, why = _budget(args)
    # A remote dataset's metadata and index are fetched once: here, into the disk tier or into a directory
    # named after the mount point and handed to the serving process (which removes it; 'blockfs umount'
    # does when that process was killed).  A local dataset is opened by the server alone, which makes the
    # plan once and reports it here to be printed.
    fetched = None
    if is_remote(args.dest) and not args.disk_cache and not args.fetched_dir:
        mount_files.remove_fetched(args.mountpoint)  # left by a killed server of an earlier mount here
        fetched = mount_files.fetched_directory(args.mountpoint)
        if args.foreground:
            args.fetched_dir = fetched  # this process serves: it removes it when it ends
    try:
        if is_remote(args.dest) and not args.foreground:
            with open_from_args(args, keep_fetched_in=fetched):
                pass
        if args.foreground:
            return _serve_here(args, size, why)
        log_path = os.path.abspath(args.log) if args.log else mount_files.default_log_path(args.mountpoint)
        # The serving process gets the user's own command line: every option is declared once, in the parser.
        # Only what this process decided is added: the budget (MemAvailable changes) and the log file.
        # Secrets (storage options, a URL's user and token) go through a pipe, never the command line.
        argv = _secret_free(args.argv, args.dest)
        end = argv.index("--") if "--" in argv else len(argv)  # what follows "--" is positionals only
        added = ["--foreground", "--budget-bytes", str(size)] + ([] if args.log else ["--log", log_path])
        added += ["--fetched-dir", fetched] if fetched else []
        command = [sys.executable, "-m", "blockfs", *argv[:end], *added, *argv[end:]]
        # Waited for until the server says it serves, or dies: however long a large dataset takes (a preload
        # too: it logs its progress), unless --timeout is given.
        timeout = args.timeout
        on_report = lambda raw: _print_plan(args, size, why, json.loads(raw))  # noqa: E731
        try:
            pid = mnt.start_background(
                command,
                args.mountpoint,
                log_path,
                timeout=timeout,
                handoff=_handoff(args),
                on_report=on_report,
                stop_on=STOP_SIGNALS,
            )
        except KeyboardInterrupt as e:  # start_background stopped its server and unmounted what it left
            left = mnt.is_mounted(args.mountpoint)
            raise mnt.Stopped(
                getattr(e, "signum", signal.SIGINT),
                f"the serving process it started was stopped; {args.mountpoint} is still mounted: run "
                f"'{_program()} umount {args.mountpoint}'"
                if left
                else f"the serving process it started was stopped, nothing is mounted at {args.mountpoint}",
            ) from None
    except BaseException:
        if fetched:
            shutil.rmtree(fetched, ignore_errors=True)
        raise
    if not args.quiet:
        shown = redact(args.dest) if is_remote(args.dest) else args.dest
        print(
            f"mounted {shown} at {args.mountpoint} (pid {pid}, log {log_path}); "
            f"stop with: {_program()} umount {args.mountpoint}"
        )
    return 0


# While mount waits for its server, these stop the wait as Ctrl-C does, the server stopped on the way out:
# SIGTERM's and SIGHUP's default (to die at once) would leave a half-started server, maybe mounted.
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


def _mount_options(args: argparse.Namespace, size: int) -> MountOptions:
    """The parsed ``mount`` command line as :class:`~blockfs.serve.mount_options.MountOptions` (its flags made from
    the fields' declarations; the budget and the storage options worked out here)."""
    return mount_options(args, cache_bytes=size, storage=storage_options(args))


def _serve_here(args: argparse.Namespace, size: int, why: str) -> int:
    """Serve in this process until unmounted (``--foreground``).  The plan the server makes goes to the
    command that started it (``--report-fd``), or is printed here when a person started it."""
    from ..serve.daemon import Reports
    from ..serve.mount_files import open_log
    from ..serve.server import serve

    if args.log:
        stream = open(open_log(args.log), "a", encoding="utf-8", errors="backslashreplace")  # never via a link
        logging.basicConfig(
            handlers=[logging.StreamHandler(stream)],
            level=log_level(args),
            force=True,
            format="%(asctime)s blockfs[%(process)d]: %(levelname)s: %(message)s",
        )
    options = _mount_options(args, size)
    bar = progress_bar(1, "B", "preload") if args.preload else None

    def progress(done: int, total: int) -> None:
        if bar is not None:  # always: serve is given progress only with a bar
            bar.total = total
            bar.update(done - bar.n)

    on_plan = on_ready = None
    if args.report_fd is not None:  # a background mount's server: its parent prints the plan, then returns
        reports = Reports(args.report_fd)
        on_plan = lambda report: reports.report(json.dumps(report).encode())  # noqa: E731
        on_ready = reports.ready
    elif args.budget_bytes is None:
        on_plan = lambda report: _print_plan(args, size, why, report)  # noqa: E731
    serve(args.dest, args.mountpoint, options, progress if bar else None, on_plan=on_plan, on_ready=on_ready)
    if bar:
        bar.close()
    _drop_clean_default_log(args)
    return 0


def _drop_clean_default_log(args: argparse.Namespace) -> None:
    """After a clean unmount, remove a background mount's default log (in the temp directory) when it holds
    no warning, error or traceback: the logs of many mount points do not pile up there, and a log with
    something to read stays."""
    from ..serve.mount_files import default_log_path

    if not args.log or os.path.abspath(args.log) != default_log_path(args.mountpoint):
        return  # a log the user named is theirs
    try:
        with open(args.log, "rb") as f:
            text = f.read()
        if not any(word in text for word in (b" WARNING: ", b" ERROR: ", b" CRITICAL: ", b"Traceback", b"error:")):
            os.unlink(args.log)
    except OSError:
        pass


def cmd_umount(args: argparse.Namespace) -> int:
    from ..serve.daemon import mount_point, unmount
    from ..serve.mount_files import canonical

    point = mount_point(args.mountpoint)  # a symbolic link: the blockfs mount it leads to, said as such
    shown = point if point == canonical(args.mountpoint) else f"{point} (linked as {args.mountpoint})"
    if unmount(point):
        print(
            f"unmounted {shown} lazily: its serving process did not answer, so the mount is detached "
            "and goes once nothing uses it"
        )
    else:
        print(f"unmounted {shown}")
    return 0


def _paths_note(checked: str | dict) -> str:
    """A first mount's paths still checked as used (core/directory_checks.py): how far, and any refused."""
    if not isinstance(checked, dict):
        return ""
    passed, refused = checked["directories_passed"], checked["directories_refused"]
    note = f"; paths checked so far in {passed:,} {'directory' if passed == 1 else 'directories'}"
    return note + (f", {refused:,} refused (their entries answer EIO: see the log)" if refused else "")


def _stats_text(s: dict, previous: dict | None, seconds: float) -> str:
    m, d, c, k = s["mount"], s["dataset"], s["cache"], s["counters"]
    lines = [
        f"mount      {m['dest']} at {m['mountpoint']} (pid {m['pid']}, {_route(m)}, "
        f"open {m['open_mode']}, up {s['uptime_s']:.0f} s)",
        f"dataset    {plural(d['files'], 'file')} ({human(d['file_bytes'])}) in {plural(d['blocks'], 'block')}; "
        f"{d.get('digest', '-')}"
        + ("" if d.get("digests", True) else " (checked against accidents only: no digests)")
        + _paths_note(d.get("paths_checked", "all")),
        f"cache      {c['policy']}: {human(c['used_bytes'])} of {human(c['budget_bytes'])} ({c['fill']:.1%}), "
        f"{plural(c['cached_blocks'], 'block')}; {c['admissions']:,} admitted, {c['refusals']:,} refused, "
        f"{c['evictions']:,} evicted; mlock: {c['mlock']}"
        + (
            f"\nwindow     {human(c['window']['held_bytes'])} of {human(c['window']['capacity_bytes'])} (other "
            f"nodes' blocks read whole, out of the budget), {plural(c['window']['blocks'], 'block')}; "
            f"{k.get('window_loads', 0):,} fetched, {k.get('window_ahead_loads', 0):,} of them ahead (announced)"
            if "window" in c
            else ""
        ),
        f"reads      {k['files_served']:,} files served, {human(k['bytes_served'])} in {k['reads']:,} reads through FUSE"
        + _shared_note(k.get("blocks_shared", 0))
        + (
            "; reads the kernel answers from pushed pages (below) reach no counter here"
            if (s.get("page_cache") or {}).get("files_pushed")
            else ""
        ),
        f"hits       files {k['file_hit_rate']:.1%} ({k['file_hits']:,} hit, {k['file_misses']:,} missed); "
        f"reads {k['block_hit_rate']:.1%} ({k['block_hits']:,} hit, {k['block_misses']:,} missed)",
        f"storage    {human(k['bytes_from_storage'])} read: {plural(k['block_loads'], 'whole block')} "
        f"({k['readahead_loads']:,} ahead), {k['file_reads']:,} files alone; {k['buffer_hits']:,} file-buffer hits",
        _epochs_line(s["epochs"], d["files"]),
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
        lines.append(
            f"remote     {remote['requests']:,} requests, {human(remote['bytes'])} fetched; "
            f"{remote['retries']:,} retried, {remote['failures']:,} failed"
        )
    tier = storage.get("disk_tier")
    if tier:
        lines.append(
            f"disk tier  {human(tier['used'])} of {human(tier['budget'])}, {plural(tier['blocks'], 'block')}; reads "
            f"{tier['disk_reads']:,} from disk ({human(tier['disk_bytes'])}), {tier['remote_reads']:,} from the "
            f"remote ({human(tier['remote_bytes'])}); {tier['copies_written']:,} copies written, "
            f"{tier['copies_dropped']:,} dropped after a failed check"
        )
    peers = storage.get("peers")
    if peers:
        by = ", ".join(
            f"{addr} {human(p['bytes'])}" + (" (avoided now)" if p["avoided"] else "")
            for addr, p in peers["by_peer"].items()
        )
        served = peers.get("served") or {}
        lines.append(
            f"peers      {human(peers['bytes'])} from peers ({by}); {served.get('ranges_served', 0):,} ranges "
            f"({human(served.get('bytes_served', 0))}) served to them, {served.get('refused', 0):,} requests "
            "refused"
        )
    if remote or peers:
        below = [f"disk {human(tier['disk_bytes'])}"] if tier else []
        below += [f"peers {human(peers['bytes'])}"] if peers else []
        lines.append(
            f"sources    memory answered {k['block_hits']:,} of {k['reads']:,} reads; below it: "
            + ", ".join([*below, f"the store {human(remote['bytes']) if remote else '0 B'}"])
        )
    pushed = s.get("page_cache")
    if pushed:
        lines.append(
            f"page cache {pushed['files_pushed']:,} files ({human(pushed['bytes_pushed'])}) pushed into the "
            f"kernel's page cache as their blocks loaded; {pushed['pushes_skipped']:,} skipped "
            "(the kernel had dropped the file)"
        )
    requests = s.get("requests") or {}
    if requests:
        top = sorted(requests.items(), key=lambda kv: -kv[1])[:6]
        lines.append(
            "requests   "
            + ", ".join(f"{n:,} {name}" for name, n in top)
            + (
                "; ioctl: the terminal check (isatty) programs make of each file they open — Python's "
                "open() makes one or more — answered at once, no data read"
                if "ioctl" in dict(top)
                else ""
            )
        )
    errors = s.get("errors", {})
    if errors.get("damaged_files_read"):
        lines.append(
            f"errors     {errors['damaged_files_read']:,} reads failed (EIO); damaged blocks "
            f"{errors['damaged_blocks_reported']}"
        )
    if errors.get("failed_reads"):
        lines.append(
            f"failed     {errors['failed_reads']:,} reads failed on I/O errors (EIO, retried by the "
            "next read; not damage)"
        )
    if previous is not None and seconds > 0:
        p = previous["counters"]
        files = (k["files_served"] - p["files_served"]) / seconds
        mbs = (k["bytes_served"] - p["bytes_served"]) / seconds / 1e6
        lines.append(f"rate       {files:,.0f} files/s, {mbs:,.1f} MB/s served")
    return "\n".join(lines)


def _route(m: dict) -> str:
    if m.get("binding") == "kernel":
        return "kernel protocol"
    return f"{m.get('binding')}/libfuse {m.get('libfuse')}"


def _shared_note(blocks: int) -> str:
    if not blocks:
        return ""
    return f"; {blocks:,} blocks mapped by BlockLoaders, whose reads of them skip FUSE and are not counted here"


def _epochs_line(epochs: list[dict], n_files: int, shown: int = 6) -> str:
    """The file hit rate of each pass over the dataset (an epoch: as many files served as it holds)."""
    if not epochs or not epochs[0]["files"]:
        return "epochs     no file read yet"
    first = max(1, len(epochs) - shown + 1)  # the statistics keep the last epochs only
    parts = []
    for number, e in enumerate(epochs[-shown:], start=first):
        done = e["files"] >= n_files
        parts.append(f"#{number} {e['hit_rate']:.1%}" + ("" if done else f" (so far: {e['files']:,} files)"))
    return f"epochs     files from memory, per pass over the {n_files:,} files: " + ", ".join(parts)


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
