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
from lightning_mics import MiCSTopology
from lightning_mics.planner import PRECISIONS, ShardingDegrees, TrainingSpec, memory_breakdown

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
    topology: MiCSTopology,
    activation_checkpointing: bool = False,
) -> Optional[float]:
    """Peak bytes of one rank training ``gpt`` sharded over ``topology``'s partition; ``None`` for a
    precision the planner does not model."""
    if precision not in PRECISIONS:
        return None
    model = gpt.model_spec()
    training = TrainingSpec(
        micro_batch=micro_batch, precision=precision, activation_checkpointing=activation_checkpointing
    )
    p = topology.partition_size
    layout = ShardingDegrees(topology.world_size, topology.ranks_per_node, p, p, p)
    return memory_breakdown(layout, model, training).total + RUNTIME_BYTES_PER_RANK


def check_fits_memory(
    gpt: GPTConfig,
    micro_batch: int,
    precision: str,
    topology: MiCSTopology,
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
    available = available_bytes if available_bytes is not None else host_available_bytes()

    def plan_for(batch: int) -> Optional[MemoryPlan]:
        per_rank = estimate_per_rank_bytes(gpt, batch, precision, topology, activation_checkpointing)
        # Lightning's `devices` rank processes share this machine's memory (emulated nodes included)
        return None if per_rank is None else MemoryPlan(per_rank, ranks_on_this_host, available)

    plan = plan_for(micro_batch)
    if plan is None or plan.fits:
        return plan
    assert plan.available_bytes is not None
    smaller_batches = range(micro_batch - 1, 0, -1)
    fitting_batch = next((b for b in smaller_batches if (smaller := plan_for(b)) is not None and smaller.fits), None)
    gpu_flag, batch_size_flag = flags
    fixes = [gpu_flag]
    if fitting_batch is not None:
        fixes.append(f"{batch_size_flag}={fitting_batch}")
    fixes.append("fewer ranks or a smaller model")
    raise ValueError(
        f"This run needs ~{plan.per_rank_bytes / GB:.1f} GB per rank ({gpt.num_params / 1e6:.0f}M parameters, "
        f"micro-batch {micro_batch} x {gpt.seq_len} tokens, {precision}), ~{plan.needed_bytes / GB:.1f} GB for the "
        f"{ranks_on_this_host} CPU ranks of this machine, which has {plan.available_bytes / GB:.1f} GB available: "
        f"use {' or '.join(fixes)}."
    )
