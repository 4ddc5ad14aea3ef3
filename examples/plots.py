"""The main job's picture: loss and throughput per optimizer step, drawn from the CSV log.

The plot is made from ``metrics.csv`` (what :class:`~lightning.pytorch.loggers.CSVLogger` wrote) rather
than from in-memory records, so it shows exactly what the log holds and can be redrawn for any
finished run: ``python -m examples.plots outputs/<date>/<time>/logs/metrics.csv``.
"""

from __future__ import annotations

import csv
import math
import sys
from collections.abc import Iterable
from pathlib import Path
from typing import Optional

#: (CSV column, legend label, panel): the curves the plot shows when the log has them.
CURVES = (
    ("train/loss", "train loss", "loss"),
    ("val/loss", "validation loss", "loss"),
    ("perf/tokens_per_s", "tokens/s (all ranks)", "throughput"),
)


def read_curves(metrics_csv: Path) -> dict[str, list[tuple[int, float]]]:
    """``column -> [(step, value), ...]`` for the columns in :data:`CURVES` (rows without a value skipped)."""
    curves: dict[str, list[tuple[int, float]]] = {column: [] for column, _, _ in CURVES}
    with metrics_csv.open(newline="") as handle:
        for row in csv.DictReader(handle):
            step = row.get("step")
            for column in curves:
                value = row.get(column)
                if step and value:
                    curves[column].append((int(float(step)), float(value)))
    return curves


def _finite(points: Iterable[tuple[int, float]]) -> list[tuple[int, float]]:
    return [(step, value) for step, value in points if math.isfinite(value)]


def write_training_plot(metrics_csv: Path, out: Optional[Path] = None) -> Optional[Path]:
    """Draw loss and throughput against the optimizer step into ``out`` (default: ``training.png``
    next to the CSV); return the path, or ``None`` when the log holds none of the curves."""
    import matplotlib

    matplotlib.use("Agg")  # files only: no display on training machines
    from matplotlib import pyplot as plt

    curves = {column: _finite(points) for column, points in read_curves(metrics_csv).items()}
    panels = [panel for panel in ("loss", "throughput") if any(curves[c] for c, _, p in CURVES if p == panel)]
    if not panels:
        return None
    out = out or metrics_csv.with_name("training.png")
    figure, axes = plt.subplots(len(panels), 1, figsize=(7, 3.2 * len(panels)), sharex=True, squeeze=False)
    for axis, panel in zip(axes[:, 0], panels):
        for column, label, where in CURVES:
            if where == panel and curves[column]:
                steps, values = zip(*curves[column])
                marker = "o" if len(steps) < 20 else None
                axis.plot(steps, values, label=label, marker=marker)
        axis.set_ylabel("loss" if panel == "loss" else "tokens/s")
        axis.grid(alpha=0.3)
        axis.legend()
    axes[-1, 0].set_xlabel("optimizer step")
    figure.suptitle(f"{metrics_csv.parent.parent.name}: training curves")
    figure.tight_layout()
    figure.savefig(out, dpi=110)
    plt.close(figure)
    return out


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: python -m examples.plots PATH/TO/metrics.csv")
    written = write_training_plot(Path(sys.argv[1]))
    print(written or "the log holds no loss or throughput column; nothing drawn")
