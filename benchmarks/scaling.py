"""Weak scaling on the emulated cluster: the report, table and chart of ``emulated_cluster.py --scaling``.

The orchestrator runs the same strategies with the same per-rank micro-batch and accumulation at
every node count (2 ranks per node by default) and hands each point's report -- the
``emulated_cluster.json`` schema -- to :func:`build_scaling_report`, which adds one flat row per
(nodes, strategy): step time, tokens/s (all ranks and per node), inter-node bytes per node per step
(measured, and :mod:`benchmarks.comm_model`'s expectation), the wire floor and the planner's
prediction. Pure functions, no processes: the tests drive them with synthetic reports.

Why per node: the MiCS paper's scaling claim is about what each node's link must carry as nodes are
added. With gloo's ring all-reduce that is ``2 (N - 1) / N`` of a node's gradient shard for MiCS's
boundary all-reduce across N replicas (bounded by twice the shard), while ZeRO-3's rings over the
whole world carry ``(n - 1) / n`` of every gathered and scattered unit, per micro-step.
"""

from __future__ import annotations

import sys
import textwrap
from pathlib import Path
from typing import Any, Optional

from benchmarks import compare_planner

#: The rows a scaling run compares (names of :func:`benchmarks.scenarios.default_strategies`).
SCALING_STRATEGIES = ("mics", "mics-auto", "fsdp-hybrid", "ddp", "zero3")
DEFAULT_SCALING_NODES = (2, 3, 4)
SCALING_RANKS_PER_NODE = 2


def parse_node_list(text: str) -> tuple[int, ...]:
    """``"2,3,4"`` -> ``(2, 3, 4)``: distinct node counts >= 2, ascending (the first sets the link rate)."""
    try:
        counts = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        counts = []
    if not counts or any(n < 2 for n in counts) or len(set(counts)) != len(counts):
        raise ValueError(
            f"--scaling-nodes takes distinct comma-separated node counts >= 2, e.g. 2,3,4; got {text!r}."
        )
    return tuple(sorted(counts))


def link_rate(network: dict[str, Any]) -> float:
    """Bytes/s of one direction of a node link: what one TCP stream measured across the shaped link,
    else the configured tbf rate (the measurement is what payload actually gets)."""
    measured = network.get("inter_node_measured_bytes_per_s")
    return float(measured if measured else network["inter_node_rate_bytes_per_s"])


def point_predictions(report: dict[str, Any]) -> dict[str, Any]:
    """The planner's prediction for every row of one point, from the point's own measured links and
    the ``mics-auto`` row's live-calibrated latencies, in two flavours of compute rate per rank:

    * ``fitted`` -- compare_planner's ``--fit-compute``: one rate for all rows of the point (the
      host's cores are shared by more ranks as nodes are added, so it is the point's, like its
      loopback rate); the comparison the documentation reports at 2 nodes;
    * ``calibrated`` -- the rate the live planner measured at set-up (fitted to nothing).

    A flavour that cannot be computed carries ``error`` instead: the measurements are kept."""
    return {
        "fitted": _predictions(report, compare_planner.build_parser().parse_args(["--fit-compute"])),
        "calibrated": _predictions(report, _calibrated_args(report)),
    }


def _calibrated_args(report: dict[str, Any]) -> Optional[Any]:
    if compare_planner.measured_compute(report) is None:
        return None
    return compare_planner.build_parser().parse_args(["--calibrated-compute"])


def _predictions(report: dict[str, Any], args: Optional[Any]) -> dict[str, Any]:
    if args is None:
        return {"error": "no mics-auto row recorded a live calibration of the compute rate", "rows": {}}
    try:
        rows, cluster = compare_planner.compare(report, args)
    except (compare_planner.MissingInput, ValueError, KeyError) as error:  # keep the point's measurements
        return {"error": f"{type(error).__name__}: {error}", "rows": {}}
    return {"compute_flops": cluster.compute_flops, "rows": {r["strategy"]: r for r in rows if r["status"] == "ok"}}


def scaling_rows(reports: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One flat row per (nodes, strategy) of the points' reports, in point order."""
    rows = []
    for report in reports:
        nodes = int(report["cluster"]["num_nodes"])
        predictions = report.get("planner_predictions") or {}
        fitted = (predictions.get("fitted") or {}).get("rows", {})
        calibrated = (predictions.get("calibrated") or {}).get("rows", {})
        for r in report["results"]:
            row: dict[str, Any] = {"nodes": nodes, "strategy": r["strategy"], "status": r.get("status")}
            expected = r.get("expected_inter_node_bytes_per_step")
            row["expected_inter_node_bytes_per_node_per_step"] = None if expected is None else expected / nodes
            if r.get("status") == "ok":
                row.update(_measured(r, nodes))
                row.update(_predicted(fitted.get(r["strategy"]), r["step_time_s"], ""))
                row.update(_predicted(calibrated.get(r["strategy"]), r["step_time_s"], "_calibrated"))
            rows.append(row)
    return rows


def _measured(record: dict[str, Any], nodes: int) -> dict[str, Any]:
    """The measured columns of a successful row (inter-node bytes: the sum of every node's tx, per node)."""
    return {
        "layout": {k: record.get(k) for k in ("partition_size", "params_degree", "optim_degree", "grad_accumulation")},
        "step_time_s": record["step_time_s"],
        "tokens_per_s": record["tokens_per_s"],
        "tokens_per_s_per_node": record["tokens_per_s"] / nodes,
        "inter_node_bytes_per_node_per_step": record["inter_node_bytes_per_step"] / nodes,
        "wire_floor_s": record.get("wire_floor_s"),
        "step_over_floor": record.get("step_over_floor"),
    }


def _predicted(prediction: Optional[dict[str, Any]], measured_s: float, suffix: str) -> dict[str, Any]:
    """The planner's columns of one row (``suffix``: ``""`` for the fitted compute rate, ``"_calibrated"``)."""
    predicted = None if prediction is None else prediction["predicted_step_time_s"]
    return {
        f"predicted_step_time{suffix}_s": predicted,
        f"prediction_error{suffix}": None if predicted is None else predicted / measured_s - 1,
        f"predicted_inter_node_bytes_per_node{suffix}": (
            None if prediction is None else prediction.get("predicted_inter_node_bytes_per_node")
        ),
    }


def build_scaling_report(reports: list[dict[str, Any]], command: str) -> dict[str, Any]:
    """``scaling.json``: the flat rows, and every point's full report (which compare_planner.py reads)."""
    first = reports[0]
    setup = {k: v for k, v in first["setup"].items() if k != "tokens_per_step"}  # grows with the nodes
    return {
        "command": command,
        "nodes": [int(r["cluster"]["num_nodes"]) for r in reports],
        "ranks_per_node": int(first["cluster"]["ranks_per_node"]),
        "strategies": [r["strategy"] for r in first["results"]],
        "setup": setup,
        "inter_node_rate_bytes_per_s": first["network"]["inter_node_rate_bytes_per_s"],
        "rows": scaling_rows(reports),
        "points": reports,
    }


def format_scaling_table(rows: list[dict[str, Any]], markdown: bool = False) -> str:
    """The rows as a text (or Markdown) table."""
    header = ["nodes", "strategy", "step s", "tokens/s", "tokens/s/node", "inter MB/node", "expected",
              "floor s", "step/floor", "pred. s (fit)", "error", "pred. s (cal.)", "error"]
    table = [header]
    for r in rows:
        if r["status"] != "ok":
            table.append([str(r["nodes"]), r["strategy"], str(r["status"])[:40], *["-"] * 3,
                          _mb(r.get("expected_inter_node_bytes_per_node_per_step")), *["-"] * 6])
            continue
        table.append([
            str(r["nodes"]), r["strategy"], f"{r['step_time_s']:.2f}", f"{r['tokens_per_s']:,.0f}",
            f"{r['tokens_per_s_per_node']:,.1f}", _mb(r["inter_node_bytes_per_node_per_step"]),
            _mb(r["expected_inter_node_bytes_per_node_per_step"]), _fmt(r.get("wire_floor_s"), "{:.2f}"),
            _fmt(r.get("step_over_floor"), "{:.2f}x"),
            _fmt(r.get("predicted_step_time_s"), "{:.2f}"), _percent(r.get("prediction_error")),
            _fmt(r.get("predicted_step_time_calibrated_s"), "{:.2f}"), _percent(r.get("prediction_error_calibrated")),
        ])
    if markdown:
        return "\n".join(["| " + " | ".join(header) + " |", "|" + "|".join("---:" for _ in header) + "|",
                          *("| " + " | ".join(row) + " |" for row in table[1:])])
    widths = [max(len(row[i]) for row in table) for i in range(len(header))]
    lines = ["  ".join(c.rjust(w) if i != 1 else c.ljust(w) for i, (c, w) in enumerate(zip(row, widths)))
             for row in table]
    return "\n".join([lines[0], "-" * len(lines[0]), *lines[1:]])


def _mb(value: Optional[float]) -> str:
    return "-" if value is None else f"{value / 1e6:,.1f}"


def _percent(value: Optional[float]) -> str:
    return "-" if value is None else f"{value * 100:+.0f}%"


def _fmt(value: Optional[float], pattern: str) -> str:
    return "-" if value is None else pattern.format(value)


def series(rows: list[dict[str, Any]], key: str) -> dict[str, tuple[list[int], list[float]]]:
    """Per strategy, the node counts and ``key``'s values of its successful rows (what one line plots)."""
    lines: dict[str, tuple[list[int], list[float]]] = {}
    for r in rows:
        if r["status"] == "ok" and r.get(key) is not None:
            xs, ys = lines.setdefault(r["strategy"], ([], []))
            xs.append(r["nodes"])
            ys.append(r[key])
    return lines


def draw_scaling(scaling: dict[str, Any], path: Path) -> Optional[Path]:
    """Two panels against the node count, one line per strategy: tokens/s per node (flat = perfect weak
    scaling) and inter-node MB per node per step (measured solid, comm_model's expectation dotted)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        import matplotlib.ticker
    except ImportError:
        print("matplotlib is missing, so no chart: `pip install -e '.[bench]'`", file=sys.stderr)
        return None
    rows = scaling["rows"]
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.5))
    colors = dict(zip(scaling["strategies"], plt.rcParams["axes.prop_cycle"].by_key()["color"] * 3))
    for name, (xs, ys) in series(rows, "tokens_per_s_per_node").items():
        left.plot(xs, ys, marker="o", label=name, color=colors.get(name))
    for name, (xs, ys) in series(rows, "inter_node_bytes_per_node_per_step").items():
        right.plot(xs, [y / 1e6 for y in ys], marker="o", label=name, color=colors.get(name))
    for name, (xs, ys) in series(rows, "expected_inter_node_bytes_per_node_per_step").items():
        right.plot(xs, [y / 1e6 for y in ys], linestyle=":", color=colors.get(name))
    left.set_ylabel("tokens/s per node")
    right.set_ylabel("inter-node MB per node per step")
    right.set_yscale("log")
    for which in (right.yaxis.set_major_formatter, right.yaxis.set_minor_formatter):  # 600, not 6x10^2
        which(matplotlib.ticker.FuncFormatter(lambda v, _: f"{v:g}"))
    right.plot([], [], color="gray", label="measured (uplink tx counters)")
    right.plot([], [], color="gray", linestyle=":", label="analytic (comm_model)")
    right.legend(fontsize=8)
    for axis in (left, right):
        axis.set_xlabel(f"nodes ({scaling['ranks_per_node']} ranks each, same per-rank batch)")
        axis.set_xticks(scaling["nodes"])
        axis.grid(alpha=0.3)
    left.legend(fontsize=8)
    rate = scaling["inter_node_rate_bytes_per_s"]
    fig.suptitle(textwrap.fill(f"Weak scaling on the emulated cluster, inter-node link {rate / 1e6:,.0f} MB/s "
                               f"per direction: {scaling['command']}", 120), fontsize=9)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
