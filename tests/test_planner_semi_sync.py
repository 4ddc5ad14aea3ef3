"""The planner knows semi-synchronous replica groups (``cross_replica_sync="diloco"``, ``sync_every=H``): no hop 2,
one delta message every H steps, two more shard copies, optimizer states only inside the partition, streaming
fragments, and ``plan``'s advice of the smallest H that keeps the GPUs busy on a slow link.

What it must get right: DiLoCo sends no hop 2 on any step and one parameter-delta message every H steps (the
schedule, which the planner prices, telemetry states and the emulated benchmark puts on the wire), holds two
more copies of the parameter shards (the last-synchronised copy and the outer momentum), keeps optimizer states
inside the partition -- and ``lightning-mics plan`` says when the link across replicas is so slow that only
semi-sync keeps the GPUs busy. The measured side (the bytes a real DiLoCo run records) is in
``tests/test_semi_sync.py``.
"""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from lightning_mics.plan import main as plan_main
from lightning_mics.planner import (
    CLUSTER_PRESETS,
    MODEL_PRESETS,
    ClusterSpec,
    TrainingSpec,
    estimate,
    layout_schedule,
    plan,
    plan_layout_for,
)
from lightning_mics.planner.report import BUSY_ENOUGH
from lightning_mics.planner.search import ADVISED_SYNC_EVERY
from lightning_mics.schedule import StepLayout, UnitSize, step_schedule
from lightning_mics.sharding_spec import ShardingSpec

UNITS = [UnitSize(1000, 1000, True), UnitSize(600, 400, True), UnitSize(90, 90, False)]  # one partly frozen
GBPS = 1e9 / 8


def _schedule(**overrides):
    layout = StepLayout(partition_size=2, world_size=8, accumulation=3, **overrides)
    return step_schedule(UNITS, layout)


def _cross_replica(schedule):
    return [entry for entry in schedule if entry.group == "replication"]


def test_diloco_schedule_has_no_hop2_and_one_delta_message_every_h_steps() -> None:
    synchronous, diloco = _schedule(), _schedule(sync_every=8)
    # everything inside the partition is untouched
    assert [e for e in diloco if e.group != "replication"] == [e for e in synchronous if e.group != "replication"]
    assert {e.phase for e in _cross_replica(synchronous)} == {"boundary"}
    (outer,) = _cross_replica(diloco)
    assert (outer.phase, outer.kind, outer.group_size, outer.calls, outer.every_steps) == (
        "post_step", "all_reduce", 4, 1, 8
    )
    # one fp32 message of the trainable shards (1000 + 400 + 90 elements over a partition of 2), 1/8 of it per step
    assert outer.payload_bytes == (1000 + 400 + 90) // 2 * 4
    assert outer.bytes_per_step(accumulation=3) == outer.payload_bytes / 8
    # the synchronous hop carries the same elements at every step
    assert sum(e.bytes_per_step(3) for e in _cross_replica(synchronous)) == outer.payload_bytes


def test_diloco_schedule_with_a_compressed_wire_packs_the_deltas_like_the_packed_hop() -> None:
    wire = {"cross_replica_bytes": 2, "cross_replica_block": 1}
    packed = _cross_replica(_schedule(cross_replica_per_unit=False, **wire))
    diloco = _cross_replica(_schedule(sync_every=4, **wire))
    assert [(e.kind, e.payload_bytes, e.every_steps, e.phase) for e in diloco] == [
        (e.kind, e.payload_bytes, 4, "post_step") for e in packed
    ]


def test_diloco_schedule_refuses_optimizer_states_across_replicas_and_h_below_one() -> None:
    with pytest.raises(ValueError, match="optimizer states sharded like the gradients"):
        StepLayout(partition_size=2, world_size=8, optim_degree=4, sync_every=4)
    with pytest.raises(ValueError, match="sync_every >= 1"):
        StepLayout(partition_size=2, world_size=8, sync_every=0)


def test_training_spec_refuses_bad_sync_every_with_the_fix() -> None:
    for bad in (0, -3, True, 2.5):
        with pytest.raises(ValueError, match="sync_every"):
            TrainingSpec(sync_every=bad)
    with pytest.raises(ValueError, match="cpu_offload"):
        TrainingSpec(sync_every=8, cpu_offload=True)


# ---------------------------------------------------------------------------------------------------------------------
# the cost model

CLUSTER = replace(CLUSTER_PRESETS["p4d"], nodes=4)
MODEL = MODEL_PRESETS["gpt-1.3b"]
FP32 = TrainingSpec(micro_batch=2, accumulation=4, precision="32-true")  # hop 2 and the deltas both fp32


def _hop2_egress(cluster: ClusterSpec, training: TrainingSpec, layout: ShardingSpec) -> float:
    degrees = layout.resolve(cluster.world_size, cluster.gpus_per_node)
    return sum(
        c.cost(cluster, hierarchical=False).node_egress_bytes
        for c in layout_schedule(degrees, MODEL, training)
        if c.role == "replication"
    )


@pytest.mark.parametrize("every", [1, 8, 64])
def test_diloco_sends_one_hth_of_the_cross_replica_bytes_and_prices_the_sync_exposed(every: int) -> None:
    mics = ShardingSpec(params=8, grads=8, optim=8)
    sync = estimate(mics, CLUSTER, MODEL, FP32)
    semi = estimate(mics, CLUSTER, MODEL, replace(FP32, sync_every=every))
    hop2 = _hop2_egress(CLUSTER, FP32, mics)
    assert hop2 > 0
    # across nodes: everything but hop 2 stays; hop 2's bytes (the same fp32 elements) come once every H steps
    assert semi.inter_node_bytes == pytest.approx(sync.inter_node_bytes - hop2 + hop2 / every, rel=1e-9)
    # the outer sync runs after the step, not behind backward: its time (1/H of it per step) is fully exposed
    outer_s = semi.comm_s["post_step"]
    assert outer_s > 0
    assert semi.step_time_s == pytest.approx(
        semi.compute_s + semi.exposed_comm_s + semi.optimizer_step_s, rel=1e-12
    )
    every_step = estimate(mics, CLUSTER, MODEL, replace(FP32, sync_every=1))
    assert outer_s == pytest.approx(every_step.comm_s["post_step"] / every)
    assert semi.sync_every == every and f"diloco H={every}" in semi.name


def test_diloco_memory_holds_the_last_synchronised_shards_and_the_outer_momentum() -> None:
    mics = ShardingSpec(params=8, grads=8, optim=8)
    sync = estimate(mics, CLUSTER, MODEL, FP32)
    semi = estimate(mics, CLUSTER, MODEL, replace(FP32, sync_every=16))
    assert sync.memory.outer == 0
    assert semi.memory.outer == pytest.approx(2 * MODEL.params * 4 / 8)
    assert semi.memory.total == pytest.approx(sync.memory.total + semi.memory.outer)


def test_diloco_plans_only_optimizer_states_inside_the_partition() -> None:
    result = plan(CLUSTER, MODEL, replace(FP32, sync_every=8))
    assert result.ranked and all(c.layout.optim == c.layout.grads for c in result.ranked)
    assert len(plan(CLUSTER, MODEL, FP32).ranked) > len(result.ranked)  # AMSP's optim > grads layouts exist


# ---------------------------------------------------------------------------------------------------------------------
# the advice

FAST = replace(CLUSTER, inter_node_bandwidth=400 * GBPS * 0.8)
SLOW = replace(CLUSTER, inter_node_bandwidth=1 * GBPS)  # cross-region
BF16 = TrainingSpec(micro_batch=2, accumulation=4)


def test_a_link_that_keeps_up_gets_no_semi_sync_advice() -> None:
    result = plan(FAST, MODEL, BF16, uniform_only=True)
    assert result.winner.busy_fraction >= BUSY_ENOUGH
    assert result.semi_sync_advice is None
    assert "semi-synchronous" not in result.explain().lower()


def test_a_cross_region_link_gets_the_smallest_h_that_keeps_the_gpus_busy() -> None:
    result = plan(SLOW, MODEL, BF16, uniform_only=True)
    advice = result.semi_sync_advice
    assert advice is not None
    assert result.winner.busy_fraction < BUSY_ENOUGH  # every synchronous layout leaves the GPUs mostly waiting
    assert advice.synchronous is result.winner
    assert advice.semi_sync.busy_fraction >= BUSY_ENOUGH
    assert advice.semi_sync.step_time_s < result.winner.step_time_s
    # the smallest such H: the one before it does not get there
    index = ADVISED_SYNC_EVERY.index(advice.sync_every)
    assert index > 0
    smaller = plan(SLOW, MODEL, replace(BF16, sync_every=ADVISED_SYNC_EVERY[index - 1]), uniform_only=True).winner
    assert smaller.busy_fraction < BUSY_ENOUGH
    text = result.explain()
    assert f"cross_replica_sync='diloco', sync_every={advice.sync_every}" in text
    assert "not synchronous training" in text
    assert result.to_dict()["semi_sync_advice"]["sync_every"] == advice.sync_every


def test_no_advice_when_nothing_crosses_replicas() -> None:
    one_node = replace(SLOW, nodes=1)
    result = plan(one_node, MODEL, BF16, uniform_only=True)
    assert result.semi_sync_advice is None


def test_plan_cli_prices_diloco_and_advises_it_on_a_slow_link(capsys: pytest.CaptureFixture[str]) -> None:
    common = ["--cluster", "p4d", "--nodes", "4", "--model", "gpt-1.3b", "--micro-batch", "2", "--accumulation", "4",
              "--uniform-only", "--top", "3"]
    assert plan_main([*common, "--inter-bandwidth", "1Gbps"]) == 0
    advised = capsys.readouterr().out
    assert "too slow for a hop 2 at every step" in advised and "sync_every=" in advised
    assert plan_main([*common, "--inter-bandwidth", "1Gbps", "--sync-every", "64", "--json"]) == 0
    priced = json.loads(capsys.readouterr().out)
    assert priced["training"]["sync_every"] == 64
    assert priced["winner"]["sync_every"] == 64 and priced["semi_sync_advice"] is None
    assert priced["winner"]["busy_fraction"] >= BUSY_ENOUGH
    with pytest.raises(SystemExit):
        plan_main([*common, "--sync-every", "0"])
    assert "sync_every" in capsys.readouterr().err


def test_the_strategys_planner_gets_diloco_from_the_options() -> None:
    torch = pytest.importorskip("torch")
    module = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 64))
    choice = plan_layout_for(module, world_size=8, ranks_per_node=4, device=torch.device("cpu"), sync_every=16)
    assert choice.estimate.sync_every == 16
    assert choice.estimate.layout.optim == choice.estimate.layout.grads


# ---------------------------------------------------------------------------------------------------------------------
# streaming DiLoCo: the same bytes in P fragments, each average started tau inner steps before its turn


def test_training_spec_refuses_streaming_settings_that_do_not_fit_with_the_fix() -> None:
    with pytest.raises(ValueError, match="need sync_every"):
        TrainingSpec(num_fragments=2)
    with pytest.raises(ValueError, match="num_fragments=3 must be a positive int dividing sync_every=8"):
        TrainingSpec(sync_every=8, num_fragments=3)
    with pytest.raises(ValueError, match=r"fragment_sync_delay=4 must be an int in \[0, sync_every / num_fragments"):
        TrainingSpec(sync_every=8, num_fragments=2, fragment_sync_delay=4)


def test_streaming_hides_what_of_each_fragments_average_fits_behind_its_delay() -> None:
    mics = ShardingSpec(params=8, grads=8, optim=8)
    slow = replace(CLUSTER, inter_node_bandwidth=1 * GBPS)  # an average that takes many inner steps
    diloco = estimate(mics, slow, MODEL, replace(FP32, sync_every=64))
    outer_per_step = diloco.comm_s["post_step"]
    inner_step = diloco.step_time_s - outer_per_step  # the step without its share of the outer average
    # the synchronisation is long: a quarter of it takes longer than one inner step can hide
    assert outer_per_step * 64 / 4 > slow.overlap * inner_step
    # fragments without a delay send the same bytes, fully exposed: DiLoCo's price
    fragments = estimate(mics, slow, MODEL, replace(FP32, sync_every=64, num_fragments=4))
    assert fragments.step_time_s == pytest.approx(diloco.step_time_s, rel=1e-12)
    assert fragments.inter_node_bytes == pytest.approx(diloco.inter_node_bytes, rel=1e-12)
    for delay in (1, 4, 15):
        training = replace(FP32, sync_every=64, num_fragments=4, fragment_sync_delay=delay)
        streaming = estimate(mics, slow, MODEL, training)
        fragment_s = outer_per_step * 64 / 4
        hidden = min(fragment_s, slow.overlap * delay * inner_step) * 4 / 64
        assert streaming.step_time_s == pytest.approx(diloco.step_time_s - hidden, rel=1e-9), delay
        assert streaming.inter_node_bytes == pytest.approx(diloco.inter_node_bytes, rel=1e-12)
        assert streaming.step_time_s >= inner_step - 1e-12  # never faster than no synchronisation at all
    # a fast link: each fragment's average fits behind one inner step, and the step is the inner step
    fast = estimate(mics, CLUSTER, MODEL, replace(FP32, sync_every=64, num_fragments=4, fragment_sync_delay=15))
    fast_diloco = estimate(mics, CLUSTER, MODEL, replace(FP32, sync_every=64))
    assert fast.step_time_s == pytest.approx(fast_diloco.step_time_s - fast_diloco.comm_s["post_step"], rel=1e-9)


def test_plan_cli_and_the_strategys_planner_take_the_streaming_settings(capsys: pytest.CaptureFixture[str]) -> None:
    common = ["--cluster", "p4d", "--nodes", "4", "--model", "gpt-1.3b", "--micro-batch", "2", "--accumulation", "4",
              "--uniform-only", "--top", "3", "--inter-bandwidth", "1Gbps", "--sync-every", "64"]
    assert plan_main([*common, "--json"]) == 0
    diloco = json.loads(capsys.readouterr().out)["winner"]
    assert plan_main([*common, "--num-fragments", "4", "--fragment-sync-delay", "8", "--json"]) == 0
    streaming = json.loads(capsys.readouterr().out)
    assert (streaming["training"]["num_fragments"], streaming["training"]["fragment_sync_delay"]) == (4, 8)
    assert streaming["winner"]["step_time_s"] < diloco["step_time_s"]
    assert plan_main([*common, "--num-fragments", "4", "--fragment-sync-delay", "8"]) == 0
    assert "in 4 fragment(s) each started 8 inner step(s) before its turn" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        plan_main([*common, "--num-fragments", "5"])
    assert "num_fragments=5 must be a positive int dividing sync_every=64" in capsys.readouterr().err
    torch = pytest.importorskip("torch")
    module = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 64))
    plain, streamed = (
        plan_layout_for(module, world_size=8, ranks_per_node=4, device=torch.device("cpu"), sync_every=16,
                        streaming=streaming_settings).estimate
        for streaming_settings in ((1, 0), (4, 3))
    )
    assert streamed.step_time_s <= plain.step_time_s
