"""Near-ties: which of the layouts the cost model cannot tell apart wins, and why each other one lost.

The model's step times carry errors of several per cent (``benchmarks/compare_planner.py`` measures them), so
a layout predicted 0.2 % faster is not known to be faster. Among the fitting layouts within ``tie_tolerance``
of the fastest prediction the winner is decided by rules instead, in this order:

1. the fewest bytes across nodes (within 1 %): network estimates are the least certain input;
2. a gradient partition inside one node, then optimizer states sharded like the gradients (``OS = G``):
   MiCS's rule, and both measured (two-stage collectives' copies and the optimizer group's post-step
   all-gather are priced only in part);
3. the least memory per GPU: headroom against the allocator's fragmentation, the estimate's own error and a
   longer sequence or bigger micro-batch later -- unless the memory differences are within
   ``memory_tie_tolerance`` of the usable device memory too, when they are noise as well and
4. the fastest prediction decides.

:func:`tie_break_winner` applies them; :func:`lost_because` says which one a rival lost on.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Optional

from lightning_mics.planner.cost_model import LayoutEstimate

#: Step times within this fraction of the fastest fitting prediction are a tie (the cost model's noise).
TIE_TOLERANCE = 0.02
#: Memory within this fraction of the usable device memory of the leanest tied layout is a tie too.
MEMORY_TIE_TOLERANCE = 0.05
#: Bytes across nodes within this fraction of the fewest count as the fewest.
BYTES_TOLERANCE = 0.01


def near_ties(candidates: Sequence[LayoutEstimate], tie_tolerance: float = TIE_TOLERANCE) -> list[LayoutEstimate]:
    """The fitting layouts predicted within ``tie_tolerance`` of the fastest fitting one, fastest first
    (empty when none fits)."""
    fitting = [c for c in candidates if c.fits]
    if not fitting:
        return []
    limit = min(c.step_time_s for c in fitting) * (1 + tie_tolerance)
    return sorted((c for c in fitting if c.step_time_s <= limit), key=lambda c: c.step_time_s)


def _fewest_bytes_limit(tied: Sequence[LayoutEstimate]) -> float:
    return min(c.inter_node_bytes for c in tied) * (1 + BYTES_TOLERANCE) + 1.0


def _mics_rule(candidate: LayoutEstimate) -> tuple[bool, bool]:
    """MiCS's preferences as a sort key: a partition spanning nodes, then OS > G, sort last."""
    layout = candidate.layout
    return layout.grads > layout.ranks_per_node, layout.optim > layout.grads


def _stages(
    tied: Sequence[LayoutEstimate], memory_tie_tolerance: float
) -> tuple[list[LayoutEstimate], list[LayoutEstimate], list[LayoutEstimate]]:
    """The layouts left after rules 1, 2 and 3 of the module docstring."""
    frugal = [c for c in tied if c.inter_node_bytes <= _fewest_bytes_limit(tied)]
    best_rule = min(_mics_rule(c) for c in frugal)
    ruled = [c for c in frugal if _mics_rule(c) == best_rule]
    leanest = min(c.memory.total for c in ruled)
    lean = [c for c in ruled if c.memory.total <= leanest + memory_tie_tolerance * c.usable_memory_bytes]
    return frugal, ruled, lean


def tie_break_winner(
    tied: Sequence[LayoutEstimate], memory_tie_tolerance: float = MEMORY_TIE_TOLERANCE
) -> LayoutEstimate:
    """The winner among ``tied`` (:func:`near_ties`) by the module's rules."""
    if not tied:
        raise ValueError("tie_break_winner needs at least one fitting layout.")
    lean = _stages(tied, memory_tie_tolerance)[2]
    return min(lean, key=lambda c: (c.step_time_s, c.memory.total))


def lost_because(
    rival: LayoutEstimate,
    winner: LayoutEstimate,
    tied: Sequence[LayoutEstimate],
    memory_tie_tolerance: float = MEMORY_TIE_TOLERANCE,
) -> Optional[str]:
    """Why ``rival``, one of ``tied``, lost the tie-break to ``winner`` (a clause: "it sends ..."); ``None``
    when it is not among the ties (then its predicted time decided) or is the winner."""
    if rival is winner or not any(c is rival for c in tied):
        return None
    frugal, ruled, lean = _stages(tied, memory_tie_tolerance)
    if not any(c is rival for c in frugal):
        return (
            f"it sends {rival.inter_node_bytes / 1e9:.3g} GB across nodes per node and step vs "
            f"{winner.inter_node_bytes / 1e9:.3g} GB"
        )
    if not any(c is rival for c in ruled):
        if _mics_rule(rival)[0]:
            return "its gradient partition spans nodes (two-stage collectives, priced only in part)"
        return "it shards optimizer states wider than gradients (OS > G: a post-step all-gather, priced in part)"
    if not any(c is rival for c in lean):
        extra = (rival.memory.total - winner.memory.total) / 1024**3
        return f"it needs {extra:.1f} GiB more per GPU ({rival.memory.total / 1024**3:.1f} GiB)"
    return "it is predicted slower at about the same memory"
