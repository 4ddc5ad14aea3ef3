"""What happens before and as the ranks start: the layout refused once in the launching process, the ranks
per node, and the cores shared between a machine's ranks.

Lightning's launchers start the ranks after the strategy is built; these run there (and in ranks started
by torchrun or SLURM, where the launcher is not Lightning's) -- not at training time.
"""

from __future__ import annotations

import os
from typing import Optional, Union

import torch

from lightning_mics.options import ShardingOption
from lightning_mics.sharding_spec import ShardingSpec
from lightning_mics.topology import MiCSTopology, PartitionSizeSpec, WorkerSizeSpec, detect_ranks_per_node
from lightning_mics.wrapping import check_reshard_group


def check_layout(
    world_size: int,
    ranks_per_node: int,
    partition_size: PartitionSizeSpec,
    sharding: ShardingOption,
    reshard_after_forward: Union[bool, int],
) -> None:
    """Pure layout math, run when a launcher is about to start the processes (the world size is known):
    an invalid layout is refused once, in the launching process, instead of in every rank."""
    if world_size < 1 or partition_size == "auto" or sharding == "auto":
        return  # "auto" needs the model; resolved at setup
    if isinstance(sharding, ShardingSpec):
        sharding.resolve(world_size, ranks_per_node)
    else:
        topology = MiCSTopology.create(world_size, ranks_per_node, partition_size)
        check_reshard_group(reshard_after_forward, topology.partition_size)


def check_diloco_workers(
    world_size: int,
    ranks_per_node: int,
    partition_size: PartitionSizeSpec,
    sharding: ShardingOption,
    worker_size: WorkerSizeSpec,
    ranks_per_region: Optional[int],
) -> None:
    """Two-level DiLoCo's workers and regions checked in the launching process, as :func:`check_layout` checks
    the partition: a worker of whole nodes, regions of whole workers."""
    if world_size < 1 or sharding == "auto":
        return
    if isinstance(sharding, ShardingSpec):
        partition_size = sharding.resolve(world_size, ranks_per_node).partition_size
    MiCSTopology.create(world_size, ranks_per_node, partition_size, worker_size, ranks_per_region)


def resolve_ranks_per_node(override: Optional[int], num_processes: int, world_size: int) -> int:
    """The user's ``ranks_per_node``, else the launcher's announcement, else the devices per node."""
    if override is not None:
        return override
    return detect_ranks_per_node() or num_processes or world_size


def limit_intra_op_threads(local_ranks: int) -> None:
    """Give each rank of this machine an equal share of its cores, before the ranks start.

    Lightning sets ``OMP_NUM_THREADS`` in its launchers only *after* starting the other ranks, so
    they start with OpenMP's default (every core each): several ranks on few cores then thrash --
    measured on the main job with partition size 1 (4 ranks, 2 cores): 2,258 ms per step instead of
    614 ms. A value the user set is kept."""
    if "OMP_NUM_THREADS" in os.environ or local_ranks < 1:
        return
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # platforms without affinity masks
        cores = os.cpu_count() or 1
    threads = max(1, cores // local_ranks)
    os.environ["OMP_NUM_THREADS"] = str(threads)
    torch.set_num_threads(threads)
