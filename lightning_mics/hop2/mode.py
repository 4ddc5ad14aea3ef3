"""Who runs hop 2 -- the cross-replica sum at the accumulation boundary -- and when: decided once, here.

Pure Python (no torch), so the planner and the layout resolution read the same rule without importing a
runtime. :func:`decide_hop2` is called by the layout resolution (:func:`lightning_mics.layout.resolve_layout`);
everything else reads the resulting :class:`Hop2` from the layout's settings -- the mesh FSDP2 shards on,
the engine's step hook, the fault-tolerance checks, offload and the planner's mirror
(:func:`hop2_can_overlap`).

The schedules:

* ``"none"`` -- one replica: nothing crosses.
* ``"fsdp"`` -- FSDP2 runs it on its 2-D (replicate, shard) mesh, in the gradients' dtype, inside each
  unit's post-backward (blocking on CPU ranks); the engine only says on which backward
  (:mod:`lightning_mics.hop2.fsdp`).
* ``"behind_backward"`` -- the engine starts each FSDP unit's sum as soon as its gradient shards are final,
  while backward computes the units before it, and finishes every sum before clipping and the step
  (:class:`lightning_mics.hop2.pipeline.CrossReplicaPipeline`, overlapped).
* ``"after_backward"`` -- the engine sums every shard once, after backward, before clipping and the step
  (the same pipeline, not overlapped): a compressed wire with ``cross_replica_overlap=False``, or the
  fault-tolerant hop without overlap.
* ``"optimizer_states"`` -- AMSP ``optim > grads``: the gradient shards are reduce-scattered into the
  optimizer-state slices across replicas
  (:class:`lightning_mics.hop2.optimizer_states.ReplicaShardedOptimizerStates`).
* ``"diloco"`` -- semi-synchronous replica groups (``cross_replica_sync="diloco"``): no hop 2 on any step;
  every :attr:`Hop2.every` optimizer steps the replicas average their parameter deltas and an outer optimizer
  applies them (:mod:`lightning_mics.hop2.diloco`). FSDP2 shards on the partition alone, as for the engine's
  schedules. ``managed``: the average goes through torchft, and the quorum, heal and commit run once per round
  at that synchronisation, not at every step.

Two-level DiLoCo (``diloco_worker_size`` above 1): the replication dimension has two levels. Inside a DiLoCo
worker -- several partition groups on the zone's network -- hop 2 runs every step with one of the synchronous
schedules above, decided for the worker's replicas; across workers, every :attr:`Hop2.outer_every` optimizer steps,
the workers average their parameter deltas as ``"diloco"`` does (:attr:`Hop2.semi_sync`).

The transport -- the replication process group or torchft's Manager (``managed``) -- is orthogonal to the
schedule: the engine's two schedules run over either (:mod:`lightning_mics.hop2.transport`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Optional

Hop2Schedule = Literal["none", "fsdp", "behind_backward", "after_backward", "optimizer_states", "diloco"]


@dataclass(frozen=True)
class Hop2:
    """How this layout's hop 2 runs (module docstring): the schedule and whether torchft carries it."""

    schedule: Hop2Schedule = "fsdp"
    #: through torchft's Manager across replica groups (``fault_tolerance``), not the replication group
    managed: bool = False
    #: optimizer steps per synchronisation across replicas: DiLoCo's H (``sync_every``) with ``"diloco"``, else 1
    every: int = 1
    #: two-level DiLoCo: the schedule above runs every step inside a worker, and every ``outer_every`` (DiLoCo's H)
    #: optimizer steps the workers average their parameter deltas; ``None`` for one level
    outer_every: Optional[int] = None

    @property
    def semi_sync(self) -> bool:
        """DiLoCo runs: across every partition group (``"diloco"``) or across workers (two-level)."""
        return self.schedule == "diloco" or self.outer_every is not None

    @property
    def sync_every(self) -> Optional[int]:
        """DiLoCo's H at whichever level it runs, ``None`` when every step is synchronous."""
        if self.schedule == "diloco":
            return self.every
        return self.outer_every

    @property
    def overlapped(self) -> bool:
        """Started per unit behind the boundary backward."""
        return self.schedule == "behind_backward"

    @property
    def run_by_engine(self) -> bool:
        """The engine's pipeline runs it (FSDP2 then shards on the partition alone)."""
        return self.schedule in ("behind_backward", "after_backward")

    @property
    def shards_optimizer_beyond_partition(self) -> bool:
        """AMSP ``optim > grads``: optimizer states sharded across replicas, which run their own hop 2."""
        return self.schedule == "optimizer_states"

    @property
    def fsdp_uses_replicate_dim(self) -> bool:
        """FSDP2 gets the 2-D mesh (and runs hop 2 itself); every other schedule gives it the partition."""
        return self.schedule == "fsdp"

    def describe(self) -> str:
        """For the layout log."""
        where = {
            "none": "none (one replica)",
            "fsdp": "FSDP2's all-reduce on the 2-D mesh, per unit in its post-backward",
            "behind_backward": "per FSDP unit, started as its gradients are final, behind the boundary backward",
            "after_backward": "once after the boundary backward",
            "optimizer_states": "reduce-scatter into the optimizer-state slices across replicas (AMSP)",
            "diloco": f"none on inner steps; every {self.every} optimizer steps the replicas average their "
            "parameter deltas and the outer optimizer applies them (DiLoCo)",
        }[self.schedule]
        if self.outer_every is not None:
            where = (
                f"inside each DiLoCo worker every step: {where}; across workers every {self.outer_every} optimizer "
                "steps the workers average their parameter deltas and the outer optimizer applies them (DiLoCo)"
            )
        return where + (", through torchft across replica groups" if self.managed else "")


def hop2_can_overlap(cross_replica_overlap: bool, offloaded: bool) -> bool:
    """Whether hop 2 may start per unit behind backward: asked for, and not on host (offloaded) gradient
    shards. The planner's mirror of :func:`decide_hop2` for its candidate layouts."""
    return cross_replica_overlap and not offloaded


def decide_hop2(
    *,
    replicas: int,
    optim_beyond_partition: bool,
    compressed: bool,
    cross_replica_overlap: bool,
    offloaded: bool,
    managed: bool,
    sync_every: Optional[int] = None,
    worker_size: int = 1,
) -> Hop2:
    """The one rule (module docstring). ``replicas``: the replication degree inside this world;
    ``managed``: replica groups are separate worlds joined by torchft (``fault_tolerance``), so hop 2 runs
    whatever ``replicas`` says; ``sync_every``: DiLoCo's H (``cross_replica_sync="diloco"``), ``None`` for a
    hop 2 at every step. DiLoCo keeps its schedule with one replica too: the outer optimizer still steps (on
    that replica's own delta), so the numbers do not depend on how many replicas there are.

    ``worker_size`` above 1 (two-level DiLoCo, ``replicas`` then the replicas inside one worker): the per-step
    schedule for the worker's replicas, with DiLoCo across workers every ``sync_every`` steps. With one replica
    per worker it is flat DiLoCo, the same thing."""
    if sync_every is not None and worker_size > 1:
        if managed:
            raise ValueError(
                "diloco_worker_size above 1 (two-level DiLoCo) with fault_tolerance is not built: torchft's replica "
                "groups would have to be a worker's partition groups and the outer round cross workers. Drop "
                "fault_tolerance, or use flat DiLoCo with fault tolerance (diloco_worker_size=None)."
            )
        if optim_beyond_partition:
            raise ValueError(
                "diloco_worker_size above 1 (two-level DiLoCo) cannot shard optimizer states across replicas "
                "(ShardingSpec optim > grads) yet: use optim <= grads."
            )
        inner = decide_hop2(
            replicas=replicas, optim_beyond_partition=False, compressed=compressed,
            cross_replica_overlap=cross_replica_overlap, offloaded=offloaded, managed=False,
        )
        return Hop2(inner.schedule, every=1, outer_every=sync_every)
    if sync_every is not None:
        if optim_beyond_partition:
            raise ValueError(
                "cross_replica_sync='diloco' cannot shard optimizer states across replicas (ShardingSpec optim > "
                "grads): each replica group steps its own inner optimizer between outer syncs. Use optim <= grads "
                "(or partition_size=...), or cross_replica_sync='every_step'."
            )
        return Hop2("diloco", managed, every=sync_every)
    if optim_beyond_partition:
        return Hop2("optimizer_states", managed)
    if replicas == 1 and not managed:
        return Hop2("none")
    if hop2_can_overlap(cross_replica_overlap, offloaded):
        return Hop2("behind_backward", managed)
    if compressed or managed:
        return Hop2("after_backward", managed)
    return Hop2("fsdp")
