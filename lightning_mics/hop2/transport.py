"""What carries hop 2's messages: the replication process group, or torchft's Manager across fault domains.

The pipeline (:mod:`lightning_mics.hop2.pipeline`) packs, starts and unpacks; a transport only has to
*start* an average of one flat buffer asynchronously and say, at the end of the step, whether the step
counts. A new transport is one class here with :meth:`Transport.start_average`, :meth:`Transport.commit`
and :attr:`Transport.active`; a new wire format is one entry in :mod:`lightning_mics.wire` (the encoded
collectives live in :mod:`lightning_mics.collectives`).

Every transport leaves the **average over the replicas taking part** in the buffer when its
:class:`InFlight` is waited on, whatever the wire: the replication group sums and divides by its size;
torchft averages over the quorum's groups.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Optional, Protocol

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_mics import wire as wire_codec
from lightning_mics.collectives import CompressedAllReduce
from lightning_mics.wire import WireFormat

if TYPE_CHECKING:
    from lightning_mics.fault_tolerance.group import ReplicaGroup


class InFlight(Protocol):
    """One buffer's average, started. Collectives on one group must start in the same order on every rank:
    :meth:`advance` is called at the same point everywhere (when the next buffer starts), never on local
    completion."""

    def advance(self) -> None:
        """Start the next stage, if the wire has one (the compressed hop's all-gather)."""

    def flush(self) -> None:
        """Start every stage left, now: no message starts after the step's last ones, so nothing would advance
        them (called in start order at the same point on every rank, before any is waited on)."""

    def wait(self) -> None:
        """Finish: the average is in the buffer."""


class Transport(Protocol):
    """Where hop 2 travels (module docstring)."""

    @property
    def active(self) -> bool:
        """Whether there is anyone to average with (a replication group of one has nobody)."""

    def start_average(self, flat: Tensor) -> InFlight:
        """Start averaging ``flat`` in place across the replicas."""

    def commit(self) -> bool:
        """After every average of the step finished: whether the optimizer may step (``False``: a replica
        failed during the step, whose gradients must then be dropped)."""


# ------------------------------------------------------------------------------------------ process group
class _SumThenDivide:
    """A sum over ``replicas`` started by ``reduction`` (with ``wait``/``advance``), divided on completion."""

    def __init__(self, flat: Tensor, reduction: Any, replicas: int) -> None:
        self.flat, self.reduction, self.replicas = flat, reduction, replicas

    def advance(self) -> None:
        advance = getattr(self.reduction, "advance", None)
        if advance is not None:
            advance()

    def flush(self) -> None:
        self.advance()  # the compressed hop's all-gather; a plain all-reduce has no stage left

    def wait(self) -> None:
        self.reduction.wait()
        self.flat.div_(self.replicas)


class ProcessGroupTransport:
    """The replication process group of this world (gloo or NCCL; the hierarchical layouts' replication group
    is flat: same-local-rank peers of different nodes). fp32 (the gradients' own dtype): one asynchronous
    all-reduce per buffer; a compressed ``wire``: :class:`~lightning_mics.collectives.CompressedAllReduce`
    (all-to-all, fp32 sums, all-gather), staged so that it can run behind backward."""

    def __init__(self, group: dist.ProcessGroup, wire: Optional[WireFormat]) -> None:
        self.group = group
        self.wire = wire
        self.replicas = group.size()

    @property
    def active(self) -> bool:
        return self.replicas > 1

    def start_average(self, flat: Tensor) -> InFlight:
        if self.wire is None:
            reduction: Any = dist.all_reduce(flat, group=self.group, async_op=True)
        else:
            reduction = CompressedAllReduce(flat, self.group, self.wire)
        return _SumThenDivide(flat, reduction, self.replicas)

    def commit(self) -> bool:
        """A process group fails loudly (its collective raises): a step that got here counts."""
        return True


# ------------------------------------------------------------------------------------------------ torchft
class _Nothing:
    """Nothing in flight: torchft already recorded a failure this step, which will not commit."""

    def advance(self) -> None:
        """Nothing to advance."""

    def flush(self) -> None:
        """Nothing to start."""

    def wait(self) -> None:
        """Nothing to finish; the buffer keeps this rank's values (the step is dropped)."""


class _ManagedAverage:
    """A sum over torchft's process group, divided here by the groups that contributed (a catching-up group sends
    zeros); a 16-bit ``message`` is written back into ``flat`` on completion."""

    def __init__(self, flat: Tensor, message: Tensor, summed: Any, contributors: int) -> None:
        self.flat, self.message, self.summed, self.contributors = flat, message, summed, contributors

    def advance(self) -> None:
        """One collective."""

    def flush(self) -> None:
        """One collective, started."""

    def wait(self) -> None:
        self.summed.wait()
        self.message.div_(self.contributors)
        if self.message is not self.flat:
            self.flat.copy_(self.message)


class _ManagedGatherAverage:
    """int8: every group's blockwise message all-gathered (torchft has no int8 sum), decoded and summed in
    fp32 in quorum order -- the same bytes and order in every group, so every group gets the same average."""

    def __init__(self, flat: Tensor, gathered: list[Tensor], future: Any, group: ReplicaGroup) -> None:
        self.flat, self.gathered, self.future, self.group = flat, gathered, future, group

    def advance(self) -> None:
        """One collective."""

    def flush(self) -> None:
        """One collective, started."""

    def wait(self) -> None:
        self.future.wait()
        if self.group.manager.errored() is not None:
            return  # a failure: the step will not commit
        total = torch.zeros(self.flat.numel(), dtype=torch.float32, device=self.flat.device)
        for message in self.gathered:
            total += wire_codec.decode(message, self.flat.numel())
        self.flat.copy_(total.div_(self.group.contributing_groups()))


def _finished(started: Optional[tuple[Tensor, Any]], group: ReplicaGroup) -> Optional[Tensor]:
    """The output of a collective :meth:`ReplicaGroup._start` started, once it finished -- ``None`` if it was never
    started or the step failed meanwhile (the step will not commit: nothing is summed)."""
    if started is None:
        return None
    output, future = started
    future.wait()
    return None if group.manager.errored() is not None else output


def _sum_in_share_order(blocks: Tensor, holders: list[tuple[int, int]], out: Tensor) -> Tensor:
    """``out`` = the data shares' blocks (``blocks[quorum rank, slot]`` for each share's holder, in share order)
    added one after the other in fp32 and divided by their number: one fixed order of additions, whichever group
    read which share -- what makes ``exact_trajectory``'s sum the same bits in every run."""
    (rank, slot), *rest = holders
    if rest:  # the first addition writes ``out`` (the same bits as copying the first block, then adding)
        (second_rank, second_slot), *rest = rest
        torch.add(blocks[rank, slot], blocks[second_rank, second_slot], out=out)
    else:
        out.copy_(blocks[rank, slot])
    for rank, slot in rest:
        out.add_(blocks[rank, slot])
    return out.div_(len(holders))


#: A message's summed slices ride on the all-to-all of the message started this many messages after it.
LAG_BEFORE_SECOND_STAGE = 2


class _ChainedSum:
    """``exact_trajectory``: one message's average of every data share's row, each element summed in share order
    (``share 0 + share 1 + ...`` in fp32, then divided by the number of shares) whichever group read which share
    -- the same bits as in the failure-free run (:mod:`lightning_mics.hop2.shares`). Stage 1: an all-to-all gives
    each quorum rank its slice of every group's rows (padded to the most rows one group has); it sums its slice's
    shares in order. Stage 2 returns the summed slices to every rank -- not as an all-gather of its own but inside
    a later message's all-to-all (:class:`_ShareOrderChain`). While every group reads one share, the bytes of a
    ring all-reduce."""

    def __init__(self, rows: Tensor, group: ReplicaGroup, chain: _ShareOrderChain) -> None:
        self.rows, self.group, self.chain = rows, group, chain
        self.holders, self.slots = group.share_holders()
        self.quorum = group.manager.num_participants()
        self.numel = rows.shape[1]
        self.slice = -(-self.numel // self.quorum)
        #: stage 1 as started: what arrives (``[quorum, slots, slice]``: block ``q`` from quorum rank ``q``), and
        #: its collective
        self.stage_one: Optional[tuple[Tensor, Any]] = None
        #: this rank's slice summed in share order (``None``: not yet, or the step failed)
        self.total: Optional[Tensor] = None
        self._summed = False
        #: stage 2 as started: where every rank's summed slice arrives (``[quorum, slice]``), and the collective
        self.stage_two: Optional[tuple[Tensor, Any]] = None

    def sum_slice(self) -> Optional[Tensor]:
        """Wait for stage 1 and sum this rank's slice in share order (once); ``None`` if the step failed."""
        if not self._summed:
            self._summed = True
            received = _finished(self.stage_one, self.group)
            if received is not None:
                self.total = _sum_in_share_order(received, self.holders, received.new_empty(self.slice))
        return self.total

    def advance(self) -> None:
        """The chain starts stage 2, with a later message's all-to-all."""

    def flush(self) -> None:
        """Stage 2 of every message not yet carried, now (no message starts after the step's last ones)."""
        self.chain.flush()

    def wait(self) -> None:
        if self.stage_two is None:  # waited before a later message carried it (the step's last, or superseded)
            self.chain.flush()
        gathered = _finished(self.stage_two, self.group)
        if gathered is not None:
            _copy_slices_back(gathered, self.rows[0])


def _copy_slices_back(slices: Tensor, out: Tensor) -> None:
    """``out`` = every quorum rank's summed slice (``slices``: ``[quorum, width]``, maybe a strided view of a
    larger receive buffer) laid end to end, the last one cut at ``out``'s end: one copy, no contiguous temporary."""
    width = slices.shape[1]
    whole = out.numel() // width
    out[: whole * width].view(whole, width).copy_(slices[:whole])
    if out.numel() > whole * width:
        out[whole * width :].copy_(slices[whole, : out.numel() - whole * width])


class _ShareOrderChain:
    """``exact_trajectory``'s messages of one step, each summed in two stages (:class:`_ChainedSum`) in one
    collective per message: message ``k``'s all-to-all carries, beside its own blocks, the summed slice of message
    ``k - LAG_BEFORE_SECOND_STAGE`` to every rank -- an all-gather's bytes in the all-to-all that crosses anyway.
    The slices no later message carries (the step's last ones) travel in one all-gather when the first of them is
    waited on. Why: two collectives per message cost this host's gloo 2.0 ms of CPU per 98,304-element message
    against the all-reduce's 1.3 ms; fused, 1.2 ms (3 ranks, measured) -- and on hosts whose cores the ranks
    share, CPU is step time. Every rank starts the same collectives in the same order: which message carries which
    depends only on the order messages start in."""

    def __init__(self) -> None:
        #: messages started whose stage 2 no collective carries yet, in start order
        self.uncarried: list[_ChainedSum] = []

    def start(self, rows: Tensor, group: ReplicaGroup) -> InFlight:
        message = _ChainedSum(rows, group, self)
        quorum, slots, width = message.quorum, message.slots, message.slice
        carried = self.uncarried.pop(0) if len(self.uncarried) >= LAG_BEFORE_SECOND_STAGE else None
        total = None if carried is None else carried.sum_slice()
        if carried is not None and total is None:  # its stage 1 failed: the step will not commit
            return _Nothing()
        # every block: this message's slices of its rows, then (when it carries one) the earlier message's summed
        # slice -- written in place, one copy of the rows
        carried_width = 0 if total is None else total.numel()
        send = rows.new_empty(quorum, slots * width + carried_width)
        _write_slices_by_rank(rows, send[:, : slots * width].view(quorum, slots, width))
        if total is not None:
            send[:, slots * width :].copy_(total.expand(quorum, -1))
        started = group.start_all_to_all(send)
        if started is None:
            return _Nothing()
        received, future = started
        message.stage_one = (received[:, : slots * width].view(quorum, slots, width), future)
        if carried is not None:
            carried.stage_two = (received[:, slots * width :], future)
        self.uncarried.append(message)
        return message

    def flush(self) -> None:
        """Stage 2 of every message not yet carried, in one all-gather of their summed slices."""
        pending, self.uncarried = self.uncarried, []
        totals = [message.sum_slice() for message in pending]
        if not pending or any(total is None for total in totals):  # nothing left, or the step failed
            return
        group, quorum = pending[0].group, pending[0].quorum
        summed = torch.cat(totals)  # type: ignore[arg-type]
        started = group.start_all_gather_into(summed.new_empty(quorum * summed.numel()), summed)
        if started is None:
            return
        gathered, future = started
        by_rank, offset = gathered.view(quorum, summed.numel()), 0
        for message in pending:
            message.stage_two = (by_rank[:, offset : offset + message.slice], future)
            offset += message.slice


class _ShareOrderGather:
    """``exact_trajectory`` in one collective, where that moves no more bytes than :class:`_ChainedSum`'s two
    stages: every quorum rank's rows all-gathered (``[slots, n]`` each, padded to the most rows one group has),
    then each element summed here in share order and divided by the number of shares -- the same operations on the
    same values as the two stages, so the same bits. Why: the two stages wait in the main thread for stage 1
    before a later message can carry stage 2, and the step's last messages need a collective of their own; where
    the quorum is two groups reading one share each (or one group alone), the all-gather receives what the two
    stages do, in one collective and one wait (:func:`gather_moves_no_more`)."""

    def __init__(self, rows: Tensor, group: ReplicaGroup) -> None:
        self.rows, self.group = rows, group
        self.holders, self.slots = group.share_holders()
        self.quorum = group.manager.num_participants()
        count, self.numel = rows.shape
        message = rows
        if count != self.slots:  # this group reads fewer shares than the group reading the most: zero rows
            message = rows.new_zeros(self.slots, self.numel)
            message[:count].copy_(rows)
        self.gathered = group.start_all_gather_into(
            rows.new_empty(self.quorum * self.slots * self.numel), message.reshape(-1)
        )

    def advance(self) -> None:
        """One collective."""

    def flush(self) -> None:
        """One collective, started."""

    def wait(self) -> None:
        out = _finished(self.gathered, self.group)
        if out is not None:
            _sum_in_share_order(out.view(self.quorum, self.slots, self.numel), self.holders, self.rows[0])


def gather_moves_no_more(quorum: int, slots: int) -> bool:
    """Whether one all-gather of every group's ``slots`` rows receives no more than the two stages of
    :class:`_ChainedSum` (an all-to-all of ``slots`` rows' slices, then an all-gather of one row's): per rank
    ``(q - 1) s`` rows against ``(q - 1)(s + 1) / q`` -- equal for two groups reading one share each, nothing
    for a group alone, more in every other case."""
    return quorum * slots <= slots + 1


def _write_slices_by_rank(rows: Tensor, blocks: Tensor) -> None:
    """Write ``rows`` (``[rows, n]``) into ``blocks`` (``[quorum, slots, width]``, a view of stage 1's send
    buffer) as the all-to-all sends them: block ``q`` holds every row's ``q``-th slice of ``width`` elements --
    zeros past a row's end, and in the rows this group lacks (it reads fewer shares than the group reading the
    most). One copy of the rows."""
    quorum, slots, width = blocks.shape
    count, numel = rows.shape
    if count == slots and numel == quorum * width:
        blocks.copy_(rows.view(slots, quorum, width).transpose(0, 1))
        return
    blocks.zero_()
    by_row = blocks.transpose(0, 1)  # [slots, quorum, width]: a view
    whole = numel // width
    if whole:
        by_row[:count, :whole].copy_(rows[:, : whole * width].reshape(count, whole, width))
    if numel > whole * width:
        by_row[:count, whole, : numel - whole * width].copy_(rows[:, whole * width :])


class ManagedTransport:
    """Hop 2 through this replica group's torchft Manager (:class:`lightning_mics.fault_tolerance.ReplicaGroup`):
    averaged over the groups in this step's quorum, and the step commits only if every rank of every group
    finished it. A failure never raises here: torchft records it and :meth:`commit` refuses the step.

    With a 16-bit ``wire`` the buffer crosses in that dtype and torchft sums in it: half the bytes, one rounding
    per group added (G - 1 for G groups) plus the message's own, where the replication group's compressed hop
    sums in fp32. With int8 each group's buffer is encoded blockwise (a quarter of the bytes plus a scale per
    block) and all-gathered: the all-gather receives G - 1 messages where a ring all-reduce moves
    2 (G - 1) / G buffers, so int8 halves bf16's bytes for 2 groups, equals them for 4 and costs more beyond."""

    def __init__(
        self, group: ReplicaGroup, wire: Optional[WireFormat], in_share_order: bool = False
    ) -> None:
        self.group = group
        self.wire = wire
        #: ``exact_trajectory``: buffers are ``[shares, n]``, one row per data share this group read; the average
        #: over the job's shares is summed in share order, whoever read which (:class:`_ChainedSum`), into row 0
        self.in_share_order = in_share_order
        self._chain = _ShareOrderChain()

    @property
    def active(self) -> bool:
        """Always: how many groups take part is known only at each step's quorum (one is cheap)."""
        return True

    def start_average(self, flat: Tensor) -> InFlight:
        manager = self.group.manager
        if manager.errored() is not None:
            return _Nothing()
        if not self.group.contributes:  # catching up: its gradients come from stale shards; it only receives
            flat.zero_()
        if self.wire is not None and self.wire.dtype is None:  # int8
            return self._start_gather(flat)
        if self.in_share_order:  # no wire: exact_trajectory refuses one
            _, slots = self.group.share_holders()
            if gather_moves_no_more(self.group.manager.num_participants(), slots):
                return _ShareOrderGather(flat, self.group)
            return self._chain.start(flat, self.group)
        message = flat if self.wire is None else flat.to(self.wire.dtype)
        started = self.group.start_all_reduce_sum(message)
        if started is None:
            return _Nothing()
        return _ManagedAverage(flat, message, started, self.group.contributing_groups())

    def _start_gather(self, flat: Tensor) -> InFlight:
        started = self.group.start_all_gather(wire_codec.encode(flat))
        if started is None:
            return _Nothing()
        gathered, future = started
        return _ManagedGatherAverage(flat, gathered, future, self.group)

    def commit(self) -> bool:
        return self.group.commit()
