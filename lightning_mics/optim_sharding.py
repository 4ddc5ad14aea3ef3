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
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.optim import Optimizer

from lightning_mics.collectives import all_gather_flat, reduce_scatter_flat
from lightning_mics.grad_sync import DISJOINT_GROUPS_ATTR
from lightning_mics.grad_sync import local_shard as _local


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
        disjoint = [partition_group, shard_group]
        for group, group_params in zip(optimizer.param_groups, self.original_params):
            slices = []
            for p in group_params:
                start = offsets[id(p)]
                lo, hi = max(my_lo, start) - start, min(my_hi, start + _local(p).numel()) - start
                if hi <= lo:
                    continue
                slice_param = nn.Parameter(_local(p).detach().reshape(-1)[lo:hi].clone())
                setattr(slice_param, DISJOINT_GROUPS_ATTR, disjoint)
                self.pieces.append(_Piece(p, lo, hi, start, slice_param))
                slices.append(slice_param)
            group["params"] = slices

    @property
    def slice_numel(self) -> int:
        """Elements this rank optimizes (its optimizer states are this size per state tensor)."""
        return sum(piece.hi - piece.lo for piece in self.pieces)

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

    def zero_grad(self) -> None:
        for piece in self.pieces:
            piece.slice_param.grad = None
