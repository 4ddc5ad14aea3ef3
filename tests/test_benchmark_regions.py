"""The emulated cluster's region level (``--regions``) without root: the namespaces' layout, the region links'
counters, the byte model per level (two-level DiLoCo's inner and outer groups), measured against modelled bytes,
the planner's H for each DiLoCo mode, two-level DiLoCo's three ratios, the report and the command line.

In detail: a bridge per region and one shaped link per region to the core bridge; bytes inside a region across
nodes and across regions; the planner asked on the cluster with its regions. The end-to-end run is
``tests/test_benchmark_convergence.py``'s smoke (root)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any, Optional

import pytest

from benchmarks import convergence, emulated_cluster
from benchmarks.comm_model import (
    LevelBytes,
    RingCollective,
    expected_level_bytes,
    expected_step_bytes,
    level_wire_bytes,
    step_collectives,
)
from benchmarks.convergence_analysis import analyse_point
from benchmarks.convergence_regions import (
    PLANNED_ROW,
    TWO_LEVEL_ROW,
    build_regions_report,
    mode_sync_every,
    region_ratios,
    regions_planner_answer,
    resolve_region_rows,
)
from benchmarks.convergence_report import REGIONS_NOT_MEASURED, regions_figure_markdown
from benchmarks.emulated_analysis import add_expectations, level_bytes
from benchmarks.netns import EmulatedCluster
from benchmarks.netns_regions import RegionLayout, parse_net_dev, region_counters, region_deltas, region_layout
from benchmarks.scenarios import ClusterShape, TrainingSetup, diloco_spec, select_strategies, two_level_spec
from examples.models import GPTConfig

SHAPE = ClusterShape(4, 2)  # two regions of two nodes of two ranks
SETUP = TrainingSetup(GPTConfig(seq_len=8, d_model=32, n_layers=2, n_heads=2), micro_batch=2, accumulate=4,
                      warmup_steps=0, measured_steps=8)
MB = 1_000_000


# ------------------------------------------------------------------------------------------------ namespaces
def test_a_bridge_per_region_joined_by_one_link_per_region() -> None:
    layout = RegionLayout(num_nodes=4, nodes_per_region=2)
    assert layout.regions == 2 and [layout.region_of(n) for n in range(4)] == [0, 0, 1, 1]
    assert layout.nodes_of(1) == [2, 3]
    assert [layout.port_bridge(n) for n in range(4)] == ["rbr0", "rbr0", "rbr1", "rbr1"]
    commands = layout.switch_commands("sw", mtu=9000)
    assert all(c[:3] == ["ip", "-n", "sw"] for c in commands)  # everything inside the switch namespace
    joined = [" ".join(c[3:]) for c in commands]
    assert joined.count("link add br0 type bridge") == 1  # the core bridge, where the switch's own address goes
    assert [j for j in joined if j.endswith("type bridge")] == ["link add br0 type bridge", "link add rbr0 type bridge",
                                                                "link add rbr1 type bridge"]
    for region in (0, 1):
        assert f"link add rlink{region} mtu 9000 type veth peer name rcore{region} mtu 9000" in joined
        assert f"link set rlink{region} master rbr{region}" in joined and f"link set rcore{region} master br0" in joined
    assert layout.shaped_devices() == ["rlink0", "rcore0", "rlink1", "rcore1"]  # both directions of each link
    assert layout.probe_pairs() == [(1, 0), (3, 0)]  # inside region 0, and across a region link
    assert RegionLayout(6, 3).regions == 2 and RegionLayout(4, 1).probe_pairs() == [(3, 0)]
    with pytest.raises(ValueError, match="dividing the 4 nodes"):
        RegionLayout(4, 3)
    with pytest.raises(ValueError, match="one region"):
        RegionLayout(4, 4)
    with pytest.raises(ValueError, match="not one of the 4 nodes"):
        layout.region_of(4)


def test_the_cluster_with_regions_keeps_its_addresses_and_one_region_is_todays() -> None:
    cluster = EmulatedCluster(4, nodes_per_region=2)
    assert cluster.regions == RegionLayout(4, 2)
    assert [cluster.node_address(i) for i in range(4)] == ["198.18.0.1", "198.18.0.2", "198.18.0.3", "198.18.0.4"]
    assert cluster.namespaces == [cluster.node_namespace(i) for i in range(4)] + [cluster.switch_namespace]
    assert EmulatedCluster(4).regions is None and EmulatedCluster(4, nodes_per_region=4).regions is None
    assert region_layout(4, None) is None and EmulatedCluster(4).region_counter_file is None
    with pytest.raises(ValueError, match="dividing the 4 nodes"):
        EmulatedCluster(4, nodes_per_region=3)
    with pytest.raises(ValueError, match="one region"):
        EmulatedCluster(4).shape_regions(None)  # type: ignore[arg-type]


NET_DEV = """Inter-|   Receive                                                |  Transmit
 face |bytes    packets errs drop fifo frame compressed multicast|bytes    packets errs drop fifo colls carrier
    lo:       0       0    0    0    0     0          0         0        0       0    0    0    0     0       0    0
rlink0: 1000 10 0 0 0 0 0 0 2500 20 0 0 0 0 0 0
rcore0: 2500 20 0 0 0 0 0 0 1000 10 0 0 0 0 0 0
rlink1: 3000 30 0 0 0 0 0 0 4000 40 0 0 0 0 0 0
"""


def test_the_ranks_read_every_region_links_counters(tmp_path: Path) -> None:
    assert parse_net_dev(NET_DEV)["rlink1"] == {"rx_bytes": 3000, "tx_bytes": 4000}
    path = tmp_path / "dev"
    path.write_text(NET_DEV)
    start = region_counters(path)
    assert start == {"region0_tx": 2500, "region0_rx": 1000, "region1_tx": 4000, "region1_rx": 3000}
    assert region_counters(None) == {} and region_counters("") == {}
    end = {**start, "region0_tx": 2600, "region1_rx": 3500, "uplink_tx": 9}
    assert region_deltas(start, end) == {"tx": [100, 0], "rx": [0, 500]}
    assert region_deltas({"uplink_tx": 1}, {"uplink_tx": 2}) is None


# ------------------------------------------------------------------------------------------------ bytes per level
def test_ring_edges_split_into_inside_a_region_and_across_regions() -> None:
    four = level_wire_bytes([RingCollective("all_reduce", (0, 2, 4, 6), MB)], SHAPE, nodes_per_region=2)
    # edges 0-2 and 4-6 stay inside a region, 2-4 and 6-0 cross: each carries 2 * 3/4 of the buffer
    assert (four.inside_region, four.across_regions) == (pytest.approx(3 * MB), pytest.approx(3 * MB))
    pair = level_wire_bytes([RingCollective("all_reduce", (0, 4), MB, every_steps=8)], SHAPE, 2)
    assert (pair.inside_region, pair.across_regions) == (0, pytest.approx(2 * MB / 8))
    assert level_wire_bytes([RingCollective("all_gather", (0, 1), MB)], SHAPE, 2) == LevelBytes()  # one node
    assert four.inter_node == pytest.approx(6 * MB)


def test_two_level_diloco_runs_hop_2_inside_each_worker_and_the_outer_round_across_workers() -> None:
    spec = two_level_spec(SHAPE, 8, ranks_per_region=4)
    assert (spec.partition_size, spec.diloco_worker_size, spec.ranks_per_region, spec.sync_every) == (2, "region", 4, 8)
    assert spec.two_level and not diloco_spec(SHAPE, 8).two_level
    collectives = step_collectives(spec, SHAPE, SETUP)
    inner = {c.ranks for c in collectives if c.kind == "all_reduce" and c.every_steps == 1}
    outer = [c for c in collectives if c.every_steps == 8]
    assert inner == {(0, 2), (1, 3), (4, 6), (5, 7)}  # the same shard of a region's two partition groups
    assert {c.ranks for c in outer} == {(0, 4), (1, 5), (2, 6), (3, 7)}  # the same place in both workers
    levels = expected_level_bytes(spec, SHAPE, SETUP, nodes_per_region=2)
    payload = outer[0].payload_bytes
    assert levels.across_regions == pytest.approx(4 * 2 * payload / 8)  # only the outer round crosses
    assert levels.inter_node == pytest.approx(expected_step_bytes(spec, SHAPE, SETUP).inter_node)
    flat = expected_level_bytes(diloco_spec(SHAPE, 8), SHAPE, SETUP, 2)
    assert flat.across_regions > 0 and flat.inside_region == pytest.approx(flat.across_regions)  # one 4-node ring
    assert flat.across_regions < levels.across_regions  # the two-member outer ring crosses on both its edges
    synchronous = expected_level_bytes(select_strategies(SHAPE, ["mics-zero2"])[0], SHAPE, SETUP, 2)
    # hop 2 at every step on the same four-node rings that flat DiLoCo's round uses once every 8 steps
    assert synchronous.across_regions == pytest.approx(8 * flat.across_regions)


def test_measured_bytes_per_level_against_the_model() -> None:
    model = LevelBytes(inside_region=60.0, across_regions=50.0)
    close = level_bytes(measured_inter=112.0, measured_across=51.0, expected=model)
    assert close["inside_region"] == {"measured": 61.0, "expected": 60.0, "error": pytest.approx(1 / 60)}
    assert close["across_regions"]["error"] == pytest.approx(0.02) and close["within_target"]
    far = level_bytes(measured_inter=120.0, measured_across=60.0, expected=model)
    assert far["across_regions"]["error"] == pytest.approx(0.2) and not far["within_target"]
    missing = level_bytes(measured_inter=None, measured_across=None, expected=model)
    assert missing["inside_region"]["measured"] is None and not missing["within_target"]


def _args(nodes_per_region: Optional[int]) -> argparse.Namespace:
    return argparse.Namespace(cluster=SHAPE, setup=SETUP, nodes_per_region=nodes_per_region)


def test_a_throughput_rows_record_gets_its_bytes_per_level_only_with_regions() -> None:
    spec = two_level_spec(SHAPE, 8, ranks_per_region=4)
    model = expected_level_bytes(spec, SHAPE, SETUP, 2)
    record = {"status": "ok", "inter_node_bytes_per_step": model.inter_node * 1.05,
              "inter_node_rx_bytes_per_step_per_node": [model.inter_node / 4] * 4,
              "across_region_rx_bytes_per_step": model.across_regions * 1.03}
    out = add_expectations(dict(record), spec, _args(2))
    levels = out["bytes_per_level"]
    assert levels["across_regions"]["expected"] == pytest.approx(model.across_regions)
    assert levels["across_regions"]["error"] == pytest.approx(0.03)
    assert levels["inside_region"]["measured"] == pytest.approx(model.inter_node - model.across_regions * 1.03)
    assert levels["within_target"] and out["diloco_worker_size"] == 2
    assert "bytes_per_level" not in add_expectations(dict(record), spec, _args(None))


# ------------------------------------------------------------------------------------------------ planner
#: What mics-auto's strategy measured at set-up on 2 regions x 2 nodes x 2 ranks (node links 1/6 of loopback,
#: region links 1/240): its inter-node rings cross the region links, so its inter-node bandwidth is theirs.
CALIBRATED = {"nodes": 4, "gpus_per_node": 2, "gpu_memory_bytes": 1.0, "intra_node_bandwidth": 4.1e8,
              "inter_node_bandwidth": 1.93e6, "compute_flops": 3e10, "intra_node_latency": 3.9e-3,
              "inter_node_latency": 0.0, "memory_bandwidth": 8.4e8, "overlap": 0.0, "hop2_overlap": 1.0,
              "name": "calibrated"}
CONVERGENCE = emulated_cluster.parse_args(["--convergence", "--regions", "2"])
MIC_AUTO = {"strategy": "mics-auto", "status": "ok", "planner_cluster_spec": CALIBRATED,
            "compute_micro_step_s": 0.0189, "device_memory_bytes": 1.26e10}
NODE_LINK, REGION_LINK = 8.86e7, 2.21e6


def _busy_enough(answer: dict[str, Any], worker: Any, every: int) -> bool:
    """The library's rule for one H, straight from lightning_mics.planner.plan."""
    from dataclasses import replace

    from lightning_mics.planner import ClusterSpec, TrainingSpec, plan

    cluster = ClusterSpec(**answer["inputs"]["cluster"])
    model = CONVERGENCE.setup.model.model_spec(name="benchmark GPT")
    setup = CONVERGENCE.setup
    training = TrainingSpec(micro_batch=setup.micro_batch, accumulation=setup.accumulate, precision="32-true")
    synchronous = plan(cluster, model, training, grad_accumulation="auto").winner
    semi = plan(cluster, model, replace(training, sync_every=every, diloco_worker_size=worker),
                grad_accumulation="auto").winner
    return semi.busy_fraction >= 0.5 and semi.step_time_s < synchronous.step_time_s


def test_the_planner_is_asked_for_each_modes_h_on_the_cluster_with_its_regions() -> None:
    from lightning_mics.planner import ClusterSpec, TrainingSpec

    answer = regions_planner_answer(MIC_AUTO, CONVERGENCE.setup, 2, NODE_LINK, REGION_LINK)
    cluster = answer["inputs"]["cluster"]
    assert cluster["nodes_per_region"] == 2 and cluster["region_bandwidth"] == REGION_LINK
    assert cluster["inter_node_bandwidth"] == pytest.approx(1.93e6 * NODE_LINK / REGION_LINK)  # the node links' own
    flat, two = answer["modes"]["flat"], answer["modes"]["two_level"]
    assert flat["diloco_worker_size"] == 1 and two["diloco_worker_size"] * 2 == 4  # a worker is a region
    for mode, worker in ((flat, 1), (two, "region")):  # the smallest H of the list that passes the rule
        assert _busy_enough(answer, worker, mode["sync_every"])
        assert not _busy_enough(answer, worker, mode["sync_every"] // 2)
    assert answer["sync_every"] == two["sync_every"] and answer["advice_sync_every"] in (two["sync_every"], None)
    assert regions_planner_answer({**MIC_AUTO, "status": "failed"}, CONVERGENCE.setup, 2, NODE_LINK, REGION_LINK) \
        is None
    # region links as fast as the node links: synchronous MiCS keeps the ranks busy, neither mode gets an H
    fast = regions_planner_answer({**MIC_AUTO, "planner_cluster_spec": {**CALIBRATED, "inter_node_bandwidth": 8e7}},
                                  CONVERGENCE.setup, 2, NODE_LINK, NODE_LINK)
    assert fast["modes"] == {"flat": None, "two_level": None}
    rows = resolve_region_rows(answer, [PLANNED_ROW, TWO_LEVEL_ROW], SHAPE, 4, None)
    assert [(placeholder, spec.name) for placeholder, spec in rows] == [
        (PLANNED_ROW, f"mics-diloco-h{flat['sync_every']}"),
        (TWO_LEVEL_ROW, f"mics-diloco-two-level-h{two['sync_every']}")]
    two_level = rows[1][1]
    assert (two_level.diloco_worker_size, two_level.ranks_per_region, two_level.partition_size) == ("region", 4, 2)
    assert resolve_region_rows(fast, [TWO_LEVEL_ROW], SHAPE, 4, None) == [(TWO_LEVEL_ROW, None)]
    assert mode_sync_every(ClusterSpec(**fast["inputs"]["cluster"]), CONVERGENCE.setup.model.model_spec(),
                           TrainingSpec(micro_batch=2, accumulation=4), "region") is None


# ------------------------------------------------------------------------------------------------ ratios, report
def run(name: str, heldout: list[float], seconds_per_step: float, seed: int, sync_every: Optional[int] = None,
        eval_every: int = 4) -> dict[str, Any]:
    """A worker's record of one row and seed: a held-out loss every ``eval_every`` steps of ``seconds_per_step``."""
    n = len(heldout) * eval_every
    return {
        "strategy": name, "status": "ok", "seed": seed, "sync_every": sync_every, "tokens_per_step": 100,
        "steps": [{"step": i + 1, "time_s": (i + 1) * seconds_per_step, "loss": 5.0} for i in range(n)],
        "evals": [{"step": (k + 1) * eval_every, "time_s": (k + 1) * eval_every * seconds_per_step,
                   "heldout_loss": loss, "computed": True, "eval_s": 0.1} for k, loss in enumerate(heldout)],
        "eval_s": 0.1, "inter_node_tx_bytes_per_node": [1.0] * 4, "inter_node_rx_bytes_per_node": [1.0] * 4,
        "bytes_per_level": {"inside_region": {"measured": 1.0, "expected": 1.0, "error": 0.0},
                            "across_regions": {"measured": 1.0, "expected": 1.0, "error": 0.0},
                            "target_error": 0.1, "within_target": True},
    }


def two_seeds() -> list[dict[str, Any]]:
    """mics-auto: 16 steps of 1 s down to 1.5; flat DiLoCo (0.3 s a step) reaches 1.5 at step 16 (seed 0) / 12;
    two-level (0.25 s a step) at step 8 / 8."""
    runs = []
    for seed, (flat, two) in enumerate([([3.0, 2.0, 1.7, 1.5, 1.45, 1.4], [2.5, 1.5, 1.4, 1.35, 1.3, 1.28]),
                                        ([3.0, 2.0, 1.5, 1.45, 1.4, 1.4], [2.5, 1.45, 1.4, 1.4, 1.4, 1.47])]):
        runs += [run("mics-auto", [4.0, 3.0, 2.0, 1.5], 1.0, seed),
                 run("mics-diloco-h16", flat, 0.3, seed, sync_every=16),
                 run("mics-diloco-two-level-h32", two, 0.25, seed, sync_every=32)]
    return runs


ROWS = {"flat": "mics-diloco-h16", "two_level": "mics-diloco-two-level-h32"}


def test_two_levels_three_ratios_per_seed_and_their_means() -> None:
    point = {"runs": two_seeds(), "network": {"inter_node_rate_bytes_per_s": 1e6},
             "planner": {"row": ROWS["two_level"], "rows": ROWS}}
    comparison = analyse_point(point, window=1)["comparison"]
    ratios = region_ratios(comparison, ROWS["flat"], ROWS["two_level"])
    first, second = ratios["seeds"]
    assert first["time_to_sync_final_loss_ratio"] == pytest.approx(2.0 / 16)  # step 8 at 0.25 s, over 16 s
    assert first["time_to_flat_diloco_ratio"] == pytest.approx(2.0 / 4.8)  # flat: step 16 at 0.3 s
    assert first["final_loss_ratio"] == pytest.approx(1.28 / 1.5)
    assert second["time_to_flat_diloco_ratio"] == pytest.approx(2.0 / 3.6)  # flat: step 12
    assert second["final_loss_ratio"] == pytest.approx(1.47 / 1.5)
    assert ratios["time_to_sync_final_loss_ratio"] == pytest.approx(2.0 / 16)
    assert ratios["time_to_flat_diloco_ratio"] == pytest.approx((2.0 / 4.8 + 2.0 / 3.6) / 2)
    assert ratios["final_loss_ratio"] == pytest.approx((1.28 + 1.47) / 2 / 1.5)
    assert ratios["targets_met"] == {"time_to_sync_final_loss_ratio": True, "time_to_flat_diloco_ratio": True,
                                     "final_loss_ratio": True}
    # flat DiLoCo never reaching the loss in one seed: no ratio to it there, no mean; a worse final loss misses
    runs = two_seeds()
    runs[1] = run("mics-diloco-h16", [3.0, 2.0, 1.8, 1.7, 1.6, 1.6], 0.3, 0, sync_every=16)
    runs[5] = run("mics-diloco-two-level-h32", [2.5, 1.45, 1.5, 1.6, 1.7, 1.9], 0.25, 1, sync_every=32)
    comparison = analyse_point({**point, "runs": runs}, window=1)["comparison"]
    ratios = region_ratios(comparison, ROWS["flat"], ROWS["two_level"])
    assert ratios["seeds"][0]["time_to_flat_diloco_ratio"] is None and ratios["time_to_flat_diloco_ratio"] is None
    assert ratios["final_loss_ratio"] == pytest.approx((1.28 + 1.9) / 2 / 1.5)
    assert ratios["targets_met"] == {"time_to_sync_final_loss_ratio": True, "time_to_flat_diloco_ratio": False,
                                     "final_loss_ratio": False}


def test_the_regions_report_puts_two_levels_ratios_and_each_modes_h_on_top(tmp_path: Path) -> None:
    regions = {"regions": 2, "nodes_per_region": 2, "region_bandwidth_ratio": 240.0,
               "region_rate_bytes_per_s": 1e6, "region_measured_bytes_per_s": 0.98e6}
    network = {"inter_node_rate_bytes_per_s": 4e7, "inter_node_measured_bytes_per_s": 3.9e7}
    points = [{"bandwidth_ratio": 6.0, "network": network,
               "regions": regions,
               "planner": {"row": ROWS["two_level"], "sync_every": 32, "rows": ROWS, "flat_sync_every": 16,
                           "two_level_sync_every": 32}, "runs": two_seeds()}]
    report = build_regions_report(points, "python benchmarks/emulated_cluster.py --convergence --regions 2",
                                  {"window": 1, "entropy_rate": 1.0})
    assert report["time_to_sync_final_loss_ratio"] == pytest.approx(2.0 / 16)
    assert report["final_loss_ratio"] == pytest.approx((1.28 + 1.47) / 2 / 1.5)
    assert [s["seed"] for s in report["seeds"]] == [0, 1] and set(report["seeds"][0]) == {
        "seed", "time_to_sync_final_loss_ratio", "time_to_flat_diloco_ratio", "final_loss_ratio"}
    assert report["targets"] == {"time_to_sync_final_loss_ratio": 0.5, "time_to_flat_diloco_ratio": 0.8,
                                 "final_loss_ratio": 1.02}
    assert report["sync_every"] == {"flat": 16, "two_level": 32} and report["regions"] == regions
    assert report["rows_by_mode"] == {"synchronous": "mics-auto", **ROWS}
    assert report["headline_strategy"] == ROWS["two_level"] and report["bytes_per_level_within_target"]
    assert len(report["bytes_per_level"]) == 6 and "time_to_flat_diloco_ratio" in report["definitions"]
    json.dumps(report)
    block = regions_figure_markdown(report)  # docs/semi-sync.md's block, once the run exists
    assert "flat DiLoCo H = 16 (`mics-diloco-h16`) and two-level DiLoCo H = 32 (`mics-diloco-two-level-h32`)" in block
    unnamed = regions_figure_markdown({**report, "sync_every": {"flat": 16, "two_level": None}})
    assert "and no H for two-level DiLoCo (its row is skipped)" in unnamed
    assert "| time_to_flat_diloco_ratio | 0.486 | 0.417 / 0.556 | <= 0.8 | yes |" in block
    assert "convergence_regions.png" in block and regions_figure_markdown(None) == REGIONS_NOT_MEASURED
    # `python benchmarks/convergence.py convergence_regions.json` recomputes the two-level analysis, not the flat one
    report["time_to_flat_diloco_ratio"] = 9.0
    path = tmp_path / "convergence_regions.json"
    path.write_text(json.dumps(report))
    assert convergence.main([str(path)]) == 0
    again = json.loads(path.read_text())
    assert again["time_to_flat_diloco_ratio"] == pytest.approx((2.0 / 4.8 + 2.0 / 3.6) / 2)
    assert again["targets"] == report["targets"] and again["sync_every"] == {"flat": 16, "two_level": 32}


# ------------------------------------------------------------------------------------------------ command line
def test_regions_command_line() -> None:
    args = CONVERGENCE
    assert (args.cluster.num_nodes, args.cluster.ranks_per_node, args.nodes_per_region) == (4, 2, 2)
    assert [s.name for s in args.specs] == ["mics-auto"] and args.planned_rows == [PLANNED_ROW, TWO_LEVEL_ROW]
    assert args.ratios == (24.0,) and args.region_bandwidth_ratio == 240.0  # the cluster
    assert args.convergence_settings.seeds == (0, 1, 2)
    # the one-region mode's micro-batch per rank and its token budget: 128 steps of 1,024 tokens
    assert args.output_dir == emulated_cluster.RESULTS_DIR and args.setup.tokens_per_step(args.cluster) == 1024
    assert args.setup.measured_steps * 1024 == 131072
    smoke = emulated_cluster.parse_args(["--convergence", "--regions", "2", "--smoke"])
    assert smoke.convergence_settings.seeds == (0,) and smoke.region_bandwidth_ratio == 60.0
    assert smoke.ratios == (6.0,) and smoke.setup.tokens_per_step(smoke.cluster) == 512
    assert smoke.output_dir == emulated_cluster.RESULTS_DIR / "convergence_regions_smoke"
    single = emulated_cluster.parse_args(["--bandwidth-ratio", "24", "--regions", "2", "--region-bandwidth-ratio",
                                          "240", "--strategies", "mics-auto,mics-diloco-two-level-h8"])
    assert single.nodes_per_region == 2 and single.cluster.num_nodes == 4 and single.region_bandwidth_ratio == 240
    assert single.specs[1].diloco_worker_size == "region" and single.specs[1].ranks_per_region == 8
    today = emulated_cluster.parse_args([])
    assert today.regions == 1 and today.nodes_per_region is None and today.cluster.num_nodes == 2


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--regions", "3", "--nodes", "4"], "split the 4 nodes evenly"),
        (["--regions", "2", "--nodes", "2"], "regions of at least two nodes"),
        (["--regions", "0"], "--regions must be a positive int"),
        (["--region-bandwidth-ratio", "240"], "needs --regions 2 or more"),
        (["--regions", "2", "--scaling"], "--regions and --scaling exclude each other"),
        (["--regions", "2", "--region-bandwidth-ratio", "0"], "must be positive"),
        (["--convergence", "--strategies", f"mics-auto,{TWO_LEVEL_ROW}"], "needs --convergence and --regions"),
    ],
)
def test_bad_region_arguments_get_one_clear_error(argv: list[str], message: str,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        emulated_cluster.parse_args(argv)
    assert message in capsys.readouterr().err
