"""The Trainer's side of fault tolerance: its step count, schedulers and hyper-parameters kept to committed steps,
and its epochs to the data's."""

from __future__ import annotations

import copy
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, Optional

from torch import nn
from torch.optim import Optimizer

from lightning_mics import _compat as compat
from lightning_mics.fault_tolerance.heal_state import hyper_parameters, set_hyper_parameters, state_hooks
from lightning_mics.fault_tolerance.trajectory import GlobalSampleOrder

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


class DataEpochs:
    """Keeps the Trainer's epochs on the data's (``FaultTolerance(keep_trajectory=True)``): epoch ``e`` ends after
    committed step ``(e + 1) * steps_per_epoch - 1``, the last global batch of the order's epoch ``e``, however
    many steps were discarded in it.

    Why: Lightning ends an epoch after a fixed number of loader batches. A discarded step is trained again on its
    samples, one step's batches later, so without this each discarded step would push one global batch of the
    epoch into the next -- and the run's last steps' samples, under ``max_epochs``, would never be read -- and
    the end-of-epoch hooks (validation, epoch checkpoints, epoch-interval schedulers) would fire off the data's
    epoch boundaries. So each discarded step lengthens the epoch by ``accumulate`` batches, and a group that
    healed into a later epoch of the data (restarted, it resumed an older checkpoint) moves to that epoch.

    Only where Lightning's epoch is the order's whole epoch: a ``limit_train_batches`` that shortens it is left
    as it is."""

    def __init__(self, trainer: Any, order: GlobalSampleOrder) -> None:
        self.trainer = trainer
        self.order = order

    @classmethod
    def of(cls, trainer: Any, order: GlobalSampleOrder) -> Optional[DataEpochs]:
        """For a Trainer whose epoch is the order's whole epoch; ``None`` otherwise."""
        whole = order.steps_per_epoch * order.accumulate
        return cls(trainer, order) if compat.epoch_length(trainer) == whole else None

    def step_opened(self, data_step: int) -> None:
        """At the first micro-batch of a step (after its quorum and any heal), which reads ``data_step``."""
        epoch = data_step // self.order.steps_per_epoch
        if self.trainer.current_epoch != epoch:
            compat.set_current_epoch(self.trainer, epoch)
        self._end_epoch_after(compat.epoch_batches_ready(self.trainer) - 1, data_step)

    def step_discarded(self, data_step: int) -> None:
        """In the optimizer-step hook of a discarded step: the next step reads ``data_step`` again (before
        Lightning decides, after this batch, whether the epoch is over)."""
        self._end_epoch_after(compat.epoch_batches_ready(self.trainer), data_step)

    def _end_epoch_after(self, batches_done: int, data_step: int) -> None:
        """``batches_done`` batches of this epoch are behind the step that reads ``data_step``."""
        epoch_end = (self.trainer.current_epoch + 1) * self.order.steps_per_epoch
        steps_left = max(epoch_end - data_step, 1)
        compat.set_epoch_length(self.trainer, batches_done + steps_left * self.order.accumulate)
