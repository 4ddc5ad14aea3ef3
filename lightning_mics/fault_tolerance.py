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

import logging
import os
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from datetime import timedelta
from typing import Any, Optional

import torch
from torch import Tensor, nn
from torch.distributed.tensor import DTensor
from torch.optim import Optimizer

from lightning_mics import _compat as compat
from lightning_mics.grad_sync import pack_gradient_shards, unpack_gradient_shards

log = logging.getLogger(__name__)

LIGHTHOUSE_ENV = "TORCHFT_LIGHTHOUSE"
REPLICA_GROUP_ENV = "MICS_REPLICA_GROUP"
NUM_REPLICA_GROUPS_ENV = "MICS_NUM_REPLICA_GROUPS"


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
        return replace(self, lighthouse=lighthouse, replica_group=group, num_replica_groups=groups)


def _env_int(name: str) -> Optional[int]:
    value = os.environ.get(name)
    if value is None or value == "":
        return None
    if not value.isdigit():
        raise ValueError(f"{name}={value!r} must be a non-negative integer.")
    return int(value)


def check_fault_tolerant_layout(replication_degree: int, optim_beyond_partition: bool, wire: Any) -> None:
    """Refuse the layouts that cannot lose a group: inside one group's job, the world must be one partition
    (replicas live in other groups) and optimizer states may not be sharded across groups; hop 2 runs in the
    gradients' own dtype or a 16-bit float (torchft's all-reduce has no int8 wire)."""
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
    if wire is not None and wire.dtype is None:
        raise ValueError(
            f"fault_tolerance does not yet carry hop 2 in {wire.name} (torchft all-reduces floating-point tensors): "
            "use cross_replica_dtype='bf16' or 'fp16' (half the bytes), or None."
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
    ) -> None:
        try:
            from torchft import Manager
            from torchft.process_group import ProcessGroupGloo, ProcessGroupNCCL
        except ModuleNotFoundError as missing:
            raise ModuleNotFoundError(
                "fault_tolerance needs torchft: pip install 'lightning-mics[ft]' (or torchft==0.2.0)."
            ) from missing

        self.options = options
        timeout = timedelta(seconds=options.timeout)
        pg = ProcessGroupNCCL(timeout=timeout) if device.type == "cuda" else ProcessGroupGloo(timeout=timeout)
        self.manager = Manager(
            pg=pg,
            load_state_dict=load_fn,
            state_dict=state_fn,
            min_replica_size=options.min_replica_groups,
            use_async_quorum=False,  # heal before the forward, so no step trains on stale weights
            timeout=timeout,
            quorum_timeout=timedelta(seconds=options.quorum_timeout),
            rank=torch.distributed.get_rank(),
            world_size=torch.distributed.get_world_size(),
            lighthouse_addr=options.lighthouse,
            replica_id=f"mics_group_{options.replica_group}",
            init_sync=False,  # every group starts from the same seed and rank 0's broadcast weights
        )
        self.discarded_steps = 0
        self.closed = False
        self._participants: Optional[int] = None
        self._outage_started: Optional[float] = None
        self._watchdog = Watchdog(options.watchdog)

    def start_step(self) -> None:
        """The quorum for the next optimizer step (a group that joins heals here, before its forward)."""
        self._watchdog.kick()
        self.manager.start_quorum()
        participants = self.manager.num_participants()
        if participants != self._participants:
            self._log_membership(participants)
        self._participants = participants

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

    def commit(self) -> bool:
        """Whether every rank of every group in the quorum finished the step (then the optimizer may step)."""
        committed = self.manager.should_commit()
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
    the message's own, where the non-fault-tolerant ring sums 16-bit messages in fp32. Every group gets the
    same result, so the groups stay identical."""

    def __init__(self, module: nn.Module, group: ReplicaGroup, wire: Optional[Any] = None) -> None:
        self.module = module
        self.group = group
        self.dtype: Optional[torch.dtype] = None if wire is None else wire.dtype

    @torch.no_grad()
    def before_step(self) -> None:
        params = [p for p in self.module.parameters() if p.grad is not None]
        if params:
            flat = pack_gradient_shards(params)
            message = flat if self.dtype is None else flat.to(self.dtype)
            self.group.average_(message)
            unpack_gradient_shards(message.to(flat.dtype), params)
        if not self.group.commit():
            for param in self.module.parameters():
                param.grad = None

    def after_step(self) -> None:
        """Nothing after the step (the hook protocol of the engine's steps)."""


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
    module: nn.Module, optimizers: Sequence[Optimizer], schedulers: Sequence[Any], global_step: int
) -> dict[str, Any]:
    """What a joining group takes from this one (this rank's shards): the model, the optimizers' and
    schedulers' states and the step count. Runs in torchft's quorum thread at the start of a step, when
    every parameter is sharded; copies, so the snapshot is the step's start."""
    return {
        "model": local_state(module.state_dict()),
        "optimizers": [optimizer_local_state(optimizer) for optimizer in optimizers],
        "schedulers": [scheduler.state_dict() for scheduler in schedulers],
        "global_step": global_step,
    }


def load_training_state(
    state: dict[str, Any],
    module: nn.Module,
    optimizers: Sequence[Optimizer],
    schedulers: Sequence[Any],
    set_global_step: Callable[[int], None],
) -> None:
    """Heal from a peer's :func:`training_state`, in place (every rank of the group loads its own shards)."""
    copy_local_state_(module.state_dict(), state["model"])
    for optimizer, received in zip(optimizers, state["optimizers"]):
        load_optimizer_local_state(optimizer, received)
    for scheduler, received in zip(schedulers, state["schedulers"]):
        scheduler.load_state_dict(received)
    set_global_step(state["global_step"])
    log.warning("fault tolerance: healed from a live replica group at step %d", state["global_step"])
