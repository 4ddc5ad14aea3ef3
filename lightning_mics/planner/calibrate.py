"""Calibration: time real collectives on an initialised process group and fit the alpha-beta
parameters the cost model uses (``lightning-mics plan calibrate`` under torchrun)."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, replace
from typing import Any, Literal, Optional

from lightning_mics.planner.cost_model import RING_PASSES, CollectiveKind
from lightning_mics.planner.specs import ClusterSpec

# ---------------------------------------------------------------------------------------------- calibration


@dataclass(frozen=True)
class ProbeTiming:
    """Median seconds of one collective at one payload size."""

    scope: Literal["intra_node", "inter_node"]
    kind: CollectiveKind
    group_size: int
    payload_bytes: int
    seconds: float


@dataclass(frozen=True)
class Calibration:
    """Fitted link parameters. ``None`` where the cluster has no such link (one node / one GPU per node)."""

    intra_node_bandwidth: Optional[float]
    intra_node_latency: Optional[float]
    inter_node_bandwidth: Optional[float]
    inter_node_latency: Optional[float]
    probes: tuple[ProbeTiming, ...] = field(default=())

    def apply(self, cluster: ClusterSpec) -> ClusterSpec:
        """``cluster`` with the measured values replacing the assumed ones."""
        updates = {name: value for name, value in self.link_values().items() if value is not None}
        return replace(cluster, **updates)

    def link_values(self) -> dict[str, Optional[float]]:
        return {
            "intra_node_bandwidth": self.intra_node_bandwidth,
            "intra_node_latency": self.intra_node_latency,
            "inter_node_bandwidth": self.inter_node_bandwidth,
            "inter_node_latency": self.inter_node_latency,
        }

    def to_dict(self) -> dict[str, Any]:
        return {**self.link_values(), "probes": [asdict(p) for p in self.probes]}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Calibration:
        probes = tuple(ProbeTiming(**p) for p in data.get("probes", ()))
        return cls(
            data.get("intra_node_bandwidth"),
            data.get("intra_node_latency"),
            data.get("inter_node_bandwidth"),
            data.get("inter_node_latency"),
            probes,
        )


def fit_alpha_beta(
    timings: Sequence[ProbeTiming], ring_edges_per_node: float = 1.0
) -> tuple[Optional[float], Optional[float]]:
    """Fit ``T = passes * ((n-1) alpha + (n-1)/n * M * c / B)`` to probes by least squares.

    Each probe gives one linear equation in ``alpha`` and ``1/B``; ``c`` is ``ring_edges_per_node``
    (how many concurrent groups share the link: 1 inside a node, ranks per node across nodes,
    so that ``B`` comes out as the node's total network bandwidth). Negative fits (noise on tiny
    probes) are clamped: latency to 0, bandwidth to ``None``.
    """
    rows = [
        (
            RING_PASSES[t.kind] * (t.group_size - 1),
            RING_PASSES[t.kind] * (t.group_size - 1) / t.group_size * t.payload_bytes * ring_edges_per_node,
            t.seconds,
        )
        for t in timings
        if t.group_size > 1
    ]
    if len(rows) < 2:
        return None, None
    # normal equations of the 2-parameter least squares  seconds = x * alpha + y * inv_bandwidth
    sxx = sum(x * x for x, _, _ in rows)
    syy = sum(y * y for _, y, _ in rows)
    sxy = sum(x * y for x, y, _ in rows)
    sxt = sum(x * t for x, _, t in rows)
    syt = sum(y * t for _, y, t in rows)
    det = sxx * syy - sxy * sxy
    if det <= 0:
        return None, None
    alpha = (sxt * syy - syt * sxy) / det
    inv_bandwidth = (sxx * syt - sxy * sxt) / det
    if inv_bandwidth <= 0:
        return max(alpha, 0.0), None
    if alpha < 0:  # refit bandwidth alone through the origin
        inv_bandwidth = syt / syy
        alpha = 0.0
    return alpha, 1.0 / inv_bandwidth


def slowest_rank_seconds(run: Callable[[], Any], device: Any, repeats: int, budget_s: Optional[float] = None) -> float:
    """Median over ``repeats`` runs (after one warm-up: connection setup, buffers) of the slowest
    rank's seconds for ``run``, every rank starting together. A collective -- and any work every
    rank does at once -- lasts as long as its slowest rank; every rank gets the same number.
    ``budget_s``: stop repeating once the runs timed so far took that long (at least one run): a large
    probe on a slow link takes seconds a run, and its time varies little. Every rank stops at the same
    run, the samples being the same MAX-reduced numbers on all of them."""
    import torch
    import torch.distributed as dist

    def synchronize() -> None:
        if getattr(device, "type", None) == "cuda":
            torch.cuda.synchronize(device)

    run()
    samples: list[float] = []
    for _ in range(repeats):
        dist.barrier()
        synchronize()
        start = time.perf_counter()
        run()
        synchronize()
        elapsed = torch.tensor([time.perf_counter() - start], dtype=torch.float64, device=device)
        dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
        samples.append(float(elapsed.item()))
        if budget_s is not None and sum(samples) >= budget_s:
            break
    return statistics.median(samples)


def _checked_world(topology: Any) -> tuple[int, int]:
    """The process group's world size and the topology's ranks per node, once the default process
    group exists and matches the topology."""
    import torch.distributed as dist

    if not dist.is_initialized():
        raise RuntimeError(
            "calibrate_cluster needs an initialised default process group (torch.distributed.init_process_group)."
        )
    world, per_node = dist.get_world_size(), topology.ranks_per_node
    if world != topology.world_size:
        raise ValueError(f"The topology describes {topology.world_size} ranks but the process group has {world}.")
    return world, per_node


def _default_device() -> Any:
    """Where the probes' buffers live: the current CUDA device under NCCL, else the CPU."""
    import torch
    import torch.distributed as dist

    return torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")


_Scope = Literal["intra_node", "inter_node"]


def _probe_groups(world: int, per_node: int) -> list[tuple[_Scope, list[Any], list[list[int]]]]:
    """Per scope, the process groups to probe (none where the cluster has no such link) and their
    ranks: one group per node (intra-node), one per local rank across nodes (inter-node). Every rank
    creates every group, as ``new_group`` requires."""
    import torch.distributed as dist

    intra_groups = [list(range(start, start + per_node)) for start in range(0, world, per_node)]
    inter_groups = [list(range(local, world, per_node)) for local in range(per_node)]
    # new_group must be called by every rank for every group, in the same order.
    intra_handles = [dist.new_group(ranks) for ranks in intra_groups] if per_node > 1 else []
    inter_handles = [dist.new_group(ranks) for ranks in inter_groups] if world > per_node else []
    return [("intra_node", intra_handles, intra_groups), ("inter_node", inter_handles, inter_groups)]


def _timed_collective(
    kind: CollectiveKind, group: Any, size: int, elements: int, device: Any, repeats: int, budget_s: Optional[float]
) -> float:
    """:func:`slowest_rank_seconds` of one float32 collective on ``group`` of ``size`` ranks: an
    all-gather into ``elements`` elements, or an all-reduce of them."""
    import torch
    import torch.distributed as dist

    from lightning_mics.collectives import all_gather_flat

    full = torch.ones(elements, dtype=torch.float32, device=device)
    piece = torch.ones(elements // size, dtype=torch.float32, device=device)

    def run() -> None:
        if kind == "all_gather":
            all_gather_flat(full, piece, group)
        else:
            dist.all_reduce(full, group=group)

    return slowest_rank_seconds(run, device, repeats, budget_s)


def _probe_scope(
    scope: _Scope,
    handles: Sequence[Any],
    groups: Sequence[Sequence[int]],
    rank: int,
    payload_bytes: Sequence[int],
    repeats: int,
    device: Any,
    budget_s: Optional[float],
) -> list[ProbeTiming]:
    """Time all-gather and all-reduce at every payload size on this rank's group of the scope (every
    group of the scope runs at once). Payloads are rounded to float32 elements divisible by the group
    size (at least one per rank); the probes record the bytes actually moved."""
    mine = next(i for i, ranks in enumerate(groups) if rank in ranks)
    size = len(groups[mine])
    probes: list[ProbeTiming] = []
    for kind in ("all_gather", "all_reduce"):
        for payload in payload_bytes:
            elements = max(size, payload // 4 // size * size)  # float32, divisible by the group size
            seconds = _timed_collective(kind, handles[mine], size, elements, device, repeats,  # type: ignore[arg-type]
                                        budget_s)
            probes.append(ProbeTiming(scope, kind, size, elements * 4, seconds))  # type: ignore[arg-type]
    return probes


def _fitted(probes: Sequence[ProbeTiming], per_node: int) -> Calibration:
    """The :class:`Calibration` of the probes: ``alpha`` and ``B`` fitted per scope; inter-node rings
    share the node's link among its ``per_node`` concurrent groups."""
    intra = [p for p in probes if p.scope == "intra_node"]
    inter = [p for p in probes if p.scope == "inter_node"]
    intra_alpha, intra_bandwidth = fit_alpha_beta(intra) if intra else (None, None)
    inter_alpha, inter_bandwidth = fit_alpha_beta(inter, ring_edges_per_node=per_node) if inter else (None, None)
    return Calibration(intra_bandwidth, intra_alpha, inter_bandwidth, inter_alpha, tuple(probes))


def calibrate_cluster(
    topology: Any,
    payload_bytes: Sequence[int] = (1 << 12, 1 << 20, 1 << 22),
    repeats: int = 5,
    device: Optional[Any] = None,
    probe_budget_s: Optional[float] = 2.0,
) -> Calibration:
    """Measure all-gather and all-reduce inside and across nodes on the running cluster.

    Call it on every rank after ``torch.distributed`` is initialised, with the job's
    :class:`~lightning_mics.topology.MiCSTopology` (only its ``world_size`` and ``ranks_per_node``
    matter). It creates one process group per node (intra-node probes) and one per local rank
    across nodes (inter-node probes; all of them run at once, as the 2-hop boundary all-reduce
    does), times each collective at every payload size (``repeats`` runs after a warm-up, the
    slowest rank's time, median over runs), and fits ``alpha`` and ``B`` per scope with
    :func:`fit_alpha_beta`. The probe groups are destroyed before it returns, so the job keeps no
    group it does not train with. Every rank returns the same result. The default sizes take well
    under a second per probe on NCCL; on CPU/gloo they take a few seconds in all. ``probe_budget_s``
    bounds each probe's timed runs (fewer than ``repeats`` once they took that long; ``None``: all of
    them): on a slow link (tens of MB/s) a 4 MB all-reduce takes seconds a run.
    """
    import torch.distributed as dist

    world, per_node = _checked_world(topology)
    rank = dist.get_rank()
    if device is None:
        device = _default_device()
    probes: list[ProbeTiming] = []
    scopes = _probe_groups(world, per_node)
    try:
        for scope, handles, groups in scopes:
            if handles:
                probes += _probe_scope(scope, handles, groups, rank, payload_bytes, repeats, device, probe_budget_s)
    finally:
        _destroy_probe_groups([handle for _, handles, _ in scopes for handle in handles])
    return _fitted(probes, per_node)


def _destroy_probe_groups(handles: Sequence[Any]) -> None:
    """Free the groups the probes ran on. Nothing else uses them, and on NCCL each is a communicator
    (GPU memory, a finite number of NVLS slots) that would otherwise stay for the whole job: the
    calibration must leave the job's group count where it found it. A rank outside a group holds a
    placeholder for it, which there is nothing to free for."""
    import torch.distributed as dist

    for handle in handles:
        if handle is not None and handle != dist.GroupMember.NON_GROUP_MEMBER:
            dist.destroy_process_group(handle)
