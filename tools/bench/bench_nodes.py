#!/usr/bin/env python3
"""N nodes reading one dataset from one object store, on one machine: bytes from the store, from peers and from
each node's own tiers per epoch, and files/s per node — today (every node alone), with a cluster of caching
proxies (nginx or Varnish) in front of the store, and with blockfs's peer tier.

    sudo .venv/bin/python tools/bench/bench_nodes.py [--nodes 4] [--files 2000] [--budget 0.3] [--epochs 3]
        [--node-mbit 1000] [--store-mbit 100] [--modes none,nginx,varnish,peers,memref] [--blockfs PATH]
        [--no-kill] [--no-sigv4] [--reader order|ddp] [--json FILE]
    python tools/bench/bench_nodes.py --table FILE   # an earlier run's --json as a Markdown table

The machine (tools/bench/helpers/cluster_net.py; root, ``ip``, ``tc``, ``nsenter``): every node is a network
namespace with its own link to the store (an S3 server, moto, in a namespace of its own; each node's link
capped with ``tbf`` at ``--store-mbit``) and a link to a fabric bridge where the nodes reach each other
(``--node-mbit``, by default 10x the store's).  Each node's ``blockfs mount`` runs in its namespace (``nsenter
--net``, so the FUSE mount stays visible here) with the same memory budget (``--budget`` x the dataset),
``--open-mode none`` (every read reaches blockfs), ``--no-retain`` and ``--nodes N --node-rank k`` (prefill and
read-ahead keep to the node's part, as the issue's figures were measured; ``--no-node-split`` drops them).  Each
epoch, every node reads — all at once, ``--threads`` readers each, in separate processes — exactly the
samples its rank gets from the loader's **global** order (``block_shuffled_order`` with ``world_size = N``),
first announcing that epoch's blocks to its mount as ``BlockLoader`` does (``--no-announce``: not);
with ``--reader ddp``, what an unmodified DDP script reads instead (tools/bench/helpers/ddp_reader.py: torch's
``DistributedSampler`` over the mount's tree, ImageFolder's listing, ``--threads`` DataLoader workers).

Modes (``--modes``), each in turn in the same run:

* ``none``: today — each mount fetches what it lacks from the store;
* ``nginx``: each node also runs nginx (tools/bench/helpers/nginx_cluster.py: a front on its loopback, where
  the mount's S3 endpoint points, hashing each object to one owner node's ``proxy_cache``); installed by
  tools/bench/bench_nodes_setup.sh;
* ``varnish``: the same with Varnish (tools/bench/helpers/varnish_cluster.py: the shard director, a health
  probe per owner);
* ``peers``: blockfs's peer tier (``--peers`` every node's fabric address, ``--peer-rank k``, the secret in
  ``BLOCKFS_PEER_SECRET``), run with ``--blockfs`` (skipped, saying so, when that build has no ``--peers``);
* ``memref``: the reference — every node's budget holds the whole dataset; its warm epochs' files/s is what
  the goal "files/s per node from epoch 2 >= 0.8x the node with the dataset in memory" compares with (under
  the same load: four nodes reading at once on one machine).

Per mode and epoch: bytes the store sent, whole cluster (payload: the mounts' remote counters, or for
nginx its owners' ``$upstream_bytes_received``; and frames on the store's links, ``wire``), bytes the
nodes got from peers, each node's memory hit rate (its own tiers) and files/s.  Epoch 1 counts from the
mounts' start (index, prefill).  After the measured epochs, ``nginx`` and ``peers`` run one more with the last
node killed (its nginx or varnishd, or its mount) half a second in: do the other nodes' reads go on?  ``--no-kill`` skips it.

``--sigv4`` (default on): a second moto that checks every request's SigV4 signature (its
``INITIAL_NO_AUTH_ACTION_COUNT``; an IAM user and key made first) and one node reading a small dataset from it
directly, through nginx passing the client's ``Host`` on, through nginx with its default ``Host``, and
through nginx's ``slice`` module; then a request without credentials to the cache (a leak, if it answers with
the block) and to the store.

Every namespace, mount, nginx and server is removed on the way out, also after an error, Ctrl-C or SIGTERM.
The machine is shared and small: read the figures as ratios within one run.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import secrets
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import bench_remote as br  # moto, the data, the mount helpers
import numpy as np
from helpers import HELPERS, ROOT
from helpers import nginx_cluster as ngx
from helpers import varnish_cluster as vcache
from helpers.benchutil import started_server, stop_process
from helpers.cluster_net import Cluster

import blockfs
from blockfs.client import read_stats
from blockfs.loader.order import BlockLayout, batch_class_entropy, block_shuffled_order, global_shuffled_order
from blockfs.sizes import parse_size

MiB = 1 << 20
BUCKET = "bench-nodes"
MOTO_PORT = 9750
SIGV4_PORT = 9751
MODES = ("none", "nginx", "varnish", "peers", "memref")
PEER_PORT = 8470


# --- orders ------------------------------------------------------------------------------------------
def rank_names(
    packed: Path, nodes: int, partition: str, seed: int, epoch: int
) -> tuple[list[list[str]], list[list[int]]]:
    """The paths each node's (single) rank reads in ``epoch``, in the loader's order, and the blocks it
    announces to its mount (as ``BlockLoader`` does at an epoch's start: each block once, first needed first)."""
    with blockfs.open_dataset(packed) as ds:
        a = ds.index.arrays
        layout = BlockLayout(a["block_offsets"], a["block_files"])
        node_of = None
        if partition == "node" and nodes > 1:
            from blockfs.core.partition import partition_blocks

            node_of = partition_blocks(layout.block_sizes, nodes, seed=seed, block_bytes=a["block_sizes"])
        orders = [
            block_shuffled_order(
                layout,
                seed=seed,
                epoch=epoch,
                rank=r,
                world_size=nodes,
                nodes=nodes if partition == "node" else 1,
                node_of_block=node_of,
            )
            for r in range(nodes)
        ]
        names = [[os.fsdecode(ds.path_of(int(e))) for e in order] for order in orders]
        blocks = []
        for order in orders:
            of = a["block"][np.asarray(order)]
            _, first = np.unique(of, return_index=True)
            blocks.append(of[np.sort(first)].tolist())
        return names, blocks


def entropies(packed: Path, nodes: int, seed: int, batch: int) -> dict[str, float]:
    """Mean per-batch class entropy of rank 0's order, for both partitions and a global shuffle."""
    with blockfs.open_dataset(packed) as ds:
        a = ds.index.arrays
        layout = BlockLayout(a["block_offsets"], a["block_files"])
        labels = np.maximum(a["label"].astype(np.int64), 0)
        out = {}
        for partition in ("global", "node"):
            order = block_shuffled_order(
                layout, seed=seed, epoch=1, rank=0, world_size=nodes, nodes=nodes if partition == "node" else 1
            )
            out[partition] = batch_class_entropy(order, labels, batch)
        shuffled = layout.block_files[global_shuffled_order(layout.n_files, seed=seed, epoch=1)]
        out["global shuffle"] = batch_class_entropy(shuffled, labels, batch)
        return out


# --- processes in the nodes ----------------------------------------------------------------------------
def moto_command(port: int) -> list[str]:
    return [sys.executable, "-c", br.MOTO_MAIN, "-H", "0.0.0.0", "-p", str(port)]


def start_mount(
    cluster: Cluster, node: int, exe: str, url: str, mnt: Path, args: list[str], env: dict[str, str]
) -> tuple[subprocess.Popen, Path, int]:
    """``blockfs mount URL MNT --foreground`` started in node ``node``'s network namespace (the mount itself
    visible here): the server, its log and where this start's lines begin in it."""
    mnt.mkdir(parents=True, exist_ok=True)
    log = mnt.parent / f"{mnt.name}.log"
    command = cluster.command(node, exe, "mount", url, str(mnt), "--foreground", "--log", str(log), *args)
    with open(log, "ab") as out:
        offset = out.tell()
        proc = subprocess.Popen(
            command, stdin=subprocess.DEVNULL, stdout=out, stderr=out, env=env, start_new_session=True
        )
    return proc, log, offset


def stop_mount(mnt: Path, proc: subprocess.Popen) -> None:
    """Unmount (lazily if it must be) and reap the server."""
    if br.is_mounted(mnt):
        try:
            br.unmount(mnt)
        except Exception:  # a dead server's mount: detach it lazily
            subprocess.run(["umount", "-l", str(mnt)], check=False, capture_output=True)
    stop_process(proc)
    if br.is_mounted(mnt):
        subprocess.run(["umount", "-l", str(mnt)], check=False, capture_output=True)


@contextlib.contextmanager
def node_mount(
    cluster: Cluster, node: int, exe: str, url: str, mnt: Path, args: list[str], env: dict[str, str]
) -> Iterator[subprocess.Popen]:
    """:func:`start_mount` for the duration of a ``with``, once mounted; always :func:`stop_mount` after."""
    proc, log, offset = start_mount(cluster, node, exe, url, mnt, args, env)
    try:
        br.wait_until_mounted(mnt, proc, 600, str(log), offset)
        yield proc
    finally:
        stop_mount(mnt, proc)


def start_readers(
    mounts: list[Path],
    names: list[list[str]],
    work: Path,
    threads: int,
    ddp: tuple[int, int] | None = None,
    announce: list[list[int]] | None = None,
    cluster: Cluster | None = None,
) -> list[subprocess.Popen]:
    """One reader process per node, all at once: tools/bench/helpers/storage_reader.py reading ``names[k]``
    (first announcing ``announce[k]``'s blocks to its mount, as the loader does: then in node ``k``'s network
    namespace of ``cluster``, where the mount's announcement socket is),
    or with ``ddp`` (epoch, seed) an unmodified DDP script's pipeline (helpers/ddp_reader.py: torch's
    ``DistributedSampler`` over the mount's tree, ``threads`` DataLoader workers)."""
    procs = []
    for k, (mnt, part) in enumerate(zip(mounts, names, strict=True)):
        if ddp is not None:
            command = [sys.executable, str(HELPERS / "ddp_reader.py"), str(mnt), "--rank", str(k)]
            command += ["--world-size", str(len(mounts)), "--epoch", str(ddp[0]), "--seed", str(ddp[1])]
            command += ["--workers", str(threads)]
        else:
            order = work / f"order-{k}.txt"
            order.write_text("\n".join(part) + "\n")
            command = [sys.executable, str(HELPERS / "storage_reader.py"), str(mnt), str(order)]
            command += ["--threads", str(threads)]
            if announce is not None:
                blocks = work / f"blocks-{k}.txt"
                blocks.write_text("\n".join(map(str, announce[k])) + "\n")
                command += ["--announce", str(blocks)]
                if cluster is not None:  # an abstract socket is seen only in its network namespace
                    command = cluster.command(k, *command)
        procs.append(subprocess.Popen(command, stdout=subprocess.PIPE, text=True))
    return procs


def reader_results(procs: list[subprocess.Popen], victim: int | None = None, grace: float = 3.0) -> list[dict]:
    """Each reader's result; ``victim``'s (a killed node, whose reads may wait out the store's timeouts) is
    given ``grace`` seconds after the others end, then stopped."""
    for k, proc in enumerate(procs):
        if k != victim:
            proc.wait()
    if victim is not None:
        try:
            procs[victim].wait(grace)
        except subprocess.TimeoutExpired:
            procs[victim].kill()
    out = []
    for proc in procs:
        stdout, _ = proc.communicate()
        lines = stdout.strip().splitlines()
        out.append(
            json.loads(lines[-1]) if lines else {"files": 0, "bytes": 0, "errors": -1, "seconds": 0.0, "stopped": True}
        )
    return out


# --- counters ------------------------------------------------------------------------------------------
def peer_bytes(stats: dict) -> int:
    """Block bytes a mount got from peers so far, wherever its statistics put them (``storage.peers`` or
    ``peers``: a ``bytes`` figure, or one per peer)."""
    storage = stats.get("storage") or {}
    for where in (storage, stats):
        found = where.get("peers") or where.get("peer")
        if isinstance(found, dict):
            if isinstance(found.get("bytes"), int):
                return found["bytes"]
            per = found.get("per_peer") or found.get("by_peer") or found
            return sum(int(v.get("bytes", 0)) for v in per.values() if isinstance(v, dict))
    return 0


def cpu_ms(pid: int, system_only: bool = False) -> int:
    """The CPU time (user + system, all threads; or system alone) process ``pid`` has used, in ms; 0 when it
    is gone."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0
    return (int(fields[12]) + (0 if system_only else int(fields[11]))) * 1000 // os.sysconf("SC_CLK_TCK")


def node_counters(mnt: Path, pid: int) -> dict[str, int]:
    try:
        s = read_stats(mnt)
    except OSError:  # a killed node
        return {}
    c, remote = s["counters"], (s.get("storage") or {}).get("remote", {})
    disk = (s.get("storage") or {}).get("disk_tier", {})
    return {
        "remote_bytes": remote.get("bytes", 0),
        "remote_failures": remote.get("failures", 0),
        "peer_bytes": peer_bytes(s),
        "served": c["bytes_served"],
        "files_served": c["files_served"],
        "file_hits": c["file_hits"],
        "below_memory": c["block_bytes_read"] + c["file_bytes_read"],
        "disk_bytes": disk.get("disk_bytes", 0),
        "window_loads": c.get("window_loads", 0),  # other nodes' blocks read whole (the cache's window)
        "window_ahead_loads": c.get("window_ahead_loads", 0),  # of those, fetched ahead (announced)
        "load_waits": c.get("load_waits", 0),  # reads that waited for a block being loaded
        "file_reads": c.get("file_reads", 0),  # files read alone (each one request to a peer, or the store)
        "window_bytes": (s.get("cache") or {}).get("window", {}).get("capacity_bytes", 0),
        "mount_cpu_ms": cpu_ms(pid),  # its mount server's CPU: serving its own reads and its peers'
        "mount_sys_ms": cpu_ms(pid, system_only=True),  # of which in the kernel (FUSE, the network)
    }


def diff(after: dict[str, int], before: dict[str, int]) -> dict[str, int]:
    return {k: v - before.get(k, 0) for k, v in after.items()}


# --- one mode ------------------------------------------------------------------------------------------
def mode_plan(mode: str, args: argparse.Namespace, cluster: Cluster, dataset: int) -> tuple[str, list[list[str]]]:
    """The blockfs executable and each node's mount arguments."""
    n = args.nodes
    budget = int(args.budget * dataset)
    common = ["--open-mode", "none", "--no-retain", "--partition-seed", str(args.seed)]
    if mode == "memref":
        # --preload: the mount answers once its budget holds the dataset (prefill on a loaded machine would
        # still be running in epoch 2)
        return args.baseline_blockfs, [
            [*common, "--preload", "--cache-size", str(int(1.25 * dataset) + 16 * MiB)] for _ in range(n)
        ]
    per_node = []
    for k in range(n):
        a = [*common, "--cache-size", str(budget)]
        if args.node_split:
            a += ["--nodes", str(n), "--node-rank", str(k)]
        if mode == "peers":
            a += ["--peers", ",".join(f"{addr}:{PEER_PORT}" for addr in cluster.fabric_address), "--peer-rank", str(k)]
        per_node.append(a)
    return (args.blockfs if mode == "peers" else args.baseline_blockfs), per_node


def run_mode(
    mode: str,
    args: argparse.Namespace,
    cluster: Cluster,
    url: str,
    packed: Path,
    work: Path,
    dataset: int,
    s3: dict[str, str],
) -> dict:
    n = args.nodes
    exe, mount_args = mode_plan(mode, args, cluster, dataset)
    base_env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")} | s3
    out: dict = {"mode": mode, "blockfs": exe, "mount_args": mount_args[0], "epochs": []}
    with contextlib.ExitStack() as stack:
        nginx_prefixes: list[Path] = []
        nginx_procs: list[subprocess.Popen] = []
        envs = []
        for k in range(n):
            env = dict(base_env, AWS_ENDPOINT_URL=f"http://{cluster.store_address[k]}:{MOTO_PORT}")
            if mode == "nginx":
                prefix = work / f"nginx-{k}"
                text = ngx.config(
                    prefix,
                    cluster.fabric_address[k],
                    cluster.fabric_address,
                    f"{cluster.store_address[k]}:{MOTO_PORT}",
                    int(args.budget * dataset),
                    slice_bytes=args.nginx_slice,
                )
                nginx_procs.append(stack.enter_context(ngx.started(cluster.command(k), prefix, text)))
                nginx_prefixes.append(prefix)
                env["AWS_ENDPOINT_URL"] = f"http://127.0.0.1:{ngx.FRONT_PORT}"
            if mode == "varnish":
                prefix = work / f"varnish-{k}"
                text = vcache.vcl(cluster.fabric_address, f"{cluster.store_address[k]}:{MOTO_PORT}")
                nginx_procs.append(
                    stack.enter_context(
                        vcache.started(
                            cluster.command(k), prefix, text, cluster.fabric_address[k], int(args.budget * dataset)
                        )
                    )
                )
                nginx_prefixes.append(prefix)
                env["AWS_ENDPOINT_URL"] = f"http://127.0.0.1:{vcache.FRONT_PORT}"
            if mode == "peers":
                env["BLOCKFS_PEER_SECRET"] = args.peer_secret
            envs.append(env)
        if mode == "nginx":
            out["config_node0"] = (nginx_prefixes[0] / "nginx.conf").read_text()
            wait_listening(cluster, nginx_prefixes)
            stack.callback(show_nginx_errors, nginx_prefixes)
        if mode == "varnish":
            out["config_node0"] = (nginx_prefixes[0] / "cluster.vcl").read_text()
            wait_listening(cluster, nginx_prefixes, vcache.FRONT_PORT)
        wire_before = cluster.store_sent()
        mounts = [work / f"mnt-{mode}-{k}" for k in range(n)]
        started = []
        for k in range(n):  # all at once: each mount's start (and prefill, or preload) beside the others'
            started.append(start_mount(cluster, k, exe, url, mounts[k], mount_args[k], envs[k]))
            stack.callback(stop_mount, mounts[k], started[-1][0])
        for mnt, (proc, log, offset) in zip(mounts, started, strict=True):
            br.wait_until_mounted(mnt, proc, 600, str(log), offset)
        servers = [proc for proc, _, _ in started]
        before = [dict.fromkeys(("remote_bytes",), 0) for _ in range(n)]  # epoch 1 counts from the mounts' start
        up_before = 0
        epochs = min(args.epochs, 2) if mode == "memref" else args.epochs
        epochs += 1 if mode in ("nginx", "varnish", "peers") and args.kill else 0
        for epoch in range(epochs):
            killing = epoch == args.epochs and mode != "memref"
            names, blocks = rank_names(packed, n, args.partition, args.seed, epoch)
            if args.reader == "ddp":  # DistributedSampler's share: ceil(files / n) each, padded
                names = [[""] * -(-args.files // n) for _ in range(n)]
            procs = start_readers(
                mounts,
                names,
                work,
                args.threads,
                (epoch, args.seed) if args.reader == "ddp" else None,
                blocks if args.announce and args.reader == "order" else None,
                cluster,
            )
            for proc in procs:  # after an error or SIGTERM, before the mounts go
                stack.callback(stop_process, proc)
            if killing:
                time.sleep(0.5)
                victim = nginx_procs[-1] if mode in ("nginx", "varnish") else servers[-1]
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(victim.pid, signal.SIGKILL)
            results = reader_results(procs, n - 1 if killing else None)
            after = [node_counters(m, proc.pid) for m, proc in zip(mounts, servers, strict=True)]
            wire = cluster.store_sent()
            per_node = []
            for k in range(n):
                d = diff(after[k], before[k]) if after[k] else {}
                r = results[k]
                per_node.append(
                    {
                        "files": r["files"],
                        "expected_files": len(names[k]),
                        "errors": r["errors"],
                        "seconds": r["seconds"],
                        "files_s": r["files"] / r["seconds"] if r["seconds"] else 0.0,
                        "reader_cpu_ms": r.get("cpu_ms", 0),
                        **d,
                    }
                )
            if mode in ("nginx", "varnish"):
                count = ngx.upstream_bytes if mode == "nginx" else vcache.store_bytes
                up = sum(count(p) for p in nginx_prefixes)
                store_bytes, up_before = up - up_before, up
            else:
                store_bytes = sum(p.get("remote_bytes", 0) for p in per_node)
            out["epochs"].append(
                {
                    "epoch": epoch + 1,
                    "killed_node": n - 1 if killing else None,
                    "store_bytes": store_bytes,
                    "store_wire": sum(wire) - sum(wire_before),
                    "peer_bytes": sum(p.get("peer_bytes", 0) for p in per_node),
                    "nodes": per_node,
                }
            )
            before, wire_before = [a or b for a, b in zip(after, before, strict=True)], wire
            show_epoch(mode, out["epochs"][-1], dataset)
        if mode == "nginx":
            out["cache_statuses"] = [ngx.cache_statuses(p) for p in nginx_prefixes]
    return out


def show_nginx_errors(prefixes: list[Path]) -> None:
    for k, prefix in enumerate(prefixes):
        log = prefix / "error.log"
        lines = log.read_text(errors="replace").splitlines() if log.exists() else []
        if lines:
            print(
                f"  nginx node {k}: {len(lines)} lines in its error log; the last: {lines[-1][:300]}", file=sys.stderr
            )


def wait_listening(cluster: Cluster, prefixes: list[Path], port: int = ngx.FRONT_PORT, timeout: float = 60) -> None:
    """Until every node's cache answers on its front."""
    deadline = time.monotonic() + timeout
    for k in range(len(prefixes)):
        while (
            subprocess.run(
                cluster.command(k, "curl", "-s", "-o", "/dev/null", f"http://127.0.0.1:{port}/"), check=False
            ).returncode
            != 0
        ):
            if time.monotonic() > deadline:
                raise RuntimeError(f"node {k}'s cache did not answer on port {port} (its logs: {prefixes[k]})")
            time.sleep(0.1)


def curl_status(cluster: Cluster, node: int | None, address: str, *extra: str) -> str:
    """``HTTP-status bytes`` of an unsigned GET of ``address`` from node ``node``."""
    done = subprocess.run(
        cluster.command(
            node,
            "curl",
            "-s",
            "-o",
            "/dev/null",
            "-w",
            "%{http_code} %{size_download}",
            "--max-time",
            "10",
            *extra,
            address,
        ),
        capture_output=True,
        text=True,
        check=False,
    )
    return done.stdout.strip()


def show_epoch(mode: str, e: dict, dataset: int) -> None:
    rates = [p["files_s"] for p in e["nodes"]]
    errors = sum(max(0, p["errors"]) for p in e["nodes"])
    hits = [p["file_hits"] / p["files_served"] if p.get("files_served") else float("nan") for p in e["nodes"]]
    note = ""
    if e["killed_node"] is not None:
        dead = e["nodes"][e["killed_node"]]
        alive = [p for k, p in enumerate(e["nodes"]) if k != e["killed_node"]]
        errors = sum(max(0, p["errors"]) for p in alive)
        note = (
            f" (the others'); node {e['killed_node']} killed 0.5 s in: it read {dead['files']}/{dead['expected_files']}"
            f", the others {sum(p['files'] for p in alive)}/{sum(p['expected_files'] for p in alive)}"
        )
    print(
        f"  {mode:7} epoch {e['epoch']}: store {e['store_bytes'] / dataset:5.2f} D (wire {e['store_wire'] / dataset:5.2f} D), "
        f"peers {e['peer_bytes'] / dataset:5.2f} D, memory hits {min(hits):.2f}-{max(hits):.2f}, files/s per node "
        + " ".join(f"{r:6.0f}" for r in rates)
        + f", errors {errors}{note}; CPU per file read: mounts {cpu_per_file(e, 'mount_cpu_ms'):.2f} ms, "
        f"readers {cpu_per_file(e, 'reader_cpu_ms'):.2f} ms",
        flush=True,
    )


def cpu_per_file(e: dict, key: str) -> float:
    """The whole cluster's CPU of one kind (``key``: the mounts' or the readers') per file read, in ms: on a
    machine whose cores the nodes share, files/s follow it."""
    files = sum(p["files"] for p in e["nodes"])
    return sum(p.get(key, 0) for p in e["nodes"]) / files if files else float("nan")


def table(results: dict) -> str:
    """The results as a Markdown table: per mode and epoch, store and peer bytes as multiples of D, files/s
    per node (median, min-max), the memory reference's warm median beside each."""
    d = results["dataset_bytes"]
    ref = results["modes"].get("memref", {}).get("epochs", [])
    ref_rate = float(np.median([p["files_s"] for p in ref[-1]["nodes"]])) if ref else None
    lines = [
        "| mode | epoch | store (x D) | wire (x D) | from peers (x D) | memory hits | files/s per node: median (min-max) |"
        + (" x memref |" if ref_rate else "")
        + " CPU ms per file: mounts, readers |",
        "|---|---|---|---|---|---|---|" + ("---|" if ref_rate else "") + "---|",
    ]
    for mode, m in results["modes"].items():
        for e in m["epochs"]:
            alive = [p for k, p in enumerate(e["nodes"]) if k != e["killed_node"]]
            rates = [p["files_s"] for p in alive]
            hits = [p["file_hits"] / p["files_served"] for p in alive if p.get("files_served")]
            what = f"{e['epoch']}" + (
                f" (node {e['killed_node']} killed; the others)" if e["killed_node"] is not None else ""
            )
            row = (
                f"| {mode} | {what} | {e['store_bytes'] / d:.2f} | {e['store_wire'] / d:.2f} | {e['peer_bytes'] / d:.2f} "
                f"| {min(hits):.2f}-{max(hits):.2f} | {np.median(rates):.0f} ({min(rates):.0f}-{max(rates):.0f}) |"
            )
            if ref_rate:
                row += f" {np.median(rates) / ref_rate:.2f} |"
            cpu = [cpu_per_file(e, k) for k in ("mount_cpu_ms", "reader_cpu_ms")]
            row += " – |" if not any(cpu) else f" {cpu[0]:.2f}, {cpu[1]:.2f} |"  # (a run from before they were counted)
            lines.append(row)
    return "\n".join(lines)


# --- main ----------------------------------------------------------------------------------------------
def has_peer_flags(exe: str) -> bool:
    done = subprocess.run([exe, "mount", "--help"], capture_output=True, text=True, check=False)
    return "--peers" in done.stdout


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--nodes", type=int, default=4)
    p.add_argument("--files", type=int, default=2000)
    p.add_argument("--classes", type=int, default=20)
    p.add_argument("--block-size", default="1MiB")
    p.add_argument("--budget", type=float, default=0.3, help="each node's memory, as a share of the dataset")
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=4, help="reader threads per node")
    p.add_argument("--partition", choices=("global", "node"), default="global", help="the readers' order")
    p.add_argument(
        "--reader",
        choices=("order", "ddp"),
        default="order",
        help="order: each node reads its rank's share of the loader's order; ddp: an unmodified DDP script "
        "(torch's DistributedSampler over the mount's tree, --threads DataLoader workers)",
    )
    p.add_argument(
        "--no-announce",
        dest="announce",
        action="store_false",
        help="the order reader does not announce its epoch's blocks to its mount first (the loader does)",
    )
    p.add_argument(
        "--no-node-split",
        dest="node_split",
        action="store_false",
        help="mount without --nodes/--node-rank (prefill then loads the same blocks on every node)",
    )
    p.add_argument("--node-mbit", type=int, default=1000)
    p.add_argument("--store-mbit", type=int, default=None, help="each node's link to the store (default node/10)")
    p.add_argument("--modes", default=",".join(MODES))
    p.add_argument("--blockfs", default=str(ROOT / ".venv" / "bin" / "blockfs"), help="the blockfs run in peers mode")
    p.add_argument("--nginx-slice", type=parse_size, default=0, help="nginx's slice size (0: whole objects)")
    p.add_argument("--no-kill", dest="kill", action="store_false")
    p.add_argument("--no-sigv4", dest="sigv4", action="store_false")
    p.add_argument("--batch", type=int, default=64, help="batch size for the entropy figures")
    p.add_argument("--json")
    p.add_argument("--table", metavar="JSON", help="print the Markdown table of an earlier run's --json, and stop")
    args = p.parse_args(argv)
    if args.table:
        print(table(json.loads(Path(args.table).read_text())))
        return 0
    args.store_mbit = args.store_mbit or max(1, args.node_mbit // 10)
    args.baseline_blockfs = str(ROOT / ".venv" / "bin" / "blockfs")
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    if bad := [m for m in modes if m not in MODES]:
        p.error(f"--modes: {', '.join(bad)} unknown (choose from {', '.join(MODES)})")
    for mode, exe in (("nginx", ngx.NGINX), ("varnish", vcache.VARNISHD)):
        if mode in modes and not os.access(exe, os.X_OK):
            p.error(f"{exe} is missing: run tools/bench/bench_nodes_setup.sh")
    if "peers" in modes and not has_peer_flags(args.blockfs):
        print(f"peers: skipped ({args.blockfs} mount has no --peers: give --blockfs a build with the peer tier)")
        modes.remove("peers")
    args.peer_secret = secrets.token_hex(16)
    started = time.monotonic()
    results: dict = {
        "command": " ".join([sys.executable, *sys.argv]),
        "args": {k: v for k, v in vars(args).items() if k != "peer_secret"},
        "loadavg_start": os.getloadavg(),
        "modes": {},
    }
    with tempfile.TemporaryDirectory(prefix="bench-nodes-") as tmp, br.stopped_by_sigterm():
        work = Path(tmp)
        os.chmod(work, 0o711)  # nginx's workers (www-data) reach their cache under it
        with Cluster(args.nodes, args.node_mbit, args.store_mbit) as cluster, contextlib.ExitStack() as stack:
            stack.enter_context(
                started_server(
                    "moto's S3 server",
                    cluster.command(None, *moto_command(MOTO_PORT)),
                    MOTO_PORT,
                    work / "moto.log",
                    host=cluster.store_host_address,
                )
            )
            s3 = br.s3_env(f"http://{cluster.store_host_address}:{MOTO_PORT}", given=False)
            os.environ.update(s3)
            br.ensure_bucket(br.boto3_client(), BUCKET)
            br.make_tree(work / "src", args.files, 10 << 10, 100 << 10, args.classes, args.seed)
            packed = work / "packed"
            blockfs.pack(work / "src", packed, block_size=parse_size(args.block_size), fsync=False)
            url = f"s3://{BUCKET}/ds"
            blockfs.pack(work / "src", url, block_size=parse_size(args.block_size), fsync=False)
            with blockfs.open_dataset(packed) as ds:
                dataset = int(ds.metadata["block_bytes"])
            results |= {"dataset_bytes": dataset, "budget_bytes": int(args.budget * dataset), "files": args.files}
            print(
                f"dataset D = {dataset / MiB:.1f} MiB in {args.files} files; {args.nodes} nodes, each budget "
                f"{args.budget:.0%} of D; links: store {args.store_mbit} Mbit/s per node, nodes {args.node_mbit} "
                f"Mbit/s; {args.epochs} epochs, "
                f"{'DistributedSampler' if args.reader == 'ddp' else 'global'} order; store bytes for the whole cluster",
                flush=True,
            )
            for mode in modes:
                results["modes"][mode] = run_mode(mode, args, cluster, url, packed, work, dataset, s3)
            if args.sigv4 and os.access(ngx.NGINX, os.X_OK):
                results["sigv4"] = sigv4_check(args, cluster, work)
        with contextlib.suppress(ValueError):  # fewer samples than a batch
            results["entropy"] = entropies(packed, args.nodes, args.seed, args.batch)
    results["seconds"] = time.monotonic() - started
    if results["modes"]:
        print(table(results))
    print(f"{results['seconds']:.0f} s")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))
    return 0


SIGV4_VARIANTS = (
    ("direct (no cache)", None),
    ("nginx, client's Host passed on", {"keep_host": True}),
    ("nginx, default Host (the upstream's name)", {"keep_host": False}),
    ("nginx + slice 1 MiB, client's Host passed on", {"keep_host": True, "slice_bytes": MiB}),
    ("nginx, client's Host and Range passed on", {"keep_host": True, "pass_range": True}),
    ("varnish (the shard VCL as benchmarked)", "varnish"),
)


def sigv4_check(args: argparse.Namespace, cluster: Cluster, work: Path) -> dict:
    """Node 0 reads a small dataset from a moto that checks every request's SigV4 signature: directly and
    through nginx configured three ways; then unsigned GETs of a block from the cache and from the store."""
    import boto3

    out: dict = {"variants": []}
    env = dict(os.environ, INITIAL_NO_AUTH_ACTION_COUNT="3", MOTO_S3_DEFAULT_KEY_BUFFER_SIZE=str(256 * MiB))
    with started_server(
        "moto (signatures checked)",
        cluster.command(None, *moto_command(SIGV4_PORT)),
        SIGV4_PORT,
        work / "moto-sigv4.log",
        env=env,
        host=cluster.store_host_address,
    ):
        endpoint = f"http://{cluster.store_host_address}:{SIGV4_PORT}"
        iam = boto3.client(
            "iam",
            endpoint_url=endpoint,
            region_name=br.REGION,
            aws_access_key_id="bench",
            aws_secret_access_key="bench-secret",
        )
        iam.create_user(UserName="bench")  # the three actions moto lets through unchecked
        key = iam.create_access_key(UserName="bench")["AccessKey"]
        iam.put_user_policy(
            UserName="bench",
            PolicyName="s3",
            PolicyDocument=json.dumps(
                {"Version": "2012-10-17", "Statement": [{"Effect": "Allow", "Action": "s3:*", "Resource": "*"}]}
            ),
        )
        creds = {
            "AWS_ACCESS_KEY_ID": key["AccessKeyId"],
            "AWS_SECRET_ACCESS_KEY": key["SecretAccessKey"],
            "AWS_REGION": br.REGION,
            "AWS_DEFAULT_REGION": br.REGION,
        }
        s3 = boto3.client(
            "s3",
            endpoint_url=endpoint,
            region_name=br.REGION,
            aws_access_key_id=key["AccessKeyId"],
            aws_secret_access_key=key["SecretAccessKey"],
        )
        s3.create_bucket(Bucket="bench-sig")
        br.make_tree(work / "sig-src", 60, 10 << 10, 100 << 10, 4, args.seed)
        blockfs.pack(work / "sig-src", work / "sig-packed", block_size=MiB, fsync=False)
        br.upload_tree(s3, "bench-sig", "ds", work / "sig-packed")  # boto3's signatures (moto checks them alike)
        wrong = boto3.client(
            "s3",
            endpoint_url=endpoint,
            region_name=br.REGION,
            aws_access_key_id=key["AccessKeyId"],
            aws_secret_access_key="wrong",
        )
        try:
            wrong.get_object(Bucket="bench-sig", Key="ds/blockfs.json")["Body"].read()
            out["wrong_secret_refused"] = False
        except Exception as e:  # botocore's ClientError
            out["wrong_secret_refused"] = str(e)[:100]
        # (moto 5.2's check of a request with a query string, a LIST, fails even when it is right: none here)
        largest = max((p for p in (work / "sig-packed").rglob("*") if p.is_file()), key=lambda p: p.stat().st_size)
        block = f"ds/{largest.relative_to(work / 'sig-packed').as_posix()}"
        names = [str(p.relative_to(work / "sig-src")) for p in sorted((work / "sig-src").rglob("*.bin"))]
        order = work / "sig-order.txt"
        order.write_text("\n".join(names) + "\n")
        direct = f"http://{cluster.store_address[0]}:{SIGV4_PORT}"
        for i, (label, engine) in enumerate(SIGV4_VARIANTS):
            row: dict = {"variant": label}
            nginx = engine if isinstance(engine, dict) else None
            base = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
            mount_env = dict(base, **creds, AWS_ENDPOINT_URL=direct)
            with contextlib.ExitStack() as stack:
                if nginx is not None:
                    prefix = work / f"sig-nginx-{i}"
                    text = ngx.config(
                        prefix,
                        cluster.fabric_address[0],
                        [cluster.fabric_address[0]],
                        f"{cluster.store_address[0]}:{SIGV4_PORT}",
                        64 * MiB,
                        **nginx,
                    )
                    stack.enter_context(ngx.started(cluster.command(0), prefix, text))
                    wait_listening(cluster, [prefix])
                    mount_env["AWS_ENDPOINT_URL"] = f"http://127.0.0.1:{ngx.FRONT_PORT}"
                if engine == "varnish":
                    prefix = work / f"sig-varnish-{i}"
                    text = vcache.vcl([cluster.fabric_address[0]], f"{cluster.store_address[0]}:{SIGV4_PORT}")
                    stack.enter_context(
                        vcache.started(cluster.command(0), prefix, text, cluster.fabric_address[0], 64 * MiB)
                    )
                    wait_listening(cluster, [prefix], vcache.FRONT_PORT)
                    mount_env["AWS_ENDPOINT_URL"] = f"http://127.0.0.1:{vcache.FRONT_PORT}"
                mnt = work / f"sig-mnt-{i}"
                try:
                    stack.enter_context(
                        node_mount(
                            cluster,
                            0,
                            args.baseline_blockfs,
                            "s3://bench-sig/ds",
                            mnt,
                            ["--open-mode", "none", "--cache-size", str(64 * MiB)],
                            mount_env,
                        )
                    )
                except Exception as e:
                    row["mount"] = "failed: " + str(e).splitlines()[0][:200]
                else:
                    row["mount"] = "ok"
                    done = subprocess.run(
                        [sys.executable, str(HELPERS / "storage_reader.py"), str(mnt), str(order)],
                        capture_output=True,
                        text=True,
                        check=False,
                    )
                    row["read"] = json.loads(done.stdout.strip().splitlines()[-1])
                if nginx is not None:
                    row["store_statuses"] = upstream_statuses(prefix)
                    front = f"http://127.0.0.1:{ngx.FRONT_PORT}/bench-sig"
                    row["unsigned_from_cache"] = {
                        "block": curl_status(cluster, 0, f"{front}/{block}"),
                        "metadata": curl_status(cluster, 0, f"{front}/ds/blockfs.json"),
                    }
                    asked = ngx.cached_range(prefix)
                    if asked:  # a range the cache holds apart, asked for again without credentials
                        row["unsigned_from_cache"][f"{asked[0]} {asked[1]}"] = curl_status(
                            cluster, 0, f"http://127.0.0.1:{ngx.FRONT_PORT}{asked[0]}", "-H", f"Range: {asked[1]}"
                        )
                if engine == "varnish":
                    front = f"http://127.0.0.1:{vcache.FRONT_PORT}/bench-sig"
                    row["unsigned_from_cache"] = {
                        "block": curl_status(cluster, 0, f"{front}/{block}"),
                        "metadata": curl_status(cluster, 0, f"{front}/ds/blockfs.json"),
                    }
            out["variants"].append(row)
            print(
                f"  sigv4: {label}: mount {row['mount']}; read {row.get('read', {}).get('files', 0)}/{len(names)} "
                f"files, {row.get('read', {}).get('errors', '-')} errors; store answered {row.get('store_statuses', '-')}; "
                f"an unsigned GET of a block from the cache: {row.get('unsigned_from_cache', '-')}",
                flush=True,
            )
        out["unsigned_from_store"] = curl_status(cluster, 0, f"{direct}/bench-sig/{block}")
        out["block"] = block
        print(
            f"  sigv4: a wrong secret refused by the store: {out['wrong_secret_refused']}; an unsigned GET of the "
            f"block from the store: {out['unsigned_from_store']} (HTTP status, bytes)",
            flush=True,
        )
    return out


def upstream_statuses(prefix: Path) -> dict[str, int]:
    """How often the store answered each HTTP status to this node's owner cache."""
    out: dict[str, int] = {}
    log = prefix / "owner.log"
    for line in log.read_text(errors="replace").splitlines() if log.exists() else []:
        status = line.rsplit("st=", 1)[-1].strip()
        out[status] = out.get(status, 0) + 1
    return out


if __name__ == "__main__":
    sys.exit(main())
