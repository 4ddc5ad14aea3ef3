"""FSDP2's own hop 2 (schedule ``"fsdp"``): on its 2-D (replicate, shard) mesh FSDP2 all-reduces each unit's
gradient shards across replicas inside the unit's post-backward, in the gradients' dtype.

The schedule needs no step hook: what the library does is say, per unit, on which backward FSDP2 runs it --
never on a non-boundary micro-step of gradient accumulation (:func:`lightning_mics.grad_sync.defer_gradient_sync`),
never on the extra pass of another data share (``exact_trajectory``, :func:`cross_replica_sync_off`). The same
per-unit flag tells the engine's pipeline (:mod:`lightning_mics.hop2.pipeline`) which backward is the boundary one.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager

from torch.distributed.fsdp import FSDPModule

from lightning_mics import _compat as compat


def set_cross_replica_sync(units: Sequence[FSDPModule], enabled: bool) -> None:
    """Turn the cross-replica all-reduce (hop 2) on or off for every unit; reduce-scatter always runs."""
    for unit in units:
        unit.set_requires_all_reduce(enabled, recurse=False)


@contextmanager
def cross_replica_sync_off(units: Sequence[FSDPModule]) -> Iterator[None]:
    """Hop 2 off for every unit inside the block, each unit's own flag restored after it (a boundary micro-step's
    stays on for the loop's own backward, which comes after)."""
    boundary = [compat.fsdp_requires_all_reduce(unit) for unit in units]
    set_cross_replica_sync(units, False)
    try:
        yield
    finally:
        for unit, was in zip(units, boundary):
            unit.set_requires_all_reduce(was, recurse=False)
