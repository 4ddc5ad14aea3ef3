"""The two loops ``gpu_throughput.py`` compares -- a hand-written PyTorch AMP loop (:func:`train_plain`) and
``Trainer(strategy=MiCSStrategy(...))`` (:func:`train_strategy`) -- and what they must share so that the gap between
them is the strategy's overhead alone: the module and its initialisation, the optimizer, the data, and the timing
window (:class:`StepWindow`).
"""

from __future__ import annotations

import time
import weakref
from typing import Any, Optional

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback
from torch import Tensor, nn
from torch.distributed._composable import checkpoint
from torch.utils.data import DataLoader, TensorDataset

from benchmarks.gpu_config import BenchConfig
from examples.models import GPTLightningModule
from lightning_mics import MiCSStrategy


# ---------------------------------------------------------------------------------- shared pieces
class BenchmarkGPT(GPTLightningModule):
    """The examples' GPT with what both loops must share: the optimizer, and no per-step logging.

    ``GPTLightningModule`` logs the loss every step and warms the learning rate up through a
    scheduler; the plain loop has neither, so both are left out here -- the comparison is about the
    strategy, and a fused AdamW at constant learning rate is the same optimizer in both loops.
    """

    def __init__(self, cfg: BenchConfig) -> None:
        super().__init__(cfg.gpt, learning_rate=cfg.lr, weight_decay=cfg.weight_decay, betas=cfg.betas, warmup_steps=0)
        self.bench = cfg

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        return self._loss(batch)[0]

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return make_optimizer(self, self.bench)


def make_optimizer(module: nn.Module, cfg: BenchConfig) -> torch.optim.Optimizer:
    """AdamW with weight decay on matrices only (as ``GPTLightningModule``); fused on CUDA, where
    one kernel updates all parameters -- the fastest AdamW PyTorch has, for both loops."""
    decay = [p for p in module.parameters() if p.requires_grad and p.ndim >= 2]
    no_decay = [p for p in module.parameters() if p.requires_grad and p.ndim < 2]
    return torch.optim.AdamW(
        [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=cfg.lr,
        betas=cfg.betas,
        # with offload the optimizer steps on host tensors: torch's default (foreach) implementation there
        fused=True if cfg.device == "cuda" and not cfg.cpu_offload else None,
    )


def build_module(cfg: BenchConfig) -> BenchmarkGPT:
    """The model, initialised directly on the device from ``cfg.seed``: the same weights in every mode. With
    CPU offload in host memory instead: the strategy moves one unit at a time to the GPU and its shards back,
    so a model whose states do not fit the GPU never has to."""
    torch.manual_seed(cfg.seed)
    with torch.device("cpu" if cfg.cpu_offload else cfg.device):
        return BenchmarkGPT(cfg)


def make_loader(cfg: BenchConfig) -> DataLoader:
    """``total_steps`` micro-batches of random byte tokens (throughput does not depend on the text),
    the same for every mode; pinned on CUDA so the copy to the device is asynchronous in both loops."""
    gpt = cfg.gpt
    generator = torch.Generator().manual_seed(cfg.seed)
    tokens = torch.randint(0, gpt.vocab_size, (cfg.total_steps * cfg.micro_batch, gpt.seq_len + 1), generator=generator)
    dataset = TensorDataset(tokens[:, :-1], tokens[:, 1:])
    return DataLoader(dataset, batch_size=cfg.micro_batch, shuffle=False, pin_memory=cfg.device == "cuda")


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class StepWindow:
    """Times optimizer steps ``[warmup, warmup + steps)`` and keeps the first and last losses.

    Both loops call :meth:`after_step` once per optimizer step. The clock starts when step
    ``warmup - 1`` has finished on the device and stops when the last step has, so the window holds
    exactly ``steps`` steps of device work and host overhead, and no compilation or allocator warm-up.
    Losses are read (a host sync) only outside the window.
    """

    def __init__(self, cfg: BenchConfig) -> None:
        self.warmup, self.steps = cfg.warmup, cfg.steps
        self.device = torch.device(cfg.device)
        self._start: Optional[float] = None
        self.seconds: Optional[float] = None
        self.first_loss: Optional[float] = None
        self.last_loss: Optional[float] = None

    def after_step(self, step: int, loss: Tensor) -> None:
        if step == 0:
            self.first_loss = float(loss)
        if step == self.warmup - 1:
            synchronize(self.device)
            self._start = time.perf_counter()
        elif step == self.warmup + self.steps - 1:
            synchronize(self.device)
            assert self._start is not None
            self.seconds = time.perf_counter() - self._start
            self.last_loss = float(loss)


class StepWindowCallback(Callback):
    """Feeds Lightning's steps to a :class:`StepWindow` (one micro-batch per step, one epoch)."""

    def __init__(self, window: StepWindow) -> None:
        self.window = window

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        self.window.after_step(batch_idx, outputs["loss"])


# ---------------------------------------------------------------------------------- the two loops
def train_plain(cfg: BenchConfig, compiled: bool, window: StepWindow) -> weakref.ref:
    """The hand-written AMP loop. Blocks get activation checkpointing, then ``torch.compile``, per
    block and in place -- what ``MiCSStrategy`` does to its wrapped blocks before sharding -- so the
    two loops run the same compiled units and differ only by the strategy."""
    module = build_module(cfg)
    for block in module.model.blocks:
        if cfg.activation_checkpointing:
            checkpoint(block)
        if compiled:
            block.compile()
    optimizer = make_optimizer(module, cfg)
    device = torch.device(cfg.device)
    module.train()
    for step, (tokens, targets) in enumerate(make_loader(cfg)):
        tokens = tokens.to(device, non_blocking=True)
        targets = targets.to(device, non_blocking=True)
        with torch.autocast(device.type, dtype=torch.bfloat16):
            loss = module._loss((tokens, targets))[0]
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        window.after_step(step, loss.detach())
    return weakref.ref(module)


def strategy_options(cfg: BenchConfig, compiled: bool) -> dict[str, Any]:
    """``MiCSStrategy`` arguments for this run: the GPU-path options (issue 7) only when asked for."""
    options: dict[str, Any] = {"reshard_after_forward": cfg.reshard_after_forward}
    if compiled:
        options["compile_blocks"] = True
    if cfg.activation_checkpointing:
        options["activation_checkpointing_policy"] = True
    if cfg.prefetch_depth is not None:
        options["prefetch_depth"] = cfg.prefetch_depth
    if cfg.cpu_offload:
        options["cpu_offload"] = True
    return options


def train_strategy(cfg: BenchConfig, compiled: bool, window: StepWindow) -> weakref.ref:
    """The same module and data through ``Trainer(strategy=MiCSStrategy(...))`` on one device."""
    strategy = MiCSStrategy(**strategy_options(cfg, compiled))
    module = build_module(cfg)
    trainer = pl.Trainer(
        strategy=strategy,
        accelerator=cfg.device,
        devices=cfg.devices,
        precision="bf16-mixed",
        max_steps=cfg.total_steps,
        callbacks=[StepWindowCallback(window)],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        limit_val_batches=0,
        # One rank needs no DistributedSampler, and Lightning's would shuffle: keep the plain loop's batch order
        # (with --devices > 1 every rank trains the same batches: a throughput measurement, not a training run).
        use_distributed_sampler=False,
    )
    trainer.fit(module, train_dataloaders=make_loader(cfg))
    return weakref.ref(module)


TRAINERS = {"plain": train_plain, "strategy": train_strategy}
