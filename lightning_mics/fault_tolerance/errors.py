"""How a fault-tolerant group ends when it cannot go on: each error says why and what to do."""

from __future__ import annotations

class LighthouseUnavailable(RuntimeError):
    """The Lighthouse did not answer in time: at start (wrong address, not started) or mid-run (it stopped)."""


class ReplicaGroupRefused(RuntimeError):
    """This group may not train with the others: it was started unlike them, claims a taken group index, or
    only some of its ranks healed. The whole group ends (every rank sees the same verdict)."""
