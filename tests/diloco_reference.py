"""The hand-written DiLoCo the semi-synchronous tests compare against, and the pieces they share: each rank's fixed
samples, a module that reads them, and how parameters are compared.

One reference serves flat and two-level DiLoCo: a worker is ``ranks_per_worker`` consecutive ranks (a partition group
for flat DiLoCo, several for two-level), trained synchronously -- its gradient the mean over its ranks' samples, one
inner optimizer -- and every ``every`` steps the workers' deltas are averaged and the outer optimizer steps the
global copy, which every worker takes.
"""

from __future__ import annotations

import copy
import functools
from typing import Callable

import lightning.pytorch as pl
import torch
from toy import RunConfig, ToyLM, ToyModule, lm_loss, make_dataset
from torch.utils.data import DataLoader, Subset


def rank_samples(cfg: RunConfig, rank: int) -> list[int]:
    """Rank ``rank``'s micro-batch ``i`` is samples ``[(i * world + rank) * mb, ... + mb)``, every epoch alike."""
    micro_batches = cfg.steps * cfg.accumulate
    return [(i * cfg.world_size + rank) * cfg.micro_batch + j
            for i in range(micro_batches) for j in range(cfg.micro_batch)]


class PerRankData(ToyModule):
    """``ToyModule`` reading its rank's fixed samples (``use_distributed_sampler=False``), so the reference knows
    which samples each worker trained on in every epoch."""

    def train_dataloader(self) -> DataLoader:
        indices = rank_samples(self.cfg, self.trainer.global_rank)
        return DataLoader(Subset(make_dataset(self.cfg.num_samples), indices), batch_size=self.cfg.micro_batch)


def trainable(model: torch.nn.Module) -> list[torch.Tensor]:
    return [p for p in model.parameters() if p.requires_grad]


def trained(params: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The parameters DiLoCo synchronises: those the optimizer steps (the frozen gate of block 1 is not)."""
    return {name: value for name, value in params.items() if name != "blocks.1.gate.weight"}


def max_difference(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert sorted(a) == sorted(b)
    return max(float((a[n].float() - b[n].float()).abs().max()) for n in a)


def global_model(trainer: pl.Trainer) -> dict[str, torch.Tensor]:
    """The last-synchronised parameters (the global model) of the one optimizer's DiLoCo, unsharded."""
    (sync,) = trainer.strategy.engine.semi_sync.syncs
    return {name: a.full_tensor().detach().clone() for name, a in zip(sync.names, sync.anchors)}


@functools.lru_cache(maxsize=None)
def diloco_reference(
    cfg: RunConfig, epochs: int, every: int, ranks_per_worker: int,
    outer: Callable[[list[torch.Tensor]], torch.optim.Optimizer],
) -> tuple[dict[str, torch.Tensor], list[dict[str, torch.Tensor]]]:
    """DiLoCo in one process (module docstring): (the global parameters after the last outer step, each worker's
    parameters at the end). Worker ``w`` is ranks ``w * n .. w * n + n - 1``, ``n = ranks_per_worker``."""
    torch.manual_seed(cfg.seed)
    base = ToyLM()
    models = [copy.deepcopy(base) for _ in range(cfg.world_size // ranks_per_worker)]
    inner = [torch.optim.SGD(trainable(m), lr=cfg.lr, momentum=cfg.momentum) for m in models]
    reference = copy.deepcopy(base)
    outer_optimizer = outer(trainable(reference))
    tokens, targets = make_dataset(cfg.num_samples).tensors
    per_rank = [rank_samples(cfg, rank) for rank in range(cfg.world_size)]
    mb, step = cfg.micro_batch, 0
    for _ in range(epochs):
        for s in range(cfg.steps):
            for w, (model, optimizer) in enumerate(zip(models, inner)):
                optimizer.zero_grad()
                for a in range(cfg.accumulate):
                    i = s * cfg.accumulate + a
                    ranks = range(w * ranks_per_worker, (w + 1) * ranks_per_worker)
                    rows = [x for k in ranks for x in per_rank[k][i * mb : (i + 1) * mb]]
                    (lm_loss(model, (tokens[rows], targets[rows])) / cfg.accumulate).backward()
                optimizer.step()
            step += 1
            if step % every == 0:
                with torch.no_grad():
                    for g, *replica in zip(trainable(reference), *(trainable(m) for m in models)):
                        g.grad = torch.stack([g - p for p in replica]).mean(0)
                    outer_optimizer.step()
                    outer_optimizer.zero_grad()
                    for model in models:
                        for g, p in zip(trainable(reference), trainable(model)):
                            p.copy_(g)
    named = lambda m: {n: p.detach().clone() for n, p in m.named_parameters()}  # noqa: E731
    return named(reference), [named(m) for m in models]
