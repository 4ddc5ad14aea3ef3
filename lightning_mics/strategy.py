"""``MiCSStrategy``: the glue between Lightning and the MiCS pieces.

The ideas live in their own modules -- :mod:`~lightning_mics.topology` (who shards with whom),
:mod:`~lightning_mics.wrapping` (which modules become FSDP2 units), :mod:`~lightning_mics.grad_sync`
(2-hop gradient sync, clipping), :mod:`~lightning_mics.precision` and
:mod:`~lightning_mics.checkpoint`. This file only calls them at the right Lightning hooks.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Generator
from contextlib import ExitStack, contextmanager, nullcontext
from datetime import timedelta
from typing import Any, Literal, Optional, Union

import torch
import torch.distributed as dist
from lightning.fabric.plugins import CheckpointIO, ClusterEnvironment
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.fabric.utilities.distributed import group as _group
from lightning.fabric.utilities.seed import reset_seed
from lightning.fabric.utilities.types import ReduceOp
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.accelerators import Accelerator
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies.parallel import ParallelStrategy
from lightning.pytorch.strategies.strategy import TBroadcast
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.rank_zero import rank_zero_only
from lightning_utilities.core.rank_zero import rank_zero_only as utils_rank_zero_only
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule
from torch.optim import Optimizer
from typing_extensions import override

from lightning_mics import _compat as compat
from lightning_mics import checkpoint as ckpt
from lightning_mics.collectives import (
    HierarchicalGroups,
    create_hierarchical_groups,
    install_hierarchical_collectives,
    install_ring_reduce_scatter,
)
from lightning_mics.grad_sync import defer_cross_replica_sync
from lightning_mics.optim_sharding import ReplicaShardedOptimizerStates
from lightning_mics.precision import MiCSPrecision
from lightning_mics.process_groups import (
    SHARD_DIM,
    build_device_mesh,
    create_optimizer_state_groups,
)
from lightning_mics.sharding_spec import ShardingSpec
from lightning_mics.topology import MiCSTopology, PartitionSizeSpec, detect_ranks_per_node
from lightning_mics.wrapping import (
    AutoWrapPolicy,
    broadcast_module_states,
    broadcast_shards_across_replicas,
    check_reshard_group,
    has_meta_tensors,
    make_wrap_predicate,
    materialize_meta_module,
    shard_model,
)

log = logging.getLogger(__name__)



class _MiCSRoot(nn.Module):
    """The FSDP2 root unit around the LightningModule.

    Lightning calls ``training_step`` rather than ``forward``; routing the call through this
    wrapper's ``forward`` (Lightning's forward redirection) makes FSDP2's root hooks run, which
    unshard the parameters owned directly by the LightningModule and drive the backward hooks.
    """

    def __init__(self, module: LightningModule) -> None:
        super().__init__()
        self.module = module

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.module(*args, **kwargs)


class MiCSStrategy(ParallelStrategy):
    """Train with MiCS: shard model states inside small partition groups, replicate across them.

    Args:
        partition_size: ranks that shard one copy of the model states. ``None``/``"node"``: one node
            (the MiCS default); ``"world"`` or ``-1``: every rank (ZeRO-3); ``1``: no sharding
            (DDP-like); an int: that many ranks (a divisor of a node, or whole nodes).
        ranks_per_node: ranks on each node. Default: the launcher's ``LOCAL_WORLD_SIZE`` (or SLURM /
            Open MPI equivalent), else the number of devices per node. Set it to emulate a
            multi-node layout on one machine.
        auto_wrap_policy: which modules become FSDP units. ``None``: children of every
            ``nn.ModuleList`` (e.g. transformer blocks); module class(es); a callable
            ``(name, module) -> bool``; ``False``: only the root.
        reshard_after_forward: free gathered parameters after each unit's forward (ZeRO-3 style,
            least memory) or keep them until backward (``False``, less communication); an int
            reshards to that many ranks instead (must divide the partition size).
        sharding: AMSP per-state sharding degrees, ``ShardingSpec(params=..., grads=..., optim=...)``.
            ``grads`` becomes the partition size; ``params`` smaller than it reshards parameters to
            that group after forward (1: keep them gathered through the step); ``optim`` larger
            than it shards optimizer states across replicas too. Replaces ``partition_size`` and
            ``reshard_after_forward`` (pass one or the other).
        activation_checkpointing_policy: recompute activations in backward for these modules:
            ``True`` = every wrapped block; module classes or a callable as for ``auto_wrap_policy``.
        prefetch_depth: start the all-gather of the next ``N`` blocks while the current one
            computes (forward and backward), so communication overlaps compute; 0 leaves FSDP's
            implicit prefetching. Assumes blocks run in module order, as transformer layers do.
        compile_blocks: ``torch.compile`` each wrapped block (in place) before sharding.
        hierarchical: two-stage all-gather / reduce-scatter (across nodes among same-local-rank
            peers, then inside the node) for partitions that span nodes. ``"auto"``: on exactly when
            a partition spans nodes; ``True`` requires such a partition.
        process_group_backend: ``"nccl"``, ``"gloo"``, ...; default: NCCL on CUDA, gloo on CPU.
        timeout: timeout for collectives, so a dead rank cannot hang the others forever: a
            ``timedelta`` or a number of seconds.
        save_full_state_dict: save checkpoints as one file gathered on rank 0 (Lightning's usual
            format, for small models / export) instead of a sharded directory. Loading takes either.
        sync_module_states: start every rank from global rank 0's parameters and buffers, as DDP
            does (one broadcast of the model before sharding), so training does not depend on every
            rank seeding alike or loading the same weights. Meta-device models have no values before
            sharding: their replicas of each shard take the first replica's values instead.
        async_save: write sharded checkpoints in the background: a save copies the states to CPU
            memory and returns; shards are written, checksummed and committed by a worker thread
            (its own process group). At most one save is in flight; loads, the next save and the end
            of the run wait for it. A failed background save raises at the next save or at teardown.
        checkpoint_verify: how a checkpoint's files are checked against its integrity record before
            loading: ``"checksum"`` (sizes and CRC-32, default), ``"size"`` (sizes only, for very
            large checkpoints on slow storage) or ``"none"``.
    """

    strategy_name = "mics"

    def __init__(
        self,
        partition_size: PartitionSizeSpec = None,
        ranks_per_node: Optional[int] = None,
        auto_wrap_policy: AutoWrapPolicy = None,
        reshard_after_forward: Union[bool, int] = True,
        hierarchical: Union[bool, Literal["auto"]] = "auto",
        sharding: Optional[ShardingSpec] = None,
        activation_checkpointing_policy: AutoWrapPolicy = None,
        prefetch_depth: int = 1,
        compile_blocks: bool = False,
        process_group_backend: Optional[str] = None,
        timeout: Union[timedelta, float, None] = default_pg_timeout,
        save_full_state_dict: bool = False,
        sync_module_states: bool = True,
        async_save: bool = False,
        checkpoint_verify: ckpt.VerifyMode = "checksum",
        accelerator: Optional[Accelerator] = None,
        parallel_devices: Optional[list[torch.device]] = None,
        cluster_environment: Optional[ClusterEnvironment] = None,
        checkpoint_io: Optional[CheckpointIO] = None,
        precision_plugin: Optional[Precision] = None,
    ) -> None:
        super().__init__(
            accelerator=accelerator,
            parallel_devices=parallel_devices,
            cluster_environment=cluster_environment,
            checkpoint_io=checkpoint_io,
            precision_plugin=precision_plugin,
        )
        if ranks_per_node is not None and (
            isinstance(ranks_per_node, bool) or not isinstance(ranks_per_node, int) or ranks_per_node < 1
        ):
            raise ValueError(
                f"ranks_per_node must be a positive int or None (detect from the launcher), got {ranks_per_node!r}"
                + (f"; write ranks_per_node={int(ranks_per_node)}." if str(ranks_per_node).isdigit() else ".")
            )
        if not isinstance(reshard_after_forward, (bool, int)) or (
            not isinstance(reshard_after_forward, bool) and reshard_after_forward < 1
        ):
            raise ValueError(
                f"reshard_after_forward={reshard_after_forward!r} must be True, False or a positive group size."
            )
        make_wrap_predicate(auto_wrap_policy)  # a malformed policy fails here, not at setup
        if activation_checkpointing_policy is not True:
            make_wrap_predicate(activation_checkpointing_policy)
        timeout = _as_timedelta(timeout)
        if sharding is not None and (partition_size is not None or reshard_after_forward is not True):
            raise ValueError(
                "Pass either sharding=ShardingSpec(...) or partition_size/reshard_after_forward, not both: the spec's "
                "grads degree is the partition size and its params degree sets the reshard group."
            )
        if sharding is not None and not isinstance(sharding, ShardingSpec):
            raise TypeError(f"sharding must be a lightning_mics.ShardingSpec, got {type(sharding).__name__}.")
        self.sharding = sharding
        if isinstance(prefetch_depth, bool) or not isinstance(prefetch_depth, int) or prefetch_depth < 0:
            raise ValueError(f"prefetch_depth must be a non-negative int, got {prefetch_depth!r}.")
        self.activation_checkpointing_policy = activation_checkpointing_policy
        self.prefetch_depth = prefetch_depth
        self.compile_blocks = compile_blocks
        self.partition_size_spec = partition_size
        self.ranks_per_node_override = ranks_per_node
        self.auto_wrap_policy = auto_wrap_policy
        self.reshard_after_forward = reshard_after_forward
        if hierarchical not in (True, False, "auto"):
            raise ValueError(f"hierarchical must be True, False or 'auto', got {hierarchical!r}.")
        self.hierarchical = hierarchical
        self._hierarchical_groups: Optional[HierarchicalGroups] = None
        # AMSP per-state sharding (see `sharding`): optimizer-state degree beyond the partition,
        # and whether gathered parameters stay unsharded across the micro-steps of one step.
        self._optim_degree: Optional[int] = None
        self._keep_params_within_step = False
        self._optim_groups: Optional[tuple[dist.ProcessGroup, dist.ProcessGroup]] = None
        #: Per optimizer (by id): its states sharded across replicas, run around each optimizer step.
        self._optimizer_state_sharding: dict[int, ReplicaShardedOptimizerStates] = {}
        self._process_group_backend = process_group_backend
        self._timeout = timeout
        self.save_full_state_dict = save_full_state_dict
        self.sync_module_states = sync_module_states
        if not isinstance(async_save, bool):
            raise TypeError(f"async_save must be True or False, got {async_save!r}.")
        if checkpoint_verify not in ckpt.VERIFY_MODES:
            raise ValueError(
                f"checkpoint_verify={checkpoint_verify!r} is not one of {list(ckpt.VERIFY_MODES)}: 'checksum' checks "
                "sizes and CRC-32 of every file before loading, 'size' only sizes, 'none' nothing."
            )
        self.checkpoint_verify: ckpt.VerifyMode = checkpoint_verify
        self._async_saver = ckpt.AsyncCheckpointSaver(timeout) if async_save else None
        #: Seconds the training loop spent in each checkpoint save (with ``async_save``: the copy of
        #: the states to CPU memory), for logs and benchmarks.
        self.checkpoint_stall_s: list[float] = []
        self._num_nodes = 1
        self._topology: Optional[MiCSTopology] = None
        self._device_mesh: Optional[DeviceMesh] = None
        self._fsdp_units: list[FSDPModule] = []
        self._root: Optional[_MiCSRoot] = None

    # ------------------------------------------------------------------ properties
    @property
    def async_save(self) -> bool:
        """Whether sharded checkpoints are written in the background."""
        return self._async_saver is not None

    @property
    def topology(self) -> MiCSTopology:
        if self._topology is None:
            raise RuntimeError("The MiCS topology exists once the strategy has set up its processes.")
        return self._topology

    @property
    def device_mesh(self) -> DeviceMesh:
        if self._device_mesh is None:
            raise RuntimeError("The device mesh exists once the strategy has set up its processes.")
        return self._device_mesh

    @property
    def fsdp_units(self) -> list[FSDPModule]:
        """The FSDP2 units (wrapped blocks, then the root), available after ``setup``."""
        return self._fsdp_units

    @property
    @override
    def root_device(self) -> torch.device:
        assert self.parallel_devices is not None
        return self.parallel_devices[self.local_rank]

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
    def is_distributed(self) -> bool:
        """Tells Lightning to insert a ``DistributedSampler`` (it only knows its built-in strategies)."""
        return True

    @property
    @override
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        # Every rank is a data-parallel worker: partitions shard states, not data.
        return {"num_replicas": self.num_nodes * self.num_processes, "rank": self.global_rank}

    @property
    def process_group_backend(self) -> Optional[str]:
        return self._process_group_backend

    @property
    @override
    def restore_checkpoint_after_setup(self) -> bool:
        return True  # shards load straight into the sharded model and optimizer

    @property
    @override
    def lightning_restore_optimizer(self) -> bool:
        return False

    @property  # type: ignore[override]
    @override
    def precision_plugin(self) -> MiCSPrecision:
        plugin = self._precision_plugin
        if not isinstance(plugin, MiCSPrecision):
            plugin = self._precision_plugin = MiCSPrecision.from_plugin(plugin or Precision())
        return plugin

    @precision_plugin.setter
    @override
    def precision_plugin(self, precision_plugin: Optional[Precision]) -> None:
        self._precision_plugin = None if precision_plugin is None else MiCSPrecision.from_plugin(precision_plugin)

    # ------------------------------------------------------------------ processes and mesh
    @override
    def _configure_launcher(self) -> None:
        assert self.cluster_environment is not None
        if not self.cluster_environment.creates_processes_externally:
            self._check_layout_before_launch()
            limit_intra_op_threads(self.num_processes)
            self._launcher = compat.SubprocessScriptLauncher(
                self.cluster_environment, self.num_processes, self.num_nodes
            )

    def _check_layout_before_launch(self) -> None:
        """Lightning is about to start the processes, so the world size is known: refuse an invalid
        layout now, once, instead of in every rank after the processes exist (pure layout math)."""
        world_size = self.num_processes * self.num_nodes
        ranks_per_node = self.ranks_per_node_override or self.num_processes
        if world_size < 1 or self.partition_size_spec == "auto":
            return  # "auto" needs the model; resolved at setup
        if self.sharding is not None:
            self.sharding.resolve(world_size, ranks_per_node)
        else:
            topology = MiCSTopology.create(world_size, ranks_per_node, self.partition_size_spec)
            check_reshard_group(self.reshard_after_forward, topology.partition_size)

    def set_world_ranks(self) -> None:
        if self.cluster_environment is not None:
            self.cluster_environment.set_global_rank(self.node_rank * self.num_processes + self.local_rank)
            self.cluster_environment.set_world_size(self.num_nodes * self.num_processes)
        rank_zero_only.rank = utils_rank_zero_only.rank = self.global_rank

    @override
    def setup_environment(self) -> None:
        super().setup_environment()
        reset_seed()
        self.set_world_ranks()
        self._process_group_backend = self._process_group_backend or compat.default_process_group_backend_for_device(
            self.root_device
        )
        assert self.cluster_environment is not None
        kwargs: dict[str, Any] = {"timeout": self._timeout}
        if self._process_group_backend == "nccl":
            kwargs["device_id"] = self.root_device  # eager NCCL init bound to this GPU (not for gloo on CUDA)
        compat.init_dist_connection(self.cluster_environment, self._process_group_backend, **kwargs)
        if self._topology is None:  # a later stage of the same trainer keeps the layout and groups
            self._create_layout()
        assert self.lightning_module is not None
        compat.expose_device_mesh(self.lightning_module, self._device_mesh)  # visible in configure_model()

    def _create_layout(self) -> None:
        """Resolve the layout (sharding spec or partition size, 'auto' via the planner) and create
        its mesh and extra process groups -- collectively, on every rank."""
        ranks_per_node = self._ranks_per_node()
        if self.sharding is not None:
            degrees = self.sharding.resolve(self.world_size, ranks_per_node)
            self.partition_size_spec = degrees.partition_size
            self.reshard_after_forward = degrees.reshard_after_forward
            self._optim_degree = degrees.optim
            self._keep_params_within_step = degrees.params == 1 and degrees.grads > 1
        if self.partition_size_spec == "auto":
            self.partition_size_spec = self._plan_partition_size(ranks_per_node)
        self._topology = MiCSTopology.create(self.world_size, ranks_per_node, self.partition_size_spec)
        check_reshard_group(self.reshard_after_forward, self._topology.partition_size)
        self._device_mesh = self._build_mesh(self._topology)
        if self._shards_optimizer_beyond_partition:
            self._optim_groups = create_optimizer_state_groups(self._topology, self._optim_degree, self._timeout)
        if self._uses_hierarchical_collectives(self._topology):
            self._hierarchical_groups = create_hierarchical_groups(
                self._topology, self.global_rank, timeout=self._timeout
            )

    def _plan_partition_size(self, ranks_per_node: int) -> int:
        """``partition_size="auto"``: the planner's fastest layout that fits this model in memory."""
        from lightning_mics.planner import plan_partition_size_for

        assert self.lightning_module is not None
        trainer = getattr(self.lightning_module, "_trainer", None)
        size = plan_partition_size_for(
            self.lightning_module,
            self.world_size,
            ranks_per_node,
            self.root_device,
            precision=self.precision_plugin.precision,
            accumulation=int(getattr(trainer, "accumulate_grad_batches", 1) or 1),
        )
        if self.is_global_zero:
            log.info("partition_size='auto': the planner chose %d", size)
        return size

    def _ranks_per_node(self) -> int:
        if self.ranks_per_node_override is not None:
            return self.ranks_per_node_override
        return detect_ranks_per_node() or self.num_processes or self.world_size

    def _uses_hierarchical_collectives(self, topology: MiCSTopology) -> bool:
        if self.hierarchical is True and not topology.spans_nodes:
            raise ValueError(
                f"hierarchical=True needs a partition that spans nodes, but partition_size={topology.partition_size} "
                f"fits in one node of {topology.ranks_per_node} ranks. Use hierarchical='auto' (or False)."
            )
        return topology.spans_nodes and self.hierarchical in (True, "auto")

    @property
    def _shards_optimizer_beyond_partition(self) -> bool:
        return self._optim_degree is not None and self._optim_degree > self.topology.partition_size

    def _fsdp_mesh(self) -> DeviceMesh:
        """The mesh FSDP shards on. With optimizer states sharded across replicas, the
        cross-replica hop is ours (reduce-scatter + all-gather), so FSDP gets the partition alone."""
        mesh = self.device_mesh
        if self._shards_optimizer_beyond_partition and mesh.ndim == 2:
            return mesh[SHARD_DIM]
        return mesh

    def _build_mesh(self, topology: MiCSTopology) -> DeviceMesh:
        assert self._process_group_backend is not None
        return build_device_mesh(topology, self.root_device.type, self._process_group_backend, self._timeout)

    # ------------------------------------------------------------------ model setup
    @override
    def setup(self, trainer: Trainer) -> None:
        assert self.accelerator is not None
        assert self.lightning_module is not None
        self.accelerator.setup(trainer)
        root = self._root
        if root is None or root.module is not self.lightning_module:
            root = self._root = self._shard(self.lightning_module)
        # else: sharded by an earlier stage of this trainer (fit, then validate/test): reuse it
        self.model = root
        self.barrier()
        if trainer.state.fn == TrainerFn.FITTING:
            self.setup_optimizers(trainer)
        self.setup_precision_plugin()
        if trainer.state.fn == TrainerFn.FITTING:
            compat.optimizers_to_device(self.optimizers, self.root_device)
            self._shard_optimizer_states()
        self._log_layout()

    def _shard(self, module: LightningModule) -> _MiCSRoot:
        """Wrap ``module`` in the root unit and apply FSDP2 to its blocks and the root."""
        if any(isinstance(m, FSDPModule) for m in module.modules()):
            raise TypeError(
                "MiCSStrategy applies `fully_shard` itself, but the model already contains FSDP2 modules. Remove the "
                "`fully_shard` calls from your LightningModule and choose the units with "
                "`MiCSStrategy(auto_wrap_policy=...)` (or reuse the Trainer that sharded it)."
            )
        self.precision_plugin.device_type = self.root_device.type
        converted = self.precision_plugin.convert_module(module)
        assert converted is module
        root = _MiCSRoot(module)
        on_meta = has_meta_tensors(root)
        if self.sync_module_states and not on_meta:
            staging = self.root_device if self._process_group_backend == "nccl" else None
            broadcast_module_states(root, src=0, device=staging)
        self._fsdp_units = shard_model(
            root,
            self._fsdp_mesh(),
            policy=self.auto_wrap_policy,
            reshard_after_forward=self.reshard_after_forward,
            mp_policy=self.precision_plugin.mixed_precision_policy(),
            force_sum_reduction=self._process_group_backend == "gloo",
            activation_checkpointing=self.activation_checkpointing_policy,
            compile_blocks=self.compile_blocks,
            prefetch_depth=self.prefetch_depth,
        )
        if self._hierarchical_groups is not None:
            install_hierarchical_collectives(self._fsdp_units, self._hierarchical_groups)
        elif self._process_group_backend == "gloo":  # gloo's own reduce-scatter is a full all-reduce
            install_ring_reduce_scatter(self._fsdp_units)
        if on_meta:
            materialize_meta_module(module, self.root_device)
        root.to(self.root_device)  # buffers and anything FSDP did not own
        if on_meta and self.sync_module_states:
            mesh = self.device_mesh
            broadcast_shards_across_replicas(root, mesh.get_group(0) if mesh.ndim == 2 else None)
        return root

    @override
    def optimizer_step(
        self, optimizer: Optimizer, closure: Callable[[], Any], model: Any = None, **kwargs: Any
    ) -> Any:
        """With optimizer states sharded across replicas (AMSP ``optim > grads``), the step is
        bracketed: once the boundary backward has produced the gradients -- inside the closure, so
        before Lightning's ``on_before_optimizer_step`` and gradient clipping -- they are reduced
        into this rank's slice; after the step the updated slices are gathered into the parameters."""
        sharding = self._optimizer_state_sharding.get(id(getattr(optimizer, "_optimizer", optimizer)))
        if sharding is None:
            return super().optimizer_step(optimizer, closure, model, **kwargs)

        def closure_then_reduce_into_slices() -> Any:
            result = closure()
            sharding.before_step()
            return result

        output = super().optimizer_step(optimizer, closure_then_reduce_into_slices, model, **kwargs)
        sharding.after_step()
        return output

    def _shard_optimizer_states(self) -> None:
        self._optimizer_state_sharding.clear()
        self.precision_plugin.disjoint_groups = {}
        if not self._shards_optimizer_beyond_partition:
            return
        if self.precision_plugin.scaler is not None:
            raise ValueError(
                "Optimizer-state sharding across replicas does not support precision='16-mixed' (loss scaling); "
                "use 'bf16-mixed' or keep the optimizer states at the partition degree."
            )
        assert self._optim_groups is not None
        shard_pg, replica_pg = self._optim_groups
        partition_pg = self._fsdp_mesh().get_group()  # 1-D in this mode: the partition
        for optimizer in self.optimizers:
            hook = ReplicaShardedOptimizerStates(
                optimizer, shard_pg, replica_pg, partition_pg, grad_divisor=self.topology.replication_degree
            )
            self._optimizer_state_sharding[id(optimizer)] = hook
            self.precision_plugin.disjoint_groups = {**self.precision_plugin.disjoint_groups, **hook.disjoint_groups}

    @override
    def setup_optimizers(self, trainer: Trainer) -> None:
        # The optimizer must reference the sharded DTensor parameters, so it is (re)created after
        # sharding; one left from an earlier stage would point at stale tensors.
        self._reset_optimizers_and_schedulers()
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

    def _log_layout(self) -> None:
        if not self.is_global_zero:
            return
        topology = self.topology
        assert self.lightning_module is not None
        total = sum(p.numel() for p in self.lightning_module.parameters())
        trainable = sum(p.numel() for p in self.lightning_module.parameters() if p.requires_grad)
        optim_degree = self._optim_degree or topology.partition_size
        lines = [
            topology.describe(),
            f"  model states per rank: 1/{topology.partition_size} of {total:,} parameters ({trainable:,} trainable) "
            f"-> ~{total // topology.partition_size:,} params and grads, optimizer states for "
            f"~{trainable // optim_degree:,} (1/{optim_degree}); {len(self._fsdp_units)} FSDP units",
            f"  hierarchical collectives: {'on' if self._hierarchical_groups is not None else 'off'}; "
            f"reshard after forward: {self.reshard_after_forward}"
            + ("; params kept gathered within a step" if self._keep_params_within_step else ""),
        ]
        log.info("\n".join(lines))

    # ------------------------------------------------------------------ gradient sync
    @contextmanager
    @override
    def block_backward_sync(self) -> Generator[None, None, None]:
        """Non-boundary micro-steps: reduce-scatter inside the partition only; the cross-replica
        all-reduce runs once, on the boundary backward."""
        with defer_cross_replica_sync(self._fsdp_units), self._params_kept_gathered():
            yield None

    @contextmanager
    def _params_kept_gathered(self) -> Generator[None, None, None]:
        """ZeRO-2-like mode: keep gathered parameters through non-boundary backwards, so they are
        all-gathered once per optimizer step instead of once per micro-step. The boundary backward
        reshards, so the optimizer step updates the shards and the next forward gathers fresh values."""
        if not self._keep_params_within_step:
            yield
            return
        for unit in self._fsdp_units:
            unit.set_reshard_after_backward(False, recurse=False)
        try:
            yield
        finally:
            for unit in self._fsdp_units:
                unit.set_reshard_after_backward(True, recurse=False)

    def no_cross_replica_sync(self) -> Any:
        """For manual optimization: wrap the backward of every non-boundary micro-step in this.
        It is the same context Lightning enters for automatic optimization."""
        return self.block_backward_sync()

    # ------------------------------------------------------------------ collectives
    @override
    def barrier(self, name: Optional[str] = None) -> None:
        if not compat.distributed_is_initialized():
            return
        if dist.get_backend() == "nccl":
            dist.barrier(device_ids=[self.root_device.index])
        else:
            dist.barrier()

    @override
    def broadcast(self, obj: TBroadcast, src: int = 0) -> TBroadcast:
        if not compat.distributed_is_initialized():
            return obj
        container = [obj]
        dist.broadcast_object_list(container, src, group=_group.WORLD)
        return container[0]

    @override
    def reduce(
        self,
        tensor: Union[Tensor, Any],
        group: Optional[Any] = None,
        reduce_op: Optional[Union[ReduceOp, str]] = "mean",
    ) -> Union[Tensor, Any]:
        if isinstance(tensor, Tensor):
            return compat.sync_ddp_if_available(tensor, group, reduce_op=reduce_op)
        return tensor

    @override
    def teardown(self) -> None:
        if self._async_saver is not None:
            self._async_saver.close()  # the run ends only once its last checkpoint is committed
        assert self.cluster_environment is not None
        assert self.accelerator is not None
        self.cluster_environment.teardown()
        self.precision_plugin.teardown()
        self.accelerator.teardown()

    # ------------------------------------------------------------------ checkpoints
    # The logic lives in lightning_mics.checkpoint; these hooks only hand it the module and layout.
    @override
    def lightning_module_state_dict(self) -> dict[str, Any]:
        assert self.lightning_module is not None
        return ckpt.model_state_dict(self.lightning_module, full=self.save_full_state_dict)

    @override
    def optimizer_state(self, optimizer: Optimizer) -> dict[str, Any]:
        assert self.lightning_module is not None
        optimizer = getattr(optimizer, "_optimizer", optimizer)
        with self._optimizers_in_partition_form([optimizer], write_back=False):
            return ckpt.optimizer_state_dict(self.lightning_module, optimizer, full=self.save_full_state_dict)

    @contextmanager
    def _optimizers_in_partition_form(
        self, optimizers: list[Optimizer], write_back: bool
    ) -> Generator[None, None, None]:
        """With optimizer states sharded across replicas (AMSP ``optim > grads``), checkpoints see
        them at the partition degree, as plain MiCS holds them: one checkpoint format for every layout."""
        with ExitStack() as stack:
            for optimizer in optimizers:
                hook = self._optimizer_state_sharding.get(id(optimizer))
                if hook is not None:
                    stack.enter_context(hook.partition_form(write_back=write_back))
            yield

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
        topology = self.topology
        layout = ckpt.CheckpointLayout(topology.world_size, topology.partition_size, topology.ranks_per_node)
        started = time.perf_counter()
        ckpt.save(filepath, checkpoint, layout, full=self.save_full_state_dict, saver=self._async_saver)
        self.checkpoint_stall_s.append(time.perf_counter() - started)

    @override
    def load_checkpoint(self, checkpoint_path: Any, weights_only: Optional[bool] = None) -> dict[str, Any]:
        # `weights_only` is moot: every loading path is weights-only (or DCP with a weights-only planner)
        path = self.broadcast(str(checkpoint_path))
        assert self.lightning_module is not None
        if self._async_saver is not None:
            self._async_saver.wait()  # it may be the checkpoint still being written
        optimizers = [getattr(o, "_optimizer", o) for o in self.optimizers]
        strict = self.lightning_module.strict_loading
        with self._optimizers_in_partition_form(optimizers, write_back=True):
            return ckpt.load(
                path,
                self.lightning_module,
                optimizers,
                strict,
                restore_rng=True,
                for_trainer=True,
                verify=self.checkpoint_verify,
            )

    @override
    def remove_checkpoint(self, filepath: Any) -> None:
        saver = self._async_saver
        if saver is not None and saver.in_flight is not None and str(saver.in_flight) == os.path.abspath(filepath):
            saver.wait()  # never delete a checkpoint while it is being written
        ckpt.remove(filepath)

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: Any) -> None:
        strategy_registry.register(
            "mics", cls, description="MiCS: shard inside one node, replicate across nodes, 2-hop gradient sync"
        )
        strategy_registry.register(
            "mics_zero3", cls, description="MiCS strategy sharding across all ranks (ZeRO-3)", partition_size="world"
        )
        strategy_registry.register(
            "mics_replicate", cls, description="MiCS strategy without sharding (DDP-like)", partition_size=1
        )


def _as_timedelta(timeout: Union[timedelta, float, None]) -> Optional[timedelta]:
    """Collective timeouts are ``timedelta``s in torch; a plain number is taken as seconds."""
    if timeout is None or isinstance(timeout, timedelta):
        return timeout
    if isinstance(timeout, (int, float)) and not isinstance(timeout, bool) and timeout > 0:
        return timedelta(seconds=timeout)
    raise ValueError(
        f"timeout={timeout!r} must be a datetime.timedelta or a positive number of seconds, e.g. timeout=1800."
    )


def limit_intra_op_threads(local_ranks: int) -> None:
    """Give each rank of this machine an equal share of its cores, before the ranks start.

    Lightning sets ``OMP_NUM_THREADS`` in its launcher only *after* starting the other ranks, so
    they start with OpenMP's default (every core each): several ranks on few cores then thrash --
    measured on the main job with partition size 1 (4 ranks, 2 cores): 2,258 ms per step instead of
    614 ms. A value the user set is kept."""
    if "OMP_NUM_THREADS" in os.environ or local_ranks < 1:
        return
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # platforms without affinity masks
        cores = os.cpu_count() or 1
    threads = max(1, cores // local_ranks)
    os.environ["OMP_NUM_THREADS"] = str(threads)
    torch.set_num_threads(threads)
