"""Layout math for MiCS: which ranks shard the model states together and which replicate them.

Everything here is pure arithmetic on integers (no process groups), so every layout rule can be
unit-tested without spawning processes. :mod:`lightning_mics.strategy` turns a :class:`MiCSTopology`
into a :class:`~torch.distributed.device_mesh.DeviceMesh`.

Terminology (MiCS, Zhang et al., VLDB 2023):

* **partition group** -- the ranks that together hold one complete copy of the model states, each
  rank holding ``1/partition_size`` of it. Ranks are contiguous, so a partition fills a node before
  it spans nodes: all-gathers and reduce-scatters then stay on the fast intra-node links.
* **replication group** -- the ranks that hold the *same* shard in different partitions. Gradients
  cross the slow inter-node links only inside these groups, once per accumulation window.
* **intra-/inter-node sub-groups** -- when a partition spans ``k > 1`` nodes, its ranks on one node
  (intra) and its ranks with the same local index on different nodes (inter). Hierarchical
  collectives run in two stages over these.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from functools import cached_property
from typing import Literal, Optional, Union

#: What users may pass as ``partition_size``: ``None`` (one node, the MiCS default), a positive
#: int, ``-1`` or ``"world"`` (shard across every rank: the ZeRO-3 baseline), ``"node"``.
#: ``"auto"`` is resolved by the strategy with :mod:`lightning_mics.planner` before layout math.
PartitionSizeSpec = Union[int, Literal["world", "node", "auto"], None]

Group = tuple[int, ...]

#: Environment variables that launchers use to say how many ranks run on each node, most specific
#: first. torchrun/torchelastic set ``LOCAL_WORLD_SIZE``; SLURM sets ``SLURM_NTASKS_PER_NODE``
#: (possibly as ``"4(x2)"``); Open MPI sets ``OMPI_COMM_WORLD_LOCAL_SIZE``.
RANKS_PER_NODE_ENV_VARS = ("LOCAL_WORLD_SIZE", "SLURM_NTASKS_PER_NODE", "OMPI_COMM_WORLD_LOCAL_SIZE")

#: The environment variable that says how many ranks run in each region (zone, data centre): no launcher
#: knows regions, so a job that spans them says so here or with ``MiCSStrategy(ranks_per_region=...)``.
RANKS_PER_REGION_ENV_VAR = "MICS_RANKS_PER_REGION"

#: What users may pass as ``diloco_worker_size``: partition groups per DiLoCo worker (``None``: 1, each
#: partition group its own worker), or ``"region"`` -- every partition group of one region.
WorkerSizeSpec = Union[int, Literal["region"], None]


def detect_ranks_per_node(env: Mapping[str, str] | None = None) -> int | None:
    """Return the ranks per node announced by the launcher, or ``None`` when none announces it.

    Lightning's own launcher does not export such a variable; the strategy then falls back to the
    number of devices per node it was given (``Trainer(devices=...)``).
    """
    env = os.environ if env is None else env
    for name in RANKS_PER_NODE_ENV_VARS:
        raw = env.get(name)
        if not raw:
            continue
        head = raw.split("(")[0].split(",")[0].strip()  # SLURM: "4(x2)" or "4,4"
        try:
            value = int(head)
        except ValueError:
            raise ValueError(f"Environment variable {name}={raw!r} is not a whole number of ranks per node.") from None
        if value < 1:
            raise ValueError(f"Environment variable {name}={raw!r} must be a positive number of ranks per node.")
        return value
    return None


def detect_ranks_per_region(env: Mapping[str, str] | None = None) -> int | None:
    """The ranks per region the environment announces (:data:`RANKS_PER_REGION_ENV_VAR`), or ``None``."""
    env = os.environ if env is None else env
    raw = env.get(RANKS_PER_REGION_ENV_VAR)
    if not raw:
        return None
    try:
        value = int(raw)
    except ValueError:
        raise ValueError(
            f"Environment variable {RANKS_PER_REGION_ENV_VAR}={raw!r} is not a whole number of ranks per region."
        ) from None
    if value < 1:
        raise ValueError(f"Environment variable {RANKS_PER_REGION_ENV_VAR}={raw!r} must be a positive number of ranks.")
    return value


def resolve_worker_size(spec: WorkerSizeSpec, partition_size: int, ranks_per_region: int | None) -> int:
    """Partition groups per DiLoCo worker for ``diloco_worker_size=spec``: ``None`` -> 1 (flat DiLoCo: each
    partition group its own worker), ``"region"`` -> a region's partition groups, an int as given (validated
    with the rest of the layout by :class:`MiCSTopology`)."""
    if spec is None:
        return 1
    if spec == "region":
        if ranks_per_region is None:
            raise ValueError(
                "diloco_worker_size='region' needs the ranks per region: pass ranks_per_region=... or set "
                f"{RANKS_PER_REGION_ENV_VAR} (no launcher knows regions), or give diloco_worker_size as the number "
                "of partition groups per worker."
            )
        if ranks_per_region % partition_size != 0:
            raise ValueError(
                f"ranks_per_region={ranks_per_region} is not a whole number of partition groups of "
                f"{partition_size} ranks: a region must hold whole partitions."
            )
        return ranks_per_region // partition_size
    if isinstance(spec, bool) or not isinstance(spec, int) or spec < 1:
        raise ValueError(
            f"diloco_worker_size={spec!r} must be a positive number of partition groups per DiLoCo worker, "
            "'region' (every partition group of a region) or None (1: each partition group its own worker)."
        )
    return spec


def valid_partition_sizes(world_size: int, ranks_per_node: int) -> list[int]:
    """All partition sizes that divide the world and never straddle a node boundary."""
    within_node = [d for d in range(1, ranks_per_node + 1) if ranks_per_node % d == 0]
    num_nodes = world_size // ranks_per_node
    whole_nodes = [ranks_per_node * k for k in range(2, num_nodes + 1) if num_nodes % k == 0]
    return within_node + whole_nodes


def resolve_partition_size(spec: PartitionSizeSpec, world_size: int, ranks_per_node: int) -> int:
    """Turn a user's ``partition_size`` into a validated integer.

    Raises:
        ValueError: with one message naming the valid choices for this world and node size.
    """
    _check_world(world_size, ranks_per_node)
    named = named_size("node" if spec is None else spec, world_size, ranks_per_node)
    if named is not None:
        size = named
    elif spec == "auto":
        raise ValueError(
            "partition_size='auto' is chosen by the planner from the model and device memory; use "
            "MiCSStrategy(partition_size='auto') or lightning_mics.planner.choose_partition_size(...)."
        )
    elif isinstance(spec, bool) or not isinstance(spec, int):
        raise ValueError(
            f"partition_size={spec!r} is not understood. "
            f"{valid_sizes_text(world_size, ranks_per_node)}"
        )
    else:
        size = spec
    problem = _partition_problem(size, world_size, ranks_per_node)
    if problem:
        raise ValueError(
            f"partition_size={spec!r} is invalid for world_size={world_size} with ranks_per_node={ranks_per_node}: "
            f"{problem}. {valid_sizes_text(world_size, ranks_per_node)}"
        )
    return size


def named_size(spec: object, world_size: int, ranks_per_node: int) -> int | None:
    """The size a name stands for -- ``"node"``: one node, ``"world"`` or ``-1``: every rank -- or
    ``None`` when ``spec`` is not a name (partition sizes and AMSP degrees share these names)."""
    if spec == "node":
        return min(ranks_per_node, world_size)
    if (spec == "world" or spec == -1) and not isinstance(spec, bool):
        return world_size
    return None


def valid_sizes_text(world_size: int, ranks_per_node: int, what: str = "partition_size") -> str:
    """The valid choices for a partition size or sharding degree, for error messages."""
    sizes = ", ".join(str(s) for s in valid_partition_sizes(world_size, ranks_per_node))
    if what != "partition_size":
        return f"Valid degrees: {sizes} ('node' = {min(ranks_per_node, world_size)}, 'world' or -1 = {world_size})."
    return (
        f"Valid choices: None or 'node' (one node = {min(ranks_per_node, world_size)} ranks, the MiCS default), "
        f"'world' or -1 (all {world_size} ranks, ZeRO-3), 1 (pure replication), or one of: {sizes}."
    )


def _check_world(world_size: int, ranks_per_node: int) -> None:
    if world_size < 1:
        raise ValueError(f"world_size must be at least 1, got {world_size}.")
    if ranks_per_node < 1:
        raise ValueError(f"ranks_per_node must be at least 1, got {ranks_per_node}.")
    if world_size % ranks_per_node != 0:
        raise ValueError(
            f"ranks_per_node={ranks_per_node} does not divide world_size={world_size}: every node must run the same "
            f"number of ranks. Pass ranks_per_node as a divisor of {world_size} "
            f"(one of {_divisors(world_size)}), or fix the launcher's devices/num_nodes."
        )


def _partition_problem(size: int, world_size: int, ranks_per_node: int) -> str | None:
    if size < 1 or size > world_size:
        return f"it must lie between 1 and the world size {world_size}"
    if world_size % size != 0:
        return f"it does not divide the world size {world_size}"
    if size < ranks_per_node and ranks_per_node % size != 0:
        return f"a partition smaller than a node must divide ranks_per_node={ranks_per_node}, else it straddles nodes"
    if size > ranks_per_node and size % ranks_per_node != 0:
        return f"a partition larger than a node must be whole nodes (a multiple of ranks_per_node={ranks_per_node})"
    return None


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


@dataclass(frozen=True)
class MiCSTopology:
    """The rank layout of one MiCS run. Build it with :meth:`create`, which validates the input."""

    world_size: int
    ranks_per_node: int
    partition_size: int
    #: partition groups that synchronise every step inside one DiLoCo worker (two-level DiLoCo, above 1); 1: each
    #: partition group is its own worker (flat DiLoCo) -- and every synchronous layout
    worker_size: int = 1
    #: ranks in each region (zone, data centre), where known: whole nodes, tiled by whole workers
    ranks_per_region: Optional[int] = None

    @classmethod
    def create(
        cls,
        world_size: int,
        ranks_per_node: int | None = None,
        partition_size: PartitionSizeSpec = None,
        worker_size: WorkerSizeSpec = None,
        ranks_per_region: int | None = None,
    ) -> MiCSTopology:
        """Validate and build a layout. ``ranks_per_node=None`` means the whole world is one node;
        ``worker_size``: partition groups per DiLoCo worker (``diloco_worker_size``, ``"region"`` needing
        ``ranks_per_region``)."""
        ranks_per_node = world_size if ranks_per_node is None else ranks_per_node
        size = resolve_partition_size(partition_size, world_size, ranks_per_node)
        workers = resolve_worker_size(worker_size, size, ranks_per_region)
        return cls(world_size, ranks_per_node, size, workers, ranks_per_region)

    def __post_init__(self) -> None:
        _check_world(self.world_size, self.ranks_per_node)
        problem = _partition_problem(self.partition_size, self.world_size, self.ranks_per_node)
        if problem:
            raise ValueError(f"partition_size={self.partition_size}: {problem}.")
        problem = self._region_problem() or self._worker_problem()
        if problem:
            raise ValueError(problem)

    def _region_problem(self) -> str | None:
        region = self.ranks_per_region
        if region is None:
            return None
        if isinstance(region, bool) or not isinstance(region, int) or region < 1:
            return f"ranks_per_region={region!r} must be a positive int (or None: no regions)."
        if region % self.ranks_per_node or self.world_size % region:
            return (
                f"ranks_per_region={region} must be whole nodes (a multiple of ranks_per_node={self.ranks_per_node}) "
                f"that divide the world of {self.world_size} ranks: every region holds the same number of nodes."
            )
        return None

    def _worker_problem(self) -> str | None:
        """What is wrong with ``worker_size`` on this layout, or ``None``: a worker is whole partition groups that
        tile whole nodes (its per-step hop 2 then stays on the zone's network), and a region tiles whole workers
        (only the outer round crosses regions)."""
        w, replicas = self.worker_size, self.replication_degree
        if w == 1:
            return None
        what = f"diloco_worker_size={w} (partition groups per DiLoCo worker)"
        if replicas % w:
            divisors = [d for d in _divisors(replicas) if d > 1 and (d * self.partition_size) % self.ranks_per_node == 0]
            return (
                f"{what} does not divide the {replicas} partition groups of this layout; "
                + (f"choose one of {divisors}, or 1 (flat DiLoCo)." if divisors else "use 1 (flat DiLoCo).")
            )
        ranks = w * self.partition_size
        if ranks % self.ranks_per_node:
            return (
                f"{what} is {ranks} ranks, not whole nodes of {self.ranks_per_node}: a worker must tile whole nodes, "
                "so that the links it synchronises over every step are the zone's, not a node's neighbour's."
            )
        if self.ranks_per_region is not None and self.ranks_per_region % ranks:
            return (
                f"{what} is {ranks} ranks, which does not tile a region of ranks_per_region={self.ranks_per_region}: "
                "a region must hold whole workers (a worker spanning regions would run its per-step hop 2 across "
                "the region link). Use diloco_worker_size='region' or a divisor of the region's partition groups."
            )
        return None

    # ----------------------------------------------------------------------------- sizes
    @property
    def num_nodes(self) -> int:
        return self.world_size // self.ranks_per_node

    @property
    def replication_degree(self) -> int:
        """How many complete copies of the model states exist (= number of partition groups)."""
        return self.world_size // self.partition_size

    @property
    def nodes_per_partition(self) -> int:
        return max(1, self.partition_size // self.ranks_per_node)

    @property
    def spans_nodes(self) -> bool:
        """Whether one partition covers more than one node (hierarchical collectives then help)."""
        return self.partition_size > self.ranks_per_node

    @property
    def mesh_shape(self) -> tuple[int, int]:
        """Shape of the (replicate, shard) device mesh: row ``i`` is partition group ``i``."""
        return (self.replication_degree, self.partition_size)

    @property
    def num_workers(self) -> int:
        """DiLoCo workers: groups of ``worker_size`` consecutive partition groups."""
        return self.replication_degree // self.worker_size

    @property
    def two_level(self) -> bool:
        """Whether replication has two levels: partition groups synchronised every step inside a worker, workers
        averaged every H steps (``worker_size > 1``)."""
        return self.worker_size > 1

    @property
    def worker_mesh_shape(self) -> tuple[int, int, int]:
        """Shape of the (worker, replicate, shard) mesh of two-level DiLoCo: worker ``i``'s partition groups are
        the rows of plane ``i``."""
        return (self.num_workers, self.worker_size, self.partition_size)

    @property
    def num_regions(self) -> Optional[int]:
        return None if self.ranks_per_region is None else self.world_size // self.ranks_per_region

    # ----------------------------------------------------------------------------- groups
    @cached_property
    def partition_groups(self) -> tuple[Group, ...]:
        p = self.partition_size
        return tuple(tuple(range(start, start + p)) for start in range(0, self.world_size, p))

    @cached_property
    def replication_groups(self) -> tuple[Group, ...]:
        p = self.partition_size
        return tuple(tuple(range(shard, self.world_size, p)) for shard in range(p))

    @cached_property
    def worker_groups(self) -> tuple[Group, ...]:
        """The ranks of each DiLoCo worker (two-level DiLoCo; one group per partition group otherwise)."""
        size = self.worker_size * self.partition_size
        return tuple(tuple(range(start, start + size)) for start in range(0, self.world_size, size))

    @cached_property
    def outer_replication_groups(self) -> tuple[Group, ...]:
        """The ranks at the same place in every worker: those DiLoCo's outer average runs over."""
        size = self.worker_size * self.partition_size
        return tuple(tuple(range(place, self.world_size, size)) for place in range(size))

    @cached_property
    def intra_node_groups(self) -> tuple[Group, ...]:
        """Per partition, its ranks on each node. Empty when partitions fit inside one node."""
        if not self.spans_nodes:
            return ()
        m = self.ranks_per_node
        return tuple(tuple(range(start, start + m)) for start in range(0, self.world_size, m))

    @cached_property
    def inter_node_groups(self) -> tuple[Group, ...]:
        """Per partition, its ranks with the same local index on each of its nodes. Empty when
        partitions fit inside one node."""
        if not self.spans_nodes:
            return ()
        m = self.ranks_per_node
        groups = []
        for partition in self.partition_groups:
            for local in range(m):
                groups.append(tuple(partition[local::m]))
        return tuple(groups)

    def optimizer_state_groups(self, optim_degree: int) -> tuple[tuple[Group, ...], tuple[Group, ...]]:
        """Groups for optimizer states sharded over ``optim_degree`` ranks (AMSP's OS > partition).

        Optimizer states are sharded ``r = optim_degree / partition_size`` ways further, across
        ``r`` consecutive partitions: ranks with the same shard index in those partitions form an
        *optimizer-shard group* (gradients are reduce-scattered and parameters all-gathered there).
        When ``r`` is less than the replication degree, the ``R / r`` optimizer-shard groups of a
        shard index hold identical slices; the ranks at the same position in them form an
        *optimizer-replica group*, across which the slices are all-reduced.

        Returns ``(optimizer_shard_groups, optimizer_replica_groups)``.
        """
        p, replicas = self.partition_size, self.replication_degree
        if optim_degree % p != 0 or replicas % (optim_degree // p) != 0:
            raise ValueError(
                f"optimizer-state sharding degree {optim_degree} must be partition_size ({p}) times a divisor of the "
                f"replication degree ({replicas}); "
                f"valid: {[p * r for r in range(1, replicas + 1) if replicas % r == 0]}."
            )
        r = optim_degree // p
        blocks = replicas // r
        shard_groups = tuple(
            tuple(s + p * (b * r + j) for j in range(r)) for s in range(p) for b in range(blocks)
        )
        replica_groups = tuple(
            tuple(s + p * (b * r + j) for b in range(blocks)) for s in range(p) for j in range(r)
        )
        return shard_groups, replica_groups

    # ----------------------------------------------------------------------------- per rank
    def node_of(self, rank: int) -> int:
        self._check_rank(rank)
        return rank // self.ranks_per_node

    def partition_index(self, rank: int) -> int:
        """Which partition group (= mesh row, replica index) ``rank`` belongs to."""
        self._check_rank(rank)
        return rank // self.partition_size

    def shard_index(self, rank: int) -> int:
        """Which shard of the model states ``rank`` holds (= its rank inside its partition group)."""
        self._check_rank(rank)
        return rank % self.partition_size

    def partition_group_of(self, rank: int) -> Group:
        return self.partition_groups[self.partition_index(rank)]

    def replication_group_of(self, rank: int) -> Group:
        return self.replication_groups[self.shard_index(rank)]

    def _check_rank(self, rank: int) -> None:
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} is outside the world of {self.world_size} ranks.")

    # ----------------------------------------------------------------------------- reporting
    @property
    def kind(self) -> str:
        """A short human name for what the layout is on this cluster."""
        if self.world_size == 1:
            return "one device (nothing to shard, no replicas)"
        if self.partition_size == 1:
            return "replicate (DDP-like: every rank holds the whole model states)"
        if self.replication_degree == 1:
            if self.num_nodes == 1:
                return "one partition = the node (model states sharded inside it; no replicas)"
            return "zero3 (one partition across all nodes; no replicas)"
        return "mics (hybrid shard: partitions replicated)"

    def describe(self, replica_group: Optional[tuple[int, int]] = None) -> str:
        """A multi-line summary for logs: groups and where they run. ``replica_group``: (g, G) when this world
        is replica group g of a fault-tolerant job's G, whose replicas are the other groups, not ranks here."""
        job = f" -- replica group {replica_group[0]} of {replica_group[1]} (fault tolerant)" if replica_group else ""
        lines = [
            f"MiCS layout: {self.kind}{job}; world={self.world_size}, nodes={self.num_nodes} x "
            f"{self.ranks_per_node} ranks, partition_size={self.partition_size}, replicas={self.replication_degree}",
            f"  partition groups (shard model states): {_fmt_groups(self.partition_groups)}",
        ]
        if self.two_level:
            lines.append(
                f"  DiLoCo workers ({self.worker_size} partition groups each; hop 2 syncs a worker's replicas every "
                f"step): {_fmt_groups(self.worker_groups)}"
            )
            lines.append(
                "  outer replication groups (the same place in every worker; the outer round averages them): "
                f"{_fmt_groups(self.outer_replication_groups)}"
            )
        elif self.replication_degree > 1:
            lines.append(
                f"  replication groups (hold the same shard; hop 2 syncs them): {_fmt_groups(self.replication_groups)}"
            )
        if self.ranks_per_region is not None:
            lines.append(f"  regions: {self.num_regions} x {self.ranks_per_region} ranks")
        if self.spans_nodes:
            lines.append(
                f"  partition spans {self.nodes_per_partition} nodes; inter-node sub-groups: "
                f"{_fmt_groups(self.inter_node_groups)}"
            )
        return "\n".join(lines)


def _fmt_groups(groups: tuple[Group, ...], limit: int = 8) -> str:
    shown = " ".join("[" + ",".join(map(str, g)) + "]" for g in groups[:limit])
    return shown + (f" ... ({len(groups)} groups)" if len(groups) > limit else "")
