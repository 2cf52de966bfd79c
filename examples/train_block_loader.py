"""Train a small CNN on a blockfs mount with the companion loader (block-shuffled reads, batches on the GPU).

    blockfs pack TREE DATASET && blockfs mount DATASET MNT
    python examples/train_block_loader.py MNT [--epochs 3] [--batch-size 32] [--lr 0.05] [--seed 0]
        [--workers 0] [--image-size 32] [--device auto|cpu|cuda] [--reuse] [--importance FRACTION]
        [--warmup 2] [--out result.json] [--max-steps N] [--resume-at STEP] [--skip-bad]

The dataset is an ImageFolder-style tree of images (``tools/make_dataset.py --mode learnable`` makes one);
labels come from the mount's index, so no path is parsed. ``--importance`` reports each sample's loss to
the loader, which after ``--warmup`` epochs trains on that fraction of the samples. ``--resume-at STEP``
checkpoints the loader, model and optimizer after STEP steps, builds everything anew from the checkpoint
and goes on: the losses must be the same as without it (a deterministic run: one thread, fixed seeds).
A file the decoder cannot read stops the run with one line naming it; ``--skip-bad`` leaves such files out
(the loader's ``on_decode_error="skip"``) and prints how many it skipped.
"""

from __future__ import annotations

import argparse
import functools
import io
import json
import os
import sys
import time

# Older torch (until late 2025) refuses every cuBLAS call under use_deterministic_algorithms (below) unless
# cuBLAS's workspace is fixed, which cuBLAS reads when CUDA starts: so it is set before anything touches the
# GPU. Newer torch gives each stream its own workspace and needs nothing (torch 2.11 on an H100 ran without).
os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")

import numpy as np
import torch
from PIL import Image
from torch import nn

from blockfs.errors import DecodeError
from blockfs.loader import BlockLoader, ImportanceConfig


def decode_image(data: bytes, size: int) -> torch.Tensor:
    """Image bytes -> float tensor (3, size, size) in [0, 1]."""
    with Image.open(io.BytesIO(data)) as opened:
        image = opened.convert("RGB")
        if image.size != (size, size):
            image = image.resize((size, size), Image.BILINEAR)
        pixels = np.asarray(image, dtype=np.float32) / 255.0
    return torch.from_numpy(pixels).permute(2, 0, 1).contiguous()


def small_cnn(classes: int) -> nn.Module:
    """Three conv blocks, global average pooling and a linear head (as examples/train_imagefolder.py)."""
    return nn.Sequential(
        nn.Conv2d(3, 16, 3, padding=1),
        nn.BatchNorm2d(16),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Conv2d(16, 32, 3, padding=1),
        nn.BatchNorm2d(32),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Conv2d(32, 64, 3, padding=1),
        nn.BatchNorm2d(64),
        nn.ReLU(),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(64, classes),
    )


def build(args: argparse.Namespace) -> tuple[BlockLoader, nn.Module, torch.optim.Optimizer]:
    importance = ImportanceConfig(args.importance, args.warmup) if args.importance else None
    device = None if args.device == "auto" else args.device
    loader = BlockLoader(
        args.root,
        args.batch_size,
        functools.partial(decode_image, size=args.image_size),
        device,
        seed=args.seed,
        num_workers=args.workers,
        reuse=args.reuse,
        importance=importance,
        on_decode_error="skip" if args.skip_bad else "raise",
    )
    torch.manual_seed(args.seed)
    classes = len(loader.classes or []) or int(loader.mount.labels.max()) + 1
    model = small_cnn(classes).to(loader.device)
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    return loader, model, optimizer


def parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("root", metavar="MNT", help="a blockfs mount of an ImageFolder-style tree")
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--workers", type=int, default=0, help="loader worker processes")
    parser.add_argument("--image-size", type=int, default=32)
    parser.add_argument("--device", default="auto", help="auto (CUDA when available), cpu or cuda")
    parser.add_argument("--reuse", action="store_true", help="half of each batch from the sample cache")
    parser.add_argument("--importance", type=float, help="after --warmup epochs, train on this fraction")
    parser.add_argument("--warmup", type=int, default=2, help="full epochs before --importance selects")
    parser.add_argument("--out", help="write every step's loss and the final accuracy to this JSON file")
    parser.add_argument("--max-steps", type=int, help="stop after this many optimizer steps in all")
    parser.add_argument("--resume-at", type=int, help="checkpoint after this many steps and rebuild from it")
    parser.add_argument("--skip-bad", action="store_true", help="skip (and count) files the decoder cannot read")
    args = parser.parse_args(argv)
    for name in ("epochs", "batch_size", "image_size", "max_steps", "resume_at"):
        value = getattr(args, name)
        if value is not None and value < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1, got {value}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    try:
        return train(args)
    except DecodeError as e:  # one line: the file, the sample id and the fix
        hint = "" if args.skip_bad else " (here: --skip-bad)"
        print(f"train_block_loader.py: error: {e}{hint}", file=sys.stderr)
        return 2


def train(args: argparse.Namespace) -> int:
    # Reproducible: fixed seeds, deterministic kernels, one thread (a fixed reduction order).
    torch.use_deterministic_algorithms(True)
    torch.set_num_threads(1)
    loader, model, optimizer = build(args)
    loss_fn = nn.CrossEntropyLoss(reduction="none")
    # The samples an epoch reads: as ImageFolder, files outside the class directories (label -1) are not.
    files = loader.mount.file_ids
    samples = int((loader.mount.labels[files] >= 0).sum()) or files.size
    outside = f" (left out, as ImageFolder does: {files.size - samples} outside them)" if samples < files.size else ""
    print(
        f"{samples} images in {len(loader.classes or [])} classes under {args.root}{outside}, "
        f"{loader.device}, {args.workers} workers"
    )

    losses: list[float] = []
    for epoch in range(args.epochs):
        loader.set_epoch(epoch)
        start, epoch_loss, seen, correct = time.perf_counter(), 0.0, 0, 0
        batches = iter(loader)
        for images, labels, ids in _until_exhausted(lambda batches=batches: batches):
            logits = model(images)
            per_sample = loss_fn(logits, labels)
            loss = per_sample.mean()
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            if loader.importance is not None:
                loader.report_losses(ids, per_sample.detach())
            losses.append(loss.item())
            epoch_loss += loss.item() * len(labels)
            correct += (logits.argmax(1) == labels).sum().item()
            seen += len(labels)
            if len(losses) == args.resume_at:
                loader, model, optimizer = checkpoint_and_rebuild(args, loader, model, optimizer)
                loader.set_epoch(epoch)  # the epoch of the state: keeps its resume point
                batches = iter(loader)
            if args.max_steps is not None and len(losses) >= args.max_steps:
                break
        seconds = time.perf_counter() - start
        print(f"epoch {epoch}: loss {epoch_loss / max(seen, 1):.4f}  {seen / seconds:.0f} images/s  {seen:.0f} samples")
        if args.max_steps is not None and len(losses) >= args.max_steps:
            break
    if loader.skipped:
        print(
            f"skipped {loader.skipped} sample{'s' if loader.skipped != 1 else ''} the decoder could not read: "
            f"{', '.join(repr(loader.path(i)) for i in loader.skipped_ids[:3])}"
            f"{' ...' if len(loader.skipped_ids) > 3 else ''}"
        )

    # The last epoch's running training accuracy: an eval pass would read the data once more, and
    # BatchNorm's running statistics lag behind the weights after a few dozen steps.
    accuracy = correct / max(seen, 1)
    print(f"final accuracy {accuracy:.3f} ({len(losses)} steps)")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"losses": losses, "final_accuracy": accuracy, "steps": len(losses)}, f)
    return 0


def _until_exhausted(current):
    """Items of ``current()``, re-read after every item, so the loop can swap the iterator mid-epoch."""
    while True:
        try:
            yield next(current())
        except StopIteration:
            return


def checkpoint_and_rebuild(args, loader, model, optimizer):
    """Save loader, model and optimizer through torch.save, then restore them into new objects."""
    buffer = io.BytesIO()
    torch.save(
        {"loader": loader.state_dict(), "model": model.state_dict(), "optimizer": optimizer.state_dict()}, buffer
    )
    buffer.seek(0)
    state = torch.load(buffer, weights_only=True)
    loader, model, optimizer = build(args)
    loader.load_state_dict(state["loader"])
    model.load_state_dict(state["model"])
    optimizer.load_state_dict(state["optimizer"])
    return loader, model, optimizer


if __name__ == "__main__":
    sys.exit(main())
