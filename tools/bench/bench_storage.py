"""Benchmark blockfs against the tools users would pick instead, on slow and remote storage, in one run.

    python tools/bench/bench_storage.py --json results/bench_storage.json [--png results/bench_storage.png]
        [--storages local,cloud-volume,hard-disk,object-2ms,object-10ms] [--datasets inet,tiny]
        [--files 6000] [--tiny-files 30000] [--seconds 20] [--work DIR]
        [--systems raw,dataloader,null,peers,blockfs,remount,mfusepy,loader] [--readers 1,4] [--no-list]

Root only: the storages are emulated (:mod:`helpers.storage_emulation`) and each is set up and torn down here.

* **Disks** — the local disk as it is, a *cloud volume* (3,000 read IOPS, 125 MiB/s: AWS gp3's baseline) and a
  *hard disk* (150 IOPS, 150 MiB/s): a blkio cgroup throttles reads; every server and reader runs inside
  it; each system's files are evicted from the page cache before its first epoch.
* **Object store** at 2 ms and 10 ms round trip behind a 1 Gbit/s link: hadro (a read-only S3 server over a
  folder) inside a network namespace, behind :mod:`helpers.delay_proxy`, with ``tbf`` on the namespace's link.

Systems, where they apply: the raw directory (``open().read()`` per file) and a torch ``DataLoader`` over it;
ratarmount over a tar; squashfuse_ll over a squashfs image; a no-work FUSE server (:mod:`helpers.null_fs`, the
ceiling of any Python FUSE server here); s3fs-fuse and rclone mounting the raw objects; per-file GETs in a
``DataLoader``; MosaicML Streaming (MDS shards) and WebDataset (tar shards over HTTP) from the store; the
blockfs mount (epoch 1, epoch 2, a remount) and the blockfs loader.  Readers: one thread and four threads
splitting the same shuffled list (:mod:`helpers.storage_reader`); loaders use four workers.  Slow systems are cut
after ``--seconds`` and rated over what they read.  Every reader lists the tree first (``os.walk``, as
``ImageFolder`` does); ``--no-list`` opens the paths straight from the list instead, as a CSV-driven dataset does.
``--systems`` and ``--readers`` run part of it (on the disks: ``--systems raw,null,blockfs --readers 4`` is the
raw directory, the no-work server on both routes and the blockfs mount's two epochs).

Per system and epoch: files/s, MB/s, the bytes and requests that reached the storage (the cgroup's
counters; the proxy's for the store) and the serving daemon's CPU seconds per file.  Prints a table, and
writes JSON (``--json``) and a plot (``--png``).
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import io
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tarfile
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

from helpers import HELPERS, TOOLS
from helpers.benchutil import started_server, stop_process
from helpers.storage_emulation import NetworkLink, ThrottledDisk, Unavailable, evict
from helpers.storage_reader import TICK_S

from blockfs.serve.daemon import is_mounted, unmount, wait_until_mounted

MiB = 1 << 20
DISKS = {  # name: (read IOPS, read bytes/s); None: not throttled
    "local": (None, None),
    "cloud-volume": (3000, 125 * MiB),
    "hard-disk": (150, 150 * MiB),
}
OBJECT_STORES = {"object-2ms": 2.0, "object-10ms": 10.0}  # name: round trip in ms
LINK_MBIT = 1000
DATASETS = {"inet": "imagenet", "tiny": "tiny"}  # name: tools/make_dataset.py mode
# 64 MiB blocks (the default) for the ~110 KiB files; 16 MiB for the ~4 KiB ones, whose 120 MB would
# otherwise be two blocks, too coarse for tiers of half the dataset.  MDS and WebDataset shards match.
BLOCK_BYTES = {"inet": 64 * MiB, "tiny": 16 * MiB}
BUCKET = "bench"
# What --systems can pick on the disks: the raw directory, a DataLoader over it, the no-work server (both
# routes), ratarmount and squashfuse_ll, the blockfs mount's epochs 1 and 2, its remount, its mfusepy route,
# the blockfs loader.
SYSTEMS = ("raw", "dataloader", "null", "peers", "blockfs", "remount", "mfusepy", "loader")
CLK_TCK = os.sysconf("SC_CLK_TCK")


def log(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


# --- processes -------------------------------------------------------------------------------------------
def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of ``pid`` and its reaped children, or 0 when it is gone."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return sum(int(fields[i]) for i in (11, 12, 13, 14)) / CLK_TCK


@contextlib.contextmanager
def fuse_mount(command: list[str], mnt: Path, enter, env: dict | None = None, timeout: float = 120) -> Iterator[int]:
    """Run a foreground FUSE server (environment ``env``, default ours) until ``mnt`` is mounted; yield its
    pid; unmount and stop it."""
    mnt.mkdir(parents=True, exist_ok=True)
    log_path = mnt.parent / f"{mnt.name}.log"
    with open(log_path, "w") as logfile:
        proc = subprocess.Popen(command, stdout=logfile, stderr=subprocess.STDOUT, preexec_fn=enter, env=env)
    try:
        wait_until_mounted(mnt, proc, timeout, str(log_path))
        yield proc.pid
    finally:
        if is_mounted(mnt):
            unmount(mnt)
        stop_process(proc)


# --- datasets --------------------------------------------------------------------------------------------
def available_peers(skip: bool) -> dict[str, bool]:
    """Which peers this machine has (``bash tools/bench/bench_storage_setup.sh`` installs them all)."""

    def module(name: str) -> bool:
        return importlib.util.find_spec(name) is not None

    found = {
        "ratarmount": bool(shutil.which("ratarmount")),
        "squashfuse_ll": bool(shutil.which("squashfuse_ll") and shutil.which("mksquashfs")),
        "s3fs": bool(shutil.which("s3fs")),
        "rclone": bool(shutil.which("rclone")),
        "mosaic": module("streaming"),
        "webdataset": module("webdataset"),
    }
    for name, present in found.items():
        if not present and not skip:
            log(f"{name}: not installed, left out (bash tools/bench/bench_storage_setup.sh installs it)")
    return {name: present and not skip for name, present in found.items()}


def make_dataset(work: Path, name: str, files: int, peers: dict[str, bool]) -> dict:
    """The tree and the formats the systems read (blockfs; tar, squashfs, MDS, WebDataset shards for the
    peers present), made once and kept in ``work``."""
    tree, made = work / name, work / f"{name}.made"  # the marker outside the tree: it is not a sample
    if not made.exists() or made.read_text() != str(files):
        shutil.rmtree(tree, ignore_errors=True)
        shutil.rmtree(work / f"{name}.formats", ignore_errors=True)
        subprocess.run(
            [
                sys.executable,
                str(TOOLS / "make_dataset.py"),
                str(tree),
                "--mode",
                DATASETS[name],
                "--files",
                str(files),
                "--classes",
                "50",
            ],
            check=True,
            capture_output=True,
        )
        made.write_text(str(files))
    names = sorted(str(p.relative_to(tree)) for p in tree.rglob("*") if p.is_file())
    formats, done = work / f"{name}.formats", work / f"{name}.formats.done"
    wanted = {"blockfs", *(k for k in ("ratarmount", "squashfuse_ll", "mosaic", "webdataset") if peers[k])}
    if not done.exists() or not wanted <= set(done.read_text().split()):
        shutil.rmtree(formats, ignore_errors=True)
        shutil.rmtree(work / "store" / BUCKET / name, ignore_errors=True)  # staged from the old formats
        formats.mkdir()
        log(f"{name}: packing " + ", ".join(sorted(wanted)))
        subprocess.run(
            [
                sys.executable,
                "-m",
                "blockfs",
                "pack",
                str(tree),
                str(formats / "data.blockfs"),
                "--block-size",
                str(BLOCK_BYTES[name]),
            ],
            check=True,
            capture_output=True,
        )
        if "ratarmount" in wanted:
            subprocess.run(["tar", "cf", str(formats / "data.tar"), "-C", str(tree), *names], check=True)
        if "squashfuse_ll" in wanted:
            subprocess.run(
                ["mksquashfs", str(tree), str(formats / "data.sqfs"), "-noappend", "-quiet", "-no-progress"],
                check=True,
                capture_output=True,
            )
        if "mosaic" in wanted:
            write_mds(tree, names, formats / "mds", BLOCK_BYTES[name])
        if "webdataset" in wanted:
            write_wds(tree, names, formats / "wds", BLOCK_BYTES[name])
        done.write_text(" ".join(sorted(wanted)))
    shuffled = names[:]
    random.Random(7).shuffle(shuffled)
    order = work / f"{name}.order"
    order.write_text("\n".join(shuffled) + "\n")
    nbytes = sum((tree / n).stat().st_size for n in names)
    return {"name": name, "tree": tree, "names": names, "order": order, "bytes": nbytes, "formats": formats}


def write_mds(tree: Path, names: list[str], out: Path, shard_bytes: int) -> None:
    """MosaicML Streaming's MDS shards of the same files, as big as the blocks."""
    from helpers.storage_loaders import _import_streaming

    streaming = _import_streaming()
    with streaming.MDSWriter(out=str(out), columns={"data": "bytes"}, size_limit=shard_bytes) as writer:
        for n in names:
            writer.write({"data": (tree / n).read_bytes()})


def write_wds(tree: Path, names: list[str], out: Path, shard_bytes: int) -> None:
    """WebDataset tar shards of the same files, as big as the blocks."""
    out.mkdir()
    shard, size, tar = 0, 0, None
    for i, n in enumerate(names):
        if tar is None or size >= shard_bytes:
            if tar is not None:
                tar.close()
            tar, size, shard = tarfile.open(out / f"shard-{shard:05d}.tar", "w"), 0, shard + 1
        data = (tree / n).read_bytes()
        info = tarfile.TarInfo(f"{i:08d}.bin")
        info.size = len(data)
        tar.addfile(info, io.BytesIO(data))
        size += len(data)
    if tar is not None:
        tar.close()


# --- measuring ---------------------------------------------------------------------------------------------
def storage_delta(before: dict, after: dict) -> dict:
    """The bytes and requests that reached the storage between two readings of its counters."""
    return {
        "storage_bytes": after["bytes"] - before["bytes"],
        "storage_requests": after["requests"] - before["requests"],
    }


def counted(counters, run) -> dict:
    """``run()``'s result with what reached the storage while it ran (``counters()`` reads the storage's)."""
    before = counters()
    out = run()
    return {**out, **storage_delta(before, counters())}


def _consumer(cmd: list[str], enter, env: dict | None, wait_mount: Path | None) -> subprocess.Popen:
    """Start a reader or loader; with ``wait_mount``, return once it is ready and polling for that mount."""
    if wait_mount is not None:
        cmd = [*cmd, "--wait-mount", str(wait_mount)]
    proc = subprocess.Popen(
        cmd,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=enter,
        env={**os.environ, **(env or {})},
    )
    if wait_mount is not None and proc.stdout.readline().strip() != "ready":
        proc.wait()
        raise RuntimeError(f"{cmd[1]} did not start: {proc.stderr.read().strip()[-800:]}")
    return proc


def _finish(proc: subprocess.Popen, what: str):
    out, err = proc.communicate()
    if proc.returncode != 0:
        raise RuntimeError(f"{what} failed: {err.strip()[-800:]}")
    return json.loads(out.strip().splitlines()[-1])


LIST_FIRST = True  # every system is listed first, as an ImageFolder script does (main's --no-list: none is)


def reader_command(root: Path, ds: dict, threads: int, seconds: float | None) -> list[str]:
    cmd = [sys.executable, str(HELPERS / "storage_reader.py"), str(root), str(ds["order"]), "--threads", str(threads)]
    if LIST_FIRST:
        cmd.append("--list")
    return [*cmd, "--seconds", str(seconds)] if seconds else cmd


def loader_command(args: list[str], seconds: float | None, epochs: int = 1) -> list[str]:
    cmd = [sys.executable, str(HELPERS / "storage_loaders.py"), *args, "--epochs", str(epochs)]
    return [*cmd, "--seconds", str(seconds)] if seconds else cmd


def read_pass(root: Path, ds: dict, threads: int, seconds: float | None, enter) -> dict:
    return _finish(_consumer(reader_command(root, ds, threads, seconds), enter, None, None), "reader")


def loader_pass(args: list[str], enter, seconds: float | None, epochs: int = 1, env: dict | None = None) -> list[dict]:
    return _finish(_consumer(loader_command(args, seconds, epochs), enter, env, None), f"loader {args[0]}")


def record(
    results: list,
    storage: str,
    ds: dict,
    system: str,
    readers: int,
    epoch: str,
    out: dict,
    daemon_cpu: float | None = None,
) -> dict:
    seconds = max(out["seconds"], 1e-9)
    row = {
        "storage": storage,
        "dataset": ds["name"],
        "system": system,
        "readers": readers,
        "epoch": epoch,
        "files": out["files"],
        "bytes": out["bytes"],
        "seconds": round(seconds, 3),
        "files_per_s": out["files"] / seconds,
        "mb_per_s": out["bytes"] / seconds / 1e6,
        "complete": out["files"] >= len(ds["names"]),
        "storage_bytes": out.get("storage_bytes"),
        "storage_requests": out.get("storage_requests"),
        "daemon_cpu_s_per_file": None if daemon_cpu is None or not out["files"] else daemon_cpu / out["files"],
    }
    if "list_seconds" in out:  # a reader that listed the tree first (not with --no-list, nor a loader)
        row["list_seconds"] = round(out["list_seconds"], 3)
    if out.get("storage_done_s") is not None:
        row["storage_done_s"] = round(out["storage_done_s"], 3)
        if out.get("timeline") is not None:  # a reader's: how many files it had read by then
            row["files_by_storage_done"] = files_by(out["timeline"], out["storage_done_s"])
            row["timeline"] = out["timeline"]  # files read per TICK_S of the pass
    if out.get("errors"):
        row["errors"] = out["errors"]
        row["first_error"] = out.get("first_error")
    results.append(row)
    log(
        f"{storage:12s} {ds['name']:5s} {system:22s} r{readers} ep{epoch:8s} {row['files_per_s']:9,.0f} files/s "
        f"{row['mb_per_s']:7.1f} MB/s  storage {(row['storage_bytes'] or 0) / MiB:7.1f} MiB "
        f"{row['storage_requests'] or 0:6d} req"
    )
    return row


@contextlib.contextmanager
def sampled(counters, every: float = 0.02) -> Iterator[list]:
    """(seconds from now, storage bytes) every ``every`` seconds while the body runs."""
    samples: list = []
    done = threading.Event()
    started = time.monotonic()

    def sample() -> None:
        while not done.is_set():
            try:
                samples.append((time.monotonic() - started, counters()["bytes"]))
            except RuntimeError:
                return  # no sample is better than a stuck pass
            done.wait(every)

    thread = threading.Thread(target=sample, daemon=True)
    thread.start()
    try:
        yield samples
    finally:
        done.set()
        thread.join()


def files_by(timeline: list[int], seconds: float) -> int:
    """Files a reader had read ``seconds`` into its pass, from its timeline (files per ``TICK_S``; the tick
    holding ``seconds`` counted whole)."""
    return sum(timeline[: int(seconds / TICK_S) + 1])


def storage_done(samples: list, final_bytes: int) -> float | None:
    """When the storage had delivered 99% of what the pass read from it: the pass's time after that was
    spent serving, not waiting for the storage."""
    if not samples or final_bytes <= samples[0][1]:
        return None
    target = samples[0][1] + 0.99 * (final_bytes - samples[0][1])
    return next((t for t, b in samples if b >= target), samples[-1][0])


def mount_passes(
    results: list,
    storage: str,
    ds: dict,
    system: str,
    command: list[str],
    mnt: Path,
    counters,
    enter,
    *,
    readers: int,
    epochs=("1",),
    seconds: float | None = None,
    loader: bool = False,
    env: dict | None = None,
    evict_between: bool = False,
) -> None:
    """Mount with ``command``, run the epochs, unmount.  The first epoch's reader is started before the
    server and begins the moment the mount appears, and its storage counters start before the mount, so
    what a server reads from its start (an index, a prefill) is counted in both bytes and time.
    ``evict_between`` drops the kernel's page cache of the mount's files before each later epoch (a small
    dataset would otherwise be served from it, outside any budget)."""

    def consumer(wait: bool) -> subprocess.Popen:
        cmd = (
            loader_command(["blockfs", str(mnt), "--workers", str(readers)], seconds)
            if loader
            else reader_command(mnt, ds, readers, seconds)
        )
        return _consumer(cmd, enter, None, mnt if wait else None)

    start = counters()
    first = consumer(wait=True)
    try:
        with fuse_mount(command, mnt, enter, env=env) as pid:
            for epoch in epochs:
                cpu0 = 0.0 if epoch == epochs[0] else cpu_seconds(pid)  # epoch 1: with the server's start
                if epoch == epochs[0]:
                    before, proc = start, first
                else:
                    if evict_between:
                        evict([mnt])
                    before, proc = counters(), consumer(wait=False)
                with sampled(counters) as samples:
                    out = _finish(proc, system)
                out = out[0] if isinstance(out, list) else out
                after = counters()
                out.update(storage_delta(before, after), storage_done_s=storage_done(samples, after["bytes"]))
                record(results, storage, ds, system, readers, epoch, out, cpu_seconds(pid) - cpu0)
    finally:
        if first.poll() is None:
            first.kill()
            first.wait()


# --- disks -------------------------------------------------------------------------------------------------
def bench_disk(storage: str, ds: dict, work: Path, results: list, args: argparse.Namespace) -> None:
    iops, bps = DISKS[storage]
    fmt, mnt = ds["formats"], work / "mnt"
    # The cgroup's name carries this run's pid: two runs at once (a benchmark beside the suite's test of it)
    # must not share, or remove, each other's group.
    with ThrottledDisk(f"bfs-{os.getpid()}-{storage}", str(ds["tree"]), read_iops=iops, read_bps=bps) as disk:
        counters, enter = disk.counters, disk.enter
        wanted, readers = args.systems, args.readers

        def on(system: str, command: list[str], evicted: Path, **kw) -> None:
            for threads in kw.pop("readers", readers):
                if threads not in readers:
                    continue
                evict([evicted])
                mount_passes(results, storage, ds, system, command, mnt, counters, enter, readers=threads, **kw)

        for threads in readers if "raw" in wanted else ():
            evict([ds["tree"]])
            out = counted(counters, lambda threads=threads: read_pass(ds["tree"], ds, threads, args.seconds, enter))
            record(results, storage, ds, "raw", threads, "1", out)
        if storage == "local" and "raw" in wanted and 4 in readers:
            # warm: what the page cache gives a plain directory (the mount's epoch 2 goal)
            out = counted(counters, lambda: read_pass(ds["tree"], ds, 4, args.seconds, enter))
            record(results, storage, ds, "raw", 4, "2", out)
        if "dataloader" in wanted:
            evict([ds["tree"]])
            out = counted(
                counters,
                lambda: loader_pass(
                    ["files", str(ds["tree"]), str(ds["order"]), "--workers", "4"], enter, args.seconds
                )[0],
            )
            record(results, storage, ds, "raw DataLoader", 4, "1", out)
        # A no-work FUSE server reads nothing from the disk: its rate is the FUSE ceiling in this run.
        null = [sys.executable, str(HELPERS / "null_fs.py"), str(ds["tree"]), str(mnt)]
        if "null" in wanted:
            on("null FUSE (ceiling)", [*null, "--fuse", "mfusepy"], ds["tree"])
            on("null FUSE, kernel route", [*null, "--fuse", "kernel"], ds["tree"])
        if args.peers["ratarmount"] and "peers" in wanted:
            tar = fmt / "data.tar"
            with fuse_mount(["ratarmount", "-f", str(tar), str(mnt)], mnt, enter, timeout=600):
                pass  # the first mount writes ratarmount's index next to the tar: not timed
            on("ratarmount", ["ratarmount", "-f", str(tar), str(mnt)], tar, seconds=args.seconds)
        if args.peers["squashfuse_ll"] and "peers" in wanted:
            image = fmt / "data.sqfs"
            on("squashfuse_ll", ["squashfuse_ll", "-f", str(image), str(mnt)], image, seconds=args.seconds)

        packed = fmt / "data.blockfs"
        mount_cmd = [sys.executable, "-m", "blockfs", "mount", str(packed), str(mnt), "--foreground"]
        if "blockfs" in wanted:
            on("blockfs mount", mount_cmd, packed, epochs=("1", "2"))
        if "remount" in wanted:
            on("blockfs mount", mount_cmd, packed, epochs=("remount",))
        if "mfusepy" in wanted:
            on("blockfs mount, mfusepy", [*mount_cmd, "--fuse", "mfusepy"], packed, readers=(4,), epochs=("1", "2"))
        if "loader" in wanted:
            on("blockfs loader", mount_cmd, packed, readers=(4,), loader=True)


# --- object stores -----------------------------------------------------------------------------------------
@contextlib.contextmanager
def object_store(work: Path, rtt_ms: float, stats: Path) -> Iterator[tuple[str, Callable[[], dict]]]:
    """hadro over ``work/store`` inside a namespace, behind a delay proxy and a capped link; yields the
    endpoint and the proxy's counters."""
    with NetworkLink(rate_mbit=LINK_MBIT) as link:
        hadro = [
            *link.command("hadro", str(work / "store"), "--host", "127.0.0.1", "--port", "9001", "--log-level", "error")
        ]
        proxy = [
            *link.command(
                sys.executable,
                str(HELPERS / "delay_proxy.py"),
                f"{link.address}:9000",
                "127.0.0.1:9001",
                "--rtt-ms",
                str(rtt_ms),
                "--stats",
                str(stats),
            )
        ]
        with open(work / "hadro.log", "ab") as out:
            hadro_proc = subprocess.Popen(hadro, stdout=out, stderr=out)
        try:
            with started_server(
                "tools/bench/helpers/delay_proxy.py", proxy, 9000, work / "proxy.log", host=link.address
            ) as proxy_proc:
                one_at_a_time = threading.Lock()  # two SIGUSR1 close together are delivered as one

                def read() -> dict:
                    with one_at_a_time:
                        return read_now()

                def read_now() -> dict:
                    stamp = stats.stat().st_mtime_ns if stats.exists() else 0
                    proxy_proc.send_signal(signal.SIGUSR1)
                    deadline = time.monotonic() + 10
                    while not stats.exists() or stats.stat().st_mtime_ns == stamp:
                        if time.monotonic() > deadline:
                            raise RuntimeError("the delay proxy wrote no counters")
                        time.sleep(0.01)
                    values = json.loads(stats.read_text())
                    return {"bytes": values["bytes_down"], "requests": values["requests"]}

                endpoint = f"http://{link.address}:9000"
                deadline = time.monotonic() + 30
                while subprocess.run(
                    ["curl", "-sf", "-o", "/dev/null", f"{endpoint}/{BUCKET}?list-type=2&max-keys=1"], check=False
                ).returncode:
                    if time.monotonic() > deadline:
                        raise RuntimeError("hadro did not answer through the proxy")
                    time.sleep(0.1)
                yield endpoint, read
        finally:
            stop_process(hadro_proc)


def stage_bucket(work: Path, ds: dict) -> None:
    """The bucket hadro serves: the raw files, the packed dataset, MDS and WebDataset shards (hard links)."""
    root = work / "store" / BUCKET / ds["name"]
    if (root / ".done").exists():
        return
    shutil.rmtree(root, ignore_errors=True)
    for sub, src in (
        ("raw", ds["tree"]),
        ("blockfs", ds["formats"] / "data.blockfs"),
        ("mds", ds["formats"] / "mds"),
        ("wds", ds["formats"] / "wds"),
    ):
        if src.exists():
            shutil.copytree(src, root / sub, copy_function=os.link, ignore=shutil.ignore_patterns(".done"))
    (root / ".done").touch()


S3_ENV = {"AWS_ACCESS_KEY_ID": "bench", "AWS_SECRET_ACCESS_KEY": "bench-secret", "AWS_REGION": "us-east-1"}


def bench_object(storage: str, ds: dict, work: Path, results: list, args: argparse.Namespace) -> None:
    stage_bucket(work, ds)
    name, mnt = ds["name"], work / "mnt"
    seconds = args.seconds
    with object_store(work, OBJECT_STORES[storage], work / "proxy-stats.json") as (endpoint, counters):
        env = {**S3_ENV, "AWS_ENDPOINT_URL": endpoint, "AWS_ALLOW_HTTP": "true"}
        os.environ.update(env)
        url = f"s3://{BUCKET}/{name}/blockfs"
        opts = ["--storage-option", f"endpoint={endpoint}", "--storage-option", "allow_http=true"]
        mount_cmd = [sys.executable, "-m", "blockfs", "mount", url, str(mnt), "--foreground", *opts]

        def on(system: str, command: list[str], **kw) -> None:
            mount_passes(results, storage, ds, system, command, mnt, counters, None, **kw)

        for threads in (1, 4):
            on("blockfs mount", mount_cmd, readers=threads, epochs=("1", "2"))
        on("blockfs mount, mfusepy", [*mount_cmd, "--fuse", "mfusepy"], readers=4, epochs=("1", "2"))
        # Memory + disk tiers holding the dataset: a remount reads the disk tier, not the store.
        tier = work / "disk-tier"
        shutil.rmtree(tier, ignore_errors=True)
        tiered = [*mount_cmd, "--disk-cache", str(tier), "--disk-cache-size", str(2 * ds["bytes"])]
        on("blockfs mount+disk", tiered, readers=4)
        on("blockfs mount+disk", tiered, readers=4, epochs=("remount",))
        # Tiers holding half the dataset (a quarter in memory, a quarter on disk): cache-once.  The ~110 KiB
        # files only: the ~4 KiB ones would send the other half as 15,000 single-file GETs an epoch.
        shutil.rmtree(tier, ignore_errors=True)
        if name == "inet":
            quarter = str(ds["bytes"] // 4)
            half = [*mount_cmd, "--cache-size", quarter, "--disk-cache", str(tier), "--disk-cache-size", quarter]
            on("blockfs tiers=half", half, readers=4, epochs=("1", "2", "3"), evict_between=True)
            shutil.rmtree(tier, ignore_errors=True)
        on("blockfs loader", mount_cmd, readers=4, loader=True)

        # Per-file GETs, as a custom Dataset would do them.
        order = work / f"{name}.keys"
        order.write_text("".join(f"{name}/raw/{n}\n" for n in ds["order"].read_text().split()))
        out = counted(
            counters,
            lambda: loader_pass(["gets", endpoint, BUCKET, str(order), "--workers", "4"], None, seconds, env=env)[0],
        )
        record(results, storage, ds, "GET per file", 4, "1", out)

        peers_on_objects(storage, ds, work, endpoint, counters, env, results, seconds, args.peers)


def epochs_in_one_process(
    results: list, storage: str, ds: dict, system: str, args: list[str], counters, env: dict, epochs: int, log_dir: Path
) -> None:
    """Several epochs of one loader process (as training runs them: an LRU cache stays warm between them),
    with the storage's counters read at each epoch's end."""
    errors = open(log_dir / "loader.log", "w+")  # a file, not a pipe: nobody reads it while epochs run
    proc = subprocess.Popen(
        [*loader_command(args, None, epochs), "--step"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=errors,
        text=True,
        env={**os.environ, **env},
    )
    try:
        before = counters()
        for epoch in range(1, epochs + 1):
            line = proc.stdout.readline()
            if not line:
                errors.seek(0)
                raise RuntimeError(f"{system} stopped: {errors.read().strip()[-800:]}")
            out = json.loads(line)
            after = counters()
            out.update(storage_delta(before, after))
            record(results, storage, ds, system, 4, str(epoch), out)
            before = after
            if epoch < epochs:
                proc.stdin.write("\n")
                proc.stdin.flush()
    finally:
        stop_process(proc)
        errors.close()


def peers_on_objects(
    storage: str,
    ds: dict,
    work: Path,
    endpoint: str,
    counters,
    env: dict,
    results: list,
    seconds: float,
    peers: dict[str, bool],
) -> None:
    name, mnt = ds["name"], work / "mnt"
    if peers["s3fs"]:
        creds = work / "s3fs.passwd"
        creds.write_text(f"{S3_ENV['AWS_ACCESS_KEY_ID']}:{S3_ENV['AWS_SECRET_ACCESS_KEY']}\n")
        creds.chmod(0o600)
        cmd = [
            "s3fs",
            f"{BUCKET}:/{name}/raw",
            str(mnt),
            "-f",
            "-o",
            f"url={endpoint}",
            "-o",
            "use_path_request_style",
            "-o",
            f"passwd_file={creds}",
            "-o",
            "ro",
        ]
        mount_passes(results, storage, ds, "s3fs-fuse", cmd, mnt, counters, None, readers=4, seconds=seconds)
    if peers["rclone"]:
        remote = (
            f":s3,provider=Other,endpoint='{endpoint}',access_key_id={S3_ENV['AWS_ACCESS_KEY_ID']},"
            f"secret_access_key={S3_ENV['AWS_SECRET_ACCESS_KEY']}:{BUCKET}/{name}/raw"
        )
        cmd = ["rclone", "mount", remote, str(mnt), "--read-only", "--no-checksum", "--no-modtime"]
        rclone_env = {k: v for k, v in os.environ.items() if k != "AWS_CA_BUNDLE"}
        mount_passes(
            results, storage, ds, "rclone mount", cmd, mnt, counters, None, readers=4, seconds=seconds, env=rclone_env
        )
    remote = f"s3://{BUCKET}/{name}/mds"
    mosaic_env = {**env, "S3_ENDPOINT_URL": endpoint}
    # Mosaic's shard cache; tiers of half the dataset only for the ~110 KiB files (Mosaic wants a limit of
    # at least four shards, more than half of the ~4 KiB files' eight).
    for system, limit in (("MosaicML Streaming", None), ("Mosaic cache=half", ds["bytes"] // 2)):
        if not peers["mosaic"] or (limit is not None and name != "inet"):
            continue
        local = work / "mosaic-cache"
        shutil.rmtree(local, ignore_errors=True)
        extra = ["--cache-limit", str(limit)] if limit else []
        try:
            epochs_in_one_process(
                results,
                storage,
                ds,
                system,
                ["mosaic", remote, str(local), "--workers", "4", *extra],
                counters,
                mosaic_env,
                2 if limit is None else 3,
                work,
            )
        except RuntimeError as e:
            log(f"{system} failed: {e}")
        finally:
            shutil.rmtree(local, ignore_errors=True)
    if peers["webdataset"]:
        shards = sorted((work / "store" / BUCKET / name / "wds").glob("*.tar"))
        urls = [f"{endpoint}/{BUCKET}/{name}/wds/{s.name}" for s in shards]
        out = counted(counters, lambda: loader_pass(["wds", *urls, "--workers", "4"], None, None)[0])
        record(results, storage, ds, "WebDataset", 4, "1", out)


# --- report ----------------------------------------------------------------------------------------------
def cap_files_per_s(storage: str, ds: dict) -> float | None:
    """The storage's bandwidth cap in files/s at this dataset's mean file size (None: not throttled).  A
    system that reads each file alone meets the IOPS cap first on small files; the bandwidth cap is the
    most any system can get."""
    mean = ds["bytes"] / len(ds["names"])
    if storage in DISKS:
        bps = DISKS[storage][1]
        return None if bps is None else bps / mean
    return LINK_MBIT * 1e6 / 8 / mean


def table(results: list, datasets: dict) -> str:
    lines = [
        "| storage | dataset | system | readers | epoch | files/s | MB/s | of cap | storage MiB | requests | "
        "storage done at | daemon CPU ms/file |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        cap = cap_files_per_s(r["storage"], datasets[r["dataset"]])
        frac = f"{r['files_per_s'] / cap:.2f}" if cap else ""
        cpu = "" if r["daemon_cpu_s_per_file"] is None else f"{r['daemon_cpu_s_per_file'] * 1000:.3f}"
        cut = "" if r["complete"] else " (cut)"
        # How much of the pass the storage was still delivering: the rest is serving (a FUSE tail).
        # (The sampling starts and ends a little apart from the reader's own clock: at most 100%.)
        done = f"{min(1.0, r['storage_done_s'] / r['seconds']):.0%}" if r.get("storage_done_s") is not None else ""
        if r.get("files_by_storage_done") is not None:  # what the reader had read by then
            done += f" ({r['files_by_storage_done']:,} files)"
        lines.append(
            f"| {r['storage']} | {r['dataset']} | {r['system']}{cut} | {r['readers']} | {r['epoch']} | "
            f"{r['files_per_s']:,.0f} | {r['mb_per_s']:.1f} | {frac} | {(r['storage_bytes'] or 0) / MiB:,.1f} | "
            f"{r['storage_requests'] or 0:,} | {done} | {cpu} |"
        )
    return "\n".join(lines)


def _rate(results: list, storage: str, dataset: str, system: str, readers: int = 4, epoch: str = "1") -> float | None:
    for r in results:
        if (r["storage"], r["dataset"], r["system"], r["readers"], r["epoch"]) == (
            storage,
            dataset,
            system,
            readers,
            epoch,
        ):
            return r["files_per_s"]
    return None


def _row(results: list, storage: str, dataset: str, system: str, readers: int = 4, epoch: str = "1") -> dict | None:
    return next(
        (
            r
            for r in results
            if (r["storage"], r["dataset"], r["system"], r["readers"], r["epoch"])
            == (storage, dataset, system, readers, epoch)
        ),
        None,
    )


def goals(results: list, datasets: dict) -> list[tuple[str, float, float, bool]]:
    """The issue's goals, as (what, measured, goal, met) from this run's rows; a goal whose rows are missing
    from the run (a storage or peer left out) is left out."""
    out = []

    def ratio(what: str, a: float | None, b: float | None, goal: float) -> None:
        if a is not None and b:
            out.append((what, a / b, goal, a / b >= goal))

    def of_cap(storage: str, dataset: str, goal: float) -> None:
        r = _row(results, storage, dataset, "blockfs mount")
        if r is not None and dataset in datasets:
            ratio(
                f"{dataset} on {storage}: blockfs epoch 1 / bandwidth cap",
                r["files_per_s"],
                cap_files_per_s(storage, datasets[dataset]),
                goal,
            )

    for storage in ("cloud-volume", "hard-disk"):
        of_cap(storage, "inet", 0.95)
    for storage in OBJECT_STORES:
        of_cap(storage, "inet", 0.8)
    for storage in [*DISKS, *OBJECT_STORES]:
        if "tiny" in datasets and cap_files_per_s(storage, datasets["tiny"]):
            ceiling = _rate(results, storage, "tiny", "null FUSE (ceiling)") or min(
                (
                    r["files_per_s"]
                    for r in results
                    if r["system"] == "null FUSE (ceiling)" and r["dataset"] == "tiny" and r["readers"] == 4
                ),
                default=None,
            )
            binding = min(cap_files_per_s(storage, datasets["tiny"]), ceiling or float("inf"))
            ratio(
                f"tiny on {storage}: blockfs epoch 1 / min(cap, null FUSE)",
                _rate(results, storage, "tiny", "blockfs mount"),
                binding,
                0.8,
            )
    # The kernel route (issue 22): epoch 1 at page-cache pace, measured against this run's own rows.
    for storage in ("cloud-volume", "hard-disk", *OBJECT_STORES):
        ratio(
            f"tiny on {storage}: blockfs epoch 1 / its epoch 2",
            _rate(results, storage, "tiny", "blockfs mount"),
            _rate(results, storage, "tiny", "blockfs mount", epoch="2"),
            0.7,
        )
    for dataset in datasets:
        ratio(
            f"{dataset} on local: blockfs epoch 1 / raw directory cold",
            _rate(results, "local", dataset, "blockfs mount"),
            _rate(results, "local", dataset, "raw"),
            1.0,
        )
        ratio(
            f"{dataset} on local: blockfs epoch 2 / raw directory warm",
            _rate(results, "local", dataset, "blockfs mount", epoch="2"),
            _rate(results, "local", dataset, "raw", epoch="2"),
            0.9,
        )
        for storage in [*DISKS, *OBJECT_STORES]:
            ratio(
                f"{dataset} on {storage}: blockfs epoch 1, kernel route / mfusepy route",
                _rate(results, storage, dataset, "blockfs mount"),
                _rate(results, storage, dataset, "blockfs mount, mfusepy"),
                1.0,
            )
    for storage in DISKS:
        if "tiny" in datasets:
            ratio(
                f"tiny on {storage}: no-work server, kernel route / mfusepy",
                _rate(results, storage, "tiny", "null FUSE, kernel route"),
                _rate(results, storage, "tiny", "null FUSE (ceiling)"),
                2.0,
            )
    ratio(
        "tiny on hard-disk: blockfs / raw",
        _rate(results, "hard-disk", "tiny", "blockfs mount"),
        _rate(results, "hard-disk", "tiny", "raw"),
        10,
    )
    ratio(
        f"tiny on cloud-volume: blockfs / raw ({'listed first' if LIST_FIRST else 'from a list, no listing'})",
        _rate(results, "cloud-volume", "tiny", "blockfs mount"),
        _rate(results, "cloud-volume", "tiny", "raw"),
        3,
    )
    for dataset in datasets:
        for peer in ("s3fs-fuse", "rclone mount"):
            ratio(
                f"{dataset} on object-10ms: blockfs / {peer}",
                _rate(results, "object-10ms", dataset, "blockfs mount"),
                _rate(results, "object-10ms", dataset, peer),
                10,
            )
    for storage, dataset in (("hard-disk", "inet"), ("hard-disk", "tiny"), ("cloud-volume", "tiny")):
        ratio(
            f"{dataset} on {storage}: blockfs / ratarmount",
            _rate(results, storage, dataset, "blockfs mount"),
            _rate(results, storage, dataset, "ratarmount"),
            3,
        )
        ratio(
            f"{dataset} on {storage}: blockfs / squashfuse_ll",
            _rate(results, storage, dataset, "blockfs mount"),
            _rate(results, storage, dataset, "squashfuse_ll"),
            1.5,
        )
    ratio(
        "inet on cloud-volume: blockfs / squashfuse_ll (bandwidth binds)",
        _rate(results, "cloud-volume", "inet", "blockfs mount"),
        _rate(results, "cloud-volume", "inet", "squashfuse_ll"),
        1.0,
    )
    for storage in OBJECT_STORES:
        for dataset in datasets:
            loader = _rate(results, storage, dataset, "blockfs loader")
            ratio(
                f"{dataset} on {storage}: blockfs loader / MosaicML Streaming",
                loader,
                _rate(results, storage, dataset, "MosaicML Streaming"),
                1.2,
            )
            ratio(
                f"{dataset} on {storage}: blockfs loader / WebDataset",
                loader,
                _rate(results, storage, dataset, "WebDataset"),
                1.0,
            )
            size = datasets[dataset]["bytes"]
            for system, epoch in (("blockfs mount", "2"), ("blockfs mount+disk", "remount")):
                r = _row(results, storage, dataset, system, epoch=epoch)
                if r is not None:  # a mount asks for blockfs.json (a few KiB) to know the pack: no block bytes
                    sent = r["storage_bytes"] / 1024
                    out.append(
                        (
                            f"{dataset} on {storage}: {system} epoch {epoch}, KiB sent (metadata only)",
                            sent,
                            64.0,
                            sent <= 64,
                        )
                    )
            # Mosaic's cache=half rows are reported, not judged: in the run recorded in the README its epoch 1
            # sent 3.6x the dataset and its epochs 2-3 none, which half the shards cannot explain.
            for system in ("blockfs tiers=half",):
                for epoch in ("2", "3"):
                    r = _row(results, storage, dataset, system, epoch=epoch)
                    if r is not None:
                        sent = r["storage_bytes"] / size
                        out.append(
                            (
                                f"{dataset} on {storage}: {system} epoch {epoch}, share sent (<= 0.55)",
                                sent,
                                0.55,
                                sent <= 0.55,
                            )
                        )
    return out


def plot(results: list, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    storages = [*DISKS, *OBJECT_STORES]
    keys = sorted({(r["storage"], r["dataset"]) for r in results}, key=lambda k: (k[1], storages.index(k[0])))
    fig, axes = plt.subplots(len(keys), 1, figsize=(10, 2.2 * len(keys)), squeeze=False)
    for ax, (storage, dataset) in zip(axes[:, 0], keys, strict=False):
        rows = [r for r in results if r["storage"] == storage and r["dataset"] == dataset and r["epoch"] == "1"]
        labels = [f"{r['system']} r{r['readers']}" for r in rows]
        colors = ["tab:blue" if r["system"].startswith("blockfs") else "tab:gray" for r in rows]
        ax.barh(labels, [r["files_per_s"] for r in rows], color=colors)
        ax.set_xscale("log")
        ax.set_title(f"{dataset} on {storage}: epoch 1, files/s", fontsize=9)
        ax.tick_params(labelsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=90)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--storages", default=",".join([*DISKS, *OBJECT_STORES]))
    parser.add_argument("--datasets", default="inet,tiny")
    parser.add_argument("--files", type=int, default=6000, help="~110 KiB files")
    parser.add_argument("--tiny-files", type=int, default=30000, help="~4 KiB files")
    parser.add_argument("--seconds", type=float, default=20.0, help="cut slow per-file systems after this long")
    parser.add_argument(
        "--no-peers", action="store_true", help="skip ratarmount, squashfuse, s3fs, rclone, Mosaic, WebDataset"
    )
    parser.add_argument(
        "--systems",
        default=",".join(SYSTEMS),
        help="on the disks, run only these (comma-separated): " + ", ".join(SYSTEMS),
    )
    parser.add_argument("--readers", default="1,4", help="reader threads per pass, comma-separated (1, 4)")
    parser.add_argument(
        "--no-list",
        action="store_true",
        help="readers open the paths straight from the list, no listing first (a CSV-driven dataset)",
    )
    parser.add_argument("--work", type=Path, default=Path("/var/tmp/blockfs-bench-storage"))
    parser.add_argument("--json", type=Path)
    parser.add_argument("--png", type=Path)
    args = parser.parse_args(argv)
    if os.geteuid() != 0:
        print("bench_storage: needs root (cgroup v1 blkio, network namespaces)", file=sys.stderr)
        return 2
    # Tools pip installed beside this interpreter (ratarmount, hadro) are found without activating its venv.
    os.environ["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"
    storages = args.storages.split(",")
    args.systems = set(args.systems.split(","))
    if args.systems - set(SYSTEMS):
        print(
            f"bench_storage: unknown system {sorted(args.systems - set(SYSTEMS))[0]!r}: choose from {', '.join(SYSTEMS)}",
            file=sys.stderr,
        )
        return 2
    try:
        args.readers = tuple(int(n) for n in args.readers.split(","))
    except ValueError:
        args.readers = ()
    if not args.readers or any(n not in (1, 4) for n in args.readers):
        print("bench_storage: --readers takes 1, 4 or 1,4", file=sys.stderr)
        return 2
    global LIST_FIRST
    LIST_FIRST = not args.no_list
    unknown = [s for s in storages if s not in DISKS and s not in OBJECT_STORES]
    if unknown:
        print(
            f"bench_storage: unknown storage {unknown[0]!r}: choose from {', '.join([*DISKS, *OBJECT_STORES])}",
            file=sys.stderr,
        )
        return 2
    if any(s in OBJECT_STORES for s in storages) and not shutil.which("hadro"):
        print(
            "bench_storage: the object-store runs need hadro (bash tools/bench/bench_storage_setup.sh)", file=sys.stderr
        )
        return 2
    args.work.mkdir(parents=True, exist_ok=True)
    args.peers = available_peers(args.no_peers)
    datasets = {}
    for name in args.datasets.split(","):
        datasets[name] = make_dataset(args.work, name, args.files if name == "inet" else args.tiny_files, args.peers)
    results: list = []
    for storage in storages:
        for name, ds in datasets.items():
            log(f"--- {name} on {storage}")
            try:
                if storage in DISKS:
                    bench_disk(storage, ds, args.work, results, args)
                else:
                    bench_object(storage, ds, args.work, results, args)
            except Unavailable as e:
                print(f"bench_storage: cannot emulate {storage}: {e}", file=sys.stderr)
                return 2
    print(table(results, datasets))
    checked = goals(results, datasets)
    print()
    for what, measured, goal, met in checked:
        print(f"{'met   ' if met else 'missed'} {what}: {measured:.2f} (goal {goal:g})")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(
            json.dumps(
                {
                    "results": results,
                    "goals": checked,
                    "datasets": {k: {"files": len(v["names"]), "bytes": v["bytes"]} for k, v in datasets.items()},
                },
                indent=1,
            )
        )
    if args.png:
        plot(results, args.png)
    return 0


if __name__ == "__main__":
    sys.exit(main())
