"""One rank of the multi-node test (tests/test_multinode.py): torchrun's environment, a gloo process group,
a BlockLoader over this node's mount; after each epoch, local rank 0 records the mount's remote bytes.

Run as ``python multinode_rank.py MOUNT PARTITION EPOCHS OUT.json``; RANK, WORLD_SIZE, LOCAL_RANK,
LOCAL_WORLD_SIZE, GROUP_RANK, MASTER_ADDR and MASTER_PORT come from the environment.
"""

from __future__ import annotations

import json
import os
import sys

import torch.distributed as dist

from blockfs.client import read_stats
from blockfs.loader.block_loader import BlockLoader


def main() -> None:
    mount, partition, epochs, out = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]
    dist.init_process_group("gloo")
    local_rank = int(os.environ["LOCAL_RANK"])
    remote_bytes, samples = [], []
    with BlockLoader(mount, 16, partition=partition, device="cpu") as loader:
        for epoch in range(epochs):
            loader.set_epoch(epoch)
            ids = [i for _, _, batch in loader for i in batch.tolist()]
            samples.append(ids)
            dist.barrier()  # every rank of every node is done with the epoch
            if local_rank == 0:
                remote_bytes.append(read_stats(mount)["storage"]["remote"]["bytes"])
            dist.barrier()
    with open(out, "w") as f:
        json.dump({"remote_bytes": remote_bytes, "samples": samples}, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
