"""How gradients accumulate between optimizer steps: the two modes and their one validation.

Dependency-free (no torch), so that the planner and the byte schedule (pure arithmetic) can name the modes
without importing the runtime that implements them (:mod:`lightning_mics.grad_sync`).

``"sharded"`` (MiCS's default) reduce-scatters every micro-step inside the partition and keeps 1/partition of
the gradients: the least memory. ``"unsharded"`` keeps full gradients until the accumulation boundary and
reduce-scatters once per optimizer step: the least communication. Both give the same sum.
"""

from __future__ import annotations

from typing import Literal, get_args

#: How gradients accumulate between optimizer steps (module docstring).
GradAccumulation = Literal["sharded", "unsharded"]
GRAD_ACCUMULATION_MODES: tuple[str, ...] = get_args(GradAccumulation)


def check_grad_accumulation(mode: object, allow_auto: bool = False) -> None:
    """One clear error for an unknown accumulation mode, naming the valid ones and what they cost."""
    valid = GRAD_ACCUMULATION_MODES + (("auto",) if allow_auto else ())
    if mode not in valid:
        raise ValueError(
            f"grad_accumulation={mode!r} is not one of {list(valid)}: 'sharded' reduce-scatters every micro-step "
            "and keeps 1/partition of the gradients (least memory), 'unsharded' keeps full gradients until the "
            "accumulation boundary and reduce-scatters once per optimizer step (least communication)"
            + (", 'auto' lets the planner choose." if allow_auto else ".")
        )
