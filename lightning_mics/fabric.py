"""``Fabric(strategy="mics")``: Fabric's calls mapped onto one :class:`~lightning_mics.engine.MiCSEngine`.

The engine, the one the Trainer's :class:`lightning_mics.MiCSStrategy` holds too, does the work:
``fabric.launch()`` creates the processes and the layout; ``fabric.setup(model, optimizer)`` shards the
model and points the optimizer at the shards; ``fabric.no_backward_sync(model, enabled)`` runs hop 1 only
(the cross-replica all-reduce waits for the boundary backward); ``fabric.clip_gradients`` clips by the
global norm of the sharded gradients; ``fabric.save`` / ``fabric.load`` write and read the Trainer's
sharded checkpoint directory, so a checkpoint saved here resumes in ``Trainer(strategy="mics").fit(ckpt_path=...)``
(model, optimizer and RNG states) and the Trainer's loads here (its loop state in the returned remainder).
"""

from __future__ import annotations

import logging
import weakref
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, ExitStack, nullcontext
from typing import Any, Optional, Union

import torch
from lightning.fabric.plugins import CheckpointIO
from lightning.fabric.plugins.precision import Precision
from lightning.fabric.strategies import ParallelStrategy
from torch import Tensor, nn
from torch.optim import Optimizer
from typing_extensions import override

from lightning_mics import _compat as compat
from lightning_mics.engine import MiCSEngine, MiCSFabricPrecision, ShardRegistry, fabric_entries, precision_property
from lightning_mics.front_end import MiCSFrontEnd

log = logging.getLogger(__name__)

__all__ = ["MiCSStrategy"]


class MiCSStrategy(MiCSFrontEnd, ParallelStrategy):
    """Fabric strategy for MiCS: shard model states inside small partition groups, replicate across them.

    Options are the Trainer strategy's (:class:`lightning_mics.options.MiCSOptions`, ``docs/options.md``),
    minus ``async_save`` and ``release_gradients_after_step``, which only the Trainer has a place for.
    ``partition_size="auto"`` and ``sharding="auto"`` are planned when the first model is set up, for an
    accumulation of 1 (Fabric does not know yours); for the same reason ``grad_accumulation`` is
    ``"sharded"`` or ``"unsharded"``, applied to the backwards inside ``fabric.no_backward_sync(model)``.
    ``buffer_sync`` applies in ``fabric.save``; call ``fabric.strategy.sync_buffers(model)`` before
    evaluating so that the evaluated model is the one the next save writes.

    Usage::

        fabric = Fabric(strategy=MiCSStrategy(partition_size=8), devices=8, num_nodes=4)
        fabric.launch()
        with fabric.init_module(empty_init=True):    # optional: no full copy of the model anywhere
            model = GPT(config)
        optimizer = torch.optim.AdamW(model.parameters())
        model, optimizer = fabric.setup(model, optimizer)  # the optimizer now holds the shards
        for i, batch in enumerate(loader):
            boundary = (i + 1) % accumulate == 0
            with fabric.no_backward_sync(model, enabled=not boundary):
                fabric.backward(model(batch) / accumulate)
            if boundary:
                fabric.clip_gradients(model, optimizer, max_norm=1.0)
                optimizer.step()
                optimizer.zero_grad()
        fabric.save("last.ckpt", {"model": model, "optimizer": optimizer, "step": i})
    """

    _precision_argument = "precision"
    _launcher_class = compat.FabricSubprocessScriptLauncher
    _trainer_front_end = False

    def _init_front_end_state(self) -> None:
        self._modules: weakref.WeakSet[nn.Module] = weakref.WeakSet()  # models set up by this strategy
        self._optimizers: weakref.WeakSet[Optimizer] = weakref.WeakSet()
        self._backward_sync_control = _MiCSBackwardSyncControl(self)
        self._shards = ShardRegistry()  # so that optimizers created before setup step the shards

    precision = precision_property("_precision", MiCSFabricPrecision, Precision)  # type: ignore[assignment]

    @property
    @override
    def checkpoint_io(self) -> CheckpointIO:
        return super().checkpoint_io

    @checkpoint_io.setter
    @override
    def checkpoint_io(self, io: Optional[CheckpointIO]) -> None:
        if io is not None:
            raise TypeError(
                f"MiCSStrategy writes sharded checkpoints itself (DCP, one directory per checkpoint) and does not use "
                f"CheckpointIO plugins; remove {type(io).__name__} from Fabric(plugins=...)."
            )

    # ------------------------------------------------------------------ processes and layout
    def _set_world_ranks(self) -> None:
        """Fabric's connector calls this (when a strategy has it) before launching."""
        self._engine.assign_world_ranks(self)

    @override
    def setup_environment(self) -> None:
        super().setup_environment()
        self._engine.join_world(self)
        if self._engine.layout_or_none is None and not self.options.plans_anything:
            self._create_layout(None)  # "auto" layouts need the model: planned when the first one is set up

    def _create_layout(self, module: Optional[nn.Module]) -> None:
        """The layout, collectively; ``module`` is what "auto" settings plan for (an accumulation of 1)."""
        self._engine.use_layout(self._engine.resolve_layout(self, module, self.precision.precision, 1))

    # ------------------------------------------------------------------ models and optimizers
    @override
    def module_init_context(self, empty_init: Optional[bool] = None) -> AbstractContextManager:
        """``empty_init=True``: create modules on the meta device; :meth:`setup_module` shards them and
        then materialises only this rank's shards (``reset_parameters()``), so a model bigger than one
        rank's memory never exists whole. Otherwise they are built on the CPU and moved after sharding."""
        stack = ExitStack()
        if empty_init:
            stack.enter_context(torch.device("meta"))
        stack.enter_context(self.precision.module_init_context())
        return stack

    @override
    def module_to_device(self, module: nn.Module) -> None:
        pass  # setup_module moves the shards, after sharding

    @override
    def setup_module(self, module: nn.Module) -> nn.Module:
        """Shard ``module`` onto the layout in place (see :func:`lightning_mics.layout.shard_module`)."""
        if self._engine.layout_or_none is None:  # "auto" layouts: planned for the first model
            self._create_layout(module)
        if self.options.fault_tolerance is not None:
            if self._modules:
                raise ValueError(_FT_ONE_MODEL)
            # the step's quorum (and a heal) before the first forward of each step, ahead of FSDP's all-gather
            module.register_forward_pre_hook(self._begin_step, prepend=True)
        originals = self._shards.originals(module)
        units, wrap_plan = self._engine.shard(module, self.root_device, self.precision)
        self._shards.record(module, originals)
        self._fsdp_units.extend(units)
        self._modules.add(module)
        if self.is_global_zero:
            self.layout.log_description(log, module, len(units), wrap_plan)
        return module

    @override
    def setup_optimizer(self, optimizer: Optimizer) -> Optimizer:
        """Point ``optimizer`` at the sharded parameters (it may have been created from the model before
        ``setup``) and attach the engine's step hooks (compressed hop 2, AMSP optimizer-state sharding)."""
        if self._engine.layout_or_none is None or not self._fsdp_units:
            raise RuntimeError(
                "Set up the model before its optimizer: `model, optimizer = fabric.setup(model, optimizer)`, or "
                "`model = fabric.setup_module(model)` then `optimizer = fabric.setup_optimizers(optimizer)`."
            )
        self._shards.point_at_shards(optimizer)
        models = self._shards.models_of(optimizer)
        loss_scaling = self.precision.scaler is not None
        if self.options.fault_tolerance is not None:
            self._join_fault_domain(optimizer, loss_scaling)
        self._engine.attach_optimizers([optimizer], models, loss_scaling)
        compat.optimizers_to_device([optimizer], self.root_device)
        self._optimizers.add(optimizer)
        self._engine.freeze_startup_objects()  # the training loop starts after its model and optimizer are set up
        return optimizer

    # ------------------------------------------------------------------ fault tolerance
    def _join_fault_domain(self, optimizer: Optimizer, loss_scaling: bool) -> None:
        """This group's torchft Manager, serving and healing the model's and ``optimizer``'s shards."""
        if self._optimizers:
            raise ValueError(_FT_ONE_MODEL)
        if self.options.fault_tolerance is not None and self.options.fault_tolerance.exact_trajectory:
            raise ValueError(
                "FaultTolerance(exact_trajectory=True) runs a lost group's share of each micro-step as an extra pass "
                "of the training step, which only the Trainer's loop lets the strategy do; with Fabric set "
                "exact_trajectory=False (keep_trajectory=True still keeps the samples and the global batch)."
            )
        (module,) = list(self._modules)
        precision = self.precision.precision
        self._engine.join_fabric_fault_domain(module, optimizer, self.root_device, precision, loss_scaling)

    @property
    def _keeps_trajectory(self) -> bool:
        """``FaultTolerance(keep_trajectory=True)``: the loop reads :meth:`training_batches` (Fabric's default: fixed
        shares -- the loop, and so which loader trains, is the user's); resolved by the engine."""
        return self._engine.keeps_trajectory

    def _begin_step(self, module: nn.Module, args: Any) -> None:
        if torch.is_grad_enabled():  # a training forward; evaluation under no_grad starts no step
            if self._keeps_trajectory and self._engine.data_cursor is None:
                raise ValueError(
                    "FaultTolerance(keep_trajectory=True) with Fabric: take the training micro-batches from "
                    "`batches = strategy.training_batches(train_loader, accumulate=A)` (`next(batches)` in the loop), "
                    "so that each committed step reads the next global batch whichever groups are live; or set "
                    "keep_trajectory=False for a fixed share per group."
                )
            self._engine.begin_step()

    def training_batches(self, loader: Any, accumulate: int = 1) -> Iterator[Any]:
        """With ``FaultTolerance(keep_trajectory=True)``: the training micro-batches, on this rank's device, as the
        Trainer reads them with fault tolerance -- every committed step reads the next global batch of one seeded
        order, split among the groups live in its quorum (a lost group's samples read by the others, a discarded
        step re-done on its samples, a healed group at the committed step; :mod:`lightning_mics.fault_tolerance.
        trajectory`). ``loader``: the training DataLoader as you built it (or set up by Fabric), whose dataset,
        collate function, workers and shuffling (and seed) are kept; ``accumulate``: the micro-batches per optimizer
        step of your loop. Scale the loss by ``1 / accumulate`` as usual; the strategy's backward applies the
        group's weight when the live groups read unequal numbers of shares. The loop::

            batches = strategy.training_batches(train_loader, accumulate=2)
            while strategy.committed_steps < max_steps:
                for micro in range(2):
                    fabric.backward(loss_fn(model, next(batches)) / 2)
                optimizer.step()
                optimizer.zero_grad()

        Each step's quorum runs at its first ``next(batches)`` (a joining group heals there)."""
        if not self._keeps_trajectory:
            raise ValueError(
                "training_batches reads the training data on the global sample order of fault tolerance: it needs "
                "MiCSFabricStrategy(fault_tolerance=FaultTolerance(..., keep_trajectory=True))."
            )
        if self._engine.replica_group is None:
            raise RuntimeError("Set up the model and its optimizer (`fabric.setup(model, optimizer)`) before "
                               "training_batches: the replica group joins there.")
        if isinstance(accumulate, bool) or not isinstance(accumulate, int) or accumulate < 1:
            raise ValueError(
                f"accumulate is the micro-batches per optimizer step of your loop, >= 1; got {accumulate!r}."
            )
        source = compat.user_dataloader(loader)  # fabric.setup_dataloaders' wrapper: the user's DataLoader
        world = self.num_nodes * self.num_processes
        data = self._engine.training_data(source, world, self.global_rank, accumulate, self.committed_steps, True)
        return self._trained_micro_batches(data)

    def _trained_micro_batches(self, data: Any) -> Iterator[Any]:
        """Epoch after epoch: each micro-batch the loader predicted, or -- when the step's quorum decided other
        samples (a group lost or healed, a step discarded) -- the right one, loaded here."""
        while True:
            for batch in data:
                opened = self._engine.begin_step()
                replacement = self._engine.micro_batch_to_load(opened)
                yield self.batch_to_device(replacement if replacement is not None else batch)

    @override
    def backward(self, tensor: Tensor, module: Optional[nn.Module], *args: Any, **kwargs: Any) -> None:
        """With fault tolerance keeping the trajectory: the loss times this group's weight (1 unless the live groups
        read unequal numbers of shares), so that hop 2's average is the mean over the global batch."""
        weight = self._engine.gradient_weight
        super().backward(tensor * weight if weight != 1.0 else tensor, module, *args, **kwargs)

    @property
    def committed_steps(self) -> int:
        """With ``fault_tolerance``: the optimizer steps committed so far (a group that joins takes the live
        groups' count when it heals, at its first training forward). Loop on it -- ``while strategy.committed_steps <
        max_steps`` -- rather than on a counter of your own, which counts discarded steps and not healed ones."""
        group = self._engine.replica_group
        if group is None:
            raise RuntimeError("committed_steps needs MiCSFabricStrategy(fault_tolerance=...) and a set-up optimizer.")
        return group.manager.current_step()

    @property
    @override
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        """Every rank is a data-parallel worker; with ``fault_tolerance``, of every replica group's world."""
        num_replicas, rank = self._engine.data_share(self.num_nodes * self.num_processes, self.global_rank)
        return {"num_replicas": num_replicas, "rank": rank}

    # ------------------------------------------------------------------ gradients and steps
    def no_cross_replica_sync(self, module: nn.Module) -> AbstractContextManager:
        """The backward of a non-boundary micro-step: hop 1 (reduce-scatter inside the partition) only.
        ``fabric.no_backward_sync(model, enabled=True)`` is this context."""
        units = MiCSEngine.units_of(module)
        if not units:
            raise TypeError(
                f"{type(module).__name__} has not been set up by MiCSStrategy: call `model = fabric.setup(model, ...)` "
                "before `fabric.no_backward_sync(model)`."
            )
        return self._engine.accumulation_context(units)

    @override
    def clip_gradients_norm(
        self,
        module: nn.Module,
        optimizer: Optimizer,
        max_norm: Union[float, int],
        norm_type: Union[float, int] = 2.0,
        error_if_nonfinite: bool = True,
    ) -> Tensor:
        """Clip by the true global norm of the sharded gradients (every rank gets the same norm)."""
        self.precision.unscale_gradients(optimizer)
        params = self.precision.main_params(optimizer)
        return self._engine.clip_gradients(params, optimizer, float(max_norm), float(norm_type), error_if_nonfinite)

    @override
    def optimizer_step(self, optimizer: Any, **kwargs: Any) -> Any:
        """Where the engine runs hop 2 itself (compressed wire, AMSP optimizer states across replicas), the
        step is bracketed: gradients cross replicas first (unless clipping did it), and AMSP gathers the
        updated slices after."""
        if self._engine.step_hook(optimizer) is None:
            return super().optimizer_step(optimizer, **kwargs)
        closure = kwargs.get("closure")
        if closure is None:
            self._engine.sync_before_step(optimizer)
        else:  # the closure runs the backward: gradients cross replicas right after it, inside the step
            kwargs["closure"] = self._engine.closure_then_sync(optimizer, closure)
        output = super().optimizer_step(optimizer, **kwargs)
        self._engine.finish_step(optimizer)
        return output

    # ------------------------------------------------------------------ checkpoints
    @override
    def save_checkpoint(
        self,
        path: Any,
        state: dict[str, Any],
        storage_options: Optional[Any] = None,
        filter: Optional[dict[str, Callable[[str, Any], bool]]] = None,
    ) -> None:
        """Write ``state`` as the Trainer strategy's checkpoint: the model's and optimizers' shards, every
        rank's RNG state, and the other entries (``state_dict()`` of stateful objects, plain values as they
        are), committed atomically. A collective: call it on every rank."""
        if storage_options is not None:
            raise TypeError("MiCSStrategy.save_checkpoint does not take storage_options: it writes with DCP.")
        if filter is not None:
            raise ValueError(
                "fabric.save(..., filter=...) is not supported by MiCSStrategy: a sharded checkpoint holds whole "
                "states so that it reshards and resumes. Save without a filter (and select on loading)."
            )
        key, module, optimizers, others = self._split_state(state, "save")
        checkpoint = fabric_entries.entries_to_save(key, list(optimizers), others)
        checkpoint["state_dict"] = self._engine.model_state(module, self.root_device)
        if optimizers:
            checkpoint["optimizer_states"] = self._engine.optimizer_states(module, list(optimizers.values()))
        self._engine.save(path, checkpoint)

    def sync_buffers(self, module: nn.Module) -> None:
        """Make every rank's persistent buffers of ``module`` (the model ``fabric.setup`` returned) equal
        now, as ``buffer_sync`` says. A collective. ``fabric.save`` calls it; call it before evaluating too."""
        module = compat.unwrap_fabric_objects(module)
        self._check_set_up(module, "sync_buffers(module)")
        self._engine.sync_buffers(module, self.root_device)

    @override
    def load_checkpoint(
        self,
        path: Any,
        state: Optional[Union[nn.Module, Optimizer, dict[str, Any]]] = None,
        strict: bool = True,
        weights_only: Optional[bool] = None,
    ) -> dict[str, Any]:
        """Restore ``state`` in place from a checkpoint of either strategy (any layout, sharded or full);
        return the entries ``state`` did not ask for. The model, optimizers and requested keys are checked
        before anything is loaded: a refused load changes nothing. ``weights_only`` is moot (every loading
        path is weights-only). A collective: call it on every rank."""
        if not state:
            raise ValueError(
                "fabric.load(path) needs the objects to load into: fabric.load(path, {'model': model, 'optimizer': "
                "optimizer, ...}) with the set-up model. To read a sharded checkpoint into plain tensors, use "
                "lightning_mics.checkpoint.read_full_state(path) or `python -m lightning_mics.consolidate`."
            )
        path = self.broadcast(str(path))
        if isinstance(state, nn.Module):  # fabric.load_raw(path, model)
            self._check_set_up(state, "the model passed to fabric.load_raw")
            self._engine.load(path, state, [], strict)
            return {}
        if isinstance(state, Optimizer):
            raise NotImplementedError(
                "Loading an optimizer alone is not supported by MiCSStrategy (its state is keyed by the model's "
                "parameter names): fabric.load(path, {'model': model, 'optimizer': optimizer})."
            )
        _, module, optimizers, others = self._split_state(state, "load")
        saved = self._engine.load(
            path,
            module,
            list(optimizers.values()),
            strict,
            check_state=lambda saved: fabric_entries.check_requested(saved, list(others), strict, path),
        )
        return fabric_entries.restore_entries(saved, others, state)

    def _split_state(self, state: dict[str, Any], verb: str) -> tuple[str, nn.Module, dict[str, Optimizer], Any]:
        return fabric_entries.split_state(state, verb, self._check_set_up, self._optimizers)

    def _check_set_up(self, module: nn.Module, what: str) -> None:
        if module not in self._modules:
            raise ValueError(
                f"{what} ({type(module).__name__}) has not been set up by this MiCSStrategy: call "
                "`model = fabric.setup(model, ...)` (or fabric.setup_module) before saving or loading it."
            )


_FT_ONE_MODEL = (
    "fault_tolerance with Fabric heals one model and its optimizer: set up one (`model, optimizer = "
    "fabric.setup(model, optimizer)`), or combine the parts into one module and one optimizer."
)


class _MiCSBackwardSyncControl(compat.BackwardSyncControl):
    """What ``fabric.no_backward_sync(model, enabled)`` enters: MiCS's deferral of the cross-replica hop."""

    def __init__(self, strategy: MiCSStrategy) -> None:
        self._strategy = weakref.proxy(strategy)

    @override
    def no_backward_sync(self, module: nn.Module, enabled: bool) -> AbstractContextManager:
        if not enabled:
            return nullcontext()
        return self._strategy.no_cross_replica_sync(module)
