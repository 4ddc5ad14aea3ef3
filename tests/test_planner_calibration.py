"""Calibration probes on real (gloo, CPU) process groups: 4 ranks emulating 2 nodes of 2."""

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
