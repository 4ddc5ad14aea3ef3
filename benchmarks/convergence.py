"""Held-out loss against tokens and wall-clock on the emulated cluster: the ``--convergence`` mode of
``emulated_cluster.py``.

Why: a semi-synchronous row (DiLoCo, ``mics-diloco``) sends ``1 / H`` of the synchronous bytes across nodes, so its
steps are faster where the link is slow -- but it is not synchronous training, so its loss per token may be worse.
Step time alone cannot say whether it pays; the time to reach a given loss can. This mode trains the same model on
the same data under a synchronous reference (``mics-auto``) and DiLoCo rows (H = 8, H = 32 and the H the planner
names for the link), for several seeds, and evaluates every row's *synchronised* model on the same held-out
sequences at the same token counts.

The data (:class:`MarkovChain`) is learnable -- random tokens cannot be learnt below ``ln(vocab)`` -- and its
best possible loss is known: a fixed random first-order Markov chain over the byte vocabulary, each token followed
by one of ``successors`` tokens with random probabilities. Its entropy rate (nats per token) is the floor of the
loss; a model that has learnt the table reaches it.

What a worker records (``emulated_worker.run_convergence``), per row and seed:

* every ``eval_every`` optimizer steps, the held-out loss of the row's **global model**: for a synchronous row the
  model itself; for a DiLoCo row the last synchronised (outer) model -- the parameters every replica group started
  the current round from, not a group's drifted copy. The evaluation's own wall-clock is taken out of the row's
  clock, so ``time_s`` is training time only;
* every optimizer step's training loss and end time (the slowest rank's, since training started).

The analysis here is pure (no processes, no namespaces), so the tests drive it with synthetic records:

* :func:`first_reach` -- the first evaluation point at or below a target (no interpolation: a DiLoCo row's global
  model changes only at its synchronisations, so there is nothing in between to interpolate);
* :func:`compare_seed` -- per row of one seed, against that seed's ``mics-auto``: the wall-clock to reach
  ``mics-auto``'s final held-out loss over ``mics-auto``'s wall-clock for its whole budget, and the row's final
  held-out loss over ``mics-auto``'s;
* :func:`summarise_rows` -- per row, each seed's pair and their mean and spread;
* :func:`headline` -- the top-level numbers of ``convergence.json``: the means over the seeds for the row with the
  planner's H, and whether they meet the targets (:data:`TARGETS`);
* :func:`planner_answer` -- the H the library's planner names for the run's model, cluster and link;
* :func:`seed_check` -- whether different seeds really gave different curves.
"""

from __future__ import annotations

import math
import statistics
import sys
import textwrap
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any, Optional

import torch
from torch import Tensor
from torch.utils.data import Dataset

#: The synchronous reference every other row is compared against.
REFERENCE = "mics-auto"
#: In ``--strategies``: the DiLoCo row with the H the planner names for the link (resolved once the first
#: ``mics-auto`` run of a ratio has measured the cluster; it is the H = 8 or H = 32 row when the planner names 8 or 32).
PLANNED_ROW = "mics-diloco-planned"
#: The rows of a convergence run (``--strategies`` may name others, ``REFERENCE`` among them).
CONVERGENCE_STRATEGIES = ("mics-auto", "mics-diloco", "mics-diloco-h32", PLANNED_ROW)
SMOKE_CONVERGENCE_STRATEGIES = ("mics-auto", "mics-diloco", PLANNED_ROW)
#: Bandwidth ratios of a convergence run: the cross-region setting (1/240 of loopback); others by flag.
CONVERGENCE_RATIOS = (240.0,)
SMOKE_CONVERGENCE_RATIOS = (240.0,)
#: Seeds of a run: each changes the model's initialisation and the draw (and so the order) of training sequences.
CONVERGENCE_SEEDS = (0, 1, 2)
SMOKE_CONVERGENCE_SEEDS = (0, 1)
#: The targets for the planner's row at the headline ratio: the means over the seeds, and every single seed.
TARGETS = {
    "mean_time_to_sync_final_loss_ratio": 0.5,
    "mean_final_loss_ratio": 1.05,
    "every_seed_time_to_sync_final_loss_ratio": 0.6,
    "every_seed_final_loss_ratio": 1.08,
}
#: A row "reaches" the reference's final loss within this relative margin: two synchronous rows train the same
#: trajectory to fp32 rounding (~1e-7 apart), which must not read as "never reached". Far below the noise of a run.
REACH_TOLERANCE = 1e-4
#: Model initialisation of seed ``s``: ``pl.seed_everything(INIT_SEED_BASE + s)`` on every rank.
INIT_SEED_BASE = 1234
#: The chart's loss axis stops here: the first evaluations fall from ln(256) = 5.5 within a few thousand tokens,
#: and the differences that matter are near the floor.
LOSS_AXIS_TOP = 2.6


# ------------------------------------------------------------------------------------------------ settings
@dataclass(frozen=True)
class ConvergenceSettings:
    """What every row of a convergence run trains with, besides the model and cluster (one JSON object in the
    job file, so the workers and the report share it)."""

    steps: int  #: the reference's token budget, in optimizer steps (synchronous rows run exactly this many)
    learning_rate: float = 3e-3  #: peak AdamW learning rate (inner optimizer for DiLoCo rows)
    warmup_steps: int = 10  #: linear warm-up, then cosine decay to 0.1x at the row's last step
    successors: int = 4  #: tokens that may follow each token in the Markov chain
    data_seed: int = 0  #: the chain's table; training sequences use ``data_seed + 1`` (and the seed), held-out ``+ 2``
    heldout_samples: int = 512  #: held-out sequences, the same for every row and seed
    eval_every: int = 16  #: optimizer steps between two held-out evaluations (the same token counts for every row)
    #: a DiLoCo row's budget is at least this many times the reference's (whole rounds, whole evaluation intervals)
    diloco_budget: float = 2.0
    seeds: tuple[int, ...] = CONVERGENCE_SEEDS
    window: int = 16  #: trailing-mean window (steps) of the training-loss curves (the table's last column)

    def __post_init__(self) -> None:
        object.__setattr__(self, "seeds", tuple(self.seeds))
        for name in ("steps", "successors", "heldout_samples", "window", "eval_every"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"convergence {name.replace('_', '-')} must be a positive int, got {value!r}.")
        if not self.learning_rate > 0:
            raise ValueError(f"--lr must be positive, got {self.learning_rate!r}.")
        if self.warmup_steps < 0:
            raise ValueError(f"convergence warm-up steps must be >= 0, got {self.warmup_steps!r}.")
        if not self.diloco_budget >= 1.0:
            raise ValueError(f"--diloco-budget must be >= 1 (a multiple of the reference's), got {self.diloco_budget!r}.")
        if not self.seeds or len(set(self.seeds)) != len(self.seeds) or any(
            isinstance(s, bool) or not isinstance(s, int) or s < 0 for s in self.seeds
        ):
            raise ValueError(f"--seeds takes distinct non-negative ints, got {self.seeds!r}.")

    def row_steps(self, sync_every: Optional[int]) -> int:
        """A row's budget in optimizer steps: the reference's for a synchronous row; for a DiLoCo row the smallest
        multiple of both ``H`` (whole rounds: its last model is the synchronised one) and ``eval_every`` (its last
        step is an evaluation point) that is at least ``diloco_budget`` times the reference's."""
        if not sync_every:
            return self.steps
        unit = math.lcm(sync_every, self.eval_every)
        return -(-math.ceil(self.diloco_budget * self.steps) // unit) * unit

    def check(self, world_size: int) -> None:
        """Refuse a reference budget that does not end on an evaluation point, or a held-out set the ranks cannot
        split evenly."""
        if self.steps % self.eval_every:
            raise ValueError(
                f"--steps {self.steps} is not a multiple of --eval-every {self.eval_every}: the reference's final "
                "model would not be evaluated."
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


#: Seeds of the training draws: step ``t`` of seed ``s`` draws with ``data_seed + 1 + DRAW_STRIDE * s + t``.
DRAW_STRIDE = 1_000_003


def training_sequences(chain: MarkovChain, data_seed: int, seed: int, steps: int, per_step: int,
                       length: int) -> Tensor:
    """The training sequences of seed ``seed``: ``per_step`` sequences (one global batch) per optimizer step, each
    step's batch drawn with its own generator. So a longer budget (a DiLoCo row's) reads the same batches as a
    shorter one (``mics-auto``'s) over their common steps, and another seed reads other sequences in another order."""
    if steps < 1 or per_step < 1:
        raise ValueError(f"need at least one step of one sequence, got {steps} steps of {per_step}.")
    base = data_seed + 1 + DRAW_STRIDE * seed
    return torch.cat([chain.sample(per_step, length, base + step) for step in range(steps)])


def init_seed(seed: int) -> int:
    """The global seed every rank of a row sets before building the model (:data:`INIT_SEED_BASE` + ``seed``)."""
    return INIT_SEED_BASE + seed


class SequenceDataset(Dataset[tuple[Tensor, Tensor]]):
    """Sequences of ``seq_len + 1`` tokens as (inputs, next-token targets), in a fixed order: with Lightning's
    ``DistributedSampler`` (no shuffling) global optimizer step ``s`` reads samples ``[s * B, (s + 1) * B)`` --
    ``B`` = ranks x accumulation x micro-batch -- whatever the strategy, so every row of a seed sees the same
    batches."""

    def __init__(self, sequences: Tensor) -> None:
        self.sequences = sequences

    def __len__(self) -> int:
        return self.sequences.shape[0]

    def __getitem__(self, index: int) -> tuple[Tensor, Tensor]:
        row = self.sequences[index]
        return row[:-1], row[1:]


# ------------------------------------------------------------------------------------------------ planner
def planner_answer(cluster: dict[str, Any], model: dict[str, Any], micro_batch: int, accumulate: int,
                   memory_bytes: float, achieved_flops: Optional[float], precision: str = "32-true") -> dict[str, Any]:
    """The DiLoCo H the library's planner names for this run (``lightning_mics.planner.plan``, what
    ``lightning-mics plan`` calls; it names the smallest H that keeps the ranks computing at least half the step,
    :class:`~lightning_mics.planner.SemiSyncAdvice`), with its inputs:

    * ``cluster``: the :class:`~lightning_mics.planner.ClusterSpec` fields ``mics-auto``'s strategy measured at
      set-up (``planner_cluster="calibrate"``: the links, latencies, optimizer-step rate), its compute rate replaced
      by ``achieved_flops`` where given -- the rate the ranks achieved in ``mics-auto``'s own accumulation
      micro-steps (no communication in them), which is what the planner's ``compute_flops`` means ("achieved
      FLOP/s per GPU"); the calibration's matrix product is an upper bound;
    * ``model``: the GPT's :class:`~examples.models.GPTConfig` fields (its real shape and FLOPs per token);
    * the batch, accumulation and precision the rows train with, and ``memory_bytes`` per rank;
    * the search ``mics-auto`` runs (``sharding="auto"``, ``grad_accumulation="auto"``).

    ``with_calibrated_compute`` is the answer for the calibration's own compute rate, for comparison."""
    from examples.models import GPTConfig
    from lightning_mics.planner import ClusterSpec, TrainingSpec, plan

    model_spec = GPTConfig(**model).model_spec(name="benchmark GPT")
    training = TrainingSpec(micro_batch=micro_batch, accumulation=accumulate, precision=precision)
    calibrated = ClusterSpec(**{**cluster, "gpu_memory_bytes": float(memory_bytes)})
    used = calibrated if achieved_flops is None else replace(calibrated, compute_flops=float(achieved_flops))

    def answer(spec: ClusterSpec) -> dict[str, Any]:
        result = plan(spec, model_spec, training, grad_accumulation="auto")
        advice = result.semi_sync_advice
        best = result.winner
        return {
            "sync_every": None if advice is None else advice.sync_every,
            "synchronous_layout": best.name,
            "synchronous_step_s": best.step_time_s,
            "synchronous_busy_fraction": best.busy_fraction,
            "synchronous_exposed_comm_fraction": best.exposed_comm_s / best.step_time_s,
            "semi_sync": None if advice is None else {"layout": advice.semi_sync.name,
                                                      "step_s": advice.semi_sync.step_time_s,
                                                      "busy_fraction": advice.semi_sync.busy_fraction},
            "explanation": result.explain(),
        }

    chosen = answer(used)
    return {
        "sync_every": chosen["sync_every"],
        "inputs": {
            "cluster": asdict(used),
            "model": asdict(model_spec),
            "training": asdict(training),
            "search": {"grad_accumulation": "auto", "uniform_only": False, "hierarchical": "auto"},
            "compute_basis": "calibration's matrix product (no micro-step timing)" if achieved_flops is None else
            "achieved in mics-auto's accumulation micro-steps (the slowest rank's median)",
            "calibrated_compute_flops": calibrated.compute_flops,
        },
        "answer": chosen,
        "with_calibrated_compute": {k: v for k, v in answer(calibrated).items() if k != "explanation"},
    }


def achieved_flops(micro_step_s: Optional[float], flops_per_token: float, micro_batch: int, seq_len: int
                   ) -> Optional[float]:
    """FLOP/s one rank achieved in a micro-step that only computes: the training FLOPs of its tokens over its
    duration (``None`` without a timing)."""
    if not micro_step_s or micro_step_s <= 0:
        return None
    return flops_per_token * micro_batch * seq_len / micro_step_s


# ------------------------------------------------------------------------------------------------ analysis
def smoothed(values: list[float], window: int) -> list[float]:
    """Trailing mean over ``window`` values (fewer at the start)."""
    if window < 1:
        raise ValueError(f"the smoothing window must be >= 1, got {window}.")
    out, total = [], 0.0
    for i, value in enumerate(values):
        total += value
        if i >= window:
            total -= values[i - window]
        out.append(total / min(i + 1, window))
    return out


def first_reach(xs: list[float], losses: list[float], target: float) -> Optional[float]:
    """The ``x`` (time or tokens) of the first evaluation point whose loss is at or below ``target``; ``None`` if
    none is. No interpolation between points."""
    if len(xs) != len(losses):
        raise ValueError(f"{len(xs)} x values for {len(losses)} losses.")
    for x, loss in zip(xs, losses):
        if loss <= target:
            return x
    return None


def heldout_curve(record: dict[str, Any]) -> dict[str, list[float]]:
    """A run's evaluation points: optimizer step, tokens, training wall-clock (s) and held-out loss."""
    evals = record["evals"]
    return {
        "step": [e["step"] for e in evals],
        "tokens": [e["step"] * record["tokens_per_step"] for e in evals],
        "time_s": [e["time_s"] for e in evals],
        "loss": [e["heldout_loss"] for e in evals],
    }


def wire_fraction(record: dict[str, Any], link_bytes_per_s: float) -> Optional[float]:
    """The share of a row's step the shaped link alone needs: its busiest uplink direction's bytes per step over
    the link rate (the wire floor), over its mean step time (training clock). 1.0: the wire is the whole step."""
    tx, rx = record.get("inter_node_tx_bytes_per_node"), record.get("inter_node_rx_bytes_per_node")
    if record.get("status") != "ok" or not tx or not rx or not link_bytes_per_s:
        return None
    steps = record["steps"]
    floor = max(*tx, *rx) / len(steps) / link_bytes_per_s
    return floor / (steps[-1]["time_s"] / len(steps))


def compare_seed(records: list[dict[str, Any]], window: int = 16, reference: str = REFERENCE) -> list[dict[str, Any]]:
    """One row per run of one seed (and ratio), against that seed's ``reference`` (module docstring). A failed or
    skipped run keeps its status and nothing else; without a successful reference the ratios are absent.
    ``window``: the trailing mean of the training loss reported beside (``final_train_loss``)."""
    ok = {r["strategy"]: r for r in records if r.get("status") == "ok"}
    ref = ok.get(reference)
    ref_curve = heldout_curve(ref) if ref else None
    target = ref_curve["loss"][-1] if ref_curve else None
    ref_wall = ref["steps"][-1]["time_s"] if ref else None
    ref_tokens = ref_curve["tokens"][-1] if ref_curve else None
    rows = []
    for record in records:
        name = record["strategy"]
        if record.get("status") != "ok":
            rows.append({"strategy": name, "seed": record.get("seed"), "sync_every": record.get("sync_every"),
                         "status": record.get("status")})
            continue
        c = heldout_curve(record)
        steps = record["steps"]
        row: dict[str, Any] = {
            "strategy": name,
            "seed": record.get("seed"),
            "status": "ok",
            "sync_every": record.get("sync_every"),
            "steps": len(steps),
            "tokens": len(steps) * record["tokens_per_step"],
            "wall_s": steps[-1]["time_s"],
            "s_per_step": steps[-1]["time_s"] / len(steps),
            "eval_s": record.get("eval_s"),
            "final_heldout_loss": c["loss"][-1],
            "final_train_loss": smoothed([s["loss"] for s in steps], window)[-1],
            "inter_node_bytes": record.get("inter_node_bytes"),
            "expected_inter_node_bytes": record.get("expected_inter_node_bytes"),
        }
        if ref_curve is not None and target is not None and ref_wall:
            limit = target * (1 + REACH_TOLERANCE)
            reach_s = first_reach(c["time_s"], c["loss"], limit)
            at_ref = [loss for tokens, loss in zip(c["tokens"], c["loss"]) if tokens == ref_tokens]
            row.update({
                "reference_final_loss": target,
                "budget_over_reference": row["tokens"] / ref_tokens,
                "time_to_reference_loss_s": reach_s,
                "tokens_to_reference_loss": first_reach(c["tokens"], c["loss"], limit),
                "time_to_sync_final_loss_ratio": None if reach_s is None else reach_s / ref_wall,
                "final_loss_ratio": c["loss"][-1] / target,
                "loss_ratio_at_reference_tokens": at_ref[0] / target if at_ref else None,
                "wall_ratio": row["wall_s"] / ref_wall,
            })
        rows.append(row)
    return rows


def _spread(values: list[Optional[float]]) -> dict[str, Any]:
    """Mean, min, max and sample standard deviation of one ratio over the seeds; the mean is ``None`` unless every
    seed has a value (a seed that never reached the loss fails the mean too)."""
    known = [v for v in values if v is not None]
    complete = bool(values) and len(known) == len(values)
    return {
        "mean": statistics.mean(known) if complete else None,
        "min": min(known) if known else None,
        "max": max(known) if known else None,
        "std": statistics.stdev(known) if complete and len(known) > 1 else None,
        "seeds_with_value": len(known),
        "seeds": len(values),
    }


def summarise_rows(comparisons: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per row (in order of first appearance), over the seeds: each seed's (time ratio, loss ratio) pair, their
    mean and spread, and the mean step time."""
    names: list[str] = []
    by_name: dict[str, list[dict[str, Any]]] = {}
    for row in comparisons:
        if row["strategy"] not in by_name:
            names.append(row["strategy"])
            by_name[row["strategy"]] = []
        by_name[row["strategy"]].append(row)
    out = []
    for name in names:
        rows = by_name[name]
        ok = [r for r in rows if r.get("status") == "ok"]
        times = [r.get("time_to_sync_final_loss_ratio") if r.get("status") == "ok" else None for r in rows]
        losses = [r.get("final_loss_ratio") if r.get("status") == "ok" else None for r in rows]
        out.append({
            "strategy": name,
            "sync_every": rows[0].get("sync_every"),
            "seeds": [{"seed": r.get("seed"), "status": r.get("status"),
                       "time_to_sync_final_loss_ratio": t, "final_loss_ratio": loss}
                      for r, t, loss in zip(rows, times, losses)],
            "time_to_sync_final_loss_ratio": _spread(times),
            "final_loss_ratio": _spread(losses),
            "loss_ratio_at_reference_tokens": _spread([r.get("loss_ratio_at_reference_tokens") for r in ok]),
            "s_per_step": statistics.mean(r["s_per_step"] for r in ok) if ok else None,
            "tokens": ok[0]["tokens"] if ok else None,
            "budget_over_reference": ok[0].get("budget_over_reference") if ok else None,
            "final_heldout_loss": statistics.mean(r["final_heldout_loss"] for r in ok) if ok else None,
        })
    return out


def headline(summary: list[dict[str, Any]], planner_row: Optional[str]) -> dict[str, Any]:
    """The top-level numbers for one ratio: the planner's row's means over the seeds, their spread and whether they
    meet :data:`TARGETS` (the means, and every seed). Null when the planner named no H or its row did not run."""
    row = next((r for r in summary if r["strategy"] == planner_row), None) if planner_row else None
    unmet = {key: False for key in TARGETS}
    if row is None:
        return {"headline_strategy": planner_row, "planner_sync_every": None, "time_to_sync_final_loss_ratio": None,
                "final_loss_ratio": None, "spread": None, "targets": TARGETS, "targets_met": unmet}
    time_ratio, loss_ratio = row["time_to_sync_final_loss_ratio"], row["final_loss_ratio"]
    per_seed = row["seeds"]

    def every(key: str, limit: float) -> bool:
        return bool(per_seed) and all(s[key] is not None and s[key] <= limit for s in per_seed)

    return {
        "headline_strategy": row["strategy"],
        "planner_sync_every": row["sync_every"],
        "time_to_sync_final_loss_ratio": time_ratio["mean"],
        "final_loss_ratio": loss_ratio["mean"],
        "spread": {"time_to_sync_final_loss_ratio": time_ratio, "final_loss_ratio": loss_ratio},
        "targets": TARGETS,
        "targets_met": {
            "mean_time_to_sync_final_loss_ratio": time_ratio["mean"] is not None
            and time_ratio["mean"] <= TARGETS["mean_time_to_sync_final_loss_ratio"],
            "mean_final_loss_ratio": loss_ratio["mean"] is not None
            and loss_ratio["mean"] <= TARGETS["mean_final_loss_ratio"],
            "every_seed_time_to_sync_final_loss_ratio": every(
                "time_to_sync_final_loss_ratio", TARGETS["every_seed_time_to_sync_final_loss_ratio"]),
            "every_seed_final_loss_ratio": every("final_loss_ratio", TARGETS["every_seed_final_loss_ratio"]),
        },
    }


def seed_check(records: list[dict[str, Any]]) -> dict[str, Any]:
    """Whether every row's seeds gave different curves: a pair of seeds of one row with identical held-out losses
    or identical training losses means the seed changed nothing (the "seeds" would be one run repeated)."""
    by_row: dict[str, list[dict[str, Any]]] = {}
    for record in records:
        if record.get("status") == "ok":
            by_row.setdefault(record["strategy"], []).append(record)
    identical = []
    for name, runs in by_row.items():
        for i, a in enumerate(runs):
            for b in runs[i + 1:]:
                same_heldout = [e["heldout_loss"] for e in a["evals"]] == [e["heldout_loss"] for e in b["evals"]]
                same_train = [s["loss"] for s in a["steps"]] == [s["loss"] for s in b["steps"]]
                if same_heldout or same_train:
                    identical.append({"strategy": name, "seeds": [a.get("seed"), b.get("seed")],
                                      "heldout_identical": same_heldout, "train_identical": same_train})
    return {"distinct": not identical, "identical": identical}


def reference_wire(records: list[dict[str, Any]], link_bytes_per_s: float) -> dict[str, Any]:
    """The reference's measured wire fraction (:func:`wire_fraction`) per seed and its mean."""
    values = [(r.get("seed"), wire_fraction(r, link_bytes_per_s)) for r in records
              if r["strategy"] == REFERENCE and r.get("status") == "ok"]
    known = [v for _, v in values if v is not None]
    return {"mean": statistics.mean(known) if known else None,
            "per_seed": [{"seed": s, "wire_fraction": v} for s, v in values],
            "basis": "measured: the busiest uplink direction's bytes per step over the shaped link's rate, over the "
                     "mean step time (training clock)"}


def analyse_point(point: dict[str, Any], window: int = 16) -> dict[str, Any]:
    """One ratio's comparison (every seed's rows), summary, headline, seed check and wire fraction, from its runs."""
    runs = point["runs"]
    seeds = list(dict.fromkeys(r.get("seed") for r in runs))
    comparison = [row for seed in seeds for row in compare_seed([r for r in runs if r.get("seed") == seed], window)]
    summary = summarise_rows(comparison)
    planner_row = (point.get("planner") or {}).get("row")
    link = point["network"]["inter_node_rate_bytes_per_s"]
    return {
        "comparison": comparison,
        "summary": summary,
        "headline": headline(summary, planner_row),
        "seed_check": seed_check(runs),
        "reference_wire_fraction": reference_wire(runs, link),
    }


DEFINITIONS = {
    "heldout_loss": "mean cross-entropy (nats/token) of the row's global model on the held-out sequences (the same "
                    "for every row and seed), every `eval_every` optimizer steps (the same token counts for every "
                    "row); a synchronous row's global model is the model itself, a DiLoCo row's the last synchronised "
                    "(outer) model -- the parameters every replica group started the current round from",
    "time_s": "training wall-clock since training started (after set-up, the planner's calibration and a barrier) "
              "to the end of the step, the slowest rank's, with the held-out evaluations' own time taken out; a "
              "DiLoCo row's synchronising step includes its outer step",
    "time_to_sync_final_loss_ratio": "the row's training wall-clock at the first evaluation point whose held-out "
                                     "loss is at or below mics-auto's final held-out loss of the same seed (within a "
                                     f"relative {REACH_TOLERANCE:g}; no interpolation between points), divided by "
                                     "mics-auto's wall-clock for its whole budget; null if the row never reaches it",
    "final_loss_ratio": "the row's held-out loss at the end of its budget over mics-auto's at the end of its budget, "
                        "same seed",
    "loss_ratio_at_reference_tokens": "the row's held-out loss at mics-auto's token budget over mics-auto's final "
                                      "one (a DiLoCo row with a larger budget is still mid-schedule there)",
    "budget": "synchronous rows train `steps` optimizer steps; DiLoCo rows at least `diloco_budget` times as many "
              "(whole rounds of H and whole evaluation intervals), each row's learning-rate schedule spanning its "
              "own budget",
    "seeds": "per seed, each row's (time_to_sync_final_loss_ratio, final_loss_ratio); a seed sets the model's "
             "initialisation and the draw (and so the order) of the training sequences",
    "headline": "the top-level time_to_sync_final_loss_ratio and final_loss_ratio are the means over the seeds for "
                "the headline ratio's row with the planner's H (`planner`); null if any seed did not reach the loss",
}


def build_convergence_report(points: list[dict[str, Any]], command: str, settings: dict[str, Any]) -> dict[str, Any]:
    """``convergence.json``: every ratio's network, planner, runs and analysis, and at the top the headline ratio's
    (the first point's) numbers with their definitions."""
    for point in points:
        point.update(analyse_point(point, int(settings.get("window", 16))))
    first = points[0]
    top = first["headline"]
    return {
        "command": command,
        "settings": settings,
        "definitions": DEFINITIONS,
        "headline_bandwidth_ratio": first["bandwidth_ratio"],
        **top,
        "seeds": [
            {"seed": seed, "rows": {row["strategy"]: {"time_to_sync_final_loss_ratio": s["time_to_sync_final_loss_ratio"],
                                                      "final_loss_ratio": s["final_loss_ratio"]}
                                    for row in first["summary"] for s in row["seeds"] if s["seed"] == seed}}
            for seed in dict.fromkeys(r.get("seed") for r in first["runs"])
        ],
        "rows": first["summary"],
        "planner": first.get("planner"),
        "reference_wire_fraction": first["reference_wire_fraction"],
        "seeds_distinct": first["seed_check"]["distinct"],
        "points": points,
    }


# ------------------------------------------------------------------------------------------------ output
def _label(row: dict[str, Any], planner_row: Optional[str]) -> str:
    label = row["strategy"] + (f" (H={row['sync_every']})" if row.get("sync_every") else "")
    return label + (", planner's H" if row["strategy"] == planner_row else "")


def _per_seed(row: dict[str, Any], key: str, pattern: str) -> str:
    return " / ".join("-" if s[key] is None else pattern.format(s[key]) for s in row["seeds"])


def _mean_range(spread: dict[str, Any], pattern: str) -> str:
    if spread["mean"] is None:
        missing = spread["seeds"] - spread["seeds_with_value"]
        return f"not reached in {missing} of {spread['seeds']}" if spread["seeds"] else "-"
    return f"{pattern.format(spread['mean'])} ({pattern.format(spread['min'])}-{pattern.format(spread['max'])})"


def format_convergence_table(report: dict[str, Any], markdown: bool = False) -> str:
    """One row per (ratio, strategy): budget, step time, final held-out loss, each seed's two ratios and their
    means with their ranges."""
    header = ["ratio", "strategy", "tokens (x mics-auto)", "s/step", "final held-out loss",
              "time ratio per seed", "mean time ratio (range)", "loss ratio per seed", "mean loss ratio (range)"]
    table = [header]
    for point in report["points"]:
        planner_row = (point.get("planner") or {}).get("row")
        for r in point["summary"]:
            if r["s_per_step"] is None:
                statuses = ", ".join(str(s["status"])[:40] for s in r["seeds"])
                table.append([f"{point['bandwidth_ratio']:g}", _label(r, planner_row), statuses, *["-"] * 6])
                continue
            table.append([
                f"{point['bandwidth_ratio']:g}", _label(r, planner_row),
                f"{r['tokens']:,} ({_fmt(r.get('budget_over_reference'), '{:.2f}')})",
                f"{r['s_per_step']:.3f}", f"{r['final_heldout_loss']:.4f}",
                _per_seed(r, "time_to_sync_final_loss_ratio", "{:.3f}"),
                _mean_range(r["time_to_sync_final_loss_ratio"], "{:.3f}"),
                _per_seed(r, "final_loss_ratio", "{:.4f}"),
                _mean_range(r["final_loss_ratio"], "{:.4f}"),
            ])
    if markdown:
        return "\n".join(["| " + " | ".join(header) + " |", "|---:|---|" + "---:|" * (len(header) - 2),
                          *("| " + " | ".join(row) + " |" for row in table[1:])])
    widths = [max(len(row[i]) for row in table) for i in range(len(header))]
    lines = ["  ".join(c.ljust(w) if i == 1 else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths)))
             for row in table]
    return "\n".join([lines[0], "-" * len(lines[0]), *lines[1:]])


#: What the docs' block says before the measurement has run.
NOT_MEASURED = (
    "**Not measured yet.** Run `sudo \"$(command -v python)\" benchmarks/emulated_cluster.py --convergence` (about "
    "20 minutes on 2 cores; it writes `benchmarks/results/convergence/convergence.json` and `.png`), then "
    "`python benchmarks/figures.py` to render its numbers here.\n"
)


def figure_markdown(report: Optional[dict[str, Any]]) -> str:
    """The block ``benchmarks/figures.py`` renders into docs/semi-sync.md: the headline, the planner's answer, the
    reference's wire fraction, the table, the targets and the chart (:data:`NOT_MEASURED` without a report)."""
    if report is None:
        return NOT_MEASURED
    planner = report.get("planner") or {}
    wire = report.get("reference_wire_fraction") or {}
    met = report.get("targets_met") or {}
    spread = report.get("spread") or {}
    lines = [
        (f"Ratio {report['headline_bandwidth_ratio']:g}, {len(report.get('seeds', []))} seeds; the planner names "
         f"H = {planner.get('sync_every')} (row `{report.get('headline_strategy')}`); `mics-auto`'s measured wire "
         f"fraction {_fmt(wire.get('mean'), '{:.2f}')}."),
        "",
        format_convergence_table({"points": report["points"][:1]}, markdown=True),
        "",
        "| target (planner's row) | value | met |",
        "|---|---:|:-:|",
    ]
    for key, limit in TARGETS.items():
        values = spread.get(key.removeprefix("mean_").removeprefix("every_seed_")) or {}
        complete = values.get("seeds") and values.get("seeds_with_value") == values.get("seeds")
        value = values.get("mean" if key.startswith("mean_") else "max") if complete else None
        shown = _fmt(value, "{:.3f}") if complete else "not reached" if values else "-"
        what = ("mean" if key.startswith("mean_") else "worst seed") + ", " + \
            key.removeprefix("mean_").removeprefix("every_seed_")
        lines.append(f"| {what} <= {limit:g} | {shown} | {'yes' if met.get(key) else 'no'} |")
    rows = report.get("rows") or []
    at_reference = [(row["strategy"], row.get("loss_ratio_at_reference_tokens") or {}) for row in rows
                    if row.get("strategy") != REFERENCE]
    shown = [f"`{name}` {_fmt(v.get('mean'), '{:.3f}')} ({_fmt(v.get('min'), '{:.3f}')}-{_fmt(v.get('max'), '{:.3f}')})"
             for name, v in at_reference if v]
    if shown:
        lines += ["", "The DiLoCo rows train twice `mics-auto`'s tokens; their final loss ratio is at the end of that "
                      "budget. At `mics-auto`'s own token count (mean over the seeds, range): " + "; ".join(shown) + "."]
    lines += ["", "![Held-out loss of the global models against tokens and training wall-clock]"
                  "(../benchmarks/results/convergence/convergence.png)"]
    return "\n".join(lines) + "\n"


def _fmt(value: Optional[float], pattern: str) -> str:
    return "-" if value is None else pattern.format(value)


def draw_convergence(report: dict[str, Any], path: Path) -> Optional[Path]:
    """Held-out loss against tokens (left) and training wall-clock (right), one row of panels per bandwidth ratio,
    one colour per row and one line per seed (the loss axis cut at :data:`LOSS_AXIS_TOP`, or higher where a row ends
    above it); the dashed line is
    mics-auto's final held-out loss (the mean over the seeds; each seed's ratios use its own), the dotted one the
    chain's entropy rate (the best any model can do)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is missing, so no chart: `pip install -e '.[bench]'`", file=sys.stderr)
        return None
    floor = report["settings"].get("entropy_rate")
    points = report["points"]
    fig, axes = plt.subplots(len(points), 2, figsize=(11, 4.2 * len(points)), squeeze=False)
    styles = ["-", "--", ":", "-."]
    for (left, right), point in zip(axes, points):
        names = list(dict.fromkeys(r["strategy"] for r in point["runs"]))
        seeds = list(dict.fromkeys(r.get("seed") for r in point["runs"]))
        colours = {name: f"C{i}" for i, name in enumerate(names)}
        targets, finals = [], []
        for record in point["runs"]:
            if record.get("status") != "ok":
                continue
            c = heldout_curve(record)
            style = styles[seeds.index(record.get("seed")) % len(styles)]
            label = record["strategy"] + (f" (H={record['sync_every']})" if record.get("sync_every") else "") + \
                f", seed {record.get('seed')}"
            # a step function: the metric reads the curve at the evaluation points only
            drawn = {"color": colours[record["strategy"]], "label": label, "linewidth": 1, "drawstyle": "steps-post"}
            left.plot([t / 1e3 for t in c["tokens"]], c["loss"], style, **drawn)
            right.plot(c["time_s"], c["loss"], style, **drawn)
            finals.append(c["loss"][-1])
            if record["strategy"] == REFERENCE:
                targets.append(c["loss"][-1])
        for axis in (left, right):
            if targets:
                axis.axhline(statistics.mean(targets), color="gray", linestyle="--", linewidth=0.8,
                             label="mics-auto's final held-out loss (mean)")
            if floor is not None:
                axis.axhline(floor, color="black", linestyle=":", linewidth=0.8, label="entropy rate (floor)")
            axis.set_ylabel("held-out loss of the global model")
            axis.grid(alpha=0.3)
            bottom = (floor or 0.0) * 0.97
            top = max(LOSS_AXIS_TOP, 1.15 * max(finals, default=0.0))  # every row's end stays in view
            axis.set_ylim(bottom=bottom, top=max(bottom + 0.5, min(top, axis.get_ylim()[1])))
        left.set_xlabel("tokens (thousands, all ranks)")
        right.set_xlabel("training wall-clock (s, evaluations excluded)")
        rate = point["network"]["inter_node_rate_bytes_per_s"]
        left.set_title(f"inter-node link 1/{point['bandwidth_ratio']:g} of loopback ({rate / 1e6:,.1f} MB/s)",
                       fontsize=9)
        right.set_title(f"time to mics-auto's final held-out loss, ratio {point['bandwidth_ratio']:g}", fontsize=9)
        right.legend(fontsize=6)
    fig.suptitle(textwrap.fill(f"Held-out loss against tokens and wall-clock: {report['command']}", 120), fontsize=9)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


# ------------------------------------------------------------------------------------------------ re-analysis
ANALYSIS_KEYS = ("comparison", "summary", "headline", "seed_check", "reference_wire_fraction")


def reanalyse(report: dict[str, Any]) -> dict[str, Any]:
    """The report with every analysis computed again from its runs' records (which the analysis never changes):
    how a results file follows a change to the analysis without training again."""
    if not all("evals" in r for point in report["points"] for r in point["runs"] if r.get("status") == "ok"):
        raise ValueError("this convergence.json has no held-out evaluation points (written before they were "
                         "recorded): run `emulated_cluster.py --convergence` again.")
    points = [{k: v for k, v in point.items() if k not in ANALYSIS_KEYS} for point in report["points"]]
    fresh = build_convergence_report(points, report["command"], report["settings"])
    return {**{k: v for k, v in report.items() if k not in fresh}, **fresh}


def main(argv: Optional[list[str]] = None) -> int:
    """``python benchmarks/convergence.py RESULTS.json``: re-analyse a ``--convergence`` results file in place
    (analysis, headline, chart beside it) and print its tables."""
    import argparse
    import json

    parser = argparse.ArgumentParser(description=main.__doc__)
    parser.add_argument("results", type=Path, help="convergence.json written by emulated_cluster.py --convergence")
    args = parser.parse_args(argv)
    if not args.results.is_file():
        parser.error(f"{args.results} does not exist: run `emulated_cluster.py --convergence` first.")
    try:
        report = reanalyse(json.loads(args.results.read_text()))
    except ValueError as error:
        parser.error(str(error))
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
