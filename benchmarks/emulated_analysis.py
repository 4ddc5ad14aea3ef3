"""A row's record against the models: the inter-node and loopback bytes the byte model
(:mod:`benchmarks.comm_model`) expects next to the measured ones -- with ``--regions`` at both levels, between the
nodes of a region and across the region links (:func:`add_level_bytes`) --, the row's wire floor, and -- for
``--convergence`` -- the DiLoCo H the library's planner names from a ``mics-auto`` run's measurements.

Pure functions of records and the parsed command line (no processes, no namespaces): the modes
(:mod:`benchmarks.emulated_modes`) call them on every record, and the tests on synthetic ones.
"""

from __future__ import annotations

import argparse
from dataclasses import asdict
from typing import Any, Optional

from benchmarks.comm_model import (
    LevelBytes,
    expected_level_bytes,
    expected_step_bytes,
    gradient_bytes_held_during_accumulation,
)
from benchmarks.convergence_analysis import achieved_flops, planner_answer
from benchmarks.scenarios import ClusterShape, StrategySpec, diloco_spec


def add_expectations(record: dict[str, Any], spec: StrategySpec, args: argparse.Namespace) -> dict[str, Any]:
    if spec.planned and record.get("status") == "ok":
        spec = spec.with_choice(record)  # the bytes of the layout the planner chose
    expected = expected_step_bytes(spec, args.cluster, args.setup)
    rx = record.get("inter_node_rx_bytes_per_step_per_node")
    add_level_bytes(record, spec, args, None if rx is None else sum(rx), record.get("across_region_rx_bytes_per_step"),
                    1)
    record["expected_inter_node_bytes_per_step"] = expected.inter_node
    record["expected_loopback_bytes_per_step"] = expected.intra_node
    record["expected_grad_bytes_during_accumulation"] = gradient_bytes_held_during_accumulation(
        spec, args.cluster, args.setup
    )
    measured = record.get("inter_node_bytes_per_step")
    if measured is not None and expected.inter_node:
        record["inter_node_error"] = measured / expected.inter_node - 1
    record["description"] = spec.description
    return record


#: The per-level byte target: measured within this relative error of the byte model, at both levels.
LEVEL_BYTES_TARGET = 0.10


def level_bytes(measured_inter: Optional[float], measured_across: Optional[float], expected: LevelBytes
                ) -> dict[str, Any]:
    """Measured against modelled bytes at both levels of a cluster with regions: between nodes of one region
    (``measured_inter``, what every node uplink received, less ``measured_across``, what every region link received:
    a byte across regions enters its region's link and its node's uplink once each; :mod:`benchmarks.netns_regions`
    says why received) and across the region links; each level's relative error, and whether both lie within
    :data:`LEVEL_BYTES_TARGET`."""
    measured = {"inside_region": None if measured_inter is None or measured_across is None
                else measured_inter - measured_across, "across_regions": measured_across}
    out: dict[str, Any] = {}
    for level, model in (("inside_region", expected.inside_region), ("across_regions", expected.across_regions)):
        value = measured[level]
        error = None if value is None or not model else value / model - 1
        out[level] = {"measured": value, "expected": model, "error": error}
    errors = [out[level]["error"] for level in ("inside_region", "across_regions")
              if out[level]["expected"] or out[level]["measured"]]
    out["target_error"] = LEVEL_BYTES_TARGET
    out["within_target"] = bool(errors) and all(e is not None and abs(e) <= LEVEL_BYTES_TARGET for e in errors)
    return out


def add_level_bytes(record: dict[str, Any], spec: StrategySpec, args: argparse.Namespace,
                    measured_inter: Optional[float], measured_across: Optional[float], steps: int) -> None:
    """On a cluster with regions (``args.nodes_per_region``), ``record["bytes_per_level"]``: :func:`level_bytes` for
    ``steps`` optimizer steps of ``spec`` (the byte model's two-level roles for a two-level row). Nothing
    otherwise, nor for a row that did not run."""
    per_region = getattr(args, "nodes_per_region", None)
    if per_region is None or record.get("status") != "ok" or spec.family == "deepspeed":
        return
    model = expected_level_bytes(spec, args.cluster, args.setup, per_region)
    expected = LevelBytes(model.inside_region * steps, model.across_regions * steps)
    record["bytes_per_level"] = level_bytes(measured_inter, measured_across, expected)
    if spec.two_level:
        record["diloco_worker_size"] = spec.topology(args.cluster).worker_size


def add_wire_floor(record: dict[str, Any], link_bytes_per_s: float, num_nodes: int) -> dict[str, Any]:
    """Add the row's wire floor: the time the shaped links alone need for its inter-node bytes.

    Each direction of each node uplink is its own tbf queue at ``link_bytes_per_s``, so no step can
    be shorter than its busiest direction's bytes over that rate; ``step_over_floor`` says how far
    above that floor the step runs (1.0: the wire is the only cost).
    """
    if record.get("status") != "ok":
        return record
    tx = record.get("inter_node_tx_bytes_per_step_per_node")
    rx = record.get("inter_node_rx_bytes_per_step_per_node")
    if tx and rx:  # measured: every node's uplink counters, both directions
        busiest, basis = max(*tx, *rx), "busiest uplink direction (per-node tx/rx counters)"
    else:
        # Only the total is known (records from before the per-node counters): the sum over nodes of
        # every uplink's tx_bytes. It counts each crossing byte once, at its sender; that byte also
        # uses one receiver's ingress, so with symmetric traffic each node's egress -- and each
        # node's ingress -- carries total / nodes (not total / (2 * nodes): the total is one direction's sum).
        busiest, basis = record["inter_node_bytes_per_step"] / num_nodes, "total / nodes (symmetric traffic assumed)"
    floor = busiest / link_bytes_per_s
    record["inter_node_bytes_per_direction_per_step"] = busiest
    record["wire_floor_basis"] = basis
    record["wire_floor_link_bytes_per_s"] = link_bytes_per_s
    record["wire_floor_s"] = floor
    record["step_over_floor"] = record["step_time_s"] / floor if floor > 0 else None
    return record


def add_convergence_expectations(
    record: dict[str, Any], spec: StrategySpec, args: argparse.Namespace, steps: int
) -> dict[str, Any]:
    """The inter-node bytes the byte model expects for the whole run (per step x steps; a DiLoCo row's budget is
    whole rounds, so its one message per round counts exactly), next to the measured ones. The held-out
    evaluations add one all-reduce of two numbers each, too few bytes to count."""
    if spec.planned and record.get("status") == "ok":
        spec = spec.with_choice(record)
    record.setdefault("sync_every", spec.sync_every)
    record["description"] = spec.description
    expected = expected_step_bytes(spec, args.cluster, args.setup).inter_node * steps
    rx = record.get("inter_node_rx_bytes_per_node")
    add_level_bytes(record, spec, args, None if rx is None else sum(rx), record.get("across_region_rx_bytes"), steps)
    record["expected_inter_node_bytes"] = expected
    if record.get("inter_node_bytes") is not None and expected:
        record["inter_node_error"] = record["inter_node_bytes"] / expected - 1
    return record


def convergence_planner(record: dict[str, Any], args: argparse.Namespace) -> Optional[dict[str, Any]]:
    """The planner's answer for a ``mics-auto`` run (:func:`benchmarks.convergence.planner_answer`): the cluster
    its strategy measured at set-up, the compute rate its accumulation micro-steps achieved, this run's model and
    batch. ``None`` for a run that failed or recorded no measurement."""
    cluster = record.get("planner_cluster_spec")
    if record.get("status") != "ok" or not cluster:
        return None
    model = args.setup.model
    flops = achieved_flops(record.get("compute_micro_step_s"), model.flops_per_token, args.setup.micro_batch,
                           model.seq_len)
    return planner_answer(cluster, asdict(model), args.setup.micro_batch, args.setup.accumulate,
                          record["device_memory_bytes"], flops)


def planned_spec(answer: dict[str, Any], specs: list[StrategySpec], shape: ClusterShape,
                 outer_lr: Optional[float]) -> Optional[StrategySpec]:
    """The DiLoCo row for the planner's H: the run's row with that H when it has one, else a new
    ``mics-diloco-h<H>`` (same layout and outer optimizer as the others); ``None`` when the planner names no H."""
    every = answer.get("sync_every")
    if every is None:
        return None
    for spec in specs:
        if spec.sync_every == every:
            return spec
    return diloco_spec(shape, int(every), outer_lr, name=f"mics-diloco-h{every}")
