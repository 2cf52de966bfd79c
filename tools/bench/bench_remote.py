"""Benchmark a remote dataset: blockfs's tiers against one GET per file, the S3 client libraries, and part sizes.

    python tools/bench/bench_remote.py [--work DIR] [--json FILE] [--files 2000] [--min-size 10KiB] [--max-size 100KiB]
        [--block-size 4MiB] [--order random|block] [--epochs 2] [--readers 1] [--seed 0]
        [--mount] [--clients] [--parts] [--quick] [--endpoint URL]

Everything runs in one go against one S3-compatible server on loopback: moto's server, which this tool starts
in a child process (its own Python, so it does not take the GIL from the readers) and always stops, or an
existing server named by ``--endpoint`` (credentials from the standard ``AWS_*`` variables).  A seeded tree
of ``--files`` files of random bytes (sizes uniform in ``--min-size``..``--max-size``) is packed locally
(``--block-size``), and the packed dataset and the tree itself are uploaded.  Then the sections (given none
of ``--mount``, ``--clients``, ``--parts``: all three):

``--mount``: one reader (``--readers`` threads) opens, reads and closes every file, in a shuffled order
(seeded by ``(seed, epoch)``) or in ``--order block`` (the order the files are stored in blocks), for
``--epochs`` epochs, through ``blockfs mount s3://...`` in each scenario:

* ``memory``: ``--cache-size`` twice the dataset, no disk tier;
* ``small-memory``: ``--cache-size`` 25 % of the dataset, no disk tier — remote bytes per epoch should be
  at most ~1.1x the bytes memory did not serve (``memory missed``: files read alone plus blocks loaded);
* ``disk-tier``: ``--cache-size 0``, ``--disk-cache`` with room for the whole dataset;
* ``disk-tier-remount``: the same disk directory mounted again, one epoch: no block byte from the remote.

Every mount uses ``--open-mode none``, so each read reaches blockfs as it would for a dataset larger than the
page cache (here the page cache would hold it all and hide the tiers).  Per epoch: files/s, and the remote
requests and bytes, the bytes memory did not serve and the disk tier's reads *during that epoch* (the
difference of the mount's statistics before and after it).  The baseline, read the same way in the same
orders: the unpacked tree as one object per file, one GET per file, with boto3 (what most users would
write) and with obstore (the client blockfs uses); every scenario's files/s is printed as a ratio to both.

``--clients``: one 4 KiB ranged GET (median of 200) and one 8 MiB ranged GET (median of 20) with obstore
(``get_range``), blockfs's ``RemoteStore.get_range`` (obstore plus counting and checks), boto3
(``get_object`` with ``Range``) and s3fs (``cat_file``; skipped with a note when not installed), taken
round-robin so that a busy machine slows them alike.

``--parts``: a whole 64 MiB object fetched with ``RemoteStore(url, {"part_size": P, "concurrency": C})
.get_into(...)`` for P in 2/8/16 MiB and C in 1/4/16, median of 3 after one warm-up fetch, MB/s, over the
S3 server and over tools/bench/helpers/range_server.py (plain HTTP, ranges sent with ``sendfile``): the
measurement the defaults in blockfs/storage/remote.py (8 MiB, 16) are chosen by.

Caveats.  moto reads an object's whole value for every GET (then slices the range) under a per-object lock,
so on moto a ranged GET costs in proportion to the object's size and parallel GETs of one object queue
there: small parts and per-file GETs out of blocks pay for this, which the range server does not make them
do.  Loopback has no network latency, which is what concurrency hides on a real store.  Run ``--endpoint``
against MinIO or S3 before settling part size and concurrency from loopback figures alone.

``--quick``: a smoke run of under a minute (300 files unless ``--files`` is given, 1 MiB blocks, 50 / 5
client requests, a 16 MiB object and a 2x2 sweep, median of 2).  Prints a table; ``--json FILE`` also writes every
figure, with the machine, the command and the PASS/MISS checks.  Every mount is unmounted and the server
stopped on the way out, also after an error, Ctrl-C or SIGTERM.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import zlib
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
from helpers import HELPERS
from helpers.benchutil import child_server, free_port, stop_process

import blockfs
from blockfs.client import read_stats
from blockfs.errors import MountError
from blockfs.serve.cache.memory_plan import parse_size
from blockfs.serve.daemon import is_mounted, unmount, wait_until_mounted

MiB = 1 << 20
BUCKET = "blockfs-bench"
REGION = "us-east-1"
SCENARIOS = ("memory", "small-memory", "disk-tier", "disk-tier-remount")
SMALL_MEMORY_SHARE = 0.25
REMOTE_OVER_MISSED_MAX = 1.1  # small-memory: remote bytes per epoch / bytes memory did not serve


class Terminated(KeyboardInterrupt):
    """SIGTERM, raised like Ctrl-C's KeyboardInterrupt so that every ``finally`` cleans up."""


def _terminated(signum: int, frame: object) -> None:
    raise Terminated(signum)


@contextlib.contextmanager
def stopped_by_sigterm() -> Iterator[None]:
    previous = signal.signal(signal.SIGTERM, _terminated)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


# --- the server ------------------------------------------------------------------------------------
# moto's server, its request log quietened (one line per request would cost the server time).
MOTO_MAIN = (
    "import logging, sys; logging.getLogger('werkzeug').setLevel(logging.WARNING); "
    "from moto.server import main; main(sys.argv[1:])"
)


def moto_server(log: Path) -> contextlib.AbstractContextManager[str]:
    """moto's S3 server (its objects held in memory, not in temp files)."""
    port = free_port()
    env = dict(os.environ, MOTO_S3_DEFAULT_KEY_BUFFER_SIZE=str(256 * MiB))
    command = [sys.executable, "-c", MOTO_MAIN, "-H", "127.0.0.1", "-p", str(port)]
    return child_server("moto's S3 server (pip install 'moto[server]')", command, port, log, env)


def range_server(root: Path, log: Path) -> contextlib.AbstractContextManager[str]:
    """tools/bench/helpers/range_server.py serving ``root``: ranged GETs at a cost in proportion to the range."""
    port = free_port()
    command = [sys.executable, str(HELPERS / "range_server.py"), str(root), str(port)]
    return child_server("tools/bench/helpers/range_server.py", command, port, log)


def s3_env(endpoint: str, given: bool) -> dict[str, str]:
    """The ``AWS_*`` variables the clients and the mounts read: the server's; fake keys for moto."""
    env = {"AWS_ENDPOINT_URL": endpoint, "AWS_REGION": os.environ.get("AWS_REGION", REGION)}
    env["AWS_DEFAULT_REGION"] = env["AWS_REGION"]
    if not given:
        env |= {"AWS_ACCESS_KEY_ID": "bench", "AWS_SECRET_ACCESS_KEY": "bench-secret"}
    return env


def boto3_client():
    import boto3
    from botocore.config import Config

    return boto3.client(
        "s3",
        endpoint_url=os.environ["AWS_ENDPOINT_URL"],
        region_name=os.environ["AWS_REGION"],
        config=Config(max_pool_connections=32),
    )


def obstore_store(bucket: str, prefix: str = ""):
    from obstore.store import from_url

    client_options = {"allow_http": "true"} if os.environ["AWS_ENDPOINT_URL"].startswith("http://") else {}
    return from_url(f"s3://{bucket}/{prefix}".rstrip("/"), client_options=client_options)


# --- the data ----------------------------------------------------------------------------------------
def make_tree(root: Path, files: int, min_size: int, max_size: int, classes: int, seed: int) -> int:
    """``files`` files of random bytes in ``classes`` directories; their total size."""
    if root.exists():
        shutil.rmtree(root)
    rng = np.random.default_rng(seed)
    sizes = rng.integers(min_size, max_size + 1, files)
    for i, size in enumerate(sizes.tolist()):
        path = root / f"class{i % classes:03d}" / f"{i:06d}.bin"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(rng.bytes(size))
    return int(sizes.sum())


def upload_tree(client, bucket: str, prefix: str, root: Path, threads: int = 8) -> int:
    """Every file under ``root`` as the object ``prefix/<relative path>``; how many."""
    paths = [Path(d) / f for d, _, fs in os.walk(root) for f in fs]

    def put(path: Path) -> None:
        client.upload_file(str(path), bucket, f"{prefix}/{path.relative_to(root).as_posix()}")

    with ThreadPoolExecutor(threads) as pool:
        list(pool.map(put, paths))
    return len(paths)


def block_order(packed: Path) -> list[str]:
    """Every regular file's path, in the order the files are stored in blocks."""
    with blockfs.open_dataset(packed) as ds:
        offsets, entries = ds.layout
        return [os.fsdecode(ds.path_of(int(e))) for e in entries[int(offsets[0]) : int(offsets[-1])]]


def epoch_orders(names: list[str], order: str, seed: int, epochs: int) -> list[list[str]]:
    """Each epoch's reading order: ``block`` as stored; ``random`` a permutation seeded by (seed, epoch)."""
    if order == "block":
        return [list(names) for _ in range(epochs)]
    return [[names[i] for i in np.random.default_rng([seed, epoch]).permutation(len(names))] for epoch in range(epochs)]


# --- reading -------------------------------------------------------------------------------------------
def timed_pass(read_one: Callable[[str], int], names: list[str], readers: int) -> dict:
    """``read_one`` over ``names`` by ``readers`` threads (each its share, in order); files/s and MB/s."""

    def work(part: list[str]) -> int:
        return sum(read_one(name) for name in part)

    start = time.perf_counter()
    if readers == 1:
        nbytes = work(names)
    else:
        with ThreadPoolExecutor(readers) as pool:
            nbytes = sum(pool.map(work, [names[k::readers] for k in range(readers)]))
    seconds = time.perf_counter() - start
    return {
        "files": len(names),
        "bytes": nbytes,
        "seconds": seconds,
        "files_s": len(names) / seconds,
        "mb_s": nbytes / seconds / 1e6,
    }


def file_reader(root: Path) -> Callable[[str], int]:
    def read_one(name: str) -> int:
        with open(os.path.join(root, name), "rb") as f:  # what a training script's dataset does per sample
            return len(f.read())

    return read_one


@contextlib.contextmanager
def mounted(url: str, mnt: Path, args: list[str]) -> Iterator[Path]:
    """``blockfs mount URL MNT --foreground`` in a child process (its own session) for the duration of a
    ``with``; always unmounted (lazily if it must be) and the child reaped on the way out."""
    mnt.mkdir(parents=True, exist_ok=True)
    log = mnt.parent / f"{mnt.name}.log"
    command = [sys.executable, "-m", "blockfs", "mount", url, str(mnt), "--foreground", "--log", str(log), *args]
    with open(log, "ab") as out:
        offset = out.tell()
        proc = subprocess.Popen(command, stdin=subprocess.DEVNULL, stdout=out, stderr=out, start_new_session=True)
    try:
        wait_until_mounted(mnt, proc, 60, str(log), offset)
        yield mnt
    finally:
        if is_mounted(mnt):
            try:
                unmount(mnt)
            except MountError:
                subprocess.run(["umount", "-l", str(mnt)], check=False, capture_output=True)
        stop_process(proc)
        if is_mounted(mnt):  # killed before it could unmount
            subprocess.run(["umount", "-l", str(mnt)], check=False, capture_output=True)


def tier_counters(stats: dict) -> dict[str, int]:
    """The cumulative figures of a mount's statistics that an epoch's difference is taken of."""
    storage = stats.get("storage") or {}
    remote, disk, c = storage.get("remote", {}), storage.get("disk_tier", {}), stats["counters"]
    return {
        "remote_requests": remote.get("requests", 0),
        "remote_bytes": remote.get("bytes", 0),
        "remote_retries": remote.get("retries", 0),
        "remote_failures": remote.get("failures", 0),
        "memory_missed_bytes": c["file_bytes_read"] + c["block_bytes_read"],  # read from the tiers below memory
        "bytes_served": c["bytes_served"],
        "files_served": c["files_served"],
        "file_hits": c["file_hits"],
        "disk_reads": disk.get("disk_reads", 0),
        "disk_bytes": disk.get("disk_bytes", 0),
        "disk_remote_bytes": disk.get("remote_bytes", 0),  # block bytes the disk tier's reads got from the remote
        "disk_copies_written": disk.get("copies_written", 0),
    }


def run_scenario(url: str, mnt: Path, args: list[str], orders: list[list[str]], readers: int) -> dict:
    with mounted(url, mnt, args) as root:
        at_mount = tier_counters(read_stats(root))  # the metadata and index GETs, and what prefill fetched so far
        epochs = []
        for names in orders:
            before = tier_counters(read_stats(root))
            result = timed_pass(file_reader(root), names, readers)
            after = tier_counters(read_stats(root))
            result |= {k: after[k] - before[k] for k in after}
            result["file_hit_rate"] = result["file_hits"] / max(1, result["files_served"])
            epochs.append(result)
        final = read_stats(root)
    return {
        "mount_args": args,
        "at_mount": at_mount,
        "epochs": epochs,
        "disk_tier": final.get("storage", {}).get("disk_tier"),
    }


def bench_mounts(url: str, work: Path, dataset_bytes: int, orders: list[list[str]], args: argparse.Namespace) -> dict:
    common = ["--open-mode", "none"]
    disk = work / "disk-tier"
    shutil.rmtree(disk, ignore_errors=True)
    disk_args = ["--cache-size", "0", "--disk-cache", str(disk), "--disk-cache-size", str(2 * dataset_bytes + 64 * MiB)]
    plans = {
        "memory": ["--cache-size", str(2 * dataset_bytes + 64 * MiB)],
        "small-memory": ["--cache-size", str(int(SMALL_MEMORY_SHARE * dataset_bytes))],
        "disk-tier": disk_args,
        "disk-tier-remount": disk_args,
    }
    out = {}
    for name in SCENARIOS:
        log(f"mount scenario {name}")
        epochs = orders[:1] if name == "disk-tier-remount" else orders
        out[name] = run_scenario(url, work / f"mnt-{name}", common + plans[name] + args.mount_arg, epochs, args.readers)
    return out


def bench_baseline(bucket: str, prefix: str, orders: list[list[str]], readers: int) -> dict:
    """The tree as one object per file, one GET per file: boto3 and obstore."""
    import obstore

    client = boto3_client()
    store = obstore_store(bucket, prefix)
    get_by_client = {
        "boto3": lambda name: len(client.get_object(Bucket=bucket, Key=f"{prefix}/{name}")["Body"].read()),
        "obstore": lambda name: len(obstore.get(store, name).bytes()),
    }
    out = {}
    for label, read_one in get_by_client.items():
        log(f"baseline: GET per object with {label}")
        read_one(orders[0][0])  # the connection, outside the timing
        out[label] = {"epochs": [timed_pass(read_one, names, readers) for names in orders]}
    return out


# --- client libraries --------------------------------------------------------------------------------
def bench_clients(bucket: str, prefix: str, small_n: int, big_n: int) -> dict:
    """One 4 KiB and one 8 MiB ranged GET, each client in turn, round-robin; medians in seconds."""
    import obstore

    from blockfs.storage.remote import RemoteStore

    client = boto3_client()
    rng = np.random.default_rng(1)
    objects = {
        "small": (f"{prefix}/small.bin", 64 << 10, 16 << 10, 4 << 10, small_n),  # key, size, start, length, n
        "big": (f"{prefix}/big.bin", 16 * MiB, 4 * MiB, 8 * MiB, big_n),
    }
    for key, size, *_ in objects.values():
        client.put_object(Bucket=bucket, Key=key, Body=rng.bytes(size))
    store = obstore_store(bucket)
    remote = RemoteStore(f"s3://{bucket}")
    getters: dict[str, Callable[[str, int, int], int]] = {
        "obstore": lambda key, start, n: len(obstore.get_range(store, key, start=start, length=n)),
        "blockfs RemoteStore": lambda key, start, n: len(remote.get_range(key, start, n)),
        "boto3": lambda key, start, n: len(
            client.get_object(Bucket=bucket, Key=key, Range=f"bytes={start}-{start + n - 1}")["Body"].read()
        ),
    }
    notes = []
    try:
        import s3fs

        fs = s3fs.S3FileSystem(
            client_kwargs={"endpoint_url": os.environ["AWS_ENDPOINT_URL"], "region_name": os.environ["AWS_REGION"]}
        )
        getters["s3fs"] = lambda key, start, n: len(fs.cat_file(f"{bucket}/{key}", start=start, end=start + n))
    except ImportError:
        notes.append("s3fs is not installed: skipped (pip install s3fs)")
    out: dict = {"notes": notes, "results": {}}
    try:
        for what, (key, _size, start, length, n) in objects.items():
            times: dict[str, list[float]] = {name: [] for name in getters}
            for get in getters.values():  # warm up: connections, pools
                for _ in range(3):
                    get(key, start, length)
            for _ in range(n):
                for name, get in getters.items():
                    t = time.perf_counter()
                    got = get(key, start, length)
                    times[name].append(time.perf_counter() - t)
                    if got != length:
                        raise RuntimeError(f"{name}: a ranged GET of {length} bytes returned {got}")
            out["results"][what] = {
                "bytes": length,
                "requests": n,
                "median_s": {name: statistics.median(t) for name, t in times.items()},
            }
    finally:
        remote.close()
    return out


# --- part size x concurrency ------------------------------------------------------------------------
def sweep_parts(
    url: str, size: int, expected: int, part_sizes: list[int], concurrencies: list[int], repeats: int
) -> list[dict]:
    """``url``/object.bin fetched whole by RemoteStore.get_into with each part size and concurrency."""
    from blockfs.storage.remote import RemoteStore

    buffer = bytearray(size)
    view = memoryview(buffer)
    rows = []
    for part in part_sizes:
        for concurrency in concurrencies:
            store = RemoteStore(url, {"part_size": part, "concurrency": concurrency})
            try:
                store.get_into("object.bin", 0, view)  # warm up: the pool's threads and connections
                times = []
                for _ in range(repeats):
                    view[:] = bytes(size)  # so the check below sees this fetch's bytes, not an earlier one's
                    t = time.perf_counter()
                    store.get_into("object.bin", 0, view)
                    times.append(time.perf_counter() - t)
                if zlib.crc32(buffer) != expected:
                    raise RuntimeError(f"{url}: part_size {part}, concurrency {concurrency}: the fetched bytes differ")
                requests = store.counters.snapshot()["requests"] // (repeats + 1)
            finally:
                store.close()
            median = statistics.median(times)
            rows.append(
                {
                    "part_size": part,
                    "concurrency": concurrency,
                    "requests_per_fetch": requests,
                    "median_s": median,
                    "mb_s": size / median / 1e6,
                    "samples_s": times,
                }
            )
            log(f"  part {part / MiB:g} MiB x {concurrency}: {size / median / 1e6:,.0f} MB/s")
    return rows


def bench_parts(
    bucket: str, prefix: str, work: Path, size: int, part_sizes: list[int], concurrencies: list[int], repeats: int
) -> dict:
    """The sweep against the S3 server, then against tools/bench/helpers/range_server.py serving the same object."""
    data = np.random.default_rng(2).bytes(size)
    expected = zlib.crc32(data)
    boto3_client().put_object(Bucket=bucket, Key=f"{prefix}/object.bin", Body=data)
    served = work / "range-server"
    (served / "parts").mkdir(parents=True, exist_ok=True)
    (served / "parts" / "object.bin").write_bytes(data)
    del data
    servers = {}
    log("  over the S3 server")
    servers["s3"] = sweep_parts(f"s3://{bucket}/{prefix}", size, expected, part_sizes, concurrencies, repeats)
    with range_server(served, work / "range-server.log") as endpoint:
        log("  over tools/bench/helpers/range_server.py (HTTP, sendfile)")
        servers["http"] = sweep_parts(f"{endpoint}/parts", size, expected, part_sizes, concurrencies, repeats)
    return {"object_bytes": size, "repeats": repeats, "servers": servers}


# --- report ------------------------------------------------------------------------------------------
def _rate(epochs: list[dict]) -> float:
    return sum(e["files"] for e in epochs) / sum(e["seconds"] for e in epochs)


def _mib(n: float) -> str:
    return f"{n / MiB:,.1f}"


def table(results: dict) -> str:
    lines = [f"server: {results['server']}"]
    mount = results.get("mount")
    if mount:
        d = results["dataset"]
        lines.append(
            f"dataset: {d['files']:,} files, {_mib(d['bytes'])} MiB ({d['min_size'] >> 10}-{d['max_size'] >> 10} KiB "
            f"each), {d['blocks']} blocks of {d['block_size'] / MiB:g} MiB; order {d['order']}, "
            f"{d['readers']} reader(s), {d['epochs']} epochs"
        )
    lines.append("")
    if mount:
        base = {name: _rate(b["epochs"]) for name, b in mount["baseline"].items()}
        lines.append(
            "mount scenarios: files/s per epoch and its ratio to one GET per file (boto3, obstore); that epoch's"
        )
        lines.append(
            "bytes served, remote requests and bytes, bytes memory did not serve, disk-tier reads, memory file hit rate"
        )
        lines.append(
            f"  {'reader':26} {'epoch':>5} {'files/s':>8} {'x boto3':>7} {'x obstore':>9} {'served MiB':>10} "
            f"{'remote req':>10} {'remote MiB':>10} {'mem missed MiB':>14} {'disk MiB':>8} {'mem hits':>8}"
        )
        for name, b in mount["baseline"].items():
            for i, e in enumerate(b["epochs"], 1):
                lines.append(
                    f"  {'GET per object, ' + name:26} {i:>5} {e['files_s']:>8,.0f} "
                    f"{e['files_s'] / base['boto3']:>7.2f} {e['files_s'] / base['obstore']:>9.2f} "
                    f"{_mib(e['bytes']):>10} {e['files']:>10,} {_mib(e['bytes']):>10} {'-':>14} {'-':>8} "
                    f"{'-':>8}"
                )
        for name, s in mount["scenarios"].items():
            for i, e in enumerate(s["epochs"], 1):
                lines.append(
                    f"  {name:26} {i:>5} {e['files_s']:>8,.0f} "
                    f"{e['files_s'] / base['boto3']:>7.2f} {e['files_s'] / base['obstore']:>9.2f} "
                    f"{_mib(e['bytes_served']):>10} {e['remote_requests']:>10,} {_mib(e['remote_bytes']):>10} "
                    f"{_mib(e['memory_missed_bytes']):>14} {_mib(e['disk_bytes']):>8} {e['file_hit_rate']:>8.3f}"
                )
        lines.append(
            "  before epoch 1 (open: metadata and index; prefill so far): "
            + "; ".join(
                f"{name} {s['at_mount']['remote_requests']} requests, {_mib(s['at_mount']['remote_bytes'])} MiB"
                for name, s in mount["scenarios"].items()
            )
        )
        remount = mount["scenarios"].get("disk-tier-remount")
        if remount:
            e = remount["epochs"][0]
            lines.append(
                f"  disk-tier-remount epoch 1: {e['disk_remote_bytes']:,} block bytes from the remote "
                f"({e['remote_requests']} remote requests, {e['remote_bytes']:,} bytes in all), "
                f"{_mib(e['disk_bytes'])} MiB read from the disk tier"
            )
        lines.append("")
    clients = results.get("clients")
    if clients:
        r = clients["results"]
        small, big = r["small"], r["big"]
        lines.append(
            f"client libraries, one ranged GET, median of {small['requests']} ({small['bytes'] >> 10} KiB) "
            f"and {big['requests']} ({big['bytes'] / MiB:g} MiB); ratio: time / obstore's"
        )
        lines.append(f"  {'client':22} {'4 KiB ms':>9} {'ratio':>6} {'8 MiB ms':>9} {'MB/s':>7} {'ratio':>6}")
        ref_s, ref_b = small["median_s"]["obstore"], big["median_s"]["obstore"]
        for name in small["median_s"]:
            ts, tb = small["median_s"][name], big["median_s"][name]
            lines.append(
                f"  {name:22} {ts * 1e3:>9.2f} {ts / ref_s:>6.2f} {tb * 1e3:>9.1f} "
                f"{big['bytes'] / tb / 1e6:>7,.0f} {tb / ref_b:>6.2f}"
            )
        lines += [f"  note: {n}" for n in clients["notes"]]
        lines.append("")
    parts = results.get("parts")
    if parts:
        labels = {
            "s3": results["server"],
            "http": "tools/bench/helpers/range_server.py (HTTP, sendfile: a GET costs its range)",
        }
        for server, rows in parts["servers"].items():
            concurrencies = sorted({row["concurrency"] for row in rows})
            lines.append(
                f"RemoteStore.get_into of a whole {parts['object_bytes'] / MiB:g} MiB object, MB/s "
                f"(median of {parts['repeats']}), over {labels[server]}; columns: concurrency"
            )
            lines.append(f"  {'part size':18}" + "".join(f"{c:>9}" for c in concurrencies))
            for part in sorted({row["part_size"] for row in rows}):
                cells = {row["concurrency"]: row for row in rows if row["part_size"] == part}
                gets = -(-parts["object_bytes"] // part)
                lines.append(
                    f"  {f'{part / MiB:g} MiB ({gets} GETs)':18}"
                    + "".join(f"{cells[c]['mb_s']:>9,.0f}" if c in cells else f"{'-':>9}" for c in concurrencies)
                )
        if results["server"].startswith("moto"):
            lines.append("  note: moto reads an object's whole value for every GET, under a per-object lock, so there")
            lines.append("  small and parallel parts pay for the whole object each; loopback has no network latency,")
            lines.append("  which is what concurrency hides on S3: confirm against MinIO or S3 (--endpoint)")
        lines.append("")
    lines += [f"{'PASS' if ok else 'MISS'}  {what}" for what, ok in results["checks"]]
    return "\n".join(lines)


def checks(results: dict) -> list[tuple[str, bool]]:
    mount = results.get("mount")
    if not mount:
        return []
    files, nbytes = results["dataset"]["files"], results["dataset"]["bytes"]
    sc = mount["scenarios"]
    out = []
    every = [e for s in list(sc.values()) + list(mount["baseline"].values()) for e in s["epochs"]]
    complete = all(e["files"] == files and e["bytes"] == nbytes for e in every)
    out.append((f"every epoch of every reader read all {files:,} files ({nbytes:,} bytes)", complete))
    failures = sum(e.get("remote_failures", 0) for e in every)
    out.append((f"no remote request failed ({failures} failures)", failures == 0))
    later = [e["remote_bytes"] for e in sc["memory"]["epochs"][1:]]
    out.append((f"memory: epochs 2+ fetch nothing from the remote ({later} bytes)", not any(later)))
    ratios = [e["remote_bytes"] / max(1, e["memory_missed_bytes"]) for e in sc["small-memory"]["epochs"]]
    what = (
        f"small-memory: remote bytes / bytes memory did not serve = {', '.join(f'{r:.3f}' for r in ratios)} "
        f"per epoch (<= {REMOTE_OVER_MISSED_MAX})"
    )
    out.append((what, max(ratios) <= REMOTE_OVER_MISSED_MAX))
    later = [e["remote_bytes"] for e in sc["disk-tier"]["epochs"][1:]]
    out.append((f"disk-tier: epochs 2+ fetch nothing from the remote ({later} bytes)", not any(later)))
    e = sc["disk-tier-remount"]["epochs"][0]
    what = (
        f"disk-tier-remount: epoch 1 fetches 0 block bytes from the remote ({e['disk_remote_bytes']:,}; "
        f"{e['remote_bytes']:,} remote bytes in all)"
    )
    out.append((what, e["disk_remote_bytes"] == 0 and e["remote_bytes"] == 0))
    return out


# --- main --------------------------------------------------------------------------------------------
_started = time.monotonic()


def log(message: str) -> None:
    print(f"[{time.monotonic() - _started:5.0f} s] {message}", file=sys.stderr, flush=True)


def ensure_bucket(client, bucket: str) -> None:
    region = os.environ["AWS_REGION"]
    extra = {} if region == "us-east-1" else {"CreateBucketConfiguration": {"LocationConstraint": region}}
    try:
        client.create_bucket(Bucket=bucket, **extra)
    except client.exceptions.BucketAlreadyOwnedByYou:
        pass


def delete_prefix(client, bucket: str, prefix: str) -> None:
    """Remove what this run uploaded (for ``--endpoint``: moto's objects go with its process)."""
    for page in client.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=f"{prefix}/"):
        keys = [{"Key": o["Key"]} for o in page.get("Contents", [])]
        if keys:
            client.delete_objects(Bucket=bucket, Delete={"Objects": keys, "Quiet": True})


def server_name(endpoint: str | None) -> str:
    if endpoint:
        return f"{endpoint} (--endpoint)"
    import moto

    return f"moto {moto.__version__} on loopback (child process)"


def run(args: argparse.Namespace, work: Path, sections: list[str]) -> dict:
    quick = args.quick
    files = args.files or (300 if quick else 2000)
    block_size = parse_size(args.block_size or ("1MiB" if quick else "4MiB"))
    min_size, max_size = parse_size(args.min_size), parse_size(args.max_size)
    results: dict = {
        "command": " ".join([sys.executable, *sys.argv]),
        "machine": {
            "cpus": os.cpu_count(),
            "kernel": platform.release(),
            "python": platform.python_version(),
            "loadavg_start": os.getloadavg(),
        },
        "sections": sections,
        "server": server_name(args.endpoint),
    }
    with contextlib.ExitStack() as stack:
        endpoint = args.endpoint or stack.enter_context(moto_server(work / "moto.log"))
        os.environ.update(s3_env(endpoint, bool(args.endpoint)))
        client = boto3_client()
        ensure_bucket(client, args.bucket)
        run_prefix = f"bench-remote-{os.getpid()}-{int(time.time())}"
        if args.endpoint:
            stack.callback(delete_prefix, client, args.bucket, run_prefix)
        if "mount" in sections:
            log(f"making {files:,} files and packing them ({block_size / MiB:g} MiB blocks)")
            nbytes = make_tree(work / "src", files, min_size, max_size, args.classes, args.seed)
            packed = work / "packed"
            result = blockfs.pack(work / "src", packed, block_size=block_size, force=True, fsync=False)
            log("uploading the packed dataset and the tree (one object per file)")
            upload_tree(client, args.bucket, f"{run_prefix}/packed", packed)
            upload_tree(client, args.bucket, f"{run_prefix}/raw", work / "src")
            results["dataset"] = {
                "files": files,
                "bytes": nbytes,
                "min_size": min_size,
                "max_size": max_size,
                "blocks": result.n_blocks,
                "block_size": block_size,
                "order": args.order,
                "readers": args.readers,
                "epochs": args.epochs,
                "seed": args.seed,
            }
            orders = epoch_orders(block_order(packed), args.order, args.seed, args.epochs)
            url = f"s3://{args.bucket}/{run_prefix}/packed"
            results["mount"] = {
                "baseline": bench_baseline(args.bucket, f"{run_prefix}/raw", orders, args.readers),
                "scenarios": bench_mounts(url, work, nbytes, orders, args),
            }
        if "clients" in sections:
            log("client libraries")
            small_n, big_n = (50, 5) if quick else (200, 20)
            results["clients"] = bench_clients(args.bucket, f"{run_prefix}/clients", small_n, big_n)
        if "parts" in sections:
            log("part size x concurrency")
            if quick:
                sweep = (16 * MiB, [2 * MiB, 8 * MiB], [1, 16], 2)
            else:
                sweep = (64 * MiB, [2 * MiB, 8 * MiB, 16 * MiB], [1, 4, 16], 3)
            results["parts"] = bench_parts(args.bucket, f"{run_prefix}/parts", work, *sweep)
    results["checks"] = checks(results)
    results["machine"]["loadavg_end"] = os.getloadavg()
    results["seconds"] = time.monotonic() - _started
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--work", type=Path, help="scratch directory (default: a new one in the temp dir, removed after)"
    )
    parser.add_argument("--json", type=Path, help="write every figure here")
    sections = parser.add_argument_group("sections (given none: all three)")
    sections.add_argument("--mount", action="store_true", help="the mount scenarios and the GET-per-file baseline")
    sections.add_argument("--clients", action="store_true", help="obstore vs boto3 vs s3fs, 4 KiB and 8 MiB GETs")
    sections.add_argument("--parts", action="store_true", help="RemoteStore part size x concurrency sweep")
    data = parser.add_argument_group("the dataset and the readers (--mount)")
    data.add_argument("--files", type=int, help="files in the tree (default 2000; 300 with --quick)")
    data.add_argument("--min-size", default="10KiB", help="smallest file (default 10KiB)")
    data.add_argument("--max-size", default="100KiB", help="largest file (default 100KiB)")
    data.add_argument("--classes", type=int, default=10, help="directories the files are spread over")
    data.add_argument("--block-size", help="pack's block size (default 4MiB; 1MiB with --quick)")
    data.add_argument(
        "--order",
        choices=("random", "block"),
        default="random",
        help="random: a new seeded shuffle per epoch; block: the order files are stored in blocks",
    )
    data.add_argument("--epochs", type=int, default=2, help="epochs per scenario (default 2)")
    data.add_argument("--readers", type=int, default=1, help="reader threads (default 1)")
    data.add_argument("--seed", type=int, default=0)
    data.add_argument(
        "--mount-arg",
        action="append",
        default=[],
        metavar="ARG",
        help="an extra 'blockfs mount' argument for every scenario (repeat; e.g. --mount-arg=--no-prefill)",
    )
    parser.add_argument("--quick", action="store_true", help="a smoke run of under a minute")
    parser.add_argument(
        "--endpoint",
        help="an S3-compatible server already running (credentials from AWS_*) "
        "instead of starting moto; this run's objects are deleted afterwards",
    )
    parser.add_argument("--bucket", default=BUCKET, help=f"bucket to use (created if missing; default {BUCKET})")
    args = parser.parse_args(argv)
    chosen = [s for s in ("mount", "clients", "parts") if getattr(args, s)] or ["mount", "clients", "parts"]
    if args.epochs < 2 and "mount" in chosen:
        parser.error(f"--epochs {args.epochs}: the scenarios need at least 2 (the second shows what the tiers kept)")
    if args.readers < 1:
        parser.error(f"--readers {args.readers}: need at least 1")
    if "mount" in chosen and not (os.path.exists("/dev/fuse") and os.access("/dev/fuse", os.R_OK | os.W_OK)):
        parser.error("the mount scenarios need FUSE (/dev/fuse); run --clients --parts without it")
    for option in ("min_size", "max_size", "block_size"):
        try:
            value = getattr(args, option)
            parse_size(value) if value else None
        except ValueError as e:
            parser.error(f"--{option.replace('_', '-')}: {e}")

    work = args.work or Path(tempfile.mkdtemp(prefix="bench_remote-"))
    work.mkdir(parents=True, exist_ok=True)
    try:
        with stopped_by_sigterm():
            results = run(args, work, chosen)
    except KeyboardInterrupt as e:
        print(
            f"{'terminated' if isinstance(e, Terminated) else 'interrupted'}: every mount unmounted, the server "
            "stopped",
            file=sys.stderr,
        )
        return 143 if isinstance(e, Terminated) else 130
    finally:
        if not args.work:
            shutil.rmtree(work, ignore_errors=True)
    text = table(results)
    print(text)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(results, indent=1) + "\n")
        print(f"\n{results['seconds']:.0f} s; wrote {args.json}")
    else:
        print(f"\n{results['seconds']:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
