"""Hop 2 behind backward: each FSDP unit's gradient shards cross the replication group as soon as they
are final, while backward computes the units before it.

Why: on the accumulation boundary FSDP2's own hop 2 (the all-reduce of a 2-D mesh) runs inside the
post-backward of each unit. On GPUs it runs on a side stream, but without CUDA streams -- CPU ranks,
gloo -- it blocks the backward that issued it, so the slowest transfer of the step (the one across
nodes) adds to the compute instead of hiding behind it; and a compressed hop 2 (``cross_replica_dtype``)
ran once after backward, behind nothing. DDP hides its all-reduce behind backward with buckets; this is
the same idea with FSDP units as the buckets.

How, without a fork of FSDP2: FSDP2 shards on the partition alone (1-D mesh, hop 1 unchanged) and calls
each sharded parameter's post-accumulate-grad hooks once its reduce-scattered gradient is in place
(accumulated with earlier micro-steps'). When the last parameter of a unit reports on a boundary
micro-step (FSDP2's ``set_requires_all_reduce`` flag, which the strategy's accumulation contexts already
set), the unit's shards are packed into one flat message and its cross-replica sum is *started*
asynchronously (fp32: one all-reduce; bf16/int8: the staged :class:`~lightning_mics.collectives.
CompressedAllReduce`, whose second stage starts when the next unit's first stage has started -- at the same
point on every rank, since collectives on one group must start in the same order everywhere). Before
clipping and the optimizer step (:meth:`before_step`) every unit's sum is finished, divided by the
replication degree (FSDP2 already averaged over the partition) and written back; units whose hook never
fired for every parameter (a parameter without a gradient) are sent then.

Numbers: fp32 sums each unit's packed shards with one all-reduce and then divides by the replication
degree, where FSDP2 splits the divide around its all-reduce: the same sum, not always the same last bit.
A compressed wire now cuts its pieces and int8 blocks per unit instead of across the whole model, within
the same bound (one rounding of each message and one of the sum).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional, Union

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.fsdp import FSDPModule
from torch.utils.hooks import RemovableHandle

from lightning_mics import _compat as compat
from lightning_mics.collectives import CompressedAllReduce
from lightning_mics.grad_sync import fsdp_units, pack_gradient_shards, unpack_gradient_shards
from lightning_mics.wire import WireFormat


class _PlainAllReduce:
    """An fp32 (the gradients' dtype) sum started asynchronously: the driver of :class:`CompressedAllReduce`'s
    interface for an uncompressed hop."""

    def __init__(self, tensor: Tensor, group: dist.ProcessGroup) -> None:
        self.work = dist.all_reduce(tensor, group=group, async_op=True)

    def advance(self) -> None:
        """Nothing to advance: one collective."""

    def wait(self) -> None:
        self.work.wait()


@dataclass
class _UnitSum:
    """One unit's cross-replica sum in flight: its packed shards and the parameters to unpack them into."""

    params: list[Tensor]
    flat: Tensor
    reduction: Union[_PlainAllReduce, CompressedAllReduce]


class OverlappedCrossReplicaSync:
    """Hop 2 started per FSDP unit during the boundary backward and finished before the optimizer step
    (module docstring). ``wire``: the compressed format of ``cross_replica_dtype``, or ``None`` for the
    gradients' own dtype. The hook protocol of the engine's step hooks: :meth:`before_step`, :meth:`after_step`."""

    def __init__(self, module: nn.Module, replica_group: dist.ProcessGroup, wire: Optional[WireFormat]) -> None:
        self.module = module
        self.replica_group = replica_group
        self.wire = wire
        self.replicas = replica_group.size()
        #: per unit, in module order: the parameters it manages that train
        self._unit_params: list[list[Tensor]] = []
        self._units: list[FSDPModule] = []
        #: per unit index: the parameters that reported since its last sum started
        self._reported: dict[int, set[int]] = {}
        #: sums in flight, by unit index, in the order they started (the same on every rank)
        self._in_flight: dict[int, _UnitSum] = {}
        self._handles: list[RemovableHandle] = []
        for unit in fsdp_units(module):
            params = [p for p in compat.fsdp_unit_parameters(unit) if p.requires_grad]
            if not params:
                continue
            index = len(self._units)
            self._units.append(unit)
            self._unit_params.append(params)
            for param in params:
                self._handles.append(param.register_post_accumulate_grad_hook(self._reporter(index)))

    def _reporter(self, index: int) -> Any:
        def report(param: Tensor) -> None:
            self._on_gradient(index, param)

        return report

    def _on_gradient(self, index: int, param: Tensor) -> None:
        """FSDP2 placed ``param``'s reduce-scattered gradient: on a boundary micro-step, start the unit's sum
        once all its parameters reported, and move the sums in flight along."""
        if self.replicas == 1 or not compat.fsdp_requires_all_reduce(self._units[index]):
            return
        reported = self._reported.setdefault(index, set())
        reported.add(id(param))
        if len(reported) == len(self._unit_params[index]):
            self._start(index)

    @torch.no_grad()
    def _start(self, index: int) -> None:
        """Pack the unit's gradient shards and start their sum. A unit that reports again before a step (a
        second boundary backward) supersedes its earlier sum, which is still completed, on every rank alike."""
        self._reported.pop(index, None)
        earlier = self._in_flight.pop(index, None)
        if earlier is not None:
            earlier.reduction.wait()
        params = [p for p in self._unit_params[index] if p.grad is not None]
        if not params:
            return
        flat = pack_gradient_shards(params)
        reduction: Union[_PlainAllReduce, CompressedAllReduce]
        if self.wire is None:
            reduction = _PlainAllReduce(flat, self.replica_group)
        else:
            reduction = CompressedAllReduce(flat, self.replica_group, self.wire)
        for earlier_sum in self._in_flight.values():  # the previous units' second stage, one unit behind
            earlier_sum.reduction.advance()
        self._in_flight[index] = _UnitSum(params, flat, reduction)

    @torch.no_grad()
    def before_step(self) -> None:
        """Finish every unit's sum (starting, in unit order, those whose parameters did not all report) and
        write the replica average into the gradient shards."""
        if self.replicas == 1:
            return
        for index in sorted(self._reported):  # same set on every rank: the same parameters have gradients
            self._start(index)
        for unit_sum in self._in_flight.values():
            unit_sum.reduction.wait()
            unit_sum.flat.div_(self.replicas)
            unpack_gradient_shards(unit_sum.flat, unit_sum.params)
            if unit_sum.flat.is_cuda:  # allocated on FSDP2's reduce-scatter stream, last read on this one
                unit_sum.flat.record_stream(torch.cuda.current_stream())
        self._in_flight.clear()

    @property
    def units_in_flight(self) -> int:
        """Units whose cross-replica sum has started and not yet been written back."""
        return len(self._in_flight)

    def after_step(self) -> None:
        """Nothing to do after the optimizer step (the hook protocol of the strategy's step)."""

    def remove(self) -> None:
        """Detach the gradient hooks (the model is handed to another strategy or the run ends)."""
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

