"""Model and optimizer state dicts of FSDP2-sharded modules, and the two optimizer-state forms.

DCP stores optimizer state keyed by parameter *name* (the form that reshards); ``torch.optim``
and Lightning's single-file checkpoints key it by integer id. Converting keeps each group's names
as ``param_names`` (which ``torch.optim`` itself understands), so a loader can check that the ids
mean the same parameters.
"""

from __future__ import annotations

from collections.abc import Generator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
)
from torch.optim import Optimizer

from lightning_mics.checkpoint.coordination import rank
from lightning_mics.checkpoint.format import CheckpointError

MAX_LISTED_KEYS = 20


@contextmanager
def outside_inference_mode() -> Generator[None, None, None]:
    """Leave ``torch.inference_mode`` (keeping autograd off) for a checkpoint's save or load.

    Saves and loads run in whatever mode their caller is in: inside a user's
    ``with torch.inference_mode(): trainer.test(model, ckpt_path=...)`` (as Lightning's own FSDP test
    ``_run_multiple_stages`` does), or in a callback of a test/predict loop, which Lightning runs in
    inference mode with NCCL. There ``param.detach()`` of a DTensor parameter, which every state dict
    takes, fails ("Cannot set version_counter for inference tensor": the new DTensor wrapper is an
    inference tensor, the parameter it shares a version counter with is not), and tensors a load
    made would be inference tensors that a later ``fit`` cannot update or save for backward."""
    with torch.inference_mode(False), torch.no_grad():
        yield


def model_state_dict(module: nn.Module, full: bool = False) -> dict[str, Any]:
    """The module's state keyed by its own parameter names (no wrapper prefixes).

    Sharded (default): DTensor shards, no communication. ``full``: gathered, unsharded CPU tensors on
    rank 0 and an empty dict on the other ranks (a collective: call it on every rank)."""
    with outside_inference_mode():
        return get_model_state_dict(module, options=state_dict_options(full))


def optimizer_state_dict(module: nn.Module, optimizer: Optimizer, full: bool = False) -> dict[str, Any]:
    """The optimizer's state keyed by parameter name (sharded), or -- ``full`` -- gathered on rank 0
    in ``torch.optim``'s own format (integer parameter ids), as a plain optimizer would save it."""
    with outside_inference_mode():
        state = get_optimizer_state_dict(module, optimizer, options=state_dict_options(full))
    if not full or rank() != 0:
        return state
    indexed, _ = name_keyed_to_indexed(state)
    return indexed


def state_dict_options(full: bool) -> StateDictOptions:
    return StateDictOptions(full_state_dict=full, cpu_offload=full)


def name_keyed_to_indexed(state: Mapping[str, Any]) -> tuple[dict[str, Any], list[list[str]]]:
    """Name-keyed optimizer state (DCP's form) -> ``torch.optim`` format; also the names per group."""
    index: dict[str, int] = {}
    groups, names = [], []
    for group in state["param_groups"]:
        group_names = list(group["params"])
        for name in group_names:
            index[name] = len(index)
        groups.append({**group, "params": [index[name] for name in group_names], "param_names": group_names})
        names.append(group_names)
    per_param = state.get("state", {})  # optimizers without state (plain SGD) may save none
    return {"state": {index[name]: value for name, value in per_param.items()}, "param_groups": groups}, names


def indexed_to_name_keyed(state: Mapping[str, Any], names: Sequence[Sequence[str]]) -> dict[str, Any]:
    """``torch.optim`` format -> name-keyed, given this optimizer's parameter names per group."""
    saved_groups = state["param_groups"]
    sizes = [len(group["params"]) for group in saved_groups]
    if sizes != [len(group_names) for group_names in names]:
        raise CheckpointError(
            f"The checkpoint's optimizer has parameter groups of sizes {sizes}, this optimizer "
            f"{[len(group_names) for group_names in names]}: it was saved for another model or "
            "`configure_optimizers`; nothing was loaded."
        )
    for saved, group_names in zip(saved_groups, names):
        saved_names = saved.get("param_names")
        if saved_names is not None and list(saved_names) != list(group_names):
            differ = [f"{a} vs {b}" for a, b in zip(saved_names, group_names) if a != b]
            raise CheckpointError(
                "The checkpoint's optimizer state belongs to other parameters (checkpoint vs this optimizer): "
                + ", ".join(differ[:MAX_LISTED_KEYS])
                + "; nothing was loaded."
            )
    name_of: dict[int, str] = {}
    groups = []
    for saved, group_names in zip(saved_groups, names):
        name_of.update(zip((int(i) for i in saved["params"]), group_names))
        group = {key: value for key, value in saved.items() if key != "param_names"}
        groups.append({**group, "params": list(group_names)})
    return {"state": {name_of[int(i)]: value for i, value in state["state"].items()}, "param_groups": groups}
