"""Two "nodes" on one machine, each with its own mount of one dataset in the loopback S3 server and a
memory budget of about half the dataset, two ranks each (4 processes, gloo).  With partition="node" each
mount fetches ~nothing from the store from epoch 2 on; with "global" each fetches a large share every
epoch.  Every epoch still yields every sample to some rank, every rank the same count."""

from __future__ import annotations

import itertools
import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from capability import has_fuse, require
from mountutil import mounted
from treeutil import make_class_tree

import blockfs

HERE = Path(__file__).resolve().parent
EPOCHS = 3


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_ranks(mounts: list[Path], partition: str, tmp_path: Path) -> list[dict]:
    """The 4 ranks' results (2 a node, node n on ``mounts[n]``), as tests/multinode_rank.py writes them."""
    out = tmp_path / f"ranks-{partition}"
    out.mkdir()
    env = dict(
        os.environ,
        MASTER_PORT=str(free_port()),
        PYTHONPATH=os.pathsep.join([str(HERE.parent), os.environ.get("PYTHONPATH", "")]),
    )
    command = [sys.executable, str(HERE / "multinode_rank.py"), partition, str(EPOCHS), str(out), *map(str, mounts)]
    done = subprocess.run(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, timeout=240)
    assert done.returncode == 0, done.stdout.decode(errors="replace")[-3000:]
    return [json.loads((out / f"rank-{rank}.json").read_text()) for rank in range(4)]


@pytest.mark.fuse
@pytest.mark.parametrize("partition", ["node", "global"])
def test_each_node_caches_its_own_part(s3, tmp_path, torch_module, partition):
    require(has_fuse(), "/dev/fuse")
    src = tmp_path / "src"
    make_class_tree(src, files=600, seed=6, sizes=(2000, 6000))
    url = f"s3://{s3.new_bucket()}/ds"
    blockfs.pack(src, url, files_per_block=10, fsync=False)  # 60 blocks
    with blockfs.open_dataset(url) as ds:
        dataset = int(ds.metadata["block_bytes"])
        n_files = len(ds.file_ids)
    budget = str(int(dataset * 0.6))  # about half the dataset (a node's part, with room for imbalance)
    args = ["--cache-size", budget, "--no-retain", "--open-mode", "none", "--nodes", "2", "--partition-seed", "0"]
    with (
        mounted(url, tmp_path / "mnt0", *args, "--node-rank", "0") as m0,
        mounted(url, tmp_path / "mnt1", *args, "--node-rank", "1") as m1,
    ):
        results = run_ranks([m0.path, m1.path], partition, tmp_path)
    for epoch in range(EPOCHS):
        per_rank = [r["samples"][epoch] for r in results]
        assert len({len(ids) for ids in per_rank}) == 1
        assert len(set().union(*map(set, per_rank))) == n_files
    # Bytes each mount fetched in epochs 2 and 3 (the stats are cumulative, read after each epoch).
    later = [
        [b - a for a, b in itertools.pairwise(seen)]
        for seen in (results[0]["remote_bytes"], results[2]["remote_bytes"])
    ]
    if partition == "node":  # each node's part fits its budget: nothing more to fetch
        assert max(map(max, later)) <= 0.05 * dataset, (later, dataset)
    else:  # every node reads half of all blocks, of which its budget holds ~60 %: ~0.4 of the dataset in all,
        # give or take what 60 blocks dealt at random vary by
        per_epoch = [later[0][e] + later[1][e] for e in range(EPOCHS - 1)]
        assert sum(per_epoch) / len(per_epoch) >= 0.1 * dataset, (later, dataset)


def test_plan_shows_each_nodes_part_and_refuses_a_bad_node_rank(tmp_path):
    src = tmp_path / "src"
    make_class_tree(src, files=120, seed=6, sizes=(2000, 6000))
    blockfs.pack(src, tmp_path / "packed", files_per_block=10, fsync=False)
    run = lambda *a: subprocess.run([sys.executable, "-m", "blockfs", *a], capture_output=True, text=True)  # noqa: E731
    done = run("plan", str(tmp_path / "packed"), "--cache-size", "200KiB", "--nodes", "4", "--node-rank", "3")
    assert done.returncode == 0, done.stderr
    assert "nodes:            4 (partition='node'" in done.stdout and "of node 3's bytes" in done.stdout, done.stdout
    bad = run("plan", str(tmp_path / "packed"), "--nodes", "2", "--node-rank", "2")
    assert bad.returncode == 2 and "--node-rank 2 is not one of --nodes 2" in bad.stderr
