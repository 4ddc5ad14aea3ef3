"""The three modes of ``emulated_cluster.py``, each on a command line :func:`benchmarks.emulated_cluster.parse_args`
resolved: one cluster shape (:func:`run_single`), weak scaling over several node counts (:func:`run_scaling`) and
held-out loss against wall-clock (:func:`run_convergence`).

Each builds the emulated cluster (:class:`~benchmarks.netns.EmulatedCluster`, torn down on every exit path), sets
up its links (:mod:`benchmarks.emulated_network`), runs the rows (:mod:`benchmarks.emulated_rows`), checks their
records against the models (:mod:`benchmarks.emulated_analysis`), prints as it goes and writes the mode's JSON,
chart and tables; with ``--regions`` the cluster has a region level (:mod:`benchmarks.netns_regions`) and every
record its bytes at both levels. Here, apart from the command line, because this is the part that needs root and
takes minutes: the command line and everything below it are tested without either.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import tempfile
import time
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any, Optional

from benchmarks.convergence_analysis import build_convergence_report
from benchmarks.convergence_report import draw_convergence, format_convergence_table
from benchmarks.convergence_setup import PLANNED_ROW, REFERENCE, ConvergenceSettings, MarkovChain
from benchmarks.convergence_regions import (
    PLANNED_ROWS,
    REGION_TARGETS,
    REPORT_NAME,
    build_regions_report,
    regions_planner_answer,
    resolve_region_rows,
)
from benchmarks.convergence_regions import planner_digest as region_planner_digest
from benchmarks.emulated_analysis import (
    LEVEL_BYTES_TARGET,
    add_convergence_expectations,
    add_expectations,
    add_wire_floor,
    convergence_planner,
    planned_spec,
)
from benchmarks.emulated_network import (
    NetworkSettings,
    RegionSettings,
    reshape_link,
    set_up_network,
    set_up_regions,
)
from benchmarks.emulated_report import (
    all_ran,
    convergence_line,
    draw_chart,
    format_markdown,
    format_table,
    is_skipped,
    one_line,
    report_title,
)
from benchmarks.emulated_rows import ConvergenceRun, run_strategy, skip_reason, skipped_record
from benchmarks.netns import EmulatedCluster
from benchmarks.scaling import build_scaling_report, draw_scaling, format_scaling_table, link_rate, point_predictions
from benchmarks.scenarios import StrategySpec


def measure_point(args: argparse.Namespace, command: str) -> dict[str, Any]:
    """Build the cluster of ``args.cluster`` (with ``--regions`` its region level, the region links shaped and
    recorded in ``settings.regions``), run ``args.specs`` on it, tear it down; return the report (the
    ``emulated_cluster.json`` schema, which compare_planner.py reads)."""
    load_before = os.getloadavg()
    print(f"load average before: {load_before[0]:.2f} {load_before[1]:.2f} {load_before[2]:.2f} "
          f"on {os.cpu_count()} cores")
    records: list[dict[str, Any]] = []
    started = time.monotonic()
    regions: Optional[RegionSettings] = None
    with EmulatedCluster(args.cluster.num_nodes, mtu=args.mtu, nodes_per_region=args.nodes_per_region) as cluster, \
            tempfile.TemporaryDirectory(prefix="micsbench-") as tmp:
        if args.fork_server:
            cluster.start_fork_server()  # it imports while the links are probed
        network = set_up_network(cluster, args.cluster,
                                 replace(args.link, fixed_rate_bytes_per_s=args.fixed_rate_bytes_per_s))
        if args.nodes_per_region is not None:
            regions = set_up_regions(cluster, network, args.region_bandwidth_ratio, args.link.probe_seconds)
        for index, spec in enumerate(args.specs):
            print(f"[{index + 1}/{len(args.specs)}] {spec.name}: {spec.description} ...", flush=True)
            reason = skip_reason(spec)
            raw = skipped_record(spec, reason) if reason else run_strategy(cluster, spec, args, Path(tmp), index)
            record = add_wire_floor(add_expectations(raw, spec, args), link_rate(asdict(network)),
                                    args.cluster.num_nodes)
            records.append(record)
            print("    " + one_line(record), flush=True)
        cpu = cluster.cpu_settings()  # before the teardown removes the cgroups
    load_after = os.getloadavg()
    print()
    print(format_table(records))
    print(f"\nload average after: {load_after[0]:.2f} {load_after[1]:.2f} {load_after[2]:.2f}; "
          f"total {time.monotonic() - started:.0f} s")
    setup = args.setup
    return {
        "command": command,
        "title": report_title(args, network),
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(),
                    "load_before": load_before, "load_after": load_after},
        "network": asdict(network),
        "cluster": asdict(args.cluster),
        "settings": cpu if regions is None else {**cpu, "regions": asdict(regions)},
        "setup": {**asdict(setup), "model_params": setup.model.num_params,
                  "tokens_per_step": setup.tokens_per_step(args.cluster)},
        "results": records,
    }


def run_single(args: argparse.Namespace, command: str) -> int:
    """One cluster shape: ``emulated_cluster.json`` and ``.png``, and the Markdown table."""
    report = measure_point(args, command)
    records = report["results"]
    output_dir: Path = args.output_dir
    output_dir.mkdir(parents=True, exist_ok=True)
    json_path = output_dir / "emulated_cluster.json"
    json_path.write_text(json.dumps(report, indent=2))
    chart = draw_chart(records, output_dir / "emulated_cluster.png", report["title"])
    print(f"wrote {json_path}" + (f" and {chart}" if chart else ""))
    print("\n" + format_markdown(records))
    return 0 if all_ran(records) else 1


def run_scaling(args: argparse.Namespace, command: str) -> int:
    """Weak scaling: the same strategies and per-rank batch at every node count, one cluster at a time
    (torn down before the next), on one link rate -- the first point's -- so that only the node count
    changes. ``scaling.json`` is rewritten after every point: a late failure keeps the earlier ones."""
    output_dir: Path = args.output_dir
    output_dir.mkdir(parents=True, exist_ok=True)
    json_path = output_dir / "scaling.json"
    reports: list[dict[str, Any]] = []
    for shape, specs in args.points:
        print(f"\n=== scaling point: {shape.num_nodes} nodes x {shape.ranks_per_node} ranks ===", flush=True)
        point = argparse.Namespace(**vars(args))
        point.cluster, point.specs = shape, specs
        if args.profile_dir is not None:
            point.profile_dir = args.profile_dir / f"nodes{shape.num_nodes}"
        report = measure_point(point, command)
        report["planner_predictions"] = point_predictions(report)
        reports.append(report)
        if args.fixed_rate_bytes_per_s is None:
            args.fixed_rate_bytes_per_s = report["network"]["inter_node_rate_bytes_per_s"]
        scaling = build_scaling_report(reports, command)
        json_path.write_text(json.dumps(scaling, indent=2))
    chart = draw_scaling(scaling, output_dir / "scaling.png")
    print(f"\nwrote {json_path}" + (f" and {chart}" if chart else ""))
    print("\n" + format_scaling_table(scaling["rows"]))
    print("\n" + format_scaling_table(scaling["rows"], markdown=True))
    return 0 if all(all_ran(r["results"]) for r in reports) else 1


def run_convergence(args: argparse.Namespace, command: str) -> int:
    """``--convergence``: one cluster; the loopback measured once, then for every ratio of ``args.ratios`` the
    links shaped to ``1 / ratio`` of it and, for every seed, ``mics-auto`` first (its set-up measures the cluster the
    planner's H is computed for, once per ratio from the first seed's run) and then every DiLoCo row, the planner's
    included. ``convergence.json`` is rewritten after every seed (a late failure keeps the earlier ones); then the
    chart and the tables.

    With ``--regions`` (``args.nodes_per_region``): the cluster has its region level, the region links are shaped
    once (``--region-bandwidth-ratio``, the same at every ratio of the node links), and after the first seed's
    ``mics-auto`` the planner names an H for flat and for two-level DiLoCo on the measured cluster with its regions
    (:func:`_plan_region_rows`); every seed then runs those rows, and the report is ``convergence_regions.json``
    (:func:`benchmarks.convergence_regions.build_regions_report`)."""
    settings: ConvergenceSettings = args.convergence_settings
    setup = args.setup
    chain = MarkovChain(setup.model.vocab_size, settings.successors, settings.data_seed)
    tokens_per_step = setup.tokens_per_step(args.cluster)
    described = {
        **asdict(settings),
        "model": asdict(setup.model), "model_params": setup.model.num_params,
        "cluster": asdict(args.cluster), "micro_batch": setup.micro_batch, "accumulate": setup.accumulate,
        "tokens_per_step": tokens_per_step,
        "tokens": settings.steps * tokens_per_step,
        "budget": f"mics-auto (and any synchronous row) {settings.steps} optimizer steps = "
                  f"{settings.steps * tokens_per_step:,} tokens; DiLoCo rows at least {settings.diloco_budget:g} times "
                  f"as many (whole rounds of H, whole evaluation intervals), so that they may reach mics-auto's final "
                  "loss after its token budget; every row's learning-rate schedule spans its own budget",
        "optimizer": f"AdamW(lr={settings.learning_rate:g}, betas=(0.9, 0.95), weight_decay=0.1 on matrices), "
                     f"{settings.warmup_steps} warm-up steps then cosine to 0.1x at the row's last step",
        "outer_optimizer": "SGD(lr=0.7, momentum=0.9, nesterov=True) (the library's default, DiLoCo's)"
        if args.outer_lr is None else f"SGD(lr={args.outer_lr:g}, momentum=0.9, nesterov=True) (--outer-lr)",
        "data": f"first-order Markov chain over {setup.model.vocab_size} tokens, {settings.successors} successors "
                f"each (table seed {settings.data_seed}); entropy rate {chain.entropy_rate:.4f} nats/token; each seed "
                f"draws its own training sequences, every row of a seed the same ones in the same order; "
                f"{settings.heldout_samples} held-out sequences, the same for every row and seed",
        "evaluation": f"held-out loss of the global model every {settings.eval_every} optimizer steps "
                      f"({settings.eval_every * tokens_per_step:,} tokens), its time taken out of the training clock",
        "entropy_rate": chain.entropy_rate,
        "fork_server": bool(args.fork_server),
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform()},
    }
    output_dir: Path = args.output_dir
    output_dir.mkdir(parents=True, exist_ok=True)
    with_regions = args.nodes_per_region is not None
    name = REPORT_NAME if with_regions else "convergence"
    build = build_regions_report if with_regions else build_convergence_report
    if with_regions:
        described["regions"] = {"regions": args.regions, "nodes_per_region": args.nodes_per_region,
                                "region_bandwidth_ratio": args.region_bandwidth_ratio}
    json_path = output_dir / f"{name}.json"
    points: list[dict[str, Any]] = []
    started = time.monotonic()
    rows = len(args.specs) + (len(args.planned_rows) if with_regions else int(args.planner_row))
    print(f"convergence: {rows} rows x {len(settings.seeds)} seeds x {len(args.ratios)} ratios; mics-auto "
          f"{settings.steps} steps of {tokens_per_step} tokens, DiLoCo rows >= {settings.diloco_budget:g}x; loss floor "
          f"(entropy rate) {chain.entropy_rate:.3f}", flush=True)
    index = 0
    regions: Optional[RegionSettings] = None
    with EmulatedCluster(args.cluster.num_nodes, mtu=args.mtu, nodes_per_region=args.nodes_per_region) as cluster, \
            tempfile.TemporaryDirectory(prefix="micsbench-") as tmp:
        if args.fork_server:
            cluster.start_fork_server()  # it imports while the links are probed
        network: Optional[NetworkSettings] = None
        for i, ratio in enumerate(args.ratios):
            print(f"\n=== bandwidth ratio {ratio:g} ===", flush=True)
            load_before = os.getloadavg()
            if network is None:
                network = set_up_network(cluster, args.cluster, replace(args.link, bandwidth_ratio=ratio))
                current = network
                if with_regions:  # the region links keep this rate at every ratio of the node links
                    regions = set_up_regions(cluster, network, args.region_bandwidth_ratio, args.link.probe_seconds)
                    described["regions"].update(region_rate_bytes_per_s=regions.region_rate_bytes_per_s,
                                                region_measured_bytes_per_s=regions.region_measured_bytes_per_s)
            else:
                current = reshape_link(cluster, network, ratio, args.link.probe_seconds)
            planner: dict[str, Any] = {"row": None, "sync_every": None, "from_seed": None, "per_seed": []}
            point: dict[str, Any] = {"bandwidth_ratio": ratio, "network": asdict(current), "load_before": load_before,
                                     "planner": planner, "runs": []}
            if regions is not None:
                point["regions"] = asdict(regions)
            points.append(point)
            planned: Optional[StrategySpec] = None
            resolved: list[tuple[str, Optional[StrategySpec]]] = []
            for seed in settings.seeds:
                queue = list(args.specs)  # mics-auto first (_convergence_settings)
                while queue:
                    spec = queue.pop(0)
                    steps = settings.row_steps(spec.sync_every)
                    print(f"[seed {seed}] {spec.name}: {steps} steps; {spec.description} ...", flush=True)
                    record = run_strategy(cluster, spec, args, Path(tmp) / f"ratio{i}" / f"seed{seed}", index,
                                          convergence=ConvergenceRun(settings, seed, steps))
                    index += 1
                    record.setdefault("seed", seed)
                    point["runs"].append(add_convergence_expectations(record, spec, args, steps))
                    print("    " + convergence_line(record), flush=True)
                    if spec.name != REFERENCE:
                        continue
                    if regions is not None:  # the planner's H for each mode; every seed runs the same rows
                        resolved = _plan_region_rows(record, args, planner, current, regions, seed, resolved)
                        waiting = [(placeholder, None) for placeholder in args.planned_rows] if not resolved else []
                        for placeholder, row in resolved or waiting:
                            if row is not None:
                                queue.append(row)
                                continue
                            why = "the planner names no H for this mode" if resolved else "no planner answer yet"
                            point["runs"].append({"strategy": placeholder, "seed": seed, "status": f"skipped: {why}"})
                        continue
                    answer = convergence_planner(record, args)
                    planner["per_seed"].append({"seed": seed, **_planner_digest(answer)})
                    if planner["from_seed"] is None and answer is not None:
                        planner.update(answer, from_seed=seed)
                        planned = planned_spec(answer, args.specs, args.cluster, args.outer_lr)
                        if not args.planner_row and planned not in args.specs:
                            planned = None  # not asked for (--strategies without mics-diloco-planned)
                        planner["row"] = None if planned is None else planned.name
                        print(f"    planner: H = {answer['sync_every']} for this link (row {planner['row']})",
                              flush=True)
                    if args.planner_row and planned is None:
                        why = ("the planner names no H for this link" if planner["from_seed"] is not None
                               else "no planner answer yet (mics-auto did not run)")
                        point["runs"].append({"strategy": PLANNED_ROW, "seed": seed, "status": f"skipped: {why}"})
                    elif planned is not None and planned.name not in [s.name for s in args.specs]:
                        queue.append(planned)
                point["load_after"] = os.getloadavg()
                report = build(points, command, described)
                report.setdefault("settings", {}).update(cluster.cpu_settings())
                report["date_utc"] = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
                report["total_s"] = time.monotonic() - started
                json_path.write_text(json.dumps(report, indent=2))
    chart = draw_convergence(report, output_dir / f"{name}.png")
    print(f"\nwrote {json_path}" + (f" and {chart}" if chart else "") + f"; total {time.monotonic() - started:.0f} s")
    print("\n" + format_convergence_table(report))
    print("\n" + format_convergence_table(report, markdown=True))
    keys = tuple(REGION_TARGETS) if with_regions else ("time_to_sync_final_loss_ratio", "final_loss_ratio")
    means = ", ".join(f"{k} = {_or_none(report.get(k))}" for k in keys)
    print(f"\nratio {report['headline_bandwidth_ratio']:g}, {report.get('headline_strategy')} (the planner's H = "
          f"{report.get('planner_sync_every')}), mean over {len(settings.seeds)} seeds: {means}; targets met: "
          f"{report.get('targets_met')}; seeds distinct: {report.get('seeds_distinct')}")
    if with_regions:
        print(f"H per mode: {report.get('sync_every')}; bytes per level within "
              f"{LEVEL_BYTES_TARGET:.0%} of the model: {report.get('bytes_per_level_within_target')}")
    ran = all(r.get("status") == "ok" for point in points for r in point["runs"]
              if not (r["strategy"] in PLANNED_ROWS and is_skipped(r)))
    return 0 if ran else 1


def _plan_region_rows(record: dict[str, Any], args: argparse.Namespace, planner: dict[str, Any],
                      network: NetworkSettings, regions: RegionSettings, seed: int,
                      resolved: list[tuple[str, Optional[StrategySpec]]]) -> list[tuple[str, Optional[StrategySpec]]]:
    """After a ``mics-auto`` run on a cluster with regions: the planner's answer for each mode
    (:func:`benchmarks.convergence_regions.regions_planner_answer`) into ``planner``, and -- from the first seed
    with an answer -- the rows it resolves to (``resolved`` kept after that: every seed runs the same rows)."""
    answer = regions_planner_answer(record, args.setup, regions.nodes_per_region,
                                    network.inter_node_measured_bytes_per_s, regions.region_measured_bytes_per_s)
    planner["per_seed"].append({"seed": seed, **region_planner_digest(answer)})
    if planner["from_seed"] is not None or answer is None:
        return resolved
    ranks_per_region = regions.nodes_per_region * args.cluster.ranks_per_node
    resolved = resolve_region_rows(answer, args.planned_rows, args.cluster, ranks_per_region, args.outer_lr)
    names = {PLANNED_ROWS[placeholder]: None if row is None else row.name for placeholder, row in resolved}
    planner.update(answer, from_seed=seed, rows=names, row=names.get("two_level"),
                   flat_sync_every=(answer["modes"]["flat"] or {}).get("sync_every"),
                   two_level_sync_every=(answer["modes"]["two_level"] or {}).get("sync_every"))
    print(f"    planner (cluster with regions): flat DiLoCo H = {planner['flat_sync_every']}, two-level H = "
          f"{planner['two_level_sync_every']}; the library's advice H = {answer['advice_sync_every']}", flush=True)
    return resolved


def _planner_digest(answer: Optional[dict[str, Any]]) -> dict[str, Any]:
    """One seed's planner answer in brief (the ratio's ``planner`` holds the full one, from the first seed)."""
    if answer is None:
        return {"sync_every": None}
    return {"sync_every": answer["sync_every"],
            "compute_flops": answer["inputs"]["cluster"]["compute_flops"],
            "calibrated_compute_flops": answer["inputs"]["calibrated_compute_flops"],
            "sync_every_with_calibrated_compute": answer["with_calibrated_compute"]["sync_every"],
            "synchronous_busy_fraction": answer["answer"]["synchronous_busy_fraction"]}


def _or_none(value: Optional[float]) -> str:
    return "none (not reached)" if value is None else f"{value:.3f}"
