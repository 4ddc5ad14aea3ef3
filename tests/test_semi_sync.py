"""Semi-synchronous replica groups (``cross_replica_sync="diloco"``): H=1 equals synchronous training, H=4 and
streaming DiLoCo match a hand-written single-process DiLoCo, inner steps send nothing across replicas, a mid-round
checkpoint holds the global model and resumes exactly; the bf16 wire, the options' refusals, the layout's decision
and LightningCLI.

The distributed tests run 4 gloo ranks as 2 emulated nodes of 2 (partition 2, 2 replica groups), in one spawn
(process start-up dominates the cost), and compare against a hand-written single-process DiLoCo: one copy of
``ToyLM`` per replica group, each trained by its own inner optimizer on the samples of that group's ranks, the
groups' parameter deltas averaged every H steps and applied by the outer optimizer to the global copy.
"""

from __future__ import annotations

import copy
import functools
from pathlib import Path
from typing import Any, Optional

import lightning.pytorch as pl
import pytest
import torch
from diloco_reference import PerRankData, diloco_reference, max_difference, rank_samples, trainable, trained
from diloco_reference import global_model as _anchors
from distributed import run_ranks
from toy import RunConfig, ToyLM, ToyModule, full_parameters, lm_loss, make_dataset, strip_prefix, trainer_kwargs

from lightning_mics import MiCSFabricStrategy, MiCSStrategy, ShardingSpec
from lightning_mics.hop2 import decide_hop2
from lightning_mics.layout import resolve_layout
from lightning_mics.hop2.diloco import default_outer_optimizer
from lightning_mics.hop2.fragments import fragment_bounds, module_fragments
from lightning_mics.accounting import CROSS_REPLICA, INTRA_PARTITION, analytic_comm_bytes
from lightning_mics.shards import fsdp_unit_shapes
from lightning_mics.telemetry import TrainingTelemetry

WORLD, RANKS_PER_NODE = 4, 2  # partition 2 (one emulated node), 2 replica groups
REPLICAS, PARTITION = WORLD // RANKS_PER_NODE, RANKS_PER_NODE
STEPS_PER_EPOCH = 2
#: H=4 over 5 epochs of 2 steps: outer syncs after steps 4 and 8, then two inner steps (the run ends mid-round)
EPOCHS, EVERY = 5, 4
#: the checkpoint is taken after 3 epochs (step 6): mid-round, one outer sync done, its momentum live
RESUME_EPOCH = 3
TOLERANCE = 1e-6  # the bound, on the largest absolute difference of any parameter element

PLAIN_SGD = RunConfig(world_size=WORLD, accumulate=2, steps=STEPS_PER_EPOCH, lr=0.5, momentum=0.0)
MOMENTUM_SGD = RunConfig(world_size=WORLD, accumulate=1, steps=STEPS_PER_EPOCH, lr=0.1, momentum=0.9)
OUTER_SGD_LR1 = functools.partial(torch.optim.SGD, lr=1.0)
#: streaming DiLoCo: H=4 in 2 fragments (one every 2 steps), each average started 1 step early, mixed half-half
STREAMING = {"cross_replica_sync": "diloco", "sync_every": 4, "num_fragments": 2, "fragment_sync_delay": 1,
             "fragment_update_alpha": 0.5}
STREAM_CFG = RunConfig(world_size=WORLD, accumulate=1, steps=3, lr=0.1, momentum=0.9)
STREAM_EPOCHS = 3


# ---------------------------------------------------------------------------------------------------------------------
# the data: rank k's micro-batch i is samples [(i * WORLD + k) * mb, ... + mb) of make_dataset, every epoch alike
# (diloco_reference.rank_samples)


def fit(
    module: ToyModule, cfg: RunConfig, epochs: int, ckpt_path: Optional[str] = None, callbacks: Optional[list] = None,
    **options: Any,
) -> pl.Trainer:
    kwargs = {**trainer_kwargs(cfg), "max_steps": -1, "max_epochs": epochs, "use_distributed_sampler": False}
    if callbacks:
        kwargs["callbacks"] = [*kwargs.get("callbacks", []), *callbacks]
    trainer = pl.Trainer(strategy=MiCSStrategy(ranks_per_node=RANKS_PER_NODE, **options), **kwargs)
    trainer.fit(module, ckpt_path=ckpt_path)
    return trainer


# ---------------------------------------------------------------------------------------------------------------------
# the hand-written reference


def streaming_reference(
    cfg: RunConfig, epochs: int, every: int, fragments: int, delay: int, alpha: float
) -> tuple[dict[str, torch.Tensor], list[dict[str, torch.Tensor]]]:
    """Streaming DiLoCo in one process (torchft's ``DiLoCo`` with ``fragment_sync_delay`` and
    ``fragment_update_alpha``): the trained parameters cut along the blocks (:func:`module_fragments`); every ``every / fragments``
    steps one fragment, in turn: ``delay`` steps before its turn the replicas' pseudo-gradients of it are averaged,
    at its turn the outer optimizer steps its global copy with that average and each replica's fragment becomes
    ``(1 - alpha) * global + alpha * local``."""
    torch.manual_seed(cfg.seed)
    base = ToyLM()
    models = [copy.deepcopy(base) for _ in range(REPLICAS)]
    inner = [torch.optim.SGD(trainable(m), lr=cfg.lr, momentum=cfg.momentum) for m in models]
    global_model = copy.deepcopy(base)
    global_params = trainable(global_model)
    outer_optimizer = default_outer_optimizer(global_params)
    names = [n for n, p in global_model.named_parameters() if p.requires_grad]
    units = [f"blocks.{i}" for i in range(len(global_model.blocks))]  # the FSDP units, as the strategy wraps them
    members, _ = module_fragments(names, [p.numel() for p in global_params], fragments, units)
    cadence = every // fragments
    tokens, targets = make_dataset(cfg.num_samples).tensors
    per_rank = [rank_samples(cfg, rank) for rank in range(WORLD)]
    counter = synced = 0
    pending: Optional[tuple[int, list[torch.Tensor]]] = None
    for _ in range(epochs):
        for s in range(cfg.steps):
            for r, (model, optimizer) in enumerate(zip(models, inner)):
                optimizer.zero_grad()
                mine = slice(s * cfg.micro_batch, (s + 1) * cfg.micro_batch)
                rows = [x for k in range(r * PARTITION, (r + 1) * PARTITION) for x in per_rank[k][mine]]
                lm_loss(model, (tokens[rows], targets[rows])).backward()
                optimizer.step()
            counter += 1
            with torch.no_grad():
                if counter == cadence - delay:
                    fragment = synced % fragments
                    replicas = [trainable(m) for m in models]
                    pending = (fragment, [
                        torch.stack([global_params[i] - replica[i] for replica in replicas]).mean(0)
                        for i in members[fragment]
                    ])
                if counter == cadence:
                    assert pending is not None
                    fragment, averaged = pending
                    for i, value in zip(members[fragment], averaged):
                        global_params[i].grad = value
                    outer_optimizer.step()
                    outer_optimizer.zero_grad()
                    for model in models:
                        mine = trainable(model)
                        for i in members[fragment]:
                            mine[i].copy_(torch.lerp(global_params[i], mine[i], alpha))  # torchft's form
                    counter, synced, pending = 0, synced + 1, None
    named = lambda m: {n: p.detach().clone() for n, p in m.named_parameters()}  # noqa: E731
    return named(global_model), [named(m) for m in models]


def synchronous_reference(cfg: RunConfig, epochs: int) -> dict[str, torch.Tensor]:
    """Plain data-parallel SGD on the same samples: the mean gradient over every rank's samples."""
    _, replicas = diloco_reference(cfg, epochs, 1, PARTITION, OUTER_SGD_LR1)  # H=1, outer SGD lr 1: the same trajectory
    return replicas[0]


# ---------------------------------------------------------------------------------------------------------------------
# what the ranks run


def _scenarios(rank: int, world: int, root: str) -> dict[str, Any]:
    from lightning_mics.collective_recorder import CollectiveRecorder

    results: dict[str, Any] = {}
    # H=1, plain inner SGD, outer SGD lr 1 without momentum == today's synchronous MiCS (accumulating 2 micro-steps)
    module = PerRankData(PLAIN_SGD)
    fit(module, PLAIN_SGD, 3)
    results["synchronous"] = strip_prefix(full_parameters(module))
    module = PerRankData(PLAIN_SGD)
    trainer = fit(module, PLAIN_SGD, 3, cross_replica_sync="diloco", sync_every=1, outer_optimizer=OUTER_SGD_LR1)
    results["diloco_h1"] = strip_prefix(full_parameters(module))
    results["h1_outer_steps"] = trainer.strategy.engine.semi_sync.syncs[0].outer_steps

    # H=4, inner SGD with momentum, DiLoCo's outer Nesterov SGD; the collectives of every step recorded
    module = PerRankData(MOMENTUM_SGD)
    with CollectiveRecorder() as recorder:
        trainer = fit(module, MOMENTUM_SGD, EPOCHS, cross_replica_sync="diloco", sync_every=EVERY)
    strategy = trainer.strategy
    replication = tuple(sorted(strategy.topology.replication_group_of(rank)))
    results["replication_calls"] = [(c.kind, c.bytes) for c in recorder.calls if tuple(sorted(c.ranks)) == replication]
    (sync,) = strategy.engine.semi_sync.syncs
    results["pseudo_gradient_bytes"] = 4 * sum(p.to_local().numel() for p in sync.params)
    units = fsdp_unit_shapes(strategy.fsdp_units)
    results["analytic_cross_replica_per_step"] = analytic_comm_bytes(
        units, PARTITION, REPLICAS, sync_every=EVERY
    ).cross_replica
    results["fsdp_mesh_ndim"] = strategy.layout.fsdp_mesh.ndim
    results["hop2"] = strategy.layout.settings.hop2
    results["diloco_h4"] = strip_prefix(full_parameters(module))
    results["diloco_h4_global"] = strip_prefix(_anchors(trainer))
    results["h4_outer_steps"] = strategy.engine.semi_sync.syncs[0].outer_steps

    # the same under telemetry (sampling as by default): bytes per step as the schedule averages them
    telemetry = TrainingTelemetry(peak_flops=None)
    trainer = fit(PerRankData(MOMENTUM_SGD), MOMENTUM_SGD, EPOCHS, callbacks=[telemetry], cross_replica_sync="diloco",
                  sync_every=EVERY)
    results["telemetry_summary"] = telemetry.summary()
    results["telemetry_outer_steps"] = [s.step for s in telemetry.steps if s.outer_round]
    results["telemetry_text"] = telemetry.format_summary()
    results["analytic_per_step"] = analytic_comm_bytes(units, PARTITION, REPLICAS, sync_every=EVERY)

    # the same, stopped after 3 epochs (mid-round), saved, resumed by a new Trainer
    path = str(Path(root, "diloco.ckpt"))
    module = PerRankData(MOMENTUM_SGD)
    first = fit(module, MOMENTUM_SGD, RESUME_EPOCH, cross_replica_sync="diloco", sync_every=EVERY)
    first.save_checkpoint(path)
    results["saved_inner_steps"] = first.strategy.engine.semi_sync.syncs[0].inner_steps
    results["saved_global"] = strip_prefix(_anchors(first))
    results["checkpoint"] = path
    module = PerRankData(MOMENTUM_SGD)
    trainer = fit(module, MOMENTUM_SGD, EPOCHS, ckpt_path=path, cross_replica_sync="diloco", sync_every=EVERY)
    results["resumed"] = strip_prefix(full_parameters(module))
    results["resumed_global"] = strip_prefix(_anchors(trainer))
    results["resumed_global_step"] = trainer.global_step

    # bf16 on the wire: the pseudo-gradients cross in bf16 (close to, not equal to, fp32)
    module = PerRankData(MOMENTUM_SGD)
    fit(module, MOMENTUM_SGD, EPOCHS, cross_replica_sync="diloco", sync_every=EVERY, cross_replica_dtype="bf16")
    results["diloco_h4_bf16"] = strip_prefix(full_parameters(module))

    # streaming DiLoCo: 2 fragments in turn, each average started a step before it lands, mixed half-half; epochs of
    # 3 steps: 9 in all (the last fragment's average still in flight at the end)
    module = PerRankData(STREAM_CFG)
    trainer = fit(module, STREAM_CFG, STREAM_EPOCHS, **STREAMING)
    results["streaming"] = strip_prefix(full_parameters(module))
    results["streaming_global"] = strip_prefix(_anchors(trainer))
    results["streaming_outer_steps"] = trainer.strategy.engine.semi_sync.syncs[0].outer_steps
    results["streaming_fragments"] = [(sync.names, sync.fragments) for sync in trainer.strategy.engine.semi_sync.syncs]
    # stopped after one epoch (step 3: fragment 1's average in flight), saved, resumed to the end
    path = str(Path(root, "streaming.ckpt"))
    module = PerRankData(STREAM_CFG)
    first = fit(module, STREAM_CFG, 1, **STREAMING)
    first.save_checkpoint(path)
    results["streaming_saved_in_flight"] = first.strategy.engine.semi_sync.syncs[0].pending is not None
    module = PerRankData(STREAM_CFG)
    trainer = fit(module, STREAM_CFG, STREAM_EPOCHS, ckpt_path=path, **STREAMING)
    results["streaming_resumed"] = strip_prefix(full_parameters(module))

    # Fabric: the same engine, the user's loop
    results["fabric"] = _fabric_run(rank)
    return results


def _fabric_run(rank: int) -> dict[str, torch.Tensor]:
    from lightning.fabric import Fabric

    cfg = MOMENTUM_SGD
    strategy = MiCSFabricStrategy(ranks_per_node=RANKS_PER_NODE, cross_replica_sync="diloco", sync_every=EVERY)
    fabric = Fabric(accelerator="cpu", devices=WORLD, strategy=strategy)
    fabric.launch()
    module = ToyModule(cfg)
    model, optimizer = fabric.setup(module, module.configure_optimizers())
    tokens, targets = make_dataset(cfg.num_samples).tensors
    mine = rank_samples(cfg, rank)
    for _ in range(EPOCHS):
        for s in range(cfg.steps):
            rows = mine[s * cfg.micro_batch : (s + 1) * cfg.micro_batch]
            fabric.backward(lm_loss(model, (tokens[rows], targets[rows])))
            optimizer.step()
            optimizer.zero_grad()
    return strip_prefix(full_parameters(module))


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    return run_ranks(_scenarios, WORLD, str(tmp_path_factory.mktemp("semi_sync")), timeout=240)


def _replica_of(rank: int) -> int:
    return rank // PARTITION


# ---------------------------------------------------------------------------------------------------------------------
# distributed tests


@pytest.mark.distributed
def test_h1_with_plain_sgd_and_outer_sgd_lr1_equals_synchronous_training(ranks: list[dict[str, Any]]) -> None:
    """DiLoCo at H=1 with inner plain SGD and outer SGD(lr=1) takes the synchronous step: p - lr * mean(g)."""
    reference = synchronous_reference(PLAIN_SGD, 3)
    for result in ranks:
        assert result["h1_outer_steps"] == 3 * STEPS_PER_EPOCH
        assert max_difference(result["diloco_h1"], result["synchronous"]) < TOLERANCE
        assert max_difference(result["synchronous"], reference) < TOLERANCE


@pytest.mark.distributed
def test_h4_outer_steps_match_a_hand_written_diloco(ranks: list[dict[str, Any]]) -> None:
    """Two outer Nesterov steps (after steps 4 and 8) and two inner steps since: each replica group holds its own
    parameters, and the last-synchronised copy is the reference's global model."""
    global_model, replicas = diloco_reference(MOMENTUM_SGD, EPOCHS, EVERY, PARTITION, default_outer_optimizer)
    assert max_difference(replicas[0], replicas[1]) > 1e-3  # mid-round the groups have drifted apart
    for rank, result in enumerate(ranks):
        assert result["h4_outer_steps"] == 2
        assert max_difference(result["diloco_h4_global"], trained(global_model)) < TOLERANCE
        assert max_difference(result["diloco_h4"], replicas[_replica_of(rank)]) < TOLERANCE
        assert max_difference(result["fabric"], replicas[_replica_of(rank)]) < TOLERANCE


@pytest.mark.distributed
def test_streaming_diloco_matches_a_hand_written_one_and_resumes_mid_flight(ranks: list[dict[str, Any]]) -> None:
    """Fragments synchronised in turn, each average overlapping one inner step and mixed with the local values:
    the global copy and every group's parameters equal a single-process streaming DiLoCo; a checkpoint taken while
    a fragment's average is in flight resumes to the same end, bit for bit."""
    every, fragments, delay, alpha = (STREAMING[k] for k in ("sync_every", "num_fragments", "fragment_sync_delay",
                                                              "fragment_update_alpha"))
    global_model, replicas = streaming_reference(STREAM_CFG, STREAM_EPOCHS, every, fragments, delay, alpha)
    plain_global, _ = diloco_reference(STREAM_CFG, STREAM_EPOCHS, every, PARTITION, default_outer_optimizer)
    assert max_difference(trained(global_model), trained(plain_global)) > 1e-3  # streaming is its own algorithm
    for rank, result in enumerate(ranks):
        assert result["streaming_outer_steps"] == STREAM_EPOCHS * STREAM_CFG.steps // (every // fragments)
        assert max_difference(result["streaming_global"], trained(global_model)) < TOLERANCE
        assert max_difference(result["streaming"], replicas[_replica_of(rank)]) < TOLERANCE
        assert result["streaming_saved_in_flight"]
        # the fragments follow the FSDP units (blocks): the cut falls between two blocks
        ((names, cut),) = result["streaming_fragments"]
        assert [[names[i] for i in f] for f in cut][1][0] == "model.blocks.1.mix.weight"
        assert max_difference(result["streaming_resumed"], result["streaming"]) == 0


@pytest.mark.distributed
def test_inner_steps_send_nothing_across_replicas(ranks: list[dict[str, Any]]) -> None:
    """The layout decided no hop 2 (FSDP2 shards on the partition alone); the replication group carried the two
    outer syncs only: one fp32 pseudo-gradient message of this rank's shards each."""
    for result in ranks:
        hop2 = result["hop2"]
        assert (hop2.schedule, hop2.every, hop2.run_by_engine, hop2.fsdp_uses_replicate_dim) == ("diloco", EVERY, False, False)
        assert result["fsdp_mesh_ndim"] == 1
        # the two outer syncs (after steps 4 and 8): one fp32 message of this rank's pseudo-gradient shards each
        assert result["replication_calls"] == [("all_reduce", result["pseudo_gradient_bytes"])] * 2
    # the byte model the planner prices and telemetry states (schedule.py): 1/H of one message per step -- of the
    # padded shard, which rank 0 holds in full (FSDP2 pads the last ranks' shards of odd sizes)
    assert ranks[0]["analytic_cross_replica_per_step"] * EVERY == ranks[0]["pseudo_gradient_bytes"]
    for result in ranks:
        assert result["analytic_cross_replica_per_step"] * EVERY >= result["pseudo_gradient_bytes"]


@pytest.mark.distributed
def test_telemetry_states_bytes_per_step_as_the_schedule_averages_them(ranks: list[dict[str, Any]]) -> None:
    """10 steps at H = 4 (outer averages started at steps 4 and 8; the summary leaves out step 1): the cross-replica
    bytes per step are one message over H steps -- not the 2 messages over 9 steps this run happened to hold,
    nor the zero of the inner steps a sampler would see -- and an outer-average step is stated on its own."""
    for result in ranks:
        assert result["telemetry_outer_steps"] == [4, 8]
        summary, analytic = result["telemetry_summary"], result["analytic_per_step"]
        assert summary["outer_every"] == EVERY
        # one message of this rank's pseudo-gradient shards per H steps (the analytic one is rank 0's padded shard)
        message = result["pseudo_gradient_bytes"]
        assert summary["bytes_by_group"][CROSS_REPLICA] == pytest.approx(message / EVERY, rel=0.01)
        assert summary["outer_round_step_bytes"][CROSS_REPLICA] == pytest.approx(message, rel=0.01)
        assert summary["bytes_by_group"][INTRA_PARTITION] == pytest.approx(analytic.intra_partition, rel=0.01)
        assert "one outer average every 4 steps" in result["telemetry_text"]
        assert "a step that starts the outer average: cross-replica" in result["telemetry_text"]
    assert ranks[0]["telemetry_summary"]["bytes_by_group"][CROSS_REPLICA] == pytest.approx(
        ranks[0]["analytic_per_step"].cross_replica, rel=0.01
    )


@pytest.mark.distributed
def test_resume_mid_round_equals_the_uninterrupted_run(ranks: list[dict[str, Any]]) -> None:
    """Saved after step 6 (two inner steps into the second round) and resumed: the replica groups' own parameters
    and inner momentum, the outer momentum, the last-synchronised copy and the step count all come back."""
    for result in ranks:
        assert result["saved_inner_steps"] == 2
        assert result["resumed_global_step"] == EPOCHS * STEPS_PER_EPOCH
        for name, value in result["diloco_h4"].items():
            assert torch.equal(result["resumed"][name], value), name
        for name, value in result["diloco_h4_global"].items():
            assert torch.equal(result["resumed_global"][name], value), name


@pytest.mark.distributed
def test_the_checkpoints_model_is_the_global_one(ranks: list[dict[str, Any]]) -> None:
    """Mid-round the replica groups differ, so the checkpoint's model entry -- what evaluation, export and other
    layouts load -- is the last-synchronised (global) model, the same whichever replica DCP took each shard from;
    the replica groups' own parameters sit beside it, under their index."""
    from lightning_mics.checkpoint import read_full_state

    model, optimizers, _ = read_full_state(ranks[0]["checkpoint"])
    saved = strip_prefix(model)
    global_model = ranks[0]["saved_global"]
    assert max_difference({name: saved[name] for name in global_model}, global_model) == 0.0
    assert torch.equal(saved["head.weight"], saved["embed.weight"])  # the tied head: the same global tensor
    assert len(optimizers) == 1 and optimizers[0]["state"]  # the inner momentum, averaged over the replicas


@pytest.mark.distributed
def test_bf16_wire_carries_the_pseudo_gradients(ranks: list[dict[str, Any]]) -> None:
    for result in ranks:
        difference = max_difference(result["diloco_h4_bf16"], result["diloco_h4"])
        assert 0 < difference < 3e-2  # measured 8.8e-3: one bf16 rounding of each delta, amplified by the outer step


# ---------------------------------------------------------------------------------------------------------------------
# fast tests: options, the hop-2 decision


def test_options_refuse_what_diloco_does_not_take_with_the_fix() -> None:
    MiCSStrategy(cross_replica_sync="diloco", sync_every=8)
    MiCSFabricStrategy(cross_replica_sync="diloco", sync_every=8, outer_optimizer=OUTER_SGD_LR1)
    cases = [
        ({"cross_replica_sync": "diloco"}, "needs sync_every=H"),
        ({"cross_replica_sync": "diloco", "sync_every": 0}, "sync_every must be a positive int"),
        ({"cross_replica_sync": "diloco", "sync_every": True}, "sync_every must be a positive int"),
        ({"sync_every": 4}, "sync_every only applies to semi-synchronous replica groups: add cross_replica_sync"),
        ({"outer_optimizer": OUTER_SGD_LR1}, "outer_optimizer only applies"),
        ({"cross_replica_sync": "sometimes"}, "is not one of \\['every_step', 'diloco'\\]"),
        (
            {"cross_replica_sync": "diloco", "sync_every": 2, "fault_tolerance": {"keep_trajectory": True}},
            "keep_trajectory=True\\) cannot be combined with cross_replica_sync='diloco'.* Leave keep_trajectory unset",
        ),
        ({"cross_replica_sync": "diloco", "sync_every": 2, "sharding": "auto"}, "use partition_size='auto'"),
        ({"cross_replica_sync": "diloco", "sync_every": 2, "save_full_state_dict": True}, "sharded checkpoints only"),
        ({"num_fragments": 2}, "num_fragments only applies to semi-synchronous replica groups"),
        ({"cross_replica_sync": "diloco", "sync_every": 6, "num_fragments": 4}, "must be a positive int dividing"),
        (
            {"cross_replica_sync": "diloco", "sync_every": 8, "num_fragments": 4, "fragment_sync_delay": 2},
            "fragment_sync_delay=2 must be an int in \\[0, sync_every / num_fragments = 2\\)",
        ),
        ({"cross_replica_sync": "diloco", "sync_every": 8, "fragment_update_alpha": 1.5}, "must be a number in"),
    ]
    for options, message in cases:
        with pytest.raises(ValueError, match=message):
            MiCSStrategy(**options)
    with pytest.raises(TypeError, match="outer_optimizer must be a callable"):
        MiCSStrategy(cross_replica_sync="diloco", sync_every=2, outer_optimizer=0.7)
    # fault tolerance: fixed data shares (each group's inner steps read its own), Trainer only
    ft = MiCSStrategy(cross_replica_sync="diloco", sync_every=2, fault_tolerance=True).options.fault_tolerance
    assert ft.keep_trajectory is False and not ft.trainer_keeps_trajectory
    # streaming DiLoCo with fault tolerance is built (a quorum per fragment: tests/test_fault_tolerance_diloco.py)
    streaming = MiCSStrategy(cross_replica_sync="diloco", sync_every=8, num_fragments=2, fault_tolerance=True)
    assert streaming.options.num_fragments == 2 and streaming.options.fault_tolerance is not None
    with pytest.raises(ValueError, match="built for the Trainer only .* drop one of the two"):
        MiCSFabricStrategy(cross_replica_sync="diloco", sync_every=2, fault_tolerance=True)


def test_fragments_are_contiguous_non_empty_runs_of_about_equal_elements() -> None:
    assert fragment_bounds([10, 10, 10, 10], 2) == [(0, 2), (2, 4)]
    assert fragment_bounds([1, 1, 1, 100], 2) == [(0, 3), (3, 4)]  # a big last tensor still gets its own run
    assert fragment_bounds([100, 1, 1, 1], 2) == [(0, 1), (1, 4)]
    assert fragment_bounds([7], 1) == [(0, 1)]
    for sizes, count in (([3, 9, 4, 4, 8, 1, 5], 3), ([1] * 9, 4), ([50, 1, 1], 3)):
        bounds = fragment_bounds(sizes, count)
        assert len(bounds) == count and bounds[0][0] == 0 and bounds[-1][1] == len(sizes)
        assert all(start < stop for start, stop in bounds)
        assert all(bounds[i][1] == bounds[i + 1][0] for i in range(count - 1))
    with pytest.raises(ValueError, match="more than the 2 trained parameter tensors"):
        fragment_bounds([4, 4], 3)


def _settings(**overrides: Any) -> Any:
    kwargs: dict[str, Any] = dict(
        world_size=8, rank=0, ranks_per_node=4, partition_size=None, reshard_after_forward=True, sharding=None,
        hierarchical="auto", device_type="cpu", backend="gloo", cross_replica_overlap=True,
    )
    return resolve_layout(**{**kwargs, **overrides})


def test_the_layout_decides_no_hop2_and_an_outer_sync_every_h_steps() -> None:
    synchronous, diloco = _settings(), _settings(sync_every=16)
    assert synchronous.hop2.schedule == "behind_backward" and synchronous.hop2.every == 1
    assert (diloco.hop2.schedule, diloco.hop2.every) == ("diloco", 16)
    assert "every 16 optimizer steps" in diloco.hop2.describe()
    assert synchronous.differences(diloco) == [
        "cross_replica_overlap: True vs False",
        "cross_replica_sync: 'every_step' vs 'diloco'",
        "sync_every: None vs 16",
    ]
    # one replica: DiLoCo keeps its schedule (the outer optimizer steps on that group's own delta)
    assert _settings(partition_size="world", sync_every=4).hop2.schedule == "diloco"
    # a compressed wire carries the pseudo-gradients: allowed
    assert decide_hop2(
        replicas=2, optim_beyond_partition=False, compressed=True, cross_replica_overlap=True, offloaded=False,
        managed=False, sync_every=4,
    ).schedule == "diloco"
    # fault tolerance: the same schedule, its average through torchft
    managed = decide_hop2(
        replicas=1, optim_beyond_partition=False, compressed=False, cross_replica_overlap=True, offloaded=False,
        managed=True, sync_every=4,
    )
    assert (managed.schedule, managed.managed, managed.every) == ("diloco", True, 4)
    assert "through torchft" in managed.describe()


def test_optimizer_states_across_replicas_are_refused_with_the_fix() -> None:
    with pytest.raises(ValueError, match="cannot shard optimizer states across replicas .* Use optim <= grads"):
        _settings(sharding=ShardingSpec(params=4, grads=4, optim=8), sync_every=4)


def test_lightning_cli_takes_diloco_and_an_outer_optimizer_by_class_path() -> None:
    """LightningCLI (the example's ``examples/cli.py`` with its YAML config) reaches the same options."""
    from lm_jobs import CLI_CONFIG

    from examples.cli import main

    outer = '{"class_path": "torch.optim.SGD", "init_args": {"lr": 0.5, "momentum": 0.9, "nesterov": true}}'
    cli = main(
        [
            f"--config={CLI_CONFIG}",
            "--trainer.strategy=lightning_mics.MiCSStrategy",
            "--trainer.strategy.cross_replica_sync=diloco",
            "--trainer.strategy.sync_every=16",
            f"--trainer.strategy.outer_optimizer={outer}",
        ],
        run=False,
    )
    options = cli.trainer.strategy.options
    assert (options.cross_replica_sync, options.sync_every, options.ranks_per_node) == ("diloco", 16, 2)
    built = options.outer_optimizer([torch.zeros(2, requires_grad=True)])
    assert isinstance(built, torch.optim.SGD) and (built.defaults["lr"], built.defaults["nesterov"]) == (0.5, True)
