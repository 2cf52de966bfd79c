"""The commands that read a packed dataset without mounting it, and ``pack``: output for people and
scripts; the work itself is in :mod:`blockfs.core` and :mod:`blockfs.packing`."""

from __future__ import annotations

import argparse
import json
import logging
import os
import stat
import sys
import time

from ..core.dataset import PackedDataset
from ..core.index import KIND_DIR, KIND_SYMLINK
from ..packing.packer import PackOptions, pack
from ..sizes import parse_size
from ..storage.remote import parse_options
from .dataset_args import open_from_args
from .output import human, plural, progress_bar, terminal_bar

log = logging.getLogger("blockfs")


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
        staging=args.staging,
    )
    storage = parse_options(args.storage_option)
    src = args.src[0] if len(args.src) == 1 else args.src  # several: WebDataset shards
    bar = listed = None

    # Both are called only when stderr is a terminal (tty below).
    def listing(n: int) -> None:  # a million-file tree takes seconds to list: show that it is moving
        nonlocal listed
        if listed is None:
            listed = terminal_bar(None, " entries", "list")
        listed.update(n - listed.n)

    def progress(files: int, nbytes: int, total_files: int, total_bytes: int) -> None:
        nonlocal bar
        if listed is not None:
            listed.close()
        if bar is None:
            bar = terminal_bar(total_bytes, "B", "pack")
        bar.set_postfix(files=f"{files}/{total_files}", refresh=False)
        bar.update(nbytes - bar.n)

    tty = sys.stderr.isatty()
    try:
        result = pack(
            src,
            args.dest,
            options,
            storage_options=storage,
            progress=progress if tty else None,
            listing=listing if tty else None,
        )
    finally:
        for shown in (listed, bar):
            if shown is not None:
                shown.close()
    rate = result.file_bytes / max(result.seconds, 1e-9) / 1e6
    if args.quiet:
        return 0
    print(
        f"packed {plural(result.n_files, 'file')} ({human(result.file_bytes)}), {result.n_dirs} directories, "
        f"{result.n_symlinks} symlinks into {plural(result.n_blocks, 'block')} at {result.dest} "
        f"in {result.seconds:.1f} s ({result.n_files / max(result.seconds, 1e-9):,.0f} files/s, {rate:,.0f} MB/s)"
    )
    print(f"dataset {result.digest}")
    return 0


def cmd_info(args: argparse.Namespace) -> int:
    from ..core.verify import summary

    with open_from_args(args) as ds:
        info = summary(ds)
    if args.json:
        print(json.dumps(info, indent=2))
        return 0
    print(f"dataset      {info['path']}")
    print(
        f"name         {info['digest']}"
        + (
            ""
            if info["digests"]
            else f" (no digests: checked against accidents only; 'blockfs upgrade {info['path']}' adds them)"
        )
    )
    print(
        f"files        {info['files']:,} ({human(info['file_bytes'])}), {info['directories']:,} directories, {info['symlinks']:,} symlinks"
    )
    print(
        f"blocks       {info['blocks']:,} ({human(info['block_bytes'])}); size min/median/max "
        f"{human(info['block_size_min'])} / {human(info['block_size_median'])} / {human(info['block_size_max'])}; "
        f"median {info['files_per_block_median']:,} files per block"
    )
    print(
        f"headers      {human(info['header_bytes'])} ({info['header_bytes'] / max(info['files'], 1):.1f} bytes per file)"
    )
    p = info["pack"]
    print(
        f"packed with  block size {human(p['block_size'])}, order {p['order']}, seed {p['seed']}, labels {p['labels']}"
    )
    labels = info["labels"]
    print(f"labels       {len(labels)} distinct")
    for name, count in list(labels.items())[:20]:
        print(f"  {count:>10,}  {_printable(name.encode('utf-8', 'surrogateescape'))}")  # as ls shows names
    if len(labels) > 20:
        print(f"  ... and {len(labels) - 20} more (--json lists all)")
    return 0


def cmd_verify(args: argparse.Namespace) -> int:
    from ..core.verify import verify

    with open_from_args(args) as ds:
        bar = progress_bar(ds.n_blocks, "block", "verify")
        problems = verify(ds, on_block=(lambda b: bar.update(1)) if bar else None)
        if bar:
            bar.close()
        n_blocks, where = ds.n_blocks, ds.location
    for p in problems:
        print(f"BAD {p.what}: {p.message}")
        for f in p.files[:10]:
            print(f"    {f}")
        if len(p.files) > 10:
            print(f"    ... and {len(p.files) - 10} more files")
    if problems:
        print(f"{len(problems)} problems in {where}")
        return 1
    print(f"ok: {plural(n_blocks, 'block')} and the index verified in {where}")
    return 0


def cmd_upgrade(args: argparse.Namespace) -> int:
    from ..core.upgrade import upgrade

    name, changed = upgrade(args.dest)
    print(f"{'upgraded' if changed else 'already has digests:'} {args.dest}: dataset {name}")
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
    with open_from_args(args) as ds:
        e = ds.lookup(args.path)
        if ds.index.kind(e) != KIND_DIR:
            print(_ls_line(ds, e, os.fsencode(args.path)))
            return 0
        for child in ds.index.children(e):
            print(_ls_line(ds, child, ds.path_of(child).rpartition(b"/")[2]))
    return 0


def cmd_cat(args: argparse.Namespace) -> int:
    with open_from_args(args) as ds:
        e = ds.resolve(args.path)  # a link is followed, as cat(1) does
        out = sys.stdout.buffer
        for piece in ds.read_pieces(e):
            out.write(piece)
        out.flush()
    return 0


def cmd_unpack(args: argparse.Namespace) -> int:
    from ..core.unpack import unpack

    with open_from_args(args) as ds:
        bar = progress_bar(ds.index.n_entries - 1, "entry", "unpack")
        n = unpack(ds, args.out, on_file=(lambda e: bar.update(1)) if bar else None)
        if bar:
            bar.close()
    print(f"unpacked {n} entries into {args.out}")
    return 0


# --- mount, umount, stats ---------------------------------------------------------------------------
