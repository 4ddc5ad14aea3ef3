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
