"""Benchmark the companion loader against the loaders people use today, on one generated dataset.

    python tools/bench/bench_loader.py WORKDIR [--mode imagenet] [--files 20000] [--classes 100] [--seed 0]
        [--batch-size 256] [--workers 2] [--epochs 2] [--shard-files 500] [--cache-size auto]
        [--systems blockfs,blockfs-no-share,dataloader-raw,dataloader-mount,webdataset]
        [--out FILE.json] [--plot FILE.png]
        [--no-drop-caches]

WORKDIR keeps the generated tree (``src``), its packed dataset (``packed``, default pack options: seeded
random order) and WebDataset tar shards of the same files (``shards``, written in a seeded random order as
WebDataset recommends, each file with a ``.cls`` member holding its label); they are reused when present.
Every system reads every sample's bytes (no decoding, so the loaders' I/O is what is compared), with the
same batch size and number of worker processes, for ``--epochs`` epochs:

- ``blockfs``: :class:`blockfs.loader.block_loader.BlockLoader` over a fresh mount of the packed dataset;
- ``blockfs-no-share``: the same over a mount with ``--no-share`` (every file through FUSE, via ``blocks/``);
- ``dataloader-raw``: torch ``DataLoader(shuffle=True)`` over a plain file dataset (ImageFolder-style
  listing, ``open``/``read`` per file) of the raw directory;
- ``dataloader-mount``: the same over a fresh mount;
- ``webdataset``: ``WebDataset(shards, shardshuffle=100).shuffle(1000)`` in a ``DataLoader`` (skipped
  when the ``webdataset`` package is missing).

Before each system the page cache is dropped (``sync; echo 3 > /proc/sys/vm/drop_caches``, root only), so
its first epoch is cold; its second epoch is whatever its design keeps warm (the mount's block cache, the
kernel's page cache). For each system: setup seconds (listing, mounting), samples/s per epoch, and the mean
per-batch class entropy of its first epoch's batches against that of a global shuffle of the same labels.
Prints a table, writes JSON (``--out``) and a bar chart (``--plot``, PNG drawn with Pillow).
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import platform
import subprocess
import sys
import tarfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import helpers  # noqa: F401  (puts tools/ and the checkout on sys.path: make_dataset, blockfs)

# isort: split
import make_dataset as md
import numpy as np
from helpers.benchutil import drop_caches

SYSTEMS = ("blockfs", "blockfs-no-share", "dataloader-raw", "dataloader-mount", "webdataset")


# --- preparing the data -----------------------------------------------------------------------------
def prepare(workdir: Path, args: argparse.Namespace) -> dict:
    """The tree, its packed dataset and its shards under ``workdir``, made once and reused."""
    import blockfs

    spec = {"mode": args.mode, "files": args.files, "classes": args.classes, "seed": args.seed}
    stamp = workdir / "dataset.json"
    if not stamp.exists() or json.loads(stamp.read_text()).get("spec") != spec:
        workdir.mkdir(parents=True, exist_ok=True)
        started = time.perf_counter()
        summary = md.make_dataset(workdir / "src", args.mode, args.files, args.classes, args.seed, force=True)
        made = time.perf_counter() - started
        started = time.perf_counter()
        packed = blockfs.pack(workdir / "src", workdir / "packed", force=True)
        stamp.write_text(
            json.dumps(
                {
                    "spec": spec,
                    "bytes": summary["bytes"],
                    "blocks": packed.n_blocks,
                    "make_s": made,
                    "pack_s": time.perf_counter() - started,
                }
            )
        )
        for old in (workdir / "shards").glob("*.tar"):
            old.unlink()
    shards = workdir / "shards"
    if not any(shards.glob("*.tar")):
        write_shards(workdir / "src", shards, args.shard_files, args.seed)
    return json.loads(stamp.read_text())


def list_tree(root: Path) -> tuple[list[str], list[tuple[str, int]]]:
    """ImageFolder's listing: sorted class directories, each one's files sorted, labelled by class index."""
    classes = sorted(e.name for e in os.scandir(root) if e.is_dir())
    samples = []
    for label, name in enumerate(classes):
        files = sorted(e.path for e in os.scandir(os.path.join(root, name)) if e.is_file())
        samples.extend((path, label) for path in files)
    return classes, samples


def write_shards(src: Path, shards: Path, per_shard: int, seed: int) -> None:
    """WebDataset tar shards of ``src`` in a seeded random order: ``<class>/<name>.<ext>`` and ``.cls``."""
    shards.mkdir(parents=True, exist_ok=True)
    _, samples = list_tree(src)
    order = np.random.default_rng(seed).permutation(len(samples))
    for s, start in enumerate(range(0, len(samples), per_shard)):
        with tarfile.open(shards / f"shard-{s:05d}.tar", "w") as tar:
            for i in order[start : start + per_shard].tolist():
                path, label = samples[i]
                rel = os.path.relpath(path, src)
                tar.add(path, arcname=rel, recursive=False)
                cls = str(label).encode()
                info = tarfile.TarInfo(rel.rsplit(".", 1)[0] + ".cls")
                info.size = len(cls)
                tar.addfile(info, io.BytesIO(cls))


@contextlib.contextmanager
def mounted(packed: Path, mountpoint: Path, cache_size: str, *extra: str) -> Iterator[str]:
    """A fresh (cold) mount of ``packed``, served by a child process and always unmounted."""
    from blockfs.serve.daemon import is_mounted, unmount, wait_until_mounted

    mountpoint.mkdir(parents=True, exist_ok=True)
    log = mountpoint.parent / f"{mountpoint.name}.log"
    command = [
        sys.executable,
        "-m",
        "blockfs",
        "mount",
        str(packed.resolve()),
        str(mountpoint),
        "--foreground",
        "--log",
        str(log),
        "--cache-size",
        cache_size,
        *extra,
    ]
    with open(log, "ab") as out:
        proc = subprocess.Popen(command, stdin=subprocess.DEVNULL, stdout=out, stderr=out)
    try:
        wait_until_mounted(mountpoint, proc, 60, str(log))
        yield str(mountpoint)
    finally:
        if is_mounted(mountpoint):
            unmount(mountpoint)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


# --- the systems ------------------------------------------------------------------------------------
class FileDataset:
    """The plain file dataset an unmodified training script uses: listed once, one ``open`` per sample."""

    def __init__(self, root: str) -> None:
        self.classes, self.samples = list_tree(Path(root))

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, i: int) -> tuple[bytes, int]:
        path, label = self.samples[i]
        with open(path, "rb") as f:
            return f.read(), label


def collate_bytes(batch: list) -> tuple[list[bytes], torch.Tensor]:
    import torch

    return [data for data, _ in batch], torch.tensor([label for _, label in batch])


def decode_wds(sample: tuple) -> tuple[bytes, int]:
    data, cls = sample
    return data, int(cls)


def timed_epochs(make_epoch: Callable[[int], Iterator], epochs: int) -> list[dict]:
    """Per epoch: seconds, samples and the label arrays of its batches."""
    out = []
    for epoch in range(epochs):
        started = time.perf_counter()
        labels = []
        for batch_labels in make_epoch(epoch):
            labels.append(np.asarray(batch_labels, dtype=np.int64))
        seconds = time.perf_counter() - started
        out.append({"seconds": seconds, "samples": int(sum(b.size for b in labels)), "labels": labels})
    return out


def run_blockfs(ctx: dict, *mount_options: str) -> tuple[float, list[dict]]:
    from blockfs.loader import BlockLoader

    args = ctx["args"]
    with mounted(ctx["packed"], ctx["mnt"], args.cache_size, *mount_options) as mnt:
        started = time.perf_counter()
        loader = BlockLoader(mnt, args.batch_size, device="cpu", seed=args.seed, num_workers=args.workers)
        setup = time.perf_counter() - started

        def epoch(e: int) -> Iterator:
            loader.set_epoch(e)
            for _, labels, _ in loader:
                yield labels.numpy()

        try:
            return setup, timed_epochs(epoch, args.epochs)
        finally:
            loader.close()


def _dataloader_epochs(root: str, args: argparse.Namespace) -> tuple[float, list[dict]]:
    import torch

    started = time.perf_counter()
    dataset = FileDataset(root)
    loader = torch.utils.data.DataLoader(
        dataset,
        batch_size=args.batch_size,
        shuffle=True,
        num_workers=args.workers,
        collate_fn=collate_bytes,
        generator=torch.Generator().manual_seed(args.seed),
        persistent_workers=args.workers > 0,
    )
    setup = time.perf_counter() - started

    def epoch(_: int) -> Iterator:
        for _, labels in loader:
            yield labels.numpy()

    try:
        return setup, timed_epochs(epoch, args.epochs)
    finally:
        del loader  # persistent workers hold files of the mount open


def run_dataloader_raw(ctx: dict) -> tuple[float, list[dict]]:
    return _dataloader_epochs(str(ctx["src"]), ctx["args"])


def run_dataloader_mount(ctx: dict) -> tuple[float, list[dict]]:
    with mounted(ctx["packed"], ctx["mnt"], ctx["args"].cache_size) as mnt:
        return _dataloader_epochs(mnt, ctx["args"])


def run_webdataset(ctx: dict) -> tuple[float, list[dict]]:
    import torch
    import webdataset as wds

    args = ctx["args"]
    started = time.perf_counter()
    urls = sorted(str(p) for p in ctx["shards"].glob("*.tar"))
    ext = md.EXTENSIONS[args.mode].lower()  # WebDataset lower-cases extensions
    dataset = (
        wds.WebDataset(urls, shardshuffle=100, seed=args.seed, empty_check=False)
        .shuffle(1000)
        .to_tuple(ext, "cls")
        .map(decode_wds)
        .batched(args.batch_size, collation_fn=collate_bytes)
    )
    loader = torch.utils.data.DataLoader(
        dataset, batch_size=None, num_workers=args.workers, persistent_workers=args.workers > 0
    )
    setup = time.perf_counter() - started

    def epoch(_: int) -> Iterator:
        for _, labels in loader:
            yield labels.numpy()

    return setup, timed_epochs(epoch, args.epochs)


RUNNERS = {
    "blockfs": run_blockfs,
    "blockfs-no-share": lambda ctx: run_blockfs(ctx, "--no-share"),
    "dataloader-raw": run_dataloader_raw,
    "dataloader-mount": run_dataloader_mount,
    "webdataset": run_webdataset,
}


# --- measures and reports ---------------------------------------------------------------------------
def mean_batch_entropy(batches: list[np.ndarray], batch_size: int) -> float:
    """Mean class entropy (bits) of the full batches."""
    from blockfs.loader.order import batch_class_entropy

    full = [b for b in batches if b.size == batch_size]
    labels = np.concatenate(full)
    return batch_class_entropy(np.arange(labels.size), labels, batch_size)


def global_entropy(src: Path, batch_size: int, seed: int) -> float:
    from blockfs.loader.order import batch_class_entropy, global_shuffled_order

    _, samples = list_tree(src)
    labels = np.array([label for _, label in samples])
    return batch_class_entropy(global_shuffled_order(labels.size, seed=seed, epoch=0), labels, batch_size)


def table(results: dict, epochs: int) -> str:
    raw = results.get("dataloader-raw")
    head = ["system", "setup s"] + [f"epoch {e + 1} samples/s" for e in range(epochs)]
    head += [f"x raw e{e + 1}" for e in range(epochs)] if raw else []
    head += ["batch entropy", "x global"]
    rows = [head]
    for name, r in results.items():
        rate = [e["samples_per_s"] for e in r["epochs"]]
        row = [name, f"{r['setup_s']:.2f}"] + [f"{x:,.0f}" for x in rate]
        if raw:
            row += [f"{x / y:.2f}" for x, y in zip(rate, (e["samples_per_s"] for e in raw["epochs"]), strict=True)]
        row += [f"{r['batch_entropy']:.3f}", f"{r['entropy_vs_global']:.3f}"]
        rows.append(row)
    widths = [max(len(row[i]) for row in rows) for i in range(len(head))]
    lines = ["| " + " | ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)) + " |" for row in rows]
    lines.insert(1, "|" + "|".join("-" * (w + 2) for w in widths) + "|")
    return "\n".join(lines)


def plot(results: dict, epochs: int, path: Path, title: str) -> None:
    """Grouped bars of samples/s per epoch, one group per system (Pillow only)."""
    from PIL import Image, ImageDraw

    width, height, margin = 900, 480, 70
    image = Image.new("RGB", (width, height), "white")
    draw = ImageDraw.Draw(image)
    top = max(e["samples_per_s"] for r in results.values() for e in r["epochs"]) * 1.15
    colours = [(70, 110, 200), (230, 140, 40), (90, 170, 90), (160, 80, 160)]
    group = (width - 2 * margin) / max(len(results), 1)
    bar = group * 0.8 / epochs
    draw.text((margin, 15), title, fill="black")
    draw.line((margin, height - margin, width - margin, height - margin), fill="black")
    draw.line((margin, margin, margin, height - margin), fill="black")
    for tick in np.linspace(0, top, 5):
        y = height - margin - (height - 2 * margin) * tick / top
        draw.text((5, y - 6), f"{tick:,.0f}", fill="black")
    for g, (name, r) in enumerate(results.items()):
        x0 = margin + g * group + group * 0.1
        for e, epoch in enumerate(r["epochs"]):
            h = (height - 2 * margin) * epoch["samples_per_s"] / top
            box = (x0 + e * bar, height - margin - h, x0 + (e + 1) * bar - 2, height - margin)
            draw.rectangle(box, fill=colours[e % len(colours)])
            draw.text((box[0], box[1] - 12), f"{epoch['samples_per_s']:,.0f}", fill="black")
        draw.text((x0, height - margin + 8), name, fill="black")
    for e in range(epochs):
        draw.rectangle((width - 150, 40 + 18 * e, width - 138, 52 + 18 * e), fill=colours[e % len(colours)])
        draw.text((width - 132, 40 + 18 * e), f"epoch {e + 1} samples/s", fill="black")
    image.save(path)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("workdir", type=Path)
    parser.add_argument("--mode", choices=md.MODES, default="imagenet")
    parser.add_argument("--files", type=int, default=20000)
    parser.add_argument("--classes", type=int, default=100)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--batch-size", type=int, default=256)
    parser.add_argument("--workers", type=int, default=2, help="worker processes, the same for every system")
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--shard-files", type=int, default=500, help="files per WebDataset shard")
    parser.add_argument("--cache-size", default="auto", help="the mounts' --cache-size")
    parser.add_argument("--systems", default=",".join(SYSTEMS))
    parser.add_argument("--out", type=Path, help="JSON results (default: WORKDIR/bench_loader.json)")
    parser.add_argument("--plot", type=Path, help="bar chart (default: WORKDIR/bench_loader.png)")
    parser.add_argument("--no-drop-caches", action="store_true", help="keep the page cache between systems")
    args = parser.parse_args(argv)
    systems = [s for s in args.systems.split(",") if s]
    unknown = set(systems) - set(SYSTEMS)
    if unknown:
        parser.error(f"unknown systems {sorted(unknown)}; choose from {', '.join(SYSTEMS)}")

    workdir = args.workdir.resolve()
    data = prepare(workdir, args)
    ctx = {
        "args": args,
        "src": workdir / "src",
        "packed": workdir / "packed",
        "shards": workdir / "shards",
        "mnt": workdir / "mnt",
    }
    reference = global_entropy(ctx["src"], args.batch_size, args.seed)
    results: dict = {}
    cold = None
    for name in systems:
        if name == "webdataset":
            try:
                import webdataset  # noqa: F401
            except ImportError:
                print("webdataset is not installed: skipped (pip install webdataset)", file=sys.stderr)
                continue
        cold = drop_caches() if not args.no_drop_caches else False
        setup, epochs = RUNNERS[name](ctx)
        entropy = mean_batch_entropy(epochs[0]["labels"], args.batch_size)
        results[name] = {
            "setup_s": setup,
            "cold_first_epoch": cold,
            "epochs": [
                {"seconds": e["seconds"], "samples": e["samples"], "samples_per_s": e["samples"] / e["seconds"]}
                for e in epochs
            ],
            "batch_entropy": entropy,
            "entropy_vs_global": entropy / reference,
        }
        rates = ", ".join(f"{e['samples_per_s']:,.0f}" for e in results[name]["epochs"])
        print(f"{name}: setup {setup:.2f} s, samples/s per epoch {rates}, entropy {entropy:.3f}", flush=True)

    title = (
        f"{args.files} {args.mode} files ({data['bytes'] / 2**20:,.0f} MiB, {data['blocks']} blocks), "
        f"batch {args.batch_size}, {args.workers} workers, {os.cpu_count()} cores"
    )
    print(f"\n{title}; page cache dropped before each system: {bool(cold)}")
    print(f"global shuffle batch entropy: {reference:.3f} bits\n")
    print(table(results, args.epochs))
    report = {
        "dataset": {**data["spec"], "bytes": data["bytes"], "blocks": data["blocks"]},
        "batch_size": args.batch_size,
        "workers": args.workers,
        "epochs": args.epochs,
        "cache_size": args.cache_size,
        "global_batch_entropy": reference,
        "results": results,
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version(), "platform": platform.platform()},
    }
    out = args.out or workdir / "bench_loader.json"
    out.write_text(json.dumps(report, indent=1))
    if results:
        plot(results, args.epochs, args.plot or workdir / "bench_loader.png", title)
    print(f"\nwrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
