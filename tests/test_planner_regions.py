"""The planner prices three levels of network: the partition inside a node, a per-step hop 2 between the nodes of a
region, DiLoCo's outer round across regions; `lightning-mics plan --nodes-per-region` names two-level DiLoCo where
the region link is slow and synchronous MiCS where it keeps up. Pure functions, no processes."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from lightning_mics.plan import main as plan_main
from lightning_mics.planner import CLUSTER_PRESETS, MODEL_PRESETS, ClusterSpec, TrainingSpec, estimate, plan
from lightning_mics.planner.cost_model import GroupShape, collective_cost
from lightning_mics.schedule import StepLayout, UnitSize, step_schedule
from lightning_mics.sharding_spec import ShardingSpec

UNITS = [UnitSize(1000, 1000, True), UnitSize(600, 400, True), UnitSize(90, 90, False)]
GBPS = 1e9 / 8
#: 2 regions x 2 nodes x 8 A100s, 400 Gbps inside a region; the region link set per test
P4D = replace(CLUSTER_PRESETS["p4d"], nodes=4)
MODEL = MODEL_PRESETS["gpt-1.3b"]
TRAINING = TrainingSpec(micro_batch=2, accumulation=4)


def regions(bandwidth_gbps: float, inside_gbps: float = 400) -> ClusterSpec:
    return replace(P4D, nodes_per_region=2, region_bandwidth=bandwidth_gbps * GBPS,
                   inter_node_bandwidth=inside_gbps * GBPS * 0.8)


def test_the_two_level_schedule_syncs_a_workers_replicas_every_step_and_the_workers_every_h() -> None:
    layout = StepLayout(partition_size=2, world_size=16, accumulation=3, sync_every=8, worker_size=2)
    schedule = step_schedule(UNITS, layout)
    (inner,) = {(e.phase, e.kind, e.group_size, e.every_steps) for e in schedule if e.group == "replication"}
    assert inner == ("boundary", "all_reduce", 2, 1)  # every step, across the worker's two partition groups
    (outer,) = [e for e in schedule if e.group == "outer_replication"]
    assert (outer.phase, outer.kind, outer.group_size, outer.every_steps) == ("post_step", "all_reduce", 4, 8)
    assert outer.payload_bytes == (1000 + 400 + 90) // 2 * 4
    flat = step_schedule(UNITS, StepLayout(partition_size=2, world_size=16, accumulation=3, sync_every=8))
    assert not [e for e in flat if e.phase == "boundary" and e.group == "replication"]
    with pytest.raises(ValueError, match="worker_size=3 must divide the 8 partition groups"):
        StepLayout(partition_size=2, world_size=16, accumulation=1, sync_every=8, worker_size=3)


def test_a_ring_across_regions_shares_the_region_link() -> None:
    cluster = regions(10)
    inside = GroupShape.strided(2, 8, 8, ranks_per_region=16)  # two nodes of one region
    across = GroupShape.strided(2, 16, 8, ranks_per_region=16)  # one rank in each region
    assert (inside.regions, across.regions) == (1, 2)
    message = 1e9
    near = collective_cost("all_reduce", message, inside, cluster).time_s
    far = collective_cost("all_reduce", message, across, cluster).time_s
    # 16 rings share one 10 Gbps link: each gets 1/16 of it
    assert far == pytest.approx(2 * (0.001 + 0.5 * message / (10 * GBPS / 16)), rel=1e-9)
    assert far > 20 * near


def test_a_slow_region_link_gets_two_level_diloco() -> None:
    result = plan(regions(2), MODEL, TRAINING, uniform_only=True)
    advice = result.semi_sync_advice
    assert advice is not None and advice.synchronous_region_ranks == 16
    semi = advice.semi_sync
    assert semi.layout.grads * semi.diloco_worker_size == 16  # a worker is a region
    text = result.explain()
    assert "Two-level: synchronous inside each region" in text and "DiLoCo across regions only" in text
    # the synchronous plan pays the region link at every step; two-level pays it once every H
    assert semi.step_time_s < result.winner.step_time_s


def test_a_region_link_as_fast_as_the_zones_gets_synchronous_mics() -> None:
    result = plan(regions(400), MODEL, TRAINING, uniform_only=True)
    assert result.semi_sync_advice is None and result.winner.sync_every is None
    assert "synchronous MiCS, no DiLoCo needed" in result.explain()


def test_slow_links_inside_a_region_too_get_flat_diloco() -> None:
    result = plan(regions(2, inside_gbps=2), MODEL, TRAINING, uniform_only=True)
    advice = result.semi_sync_advice
    assert advice is not None
    assert advice.semi_sync.layout.grads * advice.semi_sync.diloco_worker_size < 16
    assert "Flat: DiLoCo workers of 8 ranks, smaller than a region of 16" in result.explain()
    one_rank = replace(advice.semi_sync, layout=replace(advice.semi_sync.layout, params=1, grads=1, optim=1))
    assert "Flat: DiLoCo workers of 1 rank, smaller" in replace(advice, semi_sync=one_rank).explain()


def test_a_two_level_estimate_prices_the_inner_hop_every_step_and_the_outer_every_h() -> None:
    cluster = regions(2)
    node = ShardingSpec(params=8, grads=8, optim=8)
    flat = estimate(node, cluster, MODEL, replace(TRAINING, sync_every=32))
    two_level = estimate(node, cluster, MODEL, replace(TRAINING, sync_every=32, diloco_worker_size="region"))
    assert two_level.diloco_worker_size == 2 and flat.diloco_worker_size == 1
    assert two_level.inter_node_bytes > flat.inter_node_bytes  # the per-step hop 2 between a region's nodes
    with pytest.raises(ValueError, match="does not tile whole nodes"):
        estimate(ShardingSpec(params=4, grads=4, optim=4), cluster, MODEL,
                 replace(TRAINING, sync_every=32, diloco_worker_size=3))


def test_the_specs_refuse_half_given_regions_and_a_worker_without_h() -> None:
    with pytest.raises(ValueError, match="nodes_per_region and region_bandwidth are given together"):
        replace(P4D, nodes_per_region=2)
    with pytest.raises(ValueError, match="nodes_per_region=3 must be a positive int dividing nodes=4"):
        replace(P4D, nodes_per_region=3, region_bandwidth=GBPS)
    with pytest.raises(ValueError, match="needs sync_every"):
        TrainingSpec(diloco_worker_size=2)


def test_plan_cli_weighs_the_region_link(capsys: pytest.CaptureFixture[str]) -> None:
    common = ["--cluster", "p4d", "--nodes", "4", "--nodes-per-region", "2", "--model", "gpt-1.3b",
              "--micro-batch", "2", "--accumulation", "4", "--uniform-only", "--top", "3"]
    assert plan_main([*common, "--region-bandwidth", "2Gbps"]) == 0
    slow = capsys.readouterr().out
    assert "2 regions of 2 nodes joined at 2 Gbps" in slow and "Two-level" in slow
    assert plan_main([*common, "--region-bandwidth", "400Gbps"]) == 0
    assert "synchronous MiCS, no DiLoCo needed" in capsys.readouterr().out
    assert plan_main([*common, "--region-bandwidth", "2Gbps", "--sync-every", "32", "--diloco-worker-size",
                      "region", "--json"]) == 0
    priced = json.loads(capsys.readouterr().out)
    assert priced["winner"]["diloco_worker_size"] * priced["winner"]["grads_degree"] == 16
    with pytest.raises(SystemExit):
        plan_main([*common, "--region-bandwidth", "2Gbps", "--diloco-worker-size", "zero"])
    assert "neither a number of partition groups nor 'region'" in capsys.readouterr().err
