"""2-hop, accumulation-aware gradient synchronisation and clipping over sharded gradients.

MiCS splits the data-parallel gradient average into two hops:

1. every micro-step, gradients are **reduce-scattered inside the partition group** (fast, node-local
   links); each rank keeps only its accumulated shard -- full-size gradients never persist;
2. only at the gradient-accumulation boundary are those accumulated shards **all-reduced across the
   replication group** (the slow, inter-node hop), once per optimizer step instead of once per
   micro-step.

The sum is the same as plain data parallel training, so results match single-process training.
FSDP2 implements both hops for a 2-D (replicate, shard) mesh; what it needs from us is to turn the
second hop off on non-boundary micro-steps (``set_requires_all_reduce(False)``), in which case it
keeps the reduce-scattered partial sum internally and adds it in at the boundary.

**Accumulation modes.** The above is ``grad_accumulation="sharded"``, MiCS's default: gradients
are sharded from the first micro-step, the least memory. ``"unsharded"`` trades memory for
communication: non-boundary micro-steps skip *both* hops (``set_requires_gradient_sync(False)``),
every rank accumulates the full, unsharded gradient of each unit, and the boundary backward
reduce-scatters once inside the partition and all-reduces once across replicas -- one
reduce-scatter per optimizer step instead of one per micro-step (what FSDP1 does under
``no_sync()``). Both give the same sum.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any, Optional

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor, Shard

from lightning_mics.accumulation import GradAccumulation, check_grad_accumulation
from lightning_mics.hop2.fsdp import set_cross_replica_sync
from lightning_mics.shards import fsdp_units, local_shard

def set_gradient_sync(units: Sequence[FSDPModule], enabled: bool) -> None:
    """Turn both hops (reduce-scatter and cross-replica all-reduce) on or off for every unit; while
    off, each unit accumulates its full, unsharded gradient (``grad_accumulation="unsharded"``)."""
    for unit in units:
        unit.set_requires_gradient_sync(enabled, recurse=False)


def _as_units(module_or_units: nn.Module | Sequence[FSDPModule]) -> list[FSDPModule]:
    return fsdp_units(module_or_units) if isinstance(module_or_units, nn.Module) else list(module_or_units)


@contextmanager
def defer_gradient_sync(
    module_or_units: nn.Module | Sequence[FSDPModule], grad_accumulation: GradAccumulation = "sharded"
) -> Iterator[None]:
    """Run the backward passes inside this block as non-boundary micro-steps of ``grad_accumulation``
    (module docstring): ``"sharded"`` defers only the cross-replica hop, ``"unsharded"`` both."""
    check_grad_accumulation(grad_accumulation)
    units = _as_units(module_or_units)
    toggle = set_cross_replica_sync if grad_accumulation == "sharded" else set_gradient_sync
    toggle(units, False)
    try:
        yield
    finally:
        toggle(units, True)


def defer_cross_replica_sync(module_or_units: nn.Module | Sequence[FSDPModule]) -> Any:
    """Run the backward passes inside this block with hop 1 only (see module docstring).

    Use it for manual optimization with gradient accumulation::

        for i, micro_batch in enumerate(micro_batches):
            is_last = i == len(micro_batches) - 1
            with nullcontext() if is_last else defer_cross_replica_sync(model):
                loss = model(micro_batch).mean() / len(micro_batches)
                loss.backward()
        optimizer.step()

    The boundary backward (outside the block) adds the accumulated partial sums and all-reduces
    them once across the replication group. ``MiCSStrategy.block_backward_sync()`` -- which Lightning
    enters on non-boundary micro-steps of automatic optimization -- is this same context (or, with
    ``grad_accumulation="unsharded"``, :func:`defer_gradient_sync` in that mode).
    """
    return defer_gradient_sync(module_or_units, "sharded")


def _shard_groups(grad: DTensor) -> list[dist.ProcessGroup]:
    """The process groups over which ``grad``'s local pieces are disjoint (its ``Shard`` mesh dims)."""
    mesh = grad.device_mesh
    return [mesh.get_group(dim) for dim, placement in enumerate(grad.placements) if isinstance(placement, Shard)]


def _partial_norms(
    with_grads: Sequence[Tensor],
    grads: Sequence[Optional[Tensor]],
    norm_type: float,
    disjoint_groups: Mapping[Tensor, Sequence[dist.ProcessGroup]],
    device: torch.device,
) -> dict[tuple[int, ...], tuple[list[dist.ProcessGroup], Tensor]]:
    """This rank's part of the norm: ``sum |g|^p`` over its local shards (``max |g|`` for the inf-norm),
    in fp32, one partial per distinct set of groups across which the shards are disjoint (keyed by
    the groups' ids, in order of first appearance; empty shards still get their partial, so every
    rank reduces over the same groups)."""
    # One partial sum per distinct set of groups (all gradients of one MiCS model share a mesh).
    partial: dict[tuple[int, ...], tuple[list[dist.ProcessGroup], Tensor]] = {}
    for param, grad in zip(with_grads, grads):
        groups = _shard_groups(grad) if isinstance(grad, DTensor) else list(disjoint_groups.get(param, ()))
        local = local_shard(grad)
        key = tuple(id(g) for g in groups)
        if key not in partial:
            partial[key] = (groups, torch.zeros((), dtype=torch.float32, device=device))
        acc = partial[key][1]
        if local.numel() == 0:
            continue
        if math.isinf(norm_type):
            acc.copy_(torch.maximum(acc, local.detach().abs().max().float()))
        else:
            acc.add_(torch.linalg.vector_norm(local.detach().float(), norm_type) ** norm_type)
    return partial


def _global_norm(
    partial: Mapping[tuple[int, ...], tuple[list[dist.ProcessGroup], Tensor]], norm_type: float, device: torch.device
) -> Tensor:
    """The global norm from the partials of :func:`_partial_norms`: each all-reduced (sum, or max for
    the inf-norm) over its groups in turn -- the same collectives in the same order on every rank --
    then combined (and for a finite ``p``, the ``1/p``-th power taken)."""
    total = torch.zeros((), dtype=torch.float32, device=device)
    for groups, acc in partial.values():
        op = dist.ReduceOp.MAX if math.isinf(norm_type) else dist.ReduceOp.SUM
        for group in groups:
            dist.all_reduce(acc, op=op, group=group)
        total = torch.maximum(total, acc) if math.isinf(norm_type) else total + acc
    return total if math.isinf(norm_type) else total ** (1.0 / norm_type)


@torch.no_grad()
def clip_grad_norm_(
    parameters: Iterable[Tensor],
    max_norm: float,
    norm_type: float = 2.0,
    error_if_nonfinite: bool = False,
    disjoint_groups: Optional[Mapping[Tensor, Sequence[dist.ProcessGroup]]] = None,
) -> Tensor:
    """Clip gradients by their *global* norm, computed from the shards each rank holds.

    Each rank sums ``|g|^p`` over its local shard; the sums are all-reduced over the groups across
    which the shards are disjoint (the partition group). Replicas hold identical shards after the
    boundary sync, so reducing over the replication group as well would count them twice. Gradients
    are scaled in place exactly like :func:`torch.nn.utils.clip_grad_norm_` does, and the global
    norm (identical on every rank) is returned. ``error_if_nonfinite``: as in torch, raise instead of
    scaling by a NaN/inf norm -- on every rank alike, since every rank holds the same norm.

    Where a gradient's pieces are disjoint: a DTensor's over its ``Shard`` mesh dims, which it
    carries itself; a plain tensor's over ``disjoint_groups[param]`` -- the slice parameters of
    optimizer-state sharding, whose groups only their owner knows
    (:attr:`~lightning_mics.hop2.optimizer_states.ReplicaShardedOptimizerStates.disjoint_groups`, which the
    strategy passes in through its precision plugin); any other plain tensor is taken as replicated.
    """
    disjoint_groups = disjoint_groups or {}
    with_grads = [p for p in parameters if p.grad is not None]
    grads = [p.grad for p in with_grads]
    norm_type = float(norm_type)
    if not grads:
        return torch.tensor(0.0)
    device = local_shard(grads[0]).device
    partial = _partial_norms(with_grads, grads, norm_type, disjoint_groups, device)
    total_norm = _global_norm(partial, norm_type, device)
    if error_if_nonfinite and not torch.isfinite(total_norm):
        raise RuntimeError(
            f"The total norm of order {norm_type} for gradients from `parameters` is non-finite, so it cannot be "
            "clipped. To disable this error and scale the gradients by the non-finite norm anyway, set "
            "`error_if_nonfinite=False`."
        )
    clip_coef = torch.clamp(max_norm / (total_norm + 1e-6), max=1.0)
    for grad in grads:
        local = local_shard(grad)
        local.mul_(clip_coef.to(local.dtype))
    return total_norm
