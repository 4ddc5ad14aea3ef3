"""Hop 2 run by the engine: pack each unit's gradient shards, start their average across replicas as soon
as they are final, finish before clipping and the step, unpack -- over any transport.

Why the engine runs it rather than FSDP2's 2-D mesh: on the accumulation boundary FSDP2's own hop 2 runs
inside the post-backward of each unit. On GPUs it runs on a side stream, but without CUDA streams -- CPU
ranks, gloo -- it blocks the backward that issued it, so the slowest transfer of the step (the one across
nodes) adds to the compute instead of hiding behind it; a compressed wire and torchft's Manager are not
FSDP2 collectives at all. DDP hides its all-reduce behind backward with buckets; this is the same idea with
FSDP units as the buckets.

How, without a fork of FSDP2 (``overlapped=True``, schedule ``"behind_backward"``): FSDP2 shards on the
partition alone (1-D mesh, hop 1 unchanged) and calls each sharded parameter's post-accumulate-grad hooks
once its reduce-scattered gradient is in place (accumulated with earlier micro-steps'). When the last
parameter of a unit reports on a boundary micro-step (FSDP2's ``set_requires_all_reduce`` flag, which the
strategy's accumulation contexts set), the unit's shards are packed into one flat message and its average is
*started* through the transport; a staged wire's second stage starts when the next unit's first stage has
started -- at the same point on every rank, since collectives on one group must start in the same order
everywhere. Before clipping and the optimizer step (:meth:`CrossReplicaPipeline.before_step`) every unit's
average is finished and written back; units whose hook never fired for every parameter (a parameter without a
gradient) are sent then. ``overlapped=False`` (schedule ``"after_backward"``) packs every shard of the model
into one message at :meth:`~CrossReplicaPipeline.before_step`.

Finally the transport says whether the step counts (torchft: did every group finish it); if not, every
gradient is dropped so that the optimizer step changes nothing.

Numbers: fp32 sums each packed message with one all-reduce and then divides by the replication degree, where
FSDP2 splits the divide around its all-reduce: the same sum, not always the same last bit. A compressed wire
cuts its pieces and int8 blocks per message, within the same bound (one rounding of each message and one of
the sum).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Optional

import torch
from torch import Tensor, nn
from torch.distributed.fsdp import FSDPModule
from torch.optim import Optimizer
from torch.utils.hooks import RemovableHandle

from lightning_mics import _compat as compat
from lightning_mics.shards import fsdp_units, local_shard, padded_shard_numel
from lightning_mics.hop2.shares import ShareGradients
from lightning_mics.hop2.transport import InFlight, ManagedTransport, ProcessGroupTransport, Transport

if TYPE_CHECKING:
    from lightning_mics.fault_tolerance.group import ReplicaGroup
    from lightning_mics.layout import MiCSLayout


# --------------------------------------------------------------------------------------------- packing
def pack_gradient_shards(params: Sequence[Tensor]) -> Tensor:
    """This rank's gradient shards of ``params`` in one flat buffer (each at its padded size, zeros in the
    padding): one message for the cross-replica hop instead of one per parameter."""
    first = local_shard(params[0].grad)  # type: ignore[arg-type]
    flat = torch.zeros(sum(padded_shard_numel(p) for p in params), dtype=first.dtype, device=first.device)
    offset = 0
    for param in params:
        grad = local_shard(param.grad).reshape(-1)  # type: ignore[arg-type]
        flat[offset : offset + grad.numel()].copy_(grad)
        offset += padded_shard_numel(param)
    return flat


def unpack_gradient_shards(flat: Tensor, params: Sequence[Tensor]) -> None:
    """Copy a buffer :func:`pack_gradient_shards` made (and a collective reduced) back into the gradients. A
    gradient dropped since it was packed (``zero_grad(set_to_none=True)`` while the sum was in flight) has
    nothing to receive; the others still take theirs, at the offsets they were packed at."""
    offset = 0
    for param in params:
        if param.grad is not None:
            grad = local_shard(param.grad).view(-1)
            grad.copy_(flat[offset : offset + grad.numel()])
        offset += padded_shard_numel(param)


# --------------------------------------------------------------------------------------------- pipeline
@dataclass
class _Message:
    """One unit's (or the whole model's) average in flight: its packed shards and where they go back."""

    params: list[Tensor]
    flat: Tensor
    average: InFlight


class CrossReplicaPipeline:
    """Hop 2 of ``module`` over ``transport``, per FSDP unit behind backward (``overlapped``) or as one message
    after it (module docstring). The engine's :class:`StepHook`."""

    def __init__(
        self, module: nn.Module, transport: Transport, overlapped: bool, shares: Optional[ShareGradients] = None
    ) -> None:
        self.module = module
        self.transport = transport
        self.overlapped = overlapped
        #: ``exact_trajectory``: the data shares' gradients kept apart, packed one row per share
        self.shares = shares
        #: per unit, in module order: the parameters it manages that train
        self._unit_params: list[list[Tensor]] = []
        self._units: list[FSDPModule] = []
        #: per unit index: the parameters that reported since its last average started
        self._reported: dict[int, set[int]] = {}
        #: averages in flight, by unit index (-1: the whole model), in the order they started (the same on
        #: every rank)
        self._in_flight: dict[int, _Message] = {}
        self._handles: list[RemovableHandle] = []
        if overlapped:
            self._watch_units()

    def _watch_units(self) -> None:
        for unit in fsdp_units(self.module):
            params = [p for p in compat.fsdp_unit_parameters(unit) if p.requires_grad]
            if not params:
                continue
            index = len(self._units)
            self._units.append(unit)
            self._unit_params.append(params)
            for param in params:
                self._handles.append(param.register_post_accumulate_grad_hook(self._reporter(index)))

    def _reporter(self, index: int):  # type: ignore[no-untyped-def]
        def report(param: Tensor) -> None:
            self._on_gradient(index, param)

        return report

    def _on_gradient(self, index: int, param: Tensor) -> None:
        """FSDP2 placed ``param``'s reduce-scattered gradient: on a boundary micro-step, start the unit's
        average once all its parameters reported, and move the averages in flight along."""
        if not self.transport.active or not compat.fsdp_requires_all_reduce(self._units[index]):
            return
        reported = self._reported.setdefault(index, set())
        reported.add(id(param))
        if len(reported) == len(self._unit_params[index]):
            self._start_unit(index)

    @torch.no_grad()
    def _start_unit(self, index: int) -> None:
        """A unit that reports again before a step (a second boundary backward) supersedes its earlier average,
        which is still completed, on every rank alike."""
        self._reported.pop(index, None)
        earlier = self._in_flight.pop(index, None)
        if earlier is not None:
            earlier.average.wait()
        self._start(index, [p for p in self._unit_params[index] if p.grad is not None])

    def _start(self, key: int, params: list[Tensor]) -> None:
        if not params:
            return
        if self.shares is None:
            flat = pack_gradient_shards(params)
        else:
            flat = self.shares.pack(params, [padded_shard_numel(p) for p in params])  # [shares, n]: row 0 gets it
        average = self.transport.start_average(flat)
        for earlier in self._in_flight.values():  # the earlier messages' next stage, one message behind
            earlier.average.advance()
        self._in_flight[key] = _Message(params, flat, average)

    def before_step(self) -> None:
        """Finish every average and write it into the gradient shards; drop the gradients of a step the
        transport does not commit."""
        self.finish()
        if not self.transport.commit():
            self.drop_gradients()

    @torch.no_grad()
    def finish(self) -> None:
        """Finish every average (starting, in unit order, those whose parameters did not all report; or, not
        overlapped, the whole model's) and write them into the gradient shards."""
        if not self.transport.active:
            return
        if self.overlapped:
            for index in sorted(self._reported):  # same set on every rank: the same parameters have gradients
                self._start_unit(index)
        else:
            self._start(-1, [p for p in self.module.parameters() if p.grad is not None])
        for message in self._in_flight.values():  # every stage started before the first wait
            message.average.flush()
        for message in self._in_flight.values():
            message.average.wait()
            unpack_gradient_shards(message.flat if message.flat.dim() == 1 else message.flat[0], message.params)
            if message.flat.is_cuda:  # allocated on FSDP2's reduce-scatter stream, last read on this one
                message.flat.record_stream(torch.cuda.current_stream())
        self._in_flight.clear()
        if self.shares is not None:
            self.shares.clear()

    def drop_gradients(self) -> None:
        """A step that does not count: without gradients the optimizer step changes nothing (parameters and
        optimizer states)."""
        for param in self.module.parameters():
            param.grad = None
        if self.shares is not None:
            self.shares.clear()

    @property
    def units_in_flight(self) -> int:
        """Messages whose average has started and not yet been written back."""
        return len(self._in_flight)

    def after_step(self) -> None:
        """Nothing to do after the optimizer step."""

    def remove(self) -> None:
        """Detach the gradient hooks (the model is handed to another strategy or the run ends)."""
        for handle in self._handles:
            handle.remove()
        self._handles.clear()


class EachModel:
    """Hop 2 of every model one optimizer steps (Fabric lets an optimizer hold several models' parameters),
    model by model, in the order the optimizer was set up with them (the same on every rank); the step is
    committed once, for all of them (the models share the engine's transport)."""

    def __init__(self, pipelines: Sequence[CrossReplicaPipeline]) -> None:
        self.pipelines = list(pipelines)

    def before_step(self) -> None:
        for pipeline in self.pipelines:
            pipeline.finish()
        if not self.pipelines[0].transport.commit():
            for pipeline in self.pipelines:
                pipeline.drop_gradients()

    def after_step(self) -> None:
        for pipeline in self.pipelines:
            pipeline.after_step()


# --------------------------------------------------------------------------------------------- attaching
def attach(
    optimizers: Sequence[Optimizer],
    modules: Sequence[nn.Module],
    layout: MiCSLayout,
    attached: Mapping[int, object],
    replica_group: Optional[ReplicaGroup],
) -> dict[int, CrossReplicaPipeline | EachModel]:
    """The step hook of each optimizer (by ``id``): the pipeline of the one model it steps, or of each of its
    models (:class:`EachModel`). A model keeps the pipeline it already has among ``attached`` (Fabric sets up
    several optimizers for one model: its gradients cross replicas once)."""
    existing = {id(pipeline.module): pipeline for pipeline in pipelines_in(attached.values())}
    pipelines = [existing.get(id(module)) or _pipeline(module, layout, replica_group) for module in modules]
    if not pipelines:
        return {}
    hook = pipelines[0] if len(pipelines) == 1 else EachModel(pipelines)
    return {id(optimizer): hook for optimizer in optimizers}


def _pipeline(module: nn.Module, layout: MiCSLayout, replica_group: Optional[ReplicaGroup]) -> CrossReplicaPipeline:
    """Hop 2 of ``module`` over the transport the layout names (:class:`~lightning_mics.hop2.Hop2`): torchft's
    Manager (``managed``; with ``exact_trajectory`` the data shares' gradients kept apart) or the replication group."""
    hop2 = layout.settings.hop2
    transport: Transport
    shares: Optional[ShareGradients] = None
    if hop2.managed:
        assert replica_group is not None, "join_fault_domain() runs before the optimizers are attached"
        exact = replica_group.options.exact_trajectory
        transport = ManagedTransport(replica_group, layout.settings.cross_replica_wire, in_share_order=exact)
        if exact:
            shares = ShareGradients(module)
    else:
        transport = ProcessGroupTransport(layout.device_mesh.get_group(0), layout.settings.cross_replica_wire)
    return CrossReplicaPipeline(module, transport, overlapped=hop2.overlapped, shares=shares)


def pipelines_in(hooks: Iterable[object]) -> list[CrossReplicaPipeline]:
    """The pipelines among step hooks, each once, in the order the hooks hold them (the same on every rank)."""
    found: dict[int, CrossReplicaPipeline] = {}
    for hook in hooks:
        members = hook.pipelines if isinstance(hook, EachModel) else [hook]
        for pipeline in members:
            if isinstance(pipeline, CrossReplicaPipeline):
                found.setdefault(id(pipeline), pipeline)
    return list(found.values())
