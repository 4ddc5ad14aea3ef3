"""The main job's plot (examples/plots.py): drawn from the CSV log Lightning's CSVLogger writes."""

from __future__ import annotations

import csv
from pathlib import Path

import pytest

pytest.importorskip("matplotlib")
from examples.plots import read_curves, write_training_plot  # noqa: E402

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def _write_log(path: Path, rows: list[dict[str, str]]) -> Path:
    columns = sorted({key for row in rows for key in row})
    with path.open("w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=columns)
        writer.writeheader()
        writer.writerows(rows)
    return path


def test_curves_are_read_per_step_and_drawn_next_to_the_csv(tmp_path: Path) -> None:
    # CSVLogger writes one row per logging call, with the other columns empty
    rows = [{"step": str(s), "train/loss": str(5.0 - s / 10), "perf/tokens_per_s": str(1000 + s)} for s in range(5)]
    rows.append({"step": "4", "val/loss": "4.7"})
    metrics = _write_log(tmp_path / "metrics.csv", rows)
    curves = read_curves(metrics)
    assert curves["train/loss"] == [(s, pytest.approx(5.0 - s / 10)) for s in range(5)]
    assert curves["val/loss"] == [(4, 4.7)]
    assert [step for step, _ in curves["perf/tokens_per_s"]] == list(range(5))
    plot = write_training_plot(metrics)
    assert plot == tmp_path / "training.png"
    assert plot.read_bytes().startswith(PNG_SIGNATURE) and plot.stat().st_size > 10_000


def test_a_log_without_the_curves_draws_nothing(tmp_path: Path) -> None:
    metrics = _write_log(tmp_path / "metrics.csv", [{"step": "0", "lr-AdamW": "0.001"}])
    assert write_training_plot(metrics) is None
    assert not (tmp_path / "training.png").exists()
