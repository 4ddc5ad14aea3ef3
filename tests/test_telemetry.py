"""Telemetry: the analytic byte formula, the group classification, and the callback's numbers against the formula on
real multi-rank runs of three layouts (MiCS, replicate, ZeRO-3); throughput is total tokens over the steps'
wall-clock, not a mean of rates."""

from __future__ import annotations

import csv
import time
from pathlib import Path

import pytest
import torch
from distributed import run_ranks
from lightning.pytorch.loggers import CSVLogger
from lm_jobs import MICRO_BATCH, SMALL_GPT, fit_small_gpt, quick_trainer

from lightning_mics import MiCSStrategy, MiCSTopology
from lightning_mics.collective_recorder import CollectiveCall
from lightning_mics.accounting import (
    CROSS_REPLICA,
    INTRA_PARTITION,
    OTHER,
    CommBytes,
    UnitShapes,
    analytic_comm_bytes,
    classify_calls,
    padded_numel,
)
from lightning_mics.shards import fsdp_unit_shapes
from lightning_mics.telemetry import StepTelemetry, TrainingTelemetry, compute_dtype, dense_peak_flops
from lightning_mics.wire import INT8

WORLD, RANKS_PER_NODE, ACCUMULATE, STEPS = 4, 2, 2, 3
#: (partition size, grad_accumulation, cross_replica_dtype): MiCS 2x2, pure replication, ZeRO-3, MiCS 2x2
#: accumulating unsharded, MiCS 2x2 with a bf16 cross-replica hop
LAYOUTS = (
    (2, "sharded", None),
    (1, "sharded", None),
    ("world", "sharded", None),
    (2, "unsharded", None),
    (2, "sharded", "bf16"),
)


def test_padding_rounds_dim0_up_to_the_partition_size() -> None:
    assert padded_numel((5, 3), 2) == 6 * 3
    assert padded_numel((5, 3), 5) == 5 * 3
    assert padded_numel((7,), 4) == 8
    assert padded_numel((), 4) == 4  # a scalar is one row


def test_analytic_formula_for_one_unit_by_hand() -> None:
    # One resharded unit with a (5, 3) weight and a frozen (5,) bias, partition 2, 2 replicas, 3 micro-steps.
    unit = UnitShapes(shapes=((5, 3), (5,)), trainable=(True, False), reshard_after_forward=True)
    got = analytic_comm_bytes([unit], partition_size=2, replication_degree=2, accumulate_grad_batches=3)
    padded_all, padded_trainable = 18 + 6, 18
    assert got.by_kind["all_gather"] == 3 * 2 * padded_all * 4  # gathered in forward and again in backward
    assert got.by_kind["reduce_scatter"] == 3 * padded_trainable * 4  # every micro-step
    assert got.by_kind["all_reduce"] == padded_trainable // 2 * 4  # once, the shard only
    assert got.intra_partition == got.by_kind["all_gather"] + got.by_kind["reduce_scatter"]
    assert got.cross_replica == got.by_kind["all_reduce"]
    single = analytic_comm_bytes([unit], partition_size=4, replication_degree=1)
    assert single.by_kind["all_reduce"] == 0  # ZeRO-3: nothing to replicate
    # The same partition over 2 nodes of 2 ranks, two-stage: the inter-node stage adds half again.
    two_stage = analytic_comm_bytes([unit], partition_size=4, replication_degree=1, hierarchical_ranks_per_node=2)
    assert two_stage.by_kind["all_gather"] == single.by_kind["all_gather"] * 3 // 2
    assert two_stage.by_kind["reduce_scatter"] == single.by_kind["reduce_scatter"] * 3 // 2
    unsharded = analytic_comm_bytes(
        [unit], partition_size=2, replication_degree=2, accumulate_grad_batches=3, grad_accumulation="unsharded"
    )
    assert unsharded.by_kind["reduce_scatter"] == padded_trainable * 4  # once, at the boundary
    assert unsharded.by_kind["all_gather"] == got.by_kind["all_gather"]
    assert unsharded.by_kind["all_reduce"] == got.by_kind["all_reduce"]
    with pytest.raises(ValueError, match="positive"):
        analytic_comm_bytes([unit], partition_size=2, replication_degree=2, accumulate_grad_batches=0)


def test_analytic_formula_for_an_int8_cross_replica_hop_by_hand() -> None:
    """The same unit with ``cross_replica_dtype="int8"``: each rank's 9-element shard is packed and cut
    into one piece per replica, padded to whole blocks of 256 (piece 256, 2 pieces), each element 1
    byte plus 4 per block -- one reduce-scatter and one all-gather of 2 x 260 bytes."""
    unit = UnitShapes(shapes=((5, 3), (5,)), trainable=(True, False), reshard_after_forward=True)
    fp32 = analytic_comm_bytes([unit], partition_size=2, replication_degree=2, accumulate_grad_batches=3)
    got = analytic_comm_bytes(
        [unit], partition_size=2, replication_degree=2, accumulate_grad_batches=3, **INT8.byte_model()
    )
    assert got.by_kind["all_reduce"] == 0
    assert got.by_kind["reduce_scatter"] == fp32.by_kind["reduce_scatter"] + 2 * 260
    assert got.by_kind["all_gather"] == fp32.by_kind["all_gather"] + 2 * 260
    assert got.cross_replica == 4 * 260 and isinstance(got.cross_replica, int)
    assert got.intra_partition == fp32.intra_partition


def test_int8_messages_are_cut_per_unit_when_overlapped_else_packed() -> None:
    """Two such units: overlapped (the default) each unit's 9 elements get their own 2 pieces of one block
    (2 x 260 bytes per unit and collective); after backward, packed, the 18 elements still fit 2 pieces."""
    unit = UnitShapes(shapes=((5, 3), (5,)), trainable=(True, False), reshard_after_forward=True)
    fp32 = analytic_comm_bytes([unit, unit], partition_size=2, replication_degree=2)
    per_unit = analytic_comm_bytes([unit, unit], partition_size=2, replication_degree=2, **INT8.byte_model())
    packed = analytic_comm_bytes(
        [unit, unit], partition_size=2, replication_degree=2, **INT8.byte_model(), cross_replica_per_unit=False
    )
    assert per_unit.by_kind["reduce_scatter"] == fp32.by_kind["reduce_scatter"] + 2 * 2 * 260
    assert packed.by_kind["reduce_scatter"] == fp32.by_kind["reduce_scatter"] + 2 * 260
    assert (per_unit.cross_replica, packed.cross_replica) == (8 * 260, 4 * 260)


def test_calls_are_split_by_the_group_they_ran_on() -> None:
    topology = MiCSTopology.create(world_size=4, ranks_per_node=2, partition_size=2)  # rank 1: (0,1) and (1,3)
    calls = [
        CollectiveCall("all_gather", (0, 1), 100, 0),
        CollectiveCall("reduce_scatter", (0, 1), 40, 0),
        CollectiveCall("all_reduce", (1, 3), 7, 0),
        CollectiveCall("all_reduce", (0, 1, 2, 3), 3, 0),  # e.g. a metric sync over the world
        CollectiveCall("broadcast", (0, 1, 2, 3), 8, 0),
    ]
    comm = classify_calls(calls, topology, rank=1)
    assert comm.by_group == {INTRA_PARTITION: 140, CROSS_REPLICA: 7, OTHER: 11}
    assert comm.by_kind["all_reduce"] == 10 and comm.total == 158
    assert classify_calls(calls, None, rank=1).by_group == {}  # other strategies: by kind only


def test_topology_comes_from_a_set_up_mics_strategy_only() -> None:
    from lightning.pytorch.strategies import SingleDeviceStrategy

    from lightning_mics.telemetry import _topology_of

    assert _topology_of(SingleDeviceStrategy(torch.device("cpu"))) is None  # other strategies: by kind only
    assert _topology_of(MiCSStrategy()) is None  # not set up: no layout yet, and no error


def test_bad_peak_flops_is_rejected_with_the_accepted_forms() -> None:
    with pytest.raises(ValueError, match="'auto' or None"):
        TrainingTelemetry(peak_flops="fast")
    with pytest.raises(ValueError, match="positive"):
        TrainingTelemetry(peak_flops=0)


def test_peak_flops_come_from_lightnings_table_with_dense_h200(monkeypatch: pytest.MonkeyPatch) -> None:
    assert [compute_dtype(p) for p in ("bf16-mixed", "16-mixed", "32-true", "64-true", "transformer-engine")] == [
        torch.bfloat16,
        torch.float16,
        torch.float32,
        torch.float64,
        None,
    ]
    assert dense_peak_flops(torch.device("cpu"), torch.bfloat16) is None
    cuda = torch.device("cuda", 0)
    # the names torch reports on those GPUs; Lightning's table tells SXM (HBM3) from PCIe
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H100 80GB HBM3")
    assert dense_peak_flops(cuda, torch.bfloat16) == pytest.approx(989.4e12)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H100 PCIe")
    assert dense_peak_flops(cuda, torch.bfloat16) == pytest.approx(756e12)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H200")
    assert dense_peak_flops(cuda, torch.bfloat16) == pytest.approx(989e12)  # not the sparse 2 PFLOP/s


def _measure_layouts(rank: int, world_size: int, log_dir: str) -> list[dict]:
    results = []
    for index, (partition_size, grad_accumulation, cross_replica_dtype) in enumerate(LAYOUTS):
        # the first layout records every step; the others sample (the default: steps 1 and 2 of 3)
        telemetry = TrainingTelemetry(peak_flops=1e12, **({"sample_every": 1} if index == 0 else {}))
        strategy = MiCSStrategy(
            partition_size=partition_size,
            ranks_per_node=RANKS_PER_NODE,
            grad_accumulation=grad_accumulation,
            cross_replica_dtype=cross_replica_dtype,
        )
        logger = CSVLogger(log_dir, name=f"p{partition_size}-{grad_accumulation}-{cross_replica_dtype}", version="")
        trainer = quick_trainer(
            world_size, strategy, STEPS, ACCUMULATE, callbacks=[telemetry], logger=logger, log_every_n_steps=1
        )
        started = time.perf_counter()
        model = fit_small_gpt(trainer)
        fit_wall_s = time.perf_counter() - started
        topology = strategy.topology
        expected = analytic_comm_bytes(
            fsdp_unit_shapes(strategy.fsdp_units),
            topology.partition_size,
            topology.replication_degree,
            ACCUMULATE,
            hierarchical_ranks_per_node=topology.ranks_per_node,  # ZeRO-3 here spans both emulated nodes
            grad_accumulation=grad_accumulation,
            cross_replica_bytes=2 if cross_replica_dtype == "bf16" else None,
        )
        results.append(
            dict(
                partition_size=topology.partition_size,
                steps=telemetry.steps,
                summary=telemetry.summary(skip_first=0),
                expected=expected,
                memory=telemetry.memory_per_rank,
                full_param_bytes=sum(p.numel() * 4 for p in model.parameters()),
                units=len(strategy.fsdp_units),
                fit_wall_s=fit_wall_s,
                metrics_csv=str(Path(logger.log_dir) / "metrics.csv"),
            )
        )
    return results


@pytest.fixture(scope="module")
def measured(tmp_path_factory: pytest.TempPathFactory) -> list[list[dict]]:
    return run_ranks(_measure_layouts, WORLD, str(tmp_path_factory.mktemp("telemetry_logs")))


@pytest.mark.distributed
@pytest.mark.parametrize("layout_index", range(len(LAYOUTS)))
def test_recorded_bytes_per_optimizer_step_match_the_analytic_formula(measured, layout_index: int) -> None:
    for rank_results in measured:
        result = rank_results[layout_index]
        expected = result["expected"]
        assert len(result["steps"]) == STEPS
        # sampled: the third step is not recorded and reports the second's bytes, which it repeats
        sampled = [True] * STEPS if layout_index == 0 else [True, True] + [False] * (STEPS - 2)
        assert [step.comm_measured for step in result["steps"]] == sampled
        for step in result["steps"]:
            assert step.micro_steps == ACCUMULATE
            for kind in ("all_gather", "reduce_scatter", "all_reduce"):
                assert step.comm.by_kind[kind] == expected.by_kind[kind], (result["partition_size"], kind)
            assert step.comm.intra_partition == expected.intra_partition
            assert step.comm.cross_replica == expected.cross_replica


@pytest.mark.distributed
def test_layouts_move_the_traffic_where_mics_says(measured) -> None:
    # what rank 0 recorded in its first step of each layout (the formula's agreement is the test above)
    mics, replicate, zero3, unsharded, compressed = (measured[0][i]["steps"][0].comm for i in range(len(LAYOUTS)))
    assert mics.intra_partition > 0 and mics.cross_replica > 0
    assert replicate.intra_partition == 0 and replicate.cross_replica > mics.cross_replica  # full gradients
    assert zero3.cross_replica == 0 and zero3.intra_partition > 0
    # unsharded accumulation: one reduce-scatter per optimizer step instead of one per micro-step
    assert unsharded.by_kind["reduce_scatter"] * ACCUMULATE == mics.by_kind["reduce_scatter"]
    assert unsharded.by_kind["all_gather"] == mics.by_kind["all_gather"]
    assert unsharded.cross_replica == mics.cross_replica
    # bf16 on the cross-replica hop: per unit a reduce-scatter + all-gather of 2-byte elements instead
    # of an fp32 all-reduce -- half the ring bytes (payload 2 x 2 bytes vs 4, up to each unit's padding to
    # a multiple of the 2 replicas: one element, 2 bytes, in each of the two collectives)
    assert compressed.by_kind["all_reduce"] == 0 and compressed.intra_partition == mics.intra_partition
    units = measured[0][len(LAYOUTS) - 1]["units"]
    assert mics.cross_replica <= compressed.cross_replica <= mics.cross_replica + 2 * 2 * 2 * units


@pytest.mark.distributed
def test_throughput_mfu_and_memory_are_consistent(measured) -> None:
    tokens_per_step = WORLD * ACCUMULATE * MICRO_BATCH * SMALL_GPT.seq_len
    for result in measured[0]:
        # the step times are measured, not derived: positive, and together within the fit's own wall time
        assert all(step.step_time_s > 0 for step in result["steps"])
        assert sum(step.step_time_s for step in result["steps"]) <= result["fit_wall_s"]
        for step in result["steps"]:
            assert step.tokens == tokens_per_step
            assert step.tokens_per_s == pytest.approx(step.tokens / step.step_time_s)
            assert step.mfu == pytest.approx(SMALL_GPT.flops_per_token * step.tokens_per_s / (1e12 * WORLD))
            assert step.loss is not None and 0 < step.loss < 7
        # Each rank holds ~1/p of the parameters (up to dim-0 padding), the same again as gradients,
        # and twice that as AdamW moments.
        for memory in result["memory"]:
            share = result["full_param_bytes"] / result["partition_size"]
            assert share <= memory["params"] <= share * 1.2
            assert memory["grads"] == memory["params"]
            assert memory["optimizer"] == 2 * memory["params"]


def _step(step: int, started_at: float, seconds: float, tokens: int = 1000) -> StepTelemetry:
    return StepTelemetry(
        step=step, micro_steps=1, step_time_s=seconds, tokens=tokens, tokens_per_s=tokens / seconds, mfu=None,
        comm=CommBytes(by_kind={}, by_group={}), started_at=started_at, ended_at=started_at + seconds,
    )


def test_throughput_is_total_tokens_over_total_time_not_a_mean_of_rates() -> None:
    telemetry = TrainingTelemetry(peak_flops=None)
    # a 1 s step and a 3 s step of 1000 tokens each, 0.5 s apart (data loading: training time), then a
    # 2 s validation pass and a 1 s step: 3000 tokens in 1 + 0.5 + 3 + 2.5 + 1 - 2 = 6 s
    telemetry.steps = [_step(1, 10.0, 1.0), _step(2, 11.5, 3.0), _step(3, 17.0, 1.0)]
    telemetry._validation_spans = [(14.75, 16.75), (1.0, 2.0)]  # the second lies before the steps
    summary = telemetry.summary(skip_first=0)
    assert summary["tokens"] == 3000 and summary["seconds"] == pytest.approx(6.0)
    assert summary["tokens_per_s"] == pytest.approx(500.0)  # the mean of the per-step rates reads 777.8
    assert summary["tokens_per_s_per_step"] == pytest.approx((1000 / 3, 1000.0, 1000.0))
    text = telemetry.format_summary(skip_first=0)
    assert "throughput: 500 tokens/s over all ranks (3,000 tokens in 6.00 s, 3 optimizer steps" in text
    assert "validation not counted" in text and "p10 / median / p90: 333 / 1,000 / 1,000 tokens/s" in text


@pytest.mark.distributed
def test_the_summary_rate_of_a_recorded_run_is_its_tokens_over_its_wall_clock(measured) -> None:
    for result in measured[0]:
        steps, summary = result["steps"], result["summary"]
        seconds = steps[-1].ended_at - steps[0].started_at  # no validation in these runs
        assert summary["seconds"] == pytest.approx(seconds)
        assert summary["tokens_per_s"] == pytest.approx(sum(s.tokens for s in steps) / seconds)
        assert summary["mfu"] == pytest.approx(SMALL_GPT.flops_per_token * summary["tokens_per_s"] / (1e12 * WORLD))


@pytest.mark.distributed
def test_numbers_reach_the_logger(measured) -> None:
    with open(measured[0][0]["metrics_csv"]) as f:
        rows = [row for row in csv.DictReader(f) if row.get("comm/intra_partition_bytes")]
    assert len(rows) == STEPS
    logged = [float(row["comm/intra_partition_bytes"]) for row in rows]
    assert logged == [float(measured[0][0]["expected"].intra_partition)] * STEPS
    assert all(float(row["perf/tokens_per_s"]) > 0 for row in rows)
    torch.testing.assert_close(float(rows[-1]["perf/mfu"]), measured[0][0]["steps"][-1].mfu)
