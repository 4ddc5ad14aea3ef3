"""Analytic expectation of the bytes each strategy moves per optimizer step, split into the bytes that
cross node links (what the emulated NICs' counters see) and the bytes that stay on a node (loopback).

Two layers, both pure arithmetic:

1. **Schedule** -- which collectives one optimizer step issues, on which group, with which payload,
   derived from the model's FSDP units (parameter shapes from a meta-device :class:`GPT`) and the
   strategy's layout. It follows what FSDP2 (MiCS) and FSDP1 (Lightning's ``FSDPStrategy``) do:

   * FSDP2 / MiCS, per micro-step: one all-gather per unit for forward and one more for backward
     for units that reshard after forward (all but the root), one reduce-scatter per unit, all on
     the partition group; at the accumulation boundary only, one all-reduce of each unit's gradient
     shard across the replication group. With ``partition_size == 1`` FSDP2 issues no all-gather or
     reduce-scatter. Hierarchical mode replaces each partition all-gather / reduce-scatter by the
     two stages of :mod:`lightning_mics.collectives`.
   * FSDP1 under Lightning's Trainer: the same all-gathers, but Lightning enters FSDP1's
     ``no_sync()`` on non-boundary micro-steps (``block_backward_sync`` treats any model with a
     ``no_sync`` method like DDP). Gradients then accumulate *unsharded* -- full size on every
     rank -- and the reduce-scatter (and ``HYBRID_SHARD``'s all-reduce) run once, at the boundary.

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

Payload bytes are counted; TCP/IP/Ethernet framing (about 1% with 9000-byte frames) and control
messages (barriers, Lightning's per-batch flag broadcast) are not, which is why measured counters
sit slightly above these numbers.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Literal

import torch

from benchmarks.scenarios import ClusterShape, StrategySpec, TrainingSetup
from examples.models import GPT, GPTConfig
from lightning_mics.telemetry import UnitShapes, padded_numel
from lightning_mics.topology import MiCSTopology

CollectiveKind = Literal["all_gather", "reduce_scatter", "all_reduce"]

#: FSDP1 with ``use_orig_params=True`` (Lightning's default) starts every parameter at a 16-byte boundary.
FSDP1_ALIGNMENT_BYTES = 16


@dataclass(frozen=True)
class Collective:
    """``count`` identical collectives on the group ``ranks`` (in ring order), each carrying
    ``payload_bytes``: the gathered output, the pre-scatter input, or the all-reduced buffer."""

    kind: CollectiveKind
    ranks: tuple[int, ...]
    payload_bytes: int
    count: int = 1
    #: a reduce-scatter through gloo's own ``reduce_scatter_tensor`` (an all-reduce), not our ring
    via_all_reduce: bool = False


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


def gloo_wire_bytes(collective: Collective, cluster: ClusterShape) -> WireBytes:
    """Bytes that gloo's ring algorithm for ``collective`` puts on node links and on loopback."""
    ranks = collective.ranks
    n = len(ranks)
    if n < 2 or collective.payload_bytes == 0:
        return WireBytes()
    kind = "all_reduce" if collective.via_all_reduce else collective.kind
    per_edge = _RING_EDGE_SHARE[kind](n) * collective.payload_bytes
    edges = [(ranks[i], ranks[(i + 1) % n]) for i in range(n)]
    crossing = sum(1 for a, b in edges if cluster.node_of(a) != cluster.node_of(b))
    return WireBytes(crossing * per_edge, (n - crossing) * per_edge).scaled(collective.count)


def total_wire_bytes(collectives: Iterable[Collective], cluster: ClusterShape) -> WireBytes:
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
def _partition_collective(
    kind: Literal["all_gather", "reduce_scatter"],
    partition: Sequence[int],
    payload_bytes: int,
    count: int,
    topology: MiCSTopology,
    hierarchical: bool,
    via_all_reduce: bool = False,
) -> list[Collective]:
    """One all-gather / reduce-scatter over ``partition``, flat or in MiCS's two stages
    (:class:`~lightning_mics.collectives.HierarchicalAllGather` / ``HierarchicalReduceScatter``).
    ``via_all_reduce``: a flat reduce-scatter by gloo's own algorithm (FSDP1)."""
    if not hierarchical:
        return [Collective(kind, tuple(partition), payload_bytes, count, via_all_reduce and kind == "reduce_scatter")]
    m = topology.ranks_per_node
    per_local_index = payload_bytes // m  # the k shards of one local index: k * shard bytes
    node_groups = [tuple(partition[i : i + m]) for i in range(0, len(partition), m)]
    peer_groups = [tuple(partition[local::m]) for local in range(m)]
    # All-gather: across nodes first (k * n per peer group), then inside each node (the whole buffer).
    # Reduce-scatter: inside each node on the whole buffer first, then across nodes on k * n.
    across = [Collective(kind, g, per_local_index, count) for g in peer_groups]
    within = [Collective(kind, g, payload_bytes, count) for g in node_groups]
    return across + within if kind == "all_gather" else within + across


def step_collectives(
    spec: StrategySpec, cluster: ClusterShape, setup: TrainingSetup, element_bytes: int = 4
) -> list[Collective]:
    """Every collective (on every group) of one optimizer step of ``spec``; fp32 throughout."""
    topology = MiCSTopology.create(cluster.world_size, cluster.ranks_per_node, spec.partition_size)
    p, accumulate = topology.partition_size, setup.accumulate
    hierarchical = bool(spec.hierarchical) and topology.spans_nodes
    # MiCS reduce-scatters every micro-step (sharded gradients); FSDP1 under no_sync only at the boundary.
    reduce_scatters = accumulate if spec.family == "mics" else 1
    numel = fsdp1_unit_numel if spec.family == "fsdp1" else fsdp2_unit_numel
    collectives: list[Collective] = []
    for unit in gpt_fsdp_units(setup.model):
        unit_bytes = numel(unit, p) * element_bytes
        gathers = 2 if unit.reshard_after_forward else 1
        if p > 1:
            for partition in topology.partition_groups:
                collectives += _partition_collective(
                    "all_gather", partition, unit_bytes, gathers * accumulate, topology, hierarchical
                )
                collectives += _partition_collective(
                    "reduce_scatter", partition, unit_bytes, reduce_scatters, topology, hierarchical,
                    via_all_reduce=spec.family == "fsdp1",
                )
        if topology.replication_degree > 1:  # once per optimizer step, at the boundary
            for group in topology.replication_groups:
                collectives.append(Collective("all_reduce", group, unit_bytes // p))
    return collectives


def expected_step_bytes(spec: StrategySpec, cluster: ClusterShape, setup: TrainingSetup) -> WireBytes:
    """Inter-node and loopback bytes of one optimizer step of ``spec`` under gloo (module docstring)."""
    return total_wire_bytes(step_collectives(spec, cluster, setup), cluster)


def gradient_bytes_held_during_accumulation(spec: StrategySpec, cluster: ClusterShape, setup: TrainingSetup) -> int:
    """Gradient bytes one rank keeps between micro-steps: MiCS (FSDP2) keeps its reduce-scattered
    shard, ``1 / partition_size`` of the model; FSDP1 under Lightning's ``no_sync`` keeps the full,
    unsharded gradient (padded flat parameters) whatever its sharding."""
    if spec.family == "fsdp1":
        return sum(fsdp1_unit_numel(u, spec.partition_size) for u in gpt_fsdp_units(setup.model)) * 4
    return sum(fsdp2_unit_numel(u, spec.partition_size) for u in gpt_fsdp_units(setup.model)) // spec.partition_size * 4
