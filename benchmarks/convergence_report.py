"""The tables, docs blocks and chart of a ``--convergence`` report (the one
:func:`benchmarks.convergence_analysis.build_convergence_report` builds): what ``emulated_cluster.py --convergence``
and ``convergence.py`` print (:func:`format_convergence_table`), the blocks ``benchmarks/figures.py`` renders into
docs/semi-sync.md (:func:`figure_markdown`; with ``--regions`` :func:`regions_figure_markdown`) and
``convergence.png`` (:func:`draw_convergence`). Formatting only:
the numbers are the report's, the chart's curves its records' (:func:`heldout_curve`).
"""

from __future__ import annotations

import statistics
import sys
import textwrap
from pathlib import Path
from typing import Any, Optional

from benchmarks.convergence_analysis import TARGETS, heldout_curve
from benchmarks.convergence_setup import REFERENCE

#: The chart's loss axis stops here: the first evaluations fall from ln(256) = 5.5 within a few thousand tokens,
#: and the differences that matter are near the floor.
LOSS_AXIS_TOP = 2.6


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
                statuses = ", ".join(dict.fromkeys(str(s["status"])[:40] for s in r["seeds"]))  # each once
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


#: What the docs' two-level block says before ``--convergence --regions 2`` has run.
REGIONS_NOT_MEASURED = (
    "**Not measured yet.** Run `sudo \"$(command -v python)\" benchmarks/emulated_cluster.py --convergence "
    "--regions 2` (it writes `convergence_regions.json` and `.png` beside the other results), then "
    "`python benchmarks/figures.py` to render its numbers here.\n"
)


def _links(regions: dict[str, Any], point: dict[str, Any], seeds: int) -> str:
    """A regions run's cluster, links and seed count, as its figure's first sentence opens."""
    return (f"{regions.get('regions')} regions of {regions.get('nodes_per_region')} nodes, node links "
            f"1/{point['bandwidth_ratio']:g} and region links 1/{regions.get('region_bandwidth_ratio', 0):g} of "
            f"loopback ({point['network']['inter_node_measured_bytes_per_s'] / 1e6:,.1f} and "
            f"{regions.get('region_measured_bytes_per_s', 0) / 1e6:,.2f} MB/s measured), {seeds} seeds")


def _mode_h(mode: str, every: Optional[int], row: Optional[str]) -> str:
    """One mode's H as the figure's sentence says it: the H and its row, or that the planner names none."""
    if every is None:
        return f"no H for {mode} (its row is skipped)"
    return f"{mode} H = {every} (`{row}`)"


def regions_figure_markdown(report: Optional[dict[str, Any]]) -> str:
    """The block ``benchmarks/figures.py`` renders into docs/semi-sync.md from ``convergence_regions.json``: the
    links and each mode's H, the table, two-level DiLoCo's three ratios against their targets, the bytes per level
    against the model, and the chart (:data:`REGIONS_NOT_MEASURED` without a report)."""
    if report is None:
        return REGIONS_NOT_MEASURED
    regions, point = report.get("regions") or {}, report["points"][0]
    every, rows = report.get("sync_every") or {}, report.get("rows_by_mode") or {}
    lines = [
        (f"{_links(regions, point, len(report.get('seeds', [])))}; the planner names "
         f"{_mode_h('flat DiLoCo', every.get('flat'), rows.get('flat'))} and "
         f"{_mode_h('two-level DiLoCo', every.get('two_level'), rows.get('two_level'))}."),
        "",
        format_convergence_table({"points": report["points"][:1]}, markdown=True),
        "",
        "| two-level DiLoCo, mean over the seeds | value | per seed | target | met |",
        "|---|---:|---:|---:|:-:|",
    ]
    for key, limit in (report.get("targets") or {}).items():
        per_seed = " / ".join(_fmt(s.get(key), "{:.3f}") for s in report.get("seeds", []))
        met = (report.get("targets_met") or {}).get(key)
        lines.append(f"| {key} | {_fmt(report.get(key), '{:.3f}')} | {per_seed} | <= {limit:g} | "
                     f"{'yes' if met else 'no'} |")
    levels = report.get("bytes_per_level") or []
    worst = {level: max((100 * abs(e[level]["error"]) for e in levels if e[level]["error"] is not None), default=None)
             for level in ("inside_region", "across_regions")}
    met = "met" if report.get("bytes_per_level_within_target") else "not met"
    lines += ["", (f"Bytes per level against the byte model, worst run: inside a region "
                   f"{_fmt(worst['inside_region'], '{:.1f}')} %, across regions "
                   f"{_fmt(worst['across_regions'], '{:.1f}')} % (target within 10 %: {met})."),
              *two_level_pricing(point),
              "", "![Held-out loss of the global models against tokens and training wall-clock, with regions]"
                  "(../benchmarks/results/convergence_regions.png)"]
    return "\n".join(lines) + "\n"


def fixed_h_regions_markdown(report: Optional[dict[str, Any]]) -> str:
    """The block of a ``--convergence --regions 2`` run whose DiLoCo rows were given (``--strategies
    mics-auto,mics-diloco-h<H>,mics-diloco-two-level-h<H>``) rather than planned: a labelled extra beside the
    headline. The links, the table, and two-level against flat DiLoCo at the same H, per seed and mean: the tokens
    and the wall-clock each took to mics-auto's final held-out loss, and the final held-out loss."""
    if report is None:
        return REGIONS_NOT_MEASURED
    regions, point = report.get("regions") or {}, report["points"][0]
    rows = point["comparison"]
    flat_name = next(r["strategy"] for r in rows if r["strategy"].startswith("mics-diloco-h"))
    two_name = next(r["strategy"] for r in rows if r["strategy"].startswith("mics-diloco-two-level-h"))
    seeds = sorted({r["seed"] for r in rows})

    def of(name: str, seed: int) -> dict[str, Any]:
        return next(r for r in rows if r["strategy"] == name and r["seed"] == seed)

    def ratios(key: str) -> list[Optional[float]]:
        out: list[Optional[float]] = []
        for seed in seeds:
            two, flat = of(two_name, seed).get(key), of(flat_name, seed).get(key)
            out.append(two / flat if two is not None and flat else None)
        return out

    def line(what: str, key: str) -> str:
        values = ratios(key)
        known = [v for v in values if v is not None]
        mean = statistics.mean(known) if len(known) == len(values) else None
        return (f"| {what} | {_fmt(mean, '{:.3f}')} | {' / '.join(_fmt(v, '{:.3f}') for v in values)} |")

    lines = [
        (f"A labelled extra, not the headline: {_links(regions, point, len(seeds))}, both DiLoCo rows given at the "
         f"same H (`{flat_name}`, `{two_name}`) rather than each at its planner's."),
        "",
        format_convergence_table({"points": report["points"][:1]}, markdown=True),
        "",
        "| two-level over flat DiLoCo, same H | mean | per seed |",
        "|---|---:|---:|",
        line("tokens to mics-auto's final held-out loss", "tokens_to_reference_loss"),
        line("wall-clock to mics-auto's final held-out loss", "time_to_reference_loss_s"),
        line("seconds per step", "s_per_step"),
        line("final held-out loss", "final_heldout_loss"),
    ]
    return "\n".join(lines) + "\n"


#: the cluster preset a "real" zone is compared with: A100s on 400 Gbps node links
REAL_ZONE_PRESET = "p4d"


def two_level_pricing(point: dict[str, Any]) -> list[str]:
    """Where the planner names no two-level H: why, in its own prices on the measured cluster (the run's planner
    inputs) -- two-level's step at the largest H it tries, how much of it computes against the rule's
    :data:`~lightning_mics.planner.report.BUSY_ENOUGH` -- and the compute per byte of a rank's share of the node
    links there and on :data:`REAL_ZONE_PRESET`, which decides whether a per-step hop 2 inside a region hides behind
    the step. Empty where two-level has an H or the run recorded no planner inputs."""
    from dataclasses import replace

    from lightning_mics.planner import CLUSTER_PRESETS, ClusterSpec, TrainingSpec, plan
    from lightning_mics.planner.cost_model import ModelSpec
    from lightning_mics.planner.report import BUSY_ENOUGH
    from lightning_mics.planner.search import ADVISED_SYNC_EVERY

    planner = point.get("planner") or {}
    inputs = planner.get("inputs")
    if inputs is None or any(seed.get("two_level_sync_every") for seed in planner.get("per_seed", [])):
        return []
    cluster, model = ClusterSpec(**inputs["cluster"]), ModelSpec(**inputs["model"])
    every = ADVISED_SYNC_EVERY[-1]
    training = replace(TrainingSpec(**inputs["training"]), sync_every=every, diloco_worker_size="region")
    two_level = plan(cluster, model, training, grad_accumulation="auto").winner
    real = CLUSTER_PRESETS[REAL_ZONE_PRESET]

    def per_byte(spec: Any) -> float:
        return spec.compute_flops / (spec.inter_node_bandwidth / spec.gpus_per_node)

    return ["", (
        f"Why two-level has no H here, in the planner's prices for the measured cluster (seed 0's inputs): at H = "
        f"{every}, the most it tries, a two-level step takes {two_level.step_time_s:.3f} s, of which "
        f"{two_level.compute_s:.3f} s compute -- {two_level.busy_fraction:.3f} busy where the rule asks "
        f"{BUSY_ENOUGH:g} -- since the hop 2 inside a region runs at every step whatever H is. The emulated ranks "
        f"compute {per_byte(cluster):,.0f} FLOP per byte of their share of a node link, the planner's "
        f"`{REAL_ZONE_PRESET}` preset {per_byte(real):,.0f} ({per_byte(real) / per_byte(cluster):.0f}x more): there a "
        f"per-step hop 2 between a region's nodes hides behind the step, and `lightning-mics plan` names two-level "
        f"DiLoCo for two regions joined at 2 Gbps ([Planner](planner.md))."
    )]


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
        regions = point.get("regions")
        region_text = "" if not regions else (
            f"; {regions['regions']} regions, region links 1/{regions['region_bandwidth_ratio']:g} "
            f"({regions['region_rate_bytes_per_s'] / 1e6:,.1f} MB/s)")
        left.set_title(f"inter-node link 1/{point['bandwidth_ratio']:g} of loopback ({rate / 1e6:,.1f} MB/s)"
                       + region_text, fontsize=9)
        right.set_title(f"time to mics-auto's final held-out loss, ratio {point['bandwidth_ratio']:g}", fontsize=9)
        right.legend(fontsize=6)
    fig.suptitle(textwrap.fill(f"Held-out loss against tokens and wall-clock: {report['command']}", 120), fontsize=9)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
