"""Train a `litgpt <https://github.com/Lightning-AI/litgpt>`_ ``GPT`` with ``Fabric(strategy="mics")``,
then hand the weights back to a plain, unsharded ``litgpt.GPT``.

    pip install -e ".[litgpt]"
    python examples/litgpt_fabric.py --out runs/litgpt     # 4 CPU ranks as 2 emulated nodes x 2

litgpt is the most used Lightning LLM codebase and is written on Fabric, so this is the loop its
``pretrain.py`` runs, cut down to what MiCS changes: nothing is downloaded (a tiny ``litgpt.Config``
with random weights, trained on the repository's embedded byte-level corpus), and it shows, end to end:

1. the model is created on the meta device (``fabric.init_module(empty_init=True)``) and initialised
   by litgpt's own ``initialize_weights`` -- MiCS calls the ``reset_parameters`` it installs shard by
   shard, so no rank ever holds the whole model;
2. MiCS's default wrapping finds litgpt's transformer blocks by itself (``transformer.h``, an
   ``nn.ModuleList``): the layout line reports one FSDP unit per block plus the root;
3. gradient accumulation with ``fabric.no_backward_sync`` (the cross-replica all-reduce waits for
   the last micro-batch) and ``fabric.clip_gradients``; the loss falls;
4. ``fabric.save`` writes the sharded checkpoint; ``lightning_mics.consolidate`` turns it into a bare
   state dict (Fabric's checkpoint keeps the model's own key names: no ``--strip-prefix`` needed)
   that a fresh ``litgpt.GPT(config)`` loads with ``strict=True`` and that, in one plain process,
   reproduces the sharded model's loss on a fixed held-out batch.
"""

from __future__ import annotations

import argparse
import logging
import sys
import time
import warnings
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Optional

import torch
import torch.nn.functional as F
from lightning.fabric import Fabric
from torch import Tensor, nn
from torch.utils.data import DataLoader

if __package__ in (None, ""):  # run as a script: make `examples` and `lightning_mics` importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from examples.console import configure_console  # noqa: E402
from examples.models.corpus import ByteWindows, encode_bytes, load_pydoc_topics  # noqa: E402
from lightning_mics.consolidate import consolidate  # noqa: E402
from lightning_mics.fabric import MiCSStrategy  # noqa: E402

try:
    from litgpt import GPT, Config
    from litgpt.pretrain import initialize_weights
except ImportError as error:  # an optional extra
    raise SystemExit(f"This example needs litgpt: pip install -e '.[litgpt]' ({error}).") from None

log = logging.getLogger("lightning_mics.examples.litgpt")

#: The model's entry in ``fabric.save``'s state. The key names the entry only: the checkpoint keeps
#: the model's parameters under the bare ``litgpt.GPT``'s own names (``lm_head.weight``,
#: ``transformer.h.0.attn.qkv.weight``, ...), with no prefix, so the consolidated file needs no
#: ``--strip-prefix`` (unlike a Trainer checkpoint, keyed by the LightningModule: ``model.``...).
MODEL_KEY = "model"
#: bytes of the embedded corpus used (quick to tokenise; plenty of windows for a few steps)
CORPUS_BYTES = 200_000
#: the tail of the corpus held out for the fixed evaluation batch
HELD_OUT_BYTES = 4_096


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True, help="run directory (checkpoint, consolidated weights)")
    parser.add_argument("--devices", type=int, default=4, help="CPU ranks (default 4)")
    parser.add_argument("--ranks-per-node", type=int, default=2, help="emulated ranks per node (default 2)")
    parser.add_argument("--partition-size", type=int, default=2, help="ranks sharing one copy of the model (default 2)")
    parser.add_argument("--steps", type=int, default=10, help="optimizer steps (default 10)")
    parser.add_argument("--accumulate", type=int, default=2, help="micro-batches per optimizer step (default 2)")
    parser.add_argument("--micro-batch", type=int, default=8, help="sequences per micro-batch and rank (default 8)")
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--width", type=int, default=64)
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument(
        "--tie-embeddings",
        action="store_true",
        help="share the embedding and output weights, as litgpt's pretrain.py --train.tie_embeddings",
    )
    args = parser.parse_args(argv)
    positive = ("devices", "ranks_per_node", "partition_size", "steps", "accumulate", "micro_batch", "layers", "width")
    if min(getattr(args, name) for name in positive + ("seq_len",)) < 1:
        parser.error(
            "--devices, --ranks-per-node, --partition-size, --steps, --accumulate, --micro-batch, --layers, "
            "--width and --seq-len must be positive."
        )
    if args.width % 4:
        parser.error("--width must be a multiple of the 4 attention heads.")
    return args


def litgpt_config(args: argparse.Namespace) -> Config:
    """A tiny Pythia-style litgpt model over bytes (vocabulary 256, no padding to 512)."""
    return Config(
        name="mics-tiny",
        block_size=args.seq_len,
        vocab_size=256,
        padded_vocab_size=256,
        n_layer=args.layers,
        n_head=4,
        n_embd=args.width,
        rotary_percentage=0.25,
        parallel_residual=True,
        bias=True,
    )


def lm_loss(model: nn.Module, inputs: Tensor, targets: Tensor) -> Tensor:
    """Next-token cross entropy, computed in fp32."""
    logits = model(inputs)
    return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), targets.reshape(-1))


def corpus_split() -> tuple[Tensor, Tensor]:
    """Training bytes and the held-out tail of the embedded corpus (the same on every rank)."""
    tokens = encode_bytes(load_pydoc_topics())[:CORPUS_BYTES]
    return tokens[:-HELD_OUT_BYTES], tokens[-HELD_OUT_BYTES:]


def fixed_batch(held_out: Tensor, seq_len: int, size: int) -> tuple[Tensor, Tensor]:
    """The first ``size`` held-out windows: the batch on which the sharded model and its consolidated
    copy are compared (a function, so a test can rebuild it without running the script)."""
    windows = ByteWindows(held_out, seq_len)
    inputs, targets = zip(*(windows[i] for i in range(size)))
    return torch.stack(inputs), torch.stack(targets)


def batches(loader: Iterable[tuple[Tensor, Tensor]]) -> Iterator[tuple[Tensor, Tensor]]:
    """The loader's batches, epoch after epoch (a few steps may run past one epoch); Fabric's loader
    sets its distributed sampler's epoch on each pass, so every epoch is shuffled anew."""
    while True:
        yield from loader


def main(argv: Optional[list[str]] = None) -> int:
    args = parse_args(argv)
    # torch warns on every rank that DTensor random ops "may not have complete support on cpu device
    # mesh" when litgpt's init draws the shards' values; the replicas of each shard are made equal
    # afterwards (MiCS broadcasts them), so the warning says nothing about this run
    warnings.filterwarnings("ignore", message="DTensor random operators may not have complete support")
    configure_console()  # rank 0 shows the MiCS layout line; other ranks keep warnings and errors
    started = time.perf_counter()
    strategy = MiCSStrategy(partition_size=args.partition_size, ranks_per_node=args.ranks_per_node)
    fabric = Fabric(accelerator="cpu", devices=args.devices, strategy=strategy)
    fabric.launch()
    fabric.seed_everything(0)  # same seed on every rank, as litgpt's pretrain.py does

    config = litgpt_config(args)
    with fabric.init_module(empty_init=True):  # meta device: materialised shard by shard in setup
        model = GPT(config)
    # litgpt's own init: it installs per-module `reset_parameters`, which MiCS calls on the shards
    initialize_weights(fabric, model, n_layer=config.n_layer, n_embd=config.n_embd)
    if args.tie_embeddings:
        model.transformer.wte.weight = model.lm_head.weight
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)
    model, optimizer = fabric.setup(model, optimizer)  # the optimizer now holds the shards

    train_tokens, held_out = corpus_split()
    loader = DataLoader(
        ByteWindows(train_tokens, args.seq_len), batch_size=args.micro_batch, shuffle=True, drop_last=True
    )
    data = batches(fabric.setup_dataloaders(loader))  # a DistributedSampler: each rank its own windows
    fixed_inputs, fixed_targets = fixed_batch(held_out, args.seq_len, args.micro_batch)

    losses: list[float] = []
    for step in range(1, args.steps + 1):
        step_loss = torch.zeros(())
        for micro in range(args.accumulate):
            inputs, targets = next(data)
            boundary = micro == args.accumulate - 1
            # not at the boundary: reduce-scatter inside the partition only; the all-reduce across
            # replicas runs once, in the boundary backward
            with fabric.no_backward_sync(model, enabled=not boundary):
                loss = lm_loss(model, inputs, targets)
                fabric.backward(loss / args.accumulate)
            step_loss += loss.detach() / args.accumulate
        grad_norm = fabric.clip_gradients(model, optimizer, max_norm=1.0)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(float(fabric.all_reduce(step_loss, reduce_op="mean")))
        fabric.print(
            f"step {step}: loss {losses[-1]:.4f} (mean of {fabric.world_size} ranks), grad norm {float(grad_norm):.3f}"
        )

    model.eval()
    with torch.no_grad():  # every rank: the forward gathers the shards collectively
        sharded_loss = float(lm_loss(model, fixed_inputs, fixed_targets))
    checkpoint = args.out / "last.ckpt"
    fabric.save(checkpoint, {MODEL_KEY: model, "optimizer": optimizer, "step": args.steps})
    fabric.barrier()
    elapsed = time.perf_counter() - started
    if fabric.global_rank != 0:
        return 0

    weights = consolidate(checkpoint, args.out / "model.pt")  # = python -m lightning_mics.consolidate DIR FILE
    plain = GPT(config)  # fresh, unsharded, in this one process
    if args.tie_embeddings:
        plain.transformer.wte.weight = plain.lm_head.weight
    plain.load_state_dict(torch.load(weights, weights_only=True), strict=True)
    plain.eval()
    with torch.no_grad():
        plain_loss = float(lm_loss(plain, fixed_inputs, fixed_targets))
    print(
        f"train loss: {losses[0]:.3f} (step 1) -> {losses[-1]:.3f} (step {len(losses)}); "
        f"{args.steps} steps x {args.accumulate} micro-batches on {fabric.world_size} ranks in {elapsed:.1f} s"
    )
    print(f"fixed-batch loss: sharded run {sharded_loss:.6f}, consolidated litgpt.GPT {plain_loss:.6f}")
    if abs(plain_loss - sharded_loss) > 1e-5:
        print("error: the consolidated weights do not reproduce the sharded run", file=sys.stderr)
        return 1
    print(f"consolidated weights: {weights} (load with litgpt.GPT(config).load_state_dict(..., strict=True))")
    return 0


if __name__ == "__main__":
    sys.exit(main())
