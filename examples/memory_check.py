"""Refuse a demo run that cannot fit in memory, before any rank starts, with an estimate and the fix.

Without it a too-large run (``model=gpt_small`` on four CPU ranks of a 24 GB machine) is killed by
the kernel's OOM killer midway, and the user sees only gloo's "Connection closed by peer" from the
surviving ranks. The estimate is the planner's memory model (:func:`lightning_mics.planner.memory_breakdown`:
model states of this layout + activations of one micro-batch) plus the per-process runtime; CPU ranks
share the host's memory, GPU ranks each have their own device.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from examples.models import GPTConfig
from lightning_mics.planner import PRECISIONS, ModelSpec, ShardingDegrees, TrainingSpec, memory_breakdown

#: What a CPU rank holds beyond model states and activations: Python + torch + Lightning (~360 MB
#: before the model exists), gloo buffers, the data, allocator slack. Calibrated on the demo GPT
#: "small" (86M) on 4 CPU ranks: 3.1 GB measured peak RSS at micro-batch 2 (this estimate: 3.1 GB),
#: and 5.1-5.9 GB reported at micro-batch 8 (estimate: 7.0 GB, on the safe side).
RUNTIME_BYTES_PER_RANK = 1.0e9
#: the share of the available memory a run may plan to use (allocator slack, data, logging)
USABLE_FRACTION = 0.9
GB = 1e9


@dataclass(frozen=True)
class MemoryPlan:
    """What one rank needs, and what the ranks that share one memory need together."""

    per_rank_bytes: float
    ranks_sharing_memory: int
    available_bytes: Optional[float]

    @property
    def needed_bytes(self) -> float:
        return self.per_rank_bytes * self.ranks_sharing_memory

    @property
    def fits(self) -> bool:
        return self.available_bytes is None or self.needed_bytes <= USABLE_FRACTION * self.available_bytes


def host_available_bytes() -> Optional[float]:
    """``MemAvailable`` of this Linux host (what can be allocated without swapping), else ``None``."""
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return float(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def estimate_per_rank_bytes(
    gpt: GPTConfig,
    micro_batch: int,
    precision: str,
    world_size: int,
    ranks_per_node: int,
    partition_size: int,
    activation_checkpointing: bool = False,
) -> Optional[float]:
    """Peak bytes of one rank training ``gpt`` sharded over ``partition_size`` ranks; ``None`` for a
    precision the planner does not model."""
    if precision not in PRECISIONS:
        return None
    model = ModelSpec(
        params=gpt.num_params,
        layers=gpt.n_layers,
        hidden=gpt.d_model,
        seq_len=gpt.seq_len,
        heads=gpt.n_heads,
        vocab=gpt.vocab_size,
        fused_attention=True,  # the demo GPT uses F.scaled_dot_product_attention
    )
    training = TrainingSpec(
        micro_batch=micro_batch, precision=precision, activation_checkpointing=activation_checkpointing
    )
    layout = ShardingDegrees(world_size, ranks_per_node, partition_size, partition_size, partition_size)
    return memory_breakdown(layout, model, training).total + RUNTIME_BYTES_PER_RANK


def check_fits_memory(
    gpt: GPTConfig,
    micro_batch: int,
    precision: str,
    world_size: int,
    ranks_per_node: int,
    partition_size: int,
    ranks_on_this_host: int,
    on_gpu: bool,
    activation_checkpointing: bool = False,
    available_bytes: Optional[float] = None,
    flags: tuple[str, str] = ("trainer=gpu", "data.batch_size"),
) -> Optional[MemoryPlan]:
    """Raise ``ValueError`` naming the estimate and the fixes when the run cannot fit; return the plan.

    ``ranks_on_this_host``: the rank processes that share this machine's memory (Lightning's
    ``devices``). ``available_bytes``: what they may use (default: this host's available memory).
    GPU runs are not checked here: each rank has its own device, not known before launch.
    ``flags``: how the entry point spells "train on GPUs" and "the micro-batch size" in its fix."""
    if on_gpu:
        return None
    per_rank = estimate_per_rank_bytes(
        gpt, micro_batch, precision, world_size, ranks_per_node, partition_size, activation_checkpointing
    )
    if per_rank is None:
        return None
    ranks_here = ranks_on_this_host  # Lightning's `devices`: processes per machine (emulated nodes share it)
    plan = MemoryPlan(per_rank, ranks_here, available_bytes if available_bytes is not None else host_available_bytes())
    if plan.fits:
        return plan
    assert plan.available_bytes is not None
    smaller = [
        b
        for b in range(micro_batch - 1, 0, -1)
        if ranks_here
        * (
            estimate_per_rank_bytes(
                gpt, b, precision, world_size, ranks_per_node, partition_size, activation_checkpointing
            )
            or 0
        )
        <= USABLE_FRACTION * plan.available_bytes
    ]
    gpu_flag, batch_size_flag = flags
    fixes = [gpu_flag]
    if smaller:
        fixes.append(f"{batch_size_flag}={smaller[0]}")
    fixes.append("fewer ranks or a smaller model")
    raise ValueError(
        f"This run needs ~{per_rank / GB:.1f} GB per rank ({gpt.num_params / 1e6:.0f}M parameters, micro-batch "
        f"{micro_batch} x {gpt.seq_len} tokens, {precision}), ~{plan.needed_bytes / GB:.1f} GB for the "
        f"{ranks_here} CPU ranks of this machine, which has {plan.available_bytes / GB:.1f} GB available: "
        f"use {' or '.join(fixes)}."
    )
