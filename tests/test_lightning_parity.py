"""Lightning's contract, side by side: what a user observes under ``strategy="mics"`` equals what they observe under
``strategy="ddp"`` -- Trainer properties, every hook and callback in order, logged metrics and the CSV log,
``validate`` / ``test`` / ``predict`` results, checkpoints and the Trainer's flags -- and the documented differences
are asserted as such.

In detail: Trainer properties at construction, in ``setup``, during and after ``fit``; every hook, callback and
module, in order; logged metrics (``callback_metrics`` and the CSV log, LearningRateMonitor's columns included);
``validate`` / ``test`` / ``predict`` results; checkpoint names, contents and ``ckpt_path`` (a path, ``"last"``,
``"best"``); ModelCheckpoint, EarlyStopping, LearningRateMonitor; ``fast_dev_run``, ``limit_*_batches``,
``val_check_interval``, ``max_time``; a second ``fit`` on the same Trainer.

One launch of 2 CPU ranks runs every scenario under DDP and under two MiCS layouts (sharded: one partition of 2;
replicated: 2 emulated nodes, hop 2 between them), one after the other in the same processes -- a launch costs
more than a Trainer on a 2-core host; the file takes 15-25 s there. The comparisons run in this process, on what
the ranks returned and wrote.

The documented differences (docs/usage.md, "Differences from DDP") are asserted as such: a MiCS checkpoint is a
directory of shards, DDP's one file (same names, same contents once consolidated, ``ckpt_path`` takes both); and
Lightning's ``Model.load_from_checkpoint`` cannot open a directory, where ``lightning_mics.load_from_checkpoint``
(or the ``LoadsShardedCheckpoints`` mixin) gives the same model. Fabric's ranks at construction are compared here
too (single process; the Trainer's are in tests/test_trainer_ranks.py).
"""

from __future__ import annotations

import csv
from pathlib import Path
from typing import Any, Callable, Optional

import lightning.pytorch as pl
import pytest
import torch
from distributed import run_ranks
from lightning.fabric import Fabric
from lightning.pytorch.callbacks import EarlyStopping, LearningRateMonitor, ModelCheckpoint
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import lightning_mics
from lightning_mics import MiCSFabricStrategy, MiCSStrategy
from lightning_mics.checkpoint.from_checkpoint import LoadsShardedCheckpoints
from lightning_mics.consolidate import consolidate

WORLD = 2
#: what runs side by side in the same ranks: DDP and two MiCS layouts -- sharded (2 ranks of one node: one partition
#: of 2) and replicated (2 emulated nodes of 1 rank: 2 partitions of 1, gradients averaged across them by hop 2)
STRATEGIES: dict[str, Callable[[], Any]] = {
    "ddp": lambda: "ddp", "mics": lambda: "mics", "mics_2_nodes": lambda: MiCSStrategy(ranks_per_node=1),
}
MICS_VARIANTS = [name for name in STRATEGIES if name != "ddp"]
TOLERANCE = dict(rel=1e-4, abs=1e-6)  # sharded reductions sum in another order than DDP's all-reduce

#: every hook of a process, callback's and module's, in call order (a rank is one process; reset per Trainer)
EVENTS: list[str] = []

#: LightningModule hooks a strategy could call differently (or not at all); each is recorded, then runs as usual
MODULE_HOOKS = (
    "configure_model", "configure_optimizers", "on_before_batch_transfer", "transfer_batch_to_device",
    "on_after_batch_transfer", "backward", "optimizer_step", "optimizer_zero_grad", "lr_scheduler_step",
    "on_validation_model_eval", "on_validation_model_train", "on_test_model_eval", "on_predict_model_eval",
    "on_save_checkpoint", "on_load_checkpoint",
)


def _recording_module_hook(name: str) -> Any:
    def hook(self: Any, *args: Any, **kwargs: Any) -> Any:
        EVENTS.append(f"module.{name}")
        return getattr(super(Regressor, self), name)(*args, **kwargs)

    hook.__name__ = name
    return hook


class _Regressor(pl.LightningModule):
    """A small model with every stage, logging like a user would (step and epoch, synced validation)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(8, 8), nn.Tanh()) for _ in range(2))
        self.head = nn.Linear(8, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.head(x)

    def _loss(self, batch: Any) -> torch.Tensor:
        x, y = batch
        return nn.functional.mse_loss(self(x), y)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss = self._loss(batch)
        self.log("train_loss", loss, on_step=True, on_epoch=True, sync_dist=True)
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        self.log("val_loss", self._loss(batch), sync_dist=True)

    def test_step(self, batch: Any, batch_idx: int) -> None:
        self.log("test_loss", self._loss(batch), sync_dist=True)

    def predict_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return self(batch[0])

    def configure_optimizers(self) -> Any:
        optimizer = torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9)
        return {"optimizer": optimizer, "lr_scheduler": torch.optim.lr_scheduler.StepLR(optimizer, 2, 0.5)}

    def _loader(self, seed: int) -> DataLoader:
        generator = torch.Generator().manual_seed(seed)
        x = torch.randn(64, 8, generator=generator)
        return DataLoader(TensorDataset(x, x.sum(dim=1, keepdim=True)), batch_size=4)

    def train_dataloader(self) -> DataLoader:
        return self._loader(1)

    def val_dataloader(self) -> DataLoader:
        return self._loader(2)

    def test_dataloader(self) -> DataLoader:
        return self._loader(3)

    def predict_dataloader(self) -> DataLoader:
        return self._loader(4)


Regressor = type("Regressor", (_Regressor,), {name: _recording_module_hook(name) for name in MODULE_HOOKS})


class LoadableRegressor(LoadsShardedCheckpoints, _Regressor):
    """What a user writes to make ``Model.load_from_checkpoint`` take a sharded directory too."""


PROPERTIES = ("world_size", "global_rank", "local_rank", "node_rank", "num_devices", "num_nodes", "is_global_zero")


def _properties(trainer: pl.Trainer) -> tuple[Any, ...]:
    return tuple(getattr(trainer, name) for name in PROPERTIES)


def _in_fit(trainer: pl.Trainer) -> dict[str, Any]:
    """What a hook can read once the loaders exist: the sampler's split of the data, the batch counts, the module."""
    sampler = trainer.train_dataloader.sampler if trainer.train_dataloader is not None else None
    module = trainer.lightning_module
    return dict(
        sampler=(type(sampler).__name__, getattr(sampler, "num_replicas", None), getattr(sampler, "rank", None)),
        num_training_batches=trainer.num_training_batches, num_val_batches=list(trainer.num_val_batches),
        estimated_stepping_batches=trainer.estimated_stepping_batches,
        module=(module.global_rank, module.local_rank, str(module.device)),
    )


def _recording_callback_hook(name: str) -> Any:
    def hook(self: Any, trainer: pl.Trainer, *args: Any, **kwargs: Any) -> None:
        stage = kwargs.get("stage", args[1] if name in ("setup", "teardown") and len(args) > 1 else None)
        event = f"{name}:{stage}" if stage is not None else name
        EVENTS.append(event)
        self.seen.setdefault(event, _properties(trainer))
        if name == "on_train_start":
            self.in_fit = _in_fit(trainer)

    hook.__name__ = name
    return hook


CALLBACK_HOOKS = [name for name, value in vars(pl.Callback).items()
                  if callable(value) and (name.startswith("on_") or name in ("setup", "teardown"))]


def _recorder_init(self: Any) -> None:
    self.seen, self.in_fit = {}, None


#: records every Callback hook into EVENTS, and the Trainer's properties the first time each is called
Recorder = type("Recorder", (pl.Callback,),
                {"__init__": _recorder_init, **{name: _recording_callback_hook(name) for name in CALLBACK_HOOKS}})


def _trainer(strategy: str, root: Path, callbacks: list, **overrides: Any) -> pl.Trainer:
    kwargs: dict[str, Any] = dict(
        accelerator="cpu", devices=WORLD, strategy=STRATEGIES[strategy](), max_epochs=2, default_root_dir=str(root),
        logger=pl.loggers.CSVLogger(str(root), name="logs", version=""), enable_progress_bar=False,
        enable_model_summary=False, num_sanity_val_steps=0, callbacks=callbacks,
    )
    kwargs.update(overrides)
    return pl.Trainer(**kwargs)


def _metrics(trainer: pl.Trainer) -> dict[str, float]:
    return {name: float(value) for name, value in trainer.callback_metrics.items()}


def _events() -> list[str]:
    events = list(EVENTS)
    EVENTS.clear()
    return events


def _one_strategy(strategy: str, base: Path) -> dict[str, Any]:
    result: dict[str, Any] = {}
    EVENTS.clear()
    recorder = Recorder()
    checkpoints = ModelCheckpoint(monitor="val_loss", save_top_k=2, save_last=True)
    early = EarlyStopping(monitor="val_loss", patience=1, min_delta=0.5)  # stops before max_epochs
    trainer = _trainer(strategy, base / "fit", [recorder, checkpoints, early, LearningRateMonitor(log_momentum=True)],
                       limit_train_batches=6, val_check_interval=3, max_epochs=6, log_every_n_steps=1)
    result["construction"] = _properties(trainer)
    model = Regressor()
    trainer.fit(model)
    result.update(
        fit_events=_events(), after_fit=_properties(trainer), in_hooks=recorder.seen, in_fit=recorder.in_fit,
        metrics=_metrics(trainer), global_step=trainer.global_step, epoch=trainer.current_epoch,
        stopped_epoch=early.stopped_epoch, log_dir=str(Path(trainer.log_dir).relative_to(base)),
        best=checkpoints.best_model_path, last=checkpoints.last_model_path,
        best_k=sorted(Path(p).name for p in checkpoints.best_k_models), best_score=float(checkpoints.best_model_score),
        checkpoint_files=sorted(p.name for p in Path(checkpoints.dirpath).iterdir()),
    )
    topology = getattr(trainer.strategy, "topology", None)
    result["layout"] = (topology.partition_size, topology.replication_degree) if topology is not None else None
    result["validate"] = trainer.validate(model, verbose=False)
    result["test"] = trainer.test(model, verbose=False)
    result["predict"] = torch.cat(trainer.predict(model)).flatten().tolist()
    result["eval_events"] = _events()
    # ckpt_path by name: the checkpoints ModelCheckpoint tracked, loaded into the fitted model
    result["validate_best"] = (trainer.validate(model, ckpt_path="best", verbose=False), Path(trainer.ckpt_path).name)
    result["test_last"] = (trainer.test(model, ckpt_path="last", verbose=False), Path(trainer.ckpt_path).name)
    result["ckpt_events"] = _events()
    # ckpt_path as a path: a new Trainer resumes the last checkpoint and trains 2 more steps
    resumed = _trainer(strategy, base / "resume", [], max_steps=trainer.global_step + 2, limit_val_batches=0)
    resumed.fit(Regressor(), ckpt_path=checkpoints.last_model_path)
    result["resumed"] = (resumed.global_step, resumed.current_epoch, _metrics(resumed))
    fast = _trainer(strategy, base / "fast", [], fast_dev_run=2)
    fast.fit(Regressor())
    result["fast_dev_run"] = (fast.global_step, sorted(_metrics(fast)), (base / "fast").exists())
    # limit_*_batches, then a second fit of the same model on the same Trainer, one epoch further
    limited = _trainer(strategy, base / "limited", [], limit_train_batches=3, limit_val_batches=2, max_epochs=2)
    limited_model = Regressor()
    limited.fit(limited_model)
    first = (limited.global_step, limited.current_epoch, _metrics(limited))
    limited.fit_loop.max_epochs = 3
    limited.fit(limited_model)
    result["limited"] = (first, (limited.global_step, limited.current_epoch, _metrics(limited)))
    result["second_fit_predict"] = torch.cat(limited.predict(limited_model)).flatten().tolist()
    timed = _trainer(strategy, base / "timed", [], max_time={"seconds": 0}, max_epochs=50)
    timed.fit(Regressor())
    result["max_time"] = (timed.global_step, timed.current_epoch)
    _events()
    return result


def _scenarios(rank: int, world: int, root: str) -> dict[str, dict[str, Any]]:
    return {strategy: _one_strategy(strategy, Path(root) / strategy) for strategy in STRATEGIES}


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("parity")


@pytest.fixture(scope="module")
def observed(root: Path) -> list[dict[str, dict[str, Any]]]:
    return run_ranks(_scenarios, WORLD, str(root), timeout=300)


@pytest.fixture(params=MICS_VARIANTS)
def variant(request: pytest.FixtureRequest) -> str:
    """Which MiCS run a test compares with DDP's."""
    return request.param


def _both(observed: list[dict[str, dict[str, Any]]], key: str, variant: str) -> list[tuple[Any, Any]]:
    return [(rank["ddp"][key], rank[variant][key]) for rank in observed]


def _close(mics: Any, ddp: Any) -> bool:
    """Equal structure, exact for everything but floats, floats and tensors within TOLERANCE."""
    if isinstance(ddp, dict):
        return isinstance(mics, dict) and set(mics) == set(ddp) and all(_close(mics[k], ddp[k]) for k in ddp)
    if isinstance(ddp, (list, tuple)):
        return type(mics) is type(ddp) and len(mics) == len(ddp) and all(map(_close, mics, ddp))
    if isinstance(ddp, torch.Tensor):
        return isinstance(mics, torch.Tensor) and mics.shape == ddp.shape and torch.allclose(
            mics.float(), ddp.float(), rtol=TOLERANCE["rel"], atol=TOLERANCE["abs"])
    if isinstance(ddp, float):
        return isinstance(mics, float) and mics == pytest.approx(ddp, **TOLERANCE)
    return mics == ddp


# ---------------------------------------------------------------------------------------- what the ranks report


@pytest.mark.distributed
@pytest.mark.parametrize("key", ["construction", "after_fit", "in_hooks", "in_fit", "global_step", "epoch",
                                 "stopped_epoch", "log_dir", "best_k", "checkpoint_files", "fast_dev_run",
                                 "max_time"])
def test_what_a_user_reads_equals_ddp(observed, variant: str, key: str) -> None:
    for rank, (ddp, mics) in enumerate(_both(observed, key, variant)):
        assert mics == ddp, (key, rank)


@pytest.mark.distributed
def test_the_scenarios_do_what_they_claim(observed) -> None:
    """Against DDP's own values: the comparisons above only mean something if the runs did these things."""
    for rank, result in enumerate(observed):
        ddp = result["ddp"]
        assert ddp["construction"][:2] == (WORLD, rank) and ddp["in_fit"]["sampler"] == ("DistributedSampler",
                                                                                          WORLD, rank)
        # 6 batches per epoch and rank, validation after 3 and 6; EarlyStopping stops at the third validation
        assert (ddp["stopped_epoch"], ddp["epoch"], ddp["global_step"]) == (1, 2, 9)
        assert ddp["fit_events"].count("on_validation_start") == 3 and ddp["best_k"][0] == "epoch=0-step=6.ckpt"
        assert ddp["fast_dev_run"] == (2, ["train_loss", "train_loss_epoch", "train_loss_step", "val_loss"], False)
        assert ddp["limited"][0][:2] == (6, 2) and ddp["limited"][1][:2] == (9, 3)  # the second fit trained
        assert ddp["max_time"] == (0, 0)  # max_time=0: stopped before the first step
        assert ddp["resumed"][0] == ddp["global_step"] + 2
        assert (result["mics"]["layout"], result["mics_2_nodes"]["layout"]) == ((2, 1), (1, 2))  # sharded, replicated


@pytest.mark.distributed
def test_the_ranks_are_the_launched_ones_from_construction_on(observed, variant: str) -> None:
    for rank, result in enumerate(observed):
        assert result[variant]["construction"][:2] == (WORLD, rank)
        assert result[variant]["construction"][-1] is (rank == 0)


@pytest.mark.distributed
@pytest.mark.parametrize("key", ["fit_events", "eval_events", "ckpt_events"])
def test_every_hook_runs_in_ddps_order(observed, variant: str, key: str) -> None:
    for rank, (ddp, mics) in enumerate(_both(observed, key, variant)):
        if key == "fit_events":  # the module's hooks are recorded too
            assert {"module.configure_model", "module.optimizer_step", "module.backward"} <= set(ddp)
        first_difference = next(((i, d, m) for i, (d, m) in enumerate(zip(ddp, mics)) if d != m), None)
        assert mics == ddp, (key, rank, first_difference or (len(ddp), len(mics)))


@pytest.mark.distributed
@pytest.mark.parametrize("key", ["metrics", "validate", "test", "predict", "validate_best", "test_last", "resumed",
                                 "limited", "second_fit_predict", "best_score"])
def test_logged_and_evaluated_numbers_equal_ddp(observed, variant: str, key: str) -> None:
    for rank, (ddp, mics) in enumerate(_both(observed, key, variant)):
        assert _close(mics, ddp), (key, rank, mics, ddp)


def _csv(path: Path) -> list[dict[str, Any]]:
    with path.open() as handle:
        rows = list(csv.DictReader(handle))
    return [{k: (float(v) if v not in ("", None) else None) for k, v in row.items()} for row in rows]


@pytest.mark.distributed
def test_the_csv_log_equals_ddps_learning_rate_columns_included(observed, variant: str, root: Path) -> None:
    ddp, mics = (_csv(root / name / "fit" / "logs" / "metrics.csv") for name in ("ddp", variant))
    assert {"lr-SGD", "lr-SGD-momentum", "train_loss_step", "val_loss", "test_loss", "epoch", "step"} <= set(ddp[0])
    assert len(ddp) > 10
    assert [sorted(row) for row in mics] == [sorted(row) for row in ddp]
    for d, m in zip(ddp, mics):
        for column, value in d.items():
            assert (m[column] is None) == (value is None), column
            if value is not None:
                assert m[column] == pytest.approx(value, **TOLERANCE), (column, d)


# ---------------------------------------------------------------------------------------- checkpoints


def _relocated(state: Any, old: str, new: str) -> Any:
    """``state`` with ``old`` replaced by ``new`` at the start of every string, dictionary keys included."""
    if isinstance(state, dict):
        return {_relocated(k, old, new): _relocated(v, old, new) for k, v in state.items()}
    if isinstance(state, str) and state.startswith(old):
        return new + state[len(old):]
    return state


@pytest.mark.distributed
def test_the_documented_difference_a_checkpoint_is_a_directory_with_the_same_name(observed, variant: str) -> None:
    for ddp, mics in _both(observed, "best", variant) + _both(observed, "last", variant):
        assert Path(ddp).name == Path(mics).name and Path(ddp).parent.name == Path(mics).parent.name
        assert Path(ddp).is_file() and Path(mics).is_dir()


@pytest.mark.distributed
def test_a_consolidated_checkpoint_has_ddps_contents(observed, variant: str, tmp_path: Path) -> None:
    """`python -m lightning_mics.consolidate --with-optimizer` gives the file DDP would have written."""
    ddp_path, mics_path = observed[0]["ddp"]["last"], observed[0][variant]["last"]
    ddp = torch.load(ddp_path, weights_only=False)
    mics = torch.load(consolidate(mics_path, tmp_path / "last.ckpt", with_optimizer=True), weights_only=False)
    assert set(mics) == set(ddp)
    assert _close(mics["state_dict"], ddp["state_dict"])
    for key in ("epoch", "global_step", "loops", "lr_schedulers"):
        assert mics[key] == ddp[key], key
    assert set(mics["callbacks"]) == set(ddp["callbacks"])
    ddp_root, mics_root = (str(Path(path).parents[3]) for path in (ddp_path, mics_path))  # <root>/<strategy>
    for name, state in ddp["callbacks"].items():  # ModelCheckpoint's paths: the same under each run's directory
        assert _close(_relocated(mics["callbacks"][name], mics_root, ddp_root), state), name
    (ddp_optimizer,), (mics_optimizer,) = ddp["optimizer_states"], mics["optimizer_states"]
    assert _close(mics_optimizer["state"], ddp_optimizer["state"])
    for d, m in zip(ddp_optimizer["param_groups"], mics_optimizer["param_groups"]):
        assert {k: v for k, v in m.items() if k != "param_names"} == d  # MiCS also names the parameters


@pytest.mark.distributed
def test_load_from_checkpoint_of_a_directory_names_what_to_call(observed, variant: str) -> None:
    """Lightning's classmethod opens one file before any hook or strategy runs: a directory fails there (the
    documented difference); the library's function and the opt-in mixin load the model DDP's file gives."""
    ddp_path, mics_path = observed[0]["ddp"]["best"], observed[0][variant]["best"]
    expected = _Regressor.load_from_checkpoint(ddp_path).state_dict()
    with pytest.raises(IsADirectoryError):
        _Regressor.load_from_checkpoint(mics_path)
    assert _close(lightning_mics.load_from_checkpoint(_Regressor, mics_path).state_dict(), expected)
    loaded = LoadableRegressor.load_from_checkpoint(mics_path)
    assert type(loaded) is LoadableRegressor and _close(loaded.state_dict(), expected)
    assert _close(LoadableRegressor.load_from_checkpoint(ddp_path).state_dict(), expected)  # a file as before


def test_the_mixin_after_lightning_module_is_refused_naming_the_order() -> None:
    with pytest.raises(TypeError, match=r"class Late\(LoadsShardedCheckpoints, LightningModule\)"):
        type("Late", (pl.LightningModule, LoadsShardedCheckpoints), {})


# ---------------------------------------------------------------------------------------- Fabric, no process

FABRIC_ENVIRONMENTS: dict[str, dict[str, str]] = {
    "single process": {},
    "launched rank": {"LOCAL_RANK": "1", "NODE_RANK": "1"},
    "torchrun": {"RANK": "5", "LOCAL_RANK": "1", "WORLD_SIZE": "8", "LOCAL_WORLD_SIZE": "4", "GROUP_RANK": "1",
                 "TORCHELASTIC_RUN_ID": "test", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29555"},
    "slurm": {"SLURM_NTASKS": "8", "SLURM_NTASKS_PER_NODE": "4", "SLURM_PROCID": "6", "SLURM_LOCALID": "2",
              "SLURM_NODEID": "1", "SLURM_JOB_NAME": "train", "SLURM_JOB_ID": "1234", "SLURM_NODELIST": "node[1-2]",
              "MASTER_PORT": "29556"},
}
#: the global rank each environment names (LOCAL_RANK 1 of node 1, 4 devices per node: 5)
FABRIC_GLOBAL_RANK = {"single process": 0, "launched rank": 5, "torchrun": 5, "slurm": 6}
_CLEARED = sorted({name for env in FABRIC_ENVIRONMENTS.values() for name in env}
                  | {"SLURM_NNODES", "JSM_NAMESPACE_SIZE", "PMI_SIZE"})


def _fabric_ranks(strategy: Any, num_nodes: int) -> tuple[Any, ...]:
    fabric = Fabric(accelerator="cpu", devices=4, num_nodes=num_nodes, strategy=strategy)
    return fabric.world_size, fabric.global_rank, fabric.local_rank, fabric.node_rank, fabric.is_global_zero


@pytest.mark.parametrize("environment", list(FABRIC_ENVIRONMENTS))
@pytest.mark.parametrize("name", ["mics", "mics_auto", "mics_zero3", "mics_replicate", "class"])
def test_fabric_ranks_at_construction_equal_ddps(monkeypatch: pytest.MonkeyPatch, name: str, environment: str) -> None:
    for variable in _CLEARED:
        monkeypatch.delenv(variable, raising=False)
    for variable, value in FABRIC_ENVIRONMENTS[environment].items():
        monkeypatch.setenv(variable, value)
    num_nodes = 1 if environment == "single process" else 2
    strategy: Optional[Any] = MiCSFabricStrategy(partition_size=2) if name == "class" else name
    ddp, mics = _fabric_ranks("ddp", num_nodes), _fabric_ranks(strategy, num_nodes)
    assert mics == ddp, (name, environment)
    assert mics[1] == FABRIC_GLOBAL_RANK[environment] and mics[0] == 4 * num_nodes, mics


def test_close_tells_a_difference() -> None:
    """The comparison helper itself can fail: a structure, a float or a tensor apart is not close."""
    assert _close({"a": [1.0, torch.ones(2)]}, {"a": [1.0, torch.ones(2)]})
    assert not _close({"a": 1.0}, {"a": 1.01}) and not _close({"a": 1.0}, {"b": 1.0})
    assert not _close([torch.ones(2)], [torch.zeros(2)]) and not _close((1, 2), [1, 2])
