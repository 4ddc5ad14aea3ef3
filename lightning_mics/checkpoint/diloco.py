"""DiLoCo's state in a sharded checkpoint (``cross_replica_sync="diloco"``): written beside the shards, read back after
the model and the optimizers are loaded.

Why it needs entries of its own: between two synchronisations the replicas differ -- their parameters and their
inner optimizer states -- so a checkpoint's usual entries, which DCP writes once per shard from whichever replica it
picks, would mix them. The model entry holds the last-synchronised parameters (the global model: what evaluation,
export and any other layout load; :meth:`~lightning_mics.hop2.diloco.SemiSync.global_model_state`), the optimizer
entries the inner states averaged over the replicas (:meth:`~lightning_mics.hop2.diloco.SemiSync.replica_averaged`),
and the sharded extras (under :data:`~lightning_mics.checkpoint.format.SHARDED_EXTRAS_KEY`, :data:`EXTRAS_ENTRY`)
the outer optimizer's state, the inner-step count and each replica group's own parameters and inner optimizer
states under its index. Resuming with the same layout restores all of it, so the run goes on exactly as if
uninterrupted; another layout resumes from the global model with averaged inner states.

The schedule (:mod:`lightning_mics.hop2.diloco`) holds the state; this module reads and writes it through the
checkpoint package's own functions (:func:`~lightning_mics.checkpoint.loading.open_checkpoint`,
:func:`~lightning_mics.checkpoint.loading.saved_shapes`, :func:`~lightning_mics.checkpoint.loading.read_dcp`).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor
from torch.distributed.checkpoint.state_dict import set_optimizer_state_dict

from lightning_mics.checkpoint.format import METADATA_FILE, SHARDED_EXTRAS_KEY
from lightning_mics.checkpoint.loading import fresh_like, open_checkpoint, read_dcp, saved_shapes
from lightning_mics.checkpoint.safe_load import SafeLoadPlanner, read_metadata
from lightning_mics.checkpoint.state_dicts import optimizer_state_dict
from lightning_mics.shards import local_shard

if TYPE_CHECKING:
    from lightning_mics.hop2.diloco import OuterSync, SemiSync

log = logging.getLogger("lightning_mics")

#: The extras' entry DiLoCo's state is kept under (inside ``SHARDED_EXTRAS_KEY``).
EXTRAS_ENTRY = "diloco"


def checkpoint_entries(run: SemiSync) -> dict[str, Any]:
    """What a sharded checkpoint keeps beside the global model (the module docstring)."""

    assert run.module is not None
    own: dict[str, Any] = {
        "params": {name: p.detach() for sync in run.syncs for name, p in zip(sync.names, sync.params)},
        "optimizers": {
            str(i): optimizer_state_dict(run.module, optimizer) for i, optimizer in enumerate(run.optimizers)
        },
    }
    pending = {name: piece for sync in run.syncs for name, piece in sync.pending_pieces().items()}
    if pending:  # streaming: a fragment's average in flight, as this replica sent it
        own["pending"] = pending
    return {EXTRAS_ENTRY: {
        "layout": torch.tensor(list(run.layout_key)),  # partition groups, their size, partition groups per worker
        "inner_steps": torch.tensor([sync.inner_steps for sync in run.syncs]),
        "outer_steps": torch.tensor([sync.outer_steps for sync in run.syncs]),
        "outer": {str(i): sync.outer_state() for i, sync in enumerate(run.syncs)},
        "replica": {str(run.replica): own},
    }}


@torch.no_grad()
def after_load(run: SemiSync, path: str) -> None:
    """After the checkpoint's model (the global one) and averaged inner states were loaded: those parameters are
    the last-synchronised copy; then the outer state and step count, and -- same layout -- this replica group's
    own parameters and inner optimizer states (the module docstring). A collective."""

    for sync in run.syncs:
        sync.restart_from_parameters()
    info, _ = open_checkpoint(Path(path))
    if info.kind != "sharded" or info.data_dir is None:
        return  # a full file: a new round from its parameters
    saved = saved_shapes(read_metadata(info.data_dir / METADATA_FILE))
    root = (SHARDED_EXTRAS_KEY, EXTRAS_ENTRY)
    if (*root, "inner_steps") not in saved:
        return  # a synchronous run's checkpoint: a new round from its parameters
    template: dict[str, Any] = {
        # (partition groups, partition size[, groups per DiLoCo worker]): checkpoints before two-level DiLoCo hold two
        "layout": torch.zeros(saved.get((*root, "layout")) or (3,), dtype=torch.int64),
        "inner_steps": torch.zeros(len(run.syncs), dtype=torch.int64),
    }
    if saved[(*root, "inner_steps")] != (len(run.syncs),):
        raise ValueError(
            f"{path} holds DiLoCo state for {saved[(*root, 'inner_steps')]} optimizer(s), this run has "
            f"{len(run.syncs)}: it was saved with another `configure_optimizers`."
        )
    template["outer"] = {str(i): _outer_template(i, sync, saved, root) for i, sync in enumerate(run.syncs)}
    if (*root, "outer_steps") in saved:  # which fragment is next (streaming); older checkpoints: the first
        template["outer_steps"] = torch.zeros(len(run.syncs), dtype=torch.int64)
    read_dcp(info.data_dir, {SHARDED_EXTRAS_KEY: {EXTRAS_ENTRY: template}}, SafeLoadPlanner())
    outer_steps = template.get("outer_steps", torch.zeros(len(run.syncs), dtype=torch.int64)).tolist()
    for sync, steps, done in zip(run.syncs, template["inner_steps"].tolist(), outer_steps):
        sync.inner_steps, sync.outer_steps = int(steps), int(done)
    for sync, outer in zip(run.syncs, template["outer"].values()):
        anchor_of = dict(zip(sync.names, sync.anchors))
        for name, state in outer.items():
            sync.outer.state[anchor_of[name]] = state
    saved_layout = (*template["layout"].tolist(), 1)[:3]
    if saved_layout != run.layout_key:
        log.warning(
            "DiLoCo: %s was saved by %s replica(s) of partition %s in workers of %s, this run has %s of %s in workers "
            "of %s: every worker resumes from the last-synchronised model and the replica-averaged inner optimizer "
            "states (not from its own)%s",
            path, *saved_layout, *run.layout_key,
            "; the fragment average in flight starts again from them" if any(
                sync.pending_after_load() is not None for sync in run.syncs) else "",
        )
        for sync in run.syncs:
            fragment = sync.pending_after_load()
            if fragment is not None:
                sync.start_fragment(fragment)
        return
    _load_own_replica(run, info.data_dir, root)


def _outer_template(
    index: int, sync: OuterSync, saved: Mapping[tuple[str, ...], Any], root: tuple[str, ...]
) -> dict[str, dict[str, Tensor]]:
    """Tensors to read the saved outer state into: placed like the anchors where the saved entry has the
    parameter's shape, plain otherwise (a step count). Built from the checkpoint's metadata, since an outer
    optimizer that has not stepped yet has no state to copy the layout from."""
    prefix = (*root, "outer", str(index))
    anchor_of = dict(zip(sync.names, sync.anchors))
    template: dict[str, dict[str, Tensor]] = {}
    for key, shape in saved.items():
        if key[: len(prefix)] != prefix or len(key) != len(prefix) + 2 or shape is None:
            continue
        name, slot = key[len(prefix)], key[len(prefix) + 1]
        anchor = anchor_of.get(name)
        if anchor is None:
            raise ValueError(
                f"The checkpoint's outer optimizer state names {name!r}, which this model does not train."
            )
        if shape == tuple(anchor.shape):
            value = torch.empty_like(anchor)
        else:
            value = torch.zeros(shape, device=local_shard(anchor).device if shape else "cpu")
        template.setdefault(name, {})[slot] = value
    return template


def _load_own_replica(run: SemiSync, data_dir: Path, root: tuple[str, ...]) -> None:
    """This replica group's own parameters and inner optimizer states (saved under its index)."""

    assert run.module is not None
    params = {name: p for sync in run.syncs for name, p in zip(sync.names, sync.params)}
    own: dict[str, Any] = {
        "params": {name: torch.empty_like(p.detach()) for name, p in params.items()},
        "optimizers": {
            str(i): fresh_like(optimizer_state_dict(run.module, optimizer))
            for i, optimizer in enumerate(run.optimizers)
        },
    }
    in_flight = [sync for sync in run.syncs if sync.pending_after_load() is not None]
    if in_flight:  # streaming: the fragment average the checkpoint had in flight, as this replica sent it
        own["pending"] = {
            sync.names[i]: torch.empty_like(sync.params[i].detach())
            for sync in in_flight
            for i in sync.members(sync.pending_after_load())
        }
    template = {SHARDED_EXTRAS_KEY: {EXTRAS_ENTRY: {"replica": {str(run.replica): own}}}}
    read_dcp(data_dir, template, SafeLoadPlanner())
    for name, value in own["params"].items():
        local_shard(params[name]).copy_(local_shard(value))
    for sync in in_flight:
        sync.resume_pending(own["pending"])
    for i, optimizer in enumerate(run.optimizers):
        set_optimizer_state_dict(run.module, optimizer, own["optimizers"][str(i)])
