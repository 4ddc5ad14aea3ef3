"""A MiCS run's layout, and sharding modules and optimizers onto it: what both Lightning front ends share.

The Trainer strategy (:mod:`lightning_mics.strategy`) and the Fabric strategy
(:mod:`lightning_mics.fabric`) differ only in *when* Lightning calls them; *what* they do is here,
once, so that the two cannot drift apart:

* :func:`resolve_layout` -> :class:`LayoutSettings` -> :func:`build_layout` -> :class:`MiCSLayout` --
  the layout resolved from the options (no groups yet, comparable with an earlier strategy's), then
  the (replicate, shard) device mesh, AMSP's optimizer-state groups and the hierarchical sub-groups,
  created collectively;
* :func:`shard_module` -- one model onto the layout: every rank starts from rank 0's states,
  FSDP2 units on the mesh, the collectives gloo or multi-node partitions need, meta-device models
  materialised shard by shard;
* :func:`accumulation_context` -- the gradient-accumulation context that depends on the layout (the
  cross-replica schedules, AMSP's optimizer states among them, are :mod:`lightning_mics.hop2`'s).

What happens before the ranks start (the pre-launch layout check, ranks per node, threads) is in
:mod:`lightning_mics.launch`.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Generator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field, fields
from datetime import timedelta
from typing import Any, Optional, Union

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy

from lightning_mics import _compat as compat
from lightning_mics import checkpoint as ckpt
from lightning_mics.collectives import (
    HierarchicalGroups,
    create_hierarchical_groups,
    install_direct_all_gather,
    install_hierarchical_collectives,
    install_ring_reduce_scatter,
)
from lightning_mics.accumulation import GradAccumulation, check_grad_accumulation
from lightning_mics.grad_sync import defer_gradient_sync
from lightning_mics.hop2 import Hop2, decide_hop2, hop2_can_overlap
from lightning_mics.offload import (
    CPUOffloadOption,
    check_offload_layout,
    describe_offload,
    move_unsharded_states,
    offload_policy,
)
from lightning_mics.options import Hierarchical, ShardingOption
from lightning_mics.planner.live import PlannerCluster, describe_cluster, planner_cluster_for
from lightning_mics.post_forward_mesh import PostForwardMeshes
from lightning_mics.process_groups import SHARD_DIM, build_layout_meshes, create_optimizer_state_groups
from lightning_mics.sharding_spec import ShardingSpec
from lightning_mics.topology import MiCSTopology, PartitionSizeSpec, WorkerSizeSpec
from lightning_mics.wire import WireFormat
from lightning_mics.wrapping import (
    AutoWrapPolicy,
    WrapPlan,
    broadcast_module_states,
    broadcast_shards_across_replicas,
    check_reshard_group,
    has_meta_tensors,
    materialize_meta_module,
    shard_model,
)

#: ``plan_layout(ranks_per_node, fixed partition size or None, grad_accumulation spec, uniform_only)``
#: -> the planner's :class:`~lightning_mics.planner.LayoutChoice` (``partition_size``,
#: ``grad_accumulation``, ``reason``, and ``estimate.layout``: the chosen (P, G, OS)).
LayoutPlanner = Callable[[int, Optional[int], str, bool], Any]


def uses_hierarchical_collectives(topology: MiCSTopology, hierarchical: Hierarchical) -> bool:
    """Two-stage collectives run exactly when a partition spans nodes (``"auto"``); ``True`` insists."""
    if hierarchical is True and not topology.spans_nodes:
        raise ValueError(
            f"hierarchical=True needs a partition that spans nodes, but partition_size={topology.partition_size} "
            f"fits in one node of {topology.ranks_per_node} ranks. Use hierarchical='auto' (or False)."
        )
    return topology.spans_nodes and hierarchical in (True, "auto")


# ---------------------------------------------------------------------------------------------
# The layout
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class MiCSLayout:
    """Everything a rank knows about the layout once its process groups exist. Build it with
    :func:`resolve_layout` and :func:`build_layout`."""

    #: what the layout was resolved to (:func:`resolve_layout`); compared when a new strategy meets a model an
    #: earlier one sharded
    settings: LayoutSettings
    device_mesh: DeviceMesh
    #: AMSP ``optim > grads``: this rank's (optimizer-shard, optimizer-replica) groups
    optim_groups: Optional[tuple[dist.ProcessGroup, dist.ProcessGroup]] = None
    hierarchical_groups: Optional[HierarchicalGroups] = None
    #: process groups :func:`build_layout` created in this process (mesh, AMSP and hierarchical groups)
    created_process_groups: int = field(default=0, compare=False)
    #: hpZ's post-forward meshes, one per group size, shared by every unit sharded onto this layout
    post_forward_meshes: PostForwardMeshes = field(default_factory=PostForwardMeshes, compare=False)
    #: two-level DiLoCo with several workers: the 1-D mesh across them (this rank's outer replication group);
    #: ``device_mesh`` is then the worker's own (replicate, shard) plane
    worker_mesh: Optional[DeviceMesh] = None

    def diloco_group(self) -> tuple[Optional[dist.ProcessGroup], int]:
        """The group DiLoCo's outer average runs over and this rank's index in it (the replica whose own state a
        checkpoint keeps): across workers (two-level), across partition groups (flat), ``(None, 0)`` with one."""
        if self.worker_mesh is not None:
            return self.worker_mesh.get_group(), self.worker_mesh.get_local_rank()
        if self.settings.topology.two_level or self.device_mesh.ndim != 2:
            return None, 0  # one worker spans every partition group, or one partition group
        return self.device_mesh.get_group(0), self.device_mesh.get_local_rank(0)

    @property
    def fsdp_mesh(self) -> DeviceMesh:
        """The mesh FSDP shards on: the 2-D one where FSDP2 runs hop 2 itself; the partition alone where the
        engine runs it or there is none (:class:`~lightning_mics.hop2.Hop2`)."""
        if not self.settings.hop2.fsdp_uses_replicate_dim and self.device_mesh.ndim == 2:
            return self.device_mesh[SHARD_DIM]
        return self.device_mesh

    @property
    def process_groups(self) -> int:
        """Process groups this layout created in this process: its mesh, AMSP and hierarchical groups and
        hpZ's post-forward meshes. A budget (each is an NCCL communicator on GPUs): it depends on the layout,
        never on the number of FSDP units."""
        return self.created_process_groups + self.post_forward_meshes.process_groups

    @property
    def checkpoint_layout(self) -> ckpt.CheckpointLayout:
        """What a checkpoint records about the layout that wrote it (informational)."""
        t = self.settings.topology
        return ckpt.CheckpointLayout(t.world_size, t.partition_size, t.ranks_per_node)

    def describe(self, module: nn.Module, num_units: int, wrapping: Optional[WrapPlan] = None) -> str:
        """Log lines: the groups, and what each rank holds of ``module`` -- in ``num_units`` FSDP
        units, chosen as ``wrapping`` (the plan they were sharded with, when known) says."""
        topology = self.settings.topology
        total = sum(p.numel() for p in module.parameters())
        trainable = sum(p.numel() for p in module.parameters() if p.requires_grad)
        optim_degree = self.settings.optim_degree or topology.partition_size
        units = f"{num_units} FSDP units" + (f" ({wrapping.summary()})" if wrapping is not None else "")
        return "\n".join(
            [
                topology.describe(self.settings.replica_group),
                f"  model states per rank: 1/{topology.partition_size} of {total:,} parameters ({trainable:,} "
                f"trainable) -> ~{total // topology.partition_size:,} params and grads, optimizer states for "
                f"~{trainable // optim_degree:,} (1/{optim_degree}); {units}",
                *([describe_offload(self.settings.cpu_offload)] if self.settings.cpu_offload is not None else []),
                f"  hierarchical collectives: {'on' if self.hierarchical_groups is not None else 'off'}; "
                f"reshard after forward: {self.settings.reshard_after_forward}"
                + ("; params kept gathered within a step" if self.settings.keep_params_within_step else ""),
                f"  grad accumulation: {self.settings.grad_accumulation}"
                + (f" -- {self.settings.planner_reason}" if self.settings.planner_reason else ""),
                self._describe_hop2(),
                (
                    f"  {self.process_groups} process groups created by this layout "
                    f"({compat.process_group_count()} alive in this process, the default group included)"
                ),
            ]
        )

    def _describe_hop2(self) -> str:
        """What crosses the replication groups and in which dtype; DiLoCo's outer round instead of a per-step
        all-reduce."""
        hop2 = self.settings.hop2
        if hop2.schedule == "diloco":
            return f"  cross-replica: {hop2.describe()}"
        if hop2.schedule == "none" and not hop2.managed:
            return f"  hop 2: {hop2.describe()}"
        wire = self.settings.cross_replica_wire
        dtype = "the gradients' dtype" if wire is None else str(wire)
        return f"  cross-replica gradient sync in {dtype}; hop 2: {hop2.describe()}"

    def single_unit_warning(self, num_units: int) -> Optional[str]:
        """What to do when the whole model is one FSDP unit in a partition of several ranks, or
        ``None``: then every rank gathers the whole model at once, with nothing to overlap."""
        if num_units != 1 or self.settings.topology.partition_size == 1:
            return None
        return (
            "wrapping: the whole model is one FSDP unit, so it is gathered at once with nothing to overlap "
            "(auto_wrap_policy=False, a policy that matched no module, or a model without submodules of its own "
            "that can be split off); pass auto_wrap_policy={YourBlockClass} or a callable (name, module) -> bool to "
            "shard it block by block"
        )

    def log_description(
        self, logger: logging.Logger, module: nn.Module, num_units: int, wrapping: Optional[WrapPlan] = None
    ) -> None:
        """Log :meth:`describe` (info) and, when the model is one unit in a multi-rank partition,
        :meth:`single_unit_warning` (warning). The strategies call it on global rank 0."""
        logger.info(self.describe(module, num_units, wrapping))
        warning = self.single_unit_warning(num_units)
        if warning is not None:
            logger.warning(warning)


@dataclass(frozen=True)
class LayoutSettings:
    """A layout resolved from the options, before any process group exists.

    Two strategies whose settings are equal shard a model identically, so a model one of them sharded
    can be used by the other (a new Trainer evaluating or fitting a model an earlier Trainer set up).
    Everything that decides where each parameter's shards live, how gradients and optimizer states are
    synced and over which backend is here; ``planner_reason`` (prose) is not compared."""

    rank: int
    topology: MiCSTopology
    #: the per-state degrees in use, or ``None`` (no ShardingSpec)
    sharding: Optional[ShardingSpec]
    reshard_after_forward: Union[bool, int]
    grad_accumulation: GradAccumulation
    optim_degree: Optional[int]
    keep_params_within_step: bool
    #: whether two-stage collectives are installed (a partition spanning nodes, ``hierarchical`` on)
    hierarchical: bool
    #: the compressed cross-replica hop (``cross_replica_dtype``), or ``None``
    cross_replica_wire: Optional[WireFormat]
    device_type: str
    backend: str
    #: who runs hop 2 and when (:func:`~lightning_mics.hop2.decide_hop2`): read by everything that depends on it
    hop2: Hop2 = Hop2()
    planner_reason: Optional[str] = field(default=None, compare=False)
    #: (g, G) when this world is replica group g of a fault-tolerant job's G (for the layout log)
    replica_group: Optional[tuple[int, int]] = field(default=None, compare=False)
    #: ``cpu_offload``'s FSDP2 policy (sharded states in host memory), or ``None``
    cpu_offload: Optional[CPUOffloadPolicy] = None

    @property
    def cross_replica_overlap(self) -> bool:
        """Hop 2 runs per unit behind the boundary backward."""
        return self.hop2.overlapped

    @property
    def shards_optimizer_beyond_partition(self) -> bool:
        """AMSP ``optim > grads``: optimizer states sharded across replicas."""
        return self.hop2.shards_optimizer_beyond_partition

    def differences(self, other: LayoutSettings) -> list[str]:
        """``"partition_size: 2 (earlier) vs 4 (now)"``-style lines for every setting that differs."""
        mine, theirs = self._flat(), other._flat()
        return [f"{name}: {mine[name]!r} vs {theirs[name]!r}" for name in mine if mine[name] != theirs[name]]

    def _flat(self) -> dict[str, Any]:
        t = self.topology
        values: dict[str, Any] = {
            "world_size": t.world_size,
            "rank": self.rank,
            "ranks_per_node": t.ranks_per_node,
            "partition_size": t.partition_size,
            "replicas": t.replication_degree,
            "diloco_worker_size": t.worker_size,
        }
        for f in fields(self):
            if f.compare and f.name not in ("rank", "topology"):
                values[f.name] = getattr(self, f.name)
        # by the option's name and value, as the user wrote it: cross_replica_dtype: None vs 'int8'
        wire = values.pop("cross_replica_wire")
        values["cross_replica_dtype"] = None if wire is None else wire.name
        # hop 2 follows from the other settings except where it overlaps backward and whether torchft carries it:
        # those two, under their options' names (the rest would repeat another line of the difference)
        hop2 = values.pop("hop2")
        values["cross_replica_overlap"] = hop2.overlapped
        values["fault_tolerance"] = hop2.managed
        values["cross_replica_sync"] = "diloco" if hop2.semi_sync else "every_step"
        values["sync_every"] = hop2.sync_every
        return values


def resolve_layout(
    *,
    world_size: int,
    rank: int,
    ranks_per_node: int,
    partition_size: PartitionSizeSpec,
    reshard_after_forward: Union[bool, int],
    sharding: ShardingOption,
    hierarchical: Hierarchical,
    device_type: str,
    backend: str,
    grad_accumulation: str = "sharded",
    cross_replica_wire: Optional[WireFormat] = None,
    cpu_offload: CPUOffloadOption = False,
    plan_layout: Optional[LayoutPlanner] = None,
    cross_replica_overlap: bool = False,
    managed: bool = False,
    sync_every: Optional[int] = None,
    replica_group: Optional[tuple[int, int]] = None,
    diloco_worker_size: WorkerSizeSpec = None,
    ranks_per_region: Optional[int] = None,
) -> LayoutSettings:
    """Resolve the layout -- a ShardingSpec or a partition size; ``"auto"`` degrees (``sharding``),
    partition size and/or accumulation mode through ``plan_layout``, explicit settings staying as
    given -- without creating any process group (:func:`build_layout` creates them), so that a
    strategy can compare it with the layout of a model sharded before. ``managed``: hop 2 runs through
    torchft across replica groups (``fault_tolerance``), this world being group g of G (``replica_group``,
    for the log); ``sync_every``: DiLoCo's H (``cross_replica_sync="diloco"``), ``None`` for a hop 2 every step;
    ``diloco_worker_size``: partition groups per DiLoCo worker (two-level DiLoCo above 1; ``"region"`` needs
    ``ranks_per_region``). Who runs hop 2 is decided here, once."""
    planner_reason = None
    if sharding == "auto" or (sharding is None and partition_size == "auto") or grad_accumulation == "auto":
        if plan_layout is None:
            raise ValueError("'auto' layouts need the model: they are planned when the model is set up.")
        sharding, partition_size, grad_accumulation, planner_reason = _planned(
            plan_layout, world_size, ranks_per_node, partition_size, sharding, grad_accumulation
        )
    check_grad_accumulation(grad_accumulation)
    optim_degree: Optional[int] = None
    keep_params_within_step = False
    if isinstance(sharding, ShardingSpec):
        degrees = sharding.resolve(world_size, ranks_per_node)
        partition_size = degrees.partition_size
        reshard_after_forward = degrees.reshard_after_forward
        optim_degree = degrees.optim
        keep_params_within_step = degrees.params == 1 and degrees.grads > 1
    topology = MiCSTopology.create(
        world_size, ranks_per_node, partition_size, diloco_worker_size if sync_every is not None else None,
        ranks_per_region,
    )
    check_reshard_group(reshard_after_forward, topology.partition_size)
    if topology.partition_size == 1 and grad_accumulation == "sharded":
        # the mode is changed here, so this is its reason (a planner's "sharded as configured" no longer holds)
        grad_accumulation, planner_reason = "unsharded", ONE_RANK_PARTITION_REASON
    offload = _checked_step_hooks(optim_degree, topology.partition_size, cross_replica_wire, cpu_offload, device_type)
    optim_beyond_partition = optim_degree is not None and optim_degree > topology.partition_size
    return LayoutSettings(
        rank=rank,
        topology=topology,
        sharding=sharding if isinstance(sharding, ShardingSpec) else None,
        reshard_after_forward=reshard_after_forward,
        grad_accumulation=grad_accumulation,  # type: ignore[arg-type]
        optim_degree=optim_degree,
        keep_params_within_step=keep_params_within_step,
        hierarchical=uses_hierarchical_collectives(topology, hierarchical),
        cross_replica_wire=cross_replica_wire,
        device_type=device_type,
        backend=backend,
        hop2=decide_hop2(
            replicas=topology.worker_size if topology.two_level else topology.replication_degree,
            optim_beyond_partition=optim_beyond_partition,
            compressed=cross_replica_wire is not None,
            cross_replica_overlap=cross_replica_overlap,
            offloaded=offload is not None,
            managed=managed,
            sync_every=sync_every,
            worker_size=topology.worker_size,
        ),
        planner_reason=planner_reason,
        replica_group=replica_group,
        cpu_offload=offload,
    )


def _checked_step_hooks(
    optim_degree: Optional[int],
    partition_size: int,
    cross_replica_wire: Optional[WireFormat],
    cpu_offload: CPUOffloadOption,
    device_type: str,
) -> Optional[CPUOffloadPolicy]:
    """What works on the gradient shards between backward and the step must combine: optimizer states sharded
    across replicas reduce-scatter them, so neither a compressed hop 2 nor offloaded (host) shards can join
    them; offload is refused on CPU ranks too. Returns ``cpu_offload``'s FSDP2 policy (``None``: off)."""
    if optim_degree is not None and optim_degree > partition_size and cross_replica_wire is not None:
        raise ValueError(
            "cross_replica_dtype cannot be combined with optimizer states sharded across replicas "
            "(ShardingSpec optim > grads): drop one of the two."
        )
    offload = offload_policy(cpu_offload)
    check_offload_layout(offload, device_type, optim_degree, partition_size)
    return offload


#: A gradient "shard" of a one-rank partition is the whole gradient: both modes hold full gradients
#: between micro-steps, but "sharded" copies each micro-step's gradients through FSDP2's one-rank
#: reduce-scatter. Emulated cluster, partition 1: 2.33 -> 2.01 s per step.
ONE_RANK_PARTITION_REASON = (
    "partition of 1: gradients are full-size in either mode, so they accumulate in place "
    "instead of through a one-rank reduce-scatter every micro-step"
)


def _planned(
    plan_layout: LayoutPlanner,
    world_size: int,
    ranks_per_node: int,
    partition_size: PartitionSizeSpec,
    sharding: ShardingOption,
    grad_accumulation: str,
) -> tuple[ShardingOption, PartitionSizeSpec, str, str]:
    """``"auto"`` settings through the planner, the explicit ones kept: (sharding, partition size,
    accumulation mode, the planner's reason). A fixed partition (a spec's grads degree, an explicit size)
    is passed on so that the planner only chooses what is left to it."""
    fixed = None
    if isinstance(sharding, ShardingSpec):
        fixed = sharding.resolve(world_size, ranks_per_node).partition_size
    elif sharding is None and partition_size != "auto":
        fixed = MiCSTopology.create(world_size, ranks_per_node, partition_size).partition_size
    choice = plan_layout(ranks_per_node, fixed, grad_accumulation, sharding != "auto")
    if sharding == "auto":
        chosen = choice.estimate.layout
        sharding = ShardingSpec(params=chosen.params, grads=chosen.grads, optim=chosen.optim)
    elif sharding is None:
        partition_size = choice.partition_size
    return sharding, partition_size, choice.grad_accumulation, choice.reason


def build_layout(settings: LayoutSettings, timeout: Optional[timedelta]) -> MiCSLayout:
    """Create the mesh and extra process groups ``settings`` call for.

    A collective: every rank calls it, in the same order relative to other group creations."""
    topology = settings.topology
    groups_before = compat.process_group_count()
    mesh, worker_mesh = build_layout_meshes(topology, settings.device_type, settings.backend, timeout)
    optim_groups = None
    if settings.shards_optimizer_beyond_partition:
        optim_groups = create_optimizer_state_groups(topology, settings.optim_degree, timeout)
    hierarchical_groups = None
    if settings.hierarchical:
        hierarchical_groups = create_hierarchical_groups(topology, settings.rank, timeout=timeout)
    created = compat.process_group_count() - groups_before
    return MiCSLayout(
        settings, mesh, optim_groups, hierarchical_groups, created_process_groups=created, worker_mesh=worker_mesh
    )


def layout_planner(
    module: nn.Module,
    *,
    world_size: int,
    device: torch.device,
    precision: str,
    accumulation: int,
    cross_replica_wire: Optional[WireFormat] = None,
    log: Optional[logging.Logger] = None,
    planner_cluster: PlannerCluster = None,
    cpu_offload: CPUOffloadOption = False,
    cross_replica_overlap: bool = True,
    sync_every: Optional[int] = None,
    streaming: tuple[int, int] = (1, 0),
) -> LayoutPlanner:
    """The planner (:func:`lightning_mics.planner.plan_layout_for`) for ``module`` on this device, as
    :func:`resolve_layout` calls it for ``"auto"`` settings; its choice and the reason go to ``log``.
    ``planner_cluster``: what the planner assumes about the cluster (:mod:`lightning_mics.planner.live`;
    ``"calibrate"`` measures it here, collectively). ``cpu_offload``: only what stays on the device counts
    against its memory; the PCIe copies and the host optimizer step count in time. ``sync_every``: DiLoCo's H
    (the cross-replica average priced once every H steps, and optimizer states kept inside the partition);
    ``streaming``: streaming DiLoCo's ``(num_fragments, fragment_sync_delay)``."""
    offloading = offload_policy(cpu_offload) is not None

    def plan(ranks_per_node: int, partition_size: Optional[int], grad_accumulation: str, uniform_only: bool) -> Any:
        from lightning_mics.planner import plan_layout_for

        cluster = planner_cluster_for(planner_cluster, world_size, ranks_per_node, device)
        choice = plan_layout_for(
            module,
            world_size,
            ranks_per_node,
            device,
            precision=precision,
            accumulation=accumulation,
            partition_size=partition_size,
            grad_accumulation=grad_accumulation,  # type: ignore[arg-type]
            uniform_only=uniform_only,
            cross_replica_bytes=cross_replica_wire.element_bytes if cross_replica_wire is not None else None,
            cluster=cluster,
            cpu_offload=offloading,
            cross_replica_overlap=hop2_can_overlap(cross_replica_overlap, offloading),  # as resolve_layout decides
            sync_every=sync_every,
            streaming=streaming,
        )
        if log is not None:
            chosen = choice.estimate
            log.info(
                "planner chose %s, %s, for %s%s",  # the reason starts with "grad_accumulation=<mode>"
                chosen.layout.label,
                choice.reason,
                describe_cluster(cluster),
                f"; cpu offload on: {chosen.host_copy_s:.3g} s of PCIe copies and a {chosen.optimizer_step_s:.3g} s "
                "host optimizer step predicted per optimizer step"
                if offloading
                else "",
            )
        return choice

    return plan


# ---------------------------------------------------------------------------------------------
# Sharding a module and its optimizers
# ---------------------------------------------------------------------------------------------


def shard_module(
    module: nn.Module,
    layout: MiCSLayout,
    device: torch.device,
    *,
    root: Optional[nn.Module] = None,
    mp_policy: Optional[MixedPrecisionPolicy] = None,
    auto_wrap_policy: Union[AutoWrapPolicy, WrapPlan] = None,
    activation_checkpointing: AutoWrapPolicy = None,
    compile_blocks: bool = False,
    prefetch_depth: int = 0,
    sync_module_states: bool = True,
) -> list[FSDPModule]:
    """Shard ``module`` onto ``layout`` in place and return its FSDP units (blocks, then the root).

    ``root`` is the module that becomes the FSDP root unit (default: ``module`` itself; the Trainer
    passes a thin wrapper whose ``forward`` Lightning calls). ``auto_wrap_policy`` may be the
    :class:`~lightning_mics.wrapping.WrapPlan` made for ``root`` (to log it afterwards). In order:

    1. every rank takes global rank 0's parameters and buffers (``sync_module_states``), as DDP
       does, so that all replicas of a shard hold the same values;
    2. :func:`~lightning_mics.wrapping.shard_model` on the layout's mesh;
    3. the collectives the layout needs: hierarchical ones for partitions that span nodes, else on
       gloo a ring reduce-scatter (gloo's own is an all-reduce: twice the bytes);
    4. a meta-device model is materialised shard by shard (``reset_parameters()``), and the
       replicas of each shard take the first replica's values.

    A collective: call it on every rank.
    """
    root = module if root is None else root
    if any(isinstance(m, FSDPModule) for m in root.modules()):
        raise TypeError(
            "MiCS applies `fully_shard` itself, but the model already contains FSDP2 modules (it called "
            "`fully_shard`, or a MiCS Fabric strategy set it up before; a model a MiCSStrategy Trainer sharded is used "
            "as it is by the next one). Remove the `fully_shard` calls, choose the units with "
            "`MiCSStrategy(auto_wrap_policy=...)`, and set each model up only once."
        )
    on_meta = has_meta_tensors(root)
    if sync_module_states and not on_meta:
        broadcast_module_states(root, src=0, device=device if layout.settings.backend == "nccl" else None)
    units = shard_model(
        root,
        layout.fsdp_mesh,
        policy=auto_wrap_policy,
        reshard_after_forward=layout.settings.reshard_after_forward,
        mp_policy=mp_policy,
        force_sum_reduction=layout.settings.backend == "gloo",
        activation_checkpointing=activation_checkpointing,
        compile_blocks=compile_blocks,
        prefetch_depth=prefetch_depth,
        post_forward_meshes=layout.post_forward_meshes,
        offload_policy=layout.settings.cpu_offload,
    )
    install_layout_collectives(units, layout)
    _place_states(module, root, layout, device, on_meta, sync_module_states)
    return units


def _place_states(
    module: nn.Module, root: nn.Module, layout: MiCSLayout, device: torch.device, on_meta: bool, sync: bool
) -> None:
    """After ``fully_shard``: a meta-device model materialised shard by shard, everything on ``device`` --
    except, with ``cpu_offload``, the shards, which stay in (and are materialised into) host memory -- and
    with ``sync``, a meta model's replicas of each shard made equal."""
    offloaded = layout.settings.cpu_offload is not None
    if on_meta:
        materialize_meta_module(module, torch.device("cpu") if offloaded else device)
    if offloaded:
        move_unsharded_states(root, device)
    else:
        root.to(device)  # buffers and anything FSDP did not own
    if on_meta and sync:
        mesh = layout.device_mesh
        staging = device if layout.settings.backend == "nccl" else None  # NCCL takes device tensors only
        broadcast_shards_across_replicas(root, mesh.get_group(0) if mesh.ndim == 2 else None, device=staging)


def install_layout_collectives(units: Sequence[FSDPModule], layout: MiCSLayout) -> None:
    """The collectives ``layout`` needs instead of FSDP2's own: two-stage ones for partitions that span
    nodes; on gloo a ring reduce-scatter (gloo's own is an all-reduce: twice the bytes) and, inside one
    node, a direct-exchange all-gather."""
    if layout.hierarchical_groups is not None:
        install_hierarchical_collectives(units, layout.hierarchical_groups)
    elif layout.settings.backend == "gloo":
        install_ring_reduce_scatter(units)
        if not layout.settings.topology.spans_nodes:  # every pair of a partition talks: keep it off the slow links
            install_direct_all_gather(units)


@contextmanager
def params_kept_gathered(units: Sequence[FSDPModule], enabled: bool) -> Generator[None, None, None]:
    """ZeRO-2-like mode (AMSP ``params=1``): keep gathered parameters through non-boundary backwards,
    so they are all-gathered once per optimizer step instead of once per micro-step. The boundary
    backward reshards, so the optimizer step updates the shards and the next forward gathers fresh values."""
    if not enabled:
        yield
        return
    for unit in units:
        unit.set_reshard_after_backward(False, recurse=False)
    try:
        yield
    finally:
        for unit in units:
            unit.set_reshard_after_backward(True, recurse=False)


@contextmanager
def accumulation_context(units: Sequence[FSDPModule], layout: MiCSLayout) -> Generator[None, None, None]:
    """The backward of a non-boundary micro-step: ``grad_accumulation="sharded"`` reduce-scatters
    inside the partition only, ``"unsharded"`` keeps full gradients; either way the cross-replica
    all-reduce runs once, on the boundary backward (outside this context)."""
    with defer_gradient_sync(units, layout.settings.grad_accumulation), params_kept_gathered(
        units, layout.settings.keep_params_within_step
    ):
        yield
