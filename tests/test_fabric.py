"""``Fabric(strategy="mics")``: the Fabric strategy trains like single-process training (accumulation under
``no_backward_sync`` with the cross-replica hop deferred to the boundary, clipping, unsharded accumulation, AMSP,
``sharding="auto"``, a bf16 or int8 hop 2), resumes exactly, shares the Trainer's checkpoint format both ways, and
launches the ranks of a plain script.

4 gloo ranks, partition 2 (``ranks_per_node=2``: two emulated nodes, 2 replicas). One spawn of ranks
runs every scenario (process start-up dominates the cost); the tests check its results.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any, Optional

import lightning.pytorch as pl
import pytest
import torch
from checkpoint_helpers import assert_same_tensors
from distributed import run_ranks
from lightning.fabric import Fabric
from lightning.fabric.plugins import TorchCheckpointIO
from toy import (
    INT8_RTOL,
    LAYERS,
    RunConfig,
    ToyModule,
    assert_compressed_run,
    assert_matches_reference,
    full_parameters,
    global_batches,
    lm_loss,
    reference_training,
    trainer_kwargs,
)
from torch import nn
from torch.distributed.tensor import DTensor

import lightning_mics
from lightning_mics import CollectiveRecorder, MiCSFabricStrategy, MiCSStrategy, ShardingSpec
from lightning_mics.precision import MiCSFabricPrecision
from lightning_mics.topology import MiCSTopology

WORLD, PARTITION, RANKS_PER_NODE = 4, 2, 2
TOPOLOGY = MiCSTopology.create(WORLD, RANKS_PER_NODE, PARTITION)
CLIP = 0.5  # reference gradient norms are ~3-5, so this clips every step
#: equivalence with gradient accumulation (no_backward_sync) and clipping
ACCUMULATING = RunConfig(world_size=WORLD, accumulate=3, clip=CLIP, steps=2)
#: checkpoint scenarios: one micro-batch per step
PLAIN = RunConfig(world_size=WORLD, steps=4)
UNITS_WITH_GRADS = LAYERS + 1  # one per block, plus the root (embedding/head)


# ---------------------------------------------------------------------------------------------
# A Fabric training loop on the toy model (what the ranks run)
# ---------------------------------------------------------------------------------------------


def launch(**layout: Any) -> Fabric:
    """A Fabric on the ranks ``run_ranks`` started (default layout: partition 2 of 2 replicas)."""
    layout = layout or {"partition_size": PARTITION}
    strategy = MiCSFabricStrategy(ranks_per_node=RANKS_PER_NODE, **layout)
    fabric = Fabric(accelerator="cpu", devices=WORLD, strategy=strategy)
    fabric.launch()
    return fabric


def set_up(fabric: Fabric, cfg: RunConfig, seed: Optional[int] = None) -> tuple[Any, Any]:
    """``ToyModule`` and its optimizer, created *before* ``fabric.setup`` (which must point the
    optimizer at the shards), as the reference builds them."""
    module = ToyModule(cfg if seed is None else RunConfig(**{**cfg.__dict__, "seed": seed}))
    return fabric.setup(module, module.configure_optimizers())


def train(
    fabric: Fabric,
    model: Any,
    optimizer: Any,
    cfg: RunConfig,
    micro_batches: range | list[int],
    recorder: Optional[CollectiveRecorder] = None,
    noisy: bool = False,
) -> list[float]:
    """``cfg.accumulate`` micro-batches per optimizer step, all but the last inside
    ``no_backward_sync``; clipping by norm (``inf`` without ``cfg.clip``: it then only measures).
    Rank ``r`` takes its piece of global micro-batch ``i``; ``noisy`` masks tokens with the global
    RNG (so a resumed run matches only if RNG states were restored). Returns the norms."""
    tokens, targets = global_batches(cfg)
    indices = list(micro_batches)
    norms = []
    for start in range(0, len(indices), cfg.accumulate):
        window = indices[start : start + cfg.accumulate]
        for j, index in enumerate(window):
            if recorder is not None:
                recorder.step = index
            first = (index * cfg.world_size + fabric.global_rank) * cfg.micro_batch
            mine = slice(first, first + cfg.micro_batch)
            batch_tokens, batch_targets = tokens[mine], targets[mine]
            if noisy:
                batch_tokens = batch_tokens.masked_fill(torch.rand(batch_tokens.shape) < 0.3, 0)
            with fabric.no_backward_sync(model, enabled=j < len(window) - 1):
                fabric.backward(lm_loss(model, (batch_tokens, batch_targets)) / cfg.accumulate)
        norm = fabric.clip_gradients(model, optimizer, max_norm=cfg.clip or float("inf"))
        norms.append(float(norm))
        optimizer.step()
        optimizer.zero_grad()
    if recorder is not None:
        recorder.step = -1
    return norms


def _error(fn: Any) -> Optional[str]:
    try:
        fn()
    except Exception as err:  # noqa: BLE001 - the tests check type and message
        return f"{type(err).__name__}: {err}"
    return None


def _scenarios(rank: int, world: int, tmp: str) -> dict[str, Any]:
    out: dict[str, Any] = {}
    fabric = launch()
    root = Path(tmp)

    # 1. equivalence with gradient accumulation and clipping; the collectives of every micro-step
    model, optimizer = set_up(fabric, ACCUMULATING)
    out["optimizer_holds_shards"] = all(isinstance(p, DTensor) for g in optimizer.param_groups for p in g["params"])
    with CollectiveRecorder() as recorder:
        recorder.step = -1
        out["norms"] = train(fabric, model, optimizer, ACCUMULATING, range(6), recorder)
    out["calls"] = {"sharded": [call for call in recorder.calls if call.step >= 0]}
    out["accumulating"] = full_parameters(model.module)
    out["local_numel"] = sum(p.to_local().numel() for p in model.parameters())
    out["full_numel"] = sum(p.numel() for p in model.parameters())

    # 1b. grad_accumulation="unsharded": full gradients until the boundary, one reduce-scatter per step
    unsharded = launch(partition_size=PARTITION, grad_accumulation="unsharded")
    model, optimizer = set_up(unsharded, ACCUMULATING)
    with CollectiveRecorder() as recorder:
        recorder.step = -1
        train(unsharded, model, optimizer, ACCUMULATING, range(6), recorder)
    out["calls"]["unsharded"] = [call for call in recorder.calls if call.step >= 0]
    out["unsharded"] = full_parameters(model.module)

    # 1c. cross_replica_dtype="bf16": hop 2 in 16 bits, synced before clipping and the step
    compressed = launch(partition_size=PARTITION, cross_replica_dtype="bf16")
    model, optimizer = set_up(compressed, ACCUMULATING)
    train(compressed, model, optimizer, ACCUMULATING, range(6))
    out["bf16_cross_replica"] = full_parameters(model.module)
    # ... and in blockwise int8
    compressed = launch(partition_size=PARTITION, cross_replica_dtype="int8")
    model, optimizer = set_up(compressed, ACCUMULATING)
    train(compressed, model, optimizer, ACCUMULATING, range(6))
    out["int8_cross_replica"] = full_parameters(model.module)

    # 1d. sharding="auto": the planner picks the degrees when the model is set up
    planned = launch(sharding="auto")
    model, optimizer = set_up(planned, ACCUMULATING)
    out["auto_layout"] = (planned.strategy.layout.settings.sharding, planned.strategy.layout.settings.planner_reason)
    train(planned, model, optimizer, ACCUMULATING, range(6))
    out["auto"] = full_parameters(model.module)

    # 1e. AMSP: parameters kept gathered within a step (P=1), optimizer states sharded across the
    # replicas (OS=4): clipping and the step run on slices; its checkpoint is plain MiCS's format
    amsp = launch(sharding=ShardingSpec(params=1, grads=PARTITION, optim=WORLD))
    model, optimizer = set_up(amsp, ACCUMULATING)
    out["amsp_optimizer_slices"] = sum(p.numel() for g in optimizer.param_groups for p in g["params"])
    train(amsp, model, optimizer, ACCUMULATING, range(3))
    amsp.save(root / "amsp.ckpt", {"model": model, "optimizer": optimizer})
    out["amsp_norms"] = train(amsp, model, optimizer, ACCUMULATING, range(3, 6))
    out["amsp"] = full_parameters(model.module)
    model, optimizer = set_up(fabric, ACCUMULATING, seed=7)  # plain MiCS resumes the AMSP checkpoint
    fabric.load(root / "amsp.ckpt", {"model": model, "optimizer": optimizer})
    train(fabric, model, optimizer, ACCUMULATING, range(3, 6))
    out["amsp_resumed_by_mics"] = full_parameters(model.module)

    # 2. save -> load resumes exactly: model, optimizer (momentum), RNG, the user's entries
    model, optimizer = set_up(fabric, PLAIN)
    train(fabric, model, optimizer, PLAIN, [0, 1], noisy=True)
    fabric.save(root / "fabric.ckpt", {"model": model, "optimizer": optimizer, "step": 2, "note": "hello"})
    train(fabric, model, optimizer, PLAIN, [2, 3], noisy=True)
    out["uninterrupted"] = full_parameters(model.module)
    resumed_model, resumed_optimizer = set_up(fabric, PLAIN, seed=7)  # other weights: the load must replace them
    state = {"model": resumed_model, "optimizer": resumed_optimizer, "step": 0}
    out["remainder"] = fabric.load(root / "fabric.ckpt", state)
    out["restored_step"] = state["step"]
    out["loaded"] = full_parameters(resumed_model.module)
    train(fabric, resumed_model, resumed_optimizer, PLAIN, [2, 3], noisy=True)
    out["resumed"] = full_parameters(resumed_model.module)

    # fabric.load_raw(path, model): the model's weights alone, from the same checkpoint
    raw_model, _ = set_up(fabric, PLAIN, seed=9)
    fabric.load_raw(root / "fabric.ckpt", raw_model)
    out["raw_loaded"] = full_parameters(raw_model.module)

    # a refused load changes nothing: a requested key the checkpoint lacks (strict)
    before = full_parameters(resumed_model.module)
    out["missing_key_error"] = _error(
        lambda: fabric.load(root / "fabric.ckpt", {"model": resumed_model, "optimizer": resumed_optimizer, "x": 1})
    )
    out["unchanged_after_refused_load"] = all(
        torch.equal(before[name], value) for name, value in full_parameters(resumed_model.module).items()
    )

    # 3. Fabric -> Trainer: Trainer(strategy="mics").fit(ckpt_path=...) resumes the Fabric checkpoint
    model, optimizer = set_up(fabric, PLAIN)
    train(fabric, model, optimizer, PLAIN, [0, 1])
    fabric.save(root / "for_trainer.ckpt", {"model": model, "optimizer": optimizer})
    module = ToyModule(PLAIN)
    trainer = pl.Trainer(
        strategy=MiCSStrategy(partition_size=PARTITION, ranks_per_node=RANKS_PER_NODE),
        **{**trainer_kwargs(PLAIN), "max_steps": 1},  # the Trainer's loops start afresh: global batch 0
    )
    trainer.fit(module, ckpt_path=str(root / "for_trainer.ckpt"))
    out["trainer_resumed_fabric"] = full_parameters(module)

    # 4. Trainer -> Fabric: the Trainer's checkpoint loads here; its loop state is in the remainder
    module = ToyModule(PLAIN)
    trainer = pl.Trainer(
        strategy=MiCSStrategy(partition_size=PARTITION, ranks_per_node=RANKS_PER_NODE),
        **{**trainer_kwargs(PLAIN), "max_steps": 2},
    )
    trainer.fit(module)
    trainer.save_checkpoint(root / "from_trainer.ckpt")
    model, optimizer = set_up(fabric, PLAIN, seed=7)
    state = {"model": model, "optimizer": optimizer, "global_step": None}
    remainder = fabric.load(root / "from_trainer.ckpt", state)
    out["trainer_global_step"] = state["global_step"]
    out["trainer_remainder_keys"] = sorted(remainder)
    train(fabric, model, optimizer, PLAIN, [2, 3])
    out["fabric_resumed_trainer"] = full_parameters(model.module)

    # 5. fabric.init_module(empty_init=True): meta device, materialised shard by shard, replicas agree
    with fabric.init_module(empty_init=True):
        module = ToyModule(PLAIN)
    out["built_on_meta"] = all(p.is_meta for p in module.parameters())
    model, optimizer = fabric.setup(module, module.configure_optimizers())
    out["meta_materialised"] = full_parameters(model.module)
    train(fabric, model, optimizer, PLAIN, [0])
    out["meta_trained_finite"] = all(torch.isfinite(p).all().item() for p in full_parameters(model.module).values())

    # 6. Fabric's collectives
    out["all_reduce"] = fabric.all_reduce(torch.tensor(float(rank)), reduce_op="sum").item()
    out["broadcast"] = fabric.broadcast(f"from rank {rank}", src=1)
    fabric.barrier()

    # 7. bad input: one clear error, on every rank alike (raised before any collective)
    out["errors"] = {
        "no_model": _error(lambda: fabric.save(root / "bad", {"optimizer": optimizer})),
        "reserved": _error(lambda: fabric.save(root / "bad", {"model": model, "state_dict": 1})),
        "no_state": _error(lambda: fabric.load(root / "fabric.ckpt")),
        "not_set_up": _error(lambda: fabric.save(root / "bad", {"model": ToyModule(PLAIN)})),
        "foreign_optimizer": _error(
            lambda: fabric.setup(ToyModule(PLAIN), torch.optim.SGD([nn.Parameter(torch.zeros(3))], lr=0.1))
        ),
    }
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    return run_ranks(_scenarios, WORLD, str(tmp_path_factory.mktemp("fabric")))


# ---------------------------------------------------------------------------------------------
# Training
# ---------------------------------------------------------------------------------------------


@pytest.mark.distributed
def test_accumulation_and_clipping_match_single_process_training(runs):
    assert_matches_reference([run["accumulating"] for run in runs], ACCUMULATING)
    _, reference_norms = reference_training(ACCUMULATING)
    assert min(reference_norms) > CLIP  # clipping was active
    for run in runs:  # the norm clipping saw is the global norm of the unsharded gradients
        assert run["norms"] == pytest.approx(reference_norms, rel=1e-5)


@pytest.mark.distributed
def test_bf16_cross_replica_sync_tracks_fp32_and_keeps_replicas_identical(runs):
    params = [run["bf16_cross_replica"] for run in runs]
    assert_matches_reference(params, ACCUMULATING, rtol=1e-2)  # one bf16 rounding per gradient message
    for name in params[0]:  # ranks 0 and 2 hold the same shard in the two replicas: no drift
        assert torch.equal(params[0][name], params[2][name]), name
    assert any(not torch.equal(params[0][n], runs[0]["accumulating"][n]) for n in params[0])  # really bf16


@pytest.mark.distributed
def test_int8_cross_replica_sync_tracks_fp32_and_keeps_replicas_identical(runs):
    params = [run["int8_cross_replica"] for run in runs]
    assert_compressed_run(params, ACCUMULATING, INT8_RTOL, [[0, 2], [1, 3]], runs[0]["accumulating"])


@pytest.mark.distributed
def test_planner_chosen_sharding_matches_single_process_training(runs):
    spec, reason = runs[0]["auto_layout"]
    assert isinstance(spec, ShardingSpec) and reason  # resolved by the planner, with its reason
    assert all(run["auto_layout"] == (spec, reason) for run in runs)  # every rank chose alike
    assert_matches_reference([run["auto"] for run in runs], ACCUMULATING)


@pytest.mark.distributed
def test_amsp_sharding_spec_matches_single_process_training_and_checkpoints_as_mics(runs):
    """ShardingSpec(params=1, grads=2, optim=4): each rank steps the optimizer on a quarter of the
    model; training equals single-process training, clipping sees the global norm, and the
    checkpoint it wrote mid-run resumes under plain MiCS to the same parameters."""
    assert_matches_reference([run["amsp"] for run in runs], ACCUMULATING)
    assert_matches_reference([run["amsp_resumed_by_mics"] for run in runs], ACCUMULATING)
    _, reference_norms = reference_training(ACCUMULATING)
    assert runs[0]["amsp_norms"] == pytest.approx(reference_norms[1:], rel=1e-5)
    trainable = sum(value.numel() for name, value in runs[0]["amsp"].items() if "blocks.1.gate" not in name)
    assert sum(run["amsp_optimizer_slices"] for run in runs) == trainable


@pytest.mark.distributed
def test_optimizer_created_before_setup_steps_on_the_shards(runs):
    assert all(run["optimizer_holds_shards"] for run in runs)
    for partition in TOPOLOGY.partition_groups:  # the ranks of a partition hold one copy between them
        assert sum(runs[rank]["local_numel"] for rank in partition) == runs[0]["full_numel"]
        assert all(runs[rank]["local_numel"] < runs[0]["full_numel"] for rank in partition)


@pytest.mark.distributed
def test_unsharded_accumulation_matches_single_process_training(runs):
    assert_matches_reference([run["unsharded"] for run in runs], ACCUMULATING)


@pytest.mark.distributed
@pytest.mark.parametrize("mode", ["sharded", "unsharded"])
def test_no_backward_sync_defers_the_cross_replica_all_reduce_to_the_boundary(runs, mode):
    """Only the boundary micro-step all-reduces across replicas (once per unit with gradients);
    clipping's norm is one all-reduce over the partition, on the boundary. Reduce-scatters run inside
    the partition: every micro-step when accumulating sharded, only on the boundary when unsharded."""
    for rank, run in enumerate(runs):
        partition, replicas = TOPOLOGY.partition_group_of(rank), TOPOLOGY.replication_group_of(rank)
        for step in range(ACCUMULATING.steps * ACCUMULATING.accumulate):
            calls = [c for c in run["calls"][mode] if c.step == step]
            boundary = (step + 1) % ACCUMULATING.accumulate == 0
            scattered = [c.ranks for c in calls if c.kind == "reduce_scatter"]
            reduced = [c.ranks for c in calls if c.kind == "all_reduce"]
            assert set(scattered) <= {partition}, (rank, step, scattered)
            if mode == "sharded" or boundary:
                assert len(scattered) == UNITS_WITH_GRADS, (rank, step, scattered)
            else:
                assert not scattered, (rank, step, scattered)
            assert reduced.count(replicas) == (UNITS_WITH_GRADS if boundary else 0), (rank, step, reduced)
            assert reduced.count(partition) == (1 if boundary else 0), (rank, step, reduced)
            assert len(reduced) == reduced.count(replicas) + reduced.count(partition), (rank, step, reduced)


@pytest.mark.distributed
def test_meta_device_model_is_materialised_and_replicas_agree(runs):
    assert all(run["built_on_meta"] for run in runs)
    first = runs[0]["meta_materialised"]
    assert all(value.abs().sum() > 0 for name, value in first.items() if "weight" in name)
    for run in runs[1:]:
        assert_same_tensors(run["meta_materialised"], first)
    assert all(run["meta_trained_finite"] for run in runs)


@pytest.mark.distributed
def test_fabric_collectives(runs):
    assert [run["all_reduce"] for run in runs] == [6.0] * WORLD
    assert [run["broadcast"] for run in runs] == ["from rank 1"] * WORLD


# ---------------------------------------------------------------------------------------------
# Checkpoints
# ---------------------------------------------------------------------------------------------


@pytest.mark.distributed
def test_save_then_load_resumes_exactly(runs):
    for run in runs:
        assert run["restored_step"] == 2
        assert run["remainder"] == {"note": "hello"}  # the entries not asked for; nothing of the bookkeeping
        assert_same_tensors(run["resumed"], run["uninterrupted"])
        assert_same_tensors(run["raw_loaded"], run["loaded"])  # fabric.load_raw: the weights alone


@pytest.mark.distributed
def test_a_load_refused_for_a_missing_key_changes_nothing(runs):
    for run in runs:
        assert run["missing_key_error"].startswith("KeyError") and "'x'" in run["missing_key_error"]
        assert "strict=False" in run["missing_key_error"]
        assert run["unchanged_after_refused_load"]


@pytest.mark.distributed
def test_trainer_resumes_a_fabric_checkpoint(runs):
    """Fabric trained on global batches 0, 1 and saved; the Trainer resumed (model and momentum)
    and, its loops starting afresh, trained on batch 0 again."""
    assert_matches_reference([run["trainer_resumed_fabric"] for run in runs], PLAIN, micro_batches=(0, 1, 0))


@pytest.mark.distributed
def test_fabric_resumes_a_trainer_checkpoint(runs):
    """The Trainer trained on global batches 0, 1 and saved; Fabric loaded it and trained on 2, 3:
    the same as 4 uninterrupted single-process steps."""
    assert_matches_reference([run["fabric_resumed_trainer"] for run in runs], PLAIN)
    for run in runs:
        assert run["trainer_global_step"] == 2
        assert {"loops", "epoch", "lr_schedulers"} <= set(run["trainer_remainder_keys"])


@pytest.mark.distributed
def test_bad_input_in_the_ranks_gets_one_clear_error(runs):
    errors = runs[0]["errors"]
    assert all(run["errors"] == errors for run in runs)  # every rank alike
    assert errors["no_model"].startswith("ValueError") and "exactly one model" in errors["no_model"]
    assert errors["reserved"].startswith("ValueError") and "['state_dict'] are reserved" in errors["reserved"]
    assert errors["no_state"].startswith("ValueError") and "{'model': model" in errors["no_state"]
    assert errors["not_set_up"].startswith("ValueError") and "has not been set up" in errors["not_set_up"]
    assert errors["foreign_optimizer"].startswith("ValueError")
    assert "belongs to no model set up by MiCSStrategy" in errors["foreign_optimizer"]


# ---------------------------------------------------------------------------------------------
# Fabric starting the ranks itself
# ---------------------------------------------------------------------------------------------

LAUNCHED_SCRIPT = """
import os, sys
sys.path.insert(0, {tests!r})
import torch
from lightning.fabric import Fabric
import lightning_mics  # registers strategy="mics"
from distributed import exit_after_distributed_work
from toy import RunConfig, ToyModule, full_parameters, global_batches, lm_loss

cfg = RunConfig(world_size=2, steps=1)
fabric = Fabric(accelerator="cpu", devices=2, strategy="mics")  # a plain script: Fabric starts rank 1
fabric.launch()
module = ToyModule(cfg)
model, optimizer = fabric.setup(module, module.configure_optimizers())
tokens, targets = global_batches(cfg)
mine = slice(fabric.global_rank * cfg.micro_batch, (fabric.global_rank + 1) * cfg.micro_batch)
fabric.backward(lm_loss(model, (tokens[mine], targets[mine])))
optimizer.step()
layout = (fabric.global_rank, fabric.strategy.topology.partition_size, os.environ["OMP_NUM_THREADS"])
torch.save((layout, full_parameters(model.module)), {out!r} + f"/rank{{fabric.global_rank}}.pt")
exit_after_distributed_work()
"""


@pytest.mark.distributed
def test_fabric_launches_the_ranks_of_a_plain_script(tmp_path: Path) -> None:
    """``Fabric(devices=2, strategy="mics").launch()`` in a script re-runs it for rank 1 (each rank
    gets its share of the cores first); both ranks train the same model as one process would."""
    script = tmp_path / "train.py"
    script.write_text(textwrap.dedent(LAUNCHED_SCRIPT.format(tests=os.path.dirname(__file__), out=str(tmp_path))))
    launcher_vars = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "NODE_RANK", "MASTER_ADDR", "MASTER_PORT", "OMP_NUM_THREADS")
    env = {k: v for k, v in os.environ.items() if k not in launcher_vars}
    done = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    threads = str(max(1, len(os.sched_getaffinity(0)) // 2))
    results = [torch.load(tmp_path / f"rank{r}.pt") for r in (0, 1)]
    assert [layout for layout, _ in results] == [(r, 2, threads) for r in (0, 1)]  # one node: partition 2
    assert_matches_reference([params for _, params in results], RunConfig(world_size=2, steps=1))


# ---------------------------------------------------------------------------------------------
# Registration and configuration (no ranks)
# ---------------------------------------------------------------------------------------------


@pytest.fixture
def no_launcher_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """As in a plain script: Fabric will start the ranks itself."""
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "OMP_NUM_THREADS"):
        monkeypatch.setenv(name, "")  # recorded, so anything set during the test is undone after it
        monkeypatch.delenv(name)


@pytest.mark.parametrize(
    ("name", "partition_spec"), [("mics", None), ("mics_zero3", "world"), ("mics_replicate", 1), ("mics_auto", None)]
)
def test_registered_names_build_the_fabric_strategy(name, partition_spec):
    fabric = Fabric(strategy=name, accelerator="cpu", devices=2)
    assert type(fabric.strategy) is MiCSFabricStrategy
    assert fabric.strategy.partition_size_spec == partition_spec
    planned = (fabric.strategy.sharding, fabric.strategy.grad_accumulation, fabric.strategy.planner_cluster)
    # Fabric does not know the accumulation count: the planner picks the degrees, accumulation stays sharded
    assert planned == (("auto", "sharded", "calibrate") if name == "mics_auto" else (None, "sharded", None))
    assert lightning_mics.fabric.MiCSStrategy is MiCSFabricStrategy


@pytest.mark.parametrize("precision", ["32-true", "bf16-mixed", "bf16-true"])
def test_precision_flags_become_the_mics_fabric_plugin(precision):
    fabric = Fabric(strategy="mics", accelerator="cpu", devices=2, precision=precision)
    plugin = fabric.strategy.precision
    assert isinstance(plugin, MiCSFabricPrecision) and plugin.precision == precision
    expected = torch.bfloat16 if precision == "bf16-mixed" else None
    assert plugin.mixed_precision_policy().param_dtype == expected


@pytest.mark.parametrize("precision", ["64-true", "16-true"])
def test_unsupported_precision_is_refused_naming_the_supported_ones(precision):
    with pytest.raises(ValueError, match=f"precision='{precision}' is not supported.*32-true, bf16-mixed"):
        Fabric(strategy="mics", accelerator="cpu", devices=2, precision=precision)


@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        ({"ranks_per_node": "2"}, ValueError, "ranks_per_node must be a positive int .*write ranks_per_node=2"),
        ({"reshard_after_forward": 0}, ValueError, "reshard_after_forward"),
        ({"timeout": "30"}, ValueError, "timedelta or a positive number of seconds"),
        ({"hierarchical": "yes"}, ValueError, "hierarchical must be True, False or 'auto'"),
        ({"checkpoint_verify": "sha"}, ValueError, "checkpoint_verify='sha' is not one of"),
        ({"buffer_sync": True}, ValueError, r"buffer_sync=True is not one of \['broadcast', 'average', 'none'\]"),
        ({"grad_accumulation": "full"}, ValueError, "grad_accumulation='full' is not one of"),
        ({"cross_replica_dtype": "int4"}, ValueError, r"cross_replica_dtype='int4' is not one of \[None, .*'int8'\]"),
        ({"grad_accumulation": "auto"}, ValueError, "needs the number of micro-steps .* choose 'sharded'"),
        ({"auto_wrap_policy": lambda module: True}, TypeError, r"cannot be called as policy\(name, module\)"),
        (
            {"partition_size": 2, "sharding": lightning_mics.ShardingSpec()},
            ValueError,
            "Pass either sharding=ShardingSpec",
        ),
    ],
)
def test_bad_constructor_arguments(kwargs, error, message):
    with pytest.raises(error, match=message):
        MiCSFabricStrategy(**kwargs)


def test_invalid_layout_is_refused_before_any_process_starts(no_launcher_env):
    with pytest.raises(ValueError, match=r"partition_size=3 is invalid for world_size=4.*Valid choices"):
        Fabric(strategy=MiCSFabricStrategy(partition_size=3), accelerator="cpu", devices=4)


def test_checkpoint_io_plugins_are_refused():
    with pytest.raises(TypeError, match="does not use CheckpointIO plugins; remove TorchCheckpointIO"):
        Fabric(strategy="mics", accelerator="cpu", devices=2, plugins=[TorchCheckpointIO()])
