"""The entries of ``fabric.save(path, state)`` beside the model and optimizers, in the Trainer's format.

A Fabric save is the Trainer's checkpoint with the user's other entries added, so that
``Trainer(strategy="mics").fit(ckpt_path=...)`` resumes from it and the Trainer's checkpoint loads back
into Fabric: Lightning's version (its checkpoint migration needs one), the schedulers' states where the
Trainer restores them, and which of the user's keys held the model, the optimizers and the other entries.
"""

from __future__ import annotations

from collections.abc import Callable, Container, Sequence
from typing import Any

import lightning
from torch import nn
from torch.optim import Optimizer
from torch.optim.lr_scheduler import LRScheduler

from lightning_mics import _compat as compat

VERSION_KEY = "pytorch-lightning_version"
SCHEDULERS_KEY = "lr_schedulers"
FABRIC_KEY = "mics_fabric"
RESERVED_KEYS = ("state_dict", "optimizer_states", VERSION_KEY, SCHEDULERS_KEY, FABRIC_KEY)


def entries_to_save(model_key: str, optimizer_keys: Sequence[str], others: dict[str, Any]) -> dict[str, Any]:
    """The checkpoint's entries besides ``state_dict`` / ``optimizer_states``: stateful objects (schedulers,
    metrics, ...) as their ``state_dict()``, plain values as they are, and the keys the Trainer reads."""
    clashing = [name for name in others if name in RESERVED_KEYS]
    if clashing:
        raise ValueError(
            f"The state keys {clashing} are reserved in a MiCS checkpoint (they hold Lightning's model, optimizer "
            f"and scheduler states); rename these entries of fabric.save(path, state)."
        )
    entries: dict[str, Any] = {}
    schedulers: list[dict[str, Any]] = []
    for name, value in others.items():
        if isinstance(value, compat.Stateful):  # schedulers, metrics, ...: their state, not the object
            entries[name] = value.state_dict()
            if isinstance(value, LRScheduler):  # also where Trainer.fit(ckpt_path=...) restores them from
                schedulers.append(entries[name])
        else:
            entries[name] = value
    entries[VERSION_KEY] = lightning.__version__
    entries[SCHEDULERS_KEY] = schedulers
    entries[FABRIC_KEY] = {"model": model_key, "optimizers": list(optimizer_keys), "entries": list(others)}
    return entries


def check_requested(saved: Any, requested: Sequence[str], strict: bool, path: str) -> None:
    """Before anything is loaded: with ``strict``, every requested entry must be in the checkpoint."""
    missing = [name for name in requested if name not in saved]
    if strict and missing:
        raise KeyError(
            f"The requested state contains a key {missing[0]!r} that does not exist in the checkpoint {path} "
            "(nothing was loaded). To load without it, set `strict=False`."
        )


def restore_entries(saved: dict[str, Any], others: dict[str, Any], state: dict[str, Any]) -> dict[str, Any]:
    """Load the requested entries ``others`` (stateful objects in place, plain values into ``state``) from
    a loaded checkpoint's remainder ``saved``; return what nobody asked for."""
    remainder = dict(saved)
    if remainder.pop(FABRIC_KEY, None) is not None:  # saved by Fabric: drop what it added for the Trainer
        remainder.pop(VERSION_KEY, None)
        remainder.pop(SCHEDULERS_KEY, None)
    for name, obj in others.items():
        if name not in remainder:
            continue
        value = remainder.pop(name)
        if isinstance(obj, compat.Stateful):
            obj.load_state_dict(value)
        else:
            state[name] = value
    return remainder


def split_state(
    state: dict[str, Any],
    verb: str,
    check_set_up: Callable[[nn.Module, str], None],
    set_up_optimizers: Container[Optimizer],
) -> tuple[str, nn.Module, dict[str, Optimizer], dict[str, Any]]:
    """``fabric.save/load``'s ``state``: its one model (checked with ``check_set_up``), its optimizers (in
    order; each must be one the strategy set up) and everything else."""
    modules = {name: value for name, value in state.items() if isinstance(value, nn.Module)}
    if len(modules) != 1:
        raise ValueError(
            f"fabric.{verb}(path, state) needs exactly one model in `state`, e.g. {{'model': model, 'optimizer': "
            f"optimizer}}; found {len(modules)}{' (' + ', '.join(modules) + ')' if modules else ''}. A MiCS "
            "checkpoint holds one model: save several models to separate paths."
        )
    key, module = next(iter(modules.items()))
    check_set_up(module, f"state[{key!r}]")
    optimizers = {name: value for name, value in state.items() if isinstance(value, Optimizer)}
    foreign = [name for name, optimizer in optimizers.items() if optimizer not in set_up_optimizers]
    if foreign:
        raise ValueError(
            f"The optimizers {foreign} in fabric.{verb}(path, state) were not set up by MiCSStrategy: pass them to "
            "fabric.setup(model, optimizer) first (their states are keyed by the sharded model's parameters)."
        )
    others = {name: value for name, value in state.items() if name not in modules and name not in optimizers}
    return key, module, optimizers, others
