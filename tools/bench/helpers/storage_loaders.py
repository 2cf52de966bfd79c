"""One epoch of a data loader over one storage, timed: the loaders ``tools/bench/bench_storage.py`` compares.

    python tools/bench/helpers/storage_loaders.py KIND [options]      # prints one JSON line: files, bytes, seconds

Kinds (each with ``--workers`` DataLoader workers, batches of 32, bytes only, no decoding):

* ``files ROOT LIST``        — torch ``DataLoader`` over the files in LIST (shuffled by the caller), ``open().read()``;
* ``blockfs MOUNT``          — :class:`blockfs.loader.BlockLoader` on a blockfs mount (block-shuffled order);
* ``gets ENDPOINT BUCKET LIST`` — a ``DataLoader`` whose items are one S3 GET each (boto3, a client per worker);
* ``mosaic REMOTE LOCAL``    — MosaicML Streaming's ``StreamingDataset`` (MDS shards) with its local cache;
* ``wds URL...``             — WebDataset over HTTP tar shards, shard-shuffled with a sample buffer.

A separate process, so the benchmark can start it inside a throttled cgroup, with a fresh cache.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import types

import torch
from torch.utils.data import DataLoader, Dataset

BATCH = 32


def _nbytes(batch) -> tuple[int, int]:
    """(files, bytes) in one batch: a list of bytes or of dicts holding bytes (Mosaic, WebDataset), or
    BlockLoader's ``(ByteBatch, labels, ids)``."""
    if isinstance(batch, tuple) and isinstance(batch[-1], torch.Tensor):
        batch = batch[0]  # (samples, labels, ...)
    if hasattr(batch, "offsets") and hasattr(batch, "data"):  # blockfs ByteBatch: one buffer
        return len(batch), int(batch.data.numel())
    files = nbytes = 0
    for sample in batch:
        if isinstance(sample, dict):
            sample = next(v for k, v in sample.items() if not str(k).startswith("__"))
        files, nbytes = files + 1, nbytes + len(sample)
    return files, nbytes


def _keep_bytes(batch):
    return batch  # a list of samples: no tensor stacking (the files differ in size)


class Files(Dataset):
    def __init__(self, root: str, names: list[str]) -> None:
        self.root, self.names = root, names

    def __len__(self) -> int:
        return len(self.names)

    def __getitem__(self, i: int) -> bytes:
        with open(os.path.join(self.root, self.names[i]), "rb") as f:
            return f.read()


class Gets(Dataset):
    """One GET per item; each worker makes its own client (boto3 clients are not fork-safe)."""

    def __init__(self, endpoint: str, bucket: str, names: list[str]) -> None:
        self.endpoint, self.bucket, self.names = endpoint, bucket, names
        self._client = None

    def __len__(self) -> int:
        return len(self.names)

    def __getitem__(self, i: int) -> bytes:
        if self._client is None:
            import boto3
            from botocore.config import Config

            self._client = boto3.client(
                "s3", endpoint_url=self.endpoint, region_name="us-east-1", config=Config(max_pool_connections=4)
            )
        return self._client.get_object(Bucket=self.bucket, Key=self.names[i])["Body"].read()


def _import_streaming():
    """MosaicML Streaming imports torchvision at the top for its vision datasets, which we do not use; there
    is no torchvision build for the CPU torch installed here, so stand in two names for that import."""
    try:
        import torchvision  # noqa: F401
    except ImportError:
        tv = types.ModuleType("torchvision")
        tv.datasets = types.ModuleType("torchvision.datasets")
        tv.datasets.VisionDataset = object
        tv.datasets.CIFAR10 = object
        tv.transforms = types.ModuleType("torchvision.transforms")
        tv.transforms.functional = types.ModuleType("torchvision.transforms.functional")
        tv.transforms.functional.to_tensor = None
        import importlib.machinery

        for name, mod in {
            "torchvision": tv,
            "torchvision.datasets": tv.datasets,
            "torchvision.transforms": tv.transforms,
            "torchvision.transforms.functional": tv.transforms.functional,
        }.items():
            mod.__spec__ = importlib.machinery.ModuleSpec(name, None)
            sys.modules[name] = mod
    import streaming

    return streaming


def _loader(args: argparse.Namespace):
    workers = args.workers
    common = {
        "batch_size": BATCH,
        "num_workers": workers,
        "collate_fn": _keep_bytes,
        "persistent_workers": False,
        "prefetch_factor": 4 if workers else None,
    }
    if args.kind in ("files", "gets"):
        with open(args.list) as f:
            names = [line.rstrip("\n") for line in f if line.strip()]
        data = Files(args.root, names) if args.kind == "files" else Gets(args.endpoint, args.bucket, names)
        return DataLoader(data, shuffle=False, **common)  # the list is already shuffled
    if args.kind == "blockfs":
        from blockfs.loader import BlockLoader

        return BlockLoader(args.root, batch_size=BATCH, num_workers=workers, seed=args.seed)
    if args.kind == "mosaic":
        streaming = _import_streaming()
        data = streaming.StreamingDataset(
            remote=args.remote,
            local=args.local,
            shuffle=True,
            shuffle_seed=args.seed,
            batch_size=BATCH,
            cache_limit=args.cache_limit,
        )
        # Reading index.json made a boto3 client in this process; forked workers would share its pooled
        # socket and read each other's responses (seen: a shard holding another shard's bytes at 10 ms).
        # Dropping it makes each worker open its own.
        for stream in data.streams:
            stream._downloader.clean_up()
        return streaming.StreamingDataLoader(data, **common)  # Mosaic's own DataLoader
    if args.kind == "wds":
        import webdataset as wds

        data = wds.WebDataset(args.urls, shardshuffle=len(args.urls), seed=args.seed, empty_check=False).shuffle(1000)
        return DataLoader(data, **common)
    raise SystemExit(f"unknown kind {args.kind}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="kind", required=True)
    p = sub.add_parser("files")
    p.add_argument("root")
    p.add_argument("list")
    p = sub.add_parser("blockfs")
    p.add_argument("root")
    p = sub.add_parser("gets")
    p.add_argument("endpoint")
    p.add_argument("bucket")
    p.add_argument("list")
    p = sub.add_parser("mosaic")
    p.add_argument("remote")
    p.add_argument("local")
    p.add_argument("--cache-limit", default=None)
    p = sub.add_parser("wds")
    p.add_argument("urls", nargs="+")
    for p in sub.choices.values():
        p.add_argument("--workers", type=int, default=4)
        p.add_argument("--seed", type=int, default=0)
        p.add_argument("--seconds", type=float, default=None, help="stop after this long (slow systems)")
        p.add_argument("--epochs", type=int, default=1)
        p.add_argument("--wait-mount", default=None, help="print 'ready', then start once this path is mounted")
        p.add_argument(
            "--step",
            action="store_true",
            help="print each epoch's result as it ends and wait for a line on stdin before the next",
        )
    args = parser.parse_args()
    if args.wait_mount:
        from storage_reader import wait_for_mount

        wait_for_mount(args.wait_mount)
    loader = _loader(args)
    results = []
    first = time.monotonic()  # epoch 1 includes making the loader (a BlockLoader reads the index)
    for epoch in range(args.epochs):
        if hasattr(loader, "set_epoch"):
            loader.set_epoch(epoch)
        files = nbytes = 0
        started = first if epoch == 0 or args.step else time.monotonic()
        for batch in loader:
            f, b = _nbytes(batch)
            files, nbytes = files + f, nbytes + b
            if args.seconds and time.monotonic() - started > args.seconds:
                break
        results.append({"files": files, "bytes": nbytes, "seconds": time.monotonic() - started})
        if args.step:  # the caller reads the storage's counters between epochs
            print(json.dumps(results[-1]), flush=True)
            if epoch + 1 < args.epochs:
                sys.stdin.readline()
                first = time.monotonic()
    print(json.dumps(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
