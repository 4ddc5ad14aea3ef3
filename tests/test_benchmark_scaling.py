"""The pure parts of the emulated-cluster benchmark's wire floor and ``--scaling`` mode: argument
parsing, the floor's arithmetic, the analytic bytes per node as nodes are added, the scaling report,
its chart and the planner's per-point comparison. No root, namespaces or rank processes."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from benchmarks import compare_planner, emulated_analysis, emulated_cluster, emulated_modes, emulated_report, scaling
from benchmarks.comm_model import (
    expected_inter_node_bytes_per_node,
    fsdp2_unit_numel,
    gpt_fsdp_units,
)
from benchmarks.scenarios import ClusterShape, TrainingSetup, default_strategies
from examples.models import GPTConfig

#: the model of a --quick run (a tiny model's padding to 6 ranks outweighs ZeRO-3's ring growth)
QUICK = emulated_cluster.QUICK
SETUP = TrainingSetup(GPTConfig(seq_len=8, d_model=QUICK.d_model, n_layers=QUICK.n_layers, n_heads=QUICK.n_heads),
                      micro_batch=1, accumulate=4, warmup_steps=0, measured_steps=1)


# ------------------------------------------------------------------------------------ arguments
def test_scaling_defaults() -> None:
    args = emulated_cluster.parse_args(["--quick", "--scaling"])
    assert args.node_counts == (2, 3, 4) and args.ranks_per_node == 2
    assert [(shape.num_nodes, shape.ranks_per_node) for shape, _ in args.points] == [(2, 2), (3, 2), (4, 2)]
    for _, specs in args.points:
        assert [s.name for s in specs] == ["mics", "mics-auto", "fsdp-hybrid", "ddp", "zero3"]
    assert args.output_dir == emulated_cluster.RESULTS_DIR / "scaling"
    single = emulated_cluster.parse_args(["--quick"])  # a plain run is unchanged: 2 nodes x 4 ranks
    assert (single.cluster.num_nodes, single.cluster.ranks_per_node, len(single.points)) == (2, 4, 1)
    assert single.output_dir == emulated_cluster.RESULTS_DIR


def test_scaling_nodes_are_sorted_and_other_options_carry_over() -> None:
    args = emulated_cluster.parse_args(["--scaling", "--scaling-nodes", "4,2", "--ranks-per-node", "3",
                                        "--strategies", "zero3,mics", "--steps", "1"])
    assert [shape.num_nodes for shape, _ in args.points] == [2, 4]
    assert {shape.ranks_per_node for shape, _ in args.points} == {3}
    assert [s.partition_size for s in args.points[1][1]] == [12, 3]  # zero3 = world, mics = node
    assert args.setup.measured_steps == 1


def test_three_and_four_node_rows_fit_the_layout_rules() -> None:
    for nodes in (3, 4):
        shape = ClusterShape(nodes, 2)
        specs = {s.name: s for s in default_strategies(shape)}
        assert specs["zero3"].partition_size == 2 * nodes and specs["mics"].partition_size == 2
        assert specs["fsdp-hybrid"].replication_degree(shape) == nodes


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--scaling", "--nodes", "3"], "--nodes and --scaling exclude each other"),
        (["--scaling-nodes", "2,3"], "--scaling-nodes only applies with --scaling"),
        (["--scaling", "--scaling-nodes", "1,2"], "distinct comma-separated node counts >= 2"),
        (["--scaling", "--scaling-nodes", "2,2"], "distinct comma-separated node counts >= 2"),
        (["--scaling", "--scaling-nodes", "two"], "distinct comma-separated node counts >= 2"),
        (["--scaling", "--strategies", "mics-2node-hier"], "for 3 nodes"),  # not at every node count
    ],
)
def test_bad_scaling_arguments_get_one_clear_error(argv: list[str], message: str,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        emulated_cluster.parse_args(["--quick", *argv])
    assert message in capsys.readouterr().err


# ------------------------------------------------------------------------------------ wire floor
def _ok_record(**extra: Any) -> dict[str, Any]:
    return {"strategy": "mics", "partition_size": 2, "hierarchical": False, "status": "ok", "step_time_s": 2.0,
            "tokens_per_s": 64.0, "inter_node_bytes_per_step": 100e6, "expected_inter_node_bytes_per_step": 99e6,
            "inter_node_error": 0.01, "loopback_bytes_per_step": 5e6, "expected_loopback_bytes_per_step": 5e6,
            "peak_mem_bytes": 4e8, "grad_bytes_during_accumulation": 1e6, **extra}


def test_wire_floor_uses_the_busiest_measured_direction() -> None:
    record = _ok_record(inter_node_tx_bytes_per_step_per_node=[40e6, 60e6],
                        inter_node_rx_bytes_per_step_per_node=[70e6, 30e6])
    emulated_analysis.add_wire_floor(record, link_bytes_per_s=50e6, num_nodes=2)
    assert record["inter_node_bytes_per_direction_per_step"] == 70e6  # node 0's ingress
    assert record["wire_floor_s"] == pytest.approx(1.4)
    assert record["step_over_floor"] == pytest.approx(2.0 / 1.4)
    assert "tx/rx counters" in record["wire_floor_basis"]
    text = emulated_report.format_table([record])
    assert "floor s" in text and "1.40" in text and "1.43x" in text
    assert "| 1.40 | 1.43x |" in emulated_report.format_markdown([record])


def test_wire_floor_from_the_total_assumes_symmetric_traffic() -> None:
    record = emulated_analysis.add_wire_floor(_ok_record(), link_bytes_per_s=25e6, num_nodes=4)
    assert record["inter_node_bytes_per_direction_per_step"] == pytest.approx(25e6)  # 100 MB sent by 4 nodes
    assert (record["wire_floor_s"], record["step_over_floor"]) == (pytest.approx(1.0), pytest.approx(2.0))
    assert "symmetric" in record["wire_floor_basis"]
    failed = emulated_analysis.add_wire_floor({"strategy": "zero3", "status": "failed: x"}, 25e6, 4)
    assert "wire_floor_s" not in failed


def test_link_rate_prefers_the_measured_stream() -> None:
    assert scaling.link_rate({"inter_node_measured_bytes_per_s": 9e7, "inter_node_rate_bytes_per_s": 1e8}) == 9e7
    assert scaling.link_rate({"inter_node_rate_bytes_per_s": 1e8}) == 1e8


def test_worker_keeps_each_nodes_counters_per_measured_step() -> None:
    from benchmarks.emulated_probes import per_node_means

    leaders = [  # out of order on purpose: the result is in node order
        {"rank": 2, "boundaries": [{"uplink_tx": 0}, {"uplink_tx": 500}, {"uplink_tx": 700}, {"uplink_tx": 1100}]},
        {"rank": 0, "boundaries": [{"uplink_tx": 0}, {"uplink_tx": 900}, {"uplink_tx": 1000}, {"uplink_tx": 1300}]},
    ]
    assert per_node_means(leaders, "uplink_tx", warmup_steps=1) == [200.0, 300.0]


# ------------------------------------------------------------------------------------ bytes per node vs nodes
def test_mics_bytes_per_node_follow_the_ring_all_reduce_and_zero3_stays_far_above() -> None:
    """MiCS (partition = node) crosses nodes only in the boundary all-reduce of each rank's shard over
    the N replicas: gloo's ring sends 2 (N - 1) / N of the node's shards per node -- 1x, 4/3x, 3/2x
    the padded model from 2 to 4 nodes, never above 2x. ZeRO-3's world rings grow too, from far higher."""
    model_bytes = sum(fsdp2_unit_numel(u, 2) for u in gpt_fsdp_units(SETUP.model)) * 4
    mics, zero3 = {}, {}
    for nodes in (2, 3, 4):
        shape = ClusterShape(nodes, 2)
        specs = {s.name: s for s in default_strategies(shape)}
        mics[nodes] = expected_inter_node_bytes_per_node(specs["mics"], shape, SETUP)
        zero3[nodes] = expected_inter_node_bytes_per_node(specs["zero3"], shape, SETUP)
        assert mics[nodes] == pytest.approx(2 * (nodes - 1) / nodes * model_bytes)
        assert mics[nodes] < 2 * model_bytes
        assert zero3[nodes] > 5 * mics[nodes]
    assert mics[3] / mics[2] == pytest.approx(4 / 3) and mics[4] / mics[2] == pytest.approx(3 / 2)
    assert zero3[2] < zero3[3] < zero3[4]
    # a world ring of n = 2N ranks carries (n - 1) / n of each payload per node: 3/4 -> 7/8 (padding aside)
    assert zero3[4] / zero3[2] == pytest.approx((7 / 8) / (3 / 4), rel=0.02)


# ------------------------------------------------------------------------------------ report, chart, planner
def _point(nodes: int, compute_flops: float, slowdown: float = 1.0) -> dict[str, Any]:
    """One scaling point in the emulated_cluster.json schema; measured step times are the planner's
    own prediction at ``compute_flops`` (times ``slowdown``), so the comparison has a known answer."""
    rows = [
        {"strategy": "mics", "family": "mics", "partition_size": 2, "hierarchical": False},
        {"strategy": "mics-auto", "family": "mics", "partition_size": 2, "params_degree": 1, "optim_degree": 2,
         "grad_accumulation": "unsharded", "hierarchical": False, "planned": True,
         "planner_cluster_spec": {"intra_node_latency": 1e-4, "inter_node_latency": 2e-4,
                                  "compute_flops": compute_flops}},
        {"strategy": "fsdp-hybrid", "family": "fsdp1", "partition_size": 2},
        {"strategy": "ddp", "family": "ddp", "partition_size": 1},
        {"strategy": "zero3", "family": "mics", "partition_size": 2 * nodes, "hierarchical": False},
    ]
    report = {
        "network": {"loopback_per_node_bytes_per_s": 2e9, "inter_node_rate_bytes_per_s": 1e8,
                    "inter_node_measured_bytes_per_s": 9e7},
        "cluster": {"num_nodes": nodes, "ranks_per_node": 2},
        "setup": {"model": {"seq_len": 8, "d_model": 64, "n_layers": 2, "n_heads": 2}, "micro_batch": 1,
                  "accumulate": 4, "tokens_per_step": 32 * 2 * nodes},
        "results": rows,
    }
    for row in rows:
        row["status"] = "ok"  # before the cluster is read: the planned row's latencies count only then
    args = compare_planner.build_parser().parse_args(["--compute-flops", str(compute_flops)])
    cluster = compare_planner.cluster_from_report(report, args)
    model, training = compare_planner.model_from_report(report)
    for i, row in enumerate(rows):
        step = compare_planner.predict(row, cluster, model, training).step_time_s * slowdown
        row.update(step_time_s=step, tokens_per_s=32 * 2 * nodes / step,
                   inter_node_bytes_per_step=(i + 1) * 1e6 * nodes, expected_inter_node_bytes_per_step=nodes * 1e6)
        emulated_analysis.add_wire_floor(row, scaling.link_rate(report["network"]), nodes)
    report["results"].append({"strategy": "broken", "partition_size": 2, "status": "failed: timed out"})
    return report


def test_scaling_report_rows_and_predictions() -> None:
    points = [_point(2, 3e9), _point(3, 3e9, slowdown=1.5)]
    for point in points:
        point["planner_predictions"] = scaling.point_predictions(point)
    report = scaling.build_scaling_report(points, "cmd")
    assert report["nodes"] == [2, 3] and report["ranks_per_node"] == 2 and "tokens_per_step" not in report["setup"]
    rows = {(r["nodes"], r["strategy"]): r for r in report["rows"]}
    ddp3 = rows[(3, "ddp")]
    assert ddp3["tokens_per_s_per_node"] == pytest.approx(ddp3["tokens_per_s"] / 3)
    assert ddp3["inter_node_bytes_per_node_per_step"] == pytest.approx(4e6)  # 4 MB x 3 nodes, per node
    assert ddp3["expected_inter_node_bytes_per_node_per_step"] == pytest.approx(1e6)
    assert ddp3["wire_floor_s"] == pytest.approx(4e6 / 9e7)  # total / nodes over the measured rate
    # calibrated: the planner at the rate it measured; the 3-node point ran 1.5x slower than that
    assert rows[(2, "zero3")]["prediction_error_calibrated"] == pytest.approx(0.0, abs=1e-9)
    assert rows[(3, "zero3")]["prediction_error_calibrated"] == pytest.approx(1 / 1.5 - 1)
    # fitted: one rate per point; at 2 nodes it finds the rate the times were made with (2 % grid)
    assert points[0]["planner_predictions"]["fitted"]["compute_flops"] == pytest.approx(3e9, rel=0.025)
    assert all(abs(rows[(2, name)]["prediction_error"]) < 0.03 for name in scaling.SCALING_STRATEGIES)
    mics3 = rows[(3, "mics")]
    assert mics3["prediction_error"] == pytest.approx(mics3["predicted_step_time_s"] / mics3["step_time_s"] - 1)
    assert rows[(3, "broken")]["status"] == "failed: timed out" and "step_time_s" not in rows[(3, "broken")]
    text = scaling.format_scaling_table(report["rows"])
    assert "tokens/s/node" in text and "failed: timed out" in text and "-33%" in text
    assert scaling.format_scaling_table(report["rows"], markdown=True).count("\n") == len(report["rows"]) + 1


def test_prediction_without_a_calibrated_row_keeps_the_measurements() -> None:
    point = _point(2, 3e9)
    point["results"] = [r for r in point["results"] if r["strategy"] != "mics-auto"]
    predictions = scaling.point_predictions(point)
    assert "no mics-auto row" in predictions["calibrated"]["error"]
    assert set(predictions["fitted"]["rows"]) == {"mics", "fsdp-hybrid", "ddp", "zero3"}


def test_scaling_chart_and_compare_planner(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    report = scaling.build_scaling_report([_point(2, 3e9), _point(4, 2e9, slowdown=1.1)], "cmd")
    assert scaling.series(report["rows"], "tokens_per_s_per_node")["zero3"][0] == [2, 4]
    chart = scaling.draw_scaling(report, tmp_path / "scaling.png")
    assert chart is not None and chart.read_bytes()[:4] == b"\x89PNG"
    path = tmp_path / "scaling.json"
    path.write_text(json.dumps(report))
    assert compare_planner.main(["--results", str(path), "--json", "--calibrated-compute"]) == 0
    rows = {(r["nodes"], r["strategy"]): r for r in json.loads(capsys.readouterr().out)["rows"]}
    assert rows[(2, "mics")]["step_time_error"] == pytest.approx(0.0, abs=1e-9)
    assert rows[(4, "mics")]["step_time_error"] == pytest.approx(1 / 1.1 - 1)
    assert rows[(4, "broken")]["status"] == "failed: timed out"
    assert compare_planner.main(["--results", str(path), "--fit-compute"]) == 0
    out = capsys.readouterr().out
    assert "10/10 (nodes, strategy) points within +-20%" in out and out.count("(fitted)") == 2
    assert compare_planner.main(["--results", str(path)]) == 2  # no compute rate: one clear error
    assert "--calibrated-compute" in capsys.readouterr().err


def test_run_scaling_keeps_the_first_points_link_rate(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every node count gets the link rate the first point calibrated, and scaling.json is written
    after every point (a late failure keeps the earlier ones)."""
    args = emulated_cluster.parse_args(["--quick", "--scaling", "--scaling-nodes", "2,3", "--output-dir",
                                        str(tmp_path), "--profile-dir", str(tmp_path / "prof")])
    seen: list[tuple[int, Any, Path]] = []

    def fake_measure(point: Any, command: str) -> dict[str, Any]:
        seen.append((point.cluster.num_nodes, point.fixed_rate_bytes_per_s, point.profile_dir))
        report = _point(point.cluster.num_nodes, 3e9)
        if point.cluster.num_nodes == 3:
            assert json.loads((tmp_path / "scaling.json").read_text())["nodes"] == [2]
        return report

    monkeypatch.setattr(emulated_modes, "measure_point", fake_measure)
    assert emulated_modes.run_scaling(args, "cmd") == 1  # the synthetic points hold a failed row
    assert seen == [(2, None, tmp_path / "prof" / "nodes2"), (3, 1e8, tmp_path / "prof" / "nodes3")]
    written = json.loads((tmp_path / "scaling.json").read_text())
    assert written["nodes"] == [2, 3] and (tmp_path / "scaling.png").exists()
    assert written["points"][1]["planner_predictions"]["fitted"]["rows"]["zero3"]["status"] == "ok"
