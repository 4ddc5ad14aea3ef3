"""Collectives: what crosses which group, and how.

* Every collective built here from other communication is recorded as the one it stands for by
  :mod:`lightning_mics.collective_recorder` (which counts collectives; observation lives there).
* :func:`ring_reduce_scatter`: gloo has no reduce-scatter algorithm -- its ``reduce_scatter_tensor``
  all-reduces the whole input and keeps one chunk, twice the bytes of a real reduce-scatter on every
  link. On gloo (CPU tensors) we reduce-scatter over a ring of point-to-point messages instead
  (:class:`RingReduceScatter` is FSDP2's comm for it).
* :class:`HierarchicalAllGather` / :class:`HierarchicalReduceScatter`: MiCS's two-stage collectives
  for partitions that span nodes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.distributed as dist

from lightning_mics import wire as wire_codec
from lightning_mics._compat import AllGather, ReduceScatter
from lightning_mics.collective_recorder import group_ranks, recorded_as_one
from lightning_mics.wire import WireFormat


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


#: torch 2.12 renamed ``all_gather_into_tensor`` / ``reduce_scatter_tensor`` to ``*_single`` and
#: deprecated the old names; resolved once, at import.
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def all_gather_flat(output: torch.Tensor, input: torch.Tensor, group: Any, async_op: bool = False) -> Any:
    """All-gather ``input`` from every rank of ``group`` into ``output``, in group-rank order."""
    return _all_gather_single(output, input, group=group, async_op=async_op)


def reduce_scatter_flat(output: torch.Tensor, input: torch.Tensor, op: Any, group: Any, async_op: bool = False) -> Any:
    """Reduce ``input`` over ``group``; group rank ``i`` receives the ``i``-th block in ``output``.
    On gloo with CPU tensors and a sum or mean, over a ring (:func:`ring_reduce_scatter`)."""
    if not async_op and _ring_applies(input, op, group):
        ring_reduce_scatter(output, input, op, group)
        return None
    return _reduce_scatter_single(output, input, op=op, group=group, async_op=async_op)


_RING_OPS = (dist.ReduceOp.SUM, dist.ReduceOp.AVG)


def _ring_applies(input: torch.Tensor, op: Any, group: Any) -> bool:
    """Gloo moves point-to-point messages from host memory only; other reductions (and NCCL, which
    has a real reduce-scatter) take the backend's own collective."""
    if input.device.type != "cpu" or not any(op == supported for supported in _RING_OPS):
        return False
    return dist.get_world_size(group) > 1 and _backend_name(group) == "gloo"


def ring_reduce_scatter(
    output: torch.Tensor,
    input: torch.Tensor,
    op: Any,
    group: Any,
) -> None:
    """Reduce-scatter over a ring of point-to-point messages: ``n - 1`` steps, in each of which a
    rank passes a partial sum of one block to the next rank and adds its own block to the one it
    receives. Every rank sends ``(n - 1) / n`` of the input once -- half of what gloo's
    all-reduce-based ``reduce_scatter_tensor`` sends. Blocks are summed in ring order starting after
    their owner, so results may differ from gloo's in the last bits (they are the same on every run).
    ``op``: SUM or AVG; ``group`` None is the default group."""
    group = dist.GroupMember.WORLD if group is None else group
    n = dist.get_world_size(group)
    if input.numel() != n * output.numel():
        raise ValueError(f"reduce-scatter input has {input.numel()} elements, expected {n} x {output.numel()}")
    # one reduce-scatter of the whole input to a recorder, as gloo's own would be; its messages are not
    with recorded_as_one("reduce_scatter", group, input):
        _ring_reduce_scatter(output, input, op, group)


def _ring_reduce_scatter(output: torch.Tensor, input: torch.Tensor, op: Any, group: Any) -> None:
    n, rank = dist.get_world_size(group), dist.get_rank(group)
    block = output.numel()
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


def _backend_name(group: Any) -> str:
    """The backend of ``group``, read in one place: the choice of where messages live depends on it
    and nothing else (tests force NCCL's choice through this on gloo)."""
    return str(dist.get_backend(group))


def _wire_device(tensor: torch.Tensor, group: Any) -> torch.device:
    """Where compressed messages live: on the tensor's device, except on gloo, which moves host
    memory only (CUDA tensors there are encoded on the device and their messages staged via the CPU)."""
    return torch.device("cpu") if _backend_name(group) == "gloo" else tensor.device


def _sum_rows(rows: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The rows of ``rows`` added in ``dtype`` in row (= group-rank) order: one fixed order, so the
    result is the same on every rank, backend and run (a reduction kernel may reorder)."""
    total = rows[0].to(dtype, copy=True)
    for row in rows[1:]:
        total.add_(row)
    return total


def compressed_all_reduce_(tensor: torch.Tensor, group: Any, wire: WireFormat) -> None:
    """Sum ``tensor`` in place over ``group``, every message in the compressed ``wire`` format (16-bit
    floats or blockwise int8, :mod:`lightning_mics.wire`), the sums in fp32 on every backend.

    Why not the backend's reduce-scatter on 16-bit messages: NCCL adds them in 16 bits at every ring
    hop, so the error would grow with the number of replicas and differ between backends. Instead:

    1. the flat tensor is cut into one piece per rank (int8: padded to whole blocks) and every piece
       is encoded once (:func:`~lightning_mics.wire.encode_rows`);
    2. an all-to-all gives rank ``i`` every rank's message for piece ``i`` -- the bytes of a ring
       reduce-scatter, ``(n - 1) / n`` of the messages leave each rank; recorded
       (:class:`CollectiveRecorder`) as one reduce-scatter of the messages;
    3. rank ``i`` decodes them and adds them in fp32 (or the tensor's dtype if wider), in
       group-rank order;
    4. it encodes its sum once and the sums are all-gathered; every rank, the owner of a piece too,
       decodes the same bytes, so all ranks end bit-identical.

    Error: one rounding of each rank's input and one of the sum, whatever the number of replicas.
    The message's bytes and the step's collectives are the same on every backend; only where the
    messages live differs (:func:`_wire_device`). Nothing reads a tensor's value on the host.
    """
    CompressedAllReduce(tensor, group, wire).wait()


class CompressedAllReduce:
    """:func:`compressed_all_reduce_` in stages, so that it can run behind other work (hop 2 overlapped
    with backward, :mod:`lightning_mics.hop2.pipeline`): the constructor encodes and starts the
    all-to-all, :meth:`advance` adds the pieces and starts the all-gather, :meth:`wait` finishes and writes
    the sum into the tensor. The arithmetic is the
    same whichever way it is driven."""

    def __init__(self, tensor: torch.Tensor, group: Any, wire: WireFormat) -> None:
        self.tensor, self.wire = tensor, wire
        self.group = dist.GroupMember.WORLD if group is None else group
        n = dist.get_world_size(self.group)
        self.done = n == 1
        if self.done:
            return
        flat = tensor.view(-1)
        self.piece = wire_codec.round_up_to_blocks(-(-flat.numel() // n), wire.block)
        self.accumulate = torch.promote_types(tensor.dtype, torch.float32)
        pieces = torch.zeros(n * self.piece, dtype=self.accumulate, device=tensor.device)
        pieces[: flat.numel()].copy_(flat)
        self.wire_device = _wire_device(tensor, self.group)
        self.outgoing = wire_codec.encode_rows(pieces.view(n, self.piece), wire).to(self.wire_device)
        self.incoming = torch.empty_like(self.outgoing)
        with recorded_as_one("reduce_scatter", self.group, self.outgoing):
            self.exchange = dist.all_to_all_single(self.incoming, self.outgoing, group=self.group, async_op=True)
        self.gather: Any = None
        self.gathered: Optional[torch.Tensor] = None

    def _start_gather(self) -> None:
        """Rank ``i`` adds every rank's message for piece ``i`` in fp32, encodes the sum once and starts
        the all-gather of the sums."""
        self.exchange.wait()
        decoded = wire_codec.decode_rows(self.incoming.to(self.tensor.device), self.wire, self.piece)
        total = _sum_rows(decoded, self.accumulate)
        mine = wire_codec.encode_rows(total.view(1, self.piece), self.wire).to(self.wire_device)
        self.gathered = torch.empty_like(self.outgoing)
        self.gather = all_gather_flat(self.gathered.view(-1), mine.view(-1), self.group, async_op=True)

    def advance(self) -> None:
        """Move on to the all-gather (waiting for the all-to-all if it has not arrived). Call it at the same
        point on every rank -- never on local completion: collectives on one group must start in the same
        order everywhere."""
        if not self.done and self.gather is None:
            self._start_gather()

    def wait(self) -> None:
        """Finish: every rank decodes the same gathered bytes into ``tensor``."""
        if self.done:
            return
        if self.gather is None:
            self._start_gather()
        self.gather.wait()
        assert self.gathered is not None
        flat = self.tensor.view(-1)
        decoded = wire_codec.decode_rows(self.gathered.to(self.tensor.device), self.wire, self.piece)
        flat.copy_(decoded.view(-1)[: flat.numel()])
        self.done = True
        if self.tensor.is_cuda:  # the stages may run on different streams (overlapped: FSDP2's, then the step's)
            for buffer in (self.outgoing, self.incoming, self.gathered):
                if buffer.is_cuda:
                    buffer.record_stream(torch.cuda.current_stream())


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


def direct_all_gather(output: torch.Tensor, input: torch.Tensor, group: Any) -> None:
    """All-gather by direct exchange: every rank sends its shard to each peer and receives each
    peer's shard straight into its place in ``output`` -- all ``n - 1`` transfers at once, one round
    instead of a ring's ``n - 1`` dependent steps. The same bytes leave every rank as in a ring
    (``(n-1)/n`` of the output), but a ring crosses a node boundary only on its few boundary edges,
    while here every pair talks: use it only for groups inside one node (MiCS's partition)."""
    group = dist.GroupMember.WORLD if group is None else group
    n, rank = dist.get_world_size(group), dist.get_rank(group)
    if output.numel() != n * input.numel():
        raise ValueError(f"all-gather output has {output.numel()} elements, expected {n} x {input.numel()}")
    blocks = output.view(n, -1)
    with recorded_as_one("all_gather", group, output):
        requests = []
        for offset in range(1, n):  # pair up as (rank + k, rank - k) so no two ranks wait on each other
            requests.append(dist.isend(input, dist.get_global_rank(group, (rank + offset) % n), group=group))
            source = (rank - offset) % n
            requests.append(dist.irecv(blocks[source], dist.get_global_rank(group, source), group=group))
        blocks[rank].copy_(input.view(-1))
        for request in requests:
            request.wait()


class DirectAllGather(_PlainAllocation, AllGather):
    """FSDP2's all-gather comm on gloo for partitions inside one node: :func:`direct_all_gather`.

    Gloo's ``all_gather_into_tensor`` runs a ring of dependent steps; on loopback the direct
    exchange measured 1.1-1.4x faster for 4 ranks and 3-20 MB outputs
    (``python benchmarks/ring_reduce_scatter.py --all-gather``). Other devices and backends, and
    asynchronous calls, take the backend's own collective."""

    def __call__(
        self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: dist.ProcessGroup, async_op: bool = False
    ) -> Any:
        if async_op or input_tensor.device.type != "cpu" or dist.get_backend(group) != "gloo":
            return all_gather_flat(output_tensor, input_tensor, group, async_op)
        direct_all_gather(output_tensor, input_tensor.contiguous(), group)
        return None


def install_direct_all_gather(units: list[Any]) -> None:
    """Use :class:`DirectAllGather` in every FSDP unit (FSDP's setter is per unit, not recursive)."""
    comm = DirectAllGather()
    for unit in units:
        unit.set_custom_all_gather(comm)


class _HierarchicalComm(_PlainAllocation):
    """Shared parts: allocation and deciding whether a call is for our partition group."""

    def __init__(self, groups: HierarchicalGroups) -> None:
        self.groups = groups
        self._partition_group_ids: set[int] = set()

    def _is_partition_group(self, group: dist.ProcessGroup) -> bool:
        key = id(group)
        if key not in self._partition_group_ids:
            if group_ranks(group) != self.groups.partition_ranks:
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
        # AVG composes (mean of means over equal counts); a pre-multiplied sum is applied once, first.
        second_op = op if _is_sum_or_avg(op) else dist.ReduceOp.SUM
        _reduce_scatter_stage(node_sum, by_local, op, self.groups.intra_node)
        _reduce_scatter_stage(output_tensor, node_sum, second_op, self.groups.inter_node)
        return None


def _is_sum_or_avg(op: Any) -> bool:
    """Whether ``op`` is a plain SUM or AVG (FSDP2 also passes ``PREMUL_SUM(factor)`` objects)."""
    return any(op == plain for plain in (dist.ReduceOp.SUM, dist.ReduceOp.AVG))


def _reduce_scatter_stage(output: torch.Tensor, input: torch.Tensor, op: Any, group: Any) -> None:
    """One stage of :class:`HierarchicalReduceScatter`. A stage over one rank (the node stage with
    ``ranks_per_node=1``) is its input: a sum or mean over one rank is a copy, NCCL's AVG over a single
    rank is not to be trusted (FSDP2 itself avoids it) and gloo implements AVG only in our ring, which
    needs two ranks. A pre-multiplied sum still runs as a collective (it carries its factor)."""
    if dist.get_world_size(group) == 1 and _is_sum_or_avg(op):
        output.copy_(input.view_as(output))
        return
    reduce_scatter_flat(output, input, op, group)


def install_hierarchical_collectives(units: list[Any], groups: HierarchicalGroups) -> None:
    """Use the two-stage collectives in every FSDP unit (FSDP's setter is per unit, not recursive)."""
    all_gather, reduce_scatter = HierarchicalAllGather(groups), HierarchicalReduceScatter(groups)
    for unit in units:
        unit.set_custom_all_gather(all_gather)
        unit.set_custom_reduce_scatter(reduce_scatter)
