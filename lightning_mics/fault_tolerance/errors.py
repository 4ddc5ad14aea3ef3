"""How a fault-tolerant group ends when it cannot go on: each error says why and what to do."""

from __future__ import annotations


class LighthouseUnavailable(RuntimeError):
    """The Lighthouse did not answer in time: at start (wrong address, not started) or mid-run (it stopped)."""


class ReplicaGroupRefused(RuntimeError):
    """This group may not train with the others: it was started unlike them, claims a taken group index, or
    only some of its ranks healed. The whole group ends (every rank sees the same verdict)."""


class ReplicaGroupRankLost(RuntimeError):
    """A rank of this replica group is gone (its process died or its host was lost): the group cannot train on
    with part of its shards, so all of it ends; the other groups go on, and a relaunched group heals."""


class TooFewReplicaGroups(RuntimeError):
    """Fewer than ``min_replica_groups`` groups stayed live for longer than ``quorum_timeout``."""


class ReplicaGroupsDiverged(RuntimeError):
    """The groups' parameters differ although they must be bit-identical: the run ends (see the message)."""


class CatchUpFailed(RuntimeError):
    """A catching-up group could not fetch its snapshot (the serving group was lost meanwhile, or the transfer
    timed out): the group ends; relaunched, it heals anew from a live group."""
