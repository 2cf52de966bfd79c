"""Generate a seeded ImageFolder-style tree of small files, for tests, benchmarks and the demo.

    python tools/make_dataset.py OUT --mode {imagenet,tiny,learnable} --files N --classes C --seed S

Layout: ``OUT/<class>/<class>_<index:06d>.<ext>``, ``index`` counting from 0 inside each class.

Modes:

- ``imagenet``: ImageNet-JPEG-like sizes (lognormal, mean ~110 KiB, median ~95 KiB) of random bytes framed
  by the JPEG SOI (``FF D8 FF``) and EOI (``FF D9``) markers; classes named like WordNet ids
  (``n01440764``); extension ``.JPEG``. Not decodable images: for I/O benchmarks only.
- ``tiny``: random bytes, uniform 2-6 KiB (mean 4 KiB); extension ``.bin``.
- ``learnable``: real ``image_size`` x ``image_size`` RGB PNGs, one drawn shape per class on a noisy
  background, so a small CNN visibly learns them; extension ``.png``.

The same arguments give a byte-identical tree with identical modes and nanosecond mtimes (files and
directories), which the packer's determinism tests rely on.
"""

from __future__ import annotations

import argparse
import colorsys
import io
import os
import shutil
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import numpy as np

MODES = ("imagenet", "tiny", "learnable")
EXTENSIONS = {"imagenet": "JPEG", "tiny": "bin", "learnable": "png"}

# ImageNet-1k train JPEGs: mean ~110 KiB, median ~95 KiB. mean = exp(mu + sigma^2 / 2).
IMAGENET_MEAN_BYTES = 110 * 1024
IMAGENET_SIGMA = 0.55
IMAGENET_MIN_BYTES = 1024
JPEG_SOI = b"\xff\xd8\xff"
JPEG_EOI = b"\xff\xd9"

TINY_MIN_BYTES = 2 * 1024
TINY_MAX_BYTES = 6 * 1024

SHAPES = ("circle", "square", "triangle", "cross", "hbar", "vbar", "ring", "diamond")
MIN_IMAGE_SIZE = 16

FILE_MODE = 0o644
DIR_MODE = 0o755
# mtimes lie in the year after 2020-09-13 (1.6e9 s), with a nanosecond part, so a packer that rounds
# them to microseconds or seconds is caught.
MTIME_BASE_NS = 1_600_000_000 * 10**9
MTIME_SPAN_NS = 365 * 24 * 3600 * 10**9

# Independent random streams, so e.g. the class names do not shift when the file contents change.
_STREAM_NAMES, _STREAM_MTIMES, _STREAM_CONTENT = 0, 1, 2


def _rng(seed: int, stream: int) -> np.random.Generator:
    return np.random.default_rng([seed, stream])


def class_names(mode: str, classes: int, seed: int = 0) -> list[str]:
    """The sorted class directory names: WordNet-like ids for ``imagenet``, ``class_000`` otherwise."""
    if mode == "imagenet":
        ids = _rng(seed, _STREAM_NAMES).choice(10**8 - 10**6, size=classes, replace=False) + 10**6
        return [f"n{i:08d}" for i in sorted(ids.tolist())]
    width = max(3, len(str(classes - 1)))
    return [f"class_{c:0{width}d}" for c in range(classes)]


def _files_per_class(files: int, classes: int) -> list[int]:
    """Split ``files`` as evenly as possible; the first classes get the remainder."""
    base, extra = divmod(files, classes)
    return [base + (c < extra) for c in range(classes)]


def _imagenet_contents(rng: np.random.Generator, count: int, _label: int) -> Iterator[Sequence[bytes]]:
    mu = np.log(IMAGENET_MEAN_BYTES) - IMAGENET_SIGMA**2 / 2
    sizes = np.maximum(rng.lognormal(mu, IMAGENET_SIGMA, size=count).astype(np.int64), IMAGENET_MIN_BYTES)
    for size in sizes.tolist():
        yield JPEG_SOI, rng.bytes(size - len(JPEG_SOI) - len(JPEG_EOI)), JPEG_EOI


def _tiny_contents(rng: np.random.Generator, count: int, _label: int) -> Iterator[Sequence[bytes]]:
    for size in rng.integers(TINY_MIN_BYTES, TINY_MAX_BYTES, size=count, endpoint=True).tolist():
        yield (rng.bytes(size),)


def _learnable_contents(
    classes: int, image_size: int
) -> Callable[[np.random.Generator, int, int], Iterator[Sequence[bytes]]]:
    # Pillow is imported only here, so the byte modes work without it.
    from PIL import Image, ImageDraw

    # Beyond len(SHAPES) classes, shapes repeat and each repetition gets its own hue band.
    bands = -(-classes // len(SHAPES))
    # A gap between hue bands keeps repeated shapes apart; one band may use every hue.
    margin = 0.1 if bands > 1 else 0.0

    def contents(rng: np.random.Generator, count: int, label: int) -> Iterator[Sequence[bytes]]:
        shape = SHAPES[label % len(SHAPES)]
        band = label // len(SHAPES)
        for _ in range(count):
            background = rng.integers(0, 96)
            pixels = rng.normal(background, 12.0, size=(image_size, image_size, 3))
            image = Image.fromarray(np.clip(pixels, 0, 255).astype(np.uint8), "RGB")
            hue = (band + rng.uniform(margin, 1.0 - margin)) / bands
            rgb = colorsys.hsv_to_rgb(hue, rng.uniform(0.5, 1.0), rng.uniform(0.75, 1.0))
            colour = tuple(int(255 * v) for v in rgb)
            extent = int(rng.integers(image_size * 0.35, image_size * 0.7, endpoint=True))
            x0, y0 = (int(v) for v in rng.integers(0, image_size - extent, size=2, endpoint=True))
            _draw_shape(ImageDraw.Draw(image), shape, (x0, y0, x0 + extent - 1, y0 + extent - 1), colour)
            buffer = io.BytesIO()
            image.save(buffer, format="PNG")
            yield (buffer.getvalue(),)

    return contents


def _draw_shape(draw, shape: str, box: tuple[int, int, int, int], colour: tuple[int, ...]) -> None:
    x0, y0, x1, y1 = box
    xm, ym = (x0 + x1) // 2, (y0 + y1) // 2
    thick = max(2, (x1 - x0) // 4)
    if shape == "circle":
        draw.ellipse(box, fill=colour)
    elif shape == "square":
        draw.rectangle(box, fill=colour)
    elif shape == "triangle":
        draw.polygon([(xm, y0), (x1, y1), (x0, y1)], fill=colour)
    elif shape == "cross":
        draw.rectangle((xm - thick // 2, y0, xm + thick // 2, y1), fill=colour)
        draw.rectangle((x0, ym - thick // 2, x1, ym + thick // 2), fill=colour)
    elif shape == "hbar":
        draw.rectangle((x0, ym - thick // 2, x1, ym + thick // 2), fill=colour)
    elif shape == "vbar":
        draw.rectangle((xm - thick // 2, y0, xm + thick // 2, y1), fill=colour)
    elif shape == "ring":
        draw.ellipse(box, outline=colour, width=thick // 2 + 1)
    elif shape == "diamond":
        draw.polygon([(xm, y0), (x1, ym), (xm, y1), (x0, ym)], fill=colour)
    else:
        raise ValueError(f"unknown shape {shape!r}; expected one of {SHAPES}")


def _prepare_out(out: Path, force: bool) -> None:
    if out.exists() and not out.is_dir():
        raise NotADirectoryError(f"{out} exists and is not a directory; choose another OUT")
    if out.is_dir() and any(out.iterdir()):
        if not force:
            raise FileExistsError(f"{out} is not empty; pass --force to remove and recreate it")
        shutil.rmtree(out)
    out.mkdir(parents=True, exist_ok=True)


def _write_file(path: Path, chunks: Sequence[bytes], mtime_ns: int) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, FILE_MODE)
    try:
        os.writev(fd, chunks)
        # fchmod: the umask must not decide the mode; utime last, as every write moves the mtime.
        os.fchmod(fd, FILE_MODE)
        os.utime(fd, ns=(mtime_ns, mtime_ns))
    finally:
        os.close(fd)


def make_dataset(
    out: str | os.PathLike,
    mode: str,
    files: int,
    classes: int,
    seed: int = 0,
    image_size: int = 32,
    *,
    force: bool = False,
) -> dict:
    """Write a seeded ImageFolder-style tree to ``out`` and return ``{"files", "bytes", "classes", ...}``.

    ``out`` must be missing or empty unless ``force`` is true, in which case it is removed first.
    """
    if mode not in MODES:
        raise ValueError(f"mode {mode!r} is not one of {', '.join(MODES)}")
    if classes < 1:
        raise ValueError(f"classes must be at least 1, got {classes}")
    if files < classes:
        raise ValueError(f"files ({files}) must be at least classes ({classes}): every class needs a file")
    if mode == "learnable" and image_size < MIN_IMAGE_SIZE:
        raise ValueError(f"image_size must be at least {MIN_IMAGE_SIZE} for learnable mode, got {image_size}")

    out = Path(out)
    _prepare_out(out, force)
    names = class_names(mode, classes, seed)
    extension = EXTENSIONS[mode]
    if mode == "imagenet":
        contents = _imagenet_contents
    elif mode == "tiny":
        contents = _tiny_contents
    else:
        contents = _learnable_contents(classes, image_size)

    # One mtime per file plus one per directory (the classes, then OUT itself).
    offsets = _rng(seed, _STREAM_MTIMES).integers(0, MTIME_SPAN_NS, size=files + classes + 1)
    mtimes = (MTIME_BASE_NS + offsets).tolist()
    rng = _rng(seed, _STREAM_CONTENT)
    total_bytes = 0
    written = 0
    for label, (name, count) in enumerate(zip(names, _files_per_class(files, classes), strict=True)):
        class_dir = out / name
        class_dir.mkdir()
        for index, chunks in enumerate(contents(rng, count, label)):
            _write_file(class_dir / f"{name}_{index:06d}.{extension}", chunks, mtimes[written])
            total_bytes += sum(len(chunk) for chunk in chunks)
            written += 1

    # Directory mtimes last: creating their entries moved them.
    for label, name in enumerate(names):
        os.chmod(out / name, DIR_MODE)
        os.utime(out / name, ns=(mtimes[files + label],) * 2)
    os.chmod(out, DIR_MODE)
    os.utime(out, ns=(mtimes[-1],) * 2)
    return {
        "out": str(out),
        "mode": mode,
        "files": files,
        "bytes": total_bytes,
        "classes": classes,
        "seed": seed,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out", metavar="OUT", help="directory to create (must be missing or empty)")
    parser.add_argument("--mode", choices=MODES, required=True)
    parser.add_argument("--files", type=int, required=True, help="number of files in all")
    parser.add_argument("--classes", type=int, required=True, help="number of class directories")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--image-size", type=int, default=32, help="side in pixels (learnable mode)")
    parser.add_argument("--force", action="store_true", help="remove a non-empty OUT first")
    args = parser.parse_args(argv)

    start = time.perf_counter()
    try:
        summary = make_dataset(
            args.out, args.mode, args.files, args.classes, args.seed, args.image_size, force=args.force
        )
    except (ValueError, OSError) as error:
        print(f"make_dataset.py: error: {error}", file=sys.stderr)
        return 2
    seconds = time.perf_counter() - start
    print(
        f"wrote {summary['files']} {args.mode} files ({summary['bytes'] / 2**20:.1f} MiB) in "
        f"{summary['classes']} classes to {summary['out']} in {seconds:.2f} s"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
