"""Callbacks that record what happens inside training steps, shared by the distributed tests."""

from __future__ import annotations

import lightning.pytorch as pl

from lightning_mics import CollectiveRecorder


class RecordPerMicroStep(pl.Callback):
    """Stamps each recorded collective with the micro-step (batch index) it ran in; -1 outside."""

    def __init__(self) -> None:
        self.recorder = CollectiveRecorder()
        self.recorder.step = -1

    def on_fit_start(self, trainer, pl_module):
        self.recorder.__enter__()

    def on_fit_end(self, trainer, pl_module):
        self.recorder.__exit__(None, None, None)

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.recorder.step = batch_idx

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.recorder.step = -1


def local_numel(t) -> int:
    """Elements this rank stores for ``t`` (its local shard if ``t`` is a DTensor)."""
    return t.to_local().numel() if hasattr(t, "to_local") else t.numel()


class CountLocalStateElements(pl.Callback):
    """Elements of parameters, gradients and optimizer state this rank holds (its shards)."""

    def __init__(self) -> None:
        self.local: dict[str, int] = {}

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        params = list(pl_module.parameters())
        self.local["params"] = sum(local_numel(p) for p in params)
        self.local["grads"] = sum(local_numel(p.grad) for p in params if p.grad is not None)

    def on_train_end(self, trainer, pl_module):
        optimizer = trainer.optimizers[0]
        self.local["optim"] = sum(
            local_numel(state["momentum_buffer"]) for state in optimizer.state.values()
        )
