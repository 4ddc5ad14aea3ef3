"""The bytes of a MiCS step and of a rank's model states: pure arithmetic, shared by telemetry, the planner's
schedule and the benchmarks.

Why a module of its own: the planner and the benchmarks' byte models price layouts that do not run here, and
the telemetry callback checks what ran against the same numbers -- so the arithmetic must import neither
Lightning nor ``torch.distributed``'s runtime (collectives, FSDP), only the per-step schedule
(:mod:`lightning_mics.schedule`). :func:`padded_numel` is FSDP2's dim-0 padding, written once: the schedule's
unit sizes, the benchmarks' byte model and the hop-2 packing offsets (:func:`lightning_mics.shards.padded_shard_numel`)
all read it.

* :func:`analytic_comm_bytes` -- the bytes each rank's collectives carry in one optimizer step, from parameter
  shapes alone (:class:`UnitShapes`);
* :func:`classify_calls` -- the same split (by kind, and by the group a call ran on) for the collectives a rank
  recorded (:class:`~lightning_mics.collective_recorder.CollectiveRecorder`);
* :func:`model_state_bytes` -- what a rank holds of parameters, gradients and optimizer states.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Optional

import torch
from torch import Tensor, nn

from lightning_mics.accumulation import GradAccumulation
from lightning_mics.schedule import PARTITION_ROLES, StepLayout, UnitSize, step_schedule
from lightning_mics.topology import MiCSTopology

if TYPE_CHECKING:
    from lightning_mics.collective_recorder import CollectiveCall

INTRA_PARTITION, CROSS_REPLICA, OTHER = "intra_partition", "cross_replica", "other"
COLLECTIVE_KINDS = ("all_gather", "reduce_scatter", "all_reduce", "broadcast")


# ---------------------------------------------------------------------------------- byte accounting
@dataclass(frozen=True)
class CommBytes:
    """Bytes of collective payload in one optimizer step, by kind and by the group they ran on.

    ``by_group`` is empty when the strategy has no MiCS topology to classify against.
    """

    by_kind: Mapping[str, int]
    by_group: Mapping[str, int] = field(default_factory=dict)

    @property
    def total(self) -> int:
        return sum(self.by_kind.values())

    @property
    def intra_partition(self) -> Optional[int]:
        return self.by_group.get(INTRA_PARTITION) if self.by_group else None

    @property
    def cross_replica(self) -> Optional[int]:
        return self.by_group.get(CROSS_REPLICA) if self.by_group else None


def classify_calls(calls: Iterable[CollectiveCall], topology: Optional[MiCSTopology], rank: int) -> CommBytes:
    """Sum the payload of ``calls`` by kind and, with a topology, by group (see module docstring).

    Sub-groups count with their group: a partition spanning nodes runs hierarchical all-gathers on
    its intra- and inter-node sub-groups, which are intra-partition traffic (the analytic formula
    below assumes flat collectives and does not model those two stages).
    A group that is both the partition and the replication group (a single rank) counts as
    intra-partition; with ZeRO-3 the partition group is the world, so world-wide calls are intra.
    A call on a group outside this world (torchft's, with ``fault_tolerance``) is hop 2 across replica
    groups: cross-replica. Broadcasts are never model-state traffic (Lightning broadcasts a SIGTERM flag
    every batch) and always count as other.
    """
    by_kind: Counter[str] = Counter({kind: 0 for kind in COLLECTIVE_KINDS})
    by_group: Counter[str] = Counter()
    partition = set(topology.partition_group_of(rank)) if topology else set()
    replication = set(topology.replication_group_of(rank)) if topology else set()
    if topology:
        by_group.update({INTRA_PARTITION: 0, CROSS_REPLICA: 0, OTHER: 0})
    for call in calls:
        by_kind[call.kind] += call.bytes
        if topology is None:
            continue
        ranks = set(call.ranks)
        if call.kind == "broadcast":
            by_group[OTHER] += call.bytes  # control traffic (e.g. Lightning's per-batch SIGTERM flag)
        elif not ranks:  # a group outside this world: hop 2 across fault-tolerant replica groups
            by_group[CROSS_REPLICA] += call.bytes
        elif ranks <= partition:  # the partition group, or its intra-/inter-node sub-groups
            by_group[INTRA_PARTITION] += call.bytes
        elif ranks <= replication:
            by_group[CROSS_REPLICA] += call.bytes
        else:
            by_group[OTHER] += call.bytes
    return CommBytes(dict(by_kind), dict(by_group))


@dataclass(frozen=True)
class UnitShapes:
    """The parameters one FSDP unit owns (not those of units nested inside it)."""

    shapes: tuple[tuple[int, ...], ...]
    trainable: tuple[bool, ...]
    #: Whether the unit frees its gathered parameters after forward (then it all-gathers again in backward).
    reshard_after_forward: bool


def padded_numel(shape: Sequence[int], shard_size: int) -> int:
    """Elements of a parameter once FSDP pads its dim 0 to a multiple of ``shard_size``."""
    if not shape:
        shape = (1,)
    rows = math.ceil(shape[0] / shard_size) * shard_size
    return rows * math.prod(shape[1:])


def unit_sizes(units: Sequence[UnitShapes], partition_size: int) -> list[UnitSize]:
    """What each unit moves under FSDP2 on a partition of ``partition_size``: every parameter padded
    to a multiple of it in dim 0 (all are gathered, only trainable ones reduced)."""
    sizes = []
    for unit in units:
        padded = [padded_numel(s, partition_size) for s in unit.shapes]
        trainable = sum(n for n, t in zip(padded, unit.trainable) if t)
        sizes.append(UnitSize(sum(padded), trainable, unit.reshard_after_forward))
    return sizes


def analytic_comm_bytes(
    units: Sequence[UnitShapes],
    partition_size: int,
    replication_degree: int,
    accumulate_grad_batches: int = 1,
    param_bytes: int = 4,
    reduce_bytes: int = 4,
    hierarchical_ranks_per_node: Optional[int] = None,
    grad_accumulation: GradAccumulation = "sharded",
    cross_replica_bytes: Optional[float] = None,
    cross_replica_block: int = 1,
    cross_replica_per_unit: bool = True,
    sync_every: Optional[int] = None,
) -> CommBytes:
    """Bytes each rank's collectives carry in one optimizer step under MiCS on FSDP2: the sum of
    :func:`lightning_mics.schedule.step_schedule` for these units (its docstring derives it).

    With ``p`` the partition size, ``R`` the replication degree, ``A`` the micro-steps per optimizer
    step, and for each unit ``u`` its padded size ``S_u = sum over its params of ceil(dim0 / p) * p *
    rest`` (``S'_u``: trainable params only)::

        all_gather     = A * sum_u g_u * S_u * param_bytes      g_u = 2 if u reshards after forward
                                                                  (gathered again for backward), else 1
        reduce_scatter = A' * sum_u S'_u * reduce_bytes          A' = A (sharded accumulation) or 1 (unsharded)
        all_reduce     = [R > 1] * sum_u S'_u / p * reduce_bytes once, at the boundary, across replicas

    With ``p = 1`` (pure replication) FSDP2 skips the all-gather and reduce-scatter altogether. A
    partition spanning nodes of ``m`` ranks uses two-stage collectives by default; pass
    ``hierarchical_ranks_per_node=m`` then: each all-gather and reduce-scatter adds a stage on
    ``1/m`` of its buffer, all of it inside the partition.

    Also observed but not modelled: after a validation pass the root unit stays gathered, so the next
    step skips the root's first all-gather. ``param_bytes`` is the all-gather dtype (2 for bf16 mixed
    precision), ``reduce_bytes`` the gradient-reduction dtype (4 for the mixed modes). Not included:
    the scalar all-reduce of gradient clipping by norm (4 bytes per step when clipping) and metric syncs.
    ``cross_replica_bytes``: bytes per element of a compressed cross-replica hop (2 for
    ``cross_replica_dtype="bf16"``, ``1 + 4 / 256`` for ``"int8"``), which turns the all-reduces
    into reduce-scatters and all-gathers across replicas; ``cross_replica_block``: its
    elements per scale (256 for int8), to which each rank's piece is padded; ``cross_replica_per_unit``:
    one such message per unit (``cross_replica_overlap``, the default) or one for all units.
    :meth:`WireFormat.byte_model <lightning_mics.wire.WireFormat.byte_model>` gives the first two.
    ``sync_every``: semi-synchronous replica groups (``cross_replica_sync="diloco"``, DiLoCo's H): no all-reduce
    at the boundary; one message of every unit's ``S'_u / p`` parameter delta (``param_bytes`` per element, or
    the compressed pair) every H steps, counted here as ``1 / H`` of it per step.
    """
    if partition_size < 1 or replication_degree < 1 or accumulate_grad_batches < 1:
        raise ValueError("partition_size, replication_degree and accumulate_grad_batches must be positive.")
    layout = StepLayout(
        partition_size=partition_size,
        world_size=partition_size * replication_degree,
        accumulation=accumulate_grad_batches,
        grad_accumulation=grad_accumulation,
        hierarchical_ranks_per_node=hierarchical_ranks_per_node,
        gather_bytes=param_bytes,
        reduce_bytes=reduce_bytes,
        cross_replica_bytes=cross_replica_bytes,
        cross_replica_block=cross_replica_block,
        cross_replica_per_unit=cross_replica_per_unit,
        sync_every=sync_every,
    )
    by_kind: Counter[str] = Counter({kind: 0 for kind in COLLECTIVE_KINDS})
    by_group: Counter[str] = Counter({INTRA_PARTITION: 0, CROSS_REPLICA: 0, OTHER: 0})
    for entry in step_schedule(unit_sizes(units, partition_size), layout):
        moved = int(entry.bytes_per_step(accumulate_grad_batches))
        by_kind[entry.kind] += moved
        by_group[INTRA_PARTITION if entry.group in PARTITION_ROLES else CROSS_REPLICA] += moved
    return CommBytes(dict(by_kind), dict(by_group))


# ---------------------------------------------------------------------------------- memory
def tensor_bytes(t: Tensor) -> int:
    """Bytes of the elements this rank holds of ``t``: a DTensor's local shard, else the tensor. Read through
    the public ``to_local()`` (duck-typed, so this module needs no ``torch.distributed``)."""
    local = t.to_local() if hasattr(t, "to_local") else t
    return local.numel() * local.element_size()


def unique_parameters(module: nn.Module) -> list[nn.Parameter]:
    """``module``'s parameters, each once (tied weights counted once)."""
    return list({id(p): p for p in module.parameters()}.values())


def model_state_bytes(module: nn.Module, optimizers: Iterable[torch.optim.Optimizer] = ()) -> dict[str, int]:
    """Bytes this rank holds of parameters, gradients and optimizer states (its shards, under MiCS).
    ``optimizers``: torch optimizers, or wrappers that expose their ``state`` (Lightning's)."""
    params = unique_parameters(module)
    state = {
        "params": sum(tensor_bytes(p) for p in params),
        "grads": sum(tensor_bytes(p.grad) for p in params if p.grad is not None),
        "optimizer": 0,
    }
    for optimizer in optimizers:
        for per_param in optimizer.state.values():
            state["optimizer"] += sum(
                tensor_bytes(v) for v in per_param.values() if isinstance(v, Tensor) and v.dim() > 0
            )
    state["total"] = state["params"] + state["grads"] + state["optimizer"]
    return state
