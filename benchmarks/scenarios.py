"""What the emulated-cluster benchmark runs: the cluster shape, the training setting and the
strategies to compare. Pure data and validation -- no processes, no namespaces -- so both the
orchestrator (``emulated_cluster.py``), the per-rank worker and the tests share one definition.
"""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass, field, replace
from typing import Any, Literal, Optional, Union

from examples.models import GPTConfig
from lightning_mics.topology import MiCSTopology

#: ``mics``: :class:`~lightning_mics.MiCSStrategy` (FSDP2); ``fsdp1``: Lightning's own ``FSDPStrategy``;
#: ``ddp``: Lightning's ``DDPStrategy`` (torch DDP: gradient buckets, ``no_sync`` while accumulating);
#: ``deepspeed``: DeepSpeed's own MiCS (ZeRO-3, ``mics_shard_size``) or, with a partition of the whole
#: world, its plain ZeRO-3, driven directly (``deepspeed_peer``).
Family = Literal["mics", "fsdp1", "ddp", "deepspeed"]


@dataclass(frozen=True)
class ClusterShape:
    """``num_nodes`` emulated nodes with ``ranks_per_node`` ranks each; rank ``r`` lives on node
    ``r // ranks_per_node``."""

    num_nodes: int
    ranks_per_node: int

    def __post_init__(self) -> None:
        if isinstance(self.num_nodes, bool) or not isinstance(self.num_nodes, int) or self.num_nodes < 2:
            raise ValueError(
                f"--nodes must be an int >= 2 (inter-node traffic needs at least two nodes), got {self.num_nodes!r}."
            )
        if isinstance(self.ranks_per_node, bool) or not isinstance(self.ranks_per_node, int) or self.ranks_per_node < 1:
            raise ValueError(f"--ranks-per-node must be a positive int, got {self.ranks_per_node!r}.")

    @property
    def world_size(self) -> int:
        return self.num_nodes * self.ranks_per_node

    def node_of(self, rank: int) -> int:
        return rank // self.ranks_per_node


@dataclass(frozen=True)
class StrategySpec:
    """One row of the comparison.

    Attributes:
        name: the label in the table, JSON and chart.
        family: which implementation runs it (see :data:`Family`).
        partition_size: ranks sharding one copy of the model states (FSDP1: the shard-group size).
        hierarchical: MiCS two-stage collectives for partitions spanning nodes (``None`` for FSDP1).
        sharding_strategy: FSDP1's ``ShardingStrategy`` name (``None`` for MiCS).
        grad_accumulation: MiCS's accumulation mode (``"sharded"`` / ``"unsharded"``); FSDP1 rows
            accumulate unsharded under Lightning's ``no_sync`` whatever this says.
        params_degree: AMSP's parameter degree for MiCS rows (``None``: the partition size; 1: keep
            parameters gathered through each optimizer step, ZeRO-2-like).
        cross_replica_dtype: MiCS's wire format across replicas (``None``: fp32, ``"bf16"``, ``"int8"``:
            a key of :data:`lightning_mics.wire.WIRE_FORMATS`).
        optim_degree: AMSP's optimizer-state degree for MiCS rows (``None``: the partition size).
        planned: the layout is not given but chosen by the planner at set-up for the measured cluster
            (``MiCSStrategy(sharding="auto", grad_accumulation="auto", planner_cluster="calibrate")``);
            the row's result records the choice (:meth:`with_choice`) and its bytes follow from it.
        cross_replica_overlap: MiCS's hop 2 started per unit during the boundary backward (the default);
            ``False`` (the ``-serial`` rows): FSDP2's own hop 2, or a compressed one after backward.
        sync_every: semi-synchronous replica groups (``cross_replica_sync="diloco"``, DiLoCo's H): the groups
            synchronise every ``sync_every`` optimizer steps instead of running hop 2 at every step; ``None``:
            synchronous.
        outer_lr: the learning rate of DiLoCo's outer Nesterov SGD (momentum 0.9); ``None``: the library's
            default (0.7, the DiLoCo paper's).
        diloco_worker_size: two-level DiLoCo (``MiCSStrategy(diloco_worker_size=...)``): partition groups per
            DiLoCo worker, synchronised every step, or ``"region"``; ``None``: flat DiLoCo (or synchronous).
        ranks_per_region: the emulated cluster's ranks per region (``MiCSStrategy(ranks_per_region=...)``), which
            ``diloco_worker_size="region"`` reads; ``None``: no regions.
    """

    name: str
    family: Family
    partition_size: int
    hierarchical: Optional[bool] = None
    sharding_strategy: Optional[str] = None
    description: str = ""
    grad_accumulation: str = "sharded"
    params_degree: Optional[int] = None
    cross_replica_dtype: Optional[str] = None
    optim_degree: Optional[int] = None
    planned: bool = False
    cross_replica_overlap: bool = True
    sync_every: Optional[int] = None
    outer_lr: Optional[float] = None
    diloco_worker_size: Optional[Union[int, str]] = None
    ranks_per_region: Optional[int] = None

    def __post_init__(self) -> None:
        if self.sync_every is not None:
            if isinstance(self.sync_every, bool) or not isinstance(self.sync_every, int) or self.sync_every < 1:
                raise ValueError(f"{self.name}: sync_every must be a positive int, got {self.sync_every!r}.")
            if self.family != "mics" or self.planned:
                raise ValueError(f"{self.name}: semi-synchronous rows need an explicit MiCS layout (family 'mics', "
                                 "not planned: the strategy refuses sharding='auto' with DiLoCo).")
        if self.diloco_worker_size is not None and self.sync_every is None:
            raise ValueError(f"{self.name}: diloco_worker_size (two-level DiLoCo) needs sync_every.")
        if self.diloco_worker_size == "region" and self.ranks_per_region is None:
            raise ValueError(f"{self.name}: diloco_worker_size='region' needs ranks_per_region.")
        if self.outer_lr is not None and (self.sync_every is None or not self.outer_lr > 0):
            raise ValueError(f"{self.name}: outer_lr needs sync_every (a DiLoCo row) and must be positive, "
                             f"got {self.outer_lr!r}.")

    @property
    def semi_synchronous(self) -> bool:
        """The row's replica groups synchronise every :attr:`sync_every` steps (DiLoCo), not at every step: its
        inter-node bytes arrive in one burst per ``sync_every`` steps, so per-step numbers are averages over
        whole rounds (the benchmark measures a multiple of ``sync_every`` steps for it)."""
        return self.sync_every is not None

    def with_choice(self, record: dict[str, Any]) -> StrategySpec:
        """A planned row with the layout its result recorded (the planner's choice at set-up)."""
        if not self.planned:
            return self
        return replace(
            self,
            partition_size=int(record["partition_size"]),
            params_degree=record.get("params_degree"),
            optim_degree=record.get("optim_degree"),
            grad_accumulation=record["grad_accumulation"],
            hierarchical=bool(record.get("hierarchical")),
        )

    @property
    def two_level(self) -> bool:
        """Two-level DiLoCo: a hop 2 at every step inside each worker, DiLoCo's outer round across workers."""
        return self.diloco_worker_size not in (None, 1)

    def replication_degree(self, cluster: ClusterShape) -> int:
        return cluster.world_size // self.partition_size

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> StrategySpec:
        return cls(**data)

    def topology(self, cluster: ClusterShape) -> MiCSTopology:
        """The row's MiCS topology on ``cluster``: partitions, and for two-level DiLoCo its workers and regions."""
        worker = self.diloco_worker_size if self.sync_every is not None else None
        return MiCSTopology.create(cluster.world_size, cluster.ranks_per_node, self.partition_size, worker,
                                   self.ranks_per_region)


def default_strategies(cluster: ClusterShape) -> list[StrategySpec]:
    """The strategies of issue 5: MiCS (partition = one node), MiCS over a 2-node partition with and
    without hierarchical collectives, ZeRO-3 (partition = world, flat collectives as in DeepSpeed),
    pure replication, Lightning's ``FSDPStrategy`` in ``HYBRID_SHARD`` and ``FULL_SHARD`` modes, Lightning's
    ``DDPStrategy``, and DeepSpeed's own MiCS (run only where the ``[peers]`` extra is installed).

    With 2 nodes the 2-node partition *is* the world: ``mics-2node-flat`` then has exactly ZeRO-3's
    layout and the pair doubles as a run-to-run noise check. With an odd node count a 2-node
    partition does not divide the world and those two rows are left out.
    """
    m, world = cluster.ranks_per_node, cluster.world_size
    specs = [
        StrategySpec("mics", "mics", m, hierarchical=False, description="MiCS, partition = one node"),
        StrategySpec("mics-unsharded", "mics", m, hierarchical=False, grad_accumulation="unsharded",
                     description="MiCS, partition = one node, gradients accumulated unsharded"),
        StrategySpec("mics-zero2", "mics", m, hierarchical=False, grad_accumulation="unsharded", params_degree=1,
                     description="AMSP P=1 G=OS=node: parameters gathered once per step, gradients unsharded"),
        StrategySpec("mics-bf16", "mics", m, hierarchical=False, cross_replica_dtype="bf16",
                     description="MiCS, partition = one node, bf16 cross-replica all-reduce"),
        StrategySpec("mics-zero2-bf16", "mics", m, hierarchical=False, grad_accumulation="unsharded",
                     params_degree=1, cross_replica_dtype="bf16",
                     description="mics-zero2 with a bf16 cross-replica all-reduce"),
        StrategySpec("mics-auto", "mics", m, planned=True,
                     description="the planner's layout for the measured cluster: sharding='auto', "
                                 "grad_accumulation='auto', planner_cluster='calibrate'"),
        StrategySpec("mics-auto-bf16", "mics", m, planned=True, cross_replica_dtype="bf16",
                     description="mics-auto with a bf16 cross-replica all-reduce"),
        StrategySpec("mics-serial", "mics", m, hierarchical=False, cross_replica_overlap=False,
                     description="mics with hop 2 after each unit's reduce-scatter, blocking (before issue 24)"),
        StrategySpec("mics-auto-serial", "mics", m, planned=True, cross_replica_overlap=False,
                     description="mics-auto with hop 2 not overlapped with backward (before issue 24)"),
        StrategySpec("mics-int8", "mics", m, hierarchical=False, cross_replica_dtype="int8",
                     description="MiCS, partition = one node, blockwise-int8 cross-replica all-reduce"),
        StrategySpec("mics-zero2-int8", "mics", m, hierarchical=False, grad_accumulation="unsharded",
                     params_degree=1, cross_replica_dtype="int8",
                     description="mics-zero2 with a blockwise-int8 cross-replica all-reduce"),
    ]
    if cluster.num_nodes % 2 == 0:
        specs += [
            StrategySpec("mics-2node-hier", "mics", 2 * m, hierarchical=True,
                         description="MiCS, partition = 2 nodes, hierarchical all-gather/reduce-scatter"),
            StrategySpec("mics-2node-flat", "mics", 2 * m, hierarchical=False,
                         description="MiCS, partition = 2 nodes, flat collectives"),
        ]
    specs += [
        StrategySpec("zero3", "mics", world, hierarchical=False, description="ZeRO-3: shard over all ranks, flat"),
        StrategySpec("replicate", "mics", 1, hierarchical=False, description="no sharding (DDP-like)"),
        StrategySpec("fsdp-hybrid", "fsdp1", m, sharding_strategy="HYBRID_SHARD",
                     description="Lightning FSDPStrategy HYBRID_SHARD, shard group = one node"),
        StrategySpec("fsdp-full", "fsdp1", world, sharding_strategy="FULL_SHARD",
                     description="Lightning FSDPStrategy FULL_SHARD (shard over all ranks)"),
        StrategySpec("ddp", "ddp", 1,
                     description="Lightning DDPStrategy (gradient buckets, no_sync while accumulating)"),
        StrategySpec("deepspeed-mics", "deepspeed", m,
                     description="DeepSpeed 0.19.2's own MiCS: ZeRO-3, mics_shard_size = one node (skipped "
                                 "unless the [peers] extra is installed)"),
        StrategySpec("deepspeed-zero3", "deepspeed", world,
                     description="DeepSpeed 0.19.2's plain ZeRO-3 (shard over all ranks, flat; the MiCS paper's "
                                 "baseline; skipped unless the [peers] extra is installed)"),
    ]
    for spec in specs:  # the same layout rules as the strategy itself
        MiCSTopology.create(world, m, spec.partition_size)
    return specs


#: DiLoCo's H of the ``mics-diloco`` row; ``mics-diloco-h<H>`` names any other.
DILOCO_SYNC_EVERY = 8
_DILOCO_NAME = re.compile(r"mics-diloco-h(\d+)")
_TWO_LEVEL_NAME = re.compile(r"mics-diloco-two-level-h(\d+)")


def diloco_spec(cluster: ClusterShape, sync_every: int = DILOCO_SYNC_EVERY, outer_lr: Optional[float] = None,
                name: Optional[str] = None) -> StrategySpec:
    """MiCS with semi-synchronous replica groups (DiLoCo every ``sync_every`` steps) on the layout the planner
    picks on this emulated cluster in both recorded runs (``mics-auto``: ``P=1 G=OS=node``, unsharded
    accumulation -- the ``mics-zero2`` row), so that against ``mics-auto`` only the hop across nodes differs.
    An explicit layout because the strategy refuses ``sharding="auto"`` with DiLoCo (the planner may shard
    optimizer states across replicas, which DiLoCo cannot)."""
    name = name or ("mics-diloco" if sync_every == DILOCO_SYNC_EVERY and outer_lr is None
                    else f"mics-diloco-h{sync_every}")
    outer = "DiLoCo's outer Nesterov SGD (lr 0.7, momentum 0.9)" if outer_lr is None else \
        f"outer Nesterov SGD lr {outer_lr:g}, momentum 0.9"
    return StrategySpec(
        name, "mics", cluster.ranks_per_node, hierarchical=False, grad_accumulation="unsharded", params_degree=1,
        sync_every=sync_every, outer_lr=outer_lr,
        description=f"semi-synchronous (DiLoCo, H={sync_every}): mics-zero2's layout, replica groups average "
                    f"their parameter deltas every {sync_every} optimizer steps with {outer}; per-step numbers "
                    f"are averages over whole rounds of {sync_every} steps",
    )


def two_level_spec(cluster: ClusterShape, sync_every: int, ranks_per_region: int, outer_lr: Optional[float] = None,
                   name: Optional[str] = None) -> StrategySpec:
    """Two-level DiLoCo on :func:`diloco_spec`'s layout (partition = one node): every partition group of a region is
    one DiLoCo worker (``diloco_worker_size="region"``), whose replicas run hop 2 at every step on the region's
    network; only the workers -- the regions -- average their parameter deltas, every ``sync_every`` steps, across
    the region links."""
    flat = diloco_spec(cluster, sync_every, outer_lr)
    name = name or f"mics-diloco-two-level-h{sync_every}"
    regions, nodes = cluster.world_size // ranks_per_region, ranks_per_region // cluster.ranks_per_node
    return replace(
        flat, name=name, diloco_worker_size="region", ranks_per_region=ranks_per_region,
        description=f"two-level DiLoCo (H={sync_every}): mics-zero2's layout; the {nodes} partition groups (nodes) of "
                    f"each region are one worker with a hop 2 at every step, the {regions} workers average their "
                    f"parameter deltas every {sync_every} optimizer steps",
    )


def optional_strategies(cluster: ClusterShape) -> list[StrategySpec]:
    """Rows run only when named (``--strategies``): the semi-synchronous ``mics-diloco`` (H = 8; any H as
    ``mics-diloco-h<H>``). Not in the default set: it is not synchronous training (its loss is another
    question, ``--convergence``), and ``compare_planner.py`` prices every row as synchronous."""
    return [diloco_spec(cluster)]


def select_strategies(cluster: ClusterShape, names: Optional[list[str]],
                      ranks_per_region: Optional[int] = None) -> list[StrategySpec]:
    """The default strategies, or the subset named (in the given order), which may include the optional rows
    (:func:`optional_strategies`, ``mics-diloco-h<H>`` for any H >= 1 and, on a cluster with regions of
    ``ranks_per_region`` ranks, ``mics-diloco-two-level-h<H>``). Unknown names are an error."""
    defaults = {spec.name: spec for spec in default_strategies(cluster)}
    if not names:
        return list(defaults.values())
    available = {**defaults, **{spec.name: spec for spec in optional_strategies(cluster)}}
    for name in names:
        match = _DILOCO_NAME.fullmatch(name)
        if match and name not in available and int(match.group(1)) >= 1:
            available[name] = diloco_spec(cluster, int(match.group(1)), name=name)
        match = _TWO_LEVEL_NAME.fullmatch(name)
        if match and ranks_per_region is not None and int(match.group(1)) >= 1:
            available[name] = two_level_spec(cluster, int(match.group(1)), ranks_per_region, name=name)
    unknown = [n for n in names if n not in available]
    if unknown:
        raise ValueError(
            f"Unknown strategy name(s) {unknown} for {cluster.num_nodes} nodes. Choose from: {', '.join(available)} "
            "(and mics-diloco-h<H> for DiLoCo every H steps; with --regions mics-diloco-two-level-h<H>)."
        )
    return [available[n] for n in names]


def measured_steps_for(spec: StrategySpec, measured_steps: int) -> int:
    """The measured steps a row runs: ``measured_steps``, rounded up to whole rounds of ``sync_every`` steps for a
    semi-synchronous row, so that its window holds exactly one outer synchronisation per ``sync_every`` steps
    (whatever the warm-up: any ``H`` consecutive steps hold one) and its per-step bytes and time are honest
    averages."""
    if not spec.semi_synchronous:
        return measured_steps
    every = spec.sync_every or 1
    return -(-measured_steps // every) * every


@dataclass(frozen=True)
class TrainingSetup:
    """The training every strategy runs: same model, micro-batch, accumulation and step count."""

    model: GPTConfig
    micro_batch: int
    accumulate: int
    warmup_steps: int
    measured_steps: int
    #: Bytes of the corpus to tokenise (enough windows for every rank's micro-batches).
    corpus_bytes: int = 400_000
    extra: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for name in ("micro_batch", "accumulate", "measured_steps"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name.replace('_', '-')} must be a positive int, got {value!r}.")
        if isinstance(self.warmup_steps, bool) or not isinstance(self.warmup_steps, int) or self.warmup_steps < 0:
            raise ValueError(f"warmup-steps must be an int >= 0, got {self.warmup_steps!r}.")

    @property
    def total_steps(self) -> int:
        return self.warmup_steps + self.measured_steps

    def tokens_per_step(self, cluster: ClusterShape) -> int:
        """Tokens of one optimizer step over all ranks (every rank is a data-parallel worker)."""
        return self.micro_batch * self.model.seq_len * self.accumulate * cluster.world_size

    def check_corpus(self, cluster: ClusterShape, val_fraction: float = 0.1) -> None:
        """Refuse a setting whose training windows run out before the last step."""
        windows = int(self.corpus_bytes * (1 - val_fraction)) // self.model.seq_len - 1
        needed = self.total_steps * self.accumulate * self.micro_batch * cluster.world_size
        if windows < needed:
            raise ValueError(
                f"The corpus slice of {self.corpus_bytes} bytes gives {windows} training windows, but "
                f"{self.total_steps} steps x {self.accumulate} micro-batches x {self.micro_batch} samples x "
                f"{cluster.world_size} ranks need {needed}. Use fewer steps or a longer --seq-len."
            )
