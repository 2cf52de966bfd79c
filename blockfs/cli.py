"""The ``blockfs`` command.  The only module that prints, exits or configures logging."""

from __future__ import annotations

import argparse
import json
import logging
import os
import select
import stat
import sys
import time
from typing import Sequence

from . import __version__
from .core.dataset import PackedDataset, open_dataset
from .errors import BlockfsError
from .core.index import KIND_DIR, KIND_SYMLINK
from .packing.options import ORDERS
from .packing.packer import PackOptions, pack
from .serve.plan import parse_size
from .serve.server import OPEN_MODES

log = logging.getLogger("blockfs")


def _progress_bar(total: int | None, unit: str, desc: str):
    """A tqdm bar on a terminal (a counter when ``total`` is None); None (quiet) when stderr is not one."""
    if not sys.stderr.isatty():
        return None
    from tqdm import tqdm

    divisor = 1024 if unit == "B" else 1000
    return tqdm(total=total, unit=unit, unit_scale=True, unit_divisor=divisor, desc=desc, dynamic_ncols=True)


def cmd_pack(args: argparse.Namespace) -> int:
    options = PackOptions(
        block_size=parse_size(args.block_size),
        files_per_block=args.files_per_block,
        labels=args.labels,
        order=args.order,
        seed=args.seed,
        workers=args.workers,
        force=args.force,
        follow_symlinks=args.follow_symlinks,
        skip_unreadable=args.skip_unreadable,
        skip_damaged=args.skip_damaged,
        fsync=not args.no_fsync,
    )
    src = args.src[0] if len(args.src) == 1 else args.src  # several: WebDataset shards
    bar = listed = None

    def listing(n: int) -> None:  # a million-file tree takes seconds to list: show that it is moving
        nonlocal listed
        if listed is None:
            listed = _progress_bar(None, " entries", "list")
        listed.update(n - listed.n)

    def progress(files: int, nbytes: int, total_files: int, total_bytes: int) -> None:
        nonlocal bar
        if listed is not None:
            listed.close()
        if bar is None:
            bar = _progress_bar(total_bytes, "B", "pack")
        bar.set_postfix(files=f"{files}/{total_files}", refresh=False)
        bar.update(nbytes - bar.n)

    tty = sys.stderr.isatty()
    try:
        result = pack(src, args.dest, options, progress=progress if tty else None, listing=listing if tty else None)
    finally:
        for shown in (listed, bar):
            if shown is not None:
                shown.close()
    rate = result.file_bytes / max(result.seconds, 1e-9) / 1e6
    print(
        f"packed {result.n_files} files ({_human(result.file_bytes)}), {result.n_dirs} directories, "
        f"{result.n_symlinks} symlinks into {result.n_blocks} blocks at {args.dest} "
        f"in {result.seconds:.1f} s ({result.n_files / max(result.seconds, 1e-9):,.0f} files/s, {rate:,.0f} MB/s)"
    )
    return 0


def cmd_info(args: argparse.Namespace) -> int:
    from .core.verify import summary

    with open_dataset(args.dest) as ds:
        info = summary(ds)
    if args.json:
        print(json.dumps(info, indent=2))
        return 0
    print(f"dataset      {info['path']}")
    print(f"files        {info['files']:,} ({_human(info['file_bytes'])}), {info['directories']:,} directories, {info['symlinks']:,} symlinks")
    print(f"blocks       {info['blocks']:,} ({_human(info['block_bytes'])}); size min/median/max "
          f"{_human(info['block_size_min'])} / {_human(info['block_size_median'])} / {_human(info['block_size_max'])}; "
          f"median {info['files_per_block_median']:,} files per block")
    print(f"headers      {_human(info['header_bytes'])} ({info['header_bytes'] / max(info['files'], 1):.1f} bytes per file)")
    p = info["pack"]
    print(f"packed with  block size {_human(p['block_size'])}, order {p['order']}, seed {p['seed']}, labels {p['labels']}")
    labels = info["labels"]
    print(f"labels       {len(labels)} distinct")
    for name, count in list(labels.items())[:20]:
        print(f"  {count:>10,}  {name}")
    if len(labels) > 20:
        print(f"  ... and {len(labels) - 20} more (--json lists all)")
    return 0


def cmd_verify(args: argparse.Namespace) -> int:
    from .core.verify import verify

    with open_dataset(args.dest) as ds:
        bar = _progress_bar(ds.n_blocks, "block", "verify")
        problems = verify(ds, on_block=(lambda b: bar.update(1)) if bar else None)
        if bar:
            bar.close()
        n_blocks = ds.n_blocks
    for p in problems:
        print(f"BAD {p.what}: {p.message}")
        for f in p.files[:10]:
            print(f"    {f}")
        if len(p.files) > 10:
            print(f"    ... and {len(p.files) - 10} more files")
    if problems:
        print(f"{len(problems)} problems in {args.dest}")
        return 1
    print(f"ok: {n_blocks} blocks and the index verified in {args.dest}")
    return 0


def _printable(name: bytes) -> str:
    """A name as a terminal can show it: bytes that are not UTF-8 and control characters escaped."""
    text = name.decode("utf-8", "backslashreplace")
    return text.encode("unicode_escape").decode("ascii") if not text.isprintable() else text


def _ls_line(ds: PackedDataset, e: int, name: bytes) -> str:
    st = ds.stat_entry(e)
    when = time.strftime("%Y-%m-%d %H:%M", time.localtime(st.mtime_ns / 1e9))
    line = f"{stat.filemode(st.mode)} {st.nlink:>3} {st.size:>12} {when} {_printable(name)}"
    if st.kind == KIND_SYMLINK:
        line += f" -> {_printable(ds.index.link_target(e))}"
    return line


def cmd_ls(args: argparse.Namespace) -> int:
    with open_dataset(args.dest) as ds:
        e = ds.lookup(args.path)
        if ds.index.kind(e) != KIND_DIR:
            print(_ls_line(ds, e, os.fsencode(args.path)))
            return 0
        for child in ds.index.children(e):
            print(_ls_line(ds, child, ds.path_of(child).rpartition(b"/")[2]))
    return 0


def cmd_cat(args: argparse.Namespace) -> int:
    with open_dataset(args.dest) as ds:
        e = ds.lookup(args.path)
        out = sys.stdout.buffer
        for piece in ds.read_pieces(e):
            out.write(piece)
        out.flush()
    return 0


def cmd_unpack(args: argparse.Namespace) -> int:
    from .core.unpack import unpack

    with open_dataset(args.dest) as ds:
        bar = _progress_bar(ds.index.n_entries - 1, "entry", "unpack")
        n = unpack(ds, args.out, on_file=(lambda e: bar.update(1)) if bar else None)
        if bar:
            bar.close()
    print(f"unpacked {n} entries into {args.out}")
    return 0


# --- mount, umount, stats ---------------------------------------------------------------------------
AUTO_CACHE_FRACTION = 0.5  # --cache-size auto: this share of MemAvailable


def _cache_size(text: str) -> tuple[int, str]:
    """(bytes, how they were chosen) for --cache-size."""
    if text == "auto":
        from .serve.plan import read_mem_available

        available = read_mem_available()
        return int(AUTO_CACHE_FRACTION * available), f"auto: {AUTO_CACHE_FRACTION:.0%} of {_human(available)} available"
    return parse_size(text), "given"


def _budget(args: argparse.Namespace) -> tuple[int, str]:
    """(bytes, how they were chosen) from --memory-fraction or --cache-size."""
    if getattr(args, "budget_bytes", None) is not None:
        return args.budget_bytes, "chosen by the command that started this server"
    if getattr(args, "memory_fraction", None) is not None:
        from .serve.plan import budget_from_memory_fraction, read_mem_available

        size = budget_from_memory_fraction(args.memory_fraction)
        return size, f"{args.memory_fraction:g} of {_human(read_mem_available())} available"
    return _cache_size(args.cache_size)


def _threshold(text: str | None) -> int | str | None:
    return None if text is None else ("auto" if text == "auto" else parse_size(text))


def _memory_plan(args: argparse.Namespace, size: int):
    """The plan ``blockfs plan`` prints and the mount uses (the same function: blockfs.serve.retain.plan_dataset)."""
    from .serve.retain import plan_dataset

    with open_dataset(args.dest) as ds:
        plan, _files = plan_dataset(
            ds.index.arrays, size, strategy=args.retain_strategy, threshold=_threshold(args.retain_threshold),
            retain=not args.no_retain and getattr(args, "policy", "cache-once") != "none",
        )  # fmt: skip
    return plan


def cmd_plan(args: argparse.Namespace) -> int:
    size, why = _budget(args)
    plan = _memory_plan(args, size)
    if args.json:
        print(json.dumps(plan.to_dict() | {"budget_from": why}, indent=2))
    else:
        print(f"budget from:      {why}")
        print(plan.describe())
    return 0


def _plan_line(meta: dict, size: int, why: str, policy: str) -> str:
    dataset = int(meta["file_bytes"])
    head = (f"memory plan: cache {_human(size)} ({why}), policy {policy}; dataset {_human(dataset)} in "
            f"{int(meta['n_files']):,} files, {int(meta['n_blocks']):,} blocks: ")
    if policy == "none":
        return head + "no caching, every read goes to storage"
    if dataset <= size:
        return head + "fits, every block stays in memory after its first read"
    return head + f"about {size / dataset:.0%} of it stays in memory (the hit rate to expect from the 2nd epoch)"


def cmd_mount(args: argparse.Namespace) -> int:
    from .serve import process as mnt

    # Absolute before anything: libfuse 3 changes the working directory to / once mounted.
    args.dest, args.mountpoint = os.path.abspath(args.dest), os.path.abspath(args.mountpoint)
    meta = mnt.check_dest(args.dest)
    mnt.check_mountpoint(args.mountpoint)
    size, why = _budget(args)
    print(_plan_line(meta, size, why, args.policy), flush=True)
    if args.policy != "none":
        print(_memory_plan(args, size).describe(), flush=True)
    if args.foreground:
        return _serve_here(args, size)
    log_path = os.path.abspath(args.log) if args.log else mnt.default_log_path(args.mountpoint)
    # The serving process gets the user's own command line: every option is declared once, in the parser.
    # Only what this process decided is added: the budget (MemAvailable changes) and the log file.
    command = [sys.executable, "-m", "blockfs", *args.argv, "--foreground", "--budget-bytes", str(size)]
    command += [] if args.log else ["--log", log_path]
    # A preload reads before mounting: wait for it as long as the server lives (it logs its progress).
    timeout = args.timeout if not args.preload else max(args.timeout, 86400.0)
    pid = mnt.start_background(command, args.mountpoint, log_path, timeout=timeout)
    print(f"mounted {args.dest} at {args.mountpoint} (pid {pid}, log {log_path}); "
          f"stop with: blockfs umount {args.mountpoint}")  # fmt: skip
    return 0


def _mount_options(args: argparse.Namespace, size: int):
    """The parsed ``mount`` command line as :class:`~blockfs.serve.server.MountOptions`."""
    from .serve.server import MountOptions

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
    )


def _serve_here(args: argparse.Namespace, size: int) -> int:
    """Serve in this process until unmounted (``--foreground``)."""
    from .serve.server import serve

    if args.log:
        logging.basicConfig(
            filename=args.log, level=logging.DEBUG if args.verbose else logging.INFO, force=True,
            format="%(asctime)s blockfs[%(process)d]: %(levelname)s: %(message)s",
        )  # fmt: skip
    options = _mount_options(args, size)
    bar = _progress_bar(1, "B", "preload") if args.preload else None

    def progress(done: int, total: int) -> None:
        bar.total = total
        bar.update(done - bar.n)

    serve(args.dest, args.mountpoint, options, progress if bar else None)
    if bar:
        bar.close()
    return 0


def cmd_umount(args: argparse.Namespace) -> int:
    from .serve.process import unmount

    unmount(args.mountpoint)
    print(f"unmounted {args.mountpoint}")
    return 0


def _stats_text(s: dict, previous: dict | None, seconds: float) -> str:
    m, d, c, k = s["mount"], s["dataset"], s["cache"], s["counters"]
    lines = [
        f"mount      {m['dest']} at {m['mountpoint']} (pid {m['pid']}, {m['binding']}/libfuse {m['libfuse']}, "
        f"open {m['open_mode']}, up {s['uptime_s']:.0f} s)",
        f"dataset    {d['files']:,} files ({_human(d['file_bytes'])}) in {d['blocks']:,} blocks",
        f"cache      {c['policy']}: {_human(c['used_bytes'])} of {_human(c['budget_bytes'])} ({c['fill']:.1%}), "
        f"{c['cached_blocks']:,} blocks; {c['admissions']:,} admitted, {c['refusals']:,} refused, "
        f"{c['evictions']:,} evicted; mlock: {c['mlock']}",
        f"reads      {k['reads']:,} reads, {k['files_served']:,} files served, {_human(k['bytes_served'])}; "
        f"{k.get('blocks_shared', 0):,} blocks shared with loaders (their files are not counted here)",
        f"hits       files {k['file_hit_rate']:.1%} ({k['file_hits']:,} hit, {k['file_misses']:,} missed); "
        f"reads {k['block_hit_rate']:.1%} ({k['block_hits']:,} hit, {k['block_misses']:,} missed)",
        f"storage    {_human(k['bytes_from_storage'])} read: {k['block_loads']:,} whole blocks "
        f"({k['readahead_loads']:,} ahead), {k['file_reads']:,} files alone; {k['buffer_hits']:,} file-buffer hits",
        "epochs     " + ("  ".join(f"{e['hit_rate']:.1%} of {e['files']:,}" for e in s["epochs"][-8:]) or "-"),
    ]
    r = s.get("retained")
    if r:
        lines.append(
            f"retained   {r['retained_files']:,} of {r['target_files']:,} target files, {_human(r['retained_bytes'])} "
            f"of {_human(r['target_bytes'])}; {r['retained_hits']:,} hits, "
            f"{_human(r['storage_bytes_avoided'])} not read again; mlock: {r['mlock']}"
        )
    errors = s.get("errors", {})
    if errors.get("damaged_files_read"):
        lines.append(f"errors     {errors['damaged_files_read']:,} reads failed (EIO); damaged blocks "
                     f"{errors['damaged_blocks_reported']}")  # fmt: skip
    if previous is not None and seconds > 0:
        p = previous["counters"]
        files = (k["files_served"] - p["files_served"]) / seconds
        mbs = (k["bytes_served"] - p["bytes_served"]) / seconds / 1e6
        lines.append(f"rate       {files:,.0f} files/s, {mbs:,.1f} MB/s served")
    return "\n".join(lines)


def cmd_stats(args: argparse.Namespace) -> int:
    from .client import read_stats

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


def _human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


def _memory_arguments(p: argparse.ArgumentParser) -> None:
    """The memory budget and retention options, shared by ``plan`` and ``mount`` so both plan alike."""
    from .serve.plan import STRATEGIES

    budget = p.add_mutually_exclusive_group()
    budget.add_argument("--cache-size", default="auto", help="memory for retained files and cached blocks, "
                        f"e.g. 8GiB, or auto ({AUTO_CACHE_FRACTION * 100:.0f}%% of MemAvailable; the default)")
    budget.add_argument("--memory-fraction", type=float, help="the budget as this fraction of MemAvailable now")

    p.add_argument("--retain-strategy", choices=STRATEGIES, default=None,
                   help="which files stay in memory after their first read when the dataset does not fit: "
                        "most-files (the default: as many as fit, smallest first) or threshold")
    p.add_argument("--retain-threshold", metavar="SIZE|auto", default=None,
                   help="with --retain-strategy threshold: files up to SIZE (auto: the largest that fits)")
    p.add_argument("--no-retain", action="store_true", help="no retained files: the whole budget caches blocks")


DESCRIPTION = """\
Pack a dataset of many small files into a few large block files plus an index, and serve it back
read-only over FUSE as the original tree, byte for byte. Training scripts and ordinary tools read it
unchanged, while storage sees whole blocks read sequentially instead of a seek per file.

a typical session:
  blockfs pack ~/data/imagenet /fast/imagenet.bf     pack a tree (or a tar, RecordIO, WebDataset)
  blockfs plan /fast/imagenet.bf --cache-size 32GiB  what a memory budget will keep resident
  blockfs mount /fast/imagenet.bf /mnt/imagenet      serve it (in the background)
  python train.py /mnt/imagenet                      any program reads the files as before
  blockfs stats /mnt/imagenet                        hits, misses and storage reads so far
  blockfs umount /mnt/imagenet

`blockfs COMMAND --help` lists a command's options."""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="blockfs", description=DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--version", action="version", version=f"blockfs {__version__}")
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging, tracebacks on errors")
    sub = parser.add_subparsers(title="commands", dest="command", required=True, metavar="COMMAND")

    p = sub.add_parser("pack", help="pack a directory tree into blocks plus an index")
    p.add_argument("src", nargs="+", metavar="SOURCE",
                   help="directory, tar (.tar/.gz/.bz2/.xz), MXNet RecordIO .rec, or WebDataset shards "
                        "(several files, a quoted glob or a {000..009} range)")
    p.add_argument("dest", help="new directory for the packed dataset")
    p.add_argument("--block-size", default="64MiB", help="target bytes per block (default 64MiB)")
    p.add_argument("--files-per-block", type=int, default=None, help="at most this many files per block")
    p.add_argument("--labels", default="dirname",
                   help="dirname (ImageFolder: first directory level), none, or a CSV file of path,label")
    p.add_argument("--order", choices=ORDERS, default="shuffled",
                   help="files go to blocks in a seeded random order (default) or in directory order")
    p.add_argument("--seed", type=int, default=0, help="seed of the shuffled order (default 0)")
    p.add_argument("--workers", type=int, default=None, help="parallel block writers, forked processes on Linux (default: cores)")
    p.add_argument("--force", action="store_true", help="replace an existing packed dataset at DEST")
    p.add_argument("--follow-symlinks", action="store_true", help="pack what links point to, not the links")
    p.add_argument("--skip-unreadable", action="store_true", help="list and skip unreadable files instead of stopping")
    p.add_argument("--skip-damaged", action="store_true",
                   help="pack around damaged records or tar members (listing them) instead of stopping")
    p.add_argument("--no-fsync", action="store_true", help="do not fsync blocks (faster; unsafe on power loss)")
    p.set_defaults(func=cmd_pack)

    p = sub.add_parser("info", help="counts, bytes, blocks and labels of a packed dataset")
    p.add_argument("dest")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_info)

    p = sub.add_parser("verify", help="check every checksum; exit 1 naming each bad block and its files")
    p.add_argument("dest")
    p.set_defaults(func=cmd_verify)

    p = sub.add_parser("ls", help="list a directory of a packed dataset like ls -l")
    p.add_argument("dest")
    p.add_argument("path", nargs="?", default="")
    p.set_defaults(func=cmd_ls)

    p = sub.add_parser("cat", help="write one file's bytes to stdout")
    p.add_argument("dest")
    p.add_argument("path")
    p.set_defaults(func=cmd_cat)

    p = sub.add_parser("unpack", help="write the packed tree back out (exact inverse of pack)")
    p.add_argument("dest")
    p.add_argument("out")
    p.set_defaults(func=cmd_unpack)

    p = sub.add_parser("plan", help="the memory plan of a mount: budget, retained files, block cache, hit rates")
    p.add_argument("dest", help="the packed dataset")
    _memory_arguments(p)
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_plan)

    p = sub.add_parser("mount", help="serve a packed dataset as its original tree (read-only FUSE)")
    p.add_argument("dest", help="the packed dataset")
    p.add_argument("mountpoint", help="an empty directory")
    _memory_arguments(p)
    p.add_argument("--preload", action="store_true", help="read what the plan keeps before serving")
    p.add_argument("--policy", choices=("cache-once", "lru", "fifo", "none"), default="cache-once",
                   help="cache-once (default: fill once, never replace), lru, fifo (for comparison) or none")
    p.add_argument("--foreground", action="store_true", help="serve in this process until unmounted or interrupted")
    p.add_argument("--allow-other", action="store_true", help="let other users see the mount (FUSE allow_other)")
    p.add_argument("-o", action="append", metavar="FUSE_OPTIONS", help="extra libfuse options, comma-separated")
    p.add_argument("--log", help="log file (default for a background mount: one in the temp directory)")
    p.add_argument("--timeout", type=float, default=30.0, help="seconds to wait for the mount to serve")
    p.add_argument("--budget-bytes", type=int, help=argparse.SUPPRESS)  # a background mount's budget, resolved
    tuning = p.add_argument_group("tuning (defaults chosen by tools/bench_mount.py)")
    tuning.add_argument("--open-mode", choices=OPEN_MODES,
                        default="auto", help="how the kernel page cache is kept across opens (auto: enosys with "
                        "libfuse 3; targets: only the files the memory plan retains)")
    tuning.add_argument("--single-threaded", action="store_true", help="one FUSE request at a time")
    tuning.add_argument("--readahead", type=int, default=2, help="blocks loaded ahead of reads in block order")
    tuning.add_argument("--no-prefill", action="store_true",
                        help="load blocks only when read (default: fill the budget in the background from mount on)")
    tuning.add_argument("--no-mlock", action="store_true", help="do not try to lock cached blocks in memory")
    tuning.add_argument("--no-share", action="store_true", help="do not hand cached blocks to loaders on this "
                        "machine as shared memory (they then read every file through FUSE)")
    p.set_defaults(func=cmd_mount)

    p = sub.add_parser("umount", help="unmount a blockfs mount (also one whose server was killed)")
    p.add_argument("mountpoint")
    p.set_defaults(func=cmd_umount)

    p = sub.add_parser("stats", help="live statistics of a mount: hits, misses, storage reads, cache fill")
    p.add_argument("mountpoint")
    p.add_argument("--json", action="store_true", help="machine-readable (with --watch: one line per sample)")
    p.add_argument("--watch", action="store_true", help="refresh until interrupted")
    p.add_argument("--interval", type=float, default=1.0, help="seconds between --watch samples (default 1)")
    p.set_defaults(func=cmd_stats)
    return parser


def _stdout_gone() -> bool:
    """Whether stdout is a pipe whose reader has closed it (poll reports POLLERR on its write end)."""
    try:
        fd = sys.stdout.fileno()
    except (AttributeError, OSError, ValueError):  # replaced by a test harness: not a pipe of ours
        return False
    poller = select.poll()
    poller.register(fd, select.POLLOUT)
    return any(events & select.POLLERR for _, events in poller.poll(0))


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; return the exit status (0 ok, 1 verify found damage, 2 error)."""
    parser = build_parser()
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parser.parse_args(argv)
    args.argv = argv  # a background mount re-runs it in the serving process
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO,
        format="blockfs: %(levelname)s: %(message)s" if args.verbose else "blockfs: %(message)s",
    )
    try:
        status = args.func(args)
        sys.stdout.flush()  # a reader that went away shows here, not at interpreter exit
        return status
    except (BlockfsError, ValueError, OSError) as e:
        if isinstance(e, BrokenPipeError) and _stdout_gone():
            # `blockfs ls ds | head -1`: the reader has what it wanted.  Quietly, as ls does; stdout is
            # pointed at /dev/null so the interpreter's last flush cannot complain (Python docs, "Note
            # on SIGPIPE").  A broken pipe of the command's own is an error like any other.
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
            return 0
        if args.verbose:
            log.exception("failed")
        print(f"blockfs {args.command}: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"blockfs {args.command}: interrupted", file=sys.stderr)
        return 130
