"""hpZ's parameter group, created once per layout and shared by every FSDP unit.

A ``ShardingSpec`` with ``1 < params < grads`` (ZeRO++ hpZ) reshards each unit's parameters to a group
of ``params`` ranks after forward, so that backward re-gathers them inside that group. FSDP2 realises
this with an int ``reshard_after_forward``, and ``fully_shard`` then builds a new 2-D ``DeviceMesh``
for that group *for every unit it wraps*: two new process groups per block (measured: 5 groups on 4
gloo ranks with 2 blocks, 25 with 12). On NCCL each group is a communicator -- GPU memory, seconds
of set-up, a finite number of NVLS slots -- so an 80-block model would hold 160 of them per rank.

Every unit on the same mesh resharding to the same size needs the same groups, so
:class:`PostForwardMeshes` builds the post-forward mesh once per (mesh, size), with torch's own
helper (the same ranks in the same order as ``fully_shard`` would use: the arithmetic is unchanged),
and each unit is sharded with ``reshard_after_forward=True`` -- which creates nothing -- and then
pointed at the shared mesh (:func:`shard_with_shared_post_forward_mesh`).
"""

from __future__ import annotations

from typing import Any

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, fully_shard

from lightning_mics import _compat as compat


def is_group_size(reshard_after_forward: bool | int) -> bool:
    """Whether ``reshard_after_forward`` names a group size (an int, not a bool): the case in which
    ``fully_shard`` would build a mesh of its own."""
    return isinstance(reshard_after_forward, int) and not isinstance(reshard_after_forward, bool)


class PostForwardMeshes:
    """The post-forward meshes of one layout, one per (FSDP mesh, group size), built on first use.

    A collective on first use of each key (it creates process groups): every rank shards the same
    units in the same order, so every rank builds the same meshes at the same point."""

    def __init__(self) -> None:
        self._infos: dict[tuple[DeviceMesh, int], Any] = {}
        #: process groups these meshes created in this process (for the layout log)
        self.process_groups = 0

    def mesh_info(self, mesh_info: Any, size: int) -> Any:
        """The shared post-forward mesh info for units sharded on ``mesh_info`` (an FSDP2
        ``FSDPMeshInfo``) that reshard to ``size`` ranks."""
        key = (mesh_info.mesh, size)
        if key not in self._infos:
            before = compat.process_group_count()
            self._infos[key] = compat.post_forward_mesh_info(size, mesh_info)
            self.process_groups += compat.process_group_count() - before
        return self._infos[key]

    def share(self, unit: FSDPModule, size: int) -> None:
        """Point every parameter group of ``unit`` (sharded with ``reshard_after_forward=True``) at the
        shared mesh for ``size``."""
        for param_group in compat.fsdp_param_groups(unit):
            compat.set_post_forward_mesh_info(param_group, self.mesh_info(param_group.mesh_info, size))


def shard_with_shared_post_forward_mesh(
    module: nn.Module,
    mesh: DeviceMesh,
    reshard_after_forward: bool | int,
    meshes: PostForwardMeshes,
    **fully_shard_kwargs: Any,
) -> FSDPModule:
    """``fully_shard(module, mesh=mesh, reshard_after_forward=..., **kwargs)``, except that a group size
    reshards onto ``meshes``' shared mesh instead of one ``fully_shard`` would build for this unit alone."""
    if not is_group_size(reshard_after_forward):
        return fully_shard(module, mesh=mesh, reshard_after_forward=reshard_after_forward, **fully_shard_kwargs)
    unit = fully_shard(module, mesh=mesh, reshard_after_forward=True, **fully_shard_kwargs)
    meshes.share(unit, int(reshard_after_forward))
    return unit
