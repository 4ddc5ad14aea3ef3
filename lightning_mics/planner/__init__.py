"""Layout planner: predict step time, traffic and memory of every (P, G, OS) layout and rank them.

The planner answers "which partition size (or AMSP sharding spec) should this job use on this
cluster?" before anything is launched. It is pure Python (no processes) except
:func:`calibrate_cluster`, which times real collectives on an initialised process group.

* :mod:`.specs` -- the inputs: cluster, model, training setup, precision byte widths, cluster presets.
* :mod:`.models` -- the models: published shapes (Llama, Mistral, GPT-2), a local ``config.json``, presets.
* :mod:`.cost_model` -- the alpha-beta collective model, a layout's per-step schedule, and its
  time/traffic/memory estimate (the derivation is in that module's docstring).
* :mod:`.search` -- ranking every valid layout; ``partition_size="auto"``'s entry points.
* :mod:`.report` -- :class:`Plan`: the ranked layouts as a table, an explanation, JSON.
* :mod:`.calibrate` -- measuring alpha and beta of a real cluster.
* :mod:`.live` -- the cluster a running job's ``"auto"`` settings are planned for (``planner_cluster``).
* :mod:`.units` -- ``"100Gb/s"``-style quantities.
"""

from lightning_mics.planner.calibrate import Calibration, ProbeTiming, calibrate_cluster, fit_alpha_beta
from lightning_mics.planner.cost_model import (
    Collective,
    CollectiveCost,
    GroupShape,
    HostCopies,
    LayoutEstimate,
    MemoryBreakdown,
    activation_bytes,
    collective_cost,
    estimate,
    host_copies,
    layout_schedule,
    memory_breakdown,
    ring_cost,
)
from lightning_mics.planner.report import Plan, SemiSyncAdvice
from lightning_mics.planner.search import (
    LayoutChoice,
    choose_layout,
    choose_partition_size,
    device_memory_bytes,
    mics_speedup_over_zero3,
    plan,
    plan_layout_for,
    plan_partition_size_for,
)
from lightning_mics.planner.models import (
    DEFAULT_SEQ_LEN,
    MODEL_PRESETS,
    MODEL_SHAPES,
    TransformerShape,
    read_hf_config,
    shape_from_hf_config,
)
from lightning_mics.planner.specs import (
    CLUSTER_PRESETS,
    GB,
    GIB,
    NETWORK_EFFICIENCY,
    PRECISIONS,
    ClusterSpec,
    ModelSpec,
    PrecisionProfile,
    TrainingSpec,
)
from lightning_mics.planner.units import parse_bandwidth, parse_bytes, parse_count, parse_flops, parse_seconds
from lightning_mics.sharding_spec import ShardingDegrees, ShardingSpec

__all__ = [
    "CLUSTER_PRESETS",
    "DEFAULT_SEQ_LEN",
    "GB",
    "GIB",
    "MODEL_PRESETS",
    "MODEL_SHAPES",
    "NETWORK_EFFICIENCY",
    "PRECISIONS",
    "Calibration",
    "ClusterSpec",
    "Collective",
    "CollectiveCost",
    "GroupShape",
    "HostCopies",
    "LayoutChoice",
    "LayoutEstimate",
    "MemoryBreakdown",
    "ModelSpec",
    "Plan",
    "PrecisionProfile",
    "ProbeTiming",
    "SemiSyncAdvice",
    "ShardingDegrees",
    "ShardingSpec",
    "TrainingSpec",
    "TransformerShape",
    "activation_bytes",
    "calibrate_cluster",
    "choose_layout",
    "choose_partition_size",
    "collective_cost",
    "device_memory_bytes",
    "estimate",
    "fit_alpha_beta",
    "host_copies",
    "layout_schedule",
    "memory_breakdown",
    "mics_speedup_over_zero3",
    "parse_bandwidth",
    "parse_bytes",
    "parse_count",
    "parse_flops",
    "parse_seconds",
    "plan",
    "plan_layout_for",
    "plan_partition_size_for",
    "read_hf_config",
    "ring_cost",
    "shape_from_hf_config",
]
