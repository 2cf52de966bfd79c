#!/usr/bin/env python3
"""How many bytes N nodes fetch from one object store per epoch, with ``partition="node"`` against
``"global"``, and what the node split costs in batch mixing.

One run, against moto's S3 server on loopback (a child process; ``tools/bench/bench_remote.py``'s helpers):
the dataset is packed straight to the store; for N = 1, 2, 4 simulated nodes, N mounts of it (each with
the same memory budget, ``--open-mode none`` so every read reaches blockfs, ``--nodes N --node-rank k``)
and one reader per node reading, each epoch, exactly the samples its rank gets from the loader's order
(``BlockShuffleDataset``'s, with ``world_size = N``), file by file through its mount.  Reported per epoch:
the bytes all N mounts fetched from the store, next to the model's expectation — ``max(0, D - N x B)``
with ``"node"`` and ``D - B`` with ``"global"`` (each node reads ``D / N`` and keeps ``B / D`` of whatever
it reads).  Then the per-batch class entropy of both orders against a global shuffle's, from the orders
alone.

    python tools/bench/bench_nodes.py [--files 3000] [--budget 0.3] [--epochs 3] [--json FILE]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

import helpers  # noqa: F401  (puts the checkout on sys.path, for blockfs)

import bench_remote as br  # the loopback server and mount helpers
import blockfs
from blockfs.client import read_stats
from blockfs.serve.cache.memory_plan import parse_size
from blockfs.loader.order import BlockLayout, batch_class_entropy, block_shuffled_order, global_shuffled_order


def rank_names(packed: Path, nodes: int, partition: str, seed: int, epoch: int) -> list[list[str]]:
    """The paths each node's (single) rank reads in ``epoch``, in the loader's order."""
    with blockfs.open_dataset(packed) as ds:
        a = ds.index.arrays
        layout = BlockLayout(a["block_offsets"], a["block_files"])
        node_of = None
        if partition == "node" and nodes > 1:
            from blockfs.core.partition import partition_blocks

            node_of = partition_blocks(layout.block_sizes, nodes, seed=seed, block_bytes=a["block_sizes"])
        orders = [
            block_shuffled_order(layout, seed=seed, epoch=epoch, rank=r, world_size=nodes,
                                 nodes=nodes if partition == "node" else 1, node_of_block=node_of)  # fmt: skip
            for r in range(nodes)
        ]
        return [[os.fsdecode(ds.path_of(int(e))) for e in order] for order in orders]


def run(nodes: int, partition: str, url: str, packed: Path, work: Path, budget: int, epochs: int, seed: int) -> list[int]:
    """Store bytes all mounts fetched in each epoch."""
    args = ["--cache-size", str(budget), "--no-retain", "--open-mode", "none", "--nodes", str(nodes),
            "--partition-seed", str(seed)]  # fmt: skip
    with contextlib.ExitStack() as stack:
        mounts = [
            stack.enter_context(br.mounted(url, work / f"{partition}-{nodes}-{k}", [*args, "--node-rank", str(k)]))
            for k in range(nodes)
        ]
        before = 0  # epoch 1 counts everything since the mounts started: index, prefill, reads
        fetched = []
        for epoch in range(epochs):
            names = rank_names(packed, nodes, partition, seed, epoch)
            for m, part in zip(mounts, names):
                reader = br.file_reader(m)
                for name in part:
                    reader(name)
            now = sum(read_stats(m)["storage"]["remote"]["bytes"] for m in mounts)
            fetched.append(now - before)
            before = now
        return fetched


def entropies(packed: Path, nodes: int, seed: int, batch: int) -> dict[str, float]:
    """Mean per-batch class entropy of rank 0's order, for both partitions and a global shuffle."""
    with blockfs.open_dataset(packed) as ds:
        a = ds.index.arrays
        layout = BlockLayout(a["block_offsets"], a["block_files"])
        labels = np.maximum(a["label"].astype(np.int64), 0)
        out = {}
        for partition in ("global", "node"):
            order = block_shuffled_order(layout, seed=seed, epoch=1, rank=0, world_size=nodes,
                                         nodes=nodes if partition == "node" else 1)  # fmt: skip
            out[partition] = batch_class_entropy(order, labels, batch)
        shuffled = layout.block_files[global_shuffled_order(layout.n_files, seed=seed, epoch=1)]
        out["global shuffle"] = batch_class_entropy(shuffled, labels, batch)
        return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--files", type=int, default=3000)
    p.add_argument("--classes", type=int, default=20)
    p.add_argument("--block-size", default="1MiB")
    p.add_argument("--budget", type=float, default=0.3, help="each node's memory, as a share of the dataset")
    p.add_argument("--nodes", default="1,2,4")
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--batch", type=int, default=64, help="batch size for the entropy figures")
    p.add_argument("--json")
    args = p.parse_args(argv)
    started = time.monotonic()
    results: dict = {"runs": []}
    with tempfile.TemporaryDirectory(prefix="bench-nodes-") as tmp, br.stopped_by_sigterm():
        work = Path(tmp)
        with br.moto_server(work / "moto.log") as endpoint:
            os.environ.update(br.s3_env(endpoint, given=False))
            client = br.boto3_client()
            br.ensure_bucket(client, "bench-nodes")
            br.make_tree(work / "src", args.files, 10 << 10, 100 << 10, args.classes, args.seed)
            packed = work / "packed"
            blockfs.pack(work / "src", packed, block_size=parse_size(args.block_size), fsync=False)
            url = "s3://bench-nodes/ds"
            blockfs.pack(work / "src", url, block_size=parse_size(args.block_size), fsync=False)
            with blockfs.open_dataset(packed) as ds:
                dataset = int(ds.metadata["block_bytes"])
            budget = int(args.budget * dataset)
            results |= {"dataset_bytes": dataset, "budget_bytes": budget, "files": args.files}
            print(f"dataset {dataset / 2**20:.1f} MiB in {args.files} files; each node's budget {budget / 2**20:.1f} MiB "
                  f"({args.budget:.0%}); store bytes per epoch, all nodes together (MiB; epoch 1 includes "
                  "the mounts' start: index and prefill):")  # fmt: skip
            for n in (int(x) for x in args.nodes.split(",")):
                for partition in ("global", "node"):
                    fetched = run(n, partition, url, packed, work, budget, args.epochs, args.seed)
                    model = max(0, dataset - n * budget) if partition == "node" else max(0, dataset - budget)
                    results["runs"].append({"nodes": n, "partition": partition, "fetched": fetched, "model": model})
                    shown = "  ".join(f"{f / 2**20:7.1f}" for f in fetched)
                    print(f"  N={n} {partition:6}  epochs: {shown}   model from epoch 2: {model / 2**20:6.1f}", flush=True)
            results["entropy"] = {n: entropies(packed, n, args.seed, args.batch) for n in (2, 4)}
            for n, e in results["entropy"].items():
                print(f"batch class entropy, {n} nodes, rank 0: " + ", ".join(f"{k} {v:.3f}" for k, v in e.items()))
    print(f"{time.monotonic() - started:.0f} s")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
