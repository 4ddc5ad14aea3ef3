"""Loss against tokens and wall-clock on the emulated cluster: the ``--convergence`` mode of ``emulated_cluster.py``.

Why: a semi-synchronous row (DiLoCo, ``mics-diloco``) sends ``1 / H`` of the synchronous bytes across nodes, so its
steps are faster where the link is slow -- but it is not synchronous training, so its loss per token may be worse.
Step time alone cannot say whether it pays; the time to reach a given loss can. This mode trains the same model on
the same data, in the same global sample order, under a synchronous reference (``mics-auto``), Lightning's DDP and
DiLoCo rows, for a fixed token budget, and records the loss of every optimizer step with its wall-clock time.

The data (:class:`MarkovChain`) is learnable -- random tokens cannot be learnt below ``ln(vocab)`` -- and its
best possible loss is known: a fixed random first-order Markov chain over the byte vocabulary, each token followed
by one of ``successors`` tokens with random probabilities. Its entropy rate (nats per token) is the floor of the
loss; a model that has learnt the table reaches it.

The analysis here is pure (no processes, no namespaces), so the tests drive it with synthetic records:

* :func:`smoothed` -- a trailing mean over ``window`` steps: a per-step loss over a small global batch is noisy,
  and the time to reach a loss must not hinge on one lucky batch;
* :func:`time_to_loss` -- the first time the smoothed curve reaches a target, linearly interpolated between the two
  steps around the crossing (``None``: never within the budget);
* :func:`compare_runs` -- per row of one bandwidth ratio, against ``mics-auto``: its wall-clock to reach
  ``mics-auto``'s final (smoothed) loss over ``mics-auto``'s wall-clock for the whole budget, and its held-out loss
  at the full budget over ``mics-auto``'s;
* :func:`headline` -- the two top-level numbers of ``convergence.json`` (the issue's targets: time ratio <= 0.5,
  loss ratio <= 1.05) for the semi-synchronous row with the smallest time ratio.
"""

from __future__ import annotations

import math
import sys
import textwrap
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import torch
from torch import Tensor
from torch.utils.data import Dataset

#: The synchronous reference every other row is compared against.
REFERENCE = "mics-auto"
#: The rows of a convergence run (``--strategies`` may name others, ``REFERENCE`` among them).
CONVERGENCE_STRATEGIES = ("mics-auto", "ddp", "mics-diloco", "mics-diloco-h32")
SMOKE_CONVERGENCE_STRATEGIES = ("mics-auto", "ddp", "mics-diloco")
#: Bandwidth ratios of a convergence run: the cross-region setting (1/240 of loopback) and a data-centre-like one.
CONVERGENCE_RATIOS = (240.0, 24.0)
SMOKE_CONVERGENCE_RATIOS = (240.0,)
#: The issue's targets for the headline ratio's best semi-synchronous row.
TARGET_TIME_RATIO = 0.5
TARGET_LOSS_RATIO = 1.05
#: A row "reaches" the reference's final loss within this relative margin: DDP and mics-auto train the same
#: trajectory to fp32 rounding (~1e-7 apart), which must not read as "never reached". Far below the noise of a run.
REACH_TOLERANCE = 1e-4
#: The chart's loss axis stops here: the first steps fall from ln(256) = 5.5 within a few thousand tokens, and the
#: differences that matter are near the floor.
LOSS_AXIS_TOP = 2.6


# ------------------------------------------------------------------------------------------------ settings
@dataclass(frozen=True)
class ConvergenceSettings:
    """What every row of a convergence run trains with, besides the model and cluster (one JSON object in the
    job file, so the workers and the report share it)."""

    steps: int  #: the token budget, in optimizer steps (every row runs exactly this many)
    learning_rate: float = 3e-3  #: peak AdamW learning rate (inner optimizer for DiLoCo rows)
    warmup_steps: int = 10  #: linear warm-up, then cosine decay to 0.1x at the last step
    successors: int = 4  #: tokens that may follow each token in the Markov chain
    data_seed: int = 0  #: the chain's table; the training samples use ``data_seed + 1``, held-out ``+ 2``
    heldout_samples: int = 256  #: held-out sequences, evaluated once with the final (synchronised) model
    window: int = 16  #: trailing-mean window (steps) of the loss curves the comparison reads

    def __post_init__(self) -> None:
        for name in ("steps", "successors", "heldout_samples", "window"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"convergence {name.replace('_', '-')} must be a positive int, got {value!r}.")
        if not self.learning_rate > 0:
            raise ValueError(f"--lr must be positive, got {self.learning_rate!r}.")
        if self.warmup_steps < 0:
            raise ValueError(f"convergence warm-up steps must be >= 0, got {self.warmup_steps!r}.")

    def check(self, sync_every: list[int], world_size: int) -> None:
        """Refuse a budget that would end a DiLoCo row mid-round (its final model would not be the synchronised
        one, and its bytes per step not a whole-round average) or a held-out set the ranks cannot split evenly."""
        partial = [h for h in sync_every if self.steps % h]
        if partial:
            raise ValueError(
                f"--steps {self.steps} is not a multiple of sync_every {partial}: a DiLoCo row would end mid-round, "
                f"with unsynchronised groups. Use a multiple of {math.lcm(*sync_every)}."
            )
        if self.heldout_samples % world_size:
            raise ValueError(f"the {self.heldout_samples} held-out samples must split evenly over {world_size} ranks.")


# ------------------------------------------------------------------------------------------------ data
class MarkovChain:
    """A fixed random first-order Markov chain over ``vocab`` tokens: token ``i`` is followed by one of
    ``successors`` distinct tokens (drawn at random), with probabilities ``w / sum(w)``, ``w ~ Exp(1)`` (a flat
    Dirichlet). Sequences start from the stationary distribution, so every position predicts with the same
    best-possible loss, the chain's entropy rate."""

    def __init__(self, vocab: int, successors: int, seed: int) -> None:
        if not 1 <= successors <= vocab:
            raise ValueError(f"successors must lie in [1, {vocab}], got {successors}.")
        generator = torch.Generator().manual_seed(seed)
        table = torch.zeros(vocab, vocab, dtype=torch.float64)
        for token in range(vocab):
            following = torch.randperm(vocab, generator=generator)[:successors]
            weights = -torch.log(torch.rand(successors, generator=generator, dtype=torch.float64))
            table[token, following] = weights / weights.sum()
        self.table = table
        stationary = torch.full((vocab,), 1.0 / vocab, dtype=torch.float64)
        for _ in range(1000):  # power iteration; a random sparse chain mixes in a few dozen steps
            stationary = stationary @ table
        self.stationary = stationary / stationary.sum()

    @property
    def entropy_rate(self) -> float:
        """Nats per token of the best predictor: ``sum_i pi_i H(P_i)`` -- the floor of the loss."""
        logs = torch.where(self.table > 0, self.table.log(), torch.zeros_like(self.table))
        return float(-(self.stationary[:, None] * self.table * logs).sum())

    def sample(self, count: int, length: int, seed: int) -> Tensor:
        """``count`` sequences of ``length`` tokens (int64), reproducibly from ``seed``."""
        generator = torch.Generator().manual_seed(seed)
        out = torch.empty(count, length, dtype=torch.int64)
        out[:, 0] = torch.multinomial(self.stationary.float(), count, replacement=True, generator=generator)
        table = self.table.float()
        for t in range(1, length):
            out[:, t] = torch.multinomial(table[out[:, t - 1]], 1, generator=generator)[:, 0]
        return out


class SequenceDataset(Dataset[tuple[Tensor, Tensor]]):
    """Sequences of ``seq_len + 1`` tokens as (inputs, next-token targets), in a fixed order: with Lightning's
    ``DistributedSampler`` (no shuffling) global optimizer step ``s`` reads samples ``[s * B, (s + 1) * B)`` --
    ``B`` = ranks x accumulation x micro-batch -- whatever the strategy, so every row sees the same batches."""

    def __init__(self, sequences: Tensor) -> None:
        self.sequences = sequences

    def __len__(self) -> int:
        return self.sequences.shape[0]

    def __getitem__(self, index: int) -> tuple[Tensor, Tensor]:
        row = self.sequences[index]
        return row[:-1], row[1:]


# ------------------------------------------------------------------------------------------------ analysis
def smoothed(values: list[float], window: int) -> list[float]:
    """Trailing mean over ``window`` values (fewer at the start): the curve the comparison reads."""
    if window < 1:
        raise ValueError(f"the smoothing window must be >= 1, got {window}.")
    out, total = [], 0.0
    for i, value in enumerate(values):
        total += value
        if i >= window:
            total -= values[i - window]
        out.append(total / min(i + 1, window))
    return out


def time_to_loss(xs: list[float], losses: list[float], target: float) -> Optional[float]:
    """The first ``x`` (time or tokens) at which the curve ``losses`` reaches ``target`` or goes below it, linearly
    interpolated between the steps on either side of the crossing; ``None`` if it never does."""
    if len(xs) != len(losses):
        raise ValueError(f"{len(xs)} x values for {len(losses)} losses.")
    for i, loss in enumerate(losses):
        if loss <= target:
            if i == 0 or losses[i - 1] == loss:
                return xs[i]
            fraction = (losses[i - 1] - target) / (losses[i - 1] - loss)
            return xs[i - 1] + fraction * (xs[i] - xs[i - 1])
    return None


def curve(record: dict[str, Any], window: int) -> dict[str, list[float]]:
    """A run's per-step series: wall-clock (s since training started), tokens, raw and smoothed loss."""
    steps = record["steps"]
    raw = [s["loss"] for s in steps]
    return {
        "time_s": [s["time_s"] for s in steps],
        "tokens": [s["step"] * record["tokens_per_step"] for s in steps],
        "loss": raw,
        "smoothed": smoothed(raw, window),
    }


def compare_runs(records: list[dict[str, Any]], window: int, reference: str = REFERENCE) -> list[dict[str, Any]]:
    """One row per run of one bandwidth ratio, against ``reference`` (module docstring). A failed run keeps its
    status and nothing else; without a successful reference the ratios are ``None``."""
    ok = {r["strategy"]: r for r in records if r.get("status") == "ok"}
    ref = ok.get(reference)
    ref_curve = curve(ref, window) if ref else None
    target = ref_curve["smoothed"][-1] if ref_curve else None
    ref_wall = ref_curve["time_s"][-1] if ref_curve else None
    rows = []
    for record in records:
        name = record["strategy"]
        if record.get("status") != "ok":
            rows.append({"strategy": name, "status": record.get("status")})
            continue
        c = curve(record, window)
        row: dict[str, Any] = {
            "strategy": name,
            "status": "ok",
            "sync_every": record.get("sync_every"),
            "steps": len(c["loss"]),
            "tokens": c["tokens"][-1],
            "wall_s": c["time_s"][-1],
            "s_per_step": c["time_s"][-1] / len(c["loss"]),
            "final_train_loss": c["smoothed"][-1],
            "heldout_loss": record.get("heldout_loss"),
            "inter_node_bytes": record.get("inter_node_bytes"),
            "expected_inter_node_bytes": record.get("expected_inter_node_bytes"),
        }
        if ref_curve is not None and target is not None and ref_wall:
            reach_s = time_to_loss(c["time_s"], c["smoothed"], target * (1 + REACH_TOLERANCE))
            reach_tokens = time_to_loss(c["tokens"], c["smoothed"], target * (1 + REACH_TOLERANCE))
            row.update({
                "reference_final_loss": target,
                "time_to_reference_loss_s": reach_s,
                "tokens_to_reference_loss": reach_tokens,
                "time_to_sync_final_loss_ratio": None if reach_s is None else reach_s / ref_wall,
                "wall_ratio": c["time_s"][-1] / ref_wall,
                "final_train_loss_ratio": c["smoothed"][-1] / target,
                "final_loss_ratio": _ratio(record.get("heldout_loss"), ref.get("heldout_loss")),
            })
        rows.append(row)
    return rows


def _ratio(value: Optional[float], reference: Optional[float]) -> Optional[float]:
    return None if value is None or not reference else value / reference


def headline(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """The top-level numbers for one ratio's comparison rows: the semi-synchronous row with the smallest
    ``time_to_sync_final_loss_ratio`` (if none reaches the reference's final loss: the one with the smallest
    ``final_loss_ratio``), both of its ratios, and whether each meets the issue's target. Both numbers come from
    the same row: picking each from whichever row flatters it would describe no run."""
    semi = [r for r in rows if r.get("status") == "ok" and r.get("sync_every")]
    if not semi:
        return {"headline_strategy": None, "time_to_sync_final_loss_ratio": None, "final_loss_ratio": None,
                "targets_met": {"time_to_sync_final_loss_ratio": False, "final_loss_ratio": False}}
    reached = [r for r in semi if r.get("time_to_sync_final_loss_ratio") is not None]
    if reached:
        best = min(reached, key=lambda r: r["time_to_sync_final_loss_ratio"])
    else:
        best = min(semi, key=lambda r: math.inf if r.get("final_loss_ratio") is None else r["final_loss_ratio"])
    time_ratio, loss_ratio = best.get("time_to_sync_final_loss_ratio"), best.get("final_loss_ratio")
    return {
        "headline_strategy": best["strategy"],
        "time_to_sync_final_loss_ratio": time_ratio,
        "final_loss_ratio": loss_ratio,
        "targets": {"time_to_sync_final_loss_ratio": TARGET_TIME_RATIO, "final_loss_ratio": TARGET_LOSS_RATIO},
        "targets_met": {
            "time_to_sync_final_loss_ratio": time_ratio is not None and time_ratio <= TARGET_TIME_RATIO,
            "final_loss_ratio": loss_ratio is not None and loss_ratio <= TARGET_LOSS_RATIO,
        },
    }


DEFINITIONS = {
    "loss": "per optimizer step: the mean cross-entropy (nats/token) over the global batch, i.e. over every rank's "
            "micro-batches; for DiLoCo rows each rank's loss is that of its replica group's current model (groups "
            "differ between synchronisations), averaged over all ranks",
    "time_s": "wall-clock since training started (after set-up, the planner's calibration and a barrier) to the "
              "end of the step, the slowest rank's; a DiLoCo row's synchronising step includes its outer step",
    "smoothed": "trailing mean over `window` steps; the comparison reads only smoothed curves",
    "time_to_sync_final_loss_ratio": "the row's wall-clock to reach mics-auto's final smoothed training loss "
                                     f"(within a relative {REACH_TOLERANCE:g}: fp32 rounding; linear interpolation "
                                     "between steps), divided by mics-auto's wall-clock for the whole budget; null "
                                     "if the row never reaches it within the budget",
    "final_loss_ratio": "the row's held-out loss at the full budget over mics-auto's: every row's final model "
                        "(DiLoCo: the synchronised global model, the budget being whole rounds) evaluated on the "
                        "same held-out sequences",
    "headline": "the top-level keys are those of the headline bandwidth ratio's semi-synchronous row with the "
                "smallest time_to_sync_final_loss_ratio (both keys from that one row)",
}


def build_convergence_report(points: list[dict[str, Any]], command: str, settings: dict[str, Any],
                             window: int) -> dict[str, Any]:
    """``convergence.json``: every ratio's network, runs and comparison, and at the top the headline ratio's
    (the first point's) two numbers with their definitions."""
    for point in points:
        point["comparison"] = compare_runs(point["runs"], window)
        point["headline"] = headline(point["comparison"])
    first = points[0]
    return {
        "command": command,
        "settings": settings,
        "definitions": DEFINITIONS,
        "headline_bandwidth_ratio": first["bandwidth_ratio"],
        **first["headline"],
        "points": points,
    }


# ------------------------------------------------------------------------------------------------ output
def format_convergence_table(report: dict[str, Any], markdown: bool = False) -> str:
    """One row per (ratio, strategy): wall-clock, step time, losses, the two ratios and the bytes."""
    header = ["ratio", "strategy", "wall s", "s/step", "final train loss", "held-out loss", "held-out / mics-auto",
              "time to mics-auto's loss (s)", "/ mics-auto wall", "inter-node MB (expected)"]
    table = [header]
    for point in report["points"]:
        for r in point["comparison"]:
            label = r["strategy"] + (f" (semi-sync, H={r['sync_every']})" if r.get("sync_every") else "")
            if r.get("status") != "ok":
                table.append([f"{point['bandwidth_ratio']:g}", label, str(r.get("status"))[:50], *["-"] * 7])
                continue
            reach = r.get("time_to_reference_loss_s")
            table.append([
                f"{point['bandwidth_ratio']:g}", label, f"{r['wall_s']:.0f}", f"{r['s_per_step']:.2f}",
                f"{r['final_train_loss']:.3f}", _fmt(r.get("heldout_loss"), "{:.3f}"),
                _fmt(r.get("final_loss_ratio"), "{:.3f}"),
                "not reached" if reach is None and "reference_final_loss" in r else _fmt(reach, "{:.0f}"),
                _fmt(r.get("time_to_sync_final_loss_ratio"), "{:.2f}"),
                f"{_mb(r.get('inter_node_bytes'))} ({_mb(r.get('expected_inter_node_bytes'))})",
            ])
    if markdown:
        return "\n".join(["| " + " | ".join(header) + " |", "|---:|---|" + "---:|" * (len(header) - 2),
                          *("| " + " | ".join(row) + " |" for row in table[1:])])
    widths = [max(len(row[i]) for row in table) for i in range(len(header))]
    lines = ["  ".join(c.ljust(w) if i == 1 else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths)))
             for row in table]
    return "\n".join([lines[0], "-" * len(lines[0]), *lines[1:]])


def _fmt(value: Optional[float], pattern: str) -> str:
    return "-" if value is None else pattern.format(value)


def _mb(value: Optional[float]) -> str:
    return "-" if value is None else f"{value / 1e6:,.1f}"


def draw_convergence(report: dict[str, Any], path: Path) -> Optional[Path]:
    """Smoothed loss against tokens (left) and wall-clock (right), one row of panels per bandwidth ratio (the loss
    axis cut at :data:`LOSS_AXIS_TOP`); the dashed line is mics-auto's final loss (what ``time_to_sync_final_loss_ratio`` reaches for), the dotted one
    the chain's entropy rate (the best any model can do)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is missing, so no chart: `pip install -e '.[bench]'`", file=sys.stderr)
        return None
    window = report["settings"]["window"]
    floor = report["settings"].get("entropy_rate")
    points = report["points"]
    fig, axes = plt.subplots(len(points), 2, figsize=(11, 4.2 * len(points)), squeeze=False)
    for (left, right), point in zip(axes, points):
        target = None
        for record in point["runs"]:
            if record.get("status") != "ok":
                continue
            c = curve(record, window)
            label = record["strategy"] + (f" (H={record['sync_every']})" if record.get("sync_every") else "")
            left.plot([t / 1e3 for t in c["tokens"]], c["smoothed"], label=label)
            right.plot(c["time_s"], c["smoothed"], label=label)
            if record["strategy"] == REFERENCE:
                target = c["smoothed"][-1]
        for axis in (left, right):
            if target is not None:
                axis.axhline(target, color="gray", linestyle="--", linewidth=0.8, label="mics-auto's final loss")
            if floor is not None:
                axis.axhline(floor, color="black", linestyle=":", linewidth=0.8, label="entropy rate (floor)")
            axis.set_ylabel(f"training loss (trailing mean of {window} steps)")
            axis.grid(alpha=0.3)
            # the first steps fall from ln(vocab) fast; the comparison happens near the floor
            bottom = (floor or 0.0) * 0.97
            axis.set_ylim(bottom=bottom, top=max(bottom + 0.5, min(LOSS_AXIS_TOP, axis.get_ylim()[1])))
        left.set_xlabel("tokens (thousands, all ranks)")
        right.set_xlabel("wall-clock (s)")
        rate = point["network"]["inter_node_rate_bytes_per_s"]
        left.set_title(f"inter-node link 1/{point['bandwidth_ratio']:g} of loopback ({rate / 1e6:,.1f} MB/s)",
                       fontsize=9)
        right.set_title(f"time to mics-auto's final loss, ratio {point['bandwidth_ratio']:g}", fontsize=9)
        right.legend(fontsize=7)
    fig.suptitle(textwrap.fill(f"Loss against tokens and wall-clock: {report['command']}", 120), fontsize=9)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


# ------------------------------------------------------------------------------------------------ re-analysis
def reanalyse(report: dict[str, Any]) -> dict[str, Any]:
    """The report with every comparison and the headline computed again from its runs' records (which the
    analysis never changes): how a results file follows a change to the analysis without training again."""
    window = int(report["settings"]["window"])
    points = [{k: v for k, v in point.items() if k not in ("comparison", "headline")} for point in report["points"]]
    fresh = build_convergence_report(points, report["command"], report["settings"], window)
    return {**{k: v for k, v in report.items() if k not in fresh}, **fresh}


def main(argv: Optional[list[str]] = None) -> int:
    """``python benchmarks/convergence.py RESULTS.json``: re-analyse a ``--convergence`` results file in place
    (comparison, headline, chart beside it) and print its tables."""
    import argparse
    import json

    parser = argparse.ArgumentParser(description=main.__doc__)
    parser.add_argument("results", type=Path, help="convergence.json written by emulated_cluster.py --convergence")
    args = parser.parse_args(argv)
    if not args.results.is_file():
        parser.error(f"{args.results} does not exist: run `emulated_cluster.py --convergence` first.")
    report = reanalyse(json.loads(args.results.read_text()))
    args.results.write_text(json.dumps(report, indent=2))
    chart = draw_convergence(report, args.results.with_suffix(".png"))
    print(format_convergence_table(report))
    print("\n" + format_convergence_table(report, markdown=True))
    print(f"\nrewrote {args.results}" + (f" and {chart}" if chart else ""))
    return 0


if __name__ == "__main__":
    if __package__ in (None, ""):  # run as a script: make `benchmarks` importable
        sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    sys.exit(main())
