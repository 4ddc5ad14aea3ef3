"""Partition groups as fault domains: a lost node costs a step, not the job (torchft).

Every MiCS partition group holds a complete copy of the model states, and only hop 2 -- the
cross-replica all-reduce at the accumulation boundary -- joins the groups. With
``MiCSStrategy(fault_tolerance=FaultTolerance(...))`` each replica group is launched as its own job whose
``torch.distributed`` world is one partition, and hop 2 runs through a torchft ``Manager``:

* every optimizer step starts with a quorum (the Lighthouse says which groups are alive); a group that
  joins -- restarted or new -- first takes the live state (model, optimizer, schedulers, step count) from a
  peer over torchft's checkpoint transport;
* at the boundary the gradient shards are averaged over the groups that took part in the step
  (:class:`ManagedCrossReplicaSync`), and the optimizer steps only if the quorum commits; a step a failure
  interrupted is discarded (its gradients dropped, nothing updated) and the next one runs with the
  groups still alive.

What torchft cannot be told, this module checks: a layout whose states span groups cannot survive losing
one, so it is refused (:func:`check_fault_tolerant_layout`).
"""

from __future__ import annotations

import copy
import hashlib
import logging
import os
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from datetime import timedelta
from typing import Any, Optional

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.distributed_c10d import AllgatherOptions
from torch.distributed.tensor import DTensor
from torch.optim import Optimizer

from lightning_mics import _compat as compat
from lightning_mics import wire as wire_codec
from lightning_mics.grad_sync import pack_gradient_shards, unpack_gradient_shards

log = logging.getLogger(__name__)

LIGHTHOUSE_ENV = "TORCHFT_LIGHTHOUSE"
REPLICA_GROUP_ENV = "MICS_REPLICA_GROUP"
NUM_REPLICA_GROUPS_ENV = "MICS_NUM_REPLICA_GROUPS"
#: A configuration digest crosses as two 16-bit integers in float64: their sums over every group stay exact
#: (through torchft's average and back), so every group reads back every other group's digest.
DIGEST_CHUNKS = 2
#: The agreement message has a slot per possible group, the same length in every group whatever its options
#: say (an all-reduce of unequal lengths would fail in the transport, not with a clear error): 6 KB a step.
MAX_REPLICA_GROUPS = 256
AGREEMENT_BYTES = MAX_REPLICA_GROUPS * (DIGEST_CHUNKS + 1) * 8


@dataclass(frozen=True)
class FaultTolerance:
    """Where this replica group finds the others (``MiCSStrategy(fault_tolerance=...)``).

    Each field left ``None`` is read from the environment when training starts, so that one config serves
    every group's job: ``lighthouse`` from ``TORCHFT_LIGHTHOUSE``, ``replica_group`` from
    ``MICS_REPLICA_GROUP`` and ``num_replica_groups`` from ``MICS_NUM_REPLICA_GROUPS``."""

    #: the Lighthouse's address, e.g. ``"http://10.0.0.1:29510"``
    lighthouse: Optional[str] = None
    #: this group's index, ``0 <= replica_group < num_replica_groups``: its share of the data
    replica_group: Optional[int] = None
    #: how many replica groups the job has when all are alive (the data is split into that many shares)
    num_replica_groups: Optional[int] = None
    #: the fewest live groups a step may commit with
    min_replica_groups: int = 1
    #: seconds a cross-group collective, commit or heal may take before the step is given up
    timeout: float = 60.0
    #: seconds to wait for a quorum (longer than a step)
    quorum_timeout: float = 60.0
    #: seconds without a new step (quorum) after which a rank takes its whole process down: a hung group must
    #: die, not keep heartbeating and block everyone's quorum. Longer than a step plus any validation or save.
    watchdog: float = 900.0

    def __post_init__(self) -> None:
        for name in ("min_replica_groups", "timeout", "quorum_timeout", "watchdog"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
                raise ValueError(f"FaultTolerance({name}={value!r}) must be a positive number.")

    def resolved(self) -> FaultTolerance:
        """The options with the environment's values filled in; one clear error for what is missing."""
        lighthouse = self.lighthouse or os.environ.get(LIGHTHOUSE_ENV)
        group = self.replica_group if self.replica_group is not None else _env_int(REPLICA_GROUP_ENV)
        groups = self.num_replica_groups if self.num_replica_groups is not None else _env_int(NUM_REPLICA_GROUPS_ENV)
        if not lighthouse:
            raise ValueError(
                f"fault_tolerance needs the Lighthouse's address: FaultTolerance(lighthouse='http://host:29510') or "
                f"{LIGHTHOUSE_ENV}=http://host:29510 (start one with `torchft_lighthouse --min_replicas 1 --bind "
                "0.0.0.0:29510`, see docs/fault-tolerance.md)."
            )
        if group is None or groups is None or not 0 <= group < groups:
            raise ValueError(
                f"fault_tolerance needs this group's index and the number of groups (0 <= index < number), got "
                f"replica_group={group!r}, num_replica_groups={groups!r}: set FaultTolerance(replica_group=..., "
                f"num_replica_groups=...) or {REPLICA_GROUP_ENV} and {NUM_REPLICA_GROUPS_ENV} in each group's job."
            )
        if groups > MAX_REPLICA_GROUPS:
            raise ValueError(
                f"fault_tolerance supports up to {MAX_REPLICA_GROUPS} replica groups, got num_replica_groups={groups}: "
                "make each partition (and so each group) larger."
            )
        return replace(self, lighthouse=lighthouse, replica_group=group, num_replica_groups=groups)


def _env_int(name: str) -> Optional[int]:
    value = os.environ.get(name)
    if value is None or value == "":
        return None
    if not value.isdigit():
        raise ValueError(f"{name}={value!r} must be a non-negative integer.")
    return int(value)


def check_fault_tolerant_layout(replication_degree: int, optim_beyond_partition: bool) -> None:
    """Refuse the layouts that cannot lose a group: inside one group's job, the world must be one partition
    (replicas live in other groups) and optimizer states may not be sharded across groups."""
    if replication_degree != 1:
        raise ValueError(
            f"With fault_tolerance each replica group's job is one partition, but this world holds "
            f"{replication_degree} replicas of the partition. Launch each partition as its own job (its own "
            "torchrun/SLURM step with MICS_REPLICA_GROUP), or set partition_size to the job's world size."
        )
    if optim_beyond_partition:
        raise ValueError(
            "fault_tolerance cannot be combined with optimizer states sharded across replicas (ShardingSpec optim > "
            "grads): a lost group would take its slice of every optimizer state with it. Use optim <= grads."
        )


class ReplicaGroup:
    """This group's torchft ``Manager``: quorum, cross-group all-reduce, commit, and the state a joining
    group heals from (``state_fn`` / ``load_fn``, called on every rank of the group for its own shards)."""

    def __init__(
        self,
        options: FaultTolerance,
        device: torch.device,
        state_fn: Callable[[], dict[str, Any]],
        load_fn: Callable[[dict[str, Any]], None],
        configuration: Optional[GroupConfiguration] = None,
    ) -> None:
        try:
            from torchft import Manager
            from torchft.process_group import ProcessGroupGloo, ProcessGroupNCCL
        except ModuleNotFoundError as missing:
            raise ModuleNotFoundError(
                "fault_tolerance needs torchft: pip install 'lightning-mics[ft]' (or torchft==0.2.0)."
            ) from missing

        self.options = options
        self.device = device
        self.configuration = configuration or GroupConfiguration(())
        _forget_earlier_manager()
        timeout = timedelta(seconds=options.timeout)
        pg = ProcessGroupNCCL(timeout=timeout) if device.type == "cuda" else ProcessGroupGloo(timeout=timeout)
        #: torchft's reconfigurable group of this rank index across the quorum's groups (hop 2's wire)
        self.pg = pg
        try:
            self.manager = Manager(
                pg=pg,
                load_state_dict=lambda state: self._heal(state, load_fn),
                state_dict=lambda: {"configuration": self.configuration.items, "state": state_fn()},
                min_replica_size=options.min_replica_groups,
                use_async_quorum=False,  # heal before the forward, so no step trains on stale weights
                timeout=timeout,
                quorum_timeout=timedelta(seconds=options.quorum_timeout),
                connect_timeout=timeout,  # an unreachable Lighthouse is an error within the configured timeout
                rank=dist.get_rank(),
                world_size=dist.get_world_size(),
                lighthouse_addr=options.lighthouse,
                replica_id=f"mics_group_{options.replica_group}",
                init_sync=False,  # every group starts from the same seed and rank 0's broadcast weights
            )
        except RuntimeError as error:
            if dist.get_rank() == 0:  # the group's other ranks wait for rank 0's server address: fail them too
                _job_store().set(_manager_keys()[0], _NO_MANAGER)
            raise LighthouseUnavailable(
                f"fault tolerance: no Lighthouse answered at {options.lighthouse} within {options.timeout:g} s "
                f"({error}). Start it before the groups (`torchft_lighthouse --min_replicas 1 --bind 0.0.0.0:29510`) "
                f"and give every group its address (FaultTolerance(lighthouse=...) or {LIGHTHOUSE_ENV})."
            ) from error
        self.discarded_steps = 0
        #: whether the last step this group finished was discarded
        self.last_step_discarded = False
        self.closed = False
        self._participants: Optional[int] = None
        self._outage_started: Optional[float] = None
        self._watchdog = Watchdog(options.watchdog)

    def start_step(self) -> None:
        """The quorum for the next optimizer step (a group that joins heals here, before its forward), then the
        two checks torchft does not make: every rank of this group healed (or none did), and every group in
        the quorum was started alike. A failed check ends this group with :class:`ReplicaGroupRefused`."""
        self._watchdog.kick()
        try:
            self.manager.start_quorum()
        except ReplicaGroupRefused:
            raise  # the heal refused the live groups' state (another configuration): that error, as it is
        except (TimeoutError, RuntimeError) as error:
            raise LighthouseUnavailable(
                f"fault tolerance: no quorum from the Lighthouse at {self.options.lighthouse} within "
                f"{self.options.quorum_timeout:g} s ({error}). Either the Lighthouse stopped or fewer than "
                f"min_replica_groups={self.options.min_replica_groups} groups are up. This group stops at torchft "
                f"step {self.manager.current_step()}; its last checkpoint is what survives: restart the Lighthouse, "
                "then relaunch every group with ckpt_path='last' (docs/fault-tolerance.md)."
            ) from error
        check_healed_whole(self.manager.current_step(), self.device)
        self._check_agreement()
        participants = self.manager.num_participants()
        if participants != self._participants:
            self._log_membership(participants)
        self._participants = participants

    def _heal(self, received: dict[str, Any], load_fn: Callable[[dict[str, Any]], None]) -> None:
        """Refuse a peer started differently before touching any state; else load its state."""
        theirs = GroupConfiguration(tuple(received["configuration"]))
        differences = self.configuration.differences(theirs)
        if differences:
            raise ReplicaGroupRefused(
                f"fault tolerance: replica group {self.options.replica_group} cannot heal from the live groups: it "
                f"was started differently ({'; '.join(differences)}, this group's vs theirs). Start every group "
                "with the same configuration."
            )
        load_fn(received["state"])
        log.warning("fault tolerance: healed from a live replica group at step %d", self.manager.current_step())

    def _check_agreement(self) -> None:
        """Every group of the quorum publishes its index and configuration digest (one tiny all-reduce);
        a group claiming a taken index, or started unlike the others, is refused before any step commits."""
        group = self.options.replica_group
        assert group is not None
        message = agreement_message(group, self.configuration.digest_chunks()).to(self.device)
        self.manager.allreduce(message).wait()
        if self.manager.errored() is not None:
            return  # the step is discarded anyway; the next one checks again
        summed = message.cpu() * self.manager.num_participants()  # torchft averaged
        verdict = agreement_verdict(summed, group)
        if verdict is not None:
            raise ReplicaGroupRefused(f"fault tolerance: replica group {group} refused at the quorum: {verdict}")

    def _log_membership(self, participants: int) -> None:
        if self._participants is not None and participants < self._participants:
            self._outage_started = time.monotonic()
            log.warning(
                "fault tolerance: %d replica group(s) left at step %d; training on with %d",
                self._participants - participants,
                self.manager.current_step(),
                participants,
            )
        elif self._participants is not None:
            started = self._outage_started
            outage = "" if started is None else f" after an outage of {time.monotonic() - started:.1f} s"
            log.warning(
                "fault tolerance: %d replica group(s) joined at step %d%s; %d train now",
                participants - self._participants,
                self.manager.current_step(),
                outage,
                participants,
            )
            self._outage_started = None

    def average_(self, flat: Tensor) -> None:
        """Average ``flat`` over the groups in this step's quorum, in place (a failure is recorded by torchft
        and makes :meth:`commit` refuse the step)."""
        self.manager.allreduce(flat).wait()

    def gather_(self, message: Tensor) -> Optional[list[Tensor]]:
        """Every group's ``message`` (same shape in each), in quorum order; ``None`` after a failure, which
        torchft records (then :meth:`commit` refuses the step)."""
        if self.manager.errored() is not None:
            return None
        gathered = [torch.empty_like(message) for _ in range(self.manager.num_participants())]
        try:
            work = self.pg.allgather([gathered], [message], AllgatherOptions())
            self.manager.wrap_future(work.get_future(), None).wait()
        except RuntimeError as error:  # a transport failure (DistBackendError included) is the step's
            self.manager.report_error(error)
        return None if self.manager.errored() is not None else gathered

    def commit(self) -> bool:
        """Whether every rank of every group in the quorum finished the step (then the optimizer may step)."""
        committed = self.manager.should_commit()
        self.last_step_discarded = not committed
        if not committed:
            self.discarded_steps += 1
            log.warning(
                "fault tolerance: step %d discarded (a replica group failed during it; %d discarded so far)",
                self.manager.current_step(),
                self.discarded_steps,
            )
        return committed

    @property
    def writes_checkpoints(self) -> bool:
        """One group writes checkpoints for all (the others' would be copies): the first group of the
        current quorum -- the same answer on every rank of a group, and on one group of the quorum."""
        return self.manager.participating_rank() == 0

    def state_dict(self) -> dict[str, Any]:
        """What a checkpoint keeps of fault tolerance: torchft's step count (a group resumed from the checkpoint
        is then ahead of a fresh one, which heals from it instead of averaging with it)."""
        return {"manager": self.manager.state_dict(), "replica_group": self.options.replica_group}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.manager.load_state_dict(state["manager"])

    def shutdown(self) -> None:
        """Stop serving and heartbeating (the Lighthouse then drops this group); idempotent."""
        if not self.closed:
            self.closed = True
            self._watchdog.stop()
            self.manager.shutdown(wait=False)


#: What rank 0 publishes as its Manager's address when it could not start one (the Lighthouse did not answer):
#: the other ranks then fail to connect within the timeout too, instead of waiting for an address forever.
_NO_MANAGER = "http://127.0.0.1:1"


def _manager_keys() -> tuple[str, str]:
    from torchft.manager import MANAGER_ADDR_KEY, REPLICA_ID_KEY

    return MANAGER_ADDR_KEY, REPLICA_ID_KEY


def _job_store() -> dist.TCPStore:
    """The job's store (``MASTER_ADDR``/``MASTER_PORT``), where torchft's Managers publish their address."""
    return dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                         wait_for_workers=False)


def _forget_earlier_manager() -> None:
    """Before a second Manager in this world (a second ``fit`` in the same processes): rank 0 deletes the
    address an earlier one published in the job's store, so that the other ranks wait for the new one
    instead of connecting to the old, shut-down server. A collective (a barrier of the world)."""
    if dist.get_rank() == 0:
        store = _job_store()
        for key in _manager_keys():
            store.delete_key(key)
    dist.barrier()


class LighthouseUnavailable(RuntimeError):
    """The Lighthouse did not answer in time: at start (wrong address, not started) or mid-run (it stopped)."""


class ReplicaGroupRefused(RuntimeError):
    """This group may not train with the others: it was started unlike them, claims a taken group index, or
    only some of its ranks healed. The whole group ends (every rank sees the same verdict)."""


class Watchdog:
    """Takes the process down when no step has started for ``seconds``: a rank that hangs outside a
    collective (whose timeout would end it) would otherwise keep its group heartbeating to the Lighthouse and
    block the quorum of every group. Killing one rank ends the group: its peers' collectives fail."""

    def __init__(self, seconds: float, exit: Callable[[int], None] = os._exit) -> None:
        self.seconds = seconds
        self._exit = exit
        self._last = time.monotonic()
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="mics-ft-watchdog", daemon=True)
        self._thread.start()

    def kick(self) -> None:
        self._last = time.monotonic()

    def stop(self) -> None:
        self._stopped.set()

    def _watch(self) -> None:
        while not self._stopped.wait(min(1.0, self.seconds / 4)):
            idle = time.monotonic() - self._last
            if idle > self.seconds:
                log.error("fault tolerance: no step for %.0f s (watchdog %.0f s): ending this rank", idle, self.seconds)
                self._exit(1)
                return


class ManagedCrossReplicaSync:
    """Hop 2 through torchft, as the engine's step hook: at the boundary, this rank's gradient shards are
    packed into one buffer, averaged over the live groups and unpacked; if the quorum does not commit, the
    gradients are dropped so that the optimizer step changes nothing (parameters and optimizer states).

    With a 16-bit ``wire`` (``cross_replica_dtype="bf16"`` / ``"fp16"``) the buffer crosses in that dtype:
    half the bytes; torchft's all-reduce sums in it, one rounding per group added (G - 1 for G groups) plus
    the message's own, where the non-fault-tolerant ring sums 16-bit messages in fp32. With ``"int8"`` each
    group's buffer is encoded blockwise (:mod:`lightning_mics.wire`: a quarter of the bytes plus one scale
    per block) and all-gathered; every group decodes the messages and sums them in fp32, in quorum order.
    The all-gather receives G - 1 messages where a ring all-reduce moves 2 (G - 1) / G buffers: int8 halves
    bf16's bytes for 2 groups, equals them for 4 and costs more beyond. Every group gets the same result, so
    the groups stay identical."""

    def __init__(self, module: nn.Module, group: ReplicaGroup, wire: Optional[Any] = None) -> None:
        self.module = module
        self.group = group
        self.wire = wire

    @torch.no_grad()
    def before_step(self) -> None:
        params = [p for p in self.module.parameters() if p.grad is not None]
        if params:
            flat = pack_gradient_shards(params)
            unpack_gradient_shards(self._average(flat), params)
        if not self.group.commit():
            for param in self.module.parameters():
                param.grad = None

    def _average(self, flat: Tensor) -> Tensor:
        """``flat`` averaged over the quorum's groups, in the wire format (on a failure: whatever is left,
        which the uncommitted step then drops)."""
        if self.wire is not None and self.wire.dtype is None:  # int8: all-gather, decode, sum in fp32
            gathered = self.group.gather_(wire_codec.encode(flat))
            if gathered is None:
                return flat
            total = torch.zeros(flat.numel(), dtype=torch.float32, device=flat.device)
            for message in gathered:
                total += wire_codec.decode(message, flat.numel())
            return total.div_(len(gathered)).to(flat.dtype)
        message = flat if self.wire is None else flat.to(self.wire.dtype)
        self.group.average_(message)
        return message.to(flat.dtype)

    def after_step(self) -> None:
        """Nothing after the step (the hook protocol of the engine's steps)."""


# ------------------------------------------------------------------------------------------------ agreement
@dataclass(frozen=True)
class GroupConfiguration:
    """What every replica group of a job must share -- layout, precision, accumulation, model shapes,
    optimizers, number of groups -- as ``(name, value)`` text pairs: a group started with another one would
    average gradients of a different model, or at other steps."""

    items: tuple[tuple[str, str], ...]

    @classmethod
    def of(cls, values: Mapping[str, Any]) -> GroupConfiguration:
        return cls(tuple((name, str(value)) for name, value in values.items()))

    def digest_chunks(self) -> list[int]:
        digest = hashlib.sha256(repr(self.items).encode()).digest()
        return [int.from_bytes(digest[2 * i : 2 * i + 2], "big") for i in range(DIGEST_CHUNKS)]

    def differences(self, other: GroupConfiguration) -> list[str]:
        mine, theirs = dict(self.items), dict(other.items)
        return [
            f"{name}: {mine.get(name)} vs {theirs.get(name)}"
            for name in sorted(mine.keys() | theirs.keys())
            if mine.get(name) != theirs.get(name)
        ]

    def __str__(self) -> str:
        return ", ".join(f"{name}={value}" for name, value in self.items)


def model_signature(module: nn.Module) -> str:
    """Parameter and buffer names, global shapes and dtypes: equal for two groups holding the same model."""
    entries = [f"{name}:{tuple(t.shape)}:{t.dtype}" for name, t in module.state_dict().items() if isinstance(t, Tensor)]
    return f"{len(entries)} tensors, sha256 {hashlib.sha256(';'.join(entries).encode()).hexdigest()[:16]}"


def run_configuration(
    precision: str, accumulate_grad_batches: int, module: nn.Module, optimizers: Sequence[Optimizer]
) -> dict[str, Any]:
    """What besides the layout every group must share (see :class:`GroupConfiguration`)."""
    return {
        "precision": precision,
        "accumulate_grad_batches": accumulate_grad_batches,
        "model": model_signature(module),
        "optimizers": [type(optimizer).__name__ for optimizer in optimizers],
    }


def agreement_message(group: int, chunks: Sequence[int]) -> Tensor:
    """This group's entry of the quorum's agreement: its digest in its own slot and a 1 in its count slot."""
    message = torch.zeros(MAX_REPLICA_GROUPS * (DIGEST_CHUNKS + 1), dtype=torch.float64)
    message[group * DIGEST_CHUNKS : (group + 1) * DIGEST_CHUNKS] = torch.tensor(chunks, dtype=torch.float64)
    message[MAX_REPLICA_GROUPS * DIGEST_CHUNKS + group] = 1.0
    return message


def agreement_verdict(summed: Tensor, group: int) -> Optional[str]:
    """Why ``group`` may not train in this quorum (``summed``: every group's :func:`agreement_message`
    added), or ``None``. Two groups with one index are both refused; a group whose configuration differs
    from the most common one (ties: the one of the lowest index) is refused and the others go on."""
    counts = summed[MAX_REPLICA_GROUPS * DIGEST_CHUNKS :].round().long().tolist()
    if counts[group] > 1:
        return (
            f"{counts[group]} groups claim replica_group={group}: give each group's job its own index "
            "(MICS_REPLICA_GROUP), else two groups train on the same share of the data."
        )
    digests = {
        other: tuple(summed[other * DIGEST_CHUNKS : (other + 1) * DIGEST_CHUNKS].round().long().tolist())
        for other in range(MAX_REPLICA_GROUPS)
        if counts[other] == 1
    }
    holders: dict[tuple[int, ...], list[int]] = {}
    for other in sorted(digests):
        holders.setdefault(digests[other], []).append(other)
    reference = max(holders, key=lambda digest: (len(holders[digest]), -holders[digest][0]))
    if digests[group] == reference:
        return None
    return (
        f"it was started with another configuration (layout, precision, accumulation, model or optimizers) than "
        f"group(s) {holders[reference]}. Each group's job log lists its configuration "
        "(\"this group's configuration: ...\"); start every group with the same one."
    )


def check_healed_whole(step: int, device: torch.device) -> None:
    """Refuse a group whose ranks disagree on torchft's step after the quorum: a heal that reached only some
    of them (torchft 0.2.0 does not make a group's heal all-or-nothing) would otherwise let the group commit
    steps with a stale shard. A collective of this group's world; the whole group raises."""
    steps = torch.tensor([step, -step], dtype=torch.int64, device=device)
    dist.all_reduce(steps, op=dist.ReduceOp.MAX)
    highest, lowest = int(steps[0]), -int(steps[1])
    if highest != lowest:
        raise ReplicaGroupRefused(
            f"fault tolerance: a heal reached only some ranks of this group (their steps range from {lowest} to "
            f"{highest}); the group ends rather than train on a stale shard. Restart it: it heals anew, all ranks."
        )


# ------------------------------------------------------------------------------------------------ counters
class CommittedStepCounters:
    """Keeps the Trainer's step count, its LR schedulers and the optimizers' hyper-parameters in line with
    the committed steps. Lightning counts every optimizer step and steps its schedulers after it, committed
    or not; a discarded step is undone before the next quorum, so that ``max_steps``, checkpoint names and
    the learning rate follow committed steps only -- the same in every group, whichever joined when (a group
    that joins heals only when torchft's committed step differs)."""

    def __init__(
        self, trainer: Any, optimizers: Sequence[Optimizer], schedulers: Sequence[Any], set_global_step: Callable
    ) -> None:
        self.trainer = trainer
        self.optimizers = list(optimizers)
        self.schedulers = list(schedulers)
        self.set_global_step = set_global_step
        self._snapshot: Optional[tuple[int, list[Any], list[Any]]] = None

    def undo_if_discarded(self, group: ReplicaGroup) -> None:
        """Before the quorum: if the last step was discarded, back to the counters it started with."""
        if group.last_step_discarded and self._snapshot is not None:
            global_step, schedulers, hyper_parameters = self._snapshot
            for scheduler, state in zip(self.schedulers, schedulers):
                scheduler.load_state_dict(state)
            for optimizer, groups in zip(self.optimizers, hyper_parameters):
                for param_group, values in zip(optimizer.param_groups, groups):
                    param_group.update(values)
            self.set_global_step(global_step)
            group.last_step_discarded = False

    def remember(self) -> None:
        """After the quorum (and any heal): the counters this step starts with."""
        self._snapshot = (
            self.trainer.global_step,
            copy.deepcopy([scheduler.state_dict() for scheduler in self.schedulers]),
            [[_hyper_parameters(group) for group in optimizer.param_groups] for optimizer in self.optimizers],
        )


def _hyper_parameters(param_group: dict[str, Any]) -> dict[str, Any]:
    return copy.deepcopy({key: value for key, value in param_group.items() if key != "params"})


# ------------------------------------------------------------------------------------------------ healing
def local_state(tree: Any) -> Any:
    """``tree`` with every DTensor replaced by this rank's shard (detached copies): what a peer's rank of
    the same index needs, in a form torchft's transport can carry."""
    if isinstance(tree, DTensor):
        return tree.to_local().detach().clone()
    if isinstance(tree, Tensor):
        return tree.detach().clone()
    if isinstance(tree, dict):
        return {key: local_state(value) for key, value in tree.items()}
    if isinstance(tree, (list, tuple)):
        return type(tree)(local_state(value) for value in tree)
    return tree


@torch.no_grad()
def copy_local_state_(live: Any, received: Any) -> None:
    """Copy ``received`` (from :func:`local_state` on a peer) into the live tensors of ``live`` in place."""
    if isinstance(live, DTensor):
        live.to_local().copy_(received)
    elif isinstance(live, Tensor):
        live.copy_(received)
    elif isinstance(live, dict):
        for key, value in live.items():
            copy_local_state_(value, received[key])
    elif isinstance(live, (list, tuple)):
        for value, other in zip(live, received):
            copy_local_state_(value, other)


def optimizer_local_state(optimizer: Optimizer) -> dict[str, Any]:
    """The optimizer's per-parameter states and hyper-parameters, this rank's shards."""
    state = optimizer.state_dict()
    return {"state": local_state(state["state"]), "param_groups": state["param_groups"]}


def load_optimizer_local_state(optimizer: Optimizer, received: dict[str, Any]) -> None:
    """Give ``optimizer`` a peer's states: created first if it never stepped, then copied into in place, so
    that they stay DTensors on this group's mesh; hyper-parameters (learning rate) too."""
    if received["state"] and not optimizer.state:
        compat.init_optimizer_state(optimizer)
    own = optimizer.state_dict()
    copy_local_state_(own["state"], received["state"])
    for group, peer in zip(optimizer.param_groups, received["param_groups"]):
        group.update({key: value for key, value in peer.items() if key != "params"})


def training_state(
    model_state: dict[str, Any], optimizers: Sequence[Optimizer], schedulers: Sequence[Any], global_step: int
) -> dict[str, Any]:
    """What a joining group takes from this one (this rank's shards): the model, the optimizers' and
    schedulers' states and the step count. Runs in torchft's quorum thread at the start of a step; reads
    ``model_state``, the sharded state dict taken when the group joined (whose DTensors are the sharded
    parameters and buffers themselves), not the module, whose state-dict hooks must not run in another
    thread while its forward is being entered. Copies, so the snapshot is the step's start."""
    return {
        "model": local_state(model_state),
        "optimizers": [optimizer_local_state(optimizer) for optimizer in optimizers],
        "schedulers": [scheduler.state_dict() for scheduler in schedulers],
        "global_step": global_step,
    }


def load_training_state(
    state: dict[str, Any],
    model_state: dict[str, Any],
    optimizers: Sequence[Optimizer],
    schedulers: Sequence[Any],
    set_global_step: Callable[[int], None],
) -> None:
    """Heal from a peer's :func:`training_state`, in place (every rank of the group loads its own shards)."""
    copy_local_state_(model_state, state["model"])
    for optimizer, received in zip(optimizers, state["optimizers"]):
        load_optimizer_local_state(optimizer, received)
    for scheduler, received in zip(schedulers, state["schedulers"]):
        scheduler.load_state_dict(received)
    set_global_step(state["global_step"])


def state_hooks(
    module: nn.Module,
    optimizers: Sequence[Optimizer],
    schedulers: Sequence[Any] = (),
    global_step: Callable[[], int] = lambda: 0,
    set_global_step: Callable[[int], None] = lambda step: None,
) -> tuple[Callable[[], dict[str, Any]], Callable[[dict[str, Any]], None]]:
    """What this group serves to a joining one and how it heals: the model, the optimizers (states and
    hyper-parameters), the schedulers and the step count -- a Fabric loop has neither of the last two (its
    counters follow torchft's committed step)."""
    model_state = module.state_dict()  # sharded now
    return (
        lambda: training_state(model_state, optimizers, schedulers, global_step()),
        lambda state: load_training_state(state, model_state, optimizers, schedulers, set_global_step),
    )


def trainer_state_hooks(
    trainer: Any, module: nn.Module, optimizers: Sequence[Optimizer], schedulers: Sequence[Any]
) -> tuple[Callable[[], dict[str, Any]], Callable[[dict[str, Any]], None], CommittedStepCounters]:
    """For a Lightning Trainer: :func:`state_hooks` with its step count, and its step counters kept to
    committed steps."""

    def set_global_step(step: int) -> None:
        compat.set_global_step(trainer, step)

    state_fn, load_fn = state_hooks(module, optimizers, schedulers, lambda: trainer.global_step, set_global_step)
    return state_fn, load_fn, CommittedStepCounters(trainer, optimizers, schedulers, set_global_step)
