"""Semi-synchronous replica groups (``cross_replica_sync="diloco"``): DiLoCo across partition groups.

Why: MiCS keeps every all-gather and reduce-scatter inside a partition group, but a synchronous run still
pays one full-gradient all-reduce across groups (hop 2) per optimizer step. Where the groups sit in different
zones or regions that hop dominates the step. DiLoCo (Douillard et al., 2023) lets each group take ``H`` steps
with its own (inner) optimizer and then averages the groups' *pseudo-gradients* -- the parameter deltas since
the last synchronisation -- which an outer optimizer (Nesterov SGD, lr 0.7, momentum 0.9 in the paper)
applies. A partition group is a DiLoCo worker: FSDP2 shards inside it as always, and only the outer
synchronisation crosses the slow links, ``1/H`` of the synchronous bytes per step.

What runs (the layout's hop 2 is ``"diloco"``, decided once by :func:`lightning_mics.hop2.decide_hop2`):

* inner steps: nothing crosses replicas -- FSDP2 shards on the partition alone, the gradients are reduce-
  scattered inside it (each group's gradient is the mean over its own data), clipping uses the group's own
  norm, and the inner optimizer steps each group's shards;
* after every ``H``-th optimizer step (:meth:`OuterSync.after_step`, the engine's step hook): on each rank,
  ``pseudo-gradient = last synchronised - current`` over its local shards, packed into one message and
  averaged across the replication group (the mesh's replicate dimension, through the hop-2 transport, so a
  compressed ``cross_replica_dtype`` applies to it too); the outer optimizer steps the last-synchronised copy
  with that average as its gradient, and the result is written into the parameters and becomes the new
  last-synchronised copy. Every replica then holds the same parameters again.

This is torchft's ``DiLoCo`` (``torchft/local_sgd.py``: restore the global parameters, set the averaged
pseudo-gradients as their gradients, step the outer optimizer, save them), written for sharded parameters: the
outer optimizer's parameters are the DTensor copies of the shards, so an element-wise outer optimizer (SGD,
Nesterov, Adam) gives the numbers an unsharded one would. Without fault tolerance the average runs on the
replication process group; with it (replica groups as separate worlds), through torchft's Manager, with one
quorum, heal and commit per outer round (:class:`OuterSync`): a lost group misses rounds, a joining group heals
the last-synchronised copy and the outer optimizer's state too.

Checkpoints: between two synchronisations the replicas differ, so a checkpoint keeps the global model, the
replica-averaged inner optimizer states (:meth:`SemiSync.global_model_state`, :meth:`SemiSync.replica_averaged`)
and, beside the shards, the outer state and each replica group's own (:mod:`lightning_mics.checkpoint.diloco`,
which writes and reads them).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING, Any, Optional

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor
from torch.optim import Optimizer

from lightning_mics.hop2.diloco_options import DILOCO_OUTER_LR, DILOCO_OUTER_MOMENTUM, OuterOptimizerFactory
from lightning_mics.hop2.fragments import Fragment, module_fragments, named_fragments
from lightning_mics.shards import laid_out_like

if TYPE_CHECKING:
    from lightning_mics.fault_tolerance.group import ReplicaGroup
    from lightning_mics.layout import MiCSLayout

log = logging.getLogger("lightning_mics")

def default_outer_optimizer(params: list[Tensor]) -> Optimizer:
    """DiLoCo's outer optimizer: ``SGD(lr=0.7, momentum=0.9, nesterov=True)``."""
    return torch.optim.SGD(params, lr=DILOCO_OUTER_LR, momentum=DILOCO_OUTER_MOMENTUM, nesterov=True)


def _local(t: Tensor) -> Tensor:
    """This rank's elements of ``t`` (a DTensor's local shard, sharing its storage), or ``t``."""
    return t.to_local() if isinstance(t, DTensor) else t


@dataclass
class PendingFragment:
    """A fragment's average in flight: its index, this rank's pseudo-gradient as sent (what a checkpoint taken
    meanwhile keeps, to send again on resume), the buffer being averaged and the average under way; with fault
    tolerance also the count of contributing groups being averaged beside it (``count``, ``counting``)."""

    fragment: int
    sent: Tensor
    buffer: Tensor
    average: Any
    count: Optional[Tensor] = None
    counting: Any = None


class OuterSync:
    """DiLoCo for the parameters one (inner) optimizer steps: the engine's step hook for that optimizer.

    ``names``/``params``: the parameters (by their name in the model) the inner optimizer updates;
    ``transport``: the replication group's hop-2 transport (``None`` with one replica); ``every``: H.

    With fault tolerance (``round``, the engine's): the replica groups are separate worlds joined by torchft, and
    the quorum, the heal of a joining group and the commit happen once per round, at the synchronisation -- as in
    torchft's ``DiLoCo``. ``round()`` runs the quorum and says whether this group contributes to the average: a
    group that just healed holds a live group's parameters, so it does not count twice; the average is over the
    contributing groups (``transport`` carries the deltas, ``counter`` an fp32 count of them). A round that does not
    commit (a group failed during the average) is dropped: every group goes back to the last-synchronised
    parameters, as torchft does.

    Streaming DiLoCo (``fragments`` > 1, ``delay``, ``alpha``; Douillard et al. 2025, torchft's ``DiLoCo`` with
    ``fragment_sync_delay`` and ``fragment_update_alpha``): the parameters are cut into ``fragments`` contiguous runs
    (:func:`fragment_bounds`) synchronised in turn, one every ``every / fragments`` inner steps. ``delay`` steps
    before its turn, a fragment's pseudo-gradient is taken and its average started; at its turn the average is
    awaited, the outer optimizer steps that fragment's last-synchronised copy, and its parameters become
    ``(1 - alpha) * global + alpha * local``. One fragment and no delay is DiLoCo."""

    def __init__(
        self,
        names: Sequence[str],
        params: Sequence[Tensor],
        transport: Any,
        every: int,
        factory: Optional[OuterOptimizerFactory],
        round: Optional[Callable[[], bool]] = None,
        counter: Any = None,
        fragments: int = 1,
        delay: int = 0,
        alpha: float = 0.0,
        fragment_modules: Optional[Sequence[str]] = None,
        unit_names: Sequence[str] = (),
    ) -> None:
        self.names = list(names)
        self.params = list(params)
        self.transport = transport
        self.round = round
        self.counter = counter
        #: indices into ``params`` of each fragment, synchronised in turn
        self.fragments: list[Fragment] = [list(range(len(self.params)))]
        #: why the fragments are cut by element count rather than along modules (``None``: they are not)
        self.fragment_fallback: Optional[str] = None
        if fragment_modules:
            self.fragments = named_fragments(self.names, fragment_modules)
        elif self.params and fragments > 1:
            self.fragments, self.fragment_fallback = module_fragments(
                self.names, [p.numel() for p in self.params], fragments, unit_names
            )
        #: inner steps between two fragment synchronisations
        self.cadence = every // len(self.fragments)
        self.delay = delay
        self.alpha = float(alpha)
        #: the fragment whose average is in flight (started ``delay`` steps before its turn)
        self.pending: Optional[PendingFragment] = None
        with torch.no_grad():
            #: the last-synchronised parameters (DTensors placed like the parameters): the outer optimizer's
            self.anchors = [p.detach().clone() for p in self.params]
        self.outer = (factory or default_outer_optimizer)(self.anchors)
        if not isinstance(self.outer, Optimizer):
            raise TypeError(
                f"outer_optimizer must return a torch.optim.Optimizer over the tensors it is given, got "
                f"{type(self.outer).__name__}."
            )
        #: optimizer steps since the last outer synchronisation (of a fragment, when streaming)
        self.inner_steps = 0
        #: outer synchronisations run (of fragments, when streaming: the next is fragment ``outer_steps % fragments``)
        self.outer_steps = 0
        #: fault tolerance: rounds dropped because a group failed during their average
        self.dropped_rounds = 0
        #: the run this optimizer's sync belongs to (:meth:`SemiSync.attach` sets it): the one model's DiLoCo state
        self.run: Optional[SemiSync] = None

    def before_step(self) -> None:
        """Nothing crosses replicas before an inner step."""

    def starts_average_next_step(self) -> bool:
        """Whether the next optimizer step starts an outer average (the only step of a round whose collectives
        cross replicas; its turn comes ``delay`` steps later)."""
        return self.inner_steps + 1 == self.cadence - self.delay

    def after_step(self) -> None:
        """Count the inner step; ``delay`` steps before a fragment's turn start its average; at its turn (the H-th
        step without streaming) synchronise it."""
        self.inner_steps += 1
        if self.inner_steps == self.cadence - self.delay:
            self.start_fragment()
        if self.inner_steps >= self.cadence:
            self.finish_fragment()

    def members(self, fragment: Optional[int]) -> Sequence[int]:
        """The indices of ``fragment``'s parameters (``None``: all of them)."""
        return range(len(self.params)) if fragment is None else self.fragments[fragment]

    @torch.no_grad()
    def pseudo_gradient(self, fragment: Optional[int] = None) -> Tensor:
        """This rank's ``last synchronised - current`` over its shards (of ``fragment``; ``None``: all), as one flat
        message (the same offsets on every replica of these shards: they hold equal shapes)."""
        pieces = [(_local(self.anchors[i]) - _local(self.params[i])).reshape(-1) for i in self.members(fragment)]
        return torch.cat(pieces) if pieces else torch.zeros(0)

    @torch.no_grad()
    def start_fragment(self, fragment: Optional[int] = None, sent: Optional[Tensor] = None) -> None:
        """Take ``fragment``'s pseudo-gradient (or ``sent``, one taken before a checkpoint) and start its average
        across replicas; it runs while the next ``delay`` inner steps compute. ``None``: the fragment whose turn it
        is, read after the round's quorum -- with fault tolerance the quorum comes first, and a joining group heals
        there (and then sends zeros, counted as no contribution), taking from a live group which fragment is next."""
        contributes = self.round() if self.round is not None else True
        if fragment is None:
            fragment = self.outer_steps % len(self.fragments)
        sent = self.pseudo_gradient(fragment) if sent is None else sent
        if not contributes:
            sent.zero_()
        # averaged in place; with a delay ``sent`` is kept as this rank sent it, for a checkpoint taken meanwhile
        buffer = sent.clone() if self.delay else sent
        active = self.transport is not None and self.transport.active
        pending = PendingFragment(fragment, sent, buffer, self.transport.start_average(buffer) if active else None)
        if self.counter is not None:
            pending.count = torch.tensor([1.0 if contributes else 0.0], device=buffer.device)
            pending.counting = self.counter.start_average(pending.count)
        self.pending = pending

    @torch.no_grad()
    def finish_fragment(self) -> None:
        """The fragment's turn: await its average, step the outer optimizer on its last-synchronised copy, mix. With
        fault tolerance the round commits first; one that does not (a group failed during the average) is dropped:
        the fragment's parameters go back to the last-synchronised copy, as torchft does."""
        assert self.pending is not None, "start_fragment() runs first"
        pending, self.pending = self.pending, None
        if pending.average is not None:
            pending.average.wait()
        if pending.count is not None:
            pending.counting.wait()
            if not self.transport.commit() or pending.count.item() <= 0:
                self.dropped_rounds += 1
                log.warning("DiLoCo: outer round dropped (a replica group failed during its average); every group goes "
                            "back to the last-synchronised parameters")
                self.restart_from_anchors(pending.fragment)
                return
            # both are averages over the quorum's groups: their ratio is the contributors' mean
            pending.buffer.div_(pending.count.item())
        self._outer_step(pending.buffer, pending.fragment)

    @torch.no_grad()
    def _outer_step(self, flat: Tensor, fragment: Optional[int] = None) -> None:
        """Step the outer optimizer on the last-synchronised copy of ``fragment`` (``None``: all) with the averaged
        ``flat`` as its gradient (the others get none, so an element-wise optimizer leaves them and their state
        alone); the result becomes the new last-synchronised copy and, mixed with the local values by ``alpha``,
        the parameters."""
        members = self.members(fragment)
        offset = 0
        for i in members:
            anchor = self.anchors[i]
            local = _local(anchor)
            piece = flat[offset : offset + local.numel()].view(local.shape)
            anchor.grad = laid_out_like(piece.to(local.dtype), anchor)
            offset += local.numel()
        self.outer.step()
        self.outer.zero_grad(set_to_none=True)
        for i in members:
            param, anchor = _local(self.params[i]), _local(self.anchors[i])
            if self.alpha:  # global + alpha * (local - global), in torchft's form (the same bits)
                param.copy_(torch.lerp(anchor, param, self.alpha))
            else:
                param.copy_(anchor)
        self.inner_steps = 0
        self.outer_steps += 1

    @torch.no_grad()
    def restart_from_anchors(self, fragment: Optional[int] = None) -> None:
        """A dropped round: the parameters (of ``fragment``; ``None``: all) go back to the last-synchronised copy; a
        new round starts."""
        for i in self.members(fragment):
            _local(self.params[i]).copy_(_local(self.anchors[i]))
        self.inner_steps = 0

    def heal_state(self) -> dict[str, Any]:
        """What a joining group takes from this one (this rank's shards): the last-synchronised copy, the outer
        optimizer's state, the round's inner-step count and the rounds so far (streaming: which fragment is next).
        A group joins at a round's quorum, which comes before that round's average starts and after the previous
        one landed (``delay`` is below the cadence), so no average is in flight to hand over."""
        from lightning_mics.fault_tolerance.heal_state import local_state, optimizer_local_state

        return {
            "anchors": [local_state(a) for a in self.anchors],
            "outer": optimizer_local_state(self.outer),
            "inner_steps": self.inner_steps,
            "outer_steps": self.outer_steps,  # streaming: which fragment synchronises next
        }

    @torch.no_grad()
    def load_heal_state(self, state: dict[str, Any]) -> None:
        """Heal from a live group's :meth:`heal_state`, in place."""
        from lightning_mics.fault_tolerance.heal_state import copy_local_state_

        copy_local_state_(self.anchors, state["anchors"])
        # The outer optimizer's state is built here, not copied into: a group that never synchronised has none, and
        # its parameters (the anchors) take no gradients, so it cannot be created by a zero step as the inner one is.
        params = [p for group in self.outer.param_groups for p in group["params"]]
        self.outer.state.clear()
        for index, slots in state["outer"]["state"].items():
            anchor = params[int(index)]
            local = _local(anchor)
            self.outer.state[anchor] = {key: self._received(value, anchor, local) for key, value in slots.items()}
        for group, peer in zip(self.outer.param_groups, state["outer"]["param_groups"]):
            group.update({key: value for key, value in peer.items() if key != "params"})
        self.inner_steps = int(state["inner_steps"])
        self.outer_steps = int(state.get("outer_steps", self.outer_steps))

    @staticmethod
    def _received(value: Any, anchor: Tensor, local: Tensor) -> Any:
        """A peer's outer-state entry, here: a tensor of the anchor's local shape laid out like the anchor (on its
        device), any other tensor copied, anything else as it is."""
        if not isinstance(value, Tensor):
            return value
        if value.shape == local.shape:
            return laid_out_like(value.to(local.device).clone(), anchor)
        return value.clone()

    @torch.no_grad()
    def restart_from_parameters(self) -> None:
        """The parameters (just loaded) become the last-synchronised copy; a new round starts."""
        for anchor, param in zip(self.anchors, self.params):
            _local(anchor).copy_(_local(param))
        self.inner_steps = 0
        self.pending = None

    def pending_pieces(self) -> dict[str, Tensor]:
        """The fragment in flight's pseudo-gradient as this rank sent it, by parameter name, placed like the
        parameters (what a checkpoint taken during the delay keeps); empty when none is in flight."""
        if self.pending is None:
            return {}
        pieces, offset = {}, 0
        for i in self.members(self.pending.fragment):
            local = _local(self.params[i])
            piece = self.pending.sent[offset : offset + local.numel()].view(local.shape)
            pieces[self.names[i]] = laid_out_like(piece.clone(), self.params[i])
            offset += local.numel()
        return pieces

    def pending_after_load(self) -> Optional[int]:
        """The fragment a checkpoint taken at this point had in flight (its average started, not yet applied)."""
        if self.delay and self.inner_steps >= self.cadence - self.delay:
            return self.outer_steps % len(self.fragments)
        return None

    def resume_pending(self, pieces: Mapping[str, Tensor]) -> None:
        """Send the saved pseudo-gradient of the fragment in flight again (every replica resumes alike, so the
        average is the one the interrupted run would have applied)."""
        fragment = self.pending_after_load()
        assert fragment is not None
        flat = torch.cat([_local(pieces[self.names[i]]).reshape(-1) for i in self.members(fragment)])
        self.start_fragment(fragment, sent=flat)

    def outer_state(self) -> dict[str, dict[str, Tensor]]:
        """The outer optimizer's per-parameter state by parameter name (DTensors where the anchors are): the form
        DCP reshards. Its hyperparameters are the options', not saved."""
        by_anchor = {id(a): name for name, a in zip(self.names, self.anchors)}
        return {
            by_anchor[id(anchor)]: dict(state)
            for anchor, state in self.outer.state.items()
            if id(anchor) in by_anchor and state
        }


class SemiSync:
    """The DiLoCo state of one run -- an :class:`OuterSync` per inner optimizer -- and its checkpoint entries. The
    engine holds one; :meth:`attach` makes the step hooks."""

    def __init__(self) -> None:
        #: in the order the optimizers were attached (the same on every rank and in a resumed run)
        self.syncs: list[OuterSync] = []
        self.optimizers: list[Optimizer] = []
        self.module: Optional[nn.Module] = None
        self.replica = 0
        self.layout_key = (1, 1)
        self.group: Optional[dist.ProcessGroup] = None
        #: fault tolerance: this group healed from a live one at the current round's quorum
        self._healed_this_round = False
        #: fault tolerance: heals from a live group so far (for tests and logs)
        self.heals = 0

    @property
    def active(self) -> bool:
        return bool(self.syncs)

    def outer_round(self) -> Optional[tuple[int, bool]]:
        """(optimizer steps between two outer averages, whether the next step starts one); ``None`` before the
        optimizers are attached. What telemetry needs to average a round's bytes over its steps."""
        if not self.syncs:
            return None
        return self.syncs[0].cadence, any(sync.starts_average_next_step() for sync in self.syncs)

    def attach(
        self,
        optimizers: Sequence[Optimizer],
        modules: Sequence[nn.Module],
        layout: MiCSLayout,
        factory: Optional[OuterOptimizerFactory],
        replica_group: Optional[ReplicaGroup] = None,
        quorum: Optional[Callable[[], None]] = None,
        streaming: tuple[int, int, float] = (1, 0, 0.0),
        fragment_modules: Optional[Sequence[str]] = None,
    ) -> dict[int, OuterSync]:
        """One :class:`OuterSync` per optimizer, over the parameters it steps (all of them in ``modules``' one
        model); returns them by ``id(optimizer)`` for the engine's step hooks. With fault tolerance
        (``replica_group``): the average goes through torchft, after ``quorum()`` -- the engine's, run once per
        round (:class:`OuterSync`). ``streaming``: ``(num_fragments, fragment_sync_delay, fragment_update_alpha)``;
        ``fragment_modules``: the modules of each fragment (``None``: cut along the model's FSDP units)."""
        from lightning_mics.hop2.transport import ManagedTransport, ProcessGroupTransport
        from lightning_mics.wrapping import RootUnit

        if len(modules) != 1:
            raise ValueError(
                f"cross_replica_sync='diloco' synchronises one model per optimizer; this optimizer steps parameters of "
                f"{len(modules)} models. Combine them into one module (or give each model its own optimizer)."
            )
        (module,) = modules
        if isinstance(module, RootUnit):  # the Trainer's wrapper: names as the LightningModule's checkpoints have them
            module = module.module
        if self.module is not None and module is not self.module:
            raise ValueError(
                "cross_replica_sync='diloco' checkpoints one model's replicas: set up one model with this strategy."
            )
        self.module = module
        settings = layout.settings
        transport = None
        self.group, self.replica = layout.diloco_group()
        if self.group is not None:
            transport = ProcessGroupTransport(self.group, settings.cross_replica_wire)
        topology = settings.topology
        self.layout_key = (topology.replication_degree, topology.partition_size, topology.worker_size)
        round_quorum: Optional[Callable[[], bool]] = None
        counter = None
        if settings.hop2.managed:
            assert replica_group is not None and quorum is not None, "join_fault_domain() runs first"
            if len(optimizers) != 1 or self.syncs:
                raise ValueError(
                    "fault_tolerance with cross_replica_sync='diloco' runs one quorum per outer round, for one "
                    f"optimizer; this run has {len(self.syncs) + len(optimizers)}. Use one optimizer (param groups "
                    "may differ), or drop fault_tolerance."
                )
            transport = ManagedTransport(replica_group, settings.cross_replica_wire)
            counter = ManagedTransport(replica_group, None)  # the contributors' count, exact in fp32
            round_quorum = partial(self._round_quorum, quorum)

        name_of = {id(p): name for name, p in module.named_parameters()}
        unit_names = [name for name, m in module.named_modules() if isinstance(m, FSDPModule)]
        hooks: dict[int, OuterSync] = {}
        for optimizer in optimizers:
            params = [p for group in optimizer.param_groups for p in group["params"]]
            unknown = [p for p in params if id(p) not in name_of]
            if unknown:
                raise ValueError(
                    f"cross_replica_sync='diloco': the optimizer steps {len(unknown)} tensor(s) that are not "
                    "parameters of the model set up with it; DiLoCo synchronises the model's parameters only."
                )
            sync = OuterSync(
                [name_of[id(p)] for p in params], params, transport, settings.hop2.sync_every, factory, round_quorum,
                counter, *streaming, fragment_modules=fragment_modules, unit_names=unit_names,
            )
            sync.run = self
            if sync.fragment_fallback is not None:
                log.warning("streaming DiLoCo: %s", sync.fragment_fallback)
            self.syncs.append(sync)
            self.optimizers.append(optimizer)
            hooks[id(optimizer)] = sync
        return hooks

    # ------------------------------------------------------------------ fault tolerance
    def _round_quorum(self, quorum: Callable[[], None]) -> bool:
        """The engine's ``quorum()`` for an outer round; whether this group contributes to its average (not when it
        just healed: it holds a live group's parameters)."""
        self._healed_this_round = False
        quorum()
        return not self._healed_this_round

    def heal_state(self) -> list[dict[str, Any]]:
        """What a joining group takes from this one besides the model and inner optimizer (:meth:`OuterSync.heal_state`
        of each)."""
        return [sync.heal_state() for sync in self.syncs]

    def load_heal_state(self, state: list[dict[str, Any]]) -> None:
        """Heal from a live group: its last-synchronised copy and outer state; this round it does not contribute."""
        for sync, received in zip(self.syncs, state):
            sync.load_heal_state(received)
        self._healed_this_round = True
        self.heals += 1
        log.warning("DiLoCo: healed the last-synchronised model and the outer optimizer's state from a live replica "
                    "group; this group does not contribute to this round's average")

    def anchor_tensors(self) -> list[Tensor]:
        """The last-synchronised parameter shards: equal in every replica group after each round (what fault
        tolerance's parameter check compares; the current parameters differ between rounds)."""
        return [a for sync in self.syncs for a in sync.anchors]

    # ------------------------------------------------------------------ checkpoints
    def global_model_state(self, module: nn.Module, state: dict[str, Any]) -> dict[str, Any]:
        """``module``'s checkpoint state with the last-synchronised parameters in place of the replica's current
        ones: every replica saves the same model (the global one), so DCP's choice of writer does not matter."""
        anchor_of = {id(p): a for sync in self.syncs for p, a in zip(sync.params, sync.anchors)}
        named = dict(module.named_parameters(remove_duplicate=False))
        return {
            key: anchor_of[id(named[key])] if key in named and id(named[key]) in anchor_of else value
            for key, value in state.items()
        }

    @torch.no_grad()
    def replica_averaged(self, states: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """Inner optimizer states (name-keyed) with every floating-point tensor averaged over the replicas (one
        message per optimizer), so that the checkpoint's optimizer entry is one state, not DCP's per-shard mix."""
        if self.group is None:
            return states
        replicas = self.group.size()
        out = []
        for state in states:
            per_param = state.get("state", {})
            slots = [
                (name, key, value)
                for name in sorted(per_param)
                for key, value in sorted(per_param[name].items())
                if isinstance(value, Tensor) and value.is_floating_point()
            ]
            if not slots:
                out.append(state)
                continue
            flat = torch.cat([_local(value).detach().reshape(-1).float() for _, _, value in slots])
            dist.all_reduce(flat, group=self.group)
            flat.div_(replicas)
            averaged = {name: dict(entries) for name, entries in per_param.items()}
            offset = 0
            for name, key, value in slots:
                local = _local(value)
                piece = flat[offset : offset + local.numel()].view(local.shape).to(local.dtype)
                averaged[name][key] = laid_out_like(piece, value)
                offset += local.numel()
            out.append({**state, "state": averaged})
        return out


def attach(
    optimizers: Sequence[Optimizer],
    modules: Sequence[nn.Module],
    layout: MiCSLayout,
    attached: Mapping[int, object],
    factory: Optional[OuterOptimizerFactory],
    replica_group: Optional[ReplicaGroup] = None,
    quorum: Optional[Callable[[], None]] = None,
    streaming: tuple[int, int, float] = (1, 0, 0.0),
    fragment_modules: Optional[Sequence[str]] = None,
) -> dict[int, OuterSync]:
    """The step hooks of ``optimizers``: :meth:`SemiSync.attach` on the run the hooks already ``attached`` belong
    to (one per engine: its one model), or on a new one."""
    run = run_of(attached.values()) or SemiSync()
    return run.attach(optimizers, modules, layout, factory, replica_group, quorum, streaming, fragment_modules)


def run_of(hooks: Iterable[object]) -> Optional[SemiSync]:
    """The DiLoCo run step hooks belong to, or ``None`` where none of them is an :class:`OuterSync`."""
    for hook in hooks:
        if isinstance(hook, OuterSync) and hook.run is not None:
            return hook.run
    return None


__all__ = [
    "OuterSync",
    "SemiSync",
    "attach",
    "default_outer_optimizer",
    "run_of",
]
