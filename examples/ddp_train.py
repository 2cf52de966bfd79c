"""Data-parallel training on a blockfs mount: N processes (gloo backend, CPU), one BlockLoader per rank.

    python examples/ddp_train.py MNT [--world-size 2] [--epochs 2] [--batch-size 16] [--workers 0]
        [--lr 0.1] [--seed 0] [--importance FRACTION] [--warmup K] [--out result.json]

Each rank's loader takes its rank and world size from torch.distributed, reads blocks no other rank reads,
and yields the same number of batches, so the ranks' gradient all-reduces stay in step. With
``--importance``, every rank reports its samples' losses and the loader all-reduces them before each epoch,
so all ranks select the same samples. Any dataset works: a sample's features are the histogram of its
bytes, and a linear model learns what it can from them. ``--out`` gets each rank's step count, the ids it
read per epoch and its final parameters (equal on every rank).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from blockfs.loader import BlockLoader, ImportanceConfig

BINS = 16


def byte_histogram(data: bytes) -> torch.Tensor:
    """A fixed-size feature vector of any file: its byte histogram (16 bins) and its size in KiB."""
    counts = np.bincount(np.frombuffer(data, dtype=np.uint8) >> 4, minlength=BINS).astype(np.float32)
    return torch.from_numpy(np.append(counts / max(len(data), 1), len(data) / 1024.0).astype(np.float32))


def train_rank(rank: int, args: argparse.Namespace, init_file: str, out_dir: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=args.world_size)
    try:
        torch.manual_seed(args.seed)
        torch.set_num_threads(1)
        importance = ImportanceConfig(args.importance, args.warmup) if args.importance else None
        loader = BlockLoader(
            args.root,
            args.batch_size,
            byte_histogram,
            "cpu",
            seed=args.seed,
            num_workers=args.workers,
            importance=importance,
            partition=args.partition,
            nodes=args.nodes if args.partition == "node" else None,
        )
        classes = len(loader.classes or []) or int(loader.mount.labels.max()) + 1
        model = DistributedDataParallel(nn.Linear(BINS + 1, classes))
        optimizer = torch.optim.SGD(model.parameters(), lr=args.lr)
        loss_fn = nn.CrossEntropyLoss(reduction="none")
        steps, ids_per_epoch = 0, []
        for epoch in range(args.epochs):
            loader.set_epoch(epoch)
            seen: list[int] = []
            for features, labels, ids in loader:
                per_sample = loss_fn(model(features), labels)
                optimizer.zero_grad()
                per_sample.mean().backward()
                optimizer.step()
                if importance is not None:
                    loader.report_losses(ids, per_sample.detach())
                seen += ids.tolist()
                steps += 1
            ids_per_epoch.append(seen)
            if rank == 0:
                print(f"epoch {epoch}: {len(seen)} samples on rank 0, {steps} steps so far", flush=True)
        params = torch.cat([p.detach().reshape(-1) for p in model.parameters()]).tolist()
        result = {
            "rank": rank,
            "world_size": loader.world_size,
            "steps": steps,
            "ids": ids_per_epoch,
            "final_params": params,
        }
        with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
            json.dump(result, f)
        loader.close()
        # Every rank reaches here before any tears the group down: a gloo peer torn down while another
        # rank still talks to it can abort that rank (std::terminate in gloo's threads).
        dist.barrier()
    finally:
        dist.destroy_process_group()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("root", metavar="MNT", help="a blockfs mount")
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--workers", type=int, default=0, help="loader worker processes per rank")
    parser.add_argument("--lr", type=float, default=0.1)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--partition",
        choices=("global", "node"),
        default="global",
        help="node: each simulated node's ranks read a fixed part of the blocks",
    )
    parser.add_argument("--nodes", type=int, default=2, help="simulated nodes for --partition node")
    parser.add_argument("--importance", type=float, help="after --warmup epochs, train on this fraction")
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--out", help="write each rank's steps, ids and final parameters to this JSON file")
    args = parser.parse_args(argv)
    for name in ("world_size", "epochs", "batch_size"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1, got {getattr(args, name)}")

    with tempfile.TemporaryDirectory(prefix="blockfs-ddp-") as scratch:
        init_file = os.path.join(scratch, "rendezvous")
        mp.spawn(train_rank, args=(args, init_file, scratch), nprocs=args.world_size, join=True)
        ranks = []
        for rank in range(args.world_size):
            with open(os.path.join(scratch, f"rank{rank}.json")) as f:
                ranks.append(json.load(f))
    steps = {r["steps"] for r in ranks}
    print(f"{args.world_size} ranks, {ranks[0]['steps']} steps each" if len(steps) == 1 else f"steps differ: {steps}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"ranks": ranks}, f)
    return 0 if len(steps) == 1 else 1


if __name__ == "__main__":
    sys.exit(main())
