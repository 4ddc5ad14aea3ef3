"""Analytic expectation of the bytes each strategy moves per optimizer step, split into the bytes that
cross node links (what the emulated NICs' counters see) and the bytes that stay on a node (loopback).

Two layers, both pure arithmetic:

1. **Schedule** -- which collectives one optimizer step issues, on which group, with which payload:
   the library's own :func:`lightning_mics.schedule.step_schedule` (the one the planner prices and
   telemetry checks), fed the model's FSDP units (parameter shapes from a meta-device :class:`GPT`),
   with each group role mapped to the concrete ranks of every group of that role. FSDP1 under
   Lightning's Trainer fits the same schedule: Lightning enters FSDP1's ``no_sync()`` on
   non-boundary micro-steps (``block_backward_sync`` treats any model with a ``no_sync`` method like
   DDP), so gradients accumulate *unsharded* and the reduce-scatter runs once, at the boundary --
   MiCS's ``grad_accumulation="unsharded"`` -- only its units are flat parameters, padded its way.
   DDP is partition size 1 (nothing gathered or scattered; one all-reduce of every gradient across
   the world per optimizer step under ``no_sync``); its gradient buckets change the number of
   calls, not the bytes.

2. **Wire bytes** -- how gloo moves each collective over TCP (``ProcessGroupGloo`` in torch 2.x):

   * ``all_gather`` is gloo's ring all-gather: every ring edge carries ``(n - 1) / n`` of the
     gathered buffer;
   * ``all_reduce`` is gloo's ring all-reduce (reduce-scatter + all-gather phases): every edge
     carries ``2 (n - 1) / n`` of the buffer;
   * ``reduce_scatter`` has **no** native gloo algorithm: ``reduce_scatter_tensor`` clones the input
     and *all-reduces the whole buffer*, then keeps its chunk -- twice the bytes of a real
     reduce-scatter, on every edge. That is what FSDP1 gets. MiCS (FSDP2 with our comm) uses
     :func:`lightning_mics.collectives.ring_reduce_scatter` instead: point-to-point sends along the
     group's rank order, every edge carrying ``(n - 1) / n`` of the input;
   * the ring follows the group's rank order; an edge between ranks on different nodes crosses a
     node link, all others are loopback.

Semi-synchronous rows (DiLoCo, ``sync_every = H``) take the library's schedule as it is: no hop 2 on any step,
and one all-reduce of every rank's parameter-delta shards across the replicas after every ``H``-th step -- the
same bytes as one synchronous hop 2 (one fp32 value per parameter element of the shard), counted ``1 / H`` per
optimizer step (:attr:`RingCollective.every_steps`). A measured window of whole rounds gives that average.

Two-level DiLoCo rows (``diloco_worker_size``) take it the same way: a hop 2 at every step across each worker's
partition groups (``replication``), and the outer all-reduce every ``H`` steps across the workers
(``outer_replication``). On a cluster with regions the bytes crossing node links split into those between nodes of
one region and those crossing a region link (:func:`level_wire_bytes`).

Payload bytes are counted; TCP/IP/Ethernet framing (about 1% with 9000-byte frames) and control
messages (barriers, Lightning's per-batch flag broadcast) are not, which is why measured counters
sit slightly above these numbers.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Optional

import torch

from benchmarks.scenarios import ClusterShape, StrategySpec, TrainingSetup
from examples.models import GPT, GPTConfig
from lightning_mics.schedule import CollectiveKind, StepLayout, UnitSize, step_schedule
from lightning_mics.accounting import UnitShapes, padded_numel
from lightning_mics.topology import MiCSTopology
from lightning_mics.wire import resolve_wire_format

#: DeepSpeed ZeRO-3's default ``stage3_param_persistence_threshold``: parameters of at most this many
#: elements stay gathered ("persistent") and are all-gathered once per optimizer step, after it.
DEEPSPEED_PERSISTENCE_THRESHOLD = 100_000

#: DeepSpeed ZeRO-3's default ``stage3_max_reuse_distance`` (elements): once the parameter trace is
#: recorded (after the first step), a gathered parameter whose next use lies within this many
#: parameter elements is not released (``PartitionedParameterCoordinator.__params_to_release``).
DEEPSPEED_MAX_REUSE_DISTANCE = 1_000_000_000

#: FSDP1 with ``use_orig_params=True`` (Lightning's default) starts every parameter at a 16-byte boundary.
FSDP1_ALIGNMENT_BYTES = 16


@dataclass(frozen=True)
class RingCollective:
    """``count`` identical collectives on the concrete group ``ranks`` (in ring order), each carrying
    ``payload_bytes``: the gathered output, the pre-scatter input, or the all-reduced buffer."""

    kind: CollectiveKind
    ranks: tuple[int, ...]
    payload_bytes: int
    count: int = 1
    #: a reduce-scatter through gloo's own ``reduce_scatter_tensor`` (an all-reduce), not our ring
    via_all_reduce: bool = False
    #: issued once every this many optimizer steps (DiLoCo's outer synchronisation, ``sync_every``), else 1: its
    #: bytes count ``1 / every_steps`` per optimizer step, the average over whole rounds
    every_steps: int = 1


@dataclass(frozen=True)
class WireBytes:
    """Bytes on the wire: across node links (``inter_node``) and node-local loopback (``intra_node``)."""

    inter_node: float = 0.0
    intra_node: float = 0.0

    def __add__(self, other: WireBytes) -> WireBytes:
        return WireBytes(self.inter_node + other.inter_node, self.intra_node + other.intra_node)

    def scaled(self, factor: float) -> WireBytes:
        return WireBytes(self.inter_node * factor, self.intra_node * factor)


# ------------------------------------------------------------------------------------ wire bytes
#: Fraction of the payload that one ring edge carries, for an ``n``-rank group.
_RING_EDGE_SHARE = {
    "all_gather": lambda n: (n - 1) / n,
    "all_reduce": lambda n: 2 * (n - 1) / n,
    "reduce_scatter": lambda n: (n - 1) / n,
}


def gloo_wire_bytes(collective: RingCollective, cluster: ClusterShape) -> WireBytes:
    """Bytes that gloo's ring algorithm for ``collective`` puts on node links and on loopback."""
    ranks = collective.ranks
    n = len(ranks)
    if n < 2 or collective.payload_bytes == 0:
        return WireBytes()
    kind = "all_reduce" if collective.via_all_reduce else collective.kind
    per_edge = _RING_EDGE_SHARE[kind](n) * collective.payload_bytes
    edges = [(ranks[i], ranks[(i + 1) % n]) for i in range(n)]
    crossing = sum(1 for a, b in edges if cluster.node_of(a) != cluster.node_of(b))
    return WireBytes(crossing * per_edge, (n - crossing) * per_edge).scaled(collective.count / collective.every_steps)


@dataclass(frozen=True)
class LevelBytes:
    """Bytes that cross node links, by level: between nodes of one region, and across a region link."""

    inside_region: float = 0.0
    across_regions: float = 0.0

    @property
    def inter_node(self) -> float:
        return self.inside_region + self.across_regions


def level_wire_bytes(collectives: Iterable[RingCollective], cluster: ClusterShape, nodes_per_region: int) -> LevelBytes:
    """Each collective's ring edges between different nodes (as :func:`gloo_wire_bytes` counts them), split by
    whether the two nodes share a region of ``nodes_per_region`` consecutive nodes. A crossing byte leaves its
    node's uplink once and, across regions, its region's link once."""
    inside = across = 0.0
    for collective in collectives:
        ranks, n = collective.ranks, len(collective.ranks)
        if n < 2 or collective.payload_bytes == 0:
            continue
        kind = "all_reduce" if collective.via_all_reduce else collective.kind
        per_edge = _RING_EDGE_SHARE[kind](n) * collective.payload_bytes * collective.count / collective.every_steps
        for a, b in ((ranks[i], ranks[(i + 1) % n]) for i in range(n)):
            node_a, node_b = cluster.node_of(a), cluster.node_of(b)
            if node_a == node_b:
                continue
            if node_a // nodes_per_region == node_b // nodes_per_region:
                inside += per_edge
            else:
                across += per_edge
    return LevelBytes(inside, across)


def expected_level_bytes(spec: StrategySpec, cluster: ClusterShape, setup: TrainingSetup,
                         nodes_per_region: int) -> LevelBytes:
    """:func:`level_wire_bytes` of one optimizer step of ``spec`` (averaged over whole rounds of ``sync_every``)."""
    return level_wire_bytes(step_collectives(spec, cluster, setup), cluster, nodes_per_region)


def total_wire_bytes(collectives: Iterable[RingCollective], cluster: ClusterShape) -> WireBytes:
    total = WireBytes()
    for collective in collectives:
        total = total + gloo_wire_bytes(collective, cluster)
    return total


# ------------------------------------------------------------------------------------ model units
def gpt_fsdp_units(config: GPTConfig) -> list[UnitShapes]:
    """The FSDP units both strategies build for :class:`GPT`: one per transformer block (resharded
    after forward), then the root holding the rest (embeddings, final norm; never resharded)."""
    with torch.device("meta"):
        model = GPT(config)
    block_param_ids = {id(p) for block in model.blocks for p in block.parameters()}
    units = [
        UnitShapes(
            shapes=tuple(tuple(p.shape) for p in block.parameters()),
            trainable=tuple(p.requires_grad for p in block.parameters()),
            reshard_after_forward=True,
        )
        for block in model.blocks
    ]
    root = [p for p in model.parameters() if id(p) not in block_param_ids]  # a tied weight counts once
    units.append(
        UnitShapes(
            shapes=tuple(tuple(p.shape) for p in root),
            trainable=tuple(p.requires_grad for p in root),
            reshard_after_forward=False,
        )
    )
    return units


def fsdp2_unit_numel(unit: UnitShapes, shard_size: int) -> int:
    """FSDP2 pads every parameter's dim 0 to a multiple of the shard-group size."""
    return sum(padded_numel(shape, shard_size) for shape in unit.shapes)


def fsdp1_unit_numel(unit: UnitShapes, shard_size: int, element_bytes: int = 4) -> int:
    """FSDP1 flattens a unit into one ``FlatParameter``: each parameter aligned, the total padded to
    a multiple of the shard-group size."""
    align = max(1, FSDP1_ALIGNMENT_BYTES // element_bytes)
    total = sum(math.ceil(math.prod(shape or (1,)) / align) * align for shape in unit.shapes)
    return math.ceil(total / shard_size) * shard_size


# ------------------------------------------------------------------------------------ schedules
def _groups_of_role(role: str, topology: MiCSTopology, optim_degree: Optional[int] = None) -> list[tuple[int, ...]]:
    """Every group of a :data:`~lightning_mics.schedule.GroupRole`, as concrete ranks in ring order. Two-level
    DiLoCo: ``replication`` is each worker's (same shard index, the worker's partition groups: the replicate
    dimension of its plane of the (worker, replicate, shard) mesh), ``outer_replication`` the ranks at the same
    place in every worker."""
    m = topology.ranks_per_node
    if role == "replication" and topology.two_level:
        p = topology.partition_size
        return [tuple(worker[shard::p]) for worker in topology.worker_groups for shard in range(p)]
    if role == "outer_replication":
        return [tuple(g) for g in topology.outer_replication_groups]
    if role == "partition":
        return [tuple(g) for g in topology.partition_groups]
    if role == "partition_across_nodes":  # same-local-rank peers of each partition
        return [tuple(g[local::m]) for g in topology.partition_groups for local in range(m)]
    if role == "partition_within_node":
        return [tuple(g[i : i + m]) for g in topology.partition_groups for i in range(0, len(g), m)]
    if role == "replication":
        return [tuple(g) for g in topology.replication_groups]
    if role in ("optim_shard", "optim_replica") and optim_degree is not None:
        shard_groups, replica_groups = topology.optimizer_state_groups(optim_degree)
        return [tuple(g) for g in (shard_groups if role == "optim_shard" else replica_groups)]
    raise ValueError(f"The benchmark runs no layout with {role!r} collectives (hpZ).")


def gpt_parameter_numels(config: GPTConfig) -> list[int]:
    """Element counts of the GPT's parameters, a tied weight once (as ``named_parameters`` yields them)."""
    with torch.device("meta"):
        model = GPT(config)
    return [p.numel() for p in model.parameters()]


def deepspeed_partition_numel(numel: int, shard_size: int) -> int:
    """ZeRO-3 keeps ``ceil(numel / shard_size)`` elements of every parameter per rank (padded per parameter)."""
    return -(-numel // shard_size)


def deepspeed_mics_collectives(
    spec: StrategySpec, cluster: ClusterShape, setup: TrainingSetup, element_bytes: int = 4
) -> list[RingCollective]:
    """One optimizer step of DeepSpeed 0.19.2's MiCS (``runtime/zero/mics.py`` on ZeRO-3, fp32),
    with its default thresholds, on every shard and replica group:

    * every micro-step, each partitioned parameter is all-gathered in its shard group
      (``MiCS_Init``'s ``all_gather_coalesced``; our gloo shim issues one ``all_gather_into_tensor``
      per parameter: the same bytes) -- *once*, not for forward and again for backward: with the
      default ``stage3_max_reuse_distance`` (1e9 elements, far more than the model) the coordinator
      keeps every parameter gathered from its forward use to its backward use once the trace is
      recorded. A first version of this model counted two gathers per micro-step and overestimated
      the measured loopback bytes by 30 % (598 vs 461 MB, ``--quick``); with one it is within 0.3 %.
      (The warm-up step, which records the trace, may gather more; it is not measured.)
    * parameters of at most :data:`DEEPSPEED_PERSISTENCE_THRESHOLD` elements are persistent: gathered
      once per optimizer step (after it);
    * every micro-step, all gradients are reduce-scattered in the shard group
      (``reduce_scatter_coalesced`` -> ``reduce_scatter_tensor``, which gloo runs as an all-reduce of
      the whole input);
    * at the accumulation boundary, the gradient partitions are all-reduced in the replica group
      (``allreduce_mics_shard_grads``, ``all_reduce_coalesced``): the only inter-node traffic when a
      shard group is one node.
    """
    topology = MiCSTopology.create(cluster.world_size, cluster.ranks_per_node, spec.partition_size)
    p, accumulate = topology.partition_size, setup.accumulate
    numels = gpt_parameter_numels(setup.model)
    partitioned = sum(deepspeed_partition_numel(n, p) * p for n in numels if n > DEEPSPEED_PERSISTENCE_THRESHOLD)
    persistent = sum(deepspeed_partition_numel(n, p) * p for n in numels if n <= DEEPSPEED_PERSISTENCE_THRESHOLD)
    gradient_partitions = sum(deepspeed_partition_numel(n, p) for n in numels)
    gathers = 1 if sum(numels) < DEEPSPEED_MAX_REUSE_DISTANCE else 2  # per micro-step, see above
    collectives: list[RingCollective] = []
    for shard in topology.partition_groups:
        ranks = tuple(shard)
        collectives += [
            RingCollective("all_gather", ranks, partitioned * element_bytes, count=gathers * accumulate),
            RingCollective("all_gather", ranks, persistent * element_bytes, count=1),
            RingCollective("reduce_scatter", ranks, gradient_partitions * p * element_bytes, count=accumulate,
                           via_all_reduce=True),
        ]
    for replicas in topology.replication_groups:
        collectives.append(RingCollective("all_reduce", tuple(replicas), gradient_partitions * element_bytes))
    return collectives


def step_collectives(
    spec: StrategySpec, cluster: ClusterShape, setup: TrainingSetup, element_bytes: int = 4
) -> list[RingCollective]:
    """Every collective (on every group) of one optimizer step of ``spec``; fp32 throughout."""
    if spec.family == "deepspeed":
        return deepspeed_mics_collectives(spec, cluster, setup, element_bytes)
    topology = spec.topology(cluster)
    p, fsdp1 = topology.partition_size, spec.family == "fsdp1"
    numel = fsdp1_unit_numel if fsdp1 else fsdp2_unit_numel
    units = [
        UnitSize(numel(unit, p), numel(unit, p), unit.reshard_after_forward) for unit in gpt_fsdp_units(setup.model)
    ]
    wire = resolve_wire_format(spec.cross_replica_dtype)
    layout = StepLayout(
        partition_size=p,
        world_size=cluster.world_size,
        accumulation=setup.accumulate,
        grad_accumulation="unsharded" if fsdp1 else spec.grad_accumulation,
        params_degree=spec.params_degree,
        optim_degree=spec.optim_degree,
        **(wire.byte_model() if wire is not None else {}),
        hierarchical_ranks_per_node=cluster.ranks_per_node if spec.hierarchical and topology.spans_nodes else None,
        gather_bytes=element_bytes,
        reduce_bytes=element_bytes,
        sync_every=spec.sync_every,  # DiLoCo: no hop 2; one parameter-delta all-reduce every H steps
        worker_size=topology.worker_size,  # two-level: hop 2 every step inside a worker, the outer round across
    )
    collectives: list[RingCollective] = []
    for entry in step_schedule(units, layout):
        for ranks in _groups_of_role(entry.group, topology, spec.optim_degree):
            collectives.append(
                RingCollective(
                    entry.kind,
                    ranks,
                    int(entry.payload_bytes),
                    entry.calls_per_step(setup.accumulate),
                    via_all_reduce=fsdp1 and entry.kind == "reduce_scatter",  # gloo's own: an all-reduce
                    every_steps=entry.every_steps,
                )
            )
    return collectives


def expected_step_bytes(spec: StrategySpec, cluster: ClusterShape, setup: TrainingSetup) -> WireBytes:
    """Inter-node and loopback bytes of one optimizer step of ``spec`` under gloo (module docstring)."""
    return total_wire_bytes(step_collectives(spec, cluster, setup), cluster)


def expected_inter_node_bytes_per_node(spec: StrategySpec, cluster: ClusterShape, setup: TrainingSetup) -> float:
    """Inter-node bytes one node sends per optimizer step (every node sends the same share: the rings
    here are symmetric across nodes). What weak scaling compares as nodes are added: for a one-node
    partition, the boundary all-reduce across ``N`` replicas sends ``2 (N - 1) / N`` of the node's
    gradient shard (gloo's ring), so it grows towards twice the shard, not without bound."""
    return expected_step_bytes(spec, cluster, setup).inter_node / cluster.num_nodes


def gradient_bytes_held_during_accumulation(spec: StrategySpec, cluster: ClusterShape, setup: TrainingSetup) -> int:
    """Gradient bytes one rank keeps between micro-steps: MiCS (FSDP2) with sharded accumulation keeps
    its reduce-scattered shard, ``1 / partition_size`` of the model; unsharded accumulation -- and
    FSDP1 under Lightning's ``no_sync`` -- keeps the full gradient (FSDP1: padded flat parameters)."""
    if spec.family == "fsdp1":
        return sum(fsdp1_unit_numel(u, spec.partition_size) for u in gpt_fsdp_units(setup.model)) * 4
    if spec.family == "deepspeed":  # ZeRO-3's flat buffer of gradient partitions
        return sum(deepspeed_partition_numel(n, spec.partition_size) for n in gpt_parameter_numels(setup.model)) * 4
    if spec.family == "ddp":
        return sum(fsdp2_unit_numel(u, 1) for u in gpt_fsdp_units(setup.model)) * 4
    if spec.grad_accumulation == "unsharded" and spec.partition_size > 1:
        return sum(fsdp2_unit_numel(u, spec.partition_size) for u in gpt_fsdp_units(setup.model)) * 4
    return sum(fsdp2_unit_numel(u, spec.partition_size) for u in gpt_fsdp_units(setup.model)) // spec.partition_size * 4
