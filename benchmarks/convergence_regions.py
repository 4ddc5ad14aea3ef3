"""``--convergence --regions N``: does two-level DiLoCo pay on a cluster whose regions are joined by slow links?

Why: between regions the link is much slower than between the nodes of one region. Synchronous MiCS (``mics-auto``)
crosses it at every step; flat DiLoCo crosses it once every H steps but lets every partition group drift on its
own; two-level DiLoCo (``diloco_worker_size="region"``) keeps each region synchronous -- a hop 2 at every step on the
region's network -- and crosses the region link only in DiLoCo's outer round, with as many workers as regions. This
mode trains the three on the same data for several seeds (the ``--convergence`` machinery:
:mod:`benchmarks.convergence_analysis` compares the held-out loss of every row's synchronised model at the same
token counts) and asks, per seed and then as the mean over the seeds:

* ``time_to_sync_final_loss_ratio`` -- two-level's training wall-clock to reach ``mics-auto``'s final held-out loss,
  over ``mics-auto``'s wall-clock for its budget;
* ``time_to_flat_diloco_ratio`` -- two-level's time to that loss over flat DiLoCo's;
* ``final_loss_ratio`` -- two-level's final held-out loss over ``mics-auto``'s.

Both DiLoCo rows run at the H the library's planner names for the measured cluster *with its regions*
(:func:`regions_planner_answer`): the calibration ``mics-auto``'s strategy ran at set-up, the compute rate its
micro-steps achieved, and the region links the orchestrator measured; flat DiLoCo's H from the search with every
partition group its own worker, two-level's with the workers a region's (``TrainingSpec.diloco_worker_size``), as
:func:`lightning_mics.planner.plan` searches them.

Here: the rows and defaults of the mode, the planner per mode, the rows it resolves to, and the report
(:func:`build_regions_report`, ``convergence_regions.json``). Pure: no processes, no namespaces.
"""

from __future__ import annotations

import statistics
from dataclasses import asdict, replace
from typing import Any, Optional

from benchmarks.convergence_analysis import achieved_flops, build_convergence_report, planner_answer
from benchmarks.convergence_setup import PLANNED_ROW, REFERENCE
from benchmarks.scenarios import ClusterShape, StrategySpec, diloco_spec, two_level_spec

#: In ``--strategies``: two-level DiLoCo at the planner's H (resolved like :data:`PLANNED_ROW`, flat DiLoCo's).
TWO_LEVEL_ROW = "mics-diloco-two-level-planned"
#: The rows the planner resolves after the first ``mics-auto`` run, and the search each one's H comes from.
PLANNED_ROWS = {PLANNED_ROW: "flat", TWO_LEVEL_ROW: "two_level"}
REGION_CONVERGENCE_STRATEGIES = (REFERENCE, PLANNED_ROW, TWO_LEVEL_ROW)
#: Node links 1/24 of loopback, region links 1/240 (the issue's cluster): a zone's network on which a hop 2 at every
#: step between the nodes of a region costs less than the step's compute, as the planner prices it, and a link between
#: regions ten times slower than it.
REGION_CONVERGENCE_RATIOS = (24.0,)
DEFAULT_REGION_BANDWIDTH_RATIO = 240.0
#: Two nodes per region unless --nodes says otherwise.
NODES_PER_REGION = 2
#: Each rank trains the one-region mode's micro-batch (4 sequences of 8 tokens): 4 nodes of two ranks make a step of
#: 1,024 tokens, so the budget is 128 steps for the one-region mode's 131,072 tokens. (At a micro-batch of 2 the
#: planner prices the compute of a step at about what the hop 2 inside a region costs on the 1/24 link, and it names
#: two-level DiLoCo only its largest H.)
REGION_CONVERGENCE_MICRO_BATCH = 4
REGION_CONVERGENCE_STEPS = 128
#: --smoke: node links 1/6 of loopback and a micro-batch of 2, so that the planner's H -- and with it a DiLoCo row's
#: budget of whole rounds -- stays small and the main path runs in about a minute (the smoke measures nothing).
SMOKE_REGION_CONVERGENCE_RATIOS = (6.0,)
SMOKE_REGION_CONVERGENCE_MICRO_BATCH = 2
REPORT_NAME = "convergence_regions"
#: Two-level DiLoCo's targets: the means over the seeds.
REGION_TARGETS = {
    "time_to_sync_final_loss_ratio": 0.5,
    "time_to_flat_diloco_ratio": 0.8,
    "final_loss_ratio": 1.02,
}
REGION_DEFINITIONS = {
    "time_to_sync_final_loss_ratio": "two-level DiLoCo's training wall-clock at its first evaluation point whose "
                                     "held-out loss is at or below mics-auto's final one (same seed), over "
                                     "mics-auto's wall-clock for its whole budget (the `--convergence` definition); "
                                     "the top-level value is the mean over the seeds, null if a seed never reaches it",
    "time_to_flat_diloco_ratio": "two-level DiLoCo's time to mics-auto's final held-out loss over flat DiLoCo's time "
                                 "to the same loss (same seed; both at the planner's H); null where flat DiLoCo "
                                 "never reaches it",
    "final_loss_ratio": "two-level DiLoCo's held-out loss at the end of its budget over mics-auto's (same seed)",
    "bytes_per_level": "per row, the bytes between nodes of one region (every node uplink's bytes less the region "
                       "links') and across the region links, measured from the start barrier to the end barrier, "
                       "against the byte model (lightning_mics.schedule through benchmarks/comm_model.py: for a "
                       "two-level row a hop 2 every step across a worker's partition groups, the outer round every "
                       "H steps across the workers); `error` = measured / model - 1, target within 10 %",
}


# ------------------------------------------------------------------------------------------------ planner
def regions_planner_cluster(calibrated: dict[str, Any], nodes_per_region: int, node_link_bytes_per_s: float,
                            region_link_bytes_per_s: float) -> dict[str, Any]:
    """The :class:`~lightning_mics.planner.ClusterSpec` fields of the measured cluster with its regions.

    ``calibrated`` is what ``mics-auto``'s strategy measured at set-up. Its inter-node probes run one ring per local
    rank through every node, so on a cluster with regions they cross the region links and measure the slower of the
    two rates; the node links' own bandwidth is that value scaled by the measured node link over the measured region
    link (the same efficiency of gloo on both). ``region_bandwidth`` is the measured region link; its latency the
    calibrated inter-node one (tbf adds no delay)."""
    scale = max(1.0, node_link_bytes_per_s / region_link_bytes_per_s)
    return {**calibrated, "inter_node_bandwidth": calibrated["inter_node_bandwidth"] * scale,
            "nodes_per_region": nodes_per_region, "region_bandwidth": float(region_link_bytes_per_s),
            "region_latency": calibrated.get("inter_node_latency", 1e-3)}


def mode_sync_every(cluster: Any, model: Any, training: Any, worker: Any) -> Optional[dict[str, Any]]:
    """The smallest H of the planner's list that keeps the ranks busy enough with DiLoCo workers of ``worker``
    partition groups (``"region"`` or 1) and beats the synchronous plan -- the rule of the library's semi-synchronous
    advice (``lightning_mics.planner.search``), for one worker size; ``None`` when no H does, when the synchronous
    plan already keeps the ranks busy, or when no layout tiles such workers."""
    from lightning_mics.planner import plan
    from lightning_mics.planner.report import BUSY_ENOUGH
    from lightning_mics.planner.search import ADVISED_SYNC_EVERY

    synchronous = plan(cluster, model, training, grad_accumulation="auto").winner
    if synchronous.fits and synchronous.busy_fraction >= BUSY_ENOUGH:
        return None
    for every in ADVISED_SYNC_EVERY:
        try:
            semi = plan(cluster, model, replace(training, sync_every=every, diloco_worker_size=worker),
                        grad_accumulation="auto").winner
        except ValueError:
            return None
        if semi.layout.grads == semi.layout.world_size:
            return None
        if semi.fits and semi.busy_fraction >= BUSY_ENOUGH and semi.step_time_s < synchronous.step_time_s:
            return {"sync_every": every, "layout": semi.name, "step_s": semi.step_time_s,
                    "busy_fraction": semi.busy_fraction, "diloco_worker_size": semi.diloco_worker_size,
                    "inter_node_bytes": semi.inter_node_bytes}
    return None


def regions_planner_answer(record: dict[str, Any], setup: Any, nodes_per_region: int, node_link_bytes_per_s: float,
                           region_link_bytes_per_s: float) -> Optional[dict[str, Any]]:
    """The planner's answer for a ``mics-auto`` run on a cluster with regions: the library's advice
    (:func:`~benchmarks.convergence_analysis.planner_answer` on the cluster with its regions) and each mode's H
    (``modes``: ``flat`` -- every partition group its own worker --, ``two_level`` -- the workers a region's).
    ``sync_every`` is two-level's. ``None`` for a run that failed or recorded no measurement."""
    from examples.models import GPTConfig
    from lightning_mics.planner import ClusterSpec, TrainingSpec

    calibrated = record.get("planner_cluster_spec")
    if record.get("status") != "ok" or not calibrated:
        return None
    model = setup.model
    flops = achieved_flops(record.get("compute_micro_step_s"), model.flops_per_token, setup.micro_batch, model.seq_len)
    fields = regions_planner_cluster(calibrated, nodes_per_region, node_link_bytes_per_s, region_link_bytes_per_s)
    answer = planner_answer(fields, asdict(model), setup.micro_batch, setup.accumulate, record["device_memory_bytes"],
                            flops)
    cluster = ClusterSpec(**answer["inputs"]["cluster"])
    model_spec = GPTConfig(**asdict(model)).model_spec(name="benchmark GPT")
    training = TrainingSpec(micro_batch=setup.micro_batch, accumulation=setup.accumulate, precision="32-true")
    modes = {"flat": mode_sync_every(cluster, model_spec, training, 1),
             "two_level": mode_sync_every(cluster, model_spec, training, "region")}
    answer["advice_sync_every"] = answer["sync_every"]  # the library's own advice (two-level first)
    answer["modes"] = modes
    answer["sync_every"] = (modes["two_level"] or {}).get("sync_every")
    answer["inputs"]["regions"] = {
        "nodes_per_region": nodes_per_region, "node_link_measured_bytes_per_s": node_link_bytes_per_s,
        "region_link_measured_bytes_per_s": region_link_bytes_per_s,
        "calibrated_inter_node_bandwidth": calibrated["inter_node_bandwidth"],
        "basis": "inter_node_bandwidth: the calibration's (its rings cross the region links) times the measured node "
                 "link over the measured region link; region_bandwidth: the measured region link (one TCP stream)",
    }
    return answer


def resolve_region_rows(answer: dict[str, Any], requested: list[str], shape: ClusterShape, ranks_per_region: int,
                        outer_lr: Optional[float]) -> list[tuple[str, Optional[StrategySpec]]]:
    """Each requested placeholder row (:data:`PLANNED_ROWS`) with the spec of its mode's H: flat DiLoCo
    ``mics-diloco-h<H>``, two-level ``mics-diloco-two-level-h<H>``; ``None`` where the planner names no H."""
    out: list[tuple[str, Optional[StrategySpec]]] = []
    for placeholder in requested:
        mode = (answer.get("modes") or {}).get(PLANNED_ROWS[placeholder])
        if mode is None:
            out.append((placeholder, None))
        elif placeholder == PLANNED_ROW:
            every = int(mode["sync_every"])
            out.append((placeholder, diloco_spec(shape, every, outer_lr, name=f"mics-diloco-h{every}")))
        else:
            out.append((placeholder, two_level_spec(shape, int(mode["sync_every"]), ranks_per_region, outer_lr)))
    return out


def planner_digest(answer: Optional[dict[str, Any]]) -> dict[str, Any]:
    """One seed's planner answer in brief: each mode's H."""
    if answer is None:
        return {"sync_every": None}
    return {"sync_every": answer["sync_every"], "advice_sync_every": answer["advice_sync_every"],
            **{f"{mode}_sync_every": (value or {}).get("sync_every") for mode, value in answer["modes"].items()}}


# ------------------------------------------------------------------------------------------------ analysis
def _mean(values: list[Optional[float]]) -> Optional[float]:
    return statistics.mean(values) if values and all(v is not None for v in values) else None  # type: ignore[arg-type]


def region_ratios(comparison: list[dict[str, Any]], flat: Optional[str], two_level: Optional[str]) -> dict[str, Any]:
    """Per seed (from :func:`~benchmarks.convergence_analysis.compare_seed`'s rows), two-level's three ratios
    (:data:`REGION_DEFINITIONS`), and their means over the seeds; a mean is ``None`` unless every seed has a value."""
    by_seed: dict[Any, dict[str, dict[str, Any]]] = {}
    for row in comparison:
        by_seed.setdefault(row.get("seed"), {})[row["strategy"]] = row
    seeds = []
    for seed, rows in by_seed.items():
        two, other = rows.get(two_level or ""), rows.get(flat or "")
        ok = two is not None and two.get("status") == "ok"
        reach = two.get("time_to_reference_loss_s") if ok else None
        flat_reach = other.get("time_to_reference_loss_s") if other and other.get("status") == "ok" else None
        seeds.append({
            "seed": seed,
            "time_to_sync_final_loss_ratio": two.get("time_to_sync_final_loss_ratio") if ok else None,
            "time_to_flat_diloco_ratio": reach / flat_reach if reach is not None and flat_reach else None,
            "final_loss_ratio": two.get("final_loss_ratio") if ok else None,
        })
    means = {key: _mean([s[key] for s in seeds]) for key in REGION_TARGETS}
    met = {key: means[key] is not None and means[key] <= limit for key, limit in REGION_TARGETS.items()}
    return {**means, "seeds": seeds, "targets": REGION_TARGETS, "targets_met": met}


def level_summary(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Every run's bytes per level against the model (``bytes_per_level``, :func:`~benchmarks.emulated_analysis.
    level_bytes`), one entry per run."""
    return [{"strategy": r["strategy"], "seed": r.get("seed"), "sync_every": r.get("sync_every"),
             "diloco_worker_size": r.get("diloco_worker_size"), **r["bytes_per_level"]}
            for r in runs if r.get("status") == "ok" and "bytes_per_level" in r]


def build_regions_report(points: list[dict[str, Any]], command: str, settings: dict[str, Any]) -> dict[str, Any]:
    """``convergence_regions.json``: the ``--convergence`` report of the run (every point's analysis; its ``planner``
    row is two-level's, so ``headline`` and ``spread`` are two-level's), with the headline point's three two-level
    ratios at the top (:func:`region_ratios`), the H each mode ran at, and the bytes per level against the model."""
    report = build_convergence_report(points, command, settings)
    first = points[0]
    planner = first.get("planner") or {}
    rows = planner.get("rows") or {}
    ratios = region_ratios(first["comparison"], rows.get("flat"), rows.get("two_level"))
    levels = level_summary(first["runs"])
    report.update({
        "definitions": {**report["definitions"], **REGION_DEFINITIONS},
        **{key: ratios[key] for key in REGION_TARGETS},
        "seeds": ratios["seeds"],
        "targets": ratios["targets"],
        "targets_met": ratios["targets_met"],
        "regions": first.get("regions"),
        "rows_by_mode": {"synchronous": REFERENCE, **rows},
        "sync_every": {"flat": planner.get("flat_sync_every"), "two_level": planner.get("two_level_sync_every")},
        "bytes_per_level": levels,
        "bytes_per_level_within_target": bool(levels) and all(entry["within_target"] for entry in levels),
    })
    return report
