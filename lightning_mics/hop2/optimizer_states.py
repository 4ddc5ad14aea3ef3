"""AMSP: optimizer states sharded beyond the partition, across replicas.

In plain MiCS every replica keeps the optimizer states of its shard: ``R`` copies. AMSP lets the
optimizer states (OS) use a larger sharding degree than parameters and gradients: with
``OS = partition_size * r`` each of ``r`` replicas steps the optimizer on only ``1/r`` of its shard.

At the accumulation boundary, instead of all-reducing the gradient shards across replicas (hop 2
of MiCS), this module

1. reduce-scatters the flattened gradient shards across the *optimizer-shard group* (``r`` ranks):
   each rank receives the summed gradients of its ``1/r`` slice;
2. all-reduces those slices across the *optimizer-replica group* when ``r < R``;
3. lets the user's optimizer step on slice tensors (so its states are ``1/r`` the size);
4. all-gathers the updated slices across the optimizer-shard group into the parameter shards.

Steps 1 + 4 move the same bytes across replicas as the all-reduce they replace (a ring
all-reduce *is* a reduce-scatter followed by an all-gather), and the optimizer memory drops ``r``-fold.
FSDP2 runs on the partition alone (a 1-D mesh) in this mode, so it does no cross-replica traffic itself.

Checkpoints see the optimizer in *partition form* (:meth:`ReplicaShardedOptimizerStates.partition_form`):
its param groups point at the model's sharded parameters again and its states are all-gathered over
the optimizer-shard group into DTensors shaped like those parameters -- exactly what plain MiCS holds.
So a checkpoint saved in this mode is an ordinary MiCS checkpoint: it loads into any layout, with or
without optimizer-state sharding, and consolidates like any other. The price is a transient ``r``-fold
optimizer-state copy while saving or loading (never during training steps).
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Generator, Iterable, Mapping, Sequence
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.optim import Optimizer

from lightning_mics.collectives import all_gather_flat, reduce_scatter_flat
from lightning_mics.shards import laid_out_like
from lightning_mics.shards import local_shard as _local

if TYPE_CHECKING:
    from lightning_mics.layout import MiCSLayout


@dataclass
class _Piece:
    """The part ``[lo, hi)`` of ``param``'s flattened local shard that this rank optimizes."""

    param: nn.Parameter
    lo: int
    hi: int
    flat_offset: int  #: where the param's local shard starts in the flattened buffer
    slice_param: nn.Parameter


class ReplicaShardedOptimizerStates:
    """Runs the user's optimizer on ``1/r`` of each parameter shard (see module docstring).

    The optimizer object is kept (schedulers and Lightning hold references to it); only the
    ``params`` lists of its param groups are swapped for slice tensors.
    """

    def __init__(
        self,
        optimizer: Optimizer,
        shard_group: dist.ProcessGroup,
        replica_group: dist.ProcessGroup | None,
        partition_group: dist.ProcessGroup,
        grad_divisor: float,
    ) -> None:
        if any(optimizer.state.values()):
            raise RuntimeError("optimizer-state sharding must be set up before the optimizer has state")
        self.optimizer = optimizer
        self.shard_group = shard_group
        self.replica_group = replica_group if replica_group is not None and replica_group.size() > 1 else None
        self.grad_divisor = grad_divisor
        self.ways = shard_group.size()
        self.index = dist.get_rank(shard_group)
        self.original_params: list[list[nn.Parameter]] = [list(g["params"]) for g in optimizer.param_groups]
        self.params: list[nn.Parameter] = [p for group in self.original_params for p in group]
        params = self.params
        if len({_local(p).dtype for p in params}) > 1:
            raise TypeError("optimizer-state sharding needs all optimized parameters in one dtype")
        numels = [_local(p).numel() for p in params]
        self.total = sum(numels)
        self.chunk = math.ceil(self.total / self.ways) if self.total else 0
        my_lo, my_hi = self.index * self.chunk, (self.index + 1) * self.chunk
        self.pieces: list[_Piece] = []
        offsets = {}
        offset = 0
        for p, n in zip(params, numels):
            offsets[id(p)] = offset
            offset += n
        disjoint = (partition_group, shard_group)
        #: The process groups over which each slice parameter's elements are disjoint across ranks
        #: (its piece of the partition shard, then its slice of that piece): what
        #: :func:`~lightning_mics.grad_sync.clip_grad_norm_` reduces the norm of its gradient over.
        self.disjoint_groups: dict[Tensor, tuple[dist.ProcessGroup, ...]] = {}
        for group, group_params in zip(optimizer.param_groups, self.original_params):
            slices = []
            for p in group_params:
                start = offsets[id(p)]
                lo, hi = max(my_lo, start) - start, min(my_hi, start + _local(p).numel()) - start
                if hi <= lo:
                    continue
                slice_param = nn.Parameter(_local(p).detach().reshape(-1)[lo:hi].clone())
                self.disjoint_groups[slice_param] = disjoint
                self.pieces.append(_Piece(p, lo, hi, start, slice_param))
                slices.append(slice_param)
            group["params"] = slices

    @torch.no_grad()
    def before_step(self) -> None:
        """Reduce the accumulated gradient shards into this rank's slices; refresh slice values."""
        params = self.params
        device = _local(params[0]).device
        flat = torch.zeros(self.chunk * self.ways, dtype=_local(params[0]).dtype, device=device)
        offset = 0
        for p in params:
            n = _local(p).numel()
            if p.grad is not None:
                flat[offset : offset + n].copy_(_local(p.grad).reshape(-1))
            offset += n
        mine = torch.empty(self.chunk, dtype=flat.dtype, device=device)
        reduce_scatter_flat(mine, flat, dist.ReduceOp.SUM, self.shard_group)
        if self.replica_group is not None:
            dist.all_reduce(mine, group=self.replica_group)
        mine.div_(self.grad_divisor)
        base = self.index * self.chunk
        for piece in self.pieces:
            start = piece.flat_offset + piece.lo - base
            piece.slice_param.grad = mine[start : start + piece.hi - piece.lo].clone()
            piece.slice_param.copy_(_local(piece.param).reshape(-1)[piece.lo : piece.hi])
        for p in params:  # the full-shard gradients are consumed; the optimizer sees only slices
            p.grad = None

    @torch.no_grad()
    def after_step(self) -> None:
        """All-gather the updated slices into every replica's parameter shards."""
        params = self.params
        device = _local(params[0]).device
        mine = torch.zeros(self.chunk, dtype=_local(params[0]).dtype, device=device)
        base = self.index * self.chunk
        for piece in self.pieces:
            start = piece.flat_offset + piece.lo - base
            mine[start : start + piece.hi - piece.lo].copy_(piece.slice_param.reshape(-1))
        flat = torch.empty(self.chunk * self.ways, dtype=mine.dtype, device=device)
        all_gather_flat(flat, mine, self.shard_group)
        offset = 0
        for p in params:
            local = _local(p)
            local.view(-1).copy_(flat[offset : offset + local.numel()])
            offset += local.numel()

    # ------------------------------------------------------------------ checkpoints
    @contextmanager
    def partition_form(self, write_back: bool = False) -> Generator[Optimizer, None, None]:
        """Present the optimizer as plain MiCS holds it, for saving or loading a checkpoint.

        Inside, the param groups hold the model's sharded parameters and each state tensor is a
        DTensor shaped like its parameter (this rank's partition shard, gathered from the slices of
        the optimizer-shard group). ``write_back``: on exit, the states found then (e.g. just loaded)
        are cut back into this rank's slices; otherwise the slice states are restored untouched, so
        saving never changes training (DCP's state-dict helpers may run a zero-lr "init" step).
        A collective over the optimizer-shard group: every rank must enter it together."""
        optimizer = self.optimizer
        slice_params = [list(group["params"]) for group in optimizer.param_groups]
        slice_state = optimizer.state
        optimizer.state = defaultdict(dict, self._gathered_states())
        for group, params in zip(optimizer.param_groups, self.original_params):
            group["params"] = params
        succeeded = False
        try:
            yield optimizer
            succeeded = True
        finally:
            state_found = optimizer.state
            # ``load_state_dict`` replaces the group dicts, so the slices go back in by position
            for group, params in zip(optimizer.param_groups, slice_params):
                group["params"] = params
            optimizer.state = self._sliced_states(state_found) if write_back and succeeded else slice_state

    def _gathered_states(self) -> dict[nn.Parameter, dict[str, Any]]:
        """Every original parameter's optimizer state at the partition degree (see ``partition_form``)."""
        state = self.optimizer.state
        # What each rank knows: per-element state names (with dtypes), and per-parameter values
        # (Adam's ``step``, ...) of the parameters it holds pieces of. Small: no tensors of size.
        elementwise: dict[str, torch.dtype] = {}
        per_param: dict[int, dict[str, Any]] = {}
        index_of = {id(p): i for i, p in enumerate(self.params)}
        for piece in self.pieces:
            for key, value in state.get(piece.slice_param, {}).items():
                if isinstance(value, Tensor) and value.shape == piece.slice_param.shape:
                    elementwise[key] = value.dtype
                else:  # sent as a CPU pickle; remember whether it lived beside the parameter
                    on_device = isinstance(value, Tensor) and value.device == piece.slice_param.device
                    per_param.setdefault(index_of[id(piece.param)], {})[key] = (_to_cpu(value), on_device)
        known: list[Any] = [None] * self.ways
        dist.all_gather_object(known, (elementwise, per_param), group=self.shard_group)
        for other_elementwise, other_per_param in known:
            elementwise.update(other_elementwise)
            for index, values in other_per_param.items():
                per_param.setdefault(index, {}).update(values)

        device = _local(self.params[0]).device
        base = self.index * self.chunk
        gathered: dict[nn.Parameter, dict[str, Any]] = {}
        for key in sorted(elementwise):
            mine = torch.zeros(self.chunk, dtype=elementwise[key], device=device)
            for piece in self.pieces:
                value = state.get(piece.slice_param, {}).get(key)
                if value is not None:
                    start = piece.flat_offset + piece.lo - base
                    mine[start : start + piece.hi - piece.lo].copy_(value.reshape(-1))
            flat = torch.empty(self.chunk * self.ways, dtype=mine.dtype, device=device)
            all_gather_flat(flat, mine, self.shard_group)
            offset = 0
            for p in self.params:
                local = _local(p)
                values = flat[offset : offset + local.numel()].view(local.shape).clone()
                offset += local.numel()
                gathered.setdefault(p, {})[key] = laid_out_like(values, p)
        for index, values in per_param.items():
            p = self.params[index]
            restored = {k: v.to(device) if on_device else v for k, (v, on_device) in values.items()}
            gathered.setdefault(p, {}).update(restored)
        return gathered

    def _sliced_states(self, state: Any) -> defaultdict[nn.Parameter, dict[str, Any]]:
        """The inverse of ``_gathered_states``: this rank's slices of partition-form states."""
        sliced: defaultdict[nn.Parameter, dict[str, Any]] = defaultdict(dict)
        for piece in self.pieces:
            per_param = state.get(piece.param)
            if not per_param:
                continue
            for key, value in per_param.items():
                if isinstance(value, Tensor) and value.dim() > 0 and value.shape == piece.param.shape:
                    value = _local(value).reshape(-1)[piece.lo : piece.hi].clone()
                elif isinstance(value, Tensor):
                    value = value.clone()
                sliced[piece.slice_param][key] = value
        return sliced


def _to_cpu(value: Any) -> Any:
    return value.detach().cpu().clone() if isinstance(value, Tensor) else value


def attach(
    optimizers: Iterable[Optimizer], layout: MiCSLayout, loss_scaling: bool
) -> dict[int, ReplicaShardedOptimizerStates]:
    """AMSP ``optim > grads``: each optimizer steps on this rank's slice of its partition shard;
    returns the hook that brackets its steps, by ``id(optimizer)``. Empty in every other layout."""
    if not layout.settings.shards_optimizer_beyond_partition:
        return {}
    if loss_scaling:
        raise ValueError(
            "Optimizer-state sharding across replicas does not support precision='16-mixed' (loss scaling); "
            "use 'bf16-mixed' or keep the optimizer states at the partition degree."
        )
    assert layout.optim_groups is not None
    shard_pg, replica_pg = layout.optim_groups
    partition_pg = layout.fsdp_mesh.get_group()  # 1-D in this mode: the partition
    return {
        id(optimizer): ReplicaShardedOptimizerStates(
            optimizer, shard_pg, replica_pg, partition_pg, grad_divisor=layout.settings.topology.replication_degree
        )
        for optimizer in optimizers
    }


@contextmanager
def in_partition_form(
    hooks: Mapping[int, object], optimizers: Iterable[Optimizer], write_back: bool
) -> Generator[None, None, None]:
    """With optimizer states sharded across replicas (AMSP ``optim > grads``), checkpoints see them at
    the partition degree, as plain MiCS holds them: one checkpoint format for every layout."""
    with ExitStack() as stack:
        for optimizer in optimizers:
            hook = hooks.get(id(optimizer))
            if isinstance(hook, ReplicaShardedOptimizerStates):
                stack.enter_context(hook.partition_form(write_back=write_back))
        yield


def disjoint_groups(hooks: Iterable[object]) -> dict[Tensor, Sequence[dist.ProcessGroup]]:
    """For clipping: the groups over which the optimizer-state slices' gradients are disjoint, of every
    :class:`ReplicaShardedOptimizerStates` among ``hooks``; empty without them."""
    return {
        param: groups
        for hook in hooks
        if isinstance(hook, ReplicaShardedOptimizerStates)
        for param, groups in hook.disjoint_groups.items()
    }
