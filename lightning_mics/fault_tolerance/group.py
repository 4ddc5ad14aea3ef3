"""This replica group's torchft ``Manager``: the quorum at every step, healing a joining group, commit, and a
watchdog that takes a hung rank down."""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any, Optional

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_mics import _compat as compat
from lightning_mics.fault_tolerance.agreement import (
    GroupConfiguration,
    agreement_message,
    agreement_verdict,
    catching_up_groups,
    check_healed_whole,
    configurations_differ,
    drift_verdict,
    present_groups,
    reference_group,
)
from lightning_mics.fault_tolerance.catch_up import CatchUp, SnapshotServer
from lightning_mics.fault_tolerance.config import LIGHTHOUSE_ENV, FaultTolerance
from lightning_mics.fault_tolerance.errors import (
    CatchUpFailed,
    LighthouseUnavailable,
    ReplicaGroupRankLost,
    ReplicaGroupRefused,
    ReplicaGroupsDiverged,
    TooFewReplicaGroups,
)
from lightning_mics.fault_tolerance.group_vote import GroupVote, GroupVoteFailed, local_address_towards
from lightning_mics.fault_tolerance.heal_state import split_shards

#: Seconds between two quorums while fewer than ``min_replica_groups`` groups are live.
BELOW_MINIMUM_POLL_S = 1.0

log = logging.getLogger("lightning_mics.fault_tolerance")


class ReplicaGroup:
    """This group's torchft ``Manager``: quorum, commit, and the state a joining
    group heals from (``state_fn`` / ``load_fn``, called on every rank of the group for its own shards)."""

    #: a parameter check's exchange started at this step's start, finished at its commit
    #: (:meth:`_start_parameter_check`)
    _parameter_check: Optional[_ParameterCheck] = None

    def __init__(
        self,
        options: FaultTolerance,
        device: torch.device,
        state_fn: Callable[..., dict[str, Any]],
        load_fn: Callable[[dict[str, Any]], None],
        configuration: Optional[GroupConfiguration] = None,
        parameter_digest: Optional[Callable[[], list[int]]] = None,
    ) -> None:
        try:
            from torchft import Manager
            from torchft.checkpointing.pg_transport import PGTransport
            from torchft.process_group import ProcessGroupGloo, ProcessGroupNCCL
        except ModuleNotFoundError as missing:
            raise ModuleNotFoundError(
                "fault_tolerance needs torchft: pip install 'lightning-mics[ft]' (or torchft==0.2.0)."
            ) from missing

        self.options = options
        self.device = device
        self.configuration = configuration or GroupConfiguration(())
        #: this rank's parameter shards as digest chunks (:func:`~.agreement.parameter_digest_chunks`), compared
        #: across groups every ``check_parameters_every`` steps; ``None``: not compared
        self.parameter_digest = parameter_digest
        self._load_fn = load_fn
        self._state_fn = state_fn
        #: ``heal="catch_up"``: this rank's snapshot server (it serves a joining group's same rank), bound to this
        #: host's address on the route to the job's master -- the address torchft's groups reach each other at
        self.snapshots = (
            SnapshotServer(
                options.catch_up_bytes_per_s,
                wait_s=options.timeout,
                host=local_address_towards(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]))[1],
            )
            if options.heal == "catch_up"
            else None
        )
        #: while this group catches up after joining: the snapshot downloading and the steps kept meanwhile
        self.catch_up: Optional[CatchUp] = None
        #: optimizer steps replayed by this group's last catch-up
        self.replayed_steps = 0
        #: the groups of the last quorum and those of them that contribute nothing in it (catching up), from its
        #: agreement -- the same sets in every group of the quorum
        self._quorum_groups: tuple[int, ...] = ()
        self.not_contributing: frozenset[int] = frozenset()
        #: :meth:`share_holders` of the current step (``None``: not asked yet since the step's quorum)
        self._holders: Optional[tuple[list[tuple[int, int]], int]] = None
        _forget_earlier_manager()
        #: the group's own yes/no exchange (a step's commit, a lost rank's check): direct connections to its rank 0
        self._vote = GroupVote(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), _vote_timeout(options))
        timeout = timedelta(seconds=options.timeout)
        pg = ProcessGroupNCCL(timeout=timeout) if device.type == "cuda" else ProcessGroupGloo(timeout=timeout)
        #: torchft's reconfigurable group of this rank index across the quorum's groups (hop 2's wire)
        self.pg = pg
        self._pg_is_gloo = isinstance(pg, ProcessGroupGloo)
        try:
            self.manager = Manager(
                pg=pg,
                load_state_dict=lambda state: self._heal(state, load_fn),
                state_dict=lambda: self._serve(state_fn),
                min_replica_size=options.min_replica_groups,
                use_async_quorum=False,  # heal before the forward, so no step trains on stale weights
                timeout=timeout,
                quorum_timeout=timedelta(seconds=options.quorum_timeout),
                connect_timeout=timeout,  # an unreachable Lighthouse is an error within the configured timeout
                heartbeat_interval=timedelta(seconds=options.heartbeat_interval),
                # torchft's default is evaluated when torchft is imported: a process forked after that import
                # (a fork server, a launcher that preloads) would advertise its parent's host name to the others
                hostname=socket.gethostname(),
                rank=dist.get_rank(),
                world_size=dist.get_world_size(),
                lighthouse_addr=options.lighthouse,
                replica_id=self._replica_id(options.replica_group),
                init_sync=False,  # every group starts from the same seed and rank 0's broadcast weights
                # the heal's state (and a catch-up's snapshot token) over the groups' own process group: torchft's
                # default HTTP transport serves it on every interface to anyone who asks for its URL
                checkpoint_transport=PGTransport(pg, timeout=timeout, device=device),
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
        #: how many times this rank asked the Lighthouse for a quorum (``quorum_every`` makes it fewer than steps)
        self.quorums_asked = 0
        #: a step was discarded since the last quorum: the next step asks for one (torchft's commit decision is
        #: the same on every rank of the group, where an error it recorded may be on one rank only)
        self._discarded_since_quorum = False
        #: whether this step ran a quorum (then torchft's own commit ends it; else the group's vote)
        self._quorum_this_step = False
        #: whether the last step this group finished was discarded
        self.last_step_discarded = False
        self.closed = False
        self._participants: Optional[int] = None
        #: (torchft's quorum number, committed step) of the last step's quorum
        self._last_quorum: Optional[tuple[Any, int]] = None
        self._outage_started: Optional[float] = None
        self._watchdog = Watchdog(options.watchdog)

    def keep_alive(self) -> None:
        """A step that runs no quorum (DiLoCo's inner steps: the quorum is once per round): the watchdog still
        learns that this rank is making progress."""
        self._watchdog.kick()

    def start_step(self, force_quorum: bool = False) -> None:
        """The quorum for the next optimizer step -- at every ``quorum_every``-th committed step, after a
        discarded one, at this process's first step, or when ``force_quorum`` (a joining group heals here, before
        its forward; in between the step trains in the last quorum) -- then the checks torchft does not make:
        every rank of this group is there (a lost one ends the group at once, not after ``quorum_timeout``), at
        least ``min_replica_groups`` groups are live (else wait, without training, at most ``quorum_timeout``),
        every rank of this group healed (or none did), every group in the quorum was started alike, and -- every
        ``check_parameters_every`` steps -- the groups' parameters are still bit-identical (that exchange runs
        behind the step's forward and backward where the membership is the last step's: :meth:`commit` finishes
        it). A failed check ends this group (or, for diverged parameters, the run) with an error that says
        which."""
        self._watchdog.kick()
        self._holders = None  # the quorum and its contributors may change below
        self._settle_parameter_check()  # one a step started and never committed (no hop 2 ran)
        step = self.manager.current_step()
        self._quorum_this_step = force_quorum or self._needs_quorum(step)
        if not self._quorum_this_step:  # the last commit's vote was this group's presence check
            if self._checks_parameters(step):
                self._start_parameter_check(step)
            return
        self._check_ranks_present()
        self._quorum()
        waited_since = time.monotonic()
        rounds = max(1, int(self.options.quorum_timeout / BELOW_MINIMUM_POLL_S))
        for _ in range(rounds):  # counted, not timed: every rank of the group takes the same decision
            if self.manager.num_participants() >= self.options.min_replica_groups:
                break
            time.sleep(BELOW_MINIMUM_POLL_S)
            self._watchdog.kick()
            self._quorum()
        else:
            if self.manager.num_participants() < self.options.min_replica_groups:
                raise TooFewReplicaGroups(
                    f"fault tolerance: {self.manager.num_participants()} replica group(s) live, min_replica_groups="
                    f"{self.options.min_replica_groups} required; waited {time.monotonic() - waited_since:.0f} s "
                    f"(quorum_timeout={self.options.quorum_timeout:g}) without training. This group stops at "
                    f"torchft step {self.manager.current_step()}: relaunch the missing groups (they heal from the "
                    "live ones), or lower min_replica_groups."
                )
        self._publish_snapshot()
        step = self.manager.current_step()
        same_quorum = self._same_quorum_as_last_step(step)
        if not same_quorum:  # a heal (and a group started unlike the others) can only come with a new quorum
            check_healed_whole(step, self.device)
        # while a group catches up, at every quorum: it starts contributing without a new membership (a catch-up
        # starts only with one: its heal)
        if not same_quorum or self.not_contributing:
            self._check_agreement()
        elif self._checks_parameters(step):
            self._start_parameter_check(step)
        participants = self.manager.num_participants()
        if participants != self._participants:
            self._log_membership(participants)
        self._participants = participants

    def _needs_quorum(self, step: int) -> bool:
        """Whether this step asks for a quorum: the same answer in every rank of every group of the last quorum
        (they are at the same committed step, and a step is discarded by a whole group), except that a group
        whose step was discarded while another's committed asks alone -- the other's next collective then times
        out (``timeout``), is discarded too, and both meet in the next quorum. While a group of the last quorum
        catches up, every step asks (every group learned it from the same agreement): the joiner contributes from
        the step after it caught up, not up to ``quorum_every`` steps later."""
        return (
            self._last_quorum is None
            or self._discarded_since_quorum
            or step % self.options.quorum_every == 0
            or bool(self.not_contributing)  # a group catching up contributes from the quorum after it caught up
        )

    def _same_quorum_as_last_step(self, step: int) -> bool:
        """Whether this step's quorum is the one the last step ran in, with no heal in between: then the groups
        were checked alike when it formed, and the agreement's round trip is skipped (it still runs on
        parameter-check steps). The Lighthouse numbers every new membership; every member of a quorum saw
        the same earlier ones, so all groups decide alike. Without torchft's quorum number: never."""
        quorum_id = compat.quorum_id(self.manager)
        last, self._last_quorum = self._last_quorum, (quorum_id, step)
        return (
            quorum_id is not None
            and last is not None
            and last[0] == quorum_id
            and 0 <= step - last[1] <= self.options.quorum_every
        )

    def _checks_parameters(self, step: int) -> bool:
        every = self.options.check_parameters_every
        return self.parameter_digest is not None and step > 0 and step % every == 0

    def _quorum(self) -> None:
        self.quorums_asked += 1
        self._discarded_since_quorum = False
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

    def _check_ranks_present(self) -> None:
        """One vote of the group before the quorum: a rank that died fails it at once (its connections are
        reset), where the quorum would wait ``quorum_timeout`` for it and then blame the Lighthouse."""
        self._on_any_rank(False)

    def _rank_lost(self, error: Exception) -> ReplicaGroupRankLost:
        return ReplicaGroupRankLost(
            f"fault tolerance: a rank of replica group {self.options.replica_group} was lost ({error}); this "
            "group ends (its shards are incomplete) while the other groups train on. Relaunch the whole group's "
            "job: it heals from a live group."
        )

    def _serve(self, state_fn: Callable[..., dict[str, Any]]) -> dict[str, Any]:
        """What a joining group's same rank receives at the quorum (in torchft's quorum thread, while this
        rank's training waits for the quorum): this group's configuration and its training state -- with
        ``heal="catch_up"`` all of it but the shards, which this rank serves from a snapshot instead."""
        if self.catch_up is not None:
            raise RuntimeError(
                "fault tolerance: this group is still catching up (its shards are a snapshot behind the live "
                "groups'), so it cannot serve a joining group; that group's heal fails and it heals again at its "
                "next quorum"
            )
        if self.snapshots is None:
            return {"configuration": self.configuration.items, "state": state_fn()}
        step = self.manager.current_step()  # the shards follow from the training thread (:meth:`_publish_snapshot`)
        state = state_fn(shards=False)
        return {"configuration": self.configuration.items, "state": state,
                "snapshot": {"address": self.snapshots.reserve(step), "step": step,
                             "max_bytes": state.get("snapshot_bytes_bound")}}

    def _publish_snapshot(self) -> None:
        """After a quorum at which this rank served a catching-up heal, before the step's forward: copy the shards
        into the snapshot the joining rank downloads (the state at the start of the step, as the heal's rest)."""
        if self.snapshots is None or self.snapshots.reserved_step is None:
            return
        _, shards = split_shards(self._state_fn())
        self.snapshots.publish(self.snapshots.reserved_step, shards)

    def _heal(self, received: dict[str, Any], load_fn: Callable[[dict[str, Any]], None]) -> None:
        """Refuse a peer started differently before touching any state; else load its state -- or, from a peer
        serving a snapshot, all but the shards, and start catching up."""
        theirs = GroupConfiguration(tuple(received["configuration"]))
        differences = self.configuration.differences(theirs)
        if differences:
            raise ReplicaGroupRefused(
                f"fault tolerance: replica group {self.options.replica_group} cannot heal from the live groups: it "
                f"was started differently ({'; '.join(differences)}, this group's vs theirs). Start every group "
                "with the same configuration."
            )
        load_fn(received["state"])
        snapshot = received.get("snapshot")
        if snapshot is not None:
            self.catch_up = CatchUp(
                snapshot["address"], snapshot["step"], self.options.timeout, max_bytes=snapshot.get("max_bytes")
            )
            log.warning(
                "fault tolerance: joined at step %d; fetching a live group's shards in the background meanwhile "
                "(catch-up heal)", self.manager.current_step()
            )
            return
        log.warning("fault tolerance: healed from a live replica group at step %d", self.manager.current_step())

    def finish_catch_up(self, wait: bool = False) -> None:
        """At the start of a step while catching up: once every rank of the group has its snapshot (one tiny
        vote of the group, every step until then), load it and replay the kept steps. The group
        contributes from this step on (its quorum's agreement tells the others). A rank whose download failed ends
        the whole group, saying why.
        ``wait``: first wait for this rank's download (up to ``timeout``) -- before an evaluation or the end of
        training, which must see the live groups' shards."""
        catch_up = self.catch_up
        if catch_up is None:
            return
        if wait:
            catch_up.wait(self.options.timeout)
        some_not_done, some_failed = self._on_any_rank(not catch_up.downloaded, catch_up.failed)
        if some_not_done:
            return
        if some_failed:
            raise CatchUpFailed(
                f"fault tolerance: replica group {self.options.replica_group} could not fetch its shards from the "
                f"live group serving them ({catch_up.error or 'another rank of this group failed'}; snapshot "
                f"{catch_up.location}). This group ends; relaunch it and it heals anew."
            )
        self._load_fn(catch_up.snapshot())
        self.replayed_steps = catch_up.replay()
        self.catch_up = None
        log.warning(
            "fault tolerance: caught up at step %d: loaded the snapshot of step %d and replayed %d step(s); this "
            "group contributes from now on", self.manager.current_step(), catch_up.step, self.replayed_steps
        )

    def keep_for_catch_up(self, optimizer: Any) -> None:
        """After ``optimizer`` stepped: while catching up, a committed step's gradients and hyper-parameters are
        kept for the replay (the step itself updated shards that the snapshot will replace)."""
        if self.catch_up is not None and not self.last_step_discarded:
            self.catch_up.keep(optimizer)

    @property
    def contributes(self) -> bool:
        """Whether this group's gradients count in this quorum's steps (not while it catches up)."""
        return self.options.replica_group not in self.not_contributing

    def _contributors(self) -> list[int]:
        return [group for group in self._quorum_groups if group not in self.not_contributing]

    def _check_agreement(self) -> None:
        """Every group of the quorum publishes its index, configuration digest and, on a checking step, its
        parameter digest (one small all-reduce). A group claiming a taken index, or started unlike the others,
        is refused before any step commits, told which settings differ; parameters that differ end the run."""
        group = self.options.replica_group
        assert group is not None
        step = self.manager.current_step()
        checks_parameters = self._checks_parameters(step)
        message = self._agreement_message(with_parameters=checks_parameters)
        self.manager.allreduce(message).wait()
        exchanged = self.manager.errored() is None
        summed = self._quorum_sum(message) if exchanged else None
        drift = drift_verdict(summed, step) if summed is not None and checks_parameters else None
        # One outcome for the whole group. Each rank exchanged over its own torchft process group, and a peer lost
        # during the exchange can fail it on one rank while another's completed. Seen: a group killed during a
        # parameter-check step's exchange; on each survivor group rank 0's exchange failed and it went on into the
        # step, rank 1's completed and it waited in the drift check's all-reduce rank 0 had skipped -- both
        # survivors hung (the group's own world has no short timeout). And a rank that went on with this quorum's
        # membership while another kept the last would place the data shares otherwise (other collectives).
        failed, drifted = self._on_any_rank(not exchanged, drift is not None)
        if failed:  # every rank of the group discards the step; the next quorum checks again
            if exchanged:
                self.manager.report_error(RuntimeError(
                    "fault tolerance: the quorum's agreement exchange failed on another rank of this group"))
            return
        assert summed is not None
        self._quorum_groups = tuple(present_groups(summed))
        self.not_contributing = catching_up_groups(summed)
        if self.snapshots is not None and self.snapshots.serving and not self.not_contributing:
            self.snapshots.stop()  # nobody catches up from it any more: its listener closes too
        verdict = agreement_verdict(summed, group)
        if configurations_differ(summed):  # every group runs this exchange, or none
            theirs = self._exchange_configurations().get(reference_group(summed))
            differences = self.configuration.differences(theirs) if theirs is not None else []
            if verdict is not None and differences:
                verdict += " Differences (this group's vs theirs): " + "; ".join(differences)
        if verdict is not None:
            raise ReplicaGroupRefused(f"fault tolerance: replica group {group} refused at the quorum: {verdict}")
        if drifted:  # any rank of the group: the whole group ends
            raise _diverged(drift, step)

    def _agreement_message(self, with_parameters: bool) -> Tensor:
        """This group's entry of the agreement (:func:`~.agreement.agreement_message`), with this rank's parameter
        digest on a parameter-check step, on the device torchft's group exchanges it from."""
        assert self.options.replica_group is not None
        parameters = self.parameter_digest() if with_parameters else None  # type: ignore[misc]
        return agreement_message(
            self.options.replica_group, self.configuration.digest_chunks(), parameters,
            catching_up=self.catch_up is not None,
        ).to(self.device)

    def _quorum_sum(self, message: Tensor) -> Tensor:
        """Every group's entries added, from the exchanged ``message`` (torchft averaged it over the quorum)."""
        return message.cpu() * self.manager.num_participants()

    def _on_any_rank(self, *conditions: bool) -> tuple[bool, ...]:
        """Each of this rank's ``conditions`` or'ed over every rank of the group (the group's vote,
        :mod:`~.group_vote`), so every rank takes the same branch after it; a rank lost meanwhile fails it: the
        group ends, saying so."""
        try:
            return self._vote.any(*conditions)
        except GroupVoteFailed as error:
            raise self._rank_lost(error) from error

    def _start_parameter_check(self, step: int) -> None:
        """Start comparing the groups' parameter digests (the agreement's exchange, the membership as the last
        step's) without waiting for it: the exchange is one more cross-group synchronisation, which behind the
        forward and backward costs nothing -- hop 2 waits for every group anyway -- where before the forward it
        stalled every group for the slowest one (about a tenth of a step per check on the benchmark's host). The
        parameters it digests are the step's starting ones; :meth:`commit` finishes it before the optimizer
        steps. Every group of the quorum starts it at the same step, before hop 2's collectives: the same order
        of collectives on every rank."""
        message = self._agreement_message(with_parameters=True)
        self._parameter_check = _ParameterCheck(step, message, self.manager.allreduce(message))

    def _finish_parameter_check(self) -> Optional[tuple[int, Optional[str]]]:
        """Wait for the started parameter check: ``None`` if none was started, else (the committed step it
        checks, why the groups' parameters differ or ``None`` -- they agree, or the exchange failed: then torchft
        recorded the error and the step does not commit)."""
        check, self._parameter_check = self._parameter_check, None
        if check is None:
            return None
        check.work.wait()
        if self.manager.errored() is not None:
            return check.step, None
        return check.step, drift_verdict(self._quorum_sum(check.message), check.step)

    def _settle_parameter_check(self) -> None:
        """Finish a started parameter check, if there is one, and end the run on every rank of this group if any
        rank saw the groups' parameters differ (each rank compares its own rank index's shards): one vote of
        the group, so no rank goes on into a collective another skipped. Whether a
        check is pending is the same on every rank of the group."""
        finished = self._finish_parameter_check()
        if finished is None:
            return
        step, drift = finished
        (drifted,) = self._on_any_rank(drift is not None)
        if drifted:
            raise _diverged(drift, step)

    def _start(self, collective: Callable[[], Any]) -> Optional[_RecordedOnFailure]:
        """Start one of hop 2's collectives over torchft's process group: ``None`` when the step already failed
        or the transport refused at once (DistBackendError included); else the started work, whose failure
        :meth:`_RecordedOnFailure.wait` records for :meth:`commit` (the step is dropped) instead of raising --
        what torchft's ``Manager.wrap_future`` does, without its timer and callbacks."""
        if self.manager.errored() is not None:
            return None
        try:
            return _RecordedOnFailure(collective(), self.manager)
        except RuntimeError as error:  # a transport failure is the step's
            self.manager.report_error(error)
            return None

    def start_all_gather(self, message: Tensor) -> Optional[tuple[list[Tensor], _RecordedOnFailure]]:
        """Start gathering every quorum group's ``message`` (same shape in each, quorum order): ``(gathered,
        started)``, or ``None`` as :meth:`_start`."""
        from torch.distributed.distributed_c10d import AllgatherOptions

        gathered = [torch.empty_like(message) for _ in range(self.manager.num_participants())]
        started = self._start(lambda: self.pg.allgather([gathered], [message], AllgatherOptions()))
        return None if started is None else (gathered, started)

    def start_all_gather_into(self, output: Tensor, message: Tensor) -> Optional[tuple[Tensor, _RecordedOnFailure]]:
        """Start gathering every quorum group's ``message`` into ``output`` (one flat tensor, quorum order, no
        copy afterwards): ``(output, started)``, or ``None`` as :meth:`_start`."""
        from torch.distributed.distributed_c10d import AllgatherOptions

        gloo = self._gloo_process_group()
        if gloo is not None:  # gloo's flat all-gather: a third less CPU per message than its coalesced one
            started = self._start(lambda: compat.gloo_all_gather_flat(gloo, output, message))
        else:
            started = self._start(
                lambda: self.pg.allgather_into_tensor_coalesced([output], [message], AllgatherOptions())
            )
        return None if started is None else (output, started)

    def _gloo_process_group(self) -> Any:
        """torchft's current gloo process group under its reconfigurable wrapper, or ``None`` (NCCL, whose wrapper
        adds its abort-on-timeout context to every collective, or none configured). Why reach under it: torchft's
        wrapper offers only the coalesced all-gather, whose gloo implementation gathers into per-rank temporaries
        and copies them out -- 1.02 ms of CPU per hop-2 message where the flat one takes 0.69 ms (3 gloo ranks,
        98,304 fp32), and on a host whose cores the ranks share, CPU is step time. The wrapper adds nothing else
        to a gloo collective (no work wrapping, no context)."""
        return compat.wrapped_process_group(self.pg) if self._pg_is_gloo else None

    def start_all_reduce_sum(self, message: Tensor) -> Optional[_RecordedOnFailure]:
        """Start summing ``message`` in place over the quorum's groups, or ``None`` as :meth:`_start`. The caller
        divides (by the contributing groups)."""
        from torch.distributed.distributed_c10d import AllreduceOptions

        options = AllreduceOptions()
        options.reduceOp = dist.ReduceOp.SUM
        return self._start(lambda: self.pg.allreduce([message], options))

    def start_all_to_all(self, message: Tensor) -> Optional[tuple[Tensor, _RecordedOnFailure]]:
        """Start an all-to-all of ``message`` (``[quorum groups, ...]``: block ``q`` goes to quorum rank ``q``):
        ``(received, started)`` (block ``q`` from quorum rank ``q``), or ``None`` as :meth:`_start`."""
        from torch.distributed.distributed_c10d import AllToAllOptions

        received = torch.empty_like(message)
        started = self._start(lambda: self.pg.alltoall_base(received, message, [], [], AllToAllOptions()))
        return None if started is None else (received, started)

    def share_holders(self) -> tuple[list[tuple[int, int]], int]:
        """``exact_trajectory``'s sum in share order: for each data share of the job, (the quorum rank of the group
        reading it in this step, its place among that group's shares), and the most shares one group reads. The
        contributors are numbered as :meth:`participation` numbers them: by quorum rank when every group of the
        quorum contributes, else in group order -- then mapped to quorum ranks, which torchft orders by replica
        id (checked: a different order would mix shares up, so it raises)."""
        if self._holders is None:  # once per step: every message of the step asks
            self._holders = self._share_holders()
        return self._holders

    def _share_holders(self) -> tuple[list[tuple[int, int]], int]:
        shares = self.options.num_replica_groups
        assert shares is not None
        _, _, contributors = self.participation()
        if not self.not_contributing:
            ranks = list(range(contributors))
        else:
            by_quorum_rank = sorted(self._quorum_groups, key=lambda group: self._replica_id(group))
            mine = self.options.replica_group
            if mine not in by_quorum_rank or by_quorum_rank.index(mine) != self.manager.participating_rank():
                raise RuntimeError(
                    f"fault tolerance: torchft ranked this quorum's groups otherwise than by replica id "
                    f"({by_quorum_rank}, this group {mine} at rank {self.manager.participating_rank()}): "
                    "exact_trajectory cannot place the data shares; set exact_trajectory=False."
                )
            ranks = [by_quorum_rank.index(group) for group in self._contributors()]
        return [(ranks[share % contributors], share // contributors) for share in range(shares)], -(
            -shares // contributors
        )

    @staticmethod
    def _replica_id(group: int) -> str:
        return f"mics_group_{group}"

    def _exchange_configurations(self) -> dict[int, GroupConfiguration]:
        """Every group's configuration as text, by group index (an all-gather through torchft; only on a
        mismatch): what lets a refused group name the settings that differ."""
        started = self.start_all_gather(self.configuration.encoded(self.options.replica_group or 0).to(self.device))
        if started is None:
            return {}
        gathered, future = started
        future.wait()
        if self.manager.errored() is not None:
            return {}
        return dict(GroupConfiguration.decoded(m) for m in gathered)

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

    def commit(self) -> bool:
        """Whether every rank of every group in the quorum finished the step (then the optimizer may step).

        After a quorum this is torchft's ``should_commit`` (its manager server gathers the group's verdicts; it
        also closes a heal's checkpoint window). On a step that kept the last quorum it is one all-reduce of a
        flag in this group's own world -- what ``should_commit`` decides, without its round trip to the manager
        server (several ms a step) -- and torchft's step count is advanced through its public state."""
        if self._quorum_this_step:
            self._settle_parameter_check()
            committed = self.manager.should_commit()
        else:
            committed = self._commit_within_group(self._finish_parameter_check())
        self.last_step_discarded = not committed
        if not committed:
            self.discarded_steps += 1
            self._discarded_since_quorum = True
            log.warning(
                "fault tolerance: step %d discarded (a replica group failed during it; %d discarded so far)",
                self.manager.current_step(),
                self.discarded_steps,
            )
        return committed

    def _commit_within_group(self, parameter_check: Optional[tuple[int, Optional[str]]] = None) -> bool:
        """torchft's commit rule -- no error recorded on any rank of this group (its process group's included)
        and enough groups live -- decided by one all-reduce in this group's world; a committed step advances
        torchft's step and committed-batch counts as ``should_commit`` does. A rank lost since the step began
        fails the all-reduce: this group ends, saying so. The same all-reduce tells every rank whether one found
        the groups' parameters differ (``parameter_check``: the step's, as :meth:`_finish_parameter_check` gives
        it): then the run ends on all of them."""
        manager = self.manager
        error = self.pg.errored()
        if error is not None:
            manager.report_error(error)
        ok = manager.errored() is None and manager.num_participants() >= self.options.min_replica_groups
        step, drift = parameter_check or (manager.current_step(), None)
        failed, drifted = self._on_any_rank(not ok, drift is not None)
        if drifted:
            raise _diverged(drift, step)
        if failed:
            return False
        state = manager.state_dict()
        manager.load_state_dict(
            {**state, "step": state["step"] + 1,
             "batches_committed": state["batches_committed"] + manager.num_participants()}
        )
        return True

    def participation(self) -> tuple[int, Optional[int], int]:
        """After the quorum: (the committed step the groups are at, this group's index among the step's
        contributing groups or ``None``, how many contribute -- what hop 2 averages over) -- what decides the
        step's data (:mod:`~.trajectory`). Every group of the quorum contributes but those catching up; then the
        contributors are numbered in group order."""
        step = self.manager.current_step()
        if not self.not_contributing:
            return step, self.manager.participating_rank(), self.manager.num_participants()
        contributors = self._contributors()
        mine = self.options.replica_group
        return step, contributors.index(mine) if mine in contributors else None, len(contributors)

    def contributing_groups(self) -> int:
        """How many groups' gradients this step's hop 2 sums (all of the quorum but those catching up)."""
        return len(self._contributors()) if self.not_contributing else self.manager.num_participants()

    @property
    def leads(self) -> bool:
        """Whether this group is the first of the current quorum: it logs and writes checkpoints for all (group 0
        while it is live, else the next) -- the same answer on every rank of a group, and on one group of the
        quorum. A group catching up does not lead: the first of the step's contributors does."""
        return self.participation()[1] == 0

    @property
    def writes_checkpoints(self) -> bool:
        """One group writes checkpoints for all (the others' would be copies): the leading one."""
        return self.leads

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
            self._vote.close()
            if self.snapshots is not None:
                self.snapshots.close()
            self.manager.shutdown(wait=False)


#: What rank 0 publishes as its Manager's address when it could not start one (the Lighthouse did not answer):
#: the other ranks then fail to connect within the timeout too, instead of waiting for an address forever.
_NO_MANAGER = "http://127.0.0.1:1"


def _diverged(drift: Optional[str], step: int) -> ReplicaGroupsDiverged:
    """The error that ends the run when a rank of this group saw the groups' parameters differ at ``step``:
    ``drift``, this rank's verdict, or -- where another rank saw it -- a pointer to that rank's error."""
    drift = drift or (
        f"another rank of this group found the replica groups' parameters differ after committed step {step} (its "
        "error names the groups)"
    )
    return ReplicaGroupsDiverged(f"fault tolerance: {drift}")


class _ParameterCheck:
    """A parameter check's exchange in flight: the step it checks, the agreement message (averaged in place over
    the quorum by torchft) and torchft's work."""

    def __init__(self, step: int, message: Tensor, work: Any) -> None:
        self.step, self.message, self.work = step, message, work


class _RecordedOnFailure:
    """A started collective of hop 2 whose failure is recorded in torchft's Manager when it is waited on (every
    message is waited on before the step's commit), never raised. No timer of torchft's per message: the process
    group ends a hung collective itself (gloo's own timeout; torchft's NCCL group aborts at its timeout). torchft's
    ``wrap_future`` woke its event-loop thread twice per message and ran a Python callback on the collective's
    thread: several percent of a step's CPU where the ranks share few cores (``no_failure.cpu_overhead``)."""

    def __init__(self, work: Any, manager: Any) -> None:
        self.work, self.manager = work, manager

    def wait(self) -> None:
        try:
            self.work.wait()
        except Exception as error:  # noqa: BLE001 -- whatever failed the message fails the step, not the rank
            self.manager.report_error(error)


def _vote_timeout(options: FaultTolerance) -> float:
    """How long a vote waits for a rank of the group. A rank that hangs in Python is taken down by its own
    watchdog within ``watchdog`` seconds (its connections close: the vote fails at once); the vote's own timeout
    is the backstop for a rank that cannot run even that (stopped, its host gone): the longer of the two."""
    return max(options.timeout, options.watchdog)


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
