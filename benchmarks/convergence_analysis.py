"""The analysis of a ``--convergence`` run: from the records its rows wrote to ``convergence.json``.

What a worker records (:func:`benchmarks.convergence_worker.run_convergence`), per row and seed:

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
* :func:`build_convergence_report` -- ``convergence.json``: every ratio's analysis, the headline ratio's numbers at
  the top, and their definitions (:data:`DEFINITIONS`).

Its tables, docs block and chart are :mod:`benchmarks.convergence_report`'s.
"""

from __future__ import annotations

import statistics
from dataclasses import asdict, replace
from typing import Any, Optional

from benchmarks.convergence_setup import REFERENCE

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
