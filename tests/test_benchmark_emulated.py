"""The pure parts of the emulated-cluster benchmark: the gloo wire-byte model, the per-strategy schedules
(DeepSpeed's MiCS and ZeRO-3 rows and the opt-in DiLoCo rows included), argument validation, the refusals and the
tables' failure reasons. No root, namespaces or processes needed."""

from __future__ import annotations

from pathlib import Path

import pytest

from benchmarks import emulated_analysis, emulated_cluster, emulated_network, emulated_report, emulated_rows
from benchmarks.comm_model import (
    RingCollective,
    expected_step_bytes,
    fsdp1_unit_numel,
    fsdp2_unit_numel,
    gloo_wire_bytes,
    gpt_fsdp_units,
    gradient_bytes_held_during_accumulation,
    step_collectives,
)
from benchmarks.netns import EmulatedCluster, LinkShape, PrerequisiteError, check_prerequisites
from benchmarks.scenarios import (
    DILOCO_SYNC_EVERY,
    ClusterShape,
    StrategySpec,
    TrainingSetup,
    default_strategies,
    measured_steps_for,
    select_strategies,
)
from examples.models import GPTConfig

CLUSTER = ClusterShape(num_nodes=2, ranks_per_node=4)
SETUP = TrainingSetup(GPTConfig(seq_len=8, d_model=16, n_layers=2, n_heads=2), micro_batch=1, accumulate=4,
                      warmup_steps=0, measured_steps=1)
MB = 8_000_000


def spec(name: str):
    return {s.name: s for s in default_strategies(CLUSTER)}[name]


# ------------------------------------------------------------------------------------ wire bytes
def test_ring_all_reduce_over_two_nodes_crosses_two_edges() -> None:
    wire = gloo_wire_bytes(RingCollective("all_reduce", tuple(range(8)), MB), CLUSTER)
    per_edge = 2 * 7 / 8 * MB
    assert wire.inter_node == pytest.approx(2 * per_edge)  # edges 3-4 and 7-0
    assert wire.intra_node == pytest.approx(6 * per_edge)


def test_all_gather_and_reduce_scatter_shares() -> None:
    pair = (0, 4)  # same local index on both nodes: both ring edges cross
    assert gloo_wire_bytes(RingCollective("all_gather", pair, MB), CLUSTER).inter_node == pytest.approx(MB)
    # our ring reduce-scatter moves what an all-gather does; gloo's own all-reduces the whole input
    ring = gloo_wire_bytes(RingCollective("reduce_scatter", pair, MB, count=3), CLUSTER)
    assert ring.inter_node == pytest.approx(3 * MB)
    native = gloo_wire_bytes(RingCollective("reduce_scatter", pair, MB, count=3, via_all_reduce=True), CLUSTER)
    assert native.inter_node == pytest.approx(3 * 2 * MB)
    assert gloo_wire_bytes(RingCollective("all_reduce", (0, 1, 2, 3), MB), CLUSTER).inter_node == 0
    assert gloo_wire_bytes(RingCollective("all_reduce", (5,), MB), CLUSTER).inter_node == 0


# ------------------------------------------------------------------------------------ schedules
def test_units_and_padding() -> None:
    units = gpt_fsdp_units(SETUP.model)
    assert len(units) == SETUP.model.n_layers + 1 and not units[-1].reshard_after_forward
    total = sum(fsdp2_unit_numel(u, 1) for u in units)
    assert total == SETUP.model.num_params
    assert all(fsdp2_unit_numel(u, 8) >= fsdp2_unit_numel(u, 1) for u in units)
    assert all(fsdp1_unit_numel(u, 8) % 8 == 0 for u in units)


def test_mics_crosses_nodes_only_at_the_boundary() -> None:
    collectives = step_collectives(spec("mics"), CLUSTER, SETUP)
    crossing = [c for c in collectives if gloo_wire_bytes(c, CLUSTER).inter_node > 0]
    assert crossing and all(c.kind == "all_reduce" and c.count == 1 and len(c.ranks) == 2 for c in crossing)


def test_expected_ordering_of_inter_node_bytes() -> None:
    inter = {s.name: expected_step_bytes(s, CLUSTER, SETUP).inter_node for s in default_strategies(CLUSTER)}
    assert inter["mics"] < inter["mics-2node-hier"] < inter["mics-2node-flat"] == inter["zero3"]
    assert inter["fsdp-hybrid"] == pytest.approx(inter["mics"], rel=0.05)  # both all-reduce once per step
    assert inter["fsdp-full"] < inter["zero3"]  # FSDP1 reduce-scatters once per step under no_sync


def test_gradients_held_during_accumulation() -> None:
    full = gradient_bytes_held_during_accumulation(spec("replicate"), CLUSTER, SETUP)
    assert gradient_bytes_held_during_accumulation(spec("mics"), CLUSTER, SETUP) == pytest.approx(full / 4, rel=0.1)
    assert gradient_bytes_held_during_accumulation(spec("fsdp-hybrid"), CLUSTER, SETUP) == pytest.approx(full, rel=0.1)
    assert gradient_bytes_held_during_accumulation(spec("mics-unsharded"), CLUSTER, SETUP) == pytest.approx(full, rel=0.1)


def test_unsharded_accumulation_reduce_scatters_once_per_step() -> None:
    sharded = expected_step_bytes(spec("mics"), CLUSTER, SETUP)
    unsharded = expected_step_bytes(spec("mics-unsharded"), CLUSTER, SETUP)
    assert unsharded.inter_node == pytest.approx(sharded.inter_node)  # the same boundary all-reduce
    scatters = {
        name: sum(c.count for c in step_collectives(spec(name), CLUSTER, SETUP) if c.kind == "reduce_scatter")
        for name in ("mics", "mics-unsharded")
    }
    assert scatters["mics"] == SETUP.accumulate * scatters["mics-unsharded"]
    assert unsharded.intra_node < sharded.intra_node


def test_strategy_selection() -> None:
    assert [s.name for s in select_strategies(CLUSTER, ["zero3", "mics"])] == ["zero3", "mics"]
    with pytest.raises(ValueError, match="Choose from: mics, "):
        select_strategies(CLUSTER, ["zero-3"])
    odd = [s.name for s in default_strategies(ClusterShape(3, 2))]
    assert "mics-2node-hier" not in odd and "zero3" in odd


# ------------------------------------------------------------------------------------ arguments
def test_quick_defaults_and_overrides() -> None:
    args = emulated_cluster.parse_args(["--quick", "--layers", "3"])
    assert args.setup.model.n_layers == 3 and args.setup.model.d_model == emulated_cluster.QUICK.d_model
    assert args.setup.measured_steps == emulated_cluster.QUICK.measured_steps


def test_smoke_runs_one_strategy_per_family_and_one_step() -> None:
    """--smoke is what tests/test_entry_points.py runs: every worker family once, on a 2 x 2 cluster."""
    args = emulated_cluster.parse_args(["--smoke"])
    assert [spec.name for spec in args.specs] == list(emulated_cluster.SMOKE_STRATEGIES)
    assert {spec.family for spec in args.specs} == {"mics", "fsdp1", "ddp"}
    assert (args.cluster.num_nodes, args.cluster.ranks_per_node) == (2, emulated_cluster.SMOKE_RANKS_PER_NODE)
    assert (args.setup.warmup_steps, args.setup.measured_steps) == (0, 1)
    assert args.link.probe_seconds == emulated_cluster.SMOKE.probe_seconds
    scaling = emulated_cluster.parse_args(["--smoke", "--scaling"])
    assert [shape.num_nodes for shape, _ in scaling.points] == list(emulated_cluster.SMOKE_SCALING_NODES)
    assert all([s.name for s in specs] == list(emulated_cluster.SMOKE_SCALING_STRATEGIES) for _, specs in scaling.points)
    assert [s.name for s in emulated_cluster.parse_args(["--smoke", "--strategies", "zero3"]).specs] == ["zero3"]


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--smoke", "--quick"], "--smoke and --quick exclude each other"),
        (["--mtu", "0"], "--mtu must be at least 68"),
        (["--nodes", "1"], "--nodes must be an int >= 2"),
        (["--accumulate", "0"], "accumulate must be a positive int"),
        (["--strategies", "mics,horovod"], "Unknown strategy name"),
        (["--bandwidth-ratio", "0"], "--bandwidth-ratio must be positive"),
        (["--heads", "5"], "divisible by n_heads"),
        (["--steps", "100000"], "Use fewer steps"),
    ],
)
def test_bad_arguments_get_one_clear_error(argv: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        emulated_cluster.parse_args(argv)
    assert message in capsys.readouterr().err


# ------------------------------------------------------------------------------------ refusals
def test_refuses_without_root() -> None:
    with pytest.raises(PrerequisiteError, match="needs root"):
        check_prerequisites(euid=1000, which=lambda tool: f"/usr/sbin/{tool}")


def test_refuses_without_tc() -> None:
    with pytest.raises(PrerequisiteError, match="Missing tc"):
        check_prerequisites(euid=0, which=lambda tool: None if tool == "tc" else f"/usr/sbin/{tool}")


def test_main_prints_the_refusal_and_creates_nothing(monkeypatch: pytest.MonkeyPatch, capsys) -> None:  # noqa: ANN001
    monkeypatch.setattr("os.geteuid", lambda: 1000)
    created = []
    monkeypatch.setattr(EmulatedCluster, "create", lambda self: created.append(self))
    assert emulated_cluster.main(["--quick"]) == 2
    assert "needs root" in capsys.readouterr().err and not created


# ------------------------------------------------------------------------------------ small pieces
def test_addresses_stay_in_the_benchmarking_range() -> None:
    cluster = EmulatedCluster(4)
    assert [cluster.node_address(i) for i in range(4)] == ["198.18.0.1", "198.18.0.2", "198.18.0.3", "198.18.0.4"]
    with pytest.raises(ValueError, match="at least 2 nodes"):
        EmulatedCluster(1)


def test_tbf_arguments() -> None:
    args = LinkShape(125e6).tbf_args()
    assert args[:3] == ["tbf", "rate", "1000000000bit"] and "burst" in args and "latency" in args


def test_tables_show_failures_with_their_reason() -> None:
    ok = {"strategy": "mics", "partition_size": 4, "hierarchical": False, "status": "ok", "step_time_s": 1.0,
          "tokens_per_s": 1000.0, "inter_node_bytes_per_step": 1.01e6, "expected_inter_node_bytes_per_step": 1e6,
          "inter_node_error": 0.01, "loopback_bytes_per_step": 2e6, "expected_loopback_bytes_per_step": 2e6,
          "peak_mem_bytes": 4e8, "grad_bytes_during_accumulation": 1e6}
    failed = {"strategy": "fsdp-full", "partition_size": 8, "hierarchical": None, "status": "failed: timed out",
              "expected_inter_node_bytes_per_step": 5e6}
    text = emulated_report.format_table([ok, failed])
    assert "+1.0%" in text and "failed*" in text and "* fsdp-full: failed: timed out" in text
    assert "| fsdp-full | 8 | - | failed: timed out |" in emulated_report.format_markdown([ok, failed])


# ------------------------------------------------------------------------------------ profile breakdown
STEP = "wrapper (torch/optim/optimizer.py:485)"
BACKWARD = "backward (torch/_tensor.py:623);_engine_run_backward (torch/autograd/graph.py:979)"


def test_profile_breakdown_puts_each_sample_under_the_frame_nearest_the_leaf(tmp_path: Path) -> None:
    from benchmarks import profile_breakdown

    raw = tmp_path / "mics.txt"
    raw.write_text(
        "\n".join(
            [
                "advance (training_epoch_loop.py:1);training_step (gpt.py:5);forward (gpt.py:9) 6",
                "advance (training_epoch_loop.py:1);backward (tensor.py:2);_engine_run_backward (graph.py:3) 3",
                # a collective inside FSDP's copy-out is the collective's time
                "advance (training_epoch_loop.py:1);foreach_all_gather_copy_out (c.py:4);all_gather_into_tensor (d.py:5) 5",
                "advance (training_epoch_loop.py:1);backward (tensor.py:2);__call__ (collectives.py:7);ring_reduce_scatter (collectives.py:9) 4",
                "advance (training_epoch_loop.py:1);_fetch (fetching.py:2) 2",
                # Lightning runs the boundary micro-step's closure inside optimizer.step: its backward
                # is backward compute, only the optimizer's own frames are the optimizer step
                f"advance (training_epoch_loop.py:1);{STEP};closure (automatic.py:140);{BACKWARD} 2",
                f"advance (training_epoch_loop.py:1);{STEP};adamw (torch/optim/adamw.py:9) 3",
                "<module> (worker.py:1);_find_and_load (<frozen importlib>:1) 50",
            ]
        )
    )
    table = profile_breakdown.breakdown(profile_breakdown.read_samples(raw))
    assert table == pytest.approx(
        {
            "forward compute": 0.24,
            "all-gather": 0.2,
            "backward compute (autograd)": 0.2,
            "ring reduce-scatter (ours, gloo send/recv)": 0.16,
            "optimizer step": 0.12,
            "other (Lightning loop, data)": 0.08,
        }
    )
    assert "| forward compute | 24% |" in profile_breakdown.markdown({"mics": table})
    empty = tmp_path / "empty.txt"
    empty.write_text("")
    assert profile_breakdown.main([str(empty)]) == 2


# ------------------------------------------------------------------------------------ DeepSpeed peer row
def test_deepspeed_mics_crosses_nodes_only_in_the_replica_all_reduce() -> None:
    collectives = step_collectives(spec("deepspeed-mics"), CLUSTER, SETUP)
    crossing = [c for c in collectives if gloo_wire_bytes(c, CLUSTER).inter_node > 0]
    assert crossing and all(c.kind == "all_reduce" and len(c.ranks) == 2 for c in crossing)
    # the same boundary all-reduce of a 1/4 gradient partition as our mics row (padding aside)
    ds = expected_step_bytes(spec("deepspeed-mics"), CLUSTER, SETUP)
    assert ds.inter_node == pytest.approx(expected_step_bytes(spec("mics"), CLUSTER, SETUP).inter_node, rel=0.05)
    scatters = [c for c in collectives if c.kind == "reduce_scatter"]
    assert scatters and all(c.via_all_reduce and c.count == SETUP.accumulate for c in scatters)
    full = gradient_bytes_held_during_accumulation(spec("replicate"), CLUSTER, SETUP)
    held = gradient_bytes_held_during_accumulation(spec("deepspeed-mics"), CLUSTER, SETUP)
    assert held == pytest.approx(full / 4, rel=0.1)


def test_deepspeed_zero3_all_gathers_and_reduces_across_the_whole_world() -> None:
    """Plain ZeRO-3 has no replica all-reduce; its collectives span the world, so all of its traffic
    rides rings that cross nodes: far more inter-node bytes than DeepSpeed's MiCS on one node."""
    collectives = step_collectives(spec("deepspeed-zero3"), CLUSTER, SETUP)
    assert collectives and all(len(c.ranks) == CLUSTER.world_size for c in collectives if c.kind != "all_reduce")
    assert all(len(c.ranks) == 1 for c in collectives if c.kind == "all_reduce")
    ds = expected_step_bytes(spec("deepspeed-zero3"), CLUSTER, SETUP)
    assert ds.inter_node > 5 * expected_step_bytes(spec("deepspeed-mics"), CLUSTER, SETUP).inter_node
    held = gradient_bytes_held_during_accumulation(spec("deepspeed-zero3"), CLUSTER, SETUP)
    full = gradient_bytes_held_during_accumulation(spec("replicate"), CLUSTER, SETUP)
    assert held == pytest.approx(full / CLUSTER.world_size, rel=0.1)


def test_deepspeed_row_is_skipped_with_a_reason_when_deepspeed_is_missing(monkeypatch: pytest.MonkeyPatch) -> None:
    import importlib.metadata

    from benchmarks import deepspeed_peer

    def missing(name: str) -> str:
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(importlib.metadata, "version", missing)
    reason = emulated_rows.skip_reason(spec("deepspeed-mics"))
    assert reason is not None and "not installed" in reason and "[peers]" in reason
    assert emulated_rows.skip_reason(spec("mics")) is None
    monkeypatch.setattr(importlib.metadata, "version", lambda name: "0.19.7")
    assert "needs 0.19.2" in deepspeed_peer.unavailable_reason()
    record = emulated_analysis.add_expectations(
        emulated_rows.skipped_record(spec("deepspeed-mics"), reason), spec("deepspeed-mics"),
        emulated_cluster.parse_args(["--quick"]),
    )
    text = emulated_report.format_table([record])
    assert "skipped*" in text and "not installed" in text


# ------------------------------------------------------------------------------------------------ semi-synchronous rows
def test_diloco_row_sends_a_hop_2_every_h_steps_on_mics_auto_s_layout() -> None:
    """``mics-diloco`` runs ``mics-zero2``'s layout (the planner's choice on this cluster) with DiLoCo: the same
    intra-node collectives, and across nodes one all-reduce of the same bytes as hop 2 every H steps -- 1/H of
    ``mics-zero2``'s inter-node bytes per step on average."""
    diloco, h32 = select_strategies(CLUSTER, ["mics-diloco", "mics-diloco-h32"])
    assert (diloco.sync_every, h32.sync_every) == (DILOCO_SYNC_EVERY, 32) and diloco.semi_synchronous
    assert (diloco.partition_size, diloco.params_degree, diloco.grad_accumulation) == (4, 1, "unsharded")
    sync = expected_step_bytes(spec("mics-zero2"), CLUSTER, SETUP)
    for row in (diloco, h32):
        semi = expected_step_bytes(row, CLUSTER, SETUP)
        assert semi.intra_node == pytest.approx(sync.intra_node)
        assert semi.inter_node == pytest.approx(sync.inter_node / row.sync_every)
    crossing = [c for c in step_collectives(diloco, CLUSTER, SETUP) if gloo_wire_bytes(c, CLUSTER).inter_node > 0]
    assert crossing and all(c.kind == "all_reduce" and c.every_steps == DILOCO_SYNC_EVERY for c in crossing)
    assert len(crossing) == CLUSTER.ranks_per_node  # one packed message per replication group, not one per unit


def test_diloco_rows_are_opt_in_and_measure_whole_rounds() -> None:
    assert all(not s.semi_synchronous for s in default_strategies(CLUSTER))  # compare_planner prices rows as sync
    assert [s.name for s in emulated_cluster.parse_args(["--strategies", "mics-auto,mics-diloco"]).specs] == \
        ["mics-auto", "mics-diloco"]
    diloco = select_strategies(CLUSTER, ["mics-diloco"])[0]
    assert measured_steps_for(diloco, 5) == 8 and measured_steps_for(diloco, 9) == 16
    assert measured_steps_for(spec("mics"), 5) == 5
    with pytest.raises(ValueError, match="mics-diloco-h<H>"):
        select_strategies(CLUSTER, ["mics-diloco-h0"])
    with pytest.raises(ValueError, match="explicit MiCS layout"):
        StrategySpec("x", "mics", 4, planned=True, sync_every=8)
    tuned = emulated_cluster.parse_args(["--strategies", "mics-diloco", "--outer-lr", "0.3"]).specs[0]
    assert (tuned.name, tuned.outer_lr) == ("mics-diloco", 0.3) and "lr 0.3" in tuned.description


def test_diloco_row_is_labelled_semi_synchronous_in_the_tables() -> None:
    row = {"strategy": "mics-diloco", "sync_every": 8, "partition_size": 4, "hierarchical": False, "status": "ok",
           "step_time_s": 0.5, "tokens_per_s": 100.0, "inter_node_bytes_per_step": 1e6,
           "expected_inter_node_bytes_per_step": 1e6, "loopback_bytes_per_step": 2e6,
           "expected_loopback_bytes_per_step": 2e6, "peak_mem_bytes": 4e8, "grad_bytes_during_accumulation": 1e6}
    assert "mics-diloco (H=8)" in emulated_report.format_table([row])
    assert "| mics-diloco (semi-synchronous, H=8: step and bytes are means over whole rounds) |" in \
        emulated_report.format_markdown([row])


def test_bandwidth_ratio_240_is_accepted_and_15_stays_the_default() -> None:
    assert emulated_cluster.parse_args(["--bandwidth-ratio", "240"]).link.bandwidth_ratio == 240
    assert emulated_cluster.parse_args([]).link.bandwidth_ratio == emulated_network.DEFAULT_BANDWIDTH_RATIO == 15
