"""Which optimizer steps telemetry records collectives on, and what the other steps report.

Recording sees collectives through a dispatch mode (:class:`~lightning_mics.collective_recorder.CollectiveRecorder`),
which costs a Python call for *every* aten op while it is on -- thousands per step on a GPU, enough to
skew the step time and MFU telemetry reports. It does not need to be on every step: a layout's
communication pattern is fixed (:func:`lightning_mics.schedule.step_schedule`), so every full optimizer
step with the same layout and accumulation moves the same bytes. :class:`CommSampler` therefore records

* the first ``warmup`` clean steps after training starts, and again after the layout key (accumulation,
  topology, world size) changes,
* every ``every``-th step, so a drift (e.g. a user's ``self.log(..., sync_dist=True)`` added to a branch)
  still shows up,
* a step that is not representative and whose bytes differ from the pattern: the first one after a
  validation pass (FSDP2 keeps the root unit gathered, so that step skips one all-gather), and a window
  that may be cut short at the end of an epoch (fewer micro-steps);

and the other steps report the bytes of the last *clean* recorded step (``comm_measured=False``).
"""

from __future__ import annotations

from collections.abc import Hashable
from typing import Generic, Optional, TypeVar

#: The default sampling period: at 1 recorded step in 50 the recorder's cost is a fiftieth of what it
#: is when always on (measured in docs/benchmarks.md), while a change still shows within 50 steps.
DEFAULT_SAMPLE_EVERY = 50
#: Steps recorded after a start or a change: the first catches one-off traffic, the second confirms the pattern.
DEFAULT_WARMUP = 2

T = TypeVar("T")


class CommSampler(Generic[T]):
    """Decides, at the start of each optimizer step, whether its collectives are recorded, and keeps
    the bytes of the last clean recorded step (``T``) for the steps that are not."""

    def __init__(self, every: int = DEFAULT_SAMPLE_EVERY, warmup: int = DEFAULT_WARMUP) -> None:
        if every < 1 or warmup < 0:
            raise ValueError(
                f"sample_every must be >= 1 (1 records every step) and warmup >= 0, got {every} and {warmup}."
            )
        self.every, self.warmup = every, warmup
        self.reference: Optional[T] = None
        self._key: Optional[Hashable] = None
        self._clean_recorded = 0
        self._window = 0
        self._interrupted = False
        self._window_clean = True

    def restart(self) -> None:
        """A new training run: record from scratch (a pending interruption, e.g. the sanity check's
        validation pass before training starts, still counts)."""
        self.reference, self._key = None, None
        self._clean_recorded = self._window = 0

    def interrupt(self) -> None:
        """Something ran between steps that changes the next step's collectives (a validation pass)."""
        self._interrupted = True

    def should_record(self, key: Hashable, may_be_short: bool = False) -> bool:
        """Whether the step starting now is recorded. ``key``: what fixes the pattern (a change
        restarts the warm-up); ``may_be_short``: the step may have fewer micro-steps than the others."""
        if key != self._key:
            self._key, self._clean_recorded, self.reference = key, 0, None
        self._window_clean = not (self._interrupted or may_be_short)
        record = (
            not self._window_clean
            or self._clean_recorded < self.warmup
            or self.reference is None
            or self._window % self.every == 0
        )
        self._interrupted = False
        self._window += 1
        return record

    def recorded(self, value: T) -> None:
        """The bytes of the step just recorded; a clean step's become the reference for unrecorded ones."""
        if self._window_clean:
            self.reference = value
            self._clean_recorded += 1
