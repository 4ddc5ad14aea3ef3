"""What a ``gpu_throughput.py`` run is: its modes (which loop trains the model, compiled or not), its configuration
(:class:`BenchConfig`, checked as it is built and written into the JSON, so a result says what it measured), what
one mode measured (:class:`ModeResult`) and the issue's targets.

No torch work here: the command line (``gpu_throughput.py``), the loops (:mod:`benchmarks.gpu_loops`) and the
measurement (:mod:`benchmarks.gpu_measure`) all read these.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Optional

from examples.models import GPTConfig

#: The issue's targets: MFU through the strategy, and its throughput relative to the plain loop.
TARGET_MFU = 0.55
TARGET_RATIO = 0.97


Runner = Literal["strategy", "plain"]


@dataclass(frozen=True)
class Mode:
    """One row of the comparison: which loop trains the model, and whether its blocks are compiled."""

    name: str
    runner: Runner
    compiled: bool


MODES: dict[str, Mode] = {
    mode.name: mode
    for mode in (
        Mode("plain", "plain", compiled=False),
        Mode("strategy", "strategy", compiled=False),
        Mode("plain-compiled", "plain", compiled=True),
        Mode("strategy-compiled", "strategy", compiled=True),
    )
}
#: The (strategy, baseline) pairs whose throughput ratio the issue asks for.
RATIO_PAIRS = (("strategy", "plain"), ("strategy-compiled", "plain-compiled"))
#: ``--find-largest``: which settings to search, offload off and/or on.
SEARCHES: dict[str, tuple[bool, ...]] = {"both": (False, True), "no-offload": (False,), "offload": (True,)}
#: Compiling on CPU needs a C++ toolchain and minutes of a shared machine; CPU runs default to eager.
DEFAULT_MODES = {"cuda": tuple(MODES), "cpu": ("plain", "strategy")}


@dataclass(frozen=True)
class BenchConfig:
    """Everything that defines a run; written into the JSON so a result says what it measured."""

    model: str = "xl"
    micro_batch: int = 8
    steps: int = 20
    warmup: int = 5
    device: str = "cuda"
    modes: tuple[str, ...] = DEFAULT_MODES["cuda"]
    #: Dense 16-bit peak of one device in TFLOP/s; ``None``: looked up from the GPU's name.
    peak_tflops: Optional[float] = None
    lr: float = 3e-4
    weight_decay: float = 0.1
    betas: tuple[float, float] = (0.9, 0.95)
    seed: int = 0
    activation_checkpointing: bool = False
    #: ``MiCSStrategy(prefetch_depth=...)``; ``None`` keeps the strategy's default.
    prefetch_depth: Optional[int] = None
    #: GPUs, one rank each (torchrun ``--nproc-per-node``); more than one runs the strategy modes only.
    devices: int = 1
    #: With one rank, resharding after forward only re-casts/copies every block again for backward,
    #: which the plain loop never does; ``False`` keeps the comparison about the strategy's overhead.
    reshard_after_forward: bool = False
    #: ``MiCSStrategy(cpu_offload=True)`` in the strategy modes (GPU only; the plain loop has no offload)
    cpu_offload: bool = False
    #: the preset's number of layers, replaced (``--find-largest`` varies it)
    n_layers: Optional[int] = None
    #: ``--find-largest``: search the largest model that fits one GPU -- "both" (without and with offload),
    #: "offload" or "no-offload" -- instead of comparing modes; at most ``max_layers`` layers
    find_largest: Optional[str] = None
    max_layers: int = 512

    def __post_init__(self) -> None:
        _ = self.gpt  # raises on an unknown size or layer count
        for name in ("micro_batch", "steps", "warmup"):
            if getattr(self, name) < 1:
                flag = "--" + name.replace("_", "-")
                raise ValueError(f"{flag} must be >= 1 (the timing window starts after a warm-up step).")
        unknown = [m for m in self.modes if m not in MODES]
        if unknown or not self.modes:
            raise ValueError(f"Unknown mode(s) {unknown}; choose among {', '.join(MODES)}.")
        if len(set(self.modes)) != len(self.modes):
            raise ValueError(f"--modes lists a mode twice: {','.join(self.modes)}.")
        if self.device not in DEFAULT_MODES:
            raise ValueError(f"--device must be 'cuda' or 'cpu', got {self.device!r}.")
        if self.devices < 1 or (self.devices > 1 and (self.device != "cuda" or self._plain_modes)):
            raise ValueError(
                f"--devices {self.devices}: more than one device runs only the strategy modes on CUDA (the plain "
                f"loop is one GPU), e.g. torchrun --nproc-per-node={self.devices} benchmarks/gpu_throughput.py "
                f"--devices {self.devices} --modes strategy,strategy-compiled"
            )
        if self.peak_tflops is not None and self.peak_tflops <= 0:
            raise ValueError(f"--peak-tflops must be positive, got {self.peak_tflops}.")
        if self.find_largest is not None and (self.find_largest not in SEARCHES or self.device != "cuda"):
            raise ValueError(
                f"--find-largest {self.find_largest}: one of {', '.join(SEARCHES)}, on --device cuda (it looks for "
                "the largest model before a CUDA out-of-memory error)"
            )
        if self.cpu_offload and (self.device != "cuda" or self._plain_modes):
            raise ValueError(
                "--cpu-offload moves the strategy's states from the GPU to host memory: it needs --device cuda and the "
                "strategy modes only (the plain loop has no offload), e.g. --cpu-offload --modes strategy"
            )

    @property
    def _plain_modes(self) -> list[str]:
        return [m for m in self.modes if m in MODES and MODES[m].runner == "plain"]

    @property
    def gpt(self) -> GPTConfig:
        return GPTConfig.preset(self.model, **({} if self.n_layers is None else {"n_layers": self.n_layers}))

    @property
    def total_steps(self) -> int:
        return self.warmup + self.steps

    @property
    def tokens_per_step(self) -> int:
        """Tokens one optimizer step trains, over all devices (each rank takes its own micro-batch)."""
        return self.micro_batch * self.gpt.seq_len * self.devices


@dataclass
class ModeResult:
    """What one mode measured. ``status``: ``ok`` or ``error``."""

    mode: str
    status: str = "ok"
    detail: str = ""
    steps_timed: int = 0
    seconds: Optional[float] = None
    tokens_per_s: Optional[float] = None
    step_time_s: Optional[float] = None
    mfu: Optional[float] = None
    peak_memory_bytes: Optional[int] = None
    peak_reserved_bytes: Optional[int] = None
    #: Loss of the first step (identical init and data, so close across modes) and of the last one.
    first_loss: Optional[float] = None
    last_loss: Optional[float] = None
