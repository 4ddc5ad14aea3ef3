"""Process groups for a MiCS layout: the (replicate, shard) device mesh and extra sub-groups.

:mod:`lightning_mics.topology` says *which* ranks belong together; this module creates the
corresponding process groups (a collective operation: every rank must call these functions in the
same order). Every group gets the strategy's collective timeout, so a hung peer is detected in
that time rather than torch's 30-minute default for new groups. It also holds the few steps
both strategies (Trainer and Fabric) take to join the world and talk across it.
"""

from __future__ import annotations

import atexit
import time
from datetime import timedelta
from typing import Any, Optional

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from lightning_mics import _compat as compat
from lightning_mics.topology import MiCSTopology

#: Mesh dimension names: rows are partition groups, columns replication groups.
REPLICATE_DIM, SHARD_DIM = "replicate", "shard"
#: Two-level DiLoCo's outer dimension: the DiLoCo workers (planes of partition groups).
WORKER_DIM = "worker"


def build_device_mesh(
    topology: MiCSTopology, device_type: str, backend: str, timeout: Optional[timedelta] = None
) -> DeviceMesh:
    """A (replicate, shard) mesh whose rows are the partition groups. With a single partition there
    is nothing to replicate, so a 1-D shard mesh over the world is used (plain FSDP, no all-reduce).

    The mesh's sub-groups get the strategy's collective ``timeout`` (``init_device_mesh`` would
    otherwise create them with torch's 30-minute default, and a hung peer would stall the others
    that long). Each dimension gets an options object of its own: creating a group may write into
    its options (NCCL's split does, which is why torch deep-copies a parent's options before a
    split), so one object shared by both dimensions could carry the first group's settings into the
    second. (Gloo's options cannot be deep-copied, so each dimension's are made afresh.)
    """
    if topology.replication_degree == 1:
        return init_device_mesh(device_type, (topology.partition_size,), mesh_dim_names=(SHARD_DIM,))
    return _mesh_with_timeouts(device_type, topology.mesh_shape, (REPLICATE_DIM, SHARD_DIM), backend, timeout)


def _mesh_with_timeouts(
    device_type: str, shape: tuple[int, ...], dims: tuple[str, ...], backend: str, timeout: Optional[timedelta]
) -> DeviceMesh:
    """``init_device_mesh`` with the collective ``timeout`` on every dimension's group, each dimension's options an
    object of its own (:func:`build_device_mesh` says why)."""
    kwargs: dict[str, Any] = {}
    if compat.backend_options(backend, timeout) is not None:
        kwargs["backend_override"] = {dim: (backend, compat.backend_options(backend, timeout)) for dim in dims}
    return init_device_mesh(device_type, shape, mesh_dim_names=dims, **kwargs)


def build_layout_meshes(
    topology: MiCSTopology, device_type: str, backend: str, timeout: Optional[timedelta] = None
) -> tuple[DeviceMesh, Optional[DeviceMesh]]:
    """The mesh a layout shards and runs hop 2 on, and -- two-level DiLoCo with several workers -- the mesh across
    the workers. There a (worker, replicate, shard) mesh is created once and sliced: its (replicate, shard) plane is
    the worker's own, on which everything synchronous runs as in a one-level layout, and its worker dimension carries
    the outer round. One group per dimension, none per FSDP unit. Otherwise :func:`build_device_mesh` and ``None``."""
    if not topology.two_level or topology.num_workers == 1:
        return build_device_mesh(topology, device_type, backend, timeout), None
    dims = (WORKER_DIM, REPLICATE_DIM, SHARD_DIM)
    mesh = _mesh_with_timeouts(device_type, topology.worker_mesh_shape, dims, backend, timeout)
    return mesh[REPLICATE_DIM, SHARD_DIM], mesh[WORKER_DIM]


def create_optimizer_state_groups(
    topology: MiCSTopology, optim_degree: int, timeout: Optional[timedelta] = None
) -> tuple[dist.ProcessGroup, dist.ProcessGroup]:
    """This rank's optimizer-shard and optimizer-replica groups (see
    :meth:`MiCSTopology.optimizer_state_groups`) for optimizer states sharded ``optim_degree`` ways."""
    shard_groups, replica_groups = topology.optimizer_state_groups(optim_degree)
    shard_pg, _ = dist.new_subgroups_by_enumeration([list(g) for g in shard_groups], timeout=timeout)
    replica_pg, _ = dist.new_subgroups_by_enumeration([list(g) for g in replica_groups], timeout=timeout)
    return shard_pg, replica_pg


# ---------------------------------------------------------------------------------------------
# The world: what the Trainer and the Fabric strategy do alike to join it and talk across it
# ---------------------------------------------------------------------------------------------


def assign_world_ranks(strategy: Any) -> None:
    """Tell the cluster environment this process's global rank and the world size, and make
    ``rank_zero_only`` agree (the launcher may have set neither). ``strategy`` is a Lightning
    ``ParallelStrategy`` (Trainer or Fabric): it has ``cluster_environment``, ``node_rank``,
    ``num_processes``, ``local_rank``, ``num_nodes`` and ``global_rank``."""
    environment = strategy.cluster_environment
    if environment is not None:
        environment.set_global_rank(strategy.node_rank * strategy.num_processes + strategy.local_rank)
        environment.set_world_size(strategy.num_nodes * strategy.num_processes)
    set_logging_rank(strategy.global_rank)


def set_logging_rank(rank: int) -> None:
    """The rank Lightning's ``rank_zero_only`` output (loggers, progress messages) sees: only rank 0 writes.
    Normally the global rank; with fault tolerance, the rank among every replica group's ranks, so that one
    group logs for all."""
    from lightning.fabric.utilities.rank_zero import rank_zero_only as fabric_rank_zero_only
    from lightning.pytorch.utilities.rank_zero import rank_zero_only
    from lightning_utilities.core.rank_zero import rank_zero_only as utils_rank_zero_only

    rank_zero_only.rank = utils_rank_zero_only.rank = fabric_rank_zero_only.rank = rank


def join_world(
    cluster_environment: Any, device: torch.device, backend: Optional[str], timeout: Optional[timedelta]
) -> str:
    """Initialise the default process group (a no-op when it exists); return the backend used --
    ``backend``, or NCCL on CUDA and gloo on CPU."""
    backend = backend or compat.default_process_group_backend_for_device(device)
    kwargs: dict[str, Any] = {"timeout": timeout}
    if backend == "nccl":
        kwargs["device_id"] = device  # eager NCCL init bound to this GPU (not for gloo on CUDA)
    created_here = not compat.distributed_is_initialized()
    compat.init_dist_connection(cluster_environment, backend, **kwargs)
    if created_here:
        _leave_world_at_exit(backend)
    return backend


#: The backends this process has joined a world with (a Hydra multirun joins once per job).
_backends_joined: set[str] = set()


def _leave_world_at_exit(backend: str) -> None:
    """Destroy the process groups when the interpreter exits, for every backend (Lightning does it
    only for NCCL).

    Why gloo needs it too: gloo's worker thread drops its reference to a finished collective's
    tensors just *after* waking the caller, and with torch 2.13 dropping a tensor Python has seen
    takes the GIL. If the program's last collective (LightningCLI's ``trainer.log_dir`` broadcast)
    is followed at once by interpreter shutdown, that thread meets a finalizing interpreter and the
    process aborts ("terminate called without an active exception", exit -6) after a successful
    run -- about one exit in seven on the LightningCLI job. Giving the workers a moment to finish
    that release before tearing the groups down closes the window."""
    if not _backends_joined:
        atexit.register(_leave_world)
    _backends_joined.add(backend)


#: How long to let a gloo worker thread finish releasing its last collective at exit (it needs only
#: microseconds once scheduled; the margin is for loaded machines).
_GLOO_WORKER_SETTLE_SECONDS = 0.05


def _leave_world() -> None:
    # also when the program destroyed the world itself: the race is with the last collective
    if "gloo" in _backends_joined:
        time.sleep(_GLOO_WORKER_SETTLE_SECONDS)
    if compat.distributed_is_initialized():
        dist.destroy_process_group()


def barrier(device: torch.device) -> None:
    """A barrier over the world (NCCL's needs the device so it does not guess one)."""
    if not compat.distributed_is_initialized():
        return
    if dist.get_backend() == "nccl":
        dist.barrier(device_ids=[device.index])
    else:
        dist.barrier()


def broadcast_object(obj: Any, src: int = 0) -> Any:
    """Global rank ``src``'s ``obj`` on every rank (``obj`` itself without ``torch.distributed``)."""
    if not compat.distributed_is_initialized():
        return obj
    container = [obj]
    dist.broadcast_object_list(container, src)
    return container[0]
