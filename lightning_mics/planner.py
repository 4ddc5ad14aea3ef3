"""Layout planner: predict step time, traffic and memory of every (P, G, OS) layout and rank them.

The planner answers "which partition size (or AMSP sharding spec) should this job use on this
cluster?" before anything is launched. It is pure Python (no processes) except
:func:`calibrate_cluster`, which times real collectives on an initialised process group.

Model
=====

**Collectives (alpha-beta ring model).** A ring collective over ``n`` ranks moves its payload in
``n - 1`` steps. For an all-gather whose *gathered output* is ``M`` bytes, every rank sends and
receives ``M / n`` per step, so over the whole operation each ring edge carries ``(n-1)/n * M``::

    T_allgather(M, n) = (n - 1) * alpha + (n - 1) / n * M / B
    T_reducescatter   = the same, with M the *pre-scatter input* (the mirror image of the all-gather)
    T_allreduce       = T_reducescatter + T_allgather = 2 (n - 1) alpha + 2 (n - 1) / n * M / B

``alpha`` is the per-step latency of the slowest link in the ring and ``B`` the bandwidth a ring
edge gets. Inside a node every GPU has its own links (NVLink/NVSwitch): ``B = B_intra`` per GPU.
Across nodes the ring leaves each node once per group, and every group of the same shape runs at
the same time (collectives are SPMD), so the node's NIC bandwidth ``B_node`` is shared by the
``c = ranks_per_node / m`` groups that have ``m`` ranks on the node::

    flat ring spanning k nodes:  T = (n-1) alpha_inter + (n-1)/n * M * max(1 / B_intra, c / B_node)
                                 node egress = c * (n-1)/n * M

**Hierarchical collectives** (MiCS Sec. 3.3, ``hierarchical=True`` in the strategy) split a group
of ``n = k * m`` ranks (``m`` per node on ``k`` nodes) into an inter-node stage among the ``k``
same-local-rank peers, on ``M / m`` bytes, and an intra-node stage among ``m`` ranks on ``M``::

    T = (k-1) alpha_inter + (k-1)/k * (M / m) * (ranks_per_node / B_node)
      + (m-1) alpha_intra + (m-1)/m * M / B_intra
    node egress = c * (k-1)/k * M        (flat: c * (n-1)/n * M -- a factor ~m less across nodes
                                          when k is small, and k-1 instead of n-1 slow latencies)

**Per-step schedule of a layout (P, G, OS)** with ``Psi`` parameters split into ``U`` FSDP units
(the blocks plus the root), ``A`` micro-steps per optimizer step, ``W`` ranks, and the precision's
byte widths ``b_gather`` (all-gather dtype), ``b_reduce`` (gradient reduction dtype), ``b_param``
(sharded parameter / master dtype) -- see :func:`layout_schedule`:

* every micro-step: forward all-gather of ``Psi * b_gather`` over the ``G`` group; backward
  all-gather again over the ``G`` group (``P = G``), over the ``P`` group (hpZ) or not at all
  (``P = 1``); reduce-scatter of ``Psi * b_reduce`` over the ``G`` group;
* once per optimizer step (the 2-hop boundary): ``OS = G``: all-reduce of the ``Psi / G`` shard
  across the ``W / G`` replicas. ``OS > G``: reduce-scatter of it across ``OS / G`` replicas,
  all-reduce of the ``Psi / OS`` result across ``W / OS`` replicas, then all-gather of the updated
  ``Psi / G * b_param`` parameter shard across the ``OS / G`` replicas after the optimizer step.
* the optimizer step itself streams ``Psi / OS`` parameters through HBM.

**Overlap.** FSDP prefetches the next unit's all-gather during the current unit's compute and
reduce-scatters (then all-reduces, on the boundary) a unit's gradients during the next unit's
backward. Collectives on the same links serialise, compute runs beside them, and the first
unit's all-gather / last unit's reduction cannot hide. With ``overlap`` the fraction of compute
time that can hide communication (1 on GPUs with separate comm streams, ~0 on CPU ranks where
compute and gloo share cores)::

    exposed_phase = comm_phase / U + max(0, comm_phase * (U-1)/U - overlap * compute_phase)

for the forward and backward phases. The post-step parameter all-gather (``OS > G``) and the
optimizer step are fully exposed. Compute per micro-step is ``flops_per_token * tokens /
compute_rate`` (PaLM's ``6 Psi + 12 L h s`` per token; x 4/3 with activation checkpointing, which
recomputes the forward), split 1/3 forward, 2/3 backward.

**Memory per GPU** (:func:`memory_breakdown`)::

    states      = Psi * (b_param / G + b_grad / G + b_optim / OS)
    held params = Psi * b_gather / P      parameters kept between forward and backward (P < G)
    buffers     = 2 Psi / U * (b_gather + b_reduce)   prefetched unit + unsharded gradients (G > 1)
    activations = per layer s*b*h*(34 + 5*a*s/h) bytes at 16-bit (Korthikanti et al. 2022), or
                  2*s*b*h per layer + one layer's worth with activation checkpointing

and a layout *fits* when their sum is at most ``(1 - memory_reserve_fraction)`` of device memory
(the reserve stands for the CUDA context, allocator fragmentation and temporaries).

The ranking (:func:`plan`) puts fitting layouts first, then by predicted optimizer-step time.
"""

from __future__ import annotations

import json
import re
import statistics
import time
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field, replace
from typing import Any, Literal, Optional, Union

from lightning_mics.sharding_spec import ShardingDegrees, ShardingSpec, all_sharding_degrees

GIB = 1024**3
GB = 1e9

# ---------------------------------------------------------------------------------------------- inputs


@dataclass(frozen=True)
class PrecisionProfile:
    """Byte widths of everything the model counts, for one precision setting."""

    gather_bytes: float  #: all-gather dtype (compute dtype of parameters)
    reduce_bytes: float  #: gradient reduce-scatter / all-reduce dtype
    param_bytes: float  #: sharded parameter storage (= master weights under FSDP2)
    grad_bytes: float  #: sharded gradient storage
    optim_bytes: float  #: optimizer state per parameter (Adam: exp_avg + exp_avg_sq; + master if separate)
    activation_bytes: float  #: activation dtype


#: ``"32-true"``, ``"bf16-mixed"``/``"16-mixed"``, ``"bf16-true"``: this repo's FSDP2 mapping (mixed
#: modes gather in 16 bit, reduce in fp32, keep fp32 sharded params as master weights).
#: ``"deepspeed-fp16"``: DeepSpeed ZeRO's fp16 recipe as in the MiCS paper (fp16 params and grads,
#: fp16 reduction, fp32 master + Adam states in the optimizer shard: the classic 2 + 2 + 12 bytes).
PRECISIONS: dict[str, PrecisionProfile] = {
    "32-true": PrecisionProfile(4, 4, 4, 4, 8, 4),
    "bf16-mixed": PrecisionProfile(2, 4, 4, 4, 8, 2),
    "16-mixed": PrecisionProfile(2, 4, 4, 4, 8, 2),
    "bf16-true": PrecisionProfile(2, 2, 2, 2, 4, 2),
    "deepspeed-fp16": PrecisionProfile(2, 2, 2, 2, 12, 2),
}


@dataclass(frozen=True)
class ClusterSpec:
    """Hardware the job runs on. Bandwidths in bytes/s, latencies in seconds, memory in bytes.

    ``intra_node_bandwidth`` is what one GPU's ring edge gets inside a node (NCCL "bus bandwidth"),
    ``inter_node_bandwidth`` the node's total network bandwidth (all its NICs), shared by the
    node's ranks. ``compute_flops`` is the *achieved* FLOP/s per GPU (peak x MFU), not the peak.
    """

    nodes: int
    gpus_per_node: int
    gpu_memory_bytes: float
    intra_node_bandwidth: float
    inter_node_bandwidth: float
    compute_flops: float
    intra_node_latency: float = 10e-6
    inter_node_latency: float = 30e-6
    memory_bandwidth: float = 1.5e12  #: HBM bytes/s (the optimizer step is memory-bound)
    #: Fraction of compute time that can hide communication. Not 1 even with separate streams: NCCL
    #: kernels take SMs and HBM bandwidth from the compute they overlap.
    overlap: float = 0.8
    memory_reserve_fraction: float = 0.1
    #: How reduce-scatters run: ``"ring"`` -- one ring pass (NCCL; MiCSStrategy on gloo, which uses
    #: :func:`~lightning_mics.collectives.ring_reduce_scatter`) -- or ``"all_reduce"``: gloo's own
    #: ``reduce_scatter_tensor`` (what FSDP1 gets) all-reduces the whole buffer and keeps its chunk,
    #: two ring passes.
    reduce_scatter_algorithm: Literal["ring", "all_reduce"] = "ring"
    name: str = "custom"

    def __post_init__(self) -> None:
        for name in ("nodes", "gpus_per_node"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"ClusterSpec.{name} must be a positive int, got {value!r}.")
        for name in (
            "gpu_memory_bytes",
            "intra_node_bandwidth",
            "inter_node_bandwidth",
            "compute_flops",
            "memory_bandwidth",
        ):
            if not getattr(self, name) > 0:
                raise ValueError(f"ClusterSpec.{name} must be positive, got {getattr(self, name)!r}.")
        for name in ("intra_node_latency", "inter_node_latency"):
            if getattr(self, name) < 0:
                raise ValueError(f"ClusterSpec.{name} must be >= 0 seconds, got {getattr(self, name)!r}.")
        if not 0.0 <= self.overlap <= 1.0:
            raise ValueError(f"ClusterSpec.overlap is a fraction in [0, 1], got {self.overlap!r}.")
        if self.reduce_scatter_algorithm not in ("ring", "all_reduce"):
            raise ValueError(
                f"ClusterSpec.reduce_scatter_algorithm must be 'ring' or 'all_reduce', got {self.reduce_scatter_algorithm!r}."
            )
        if not 0.0 <= self.memory_reserve_fraction < 1.0:
            raise ValueError(f"ClusterSpec.memory_reserve_fraction must lie in [0, 1), got {self.memory_reserve_fraction!r}.")

    @property
    def world_size(self) -> int:
        return self.nodes * self.gpus_per_node

    def with_nodes(self, nodes: int) -> ClusterSpec:
        return replace(self, nodes=nodes)

    @classmethod
    def generic(cls, nodes: int, gpus_per_node: int, gpu_memory_bytes: float) -> ClusterSpec:
        """A middle-of-the-road GPU cluster (A100-class, 200 Gbps per node) when nothing is known
        but the shape and memory -- what ``partition_size="auto"`` assumes without calibration."""
        return cls(
            nodes=nodes,
            gpus_per_node=gpus_per_node,
            gpu_memory_bytes=gpu_memory_bytes,
            intra_node_bandwidth=150 * GB,
            inter_node_bandwidth=25 * GB,
            compute_flops=120e12,
            name="generic",
        )


#: Achieved NCCL bus bandwidth over the line rate of the network (EFA / InfiniBand): ~80 %.
NETWORK_EFFICIENCY = 0.8


def _cluster_preset(name: str, **fields: Any) -> ClusterSpec:
    return ClusterSpec(nodes=1, name=name, **fields)


#: Named clusters (one node; set ``nodes`` with :meth:`ClusterSpec.with_nodes` or ``--nodes``).
#: ``p3dn`` and ``p4d`` are the MiCS paper's AWS instances: 8 x V100 32 GB with 100 Gbps, and
#: 8 x A100 40 GB with 400 Gbps (4 x 100 Gbps EFA). Bandwidths are *achieved* bus bandwidths
#: (:data:`NETWORK_EFFICIENCY` of the line rate; NVLink figures are NCCL's typical in-node bus
#: bandwidth), compute is ~40-45 % of the 16-bit tensor-core peak.
CLUSTER_PRESETS: dict[str, ClusterSpec] = {
    "p3dn": _cluster_preset(
        "p3dn",
        gpus_per_node=8,
        gpu_memory_bytes=32 * GIB,
        intra_node_bandwidth=130 * GB,
        inter_node_bandwidth=NETWORK_EFFICIENCY * 100e9 / 8,
        compute_flops=0.4 * 125e12,
        intra_node_latency=10e-6,
        inter_node_latency=30e-6,
        memory_bandwidth=900e9,
    ),
    "p4d": _cluster_preset(
        "p4d",
        gpus_per_node=8,
        gpu_memory_bytes=40 * GIB,
        intra_node_bandwidth=230 * GB,
        inter_node_bandwidth=NETWORK_EFFICIENCY * 400e9 / 8,
        compute_flops=0.45 * 312e12,
        intra_node_latency=8e-6,
        inter_node_latency=20e-6,
        memory_bandwidth=1.55e12,
    ),
    "dgx-h100": _cluster_preset(
        "dgx-h100",
        gpus_per_node=8,
        gpu_memory_bytes=80 * GIB,
        intra_node_bandwidth=360 * GB,
        inter_node_bandwidth=NETWORK_EFFICIENCY * 3200e9 / 8,
        compute_flops=0.45 * 989e12,
        intra_node_latency=6e-6,
        inter_node_latency=15e-6,
        memory_bandwidth=3.35e12,
    ),
}


@dataclass(frozen=True)
class ModelSpec:
    """The model: parameter count and the transformer shape that sets activations and FLOPs."""

    params: int
    layers: int
    hidden: int
    seq_len: int
    heads: Optional[int] = None  #: default: hidden / 128
    vocab: int = 0  #: adds the logits to activation memory when known
    flops_per_token: Optional[float] = None  #: default: PaLM's 6 * params + 12 * layers * hidden * seq_len
    name: str = "custom"

    def __post_init__(self) -> None:
        for name in ("params", "layers", "hidden", "seq_len"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"ModelSpec.{name} must be a positive int, got {value!r}.")
        if self.heads is not None and self.heads < 1:
            raise ValueError(f"ModelSpec.heads must be positive, got {self.heads!r}.")

    @property
    def num_heads(self) -> int:
        return self.heads or max(1, self.hidden // 128)

    @property
    def num_units(self) -> int:
        """FSDP units: one per layer plus the root (embeddings, final norm, head)."""
        return self.layers + 1

    @property
    def training_flops_per_token(self) -> float:
        if self.flops_per_token is not None:
            return self.flops_per_token
        return 6.0 * self.params + 12.0 * self.layers * self.hidden * self.seq_len

    @classmethod
    def from_param_count(cls, params: int, seq_len: int = 2048) -> ModelSpec:
        """A GPT-shaped guess when only the parameter count is known: ``params ~ 12 L h^2`` with the
        GPT-3 family's aspect ratio ``h / L ~ 128``, hidden rounded to a multiple of 64."""
        if params < 1:
            raise ValueError(f"params must be positive, got {params!r}.")
        hidden = max(64, int(round((128 * params / 12) ** (1 / 3) / 64)) * 64)
        layers = max(1, int(round(params / (12 * hidden * hidden))))
        return cls(params=int(params), layers=layers, hidden=hidden, seq_len=seq_len, name=f"gpt-like {params:.3g}")


#: Models of the papers' experiments. ``bert-10b``: MiCS's BERT-10B (hidden 2560, 127 layers,
#: 40 heads, sequence 512 -- 12 * 127 * 2560^2 = 10.0e9 parameters).
MODEL_PRESETS: dict[str, ModelSpec] = {
    "bert-10b": ModelSpec(params=10_000_000_000, layers=127, hidden=2560, seq_len=512, heads=40, name="bert-10b"),
    "bert-20b": ModelSpec(params=20_000_000_000, layers=254, hidden=2560, seq_len=512, heads=40, name="bert-20b"),
    "gpt-1.3b": ModelSpec(params=1_300_000_000, layers=24, hidden=2048, seq_len=2048, heads=16, name="gpt-1.3b"),
    "gpt-13b": ModelSpec(params=13_000_000_000, layers=40, hidden=5120, seq_len=2048, heads=40, name="gpt-13b"),
    "gpt-175b": ModelSpec(params=175_000_000_000, layers=96, hidden=12288, seq_len=2048, heads=96, name="gpt-175b"),
}


@dataclass(frozen=True)
class TrainingSpec:
    """Batch and numerics: micro-batch per GPU, micro-steps per optimizer step, precision."""

    micro_batch: int = 1
    accumulation: int = 1
    precision: str = "bf16-mixed"
    activation_checkpointing: bool = False

    def __post_init__(self) -> None:
        for name in ("micro_batch", "accumulation"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"TrainingSpec.{name} must be a positive int, got {value!r}.")
        if self.precision not in PRECISIONS:
            raise ValueError(f"Unknown precision {self.precision!r}. Choose one of: {', '.join(PRECISIONS)}.")

    @property
    def bytes(self) -> PrecisionProfile:
        return PRECISIONS[self.precision]


# ---------------------------------------------------------------------------------------------- collectives

CollectiveKind = Literal["all_gather", "reduce_scatter", "all_reduce"]
_RING_PASSES: dict[str, int] = {"all_gather": 1, "reduce_scatter": 1, "all_reduce": 2}


@dataclass(frozen=True)
class GroupShape:
    """Where the ranks of one process group sit: ``size`` ranks, ``per_node`` of them on each node."""

    size: int
    per_node: int

    @property
    def nodes(self) -> int:
        return self.size // self.per_node

    @classmethod
    def strided(cls, size: int, stride: int, ranks_per_node: int) -> GroupShape:
        """The group ``{base + j * stride : j < size}`` under the contiguous rank layout: with a stride
        smaller than a node, ``ranks_per_node / stride`` members share each node."""
        per_node = min(size, max(1, ranks_per_node // stride))
        return cls(size=size, per_node=per_node)


@dataclass(frozen=True)
class CollectiveCost:
    """Time of one collective and the bytes each node sends across the network for it."""

    time_s: float = 0.0
    node_egress_bytes: float = 0.0

    def __add__(self, other: CollectiveCost) -> CollectiveCost:
        return CollectiveCost(self.time_s + other.time_s, self.node_egress_bytes + other.node_egress_bytes)

    def __mul__(self, factor: float) -> CollectiveCost:
        return CollectiveCost(self.time_s * factor, self.node_egress_bytes * factor)


def ring_cost(payload_bytes: float, ranks: int, alpha: float, edge_bandwidth: float) -> float:
    """One ring pass (an all-gather or a reduce-scatter): ``(n-1) alpha + (n-1)/n * M / B``."""
    if ranks <= 1:
        return 0.0
    return (ranks - 1) * alpha + (ranks - 1) / ranks * payload_bytes / edge_bandwidth


def collective_cost(
    kind: CollectiveKind, payload_bytes: float, group: GroupShape, cluster: ClusterSpec, hierarchical: bool = False
) -> CollectiveCost:
    """Time and node egress of one collective on ``group`` (formulas in the module docstring).

    ``payload_bytes`` follows :class:`~lightning_mics.collectives.CollectiveRecorder`: the gathered
    output of an all-gather, the pre-scatter input of a reduce-scatter, the buffer of an all-reduce.
    """
    passes = 2 if (kind == "reduce_scatter" and cluster.reduce_scatter_algorithm == "all_reduce") else _RING_PASSES[kind]
    n, m, k = group.size, group.per_node, group.nodes
    if n <= 1:
        return CollectiveCost()
    if k == 1:
        return CollectiveCost(passes * ring_cost(payload_bytes, n, cluster.intra_node_latency, cluster.intra_node_bandwidth))
    concurrent_groups = cluster.gpus_per_node / m  # groups of this shape sharing one node's NIC
    if hierarchical and m > 1:
        inter = ring_cost(payload_bytes / m, k, cluster.inter_node_latency, cluster.inter_node_bandwidth / cluster.gpus_per_node)
        intra = ring_cost(payload_bytes, m, cluster.intra_node_latency, cluster.intra_node_bandwidth)
        egress = concurrent_groups * (k - 1) / k * payload_bytes
        return CollectiveCost(passes * (inter + intra), passes * egress)
    edge_bandwidth = min(cluster.intra_node_bandwidth, cluster.inter_node_bandwidth / concurrent_groups)
    ring = ring_cost(payload_bytes, n, cluster.inter_node_latency, edge_bandwidth)
    egress = concurrent_groups * (n - 1) / n * payload_bytes
    return CollectiveCost(passes * ring, passes * egress)


# ---------------------------------------------------------------------------------------------- schedule


@dataclass(frozen=True)
class Collective:
    """One kind of collective in the schedule, issued ``count`` times (once per FSDP unit)."""

    phase: Literal["forward", "backward", "boundary", "post_step"]
    what: str
    kind: CollectiveKind
    group: GroupShape
    payload_bytes: float  #: total over the units (each call carries payload / count)
    count: int
    every_micro_step: bool

    def cost(self, cluster: ClusterSpec, hierarchical: bool) -> CollectiveCost:
        # Each unit is its own collective: latency is paid per call, bandwidth on the total.
        one = collective_cost(self.kind, self.payload_bytes / self.count, self.group, cluster, hierarchical)
        return one * self.count


def layout_schedule(
    layout: ShardingDegrees, model: ModelSpec, training: TrainingSpec, reduce_every_micro_step: bool = True
) -> list[Collective]:
    """The collectives one rank issues per micro-step and per optimizer step (see module docstring).

    ``reduce_every_micro_step=False`` models FSDP1 under Lightning (``FSDPStrategy``): Lightning's
    ``no_sync()`` on non-boundary micro-steps keeps gradients unsharded, and the reduce-scatter runs
    once, at the boundary (still overlapped with that backward).
    """
    psi, units, b = float(model.params), model.num_units, training.bytes
    p, g, os_, w, r = layout.params, layout.grads, layout.optim, layout.world_size, layout.ranks_per_node
    resharded_units = max(1, units - 1)  # the root unit keeps its parameters from forward to backward
    partition = GroupShape.strided(g, 1, r)
    schedule: list[Collective] = []
    if g > 1:
        schedule.append(Collective("forward", "param all-gather", "all_gather", partition, psi * b.gather_bytes, units, True))
        if p > 1:  # P = 1 keeps the gathered parameters until backward: no re-gather
            backward_group = partition if p == g else GroupShape.strided(p, 1, r)
            schedule.append(
                Collective(
                    "backward",
                    "param re-gather" + ("" if p == g else f" (hpZ, {p} ranks)"),
                    "all_gather",
                    backward_group,
                    psi * b.gather_bytes * resharded_units / units,
                    resharded_units,
                    True,
                )
            )
        schedule.append(
            Collective(
                "backward" if reduce_every_micro_step else "boundary",
                "grad reduce-scatter",
                "reduce_scatter",
                partition,
                psi * b.reduce_bytes,
                units,
                reduce_every_micro_step,
            )
        )
    shard = psi / g
    if os_ == g:
        replicas = GroupShape.strided(w // g, g, r)
        schedule.append(Collective("boundary", "grad all-reduce across replicas", "all_reduce", replicas, shard * b.reduce_bytes, units, False))
    else:
        optim_group = GroupShape.strided(os_ // g, g, r)
        schedule.append(
            Collective("boundary", "grad reduce-scatter across replicas", "reduce_scatter", optim_group, shard * b.reduce_bytes, units, False)
        )
        if w > os_:
            rest = GroupShape.strided(w // os_, os_, r)
            schedule.append(
                Collective("boundary", "grad all-reduce across replicas", "all_reduce", rest, psi / os_ * b.reduce_bytes, units, False)
            )
        schedule.append(
            Collective("post_step", "updated param all-gather across replicas", "all_gather", optim_group, shard * b.param_bytes, units, False)
        )
    return [c for c in schedule if c.group.size > 1]


# ---------------------------------------------------------------------------------------------- estimates


@dataclass(frozen=True)
class MemoryBreakdown:
    """Bytes per GPU at the peak of a step."""

    params: float
    grads: float
    optimizer: float
    held_params: float
    buffers: float
    activations: float

    @property
    def total(self) -> float:
        return self.params + self.grads + self.optimizer + self.held_params + self.buffers + self.activations


def activation_bytes(model: ModelSpec, training: TrainingSpec) -> float:
    """Activation memory per GPU for one micro-batch.

    Without checkpointing each layer keeps ``s*b*h*(34 + 5*a*s/h)`` bytes at 16-bit (Korthikanti et al.,
    "Reducing Activation Recomputation", 2022: 34 sbh for the matmul/GeLU/LayerNorm/dropout inputs,
    5 a s^2 b for the attention scores, softmax and its dropout mask). With checkpointing only each
    layer's input (``2 sbh`` at 16-bit) is kept, plus one layer's full activations while it is
    recomputed. Other dtypes scale by ``bytes / 2``; known vocabularies add fp32 logits and their
    gradient (``2 * 4 s b V``).
    """
    s, bsz, h, a = model.seq_len, training.micro_batch, model.hidden, model.num_heads
    scale = training.bytes.activation_bytes / 2
    per_layer = s * bsz * h * (34 + 5 * a * s / h) * scale
    if training.activation_checkpointing:
        body = model.layers * 2 * s * bsz * h * scale + per_layer
    else:
        body = model.layers * per_layer
    logits = 2 * 4 * s * bsz * model.vocab
    return body + logits


def memory_breakdown(
    layout: ShardingDegrees, model: ModelSpec, training: TrainingSpec, reduce_every_micro_step: bool = True
) -> MemoryBreakdown:
    """Peak bytes per GPU of ``layout`` (formulas in the module docstring). Without a reduction every
    micro-step (FSDP1 under Lightning's ``no_sync``) the gradients accumulate unsharded."""
    psi, units, b = float(model.params), model.num_units, training.bytes
    p, g, os_ = layout.params, layout.grads, layout.optim
    if g == 1:  # plain replication: parameters are whole already, nothing is gathered
        held = buffers = 0.0
    else:
        root_share = psi / units  # the root unit is never resharded after forward
        held = root_share * b.gather_bytes + (0.0 if p == g else (psi - root_share) * b.gather_bytes / p)
        buffers = 2 * psi / units * (b.gather_bytes + b.reduce_bytes)
    return MemoryBreakdown(
        params=psi * b.param_bytes / g,
        grads=psi * b.grad_bytes / (g if reduce_every_micro_step else 1),
        optimizer=psi * b.optim_bytes / os_,
        held_params=held,
        buffers=buffers,
        activations=activation_bytes(model, training),
    )


@dataclass(frozen=True)
class LayoutEstimate:
    """Everything the planner predicts for one layout, per optimizer step."""

    layout: ShardingDegrees
    hierarchical: bool
    compute_s: float
    comm_s: dict[str, float]  #: total communication time by phase (forward/backward/boundary/post_step)
    exposed_comm_s: float
    optimizer_step_s: float
    step_time_s: float
    inter_node_bytes: float  #: bytes each node sends across the network per optimizer step
    memory: MemoryBreakdown
    usable_memory_bytes: float
    tokens_per_step: int

    @property
    def fits(self) -> bool:
        return self.memory.total <= self.usable_memory_bytes

    @property
    def tokens_per_s(self) -> float:
        return self.tokens_per_step / self.step_time_s

    @property
    def name(self) -> str:
        return f"{self.layout.kind}: {self.layout.label}" + (" hier" if self.hierarchical else "")

    def to_dict(self) -> dict[str, Any]:
        return {
            "kind": self.layout.kind,
            "params_degree": self.layout.params,
            "grads_degree": self.layout.grads,
            "optim_degree": self.layout.optim,
            "partition_size": self.layout.partition_size,
            "reshard_after_forward": self.layout.reshard_after_forward,
            "hierarchical": self.hierarchical,
            "step_time_s": self.step_time_s,
            "tokens_per_s": self.tokens_per_s,
            "compute_s": self.compute_s,
            "exposed_comm_s": self.exposed_comm_s,
            "comm_s": dict(self.comm_s),
            "optimizer_step_s": self.optimizer_step_s,
            "inter_node_bytes_per_step": self.inter_node_bytes,
            "memory_bytes": self.memory.total,
            "memory_breakdown_bytes": asdict(self.memory),
            "usable_memory_bytes": self.usable_memory_bytes,
            "fits": self.fits,
        }


def _exposed(comm_s: float, compute_s: float, units: int, overlap: float) -> float:
    """Communication of one phase left visible: the first (or last) unit's share cannot overlap;
    the rest hides behind ``overlap * compute_s``."""
    if comm_s <= 0:
        return 0.0
    lead = comm_s / units
    return lead + max(0.0, comm_s - lead - overlap * compute_s)


def estimate(
    layout: Union[ShardingDegrees, ShardingSpec],
    cluster: ClusterSpec,
    model: ModelSpec,
    training: TrainingSpec,
    hierarchical: Union[bool, Literal["auto"]] = "auto",
    reduce_every_micro_step: bool = True,
) -> LayoutEstimate:
    """Predict one layout. ``hierarchical="auto"`` does what the strategy does: two-stage
    collectives whenever a group spans nodes (``False`` models flat rings, e.g. DeepSpeed ZeRO-3).
    ``reduce_every_micro_step=False``: see :func:`layout_schedule` (FSDP1 peers)."""
    if isinstance(layout, ShardingSpec):
        layout = layout.resolve(cluster.world_size, cluster.gpus_per_node)
    if (layout.world_size, layout.ranks_per_node) != (cluster.world_size, cluster.gpus_per_node):
        raise ValueError(
            f"Layout {layout.label} was resolved for world_size={layout.world_size} x ranks_per_node="
            f"{layout.ranks_per_node}, but the cluster has {cluster.nodes} nodes x {cluster.gpus_per_node} GPUs. "
            f"Resolve the ShardingSpec with the cluster's shape."
        )
    spans = layout.grads > layout.ranks_per_node
    use_hierarchical = spans if hierarchical == "auto" else bool(hierarchical)
    units = model.num_units
    tokens_micro = training.micro_batch * model.seq_len
    recompute = 4 / 3 if training.activation_checkpointing else 1.0
    compute_micro = model.training_flops_per_token * tokens_micro * recompute / cluster.compute_flops
    forward_compute, backward_compute = compute_micro / 3, compute_micro * 2 / 3

    comm = {"forward": CollectiveCost(), "backward": CollectiveCost(), "boundary": CollectiveCost(), "post_step": CollectiveCost()}
    for collective in layout_schedule(layout, model, training, reduce_every_micro_step):
        cost = collective.cost(cluster, use_hierarchical)
        comm[collective.phase] = comm[collective.phase] + cost
    fwd, bwd, boundary, post = (comm[k].time_s for k in ("forward", "backward", "boundary", "post_step"))
    a = training.accumulation
    exposed_micro = _exposed(fwd, forward_compute, units, cluster.overlap) + _exposed(bwd, backward_compute, units, cluster.overlap)
    exposed_boundary_micro = _exposed(fwd, forward_compute, units, cluster.overlap) + _exposed(
        bwd + boundary, backward_compute, units, cluster.overlap
    )
    b = training.bytes
    optim_shard = model.params / layout.optim
    # Adam reads param, grad, two moments and writes param and both moments.
    optimizer_step = optim_shard * (2 * b.param_bytes + b.grad_bytes + 2 * b.optim_bytes) / cluster.memory_bandwidth
    exposed = (a - 1) * exposed_micro + exposed_boundary_micro + post
    step = a * compute_micro + exposed + optimizer_step
    egress = a * (comm["forward"].node_egress_bytes + comm["backward"].node_egress_bytes)
    egress += comm["boundary"].node_egress_bytes + comm["post_step"].node_egress_bytes
    return LayoutEstimate(
        layout=layout,
        hierarchical=use_hierarchical and spans,
        compute_s=a * compute_micro,
        comm_s={"forward": a * fwd, "backward": a * bwd, "boundary": boundary, "post_step": post},
        exposed_comm_s=exposed,
        optimizer_step_s=optimizer_step,
        step_time_s=step,
        inter_node_bytes=egress,
        memory=memory_breakdown(layout, model, training, reduce_every_micro_step),
        usable_memory_bytes=cluster.gpu_memory_bytes * (1 - cluster.memory_reserve_fraction),
        tokens_per_step=tokens_micro * a * cluster.world_size,
    )


# ---------------------------------------------------------------------------------------------- search


@dataclass(frozen=True)
class Plan:
    """The ranked layouts for one job: fitting layouts first, fastest first."""

    cluster: ClusterSpec
    model: ModelSpec
    training: TrainingSpec
    ranked: tuple[LayoutEstimate, ...]

    @property
    def winner(self) -> LayoutEstimate:
        return self.ranked[0]

    @property
    def any_fits(self) -> bool:
        return self.winner.fits

    def find(self, params: int, grads: int, optim: int) -> LayoutEstimate:
        for candidate in self.ranked:
            layout = candidate.layout
            if (layout.params, layout.grads, layout.optim) == (params, grads, optim):
                return candidate
        raise KeyError(f"No layout P={params} G={grads} OS={optim} in this plan.")

    def explain(self) -> str:
        """Why the winner wins: against the runner-up and, when different, the MiCS default and ZeRO-3."""
        best = self.winner
        if not best.fits:
            return (
                f"No layout fits in {_gib(best.usable_memory_bytes)} usable per GPU; the leanest, "
                f"{_leanest(self.ranked).name}, needs {_gib(_leanest(self.ranked).memory.total)}. Add GPUs or nodes, use "
                f"activation checkpointing, a smaller micro-batch or bf16-true."
            )
        lines = [
            f"{best.name} wins: {best.step_time_s:.3g} s/step ({best.tokens_per_s:,.0f} tokens/s), "
            f"{best.exposed_comm_s:.3g} s exposed communication, {_gb(best.inter_node_bytes)} across nodes per node, "
            f"{_gib(best.memory.total)} of {_gib(best.usable_memory_bytes)} per GPU."
        ]
        world, node = self.cluster.world_size, min(self.cluster.gpus_per_node, self.cluster.world_size)
        rivals: list[tuple[str, LayoutEstimate]] = []
        if len(self.ranked) > 1:
            rivals.append(("runner-up", self.ranked[1]))
        for label, degree in (("MiCS default", node), ("ZeRO-3", world)):
            try:
                rivals.append((label, self.find(degree, degree, degree)))
            except KeyError:
                pass
        seen = {id(best)}
        for label, rival in rivals:
            if id(rival) in seen:
                continue
            seen.add(id(rival))
            lines.append(f"  vs {label} {rival.name}: {_compare(best, rival)}")
        return "\n".join(lines)

    def table(self, top: Optional[int] = None) -> str:
        """The ranked table as fixed-width text."""
        header = ("#", "layout", "step s", "tokens/s", "exposed comm s", "inter-node GB", "mem GiB/GPU", "fits")
        rows = [header]
        for index, candidate in enumerate(self.ranked[:top] if top else self.ranked, start=1):
            rows.append(
                (
                    str(index),
                    candidate.name,
                    f"{candidate.step_time_s:.4g}",
                    f"{candidate.tokens_per_s:,.0f}",
                    f"{candidate.exposed_comm_s:.4g}",
                    f"{candidate.inter_node_bytes / GB:.3g}",
                    f"{candidate.memory.total / GIB:.1f}",
                    "yes" if candidate.fits else "NO",
                )
            )
        widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
        lines = ["  ".join(cell.ljust(width) for cell, width in zip(row, widths)).rstrip() for row in rows]
        lines.insert(1, "  ".join("-" * width for width in widths))
        return "\n".join(lines)

    def to_dict(self, top: Optional[int] = None) -> dict[str, Any]:
        return {
            "cluster": asdict(self.cluster),
            "model": asdict(self.model),
            "training": asdict(self.training),
            "winner": self.winner.to_dict(),
            "explanation": self.explain(),
            "ranked": [c.to_dict() for c in (self.ranked[:top] if top else self.ranked)],
        }

    def to_json(self, top: Optional[int] = None) -> str:
        return json.dumps(self.to_dict(top), indent=2)


def _gib(value: float) -> str:
    return f"{value / GIB:.1f} GiB"


def _gb(value: float) -> str:
    return f"{value / GB:.3g} GB"


def _leanest(candidates: Iterable[LayoutEstimate]) -> LayoutEstimate:
    return min(candidates, key=lambda c: c.memory.total)


def _compare(best: LayoutEstimate, rival: LayoutEstimate) -> str:
    """One line naming the terms that separate two layouts."""
    if not rival.fits:
        return f"does not fit ({_gib(rival.memory.total)} > {_gib(rival.usable_memory_bytes)})."
    ratio = rival.step_time_s / best.step_time_s
    if ratio >= 1:
        parts = [f"{rival.step_time_s:.3g} s/step ({ratio:.2f}x slower)"]
    else:
        parts = [
            f"predicted {100 * (1 - ratio):.1f}% faster ({rival.step_time_s:.3g} s/step), within the tie tolerance, "
            f"but it sends {_gb(rival.inter_node_bytes)} across nodes vs {_gb(best.inter_node_bytes)}"
        ]
    exposed_gap = rival.exposed_comm_s - best.exposed_comm_s
    if abs(exposed_gap) > 0.01 * best.step_time_s:
        parts.append(f"{rival.exposed_comm_s:.3g} s exposed communication vs {best.exposed_comm_s:.3g}")
    if ratio >= 1 and rival.inter_node_bytes > 1.05 * best.inter_node_bytes:
        parts.append(f"{_gb(rival.inter_node_bytes)} across nodes vs {_gb(best.inter_node_bytes)}")
    if rival.compute_s > 1.001 * best.compute_s:
        parts.append("more recompute")
    if rival.memory.total < best.memory.total:
        parts.append(f"though it needs less memory ({_gib(rival.memory.total)})")
    return "; ".join(parts) + "."


def plan(
    cluster: ClusterSpec,
    model: ModelSpec,
    training: TrainingSpec = TrainingSpec(),
    uniform_only: bool = False,
    hierarchical: Union[bool, Literal["auto"]] = "auto",
    tie_tolerance: float = 0.02,
) -> Plan:
    """Estimate every valid layout (only ``P = G = OS`` with ``uniform_only``) and rank them.

    Layouts that fit come first, fastest first -- except that the winner is chosen among all
    fitting layouts within ``tie_tolerance`` of the fastest predicted time: the model cannot tell
    those apart, so among them the layouts sending the fewest bytes across nodes (within 1 %) are
    preferred -- the least exposed to a wrong network estimate -- and the fastest of those wins.
    """
    if not 0.0 <= tie_tolerance < 1.0:
        raise ValueError(f"tie_tolerance is a fraction of the step time in [0, 1), got {tie_tolerance!r}.")
    layouts = all_sharding_degrees(cluster.world_size, cluster.gpus_per_node, uniform_only=uniform_only)
    estimates = [estimate(layout, cluster, model, training, hierarchical) for layout in layouts]
    estimates.sort(key=lambda c: (not c.fits, c.step_time_s, c.memory.total))
    if estimates[0].fits:
        limit = estimates[0].step_time_s * (1 + tie_tolerance)
        near_best = [c for c in estimates if c.fits and c.step_time_s <= limit]
        fewest_bytes = min(c.inter_node_bytes for c in near_best)
        frugal = [c for c in near_best if c.inter_node_bytes <= fewest_bytes * 1.01 + 1.0]
        winner = min(frugal, key=lambda c: (c.step_time_s, c.memory.total))
        estimates.remove(winner)
        estimates.insert(0, winner)
    return Plan(cluster, model, training, tuple(estimates))


def choose_partition_size(
    world_size: int,
    ranks_per_node: int,
    param_count: int,
    device_memory_bytes: float,
    cluster: Optional[ClusterSpec] = None,
    model: Optional[ModelSpec] = None,
    training: Optional[TrainingSpec] = None,
) -> int:
    """The MiCS partition size (``P = G = OS``) the planner predicts fastest among those that fit.

    This is what ``MiCSStrategy(partition_size="auto")`` calls. Without a ``cluster`` it assumes
    :meth:`ClusterSpec.generic` bandwidths (or pass one from :func:`calibrate_cluster`); without a
    ``model`` it guesses a GPT shape from ``param_count`` (:meth:`ModelSpec.from_param_count`).

    Raises:
        ValueError: when no partition size fits, naming the memory needed and the ways out.
    """
    if world_size % ranks_per_node:
        raise ValueError(f"ranks_per_node={ranks_per_node} must divide world_size={world_size}.")
    if cluster is None:
        cluster = ClusterSpec.generic(world_size // ranks_per_node, ranks_per_node, device_memory_bytes)
    else:
        cluster = replace(cluster, nodes=world_size // ranks_per_node, gpus_per_node=ranks_per_node, gpu_memory_bytes=device_memory_bytes)
    model = model or ModelSpec.from_param_count(param_count)
    if model.params != param_count:
        model = replace(model, params=int(param_count))
    result = plan(cluster, model, training or TrainingSpec(), uniform_only=True)
    if not result.any_fits:
        leanest = _leanest(result.ranked)
        raise ValueError(
            f"partition_size='auto': no partition size fits a {param_count:,}-parameter model in "
            f"{_gib(device_memory_bytes)} per device on {world_size} ranks; even {leanest.layout.label} needs "
            f"~{_gib(leanest.memory.total)}. Use more devices, a smaller micro-batch, activation checkpointing or "
            f"bf16-true, or pass partition_size explicitly."
        )
    return result.winner.layout.partition_size


def mics_speedup_over_zero3(
    cluster: ClusterSpec, model: ModelSpec, training: TrainingSpec, partition_size: Optional[int] = None
) -> float:
    """Predicted throughput of MiCS (``partition_size``, default one node, hierarchical where it
    spans nodes) over ZeRO-3 with flat rings across the world (DeepSpeed's ZeRO-3, MiCS's baseline)."""
    partition = partition_size or cluster.gpus_per_node
    mics = estimate(ShardingSpec.uniform(partition), cluster, model, training, hierarchical="auto")
    zero3 = estimate(ShardingSpec.uniform("world"), cluster, model, training, hierarchical=False)
    return zero3.step_time_s / mics.step_time_s


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
        (_RING_PASSES[t.kind] * (t.group_size - 1), _RING_PASSES[t.kind] * (t.group_size - 1) / t.group_size * t.payload_bytes * ring_edges_per_node, t.seconds)
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


def calibrate_cluster(
    topology: Any,
    payload_bytes: Sequence[int] = (1 << 12, 1 << 20, 1 << 22),
    repeats: int = 5,
    device: Optional[Any] = None,
) -> Calibration:
    """Measure all-gather and all-reduce inside and across nodes on the running cluster.

    Call it on every rank after ``torch.distributed`` is initialised, with the job's
    :class:`~lightning_mics.topology.MiCSTopology` (only its ``world_size`` and ``ranks_per_node``
    matter). It creates one process group per node (intra-node probes) and one per local rank
    across nodes (inter-node probes; all of them run at once, as the 2-hop boundary all-reduce
    does), times each collective at every payload size (``repeats`` runs after a warm-up, the
    slowest rank's time, median over runs), and fits ``alpha`` and ``B`` per scope with
    :func:`fit_alpha_beta`. Every rank returns the same result. The default sizes take well under
    a second per probe on NCCL; on CPU/gloo they take a few seconds in all.
    """
    import torch
    import torch.distributed as dist

    from lightning_mics.collectives import all_gather_flat

    if not dist.is_initialized():
        raise RuntimeError("calibrate_cluster needs an initialised default process group (torch.distributed.init_process_group).")
    world, per_node = dist.get_world_size(), topology.ranks_per_node
    if world != topology.world_size:
        raise ValueError(f"The topology describes {topology.world_size} ranks but the process group has {world}.")
    rank = dist.get_rank()
    if device is None:
        device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")
    intra_groups = [list(range(start, start + per_node)) for start in range(0, world, per_node)]
    inter_groups = [list(range(local, world, per_node)) for local in range(per_node)]
    # new_group must be called by every rank for every group, in the same order.
    intra_handles = [dist.new_group(ranks) for ranks in intra_groups] if per_node > 1 else []
    inter_handles = [dist.new_group(ranks) for ranks in inter_groups] if world > per_node else []

    def synchronize() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    def timed(kind: CollectiveKind, group: Any, size: int, payload: int) -> float:
        elements = max(size, payload // 4 // size * size)  # float32, divisible by the group size
        full = torch.ones(elements, dtype=torch.float32, device=device)
        piece = torch.ones(elements // size, dtype=torch.float32, device=device)

        def run() -> None:
            if kind == "all_gather":
                all_gather_flat(full, piece, group)
            else:
                dist.all_reduce(full, group=group)

        run()  # warm-up: connection setup, buffers
        samples = []
        for _ in range(repeats):
            dist.barrier()
            synchronize()
            start = time.perf_counter()
            run()
            synchronize()
            elapsed = torch.tensor([time.perf_counter() - start], dtype=torch.float64, device=device)
            dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)  # the collective lasts as long as its slowest rank
            samples.append(float(elapsed.item()))
        return statistics.median(samples)

    probes: list[ProbeTiming] = []
    for scope, handles, groups in (("intra_node", intra_handles, intra_groups), ("inter_node", inter_handles, inter_groups)):
        if not handles:
            continue
        mine = next(i for i, ranks in enumerate(groups) if rank in ranks)
        size = len(groups[mine])
        for kind in ("all_gather", "all_reduce"):
            for payload in payload_bytes:
                elements = max(size, payload // 4 // size * size)
                seconds = timed(kind, handles[mine], size, payload)  # type: ignore[arg-type]
                probes.append(ProbeTiming(scope, kind, size, elements * 4, seconds))  # type: ignore[arg-type]
    intra = [p for p in probes if p.scope == "intra_node"]
    inter = [p for p in probes if p.scope == "inter_node"]
    intra_alpha, intra_bandwidth = fit_alpha_beta(intra) if intra else (None, None)
    inter_alpha, inter_bandwidth = fit_alpha_beta(inter, ring_edges_per_node=per_node) if inter else (None, None)
    return Calibration(intra_bandwidth, intra_alpha, inter_bandwidth, inter_alpha, tuple(probes))


# ---------------------------------------------------------------------------------------------- parsing helpers

_UNIT_RE = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:[eE][-+]?[0-9]+)?)\s*([A-Za-z/]*)\s*$")
_BANDWIDTH_UNITS = {"": 1.0, "b/s": 1.0, "bps": 1 / 8, "kb/s": 1e3, "mb/s": 1e6, "gb/s": 1e9, "tb/s": 1e12,
                    "gbps": 1e9 / 8, "gbit/s": 1e9 / 8, "mbps": 1e6 / 8, "tbps": 1e12 / 8}
_SIZE_UNITS = {"": 1.0, "b": 1.0, "kb": 1e3, "mb": 1e6, "gb": 1e9, "tb": 1e12, "kib": 1024.0, "mib": 1024.0**2,
               "gib": 1024.0**3, "tib": 1024.0**4}
_TIME_UNITS = {"": 1.0, "s": 1.0, "ms": 1e-3, "us": 1e-6, "ns": 1e-9}
_FLOPS_UNITS = {"": 1.0, "flops": 1.0, "gflops": 1e9, "tflops": 1e12, "pflops": 1e15}
_COUNT_UNITS = {"": 1.0, "k": 1e3, "m": 1e6, "b": 1e9, "t": 1e12}


def _parse_quantity(text: Union[str, float, int], units: dict[str, float], what: str, example: str) -> float:
    if isinstance(text, (int, float)) and not isinstance(text, bool):
        return float(text)
    match = _UNIT_RE.match(str(text))
    unit = match.group(2).lower() if match else None
    if match is None or unit not in units:
        raise ValueError(f"Cannot read {what} {text!r}: write a number with one of the units {sorted(units)} (e.g. {example!r}).")
    return float(match.group(1)) * units[unit]


def parse_bandwidth(text: Union[str, float]) -> float:
    """``"100Gbps"`` (bits) or ``"12.5GB/s"`` (bytes) -> bytes/s."""
    return _parse_quantity(text, _BANDWIDTH_UNITS, "bandwidth", "100Gbps")


def parse_bytes(text: Union[str, float]) -> float:
    """``"40GiB"`` / ``"40GB"`` -> bytes."""
    return _parse_quantity(text, _SIZE_UNITS, "memory size", "40GiB")


def parse_seconds(text: Union[str, float]) -> float:
    """``"30us"`` / ``"5e-6"`` -> seconds."""
    return _parse_quantity(text, _TIME_UNITS, "latency", "30us")


def parse_flops(text: Union[str, float]) -> float:
    """``"120TFLOPS"`` -> FLOP/s."""
    return _parse_quantity(text, _FLOPS_UNITS, "compute rate", "120TFLOPS")


def parse_count(text: Union[str, float]) -> int:
    """``"10B"`` / ``"1.3e9"`` / ``"350M"`` -> an int."""
    return int(round(_parse_quantity(text, _COUNT_UNITS, "count", "10B")))


__all__ = [
    "CLUSTER_PRESETS",
    "MODEL_PRESETS",
    "PRECISIONS",
    "Calibration",
    "ClusterSpec",
    "CollectiveCost",
    "GroupShape",
    "LayoutEstimate",
    "ModelSpec",
    "Plan",
    "ProbeTiming",
    "ShardingDegrees",
    "ShardingSpec",
    "TrainingSpec",
    "calibrate_cluster",
    "choose_partition_size",
    "collective_cost",
    "estimate",
    "fit_alpha_beta",
    "layout_schedule",
    "memory_breakdown",
    "mics_speedup_over_zero3",
    "plan",
]


def device_memory_bytes(device: Any, ranks_per_node: int) -> float:
    """Memory one rank may use: the GPU's total memory, or on CPU the host's memory shared by the
    node's ranks."""
    import os

    if getattr(device, "type", device) == "cuda":
        import torch

        return float(torch.cuda.get_device_properties(device).total_memory)
    return float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")) / ranks_per_node


def plan_partition_size_for(
    module: Any,
    world_size: int,
    ranks_per_node: int,
    device: Any,
    precision: str = "bf16-mixed",
    accumulation: int = 1,
) -> int:
    """:func:`choose_partition_size` for a live module on this device: what
    ``MiCSStrategy(partition_size="auto")`` calls once the processes exist.

    Raises:
        ValueError: when the module has no parameters yet (built later, in ``configure_model``).
    """
    param_count = sum(p.numel() for p in module.parameters())
    if param_count == 0:
        raise ValueError(
            "partition_size='auto' needs the model's parameters before the processes are set up, but the "
            "LightningModule has none yet (built in configure_model?). Create the model in __init__ (inside "
            "`trainer.init_module(empty_init=True)` for big models) or pass partition_size explicitly."
        )
    return choose_partition_size(
        world_size,
        ranks_per_node,
        param_count,
        device_memory_bytes(device, ranks_per_node),
        training=TrainingSpec(accumulation=accumulation, precision=precision),
    )
