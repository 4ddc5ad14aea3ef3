"""MiCSStrategy's Lightning glue: registration, precision, configuration errors, collectives, sampler, meta init,
``partition_size="auto"``, the mesh groups' timeout, gradients freed after the step, a new Trainer evaluating or
fitting a model another sharded, and a gloo world left at interpreter exit."""

from __future__ import annotations

import gc
import logging
import os
from datetime import timedelta

import lightning.pytorch as pl
import pytest
import torch
from distributed import free_port, run_ranks
from toy import RunConfig, ToyModule, fit_with_mics, full_parameters, lm_loss, trainer_kwargs

import lightning_mics  # noqa: F401  (registers the strategy names)
from lightning_mics import MiCSStrategy, ShardingSpec
from lightning_mics.planner import device_memory_bytes
from lightning_mics.wrapping import check_reshard_group


@pytest.mark.parametrize(
    ("name", "partition_spec"), [("mics", None), ("mics_zero3", "world"), ("mics_replicate", 1), ("mics_auto", None)]
)
def test_registered_names_build_the_strategy(name, partition_spec):
    trainer = pl.Trainer(strategy=name, accelerator="cpu", devices=2, logger=False)
    assert isinstance(trainer.strategy, MiCSStrategy)
    assert trainer.strategy.partition_size_spec == partition_spec
    assert trainer.strategy.distributed_sampler_kwargs == {"num_replicas": 2, "rank": 0}
    planned = (trainer.strategy.sharding, trainer.strategy.grad_accumulation_spec, trainer.strategy.planner_cluster)
    assert planned == (("auto", "auto", "calibrate") if name == "mics_auto" else (None, "sharded", None))


def test_precision_flags_become_the_mics_plugin():
    trainer = pl.Trainer(strategy="mics", accelerator="cpu", devices=2, precision="bf16-true", logger=False)
    assert trainer.strategy.precision_plugin.precision == "bf16-true"
    assert type(trainer.precision_plugin).__name__ == "MiCSPrecision"


def test_unsupported_precision_is_rejected_at_construction():
    with pytest.raises(ValueError, match="32-true, bf16-mixed, 16-mixed, bf16-true"):
        pl.Trainer(strategy="mics", accelerator="cpu", devices=2, precision="64-true", logger=False)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"ranks_per_node": 0}, "ranks_per_node"),
        ({"ranks_per_node": "2"}, "ranks_per_node must be a positive int .*write ranks_per_node=2"),
        ({"reshard_after_forward": 0}, "reshard_after_forward"),
        ({"reshard_after_forward": "yes"}, "must be True, False or a positive group size"),
        ({"timeout": "30"}, "timedelta or a positive number of seconds"),
        ({"timeout": -5}, "timedelta or a positive number of seconds"),
        ({"checkpoint_verify": "sha"}, "checkpoint_verify='sha' is not one of \\['checksum', 'size', 'none'\\]"),
        ({"grad_accumulation": "full"}, "grad_accumulation='full' is not one of .*'unsharded' keeps full gradients"),
        ({"cross_replica_dtype": "int4"}, "cross_replica_dtype='int4' is not one of \\[None, 'bf16', 'fp16', 'int8'"),
        ({"buffer_sync": "mean"}, "buffer_sync='mean' is not one of \\['broadcast', 'average', 'none'\\]"),
    ],
)
def test_bad_constructor_arguments(kwargs, message):
    with pytest.raises(ValueError, match=message):
        MiCSStrategy(**kwargs)


@pytest.mark.parametrize("option", ["auto_wrap_policy", "activation_checkpointing_policy"])
def test_policy_callable_with_the_wrong_signature_is_refused_at_construction(option):
    with pytest.raises(TypeError, match=r"cannot be called as policy\(name, module\)"):
        MiCSStrategy(**{option: lambda module: True})
    MiCSStrategy(**{option: lambda name, module: False})  # the documented form
    MiCSStrategy(**{option: lambda *args: False})


def test_timeout_in_seconds_is_accepted():
    assert MiCSStrategy(timeout=30).options.timeout_delta == timedelta(seconds=30)
    with pytest.raises(TypeError, match="async_save must be True or False"):
        MiCSStrategy(async_save="yes")


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"partition_size": 3}, r"partition_size=3 is invalid for world_size=4.*Valid choices"),
        ({"partition_size": 2, "reshard_after_forward": 3}, r"reshard_after_forward=3 .* partition size 2"),
    ],
)
def test_invalid_layout_is_refused_before_any_process_starts(kwargs, message, monkeypatch):
    """Lightning knows the world size when it builds its launcher: the error comes once, from the
    Trainer's constructor in this process, instead of from every rank after launch."""
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    with pytest.raises(ValueError, match=message):
        pl.Trainer(strategy=MiCSStrategy(**kwargs), accelerator="cpu", devices=4, logger=False)


def test_ranks_started_by_lightning_get_a_share_of_the_cores(monkeypatch):
    """The launcher's children inherit OMP_NUM_THREADS, so it must be set before they start."""
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "OMP_NUM_THREADS"):
        monkeypatch.setenv(name, "")  # recorded, so the strategy's setting is undone after the test
        monkeypatch.delenv(name)
    threads_before = torch.get_num_threads()
    try:
        pl.Trainer(strategy=MiCSStrategy(), accelerator="cpu", devices=4, logger=False)
        expected = max(1, len(os.sched_getaffinity(0)) // 4)
        assert os.environ["OMP_NUM_THREADS"] == str(expected) and torch.get_num_threads() == expected
        monkeypatch.setenv("OMP_NUM_THREADS", "3")  # the user's choice is kept
        pl.Trainer(strategy=MiCSStrategy(), accelerator="cpu", devices=4, logger=False)
        assert os.environ["OMP_NUM_THREADS"] == "3"
    finally:
        torch.set_num_threads(threads_before)


def test_reshard_group_must_divide_the_partition():
    check_reshard_group(2, 4)
    check_reshard_group(True, 4)
    check_reshard_group(False, 3)
    with pytest.raises(ValueError, match=r"reshard_after_forward=3 .* partition size 4.*\[1, 2, 4\]"):
        check_reshard_group(3, 4)


class RecordBatches(pl.Callback):
    def __init__(self) -> None:
        self.tokens: list[torch.Tensor] = []
        self.losses: list[float] = []
        self.initial: dict[str, torch.Tensor] = {}

    def on_train_start(self, trainer, pl_module):
        self.initial = full_parameters(pl_module)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.tokens.append(batch[0].clone())
        self.losses.append(float(outputs["loss"]))


class ValidatedToyModule(ToyModule):
    def validation_step(self, batch, batch_idx):
        loss = lm_loss(self, batch)
        self.log("val_loss", loss, sync_dist=True)
        return loss

    def val_dataloader(self):
        return self.train_dataloader()


class AlreadySharded(ToyModule):
    def configure_model(self):
        from torch.distributed.fsdp import fully_shard

        fully_shard(self.model)


class GradientLifetime(pl.Callback):
    """Whether parameters hold gradients when the optimizer step starts and once it is over."""

    def __init__(self) -> None:
        #: per optimizer step, the names of the parameters holding a gradient
        self.at_step: list[list[str]] = []
        self.after_step: list[list[str]] = []

    @staticmethod
    def _with_grads(pl_module: pl.LightningModule) -> list[str]:
        return [name for name, p in pl_module.named_parameters() if p.grad is not None]

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        self.at_step.append(self._with_grads(pl_module))

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if (batch_idx + 1) % trainer.accumulate_grad_batches == 0:  # an optimizer step just ran
            self.after_step.append(self._with_grads(pl_module))


class FrozenObjects(pl.Callback):
    """How many objects the garbage collector has frozen at each training batch."""

    def __init__(self) -> None:
        self.counts: list[int] = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.counts.append(gc.get_freeze_count())


def _misc(rank: int, world: int) -> dict:
    out: dict = {}
    cfg = RunConfig(world_size=world, accumulate=1, steps=6, lr=0.2)

    # layout log, distinct data per rank
    records: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: records.append(record.getMessage())  # type: ignore[method-assign]
    logging.getLogger("lightning_mics.strategy").addHandler(handler)
    logging.getLogger("lightning_mics.strategy").setLevel(logging.INFO)
    batches = RecordBatches()
    trainer = fit_with_mics(ToyModule(cfg), cfg, callbacks=[batches], partition_size=2, ranks_per_node=2)
    out["log"] = records
    out["tokens"] = torch.cat(batches.tokens)

    # reduce / broadcast / barrier through the strategy
    strategy = trainer.strategy
    out["sum"] = strategy.reduce(torch.tensor(float(rank + 1)), reduce_op="sum").item()
    out["mean"] = strategy.reduce(torch.tensor(float(rank + 1))).item()
    out["broadcast"] = strategy.broadcast({"from": rank}, src=1)
    strategy.barrier()
    out["all_gather"] = strategy.all_gather(torch.tensor([rank])).flatten().tolist()

    # meta-device creation: materialised shard by shard, replicas agree, training works
    batches = RecordBatches()
    trainer = pl.Trainer(
        strategy=MiCSStrategy(partition_size=2, ranks_per_node=2), callbacks=[batches], **trainer_kwargs(cfg)
    )
    with trainer.init_module(empty_init=True):
        module = ToyModule(cfg)
    out["created_on_meta"] = all(p.is_meta for p in module.parameters())
    trainer.fit(module)
    out["meta_params"] = full_parameters(module)
    out["meta_losses"] = batches.losses
    out["meta_initial"] = batches.initial
    out["meta_tied"] = module.model.head.weight is module.model.embed.weight
    out["meta_buffer"] = module.model.scale.clone()

    # partition_size="auto": the planner's choice for this model and memory; needs the parameters up front
    trainer = fit_with_mics(ToyModule(cfg), cfg, partition_size="auto", ranks_per_node=2)
    out["auto_partition"] = trainer.strategy.topology.partition_size
    out["auto_memory"] = device_memory_bytes(trainer.strategy.root_device, 2)
    try:
        fit_with_mics(ToyModule(cfg, in_configure_model=True), cfg, partition_size="auto", ranks_per_node=2)
        out["auto_error"] = None
    except ValueError as err:
        out["auto_error"] = str(err)

    # the same trainer validates after fitting: the sharded model is reused, not re-wrapped
    plain = RunConfig(world_size=world, accumulate=1, steps=3, lr=0.2)
    module = ValidatedToyModule(plain)
    trainer = fit_with_mics(module, plain, partition_size=2, ranks_per_node=2)
    before = full_parameters(module)
    out["validate_loss"] = trainer.validate(module, verbose=False)[0]["val_loss"]
    out["validate_kept_params"] = all(torch.equal(before[n], p) for n, p in full_parameters(module).items())
    out["fit_params"] = before

    # a new trainer with the same options uses the model as the earlier one sharded it
    validator = pl.Trainer(strategy=MiCSStrategy(partition_size=2, ranks_per_node=2), **trainer_kwargs(plain))
    out["new_trainer_validate_loss"] = validator.validate(module, verbose=False)[0]["val_loss"]
    out["new_trainer_kept_params"] = all(torch.equal(before[n], p) for n, p in full_parameters(module).items())
    out["new_trainer_adopted_root"] = validator.strategy.model is trainer.strategy.model
    fit_with_mics(module, plain, partition_size=2, ranks_per_node=2)  # 3 more steps, a fresh optimizer
    out["fit_on_params"] = full_parameters(module)
    fresh = ValidatedToyModule(plain)  # the reference: the same weights in a model set up from scratch
    out["fresh_load_keys"] = fresh.load_state_dict(before, strict=False)
    fit_with_mics(fresh, plain, partition_size=2, ranks_per_node=2)
    out["fit_fresh_params"] = full_parameters(fresh)
    try:  # another layout cannot take the sharded model
        pl.Trainer(strategy=MiCSStrategy(partition_size=4, ranks_per_node=2), **trainer_kwargs(plain)).validate(
            module, verbose=False
        )
        out["other_layout_error"] = None
    except ValueError as err:
        out["other_layout_error"] = str(err)

    # release_gradients_after_step: gradients freed once the step used them, same training either way
    accumulating = RunConfig(world_size=world, accumulate=2, steps=3, lr=0.2)
    for release in (True, False):
        lifetime = GradientLifetime()
        module = ToyModule(accumulating)
        fit_with_mics(
            module,
            accumulating,
            callbacks=[lifetime],
            partition_size=2,
            ranks_per_node=2,
            release_gradients_after_step=release,
        )
        out[f"grads_release={release}"] = (lifetime.at_step, lifetime.after_step, full_parameters(module))

    # gc_freeze: the startup objects frozen while training (when nothing froze them before), thawed at the end
    for freeze in (True, False):
        frozen = FrozenObjects()
        fit_with_mics(ToyModule(plain), plain, callbacks=[frozen], partition_size=2, ranks_per_node=2, gc_freeze=freeze)
        out[f"gc_freeze={freeze}"] = (frozen.counts, gc.get_freeze_count())

    # a model that applied fully_shard itself is refused with a clear error
    try:
        fit_with_mics(AlreadySharded(cfg), cfg, partition_size=2, ranks_per_node=2)
        out["already_sharded_error"] = None
    except TypeError as err:
        out["already_sharded_error"] = str(err)
    return out


@pytest.fixture(scope="module")
def misc():
    return run_ranks(_misc, 4)


@pytest.mark.distributed
def test_rank_zero_logs_the_layout(misc):
    text = "\n".join(misc[0]["log"])
    assert "partition groups (shard model states): [0,1] [2,3]" in text
    assert "replication groups (hold the same shard; hop 2 syncs them): [0,2] [1,3]" in text
    assert "model states per rank: 1/2" in text
    assert not any("MiCS layout" in m for rank in misc[1:] for m in rank["log"])


@pytest.mark.distributed
def test_each_rank_sees_distinct_data(misc):
    rows = [tuple(row.tolist()) for rank in misc for row in rank["tokens"]]
    per_rank = [{tuple(row.tolist()) for row in rank["tokens"]} for rank in misc]
    assert len(rows) == RunConfig(world_size=4, steps=6).num_samples
    for i in range(4):
        for j in range(i + 1, 4):
            assert not per_rank[i] & per_rank[j], f"ranks {i} and {j} saw the same samples"


@pytest.mark.distributed
def test_reduce_broadcast_gather(misc):
    for rank, out in enumerate(misc):
        assert out["sum"] == 10.0 and out["mean"] == 2.5
        assert out["broadcast"] == {"from": 1}
        assert out["all_gather"] == [0, 1, 2, 3]


@pytest.mark.distributed
def test_meta_device_model_is_materialised_consistently(misc):
    assert all(out["created_on_meta"] for out in misc)
    first = misc[0]["meta_params"]
    for out in misc:
        assert out["meta_tied"]
        torch.testing.assert_close(out["meta_buffer"], torch.linspace(0.5, 1.5, out["meta_buffer"].numel()))
        for name, value in out["meta_params"].items():
            assert torch.isfinite(value).all()
            torch.testing.assert_close(value, first[name], rtol=0, atol=0)  # replicas agree exactly
        assert torch.isfinite(torch.tensor(out["meta_losses"])).all()
        moved = [n for n, p in out["meta_params"].items() if not torch.equal(p, out["meta_initial"][n])]
        assert moved == [n for n in out["meta_params"] if "blocks.1.gate" not in n]  # all but the frozen one


@pytest.mark.distributed
def test_pre_sharded_model_is_refused(misc):
    for out in misc:
        assert out["already_sharded_error"] and "auto_wrap_policy" in out["already_sharded_error"]


@pytest.mark.distributed
def test_auto_partition_size_is_the_planners_choice(misc):
    from toy import ToyLM

    from lightning_mics.planner import TrainingSpec, choose_partition_size

    params = sum(p.numel() for p in ToyLM().parameters())
    expected = choose_partition_size(4, 2, params, misc[0]["auto_memory"], training=TrainingSpec(precision="32-true"))
    assert {out["auto_partition"] for out in misc} == {expected}
    assert all("configure_model" in out["auto_error"] for out in misc)


def _hang_on_the_shard_group(rank: int, world: int) -> dict:
    import time
    from datetime import timedelta

    import torch.distributed as dist

    from lightning_mics.process_groups import SHARD_DIM, build_device_mesh
    from lightning_mics.topology import MiCSTopology

    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=60))
    mesh = build_device_mesh(MiCSTopology.create(world, 2, 2), "cpu", "gloo", timeout=timedelta(seconds=2))
    group = mesh.get_group(SHARD_DIM)
    dist.barrier(group=group)  # the groups work
    if rank % 2 == 1:
        time.sleep(6)  # a peer that hangs without dying, for longer than the groups' 2 s timeout (and then some)
        return {"error": None, "waited": 0.0}
    start = time.monotonic()
    try:
        dist.all_reduce(torch.ones(1), group=group)
        error = None
    except RuntimeError as err:
        error = str(err)
    return {"error": error, "waited": time.monotonic() - start}


@pytest.mark.distributed
def test_mesh_groups_use_the_strategy_timeout():
    results = run_ranks(_hang_on_the_shard_group, 4)
    for rank in (0, 2):
        assert results[rank]["error"], "a rank waiting on a hung peer must fail, not hang"
        assert results[rank]["waited"] < 5.5, results[rank]  # the timeout ended it, not the peer's return at 6 s


@pytest.mark.distributed
def test_gradients_are_released_right_after_the_optimizer_step(misc):
    for rank in misc:
        at_step, after_step, released_params = rank["grads_release=True"]
        kept_at_step, kept_after_step, kept_params = rank["grads_release=False"]
        trained = kept_at_step[0]  # every trainable parameter (the toy freezes one gate)
        assert len(trained) == len(kept_params) - 1
        assert at_step == [trained] * 3  # hooks before the step (clipping, logging) still see every gradient
        assert after_step == [[]] * 3  # freed before the next forward, not after it
        assert kept_at_step == [trained] * 3 and kept_after_step == [trained] * 3  # Lightning's own order
        for name, value in kept_params.items():
            assert torch.equal(released_params[name], value), name  # the same training, bit for bit


def test_training_freezes_the_startup_objects_and_thaws_them_after(misc):
    """``gc_freeze=True`` (the default): Python's full collections skip everything that existed when training
    started (a pause of 0.2-0.3 s per rank otherwise); the freeze ends with the run. ``False``: untouched."""
    for rank in misc:
        counts, after = rank["gc_freeze=True"]
        assert len(counts) == 3 and min(counts) > 10_000, counts  # torch, Lightning and the model, at least
        assert after == 0
        counts, after = rank["gc_freeze=False"]
        assert counts == [0, 0, 0] and after == 0


def test_gc_freeze_leaves_a_process_with_its_own_policy_alone():
    """A process that disabled the collector or froze objects itself keeps its policy (and its freeze)."""
    from lightning_mics import MiCSOptions
    from lightning_mics.engine import MiCSEngine

    assert gc.get_freeze_count() == 0
    gc.freeze()
    try:
        engine = MiCSEngine(MiCSOptions())
        frozen = gc.get_freeze_count()
        engine.freeze_startup_objects()
        engine.teardown()
        assert gc.get_freeze_count() == frozen  # not thawed by the engine: it did not freeze them
    finally:
        gc.unfreeze()
    gc.disable()
    try:
        engine = MiCSEngine(MiCSOptions())
        engine.freeze_startup_objects()
        assert gc.get_freeze_count() == 0
    finally:
        gc.enable()
    engine = MiCSEngine(MiCSOptions())
    engine.freeze_startup_objects()
    assert gc.get_freeze_count() > 0
    engine.teardown()
    assert gc.get_freeze_count() == 0
    with pytest.raises(TypeError, match="gc_freeze must be True or False"):
        MiCSStrategy(gc_freeze="yes")


def test_release_gradients_after_step_must_be_a_bool():
    with pytest.raises(TypeError, match="release_gradients_after_step must be True or False"):
        MiCSStrategy(release_gradients_after_step="yes")


def test_validate_after_fit_reuses_the_sharded_model(misc):
    losses = {round(out["validate_loss"], 6) for out in misc}
    assert len(losses) == 1 and all(torch.isfinite(torch.tensor(list(losses))))  # synced across ranks
    assert all(out["validate_kept_params"] for out in misc)


@pytest.mark.distributed
def test_a_new_trainer_validates_the_model_an_earlier_one_sharded(misc):
    """``pl.Trainer(strategy=MiCSStrategy(...)).validate(model)`` after another trainer's fit, as with DDP."""
    for out in misc:
        assert out["new_trainer_validate_loss"] == out["validate_loss"]  # the same model, exactly
        assert out["new_trainer_kept_params"] and out["new_trainer_adopted_root"]


@pytest.mark.distributed
def test_a_new_trainer_fits_the_model_an_earlier_one_sharded(misc):
    """Fitting on with a new trainer trains exactly as a fresh model holding the same weights would
    (both start a new optimizer, as with DDP), and every rank ends with the same model."""
    first = misc[0]["fit_on_params"]
    for out in misc:
        keys = out["fresh_load_keys"]  # every parameter but the tied head loaded; the buffer is a constant
        assert set(keys.missing_keys) == {"model.head.weight", "model.scale"} and not keys.unexpected_keys
        differ = [n for n in first if not torch.equal(out["fit_on_params"][n], out["fit_fresh_params"][n])]
        assert not differ, differ
        for name, value in out["fit_on_params"].items():
            assert torch.equal(value, first[name]), name
    trained = [n for n in first if not torch.equal(first[n], misc[0]["fit_params"][n])]
    assert len(trained) == len(first) - 1  # the second trainer trained every parameter but the frozen one


@pytest.mark.distributed
def test_a_new_trainer_with_another_layout_is_refused_naming_the_fixes(misc):
    for out in misc:
        error = out["other_layout_error"]
        assert error and "partition_size: 2 vs 4" in error, error
        assert "same options" in error and "trainer.save_checkpoint" in error and "ckpt_path=" in error


def test_sync_batchnorm_on_cpu_ranks_is_refused_not_ignored() -> None:
    with pytest.raises(ValueError, match="SyncBatchNorm, which torch runs on GPUs only; on CPU ranks remove sync_batchnorm"):
        pl.Trainer(accelerator="cpu", devices=2, strategy="mics", sync_batchnorm=True, logger=False)
    trainer = pl.Trainer(accelerator="cpu", devices=2, strategy="mics", logger=False)  # the default stays accepted
    assert trainer.strategy._layer_sync is None


_EXIT_PROBE = """
import atexit
from datetime import timedelta
import torch
import torch.distributed as dist
from lightning.fabric.plugins.environments import LightningEnvironment
from lightning_mics.process_groups import join_world

# registered before join_world, so it runs after the strategy's exit hook (atexit is LIFO)
atexit.register(lambda: print("world alive at exit:", dist.is_available() and dist.is_initialized(), flush=True))
environment = LightningEnvironment()
print("backend:", join_world(environment, torch.device("cpu"), None, timedelta(seconds=60)), flush=True)
payload = [{"log_dir": "x"}]
dist.broadcast_object_list(payload, src=0)  # the last collective, then straight to exit
"""


def test_a_gloo_world_is_left_at_interpreter_exit() -> None:
    """Why: gloo's worker releases the last collective's tensors after waking the caller; meeting a
    finalizing interpreter there aborted the LightningCLI job (-6) after a successful run. The
    strategy's exit hook lets the worker settle and destroys the world before finalization."""
    import subprocess
    import sys

    world = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "WORLD_SIZE": "1", "RANK": "0"}
    env = {**os.environ, **world}
    done = subprocess.run([sys.executable, "-c", _EXIT_PROBE], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "backend: gloo" in done.stdout
    assert "world alive at exit: False" in done.stdout, done.stdout


@pytest.mark.parametrize(
    ("partition_size", "sharding", "expected"),
    [
        (1, None, "unsharded"),  # nothing to shard: full gradients either way
        (None, ShardingSpec(params=1, grads=1, optim=8), "unsharded"),  # AMSP with G = 1 as well
        (2, None, "sharded"),
        (None, None, "sharded"),  # one node: MiCS's least-memory default stays
    ],
)
def test_a_one_rank_partition_accumulates_gradients_in_place(partition_size, sharding, expected) -> None:
    """Why: with a partition of one rank the sharded gradient *is* the full gradient, so "sharded"
    accumulation only adds a copy through FSDP2's one-rank reduce-scatter every micro-step (measured
    on the emulated cluster: 2.33 -> 2.01 s per step, the same gradient memory). The layout log
    says why the mode differs from the option."""
    from lightning_mics.layout import resolve_layout

    settings = resolve_layout(
        world_size=8,
        rank=0,
        ranks_per_node=4,
        partition_size=partition_size,
        reshard_after_forward=True,
        sharding=sharding,
        hierarchical="auto",
        device_type="cpu",
        backend="gloo",
        grad_accumulation="sharded",
    )
    assert settings.grad_accumulation == expected
    assert (settings.planner_reason is not None) == (expected == "unsharded")
    if expected == "unsharded":
        assert "partition of 1" in settings.planner_reason


_CONSOLE_PROBE = """
import logging, sys
import lightning_mics
from lightning_mics import MiCSFabricStrategy, MiCSStrategy

def say(text):
    logging.getLogger("lightning_mics.layout").info(text)  # where the layout line comes from: a child logger

if sys.argv[1] == "plain":
    say("probe at import")  # importing the package alone changes no logging
    MiCSStrategy()
    say("probe after the strategy")
    logging.basicConfig(level=logging.INFO, format="user: %(message)s")  # the application configures it late
    say("probe after basicConfig")
else:
    logging.basicConfig(level=logging.INFO, format="user: %(message)s")
    MiCSFabricStrategy()
    say("probe configured first")
"""


@pytest.mark.parametrize("mode", ["plain", "configured"])
def test_start_up_lines_reach_the_console_once_with_or_without_logging_set_up(mode: str) -> None:
    """Like Lightning's own start-up lines: shown with no logging set up (from the strategy's construction on,
    not at import), once -- never twice once the application has a root handler, configured before or after."""
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-c", _CONSOLE_PROBE, mode], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    if mode == "plain":
        assert "probe at import" not in done.stderr
        assert done.stderr.count("probe after the strategy") == 1
        assert done.stderr.count("probe after basicConfig") == 1, done.stderr
    else:
        assert done.stderr.count("probe configured first") == 1 and "user: probe configured first" in done.stderr
