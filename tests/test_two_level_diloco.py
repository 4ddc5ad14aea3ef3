"""Two-level DiLoCo (``diloco_worker_size``): a DiLoCo worker of several partition groups synchronises every step
inside, and only the workers average every H steps -- equal to a hand-written two-level reference, to synchronous
MiCS with one worker, to flat DiLoCo with workers of one group; its layout, collectives, resume and refusals.

The distributed tests run 8 gloo ranks as 4 emulated nodes of 2 (partition 2): two workers of two partition groups
each, in one spawn. The reference trains one model per worker in one process, its gradient the mean over the
worker's four ranks' samples, the workers' parameter deltas averaged every H steps by the outer optimizer.
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any, Optional

import lightning.pytorch as pl
import pytest
import torch
from diloco_reference import PerRankData, diloco_reference, max_difference, rank_samples, trained
from diloco_reference import global_model as _anchors
from distributed import run_ranks
from toy import RunConfig, ToyModule, full_parameters, lm_loss, make_dataset, strip_prefix, trainer_kwargs

from lightning_mics import MiCSFabricStrategy, MiCSOptions, MiCSStrategy, ShardingSpec
from lightning_mics.hop2.diloco import default_outer_optimizer
from lightning_mics.layout import resolve_layout
from lightning_mics.topology import MiCSTopology

WORLD, RANKS_PER_NODE, PARTITION = 8, 2, 2
WORKER = 2  # partition groups per DiLoCo worker: 2 workers of 4 ranks
STEPS_PER_EPOCH, EPOCHS, EVERY = 2, 5, 4  # outer rounds after steps 4 and 8, then two inner steps
RESUME_EPOCH = 3  # saved after step 6: mid-round, one outer step (and its momentum) done
TOLERANCE = 1e-6

CFG = RunConfig(world_size=WORLD, accumulate=1, steps=STEPS_PER_EPOCH, lr=0.1, momentum=0.9)
PLAIN_SGD = RunConfig(world_size=WORLD, accumulate=2, steps=STEPS_PER_EPOCH, lr=0.5, momentum=0.0)
OUTER_SGD_LR1 = functools.partial(torch.optim.SGD, lr=1.0)
TWO_LEVEL = {"cross_replica_sync": "diloco", "sync_every": EVERY, "diloco_worker_size": WORKER}


def fit(module: ToyModule, cfg: RunConfig, epochs: int, ckpt_path: Optional[str] = None, **options: Any) -> pl.Trainer:
    kwargs = {**trainer_kwargs(cfg), "max_steps": -1, "max_epochs": epochs, "use_distributed_sampler": False}
    trainer = pl.Trainer(strategy=MiCSStrategy(ranks_per_node=RANKS_PER_NODE, **options), **kwargs)
    trainer.fit(module, ckpt_path=ckpt_path)
    return trainer


# ---------------------------------------------------------------------------------------------------------------------
# what the ranks run


def _scenarios(rank: int, world: int, root: str) -> dict[str, Any]:
    from lightning_mics.collective_recorder import CollectiveRecorder

    results: dict[str, Any] = {}
    # two workers of two partition groups, H=4, inner momentum, DiLoCo's outer Nesterov; collectives recorded
    module = PerRankData(CFG)
    with CollectiveRecorder() as recorder:
        trainer = fit(module, CFG, EPOCHS, **TWO_LEVEL)
    strategy = trainer.strategy
    topology = strategy.layout.settings.topology
    inside = tuple(r for r in topology.worker_groups[rank // (WORKER * PARTITION)] if r % PARTITION == rank % PARTITION)
    across = next(g for g in topology.outer_replication_groups if rank in g)
    calls = [(c.kind, tuple(sorted(c.ranks)), c.bytes) for c in recorder.calls]
    results["calls_inside_worker"] = [(k, b) for k, ranks, b in calls if ranks == inside]
    results["calls_across_workers"] = [(k, b) for k, ranks, b in calls if ranks == tuple(sorted(across))]
    (sync,) = strategy.engine.semi_sync.syncs
    results["pseudo_gradient_bytes"] = 4 * sum(p.to_local().numel() for p in sync.params)
    results["hop2"] = strategy.layout.settings.hop2
    results["layout_text"] = strategy.layout.describe(module, len(strategy.fsdp_units))
    results["two_level"] = strip_prefix(full_parameters(module))
    results["two_level_global"] = strip_prefix(_anchors(trainer))
    results["outer_steps"] = sync.outer_steps
    results["worker_index"] = strategy.engine.semi_sync.replica

    # FSDP2's own hop 2 on the worker's 2-D plane (cross_replica_overlap=False) inside the worker
    module = PerRankData(CFG)
    trainer = fit(module, CFG, EPOCHS, cross_replica_overlap=False, **TWO_LEVEL)
    results["fsdp_inner_schedule"] = trainer.strategy.layout.settings.hop2.schedule
    results["two_level_fsdp_inner"] = strip_prefix(full_parameters(module))

    # saved mid-round (after step 6) and resumed by a new Trainer
    path = str(Path(root, "two_level.ckpt"))
    module = PerRankData(CFG)
    first = fit(module, CFG, RESUME_EPOCH, **TWO_LEVEL)
    first.save_checkpoint(path)
    results["saved_inner_steps"] = first.strategy.engine.semi_sync.syncs[0].inner_steps
    module = PerRankData(CFG)
    trainer = fit(module, CFG, EPOCHS, ckpt_path=path, **TWO_LEVEL)
    results["resumed"] = strip_prefix(full_parameters(module))
    results["resumed_global"] = strip_prefix(_anchors(trainer))

    # one worker spanning every partition group, plain SGD and outer SGD(lr=1): synchronous MiCS
    module = PerRankData(PLAIN_SGD)
    fit(module, PLAIN_SGD, 3)
    results["synchronous"] = strip_prefix(full_parameters(module))
    module = PerRankData(PLAIN_SGD)
    trainer = fit(module, PLAIN_SGD, 3, cross_replica_sync="diloco", sync_every=EVERY, diloco_worker_size=4,
                  outer_optimizer=OUTER_SGD_LR1)
    results["one_worker"] = strip_prefix(full_parameters(module))
    results["one_worker_outer_steps"] = trainer.strategy.engine.semi_sync.syncs[0].outer_steps

    # workers of one partition group: flat DiLoCo
    module = PerRankData(CFG)
    fit(module, CFG, EPOCHS, cross_replica_sync="diloco", sync_every=EVERY)
    results["flat"] = strip_prefix(full_parameters(module))
    module = PerRankData(CFG)
    fit(module, CFG, EPOCHS, cross_replica_sync="diloco", sync_every=EVERY, diloco_worker_size=1)
    results["flat_worker_size_1"] = strip_prefix(full_parameters(module))

    results["fabric"] = _fabric_run(rank)
    return results


def _fabric_run(rank: int) -> dict[str, torch.Tensor]:
    from lightning.fabric import Fabric

    strategy = MiCSFabricStrategy(ranks_per_node=RANKS_PER_NODE, **TWO_LEVEL)
    fabric = Fabric(accelerator="cpu", devices=WORLD, strategy=strategy)
    fabric.launch()
    module = ToyModule(CFG)
    model, optimizer = fabric.setup(module, module.configure_optimizers())
    tokens, targets = make_dataset(CFG.num_samples).tensors
    mine = rank_samples(CFG, rank)
    for _ in range(EPOCHS):
        for s in range(CFG.steps):
            rows = mine[s * CFG.micro_batch : (s + 1) * CFG.micro_batch]
            fabric.backward(lm_loss(model, (tokens[rows], targets[rows])))
            optimizer.step()
            optimizer.zero_grad()
    return strip_prefix(full_parameters(module))


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    return run_ranks(_scenarios, WORLD, str(tmp_path_factory.mktemp("two_level")), timeout=400)


def _worker_of(rank: int) -> int:
    return rank // (WORKER * PARTITION)


# ---------------------------------------------------------------------------------------------------------------------
# distributed tests


@pytest.mark.distributed
def test_two_workers_of_two_groups_match_a_hand_written_two_level_diloco(ranks: list[dict[str, Any]]) -> None:
    """Synchronous inside each worker every step, outer Nesterov across workers after steps 4 and 8: each worker's
    parameters and the global copy equal the reference, through the engine's hop 2 and FSDP2's, and through
    Fabric; the partition groups of one worker hold the same parameters, the two workers differ mid-round."""
    global_model, workers = diloco_reference(CFG, EPOCHS, EVERY, WORKER * PARTITION, default_outer_optimizer)
    assert max_difference(workers[0], workers[1]) > 1e-3
    flat_global, _ = diloco_reference(CFG, EPOCHS, EVERY, PARTITION, default_outer_optimizer)
    assert max_difference(trained(global_model), trained(flat_global)) > 1e-3  # not flat DiLoCo's numbers
    for rank, result in enumerate(ranks):
        assert result["outer_steps"] == 2
        assert result["worker_index"] == _worker_of(rank)
        assert result["fsdp_inner_schedule"] == "fsdp"
        assert max_difference(result["two_level_global"], trained(global_model)) < TOLERANCE
        for key in ("two_level", "two_level_fsdp_inner", "fabric"):
            assert max_difference(result[key], workers[_worker_of(rank)]) < TOLERANCE, key


@pytest.mark.distributed
def test_hop_2_runs_inside_the_worker_every_step_and_the_outer_round_across_workers(
    ranks: list[dict[str, Any]],
) -> None:
    """Every one of the 10 steps all-reduces gradient shards among the worker's replicas of this shard; across
    workers only the two outer rounds' pseudo-gradient messages travel."""
    for result in ranks:
        hop2 = result["hop2"]
        assert (hop2.schedule, hop2.outer_every, hop2.semi_sync, hop2.sync_every) == ("behind_backward", EVERY, True,
                                                                                       EVERY)
        inside = result["calls_inside_worker"]
        assert inside and {kind for kind, _ in inside} == {"all_reduce"}
        assert len(inside) >= EPOCHS * STEPS_PER_EPOCH  # one per FSDP unit per step (at least one unit)
        assert len(inside) % (EPOCHS * STEPS_PER_EPOCH) == 0
        assert result["calls_across_workers"] == [("all_reduce", result["pseudo_gradient_bytes"])] * 2
        assert "DiLoCo workers (2 partition groups each" in result["layout_text"]
        assert "across workers every 4 optimizer steps" in result["layout_text"]


@pytest.mark.distributed
def test_a_two_level_run_resumes_mid_round_exactly(ranks: list[dict[str, Any]]) -> None:
    """Saved two inner steps into the second round and resumed: each worker's own parameters and inner momentum,
    the outer momentum and the global copy come back, bit for bit."""
    for result in ranks:
        assert result["saved_inner_steps"] == 2
        for name, value in result["two_level"].items():
            assert torch.equal(result["resumed"][name], value), name
        for name, value in result["two_level_global"].items():
            assert torch.equal(result["resumed_global"][name], value), name


@pytest.mark.distributed
def test_one_worker_is_synchronous_mics_and_workers_of_one_group_are_flat_diloco(ranks: list[dict[str, Any]]) -> None:
    """One worker spanning all four partition groups with outer SGD(lr=1): today's synchronous MiCS within 1e-6
    (the outer step is then the identity); ``diloco_worker_size=1``: flat DiLoCo, bit for bit."""
    for result in ranks:
        assert result["one_worker_outer_steps"] == 3 * STEPS_PER_EPOCH // EVERY
        assert max_difference(result["one_worker"], result["synchronous"]) < TOLERANCE
        for name, value in result["flat"].items():
            assert torch.equal(result["flat_worker_size_1"][name], value), name


# ---------------------------------------------------------------------------------------------------------------------
# layout and refusals, no processes


def test_topology_tiles_workers_into_whole_nodes_and_regions() -> None:
    topology = MiCSTopology.create(8, 2, 2, 2)
    assert (topology.num_workers, topology.worker_mesh_shape) == (2, (2, 2, 2))
    assert topology.worker_groups == ((0, 1, 2, 3), (4, 5, 6, 7))
    assert topology.outer_replication_groups == ((0, 4), (1, 5), (2, 6), (3, 7))
    assert MiCSTopology.create(16, 2, 2, "region", ranks_per_region=8).worker_size == 4
    with pytest.raises(ValueError, match="does not divide the 4 partition groups.*choose one of \\[2, 4\\]"):
        MiCSTopology.create(8, 2, 2, 3)
    with pytest.raises(ValueError, match="not whole nodes of 4"):
        MiCSTopology.create(8, 4, 1, 2)
    with pytest.raises(ValueError, match="does not tile a region of ranks_per_region=4"):
        MiCSTopology.create(16, 2, 2, 4, ranks_per_region=4)
    with pytest.raises(ValueError, match="ranks_per_region=3 must be whole nodes"):
        MiCSTopology.create(12, 2, 2, None, ranks_per_region=3)
    with pytest.raises(ValueError, match="needs the ranks per region: pass ranks_per_region"):
        MiCSTopology.create(8, 2, 2, "region")


def _settings(**kwargs: Any):
    base = dict(world_size=8, rank=0, ranks_per_node=2, partition_size=2, reshard_after_forward=True, sharding=None,
                hierarchical="auto", device_type="cpu", backend="gloo", cross_replica_overlap=True, sync_every=EVERY)
    return resolve_layout(**{**base, **kwargs})


def test_the_layout_decides_the_workers_schedule_and_the_outer_round() -> None:
    assert _settings(diloco_worker_size=None) == _settings(diloco_worker_size=1)
    assert _settings(diloco_worker_size=None).hop2.schedule == "diloco"
    two_level = _settings(diloco_worker_size=2).hop2
    assert (two_level.schedule, two_level.outer_every) == ("behind_backward", EVERY)
    compressed = _settings(diloco_worker_size=2, cross_replica_overlap=False, cross_replica_wire=None).hop2
    assert compressed.schedule == "fsdp"
    differences = _settings(diloco_worker_size=2).differences(_settings(diloco_worker_size=4))
    assert "diloco_worker_size: 2 vs 4" in differences
    with pytest.raises(ValueError, match="cannot shard optimizer states across replicas"):
        _settings(diloco_worker_size=2, sharding=ShardingSpec(params=2, grads=2, optim=4))


def test_the_options_refuse_what_two_level_diloco_does_not_do() -> None:
    with pytest.raises(ValueError, match="diloco_worker_size only applies to semi-synchronous"):
        MiCSOptions(diloco_worker_size=2)
    with pytest.raises(ValueError, match="diloco_worker_size=0 must be a positive number"):
        MiCSOptions(cross_replica_sync="diloco", sync_every=4, diloco_worker_size=0)
    with pytest.raises(ValueError, match="two-level DiLoCo\\) with fault_tolerance is not built"):
        MiCSOptions(cross_replica_sync="diloco", sync_every=4, diloco_worker_size=2,
                    fault_tolerance={"lighthouse": "http://127.0.0.1:1", "replica_group": 0, "num_replica_groups": 2})
    with pytest.raises(ValueError, match="ranks_per_region must be a positive int"):
        MiCSOptions(ranks_per_region=0)


def test_the_launcher_refuses_a_worker_that_does_not_tile_whole_nodes() -> None:
    strategy = MiCSStrategy(ranks_per_node=4, partition_size=1, **TWO_LEVEL)
    with pytest.raises(ValueError, match="is 2 ranks, not whole nodes of 4"):
        strategy.engine.check_before_launch(num_processes=4, num_nodes=2)
