"""Process groups for a MiCS layout: the (replicate, shard) device mesh and extra sub-groups.

:mod:`lightning_mics.topology` says *which* ranks belong together; this module creates the
corresponding process groups (a collective operation: every rank must call these functions in the
same order). Every group gets the strategy's collective timeout, so a hung peer is detected in
that time rather than torch's 30-minute default for new groups.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any, Optional

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from lightning_mics import _compat as compat
from lightning_mics.topology import MiCSTopology

#: Mesh dimension names: rows are partition groups, columns replication groups.
REPLICATE_DIM, SHARD_DIM = "replicate", "shard"


def build_device_mesh(
    topology: MiCSTopology, device_type: str, backend: str, timeout: Optional[timedelta] = None
) -> DeviceMesh:
    """A (replicate, shard) mesh whose rows are the partition groups. With a single partition there
    is nothing to replicate, so a 1-D shard mesh over the world is used (plain FSDP, no all-reduce).

    The mesh's sub-groups get the strategy's collective ``timeout`` (``init_device_mesh`` would
    otherwise create them with torch's 30-minute default, and a hung peer would stall the others
    that long).
    """
    if topology.replication_degree == 1:
        return init_device_mesh(device_type, (topology.partition_size,), mesh_dim_names=(SHARD_DIM,))
    options = compat.backend_options(backend, timeout)
    kwargs: dict[str, Any] = {}
    if options is not None:
        kwargs["backend_override"] = {REPLICATE_DIM: (backend, options), SHARD_DIM: (backend, options)}
    return init_device_mesh(device_type, topology.mesh_shape, mesh_dim_names=(REPLICATE_DIM, SHARD_DIM), **kwargs)


def create_optimizer_state_groups(
    topology: MiCSTopology, optim_degree: int, timeout: Optional[timedelta] = None
) -> tuple[dist.ProcessGroup, dist.ProcessGroup]:
    """This rank's optimizer-shard and optimizer-replica groups (see
    :meth:`MiCSTopology.optimizer_state_groups`) for optimizer states sharded ``optim_degree`` ways."""
    shard_groups, replica_groups = topology.optimizer_state_groups(optim_degree)
    shard_pg, _ = dist.new_subgroups_by_enumeration([list(g) for g in shard_groups], timeout=timeout)
    replica_pg, _ = dist.new_subgroups_by_enumeration([list(g) for g in replica_groups], timeout=timeout)
    return shard_pg, replica_pg
