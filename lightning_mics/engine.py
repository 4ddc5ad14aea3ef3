"""One MiCS run's state and behaviour, under both Lightning front ends.

:class:`MiCSEngine` owns what a run holds -- the options, the process-group backend, the layout, the
hooks around optimizer steps (hop 2 in a compressed wire format, or AMSP optimizer states sharded across
replicas), the background checkpoint saver -- and does everything with them: check a layout before the
launcher starts ranks, join the world, resolve and build the layout, shard a module, attach optimizers,
bracket their steps, sync buffers, save, load and remove checkpoints, tear down.

The Trainer's :class:`lightning_mics.MiCSStrategy` and Fabric's :class:`lightning_mics.MiCSFabricStrategy`
each hold one engine and only map their framework's hooks onto it;
:class:`~lightning_mics.front_end.MiCSFrontEnd` is what both expose in the same way (devices, layout, the
options as attributes). Lightning's own FSDP pair shares its mechanics through module functions and still
repeats much; one object that both hold leaves nothing to repeat. With ``fault_tolerance`` the engine also
holds the replica group's torchft Manager (:mod:`lightning_mics.fault_tolerance`).
"""

from __future__ import annotations

import gc
import logging
import os
import time
import weakref
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass
from typing import Any, Optional, Union

import torch
import torch.distributed as dist
from lightning.fabric.utilities.seed import reset_seed
from torch import Tensor, nn
from torch.distributed.fsdp import FSDPModule
from torch.optim import Optimizer

from lightning_mics import checkpoint as ckpt
from lightning_mics import process_groups
from lightning_mics.buffer_sync import sync_buffers
from lightning_mics.checkpoint import diloco as diloco_checkpoint
from lightning_mics.checkpoint import fabric_entries
from lightning_mics.checkpoint.format import SHARDED_EXTRAS_KEY
from lightning_mics.console import quiet_torchft, show_start_up_lines
from lightning_mics.fault_tolerance import (
    CommittedStepCounters,
    DataEpochs,
    GroupConfiguration,
    ReplicaGroup,
    check_catch_up_heal,
    check_exact_trajectory,
    check_fault_tolerant_layout,
    run_configuration,
    state_hooks,
    trainer_state_hooks,
)
from lightning_mics.fault_tolerance.agreement import parameter_digest_chunks, tensor_digest_chunks
from lightning_mics.fault_tolerance.trajectory import DataCursor, TrajectoryDataLoader, sample_order_of
from lightning_mics.grad_sync import clip_grad_norm_
from lightning_mics.hop2 import diloco, optimizer_states
from lightning_mics.hop2.attach import InnerThenOuter, StepHook, attach, hook_parts
from lightning_mics.hop2.diloco import SemiSync
from lightning_mics.hop2.fsdp import cross_replica_sync_off
from lightning_mics.hop2.pipeline import CrossReplicaPipeline, EachModel, pipelines_in
from lightning_mics.hop2.shares import ShareGradients
from lightning_mics.launch import check_diloco_workers, check_layout, limit_intra_op_threads, resolve_ranks_per_node
from lightning_mics.layout import (
    LayoutSettings,
    MiCSLayout,
    accumulation_context,
    build_layout,
    layout_planner,
    resolve_layout,
    shard_module,
)
from lightning_mics.offload_option import check_offload_before_launch
from lightning_mics.options import MiCSOptions
from lightning_mics.precision import MiCSFabricPrecision, MiCSPrecision, precision_property
from lightning_mics.shards import fsdp_units
from lightning_mics.topology import MiCSTopology, detect_ranks_per_region
from lightning_mics.wire import WireFormat, resolve_wire_format
from lightning_mics.wrapping import RootUnit, ShardRegistry, WrapPlan, plan_wrapping

log = logging.getLogger("lightning_mics")

#: The checkpoint entry that holds the fault-tolerance state (torchft's step count).
FAULT_TOLERANCE_KEY = "mics_fault_tolerance"

#: whether ``gc_freeze`` ran its one full garbage collection in this process (:meth:`MiCSEngine.freeze_startup_objects`)
_COLLECTED_FULLY = False


class MiCSEngine:
    """A MiCS run: the layout, the step hooks and checkpoints of one strategy (see the module doc).

    Collective methods say so; every rank calls them in the same order."""

    def __init__(self, options: MiCSOptions, trainer_loop: bool = True) -> None:
        """``trainer_loop``: the Trainer's front end runs the training loop (Fabric's leaves it to the user's)."""
        self.options = options
        self.trainer_loop = trainer_loop
        show_start_up_lines()  # the layout line shows like Lightning's own, without logging set up
        #: the process-group backend: the option, or (after :meth:`join_world`) what the world uses
        self.backend: Optional[str] = options.process_group_backend
        self.layout_or_none: Optional[MiCSLayout] = None
        #: per optimizer (by id): the hook of its cross-replica schedule (:func:`lightning_mics.hop2.attach.attach`)
        #: -- hop 2 run by the engine, AMSP ``optim > grads`` states sharded across replicas, or DiLoCo's outer sync
        self._step_hooks: dict[int, StepHook] = {}
        #: with ``fault_tolerance``: this group's torchft Manager (created when training starts)
        self.replica_group: Optional[ReplicaGroup] = None
        #: (group, quorums it asked, groups not contributing) when the logging rank was last set: the same at the
        #: next step means the same quorum, so the same group leads (:meth:`_log_from_first_live_group`)
        self._logging_membership: Optional[tuple[Any, ...]] = None
        self._step_open = False
        #: with ``fault_tolerance``: the training data on the global sample order (:meth:`training_data`)
        self._training_data: Optional[TrajectoryDataLoader] = None
        #: optimizers whose gradients already crossed replicas this step (clipping came first)
        self._synced_before_step: set[int] = set()
        #: the background checkpoint writer with ``async_save``, else ``None``
        self.async_saver = ckpt.AsyncCheckpointSaver(options.timeout_delta) if options.async_save else None
        #: seconds the training loop spent in each checkpoint save (async: the copy to CPU memory)
        self.checkpoint_stall_s: list[float] = []
        #: ``gc_freeze``: whether this engine froze the garbage collector's objects (and thaws them at teardown)
        self._froze_gc = False

    @property
    def cross_replica_wire(self) -> Optional[WireFormat]:
        """The format of hop 2 (``cross_replica_dtype``), or ``None``: the gradients' own dtype."""
        return resolve_wire_format(self.options.cross_replica_dtype)

    def layout(self) -> MiCSLayout:
        if self.layout_or_none is None:
            raise RuntimeError(
                "The MiCS layout exists once the strategy has set up its processes (the Trainer's fit/validate/"
                "test/predict, fabric.launch()); with 'auto' settings under Fabric, once the first model is set up."
            )
        return self.layout_or_none

    # ------------------------------------------------------------------ processes and layout
    def check_devices_before_launch(self, device_type: Optional[str], num_processes: int, num_nodes: int) -> None:
        """Whatever starts the ranks: ``cpu_offload`` on CPU ranks, or with a spec whose optimizer degree resolves
        beyond its gradient degree, is refused once, before they run."""
        o = self.options
        world_size = num_processes * num_nodes
        ranks_per_node = o.ranks_per_node or num_processes
        check_offload_before_launch(o.cpu_offload, device_type, world_size, ranks_per_node, o.sharding)

    def check_before_launch(self, num_processes: int, num_nodes: int) -> None:
        """A launcher is about to start ``num_processes`` ranks per node: refuse an invalid layout now,
        once, instead of in every rank (pure layout math), and share the cores between the local ranks."""
        o = self.options
        world_size = num_processes * num_nodes
        ranks_per_node = o.ranks_per_node or num_processes
        check_layout(world_size, ranks_per_node, o.partition_size, o.sharding, o.reshard_after_forward)
        if o.cross_replica_sync == "diloco" and o.partition_size != "auto":
            check_diloco_workers(world_size, ranks_per_node, o.partition_size, o.sharding, o.diloco_worker_size,
                                 o.ranks_per_region if o.ranks_per_region is not None else detect_ranks_per_region())
        limit_intra_op_threads(num_processes)

    def join_world(self, strategy: Any) -> None:
        """Seed, tell the cluster environment the ranks and initialise the default process group
        (``strategy`` is the Lightning ``ParallelStrategy`` that holds this engine). A collective."""
        reset_seed()
        process_groups.assign_world_ranks(strategy)
        if self.options.fault_tolerance is not None:  # one replica group logs for all: rank 0 of group 0
            process_groups.set_logging_rank(self.data_share(strategy.world_size, strategy.global_rank)[1])
        self.backend = process_groups.join_world(
            strategy.cluster_environment, strategy.root_device, self.backend, self.options.timeout_delta
        )

    def resolve_layout(
        self, strategy: Any, plan_for: Optional[nn.Module], precision: str, accumulation: int
    ) -> LayoutSettings:
        """The layout the options describe on ``strategy``'s world, ``"auto"`` settings planned for the
        module ``plan_for`` (``None``: nothing to plan with). No process group is created yet."""
        assert self.backend is not None, "join_world() runs first"
        o, world_size = self.options, strategy.world_size
        sync_every = o.sync_every if o.cross_replica_sync == "diloco" else None
        planner = None
        if plan_for is not None:
            planner = layout_planner(
                plan_for,
                world_size=world_size,
                device=strategy.root_device,
                precision=precision,
                accumulation=accumulation,
                cross_replica_wire=self.cross_replica_wire,
                log=log if strategy.is_global_zero else None,
                planner_cluster=o.planner_cluster,
                cross_replica_overlap=o.cross_replica_overlap,
                cpu_offload=o.cpu_offload,
                sync_every=sync_every,
                streaming=(o.num_fragments, o.fragment_sync_delay) if sync_every is not None else (1, 0),
            )
        settings = resolve_layout(
            world_size=world_size,
            rank=strategy.global_rank,
            ranks_per_node=resolve_ranks_per_node(o.ranks_per_node, strategy.num_processes, world_size),
            partition_size=o.partition_size,
            reshard_after_forward=o.reshard_after_forward,
            sharding=o.sharding,
            hierarchical=o.hierarchical,
            device_type=strategy.root_device.type,
            backend=self.backend,
            grad_accumulation=o.grad_accumulation,
            cross_replica_wire=self.cross_replica_wire,
            plan_layout=planner,
            cross_replica_overlap=o.cross_replica_overlap,
            cpu_offload=o.cpu_offload,
            managed=o.fault_tolerance is not None,
            sync_every=sync_every,
            replica_group=self._replica_group_of_job(),
            diloco_worker_size=o.diloco_worker_size,
            ranks_per_region=o.ranks_per_region if o.ranks_per_region is not None else detect_ranks_per_region(),
        )
        if o.fault_tolerance is not None:
            replicas = settings.topology.replication_degree
            check_fault_tolerant_layout(replicas, settings.shards_optimizer_beyond_partition)
        return settings

    def _replica_group_of_job(self) -> Optional[tuple[int, int]]:
        """(g, G) of a fault-tolerant job as its options and environment give them, for the layout log;
        ``None`` without fault tolerance or before they are known (joining the job checks them)."""
        ft = self.options.fault_tolerance
        if ft is None:
            return None
        try:
            ft = ft.resolved()
        except ValueError:
            return None
        assert ft.replica_group is not None and ft.num_replica_groups is not None
        return ft.replica_group, ft.num_replica_groups

    def use_layout(self, settings: LayoutSettings, existing: Optional[MiCSLayout] = None) -> MiCSLayout:
        """Create the mesh and groups ``settings`` call for (a collective), or take ``existing`` (a model an
        earlier strategy sharded keeps that strategy's layout and groups)."""
        self.layout_or_none = existing or build_layout(settings, self.options.timeout_delta)
        return self.layout_or_none

    # ------------------------------------------------------------------ models and optimizers
    def shard(
        self, module: nn.Module, device: torch.device, precision: Any, root: Optional[nn.Module] = None
    ) -> tuple[list[FSDPModule], WrapPlan]:
        """Shard ``module`` (through ``root``, its FSDP root unit, when given) onto the layout in place,
        with ``precision``'s mixed-precision policy; return its units and the wrap plan. A collective."""
        o = self.options
        precision.device_type = device.type
        wrap_plan = plan_wrapping(module if root is None else root, o.auto_wrap_policy)
        units = shard_module(
            module,
            self.layout(),
            device,
            root=root,
            mp_policy=precision.mixed_precision_policy(),
            auto_wrap_policy=wrap_plan,
            activation_checkpointing=o.activation_checkpointing_policy,
            compile_blocks=o.compile_blocks,
            prefetch_depth=o.prefetch_depth,
            sync_module_states=o.sync_module_states,
        )
        return units, wrap_plan

    def attach_optimizers(
        self, optimizers: Sequence[Optimizer], modules: Union[nn.Module, Sequence[nn.Module]], loss_scaling: bool
    ) -> None:
        """The hooks around each optimizer's steps, from the layout's cross-replica schedule
        (:func:`lightning_mics.hop2.attach.attach`): hop 2 of ``modules`` (the models the optimizers step) run by
        the engine, their states sharded across replicas (AMSP ``optim > grads``) or DiLoCo's outer sync."""
        ft = self.options.fault_tolerance
        check_catch_up_heal(ft, loss_scaling=loss_scaling)
        layout = self.layout()
        check_exact_trajectory(ft, loss_scaling=loss_scaling, grad_accumulation=layout.settings.grad_accumulation)
        modules = [modules] if isinstance(modules, nn.Module) else list(modules)
        hooks = attach(
            optimizers,
            modules,
            layout,
            self._step_hooks,
            self.options,
            loss_scaling=loss_scaling,
            replica_group=self.replica_group,
            round_quorum=self._round_quorum,
        )
        self._step_hooks.update(hooks)

    def pipelines(self) -> list[CrossReplicaPipeline]:
        """The hop-2 pipelines of the models set up (schedules ``behind_backward``/``after_backward``), in the order
        their optimizers were attached."""
        return pipelines_in(hook_parts(self._step_hooks.values()))

    @property
    def semi_sync(self) -> SemiSync:
        """With ``cross_replica_sync="diloco"``: the run's DiLoCo state, an :class:`OuterSync
        <lightning_mics.hop2.diloco.OuterSync>` per optimizer (an empty one before the optimizers are attached)."""
        return self._diloco() or SemiSync()

    def _diloco(self) -> Optional[SemiSync]:
        return diloco.run_of(hook_parts(self._step_hooks.values()))

    def outer_round(self) -> Optional[tuple[int, bool]]:
        """With ``cross_replica_sync="diloco"``: (optimizer steps between two outer averages, whether the next
        step starts one); ``None`` with a hop 2 every step, or before the optimizers are attached."""
        run = self._diloco()
        return None if run is None else run.outer_round()

    def _share_gradients(self) -> Optional[ShareGradients]:
        """``exact_trajectory``: the data shares' gradients kept apart (the Trainer's one model's pipeline)."""
        return next((p.shares for p in self.pipelines() if p.shares is not None), None)

    def use_share(self, share: int) -> None:
        """``exact_trajectory``: the micro-step's backward accumulates into data share ``share``'s gradients."""
        shares = self._share_gradients()
        if shares is not None:
            shares.use(share)

    @contextmanager
    def training_other_share(self, share: int) -> Iterator[None]:
        """``exact_trajectory``: around the extra pass (forward and backward) of one more data share of this
        micro-step -- a lost group's: its gradients accumulate apart (:mod:`lightning_mics.hop2.shares`), and
        even on the boundary micro-step hop 2 does not start (it starts in the loop's own backward, last)."""
        shares = self._share_gradients()
        if shares is None:
            raise RuntimeError("training_other_share needs FaultTolerance(exact_trajectory=True) and an optimizer.")
        shares.use(share)
        with cross_replica_sync_off(shares.units):
            yield

    # ------------------------------------------------------------------ collectives and units, for the front ends
    @staticmethod
    def assign_world_ranks(strategy: Any) -> None:
        """Tell ``strategy``'s cluster environment the ranks and the world size
        (:mod:`lightning_mics.process_groups`)."""
        process_groups.assign_world_ranks(strategy)

    @staticmethod
    def barrier(device: torch.device) -> None:
        process_groups.barrier(device)

    @staticmethod
    def broadcast(obj: Any, src: int = 0) -> Any:
        return process_groups.broadcast_object(obj, src)

    @staticmethod
    def units_of(module: nn.Module) -> list[FSDPModule]:
        """The FSDP units inside ``module`` (itself included), in module order."""
        return fsdp_units(module)

    def accumulation_context(self, units: Sequence[FSDPModule]) -> AbstractContextManager[None]:
        """The backward of a non-boundary micro-step, as the layout's ``grad_accumulation`` says (hop 1 only, or
        full gradients kept); hop 2 waits for the boundary backward
        (:func:`lightning_mics.layout.accumulation_context`)."""
        return accumulation_context(units, self.layout())

    @staticmethod
    def outside_inference_mode() -> AbstractContextManager[None]:
        """Evaluation runs outside inference mode: FSDP2 keeps the all-gather buffers of its first unshard, and
        made under inference mode they break the next fit (:func:`lightning_mics.checkpoint.outside_inference_mode`)."""
        return ckpt.outside_inference_mode()

    # ------------------------------------------------------------------ fault tolerance (torchft)
    @property
    def keeps_trajectory(self) -> bool:
        """``FaultTolerance.keep_trajectory`` as this front end reads it: the Trainer's training data keeps the global
        sample order unless ``keep_trajectory=False``; Fabric's only with ``True`` (its loop, and so which loader
        trains, is the user's: ``MiCSFabricStrategy.training_batches``). ``False`` without fault tolerance."""
        ft = self.options.fault_tolerance
        if ft is None:
            return False
        return ft.trainer_keeps_trajectory if self.trainer_loop else ft.keep_trajectory is True

    def join_trainer_fault_domain(
        self,
        trainer: Any,
        module: nn.Module,
        optimizers: Sequence[Optimizer],
        schedulers: Sequence[Any],
        device: torch.device,
        precision: str,
        loss_scaling: bool,
    ) -> CommittedStepCounters:
        """:meth:`join_fault_domain` for a Trainer: serving and healing its model, optimizers, schedulers and step
        count; returns its step counters, kept to committed steps."""
        state_fn, load_fn, counters = trainer_state_hooks(trainer, module, optimizers, schedulers)
        run = run_configuration(precision, trainer.accumulate_grad_batches, module, optimizers, schedulers)
        run |= {"keep_trajectory": self.keeps_trajectory}
        self.join_fault_domain(device, state_fn, load_fn, run, loss_scaling=loss_scaling)
        return counters

    def join_fabric_fault_domain(
        self, module: nn.Module, optimizer: Optimizer, device: torch.device, precision: str, loss_scaling: bool
    ) -> None:
        """:meth:`join_fault_domain` for Fabric: serving and healing one model and its optimizer."""
        state_fn, load_fn = state_hooks(module, [optimizer])
        run = run_configuration(precision, 0, module, [optimizer]) | {"keep_trajectory": self.keeps_trajectory}
        self.join_fault_domain(device, state_fn, load_fn, run, loss_scaling=loss_scaling)

    def data_epochs(self, trainer: Any) -> Optional[DataEpochs]:
        """With fault tolerance keeping the trajectory: the Trainer's epochs kept to the data's (``None`` without a
        data cursor, or where ``limit_train_batches`` shortens the epoch)."""
        cursor = self.data_cursor
        return None if cursor is None else DataEpochs.of(trainer, cursor.order)

    def join_fault_domain(
        self,
        device: torch.device,
        state_fn: Callable[..., dict[str, Any]],
        load_fn: Callable[[dict[str, Any]], None],
        run: Mapping[str, Any],
        loss_scaling: bool = False,
    ) -> None:
        """With ``fault_tolerance``: this group's torchft Manager, serving ``state_fn()`` to groups that join
        (``state_fn(shards=False)``: all but the shards, :func:`~lightning_mics.fault_tolerance.training_state`)
        and healing through ``load_fn`` when this one joins (once; before the optimizers are attached).
        ``run``: what else every group must share besides the layout (precision, accumulation, model,
        optimizers), checked at every quorum; ``loss_scaling``: a loss scaler runs (``heal="auto"`` then blocks)."""
        ft = self.options.fault_tolerance
        self._logging_membership = None  # the front end's setup set the logging rank back to the global rank
        if ft is not None and (self.replica_group is None or self.replica_group.closed):
            quiet_torchft()  # before torchft's first import: its Rust side reads RUST_LOG once
            ft, heal_note = ft.resolved().with_heal_for(self.options.cross_replica_sync, loss_scaling)
            layout = {name: value for name, value in self.layout().settings._flat().items() if name != "rank"}
            configuration = GroupConfiguration.of(
                layout
                | dict(run)
                | {"num_replica_groups": ft.num_replica_groups, "heal": ft.heal}
                | {"exact_trajectory": ft.exact_trajectory}
            )
            def serve(shards: bool = True) -> dict[str, Any]:  # DiLoCo: the outer state travels with the rest
                run = self._diloco()
                return state_fn(shards=shards) | ({"diloco": run.heal_state()} if run is not None else {})

            def heal(state: dict[str, Any]) -> None:
                load_fn(state)
                if "diloco" in state:
                    self.semi_sync.load_heal_state(state["diloco"])

            self.replica_group = ReplicaGroup(
                ft, device, serve, heal, configuration, parameter_digest=self._parameter_digest
            )
            if dist.get_rank() == 0:  # in each group's job log
                log.info(
                    "fault tolerance: this job is replica group %d of %d (Lighthouse %s); hop 2 through torchft, "
                    "steps commit with at least %d group(s); a joining group heals with %s",
                    ft.replica_group,
                    ft.num_replica_groups,
                    ft.lighthouse,
                    ft.min_replica_groups,
                    heal_note,
                )
                log.info("fault tolerance: this group's configuration: %s", configuration)

    def _parameter_digest(self) -> list[int]:
        """This rank's parameter shards of every model hop 2 runs for -- with DiLoCo the last-synchronised copy,
        since the groups' parameters differ between rounds -- as digest chunks (fault tolerance compares them
        across groups every ``check_parameters_every`` committed steps, or rounds)."""
        run = self._diloco()
        if run is not None:
            return tensor_digest_chunks(run.anchor_tensors())
        return parameter_digest_chunks([pipeline.module for pipeline in self.pipelines()])

    def _round_quorum(self) -> None:
        """DiLoCo with fault tolerance: the quorum of an outer round, at its synchronisation (a joining group heals
        here), as :meth:`begin_step` runs it at every step otherwise."""
        assert self.replica_group is not None
        self.replica_group.start_step(force_quorum=True)
        self._log_from_first_live_group()

    def finish_catch_up_now(self) -> None:
        """Before an evaluation or the end of training: a group still catching up (``heal="catch_up"``) waits for
        its snapshot and replays the steps it missed now, so that what it evaluates or hands back is the live
        groups' model. A collective of the group."""
        if self.replica_group is not None:
            self.replica_group.finish_catch_up(wait=True)

    def data_share(self, world_size: int, rank: int, across_groups: bool = True) -> tuple[int, int]:
        """(number of data shares, this rank's): one per rank of the world -- and with ``fault_tolerance``
        and ``across_groups`` (training data), of every replica group's world, this group's shares at its
        index. Evaluation data is shared within the group only: every group evaluates the same model on the
        same data, so that metrics, and the decisions taken on them, agree across groups."""
        ft = self.options.fault_tolerance
        if ft is None or not across_groups:
            return world_size, rank
        ft = ft.resolved()
        assert ft.num_replica_groups is not None and ft.replica_group is not None
        return world_size * ft.num_replica_groups, ft.replica_group * world_size + rank

    def begin_step(self, counters: Optional[CommittedStepCounters] = None) -> bool:
        """Before the first micro-step of an optimizer step: the quorum (a joining group heals here), and the
        front end's step counters kept to committed steps. Whether this call opened the step."""
        if self.replica_group is not None and self._diloco() is not None:
            self.replica_group.keep_alive()  # the quorum runs once per outer round (:meth:`_round_quorum`)
            return False
        if self.replica_group is not None and not self._step_open:
            if counters is not None:
                counters.undo_if_discarded(self.replica_group)
            self.replica_group.finish_catch_up()
            self.replica_group.start_step()
            self._log_from_first_live_group()
            if counters is not None:
                counters.remember()
            self._step_open = True
            return True
        return False

    def discarded_step(self) -> bool:
        """After a synchronous step's commit: whether the groups discarded it (it must not count). A
        semi-synchronous run counts every inner step; its rounds commit or not on their own."""
        group = self.replica_group
        return group is not None and self._diloco() is None and group.last_step_discarded

    def training_data(
        self, loader: Any, world_size: int, rank: int, accumulate: int, first_step: int, keep_trajectory: bool
    ) -> Any:
        """The training DataLoader as the run reads it: with ``fault_tolerance`` and ``keep_trajectory`` (what the
        front end resolved ``FaultTolerance.keep_trajectory`` to), rebuilt on the global sample order that every
        committed step reads from, whichever groups are live (:mod:`~lightning_mics.fault_tolerance.trajectory`);
        else ``loader`` itself."""
        self._training_data = None
        ft = self.options.fault_tolerance
        if ft is None or not keep_trajectory:
            return loader
        ft = ft.resolved()
        assert ft.num_replica_groups is not None and ft.replica_group is not None
        order = sample_order_of(loader, ft.num_replica_groups, world_size, accumulate)
        cursor = DataCursor(order, ft.replica_group, rank, first_step, separate_shares=ft.exact_trajectory)
        self._training_data = TrajectoryDataLoader(loader, cursor)
        return self._training_data

    def micro_batch_to_load(self, step_opened: bool) -> Optional[Any]:
        """At each training micro-step, after :meth:`begin_step`: ``None`` when the loader delivered the samples
        this group must read in this step (the usual case), else those samples, loaded here -- the quorum
        changed, a step was discarded or this group healed since the loader predicted them."""
        data = self._training_data
        if data is None or self.replica_group is None:
            return None
        if step_opened:
            data.cursor.start_step(*self.replica_group.participation())
        delivered, needed = data.cursor.take()
        return None if delivered == needed else data.load(needed)

    @property
    def data_cursor(self) -> Optional[DataCursor]:
        """With ``fault_tolerance``: where the training data stands (``.current``: the micro-batch being trained
        on; ``.order.samples(key, rank)``: its sample indices); ``None`` without it."""
        return self._training_data.cursor if self._training_data is not None else None

    @property
    def gradient_weight(self) -> float:
        """What this group's loss is multiplied by before backward so that hop 2's average over the live groups
        is the mean over the global batch (1 unless the live groups read unequal numbers of shares)."""
        return self._training_data.cursor.weight if self._training_data is not None else 1.0

    def _log_from_first_live_group(self) -> None:
        """With fault tolerance one group logs for all: the first of the current quorum -- group 0 while it is
        live, else the next -- so that a lost group 0 does not silence the run's loggers and progress."""
        group = self.replica_group
        assert group is not None
        membership = (group, group.quorums_asked, group.not_contributing)
        if membership == self._logging_membership:  # no quorum since: the same group leads (~0.1 ms a step saved)
            return
        self._logging_membership = membership
        rank, world = dist.get_rank(), dist.get_world_size()
        process_groups.set_logging_rank(rank if group.leads else world + rank)

    def detach_optimizers(self) -> None:
        """Forget every optimizer's hooks (the Trainer creates its optimizers afresh at each fit); the pipelines
        let go of the models' gradients, and the next :meth:`attach_optimizers` makes new ones."""
        for pipeline in self.pipelines():
            pipeline.remove()
        self._step_hooks.clear()
        self._synced_before_step.clear()

    def step_hook(self, optimizer: Optimizer) -> Optional[StepHook]:
        return self._step_hooks.get(id(optimizer))

    def disjoint_groups(self, optimizer: Optional[Optimizer] = None) -> dict[Tensor, Sequence[dist.ProcessGroup]]:
        """For clipping: the groups over which the optimizer-state slices' gradients are disjoint (AMSP
        ``optim > grads``), of ``optimizer`` or of every optimizer; empty in every other layout."""
        hooks = self._step_hooks.values() if optimizer is None else [self._step_hooks.get(id(optimizer))]
        return optimizer_states.disjoint_groups(hooks)

    def sync_before_step(self, optimizer: Optimizer) -> None:
        """Once per step, before clipping and the step: the boundary gradients cross replicas in this
        engine's hook (compressed hop 2, or the reduction into this rank's optimizer-state slices)."""
        hook = self.step_hook(optimizer)
        if hook is not None and id(optimizer) not in self._synced_before_step:
            hook.before_step()
            self._synced_before_step.add(id(optimizer))

    def closure_then_sync(self, optimizer: Optimizer, closure: Callable[[], Any]) -> Callable[[], Any]:
        """``closure`` (it runs the boundary backward inside ``optimizer.step``), followed by
        :meth:`sync_before_step`: the gradients cross replicas before the update reads them."""

        def closure_then_sync_across_replicas() -> Any:
            result = closure()
            self.sync_before_step(optimizer)
            return result

        return closure_then_sync_across_replicas

    def finish_step(self, optimizer: Optimizer) -> None:
        """After the step: AMSP gathers the updated slices into the parameters."""
        self._synced_before_step.discard(id(optimizer))
        self._step_open = False
        hook = self.step_hook(optimizer)
        if hook is not None:
            hook.after_step()
        if self.replica_group is not None:
            self.replica_group.keep_for_catch_up(optimizer)

    def clip_gradients(
        self, params: Any, optimizer: Optimizer, max_norm: float, norm_type: float, error_if_nonfinite: bool
    ) -> Tensor:
        """Clip by the true global norm of the sharded gradients, after they crossed replicas."""
        self.sync_before_step(optimizer)
        return clip_grad_norm_(
            params, max_norm, norm_type, error_if_nonfinite, disjoint_groups=self.disjoint_groups(optimizer)
        )

    # ------------------------------------------------------------------ buffers and checkpoints
    def sync_buffers(self, module: nn.Module, device: torch.device) -> None:
        """Make every rank's persistent buffers of ``module`` equal now, as ``buffer_sync`` says. A collective."""
        sync_buffers(module, self.options.buffer_sync, device=device)

    def model_state(self, module: nn.Module, device: torch.device) -> dict[str, Any]:
        """``module``'s state for a checkpoint, buffers synced first (one model, not a per-tensor mix of ranks)."""
        self.sync_buffers(module, device)
        state = ckpt.model_state_dict(module, full=self.options.save_full_state_dict)
        run = self._diloco()
        return run.global_model_state(module, state) if run is not None else state

    def optimizer_states(self, module: nn.Module, optimizers: Sequence[Optimizer]) -> list[dict[str, Any]]:
        """The optimizers' states at the partition degree (one checkpoint format for every layout)."""
        with optimizer_states.in_partition_form(self._step_hooks, optimizers, write_back=False):
            full = self.options.save_full_state_dict
            states = [ckpt.optimizer_state_dict(module, optimizer, full=full) for optimizer in optimizers]
        run = self._diloco()
        return run.replica_averaged(states) if run is not None else states

    def save(self, path: Any, checkpoint: dict[str, Any]) -> None:
        """Write ``checkpoint`` (with states from :meth:`model_state` / :meth:`optimizer_states`). A collective.
        With ``fault_tolerance`` one replica group writes (see :attr:`ReplicaGroup.writes_checkpoints`) and the
        checkpoint keeps torchft's step."""
        if self.replica_group is not None:
            if not self.replica_group.writes_checkpoints:
                return
            checkpoint[FAULT_TOLERANCE_KEY] = self.replica_group.state_dict()
        run = self._diloco()
        if run is not None:  # DiLoCo's outer state and each replica group's own states, with the shards
            checkpoint[SHARDED_EXTRAS_KEY] = diloco_checkpoint.checkpoint_entries(run)
        started = time.perf_counter()
        layout = self.layout().checkpoint_layout
        ckpt.save(
            path,
            checkpoint,
            layout,
            full=self.options.save_full_state_dict,
            saver=self.async_saver,
            keep_previous=self.replica_group is not None,  # a restarted group may be loading it right now
        )
        self.checkpoint_stall_s.append(time.perf_counter() - started)

    def load(
        self, path: str, module: nn.Module, optimizers: Sequence[Optimizer], strict: bool, **kwargs: Any
    ) -> dict[str, Any]:
        """Load a checkpoint of any layout into ``module`` and ``optimizers`` in place (after any save in
        flight: it may be this one); return its other entries. A collective."""
        if self.async_saver is not None:
            self.async_saver.wait()
        with optimizer_states.in_partition_form(self._step_hooks, optimizers, write_back=True):
            state = ckpt.load(
                path, module, optimizers, strict, restore_rng=True, verify=self.options.checkpoint_verify, **kwargs
            )
        run = self._diloco()
        if optimizers and run is not None:
            diloco_checkpoint.after_load(run, path)
        fault_tolerance = state.pop(FAULT_TOLERANCE_KEY, None)
        if fault_tolerance is not None and self.replica_group is not None:
            self.replica_group.load_state_dict(fault_tolerance)
        return state

    def remove(self, path: Any) -> None:
        if self.replica_group is not None and not self.replica_group.writes_checkpoints:
            return  # this group wrote nothing
        saver = self.async_saver
        if saver is not None and saver.in_flight is not None and str(saver.in_flight) == os.path.abspath(path):
            saver.wait()  # never delete a checkpoint while it is being written
        ckpt.remove(path)

    def freeze_startup_objects(self) -> None:
        """``gc_freeze``: when training starts, collect the garbage and freeze the rest, so that Python's full
        collections -- a pause of a few tenths of a second on one rank, which every rank of a synchronous job then
        waits for -- no longer walk the startup objects. The first time in a process the collection is a full one
        (itself such a pause, 0.2 s, once): it also sets the collector's count of long-lived objects to all of
        them, so that later full collections come seldom (in rejoin runs, survivors' stall 0.53-0.84 steps with
        it, 0.63-1.06 with the young generations only). Later ``fit``s of the process collect the young
        generations only. Not when the process runs its own policy (collector disabled, objects frozen already);
        once per engine."""
        global _COLLECTED_FULLY
        if not self.options.gc_freeze or self._froze_gc or not gc.isenabled() or gc.get_freeze_count() > 0:
            return
        gc.collect(2 if not _COLLECTED_FULLY else 1)
        _COLLECTED_FULLY = True
        gc.freeze()
        self._froze_gc = True

    def teardown(self) -> None:
        """The run ends only once its last checkpoint is committed (a failed background save raises here)."""
        if self._froze_gc:  # what was frozen is collectable again once the run is over
            gc.unfreeze()
            self._froze_gc = False
        for pipeline in self.pipelines():  # the model may go on under another strategy
            pipeline.remove()
        pipelines = (CrossReplicaPipeline, EachModel)
        self._step_hooks = {
            key: hook.without_inner() if isinstance(hook, InnerThenOuter) else hook
            for key, hook in self._step_hooks.items() if not isinstance(hook, pipelines)
        }
        try:
            if self.async_saver is not None:
                self.async_saver.close()
        finally:
            if self.replica_group is not None:
                self.replica_group.shutdown()


# ---------------------------------------------------------------------------------------------
# A model sharded by one Trainer, used by the next
# ---------------------------------------------------------------------------------------------

_REUSE_FIXES = (
    "save a checkpoint with the earlier trainer (`trainer.save_checkpoint(path)`) and load it into a freshly "
    "created model with this one (`trainer.fit/validate/test/predict(new_model, ckpt_path=path)`)"
)


@dataclass(frozen=True)
class ShardedModel:
    """What a Trainer's ``MiCSStrategy`` leaves behind about a module it sharded, so that a later strategy --
    a new Trainer given the same model, as ``pl.Trainer(...).test(model)`` after a fit -- uses the model as it
    is instead of refusing it (sharding twice is impossible) or re-sharding it.

    Kept in :data:`SHARDED_MODELS`, keyed weakly by the module. Nothing here may hold the module strongly --
    the record would then keep its own key, and the model, alive for the rest of the process -- so the root
    unit (which holds the module) is referenced weakly: it lives while a strategy holds it or, once the model
    has run a forward, through FSDP's own state. The layout holds only meshes and process groups."""

    root: weakref.ReferenceType[nn.Module]
    layout: MiCSLayout
    precision: str
    #: whether ``Trainer(sync_batchnorm=True)`` converted BatchNorm layers before sharding
    sync_batchnorm: bool
    #: the default process group the layout's groups were created under (gone after a re-initialisation)
    world: Any

    def check_reusable(self, settings: LayoutSettings, precision: str, sync_batchnorm: bool) -> None:
        """Refuse, with what to do instead, when the model cannot be used as it is by a strategy with these
        settings: its groups are gone, its root unit is gone, or the layout differs."""
        if not dist.is_initialized() or dist.group.WORLD is not self.world:
            raise RuntimeError(
                "This model was sharded by an earlier MiCSStrategy on process groups that no longer exist "
                "(torch.distributed was shut down or re-initialised since), so it cannot be used again; "
                + _REUSE_FIXES
                + "."
            )
        if self.root() is None:
            raise RuntimeError(
                "This model was sharded by an earlier MiCSStrategy that is gone, and it never ran a step, so "
                "its root unit went with it; " + _REUSE_FIXES + ", or set the model up with one trainer."
            )
        diffs = self.layout.settings.differences(settings)
        if precision != self.precision:
            diffs.append(f"precision: {self.precision!r} vs {precision!r}")
        if sync_batchnorm and not self.sync_batchnorm:
            diffs.append("sync_batchnorm: False vs True")
        if diffs:
            raise ValueError(
                "This model was sharded by an earlier MiCSStrategy (another Trainer) with a different layout ("
                + "; ".join(diffs)
                + ", earlier vs this strategy), and a sharded model keeps its layout. Either create this "
                "Trainer's MiCSStrategy with the same options as the earlier one, or " + _REUSE_FIXES + "."
            )


#: Models that a Trainer's MiCSStrategy sharded, and how (see :class:`ShardedModel`).
SHARDED_MODELS: weakref.WeakKeyDictionary[nn.Module, ShardedModel] = weakref.WeakKeyDictionary()


def sharded_before(
    module: nn.Module, settings: LayoutSettings, precision: str, sync_batchnorm: bool
) -> Optional[ShardedModel]:
    """The record of an earlier strategy that sharded ``module`` the way ``settings`` would (it is then
    used as it is), ``None`` for a model none sharded; refused when it cannot be reused."""
    earlier = SHARDED_MODELS.get(module)
    if earlier is not None:
        earlier.check_reusable(settings, precision, sync_batchnorm)
    return earlier


#: The engine module is the front ends' one door to the library: besides the engine, what they name of the layout,
#: precision, wrapping, fault tolerance and Fabric's checkpoint entries is taken from here.
__all__ = [
    "SHARDED_MODELS",
    "CommittedStepCounters",
    "DataCursor",
    "DataEpochs",
    "MiCSEngine",
    "MiCSFabricPrecision",
    "MiCSLayout",
    "MiCSPrecision",
    "MiCSTopology",
    "RootUnit",
    "ShardRegistry",
    "ShardedModel",
    "WireFormat",
    "WrapPlan",
    "fabric_entries",
    "precision_property",
    "sharded_before",
]
