"""What a joining group takes from a live one -- this rank's shards of the model and optimizer states, the
schedulers, the step count -- and how it loads them in place."""

from __future__ import annotations

import copy
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch import Tensor, nn
from torch.distributed.tensor import DTensor
from torch.optim import Optimizer

from lightning_mics import _compat as compat


def local_state(tree: Any) -> Any:
    """``tree`` with every DTensor replaced by this rank's shard (detached copies): what a peer's rank of
    the same index needs, in a form torchft's transport can carry."""
    if isinstance(tree, DTensor):
        return tree.to_local().detach().clone()
    if isinstance(tree, Tensor):
        return tree.detach().clone()
    if isinstance(tree, dict):
        return {key: local_state(value) for key, value in tree.items()}
    if isinstance(tree, (list, tuple)):
        return type(tree)(local_state(value) for value in tree)
    return tree


@torch.no_grad()
def copy_local_state_(live: Any, received: Any) -> None:
    """Copy ``received`` (from :func:`local_state` on a peer) into the live tensors of ``live`` in place."""
    if isinstance(live, DTensor):
        live.to_local().copy_(received)
    elif isinstance(live, Tensor):
        live.copy_(received)
    elif isinstance(live, dict):
        for key, value in live.items():
            copy_local_state_(value, received[key])
    elif isinstance(live, (list, tuple)):
        for value, other in zip(live, received):
            copy_local_state_(value, other)


def hyper_parameters(optimizer: Optimizer) -> list[dict[str, Any]]:
    """Each parameter group's hyper-parameters -- everything but its parameters -- copied, so that the schedule
    moving them later does not change what was taken."""
    return [copy.deepcopy({key: value for key, value in group.items() if key != "params"})
            for group in optimizer.param_groups]


def set_hyper_parameters(optimizer: Optimizer, groups: Sequence[Mapping[str, Any]]) -> None:
    """Each parameter group's hyper-parameters from ``groups`` (from :func:`hyper_parameters`, or a state dict's
    ``param_groups``, whose ``params`` are left out)."""
    for group, values in zip(optimizer.param_groups, groups):
        group.update({key: value for key, value in values.items() if key != "params"})


def optimizer_local_state(optimizer: Optimizer) -> dict[str, Any]:
    """The optimizer's per-parameter states and hyper-parameters, this rank's shards."""
    state = optimizer.state_dict()
    return {"state": local_state(state["state"]), "param_groups": state["param_groups"]}


def load_optimizer_local_state(optimizer: Optimizer, received: dict[str, Any]) -> None:
    """Give ``optimizer`` a peer's states: created first if it never stepped, then copied into in place, so
    that they stay DTensors on this group's mesh; hyper-parameters (learning rate) too. Either part may be
    missing (a catching-up heal loads the hyper-parameters first and the states later)."""
    if "state" in received:
        if received["state"] and not optimizer.state:
            compat.init_optimizer_state(optimizer)
        own = optimizer.state_dict()
        copy_local_state_(own["state"], received["state"])
    set_hyper_parameters(optimizer, received.get("param_groups", ()))


#: Bytes :func:`snapshot_bytes_bound` allows per tensor beyond its data: torch.save's record of it (its zip entry,
#: the 64-byte alignment, the pickled rebuild call) takes about 280.
SNAPSHOT_BYTES_PER_TENSOR = 512
#: Bytes it allows per other entry (a dictionary key, a number), beyond the length of the entry's text.
SNAPSHOT_BYTES_PER_ENTRY = 64
#: Bytes it allows once per snapshot (the archive's own records, the pickle's frame: about 1.3 KB).
SNAPSHOT_BYTES_FIXED = 1 << 16


def snapshot_bytes_bound(shards: Any) -> int:
    """The most bytes ``torch.save`` takes for ``shards`` (:func:`split_shards`' second part, or the live trees it is
    copied from: DTensors count their local shard), from their sizes alone -- no data is read or copied, so the
    quorum can announce it before the snapshot is taken. A catching-up joiner refuses a larger body: whatever
    answers at the snapshot's address cannot make it buffer more than about its shards' size."""
    total = SNAPSHOT_BYTES_FIXED
    stack = [shards]
    while stack:
        tree = stack.pop()
        if isinstance(tree, DTensor):
            tree = compat.local_tensor(tree)
        if isinstance(tree, Tensor):
            total += tree.numel() * tree.element_size() + SNAPSHOT_BYTES_PER_TENSOR
        elif isinstance(tree, dict):
            total += sum(len(str(key)) + SNAPSHOT_BYTES_PER_ENTRY for key in tree)
            stack.extend(tree.values())
        elif isinstance(tree, (list, tuple)):
            total += SNAPSHOT_BYTES_PER_ENTRY
            stack.extend(tree)
        else:
            total += len(repr(tree)) + SNAPSHOT_BYTES_PER_ENTRY
    return total


def training_state(
    model_state: dict[str, Any],
    optimizers: Sequence[Optimizer],
    schedulers: Sequence[Any],
    global_step: int,
    shards: bool = True,
) -> dict[str, Any]:
    """What a joining group takes from this one (this rank's shards): the model, the optimizers' and
    schedulers' states and the step count. Runs in torchft's quorum thread at the start of a step; reads
    ``model_state``, the sharded state dict taken when the group joined (whose DTensors are the sharded
    parameters and buffers themselves), not the module, whose state-dict hooks must not run in another
    thread while its forward is being entered. Copies, so the snapshot is the step's start.
    ``shards=False``: the small rest only, as :func:`split_shards` makes it, without copying the shards (a
    catching-up heal's quorum), with the bound the shards' snapshot will keep to (:func:`snapshot_bytes_bound`)."""
    if shards:
        return {
            "model": local_state(model_state),
            "optimizers": [optimizer_local_state(optimizer) for optimizer in optimizers],
            "schedulers": [scheduler.state_dict() for scheduler in schedulers],
            "global_step": global_step,
        }
    states = [optimizer.state_dict() for optimizer in optimizers]
    return {
        "optimizers": [{"param_groups": state["param_groups"]} for state in states],
        "schedulers": [scheduler.state_dict() for scheduler in schedulers],
        "global_step": global_step,
        "snapshot_bytes_bound": snapshot_bytes_bound(
            {"model": model_state, "optimizers": [{"state": state["state"]} for state in states]}
        ),
    }


def load_training_state(
    state: dict[str, Any],
    model_state: dict[str, Any],
    optimizers: Sequence[Optimizer],
    schedulers: Sequence[Any],
    set_global_step: Callable[[int], None],
) -> None:
    """Heal from a peer's :func:`training_state`, in place (every rank of the group loads its own shards), or
    from either part of it that :func:`split_shards` made: what is missing is left as it is."""
    if "model" in state:
        copy_local_state_(model_state, state["model"])
    for optimizer, received in zip(optimizers, state.get("optimizers", ())):
        load_optimizer_local_state(optimizer, received)
    for scheduler, received in zip(schedulers, state.get("schedulers", ())):
        scheduler.load_state_dict(received)
    if "global_step" in state:
        set_global_step(state["global_step"])


def split_shards(state: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """A :func:`training_state` as (everything but the shards, the shards): the model's and the optimizers'
    per-parameter states are what grows with the model; the rest (hyper-parameters, schedulers, step count,
    a semi-synchronous round's state, the shards' :func:`snapshot_bytes_bound`) is small and is what a
    catching-up heal moves at the quorum."""
    optimizers = state.get("optimizers", ())
    small = {key: value for key, value in state.items() if key != "model"}
    small["optimizers"] = [{"param_groups": optimizer["param_groups"]} for optimizer in optimizers]
    shards = {"model": state.get("model", {}), "optimizers": [{"state": o["state"]} for o in optimizers]}
    small["snapshot_bytes_bound"] = snapshot_bytes_bound(shards)
    return small, shards


def state_hooks(
    module: nn.Module,
    optimizers: Sequence[Optimizer],
    schedulers: Sequence[Any] = (),
    global_step: Callable[[], int] = lambda: 0,
    set_global_step: Callable[[int], None] = lambda step: None,
) -> tuple[Callable[..., dict[str, Any]], Callable[[dict[str, Any]], None]]:
    """What this group serves to a joining one (``state_fn(shards=True)``, :func:`training_state`) and how it
    heals: the model, the optimizers (states and hyper-parameters), the schedulers and the step count -- a
    Fabric loop has neither of the last two (its counters follow torchft's committed step)."""
    model_state = module.state_dict()  # sharded now
    return (
        lambda shards=True: training_state(model_state, optimizers, schedulers, global_step(), shards),
        lambda state: load_training_state(state, model_state, optimizers, schedulers, set_global_step),
    )
