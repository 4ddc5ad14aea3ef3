"""The Trainer's side of fault tolerance: its step count, schedulers and hyper-parameters kept to committed steps."""

from __future__ import annotations

import copy
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, Optional

from torch import nn
from torch.optim import Optimizer

from lightning_mics import _compat as compat
from lightning_mics.fault_tolerance.heal_state import hyper_parameters, set_hyper_parameters, state_hooks

if TYPE_CHECKING:
    from lightning_mics.fault_tolerance.group import ReplicaGroup


class CommittedStepCounters:
    """Keeps the Trainer's step count, its LR schedulers and the optimizers' hyper-parameters in line with
    the committed steps. Lightning counts every optimizer step and steps its schedulers after it, committed
    or not: a discarded step's count is taken back before Lightning adds it, and its schedulers and
    hyper-parameters before the next quorum, so that ``max_steps``, checkpoint names and the learning rate
    follow committed steps only -- the same in every group, whichever joined when (a group that joins heals
    only when torchft's committed step differs)."""

    def __init__(
        self, trainer: Any, optimizers: Sequence[Optimizer], schedulers: Sequence[Any], set_global_step: Callable
    ) -> None:
        self.trainer = trainer
        self.optimizers = list(optimizers)
        self.schedulers = list(schedulers)
        self.set_global_step = set_global_step
        self._snapshot: Optional[tuple[int, list[Any], list[Any]]] = None

    def undo_if_discarded(self, group: ReplicaGroup) -> None:
        """Before the quorum: if the last step was discarded, back to the counters it started with."""
        if group.last_step_discarded and self._snapshot is not None:
            global_step, schedulers, hyper_parameters = self._snapshot
            for scheduler, state in zip(self.schedulers, schedulers):
                scheduler.load_state_dict(state)
            for optimizer, groups in zip(self.optimizers, hyper_parameters):
                set_hyper_parameters(optimizer, groups)
            self.set_global_step(global_step)
            group.last_step_discarded = False

    def uncount_discarded_step(self) -> None:
        """Inside Lightning's optimizer-step hook of a step the groups discarded: Lightning counts an optimizer
        step when that hook returns, so the count is taken back first. The step's end-of-batch callbacks (a
        ``ModelCheckpoint`` every N steps, the loggers' step), the ``max_steps`` check and everything after see
        committed steps only -- a discarded last step is trained again instead of ending the run one committed
        step short. The schedulers and hyper-parameters go back before the next quorum
        (:meth:`undo_if_discarded`)."""
        compat.uncount_pending_optimizer_step(self.trainer)

    def remember(self) -> None:
        """After the quorum (and any heal): the counters this step starts with."""
        self._snapshot = (
            self.trainer.global_step,
            copy.deepcopy([scheduler.state_dict() for scheduler in self.schedulers]),
            [hyper_parameters(optimizer) for optimizer in self.optimizers],
        )


def trainer_state_hooks(
    trainer: Any, module: nn.Module, optimizers: Sequence[Optimizer], schedulers: Sequence[Any]
) -> tuple[Callable[..., dict[str, Any]], Callable[[dict[str, Any]], None], CommittedStepCounters]:
    """For a Lightning Trainer: :func:`state_hooks` with its step count, and its step counters kept to
    committed steps."""

    def set_global_step(step: int) -> None:
        compat.set_global_step(trainer, step)

    state_fn, load_fn = state_hooks(module, optimizers, schedulers, lambda: trainer.global_step, set_global_step)
    return state_fn, load_fn, CommittedStepCounters(trainer, optimizers, schedulers, set_global_step)
