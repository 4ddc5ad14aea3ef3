"""Collectives: what crosses which group, and how.

* :class:`CollectiveRecorder` records every all-gather, reduce-scatter, all-reduce and broadcast
  issued through :mod:`torch.distributed` (or :func:`ring_reduce_scatter`) while it is active -- by
  FSDP2 or anyone else -- with the ranks of the group and the bytes of the payload. Tests use it to
  prove the 2-hop schedule (which collective runs on which group in which micro-step); telemetry uses
  it to report bytes per step.
* :func:`ring_reduce_scatter`: gloo has no reduce-scatter algorithm -- its ``reduce_scatter_tensor``
  all-reduces the whole input and keeps one chunk, twice the bytes of a real reduce-scatter on every
  link. On gloo (CPU tensors) we reduce-scatter over a ring of point-to-point messages instead
  (:class:`RingReduceScatter` is FSDP2's comm for it).
* :class:`HierarchicalAllGather` / :class:`HierarchicalReduceScatter`: MiCS's two-stage collectives
  for partitions that span nodes.
"""

from __future__ import annotations

import functools
import sys
import threading
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.distributed as dist

from lightning_mics._compat import AllGather, ReduceScatter

#: torch.distributed functions we account for, by the kind of collective they are. Old and new
#: spellings are both listed (torch renamed ``all_gather_into_tensor`` to ``all_gather_single``);
#: a nested call from one spelling into the other is counted once.
_TRACKED: dict[str, str] = {
    "all_gather_single": "all_gather",
    "all_gather_into_tensor": "all_gather",
    "_all_gather_base": "all_gather",
    "all_gather": "all_gather",
    "reduce_scatter_single": "reduce_scatter",
    "reduce_scatter_tensor": "reduce_scatter",
    "_reduce_scatter_base": "reduce_scatter",
    "reduce_scatter": "reduce_scatter",
    "all_reduce": "all_reduce",
    "broadcast": "broadcast",
}
#: Our own collectives, looked up in this module at call time so that the recorder can wrap them.
_TRACKED_HERE: dict[str, str] = {"ring_reduce_scatter": "reduce_scatter"}


@dataclass(frozen=True)
class CollectiveCall:
    """One collective as seen by this rank."""

    kind: str  #: "all_gather", "reduce_scatter", "all_reduce" or "broadcast"
    ranks: tuple[int, ...]  #: global ranks of the group it ran on
    bytes: int  #: payload bytes: the full (gathered / pre-scatter / reduced) buffer on this rank
    step: int  #: the value of :attr:`CollectiveRecorder.step` when it was issued


def _group_ranks(group: Any) -> tuple[int, ...]:
    if group is None or group is dist.GroupMember.WORLD:
        return tuple(range(dist.get_world_size()))
    return tuple(dist.get_process_group_ranks(group))


def _payload_bytes(args: tuple[Any, ...], kwargs: dict[str, Any]) -> int:
    """Bytes of the largest tensor argument: the gathered output, the pre-scatter input, or the
    reduced buffer -- the size one would quote for the collective. List arguments (the list forms
    of all-gather / reduce-scatter) count as the sum of their tensors."""
    sizes = [0]
    for value in (*args, *kwargs.values()):
        if isinstance(value, torch.Tensor):
            sizes.append(value.numel() * value.element_size())
        elif isinstance(value, (list, tuple)) and value and all(isinstance(v, torch.Tensor) for v in value):
            sizes.append(sum(v.numel() * v.element_size() for v in value))
    return max(sizes)


class CollectiveRecorder:
    """Context manager that records the collectives this process issues.

    Example::

        with CollectiveRecorder() as rec:
            loss.backward()
        rec.count("all_reduce")  # how many all-reduces this backward issued
    """

    def __init__(self) -> None:
        self.calls: list[CollectiveCall] = []
        #: Free-form step label stamped on each call (tests set it per micro-step).
        self.step: int = 0
        self._originals: dict[tuple[Any, str], Callable[..., Any]] = {}
        self._local = threading.local()

    def _wrap(self, name: str, kind: str, original: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(original)
        def recorded(*args: Any, **kwargs: Any) -> Any:
            depth = getattr(self._local, "depth", 0)
            if depth == 0:
                group = kwargs.get("group")
                if group is None:
                    group = next((a for a in args if isinstance(a, dist.ProcessGroup)), None)
                self.calls.append(
                    CollectiveCall(kind, _group_ranks(group), _payload_bytes(args, kwargs), self.step)
                )
            self._local.depth = depth + 1
            try:
                return original(*args, **kwargs)
            finally:
                self._local.depth = depth

        return recorded

    def __enter__(self) -> CollectiveRecorder:
        for namespace, tracked in ((dist, _TRACKED), (sys.modules[__name__], _TRACKED_HERE)):
            for name, kind in tracked.items():
                original = getattr(namespace, name, None)
                if original is None:
                    continue
                self._originals[(namespace, name)] = original
                setattr(namespace, name, self._wrap(name, kind, original))
        return self

    def __exit__(self, *exc: Any) -> None:
        for (namespace, name), original in self._originals.items():
            setattr(namespace, name, original)
        self._originals.clear()

    # ------------------------------------------------------------------ queries
    def count(self, kind: str, step: int | None = None) -> int:
        return sum(1 for c in self.calls if c.kind == kind and (step is None or c.step == step))

    def bytes_by_kind(self, step: int | None = None) -> Counter[str]:
        totals: Counter[str] = Counter()
        for call in self.calls:
            if step is None or call.step == step:
                totals[call.kind] += call.bytes
        return totals

    def reset(self) -> None:
        self.calls.clear()


# ---------------------------------------------------------------------------------------------
# Hierarchical all-gather / reduce-scatter for partitions that span nodes
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class HierarchicalGroups:
    """The process groups one rank needs for two-stage collectives over its partition.

    The partition's shard-group rank ``s`` of a rank is ``node_in_partition * m + local`` (partitions
    are contiguous, whole nodes), with ``m`` ranks per node and ``k`` nodes per partition.
    """

    partition_ranks: tuple[int, ...]  #: global ranks of the partition in shard-rank order
    intra_node: dist.ProcessGroup  #: this rank's partition ranks on its own node (size m)
    inter_node: dist.ProcessGroup  #: this rank's partition peers with the same local index (size k)
    ranks_per_node: int  #: m
    nodes_per_partition: int  #: k


def create_hierarchical_groups(
    topology: Any, rank: int, backend: str | None = None, timeout: Any = None
) -> HierarchicalGroups:
    """Create (collectively: every rank must call this) the intra- and inter-node sub-groups of
    every partition, and return this rank's. ``topology`` is a :class:`MiCSTopology`."""
    if not topology.spans_nodes:
        raise ValueError("hierarchical collectives need a partition that spans more than one node")
    intra, _ = dist.new_subgroups_by_enumeration(
        [list(g) for g in topology.intra_node_groups], timeout=timeout, backend=backend
    )
    inter, _ = dist.new_subgroups_by_enumeration(
        [list(g) for g in topology.inter_node_groups], timeout=timeout, backend=backend
    )
    return HierarchicalGroups(
        partition_ranks=topology.partition_group_of(rank),
        intra_node=intra,
        inter_node=inter,
        ranks_per_node=topology.ranks_per_node,
        nodes_per_partition=topology.nodes_per_partition,
    )


def all_gather_flat(output: torch.Tensor, input: torch.Tensor, group: Any, async_op: bool = False) -> Any:
    """All-gather ``input`` from every rank of ``group`` into ``output``, in group-rank order."""
    # Looked up at call time (torch >= 2.12 renamed it), which also lets CollectiveRecorder see it.
    fn = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    return fn(output, input, group=group, async_op=async_op)


def reduce_scatter_flat(output: torch.Tensor, input: torch.Tensor, op: Any, group: Any, async_op: bool = False) -> Any:
    """Reduce ``input`` over ``group``; group rank ``i`` receives the ``i``-th block in ``output``.
    On gloo with CPU tensors and a sum or mean, over a ring (:func:`ring_reduce_scatter`)."""
    if not async_op and _ring_applies(input, op, group):
        ring_reduce_scatter(output, input, op, group)
        return None
    fn = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    return fn(output, input, op=op, group=group, async_op=async_op)


_RING_OPS = (dist.ReduceOp.SUM, dist.ReduceOp.AVG)


def _ring_applies(input: torch.Tensor, op: Any, group: Any) -> bool:
    """Gloo moves point-to-point messages from host memory only; other reductions (and NCCL, which
    has a real reduce-scatter) take the backend's own collective."""
    if input.device.type != "cpu" or not any(op == supported for supported in _RING_OPS):
        return False
    return dist.get_world_size(group) > 1 and dist.get_backend(group) == "gloo"


def ring_reduce_scatter(
    output: torch.Tensor,
    input: torch.Tensor,
    op: Any,
    group: Any,
    accumulate_dtype: Optional[torch.dtype] = None,
) -> None:
    """Reduce-scatter over a ring of point-to-point messages: ``n - 1`` steps, in each of which a
    rank passes a partial sum of one block to the next rank and adds its own block to the one it
    receives. Every rank sends ``(n - 1) / n`` of the input once -- half of what gloo's
    all-reduce-based ``reduce_scatter_tensor`` sends. Blocks are summed in ring order starting after
    their owner, so results may differ from gloo's in the last bits (they are the same on every run).
    ``op``: SUM or AVG; ``group`` None is the default group. ``accumulate_dtype``: add the partial
    sums in this (wider) dtype while messages stay in the input's dtype -- a bf16 wire with fp32
    sums (:func:`compressed_all_reduce_`)."""
    if accumulate_dtype is not None and accumulate_dtype != input.dtype:
        _ring_reduce_scatter_widened(output, input, op, group, accumulate_dtype)
        return
    group = dist.GroupMember.WORLD if group is None else group
    n, rank = dist.get_world_size(group), dist.get_rank(group)
    block = output.numel()
    if input.numel() != n * block:
        raise ValueError(f"reduce-scatter input has {input.numel()} elements, expected {n} x {block}")
    blocks = input.reshape(n, block)
    send_to = dist.get_global_rank(group, (rank + 1) % n)
    receive_from = dist.get_global_rank(group, (rank - 1) % n)
    # block b travels r = b + 1, b + 2, ..., and ends, summed over all ranks, at its owner b
    outgoing = blocks[(rank - 1) % n].clone()
    incoming = torch.empty_like(outgoing)
    destination = output.view(-1)
    for step in range(n - 1):
        requests = [dist.isend(outgoing, send_to, group=group), dist.irecv(incoming, receive_from, group=group)]
        for request in requests:
            request.wait()
        # the received partial sum is of block (rank - step - 2); after n - 1 steps, our own block
        own = blocks[(rank - step - 2) % n]
        last = step == n - 2
        torch.add(incoming, own, out=destination if last else outgoing)
    if n == 1:
        destination.copy_(blocks[0])
    if op == dist.ReduceOp.AVG:
        destination.div_(n)


def _ring_reduce_scatter_widened(
    output: torch.Tensor, input: torch.Tensor, op: Any, group: Any, accumulate_dtype: torch.dtype
) -> None:
    """:func:`ring_reduce_scatter` with partial sums kept in ``accumulate_dtype`` and every message
    rounded to the input's dtype: the rounding error grows with the ring's length, not the sum's."""
    group = dist.GroupMember.WORLD if group is None else group
    n, rank = dist.get_world_size(group), dist.get_rank(group)
    block = output.numel()
    if input.numel() != n * block:
        raise ValueError(f"reduce-scatter input has {input.numel()} elements, expected {n} x {block}")
    blocks = input.reshape(n, block)
    send_to = dist.get_global_rank(group, (rank + 1) % n)
    receive_from = dist.get_global_rank(group, (rank - 1) % n)
    partial = blocks[(rank - 1) % n].to(accumulate_dtype)
    outgoing = torch.empty_like(blocks[0])
    incoming = torch.empty_like(blocks[0])
    for step in range(n - 1):
        outgoing.copy_(partial)
        requests = [dist.isend(outgoing, send_to, group=group), dist.irecv(incoming, receive_from, group=group)]
        for request in requests:
            request.wait()
        partial = incoming.to(accumulate_dtype).add_(blocks[(rank - step - 2) % n])
    if op == dist.ReduceOp.AVG:
        partial.div_(n)
    output.view(-1).copy_(partial)


def compressed_all_reduce_(tensor: torch.Tensor, group: Any, wire_dtype: torch.dtype) -> None:
    """Sum ``tensor`` in place over ``group`` with ``wire_dtype`` on the wire (a ring reduce-scatter,
    then an all-gather: the bytes of a ring all-reduce, at ``wire_dtype``'s width).

    On gloo the partial sums are added in ``tensor``'s dtype (:func:`ring_reduce_scatter` with
    ``accumulate_dtype``); other backends reduce in ``wire_dtype``. Every rank -- the owner of a
    block too -- takes the all-gathered, ``wire_dtype``-rounded values, so all ranks end identical.
    """
    n = dist.get_world_size(group)
    if n == 1:
        return
    flat = tensor.view(-1)
    block = -(-flat.numel() // n)
    wire = torch.zeros(n * block, dtype=wire_dtype, device=tensor.device)
    wire[: flat.numel()].copy_(flat)
    mine = torch.empty(block, dtype=wire_dtype, device=tensor.device)
    if _ring_applies(wire, dist.ReduceOp.SUM, group):
        ring_reduce_scatter(mine, wire, dist.ReduceOp.SUM, group, accumulate_dtype=tensor.dtype)
    else:
        reduce_scatter_flat(mine, wire, dist.ReduceOp.SUM, group)
    all_gather_flat(wire, mine, group)
    flat.copy_(wire[: flat.numel()])


class _PlainAllocation:
    """FSDP2 comms also decide how their buffers are allocated; ours take ordinary tensors."""

    def allocate(self, size: Any, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return torch.empty(*size, dtype=dtype, device=device)


class RingReduceScatter(_PlainAllocation, ReduceScatter):
    """FSDP2's reduce-scatter comm on gloo: :func:`reduce_scatter_flat`, which takes the ring."""

    def __call__(
        self,
        output_tensor: torch.Tensor,
        input_tensor: torch.Tensor,
        group: dist.ProcessGroup,
        op: Any = dist.ReduceOp.SUM,
        async_op: bool = False,
    ) -> Any:
        return reduce_scatter_flat(output_tensor, input_tensor, op, group, async_op)


def install_ring_reduce_scatter(units: list[Any]) -> None:
    """Use :class:`RingReduceScatter` in every FSDP unit (FSDP's setter is per unit, not recursive)."""
    comm = RingReduceScatter()
    for unit in units:
        unit.set_custom_reduce_scatter(comm)


class _HierarchicalComm(_PlainAllocation):
    """Shared parts: allocation and deciding whether a call is for our partition group."""

    def __init__(self, groups: HierarchicalGroups) -> None:
        self.groups = groups
        self._partition_group_ids: set[int] = set()

    def _is_partition_group(self, group: dist.ProcessGroup) -> bool:
        key = id(group)
        if key not in self._partition_group_ids:
            if _group_ranks(group) != self.groups.partition_ranks:
                return False
            self._partition_group_ids.add(key)
        return True


class HierarchicalAllGather(_HierarchicalComm, AllGather):
    """All-gather over a multi-node partition in two stages (MiCS §3.3).

    1. across nodes, among the ranks with the same local index: each rank collects the shards of
       its ``k`` peers -- the only traffic on the slow links, in ``m`` parallel streams;
    2. inside the node: each rank collects the ``k``-shard blocks of its ``m`` node-local peers;
    3. a local reorder from (local, node) to shard-rank order (node, local), the layout FSDP expects.

    Any other group FSDP passes (e.g. a smaller post-forward reshard group) gets the flat collective.
    """

    def __call__(
        self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: dist.ProcessGroup, async_op: bool = False
    ) -> Any:
        if not self._is_partition_group(group):
            return all_gather_flat(output_tensor, input_tensor, group, async_op)
        m, k, n = self.groups.ranks_per_node, self.groups.nodes_per_partition, input_tensor.numel()
        across_nodes = torch.empty(k * n, dtype=input_tensor.dtype, device=input_tensor.device)
        all_gather_flat(across_nodes, input_tensor.contiguous(), self.groups.inter_node)
        within_node = torch.empty(m * k * n, dtype=input_tensor.dtype, device=input_tensor.device)
        all_gather_flat(within_node, across_nodes, self.groups.intra_node)
        output_tensor.view(k, m, n).copy_(within_node.view(m, k, n).transpose(0, 1))
        return None


class HierarchicalReduceScatter(_HierarchicalComm, ReduceScatter):
    """Reduce-scatter over a multi-node partition: the mirror of :class:`HierarchicalAllGather`.

    1. a local reorder so that the blocks destined for each local index are contiguous;
    2. reduce-scatter inside the node: each rank gets the node's sum of the ``k`` blocks meant for
       its local index;
    3. reduce-scatter across nodes among same-local-index peers: the only slow-link traffic.
    """

    def __call__(
        self,
        output_tensor: torch.Tensor,
        input_tensor: torch.Tensor,
        group: dist.ProcessGroup,
        op: Any = dist.ReduceOp.SUM,
        async_op: bool = False,
    ) -> Any:
        if not self._is_partition_group(group):
            return reduce_scatter_flat(output_tensor, input_tensor, op, group, async_op)
        m, k = self.groups.ranks_per_node, self.groups.nodes_per_partition
        n = output_tensor.numel()
        by_local = input_tensor.view(k, m, n).transpose(0, 1).contiguous().view(-1)
        node_sum = torch.empty(k * n, dtype=input_tensor.dtype, device=input_tensor.device)
        # AVG composes (mean of means); a pre-multiplied sum must be applied once, in the first stage.
        second_op = op if op in (dist.ReduceOp.SUM, dist.ReduceOp.AVG) else dist.ReduceOp.SUM
        reduce_scatter_flat(node_sum, by_local, op, self.groups.intra_node)
        reduce_scatter_flat(output_tensor, node_sum, second_op, self.groups.inter_node)
        return None


def install_hierarchical_collectives(units: list[Any], groups: HierarchicalGroups) -> None:
    """Use the two-stage collectives in every FSDP unit (FSDP's setter is per unit, not recursive)."""
    all_gather, reduce_scatter = HierarchicalAllGather(groups), HierarchicalReduceScatter(groups)
    for unit in units:
        unit.set_custom_all_gather(all_gather)
        unit.set_custom_reduce_scatter(reduce_scatter)
