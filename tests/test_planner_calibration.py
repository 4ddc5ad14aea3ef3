"""Calibration probes on real (gloo, CPU) process groups, 4 ranks emulating 2 nodes of 2: both scopes are measured
and fed to the cluster, and a probe stops repeating once its budget is spent, on every rank alike."""

from __future__ import annotations

import time

import pytest
import torch.distributed as dist
from distributed import run_ranks

from lightning_mics.planner import CLUSTER_PRESETS, calibrate_cluster
from lightning_mics.topology import MiCSTopology

pytestmark = pytest.mark.distributed  # every test here spawns rank processes


def _calibrate(rank: int, world_size: int) -> dict:
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    start = time.perf_counter()
    result = calibrate_cluster(MiCSTopology.create(world_size, 2, 1), payload_bytes=(1 << 12, 1 << 22, 1 << 24), repeats=3)
    return {"result": result.to_dict(), "seconds": time.perf_counter() - start}


def test_calibration_measures_both_scopes_and_feeds_the_cluster():
    results = run_ranks(_calibrate, 4, timeout=120)
    first = results[0]["result"]
    assert all(r["result"] == first for r in results), "every rank must return the same (MAX-reduced) timings"
    probes = first["probes"]
    scopes = {(p["scope"], p["kind"]) for p in probes}
    assert scopes == {(s, k) for s in ("intra_node", "inter_node") for k in ("all_gather", "all_reduce")}
    assert all(p["group_size"] == 2 and p["seconds"] > 0 for p in probes)
    for scope in ("intra_node", "inter_node"):  # every payload size was probed in each scope
        assert {p["payload_bytes"] for p in probes if p["scope"] == scope} == {1 << 12, 1 << 22, 1 << 24}
    assert first["intra_node_bandwidth"] is not None and first["intra_node_bandwidth"] > 1e6
    assert first["inter_node_bandwidth"] is not None and first["inter_node_bandwidth"] > 1e6

    from lightning_mics.planner import Calibration

    calibrated = Calibration.from_dict(first).apply(CLUSTER_PRESETS["p4d"])
    assert calibrated.inter_node_bandwidth == pytest.approx(first["inter_node_bandwidth"])
    assert calibrated.intra_node_bandwidth == pytest.approx(first["intra_node_bandwidth"])
    assert calibrated.compute_flops == CLUSTER_PRESETS["p4d"].compute_flops  # untouched: not measured


def _timed_with_budget(rank: int, world_size: int) -> dict:
    from lightning_mics.planner.calibrate import slowest_rank_seconds

    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    calls = {"slow": 0, "fast": 0}

    def slow() -> None:  # the slowest rank's 0.3 s a run is what every rank times
        calls["slow"] += 1
        time.sleep(0.3 if rank == 1 else 0.01)

    def fast() -> None:
        calls["fast"] += 1

    slow_seconds = slowest_rank_seconds(slow, "cpu", repeats=5, budget_s=0.5)
    fast_seconds = slowest_rank_seconds(fast, "cpu", repeats=5, budget_s=0.5)
    return {"calls": calls, "slow": slow_seconds, "fast": fast_seconds}


def test_a_probe_stops_repeating_once_its_budget_is_spent_on_every_rank_alike():
    """A warm-up and two timed runs of the slowest rank's 0.3 s pass the 0.5 s budget: every rank stops there
    (a rank that went on alone would wait in a collective forever); fast runs still repeat all five times."""
    results = run_ranks(_timed_with_budget, 2, timeout=60)
    assert [r["calls"] for r in results] == [{"slow": 3, "fast": 6}] * 2
    assert all(0.3 <= r["slow"] < 0.5 for r in results) and results[0]["slow"] == results[1]["slow"]
