"""The core proof: MiCS training equals single-process training on the same global batch (relative error < 1e-5) for
world 4 and world 8 as 2 nodes, with accumulation, clipping, ``configure_model``, manual optimization, activation
checkpointing, ``torch.compile``, bf16-mixed, unsharded accumulation and the planner's layouts; a bf16 or int8 hop 2
stays within its bound with replicas bit-identical.

Each layout trains ``ToyModule`` (odd sizes, tied embedding/head, a frozen parameter, a buffer) for
3 SGD-momentum steps through ``Trainer(strategy=MiCSStrategy(...))``; every rank then gathers the
full parameters, which must match a plain single-process loop to a relative error < 1e-5. One spawn
of ranks runs all layouts of a world size (process start-up dominates the cost).
"""

from __future__ import annotations

import lightning.pytorch as pl
import pytest
import torch
from distributed import run_ranks
from lightning_mics import MiCSStrategy, ShardingSpec
from lightning_mics.planner import ClusterSpec, plan_layout_for
from lightning_mics.accounting import analytic_comm_bytes
from lightning_mics.shards import fsdp_unit_shapes
from lightning_mics.telemetry import TrainingTelemetry
from lightning_mics.wire import INT8, INT8_BLOCK
from toy import (
    INT8_RTOL,
    ManualAccumulationModule,
    RunConfig,
    ToyModule,
    assert_compressed_run,
    assert_matches_reference,
    fit_with_mics,
    full_parameters,
    reference_training,
    trainer_kwargs,
)

CLIP = 0.5  # reference gradient norms are ~3-5, so this clips every step


def config(world: int, accumulate: int, clip: float | None = None) -> RunConfig:
    return RunConfig(world_size=world, accumulate=accumulate, clip=clip)


WORLD4_LAYOUTS = [(p, a) for p in (1, 2, 4) for a in (1, 3)]
WORLD8_LAYOUTS = [(p, a) for p in (2, 4, 8) for a in (1, 3)]
#: grad_accumulation="unsharded" (one reduce-scatter per optimizer step): partitions inside a node
#: and, at world 8, one spanning both nodes (hierarchical stages).
WORLD4_UNSHARDED = [2, 4]
WORLD8_UNSHARDED = [8]


def _clip_for(accumulate: int) -> float | None:
    return CLIP if accumulate == 3 else None


def _train_layouts(rank: int, world: int, layouts, ranks_per_node: int | None) -> dict:
    results = {}
    for partition, accumulate in layouts:
        cfg = config(world, accumulate, _clip_for(accumulate))
        module = ToyModule(cfg)
        fit_with_mics(module, cfg, partition_size=partition, ranks_per_node=ranks_per_node)
        results[(partition, accumulate)] = full_parameters(module)
    return results


def _train_unsharded(world: int, partitions: list[int], ranks_per_node: int | None) -> dict:
    results = {}
    for partition in partitions:
        cfg = config(world, 3, CLIP)
        module = ToyModule(cfg)
        fit_with_mics(
            module, cfg, partition_size=partition, ranks_per_node=ranks_per_node, grad_accumulation="unsharded"
        )
        results[("unsharded", partition)] = full_parameters(module)
    return results


def _train_world4_variants(rank: int, world: int) -> dict:
    results = _train_layouts(rank, world, WORLD4_LAYOUTS, None)
    results.update(_train_unsharded(world, WORLD4_UNSHARDED, None))

    cfg = config(world, 3, CLIP)
    module = ManualAccumulationModule(cfg)
    fit_with_mics(module, cfg, partition_size=2, grad_accumulation="unsharded")
    results["manual-unsharded"] = full_parameters(module)

    module = ToyModule(cfg)
    fit_with_mics(module, cfg, partition_size=2, cross_replica_dtype="bf16")
    results["bf16-cross-replica"] = full_parameters(module)
    results["int8-cross-replica"] = _train_int8(cfg, partition_size=2, ranks_per_node=2)

    auto = MiCSStrategy(sharding="auto", grad_accumulation="auto")
    module = ToyModule(cfg)
    fit_with_mics(module, cfg, strategy=auto)
    results["auto"] = full_parameters(module)
    predicted = plan_layout_for(
        module, world, world, torch.device("cpu"), "32-true", 3, grad_accumulation="auto", uniform_only=False
    )
    results["auto layout"] = (auto.sharding, auto.grad_accumulation, predicted)

    # the same, planned for this job's measured cluster (2 "nodes" x 2 ranks) instead of a generic GPU one
    from lightning_mics.planner import live

    calibrated = MiCSStrategy(sharding="auto", grad_accumulation="auto", ranks_per_node=2, planner_cluster="calibrate")
    module = ToyModule(cfg)
    fit_with_mics(module, cfg, strategy=calibrated)
    results["auto-calibrated"] = full_parameters(module)
    measured = live.planner_cluster_for("calibrate", world, 2, torch.device("cpu"))  # the cached measurement
    predicted = plan_layout_for(
        module, world, 2, torch.device("cpu"), "32-true", 3, grad_accumulation="auto", uniform_only=False,
        cluster=measured,
    )
    results["auto-calibrated layout"] = (calibrated.sharding, calibrated.grad_accumulation, predicted, measured)

    module = ToyModule(cfg)  # AMSP: optimizer states sharded across both replicas
    fit_with_mics(module, cfg, sharding=ShardingSpec(params=2, grads=2, optim=4), grad_accumulation="unsharded")
    results["amsp-optim-world-unsharded"] = full_parameters(module)

    cfg = config(world, 3, CLIP)
    module = ToyModule(cfg, in_configure_model=True)
    fit_with_mics(module, cfg, partition_size=2)
    results["configure_model"] = full_parameters(module)

    module = ManualAccumulationModule(cfg)
    fit_with_mics(module, cfg, partition_size=2)
    results["manual"] = full_parameters(module)

    cfg = config(world, 1)
    module = ToyModule(cfg)
    fit_with_mics(module, cfg, partition_size=2, auto_wrap_policy=torch.nn.Linear, reshard_after_forward=False)
    results["linear_units_no_reshard"] = full_parameters(module)

    cfg = config(world, 3, CLIP)
    module = ToyModule(cfg)
    fit_with_mics(module, cfg, partition_size=2, activation_checkpointing_policy=True, prefetch_depth=2)
    results["activation_checkpointing_prefetch2"] = full_parameters(module)

    cfg = config(world, 1)
    module = ToyModule(cfg)
    trainer = pl.Trainer(strategy="mics", **{**trainer_kwargs(cfg), "precision": "bf16-mixed"})
    trainer.fit(module)
    results["bf16-mixed"] = full_parameters(module)
    results["bf16-mixed master dtypes"] = {p.dtype for p in module.parameters()}
    return results


def _train_int8(cfg, **strategy_kwargs) -> dict:
    """``cross_replica_dtype="int8"``: the parameters, and the bytes telemetry recorded per optimizer
    step next to the analytic schedule's for the int8 wire (blocks of 256 with one fp32 scale)."""
    module, telemetry = ToyModule(cfg), TrainingTelemetry(peak_flops=None, prog_bar=False)
    trainer = fit_with_mics(module, cfg, callbacks=[telemetry], cross_replica_dtype="int8", **strategy_kwargs)
    strategy, topology = trainer.strategy, trainer.strategy.topology
    expected = analytic_comm_bytes(
        fsdp_unit_shapes(strategy.fsdp_units),
        topology.partition_size,
        topology.replication_degree,
        cfg.accumulate,
        grad_accumulation=strategy.grad_accumulation,
        **INT8.byte_model(),
    )
    recorded = [step.comm for step in telemetry.steps]
    return {"params": full_parameters(module), "recorded": recorded, "expected": expected}


def _int8_across_three_replicas(rank: int, world: int) -> dict:
    """Partition 1, three replicas: each rank's int8 pieces go to two others (a group of 3); and a
    non-finite gradient element on one rank reaches every rank as NaN (not a finite number) through the
    same collective."""
    import torch.distributed as dist

    from lightning_mics.collectives import compressed_all_reduce_

    cfg = config(world, 3, CLIP)
    results = _train_int8(cfg, partition_size=1)
    grads = torch.arange(3 * INT8_BLOCK, dtype=torch.float32) / INT8_BLOCK
    if rank == 1:
        grads[5] = float("inf")
    compressed_all_reduce_(grads, dist.group.WORLD, INT8)
    results["non-finite sum"] = grads
    return results


def _train_compiled(rank: int, world: int) -> dict:
    cfg = config(world, 3)
    module = ToyModule(cfg)
    fit_with_mics(module, cfg, partition_size=2, compile_blocks=True)
    compiled = all(block._compiled_call_impl is not None for block in module.model.blocks)
    return {"params": full_parameters(module), "compiled": compiled}


@pytest.fixture(scope="module")
def world4():
    return run_ranks(_train_world4_variants, 4)


def _train_world8(rank: int, world: int) -> dict:
    results = _train_layouts(rank, world, WORLD8_LAYOUTS, 4)
    results.update(_train_unsharded(world, WORLD8_UNSHARDED, 4))
    return results


@pytest.fixture(scope="module")
def world8():
    return run_ranks(_train_world8, 8)


@pytest.mark.distributed
@pytest.mark.parametrize(("partition", "accumulate"), WORLD4_LAYOUTS)
def test_world4_matches_single_process(world4, partition, accumulate):
    cfg = config(4, accumulate, _clip_for(accumulate))
    assert_matches_reference([rank[(partition, accumulate)] for rank in world4], cfg)


@pytest.mark.distributed
@pytest.mark.parametrize(("partition", "accumulate"), WORLD8_LAYOUTS)
def test_world8_two_nodes_matches_single_process(world8, partition, accumulate):
    cfg = config(8, accumulate, _clip_for(accumulate))
    assert_matches_reference([rank[(partition, accumulate)] for rank in world8], cfg)


@pytest.mark.distributed
@pytest.mark.parametrize("partition", WORLD4_UNSHARDED)
def test_world4_unsharded_accumulation_matches_single_process(world4, partition):
    assert_matches_reference([rank[("unsharded", partition)] for rank in world4], config(4, 3, CLIP))


@pytest.mark.distributed
@pytest.mark.parametrize("partition", WORLD8_UNSHARDED)
def test_world8_unsharded_accumulation_matches_single_process(world8, partition):
    assert_matches_reference([rank[("unsharded", partition)] for rank in world8], config(8, 3, CLIP))


@pytest.mark.distributed
def test_manual_optimization_with_unsharded_accumulation(world4):
    assert_matches_reference([rank["manual-unsharded"] for rank in world4], config(4, 3, CLIP))


def assert_recorded_bytes_are_the_analytic_ones(per_rank: list[dict], steps: int) -> None:
    """Telemetry's bytes per optimizer step equal the schedule's, exactly; besides them only the
    scalar all-reduce of clipping by norm (4 bytes, inside the partition: not modelled) and
    Lightning's broadcasts (control traffic, "other")."""
    for result in per_rank:
        assert len(result["recorded"]) == steps
        expected = result["expected"]
        for comm in result["recorded"]:
            for kind in ("all_gather", "reduce_scatter"):
                assert comm.by_kind[kind] == expected.by_kind[kind], kind
            assert comm.by_kind["all_reduce"] == expected.by_kind["all_reduce"] + 4
            assert comm.cross_replica == expected.cross_replica > 0


@pytest.mark.distributed
def test_bf16_cross_replica_all_reduce_tracks_fp32_and_keeps_replicas_identical(world4):
    runs = [rank["bf16-cross-replica"] for rank in world4]
    # one bf16 rounding of each gradient message: close to the fp32 reference, not bit-close;
    # partitions {0, 1} and {2, 3} hold replicas
    assert_compressed_run(runs, config(4, 3, CLIP), 1e-2, [[0, 2], [1, 3]], world4[0][(2, 3)])




@pytest.mark.distributed
def test_int8_cross_replica_all_reduce_tracks_fp32_keeps_replicas_identical_and_counts_its_bytes(world4):
    """4 ranks as 2 nodes x 2 (replication 2), accumulation 3, clipping."""
    per_rank = [rank["int8-cross-replica"] for rank in world4]
    runs = [result["params"] for result in per_rank]
    assert_compressed_run(runs, config(4, 3, CLIP), INT8_RTOL, [[0, 2], [1, 3]], world4[0][(2, 3)])
    assert_recorded_bytes_are_the_analytic_ones(per_rank, config(4, 3, CLIP).steps)
    # what crosses replicas: one packed int8 reduce-scatter + all-gather, (1 + 4/256) bytes per element
    expected = per_rank[0]["expected"]
    assert expected.by_kind["all_reduce"] == 0
    assert expected.by_kind["reduce_scatter"] > 0 and expected.cross_replica % (INT8_BLOCK + 4) == 0


@pytest.mark.distributed
def test_int8_cross_replica_ring_of_three_replicas():
    per_rank = run_ranks(_int8_across_three_replicas, 3)
    runs = [result["params"] for result in per_rank]
    cfg = config(3, 3, CLIP)
    assert_matches_reference(runs, cfg, rtol=INT8_RTOL)
    for rank in (1, 2):  # partition 1: all three ranks are replicas of the whole model
        for name in runs[0]:
            assert torch.equal(runs[0][name], runs[rank][name]), (rank, name)
    assert_recorded_bytes_are_the_analytic_ones(per_rank, cfg.steps)
    sums = [result["non-finite sum"] for result in per_rank]
    for other in sums:  # the same on every rank (NaN included), and the NaN stays where the inf was
        assert torch.isnan(other[5]) and torch.isfinite(other[torch.arange(other.numel()) != 5]).all()
        torch.testing.assert_close(other, sums[0], equal_nan=True, rtol=0, atol=0)


@pytest.mark.distributed
def test_planner_chosen_layout_and_accumulation_match_single_process(world4):
    spec, mode, predicted = world4[0]["auto layout"]
    chosen = predicted.estimate.layout
    assert spec == ShardingSpec(chosen.params, chosen.grads, chosen.optim) and mode == predicted.grad_accumulation
    assert all(rank["auto layout"][:2] == (spec, mode) for rank in world4)  # every rank chose alike
    assert_matches_reference([rank["auto"] for rank in world4], config(4, 3, CLIP))


@pytest.mark.distributed
def test_layout_planned_for_the_measured_cluster_matches_single_process(world4):
    spec, mode, predicted, measured = world4[0]["auto-calibrated layout"]
    chosen = predicted.estimate.layout
    assert spec == ShardingSpec(chosen.params, chosen.grads, chosen.optim) and mode == predicted.grad_accumulation
    # every rank measured the same cluster (slowest-rank values) and so chose alike
    assert all(rank["auto-calibrated layout"][3] == measured for rank in world4)
    assert all(rank["auto-calibrated layout"][:2] == (spec, mode) for rank in world4)
    assert measured.name == "calibrated" and measured.overlap == 0.0 and (measured.nodes, measured.gpus_per_node) == (2, 2)
    # links, compute and optimizer rate were measured here, not the generic GPU cluster's
    generic = ClusterSpec.generic(2, 2, 1.0)
    for name in ("intra_node_bandwidth", "inter_node_bandwidth", "compute_flops", "memory_bandwidth"):
        assert 0 < getattr(measured, name) < getattr(generic, name), name
    assert_matches_reference([rank["auto-calibrated"] for rank in world4], config(4, 3, CLIP))


@pytest.mark.distributed
def test_unsharded_accumulation_with_optimizer_states_sharded_across_replicas(world4):
    assert_matches_reference([rank["amsp-optim-world-unsharded"] for rank in world4], config(4, 3, CLIP))


def test_clipping_was_active():
    _, norms = reference_training(config(4, 3, CLIP))
    assert min(norms) > CLIP  # otherwise the clipped runs would not test clipping


@pytest.mark.distributed
def test_model_built_in_configure_model(world4):
    assert_matches_reference([rank["configure_model"] for rank in world4], config(4, 3, CLIP))


@pytest.mark.distributed
def test_manual_optimization_with_no_cross_replica_sync(world4):
    assert_matches_reference([rank["manual"] for rank in world4], config(4, 3, CLIP))


@pytest.mark.distributed
def test_custom_units_without_reshard(world4):
    assert_matches_reference([rank["linear_units_no_reshard"] for rank in world4], config(4, 1))


@pytest.mark.distributed
def test_activation_checkpointing_with_deeper_prefetch(world4):
    assert_matches_reference([rank["activation_checkpointing_prefetch2"] for rank in world4], config(4, 3, CLIP))


@pytest.mark.distributed
def test_bf16_mixed_keeps_fp32_master_weights_and_tracks_fp32_run(world4):
    assert world4[0]["bf16-mixed master dtypes"] == {torch.float32}
    # bf16 compute: close to the fp32 reference, but not bit-close.
    assert_matches_reference([rank["bf16-mixed"] for rank in world4], config(4, 1), rtol=3e-2)


@pytest.mark.distributed
def test_torch_compiled_blocks():
    results = run_ranks(_train_compiled, 2)
    assert all(r["compiled"] for r in results)
    assert_matches_reference([r["params"] for r in results], config(2, 3))
