"""``Trainer(strategy="mics")``: the Trainer's hooks mapped onto one :class:`~lightning_mics.engine.MiCSEngine`.

The run's state and behaviour live in the engine, which Fabric's strategy holds too. What is the Trainer's
alone is here: the root unit around the LightningModule, a model sharded by an earlier Trainer used as it is,
optimizers created by Lightning after sharding, hop 2 inside the step's closure, the fault-tolerant quorum.
"""

from __future__ import annotations

import logging
import weakref
from collections.abc import Callable, Generator, Mapping
from contextlib import contextmanager, nullcontext
from typing import TYPE_CHECKING, Any, Optional

import torch
import torch.distributed as dist
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies.parallel import ParallelStrategy
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.signature_utils import is_param_in_hook_signature
from torch.optim import Optimizer
from typing_extensions import override

from lightning_mics import _compat as compat
from lightning_mics.engine import (
    SHARDED_MODELS,
    MiCSEngine,
    MiCSPrecision,
    RootUnit,
    ShardedModel,
    WrapPlan,
    precision_property,
    sharded_before,
)
from lightning_mics.front_end import MiCSFrontEnd

if TYPE_CHECKING:
    from lightning_mics.engine import CommittedStepCounters, DataCursor, DataEpochs

__all__ = ["MiCSStrategy"]

log = logging.getLogger(__name__)


class MiCSStrategy(MiCSFrontEnd, ParallelStrategy):
    """Train with MiCS: shard model states inside small partition groups, replicate across them.

    Every option is a field of :class:`lightning_mics.options.MiCSOptions` (``docs/options.md``), passed by
    name -- ``MiCSStrategy(partition_size=8)`` -- or as an object, ``MiCSStrategy(MiCSOptions(...))``, which
    keyword options override; readable as attributes (``partition_size_spec``, ``sharding``,
    ``reshard_after_forward``, ``grad_accumulation``: the layout's resolved values once it exists). The
    Lightning arguments (``accelerator``, ``precision_plugin``, ...) are set by the Trainer.
    """

    _precision_argument = "precision_plugin"
    _launcher_class = compat.SubprocessScriptLauncher
    _trainer_front_end = True
    #: with ``fault_tolerance``: the Trainer's counters kept to committed steps (set when training starts)
    _step_counters: Optional[CommittedStepCounters] = None
    #: with ``fault_tolerance`` keeping the trajectory: the Trainer's epochs kept to the data's (set when training
    #: starts; ``None`` where ``limit_train_batches`` shortens the epoch)
    _data_epochs: Optional[DataEpochs] = None

    def _init_front_end_state(self) -> None:
        self._wrap_plan: Optional[WrapPlan] = None  # which modules became units and why, for the layout log
        self._root: Optional[RootUnit] = None
        #: the root unit whose layout was logged: a later stage of this trainer (validate after fit) says it once
        self._layout_logged_for: Optional[RootUnit] = None

    # ------------------------------------------------------------------ properties
    @property
    def is_distributed(self) -> bool:
        """Tells Lightning to insert a ``DistributedSampler`` (it only knows its built-in strategies)."""
        return True

    @property
    @override
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        # Every rank is a data-parallel worker: partitions shard states, not data.
        trainer = compat.trainer_of(self.lightning_module)
        world, training = self.num_nodes * self.num_processes, trainer is not None and trainer.training
        num_replicas, rank = self._engine.data_share(world, self.global_rank, across_groups=training)
        return {"num_replicas": num_replicas, "rank": rank}

    @property
    @override
    def restore_checkpoint_after_setup(self) -> bool:
        return True  # shards load straight into the sharded model and optimizer

    @property
    @override
    def lightning_restore_optimizer(self) -> bool:
        return False

    precision_plugin = precision_property("_precision_plugin", MiCSPrecision, Precision)  # type: ignore[assignment]

    # ------------------------------------------------------------------ processes and layout
    @override
    def _configure_launcher(self) -> None:
        assert self.cluster_environment is not None
        # SyncBatchNorm runs on GPUs only: refuse it on CPU ranks now rather than in every rank's first forward
        if compat.layer_sync(self) is not None and self.parallel_devices and self.parallel_devices[0].type == "cpu":
            raise ValueError(
                "Trainer(sync_batchnorm=True) converts BatchNorm to torch.nn.SyncBatchNorm, which torch runs on GPUs "
                "only; on CPU ranks remove sync_batchnorm=True (each rank then keeps its own BatchNorm statistics)."
            )
        super()._configure_launcher()

    def set_world_ranks(self) -> None:
        """Lightning's accelerator connector calls this when the Trainer is built: the ranks and the world size
        are right from construction on, as with DDP and FSDP (scripts size data or guard downloads by
        ``trainer.world_size`` / ``trainer.is_global_zero`` before ``fit``)."""
        self._engine.assign_world_ranks(self)

    @override
    def setup_environment(self) -> None:
        super().setup_environment()
        self._engine.join_world(self)
        if self._engine.layout_or_none is None:  # a later stage of the same trainer keeps the layout and groups
            self._create_layout()
        assert self.lightning_module is not None
        compat.expose_device_mesh(self.lightning_module, self.device_mesh)  # visible in configure_model()

    def _create_layout(self) -> None:
        """Resolve the layout ("auto" settings planned for the LightningModule and the Trainer's accumulation)
        and create its groups, collectively -- unless an earlier strategy sharded this model the same way:
        then its layout and groups are used."""
        module = self.lightning_module
        assert module is not None
        trainer = compat.trainer_of(module)
        accumulation = int(getattr(trainer, "accumulate_grad_batches", 1) or 1)
        settings = self._engine.resolve_layout(self, module, self.precision_plugin.precision, accumulation)
        earlier = sharded_before(module, settings, self.precision_plugin.precision, self._converts_batchnorm())
        self._engine.use_layout(settings, earlier.layout if earlier is not None else None)

    def _converts_batchnorm(self) -> bool:
        trainer = compat.trainer_of(self.lightning_module)
        fitting = trainer is not None and trainer.state.fn == TrainerFn.FITTING
        return compat.layer_sync(self) is not None and fitting

    # ------------------------------------------------------------------ model setup
    @override
    def setup(self, trainer: Trainer) -> None:
        assert self.accelerator is not None and self.lightning_module is not None
        self.accelerator.setup(trainer)
        if self._root is None or self._root.module is not self.lightning_module:
            with torch.inference_mode(False):  # a caller's inference mode would make the shards inference tensors
                self._root = self._adopt(self.lightning_module) or self._shard(self.lightning_module)
        # else: sharded by an earlier stage of this trainer (fit, then validate/test): reuse it
        for unit in self._fsdp_units:
            # An evaluation leaves the root unit's parameters gathered (FSDP reshards the root after
            # backward, and evaluation has none): register the sharded ones again, or the optimizers
            # made below would hold the gathered copies and their steps would never reach the shards.
            unit.reshard()
        self.model = self._root
        self.barrier()
        fitting = trainer.state.fn == TrainerFn.FITTING
        if fitting:
            self.setup_optimizers(trainer)
        self.setup_precision_plugin()
        if fitting:
            compat.optimizers_to_device(self.optimizers, self.root_device)
            self._join_fault_domain(trainer)
            self._engine.detach_optimizers()
            raw = [compat.unwrap_optimizer(o) for o in self.optimizers]
            self._engine.attach_optimizers(raw, self._root, loss_scaling=self.precision_plugin.scaler is not None)
            self.precision_plugin.disjoint_groups = self._engine.disjoint_groups()
            unwrap = compat.unwrap_optimizer
            self.precision_plugin.before_clipping = lambda opt: self._engine.sync_before_step(unwrap(opt))
        if self.is_global_zero and self._layout_logged_for is not self._root:
            self.layout.log_description(log, self.lightning_module, len(self._fsdp_units), self._wrap_plan)
            self._layout_logged_for = self._root

    def _join_fault_domain(self, trainer: Trainer) -> None:
        """With ``fault_tolerance``: this group's torchft Manager, healing from and serving the training state."""
        module = self.lightning_module
        if self.options.fault_tolerance is None or module is None:
            return
        if not module.automatic_optimization:
            raise ValueError("fault_tolerance needs automatic optimization: each step must be one quorum and commit.")
        optimizers = [compat.unwrap_optimizer(o) for o in self.optimizers]
        schedulers = [config.scheduler for config in self.lr_scheduler_configs]
        plugin = self.precision_plugin
        self._step_counters = self._engine.join_trainer_fault_domain(
            trainer, module, optimizers, schedulers, self.root_device, plugin.precision, plugin.scaler is not None
        )

    @override
    def process_dataloader(self, dataloader: object) -> object:
        """With fault tolerance, the training data on the global sample order (every committed step reads the
        next global batch, split among the live groups); evaluation data as it is."""
        trainer = self.lightning_module.trainer if self.lightning_module is not None else None
        if trainer is None or not trainer.training or self.options.fault_tolerance is None:
            return dataloader
        keep = self._engine.keeps_trajectory
        if keep and is_param_in_hook_signature(
            self.lightning_module.training_step, "dataloader_iter", explicit=True
        ):
            raise ValueError(
                "fault tolerance keeps the training trajectory by choosing each micro-step's samples after the "
                "step's quorum; a training_step that takes `dataloader_iter` fetches its own batches. Take `batch` "
                "instead, or set FaultTolerance(keep_trajectory=False) to give each group a fixed share of the data."
            )
        world = self.num_nodes * self.num_processes
        accumulate = trainer.accumulate_grad_batches
        return self._engine.training_data(dataloader, world, self.global_rank, accumulate, trainer.global_step, keep)

    @override
    def on_train_start(self) -> None:
        super().on_train_start()
        self._engine.freeze_startup_objects()
        module = self.lightning_module
        if self._engine.data_cursor is not None and module is not None:
            loaders = module.trainer.train_dataloader
            if isinstance(loaders, (list, tuple, dict)) and len(loaders) > 1:
                raise ValueError(
                    f"fault tolerance keeps the training trajectory of one training DataLoader; got {len(loaders)}. "
                    "Combine them into one dataset, or set FaultTolerance(keep_trajectory=False) to give each group "
                    "a fixed share of each."
                )
        self._data_epochs = None if module is None else self._engine.data_epochs(module.trainer)

    @override
    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        opened = self._engine.begin_step(self._step_counters)  # fault tolerance: the step's quorum, before forward
        replacement = self._engine.micro_batch_to_load(opened)
        if replacement is not None and args:  # the loader predicted other samples than the quorum decided
            args = (self._to_device(replacement), *args[1:])
        cursor = self._engine.data_cursor
        if opened and self._data_epochs is not None and cursor is not None and cursor.current is not None:
            self._data_epochs.step_opened(cursor.current.step)
        if cursor is not None and cursor.separate_shares and cursor.current is not None:
            self._train_other_shares(cursor, args[1:], kwargs)
            self._engine.use_share(cursor.current.shares[0])
        return super().training_step(*args, **kwargs)

    def _train_other_shares(self, cursor: DataCursor, rest: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        """``FaultTolerance(exact_trajectory=True)``, while this group reads more than its own share (a group is
        out): one forward and backward per extra share, each on the failure-free micro-batch and into its own
        gradients, before the loop's pass over the first share. The loss is divided by the accumulation as
        Lightning divides the loop's; the backward hooks (``on_before_backward``...) run for the loop's pass only."""
        module = self.lightning_module
        assert module is not None and cursor.current is not None
        accumulate = module.trainer.accumulate_grad_batches
        for share, batch in zip(cursor.current.shares[1:], cursor.other_shares):
            with self._engine.training_other_share(share):
                output = super().training_step(self._to_device(batch), *rest, **kwargs)
                loss = output.get("loss") if isinstance(output, Mapping) else output
                if loss is None:
                    raise ValueError(
                        "FaultTolerance(exact_trajectory=True) trains a lost group's share of each micro-step as an "
                        "extra pass of training_step, which returned no loss: return the loss on every batch."
                    )
                self.precision_plugin.backward(loss / accumulate, module, None)
                cursor.other_share_losses[share] = loss.detach()

    def _to_device(self, batch: Any) -> Any:
        """A batch loaded outside the loader, through the same hooks the Trainer runs on every batch."""
        module = self.lightning_module
        assert module is not None
        batch = module.trainer.precision_plugin.convert_input(batch)
        batch = compat.on_before_batch_transfer(module, batch, dataloader_idx=0)
        return self.batch_to_device(batch, dataloader_idx=0)

    @override
    def backward(self, closure_loss: torch.Tensor, optimizer: Optional[Optimizer], *args: Any, **kwargs: Any) -> Any:
        weight = self._engine.gradient_weight  # fault tolerance: a group reading more or fewer shares than others
        if weight != 1.0:
            closure_loss = closure_loss * weight
        return super().backward(closure_loss, optimizer, *args, **kwargs)

    def _adopt(self, module: LightningModule) -> Optional[RootUnit]:
        """The root unit an earlier MiCSStrategy made of ``module``, taken over with its units and layout (refused
        when this strategy would shard it differently); ``None`` when none sharded the module."""
        precision = self.precision_plugin.precision
        earlier = sharded_before(module, self.layout.settings, precision, self._converts_batchnorm())
        if earlier is None:
            return None
        self._engine.use_layout(self.layout.settings, earlier.layout)  # this strategy's own groups stay unused
        root = earlier.root()
        assert isinstance(root, RootUnit)
        self.precision_plugin.device_type = self.root_device.type
        self._fsdp_units = [unit for unit in MiCSEngine.units_of(root) if unit is not root] + [root]  # blocks, root
        self._wrap_plan = None  # the plan it was sharded with is the earlier strategy's
        if self.is_global_zero:
            log.info("using the model as an earlier MiCSStrategy sharded it (same layout): not sharding it again")
        return root

    def _shard(self, module: LightningModule) -> RootUnit:
        """Wrap ``module`` in the root unit and shard it onto the layout, and record that this strategy did,
        so that a later one can use the model as it is."""
        sync_batchnorm = self._converts_batchnorm()
        layer_sync = compat.layer_sync(self)
        if layer_sync is not None and sync_batchnorm:
            layer_sync.apply(module)  # BatchNorm -> SyncBatchNorm, before sharding
        converted = self.precision_plugin.convert_module(module)
        assert converted is module
        root = RootUnit(module)
        self._fsdp_units, self._wrap_plan = self._engine.shard(module, self.root_device, self.precision_plugin, root)
        SHARDED_MODELS[module] = ShardedModel(
            weakref.ref(root), self.layout, self.precision_plugin.precision, sync_batchnorm, dist.group.WORLD
        )
        return root

    @override
    def optimizer_step(
        self, optimizer: Optimizer, closure: Callable[[], Any], model: Any = None, **kwargs: Any
    ) -> Any:
        """Where the engine runs hop 2 itself (compressed wire, AMSP optimizer states across replicas), it does
        so inside the closure -- once the boundary backward has produced the gradients, before Lightning's
        ``on_before_optimizer_step`` and clipping -- and finishes after the step. Then, with
        ``release_gradients_after_step``, the gradients are freed."""
        raw = compat.unwrap_optimizer(optimizer)
        if self._engine.step_hook(raw) is None:
            output = super().optimizer_step(optimizer, closure, model, **kwargs)
        else:
            output = super().optimizer_step(optimizer, self._engine.closure_then_sync(raw, closure), model, **kwargs)
            self._engine.finish_step(raw)
        if self._step_counters is not None and self._engine.discarded_step():
            self._step_counters.uncount_discarded_step()  # Lightning counts the step once this returns
            cursor = self._engine.data_cursor
            if self._data_epochs is not None and cursor is not None and cursor.current is not None:
                self._data_epochs.step_discarded(cursor.current.step)  # the epoch takes its samples again
        module = self.lightning_module
        if self.release_gradients_after_step and module is not None and module.automatic_optimization:
            raw.zero_grad(set_to_none=True)
        return output

    @override
    def setup_optimizers(self, trainer: Trainer) -> None:
        # The optimizer must reference the sharded DTensor parameters, so it is (re)created after
        # sharding; one left from an earlier stage would point at stale tensors.
        compat.reset_optimizers_and_schedulers(self)
        super().setup_optimizers(trainer)

    @override
    def model_to_device(self) -> None:
        if self.model is not None:
            self.model.to(self.root_device)

    @contextmanager
    @override
    def tensor_init_context(self, empty_init: Optional[bool] = None) -> Generator[None, None, None]:
        # With empty_init, modules are created on the meta device and materialised shard by shard
        # after fully_shard in `setup()` -- a model bigger than one rank's memory never exists whole.
        empty_init_context = torch.device("meta") if empty_init else nullcontext()
        with empty_init_context, self.precision_plugin.tensor_init_context():
            yield

    # Evaluation runs outside inference mode, as Lightning runs its own FSDP strategy's (pytorch#95957): FSDP2
    # keeps the all-gather buffers its first unshard makes, and made under inference mode -- Lightning's loops
    # with NCCL, or a caller's `with torch.inference_mode(): trainer.test(...)` -- they break the next fit.
    @override
    def validation_step(self, *args: Any, **kwargs: Any) -> Any:
        with self._engine.outside_inference_mode():
            return super().validation_step(*args, **kwargs)

    @override
    def test_step(self, *args: Any, **kwargs: Any) -> Any:
        with self._engine.outside_inference_mode():
            return super().test_step(*args, **kwargs)

    @override
    def predict_step(self, *args: Any, **kwargs: Any) -> Any:
        with self._engine.outside_inference_mode():
            return super().predict_step(*args, **kwargs)

    # ------------------------------------------------------------------ gradient sync and collectives
    @contextmanager
    @override
    def block_backward_sync(self) -> Generator[None, None, None]:
        """Non-boundary micro-steps: ``grad_accumulation="sharded"`` reduce-scatters inside the
        partition only, ``"unsharded"`` keeps full gradients; either way the cross-replica
        all-reduce runs once, on the boundary backward."""
        with self._engine.accumulation_context(self._fsdp_units):
            yield None

    def no_cross_replica_sync(self) -> Any:
        """For manual optimization: the backward of every non-boundary micro-step (as automatic optimization)."""
        return self.block_backward_sync()

    @override
    def teardown(self) -> None:
        self._engine.teardown()  # the run ends only once its last checkpoint is committed
        assert self.cluster_environment is not None and self.accelerator is not None
        self.cluster_environment.teardown()
        self.precision_plugin.teardown()
        self.accelerator.teardown()

    # ------------------------------------------------------------------ buffers: one model on every rank
    # The evaluation that is logged and the checkpoint that is saved use the same buffers (see `buffer_sync`).
    def sync_buffers(self) -> None:
        """Make every rank's persistent buffers equal now, as ``buffer_sync`` says (a collective)."""
        if self.lightning_module is not None:
            self._engine.sync_buffers(self.lightning_module, self.root_device)

    @override
    def on_validation_start(self) -> None:
        self._engine.finish_catch_up_now()  # a group catching up evaluates (and ends with) the live groups' model
        self.sync_buffers()  # as at the start of test and predict, and at the end of fit (one model after it)

    on_test_start = on_predict_start = on_train_end = on_validation_start

    # ------------------------------------------------------------------ checkpoints (lightning_mics.checkpoint)
    @override
    def lightning_module_state_dict(self) -> dict[str, Any]:
        assert self.lightning_module is not None  # on every rank, before any state is taken
        return self._engine.model_state(self.lightning_module, self.root_device)

    @override
    def optimizer_state(self, optimizer: Optimizer) -> dict[str, Any]:
        assert self.lightning_module is not None
        return self._engine.optimizer_states(self.lightning_module, [compat.unwrap_optimizer(optimizer)])[0]

    @override
    def load_model_state_dict(self, checkpoint: Any, strict: bool = True) -> None:
        pass  # already loaded in place by `load_checkpoint`

    @override
    def load_optimizer_state_dict(self, checkpoint: Any) -> None:
        pass  # already loaded in place by `load_checkpoint`

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Optional[Any] = None) -> None:
        if storage_options is not None:
            raise TypeError("MiCSStrategy.save_checkpoint does not take storage_options: it writes with DCP.")
        self._engine.save(filepath, checkpoint)

    @override
    def load_checkpoint(self, checkpoint_path: Any, weights_only: Optional[bool] = None) -> dict[str, Any]:
        # `weights_only` is moot: every loading path is weights-only (or DCP with a weights-only planner).
        # Only fitting resumes optimizers: validate/test/predict after a fit still hold the fit's optimizers,
        # and must neither need their state (weights-only checkpoints) nor write it.
        module = self.lightning_module
        assert module is not None
        trainer = compat.trainer_of(module)
        fitting = trainer is not None and trainer.state.fn == TrainerFn.FITTING
        optimizers = [compat.unwrap_optimizer(o) for o in self.optimizers] if fitting else []
        path = self.broadcast(str(checkpoint_path))
        return self._engine.load(path, module, optimizers, module.strict_loading, for_trainer=True)

    @override
    def remove_checkpoint(self, filepath: Any) -> None:
        self._engine.remove(filepath)
