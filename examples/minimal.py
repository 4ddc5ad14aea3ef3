"""The smallest complete MiCS run: a model, an optimizer, ``Trainer(strategy="mics")``.

    python examples/minimal.py               # 4 CPU ranks, a few seconds
    python examples/minimal.py mics_auto     # any registered name: mics, mics_auto, mics_zero3, mics_replicate

Rank 0 prints the layout (which ranks shard, which replicate) and, for ``mics_auto``, the planner's choice,
then the loss of the last step. One machine is one node, so ``"mics"`` shards across its 4 ranks here; on a
cluster (``accelerator="gpu"``, ``devices=<GPUs per node>``, ``num_nodes=<nodes>``) each node is a partition
and the nodes replicate it. To see replication on one machine, emulate nodes:
``strategy=MiCSStrategy(ranks_per_node=2)``.
"""

from __future__ import annotations

import sys

import lightning as L
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import lightning_mics  # noqa: F401  (registers strategy="mics" and the other names)


class TinyRegressor(L.LightningModule):
    """Two blocks and a head: enough for MiCS to shard block by block."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(32, 32), nn.GELU()) for _ in range(2))
        self.head = nn.Linear(32, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.head(x)

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = nn.functional.mse_loss(self(x), y)
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-2)

    def train_dataloader(self) -> DataLoader:
        generator = torch.Generator().manual_seed(0)
        x = torch.randn(512, 32, generator=generator)
        return DataLoader(TensorDataset(x, x.sum(dim=1, keepdim=True)), batch_size=16)


def main(name: str = "mics") -> L.Trainer:
    trainer = L.Trainer(
        accelerator="cpu",
        devices=4,
        strategy=name,  # "mics": shard inside each node, replicate across nodes
        max_steps=20,
        accumulate_grad_batches=2,
        logger=False,
        enable_checkpointing=False,
        enable_model_summary=False,
    )
    trainer.fit(TinyRegressor())
    if trainer.is_global_zero:
        print(f"final train_loss: {float(trainer.callback_metrics['train_loss']):.4f}")
    return trainer


if __name__ == "__main__":
    main(*sys.argv[1:2])
