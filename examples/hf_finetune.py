"""Train a Hugging Face ``transformers`` model with ``Trainer(strategy="mics")``, then hand the
weights back to ``transformers``.

    pip install -e ".[examples,hf]"
    python examples/hf_finetune.py --out runs/hf          # 4 CPU ranks as 2 emulated nodes x 2

What it shows, end to end, on CPU ranks (nothing is downloaded: GPT-2 is built from a small
``GPT2Config`` with random weights, trained on the repository's embedded byte-level corpus):

1. MiCS's default wrapping finds the transformer blocks by itself (GPT-2 keeps them in the
   ``nn.ModuleList`` ``transformer.h``): the layout line reports one FSDP unit per block plus the root;
2. the loss falls;
3. the sharded checkpoint consolidates into a bare state dict (``--strip-prefix model.``), which
   ``GPT2LMHeadModel.from_pretrained`` loads after ``save_pretrained``; that model, in a plain single
   process, reproduces the validation loss of the sharded run.
"""

from __future__ import annotations

import argparse
import logging
import math
import sys
from pathlib import Path
from typing import Any, Optional

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from torch import Tensor
from torch.utils.data import DataLoader, Subset

if __package__ in (None, ""):  # run as a script: make `examples` and `lightning_mics` importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from examples.models import ByteCorpusDataModule  # noqa: E402
from lightning_mics import MiCSStrategy  # noqa: E402
from lightning_mics.consolidate import consolidate  # noqa: E402

try:
    from transformers import GPT2Config, GPT2LMHeadModel
except ImportError as error:  # an optional extra
    raise SystemExit(f"This example needs Hugging Face transformers: pip install -e '.[hf]' ({error}).") from None


VAL_BATCHES_PER_RANK = 4


class CausalLM(pl.LightningModule):
    """A ``transformers`` causal LM (``self.model``) trained on (input ids, next ids) batches."""

    def __init__(self, config: GPT2Config, learning_rate: float = 3e-3) -> None:
        super().__init__()
        self.model = GPT2LMHeadModel(config)
        self.learning_rate = learning_rate
        #: this rank's training loss per step (the ranks see different batches)
        self.train_losses: list[float] = []

    def _loss(self, batch: tuple[Tensor, Tensor]) -> Tensor:
        inputs, targets = batch
        logits = self.model(input_ids=inputs).logits
        return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), targets.reshape(-1))

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        loss = self._loss(batch)
        self.train_losses.append(float(loss.detach()))
        return loss

    def validation_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> None:
        self.log("val/loss", self._loss(batch), sync_dist=True, batch_size=batch[0].shape[0])

    def configure_optimizers(self) -> Any:
        return torch.optim.AdamW(self.parameters(), lr=self.learning_rate)


def plain_validation_loss(model: GPT2LMHeadModel, datamodule: ByteCorpusDataModule, samples: int) -> float:
    """The validation loss of ``model`` in this single process over the first ``samples`` windows --
    exactly the windows the sharded run's ranks validated on (Lightning's distributed sampler deals
    window ``i`` to rank ``i % world``; ``limit_val_batches`` keeps each rank's first batches) -- as
    the mean of equal-sized batch means, which is what the synced ``val/loss`` is."""
    model.eval()
    losses = []
    windows = Subset(datamodule.val_dataset(), range(samples))
    with torch.no_grad():
        for inputs, targets in DataLoader(windows, batch_size=datamodule.batch_size):
            logits = model(input_ids=inputs).logits
            losses.append(F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), targets.reshape(-1)))
    return float(torch.stack(losses).mean())


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True, help="run directory (checkpoint, consolidated weights)")
    parser.add_argument("--devices", type=int, default=4, help="CPU ranks (default 4)")
    parser.add_argument("--ranks-per-node", type=int, default=2, help="emulated ranks per node (default 2)")
    parser.add_argument("--steps", type=int, default=40, help="optimizer steps (default 40)")
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--width", type=int, default=64)
    parser.add_argument("--seq-len", type=int, default=32)
    args = parser.parse_args(argv)
    if min(args.devices, args.ranks_per_node, args.steps, args.layers, args.width, args.seq_len) < 1:
        parser.error("--devices, --ranks-per-node, --steps, --layers, --width and --seq-len must be positive.")
    return args


def main(argv: Optional[list[str]] = None) -> int:
    args = parse_args(argv)
    logging.getLogger("lightning_mics").setLevel(logging.INFO)
    logging.basicConfig(format="%(message)s")
    pl.seed_everything(0, verbose=False)
    config = GPT2Config(
        vocab_size=256, n_positions=args.seq_len, n_embd=args.width, n_layer=args.layers, n_head=4,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
    )
    data = ByteCorpusDataModule(seq_len=args.seq_len, batch_size=8, max_bytes=200_000)
    module = CausalLM(config)
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=args.devices,
        strategy=MiCSStrategy(ranks_per_node=args.ranks_per_node),
        max_steps=args.steps,
        limit_val_batches=VAL_BATCHES_PER_RANK,
        val_check_interval=args.steps,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(module, datamodule=data)
    sharded_val = float(trainer.validate(module, datamodule=data, verbose=False)[0]["val/loss"])
    checkpoint = args.out / "last.ckpt"
    trainer.save_checkpoint(checkpoint)
    if not trainer.is_global_zero:
        return 0

    weights = consolidate(checkpoint, args.out / "model.pt", strip_prefix="model.")
    plain = GPT2LMHeadModel(config)
    plain.load_state_dict(torch.load(weights, weights_only=True))
    plain.save_pretrained(args.out / "hf")  # the format transformers users exchange
    reloaded = GPT2LMHeadModel.from_pretrained(args.out / "hf")
    plain_val = plain_validation_loss(reloaded, data, VAL_BATCHES_PER_RANK * data.batch_size * trainer.world_size)
    first, last = module.train_losses[0], module.train_losses[-1]
    print(f"train loss (rank 0): {first:.3f} (step 1) -> {last:.3f} (step {len(module.train_losses)})")
    print(f"val loss: sharded run {sharded_val:.4f}, reloaded with from_pretrained {plain_val:.4f}")
    if not math.isclose(plain_val, sharded_val, rel_tol=1e-4):
        print("error: the consolidated weights do not reproduce the sharded run", file=sys.stderr)
        return 1
    print(f"consolidated weights: {weights}; transformers model: {args.out / 'hf'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
