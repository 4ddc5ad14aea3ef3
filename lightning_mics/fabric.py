"""``Fabric(strategy="mics")``: MiCS for Lightning Fabric.

The same layout, sharding, 2-hop gradient sync, clipping and checkpoint format as the Trainer's
:class:`lightning_mics.strategy.MiCSStrategy` -- both strategies call :mod:`lightning_mics.layout`
and the idea modules behind it -- wired to Fabric's calls instead of the Trainer's hooks:

============================================  ==========================================================
Fabric                                        MiCS
============================================  ==========================================================
``fabric.launch()``                           processes, then the layout (topology, mesh, groups)
``fabric.init_module(empty_init=True)``       modules on the meta device, materialised shard by shard
``fabric.setup(model, optimizer)``            ``shard_module``; the optimizer is pointed at the shards
``fabric.no_backward_sync(model, enabled)``   hop 1 only: reduce-scatter in the partition, the
                                              cross-replica all-reduce waits for the boundary backward
                                              (``grad_accumulation="unsharded"``: neither hop)
``fabric.clip_gradients(..., max_norm=)``     the global norm of the sharded gradients
``fabric.save`` / ``fabric.load``             the sharded checkpoint directory the Trainer writes/reads
============================================  ==========================================================

A checkpoint saved here resumes in ``Trainer(strategy="mics").fit(ckpt_path=...)`` (model, optimizer
and RNG states; the Trainer's loops start afresh since Fabric has none) and the Trainer's load here
(its loop state comes back in the returned remainder).
"""

from __future__ import annotations

import logging
import weakref
from collections.abc import Callable
from contextlib import AbstractContextManager, ExitStack, nullcontext
from datetime import timedelta
from typing import Any, Literal, Optional, Union

import lightning
import torch
from lightning.fabric.accelerators import Accelerator
from lightning.fabric.plugins import CheckpointIO, ClusterEnvironment
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.fabric.plugins.precision import Precision
from lightning.fabric.strategies import ParallelStrategy
from lightning.fabric.strategies.strategy import TBroadcast
from lightning.fabric.utilities.seed import reset_seed
from lightning.fabric.utilities.types import ReduceOp
from lightning.fabric.wrappers import _unwrap_objects
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor
from torch.optim import Optimizer
from torch.optim.lr_scheduler import LRScheduler
from typing_extensions import override

from lightning_mics import _compat as compat
from lightning_mics import checkpoint as ckpt
from lightning_mics import process_groups
from lightning_mics.buffer_sync import BufferSync, sync_buffers
from lightning_mics.grad_sync import CompressedCrossReplicaSync as CompressedSync
from lightning_mics.grad_sync import (
    GradAccumulation,
    clip_grad_norm_,
    fsdp_units,
)
from lightning_mics.layout import (
    MiCSLayout,
    ShardingOption,
    accumulation_context,
    build_layout,
    check_layout,
    cross_replica_sync,
    layout_planner,
    limit_intra_op_threads,
    optimizers_in_partition_form,
    register_strategy_names,
    resolve_layout,
    resolve_ranks_per_node,
    shard_module,
    shard_optimizer_states,
    validate_options,
)
from lightning_mics.optim_sharding import ReplicaShardedOptimizerStates
from lightning_mics.planner.live import PlannerCluster
from lightning_mics.precision import MiCSFabricPrecision
from lightning_mics.topology import MiCSTopology, PartitionSizeSpec
from lightning_mics.wire import WireFormat, resolve_wire_format
from lightning_mics.wrapping import AutoWrapPolicy, plan_wrapping

log = logging.getLogger(__name__)

__all__ = ["MiCSStrategy"]

#: Keys a Fabric save adds beside the user's entries, so the Trainer can resume from it: Lightning's
#: version (its checkpoint migration needs one), the schedulers' states in the Trainer's place, and
#: which of the user's keys held the model, the optimizers and the other entries.
VERSION_KEY = "pytorch-lightning_version"
SCHEDULERS_KEY = "lr_schedulers"
FABRIC_KEY = "mics_fabric"
RESERVED_KEYS = ("state_dict", "optimizer_states", VERSION_KEY, SCHEDULERS_KEY, FABRIC_KEY)


class MiCSStrategy(ParallelStrategy):
    """Fabric strategy for MiCS: shard model states inside small partition groups, replicate across them.

    Options are the Trainer strategy's (:class:`lightning_mics.MiCSStrategy`), minus what Fabric has
    no place for (``async_save``: Fabric ends a script without a teardown that could wait for a
    background save). ``partition_size="auto"`` and ``sharding="auto"`` are planned when the first
    model is set up, for an accumulation of 1 (Fabric does not know yours); for the same reason
    ``grad_accumulation`` is ``"sharded"`` or ``"unsharded"``, not ``"auto"``. It applies to the
    backwards run inside ``fabric.no_backward_sync(model, enabled=True)``.

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

    Args:
        partition_size, ranks_per_node, auto_wrap_policy, reshard_after_forward, hierarchical, sharding,
        grad_accumulation, cross_replica_dtype, activation_checkpointing_policy, prefetch_depth, compile_blocks,
        process_group_backend, timeout, save_full_state_dict, sync_module_states, checkpoint_verify,
        planner_cluster: as for the Trainer strategy.
        buffer_sync: as for the Trainer strategy, applied by ``fabric.save`` before the model's state is
            taken (the live model's buffers become the saved ones). Fabric has no evaluation hooks:
            call ``fabric.strategy.sync_buffers(model)`` before evaluating so that the evaluated model is
            the one the next save writes.
        accelerator, parallel_devices, cluster_environment, precision: set by Fabric.
    """

    strategy_name = "mics"

    def __init__(
        self,
        partition_size: PartitionSizeSpec = None,
        ranks_per_node: Optional[int] = None,
        auto_wrap_policy: AutoWrapPolicy = None,
        reshard_after_forward: Union[bool, int] = True,
        hierarchical: Union[bool, Literal["auto"]] = "auto",
        sharding: ShardingOption = None,
        grad_accumulation: GradAccumulation = "sharded",
        cross_replica_dtype: Union[str, torch.dtype, None] = None,
        activation_checkpointing_policy: AutoWrapPolicy = None,
        prefetch_depth: int = 1,
        compile_blocks: bool = False,
        process_group_backend: Optional[str] = None,
        timeout: Union[timedelta, float, None] = default_pg_timeout,
        save_full_state_dict: bool = False,
        sync_module_states: bool = True,
        checkpoint_verify: ckpt.VerifyMode = "checksum",
        buffer_sync: BufferSync = "broadcast",
        planner_cluster: PlannerCluster = None,
        accelerator: Optional[Accelerator] = None,
        parallel_devices: Optional[list[torch.device]] = None,
        cluster_environment: Optional[ClusterEnvironment] = None,
        precision: Optional[Precision] = None,
    ) -> None:
        super().__init__(
            accelerator=accelerator,
            parallel_devices=parallel_devices,
            cluster_environment=cluster_environment,
            precision=precision,
        )
        self._timeout = validate_options(
            partition_size=partition_size,
            ranks_per_node=ranks_per_node,
            auto_wrap_policy=auto_wrap_policy,
            reshard_after_forward=reshard_after_forward,
            sharding=sharding,
            grad_accumulation=grad_accumulation,
            activation_checkpointing_policy=activation_checkpointing_policy,
            prefetch_depth=prefetch_depth,
            hierarchical=hierarchical,
            timeout=timeout,
            checkpoint_verify=checkpoint_verify,
            buffer_sync=buffer_sync,
            planner_cluster=planner_cluster,
        )
        self.planner_cluster = planner_cluster
        if grad_accumulation == "auto":
            raise ValueError(
                "grad_accumulation='auto' needs the number of micro-steps per optimizer step, which Fabric does not "
                "know: choose 'sharded' (reduce-scatter every micro-step, least memory) or 'unsharded' (one "
                "reduce-scatter per optimizer step); lightning_mics.planner.choose_layout(..., training=TrainingSpec("
                "accumulation=...), grad_accumulation='auto') compares them for yours."
            )
        self.grad_accumulation: GradAccumulation = grad_accumulation
        #: the format of hop 2 (``cross_replica_dtype``), or ``None``: the gradients' own dtype
        self.cross_replica_wire: Optional[WireFormat] = resolve_wire_format(cross_replica_dtype)
        self.partition_size_spec = partition_size
        self.ranks_per_node_override = ranks_per_node
        self.auto_wrap_policy = auto_wrap_policy
        self.reshard_after_forward = reshard_after_forward
        self.hierarchical = hierarchical
        self.sharding = sharding
        self.activation_checkpointing_policy = activation_checkpointing_policy
        self.prefetch_depth = prefetch_depth
        self.compile_blocks = compile_blocks
        self.save_full_state_dict = save_full_state_dict
        self.sync_module_states = sync_module_states
        self.checkpoint_verify: ckpt.VerifyMode = checkpoint_verify
        self.buffer_sync: BufferSync = buffer_sync
        self._process_group_backend = process_group_backend
        self._num_nodes = 1
        self._layout: Optional[MiCSLayout] = None
        self._fsdp_units: list[FSDPModule] = []
        self._modules: weakref.WeakSet[nn.Module] = weakref.WeakSet()  # models set up by this strategy
        self._backward_sync_control = _MiCSBackwardSyncControl(self)
        #: Original parameter (by id, with a weak reference to tell a reused id) -> the shard that
        #: replaced it, so optimizers created before ``setup`` can be pointed at the shards.
        self._shards_of: dict[int, tuple[weakref.ref, nn.Parameter]] = {}
        #: Optimizers set up by this strategy, and (AMSP ``optim > grads``) their step hooks by id.
        self._optimizers: weakref.WeakSet[Optimizer] = weakref.WeakSet()
        self._optimizer_hooks: dict[int, ReplicaShardedOptimizerStates] = {}
        #: ``cross_replica_dtype``: per model (by id), its compressed hop 2; per optimizer (by id), its model's
        self._model_syncs: dict[int, CompressedSync] = {}
        self._optimizer_syncs: dict[int, CompressedSync] = {}
        #: Set-up model (by the id of each of its sharded parameters), to find an optimizer's model
        self._model_of_shard: dict[int, nn.Module] = {}
        #: Optimizers whose gradients were already synced across replicas this step (by clipping).
        self._synced_before_step: set[int] = set()

    # ------------------------------------------------------------------ properties
    @property
    @override
    def root_device(self) -> torch.device:
        assert self.parallel_devices is not None
        return self.parallel_devices[self.local_rank]

    @property
    def cross_replica_dtype(self) -> Union[torch.dtype, str, None]:
        """The resolved ``cross_replica_dtype``: ``torch.bfloat16`` / ``torch.float16``, ``"int8"``
        or ``None`` (:attr:`cross_replica_wire` is the format itself)."""
        return None if self.cross_replica_wire is None else self.cross_replica_wire.option

    @property
    def num_nodes(self) -> int:
        return self._num_nodes

    @num_nodes.setter
    def num_nodes(self, num_nodes: int) -> None:
        self._num_nodes = num_nodes

    @property
    def num_processes(self) -> int:
        return len(self.parallel_devices) if self.parallel_devices is not None else 0

    @property
    def process_group_backend(self) -> Optional[str]:
        return self._process_group_backend

    @property
    def layout(self) -> MiCSLayout:
        if self._layout is None:
            raise RuntimeError(
                "The MiCS layout exists once the processes are set up (fabric.launch()); with partition_size='auto' "
                "or sharding='auto', once the first model is set up."
            )
        return self._layout

    @property
    def topology(self) -> MiCSTopology:
        return self.layout.topology

    @property
    def device_mesh(self) -> DeviceMesh:
        return self.layout.device_mesh

    @property
    def fsdp_units(self) -> list[FSDPModule]:
        """The FSDP2 units of every model set up so far (per model: blocks, then its root)."""
        return list(self._fsdp_units)

    @property  # type: ignore[override]
    @override
    def precision(self) -> MiCSFabricPrecision:
        plugin = self._precision
        if not isinstance(plugin, MiCSFabricPrecision):
            plugin = self._precision = MiCSFabricPrecision.from_plugin(plugin or Precision())
        return plugin

    @precision.setter
    @override
    def precision(self, precision: Optional[Precision]) -> None:
        self._precision = None if precision is None else MiCSFabricPrecision.from_plugin(precision)

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
    @override
    def _configure_launcher(self) -> None:
        assert self.cluster_environment is not None
        if not self.cluster_environment.creates_processes_externally:
            check_layout(
                self.num_processes * self.num_nodes,
                self.ranks_per_node_override or self.num_processes,
                self.partition_size_spec,
                self.sharding,
                self.reshard_after_forward,
            )
            limit_intra_op_threads(self.num_processes)
            self._launcher = compat.FabricSubprocessScriptLauncher(
                self.cluster_environment, self.num_processes, self.num_nodes
            )

    def _set_world_ranks(self) -> None:
        """Fabric's connector calls this (when a strategy has it) before launching."""
        process_groups.assign_world_ranks(self)

    @override
    def setup_environment(self) -> None:
        super().setup_environment()
        reset_seed()
        self._set_world_ranks()
        assert self.cluster_environment is not None
        self._process_group_backend = process_groups.join_world(
            self.cluster_environment, self.root_device, self._process_group_backend, self._timeout
        )
        if self._layout is None and not self._planned_with_the_model:
            self._layout = self._create_layout(None)

    @property
    def _planned_with_the_model(self) -> bool:
        """``partition_size="auto"`` / ``sharding="auto"``: the planner needs the model, so the layout
        is created when the first model is set up."""
        return self.partition_size_spec == "auto" or self.sharding == "auto"

    def _create_layout(self, module: Optional[nn.Module]) -> MiCSLayout:
        """The layout, collectively; ``module`` is what ``partition_size="auto"`` plans for (for an
        accumulation of 1: Fabric does not know the user's)."""
        assert self._process_group_backend is not None, "setup_environment() runs first"
        plan = None
        if module is not None:
            plan = layout_planner(
                module,
                world_size=self.world_size,
                device=self.root_device,
                precision=self.precision.precision,
                accumulation=1,
                cross_replica_wire=self.cross_replica_wire,
                log=log if self.is_global_zero else None,
                planner_cluster=self.planner_cluster,
            )
        settings = resolve_layout(
            world_size=self.world_size,
            rank=self.global_rank,
            ranks_per_node=resolve_ranks_per_node(self.ranks_per_node_override, self.num_processes, self.world_size),
            partition_size=self.partition_size_spec,
            reshard_after_forward=self.reshard_after_forward,
            sharding=self.sharding,
            hierarchical=self.hierarchical,
            device_type=self.root_device.type,
            backend=self._process_group_backend,
            grad_accumulation=self.grad_accumulation,
            cross_replica_wire=self.cross_replica_wire,
            plan_layout=plan,
        )
        return build_layout(settings, self._timeout)

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
        if self._layout is None:  # "auto" layouts: planned for the first model
            self._layout = self._create_layout(module)
        self.precision.device_type = self.root_device.type
        originals = {id(p): (weakref.ref(p), name) for name, p in module.named_parameters()}
        wrap_plan = plan_wrapping(module, self.auto_wrap_policy)
        units = shard_module(
            module,
            self.layout,
            self.root_device,
            mp_policy=self.precision.mixed_precision_policy(),
            auto_wrap_policy=wrap_plan,
            activation_checkpointing=self.activation_checkpointing_policy,
            compile_blocks=self.compile_blocks,
            prefetch_depth=self.prefetch_depth,
            sync_module_states=self.sync_module_states,
        )
        shards = dict(module.named_parameters())
        for pid, (ref, name) in originals.items():
            if name in shards:
                self._shards_of[pid] = (ref, shards[name])
        self._model_of_shard.update({id(shard): module for shard in shards.values()})
        sync = cross_replica_sync(module, self.layout)
        if sync is not None:
            self._model_syncs[id(module)] = sync
        self._fsdp_units.extend(units)
        self._modules.add(module)
        if self.is_global_zero:
            self.layout.log_description(log, module, len(units), wrap_plan)
        return module

    @override
    def setup_optimizer(self, optimizer: Optimizer) -> Optimizer:
        """Point ``optimizer`` at the sharded parameters (it may have been created from the model
        before ``setup``) and, with AMSP ``optim > grads``, shard its states across replicas."""
        if self._layout is None or not self._fsdp_units:
            raise RuntimeError(
                "Set up the model before its optimizer: `model, optimizer = fabric.setup(model, optimizer)`, or "
                "`model = fabric.setup_module(model)` then `optimizer = fabric.setup_optimizers(optimizer)`."
            )
        self._point_at_shards(optimizer)
        self._optimizer_hooks.update(
            shard_optimizer_states([optimizer], self.layout, loss_scaling=self.precision.scaler is not None)
        )
        owners = {id(self._model_of_shard.get(id(p))) for g in optimizer.param_groups for p in g["params"]}
        syncs = [self._model_syncs[owner] for owner in owners if owner in self._model_syncs]
        if len(syncs) > 1:
            raise ValueError(
                "With cross_replica_dtype, an optimizer must hold the parameters of one model (its gradients are "
                "synced across replicas once per step, model by model): use one optimizer per model."
            )
        if syncs:
            self._optimizer_syncs[id(optimizer)] = syncs[0]
        compat.optimizers_to_device([optimizer], self.root_device)
        self._optimizers.add(optimizer)
        return optimizer

    def _point_at_shards(self, optimizer: Optimizer) -> None:
        """Replace the original parameters in ``optimizer``'s groups by the shards that replaced them
        in the model (``fully_shard`` registers new DTensor parameters under the same names)."""
        stale = [
            p for group in optimizer.param_groups for p in group["params"] if not isinstance(p, DTensor)
        ]
        if not stale:
            return
        if any(optimizer.state.values()):
            raise ValueError(
                "The optimizer already has state (it has stepped) for parameters of the unsharded model, which "
                "cannot be sharded. Create the optimizer afresh and pass it to fabric.setup(model, optimizer); load "
                "saved optimizer states with fabric.load(path, {'model': model, 'optimizer': optimizer})."
            )
        for group in optimizer.param_groups:
            params = []
            for p in group["params"]:
                if isinstance(p, DTensor):
                    params.append(p)
                    continue
                ref, shard = self._shards_of.get(id(p), (None, None))
                if ref is None or ref() is not p:
                    raise ValueError(
                        f"The optimizer holds a parameter of shape {tuple(p.shape)} that belongs to no model set up by "
                        "MiCSStrategy. Create the optimizer from the model's parameters and set both up together, "
                        "`model, optimizer = fabric.setup(model, optimizer)`, or create it after "
                        "`model = fabric.setup_module(model)`."
                    )
                params.append(shard)
            group["params"] = params

    # ------------------------------------------------------------------ gradients and steps
    def no_cross_replica_sync(self, module: nn.Module) -> AbstractContextManager:
        """The backward of a non-boundary micro-step: hop 1 (reduce-scatter inside the partition) only.
        ``fabric.no_backward_sync(model, enabled=True)`` is this context."""
        units = fsdp_units(module)
        if not units:
            raise TypeError(
                f"{type(module).__name__} has not been set up by MiCSStrategy: call `model = fabric.setup(model, ...)` "
                "before `fabric.no_backward_sync(model)`."
            )
        return accumulation_context(units, self.layout)

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
        self._sync_before_step(optimizer)
        hook = self._step_hook(optimizer)
        return clip_grad_norm_(
            self.precision.main_params(optimizer),
            float(max_norm),
            float(norm_type),
            error_if_nonfinite,
            disjoint_groups=getattr(hook, "disjoint_groups", None),  # AMSP: the optimizer-state slices' groups
        )

    @override
    def optimizer_step(self, optimizer: Any, **kwargs: Any) -> Any:
        """Where this strategy runs hop 2 itself, the step is bracketed: with ``cross_replica_dtype``
        the gradients are first synced across replicas in the compressed wire format; with optimizer states sharded
        across replicas (AMSP ``optim > grads``) they are reduced into this rank's slices, and the
        updated slices gathered into the parameters after the step. Clipping does the first half
        already when it comes first (it must see the synced gradients)."""
        hook = self._step_hook(optimizer)
        if hook is None:
            return super().optimizer_step(optimizer, **kwargs)
        if kwargs.get("closure") is not None:
            raise ValueError(
                "optimizer.step(closure) is not supported with cross_replica_dtype or optimizer states sharded "
                "across replicas (ShardingSpec optim > grads): run the backward before calling optimizer.step()."
            )
        self._sync_before_step(optimizer)
        output = super().optimizer_step(optimizer, **kwargs)
        self._synced_before_step.discard(id(optimizer))
        hook.after_step()
        return output

    def _step_hook(self, optimizer: Optimizer) -> Optional[Union[ReplicaShardedOptimizerStates, CompressedSync]]:
        return self._optimizer_hooks.get(id(optimizer)) or self._optimizer_syncs.get(id(optimizer))

    def _sync_before_step(self, optimizer: Optimizer) -> None:
        hook = self._step_hook(optimizer)
        if hook is not None and id(optimizer) not in self._synced_before_step:
            hook.before_step()
            self._synced_before_step.add(id(optimizer))

    # ------------------------------------------------------------------ collectives
    @override
    def all_reduce(
        self, tensor: Tensor, group: Optional[Any] = None, reduce_op: Optional[Union[ReduceOp, str]] = "mean"
    ) -> Tensor:
        if isinstance(tensor, Tensor):
            return compat.sync_ddp_if_available(tensor, group, reduce_op=reduce_op)
        return tensor

    @override
    def barrier(self, *args: Any, **kwargs: Any) -> None:
        process_groups.barrier(self.root_device)

    @override
    def broadcast(self, obj: TBroadcast, src: int = 0) -> TBroadcast:
        return process_groups.broadcast_object(obj, src)

    # ------------------------------------------------------------------ checkpoints
    @override
    def save_checkpoint(
        self,
        path: Any,
        state: dict[str, Any],
        storage_options: Optional[Any] = None,
        filter: Optional[dict[str, Callable[[str, Any], bool]]] = None,
    ) -> None:
        """Write ``state`` as the Trainer strategy's checkpoint: the model's and optimizers' shards
        (written once per shard, replicas sharing the writing), every rank's RNG state, and the other
        entries (``state_dict()`` of stateful objects, plain values as they are), committed atomically.
        A collective: call it on every rank."""
        if storage_options is not None:
            raise TypeError("MiCSStrategy.save_checkpoint does not take storage_options: it writes with DCP.")
        if filter is not None:
            raise ValueError(
                "fabric.save(..., filter=...) is not supported by MiCSStrategy: a sharded checkpoint holds whole "
                "states so that it reshards and resumes. Save without a filter (and select on loading)."
            )
        key, module, optimizers, others = self._split_state(state, "save")
        clashing = [name for name in others if name in RESERVED_KEYS]
        if clashing:
            raise ValueError(
                f"The state keys {clashing} are reserved in a MiCS checkpoint (they hold Lightning's model, optimizer "
                f"and scheduler states); rename these entries of fabric.save(path, state)."
            )
        checkpoint: dict[str, Any] = {}
        schedulers: list[dict[str, Any]] = []
        for name, value in others.items():
            if isinstance(value, compat.Stateful):  # schedulers, metrics, ...: their state, not the object
                checkpoint[name] = value.state_dict()
                if isinstance(value, LRScheduler):  # also where Trainer.fit(ckpt_path=...) restores them from
                    schedulers.append(checkpoint[name])
            else:
                checkpoint[name] = value
        self.sync_buffers(module)  # one model's buffers, not a per-tensor mix of ranks
        checkpoint["state_dict"] = ckpt.model_state_dict(module, full=self.save_full_state_dict)
        if optimizers:
            with optimizers_in_partition_form(self._optimizer_hooks, optimizers.values(), write_back=False):
                checkpoint["optimizer_states"] = [
                    ckpt.optimizer_state_dict(module, optimizer, full=self.save_full_state_dict)
                    for optimizer in optimizers.values()
                ]
        checkpoint[VERSION_KEY] = lightning.__version__
        checkpoint[SCHEDULERS_KEY] = schedulers
        checkpoint[FABRIC_KEY] = {"model": key, "optimizers": list(optimizers), "entries": list(others)}
        ckpt.save(path, checkpoint, self.layout.checkpoint_layout, full=self.save_full_state_dict)

    def sync_buffers(self, module: nn.Module) -> None:
        """Make every rank's persistent buffers of ``module`` (the model ``fabric.setup`` returned) equal
        now, as ``buffer_sync`` says. A collective. ``fabric.save`` calls it; call it before evaluating too."""
        module = _unwrap_objects(module)
        self._check_set_up(module, "sync_buffers(module)")
        sync_buffers(module, self.buffer_sync, device=self.root_device)

    @override
    def load_checkpoint(
        self,
        path: Any,
        state: Optional[Union[nn.Module, Optimizer, dict[str, Any]]] = None,
        strict: bool = True,
        weights_only: Optional[bool] = None,
    ) -> dict[str, Any]:
        """Restore ``state`` in place from a checkpoint of either strategy (any layout, sharded or full);
        return the checkpoint's entries that ``state`` did not ask for. The model, optimizers and the
        requested keys are checked before anything is loaded: a refused load changes nothing. Every
        rank's RNG state is restored when the world size matches the one that saved.

        ``weights_only`` is moot: every loading path is weights-only. A collective: call it on every rank."""
        if not state:
            raise ValueError(
                "fabric.load(path) needs the objects to load into: fabric.load(path, {'model': model, 'optimizer': "
                "optimizer, ...}) with the set-up model. To read a sharded checkpoint into plain tensors, use "
                "lightning_mics.checkpoint.read_full_state(path) or `python -m lightning_mics.consolidate`."
            )
        path = self.broadcast(str(path))
        if isinstance(state, nn.Module):  # fabric.load_raw(path, model)
            self._check_set_up(state, "the model passed to fabric.load_raw")
            ckpt.load(path, state, (), strict, verify=self.checkpoint_verify)
            return {}
        if isinstance(state, Optimizer):
            raise NotImplementedError(
                "Loading an optimizer alone is not supported by MiCSStrategy (its state is keyed by the model's "
                "parameter names): fabric.load(path, {'model': model, 'optimizer': optimizer})."
            )
        _, module, optimizers, others = self._split_state(state, "load")

        def check_requested(saved: Any) -> None:
            missing = [name for name in others if name not in saved]
            if strict and missing:
                raise KeyError(
                    f"The requested state contains a key {missing[0]!r} that does not exist in the checkpoint {path} "
                    "(nothing was loaded). To load without it, set `strict=False`."
                )

        with optimizers_in_partition_form(self._optimizer_hooks, optimizers.values(), write_back=True):
            saved = ckpt.load(
                path,
                module,
                list(optimizers.values()),
                strict,
                restore_rng=True,
                verify=self.checkpoint_verify,
                check_state=check_requested,
            )
        remainder = dict(saved)
        if remainder.pop(FABRIC_KEY, None) is not None:  # saved by Fabric: drop what it added for the Trainer
            remainder.pop(VERSION_KEY, None)
            remainder.pop(SCHEDULERS_KEY, None)
        for name, obj in others.items():
            if name not in remainder:
                continue
            value = remainder.pop(name)
            if isinstance(obj, compat.Stateful):
                obj.load_state_dict(value)
            else:
                state[name] = value
        return remainder

    def _split_state(
        self, state: dict[str, Any], verb: str
    ) -> tuple[str, nn.Module, dict[str, Optimizer], dict[str, Any]]:
        """``state``'s one model, its optimizers (in order) and everything else, checked."""
        modules = {name: value for name, value in state.items() if isinstance(value, nn.Module)}
        if len(modules) != 1:
            raise ValueError(
                f"fabric.{verb}(path, state) needs exactly one model in `state`, e.g. {{'model': model, 'optimizer': "
                f"optimizer}}; found {len(modules)}{' (' + ', '.join(modules) + ')' if modules else ''}. A MiCS "
                "checkpoint holds one model: save several models to separate paths."
            )
        key, module = next(iter(modules.items()))
        self._check_set_up(module, f"state[{key!r}]")
        optimizers = {name: value for name, value in state.items() if isinstance(value, Optimizer)}
        foreign = [name for name, optimizer in optimizers.items() if optimizer not in self._optimizers]
        if foreign:
            raise ValueError(
                f"The optimizers {foreign} in fabric.{verb}(path, state) were not set up by MiCSStrategy: pass them to "
                "fabric.setup(model, optimizer) first (their states are keyed by the sharded model's parameters)."
            )
        others = {name: value for name, value in state.items() if name not in modules and name not in optimizers}
        return key, module, optimizers, others

    def _check_set_up(self, module: nn.Module, what: str) -> None:
        if module not in self._modules:
            raise ValueError(
                f"{what} ({type(module).__name__}) has not been set up by this MiCSStrategy: call "
                "`model = fabric.setup(model, ...)` (or fabric.setup_module) before saving or loading it."
            )

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: Any) -> None:
        register_strategy_names(strategy_registry, cls, knows_accumulation=False)


class _MiCSBackwardSyncControl(compat.BackwardSyncControl):
    """What ``fabric.no_backward_sync(model, enabled)`` enters: MiCS's deferral of the cross-replica hop."""

    def __init__(self, strategy: MiCSStrategy) -> None:
        self._strategy = weakref.proxy(strategy)

    @override
    def no_backward_sync(self, module: nn.Module, enabled: bool) -> AbstractContextManager:
        if not enabled:
            return nullcontext()
        return self._strategy.no_cross_replica_sync(module)
