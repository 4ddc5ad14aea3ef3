"""Consolidate a sharded MiCS checkpoint into one ``torch.save`` file, in one process.

    python -m lightning_mics.consolidate CHECKPOINT_DIR OUT.pt [--with-optimizer] [--strip-prefix PREFIX]

Without options ``OUT.pt`` is a plain state dict keyed like the LightningModule's own parameters, so
``module.load_state_dict(torch.load("OUT.pt", weights_only=True))`` works on an unsharded model.
``--with-optimizer`` writes Lightning's full checkpoint format instead (``state_dict``,
``optimizer_states`` in ``torch.optim`` format, loops, schedulers, ...): a single-file checkpoint
that Lightning -- with MiCSStrategy or any other strategy -- can resume from.
``--strip-prefix model.`` keeps only the keys under ``model.`` and drops the prefix, to load the
weights into the inner ``nn.Module`` instead of the LightningModule.

It reads shards written by any layout and needs no ``torch.distributed``; it needs memory for one
full copy of the states it writes.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any, Optional

import torch

from lightning_mics import checkpoint as ckpt
from lightning_mics.checkpoint.atomic import write_durably


def consolidate(
    checkpoint_dir: ckpt.PathLike,
    out: ckpt.PathLike,
    with_optimizer: bool = False,
    strip_prefix: Optional[str] = None,
    verify: ckpt.VerifyMode = "checksum",
) -> Path:
    """Write the single-file form of ``checkpoint_dir`` to ``out`` (atomically and durably); return
    ``out``. ``verify``: how the checkpoint's files are checked first (see :func:`ckpt.load`)."""
    model_state, optimizer_states, trainer_state = ckpt.read_full_state(checkpoint_dir, verify=verify)
    if strip_prefix:
        model_state = {k[len(strip_prefix) :]: v for k, v in model_state.items() if k.startswith(strip_prefix)}
        if not model_state:
            raise ckpt.CheckpointError(f"No key of {checkpoint_dir} starts with {strip_prefix!r}; nothing written.")
    payload: Any = model_state
    if with_optimizer:
        payload = {**trainer_state, "state_dict": model_state, "optimizer_states": optimizer_states}
    out = Path(out)
    write_durably(out, lambda handle: torch.save(payload, handle))  # a reader never sees a half-written OUT
    return out


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m lightning_mics.consolidate",
        description="Consolidate a sharded MiCS checkpoint directory into one torch.save file.",
    )
    parser.add_argument("checkpoint_dir", help="sharded checkpoint directory (e.g. checkpoints/last.ckpt)")
    parser.add_argument("out", help="file to write, e.g. model.pt")
    parser.add_argument(
        "--with-optimizer",
        action="store_true",
        help="write Lightning's full checkpoint (state_dict, optimizer_states, loops, ...) instead of bare weights",
    )
    parser.add_argument(
        "--strip-prefix", default=None, help="keep only keys with this prefix and drop it, e.g. 'model.'"
    )
    parser.add_argument(
        "--verify",
        choices=ckpt.VERIFY_MODES,
        default="checksum",
        help="check the checkpoint's files against its integrity record first: sizes and checksums (default), "
        "sizes only (faster for very large checkpoints), or not at all",
    )
    args = parser.parse_args(argv)
    if args.with_optimizer and args.strip_prefix:
        parser.error("--strip-prefix applies to bare weights only; it cannot be combined with --with-optimizer")
    try:
        out = consolidate(args.checkpoint_dir, args.out, args.with_optimizer, args.strip_prefix, args.verify)
    except (FileNotFoundError, ckpt.CheckpointError) as err:
        parser.exit(2, f"error: {err}\n")
    print(f"wrote {out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
