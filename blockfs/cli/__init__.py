"""The ``blockfs`` command: the parser, and ``main``.  The only package that prints, exits or configures
logging; each command lives in :mod:`.dataset_commands` or :mod:`.mount_commands`."""

from __future__ import annotations

import argparse
import logging
import os
import select
import signal
import sys
from collections.abc import Callable, Sequence

from .. import __version__
from ..errors import BlockfsError
from ..packing.options import ORDERS
from .dataset_args import add_expect_argument, add_storage_arguments
from .mistakes import commands, unknown_command, unrecognized, usage_line
from .mount_commands import AUTO_CACHE_FRACTION, cmd_mount, cmd_plan, cmd_stats, cmd_umount
from .mount_flags import add_flags
from .output import log_level

log = logging.getLogger("blockfs")


def _dataset_command(name: str) -> Callable[[argparse.Namespace], int]:
    """A command of :mod:`.dataset_commands`, imported when run: they need NumPy and the packer, which
    ``blockfs mount`` (whose time to return counts) and ``blockfs umount`` do not."""

    def run(args: argparse.Namespace) -> int:
        from . import dataset_commands

        command: Callable[[argparse.Namespace], int] = getattr(dataset_commands, name)
        return command(args)

    return run


def _memory_arguments(p: argparse.ArgumentParser) -> None:
    """The memory budget and retention options, shared by ``plan`` and ``mount`` so both plan alike."""
    budget = p.add_mutually_exclusive_group()
    budget.add_argument(
        "--cache-size",
        default="auto",
        help="memory for retained files and cached blocks, "
        f"e.g. 8GiB, or auto ({AUTO_CACHE_FRACTION * 100:.0f}%% of MemAvailable; the default)",
    )
    budget.add_argument("--memory-fraction", type=float, help="the budget as this fraction of MemAvailable now")
    add_flags(p, "memory")
    add_flags(p.add_argument_group("multi-node training with BlockLoader(partition='node')"), "nodes")


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


LOG_LEVELS = ("debug", "info", "warning", "error")


def _logging_arguments(p: argparse.ArgumentParser, top: bool) -> None:
    """-v, -q and --log-level, before or after the command (``blockfs mount -v ...``).  After it they
    default to nothing, so that ``blockfs -v mount`` keeps what was given before."""
    default = (lambda value: value) if top else (lambda value: argparse.SUPPRESS)
    g = p.add_argument_group("logging")
    g.add_argument(
        "-v",
        "--verbose",
        action="store_true",
        default=default(False),
        help="debug logging, tracebacks on errors (--log-level debug)",
    )
    g.add_argument(
        "-q",
        "--quiet",
        action="store_true",
        default=default(False),
        help="only warnings and errors (--log-level warning); mount prints no plan",
    )
    g.add_argument("--log-level", choices=LOG_LEVELS, default=default(None), help="what is logged (default info)")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="blockfs", description=DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--version", action="version", version=f"blockfs {__version__}")
    _logging_arguments(parser, top=True)
    sub = _CommandParsers(parser.add_subparsers(title="commands", dest="command", required=True, metavar="COMMAND"))

    p = sub.add_parser("pack", help="pack a directory tree into blocks plus an index")
    p.add_argument(
        "src",
        nargs="+",
        metavar="SOURCE",
        help="directory, tar (.tar/.gz/.bz2/.xz), MXNet RecordIO .rec, WebDataset shards "
        "(several files, a quoted glob or a {000..009} range), or a URL prefix of objects",
    )
    p.add_argument("dest", help="new directory for the packed dataset, or a URL (s3://, gs://, az://)")
    p.add_argument("--block-size", default="64MiB", help="target bytes per block (default 64MiB)")
    p.add_argument("--files-per-block", type=int, default=None, help="at most this many files per block")
    p.add_argument(
        "--labels",
        default="dirname",
        help="dirname (ImageFolder: first directory level), none, or a CSV file of path,label",
    )
    p.add_argument(
        "--order",
        choices=ORDERS,
        default="shuffled",
        help="files go to blocks in a seeded random order (default) or in directory order",
    )
    p.add_argument("--seed", type=int, default=0, help="seed of the shuffled order (default 0)")
    p.add_argument(
        "--workers", type=int, default=None, help="parallel block writers, forked processes on Linux (default: cores)"
    )
    p.add_argument("--force", action="store_true", help="replace an existing packed dataset at DEST")
    p.add_argument("--follow-symlinks", action="store_true", help="pack what links point to, not the links")
    p.add_argument("--skip-unreadable", action="store_true", help="list and skip unreadable files instead of stopping")
    p.add_argument(
        "--skip-damaged",
        action="store_true",
        help="pack around damaged records or tar members (listing them) instead of stopping",
    )
    p.add_argument("--no-fsync", action="store_true", help="do not fsync blocks (faster; unsafe on power loss)")
    add_storage_arguments(p)
    p.add_argument(
        "--staging",
        metavar="DIR",
        help="a URL DEST: where finished blocks wait for their upload "
        "(default: the temp directory; a few blocks at a time)",
    )
    p.set_defaults(func=_dataset_command("cmd_pack"))

    p = sub.add_parser("info", help="counts, bytes, blocks and labels of a packed dataset")
    p.add_argument("dest")
    p.add_argument("--json", action="store_true")
    add_storage_arguments(p)
    add_expect_argument(p)
    p.set_defaults(func=_dataset_command("cmd_info"))

    p = sub.add_parser("verify", help="check every checksum; exit 1 naming each bad block and its files")
    p.add_argument("dest")
    add_storage_arguments(p)
    add_expect_argument(p)
    p.set_defaults(func=_dataset_command("cmd_verify"))

    p = sub.add_parser(
        "upgrade", help="add the digests that name a dataset packed before them (blocks are not rewritten)"
    )
    p.add_argument("dest", help="a packed dataset directory")
    p.set_defaults(func=_dataset_command("cmd_upgrade"))

    p = sub.add_parser("ls", help="list a directory of a packed dataset like ls -l")
    p.add_argument("dest")
    p.add_argument("path", nargs="?", default="")
    add_storage_arguments(p)
    add_expect_argument(p)
    p.set_defaults(func=_dataset_command("cmd_ls"))

    p = sub.add_parser("cat", help="write one file's bytes to stdout")
    p.add_argument("dest")
    p.add_argument("path")
    add_storage_arguments(p)
    add_expect_argument(p)
    p.set_defaults(func=_dataset_command("cmd_cat"))

    p = sub.add_parser("unpack", help="write the packed tree back out (exact inverse of pack)")
    p.add_argument("dest")
    p.add_argument("out")
    add_storage_arguments(p)
    add_expect_argument(p)
    p.set_defaults(func=_dataset_command("cmd_unpack"))

    p = sub.add_parser("plan", help="the memory plan of a mount: budget, retained files, block cache, hit rates")
    p.add_argument("dest", help="the packed dataset (a directory or a URL)")
    _memory_arguments(p)
    p.add_argument("--json", action="store_true")
    add_storage_arguments(p, disk_tier=True)
    add_expect_argument(p)
    p.set_defaults(func=cmd_plan)

    p = sub.add_parser("mount", help="serve a packed dataset as its original tree (read-only FUSE)")
    p.add_argument("dest", help="the packed dataset (a directory or a URL)")
    p.add_argument("mountpoint", help="an empty directory")
    _memory_arguments(p)
    add_flags(p, "cache")
    p.add_argument("--foreground", action="store_true", help="serve in this process until unmounted or interrupted")
    add_flags(p, "fuse")
    p.add_argument(
        "--log",
        help="log file (default for a background mount: one in a private directory, "
        "$XDG_RUNTIME_DIR/blockfs, /run/blockfs for root, else ~/.cache/blockfs/logs)",
    )
    p.add_argument(
        "--timeout",
        type=float,
        help="seconds to wait for the mount to serve (default: as long as its serving process lives)",
    )
    p.add_argument("--budget-bytes", type=int, help=argparse.SUPPRESS)  # a background mount's budget, resolved
    p.add_argument("--fetched-dir", help=argparse.SUPPRESS)  # a background mount's: the index its parent fetched
    p.add_argument("--handoff-fd", type=int, help=argparse.SUPPRESS)  # a background mount's: its secrets' pipe
    p.add_argument("--report-fd", type=int, help=argparse.SUPPRESS)  # a background mount's: where its plan goes
    add_storage_arguments(p, disk_tier=True)
    add_flags(p.add_argument_group("tuning (defaults chosen by tools/bench/bench_mount.py)"), "tuning")
    add_expect_argument(p)
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


class _CommandParsers:
    """``add_subparsers()``'s action, giving every command the logging options."""

    def __init__(self, action) -> None:
        self._action = action

    def add_parser(self, name: str, **kwargs) -> argparse.ArgumentParser:
        p = self._action.add_parser(name, **kwargs)
        _logging_arguments(p, top=False)
        return p


def _stdout_gone() -> bool:
    """Whether stdout is a pipe whose reader has closed it (poll reports POLLERR on its write end)."""
    try:
        fd = sys.stdout.fileno()
    except (AttributeError, OSError, ValueError):  # replaced by a test harness: not a pipe of ours
        return False
    poller = select.poll()
    poller.register(fd, select.POLLOUT)
    return any(events & select.POLLERR for _, events in poller.poll(0))


class _Reworded(logging.Filter):
    """Log records in another spelling (:func:`main`'s ``wording``)."""

    def __init__(self, wording: Callable[[str], str]) -> None:
        super().__init__()
        self._wording = wording

    def filter(self, record: logging.LogRecord) -> bool:
        record.msg, record.args = self._wording(record.getMessage()), ()
        return True


def main(argv: Sequence[str] | None = None, wording: Callable[[str], str] | None = None) -> int:
    """Run the command line; return the exit status (0 ok, 1 verify found damage, 2 error).

    ``wording``: how errors and warnings are spelled for the user (mount.fuse.blockfs: as fstab options)."""
    parser = build_parser()
    argv = list(sys.argv[1:] if argv is None else argv)
    wrong = unknown_command(parser, argv)
    if wrong is not None:
        print(usage_line(parser) + "\n" + wrong, file=sys.stderr)
        return 2
    args, extras = parser.parse_known_args(argv)
    if extras:
        print(
            usage_line(commands(parser)[args.command]) + "\n" + unrecognized(parser, args.command, extras),
            file=sys.stderr,
        )
        return 2
    args.argv = argv  # a background mount re-runs it in the serving process
    args.verbose = args.verbose or args.log_level == "debug"
    logging.basicConfig(
        level=log_level(args),
        format="blockfs: %(levelname)s: %(message)s" if args.verbose else "blockfs: %(message)s",
    )
    reworded = _Reworded(wording) if wording is not None else None
    if reworded is not None:  # the commands' warnings (logged as "blockfs"), for this run only
        log.addFilter(reworded)
    try:
        return _run(args, wording)
    finally:
        if reworded is not None:
            log.removeFilter(reworded)


def _run(args: argparse.Namespace, wording: Callable[[str], str] | None) -> int:
    """The command ``args`` names; errors as one line (see :func:`main`)."""
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
        print(f"blockfs {args.command}: error: {wording(str(e)) if wording else e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt as e:  # a pack's says what it removed or left; a mount's, what it stopped
        signum = getattr(e, "signum", signal.SIGINT)  # daemon.Stopped: SIGTERM, SIGHUP too
        said = "interrupted" if signum == signal.SIGINT else f"stopped by {signal.Signals(signum).name}"
        print(f"blockfs {args.command}: {said}" + (f"; {e}" if e.args else ""), file=sys.stderr)
        return 128 + signum
