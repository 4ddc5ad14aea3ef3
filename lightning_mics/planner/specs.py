"""What the planner takes in: the cluster, the model, the training setup and their presets.

All sizes are bytes, bandwidths bytes/s, latencies seconds; presets describe real instance types
so that ``lightning-mics plan --cluster p3dn`` needs no measurement.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Literal, Optional, Union

from lightning_mics.schedule import check_streaming_options

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
    #: Fraction of the boundary backward that can hide hop 2 when the strategy starts it per unit itself
    #: (``cross_replica_overlap``); ``None``: :attr:`overlap`. On CPU ranks (calibrated: 1.0) gloo's own
    #: threads move those bytes while the rank's thread computes, so it hides even where FSDP2's blocking
    #: collectives do not (``overlap=0``).
    hop2_overlap: Optional[float] = None
    memory_reserve_fraction: float = 0.1
    #: How reduce-scatters run: ``"ring"`` -- one ring pass (NCCL; MiCSStrategy on gloo, which uses
    #: :func:`~lightning_mics.collectives.ring_reduce_scatter`) -- or ``"all_reduce"``: gloo's own
    #: ``reduce_scatter_tensor`` (what FSDP1 gets) all-reduces the whole buffer and keeps its chunk,
    #: two ring passes.
    reduce_scatter_algorithm: Literal["ring", "all_reduce"] = "ring"
    #: With ``cpu_offload``: bytes/s one GPU's host link (PCIe) moves in each direction -- the copy of its
    #: parameter shards to the GPU, of its gradient shards back. 25 GB/s is what PCIe 4.0 x16 achieves
    #: from pinned memory: an assumption, not a measurement of your hosts (set it, or use a preset).
    host_link_bandwidth: float = 25 * GB
    #: With ``cpu_offload``: the bytes/s one rank's optimizer step streams through host memory, the role
    #: ``memory_bandwidth`` plays on the GPU. 10 GB/s assumes torch's CPU Adam (several passes over the
    #: states, each rank a share of the host's cores and memory channels): an assumption, not measured.
    host_memory_bandwidth: float = 10 * GB
    #: Regions (zones, data centres) of ``nodes_per_region`` nodes each, joined by links of ``region_bandwidth``
    #: bytes/s each way between two regions (shared by every rank of a region) and ``region_latency``; ``None``:
    #: one region, every node on the same network
    nodes_per_region: Optional[int] = None
    region_bandwidth: Optional[float] = None
    region_latency: float = 1e-3
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
            "host_link_bandwidth",
            "host_memory_bandwidth",
        ):
            if not getattr(self, name) > 0:
                raise ValueError(f"ClusterSpec.{name} must be positive, got {getattr(self, name)!r}.")
        for name in ("intra_node_latency", "inter_node_latency"):
            if getattr(self, name) < 0:
                raise ValueError(f"ClusterSpec.{name} must be >= 0 seconds, got {getattr(self, name)!r}.")
        if not 0.0 <= self.overlap <= 1.0:
            raise ValueError(f"ClusterSpec.overlap is a fraction in [0, 1], got {self.overlap!r}.")
        if self.hop2_overlap is not None and not 0.0 <= self.hop2_overlap <= 1.0:
            raise ValueError(f"ClusterSpec.hop2_overlap is a fraction in [0, 1] or None, got {self.hop2_overlap!r}.")
        if self.reduce_scatter_algorithm not in ("ring", "all_reduce"):
            raise ValueError(
                "ClusterSpec.reduce_scatter_algorithm must be 'ring' or 'all_reduce', "
                f"got {self.reduce_scatter_algorithm!r}."
            )
        regions = self.nodes_per_region
        if (regions is None) != (self.region_bandwidth is None):
            raise ValueError("ClusterSpec: nodes_per_region and region_bandwidth are given together (or neither).")
        if regions is not None:
            if isinstance(regions, bool) or not isinstance(regions, int) or regions < 1 or self.nodes % regions:
                raise ValueError(
                    f"ClusterSpec.nodes_per_region={regions!r} must be a positive int dividing nodes={self.nodes}."
                )
            if not self.region_bandwidth > 0 or self.region_latency < 0:
                raise ValueError("ClusterSpec.region_bandwidth must be positive and region_latency >= 0.")
        if not 0.0 <= self.memory_reserve_fraction < 1.0:
            raise ValueError(
                f"ClusterSpec.memory_reserve_fraction must lie in [0, 1), got {self.memory_reserve_fraction!r}."
            )

    @property
    def world_size(self) -> int:
        return self.nodes * self.gpus_per_node

    @property
    def ranks_per_region(self) -> Optional[int]:
        return None if self.nodes_per_region is None else self.nodes_per_region * self.gpus_per_node

    @property
    def regions(self) -> int:
        return 1 if self.nodes_per_region is None else self.nodes // self.nodes_per_region

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
        host_link_bandwidth=12 * GB,  # PCIe 3.0 x16
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
        host_link_bandwidth=25 * GB,  # PCIe 4.0 x16
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
        host_link_bandwidth=50 * GB,  # PCIe 5.0 x16
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
    #: attention by a fused kernel (FlashAttention, ``F.scaled_dot_product_attention``): the
    #: ``s x s`` scores and softmax are recomputed in backward instead of stored
    fused_attention: bool = False
    #: key/value heads (grouped-query attention); default: :attr:`num_heads` (every head its own)
    kv_heads: Optional[int] = None
    #: the MLP's inner width; default: ``4 * hidden`` (GPT's)
    intermediate: Optional[int] = None
    #: a gated MLP (SwiGLU: three matrices, two ``intermediate``-wide activations kept) rather than GPT's two
    gated_mlp: bool = False
    #: the model's positions (``max_position_embeddings``) when known: the longest sequence it takes
    max_positions: Optional[int] = None

    def __post_init__(self) -> None:
        for name in ("params", "layers", "hidden", "seq_len"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"ModelSpec.{name} must be a positive int, got {value!r}.")
        for name in ("heads", "kv_heads", "intermediate", "max_positions"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise ValueError(f"ModelSpec.{name} must be a positive int or None, got {value!r}.")

    @property
    def num_heads(self) -> int:
        return self.heads or max(1, self.hidden // 128)

    @property
    def num_kv_heads(self) -> int:
        return self.kv_heads or self.num_heads

    @property
    def mlp_width(self) -> int:
        return self.intermediate or 4 * self.hidden

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
        GPT-3 family's aspect ratio ``h / L ~ 128``, hidden rounded to a multiple of 64. The live planner
        (``partition_size="auto"``) uses it, since a running job tells it a module's count and not its shape;
        the CLI never does -- it plans named shapes (:mod:`lightning_mics.planner.models`) or given ones."""
        if params < 1:
            raise ValueError(f"params must be positive, got {params!r}.")
        hidden = max(64, int(round((128 * params / 12) ** (1 / 3) / 64)) * 64)
        layers = max(1, int(round(params / (12 * hidden * hidden))))
        return cls(params=int(params), layers=layers, hidden=hidden, seq_len=seq_len, name=f"gpt-like {params:.3g}")


#: Models of the papers' experiments. ``bert-10b``: MiCS's BERT-10B (hidden 2560, 127 layers,
#: 40 heads, sequence 512 -- 12 * 127 * 2560^2 = 10.0e9 parameters). The models users train now, from
#: their published configs, are in :mod:`lightning_mics.planner.models` (``MODEL_PRESETS`` holds both).
PAPER_MODELS: dict[str, ModelSpec] = {
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
    #: sharded parameters, gradients and optimizer states in host memory (``MiCSStrategy(cpu_offload=True)``)
    cpu_offload: bool = False
    #: hop 2 started per unit during the boundary backward (``MiCSStrategy(cross_replica_overlap=True)``,
    #: the default) rather than by FSDP2 inside each unit's post-backward or, compressed, after backward
    cross_replica_overlap: bool = True
    #: semi-synchronous replica groups (``MiCSStrategy(cross_replica_sync="diloco", sync_every=H)``): H, the
    #: optimizer steps between two averages across replicas; ``None``: a hop 2 at every step (synchronous)
    sync_every: Optional[int] = None
    #: streaming DiLoCo (``num_fragments``): the parameters synchronised in this many fragments, one every
    #: ``sync_every / num_fragments`` steps
    num_fragments: int = 1
    #: streaming DiLoCo (``fragment_sync_delay``): inner steps each fragment's average runs behind
    fragment_sync_delay: int = 0
    #: two-level DiLoCo (``diloco_worker_size``): partition groups per DiLoCo worker, synchronised every step;
    #: ``"region"``: a region's (:attr:`ClusterSpec.nodes_per_region`), whatever the layout's partition size
    diloco_worker_size: Union[int, Literal["region"]] = 1

    def __post_init__(self) -> None:
        for name in ("micro_batch", "accumulation"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"TrainingSpec.{name} must be a positive int, got {value!r}.")
        every = self.sync_every
        if every is not None and (isinstance(every, bool) or not isinstance(every, int) or every < 1):
            raise ValueError(f"TrainingSpec.sync_every (DiLoCo's H) must be a positive int or None, got {every!r}.")
        if every is None and (self.num_fragments, self.fragment_sync_delay) != (1, 0):
            raise ValueError("TrainingSpec: num_fragments and fragment_sync_delay (streaming DiLoCo) need sync_every.")
        if every is not None:
            check_streaming_options(every, self.num_fragments, self.fragment_sync_delay, 0.0)
        worker = self.diloco_worker_size
        if worker != "region" and (isinstance(worker, bool) or not isinstance(worker, int) or worker < 1):
            raise ValueError(f"TrainingSpec.diloco_worker_size={worker!r} must be a positive int or 'region'.")
        if worker != 1 and every is None:
            raise ValueError("TrainingSpec.diloco_worker_size (two-level DiLoCo) needs sync_every.")
        if every is not None and self.cpu_offload:
            raise ValueError("TrainingSpec: sync_every (DiLoCo) with cpu_offload is not built; drop one of the two.")
        if not isinstance(self.cpu_offload, bool):
            raise TypeError(f"TrainingSpec.cpu_offload must be True or False, got {self.cpu_offload!r}.")
        if self.precision not in PRECISIONS:
            raise ValueError(f"Unknown precision {self.precision!r}. Choose one of: {', '.join(PRECISIONS)}.")

    @property
    def bytes(self) -> PrecisionProfile:
        return PRECISIONS[self.precision]
