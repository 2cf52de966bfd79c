"""Train a small CNN on an ImageFolder-style tree with plain PyTorch (no torchvision, no blockfs).

    python examples/train_imagefolder.py ROOT [--epochs 2] [--batch-size 32] [--lr 0.05] [--seed 0]
        [--workers 0] [--image-size 32] [--out losses.json] [--max-steps N]

This is the kind of unmodified training script blockfs must serve: it lists ROOT the way torchvision's
``ImageFolder`` does (classes are the sorted sub-directories of ROOT, samples the image files under each,
recursively, sorted by path) and opens every image with ``PIL.Image.open``. Training is bit-reproducible
(seeded, deterministic algorithms, one thread), and nothing depends on where ROOT lies, so the same tree
at two paths, e.g. a source tree and its blockfs mount, gives the identical loss sequence.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import numpy as np
import torch
from PIL import Image
from torch import nn
from torch.utils.data import DataLoader, Dataset

# The extensions torchvision's ImageFolder accepts.
IMG_EXTENSIONS = (".jpg", ".jpeg", ".png", ".ppm", ".bmp", ".pgm", ".tif", ".tiff", ".webp")


def find_classes(root: str) -> list[str]:
    """Sorted names of the sub-directories of ``root``, as torchvision's ``find_classes``."""
    with os.scandir(root) as entries:
        classes = sorted(entry.name for entry in entries if entry.is_dir())
    if not classes:
        raise FileNotFoundError(f"no class directories in {root}")
    return classes


def _image_files(directory: str) -> list[str]:
    paths = []
    with os.scandir(directory) as entries:
        for entry in entries:
            if entry.is_dir():
                paths.extend(_image_files(entry.path))
            elif entry.name.lower().endswith(IMG_EXTENSIONS):
                paths.append(entry.path)
    return paths


def find_samples(root: str, classes: list[str]) -> list[tuple[str, int]]:
    """``(path, class index)`` of every image under each class directory, sorted by path."""
    samples = []
    for index, name in enumerate(classes):
        files = sorted(_image_files(os.path.join(root, name)))
        if not files:
            raise FileNotFoundError(f"no image files ({', '.join(IMG_EXTENSIONS)}) in {root}/{name}")
        samples.extend((path, index) for path in files)
    return samples


class ImageFolder(Dataset):
    """Images as float tensors ``(3, size, size)`` in [0, 1], labelled by their class directory."""

    def __init__(self, root: str, image_size: int) -> None:
        self.classes = find_classes(root)
        self.samples = find_samples(root, self.classes)
        self.image_size = image_size

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        path, label = self.samples[index]
        with Image.open(path) as opened:
            image = opened.convert("RGB")
            if image.size != (self.image_size, self.image_size):
                image = image.resize((self.image_size, self.image_size), Image.BILINEAR)
            pixels = np.asarray(image, dtype=np.float32) / 255.0
        return torch.from_numpy(pixels).permute(2, 0, 1).contiguous(), label


def small_cnn(classes: int) -> nn.Module:
    """Three conv blocks, global average pooling (any image size) and a linear head."""
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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("root", metavar="ROOT", help="ImageFolder tree: ROOT/<class>/<images>")
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--workers", type=int, default=0, help="DataLoader worker processes")
    parser.add_argument("--image-size", type=int, default=32)
    parser.add_argument("--out", help="write every step's loss and the final accuracy to this JSON file")
    parser.add_argument("--max-steps", type=int, help="stop after this many optimizer steps in all")
    args = parser.parse_args(argv)
    for name in ("epochs", "batch_size", "image_size", "max_steps"):
        value = getattr(args, name)
        if value is not None and value < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1, got {value}")

    # Bit-reproducible: fixed seeds, deterministic kernels, and one thread (reduction order is fixed).
    torch.manual_seed(args.seed)
    torch.use_deterministic_algorithms(True)
    torch.set_num_threads(1)

    dataset = ImageFolder(args.root, args.image_size)
    loader = DataLoader(
        dataset,
        batch_size=args.batch_size,
        shuffle=True,
        num_workers=args.workers,
        generator=torch.Generator().manual_seed(args.seed),
    )
    model = small_cnn(len(dataset.classes))
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    loss_fn = nn.CrossEntropyLoss()
    print(f"{len(dataset)} images in {len(dataset.classes)} classes under {args.root}")

    losses: list[float] = []
    for epoch in range(args.epochs):
        start = time.perf_counter()
        epoch_loss = correct = seen = 0
        for images, labels in loader:
            logits = model(images)
            loss = loss_fn(logits, labels)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            losses.append(loss.item())
            epoch_loss += loss.item() * len(labels)
            correct += (logits.argmax(1) == labels).sum().item()
            seen += len(labels)
            if args.max_steps is not None and len(losses) >= args.max_steps:
                break
        seconds = time.perf_counter() - start
        print(
            f"epoch {epoch}: loss {epoch_loss / seen:.4f}  accuracy {correct / seen:.3f}  {seen / seconds:.0f} images/s"
        )
        if args.max_steps is not None and len(losses) >= args.max_steps:
            break

    # The last epoch's running training accuracy: an eval pass would read the whole tree once more, and
    # BatchNorm's running statistics lag behind the weights after only a few dozen steps.
    accuracy = correct / seen
    print(f"final accuracy {accuracy:.3f} ({len(losses)} steps)")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"losses": losses, "final_accuracy": accuracy, "steps": len(losses)}, f)
    return 0


if __name__ == "__main__":
    sys.exit(main())
