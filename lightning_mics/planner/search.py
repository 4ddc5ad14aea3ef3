"""Searching the layouts: rank every valid (P, G, OS) of a job -- optionally in both gradient
accumulation modes -- and the entry points that pick a partition size and accumulation mode
(``MiCSStrategy(partition_size="auto", grad_accumulation="auto")``)."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Literal, Optional, Union

from lightning_mics.accumulation import GRAD_ACCUMULATION_MODES, GradAccumulation, check_grad_accumulation
from lightning_mics.planner.cost_model import LayoutEstimate, diloco_worker_size, estimate
from lightning_mics.planner.report import BUSY_ENOUGH, Plan, SemiSyncAdvice, gib_text, leanest
from lightning_mics.planner.specs import ClusterSpec, ModelSpec, TrainingSpec
from lightning_mics.planner.ties import MEMORY_TIE_TOLERANCE, TIE_TOLERANCE, near_ties, tie_break_winner
from lightning_mics.sharding_spec import ShardingDegrees, ShardingSpec, all_sharding_degrees
from lightning_mics.wire import WIRE_FORMATS


def plan(
    cluster: ClusterSpec,
    model: ModelSpec,
    training: TrainingSpec = TrainingSpec(),
    uniform_only: bool = False,
    hierarchical: Union[bool, Literal["auto"]] = "auto",
    tie_tolerance: float = TIE_TOLERANCE,
    grad_accumulation: Union[GradAccumulation, Literal["auto"]] = "sharded",
    partition_size: Optional[int] = None,
    cross_replica_bytes: Optional[float] = None,
    memory_tie_tolerance: float = MEMORY_TIE_TOLERANCE,
    cross_replica_dtype: Optional[str] = None,
) -> Plan:
    """Estimate every valid layout (only ``P = G = OS`` with ``uniform_only``; only partition size
    ``partition_size`` when given) and rank them.

    ``grad_accumulation="auto"`` estimates every sharded layout in both accumulation modes (they
    differ only with ``accumulation > 1``), so the ranking trades the memory of full gradients
    against the per-micro-step reduce-scatters. ``cross_replica_dtype``: the strategy's option of that
    name (``"bf16"``, ``"fp16"``, ``"int8"``), which sets ``cross_replica_bytes`` when that is not given and
    appears in the plan's :meth:`~Plan.strategy_line`.

    Layouts that fit come first, fastest first -- except that the winner is chosen among all
    fitting layouts within ``tie_tolerance`` of the fastest predicted time (:mod:`.ties`): the model
    cannot tell those apart, so among them the layouts sending the fewest bytes across nodes (within
    1 %) are preferred -- the least exposed to a wrong network estimate -- and among those MiCS's rule
    decides: a gradient partition inside one node beats one spanning nodes, then optimizer states
    sharded like the gradients (OS = G) beat a wider optimizer group; then the least memory per GPU
    wins, unless the memory too is within ``memory_tie_tolerance`` of the usable device memory, when
    the fastest wins.
    A partition inside a node keeps its collectives on the fast links and needs no two-stage
    collectives, whose extra copies the model prices only in part (measured on the emulated
    cluster: P=1 G=8 hierarchical took 3.00 s, predicted within 2 % of P=1 G=4, which took 2.67 s).
    A wider optimizer group trades a smaller optimizer step for a reduce-scatter across it before
    the step and an all-gather of the updated parameters after it, outside the backward that hides
    an all-reduce's share (measured: P=1 G=4 OS=8 took 2.08 s at bandwidth ratio 24 and 2.83 s at
    15, predicted within 2 % of P=1 G=4 OS=4, which took 1.67 s and 2.67 s).
    """
    if not 0.0 <= tie_tolerance < 1.0:
        raise ValueError(f"tie_tolerance is a fraction of the step time in [0, 1), got {tie_tolerance!r}.")
    if not 0.0 <= memory_tie_tolerance < 1.0:
        raise ValueError(
            f"memory_tie_tolerance is a fraction of the usable device memory in [0, 1), got {memory_tie_tolerance!r}."
        )
    if cross_replica_dtype is not None:
        if cross_replica_dtype not in WIRE_FORMATS:
            raise ValueError(
                f"cross_replica_dtype={cross_replica_dtype!r} is not one of {sorted(WIRE_FORMATS)} (None: fp32)."
            )
        if cross_replica_bytes is None:
            cross_replica_bytes = WIRE_FORMATS[cross_replica_dtype].element_bytes
    check_grad_accumulation(grad_accumulation, allow_auto=True)
    layouts = _candidate_layouts(cluster, uniform_only, partition_size)
    # optimizer states sharded across replicas are refused with offload, and with DiLoCo (each replica group
    # steps its own inner optimizer)
    if training.cpu_offload or training.sync_every is not None:
        layouts = [layout for layout in layouts if layout.optim == layout.grads]
        if not layouts:
            raise ValueError(
                f"no layout of partition size {partition_size} keeps optimizer states sharded like the gradients, "
                "which cpu_offload and sync_every need."
            )
    if training.diloco_worker_size != 1:  # two-level DiLoCo: only layouts whose partitions tile the workers
        layouts = [layout for layout in layouts if _tiles_workers(layout, cluster, training)]
        if not layouts:
            raise ValueError(
                f"no layout's partition groups tile DiLoCo workers of diloco_worker_size="
                f"{training.diloco_worker_size!r} on {cluster.nodes} nodes of {cluster.gpus_per_node} GPUs"
                + (f" in regions of {cluster.nodes_per_region} nodes" if cluster.nodes_per_region else "")
                + "."
            )
    modes: tuple[GradAccumulation, ...] = (
        GRAD_ACCUMULATION_MODES if grad_accumulation == "auto" else (grad_accumulation,)  # type: ignore[assignment]
    )
    estimates = [
        estimate(layout, cluster, model, training, hierarchical, mode, cross_replica_bytes)
        for layout in layouts
        for mode in modes
        # the modes differ only when a sharded gradient is accumulated over several micro-steps
        if mode == modes[0] or (layout.grads > 1 and training.accumulation > 1)
    ]
    ranked = tuple(_ranked(estimates, tie_tolerance, memory_tie_tolerance))
    advice = None
    if training.sync_every is None and ranked[0].fits and ranked[0].busy_fraction < BUSY_ENOUGH:
        advice = _semi_sync_advice(
            ranked[0], cluster, model, training, uniform_only, hierarchical, grad_accumulation, partition_size,
            cross_replica_bytes,
        )
    return Plan(
        cluster,
        model,
        training,
        ranked,
        advice,
        tie_tolerance=tie_tolerance,
        memory_tie_tolerance=memory_tie_tolerance,
        hierarchical=hierarchical,
        cross_replica_dtype=cross_replica_dtype,
        grad_accumulation=grad_accumulation,
    )


#: DiLoCo's H values :func:`_semi_sync_advice` tries, smallest (closest to synchronous training) first; the
#: DiLoCo paper ran H = 500.
ADVISED_SYNC_EVERY: tuple[int, ...] = (4, 8, 16, 32, 64, 128, 256, 512)


def _semi_sync_advice(
    synchronous: LayoutEstimate,
    cluster: ClusterSpec,
    model: ModelSpec,
    training: TrainingSpec,
    uniform_only: bool,
    hierarchical: Union[bool, Literal["auto"]],
    grad_accumulation: Union[GradAccumulation, Literal["auto"]],
    partition_size: Optional[int],
    cross_replica_bytes: Optional[float],
) -> Optional[SemiSyncAdvice]:
    """The semi-synchronous layout with the smallest H that keeps the GPUs busy (:data:`BUSY_ENOUGH`), when the
    best synchronous one does not; ``None`` when no H does (then intra-partition traffic or memory, not the link
    across replicas, holds the step back) or no layout has replicas to synchronise."""
    # two-level first (synchronous inside each region, DiLoCo across regions: the fewest workers drift), then flat
    workers: tuple[Union[int, Literal["region"]], ...] = ("region", 1) if cluster.regions > 1 else (1,)
    region = cluster.ranks_per_region if cluster.regions > 1 else None
    for worker in workers:
        for every in ADVISED_SYNC_EVERY:
            try:
                semi = plan(
                    cluster, model, replace(training, sync_every=every, diloco_worker_size=worker), uniform_only,
                    hierarchical, grad_accumulation=grad_accumulation, partition_size=partition_size,
                    cross_replica_bytes=cross_replica_bytes,
                ).winner
            except ValueError:  # no layout keeps optimizer states sharded like the gradients or tiles the workers
                break
            if semi.layout.grads == semi.layout.world_size:
                return None  # one replica: there is nothing to synchronise, semi-synchronous or not
            if semi.fits and semi.busy_fraction >= BUSY_ENOUGH and semi.step_time_s < synchronous.step_time_s:
                return SemiSyncAdvice(synchronous, semi, region)
    return None


def _tiles_workers(layout: ShardingDegrees, cluster: ClusterSpec, training: TrainingSpec) -> bool:
    try:
        diloco_worker_size(layout, cluster, training)
    except ValueError:
        return False
    return True


def _candidate_layouts(
    cluster: ClusterSpec, uniform_only: bool, partition_size: Optional[int]
) -> list[ShardingDegrees]:
    """The valid layouts of the cluster (only ``P = G = OS`` with ``uniform_only``), only those of
    partition size ``partition_size`` when given -- which must be one of them."""
    layouts = all_sharding_degrees(cluster.world_size, cluster.gpus_per_node, uniform_only=uniform_only)
    if partition_size is not None:
        layouts = [layout for layout in layouts if layout.partition_size == partition_size]
        if not layouts:
            raise ValueError(
                f"partition_size={partition_size} is not a valid layout for {cluster.world_size} ranks of "
                f"{cluster.gpus_per_node} per node."
            )
    return layouts


def _ranked(estimates: list[LayoutEstimate], tie_tolerance: float, memory_tie_tolerance: float) -> list[LayoutEstimate]:
    """``estimates`` in :func:`plan`'s order (sorted in place): fitting first, then by step time and
    memory, with the winner among the near-ties (:func:`~.ties.tie_break_winner`) moved to the front."""
    estimates.sort(key=lambda c: (not c.fits, c.step_time_s, c.memory.total))
    if estimates[0].fits:
        winner = tie_break_winner(near_ties(estimates, tie_tolerance), memory_tie_tolerance)
        estimates.remove(winner)
        estimates.insert(0, winner)
    return estimates


@dataclass(frozen=True)
class LayoutChoice:
    """What ``MiCSStrategy(partition_size="auto")`` / ``grad_accumulation="auto"`` settle on, and why."""

    partition_size: int
    grad_accumulation: GradAccumulation
    estimate: LayoutEstimate  #: its ``layout`` holds the chosen (P, G, OS)
    #: one line for the layout log: the choice against its closest alternative
    reason: str


def _accumulation_reason(result: Plan, winner: LayoutEstimate, requested: str) -> str:
    """Why the winner's accumulation mode beats the other mode of the same layout."""
    if requested != "auto":
        return f"grad_accumulation={winner.grad_accumulation} as configured"
    other_mode = "unsharded" if winner.grad_accumulation == "sharded" else "sharded"
    other = next(
        (
            c
            for c in result.ranked
            if c.layout == winner.layout and c.grad_accumulation == other_mode
        ),
        None,
    )
    if other is None:
        return f"grad_accumulation={winner.grad_accumulation} (the modes coincide for this layout and accumulation)"
    if not other.fits:
        return (
            f"grad_accumulation={winner.grad_accumulation}: {other_mode} would need {gib_text(other.memory.total)}, "
            f"more than the {gib_text(other.usable_memory_bytes)} usable per device"
        )
    return (
        f"grad_accumulation={winner.grad_accumulation}: predicted {winner.step_time_s:.3g} s per optimizer step vs "
        f"{other.step_time_s:.3g} s {other_mode} ({gib_text(winner.memory.total)} vs {gib_text(other.memory.total)} "
        "per device)"
    )


def choose_layout(
    world_size: int,
    ranks_per_node: int,
    param_count: int,
    device_memory_bytes: float,
    cluster: Optional[ClusterSpec] = None,
    model: Optional[ModelSpec] = None,
    training: Optional[TrainingSpec] = None,
    partition_size: Optional[int] = None,
    grad_accumulation: Union[GradAccumulation, Literal["auto"]] = "sharded",
    uniform_only: bool = True,
    cross_replica_bytes: Optional[float] = None,
) -> LayoutChoice:
    """The MiCS layout (``P = G = OS``, or any AMSP (P, G, OS) with ``uniform_only=False``; partition
    size ``partition_size`` when fixed) and accumulation mode (one mode, or ``"auto"``: both) the
    planner predicts fastest among those that fit.

    Without a ``cluster`` it assumes :meth:`ClusterSpec.generic` bandwidths (or pass one from
    :func:`calibrate_cluster`); without a ``model`` it guesses a GPT shape from ``param_count``
    (:meth:`ModelSpec.from_param_count`).

    Raises:
        ValueError: when nothing fits, naming the memory needed and the ways out.
    """
    if world_size % ranks_per_node:
        raise ValueError(f"ranks_per_node={ranks_per_node} must divide world_size={world_size}.")
    result = plan(
        _job_cluster(world_size, ranks_per_node, device_memory_bytes, cluster),
        _job_model(param_count, model),
        training or TrainingSpec(),
        uniform_only=uniform_only,
        grad_accumulation=grad_accumulation,
        partition_size=partition_size,
        cross_replica_bytes=cross_replica_bytes,
    )
    if not result.any_fits:
        raise _nothing_fits(result, world_size, param_count, device_memory_bytes, partition_size)
    winner = result.winner
    return LayoutChoice(
        partition_size=winner.layout.partition_size,
        grad_accumulation=winner.grad_accumulation,
        estimate=winner,
        reason=_accumulation_reason(result, winner, grad_accumulation),
    )


def _job_cluster(
    world_size: int, ranks_per_node: int, device_memory_bytes: float, cluster: Optional[ClusterSpec]
) -> ClusterSpec:
    """``cluster``'s links and rates (:meth:`ClusterSpec.generic` without one) in the job's shape:
    its nodes, ranks per node and device memory."""
    if cluster is None:
        return ClusterSpec.generic(world_size // ranks_per_node, ranks_per_node, device_memory_bytes)
    return replace(
        cluster,
        nodes=world_size // ranks_per_node,
        gpus_per_node=ranks_per_node,
        gpu_memory_bytes=device_memory_bytes,
    )


def _job_model(param_count: int, model: Optional[ModelSpec]) -> ModelSpec:
    """``model`` (a GPT shape guessed from ``param_count`` without one) with ``param_count`` parameters."""
    model = model or ModelSpec.from_param_count(param_count)
    if model.params != param_count:
        model = replace(model, params=int(param_count))
    return model


def _nothing_fits(
    result: Plan, world_size: int, param_count: int, device_memory_bytes: float, partition_size: Optional[int]
) -> ValueError:
    """The error when no candidate fits: the memory the leanest one needs, and the ways out."""
    lean = leanest(result.ranked)
    what = "partition size" if partition_size is None else f"accumulation mode of partition_size={partition_size}"
    return ValueError(
        f"partition_size='auto': no {what} fits a {param_count:,}-parameter model in "
        f"{gib_text(device_memory_bytes)} per device on {world_size} ranks; even {lean.layout.label} needs "
        f"~{gib_text(lean.memory.total)}. Use more devices, a smaller micro-batch, activation checkpointing or "
        f"bf16-true{'' if result.training.cpu_offload else ', cpu_offload=True on GPUs'}, or pass partition_size "
        "explicitly."
    )


def choose_partition_size(
    world_size: int,
    ranks_per_node: int,
    param_count: int,
    device_memory_bytes: float,
    cluster: Optional[ClusterSpec] = None,
    model: Optional[ModelSpec] = None,
    training: Optional[TrainingSpec] = None,
) -> int:
    """The MiCS partition size (``P = G = OS``, sharded accumulation) the planner predicts fastest
    among those that fit: :func:`choose_layout` with the accumulation mode fixed to MiCS's default.

    Raises:
        ValueError: when no partition size fits, naming the memory needed and the ways out.
    """
    return choose_layout(
        world_size, ranks_per_node, param_count, device_memory_bytes, cluster, model, training
    ).partition_size


def mics_speedup_over_zero3(
    cluster: ClusterSpec, model: ModelSpec, training: TrainingSpec, partition_size: Optional[int] = None
) -> float:
    """Predicted throughput of MiCS (``partition_size``, default one node, hierarchical where it
    spans nodes) over ZeRO-3 with flat rings across the world (DeepSpeed's ZeRO-3, MiCS's baseline)."""
    partition = partition_size or cluster.gpus_per_node
    mics = estimate(ShardingSpec.uniform(partition), cluster, model, training, hierarchical="auto")
    zero3 = estimate(ShardingSpec.uniform("world"), cluster, model, training, hierarchical=False)
    return zero3.step_time_s / mics.step_time_s


def device_memory_bytes(device: Any, ranks_per_node: int) -> float:
    """Memory one rank may use: the GPU's total memory, or on CPU the host's memory shared by the
    node's ranks."""
    import os

    if getattr(device, "type", device) == "cuda":
        import torch

        return float(torch.cuda.get_device_properties(device).total_memory)
    return float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")) / ranks_per_node


def plan_layout_for(
    module: Any,
    world_size: int,
    ranks_per_node: int,
    device: Any,
    precision: str = "bf16-mixed",
    accumulation: int = 1,
    partition_size: Optional[int] = None,
    grad_accumulation: Union[GradAccumulation, Literal["auto"]] = "sharded",
    uniform_only: bool = True,
    cross_replica_bytes: Optional[float] = None,
    cluster: Optional[ClusterSpec] = None,
    cpu_offload: bool = False,
    cross_replica_overlap: bool = True,
    sync_every: Optional[int] = None,
    streaming: tuple[int, int] = (1, 0),
) -> LayoutChoice:
    """:func:`choose_layout` for a live module on this device: what ``MiCSStrategy(partition_size=
    "auto")``, ``sharding="auto"`` (``uniform_only=False``) and ``grad_accumulation="auto"`` call
    once the processes exist. ``cluster``: the links and rates to plan for (the strategy's
    ``planner_cluster``, :mod:`lightning_mics.planner.live`); ``None``: :meth:`ClusterSpec.generic`.
    ``cpu_offload``: the strategy's ``cpu_offload`` (the states count against host memory, not the device).
    ``cross_replica_overlap``: the strategy's (hop 2 hidden behind the boundary backward). ``sync_every``: the
    strategy's DiLoCo H (``cross_replica_sync="diloco"``), ``None`` when synchronous; ``streaming``: its
    ``(num_fragments, fragment_sync_delay)``.

    Raises:
        ValueError: when the module has no parameters yet (built later, in ``configure_model``).
    """
    param_count = sum(p.numel() for p in module.parameters())
    if param_count == 0:
        raise ValueError(
            "partition_size='auto' / grad_accumulation='auto' need the model's parameters before the processes are "
            "set up, but the LightningModule has none yet (built in configure_model?). Create the model in __init__ "
            "(inside `trainer.init_module(empty_init=True)` for big models) or pass partition_size and "
            "grad_accumulation explicitly."
        )
    return choose_layout(
        world_size,
        ranks_per_node,
        param_count,
        device_memory_bytes(device, ranks_per_node),
        cluster=cluster,
        training=TrainingSpec(
            accumulation=accumulation,
            precision=precision,
            cpu_offload=cpu_offload,
            cross_replica_overlap=cross_replica_overlap,
            sync_every=sync_every,
            num_fragments=streaming[0],
            fragment_sync_delay=streaming[1],
        ),
        partition_size=partition_size,
        grad_accumulation=grad_accumulation,
        uniform_only=uniform_only,
        cross_replica_bytes=cross_replica_bytes,
    )


def plan_partition_size_for(
    module: Any,
    world_size: int,
    ranks_per_node: int,
    device: Any,
    precision: str = "bf16-mixed",
    accumulation: int = 1,
) -> int:
    """The partition size of :func:`plan_layout_for` with MiCS's default (sharded) accumulation."""
    return plan_layout_for(module, world_size, ranks_per_node, device, precision, accumulation).partition_size
