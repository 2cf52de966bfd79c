"""A dataset named on the command line: a path or a URL, with ``--storage-option`` and the disk tier's
options turned into :class:`~blockfs.core.location.StorageOptions` in one place for every command."""

from __future__ import annotations

import argparse
import os
import shutil
from typing import TYPE_CHECKING

from ..sizes import parse_size
from .mount_flags import add_flags

if TYPE_CHECKING:  # imported where used: the parser and `blockfs mount`'s own process need no NumPy
    from ..core.dataset import PackedDataset
    from ..core.location import StorageOptions

DISK_AUTO_FRACTION = 0.5  # --disk-cache-size auto: this share of the free space under --disk-cache


def add_storage_arguments(p: argparse.ArgumentParser, disk_tier: bool = False) -> None:
    g = p.add_argument_group("remote datasets (s3://, gs://, az://, http(s)://)")
    g.add_argument(
        "--storage-option",
        action="append",
        metavar="KEY=VALUE",
        default=[],
        help="for the object store: endpoint, region, access_key_id, secret_access_key, anon ... "
        "(fsspec spellings work: endpoint_url, key, secret); blockfs's own: part_size, "
        "concurrency, retry_timeout (seconds). Credentials are best left to the standard "
        "environment variables and profiles",
    )
    if disk_tier:
        g.add_argument("--disk-cache", metavar="DIR", help="keep fetched blocks on this local disk, across mounts")
        g.add_argument(
            "--disk-cache-size",
            metavar="SIZE|auto",
            default="auto",
            help=f"bytes the disk tier may hold (auto: {DISK_AUTO_FRACTION * 100:.0f}%% of the free space under DIR)",
        )


def add_expect_argument(p: argparse.ArgumentParser) -> None:
    add_flags(p, "dataset")  # --expect, declared with MountOptions.expect


def disk_cache_size(directory: str, text: str) -> int:
    if text != "auto":
        return parse_size(text)
    existing = os.path.abspath(directory)  # the tier creates DIR (0700) and checks it; measure where it will be
    while not os.path.isdir(existing) and os.path.dirname(existing) != existing:
        existing = os.path.dirname(existing)
    return int(shutil.disk_usage(existing).free * DISK_AUTO_FRACTION)


def storage_options(args: argparse.Namespace) -> StorageOptions:
    from ..core.location import StorageOptions
    from ..storage.remote import parse_options

    disk = getattr(args, "disk_cache", None)
    size = disk_cache_size(disk, args.disk_cache_size) if disk else 0
    fetched = getattr(args, "fetched_dir", None)  # a background mount's: what the starting command fetched
    return StorageOptions(
        parse_options(getattr(args, "storage_option", None)), disk, size, fetched, remove_fetched=fetched is not None
    )


def open_from_args(
    args: argparse.Namespace, keep_fetched_in: str | None = None, *, remembered: bool = False
) -> PackedDataset:
    """The dataset the command names.  ``keep_fetched_in``: a remote dataset's metadata and index are
    fetched into this directory and left there (for the serving process ``mount`` starts).  ``remembered``:
    an index that passed every check before is not checked again (its digest is), as a mount does."""
    from ..core.checked_indexes import CheckedIndexes
    from ..core.dataset import PackedDataset

    storage = storage_options(args)
    if keep_fetched_in is not None and storage.disk_cache is None:
        storage.fetched_dir, storage.remove_fetched = keep_fetched_in, False
    checked = CheckedIndexes.default() if remembered else None
    return PackedDataset(args.dest, storage=storage, expect=getattr(args, "expect", None), checked=checked)
