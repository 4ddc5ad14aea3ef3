"""Collectives: accounting of what crosses which group.

:class:`CollectiveRecorder` records every all-gather, reduce-scatter, all-reduce and broadcast that
is issued through :mod:`torch.distributed` while it is active -- by FSDP2 or anyone else -- with the
ranks of the group and the bytes of the payload. Tests use it to prove the 2-hop schedule (which
collective runs on which group in which micro-step); telemetry uses it to report bytes per step.
"""

from __future__ import annotations

import functools
import threading
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

#: torch.distributed functions we account for, by the kind of collective they are. Old and new
#: spellings are both listed (torch renamed ``all_gather_into_tensor`` to ``all_gather_single``);
#: a nested call from one spelling into the other is counted once.
_TRACKED: dict[str, str] = {
    "all_gather_single": "all_gather",
    "all_gather_into_tensor": "all_gather",
    "_all_gather_base": "all_gather",
    "all_gather": "all_gather",
    "reduce_scatter_single": "reduce_scatter",
    "reduce_scatter_tensor": "reduce_scatter",
    "_reduce_scatter_base": "reduce_scatter",
    "reduce_scatter": "reduce_scatter",
    "all_reduce": "all_reduce",
    "broadcast": "broadcast",
}


@dataclass(frozen=True)
class CollectiveCall:
    """One collective as seen by this rank."""

    kind: str  #: "all_gather", "reduce_scatter", "all_reduce" or "broadcast"
    ranks: tuple[int, ...]  #: global ranks of the group it ran on
    bytes: int  #: payload bytes: the full (gathered / pre-scatter / reduced) buffer on this rank
    step: int  #: the value of :attr:`CollectiveRecorder.step` when it was issued


def _group_ranks(group: Any) -> tuple[int, ...]:
    if group is None or group is dist.GroupMember.WORLD:
        return tuple(range(dist.get_world_size()))
    return tuple(dist.get_process_group_ranks(group))


def _payload_bytes(args: tuple[Any, ...], kwargs: dict[str, Any]) -> int:
    """Bytes of the largest tensor argument: the gathered output, the pre-scatter input, or the
    reduced buffer -- the size one would quote for the collective. List arguments (the list forms
    of all-gather / reduce-scatter) count as the sum of their tensors."""
    sizes = [0]
    for value in (*args, *kwargs.values()):
        if isinstance(value, torch.Tensor):
            sizes.append(value.numel() * value.element_size())
        elif isinstance(value, (list, tuple)) and value and all(isinstance(v, torch.Tensor) for v in value):
            sizes.append(sum(v.numel() * v.element_size() for v in value))
    return max(sizes)


class CollectiveRecorder:
    """Context manager that records the collectives this process issues.

    Example::

        with CollectiveRecorder() as rec:
            loss.backward()
        rec.count("all_reduce")  # how many all-reduces this backward issued
    """

    def __init__(self) -> None:
        self.calls: list[CollectiveCall] = []
        #: Free-form step label stamped on each call (tests set it per micro-step).
        self.step: int = 0
        self._originals: dict[str, Callable[..., Any]] = {}
        self._local = threading.local()

    def _wrap(self, name: str, kind: str, original: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(original)
        def recorded(*args: Any, **kwargs: Any) -> Any:
            depth = getattr(self._local, "depth", 0)
            if depth == 0:
                group = kwargs.get("group")
                if group is None:
                    group = next((a for a in args if isinstance(a, dist.ProcessGroup)), None)
                self.calls.append(
                    CollectiveCall(kind, _group_ranks(group), _payload_bytes(args, kwargs), self.step)
                )
            self._local.depth = depth + 1
            try:
                return original(*args, **kwargs)
            finally:
                self._local.depth = depth

        return recorded

    def __enter__(self) -> CollectiveRecorder:
        for name, kind in _TRACKED.items():
            original = getattr(dist, name, None)
            if original is None:
                continue
            self._originals[name] = original
            setattr(dist, name, self._wrap(name, kind, original))
        return self

    def __exit__(self, *exc: Any) -> None:
        for name, original in self._originals.items():
            setattr(dist, name, original)
        self._originals.clear()

    # ------------------------------------------------------------------ queries
    def count(self, kind: str, step: int | None = None) -> int:
        return sum(1 for c in self.calls if c.kind == kind and (step is None or c.step == step))

    def bytes_by_kind(self, step: int | None = None) -> Counter[str]:
        totals: Counter[str] = Counter()
        for call in self.calls:
            if step is None or call.step == step:
                totals[call.kind] += call.bytes
        return totals

    def group_sizes(self, kind: str) -> set[int]:
        return {len(c.ranks) for c in self.calls if c.kind == kind}

    def reset(self) -> None:
        self.calls.clear()


@contextmanager
def record_collectives() -> Iterator[CollectiveRecorder]:
    """Functional spelling of :class:`CollectiveRecorder`."""
    with CollectiveRecorder() as recorder:
        yield recorder
