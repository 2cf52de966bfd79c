"""The ranks of the multi-node test (tests/test_multinode.py): torchrun's environment for each, a gloo
process group, a BlockLoader over its node's mount; after each epoch, local rank 0 records the mount's
remote bytes.

Run as ``python multinode_rank.py PARTITION EPOCHS OUT_DIR MOUNT0 MOUNT1``, MASTER_PORT in the environment:
it starts the 4 ranks (2 a node) as forked children, after importing torch once here (each rank
importing it anew cost ~3.5 s of CPU here: most of the test's), and exits 0 only if every rank did.
Rank ``r`` writes ``OUT_DIR/rank-r.json``.
"""

from __future__ import annotations

import ctypes
import json
import os
import signal
import sys
import traceback

import torch.distributed as dist

from blockfs.client import read_stats
from blockfs.loader.block_loader import BlockLoader

RANKS, PER_NODE = 4, 2
PR_SET_PDEATHSIG = 1  # prctl(2)


def rank_main(rank: int, mount: str, partition: str, epochs: int, out: str) -> None:
    node, local_rank = divmod(rank, PER_NODE)
    os.environ.update(
        RANK=str(rank),
        WORLD_SIZE=str(RANKS),
        LOCAL_RANK=str(local_rank),
        LOCAL_WORLD_SIZE=str(PER_NODE),
        GROUP_RANK=str(node),
        MASTER_ADDR="127.0.0.1",
    )
    dist.init_process_group("gloo")
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


def main() -> int:
    partition, epochs, out_dir, *mounts = sys.argv[1:]
    children = []
    for rank in range(RANKS):
        pid = os.fork()
        if pid == 0:  # the rank: never returns into this loop
            code = 1
            try:
                # Die with the launcher (a test that times out kills it), never left waiting at a barrier.
                ctypes.CDLL(None).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
                out = os.path.join(out_dir, f"rank-{rank}.json")
                rank_main(rank, mounts[rank // PER_NODE], partition, int(epochs), out)
                code = 0
            except BaseException:
                traceback.print_exc()
            finally:
                sys.stdout.flush()
                sys.stderr.flush()
                os._exit(code)
        children.append(pid)
    codes = {}
    while len(codes) < len(children):
        pid, status = os.wait()
        codes[pid] = os.waitstatus_to_exitcode(status)
        if codes[pid]:  # the others would wait at a barrier for it: stop them
            for other in set(children) - set(codes):
                os.kill(other, signal.SIGKILL)
    print("rank exit codes:", [codes[pid] for pid in children])
    return 0 if not any(codes.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
