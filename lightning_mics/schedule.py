"""The per-step collective schedule of a layout: which collective, on which group, how many bytes, when.

One description of MiCS's traffic, used three ways: the planner prices it
(:func:`lightning_mics.planner.layout_schedule`), telemetry compares what ran against it
(:func:`lightning_mics.telemetry.analytic_comm_bytes`), and the emulated-cluster benchmark puts it
on the wire (``benchmarks/comm_model.py``). Each caller only says how big its FSDP units are
(real parameter shapes, or a model size split evenly) and what a group role means to it (a cost
formula, a byte bucket, concrete ranks).

The schedule of one rank's optimizer step of ``A`` micro-steps, per FSDP unit ``u`` with ``G_u``
elements gathered and ``R_u`` trainable elements reduced (both padded to the shard group):

* forward, every micro-step: all-gather ``G_u`` on the partition (``P > 1``); with parameters kept
  gathered through the step (``params_degree == 1``, ZeRO-2-like) only on the first micro-step;
* backward, every micro-step: all-gather ``G_u`` again for units that reshard after forward -- on
  the partition, or on the smaller parameter group of hpZ / ``reshard_after_forward=int``;
* reduce-scatter ``R_u`` on the partition: every micro-step (``grad_accumulation="sharded"``), or
  once at the boundary (``"unsharded"``: full gradients accumulate locally until then);
* boundary: all-reduce of the ``R_u / P`` shard across the replication group; with optimizer
  states sharded over ``OS > P`` ranks instead a reduce-scatter across the ``OS / P`` replicas
  sharing them, an all-reduce of the ``R_u / OS`` slice across the rest, and after the optimizer
  step an all-gather of the updated ``G_u / P`` shard across the ``OS / P`` replicas. With a
  compressed ``cross_replica_bytes`` per element (MiCSStrategy's ``cross_replica_dtype``: 2 for
  bf16, ``1 + 4 / 256`` for blockwise int8) each unit's all-reduce becomes a reduce-scatter and an
  all-gather of its ``R_u / P`` elements, padded to a multiple of the replication degree times
  ``cross_replica_block``, the elements per int8 scale (``cross_replica_per_unit=False``, the hop after
  backward: one such pair per optimizer step of all units' shards packed together).
* semi-synchronous replica groups (DiLoCo, ``sync_every = H``): no hop across replicas on any step; after
  every ``H``-th optimizer step one message of every unit's ``R_u / P`` parameter-delta shard packed
  together (``param_bytes`` per element, or the compressed pair above) is averaged across the
  replication group -- :attr:`ScheduledCollective.every_steps` ``= H``, so per optimizer step it
  carries ``1 / H`` of its bytes on average. Two-level DiLoCo (``worker_size = K`` partitions per worker):
  the boundary hop above runs every step across the ``K`` replicas of a worker, and the outer message
  every ``H`` steps across the workers (``outer_replication``).

A partition (or parameter group) spanning nodes of ``m`` ranks with hierarchical collectives runs
each all-gather as an inter-node stage on ``1/m`` of the buffer among same-local-rank peers, then
an intra-node stage on the whole buffer (reduce-scatter mirrors it: intra-node first).

Payload convention (the one :class:`~lightning_mics.collective_recorder.CollectiveRecorder` records): the
gathered output of an all-gather, the pre-scatter input of a reduce-scatter, the buffer of an
all-reduce -- bytes on the rank that issues it, per call.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal, Optional, Union, get_args

from lightning_mics.accumulation import GradAccumulation, check_grad_accumulation

CollectiveKind = Literal["all_gather", "reduce_scatter", "all_reduce"]
Phase = Literal["forward", "backward", "boundary", "post_step"]
#: The group a collective runs on, by its role in the layout:
#:
#: * ``partition`` -- the ranks sharding one copy of the states;
#: * ``param_group`` -- the smaller group parameters reshard to after forward (hpZ);
#: * ``*_across_nodes`` / ``*_within_node`` -- the two stages of a hierarchical collective on the
#:   partition or parameter group (same-local-rank peers on each node; the group's ranks on one node);
#: * ``replication`` -- the ranks holding the same shard in different partitions (with two-level DiLoCo: in the
#:   partitions of one DiLoCo worker);
#: * ``outer_replication`` -- two-level DiLoCo: the ranks at the same place in every worker (the outer round);
#: * ``optim_shard`` -- replicas that split optimizer states among themselves (``OS > P``);
#: * ``optim_replica`` -- ranks holding the same optimizer-state slice (``OS > P``, ``W > OS``).
GroupRole = Literal[
    "partition",
    "partition_across_nodes",
    "partition_within_node",
    "param_group",
    "param_group_across_nodes",
    "param_group_within_node",
    "replication",
    "outer_replication",
    "optim_shard",
    "optim_replica",
]
#: Roles whose collectives stay inside the partition (telemetry's "intra-partition" traffic).
PARTITION_ROLES: frozenset[str] = frozenset(
    role for role in get_args(GroupRole) if role.startswith(("partition", "param_group"))
)
Number = Union[int, float]


@dataclass(frozen=True)
class UnitSize:
    """How much of one FSDP unit moves: elements gathered and trainable elements reduced, each padded
    the way the sharding implementation pads them. Integers stay exact (telemetry compares them
    with recorded bytes); the planner passes floats."""

    gather_numel: Number
    reduce_numel: Number
    #: whether the unit frees its parameters after forward and gathers them again for backward
    regathered_in_backward: bool


@dataclass(frozen=True)
class StepLayout:
    """What of a layout shapes its traffic. Degrees are group sizes in ranks; ``None`` = the partition."""

    partition_size: int
    world_size: int
    accumulation: int = 1
    grad_accumulation: GradAccumulation = "sharded"
    #: ranks parameters reshard to after forward (hpZ, ``reshard_after_forward=int``); 1: kept whole
    params_degree: Optional[int] = None
    #: ranks sharing one copy of the optimizer states (AMSP ``optim``); > partition shards across replicas
    optim_degree: Optional[int] = None
    #: ranks per node when partition collectives run in two stages (a partition spanning nodes)
    hierarchical_ranks_per_node: Optional[int] = None
    gather_bytes: int = 4  #: all-gather dtype width (2 with bf16 parameters for compute)
    reduce_bytes: int = 4  #: gradient reduction dtype width
    param_bytes: int = 4  #: sharded parameter dtype width (the post-step all-gather of AMSP)
    #: bytes per element of the cross-replica hop when compressed (``cross_replica_dtype``: 2, or
    #: ``1 + 4 / block`` for int8 -- :attr:`lightning_mics.wire.WireFormat.element_bytes`); None: not compressed
    cross_replica_bytes: Optional[float] = None
    #: elements per block of the compressed format (each rank's piece is padded to whole blocks)
    cross_replica_block: int = 1
    #: the compressed hop cut per unit (``cross_replica_overlap``, the default: each unit's message starts
    #: when its gradients are final) rather than one message packing every unit's shard after backward
    cross_replica_per_unit: bool = True
    #: semi-synchronous replica groups (``cross_replica_sync="diloco"``): optimizer steps between two outer
    #: synchronisations (DiLoCo's H); ``None``: a hop across replicas at every optimizer step
    sync_every: Optional[int] = None
    #: two-level DiLoCo: partition groups per DiLoCo worker, synchronised every step (1: flat DiLoCo)
    worker_size: int = 1

    def __post_init__(self) -> None:
        check_grad_accumulation(self.grad_accumulation)
        replicas = self.world_size // self.partition_size
        if self.worker_size < 1 or replicas % self.worker_size or (self.worker_size > 1 and self.sync_every is None):
            raise ValueError(
                f"worker_size={self.worker_size} must divide the {replicas} partition groups, and above 1 needs "
                "sync_every (two-level DiLoCo)."
            )
        if min(self.partition_size, self.world_size, self.accumulation) < 1 or self.world_size % self.partition_size:
            raise ValueError(
                f"partition_size={self.partition_size} must divide world_size={self.world_size}, and accumulation="
                f"{self.accumulation} must be positive."
            )
        if self.sync_every is not None and (self.sync_every < 1 or self.optim != self.partition_size):
            raise ValueError(
                f"sync_every={self.sync_every} (DiLoCo) needs sync_every >= 1 and optimizer states sharded like the "
                f"gradients (optim_degree={self.optim}, partition_size={self.partition_size})."
            )

    @property
    def params(self) -> int:
        return self.partition_size if self.params_degree is None else self.params_degree

    @property
    def optim(self) -> int:
        return self.partition_size if self.optim_degree is None else self.optim_degree

    @property
    def step_replicas(self) -> int:
        """Replicas the boundary hop runs across every step: a worker's (two-level DiLoCo), none (flat DiLoCo:
        1), else every partition group."""
        if self.sync_every is not None:
            return self.worker_size
        return self.world_size // self.partition_size

    @property
    def outer_replicas(self) -> int:
        """Replicas DiLoCo's outer round averages: the workers (1 when every step is synchronous)."""
        if self.sync_every is None:
            return 1
        return self.world_size // self.partition_size // self.worker_size


@dataclass(frozen=True)
class ScheduledCollective:
    """``calls`` identical collectives per occurrence -- per micro-step when ``every_micro_step``,
    else once per optimizer step -- each carrying ``payload_bytes``."""

    phase: Phase
    what: str
    kind: CollectiveKind
    group: GroupRole
    group_size: int
    payload_bytes: Number
    calls: int
    every_micro_step: bool
    #: issued once every this many optimizer steps (DiLoCo's outer synchronisation: ``H``), else 1
    every_steps: int = 1

    def calls_per_step(self, accumulation: int) -> int:
        """Calls in an optimizer step that issues it (every ``every_steps``-th step)."""
        return self.calls * (accumulation if self.every_micro_step else 1)

    def bytes_per_step(self, accumulation: int) -> Number:
        """Bytes per optimizer step, averaged over ``every_steps`` steps."""
        return _div(self.payload_bytes * self.calls_per_step(accumulation), self.every_steps)


def _div(value: Number, parts: int) -> Number:
    """``value / parts``, kept an int when it divides (byte counts compared exactly with recordings)."""
    if isinstance(value, int) and value % parts == 0:
        return value // parts
    return value / parts


def _exact(value: Number) -> Number:
    """A whole number of bytes as an int: a float number of bytes per element (int8's ``1 + 4 / B``)
    times whole blocks is an integer, compared exactly with recordings."""
    return int(value) if isinstance(value, float) and value.is_integer() else value


def _on_group(
    collective: ScheduledCollective, role: Literal["partition", "param_group"], ranks_per_node: Optional[int]
) -> list[ScheduledCollective]:
    """``collective`` flat, or as MiCS's two stages when its group spans nodes of ``ranks_per_node``."""
    m = ranks_per_node
    if m is None or collective.group_size <= m:
        return [collective]
    k = collective.group_size // m
    across = ScheduledCollective(
        collective.phase,
        collective.what + " (across nodes)",
        collective.kind,
        f"{role}_across_nodes",  # type: ignore[arg-type]
        k,
        _div(collective.payload_bytes, m),
        collective.calls,
        collective.every_micro_step,
    )
    within = ScheduledCollective(
        collective.phase,
        collective.what + " (within node)",
        collective.kind,
        f"{role}_within_node",  # type: ignore[arg-type]
        m,
        collective.payload_bytes,
        collective.calls,
        collective.every_micro_step,
    )
    return [across, within] if collective.kind == "all_gather" else [within, across]


def _issued(
    entry: ScheduledCollective, layout: StepLayout, role: Optional[Literal["partition", "param_group"]] = None
) -> list[ScheduledCollective]:
    """``entry`` as the rank issues it: not at all on a one-rank group (FSDP2 skips it), and on a
    partition or parameter group (``role``) as MiCS's two stages when the group spans nodes."""
    if entry.group_size <= 1:
        return []
    return _on_group(entry, role, layout.hierarchical_ranks_per_node) if role else [entry]


def _parameter_gathers(unit: UnitSize, layout: StepLayout) -> list[ScheduledCollective]:
    """The all-gathers of ``unit``'s parameters: in forward on the partition (every micro-step, or only
    the first while parameters stay gathered through the step, ``params_degree == 1``), and again in
    backward when the unit reshards after forward -- on the partition, or on hpZ's parameter group."""
    p, params_degree = layout.partition_size, layout.params
    gathered = unit.gather_numel * layout.gather_bytes
    kept_gathered = params_degree == 1  # gathered on the first micro-step, resharded after the boundary
    forward = ScheduledCollective(
        "forward", "param all-gather", "all_gather", "partition", p, gathered, 1, not kept_gathered
    )
    entries = _issued(forward, layout, "partition")
    if unit.regathered_in_backward and params_degree > 1:
        role: Literal["partition", "param_group"] = "partition" if params_degree == p else "param_group"
        what = "param re-gather" + ("" if params_degree == p else f" (hpZ, {params_degree} ranks)")
        entries += _issued(
            ScheduledCollective("backward", what, "all_gather", role, params_degree, gathered, 1, True), layout, role
        )
    return entries


def _gradient_reductions(unit: UnitSize, layout: StepLayout) -> list[ScheduledCollective]:
    """The reductions of ``unit``'s gradients: the reduce-scatter on the partition (every micro-step
    with ``"sharded"`` accumulation, once at the boundary with ``"unsharded"``), then the hop across
    replicas -- unless that hop is compressed and packs every unit's shard (:func:`_compressed_cross_replica`)."""
    sharded = layout.grad_accumulation == "sharded"
    reduced = unit.reduce_numel * layout.reduce_bytes
    entries = _issued(
        ScheduledCollective(
            "backward" if sharded else "boundary",
            "grad reduce-scatter",
            "reduce_scatter",
            "partition",
            layout.partition_size,
            reduced,
            1,
            sharded,
        ),
        layout,
        "partition",
    )
    if layout.step_replicas == 1 and layout.sync_every is not None:
        return entries  # no hop across replicas on any step: the outer synchronisation (:func:`_outer_sync`)
    if layout.cross_replica_bytes is not None and layout.optim == layout.partition_size:
        if layout.cross_replica_per_unit:
            return entries + _compressed_cross_replica([unit], layout)
        return entries  # packed with the other units' shards (_compressed_cross_replica after the loop)
    return entries + _cross_replica_reductions(unit, layout, reduced)


def _cross_replica_reductions(unit: UnitSize, layout: StepLayout, reduced: Number) -> list[ScheduledCollective]:
    """The boundary hop of one unit's ``reduced`` gradient bytes across replicas: an all-reduce of its
    partition shard; with optimizer states sharded over ``OS > P`` ranks instead a reduce-scatter
    across the ``OS / P`` replicas sharing them, an all-reduce of the ``R_u / OS`` slice across the
    rest, and after the optimizer step an all-gather of the updated parameter shard."""
    p, w, optim = layout.partition_size, layout.world_size, layout.optim
    shard = _div(reduced, p)
    if optim == p:
        return _issued(ScheduledCollective(
            "boundary", "grad all-reduce across replicas", "all_reduce", "replication", layout.step_replicas, shard,
            1, False,
        ), layout)
    return [
        *_issued(ScheduledCollective(
            "boundary", "grad reduce-scatter across replicas", "reduce_scatter", "optim_shard", optim // p,
            shard, 1, False,
        ), layout),
        *_issued(ScheduledCollective(
            "boundary", "grad all-reduce across replicas", "all_reduce", "optim_replica", w // optim,
            _div(reduced, optim), 1, False,
        ), layout),
        *_issued(ScheduledCollective(
            "post_step", "updated param all-gather across replicas", "all_gather", "optim_shard", optim // p,
            _div(unit.gather_numel * layout.param_bytes, p), 1, False,
        ), layout),
    ]


def _compressed_cross_replica(
    units: Sequence[UnitSize], layout: StepLayout, outer: bool = False
) -> list[ScheduledCollective]:
    """The compressed hop across replicas (``cross_replica_bytes``, ``OS = P``) of ``units``: one
    reduce-scatter and one all-gather per optimizer step of their ``R_u / P`` shards packed together, the
    total padded to whole blocks of ``cross_replica_block`` elements for each replica -- across the replicas of
    every step's hop, or (``outer``) DiLoCo's outer round's."""
    p = layout.partition_size
    replicas = layout.outer_replicas if outer else layout.step_replicas
    role: GroupRole = "outer_replication" if outer and layout.worker_size > 1 else "replication"
    if layout.cross_replica_bytes is None or layout.optim != p or replicas <= 1:
        return []
    packed = sum(_div(unit.reduce_numel, p) for unit in units)
    piece = layout.cross_replica_block * -(-packed // (replicas * layout.cross_replica_block))
    payload = _exact(piece * replicas * layout.cross_replica_bytes)
    return [
        ScheduledCollective(
            "boundary", f"compressed grad {kind.replace('_', '-')} across replicas", kind,  # type: ignore[arg-type]
            role, replicas, payload, 1, False,
        )
        for kind in ("reduce_scatter", "all_gather")
    ]


def _outer_sync(units: Sequence[UnitSize], layout: StepLayout) -> list[ScheduledCollective]:
    """DiLoCo's outer synchronisation (``sync_every = H``): after every ``H``-th optimizer step, every unit's
    ``R_u / P`` parameter-delta shard packed into one message and averaged across the replicas -- an all-reduce
    of ``param_bytes`` per element, or a compressed wire's reduce-scatter and all-gather
    (:func:`_compressed_cross_replica`'s padding)."""
    assert layout.sync_every is not None
    replicas = layout.outer_replicas
    if replicas <= 1:
        return []
    every = layout.sync_every
    if layout.cross_replica_bytes is not None:
        return [
            ScheduledCollective(
                "post_step", entry.what.replace("grad", "param delta") + f" every {every} steps", entry.kind,
                entry.group, entry.group_size, entry.payload_bytes, entry.calls, False, every,
            )
            for entry in _compressed_cross_replica(units, layout, outer=True)
        ]
    packed = sum(_div(unit.reduce_numel, layout.partition_size) for unit in units)
    role: GroupRole = "outer_replication" if layout.worker_size > 1 else "replication"
    across = "across workers" if layout.worker_size > 1 else "across replicas"
    return [
        ScheduledCollective(
            "post_step", f"param delta all-reduce {across} every {every} steps", "all_reduce", role,
            replicas, _exact(packed * layout.param_bytes), 1, False, every,
        )
    ]


def step_schedule(units: Sequence[UnitSize], layout: StepLayout) -> list[ScheduledCollective]:
    """Every collective one rank issues in one optimizer step of ``layout`` (module docstring), one
    entry per unit and collective; entries on one-rank groups are left out (FSDP2 skips them)."""
    schedule: list[ScheduledCollective] = []
    for unit in units:
        schedule += _parameter_gathers(unit, layout)
        if unit.reduce_numel:
            schedule += _gradient_reductions(unit, layout)
    outer = []
    if layout.sync_every is not None:
        outer = _outer_sync([unit for unit in units if unit.reduce_numel], layout)
        if layout.step_replicas == 1:
            return schedule + outer
    if layout.cross_replica_per_unit:
        return schedule + outer
    return schedule + _compressed_cross_replica(units, layout) + outer


def check_streaming_options(every: int, fragments: Any, delay: Any, alpha: Any) -> None:
    """One clear error per streaming-DiLoCo setting that does not fit ``sync_every``."""
    if isinstance(fragments, bool) or not isinstance(fragments, int) or fragments < 1 or every % fragments:
        raise ValueError(
            f"num_fragments={fragments!r} must be a positive int dividing sync_every={every}: one fragment is "
            "synchronised every sync_every / num_fragments steps."
        )
    cadence = every // fragments
    if isinstance(delay, bool) or not isinstance(delay, int) or not 0 <= delay < cadence:
        raise ValueError(
            f"fragment_sync_delay={delay!r} must be an int in [0, sync_every / num_fragments = {cadence}): a "
            "fragment's average must land before the next one starts."
        )
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not 0.0 <= alpha <= 1.0:
        raise ValueError(f"fragment_update_alpha={alpha!r} must be a number in [0, 1].")
