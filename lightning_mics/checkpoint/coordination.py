"""The few collectives checkpointing needs, as no-ops without ``torch.distributed`` -- so saving,
loading and consolidating also work in one plain process.

Decisions about the file system are taken on rank 0 and shared, so that all ranks take the same
branch (and raise the same error) instead of racing on what each of them sees. ``group`` is the
process group to use: the default one, or the dedicated group of background (async) saves, whose
collectives must not interleave with training's.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
import torch.distributed as dist

Group = Optional[dist.ProcessGroup]


def distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def rank() -> int:
    return dist.get_rank() if distributed() else 0


def world_size() -> int:
    return dist.get_world_size() if distributed() else 1


def barrier(group: Group = None) -> None:
    if not distributed():
        return
    if dist.get_backend(group) == "nccl":
        dist.barrier(group=group, device_ids=[torch.cuda.current_device()])
    else:
        dist.barrier(group=group)


def from_rank_zero(obj: Any, group: Group = None) -> Any:
    """Rank 0's ``obj`` on every rank."""
    if not distributed():
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0, group=group)
    return box[0]


def gather_to_rank_zero(obj: Any, group: Group = None) -> Optional[list[Any]]:
    """Every rank's ``obj`` on rank 0 (in rank order); ``None`` on the other ranks."""
    if not distributed():
        return [obj]
    gathered: Optional[list[Any]] = [None] * world_size() if rank() == 0 else None
    dist.gather_object(obj, gathered, dst=0, group=group)
    return gathered


def everyones(obj: Any, group: Group = None) -> list[Any]:
    """Every rank's ``obj`` on every rank (in rank order)."""
    if not distributed():
        return [obj]
    gathered: list[Any] = [None] * world_size()
    dist.all_gather_object(gathered, obj, group=group)
    return gathered
