"""Shared pieces of the checkpoint tests: models, rank functions for ``run_ranks``, comparisons, and a
torchrun-like launcher of separate rank processes (so that one rank can be SIGKILLed).

Run as a script (``python tests/checkpoint_helpers.py SCENARIO ROOT``) it is one rank of the
fault-tolerance scenario; the environment says which rank, as torchrun would.
"""

from __future__ import annotations

import multiprocessing
import os
import signal
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any, Optional, Union

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, TensorDataset

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # when run as a script

from distributed import adopt_starters_state, exit_after_distributed_work, free_port, start_method  # noqa: E402
from toy import RunConfig, ToyModule, full_parameters, lm_loss, trainer_kwargs  # noqa: E402

from lightning_mics import MiCSStrategy  # noqa: E402
from lightning_mics import checkpoint as ckpt  # noqa: E402
from lightning_mics.checkpoint import integrity  # noqa: E402
from lightning_mics.sharding_spec import ShardingSpec  # noqa: E402

#: Two optimizer steps per epoch; runs of several epochs resume at epoch boundaries, where
#: Lightning's loops (without a stateful dataloader) continue exactly.
STEPS_PER_EPOCH = 2
TRAIN_CONFIG = RunConfig(world_size=4, steps=STEPS_PER_EPOCH)


class NoisyToyModule(ToyModule):
    """``ToyModule`` that masks random input tokens with the global torch RNG: a resumed run matches
    an uninterrupted one only if the RNG states were checkpointed and restored."""

    def __init__(self, cfg: RunConfig) -> None:
        super().__init__(cfg)
        self.steps_run = 0  # steps this instance executed: tells a resumed run from a restarted one

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        tokens, targets = batch
        dropped = torch.rand(tokens.shape) < 0.3
        self.steps_run += 1
        return lm_loss(self, (tokens.masked_fill(dropped, 0), targets))


class ReshapedToyModule(ToyModule):
    """A different model for the mismatch errors: an extra layer (missing from the checkpoint), one
    block fewer (unexpected in it) and a head of another shape."""

    def __init__(self, cfg: RunConfig) -> None:
        super().__init__(cfg)
        assert self.model is not None
        del self.model.blocks[2]
        self.model.head = nn.Linear(10, 12, bias=False)
        self.extra = nn.Linear(10, 10)


class WideModule(pl.LightningModule):
    """Two 256x256 layers: big enough that DCP's per-item overhead is negligible, so the bytes on
    disk measure how many copies of the states a checkpoint holds."""

    WIDTH = 256

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.layers = nn.ModuleList(nn.Linear(self.WIDTH, self.WIDTH) for _ in range(2))

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        inputs, targets = batch
        for layer in self.layers:
            inputs = torch.tanh(layer(inputs))
        return F.mse_loss(inputs, targets)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)

    def train_dataloader(self) -> DataLoader:
        generator = torch.Generator().manual_seed(0)
        data = torch.randn(8, self.WIDTH, generator=generator), torch.randn(8, self.WIDTH, generator=generator)
        return DataLoader(TensorDataset(*data), batch_size=2)


def make_trainer(
    world_size: int,
    partition_size: Union[int, ShardingSpec],
    max_steps: int = -1,
    max_epochs: Optional[int] = None,
    timeout: Optional[timedelta] = None,
    async_save: bool = False,
    **overrides: Any,
) -> pl.Trainer:
    """A trainer for the toy runs (``partition_size`` may be an AMSP ``ShardingSpec``). Runs that are
    resumed stop by ``max_epochs``: Lightning's loops resume an epoch-boundary checkpoint of a
    ``max_steps`` run at a wrong batch index (strategy-independent)."""
    strategy_kwargs: dict[str, Any] = (
        {"sharding": partition_size} if isinstance(partition_size, ShardingSpec) else {"partition_size": partition_size}
    )
    if timeout is not None:
        strategy_kwargs["timeout"] = timeout
    strategy_kwargs["async_save"] = async_save
    limits = {"max_steps": max_steps, "max_epochs": max_epochs}
    kwargs = {**trainer_kwargs(RunConfig(world_size=world_size)), **limits, **overrides}
    return pl.Trainer(strategy=MiCSStrategy(**strategy_kwargs), **kwargs)


def last_checkpoint_callback(dirpath: Path) -> ModelCheckpoint:
    """At every epoch end: a new ``epoch=E-step=S.ckpt`` (the previous one removed), then
    ``last.ckpt`` rewritten in place (Lightning 2.6 saves "last" only after a top-k save)."""
    return ModelCheckpoint(dirpath=dirpath, save_last=True, every_n_epochs=1)


# ---------------------------------------------------------------------------------------------------------------------
# snapshots and comparisons


@dataclass
class Snapshot:
    """Unsharded parameters and optimizer state (momentum buffers by parameter name)."""

    params: dict[str, torch.Tensor]
    momentum: dict[str, torch.Tensor]


def snapshot(module: nn.Module, optimizer: torch.optim.Optimizer) -> Snapshot:
    """Collective on sharded runs (call on every rank); complete on rank 0."""
    params = full_parameters(module)
    state = ckpt.optimizer_state_dict(module, getattr(optimizer, "_optimizer", optimizer), full=True)
    return Snapshot(params, momentum_by_name(state) if state else {})


def momentum_by_name(state: Mapping[str, Any], names: Optional[Sequence[str]] = None) -> dict[str, torch.Tensor]:
    """Momentum buffers of a ``torch.optim``-format SGD state, keyed by parameter name (from the
    groups' ``param_names`` unless ``names`` gives them in optimizer order)."""
    if names is None:
        names = [name for group in state["param_groups"] for name in group["param_names"]]
    return {names[int(i)]: per_param["momentum_buffer"].clone() for i, per_param in state["state"].items()}


def plain_toy_optimizer(module: ToyModule) -> tuple[torch.optim.Optimizer, list[str]]:
    """The optimizer ``ToyModule`` configures, on an unsharded module, with its parameter names."""
    optimizer = module.configure_optimizers()
    names = [name for name, p in module.named_parameters() if p.requires_grad]
    return optimizer, names


def assert_same_tensors(actual: Mapping[str, torch.Tensor], expected: Mapping[str, torch.Tensor]) -> None:
    """Same keys, bit-identical values (checkpoints copy values; nothing may be recomputed)."""
    assert sorted(actual) == sorted(expected)
    for name, value in expected.items():
        torch.testing.assert_close(actual[name], value, rtol=0, atol=0, msg=lambda m: f"{name}: {m}")


# ---------------------------------------------------------------------------------------------------------------------
# rank functions (run by tests/distributed.py:run_ranks)


def write_reference_checkpoints(rank: int, world_size: int, root: str) -> dict[str, Any]:
    """4 ranks, partition 2: train, then save the same state sharded and as a full file; also a
    wide model's sharded checkpoint for the dedup measurement."""
    model = ToyModule(RunConfig(world_size=world_size, steps=STEPS_PER_EPOCH))
    trainer = make_trainer(world_size, partition_size=2, max_steps=STEPS_PER_EPOCH)
    trainer.fit(model)
    trainer.save_checkpoint(Path(root, "sharded"))
    trainer.strategy.save_full_state_dict = True
    trainer.save_checkpoint(Path(root, "full.ckpt"))
    toy = snapshot(model, trainer.optimizers[0])

    wide = WideModule()
    wide_trainer = make_trainer(world_size, partition_size=2, max_steps=1)
    wide_trainer.fit(wide)
    wide_trainer.save_checkpoint(Path(root, "wide"))
    wide_state = snapshot(wide, wide_trainer.optimizers[0])
    return {"toy": toy, "wide": wide_state}


def load_and_snapshot(rank: int, world_size: int, partition_size: int, paths: list[str]) -> list[Snapshot]:
    """Resume ``fit`` from each checkpoint (already at ``max_steps``: it loads and stops) and
    snapshot what was loaded."""
    snapshots = []
    for path in paths:
        model = ToyModule(RunConfig(world_size=world_size, steps=STEPS_PER_EPOCH))
        trainer = make_trainer(world_size, partition_size, max_steps=STEPS_PER_EPOCH)
        trainer.fit(model, ckpt_path=path)
        assert trainer.global_step == STEPS_PER_EPOCH
        snapshots.append(snapshot(model, trainer.optimizers[0]))
    return snapshots


def fit_errors(rank: int, world_size: int, cases: dict[str, tuple[str, str]]) -> dict[str, str]:
    """For each case ``name -> (module kind, ckpt_path)``: ``trainer.fit`` must raise; return
    ``name -> "ExceptionType: message"``. A case that does not raise is reported as such."""
    modules = {"toy": ToyModule, "reshaped": ReshapedToyModule}
    outcomes = {}
    for name, (kind, path) in cases.items():
        model = modules[kind](RunConfig(world_size=world_size, steps=STEPS_PER_EPOCH))
        trainer = make_trainer(world_size, partition_size=2, max_steps=STEPS_PER_EPOCH)
        try:
            trainer.fit(model, ckpt_path=path)
        except Exception as err:  # noqa: BLE001 - the test inspects the type and message
            outcomes[name] = f"{type(err).__name__}: {err}"
        else:
            outcomes[name] = "no error"
    return outcomes


def resume_scenarios(rank: int, world_size: int, root: str, async_save: bool = False) -> dict[str, Any]:
    """An uninterrupted run of two epochs, and the same run stopped after one epoch and resumed,
    once via ``ckpt_path="last"`` and once via the path of a per-epoch ``ModelCheckpoint`` file
    (checkpoints saved in the background with ``async_save``)."""
    cfg = RunConfig(world_size=world_size, steps=STEPS_PER_EPOCH)
    results: dict[str, Any] = {}

    model = NoisyToyModule(cfg)
    make_trainer(world_size, 2, max_epochs=2).fit(model)
    results["uninterrupted"] = full_parameters(model)

    def callbacks() -> list[Callback]:  # ``epoch=E-step=S.ckpt`` per epoch, and ``last.ckpt``
        return [ModelCheckpoint(dirpath=Path(root, "checkpoints"), save_last=True, save_top_k=-1, every_n_epochs=1)]

    model = NoisyToyModule(cfg)
    make_trainer(
        world_size, 2, max_epochs=1, enable_checkpointing=True, callbacks=callbacks(), async_save=async_save
    ).fit(model)

    per_epoch_path = Path(root, "checkpoints", f"epoch=0-step={STEPS_PER_EPOCH}.ckpt")
    for name, ckpt_path in (("via_last", "last"), ("via_path", str(per_epoch_path))):
        model = NoisyToyModule(cfg)
        trainer = make_trainer(
            world_size, 2, max_epochs=2, enable_checkpointing=True, callbacks=callbacks(), async_save=async_save
        )
        trainer.fit(model, ckpt_path=ckpt_path)
        results[name] = {
            "params": full_parameters(model),
            "steps_run": model.steps_run,
            "global_step": trainer.global_step,
        }
    return results


# ---------------------------------------------------------------------------------------------------------------------
# separate rank processes, for killing one of them


def launch_ranks(scenario: str, root: Path, world_size: int, deadline_s: float) -> list[Optional[int]]:
    """Start ``world_size`` rank processes of ``scenario`` as torchrun would (each its own process with
    the launcher's variables, its output in ``ROOT/SCENARIO-rankR.log``); wait at most ``deadline_s``.

    Returns the exit codes (``-9`` for a SIGKILLed rank); ``None`` for a process that was still running
    at the deadline (it is killed then, so a hang fails the test instead of blocking it). The processes
    come from the harness's fork server (:func:`distributed.start_method`), which saves each rank the
    imports a fresh interpreter pays."""
    context = multiprocessing.get_context(start_method())
    port = free_port()
    processes = [
        context.Process(target=_launched_rank, args=(scenario, str(root), rank, world_size, port, dict(os.environ)))
        for rank in range(world_size)
    ]
    for process in processes:
        process.start()
    stop_at = time.monotonic() + deadline_s
    codes: list[Optional[int]] = []
    for process in processes:
        process.join(timeout=max(0.0, stop_at - time.monotonic()))
        codes.append(process.exitcode)
    for process in processes:
        if process.is_alive():
            process.kill()
        process.join(timeout=10)
    return codes


def _launched_rank(scenario: str, root: str, rank: int, world_size: int, port: int, env: dict[str, str]) -> None:
    """One rank started by :func:`launch_ranks`: torchrun's environment, output to the rank's log."""
    adopt_starters_state(env, output=None)
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE=str(world_size), RANK=str(rank),
        LOCAL_RANK=str(rank), NODE_RANK="0", OMP_NUM_THREADS="1",
    )  # fmt: skip
    os.environ.pop("LOCAL_WORLD_SIZE", None)
    with open(Path(root) / f"{scenario}-rank{rank}.log", "w") as log:
        os.dup2(log.fileno(), sys.stdout.fileno())
        os.dup2(log.fileno(), sys.stderr.fileno())
    _scenario_rank(scenario, Path(root))
    exit_after_distributed_work()


#: The rank that is killed in the fault-tolerance scenario, and the collective timeout there.
VICTIM_RANK = 1
SCENARIO_TIMEOUT = timedelta(seconds=20)
SCENARIO_EPOCHS = 3


class KillDuringSecondLastSave(Callback):
    """On the victim rank, SIGKILL the process in the middle of the second ``last.ckpt`` save (which
    overwrites the first): after its shards are written, before the save is committed."""

    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # runs before ModelCheckpoint's hook (Lightning orders checkpoint callbacks last), which then
        # saves epoch=1-step=4.ckpt and last.ckpt, each digesting the files a rank wrote right after
        # writing them (and before rank 0 commits)
        if trainer.global_rank == VICTIM_RANK and trainer.current_epoch == 1:
            saver = trainer.strategy.engine.async_saver
            if saver is not None:  # epoch 0's background saves may still be digesting: not the calls counted here
                saver.wait()
            original, calls = integrity.digest_files, []

            def die_in_second_call(*args: Any, **kwargs: Any) -> Any:
                calls.append(1)
                if len(calls) == 2:
                    os.kill(os.getpid(), signal.SIGKILL)
                return original(*args, **kwargs)

            integrity.digest_files = die_in_second_call  # type: ignore[assignment]


def _scenario_rank(scenario: str, root: Path) -> None:
    scenario, _, mode = scenario.partition(":")
    async_save = mode == "async"
    """One rank of the fault-tolerance scenario.

    ``interrupted``: an uninterrupted reference run (rank 0 keeps its parameters), then the same
    run with ``last.ckpt`` saves, killed on the victim rank during the second save.
    ``resume``: ``fit(ckpt_path="last")`` to the end; rank 0 keeps the parameters and steps run.
    A ``:async`` suffix saves in the background (the kill then hits the checkpoint worker thread)."""
    torch.set_num_threads(1)
    world_size = int(os.environ["WORLD_SIZE"])
    cfg = RunConfig(world_size=world_size, steps=STEPS_PER_EPOCH)
    callbacks: list[Callback] = [last_checkpoint_callback(root / "checkpoints")]
    if scenario == "interrupted":
        model = NoisyToyModule(cfg)
        make_trainer(world_size, 2, max_epochs=SCENARIO_EPOCHS, timeout=SCENARIO_TIMEOUT).fit(model)
        params = full_parameters(model)
        if int(os.environ["RANK"]) == 0:
            torch.save(params, root / "uninterrupted.pt")
        callbacks.append(KillDuringSecondLastSave())
    model = NoisyToyModule(cfg)
    trainer = make_trainer(
        world_size,
        2,
        max_epochs=SCENARIO_EPOCHS,
        timeout=SCENARIO_TIMEOUT,
        enable_checkpointing=True,
        callbacks=callbacks,
        async_save=async_save,
    )
    trainer.fit(model, ckpt_path="last" if scenario == "resume" else None)
    params = full_parameters(model)
    if trainer.global_rank == 0:
        torch.save({"params": params, "steps_run": model.steps_run}, root / f"{scenario}.pt")


if __name__ == "__main__":
    _scenario_rank(sys.argv[1], Path(sys.argv[2]))
    exit_after_distributed_work()
