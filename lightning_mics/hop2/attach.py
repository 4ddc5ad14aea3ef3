"""The step hooks of hop 2's schedules, made in one place: :func:`attach`, which the engine calls once per set of
optimizers and whose hooks it keeps in one mapping.

Each schedule of :class:`~lightning_mics.hop2.Hop2` lives in one module of this package:

* ``"behind_backward"`` / ``"after_backward"`` -- :mod:`~lightning_mics.hop2.pipeline` (and
  :mod:`~lightning_mics.hop2.shares` for ``exact_trajectory``), over a transport of
  :mod:`~lightning_mics.hop2.transport`;
* ``"optimizer_states"`` -- :mod:`~lightning_mics.hop2.optimizer_states` (AMSP ``optim > grads``);
* ``"diloco"`` -- :mod:`~lightning_mics.hop2.diloco` (DiLoCo and streaming DiLoCo);
* ``"fsdp"`` -- :mod:`~lightning_mics.hop2.fsdp`: FSDP2 runs it, no step hook;
* ``"none"`` -- one replica: nothing crosses;
* two-level DiLoCo (:attr:`~lightning_mics.hop2.Hop2.outer_every`) -- the worker's synchronous schedule and
  DiLoCo's outer round across workers, one after the other (:class:`InnerThenOuter`).

Adding a schedule is one module here, its case in :func:`attach` and its rule in :mod:`~lightning_mics.hop2.mode`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Optional, Protocol

from torch import nn
from torch.optim import Optimizer

from lightning_mics.hop2 import diloco, optimizer_states, pipeline

if TYPE_CHECKING:
    from lightning_mics.fault_tolerance.group import ReplicaGroup
    from lightning_mics.layout import MiCSLayout
    from lightning_mics.options import MiCSOptions


class StepHook(Protocol):
    """What the engine calls around an optimizer step: hop 2 (:class:`~lightning_mics.hop2.pipeline.
    CrossReplicaPipeline`, or several models' in :class:`~lightning_mics.hop2.pipeline.EachModel`), AMSP's
    optimizer states sharded across replicas (:class:`~lightning_mics.hop2.optimizer_states.
    ReplicaShardedOptimizerStates`) or DiLoCo's outer synchronisation
    (:class:`~lightning_mics.hop2.diloco.OuterSync`)."""

    def before_step(self) -> None:
        """Once per step, after the boundary backward and before clipping and the step."""

    def after_step(self) -> None:
        """After the optimizer step."""


class InnerThenOuter:
    """Two-level DiLoCo's step hook: the worker's synchronous hop 2 (``inner``: a pipeline, or ``None`` where
    FSDP2 runs it) before and after each step, then DiLoCo's outer round across workers (``outer``) after it."""

    def __init__(self, inner: Optional[StepHook], outer: diloco.OuterSync) -> None:
        self.inner = inner
        self.outer = outer

    def parts(self) -> list[object]:
        """The hooks it runs, for the engine's finders (pipelines, the DiLoCo run)."""
        return [hook for hook in (self.inner, self.outer) if hook is not None]

    def without_inner(self) -> diloco.OuterSync:
        """What stays when the pipelines are removed at the end of a run: the DiLoCo state."""
        return self.outer

    def before_step(self) -> None:
        if self.inner is not None:
            self.inner.before_step()

    def after_step(self) -> None:
        if self.inner is not None:
            self.inner.after_step()
        self.outer.after_step()


def hook_parts(hooks: Iterable[object]) -> list[object]:
    """``hooks`` with each two-level hook replaced by the hooks it runs."""
    return [part for hook in hooks for part in (hook.parts() if isinstance(hook, InnerThenOuter) else [hook])]


def attach(
    optimizers: Sequence[Optimizer],
    modules: Sequence[nn.Module],
    layout: MiCSLayout,
    attached: Mapping[int, StepHook],
    options: MiCSOptions,
    *,
    loss_scaling: bool,
    replica_group: Optional[ReplicaGroup] = None,
    round_quorum: Optional[Callable[[], None]] = None,
) -> dict[int, StepHook]:
    """The step hook of each of ``optimizers`` (by ``id``), which step ``modules`` (the models set up with them),
    as the layout's schedule says; none where FSDP2 runs hop 2 or nothing crosses. ``attached``: the hooks made
    before (a model keeps its pipeline, a DiLoCo run its state); ``replica_group``: with fault tolerance, this
    group's torchft Manager; ``round_quorum``: DiLoCo's quorum of an outer round (the engine's)."""
    schedule = layout.settings.hop2.schedule
    if schedule == "optimizer_states":
        return dict(optimizer_states.attach(optimizers, layout, loss_scaling=loss_scaling))
    if not modules:
        return {}
    streaming = (options.num_fragments, options.fragment_sync_delay, options.fragment_update_alpha)
    attached = dict(enumerate(hook_parts(attached.values())))  # the hooks a two-level hook runs, as hooks
    if schedule == "diloco":  # no hop 2: an outer sync every H steps
        return dict(
            diloco.attach(
                optimizers, modules, layout, attached, options.outer_optimizer, replica_group,
                round_quorum, streaming, options.fragment_modules,
            )
        )
    inner: dict[int, StepHook] = {}
    if layout.settings.hop2.run_by_engine:
        inner = dict(pipeline.attach(optimizers, modules, layout, attached, replica_group))
    if layout.settings.hop2.outer_every is None:
        return inner
    outer = diloco.attach(
        optimizers, modules, layout, attached, options.outer_optimizer, None, None, streaming, options.fragment_modules
    )
    return {key: InnerThenOuter(inner.get(key), sync) for key, sync in outer.items()}
