"""Hop 2 behind backward (``cross_replica_overlap``, the default): each unit's gradient shards start
crossing the replication group during the boundary backward, and the numbers stay those of
single-process training and of FSDP2's own (non-overlapped) hop 2.

4 gloo ranks as 2 emulated nodes x 2, partition 2 (2 replicas), Fabric loops on the toy model; one
spawn runs every scenario. The overlap is observed directly: when the first block's backward begins,
the units after it (whose backward is done) must already have their cross-replica sums in flight on a
boundary micro-step, and none on the others.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from distributed import run_ranks
from lightning.fabric import Fabric
from toy import (
    INT8_RTOL,
    LAYERS,
    RunConfig,
    ToyModule,
    assert_matches_reference,
    full_parameters,
    global_batches,
    lm_loss,
)

from lightning_mics import MiCSFabricStrategy
from lightning_mics.hop2.pipeline import CrossReplicaPipeline

WORLD, PARTITION, RANKS_PER_NODE = 4, 2, 2
CFG = RunConfig(world_size=WORLD, accumulate=3, clip=0.5, steps=2)


def _launch(**options: Any) -> Fabric:
    strategy = MiCSFabricStrategy(ranks_per_node=RANKS_PER_NODE, partition_size=PARTITION, **options)
    fabric = Fabric(accelerator="cpu", devices=WORLD, strategy=strategy)
    fabric.launch()
    return fabric


def _hop(fabric: Fabric) -> Any:
    syncs = fabric.strategy.engine.pipelines()
    return syncs[0] if syncs else None


def _micro_batch(fabric: Fabric, step: int, j: int) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's piece of global micro-batch ``j`` of optimizer step ``step`` (as the reference consumes it)."""
    tokens, targets = global_batches(CFG)
    first = ((step * CFG.accumulate + j) * WORLD + fabric.global_rank) * CFG.micro_batch
    return tokens[first : first + CFG.micro_batch], targets[first : first + CFG.micro_batch]


def _train(fabric: Fabric, use_closure: bool = False) -> tuple[dict[str, torch.Tensor], list[int]]:
    """``CFG.accumulate`` micro-steps per optimizer step (``no_backward_sync`` on all but the last), clipping,
    SGD. Returns the unsharded parameters and, per micro-step, the units whose sums were in flight when
    the first block's backward began."""
    module = ToyModule(CFG)
    model, optimizer = fabric.setup(module, module.configure_optimizers())
    hop = _hop(fabric)
    in_flight: list[int] = []
    first_block = module.model.blocks[0]
    first_block.register_full_backward_pre_hook(
        lambda *_: in_flight.append(hop.units_in_flight if isinstance(hop, CrossReplicaPipeline) and hop.overlapped else -1)
    )
    for step in range(CFG.steps):
        for j in range(CFG.accumulate):
            batch = _micro_batch(fabric, step, j)
            boundary = j == CFG.accumulate - 1

            def micro_step(batch: Any = batch) -> torch.Tensor:
                loss = lm_loss(model, batch) / CFG.accumulate
                fabric.backward(loss)
                return loss

            if boundary and use_closure:  # the backward runs inside optimizer.step(closure); no clipping there
                optimizer.step(micro_step)
            else:
                with fabric.no_backward_sync(model, enabled=not boundary):
                    micro_step()
                if boundary:
                    fabric.clip_gradients(model, optimizer, max_norm=CFG.clip)
                    optimizer.step()
        optimizer.zero_grad()
    return full_parameters(model.module), in_flight


def _train_two_models_one_optimizer(fabric: Fabric) -> list[dict[str, torch.Tensor]]:
    """Two identical models stepped by one SGD on the sum of their losses, no clipping: each gets exactly its
    own gradients, so each must train like the single model (hop 2 runs for both, model by model)."""
    first, second = ToyModule(CFG), ToyModule(CFG)
    first, second = fabric.setup_module(first), fabric.setup_module(second)
    params = [p for m in (first, second) for p in m.parameters() if p.requires_grad]
    optimizer = fabric.setup_optimizers(torch.optim.SGD(params, lr=CFG.lr, momentum=CFG.momentum))
    for step in range(CFG.steps):
        for j in range(CFG.accumulate):
            batch = _micro_batch(fabric, step, j)
            boundary = j == CFG.accumulate - 1
            with fabric.no_backward_sync(first, enabled=not boundary), fabric.no_backward_sync(
                second, enabled=not boundary
            ):
                fabric.backward((lm_loss(first, batch) + lm_loss(second, batch)) / CFG.accumulate)
        optimizer.step()
        optimizer.zero_grad()
    return [full_parameters(first.module), full_parameters(second.module)]


def _scenarios(rank: int, world: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name, options in {
        "overlap": {},
        "fsdp_hop": {"cross_replica_overlap": False},
        "overlap_unsharded": {"grad_accumulation": "unsharded"},
        "overlap_int8": {"cross_replica_dtype": "int8"},
        "after_backward_int8": {"cross_replica_dtype": "int8", "cross_replica_overlap": False},
    }.items():
        fabric = _launch(**options)
        out[name], out[name + "_in_flight"] = _train(fabric)
        out[name + "_mesh_dims"] = fabric.strategy.layout.fsdp_mesh.ndim
    out["closure"], _ = _train(_launch(), use_closure=True)
    out["two_models"] = _train_two_models_one_optimizer(_launch())
    return out


@pytest.fixture(scope="module")
def runs() -> list[dict[str, Any]]:
    return run_ranks(_scenarios, WORLD)


#: units whose backward is done when the first block's begins: the blocks after it (the root unit, which
#: holds the embedding and the tied head, reduces last)
UNITS_BEFORE_FIRST_BLOCK = LAYERS - 1


@pytest.mark.distributed
@pytest.mark.parametrize("name", ["overlap", "overlap_unsharded", "overlap_int8"])
def test_sums_start_during_the_boundary_backward_only(runs, name):
    for result in runs:
        assert result[name + "_mesh_dims"] == 1  # FSDP2 shards on the partition; hop 2 is ours
        expected = ([0] * (CFG.accumulate - 1) + [UNITS_BEFORE_FIRST_BLOCK]) * CFG.steps
        assert result[name + "_in_flight"] == expected


@pytest.mark.distributed
def test_without_overlap_fsdp2_runs_hop_2_on_its_2d_mesh(runs):
    for result in runs:
        assert result["fsdp_hop_mesh_dims"] == 2
        assert result["fsdp_hop_in_flight"] == [-1] * (CFG.accumulate * CFG.steps)


@pytest.mark.distributed
@pytest.mark.parametrize("name", ["overlap", "overlap_unsharded", "fsdp_hop"])
def test_fp32_matches_single_process(runs, name):
    assert_matches_reference([result[name] for result in runs], CFG)


@pytest.mark.distributed
def test_overlap_changes_no_number_beyond_rounding_of_the_divide(runs):
    for result in runs:
        for name, tensor in result["fsdp_hop"].items():
            torch.testing.assert_close(result["overlap"][name], tensor, rtol=1e-6, atol=1e-7)


@pytest.mark.distributed
def test_int8_overlapped_matches_single_process_and_replicas_agree(runs):
    for name in ("overlap_int8", "after_backward_int8"):
        assert_matches_reference([result[name] for result in runs], CFG, rtol=INT8_RTOL)
    # ranks 0 and 2 hold the same shard in different replicas: identical after every step
    for key, tensor in runs[0]["overlap_int8"].items():
        assert torch.equal(tensor, runs[2]["overlap_int8"][key]), key


@pytest.mark.distributed
@pytest.mark.parametrize("model", [0, 1])
def test_one_optimizer_over_two_models_syncs_both(runs, model):
    unclipped = RunConfig(world_size=WORLD, accumulate=3, clip=None, steps=2)
    assert_matches_reference([result["two_models"][model] for result in runs], unclipped)


@pytest.mark.distributed
def test_fabric_step_with_a_closure_syncs_inside_the_step(runs):
    unclipped = RunConfig(world_size=WORLD, accumulate=3, clip=None, steps=2)
    assert_matches_reference([result["closure"] for result in runs], unclipped)


def test_a_gradient_dropped_while_its_sum_is_in_flight_leaves_the_others_their_sums() -> None:
    from lightning_mics.hop2.pipeline import pack_gradient_shards, unpack_gradient_shards

    params = [torch.nn.Parameter(torch.zeros(n)) for n in (3, 2, 4)]
    for i, param in enumerate(params):
        param.grad = torch.full((param.numel(),), float(i + 1))
    flat = pack_gradient_shards(params)
    flat.mul_(10)  # the reduced sum
    params[1].grad = None  # zero_grad(set_to_none=True) while the sum was in flight
    unpack_gradient_shards(flat, params)
    assert params[1].grad is None
    torch.testing.assert_close(params[0].grad, torch.full((3,), 10.0))
    torch.testing.assert_close(params[2].grad, torch.full((4,), 30.0))  # its own offset, not shifted
