"""Making every rank's buffers equal, so that a checkpoint -- and the validation logged beside it -- is one model.

``fully_shard`` shards parameters but leaves buffers (BatchNorm's ``running_mean``/``running_var``/
``num_batches_tracked``, ...) as plain tensors replicated on every rank. Each rank updates its copy
from its own data, so the copies drift apart; and DCP deduplicates replicated items by choosing one
writer *per item*, so a sharded checkpoint would take ``bn1.running_mean`` from one rank and
``bn1.running_var`` from another -- a model that never existed anywhere. Syncing the buffers right
before a state dict is taken (and before each evaluation) makes the saved model the one every rank
evaluates.

Only *persistent* buffers are synced: they are what a checkpoint holds. Non-persistent buffers
(rotary tables, causal masks) are recomputed from constants, never saved, and may be large, so they
are left alone.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.tensor import DTensor

from lightning_mics import _compat as compat
from lightning_mics.options import BufferSync, check_buffer_sync

def persistent_buffers(module: nn.Module) -> list[Tensor]:
    """The buffers ``module.state_dict()`` holds, each once, in module order (the same on every rank).

    Meta tensors (no values yet) and DTensors (sharded: each rank holds only its part) are skipped."""
    seen: set[int] = set()
    buffers: list[Tensor] = []
    for submodule in module.modules():
        non_persistent = compat.non_persistent_buffer_names(submodule)
        for name, buffer in compat.module_buffers(submodule).items():
            if buffer is None or name in non_persistent or id(buffer) in seen:
                continue
            seen.add(id(buffer))
            if buffer.is_meta or isinstance(buffer, DTensor):
                continue
            buffers.append(buffer)
    return buffers


@torch.no_grad()
def sync_buffers(
    module: nn.Module,
    mode: BufferSync,
    device: Optional[torch.device] = None,
    src: int = 0,
) -> int:
    """Make ``module``'s persistent buffers equal on every rank, in place; return how many were synced.

    ``"broadcast"``: every buffer becomes global rank ``src``'s -- exact for any dtype, and a no-op on
    buffers that are already equal. ``"average"``: floating-point buffers become the mean over all
    ranks (reduced in at least fp32), others (``num_batches_tracked``) rank ``src``'s. ``"none"``:
    nothing. A collective over the default group (every rank holds every buffer): call it on every
    rank, with the same module. Buffers are flattened per dtype so that a ResNet's hundred
    BatchNorm buffers cost a few collectives, not a hundred. ``device``: where the collective needs
    the data (the GPU for NCCL); default: where the buffers are."""
    check_buffer_sync(mode)
    if mode == "none" or not dist.is_available() or not dist.is_initialized() or dist.get_world_size() == 1:
        return 0
    buffers = persistent_buffers(module)
    by_dtype: dict[torch.dtype, list[Tensor]] = {}
    for buffer in buffers:
        by_dtype.setdefault(buffer.dtype, []).append(buffer)
    world_size = dist.get_world_size()
    for dtype, group in by_dtype.items():
        target = device or group[0].device
        flat = torch.cat([buffer.detach().reshape(-1).to(target) for buffer in group])
        if mode == "average" and (dtype.is_floating_point or dtype.is_complex):
            if dtype.itemsize < 4:  # summing world_size bf16/fp16 copies would round at every step
                flat = flat.float()
            dist.all_reduce(flat, op=dist.ReduceOp.SUM)  # gloo has no AVG
            flat.div_(world_size)
        else:
            dist.broadcast(flat, src)
        for buffer, value in zip(group, flat.split([buffer.numel() for buffer in group])):
            buffer.copy_(value.view(buffer.shape))
    return len(buffers)
