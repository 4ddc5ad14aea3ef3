"""The cluster the planner assumes for a running job's ``"auto"`` settings (``planner_cluster``).

Without it, ``MiCSStrategy(sharding="auto" | partition_size="auto" | grad_accumulation="auto")``
plans for :meth:`ClusterSpec.generic` -- an A100-class GPU cluster with 200 Gbps per node -- whatever
it runs on, so on a cluster with other links (or CPU ranks) it can pick a layout that is slow there.
``planner_cluster`` tells it the truth:

* a :class:`ClusterSpec` -- taken as given (its shape and memory are replaced by the job's);
* the name of a preset in :data:`CLUSTER_PRESETS` (``"p4d"``, ``"p3dn"``, ``"dgx-h100"``);
* the path of a JSON file written by ``lightning-mics plan calibrate --out FILE`` -- the generic
  cluster with the measured links;
* ``"calibrate"`` -- measure this job's cluster at set-up, on its own process group, before
  anything is sharded: the links (:func:`calibrate_cluster`: all-gathers and all-reduces inside and
  across nodes), the compute rate (a matrix product on every rank at once) and the optimizer-step
  rate (an AdamW step on every rank at once). A few seconds on CPU/gloo, well under one on GPUs.
  It runs once per process: a later strategy of the same job (a new Trainer reusing the model)
  plans with the same measurements and so chooses the same layout.

All ranks must plan alike: every measurement is reduced to the slowest rank's value, so every rank
gets the same cluster and the same choice.
"""

from __future__ import annotations

import json
import os
from dataclasses import replace
from pathlib import Path
from typing import Any, Optional, Union

from lightning_mics.planner.calibrate import Calibration, calibrate_cluster, slowest_rank_seconds
from lightning_mics.planner.specs import CLUSTER_PRESETS, ClusterSpec

#: What ``planner_cluster`` accepts (module docstring).
PlannerCluster = Union[ClusterSpec, str, "os.PathLike[str]", None]

CALIBRATE = "calibrate"

#: Measured clusters of this process, by (world size, ranks per node, device type, backend).
_MEASURED: dict[tuple[int, int, str, str], ClusterSpec] = {}


def check_planner_cluster(option: PlannerCluster, plans: bool) -> None:
    """Refuse a malformed ``planner_cluster`` when the strategy is built. ``plans``: whether any
    setting is ``"auto"`` (otherwise nothing would read the option, and silently ignoring it would
    hide a mistake)."""
    if option is None:
        return
    if not plans:
        raise ValueError(
            f"planner_cluster={option!r} only informs the planner, which runs for 'auto' settings: set "
            "sharding='auto', partition_size='auto' or grad_accumulation='auto', or drop planner_cluster."
        )
    if isinstance(option, ClusterSpec):
        return
    if not isinstance(option, (str, os.PathLike)):
        raise TypeError(
            f"planner_cluster must be a ClusterSpec, 'calibrate', a preset name {sorted(CLUSTER_PRESETS)} or the "
            f"path of a calibration JSON, got {type(option).__name__}."
        )
    text = os.fspath(option)
    if text == CALIBRATE or text in CLUSTER_PRESETS:
        return
    path = Path(text)
    if not path.is_file():
        raise ValueError(
            f"planner_cluster={text!r} is neither 'calibrate', a preset {sorted(CLUSTER_PRESETS)} nor an existing "
            "file: pass one of those, or write a calibration with `torchrun ... -m lightning_mics.plan calibrate "
            "--out links.json` and pass its path."
        )
    read_calibration(path)  # a broken file fails now, not in every rank after launch


def read_calibration(path: Path) -> Calibration:
    """A calibration JSON (``lightning-mics plan calibrate --out``), or one error naming the file."""
    try:
        return Calibration.from_dict(json.loads(path.read_text()))
    except (OSError, ValueError, TypeError, KeyError) as error:
        raise ValueError(
            f"planner_cluster={str(path)!r} is not a calibration written by `lightning-mics plan calibrate --out`: "
            f"{error}. Write it again, or pass 'calibrate' to measure the cluster at set-up."
        ) from error


def planner_cluster_for(
    option: PlannerCluster, world_size: int, ranks_per_node: int, device: Any
) -> Optional[ClusterSpec]:
    """The :class:`ClusterSpec` ``option`` names for this job (``None``: the planner's generic one).
    ``"calibrate"`` measures, collectively: every rank must call this at the same point."""
    if option is None:
        return None
    nodes = world_size // ranks_per_node
    generic = ClusterSpec.generic(nodes, ranks_per_node, gpu_memory_bytes=1.0)  # memory: set by the planner
    if isinstance(option, ClusterSpec):
        return replace(option, nodes=nodes, gpus_per_node=ranks_per_node)
    text = os.fspath(option)
    if text in CLUSTER_PRESETS:
        return replace(CLUSTER_PRESETS[text], nodes=nodes, gpus_per_node=ranks_per_node)
    if text != CALIBRATE:
        return replace(read_calibration(Path(text)).apply(generic), name=f"calibrated ({text})")
    import torch.distributed as dist

    key = (world_size, ranks_per_node, str(getattr(device, "type", device)), dist.get_backend())
    if key not in _MEASURED:
        _MEASURED[key] = measure_cluster(generic, ranks_per_node, device)
    return _MEASURED[key]


def describe_cluster(cluster: Optional[ClusterSpec]) -> str:
    """One line for the layout log: which cluster the planner assumed, with the numbers that matter."""
    if cluster is None:
        return "the generic GPU cluster (pass planner_cluster='calibrate' to plan for this one)"
    inter = f", inter-node {cluster.inter_node_bandwidth / 1e6:,.0f} MB/s per node" if cluster.nodes > 1 else ""
    return (
        f"the {cluster.name} cluster: intra-node {cluster.intra_node_bandwidth / 1e6:,.0f} MB/s per rank{inter}, "
        f"compute {cluster.compute_flops / 1e9:,.1f} GFLOP/s per rank, optimizer memory "
        f"{cluster.memory_bandwidth / 1e9:,.2f} GB/s, overlap {cluster.overlap:g}"
    )


def measure_cluster(base: ClusterSpec, ranks_per_node: int, device: Any) -> ClusterSpec:
    """``base`` with this job's measured links, compute rate and optimizer-step rate. CPU ranks
    share cores with gloo's communication, so nothing overlaps there (``overlap=0``) -- except hop 2 when the
    strategy starts it per unit (``hop2_overlap=1``): gloo's threads wait on the network while the rank computes."""
    import torch.distributed as dist

    from lightning_mics.topology import MiCSTopology

    topology = MiCSTopology.create(dist.get_world_size(), ranks_per_node, ranks_per_node)
    links = calibrate_cluster(topology, device=device)
    cluster = links.apply(base)
    on_cpu = getattr(device, "type", str(device)) == "cpu"
    return replace(
        cluster,
        compute_flops=measure_compute_flops(device),
        memory_bandwidth=measure_optimizer_bandwidth(device),
        overlap=0.0 if on_cpu else cluster.overlap,
        hop2_overlap=1.0 if on_cpu else cluster.hop2_overlap,
        name="calibrated",
    )


def measure_compute_flops(device: Any, repeats: int = 3) -> float:
    """FLOP/s of one rank while every rank computes: a square matrix product (fp32 512 on CPU,
    bf16 4096 on GPUs), the slowest rank's rate. Training kernels reach less than a large product,
    so this is an upper bound of the planner's "achieved" rate."""
    import torch

    on_cpu = getattr(device, "type", str(device)) == "cpu"
    size, dtype = (512, torch.float32) if on_cpu else (4096, torch.bfloat16)
    a = torch.randn(size, size, dtype=dtype, device=device)
    b = torch.randn(size, size, dtype=dtype, device=device)
    seconds = slowest_rank_seconds(lambda: torch.mm(a, b), device, repeats)
    return 2 * size**3 / seconds


def measure_optimizer_bandwidth(device: Any, repeats: int = 3) -> float:
    """The ``memory_bandwidth`` that makes the cost model's optimizer step (``Psi * (2 b_param +
    b_grad + 2 b_optim)`` bytes, fp32) last what a real ``torch.optim.AdamW`` step lasts here, every
    rank stepping at once (1M parameters on CPU, 64M on GPUs), the slowest rank's."""
    import torch

    numel = (1 << 20) if getattr(device, "type", str(device)) == "cpu" else (1 << 26)
    param = torch.nn.Parameter(torch.zeros(numel, device=device))
    param.grad = torch.ones_like(param)
    optimizer = torch.optim.AdamW([param], lr=1e-3)
    seconds = slowest_rank_seconds(optimizer.step, device, repeats)
    return numel * (2 * 4 + 4 + 2 * 4) / seconds
