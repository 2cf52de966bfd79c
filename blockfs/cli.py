"""The ``blockfs`` command.  The only module that prints, exits or configures logging."""

from __future__ import annotations

import argparse
import json
import logging
import os
import stat
import sys
import time
from typing import Sequence

from . import __version__
from .dataset import PackedDataset, open_dataset
from .errors import BlockfsError
from .index import KIND_DIR, KIND_SYMLINK
from .pack import PackOptions, pack
from .plan import parse_size

log = logging.getLogger("blockfs")


def _progress_bar(total: int, unit: str, desc: str):
    """A tqdm bar on a terminal; None (quiet) when stderr is not one."""
    if not sys.stderr.isatty():
        return None
    from tqdm import tqdm

    return tqdm(total=total, unit=unit, unit_scale=True, unit_divisor=1024, desc=desc, dynamic_ncols=True)


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
        fsync=not args.no_fsync,
    )
    bar = None
    state = {"files": 0}

    def progress(files: int, nbytes: int) -> None:
        nonlocal bar
        if bar is None:
            return
        bar.update(nbytes - bar.n)
        bar.set_postfix(files=files, refresh=False)
        state["files"] = files

    if sys.stderr.isatty():
        from .sources import DirectorySource

        # Size the bar from a quick walk; the packer walks again, which the page cache makes cheap.
        total = sum(e.size for e in DirectorySource(args.src, args.follow_symlinks).entries())
        bar = _progress_bar(total, "B", "pack")
    try:
        result = pack(args.src, args.dest, options, progress=progress)
    finally:
        if bar is not None:
            bar.close()
    rate = result.file_bytes / max(result.seconds, 1e-9) / 1e6
    print(
        f"packed {result.n_files} files ({_human(result.file_bytes)}), {result.n_dirs} directories, "
        f"{result.n_symlinks} symlinks into {result.n_blocks} blocks at {args.dest} "
        f"in {result.seconds:.1f} s ({result.n_files / max(result.seconds, 1e-9):,.0f} files/s, {rate:,.0f} MB/s)"
    )
    return 0


def cmd_info(args: argparse.Namespace) -> int:
    from .verify import summary

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
    from .verify import verify

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


def _ls_line(ds: PackedDataset, e: int, name: bytes) -> str:
    st = ds.stat_entry(e)
    when = time.strftime("%Y-%m-%d %H:%M", time.localtime(st.mtime_ns / 1e9))
    line = f"{stat.filemode(st.mode)} {st.nlink:>3} {st.size:>12} {when} {os.fsdecode(name)}"
    if st.kind == KIND_SYMLINK:
        line += f" -> {os.fsdecode(ds.index.link_target(e))}"
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
        size = ds.stat_entry(e).size
        out = sys.stdout.buffer
        piece = 16 << 20 if size >= (1 << 32) else max(size, 1)
        for offset in range(0, size, piece):
            out.write(ds.read_entry(e, offset, piece))
        out.flush()
    return 0


def cmd_unpack(args: argparse.Namespace) -> int:
    from .unpack import unpack

    with open_dataset(args.dest) as ds:
        bar = _progress_bar(ds.index.n_entries - 1, "entry", "unpack")
        n = unpack(ds, args.out, on_file=(lambda e: bar.update(1)) if bar else None)
        if bar:
            bar.close()
    print(f"unpacked {n} entries into {args.out}")
    return 0


def _human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="blockfs", description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--version", action="version", version=f"blockfs {__version__}")
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging, tracebacks on errors")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    p = sub.add_parser("pack", help="pack a directory tree into blocks plus an index")
    p.add_argument("src", help="directory to pack")
    p.add_argument("dest", help="new directory for the packed dataset")
    p.add_argument("--block-size", default="64MiB", help="target bytes per block (default 64MiB)")
    p.add_argument("--files-per-block", type=int, default=None, help="at most this many files per block")
    p.add_argument("--labels", default="dirname",
                   help="dirname (ImageFolder: first directory level), none, or a CSV file of path,label")
    p.add_argument("--order", choices=("shuffled", "directory"), default="shuffled",
                   help="files go to blocks in a seeded random order (default) or in directory order")
    p.add_argument("--seed", type=int, default=0, help="seed of the shuffled order (default 0)")
    p.add_argument("--workers", type=int, default=None, help="parallel block writers (default: cores)")
    p.add_argument("--force", action="store_true", help="replace an existing packed dataset at DEST")
    p.add_argument("--follow-symlinks", action="store_true", help="pack what links point to, not the links")
    p.add_argument("--skip-unreadable", action="store_true", help="list and skip unreadable files instead of stopping")
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
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; return the exit status (0 ok, 1 verify found damage, 2 error)."""
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO,
        format="blockfs: %(levelname)s: %(message)s" if args.verbose else "blockfs: %(message)s",
    )
    try:
        return args.func(args)
    except (BlockfsError, ValueError, OSError) as e:
        if args.verbose:
            log.exception("failed")
        print(f"blockfs {args.command}: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"blockfs {args.command}: interrupted", file=sys.stderr)
        return 130
