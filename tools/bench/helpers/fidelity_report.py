"""The reports of tools/bench/bench_fidelity.py: summaries over seeds, the verdict, tables, the accuracy plot, and
the interleave sweep (batch class entropy of the loader's epoch plans, no training)."""

from __future__ import annotations

from pathlib import Path

import numpy as np

IN_FLIGHT_SWEEP = (1, 2, 6, 16, 32)


def entropy_sweep(workdir: Path, seeds: list[int], batch_size: int) -> dict[str, dict[int, float]]:
    """Batch class entropy of each pack's epoch plan (the loader's own, no training) as a fraction of a
    global shuffle's, by ``blocks_in_flight``: how much interleave each pack needs."""
    from blockfs import PackedDataset
    from blockfs.loader.epochplan import plan_epoch
    from blockfs.loader.order import BlockLayout, batch_class_entropy, global_shuffled_order

    sweep: dict[str, dict[int, float]] = {}
    for pack in ("shuffled", "directory"):
        with PackedDataset(workdir / f"packed-{pack}") as ds:
            layout, labels = BlockLayout(*ds.layout), np.array(ds.labels, dtype=np.int64)
        files = np.flatnonzero(labels >= 0)
        ratios = {}
        for in_flight in IN_FLIGHT_SWEEP:
            ours, uniform = [], []
            for seed in seeds:
                plan = plan_epoch(
                    layout,
                    batch_size=batch_size,
                    seed=seed,
                    epoch=0,
                    rank=0,
                    world_size=1,
                    num_workers=0,
                    blocks_in_flight=in_flight,
                    drop_last=False,
                    reuse=False,
                )
                ours.append(batch_class_entropy(plan.sequence, labels, batch_size))
                order = files[global_shuffled_order(files.size, seed=seed, epoch=0)]
                uniform.append(batch_class_entropy(order, labels, batch_size))
            ratios[in_flight] = float(np.mean(ours) / np.mean(uniform))
        sweep[pack] = ratios
    return sweep


def sweep_table(sweep: dict[str, dict[int, float]]) -> str:
    lines = [
        "| pack | " + " | ".join(f"blocks_in_flight={f}" for f in IN_FLIGHT_SWEEP) + " |",
        "|---|" + "---|" * len(IN_FLIGHT_SWEEP),
    ]
    for pack, ratios in sweep.items():
        lines.append(f"| {pack} | " + " | ".join(f"{ratios[f]:.3f}" for f in IN_FLIGHT_SWEEP) + " |")
    return "\n".join(lines)


def summarise(configs: list, results: dict[str, list[dict]]) -> dict[str, dict]:
    out = {}
    for config in configs:
        runs = results[config.name]
        final = np.array([r["accuracy"][-1] for r in runs])
        out[config.name] = {
            "what": config.what,
            "final_accuracy_mean": float(final.mean()),
            "final_accuracy_std": float(final.std(ddof=1)) if final.size > 1 else 0.0,
            "curve_mean": np.mean([r["accuracy"] for r in runs], axis=0).tolist(),
            "batch_entropy": float(np.mean([r["batch_entropy"] for r in runs])),
            "steps": int(np.mean([sum(r["steps"]) for r in runs])),
            "train_s": float(np.mean([r["train_s"] for r in runs])),
            "runs": runs,
        }
    return out


def verdict(summary: dict[str, dict]) -> str | None:
    """Whether the default blockfs order's final accuracy is within one std (over seeds) of the reference's."""
    if "global" not in summary or "blockfs" not in summary:
        return None
    ref, ours = summary["global"], summary["blockfs"]
    gap = ours["final_accuracy_mean"] - ref["final_accuracy_mean"]
    within = "within" if abs(gap) <= ref["final_accuracy_std"] else "NOT within"
    return (
        f"default blockfs vs global shuffle: {gap:+.4f} accuracy, global's std over seeds "
        f"{ref['final_accuracy_std']:.4f}: {within} one standard deviation"
    )


def table(summary: dict[str, dict]) -> str:
    ref = summary.get("global")
    rows = [
        [
            "configuration",
            "final accuracy (mean ± std)",
            "vs global",
            "batch class entropy (bits)",
            "vs global",
            "steps",
            "train s / run",
        ]
    ]
    for name, s in summary.items():
        rows.append(
            [
                f"`{name}`: {s['what']}",
                f"{s['final_accuracy_mean']:.4f} ± {s['final_accuracy_std']:.4f}",
                f"{s['final_accuracy_mean'] - ref['final_accuracy_mean']:+.4f}" if ref else "",
                f"{s['batch_entropy']:.3f}",
                f"{s['batch_entropy'] / ref['batch_entropy']:.3f}" if ref else "",
                str(s["steps"]),
                f"{s['train_s']:.1f}",
            ]
        )
    lines = ["| " + " | ".join(row) + " |" for row in rows]
    lines.insert(1, "|" + "|".join("---" for _ in rows[0]) + "|")
    return "\n".join(lines)


def plot(summary: dict[str, dict], path: Path, title: str) -> None:
    """Mean test accuracy after each epoch, one line per configuration (Pillow only)."""
    from PIL import Image, ImageDraw

    width, height, left, right, top, bottom = 900, 520, 60, 290, 40, 50
    image = Image.new("RGB", (width, height), "white")
    draw = ImageDraw.Draw(image)
    colours = [(40, 40, 40), (50, 110, 210), (90, 170, 90), (220, 60, 50), (230, 140, 40), (150, 80, 170)]
    epochs = max(len(s["curve_mean"]) for s in summary.values())
    plot_w, plot_h = width - left - right, height - top - bottom

    def xy(epoch: int, accuracy: float) -> tuple[float, float]:
        return left + plot_w * (epoch - 1) / max(epochs - 1, 1), top + plot_h * (1.0 - accuracy)

    draw.text((left, 12), title, fill="black")
    draw.rectangle((left, top, left + plot_w, top + plot_h), outline="black")
    for tick in np.linspace(0, 1, 6):
        draw.line((left - 4, xy(1, tick)[1], left, xy(1, tick)[1]), fill="black")
        draw.text((8, xy(1, tick)[1] - 6), f"{tick:.1f}", fill="black")
    for epoch in range(1, epochs + 1):
        draw.text((xy(epoch, 0)[0] - 3, top + plot_h + 8), str(epoch), fill="black")
    draw.text((left + plot_w // 2 - 60, height - 20), "epoch (test accuracy, mean over seeds)", fill="black")
    for n, (name, s) in enumerate(summary.items()):
        colour = colours[n % len(colours)]
        points = [xy(e + 1, a) for e, a in enumerate(s["curve_mean"])]
        draw.line(points, fill=colour, width=3) if len(points) > 1 else None
        for x, y in points:
            draw.ellipse((x - 3, y - 3, x + 3, y + 3), fill=colour)
        y = top + 10 + 22 * n
        draw.rectangle((width - right + 20, y, width - right + 36, y + 10), fill=colour)
        draw.text((width - right + 42, y - 1), f"{name} {s['final_accuracy_mean']:.3f}", fill="black")
    image.save(path)
