"""What a replica group needs to find the others (``FaultTolerance``), read from options or the environment,
and the layouts that cannot lose a group."""

from __future__ import annotations

import os
from dataclasses import dataclass, replace
from typing import Optional

LIGHTHOUSE_ENV = "TORCHFT_LIGHTHOUSE"
REPLICA_GROUP_ENV = "MICS_REPLICA_GROUP"
NUM_REPLICA_GROUPS_ENV = "MICS_NUM_REPLICA_GROUPS"
#: A configuration digest crosses as two 16-bit integers in float64: their sums over every group stay exact
#: (through torchft's average and back), so every group reads back every other group's digest.
DIGEST_CHUNKS = 2
#: The agreement message has slots per possible group -- its configuration digest, its presence count, its
#: parameter digest and whether it is catching up -- the same length in every group whatever its options say
#: (an all-reduce of unequal lengths would fail in the transport, not with a clear error): 12 KB a quorum.
MAX_REPLICA_GROUPS = 256
AGREEMENT_BYTES = MAX_REPLICA_GROUPS * (2 * DIGEST_CHUNKS + 2) * 8
#: On a configuration mismatch the groups exchange their configurations as text, each in this many bytes, so
#: that a refused group is told which settings differ.
CONFIGURATION_BYTES = 16384


#: How a joining group heals (:attr:`FaultTolerance.heal`); ``"auto"`` resolves to one of the other two
#: (:meth:`FaultTolerance.with_heal_for`).
HEAL_MODES = ("auto", "blocking", "catch_up")


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
    #: seconds to wait for a quorum (longer than a step); also how long a group waits, without training, while
    #: fewer than ``min_replica_groups`` groups are live, before it ends with an error saying how many are
    quorum_timeout: float = 60.0
    #: seconds between this group's heartbeats to the Lighthouse. The Lighthouse counts a group as lost once its
    #: last heartbeat is older than its ``--heartbeat_timeout_ms``, so a slower heartbeat does not notice a loss
    #: later -- keep it a quarter of that timeout or less (0.5 s against the 2 s this project's docs start it with;
    #: torchft's own 5 s default leaves more), or a busy host's late heartbeat reads as a loss. Every heartbeat is an
    #: RPC to the Lighthouse, answered by a thread in each rank: torchft's 0.1 s took fault tolerance's background
    #: CPU to about 20 ms per second on the benchmark's host where 0.5 s takes about 6.5, and the training's step
    #: time 1-2.6 % more in paired runs where the ranks share their cores (``docs/fault-tolerance.md``).
    heartbeat_interval: float = 0.5
    #: seconds without a new step (quorum) after which a rank takes its whole process down: a hung group must
    #: die, not keep heartbeating and block everyone's quorum. Longer than a step plus any validation or save.
    watchdog: float = 900.0
    #: every this many committed steps the groups compare a digest of their parameter shards: a group that
    #: drifted (another learning rate slipped through, a bit flip) ends the run with an error naming the groups
    #: and the step, at that step's commit, instead of training on silently diverged. The digest is exact
    #: integer arithmetic over the shards' bits, one read of them per check; the exchange runs behind the
    #: step's forward and backward (before it where the quorum's membership changed).
    check_parameters_every: int = 10
    #: the groups ask the Lighthouse for a quorum at every committed step that is a multiple of this (and after
    #: a discarded step, and at a process's first step); in between they train in the last quorum. A lost group
    #: is noticed at once either way (its collective fails and the step is discarded, which forces a quorum);
    #: what waits is a *joining* group, for up to ``quorum_every - 1`` steps -- keep that shorter than
    #: ``quorum_timeout`` and the Lighthouse's ``--join_timeout_ms``. 1 (torchft's own cadence) costs a quorum round
    #: trip every step, which waits for the slowest group: several percent of a quarter-second step on the emulated
    #: cluster, about twice the default's cost (``docs/fault-tolerance.md``, "What it costs"); on steps of seconds
    #: either is negligible.
    quorum_every: int = 10
    #: every committed step reads the next global batch of one fixed sample order, split among the live groups
    #: (a lost group's samples are read by the others, a discarded step is re-done on the same samples, a
    #: restarted group continues at the committed step): the run with failures trains what the run without
    #: them does (:mod:`~.trajectory`). ``False``: each group reads its own fixed share of the data. ``None``
    #: (default): on with the Trainer; with Fabric each group reads its own share unless this is ``True``, and
    #: then the loop takes its micro-batches from ``MiCSFabricStrategy.training_batches(loader, accumulate)``.
    keep_trajectory: Optional[bool] = None
    #: how a joining group takes the training state from a live one. ``"auto"`` (default): ``"catch_up"`` wherever
    #: it applies -- every-step hop 2 without a loss scaler -- else ``"blocking"``, and the job log says which and
    #: why. ``"blocking"`` (torchft's way): at the
    #: quorum that admits it, before the step -- every live group waits for the transfer, which takes longer
    #: than a step when the state is large. ``"catch_up"``: at that quorum only the small state crosses
    #: (schedulers, step counts, hyper-parameters); the shards are copied by the serving group into host memory
    #: and fetched in the background while the joining group takes part in the steps without contributing --
    #: it reads no share of the data, sends zeros in hop 2 and keeps each committed step's averaged gradients.
    #: Once every rank has its snapshot the group loads it and replays the kept steps (bit-identical to the
    #: live groups), and it contributes from that step on (:mod:`~.catch_up`).
    heal: str = "auto"
    #: ``heal="catch_up"``: the most bytes per second a serving rank sends its snapshot at. The transfer shares
    #: the network with hop 2: uncapped, it slows the live groups' steps while it runs (the step it starts in
    #: most); capped at a fraction of the link, it spreads over more steps. ``None``: uncapped.
    catch_up_bytes_per_s: Optional[float] = None
    #: the run with failures bit-for-bit the run without them (the Trainer, with ``keep_trajectory``): each data
    #: share of a micro-step is its own forward and backward of the failure-free micro-batch size -- a group that
    #: reads a lost group's share too runs an extra pass for it -- each share's gradient accumulates on its own,
    #: and hop 2 sums the shares in share order, so no sum depends on which group added which share
    #: (:mod:`lightning_mics.hop2.shares`); hop 2 as two collectives of a ring all-reduce's bytes in all.
    #: ``False``: the shares a group reads are one micro-batch, summed in fp32 -- the same samples and global
    #: batch, the loss curve equal up to rounding, which training amplifies.
    exact_trajectory: bool = False

    def __post_init__(self) -> None:
        whole = ("min_replica_groups", "check_parameters_every", "quorum_every")
        for name in ("timeout", "quorum_timeout", "heartbeat_interval", "watchdog") + whole:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
                raise ValueError(f"FaultTolerance({name}={value!r}) must be a positive number.")
        if self.keep_trajectory is not None and not isinstance(self.keep_trajectory, bool):
            raise ValueError(f"FaultTolerance(keep_trajectory={self.keep_trajectory!r}) must be true, false or None.")
        rate = self.catch_up_bytes_per_s
        if rate is not None and (isinstance(rate, bool) or not isinstance(rate, (int, float)) or rate <= 0):
            raise ValueError(
                f"FaultTolerance(catch_up_bytes_per_s={rate!r}) must be a positive number of bytes per second, or "
                "None (uncapped)."
            )
        if not isinstance(self.exact_trajectory, bool):
            raise ValueError(f"FaultTolerance(exact_trajectory={self.exact_trajectory!r}) must be true or false.")
        if self.exact_trajectory and self.keep_trajectory is False:
            raise ValueError(
                "FaultTolerance(exact_trajectory=True) makes the trajectory that keep_trajectory keeps bit-exact; with "
                "keep_trajectory=False each group reads its own fixed share and there is none to keep: drop one."
            )
        if self.heal not in HEAL_MODES:
            raise ValueError(f"FaultTolerance(heal={self.heal!r}) must be one of {', '.join(map(repr, HEAL_MODES))}.")
        for name in whole:
            if not isinstance(getattr(self, name), int):
                raise ValueError(f"FaultTolerance({name}={getattr(self, name)!r}) must be a whole number.")

    @property
    def trainer_keeps_trajectory(self) -> bool:
        """Whether the Trainer's training data keeps its trajectory: unless ``keep_trajectory=False``. (Fabric keeps
        it only when ``True``, through ``MiCSFabricStrategy.training_batches``: its loop is the user's.)"""
        return self.keep_trajectory is not False

    def with_heal_for(
        self, cross_replica_sync: str = "every_step", loss_scaling: bool = False
    ) -> tuple[FaultTolerance, str]:
        """These options with ``heal="auto"`` decided for this run -- ``"catch_up"`` where a replay of the missed
        steps reproduces them (a per-step hop 2, no loss scaler), ``"blocking"`` otherwise -- and a line for the job
        log saying which heal runs and, when ``auto`` fell back, why. An explicit mode stays as it is."""
        if self.heal != "auto":
            return self, f"heal={self.heal!r}"
        if cross_replica_sync != "every_step":
            why = f"cross_replica_sync={cross_replica_sync!r} has no per-step gradients to replay"
        elif loss_scaling:
            why = "a loss scaler (precision='16-mixed') skips steps a replay cannot tell"
        else:
            return replace(self, heal="catch_up"), "heal='catch_up' (heal='auto')"
        return replace(self, heal="blocking"), f"heal='blocking' (heal='auto' falls back: {why})"

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


def check_catch_up_heal(
    options: Optional[FaultTolerance], cross_replica_sync: str = "every_step", loss_scaling: bool = False
) -> None:
    """Refuse ``heal="catch_up"`` where a replay of the missed steps' gradients cannot reproduce them: with a
    semi-synchronous hop 2 (no per-step gradients to replay), or with a loss scaler (its skipped steps)."""
    if options is None or options.heal != "catch_up":
        return
    if cross_replica_sync != "every_step":
        raise ValueError(
            f"FaultTolerance(heal='catch_up') replays the averaged gradients of the steps a joining group missed; "
            f"with cross_replica_sync={cross_replica_sync!r} the groups average parameters once per round "
            "instead, and a joining group heals at the round's synchronisation: use heal='blocking' there."
        )
    if loss_scaling:
        raise ValueError(
            "FaultTolerance(heal='catch_up') replays the optimizer steps a joining group missed from their "
            "gradients, but a loss scaler (precision='16-mixed') skips the steps whose gradients overflowed, "
            "which a replay cannot tell: use heal='blocking', or precision='bf16-mixed' (no loss scaling)."
        )


def check_exact_trajectory(
    options: Optional[FaultTolerance],
    cross_replica_sync: str = "every_step",
    cross_replica_dtype: object = None,
    loss_scaling: bool = False,
    grad_accumulation: str = "sharded",
) -> None:
    """Refuse ``exact_trajectory=True`` where its sums cannot be exact: a compressed or semi-synchronous hop 2,
    a loss scaler (whose scaling the extra passes of a lost group's shares would have to repeat), or gradients
    accumulated unsharded (in FSDP2's unsharded buffer, which holds every share's sum at once)."""
    if options is None or not options.exact_trajectory:
        return
    if cross_replica_sync != "every_step":
        raise ValueError(
            f"FaultTolerance(exact_trajectory=True) sums every step's gradients across groups exactly; with "
            f"cross_replica_sync={cross_replica_sync!r} there is no per-step sum: set exact_trajectory=False."
        )
    if cross_replica_dtype is not None:
        raise ValueError(
            "FaultTolerance(exact_trajectory=True) sums hop 2 in the gradients' dtype, in share order; "
            f"cross_replica_dtype={cross_replica_dtype!r} would round each group's gradients first: leave "
            "cross_replica_dtype unset, or set exact_trajectory=False."
        )
    if grad_accumulation != "sharded":
        raise ValueError(
            f"FaultTolerance(exact_trajectory=True) keeps each data share's gradient apart in the sharded gradients; "
            f"with grad_accumulation={grad_accumulation!r} the micro-steps accumulate in FSDP2's unsharded buffer, "
            "one for every share: use grad_accumulation='sharded', or set exact_trajectory=False."
        )
    if loss_scaling:
        raise ValueError(
            "FaultTolerance(exact_trajectory=True) does not support a loss scaler (precision='16-mixed'): use "
            "precision='bf16-mixed' or '32-true', or set exact_trajectory=False."
        )


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
