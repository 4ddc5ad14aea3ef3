"""Sharded checkpoints with ``torch.distributed.checkpoint`` (DCP).

A checkpoint is a directory: DCP writes the model and optimizer state as DTensor shards (each
shard once -- DCP deduplicates replicas, so a checkpoint is one copy of the states, whatever the
replication degree) and rank 0 writes Lightning's own state (loops, callbacks, schedulers,
precision) next to it. DCP can load the shards onto another mesh, so a checkpoint does not pin the
layout that wrote it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.optim import Optimizer

#: Rank 0's file with everything that is not model or optimizer state.
TRAINER_STATE_FILE = "trainer_state.pt"
#: Keys written next to the trainer state describing the layout that wrote the checkpoint.
LAYOUT_KEY = "mics_layout"


def is_sharded_checkpoint(path: Path) -> bool:
    return path.is_dir() and (path / ".metadata").is_file() and (path / TRAINER_STATE_FILE).is_file()


def model_state_dict(module: nn.Module) -> dict[str, Any]:
    """The module's state as DTensor shards (no gathering)."""
    return get_model_state_dict(module, options=StateDictOptions(full_state_dict=False))


def optimizer_state_dict(module: nn.Module, optimizer: Optimizer) -> dict[str, Any]:
    """The optimizer's state keyed by parameter name, as DTensor shards."""
    return get_optimizer_state_dict(module, optimizer, options=StateDictOptions(full_state_dict=False))


def save_sharded(path: Path, checkpoint: dict[str, Any], layout: dict[str, Any], is_global_zero: bool) -> None:
    """Write ``checkpoint`` (Lightning's dict, with sharded ``state_dict`` / ``optimizer_states``)."""
    path.mkdir(parents=True, exist_ok=True)
    sharded = {
        "model": checkpoint.pop("state_dict"),
        "optimizers": {str(i): state for i, state in enumerate(checkpoint.pop("optimizer_states", []))},
    }
    dcp.save(sharded, checkpoint_id=path)
    if is_global_zero:
        checkpoint[LAYOUT_KEY] = layout
        # Plain containers only, so that loading never needs to unpickle arbitrary classes.
        for key in ("hyper_parameters", "datamodule_hyper_parameters"):
            if key in checkpoint:
                checkpoint[key] = dict(checkpoint[key])
        torch.save(checkpoint, path / TRAINER_STATE_FILE)


def load_sharded(
    path: Path, module: nn.Module, optimizers: list[Optimizer], strict: bool = True
) -> dict[str, Any]:
    """Load model and optimizer shards in place (on whatever mesh they live now); return the rest."""
    if not path.exists():
        raise FileNotFoundError(f"Checkpoint not found: {path}")
    if not is_sharded_checkpoint(path):
        raise ValueError(
            f"{path} is not a MiCS sharded checkpoint (a directory with DCP '.metadata' and '{TRAINER_STATE_FILE}')."
        )
    state: dict[str, Any] = {"model": model_state_dict(module)}
    if optimizers:
        state["optimizers"] = {str(i): optimizer_state_dict(module, opt) for i, opt in enumerate(optimizers)}
    dcp.load(state, checkpoint_id=path)
    set_model_state_dict(module, state["model"], options=StateDictOptions(strict=strict))
    for i, opt in enumerate(optimizers):
        set_optimizer_state_dict(module, opt, state["optimizers"][str(i)])
    return torch.load(path / TRAINER_STATE_FILE, map_location="cpu", weights_only=True)
