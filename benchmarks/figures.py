"""Published figures rendered from their results files: one source for every number the README and docs quote.

    python benchmarks/figures.py            # rewrite every figure block from its results file
    python benchmarks/figures.py --check    # exit 1 naming each block that no longer matches (tests/test_docs.py)

A figure block in a Markdown file is the text between ``<!-- figures:NAME -->`` and ``<!-- /figures -->``;
:data:`FIGURES` says which results file and which renderer make block ``NAME``. Editing a number by hand, or
a results file without re-rendering, makes ``--check`` (and the docs test) fail.

A few blocks quote the layout planner's *predictions* (no results file: ``None`` in :data:`FIGURES`): their renderers
compute them with :mod:`lightning_mics.planner` from the inputs they name, deterministically, so a change to the
cost model shows up as a stale block too. Every measured number comes from a results file.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any, Optional

if __package__ in (None, ""):  # run as a script: make `benchmarks` importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.figures_fault_tolerance import (  # noqa: E402  (the fault-tolerance pages' renderers)
    fault_tolerance_catch_up_table,
    fault_tolerance_cpu_table,
    fault_tolerance_defaults_table,
    fault_tolerance_exact_table,
    fault_tolerance_quorum_every_table,
    fault_tolerance_table,
    fault_tolerance_trajectory_table,
)

REPO = Path(__file__).resolve().parents[1]
#: Markdown files that may hold figure blocks: the README, the docs, and the experiment logs beside the results
DOCUMENTS = ("README.md", *sorted(str(p.relative_to(REPO)) for p in (REPO / "docs").glob("*.md")),
             *sorted(str(p.relative_to(REPO)) for p in (REPO / "benchmarks" / "results").glob("*.md")))
BLOCK = re.compile(r"(<!-- figures:(?P<name>[\w-]+) -->\n)(?P<body>.*?)(<!-- /figures -->)", re.DOTALL)


def _rows(results: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {row["strategy"]: row for row in results["results"]}


def speed_table(results: dict[str, Any]) -> str:
    """The README's emulated-cluster table: step time, wire floor and their ratio per strategy."""
    rows = _rows(results)
    auto = rows["mics-auto"]
    label = f"P={auto['params_degree']} G={auto['partition_size']} OS={auto['optim_degree']}"
    named = [
        (f"`mics_auto` (planner: {label})", "mics-auto", True),
        ("`mics`", "mics", False),
        ("Lightning DDP", "ddp", False),
        ("Lightning FSDP `HYBRID_SHARD`", "fsdp-hybrid", False),
        ("`mics_zero3`", "zero3", False),
    ]
    lines = ["| strategy | step (s) | wire floor (s) | step / floor |", "|---|---:|---:|---:|"]
    for title, key, bold in named:
        row = rows[key]
        step = f"{row['step_time_s']:.2f}"
        lines.append(
            f"| {title} | {f'**{step}**' if bold else step} | {row['wire_floor_s']:.2f} | "
            f"{row['step_over_floor']:.2f}× |"
        )
    return "\n".join(lines) + "\n"


def speed_ratios(results: dict[str, Any]) -> str:
    """The README's prose under the speed table: how the names compare in that same run (step-time ratios)."""
    rows = _rows(results)
    step = {key: rows[key]["step_time_s"] for key in ("mics-auto", "mics", "ddp", "fsdp-hybrid", "zero3")}
    return (
        f"In this run `mics_auto` stepped {step['ddp'] / step['mics-auto']:.2f}× as fast as Lightning's DDP and "
        f"{step['fsdp-hybrid'] / step['mics-auto']:.2f}× as fast as `HYBRID_SHARD`; plain `mics` "
        f"{step['fsdp-hybrid'] / step['mics']:.2f}× `HYBRID_SHARD` and {step['zero3'] / step['mics']:.2f}× "
        "`mics_zero3`.\n"
    )


def gpu_throughput_sentence(results: dict[str, Any]) -> str:
    """The README's line on the one-GPU run: the strategy's throughput over the plain loop's, MFU, peak memory."""
    by_mode = {r["mode"]: r for r in results["results"]}
    ratios = results["ratios"]
    compiled, plain = by_mode["strategy-compiled"], by_mode["plain-compiled"]
    leaner = all(by_mode[f"strategy{c}"]["peak_memory_bytes"] <= by_mode[f"plain{c}"]["peak_memory_bytes"]
                 for c in ("", "-compiled"))
    model = results["model"]
    return (
        f"`benchmarks/gpu_throughput.py` on one {results['environment']['device_name']}, a "
        f"{model['num_params'] / 1e9:.1f}B-parameter GPT in bf16 at micro-batch {results['config']['micro_batch']}: "
        f"{ratios['strategy/plain']:.3f} (eager) and {ratios['strategy-compiled/plain-compiled']:.3f} (compiled "
        f"blocks) of a plain PyTorch loop's throughput, {compiled['mfu'] * 100:.1f} % MFU compiled "
        f"({plain['mfu'] * 100:.1f} % for the plain loop), peak memory "
        + ("at or below the plain loop's" if leaner else "above the plain loop's") + ".\n"
    )


def _fmt(value: Any, pattern: str = "{:.3f}") -> str:
    return "-" if value is None else pattern.format(value)


def _mb(value: Optional[float]) -> str:
    return "-" if value is None else f"{value / 1e6:,.1f}"


def _strategy_label(row: dict[str, Any]) -> str:
    """A row's name with what it is: the planner's layout, a peer's framework, a semi-synchronous H."""
    name, family = row["strategy"], row.get("family")
    if row.get("sync_every"):
        return f"{name} (semi-synchronous, H={row['sync_every']}: mean over whole rounds)"
    notes = []
    if row.get("planned") or name.startswith("mics-auto"):
        params = row.get("params_degree") or row.get("partition_size")
        optim = row.get("optim_degree") or row.get("partition_size")
        notes.append(f"planner: P={params} G={row.get('partition_size')} OS={optim}, {row.get('grad_accumulation')}")
    if row.get("cross_replica_overlap") is False:
        notes.append("hop 2 after backward")
    if family in ("fsdp1", "ddp"):
        notes.append("Lightning")
    elif family == "deepspeed":
        notes.append("DeepSpeed")
    return name + (f" ({'; '.join(notes)})" if notes else "")


def _run_caption(results: dict[str, Any]) -> str:
    """The line above a run's table: the command that wrote it, the setting, the host's load."""
    machine = results.get("machine", {})
    load = machine.get("load_before"), machine.get("load_after")
    caption = f"`{results['command']}`: {results['title']}"
    if all(load):
        caption += f"; load average {load[0][0]:.1f} before, {load[1][0]:.1f} after, on {machine.get('cpus')} cores"
    return caption + ".\n\n"


def emulated_cluster_table(results: dict[str, Any]) -> str:
    """docs/benchmarks.md's table of one ``emulated_cluster.py`` run: per strategy the step time, throughput,
    inter-node bytes against the byte model, the wire floor, loopback bytes and peak memory."""
    rows = [r for r in results["results"] if r.get("status") == "ok"]
    fastest = min(r["step_time_s"] for r in rows)
    lines = ["| strategy | step (s) | tokens/s | inter-node MB/step (expected) | wire floor (s) | step / floor | "
             "loopback MB/step | peak RSS/rank (MB) |", "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for r in results["results"]:
        if r.get("status") != "ok":
            lines.append(f"| {r['strategy']} | {r.get('status')} | | | | | | |")
            continue
        step = f"{r['step_time_s']:.2f}"
        floor, ratio = r.get("wire_floor_s"), r.get("step_over_floor")
        lines.append(
            f"| {_strategy_label(r)} | {f'**{step}**' if r['step_time_s'] == fastest else step} | "
            f"{r['tokens_per_s']:,.0f} | {_mb(r['inter_node_bytes_per_step'])} "
            f"({_mb(r['expected_inter_node_bytes_per_step'])}, {r.get('inter_node_error', 0) * 100:+.1f}%) | "
            f"{'-' if floor is None else f'{floor:.2f}'} | {'-' if ratio is None else f'{ratio:.2f}x'} | "
            f"{_mb(r['loopback_bytes_per_step'])} | {_mb(r['peak_mem_bytes'])} |"
        )
    return _run_caption(results) + "\n".join(lines) + "\n"


def scaling_table(results: dict[str, Any]) -> str:
    """docs/benchmarks.md's table of one ``emulated_cluster.py --scaling`` run: every (nodes, strategy) point."""
    rows = [r for r in results["rows"] if r["status"] == "ok"]
    fastest = {n: min(r["step_time_s"] for r in rows if r["nodes"] == n) for n in {r["nodes"] for r in rows}}
    lines = [f"`{results['command']}`: {results['ranks_per_node']} ranks per node, the link calibrated to "
             f"{results['inter_node_rate_bytes_per_s'] / 1e6:.0f} MB/s per direction at the first point and kept.", "",
             "| nodes | strategy | step (s) | tokens/s per node | inter-node MB per node (expected) | wire floor (s) | "
             "step / floor | planner (fit) |", "|---:|---|---:|---:|---:|---:|---:|---:|"]
    for r in results["rows"]:
        if r["status"] != "ok":
            lines.append(f"| {r['nodes']} | {r['strategy']} | {r['status']} | | | | | |")
            continue
        step = f"{r['step_time_s']:.2f}"
        error = r.get("prediction_error")
        lines.append(
            f"| {r['nodes']} | {r['strategy']} | {f'**{step}**' if r['step_time_s'] == fastest[r['nodes']] else step} | "
            f"{r['tokens_per_s_per_node']:.1f} | {_mb(r['inter_node_bytes_per_node_per_step'])} "
            f"({_mb(r['expected_inter_node_bytes_per_node_per_step'])}) | {_fmt(r.get('wire_floor_s'), '{:.2f}')} | "
            f"{_fmt(r.get('step_over_floor'), '{:.2f}x')} | {'-' if error is None else f'{error * 100:+.0f} %'} |"
        )
    return "\n".join(lines) + "\n"


def telemetry_cost_table(results: Optional[dict[str, Any]]) -> str:
    """docs/benchmarks.md's table of one ``telemetry_cost.py --json`` run (``None``: not run yet)."""
    if results is None:
                        return ("Not yet measured into a results file: `python benchmarks/telemetry_cost.py --steps 40 --rounds 3 "
                "--json telemetry_cost.json`, kept as `telemetry_cost/telemetry_cost.json` beside the other results, "
                "renders this table; the earlier runs are in [the experiment log]"
                "(../benchmarks/results/emulated_cluster_history.md#telemetry-cost).\n")
    args, rows = results["args"], results["rows"]
    named = {"none": "no telemetry", "sampled (default)": "telemetry as shipped (collectives recorded on sampled "
             "steps)", "every step": "`TrainingTelemetry(sample_every=1)`: the recorder on every step"}
    lines = [f"{args['world']} ranks, {results['device']}, {args['rounds']} rounds x {args['steps']} steps (first "
             f"{args['skip']} of each left out), {args['precision']}:", "",
             "| variant | steps | median step (ms) | vs no telemetry |", "|---|---:|---:|---:|"]
    for name, row in rows.items():
        change = "-" if name == "none" else f"{(row['ratio'] - 1) * 100:+.2f} %"
        lines.append(f"| {named.get(name, name)} | {row['steps']} | {row['median_ms']:.1f} | {change} |")
    return "\n".join(lines) + "\n"


def gpu_throughput_table(results: dict[str, Any]) -> str:
    """docs/gpu.md's table of one ``gpu_throughput.py`` run: each mode's throughput, MFU, memory and loss, then
    the strategy / plain ratios against their target."""
    env, ratios, targets = results["environment"], results["ratios"], results["targets"]
    named = {"plain": "plain loop", "strategy": '`Trainer(strategy="mics")`', "plain-compiled": "plain loop, compiled "
             "blocks", "strategy-compiled": '`Trainer(strategy="mics")`, `compile_blocks=True`'}
    lines = [f"`{results['command']}` on one {env['device_name']} (torch {env['torch']}, lightning "
             f"{env['lightning']}), model `{results['config']['model']}`, micro-batch {results['config']['micro_batch']}, "
             f"{results['config']['steps']} timed steps; MFU against {env['peak_flops'] / 1e12:.0f} TFLOP/s:", "",
             "| mode | tokens/s | step ms | MFU | peak memory | loss, first → last step |",
             "|---|---:|---:|---:|---:|---:|"]
    for r in results["results"]:
        if r["status"] != "ok":
            lines.append(f"| {named.get(r['mode'], r['mode'])} | {r['status']} | | | | |")
            continue
        lines.append(f"| {named.get(r['mode'], r['mode'])} | {r['tokens_per_s']:,.0f} | {r['step_time_s'] * 1e3:.1f} | "
                     f"{r['mfu'] * 100:.1f} % | {r['peak_memory_bytes'] / 2**30:.1f} GiB | "
                     f"{r['first_loss']:.3f} → {r['last_loss']:.3f} |")
    lines += ["", f"Strategy / plain throughput: **{ratios['strategy/plain']:.3f}** eager, "
              f"**{ratios['strategy-compiled/plain-compiled']:.3f}** compiled (target ≥ {targets['strategy/plain']:.2f})."]
    return "\n".join(lines) + "\n"


def verbatim(text: str) -> str:
    """A Markdown table a benchmark wrote itself (``profile_breakdown.py --markdown``), quoted as it is."""
    return text if text.endswith("\n") else text + "\n"


def _importable() -> None:
    """Make ``benchmarks`` and ``lightning_mics`` importable when this file runs as a script."""
    if __package__ in (None, ""):
        sys.path.insert(0, str(REPO))


def convergence_table(results: Optional[dict[str, Any]]) -> str:
    """docs/semi-sync.md's block of one ``emulated_cluster.py --convergence`` run (``None``: not run yet)."""
    _importable()
    from benchmarks.convergence_report import figure_markdown

    return figure_markdown(results)


def convergence_regions_table(results: Optional[dict[str, Any]]) -> str:
    """docs/semi-sync.md's block of one ``emulated_cluster.py --convergence --regions 2`` run (``None``: not run
    yet)."""
    _importable()
    from benchmarks.convergence_report import regions_figure_markdown

    return regions_figure_markdown(results)


def convergence_regions_fixed_h_table(results: Optional[dict[str, Any]]) -> str:
    """docs/semi-sync.md's block of the labelled extra: flat and two-level DiLoCo given at the same H."""
    _importable()
    from benchmarks.convergence_report import fixed_h_regions_markdown

    return fixed_h_regions_markdown(results)


def _row(results: dict[str, Any], strategy: str) -> dict[str, Any]:
    return next(r for r in results["results"] if r["strategy"] == strategy)


def _link_ratio(results: dict[str, Any]) -> float:
    """An ``emulated_cluster.py`` report's node links as a fraction of the loopback (``--bandwidth-ratio``)."""
    network = results["network"]
    return network["loopback_per_node_bytes_per_s"] / network["inter_node_rate_bytes_per_s"]


def _cluster(results: dict[str, Any]) -> str:
    return f"{results['cluster']['num_nodes']} nodes x {results['cluster']['ranks_per_node']} ranks"


def byte_model_sentence(results: dict[str, Any]) -> str:
    """How far one run's measured inter-node bytes are from the byte model (``benchmarks/comm_model.py``): the
    largest difference over its rows, from an ``emulated_cluster.py`` report (``results``) or a ``--scaling``
    report (``rows``, bytes per node)."""
    if "rows" in results:
        pairs = [(r["inter_node_bytes_per_node_per_step"], r["expected_inter_node_bytes_per_node_per_step"])
                 for r in results["rows"] if r["status"] == "ok"]
        what = "point"
    else:
        pairs = [(r["inter_node_bytes_per_step"], r["expected_inter_node_bytes_per_step"])
                 for r in results["results"] if r.get("status") == "ok"]
        what = "row"
    errors = [measured / expected - 1 for measured, expected in pairs if measured and expected]
    if not errors:
        return "No row of this run has both measured and expected inter-node bytes.\n"
    worst = max(errors, key=abs)
    bound = math.ceil(abs(worst) * 1000) / 10  # per cent, rounded up: "within" stays true
    return (f"Every {what}'s measured inter-node bytes are within {bound:.1f} % of the byte model "
            f"({len(errors)} {what}s; the largest difference {worst * 100:+.2f} %).\n")


def wire_formats_sentence(results: dict[str, Any]) -> str:
    """docs/usage.md's line on the compressed hop 2 on the emulated cluster: the int8 row's inter-node bytes
    against the byte model and fp32, and the ``mics-zero2`` layout's step time with each wire format."""
    fp32, int8 = _row(results, "mics"), _row(results, "mics-int8")
    steps = [_row(results, name)["step_time_s"] for name in ("mics-zero2", "mics-zero2-bf16", "mics-zero2-int8")]
    return (
        f"At ratio {_link_ratio(results):.0f}, {_cluster(results)}: with an int8 wire the veths carry "
        f"{int8['inter_node_bytes_per_step'] / 1e6:.1f} MB per step (byte model "
        f"{int8['expected_inter_node_bytes_per_step'] / 1e6:.1f}; fp32 wire: {fp32['inter_node_bytes_per_step'] / 1e6:.1f}), "
        f"and the `mics-zero2` layout, where the link bounds the step, takes {steps[0]:.2f} s (fp32 wire), "
        f"{steps[1]:.2f} s (bf16) and {steps[2]:.2f} s (int8).\n"
    )


def optimizer_group_sentence(results: dict[str, Any]) -> str:
    """docs/planner.md's measured case for ``OS = G``: the ``mics-auto`` row (which ran ``P=1 G=4 OS=8``) against
    ``mics-zero2`` (``P=1 G=4 OS=4``) in one run."""
    wide, narrow = _row(results, "mics-auto"), _row(results, "mics-zero2")
    label = f"P={wide['params_degree']} G={wide['partition_size']} OS={wide['optim_degree']}"
    return (
        f"At ratio {_link_ratio(results):.0f}, {_cluster(results)}, `{label}` (the `mics-auto` row) took "
        f"{wide['step_time_s']:.2f} s a step where `P=1 G={narrow['partition_size']} OS={narrow['partition_size']}` "
        f"(`mics-zero2`) took {narrow['step_time_s']:.2f} s.\n"
    )


def planner_accuracy_sentence(results: dict[str, Any]) -> str:
    """docs/planner.md's count of rows the planner predicts within its target, from
    ``benchmarks/compare_planner.py --fit-compute`` on one ``emulated_cluster.py`` report (the comparison the
    benchmark prints; the prediction is the library's cost model, the step times the report's)."""
    _importable()
    from benchmarks.compare_planner import TARGET, build_parser, compare

    rows, _ = compare(results, build_parser().parse_args(["--fit-compute"]))
    ok = [r for r in rows if r["status"] == "ok"]
    misses = [f"`{r['strategy']}` ({r['step_time_error'] * 100:+.0f} %)" for r in ok
              if abs(r["step_time_error"]) > TARGET]
    return (f"At ratio {_link_ratio(results):.0f}: {len(ok) - len(misses)} of {len(ok)} rows within ±{TARGET * 100:.0f} %"
            + (f"; outside it {', '.join(misses)}" if misses else "") + ".\n")


# --- planner predictions: computed by the library's cost model from the inputs written here, not measured ---------


def paper_speedup_table(_: None = None) -> str:
    """docs/planner.md's table against the MiCS paper. Not a measurement and not read from a results file: the
    library's planner (:func:`lightning_mics.planner.mics_speedup_over_zero3`, deterministic) predicts MiCS
    (partition = one node) over ZeRO-3 with flat rings for BERT-10B with the paper's recipe, on the ``p3dn``
    preset at 100 and 400 Gbps (80 % of the line rate achieved, as ``tests/test_planner.py``) and the ``p4d``
    preset. A change to the cost model changes the table, and ``--check`` says so."""
    from dataclasses import replace

    _importable()
    from lightning_mics.planner import CLUSTER_PRESETS, MODEL_PRESETS, NETWORK_EFFICIENCY, TrainingSpec
    from lightning_mics.planner import mics_speedup_over_zero3

    bert = MODEL_PRESETS["bert-10b"]

    def cluster(preset: str, nodes: int, gbps: Optional[float] = None) -> Any:
        spec = CLUSTER_PRESETS[preset].with_nodes(nodes)
        return spec if gbps is None else replace(spec, inter_node_bandwidth=NETWORK_EFFICIENCY * gbps * 1e9 / 8)

    def training(micro_batch: int) -> Any:
        return TrainingSpec(micro_batch=micro_batch, accumulation=4, precision="deepspeed-fp16",
                            activation_checkpointing=True)

    columns = [(2, "p3dn", 100), (2, "p3dn", 400), (2, "p4d", None), (8, "p3dn", 100), (8, "p3dn", 400)]
    lines = ["| nodes (GPUs) | micro-batch 2: V100 @ 100 Gbps | V100 @ 400 Gbps | p4d (A100, 400 Gbps) | "
             "micro-batch 8: V100 @ 100 Gbps | V100 @ 400 Gbps |", "|---|---|---|---|---|---|"]
    for nodes in (2, 4, 8, 16):
        gains = [mics_speedup_over_zero3(cluster(preset, nodes, gbps), bert, training(micro_batch))
                 for micro_batch, preset, gbps in columns]
        lines.append(f"| {nodes} ({nodes * 8}) | " + " | ".join(f"{g:.2f}×" for g in gains) + " |")
    return "\n".join(lines) + "\n"


def _cross_region_job(inter_bandwidth: str, **training: Any) -> Any:
    """The plan of docs/planner.md's cross-region example: 4 p4d nodes, a 1.3B GPT, micro-batch 2 x 4
    micro-steps, ``P = G = OS`` layouts only (``lightning-mics plan --cluster p4d --nodes 4 --model gpt-1.3b
    --micro-batch 2 --accumulation 4 --inter-bandwidth ... --uniform-only``)."""
    from dataclasses import replace

    _importable()
    from lightning_mics.planner import CLUSTER_PRESETS, MODEL_PRESETS, TrainingSpec, parse_bandwidth, plan

    cluster = replace(CLUSTER_PRESETS["p4d"].with_nodes(4), inter_node_bandwidth=parse_bandwidth(inter_bandwidth))
    return plan(cluster, MODEL_PRESETS["gpt-1.3b"], TrainingSpec(micro_batch=2, accumulation=4, **training),
                uniform_only=True)


def semi_sync_advice_sentence(_: None = None) -> str:
    """The planner's semi-synchronous advice for the cross-region example, and the same job on a fast link. A
    prediction computed by the library's planner (deterministic), not a measurement."""
    slow, fast = _cross_region_job("1Gbps"), _cross_region_job("400Gbps")
    advice = slow.semi_sync_advice
    text = (f"Predicted by the planner (not measured): at 1 Gbps between 4 p4d nodes a 1.3B GPT (micro-batch "
            f"2 x 4 micro-steps) computes "
            f"{slow.winner.busy_fraction * 100:.0f} % of its step synchronously")
    if advice is not None:
        text += f" and {advice.semi_sync.busy_fraction * 100:.0f} % with DiLoCo at H={advice.sync_every}"
    text += f"; at 400 Gbps it computes {fast.winner.busy_fraction * 100:.0f} % synchronously"
    text += " and gets no advice.\n" if fast.semi_sync_advice is None else ", and still gets advice.\n"
    return text


def streaming_diloco_sentence(_: None = None) -> str:
    """What streaming DiLoCo's hiding buys in the cross-region example at H=64. A prediction computed by the
    library's planner (deterministic), not a measurement."""
    def step(fragments: int, delay: int) -> Any:
        return _cross_region_job("1Gbps", sync_every=64, num_fragments=fragments,
                                 fragment_sync_delay=delay).winner

    diloco, short, long = step(1, 0), step(4, 4), step(4, 15)
    return (f"Predicted by the planner (not measured): at 1 Gbps between 4 p4d nodes a 1.3B GPT with H=64 takes "
            f"{diloco.step_time_s:.2f} s a step with DiLoCo ({diloco.busy_fraction * 100:.0f} % computing), "
            f"{short.step_time_s:.2f} s with 4 fragments and tau=4 and {long.step_time_s:.2f} s with tau=15 "
            f"({long.busy_fraction * 100:.0f} % computing).\n")


def grad_accumulation_example(_: None = None) -> str:
    """docs/usage.md's example of ``grad_accumulation="auto"``: the layout log line the planner writes for a 1.3B
    GPT on 2 nodes x 8 80 GB GPUs. Computed by the library's planner (deterministic), not measured."""
    _importable()
    from lightning_mics.planner import GIB, TrainingSpec, choose_layout

    choice = choose_layout(16, 8, 1_300_000_000, 80 * GIB, training=TrainingSpec(micro_batch=4, accumulation=8),
                           grad_accumulation="auto")
    return f"`{choice.reason}`\n"


#: block name -> (results file, renderer); ``None`` for a planner prediction the renderer computes with the library
FIGURES: dict[str, tuple[Optional[str], Callable[[Any], str]]] = {
    "speed-ratio24": ("benchmarks/results/ratio24_overlap/emulated_cluster.json", speed_table),
    "speed-ratio24-ratios": ("benchmarks/results/ratio24_overlap/emulated_cluster.json", speed_ratios),
    "fault-tolerance-defaults": ("benchmarks/results/fault_tolerance_defaults/fault_tolerance.json",
                                 fault_tolerance_defaults_table),
    "fault-tolerance-hop2": ("benchmarks/results/fault_tolerance_hop2/fault_tolerance.json", fault_tolerance_table),
    "fault-tolerance-trajectory": (
        "benchmarks/results/fault_tolerance_trajectory_interleaved/fault_tolerance.json",
        fault_tolerance_trajectory_table,
    ),
    "fault-tolerance-quorum-every": (
        "benchmarks/results/fault_tolerance_quorum_every/fault_tolerance.json",
        fault_tolerance_quorum_every_table,
    ),
    "fault-tolerance-catch-up": (
        "benchmarks/results/fault_tolerance_catch_up/fault_tolerance.json",
        fault_tolerance_catch_up_table,
    ),
    "fault-tolerance-exact": (
        "benchmarks/results/fault_tolerance_exact/fault_tolerance.json",
        fault_tolerance_exact_table,
    ),
    "fault-tolerance-gc": (
        "benchmarks/results/fault_tolerance_gc/fault_tolerance.json",
        fault_tolerance_exact_table,
    ),
    "fault-tolerance-cpu": (
        "benchmarks/results/fault_tolerance_cpu/fault_tolerance.json",
        fault_tolerance_cpu_table,
    ),
    "fault-tolerance-cpu-repeat": (
        "benchmarks/results/fault_tolerance_cpu_repeat/fault_tolerance.json",
        fault_tolerance_cpu_table,
    ),
    "convergence": ("benchmarks/results/convergence/convergence.json", convergence_table),
    "convergence-regions": ("benchmarks/results/convergence_regions.json", convergence_regions_table),
    "convergence-regions-h32": ("benchmarks/results/convergence_regions_h32/convergence_regions.json",
                                convergence_regions_fixed_h_table),
    "emulated-cluster-ratio24": ("benchmarks/results/ratio24_overlap/emulated_cluster.json", emulated_cluster_table),
    "emulated-cluster-peers": ("benchmarks/results/peers/emulated_cluster.json", emulated_cluster_table),
    "emulated-cluster-ratio240": ("benchmarks/results/emulated_cluster_ratio240/emulated_cluster.json",
                                  emulated_cluster_table),
    "emulated-cluster-profile": ("benchmarks/results/ratio24_overlap/profile/breakdown.md", verbatim),
    "scaling": ("benchmarks/results/scaling/scaling.json", scaling_table),
    "gpu-throughput": ("benchmarks/results/gpu_throughput.json", gpu_throughput_table),
    "gpu-throughput-readme": ("benchmarks/results/gpu_throughput.json", gpu_throughput_sentence),
    "telemetry-cost": ("benchmarks/results/telemetry_cost/telemetry_cost.json", telemetry_cost_table),
    "byte-model-ratio24": ("benchmarks/results/ratio24_overlap/emulated_cluster.json", byte_model_sentence),
    "byte-model-scaling": ("benchmarks/results/scaling/scaling.json", byte_model_sentence),
    "wire-formats-ratio15": ("benchmarks/results/emulated_cluster.json", wire_formats_sentence),
    "optimizer-group-ratio24": ("benchmarks/results/ratio24_quiet/emulated_cluster.json", optimizer_group_sentence),
    "planner-accuracy-ratio15": ("benchmarks/results/emulated_cluster.json", planner_accuracy_sentence),
    "planner-accuracy-ratio24": ("benchmarks/results/ratio24/emulated_cluster.json", planner_accuracy_sentence),
    # planner predictions (no measurement): computed by lightning_mics.planner from the inputs their renderers name
    "planner-paper-speedups": (None, paper_speedup_table),
    "planner-semi-sync-advice": (None, semi_sync_advice_sentence),
    "planner-streaming-diloco": (None, streaming_diloco_sentence),
    "planner-grad-accumulation": (None, grad_accumulation_example),
}
#: Blocks whose measurement may not have run yet: without the results file their renderer gets ``None`` and says
#: so (once the file exists, ``--check`` fails until the block is rendered from it).
AWAITING_RUN = frozenset({"convergence", "convergence-regions", "telemetry-cost"})


def render(name: str, results: Optional[dict[str, Any]] = None) -> str:
    """Block ``name``'s text from its results file (or from ``results`` given here)."""
    path, renderer = FIGURES[name]
    if path is None:  # a planner prediction: nothing is read
        return renderer(None)
    if results is None and name in AWAITING_RUN and not (REPO / path).is_file():
        return renderer(None)
    if results is None:
        text = (REPO / path).read_text()
        results = json.loads(text) if path.endswith(".json") else text
    return renderer(results)


def stale_blocks(document: str, text: str) -> list[str]:
    """``document:NAME`` for every block in ``text`` that differs from its rendering (or names no figure)."""
    stale = []
    for match in BLOCK.finditer(text):
        name = match["name"]
        if name not in FIGURES or match["body"] != render(name):
            stale.append(f"{document}:{name}")
    return stale


def rewrite(text: str) -> str:
    return BLOCK.sub(lambda m: m.group(1) + render(m["name"]) + m.group(4), text)


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--check", action="store_true", help="change nothing; exit 1 if a block is stale")
    args = parser.parse_args(argv)
    stale: list[str] = []
    for document in DOCUMENTS:
        path = REPO / document
        text = path.read_text()
        if args.check:
            stale += stale_blocks(document, text)
        elif BLOCK.search(text):
            path.write_text(rewrite(text))
    if stale:
        print("stale figure blocks (run python benchmarks/figures.py): " + ", ".join(stale), file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
