"""Collectives: what crosses which group, and how.

* :class:`CollectiveRecorder` records every all-gather, reduce-scatter, all-reduce and broadcast
  this process issues while it is active -- by FSDP2, Lightning or anyone else -- with the ranks of
  the group and the bytes of the payload. Tests use it to prove the 2-hop schedule (which collective
  runs on which group in which micro-step); telemetry uses it to report bytes per step.
* :func:`ring_reduce_scatter`: gloo has no reduce-scatter algorithm -- its ``reduce_scatter_tensor``
  all-reduces the whole input and keeps one chunk, twice the bytes of a real reduce-scatter on every
  link. On gloo (CPU tensors) we reduce-scatter over a ring of point-to-point messages instead
  (:class:`RingReduceScatter` is FSDP2's comm for it).
* :class:`HierarchicalAllGather` / :class:`HierarchicalReduceScatter`: MiCS's two-stage collectives
  for partitions that span nodes.
"""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.distributed as dist

from lightning_mics import wire as wire_codec
from lightning_mics._compat import AllGather, ReduceScatter, TorchDispatchMode, dispatch_mode_stack, unbox_process_group
from lightning_mics.wire import WireFormat


@dataclass(frozen=True)
class CollectiveCall:
    """One collective as seen by this rank."""

    kind: str  #: "all_gather", "reduce_scatter", "all_reduce" or "broadcast"
    ranks: tuple[int, ...]  #: global ranks of the group it ran on (``()``: a group outside this world)
    bytes: int  #: payload bytes: the full (gathered / pre-scatter / reduced) buffer on this rank
    step: int  #: the value of :attr:`CollectiveRecorder.step` when it was issued


def _group_ranks(group: Any) -> tuple[int, ...]:
    """The global ranks of ``group``; ``()`` for a group that is not part of this world -- torchft's
    reconfigurable groups across replica groups (fault tolerance), each rank's peers in other jobs."""
    if group is None or group is dist.GroupMember.WORLD:
        return tuple(range(dist.get_world_size()))
    try:
        return tuple(dist.get_process_group_ranks(group))
    except KeyError:
        return ()


def _nbytes(value: Any) -> int:
    """Bytes of a tensor, or of all tensors in a (nested) list of them; 0 for anything else."""
    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    if isinstance(value, (list, tuple)):
        return sum(_nbytes(v) for v in value)
    return 0


@dataclass(frozen=True)
class _C10dOp:
    """How to read one c10d dispatcher op: its kind, which arguments hold its tensors and its group,
    and whether it is a coalesced op (one collective per position of its tensor lists)."""

    kind: str
    tensor_args: tuple[int, ...]
    group_arg: int
    coalesced: bool


def _c10d_ops() -> dict[Any, _C10dOp]:
    """The c10d dispatcher ops every ``torch.distributed`` collective of a tracked kind ends in, on any
    backend: ``all_gather_single`` / ``all_gather_into_tensor`` -> ``_allgather_base_``, the list forms
    -> ``allgather_`` / ``reduce_scatter_``, ``all_reduce`` -> ``allreduce_``, ``broadcast`` (and the
    object collectives built on these) -> ``broadcast_`` / ``allgather_``; inside a coalescing
    manager gloo issues the ``*_coalesced_`` forms. Point-to-point (``send`` / ``recv_``), barriers,
    ``reduce`` / ``gather`` / ``scatter`` / all-to-all are not tracked kinds. Ops a torch version
    lacks are skipped. Argument positions come from each op's schema."""
    kinds = {
        "_allgather_base_": ("all_gather", False),
        "allgather_": ("all_gather", False),
        "allgather_coalesced_": ("all_gather", True),
        "allgather_into_tensor_coalesced_": ("all_gather", True),
        "_reduce_scatter_base_": ("reduce_scatter", False),
        "reduce_scatter_": ("reduce_scatter", False),
        "reduce_scatter_tensor_coalesced_": ("reduce_scatter", True),
        "allreduce_": ("all_reduce", False),
        "allreduce_coalesced_": ("all_reduce", True),
        "broadcast_": ("broadcast", False),
    }
    ops: dict[Any, _C10dOp] = {}
    for name, (kind, coalesced) in kinds.items():
        packet = getattr(torch.ops.c10d, name, None)
        if packet is None:
            continue
        for overload in packet.overloads():
            op = getattr(packet, overload)
            names = [argument.name for argument in op._schema.arguments]
            group_arg = names.index("process_group")
            # the tensor arguments are the ones before the group (outputs and inputs; allreduce's
            # optional sparse indices come after it and are not payload)
            ops[op] = _C10dOp(kind, tuple(range(group_arg)), group_arg, coalesced)
    return ops


class _RecordingMode(TorchDispatchMode):
    """The dispatch mode behind :class:`CollectiveRecorder`: sees each c10d collective op as the
    dispatcher runs it and appends a :class:`CollectiveCall` to its recorder.

    Why a dispatch mode: every ``torch.distributed`` collective, whatever its Python spelling
    (``all_gather_single`` or the older ``all_gather_into_tensor``, ``_all_gather_base``, the object
    collectives) and whoever calls it (FSDP2, Lightning, DCP), ends in one c10d dispatcher op, so
    nothing in torch has to be replaced to see it. The mode stack is thread-local, which is what
    the recorder needs: it sees what the thread that entered it issues, and autograd carries the
    stack (part of ``at::ThreadLocalState``) into the threads it runs backward on -- on CPU backward
    runs on the calling thread itself, on CUDA in a device thread that gets the caller's modes -- so
    the collectives FSDP2 issues from its backward hooks are seen either way. Threads the program
    starts itself are not seen: FSDP2 and Lightning issue no collectives from one, and the only one
    here that does, the background checkpoint writer, carries no training traffic.

    Composite collectives (:func:`ring_reduce_scatter`) record themselves as one call through
    :func:`_recorded_as_one`, which hides their parts from the mode on this thread meanwhile.
    """

    #: Higher-order operators (``torch.cond``, ``flex_attention`` in eager, ...) reach the mode as a
    #: whole; without this flag torch refuses to run them under it. They run unrecorded, as one op:
    #: a collective inside their body would not be seen (none of FSDP2's or Lightning's is).
    supports_higher_order_operators = True

    def __init__(self, recorder: CollectiveRecorder) -> None:
        super().__init__()
        self.recorder = recorder
        self._ops = _c10d_ops()
        self._hidden = threading.local()  # .depth: inside this many composite collectives

    @classmethod
    def ignore_compile_internals(cls) -> bool:
        """Let ``torch.compile`` compile while a recorder is active (with ``False``, Dynamo would
        silently run every compiled block eagerly); FSDP2's collectives run outside compiled graphs."""
        return True

    def record(self, kind: str, ranks: tuple[int, ...], nbytes: int) -> None:
        if getattr(self._hidden, "depth", 0) == 0:
            self.recorder.calls.append(CollectiveCall(kind, ranks, nbytes, self.recorder.step))

    @contextmanager
    def hiding(self) -> Iterator[None]:
        self._hidden.depth = getattr(self._hidden, "depth", 0) + 1
        try:
            yield
        finally:
            self._hidden.depth -= 1

    def __torch_dispatch__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Optional[dict[str, Any]] = None
    ) -> Any:
        kwargs = kwargs or {}
        op = self._ops.get(func)
        if op is not None:
            self._record_op(func, op, args, kwargs)
        return func(*args, **kwargs)

    def _record_op(self, func: Any, op: _C10dOp, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        schema = func._schema.arguments

        def argument(index: int) -> Any:
            return args[index] if index < len(args) else kwargs.get(schema[index].name)

        ranks = _group_ranks(unbox_process_group(argument(op.group_arg)))
        tensors = [argument(i) for i in op.tensor_args]
        if op.coalesced:  # one collective per position: (output i, input i)
            for per_position in zip(*tensors):
                self.record(op.kind, ranks, max(_nbytes(t) for t in per_position))
        else:  # the gathered output, the pre-scatter input, or the reduced buffer
            self.record(op.kind, ranks, max(_nbytes(t) for t in tensors))


class CollectiveRecorder:
    """Context manager that records the collectives this process issues.

    Example::

        with CollectiveRecorder() as rec:
            loss.backward()
        rec.count("all_reduce")  # how many all-reduces this backward issued

    Nothing in torch is replaced while it records: it pushes a dispatch mode (see
    :class:`_RecordingMode`) onto the thread's mode stack and pops it on exit. Recorders (and other
    dispatch modes) must therefore be exited in the reverse order they were entered. What it sees
    is what the entering thread issues, backward passes included; work on threads of the program's
    own -- e.g. the background checkpoint writer's collectives, in a group of their own -- is not
    training traffic and is not recorded.
    """

    def __init__(self) -> None:
        self.calls: list[CollectiveCall] = []
        #: Free-form step label stamped on each call (tests set it per micro-step).
        self.step: int = 0
        self._mode: Optional[_RecordingMode] = None

    def __enter__(self) -> CollectiveRecorder:
        if self._mode is not None:
            raise RuntimeError("this CollectiveRecorder is already recording")
        self._mode = _RecordingMode(self)
        self._mode.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        if self._mode is None:
            return
        stack = dispatch_mode_stack()
        if not stack or stack[-1] is not self._mode:
            # Popping would remove the other mode instead; refused, and this recorder stays active
            # so that exiting the other one first and then this one still works.
            raise RuntimeError(
                "CollectiveRecorder exited while a dispatch mode entered after it is still active; "
                "exit recorders in the reverse order of entering them"
            )
        self._mode.__exit__(None, None, None)
        self._mode = None

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


@contextmanager
def _recorded_as_one(kind: str, group: Any, payload: torch.Tensor | int) -> Iterator[None]:
    """Record a collective built from other communication (the ring's point-to-point messages) as
    one call of ``kind`` with ``payload``'s bytes (a tensor's, or a number of bytes), in every
    recorder active on this thread, and hide the communication inside the block from them. Scoped
    explicitly: it finds the recorders on the thread's dispatch-mode stack -- the very ones that
    would see a c10d op issued here -- and keeps no state once the block ends."""
    modes = [mode for mode in dispatch_mode_stack() if isinstance(mode, _RecordingMode)]
    if not modes:
        yield
        return
    ranks, nbytes = _group_ranks(group), payload if isinstance(payload, int) else _nbytes(payload)
    with ExitStack() as stack:
        for mode in modes:
            mode.record(kind, ranks, nbytes)
            stack.enter_context(mode.hiding())
        yield


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
    with _recorded_as_one("reduce_scatter", group, input):
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
        self.piece = wire_codec.padded_numel(-(-flat.numel() // n), wire.block)
        self.accumulate = torch.promote_types(tensor.dtype, torch.float32)
        pieces = torch.zeros(n * self.piece, dtype=self.accumulate, device=tensor.device)
        pieces[: flat.numel()].copy_(flat)
        self.wire_device = _wire_device(tensor, self.group)
        self.outgoing = wire_codec.encode_rows(pieces.view(n, self.piece), wire).to(self.wire_device)
        self.incoming = torch.empty_like(self.outgoing)
        with _recorded_as_one("reduce_scatter", self.group, self.outgoing):
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
    with _recorded_as_one("all_gather", group, output):
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
