"""How finely each kind of model state is sharded: AMSP's (P, G, OS) sharding degrees.

AMSP (Chen et al., arXiv 2311.00257) lets the three model states choose their own sharding degree
instead of sharing one partition size as MiCS and ZeRO-3 do:

* **P** -- parameters, **G** -- gradients, **OS** -- optimizer states (and fp32 master weights),

each either a full replica (degree 1), partially sharded (a divisor of a node, or whole nodes), or
fully sharded (the world). The rules, checked by :meth:`ShardingSpec.resolve`:

1. every degree is a valid group size for the cluster -- it divides the world and fills a node
   before it spans nodes (the same rule as MiCS's ``partition_size``,
   :func:`~lightning_mics.topology.valid_partition_sizes`);
2. ``P <= G <= OS`` and each divides the next: the bigger the state, the more finely it may be
   sharded, and every gradient shard lies inside one parameter shard (so a reduce-scatter of the
   gradients of a parameter group never needs data from outside that group).

How the strategy realises a spec on FSDP2 (the contract the planner's cost model assumes):

* ``G`` is the **partition size**: the FSDP2 shard dimension of the (replicate, shard) mesh.
  Gradients are reduce-scattered inside it every micro-step and persist as ``1/G`` shards.
* ``P < G`` keeps parameters in a **smaller group between forward and backward**:
  ``reshard_after_forward=P`` (ZeRO++ hpZ), so the backward all-gather runs inside ``P`` ranks
  (inside a node) at the cost of holding ``1/P`` of the gathered parameters from forward to
  backward. ``P = 1`` means **no reshard within a step** (``reshard_after_forward=False``, ZeRO-2-like):
  no backward all-gather, the whole gathered model is held until backward.
* ``OS > G`` shards the optimizer states **across replicas too**: at the accumulation boundary the
  gradient shards are reduce-scattered among ``OS / G`` replicas (instead of all-reduced), the
  remaining ``world / OS`` replicas all-reduce the ``1/OS`` shard, each rank steps on ``1/OS`` of the
  parameters, and the updated ``1/G`` parameter shards are all-gathered back among the ``OS / G``
  replicas.
* MiCS is ``P = G = OS = partition``; ZeRO-3 is ``P = G = OS = world``; DDP is all ones.

Everything here is pure integer arithmetic (no processes), so it is unit-tested directly.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import Literal, Union

from lightning_mics.topology import MiCSTopology, _check_world, named_size, valid_partition_sizes, valid_sizes_text

#: What a user may write for one degree: a positive int, ``-1`` / ``"world"`` (every rank) or
#: ``"node"`` (one node's ranks).
DegreeSpec = Union[int, Literal["node", "world"]]

STATE_NAMES = ("params", "grads", "optim")
_STATE_TITLES = {"params": "parameters (P)", "grads": "gradients (G)", "optim": "optimizer states (OS)"}


@dataclass(frozen=True)
class ShardingSpec:
    """Sharding degrees for parameters, gradients and optimizer states, as the user writes them.

    The default is MiCS: all three sharded inside one node. Call :meth:`resolve` with the cluster
    shape to validate it and get integers.

    Example::

        ShardingSpec()                                  # MiCS: P = G = OS = one node
        ShardingSpec("world", "world", "world")         # ZeRO-3
        ShardingSpec(params=8, grads=16, optim=16)      # hpZ: 2-node partition, backward gathers in-node
        ShardingSpec(params=1, grads="node", optim="node")   # ZeRO-2-like inside each node
        ShardingSpec(params="node", grads="node", optim="world")  # optimizer states across replicas too
    """

    params: DegreeSpec = "node"
    grads: DegreeSpec = "node"
    optim: DegreeSpec = "node"

    @classmethod
    def uniform(cls, degree: DegreeSpec) -> ShardingSpec:
        """MiCS-style layout: one partition size for all three states."""
        return cls(degree, degree, degree)

    def resolve(self, world_size: int, ranks_per_node: int) -> ShardingDegrees:
        """Validate against a cluster of ``world_size`` ranks, ``ranks_per_node`` per node.

        Raises:
            ValueError: naming the offending state, the rule it breaks and the valid choices.
        """
        _check_world(world_size, ranks_per_node)
        resolved = {
            name: _resolve_degree(name, getattr(self, name), world_size, ranks_per_node) for name in STATE_NAMES
        }
        return ShardingDegrees(world_size=world_size, ranks_per_node=ranks_per_node, **resolved)


@dataclass(frozen=True)
class ShardingDegrees:
    """A validated (P, G, OS) layout on a concrete cluster. Build it with :meth:`ShardingSpec.resolve`."""

    world_size: int
    ranks_per_node: int
    params: int
    grads: int
    optim: int

    def __post_init__(self) -> None:
        _check_world(self.world_size, self.ranks_per_node)
        for name in STATE_NAMES:
            _resolve_degree(name, getattr(self, name), self.world_size, self.ranks_per_node)
        p, g, os_ = self.params, self.grads, self.optim
        if not p <= g <= os_:
            raise ValueError(
                f"ShardingSpec(params={p}, grads={g}, optim={os_}) breaks AMSP's ordering P <= G <= OS: a bigger state "
                f"must be sharded at least as finely as a smaller one. Raise grads/optim or lower params "
                f"(e.g. params={min(p, g, os_)}, grads={sorted((p, g, os_))[1]}, optim={max(p, g, os_)})."
            )
        if g % p or os_ % g:
            raise ValueError(
                f"ShardingSpec(params={p}, grads={g}, optim={os_}): each degree must divide the next (P | G | OS), "
                f"else a gradient shard straddles two parameter shards. Pick degrees from one chain such as "
                f"{_chain_example(self.world_size, self.ranks_per_node)}."
            )

    # ------------------------------------------------------------------ how the strategy realises it
    @property
    def partition_size(self) -> int:
        """MiCS partition size = the gradient degree: the FSDP2 shard dimension."""
        return self.grads

    @cached_property
    def topology(self) -> MiCSTopology:
        """The rank layout the degrees run on: partitions of ``grads`` ranks (valid by the same rule)."""
        return MiCSTopology(self.world_size, self.ranks_per_node, self.grads)

    @property
    def replication_degree(self) -> int:
        """Copies of the (gradient-sharded) model states: the boundary sync runs across these."""
        return self.topology.replication_degree

    @property
    def optimizer_replica_shards(self) -> int:
        """How many replicas share one partition's optimizer states (``OS / G``; 1 = plain MiCS)."""
        return self.optim // self.grads

    @property
    def reshard_after_forward(self) -> Union[bool, int]:
        """The FSDP2 ``reshard_after_forward`` that realises ``P``: ``True`` for ``P = G``, ``False``
        for ``P = 1`` (no reshard within a step), else the int group size ``P`` (hpZ)."""
        if self.params == self.grads:
            return True
        if self.params == 1:
            return False
        return self.params

    @property
    def is_uniform(self) -> bool:
        return self.params == self.grads == self.optim

    @property
    def label(self) -> str:
        return f"P={self.params} G={self.grads} OS={self.optim}"

    @property
    def kind(self) -> str:
        """A short name for the family the layout belongs to."""
        w, node = self.world_size, min(self.ranks_per_node, self.world_size)
        p, g, os_ = self.params, self.grads, self.optim
        if self.is_uniform:
            if g == 1:
                return "DDP" if w > 1 else "single"
            if g == w:
                return "ZeRO-3"
            return "MiCS" + (" (1 node)" if g == node else "")
        if p == g == 1:
            return "ZeRO-1-like"
        if p == 1 and g == os_:
            return "ZeRO-2-like"
        if p < g and g == os_:
            return "hpZ"
        return "AMSP"


def _resolve_degree(name: str, value: DegreeSpec, world_size: int, ranks_per_node: int) -> int:
    title = _STATE_TITLES[name]
    named = named_size(value, world_size, ranks_per_node)
    if named is not None:
        return named
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(
            f"ShardingSpec.{name}={value!r} is not understood for the {title}. Use a positive int, 'node' or "
            f"'world' (-1). {valid_sizes_text(world_size, ranks_per_node, 'degree')}"
        )
    valid = valid_partition_sizes(world_size, ranks_per_node)
    if value not in valid:
        raise ValueError(
            f"ShardingSpec.{name}={value} is not a valid sharding degree for the {title} with world_size={world_size} "
            f"and ranks_per_node={ranks_per_node}: a degree must divide the world and fill a node before spanning "
            f"nodes (a divisor of {ranks_per_node}, or whole nodes). "
            + valid_sizes_text(world_size, ranks_per_node, "degree")
        )
    return value


def _chain_example(world_size: int, ranks_per_node: int) -> str:
    """A divisibility chain of valid degrees, e.g. ``1 | 2 | 4 | 8 | 16``, for error messages."""
    chain = [1]
    for degree in valid_partition_sizes(world_size, ranks_per_node)[1:]:
        if degree % chain[-1] == 0:
            chain.append(degree)
    return " | ".join(map(str, chain))


def all_sharding_degrees(world_size: int, ranks_per_node: int, uniform_only: bool = False) -> list[ShardingDegrees]:
    """Every valid (P, G, OS) layout of the cluster (only ``P = G = OS`` ones with ``uniform_only``)."""
    _check_world(world_size, ranks_per_node)
    sizes = valid_partition_sizes(world_size, ranks_per_node)
    layouts = []
    for g in sizes:
        params_options = [g] if uniform_only else [p for p in sizes if p <= g and g % p == 0]
        optim_options = [g] if uniform_only else [o for o in sizes if o >= g and o % g == 0]
        for p in params_options:
            for os_ in optim_options:
                layouts.append(ShardingDegrees(world_size, ranks_per_node, p, g, os_))
    return layouts
