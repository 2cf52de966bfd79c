"""One rank of an unmodified DDP training script's input pipeline, reading a mounted tree: what it costs the store.

    python tools/bench/helpers/ddp_reader.py ROOT --rank K --world-size N [--epoch E] [--workers 4] [--seed 0]

The script knows nothing of blockfs: an ImageFolder-like dataset over ``ROOT`` (its class directories in
sorted order, each one's files in sorted order, ``os.walk`` as ImageFolder lists them; torchvision does not
install here, so the dozen lines it would run are written out), torch's ``DistributedSampler(shuffle=True,
seed=SEED)`` with ``set_epoch(E)`` for this rank's indices, and a ``DataLoader`` with ``--workers`` worker
processes reading each sample with ``open().read()`` (the bytes, undecoded: what is measured is the
storage).  ``DistributedSampler`` takes the rank and world size as arguments, so no process group is needed.
Prints one JSON line, as ``storage_reader.py`` does: files, bytes, seconds, errors.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import warnings

import torch
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler


class FolderFiles(Dataset):
    """``(bytes, class index)`` of every file under ``root``'s class directories, in ImageFolder's order."""

    def __init__(self, root: str) -> None:
        self.classes = sorted(e.name for e in os.scandir(root) if e.is_dir())
        self.samples: list[tuple[str, int]] = []
        for index, name in enumerate(self.classes):
            for folder, _dirs, files in sorted(os.walk(os.path.join(root, name))):
                self.samples += [(os.path.join(folder, f), index) for f in sorted(files)]

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, i: int) -> tuple[int, int]:
        path, target = self.samples[i]
        with open(path, "rb") as f:
            return len(f.read()), target  # the length stands in for a decoded sample


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("root")
    p.add_argument("--rank", type=int, required=True)
    p.add_argument("--world-size", type=int, required=True)
    p.add_argument("--epoch", type=int, default=0)
    p.add_argument("--workers", type=int, default=4)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    torch.set_num_threads(1)
    # torch warns when workers outnumber the cores: on the benchmark's shared machine they always do
    warnings.filterwarnings("ignore", message="This DataLoader will create")
    data = FolderFiles(args.root)
    sampler = DistributedSampler(data, num_replicas=args.world_size, rank=args.rank, shuffle=True, seed=args.seed)
    sampler.set_epoch(args.epoch)
    loader = DataLoader(data, batch_size=args.batch, sampler=sampler, num_workers=args.workers)
    totals = {"files": 0, "bytes": 0, "errors": 0}
    started = time.monotonic()
    try:
        for sizes, _targets in loader:
            totals["files"] += len(sizes)
            totals["bytes"] += int(sizes.sum())
    except Exception as e:  # a worker's OSError arrives wrapped; one line says what failed
        totals["errors"] += 1
        totals["first_error"] = str(e).splitlines()[-1][:200]
    totals["seconds"] = time.monotonic() - started
    totals["cpu_ms"] = int(time.process_time() * 1000)  # the main process only (not its workers)
    totals["complete"] = totals["files"] == len(sampler)
    print(json.dumps(totals))
    return 0


if __name__ == "__main__":
    sys.exit(main())
