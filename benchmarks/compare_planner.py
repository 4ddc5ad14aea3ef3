"""Planner predictions against the emulated-cluster benchmark's measurements.

    /work/venv/bin/python benchmarks/compare_planner.py [--results benchmarks/results/emulated_cluster.json]
        [--compute-flops 2e9] [--latency 100us] [--overlap 0] [--markdown]
    /work/venv/bin/python benchmarks/compare_planner.py --results benchmarks/results/scaling/scaling.json
        [--fit-compute]

Reads the benchmark's JSON (``network``, ``cluster``, ``setup`` and ``results``), describes the
emulated cluster to :mod:`lightning_mics.planner` and prints, for every strategy, the predicted
and measured optimizer-step time (target: within +-20 %) and the bytes crossing node links.

What is taken from the JSON:

* links -- intra-node: ``network.loopback_per_node_bytes_per_s / ranks_per_node`` (each rank's
  loopback stream while all stream); inter-node: ``network.inter_node_measured_bytes_per_s``
  (falling back to ``inter_node_rate_bytes_per_s``);
* model and batch -- ``setup.model`` (a GPTConfig), ``setup.micro_batch``, ``setup.accumulate``,
  ``setup.model_params``; precision ``32-true`` unless ``setup.precision`` says otherwise;
* compute -- ``setup.compute_flops_per_rank`` (or ``network.compute_flops_per_rank``) when the
  benchmark recorded it, else ``--compute-flops`` (or ``--fit-compute``), else with
  ``--calibrated-compute`` the rate the ``mics-auto`` rows' live calibration measured
  (:func:`measured_compute`; the scaling report's "calibrated" prediction); the link latency --
  ``network.intra_node_latency_s``
  / ``inter_node_latency_s`` when recorded, else the latencies that the ``mics-auto`` rows' live
  calibration measured on the same cluster in the same run (:func:`lightning_mics.planner.calibrate_cluster`,
  the slowest of those rows), else ``--latency``.

A ``--scaling`` report (``scaling.json``: one such report per node count under ``points``) is compared
point by point (:func:`compare_scaling`): every (nodes, strategy) gets its prediction and error, and
``--fit-compute`` fits one compute rate per node count (the host's cores are shared by more ranks
as nodes are added, so a rank's compute rate is a property of the point, like its loopback rate).

CPU ranks share cores with gloo's communication threads, so overlap defaults to 0.
FSDP1 rows (``family == "fsdp1"``) are modelled with one reduce-scatter per optimizer step
(Lightning's ``no_sync`` keeps FSDP1 gradients unsharded between boundaries), and that
reduce-scatter is gloo's own, an all-reduce of the whole buffer (MiCS rows use our ring).
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any, Optional

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from lightning_mics.planner import (  # noqa: E402
    ClusterSpec,
    LayoutEstimate,
    ModelSpec,
    ShardingSpec,
    TrainingSpec,
    estimate,
    parse_flops,
    parse_seconds,
    plan,
)
from lightning_mics.wire import WIRE_FORMATS  # noqa: E402

DEFAULT_RESULTS = Path(__file__).resolve().parent / "results" / "emulated_cluster.json"
TARGET = 0.20


class MissingInput(RuntimeError):
    """The JSON (or the command line) lacks something the model needs."""


def load_report(path: Path) -> dict[str, Any]:
    """The benchmark's JSON: one run's report, or a ``--scaling`` report (its ``points`` are checked)."""
    if not path.exists():
        raise MissingInput(
            f"{path} does not exist yet. Run the emulated-cluster benchmark first "
            "(sudo /work/venv/bin/python benchmarks/emulated_cluster.py [--quick] [--scaling]), "
            "or pass --results PATH."
        )
    report = json.loads(path.read_text())
    for point in report["points"] if "points" in report else [report]:
        for key in ("network", "cluster", "setup", "results"):
            if key not in point:
                raise MissingInput(
                    f"{path} has no '{key}' section; it was not written by benchmarks/emulated_cluster.py."
                )
    return report


def _first(*values: Optional[float]) -> Optional[float]:
    return next((v for v in values if v is not None), None)


def measured_latency(report: dict[str, Any], scope: str) -> Optional[float]:
    """The per-ring-step latency (``scope``: ``"intra_node"`` / ``"inter_node"``) that the planned
    rows' live calibration measured in this run (the largest, as the slowest rank sets a ring's
    pace), or ``None`` when no planned row recorded one."""
    values = [
        r["planner_cluster_spec"][f"{scope}_latency"]
        for r in report["results"]
        if r.get("status") == "ok" and r.get("planner_cluster_spec")
    ]
    return max(values) if values else None


def measured_compute(report: dict[str, Any]) -> Optional[float]:
    """The compute rate per rank that the planned rows' live calibration measured in this run (the
    slowest, as the slowest rank sets a step's pace), or ``None`` when no planned row recorded one."""
    values = [
        r["planner_cluster_spec"]["compute_flops"]
        for r in report["results"]
        if r.get("status") == "ok" and (r.get("planner_cluster_spec") or {}).get("compute_flops")
    ]
    return min(values) if values else None


def cluster_from_report(report: dict[str, Any], args: argparse.Namespace) -> ClusterSpec:
    network, shape, setup = report["network"], report["cluster"], report["setup"]
    ranks_per_node = int(shape["ranks_per_node"])
    calibrated = measured_compute(report) if getattr(args, "calibrated_compute", False) else None
    compute = _first(setup.get("compute_flops_per_rank"), network.get("compute_flops_per_rank"), args.compute_flops,
                     calibrated)
    if compute is None:
        raise MissingInput(
            "The benchmark JSON records no compute rate (setup.compute_flops_per_rank) -- pass --compute-flops "
            "(achieved FLOP/s of one rank while all ranks of a node compute, e.g. 2e9), or --fit-compute, or "
            "--calibrated-compute (needs an ok mics-auto row)."
        )
    intra_latency = _first(network.get("intra_node_latency_s"), measured_latency(report, "intra_node"), args.latency)
    inter_latency = _first(network.get("inter_node_latency_s"), measured_latency(report, "inter_node"), args.latency)
    return ClusterSpec(
        nodes=int(shape["num_nodes"]),
        gpus_per_node=ranks_per_node,
        gpu_memory_bytes=float(1 << 50),  # host memory: every layout fits
        intra_node_bandwidth=network["loopback_per_node_bytes_per_s"] / ranks_per_node,
        inter_node_bandwidth=_first(
            network.get("inter_node_measured_bytes_per_s"), network["inter_node_rate_bytes_per_s"]
        ),
        compute_flops=compute,
        intra_node_latency=intra_latency,
        inter_node_latency=inter_latency,
        memory_bandwidth=10e9,
        overlap=args.overlap,
        hop2_overlap=args.hop2_overlap,
        name="emulated",
    )


def model_from_report(report: dict[str, Any]) -> tuple[ModelSpec, TrainingSpec]:
    from examples.models import GPTConfig

    setup = report["setup"]
    config = GPTConfig.resolve(setup["model"])
    model = config.model_spec(params=int(setup.get("model_params", config.num_params)), name="emulated GPT")
    training = TrainingSpec(
        micro_batch=int(setup["micro_batch"]),
        accumulation=int(setup["accumulate"]),
        precision=setup.get("precision", "32-true"),
    )
    return model, training


def predict(record: dict[str, Any], cluster: ClusterSpec, model: ModelSpec, training: TrainingSpec) -> LayoutEstimate:
    partition = int(record["partition_size"])
    fsdp1 = record.get("family", "mics") == "fsdp1"
    params_degree, optim_degree = record.get("params_degree"), record.get("optim_degree")
    # hop 2 behind backward: MiCS rows since issue 24 (rows recorded before carry no flag: they ran without),
    # and DDP's bucketed all-reduce (the same layout to the model: P = G = OS = 1); FSDP1's blocks
    overlapped = record.get("cross_replica_overlap", False) or record.get("family") == "ddp"
    training = replace(training, cross_replica_overlap=bool(overlapped))
    return estimate(
        ShardingSpec(params_degree or partition, partition, optim_degree or partition),
        replace(cluster, reduce_scatter_algorithm="all_reduce") if fsdp1 else cluster,
        model,
        training,
        hierarchical=bool(record.get("hierarchical")),
        grad_accumulation="unsharded" if fsdp1 else record.get("grad_accumulation", "sharded"),
        cross_replica_bytes=(
            WIRE_FORMATS[record["cross_replica_dtype"]].element_bytes if record.get("cross_replica_dtype") else None
        ),
    )


def fit_compute(report: dict[str, Any], args: argparse.Namespace, model: ModelSpec, training: TrainingSpec) -> float:
    """The one compute rate shared by all rows that minimises the worst relative step-time error
    (a calibration, like measuring bandwidth: it says nothing about how the rows differ)."""
    rows = [r for r in report["results"] if r.get("status") == "ok" and r.get("family") != "deepspeed"]
    best: tuple[float, float] = (float("inf"), 0.0)
    for exponent in range(0, 401):
        flops = 10 ** (6 + exponent / 50)  # 1e6 .. 1e14 FLOP/s, 2 % steps
        args.compute_flops = flops
        cluster = cluster_from_report(report, args)
        worst = max(abs(predict(r, cluster, model, training).step_time_s / r["step_time_s"] - 1) for r in rows)
        best = min(best, (worst, flops))
    return best[1]


def compare(report: dict[str, Any], args: argparse.Namespace) -> tuple[list[dict[str, Any]], ClusterSpec]:
    model, training = model_from_report(report)
    if args.fit_compute:
        args.compute_flops = fit_compute(report, args, model, training)
    cluster = cluster_from_report(report, args)
    rows = []
    for record in report["results"]:
        if record.get("status") != "ok":
            rows.append({"strategy": record.get("strategy"), "status": record.get("status")})
            continue
        if record.get("family") == "deepspeed":  # another engine's schedule and overheads: not the planner's
            rows.append({"strategy": record["strategy"], "status": "not modelled (DeepSpeed)"})
            continue
        predicted = predict(record, cluster, model, training)
        measured = record["step_time_s"]
        rows.append(
            {
                "strategy": record["strategy"],
                "status": "ok",
                "partition_size": record["partition_size"],
                "predicted_step_time_s": predicted.step_time_s,
                "measured_step_time_s": measured,
                "step_time_error": predicted.step_time_s / measured - 1,
                # the benchmark sums the uplink counters over nodes; the planner reports per node
                "predicted_inter_node_bytes": predicted.inter_node_bytes * cluster.nodes,
                "predicted_inter_node_bytes_per_node": predicted.inter_node_bytes,
                "measured_inter_node_bytes": record.get("inter_node_bytes_per_step"),
                "predicted_exposed_comm_s": predicted.exposed_comm_s,
                "predicted_compute_s": predicted.compute_s,
            }
        )
    return rows, cluster


def compare_scaling(
    report: dict[str, Any], args: argparse.Namespace
) -> tuple[list[dict[str, Any]], list[ClusterSpec]]:
    """:func:`compare` at every point of a ``--scaling`` report: one row per (nodes, strategy), and
    each point's cluster. ``--fit-compute`` fits each point's compute rate on its own rows."""
    given, rows, clusters = args.compute_flops, [], []
    try:
        for point in report["points"]:
            args.compute_flops = given  # a fitted rate belongs to its point
            point_rows, cluster = compare(point, args)
            clusters.append(cluster)
            choice = planner_choice(point, cluster)
            for row in point_rows:
                rows.append({"nodes": cluster.nodes, **row, "compute_flops": cluster.compute_flops,
                             "planner_choice": choice["layout"]})
    finally:
        args.compute_flops = given
    return rows, clusters


def planner_choice(report: dict[str, Any], cluster: ClusterSpec) -> dict[str, Any]:
    """What ``MiCSStrategy(sharding="auto", grad_accumulation="auto")`` would pick on this cluster
    (with and without a bf16 cross-replica hop), and the measured row that runs that layout, if any."""
    model, training = model_from_report(report)
    candidates = [
        (plan(cluster, model, training, uniform_only=False, grad_accumulation="auto", cross_replica_bytes=wire).winner,
         None if wire is None else "bf16")
        for wire in (None, WIRE_FORMATS["bf16"].element_bytes)
    ]
    best, wire = min(candidates, key=lambda c: c[0].step_time_s)
    layout = best.layout
    measured = None
    for record in report["results"]:
        if record.get("status") != "ok" or record.get("family", "mics") != "mics":
            continue
        params = record.get("params_degree") or record["partition_size"]
        optim = record.get("optim_degree") or record["partition_size"]
        same = (params, record["partition_size"], optim) == (layout.params, layout.grads, layout.optim)
        mode = record.get("grad_accumulation", "sharded")
        if same and mode == best.grad_accumulation and record.get("cross_replica_dtype") == wire:
            if measured is None or record.get("planned"):  # the row the live planner chose, when there is one
                measured = record
    peers = [r for r in report["results"] if r.get("status") == "ok" and r.get("family") in ("fsdp1", "ddp")]
    best_peer = min(peers, key=lambda r: r["step_time_s"]) if peers else None
    return {
        "layout": f"{best.name}" + (f", cross_replica_dtype={wire}" if wire else ""),
        "predicted_step_time_s": best.step_time_s,
        "measured_row": measured["strategy"] if measured else None,
        "measured_step_time_s": measured["step_time_s"] if measured else None,
        "best_peer": best_peer["strategy"] if best_peer else None,
        "best_peer_step_time_s": best_peer["step_time_s"] if best_peer else None,
    }


def format_choice(choice: dict[str, Any]) -> str:
    line = f"planner's choice (sharding='auto', grad_accumulation='auto'): {choice['layout']}, predicted " \
           f"{choice['predicted_step_time_s']:.3f} s"
    if choice["measured_row"] is None:
        return line + "; no measured row runs this layout."
    line += f"; measured as {choice['measured_row']}: {choice['measured_step_time_s']:.3f} s"
    if choice["best_peer"] is not None:
        ratio = choice["best_peer_step_time_s"] / choice["measured_step_time_s"]
        line += f"; best peer {choice['best_peer']} {choice['best_peer_step_time_s']:.3f} s -> speed ratio {ratio:.2f}"
    return line


def format_rows(rows: list[dict[str, Any]], markdown: bool) -> str:
    """The comparison table (text or Markdown); rows of a ``--scaling`` report get a ``nodes`` column."""
    scaling = any("nodes" in row for row in rows)
    header = ["strategy", "predicted step s", "measured step s", "error", "within 20%", "pred. inter-node MB",
              "meas. inter-node MB"]
    header = (["nodes"] if scaling else []) + header
    table = [header]
    for row in rows:
        lead = [str(row.get("nodes", "-"))] if scaling else []
        if row["status"] != "ok":
            table.append(lead + [str(row["strategy"]), "-", "-", "-", str(row["status"]), "-", "-"])
            continue
        measured_bytes = row["measured_inter_node_bytes"]
        table.append(
            lead
            + [
                row["strategy"],
                f"{row['predicted_step_time_s']:.3f}",
                f"{row['measured_step_time_s']:.3f}",
                f"{100 * row['step_time_error']:+.0f}%",
                "yes" if abs(row["step_time_error"]) <= TARGET else "no",
                f"{row['predicted_inter_node_bytes'] / 1e6:.1f}",
                "-" if measured_bytes is None else f"{measured_bytes / 1e6:.1f}",
            ]
        )
    if markdown:
        return "\n".join(["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|",
                          *("| " + " | ".join(r) + " |" for r in table[1:])])
    widths = [max(len(r[i]) for r in table) for i in range(len(header))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in table)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--results", type=Path, default=DEFAULT_RESULTS,
                        help="emulated_cluster.json, or a --scaling run's scaling.json")
    parser.add_argument("--compute-flops", type=parse_flops, help="achieved FLOP/s per rank, e.g. 2e9 or 2GFLOPS")
    parser.add_argument("--fit-compute", action="store_true",
                        help="fit one shared compute rate to the rows (of each node count, for a scaling report)")
    parser.add_argument("--calibrated-compute", action="store_true",
                        help="the compute rate the mics-auto rows' live calibration measured (fitted to nothing)")
    parser.add_argument("--latency", type=parse_seconds, default=parse_seconds("100us"),
                        help="per ring step, both scopes, when the JSON records none (default 100us: gloo over TCP)")
    parser.add_argument("--overlap", type=float, default=0.0, help="fraction of compute hiding communication (CPU: 0)")
    parser.add_argument(
        "--hop2-overlap", type=float, default=1.0,
        help="fraction of the boundary backward hiding a hop 2 started per unit (MiCS cross_replica_overlap, DDP's "
        "buckets): 1 on CPU, where gloo's threads move it while the rank computes",
    )
    parser.add_argument("--markdown", action="store_true")
    parser.add_argument("--json", action="store_true")
    return parser


def _compute_source(args: argparse.Namespace) -> str:
    if args.fit_compute:
        return " (fitted)"
    return " (live calibration)" if args.calibrated_compute and args.compute_flops is None else ""


def describe_cluster(cluster: ClusterSpec, report: dict[str, Any], args: argparse.Namespace) -> str:
    measured = measured_latency(report, "inter_node") is not None
    return (
        f"emulated cluster: {cluster.nodes} nodes x {cluster.gpus_per_node} ranks, intra "
        f"{cluster.intra_node_bandwidth / 1e6:,.0f} MB/s per rank, inter {cluster.inter_node_bandwidth / 1e6:,.0f} "
        f"MB/s per node, compute {cluster.compute_flops / 1e9:.2f} GFLOP/s per rank{_compute_source(args)}, "
        f"latency {cluster.intra_node_latency * 1e6:,.0f} / {cluster.inter_node_latency * 1e6:,.0f} us (intra / inter"
        f"{', measured by the planned rows' if measured else ''}), overlap {cluster.overlap:g}"
    )


def main_scaling(report: dict[str, Any], args: argparse.Namespace) -> int:
    """Predicted against measured at every (nodes, strategy) point of a ``--scaling`` report."""
    rows, clusters = compare_scaling(report, args)
    if args.json:
        print(json.dumps({"clusters": [c.__dict__ for c in clusters], "rows": rows}, indent=2))
        return 0
    for point, cluster in zip(report["points"], clusters):
        print(describe_cluster(cluster, point, args))
    print(format_rows(rows, args.markdown))
    ok = [r for r in rows if r["status"] == "ok"]
    within = sum(abs(r["step_time_error"]) <= TARGET for r in ok)
    print(f"\n{within}/{len(ok)} (nodes, strategy) points within +-{TARGET:.0%} of the measured step time.")
    return 0


def main(argv: Optional[list[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        report = load_report(args.results)
        if "points" in report:
            return main_scaling(report, args)
        rows, cluster = compare(report, args)
    except MissingInput as error:
        print(f"compare_planner: {error}", file=sys.stderr)
        return 2
    choice = planner_choice(report, cluster)
    if args.json:
        print(json.dumps({"cluster": cluster.__dict__, "rows": rows, "planner_choice": choice}, indent=2))
        return 0
    print(describe_cluster(cluster, report, args))
    print(format_rows(rows, args.markdown))
    ok = [r for r in rows if r["status"] == "ok"]
    within = sum(abs(r["step_time_error"]) <= TARGET for r in ok)
    print(f"\n{within}/{len(ok)} strategies within +-{TARGET:.0%} of the measured step time.")
    print(format_choice(choice))
    return 0


if __name__ == "__main__":
    sys.exit(main())
