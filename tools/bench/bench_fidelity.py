"""Does a model trained through the blockfs loader reach the accuracy of one trained with a global shuffle?

    python tools/bench/bench_fidelity.py WORKDIR [--files 6000] [--test-files 2500] [--classes 50] [--image-size 16]
        [--files-per-block 60] [--epochs 5] [--batch-size 64] [--lr 0.05] [--seeds 0,1,2]
        [--configs global,blockfs,no-interleave,directory,reuse,importance] [--cache-size 256MiB]
        [--out FILE.json] [--table FILE.md] [--plot FILE.png]

Batch class entropy says how well an order mixes classes; a user deciding whether to trust the
block-shuffled order asks whether the model ends up as good. So this trains the same small CNN
(``examples/train_block_loader.py``'s) on the same generated dataset (``tools/make_dataset.py --mode
learnable``: one drawn shape and hue band per class, many classes and few samples each, so the final
accuracy is not at the ceiling), once per configuration and seed, and evaluates it on a held-out tree drawn
with another seed after every epoch:

- ``global``: torch ``DataLoader(shuffle=True)`` over the raw directory (the reference);
- ``blockfs``: the blockfs loader with its defaults over a mount of a default (shuffled) pack;
- ``no-interleave``: the same with ``blocks_in_flight=1`` (one block at a time);
- ``directory``: the defaults over a ``--order directory`` pack, whose blocks hold one class each (the
  known failure: NVIDIA DALI measured 80 % of each batch from 2 of 20 classes in that case);
- ``reuse``: ``reuse=True`` (each sample is in two batches per epoch: twice the steps, half the reads);
- ``importance``: ``importance=ImportanceConfig()`` at its defaults (after two full epochs, half the samples).

Blocks are cut at ``--files-per-block`` files, about half a class and one batch, as 64 MiB blocks of
ImageNet hold about half a class; with the default 64 MiB the whole tree would be one block and every order
the same. Everything runs on the CPU in one process with one thread and fixed seeds (model, order, pack),
so the accuracies repeat exactly; the times are wall seconds of the training loops (reading, decoding,
training; not evaluation). Each run uses the same learning-rate schedule over its epochs (linear warm-up,
cosine decay to zero), so runs with more or fewer steps per epoch (reuse, importance) end annealed too.
It also computes, from the loader's epoch plans alone (no training), each pack's batch class entropy by
``blocks_in_flight``: how much interleave a pack needs. Writes JSON (``--out``), Markdown tables
(``--table``) and a PNG of the accuracy curves (``--plot``, drawn with Pillow, so no matplotlib is needed);
the mounts are always unmounted. Without FUSE (``/dev/fuse``) it refuses to run the
configurations that need a mount.
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import os
import platform
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import helpers  # noqa: F401  (puts tools/ and the checkout on sys.path: make_dataset, blockfs)

# isort: split
import make_dataset as md
import numpy as np
from bench_loader import FileDataset, list_tree, mean_batch_entropy, mounted
from helpers import ROOT
from helpers.fidelity_report import entropy_sweep, plot, summarise, sweep_table, table, verdict

sys.path.insert(0, str(ROOT / "examples"))  # train_block_loader's model and decoder, imported where used


@dataclass(frozen=True)
class Config:
    """One way of feeding the model: a torch DataLoader over the raw tree (``pack=None``) or the blockfs
    loader with ``options`` over a mount of the pack made with ``--order pack``."""

    name: str
    what: str
    pack: str | None
    options: dict = field(default_factory=dict)


def _configs() -> dict[str, Config]:
    from blockfs.loader import ImportanceConfig

    return {
        c.name: c
        for c in (
            Config("global", "torch DataLoader(shuffle=True), raw directory (reference)", None),
            Config("blockfs", "blockfs loader, defaults, shuffled pack (default)", "shuffled"),
            Config(
                "no-interleave",
                "blockfs loader, blocks_in_flight=1, shuffled pack",
                "shuffled",
                {"blocks_in_flight": 1},
            ),
            Config("directory", "blockfs loader, defaults, --order directory pack", "directory"),
            Config("reuse", "blockfs loader, reuse=True, shuffled pack", "shuffled", {"reuse": True}),
            Config(
                "importance",
                "blockfs loader, importance=ImportanceConfig(), shuffled pack",
                "shuffled",
                {"importance": ImportanceConfig()},
            ),
            Config(
                "ranks-global",
                "2 ranks (DDP simulated: one step per pair of half batches), partition='global'",
                "shuffled",
                {"ranks": 2},
            ),
            Config(
                "ranks-node",
                "2 ranks on 2 nodes (DDP simulated), partition='node'",
                "shuffled",
                {"ranks": 2, "partition": "node", "nodes": 2},
            ),
        )
    }


# --- data --------------------------------------------------------------------------------------------
def prepare(workdir: Path, args: argparse.Namespace) -> dict:
    """The train and test trees and the two packs under ``workdir``, made once and reused."""
    import blockfs

    spec = {
        "files": args.files,
        "test_files": args.test_files,
        "classes": args.classes,
        "image_size": args.image_size,
        "files_per_block": args.files_per_block,
        "seed": args.data_seed,
    }
    stamp = workdir / "dataset.json"
    if stamp.exists() and json.loads(stamp.read_text()).get("spec") == spec:
        return json.loads(stamp.read_text())
    workdir.mkdir(parents=True, exist_ok=True)
    made = {}  # the held-out tree is drawn with the next seed: other images of the same classes
    for tree, files, seed in (("train", args.files, args.data_seed), ("test", args.test_files, args.data_seed + 1)):
        made[tree] = md.make_dataset(
            workdir / tree, "learnable", files, args.classes, seed, args.image_size, force=True
        )
    blocks = {}
    for order in ("shuffled", "directory"):
        result = blockfs.pack(
            workdir / "train",
            workdir / f"packed-{order}",
            order=order,
            seed=args.data_seed,
            files_per_block=args.files_per_block,
            fsync=False,
            force=True,
        )
        blocks[order] = result.n_blocks
    info = {"spec": spec, "train_bytes": made["train"]["bytes"], "blocks": blocks}
    stamp.write_text(json.dumps(info))
    return info


class DecodedFiles(FileDataset):
    """The raw tree as an unmodified training script reads it: ``(image, label, index)`` per sample."""

    def __init__(self, root: Path, image_size: int) -> None:
        super().__init__(str(root))
        self.image_size = image_size

    def __getitem__(self, i: int) -> tuple:
        from train_block_loader import decode_image

        data, label = super().__getitem__(i)
        return decode_image(data, self.image_size), label, i


def held_out_tensors(root: Path, image_size: int) -> tuple:
    """The held-out tree, decoded once: images (N, 3, S, S) and labels."""
    import torch

    files = DecodedFiles(root, image_size)
    images, labels, _ = zip(*(files[i] for i in range(len(files))), strict=True)
    return files.classes, torch.stack(images), torch.tensor(labels)


# --- feeding and training ----------------------------------------------------------------------------
class RawFeed:
    """torch ``DataLoader(shuffle=True)`` over the raw tree, seeded."""

    def __init__(self, root: Path, args: argparse.Namespace, seed: int) -> None:
        import torch

        self.loader = torch.utils.data.DataLoader(
            DecodedFiles(root, args.image_size),
            batch_size=args.batch_size,
            shuffle=True,
            generator=torch.Generator().manual_seed(seed),
        )
        self.importance = None

    def epoch(self, epoch: int) -> tuple[int, Iterator]:
        return len(self.loader), iter(self.loader)

    def close(self) -> None:
        pass


class BlockFeed:
    """The blockfs loader over a mount, with the configuration's options."""

    def __init__(self, mnt: str, args: argparse.Namespace, seed: int, options: dict) -> None:
        from train_block_loader import decode_image

        from blockfs.loader import BlockLoader

        decode = functools.partial(decode_image, size=args.image_size)
        self.loader = BlockLoader(mnt, args.batch_size, decode, device="cpu", seed=seed, **options)
        self.importance = self.loader.importance

    def epoch(self, epoch: int) -> tuple[int, Iterator]:
        self.loader.set_epoch(epoch)
        return len(self.loader), iter(self.loader)

    def close(self) -> None:
        self.loader.close()


class RanksFeed:
    """Data-parallel training simulated in one process: ``ranks`` blockfs loaders (one per rank, half the
    batch each) and one optimizer step per set of their batches -- the gradient DDP averages, since every
    rank's batch has the same size."""

    def __init__(self, mnt: str, args: argparse.Namespace, seed: int, options: dict) -> None:
        from train_block_loader import decode_image

        from blockfs.loader import BlockLoader

        options = dict(options)
        ranks = options.pop("ranks")
        decode = functools.partial(decode_image, size=args.image_size)
        self.loaders = [
            BlockLoader(
                mnt, args.batch_size // ranks, decode, device="cpu", seed=seed, rank=r, world_size=ranks, **options
            )
            for r in range(ranks)
        ]
        self.importance = None

    def epoch(self, epoch: int) -> tuple[int, Iterator]:
        import torch

        for loader in self.loaders:
            loader.set_epoch(epoch)
        steps = min(len(loader) for loader in self.loaders)

        def batches() -> Iterator:
            for parts in zip(*self.loaders, strict=True):
                yield tuple(torch.cat([part[i] for part in parts]) for i in range(3))

        return steps, batches()

    def close(self) -> None:
        for loader in self.loaders:
            loader.close()


def learning_rate(progress: float, peak: float, warmup: float = 0.15) -> float:
    """Linear warm-up to ``peak`` over the first ``warmup`` of training, then a cosine down to zero."""
    if progress < warmup:
        return peak * progress / warmup
    return peak * 0.5 * (1.0 + math.cos(math.pi * (progress - warmup) / (1.0 - warmup)))


def train(feed, args: argparse.Namespace, seed: int, test: tuple) -> dict:
    """Train a fresh model on ``feed`` for ``args.epochs``; per epoch: test accuracy, batch entropy, steps."""
    import torch
    from torch import nn
    from train_block_loader import small_cnn

    classes, test_images, test_labels = test
    torch.manual_seed(seed)
    model = small_cnn(len(classes))
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9, weight_decay=5e-4)
    loss_fn = nn.CrossEntropyLoss(reduction="none")
    curve, entropy, steps, seconds = [], [], [], 0.0
    for epoch in range(args.epochs):
        started = time.perf_counter()
        model.train()
        n_steps, batches = feed.epoch(epoch)
        seen_labels = []
        for k, (images, labels, ids) in enumerate(batches):
            for group in optimizer.param_groups:
                group["lr"] = learning_rate((epoch + k / n_steps) / args.epochs, args.lr)
            per_sample = loss_fn(model(images), labels)
            optimizer.zero_grad()
            per_sample.mean().backward()
            optimizer.step()
            if feed.importance is not None:
                feed.loader.report_losses(ids, per_sample.detach())
            seen_labels.append(labels.numpy())
        seconds += time.perf_counter() - started
        model.eval()
        with torch.no_grad():
            curve.append(float((model(test_images).argmax(1) == test_labels).float().mean()))
        entropy.append(mean_batch_entropy(seen_labels, args.batch_size))
        steps.append(len(seen_labels))
    return {"seed": seed, "accuracy": curve, "batch_entropy": entropy, "steps": steps, "train_s": seconds}


def run_config(config: Config, mnt: str | None, args: argparse.Namespace, test: tuple) -> list[dict]:
    runs = []
    for seed in args.seeds:
        if mnt is None:
            feed = RawFeed(args.workdir / "train", args, seed)
        elif "ranks" in config.options:
            feed = RanksFeed(mnt, args, seed, config.options)
        else:
            feed = BlockFeed(mnt, args, seed, config.options)
        try:
            runs.append(train(feed, args, seed, test))
        finally:
            feed.close()
        last = runs[-1]
        print(
            f"  {config.name} seed {seed}: accuracy {last['accuracy'][-1]:.4f}, entropy "
            f"{np.mean(last['batch_entropy']):.3f} bits, {last['train_s']:.1f} s",
            flush=True,
        )
    return runs


def run_all(configs: list[Config], args: argparse.Namespace, test: tuple) -> dict[str, list[dict]]:
    """Every configuration, grouped by pack so each pack is mounted once (and always unmounted)."""
    results: dict[str, list[dict]] = {}
    for pack in (None, "shuffled", "directory"):
        group = [c for c in configs if c.pack == pack]
        if not group:
            continue
        if pack is None:
            for config in group:
                results[config.name] = run_config(config, None, args, test)
            continue
        packed, mnt = args.workdir / f"packed-{pack}", args.workdir / f"mnt-{pack}"
        with mounted(packed, mnt, args.cache_size) as root:
            for config in group:
                results[config.name] = run_config(config, root, args, test)
    return results


# --- main --------------------------------------------------------------------------------------------
def fuse_problem() -> str | None:
    """Why a mount cannot work here, or None."""
    if not os.path.exists("/dev/fuse"):
        return "/dev/fuse does not exist (no FUSE in this kernel or container)"
    if not os.access("/dev/fuse", os.R_OK | os.W_OK):
        return "/dev/fuse is not readable and writable by this user"
    return None


def parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("workdir", type=Path, help="keeps the trees, packs and mount points (reused)")
    parser.add_argument("--files", type=int, default=6000, help="training images")
    parser.add_argument("--test-files", type=int, default=2500, help="held-out images")
    parser.add_argument("--classes", type=int, default=50)
    parser.add_argument("--image-size", type=int, default=16)
    parser.add_argument("--files-per-block", type=int, default=60)
    parser.add_argument("--data-seed", type=int, default=0, help="seed of the trees and of the shuffled pack")
    parser.add_argument("--epochs", type=int, default=5)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--lr", type=float, default=0.05, help="peak learning rate (SGD, momentum 0.9)")
    parser.add_argument("--seeds", default="0,1,2", help="one run per seed and configuration")
    parser.add_argument("--configs", default="global,blockfs,no-interleave,directory,reuse,importance")
    parser.add_argument("--cache-size", default="256MiB", help="the mounts' --cache-size")
    parser.add_argument("--out", type=Path, help="JSON (default WORKDIR/bench_fidelity.json)")
    parser.add_argument("--table", type=Path, help="Markdown table (default WORKDIR/bench_fidelity.md)")
    parser.add_argument("--plot", type=Path, help="PNG of the accuracy curves (default WORKDIR/bench_fidelity.png)")
    args = parser.parse_args(argv)
    args.workdir = args.workdir.resolve()
    try:
        args.seeds = [int(s) for s in args.seeds.split(",") if s]
    except ValueError:
        parser.error(f"--seeds must be comma-separated integers (got {args.seeds!r})")
    for name in ("files", "test_files", "classes", "image_size", "files_per_block", "epochs", "batch_size"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1 (got {getattr(args, name)})")
    if args.image_size < md.MIN_IMAGE_SIZE:
        parser.error(f"--image-size must be at least {md.MIN_IMAGE_SIZE} (got {args.image_size})")
    if min(args.files, args.test_files) < max(args.classes, args.batch_size):
        parser.error("--files and --test-files must be at least --classes and --batch-size")
    if not args.seeds or min(args.seeds) < 0:
        parser.error(f"--seeds needs at least one non-negative seed (got {args.seeds})")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    known = _configs()
    names = [c for c in args.configs.split(",") if c]
    unknown = [c for c in names if c not in known]
    if unknown:
        print(
            f"bench_fidelity.py: error: unknown configurations {unknown}; choose from {', '.join(known)}",
            file=sys.stderr,
        )
        return 2
    configs = [known[c] for c in names]
    problem = fuse_problem() if any(c.pack for c in configs) else None
    if problem:
        print(
            f"bench_fidelity.py: error: cannot mount: {problem}; only --configs global runs without FUSE",
            file=sys.stderr,
        )
        return 2

    import torch

    from blockfs.errors import MountError

    started = time.perf_counter()
    torch.set_num_threads(1)  # a fixed reduction order: the runs repeat exactly
    torch.use_deterministic_algorithms(True)
    data = prepare(args.workdir, args)
    test = held_out_tensors(args.workdir / "test", args.image_size)
    train_classes, _ = list_tree(args.workdir / "train")
    if train_classes != test[0]:
        raise RuntimeError(f"the train and test trees' classes differ: {train_classes[:3]}... {test[0][:3]}...")
    try:
        results = run_all(configs, args, test)
    except MountError as e:
        print(f"bench_fidelity.py: error: cannot mount: {e}", file=sys.stderr)
        return 2
    summary = summarise(configs, results)
    sweep = entropy_sweep(args.workdir, args.seeds, args.batch_size)
    title = (
        f"{args.files} train / {args.test_files} test images, {args.classes} classes, "
        f"{args.image_size}px, {args.files_per_block} files per block ({data['blocks']['shuffled']} blocks), "
        f"batch {args.batch_size}, {args.epochs} epochs, seeds {args.seeds}"
    )
    text = table(summary) + "\n\nBatch class entropy x a global shuffle's, by interleave (epoch plans only):\n\n"
    text += sweep_table(sweep)
    print(f"\n{title}\n\n{text}")
    check = verdict(summary)
    if check:
        print(f"\n{check}")
    report = {
        "title": title,
        "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "dataset": data,
        "verdict": check,
        "summary": summary,
        "entropy_sweep": sweep,
        "total_s": time.perf_counter() - started,
        "machine": {
            "cpus": os.cpu_count(),
            "python": platform.python_version(),
            "torch": torch.__version__,
            "platform": platform.platform(),
        },
    }
    out = args.out or args.workdir / "bench_fidelity.json"
    out.write_text(json.dumps(report, indent=1))
    (args.table or args.workdir / "bench_fidelity.md").write_text(f"{title}\n\n{text}\n\n{check or ''}\n")
    plot(summary, args.plot or args.workdir / "bench_fidelity.png", title)
    print(f"\nwrote {out} ({report['total_s']:.0f} s in all, data included)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
