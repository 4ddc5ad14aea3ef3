"""The planner's cost model: what one layout's optimizer step costs in time, traffic and memory.

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

* every micro-step: forward all-gather of ``Psi * b_gather`` over the ``G`` group (``P = 1``: only
  on the first micro-step -- parameters stay gathered until the boundary); backward all-gather
  again over the ``G`` group (``P = G``), over the ``P`` group (hpZ) or not at all (``P = 1``);
  reduce-scatter of ``Psi * b_reduce`` over the ``G`` group (with
  ``grad_accumulation="unsharded"``: once per optimizer step, at the boundary, instead);
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
                  (grad_accumulation="unsharded": Psi * b_reduce for the gradients, the full accumulator)
    held params = Psi * b_gather / P      parameters kept between forward and backward (P < G)
    buffers     = 2 Psi / U * (b_gather + b_reduce)   prefetched unit + unsharded gradients (G > 1)
    activations = per layer s*b*h*(34 + 5*a*s/h) bytes at 16-bit (Korthikanti et al. 2022; the 34 adjusted
                  for grouped-query attention and gated MLPs, see activation_bytes), or
                  2*s*b*h per layer + one layer's worth with activation checkpointing

and a layout *fits* when their sum is at most ``(1 - memory_reserve_fraction)`` of device memory
(the reserve stands for the CUDA context, allocator fragmentation and temporaries).

**CPU offload** (``TrainingSpec.cpu_offload``, the strategy's ``cpu_offload``): the states term moves to
host memory (:attr:`MemoryBreakdown.host`, not counted against the device) except, with ``A > 1`` micro-steps
and unsharded accumulation (or a partition of one, which accumulates unsharded), the full gradient
accumulator, which FSDP2 keeps on the device until the boundary. The device keeps the held parameters,
the buffers -- now for every partition size, a partition of one included, since each unit is copied in
from the host -- plus the host-to-device staging of the prefetched units' shards
(``2 Psi / U * b_param / G``), and the activations. In time, over the host link (``host_link_bandwidth``,
PCIe; an assumed 25 GB/s unless the cluster says otherwise), each all-gather from the sharded state first
copies its ``Psi / G * b_param`` shard to the device (forward every micro-step -- only the first with
``P = 1`` -- and backward again when ``P = G``), and each reduce-scatter's ``Psi / G * b_reduce`` output
goes back. The copies ride the collectives' streams, so they join the phase's communication and hide
behind compute like it, except that from the second micro-step of sharded accumulation FSDP2 copies
synchronously (it adds to a host gradient), which is counted in full. The optimizer step streams its
``Psi / OS`` states through host memory at ``host_memory_bandwidth`` instead of HBM.

**Semi-synchronous replica groups** (``TrainingSpec.sync_every = H``, DiLoCo): no boundary hop across
replicas; after every ``H``-th step one all-reduce of the ``Psi / G`` parameter-delta shard (``b_param``, or the
compressed wire) across the replicas, after the optimizer step and so fully exposed, priced at ``1 / H`` of
its time and bytes per step; memory adds the last-synchronised shard and the outer momentum,
``2 Psi / G * b_param``. Only ``OS = G`` layouts apply. Streaming DiLoCo (``TrainingSpec.num_fragments`` P,
``fragment_sync_delay`` tau) sends the same bytes as P fragments, each started tau inner steps before its turn:
of each fragment's ``T / P`` up to ``overlap x tau`` inner steps hide (:func:`_hidden_outer_sync_s`).

The ranking (:func:`plan`) puts fitting layouts first, then by predicted optimizer-step time.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace
from typing import Any, Literal, Optional, Union

from lightning_mics.accumulation import GradAccumulation
from lightning_mics.planner.specs import ClusterSpec, ModelSpec, TrainingSpec
from lightning_mics.schedule import CollectiveKind, StepLayout, UnitSize, step_schedule
from lightning_mics.sharding_spec import ShardingDegrees, ShardingSpec

# ---------------------------------------------------------------------------------------------- collectives

RING_PASSES: dict[str, int] = {"all_gather": 1, "reduce_scatter": 1, "all_reduce": 2}


@dataclass(frozen=True)
class GroupShape:
    """Where the ranks of one process group sit: ``size`` ranks, ``per_node`` of them on each node."""

    size: int
    per_node: int
    #: regions the group spans (its ring crosses the region links when above 1)
    regions: int = 1
    #: ranks per region, where the cluster has regions
    ranks_per_region: Optional[int] = None

    @property
    def nodes(self) -> int:
        return self.size // self.per_node

    @classmethod
    def strided(
        cls, size: int, stride: int, ranks_per_node: int, ranks_per_region: Optional[int] = None
    ) -> GroupShape:
        """The group ``{base + j * stride : j < size}`` under the contiguous rank layout: with a stride
        smaller than a node, ``ranks_per_node / stride`` members share each node; with regions of
        ``ranks_per_region`` ranks, ``ranks_per_region / stride`` members share each region."""
        per_node = min(size, max(1, ranks_per_node // stride))
        if ranks_per_region is None:
            return cls(size=size, per_node=per_node)
        per_region = min(size, max(1, ranks_per_region // stride))
        return cls(size=size, per_node=per_node, regions=-(-size // per_region), ranks_per_region=ranks_per_region)


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

    ``payload_bytes`` follows :class:`~lightning_mics.collective_recorder.CollectiveRecorder`: the gathered
    output of an all-gather, the pre-scatter input of a reduce-scatter, the buffer of an all-reduce.
    """
    passes = (
        2 if (kind == "reduce_scatter" and cluster.reduce_scatter_algorithm == "all_reduce") else RING_PASSES[kind]
    )
    n, m, k = group.size, group.per_node, group.nodes
    if n <= 1:
        return CollectiveCost()
    if k == 1:
        return CollectiveCost(
            passes * ring_cost(payload_bytes, n, cluster.intra_node_latency, cluster.intra_node_bandwidth)
        )
    concurrent_groups = cluster.gpus_per_node / m  # groups of this shape sharing one node's NIC
    if hierarchical and m > 1:
        bandwidth, latency = _across_regions(
            cluster.inter_node_bandwidth / cluster.gpus_per_node, cluster.inter_node_latency, k, group, cluster
        )
        inter = ring_cost(payload_bytes / m, k, latency, bandwidth)
        intra = ring_cost(payload_bytes, m, cluster.intra_node_latency, cluster.intra_node_bandwidth)
        egress = concurrent_groups * (k - 1) / k * payload_bytes
        return CollectiveCost(passes * (inter + intra), passes * egress)
    edge_bandwidth, latency = _across_regions(
        min(cluster.intra_node_bandwidth, cluster.inter_node_bandwidth / concurrent_groups),
        cluster.inter_node_latency, n, group, cluster,
    )
    ring = ring_cost(payload_bytes, n, latency, edge_bandwidth)
    egress = concurrent_groups * (n - 1) / n * payload_bytes
    return CollectiveCost(passes * ring, passes * egress)


def _across_regions(
    bandwidth: float, latency: float, ring_size: int, group: GroupShape, cluster: ClusterSpec
) -> tuple[float, float]:
    """A ring edge's bandwidth and latency where ``group``'s ring of ``ring_size`` ranks crosses the links between
    regions: every such ring of the region's ranks shares one region link, so each gets ``region_bandwidth`` over
    their number -- a region's ranks over the ring's members in one region."""
    if group.regions <= 1 or cluster.region_bandwidth is None or group.ranks_per_region is None:
        return bandwidth, latency
    crossing_rings = group.ranks_per_region / max(1.0, ring_size / group.regions)
    return min(bandwidth, cluster.region_bandwidth / crossing_rings), max(latency, cluster.region_latency)


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
    #: the :data:`~lightning_mics.schedule.GroupRole` it runs on (``"replication"``: hop 2)
    role: str = ""
    #: issued once every this many optimizer steps (DiLoCo's outer synchronisation), else 1
    every_steps: int = 1

    def cost(self, cluster: ClusterSpec, hierarchical: bool) -> CollectiveCost:
        """Per optimizer step: averaged over ``every_steps`` steps."""
        # Each unit is its own collective: latency is paid per call, bandwidth on the total.
        one = collective_cost(self.kind, self.payload_bytes / self.count, self.group, cluster, hierarchical)
        return one * (self.count / self.every_steps)


def _group_shape(
    role: str, size: int, layout: ShardingDegrees, worker_size: int = 1, ranks_per_region: Optional[int] = None
) -> GroupShape:
    """Where the ranks of a :data:`~lightning_mics.schedule.GroupRole` sit, under the contiguous layout
    (``worker_size``: partition groups per two-level DiLoCo worker; ``ranks_per_region``: the cluster's regions)."""
    r, g, os_ = layout.ranks_per_node, layout.grads, layout.optim
    if role.endswith("_across_nodes"):  # same-local-rank peers: one per node, a node's ranks apart
        return GroupShape.strided(size, r, r, ranks_per_region)
    if role.endswith("_within_node") or role in ("partition", "param_group"):
        return GroupShape.strided(size, 1, r, ranks_per_region)
    stride = {"replication": g, "outer_replication": g * worker_size, "optim_shard": g, "optim_replica": os_}[role]
    return GroupShape.strided(size, stride, r, ranks_per_region)


def layout_schedule(
    layout: ShardingDegrees,
    model: ModelSpec,
    training: TrainingSpec,
    grad_accumulation: GradAccumulation = "sharded",
    hierarchical: bool = False,
    cross_replica_bytes: Optional[float] = None,
    ranks_per_region: Optional[int] = None,
    worker_size: int = 1,
) -> list[Collective]:
    """The collectives one rank issues per micro-step and per optimizer step:
    :func:`lightning_mics.schedule.step_schedule` for ``model.num_units`` equal units (the last, the
    root, kept gathered from forward to backward), summed over the units.

    ``grad_accumulation="unsharded"`` keeps gradients unsharded until the boundary, where the
    reduce-scatter runs once (still overlapped with that backward): MiCSStrategy's
    ``grad_accumulation="unsharded"``, and FSDP1 under Lightning's ``no_sync()``. ``hierarchical``:
    partition collectives spanning nodes run in MiCS's two stages (listed as two collectives).
    ``cross_replica_bytes``: bytes per element of a compressed cross-replica hop (``cross_replica_dtype``;
    :attr:`lightning_mics.wire.WireFormat.element_bytes`: 2 for bf16, 1 + 4 / 256 for int8).
    ``ranks_per_region``: the cluster's regions, whose links a group spanning them crosses; ``worker_size``:
    partition groups per two-level DiLoCo worker (:func:`diloco_worker_size`).
    """
    psi, units, b = float(model.params), model.num_units, training.bytes
    unit = psi / units
    sizes = [UnitSize(unit, unit, regathered_in_backward=i < units - 1) for i in range(units)]
    step = StepLayout(
        partition_size=layout.grads,
        world_size=layout.world_size,
        accumulation=training.accumulation,
        grad_accumulation=grad_accumulation,
        params_degree=layout.params,
        optim_degree=layout.optim,
        hierarchical_ranks_per_node=layout.ranks_per_node if hierarchical else None,
        gather_bytes=b.gather_bytes,
        reduce_bytes=b.reduce_bytes,
        param_bytes=b.param_bytes,
        cross_replica_bytes=cross_replica_bytes,
        sync_every=training.sync_every,
        worker_size=worker_size,
    )
    merged: dict[tuple[str, str, str, str], Collective] = {}
    for entry in step_schedule(sizes, step):
        key = (entry.phase, entry.what, entry.kind, entry.group)
        total = entry.payload_bytes * entry.calls
        if key in merged:
            known = merged[key]
            merged[key] = replace(known, payload_bytes=known.payload_bytes + total, count=known.count + entry.calls)
        else:
            group = _group_shape(entry.group, entry.group_size, layout, worker_size, ranks_per_region)
            merged[key] = Collective(
                entry.phase, entry.what, entry.kind, group, total, entry.calls, entry.every_micro_step, entry.group,
                entry.every_steps,
            )
    return list(merged.values())


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
    #: with CPU offload, the states in host memory (bytes per rank; not counted in :attr:`total`)
    host: float = 0.0
    #: semi-synchronous replica groups (DiLoCo): the last-synchronised parameter shards and the outer
    #: optimizer's state (Nesterov's momentum), ``2 Psi / G * b_param``
    outer: float = 0.0

    @property
    def total(self) -> float:
        return (
            self.params + self.grads + self.optimizer + self.held_params + self.buffers + self.activations + self.outer
        )


def activation_bytes(model: ModelSpec, training: TrainingSpec) -> float:
    """Activation memory per GPU for one micro-batch.

    Without checkpointing each layer keeps ``s*b*h*(34 + 5*a*s/h)`` bytes at 16-bit (Korthikanti et al.,
    "Reducing Activation Recomputation", 2022: 34 sbh for the matmul/GeLU/LayerNorm/dropout inputs,
    5 a s^2 b for the attention scores, softmax and its dropout mask). The 34 are 11 for attention
    (of which 4 for K and V, scaled by ``kv_heads / heads`` under grouped-query attention), 19 for a GPT MLP
    of width ``4h`` (``3 + 4 I / h`` for width ``I``; a gated SwiGLU MLP keeps ``2 + 8 I / h``: its input, the
    gate and up projections, the activation and their product) and 4 for the two norms. With
    checkpointing only each layer's input (``2 sbh`` at 16-bit) is kept, plus one layer's full activations
    while it is recomputed. Other dtypes scale by ``bytes / 2``; known vocabularies add fp32 logits and their
    gradient (``2 * 4 s b V``). A fused attention kernel (``ModelSpec.fused_attention``) stores no
    scores: the ``5 a s^2 b`` term goes.
    """
    s, bsz, h, a = model.seq_len, training.micro_batch, model.hidden, model.num_heads
    scale = training.bytes.activation_bytes / 2
    scores = 0.0 if model.fused_attention else 5 * a * s / h
    attention = 7 + 4 * model.num_kv_heads / a
    width = model.mlp_width / h
    mlp = 2 + 8 * width if model.gated_mlp else 3 + 4 * width
    per_layer = s * bsz * h * (attention + mlp + 4 + scores) * scale
    if training.activation_checkpointing:
        body = model.layers * 2 * s * bsz * h * scale + per_layer
    else:
        body = model.layers * per_layer
    logits = 2 * 4 * s * bsz * model.vocab
    return body + logits


def memory_breakdown(
    layout: ShardingDegrees, model: ModelSpec, training: TrainingSpec, grad_accumulation: GradAccumulation = "sharded"
) -> MemoryBreakdown:
    """Peak bytes per GPU of ``layout`` (formulas in the module docstring). With
    ``grad_accumulation="unsharded"`` every rank also holds the full gradient accumulator (in the
    reduction dtype) between micro-steps, beside its sharded gradient."""
    psi, units, b = float(model.params), model.num_units, training.bytes
    p, g, os_ = layout.params, layout.grads, layout.optim
    if g == 1 and not training.cpu_offload:  # plain replication: parameters are whole already, nothing is gathered
        held = buffers = 0.0
    else:
        root_share = psi / units  # the root unit is never resharded after forward
        held = root_share * b.gather_bytes + (0.0 if p == g else (psi - root_share) * b.gather_bytes / p)
        buffers = 2 * psi / units * (b.gather_bytes + b.reduce_bytes)
    if training.cpu_offload:
        return _offloaded_memory(layout, model, training, grad_accumulation, held, buffers)
    return MemoryBreakdown(
        params=psi * b.param_bytes / g,
        # Unsharded accumulation holds the full accumulator (reduction dtype) until the boundary
        # reduce-scatter, which frees it unit by unit as the sharded gradients appear.
        grads=psi * b.reduce_bytes if grad_accumulation == "unsharded" and g > 1 else psi * b.grad_bytes / g,
        optimizer=psi * b.optim_bytes / os_,
        held_params=held,
        buffers=buffers,
        activations=activation_bytes(model, training),
        outer=0.0 if training.sync_every is None else 2 * psi * b.param_bytes / g,
    )


def _offloaded_memory(
    layout: ShardingDegrees,
    model: ModelSpec,
    training: TrainingSpec,
    grad_accumulation: GradAccumulation,
    held: float,
    buffers: float,
) -> MemoryBreakdown:
    """:func:`memory_breakdown` with CPU offload (module docstring): the sharded states in host memory; on the
    device what is in flight, and the unsharded gradient accumulator where FSDP2 keeps one across micro-steps."""
    psi, units, b, g = float(model.params), model.num_units, training.bytes, layout.grads
    accumulates_unsharded = training.accumulation > 1 and (grad_accumulation == "unsharded" or g == 1)
    return MemoryBreakdown(
        params=0.0,
        grads=psi * b.reduce_bytes if accumulates_unsharded else 0.0,
        optimizer=0.0,
        held_params=held,
        buffers=buffers + 2 * psi / units * b.param_bytes / g,  # + the prefetched units' shards, copied in
        activations=activation_bytes(model, training),
        host=psi * (b.param_bytes + b.grad_bytes) / g + psi * b.optim_bytes / layout.optim,
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
    #: how gradients accumulate between optimizer steps (:mod:`lightning_mics.grad_sync`)
    grad_accumulation: GradAccumulation = "sharded"
    #: the sharded states live in host memory (:class:`HostCopies`: the PCIe copies this costs)
    cpu_offload: bool = False
    #: seconds of host<->device copies per optimizer step with CPU offload (inside the comm and exposed terms)
    host_copy_s: float = 0.0
    #: semi-synchronous replica groups (DiLoCo's H): the cross-replica synchronisation every this many steps,
    #: priced per step as ``1 / H`` of it (it runs after the step, fully exposed); ``None``: synchronous
    sync_every: Optional[int] = None
    #: two-level DiLoCo: partition groups per DiLoCo worker (1: flat DiLoCo, or synchronous)
    diloco_worker_size: int = 1

    @property
    def fits(self) -> bool:
        return self.memory.total <= self.usable_memory_bytes

    @property
    def tokens_per_s(self) -> float:
        return self.tokens_per_step / self.step_time_s

    @property
    def name(self) -> str:
        return (
            f"{self.layout.kind}: {self.layout.label}"
            + (" hier" if self.hierarchical else "")
            + (" unsharded-acc" if self.grad_accumulation == "unsharded" else "")
            + (" cpu-offload" if self.cpu_offload else "")
            + self._diloco_text
        )

    @property
    def _diloco_text(self) -> str:
        if self.sync_every is None:
            return ""
        worker = f" workers of {self.diloco_worker_size} groups" if self.diloco_worker_size > 1 else ""
        return f" diloco H={self.sync_every}{worker}"

    @property
    def layout_text(self) -> str:
        """:attr:`name` without the accumulation mode, for tables that give the mode a column of its own."""
        return (
            f"{self.layout.kind}: {self.layout.label}"
            + (" hier" if self.hierarchical else "")
            + (" cpu-offload" if self.cpu_offload else "")
            + self._diloco_text
        )

    @property
    def accumulation_text(self) -> str:
        """How this layout accumulates gradients: ``sharded`` / ``unsharded`` or, with a partition of one,
        ``replicated`` -- whole gradients on every rank, where the two modes are the same thing."""
        return "replicated" if self.layout.grads == 1 else self.grad_accumulation

    @property
    def busy_fraction(self) -> float:
        """The share of the step the GPUs compute (the rest they wait for communication or step the optimizer)."""
        return self.compute_s / self.step_time_s

    def to_dict(self) -> dict[str, Any]:
        return {
            "kind": self.layout.kind,
            "params_degree": self.layout.params,
            "grads_degree": self.layout.grads,
            "optim_degree": self.layout.optim,
            "partition_size": self.layout.partition_size,
            "reshard_after_forward": self.layout.reshard_after_forward,
            "hierarchical": self.hierarchical,
            "grad_accumulation": self.grad_accumulation,
            "cpu_offload": self.cpu_offload,
            "sync_every": self.sync_every,
            "diloco_worker_size": self.diloco_worker_size,
            "busy_fraction": self.busy_fraction,
            "host_copy_s": self.host_copy_s,
            "host_memory_bytes": self.memory.host,
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
    grad_accumulation: GradAccumulation = "sharded",
    cross_replica_bytes: Optional[float] = None,
) -> LayoutEstimate:
    """Predict one layout. ``hierarchical="auto"`` does what the strategy does: two-stage
    collectives whenever a group spans nodes (``False`` models flat rings, e.g. DeepSpeed ZeRO-3).
    ``grad_accumulation``: see :func:`layout_schedule` (``"unsharded"`` also models FSDP1 peers);
    ``cross_replica_bytes``: bytes per element of a compressed cross-replica hop (2 for bf16,
    1 + 4 / 256 for int8)."""
    layout = _resolved(layout, cluster)
    spans = layout.grads > layout.ranks_per_node
    use_hierarchical = spans if hierarchical == "auto" else bool(hierarchical)
    a = training.accumulation
    tokens_micro = training.micro_batch * model.seq_len
    compute_micro = _compute_s_per_micro_step(model, training, cluster)
    worker_size = diloco_worker_size(layout, cluster, training)
    schedule = layout_schedule(
        layout, model, training, grad_accumulation, use_hierarchical and spans, cross_replica_bytes,
        cluster.ranks_per_region, worker_size,
    )
    comm, first_forward = _costs_by_phase(schedule, cluster)
    copies = host_copies(layout, model, training, cluster, grad_accumulation)
    comm, first_forward = copies.added_to(comm, first_forward)
    hop2 = _overlapped_hop2_s(schedule, cluster, training)
    exposed = _exposed_comm_s(comm, first_forward, compute_micro, model.num_units, cluster, a, hop2)
    exposed += copies.blocking_s
    optimizer_step = _optimizer_step_s(layout, model, training, cluster)
    exposed -= _hidden_outer_sync_s(schedule, cluster, training, a * compute_micro + exposed + optimizer_step)
    return LayoutEstimate(
        layout=layout,
        hierarchical=use_hierarchical and spans,
        compute_s=a * compute_micro,
        comm_s=_comm_s_by_phase(comm, first_forward, a),
        exposed_comm_s=exposed,
        optimizer_step_s=optimizer_step,
        step_time_s=a * compute_micro + exposed + optimizer_step,
        inter_node_bytes=_inter_node_bytes(comm, first_forward, a),
        memory=memory_breakdown(layout, model, training, grad_accumulation),
        usable_memory_bytes=cluster.gpu_memory_bytes * (1 - cluster.memory_reserve_fraction),
        tokens_per_step=tokens_micro * a * cluster.world_size,
        grad_accumulation=grad_accumulation,
        cpu_offload=training.cpu_offload,
        host_copy_s=copies.total_s(a),
        sync_every=training.sync_every,
        diloco_worker_size=worker_size,
    )


def diloco_worker_size(layout: ShardingDegrees, cluster: ClusterSpec, training: TrainingSpec) -> int:
    """Partition groups per DiLoCo worker of ``layout`` (``TrainingSpec.diloco_worker_size``, ``"region"``: a
    region's), validated as the strategy's topology validates it: whole nodes, dividing the partition groups,
    tiling a region."""
    worker = training.diloco_worker_size
    g, replicas = layout.grads, layout.world_size // layout.grads
    if worker == "region":
        region = cluster.ranks_per_region
        if region is None:
            raise ValueError("diloco_worker_size='region' needs a cluster with regions (nodes_per_region).")
        if region % g:
            raise ValueError(f"a region of {region} ranks does not hold whole partitions of {g}.")
        worker = region // g
    assert isinstance(worker, int)
    if worker == 1:
        return 1
    ranks = worker * g
    region = cluster.ranks_per_region
    if replicas % worker or ranks % layout.ranks_per_node or (region is not None and region % ranks):
        raise ValueError(
            f"a DiLoCo worker of {worker} partition groups of {g} ranks does not tile whole nodes of "
            f"{layout.ranks_per_node}, the {replicas} partition groups"
            + (f" and regions of {region} ranks" if region is not None else "")
        )
    return worker


def _resolved(layout: Union[ShardingDegrees, ShardingSpec], cluster: ClusterSpec) -> ShardingDegrees:
    """``layout``'s degrees on ``cluster`` (a :class:`ShardingSpec` resolved for its shape); degrees
    resolved for another shape are an error."""
    if isinstance(layout, ShardingSpec):
        layout = layout.resolve(cluster.world_size, cluster.gpus_per_node)
    if (layout.world_size, layout.ranks_per_node) != (cluster.world_size, cluster.gpus_per_node):
        raise ValueError(
            f"Layout {layout.label} was resolved for world_size={layout.world_size} x ranks_per_node="
            f"{layout.ranks_per_node}, but the cluster has {cluster.nodes} nodes x {cluster.gpus_per_node} GPUs. "
            f"Resolve the ShardingSpec with the cluster's shape."
        )
    return layout


def _compute_s_per_micro_step(model: ModelSpec, training: TrainingSpec, cluster: ClusterSpec) -> float:
    """Compute time of one micro-step: ``flops_per_token * tokens / compute_rate``, x 4/3 with
    activation checkpointing (the forward runs twice)."""
    tokens_micro = training.micro_batch * model.seq_len
    recompute = 4 / 3 if training.activation_checkpointing else 1.0
    return model.training_flops_per_token * tokens_micro * recompute / cluster.compute_flops


def _costs_by_phase(
    schedule: list[Collective], cluster: ClusterSpec
) -> tuple[dict[str, CollectiveCost], CollectiveCost]:
    """The schedule's costs summed by phase (forward and backward per micro-step, boundary and
    post-step per optimizer step), and apart from them those of the first forward only."""
    # Per micro-step collectives by phase, and those of the first forward only (parameters kept
    # gathered through the step, P = 1): the latter join the first micro-step's forward.
    comm = {
        "forward": CollectiveCost(),
        "backward": CollectiveCost(),
        "boundary": CollectiveCost(),
        "post_step": CollectiveCost(),
    }
    first_forward = CollectiveCost()
    for collective in schedule:
        cost = collective.cost(cluster, hierarchical=False)  # hierarchical stages are separate collectives
        if collective.phase == "forward" and not collective.every_micro_step:
            first_forward = first_forward + cost
        else:
            comm[collective.phase] = comm[collective.phase] + cost
    return comm, first_forward


def _hidden_outer_sync_s(
    schedule: list[Collective], cluster: ClusterSpec, training: TrainingSpec, step_s: float
) -> float:
    """Streaming DiLoCo (``num_fragments`` P, ``fragment_sync_delay`` tau): seconds per step of the outer
    synchronisation that hide behind inner steps. The post-step terms price it fully exposed, ``T / H`` a step;
    each fragment's average (``T / P``, the same bytes cut P ways) starts tau inner steps before its turn and runs
    while they compute, so up to ``overlap x tau x`` the inner step (``step_s`` less this synchronisation's share)
    of it hides -- P times per H steps. tau = 0 hides nothing (DiLoCo, or fragments without a delay)."""
    delay = training.fragment_sync_delay
    if training.sync_every is None or delay == 0:
        return 0.0
    per_step = sum(c.cost(cluster, hierarchical=False).time_s for c in schedule
                   if c.phase == "post_step" and c.every_steps > 1)
    fragments, every = training.num_fragments, training.sync_every
    fragment_s = per_step * every / fragments
    hidden = min(fragment_s, cluster.overlap * delay * (step_s - per_step))
    return hidden * fragments / every


def _overlapped_hop2_s(schedule: list[Collective], cluster: ClusterSpec, training: TrainingSpec) -> float:
    """Seconds of the boundary's cross-replica collectives when the strategy starts them per unit behind
    backward (``cross_replica_overlap``), else 0 (they are part of the blocking boundary reduction)."""
    if not training.cross_replica_overlap:
        return 0.0
    hop2 = [c for c in schedule if c.phase == "boundary" and c.role == "replication"]
    return sum(c.cost(cluster, hierarchical=False).time_s for c in hop2)


def _exposed_comm_s(
    comm: dict[str, CollectiveCost],
    first_forward: CollectiveCost,
    compute_micro: float,
    units: int,
    cluster: ClusterSpec,
    a: int,
    hop2: float = 0.0,
) -> float:
    """Communication time left visible in one optimizer step of ``a`` micro-steps: of each micro-step's
    forward and backward (:func:`_exposed`; compute split 1/3 forward, 2/3 backward), plus the
    post-step all-gather in full. ``hop2``: seconds of the boundary's cross-replica hop started per unit
    (:func:`_overlapped_hop2_s`), taken out of the boundary and hidden, at ``hop2_overlap``, behind what the
    rank does meanwhile: the boundary backward's compute and its own exposed communication (the last unit's
    share cannot hide)."""
    fwd, bwd, boundary, post = (comm[k].time_s for k in ("forward", "backward", "boundary", "post_step"))
    boundary -= hop2
    forward_compute, backward_compute = compute_micro / 3, compute_micro * 2 / 3

    def exposed_micro_step(forward_comm: float, backward_comm: float) -> float:
        return _exposed(forward_comm, forward_compute, units, cluster.overlap) + _exposed(
            backward_comm, backward_compute, units, cluster.overlap
        )

    # The first micro-step carries the once-per-step gathers, the last the boundary reduction (the
    # same micro-step when a = 1).
    if a == 1:
        exposed_steps = exposed_micro_step(fwd + first_forward.time_s, bwd + boundary)
    else:
        exposed_steps = (
            exposed_micro_step(fwd + first_forward.time_s, bwd)
            + (a - 2) * exposed_micro_step(fwd, bwd)
            + exposed_micro_step(fwd, bwd + boundary)
        )
    if hop2 > 0:
        hop2_overlap = cluster.overlap if cluster.hop2_overlap is None else cluster.hop2_overlap
        window = backward_compute + _exposed(bwd + boundary, backward_compute, units, cluster.overlap)
        exposed_steps += _exposed(hop2, window, units, hop2_overlap)
    return exposed_steps + post


def _comm_s_by_phase(comm: dict[str, CollectiveCost], first_forward: CollectiveCost, a: int) -> dict[str, float]:
    """Total communication time per optimizer step of ``a`` micro-steps, by phase."""
    return {
        "forward": a * comm["forward"].time_s + first_forward.time_s,
        "backward": a * comm["backward"].time_s,
        "boundary": comm["boundary"].time_s,
        "post_step": comm["post_step"].time_s,
    }


def _inter_node_bytes(comm: dict[str, CollectiveCost], first_forward: CollectiveCost, a: int) -> float:
    """Bytes each node sends across the network per optimizer step of ``a`` micro-steps."""
    egress = a * (comm["forward"].node_egress_bytes + comm["backward"].node_egress_bytes)
    egress += first_forward.node_egress_bytes + comm["boundary"].node_egress_bytes + comm["post_step"].node_egress_bytes
    return egress


def _optimizer_step_s(layout: ShardingDegrees, model: ModelSpec, training: TrainingSpec, cluster: ClusterSpec) -> float:
    """The optimizer step on this rank's ``Psi / OS`` slice, memory-bound: its bytes through HBM -- or, with
    CPU offload, through host memory at ``host_memory_bandwidth``."""
    b = training.bytes
    optim_shard = model.params / layout.optim
    bandwidth = cluster.host_memory_bandwidth if training.cpu_offload else cluster.memory_bandwidth
    # Adam reads param, grad, two moments and writes param and both moments.
    return optim_shard * (2 * b.param_bytes + b.grad_bytes + 2 * b.optim_bytes) / bandwidth


@dataclass(frozen=True)
class HostCopies:
    """Seconds of host<->device (PCIe) copies in one optimizer step with CPU offload, by where they fall
    (module docstring); all zero without offload."""

    forward_s: float = 0.0  #: every micro-step's forward: each unit's parameter shards to the device
    first_forward_s: float = 0.0  #: the first micro-step's forward only (``P = 1``: gathered once per step)
    backward_s: float = 0.0  #: every micro-step's backward: the shards again (``P = G``), gradients back (A = 1)
    boundary_s: float = 0.0  #: with the boundary reduction: unsharded accumulation's gradients back
    blocking_s: float = 0.0  #: synchronous gradient copies (sharded accumulation, A > 1): exposed in full

    def total_s(self, accumulation: int) -> float:
        per_micro_step = self.forward_s + self.backward_s
        return accumulation * per_micro_step + self.first_forward_s + self.boundary_s + self.blocking_s

    def added_to(
        self, comm: dict[str, CollectiveCost], first_forward: CollectiveCost
    ) -> tuple[dict[str, CollectiveCost], CollectiveCost]:
        """The phases' communication with these copies in it (they ride the collectives' streams)."""
        comm = dict(comm)
        extra = {"forward": self.forward_s, "backward": self.backward_s, "boundary": self.boundary_s}
        for phase, seconds in extra.items():
            comm[phase] = comm[phase] + CollectiveCost(seconds)
        return comm, first_forward + CollectiveCost(self.first_forward_s)


def host_copies(
    layout: ShardingDegrees,
    model: ModelSpec,
    training: TrainingSpec,
    cluster: ClusterSpec,
    grad_accumulation: GradAccumulation = "sharded",
) -> HostCopies:
    """The PCIe copies of ``layout`` with CPU offload (none without): parameter shards to the device for
    every all-gather from the sharded state, each reduce-scatter's output back (module docstring)."""
    if not training.cpu_offload:
        return HostCopies()
    psi, units, b, a = float(model.params), model.num_units, training.bytes, training.accumulation
    g, bandwidth = layout.grads, cluster.host_link_bandwidth
    shards = psi * b.param_bytes / g / bandwidth
    regathered = shards * (units - 1) / units if layout.reshard_after_forward is True else 0.0
    grads = psi * b.reduce_bytes / g / bandwidth
    gathered_once = layout.params == 1 and g > 1
    unsharded = grad_accumulation == "unsharded" or g == 1  # a partition of one accumulates unsharded
    return HostCopies(
        forward_s=0.0 if gathered_once else shards,
        first_forward_s=shards if gathered_once else 0.0,
        backward_s=regathered + (grads if not unsharded and a == 1 else 0.0),
        boundary_s=grads if unsharded else 0.0,
        blocking_s=a * grads if not unsharded and a > 1 else 0.0,
    )
