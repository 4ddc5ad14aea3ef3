"""Single-GPU throughput: the GPT trained through ``Trainer(strategy="mics")`` against a plain loop.

What it answers (issue 7): on one GPU, how much of the device does the 1.2B-parameter GPT of the
examples reach when trained through :class:`~lightning_mics.MiCSStrategy` (tokens/s, MFU, peak
memory), and how close is that to the same model and optimizer in a hand-written PyTorch loop?
With one rank there is nothing to shard, so the gap between the two is exactly the overhead the
strategy (FSDP2 units, mixed-precision casts, Lightning's loop and hooks) adds to a training step.

Modes (``--modes``), each trained for ``--warmup`` + ``--steps`` optimizer steps from the same seed:

* ``plain``: fp32 master weights, ``torch.autocast(bf16)`` around forward + loss, fused AdamW --
  the standard PyTorch AMP loop, and what ``precision="bf16-mixed"`` means;
* ``strategy``: the same module through ``Trainer(strategy=MiCSStrategy(...), precision="bf16-mixed")``;
* ``plain-compiled`` / ``strategy-compiled``: the same, with every transformer block compiled
  (``torch.compile`` per block; the strategy's ``compile_blocks=True``).

Only the ``--steps`` steps after the warm-up are timed, with the device synchronised at both ends
of the window, the same way for both loops (see :class:`StepWindow`). Each window includes the
data loading and host-to-device copy of its batches, so Lightning's per-step work is counted.

Run (GPU)::

    python benchmarks/gpu_throughput.py                     # xl, micro-batch 8, all four modes
    python benchmarks/gpu_throughput.py --modes plain,strategy --steps 30

All GPUs of a machine, the strategy modes only (one rank per GPU, launched by torchrun; the plain loop
is one GPU, so there is no ratio): tokens/s of the whole job, MFU per GPU::

    torchrun --nproc-per-node=8 benchmarks/gpu_throughput.py --devices 8 --modes strategy,strategy-compiled

CPU offload (``MiCSStrategy(cpu_offload=True)``, GPU only): ``--cpu-offload`` runs the strategy modes with the
sharded states in host memory (the model is then built in host memory, so that it need not fit the GPU first);
``--find-largest`` looks for the largest model (the preset's width, doubling then bisecting its number of
layers, a CUDA out-of-memory error meaning "does not fit") that trains on one GPU without and with offload,
and measures the tokens/s of each at its largest::

    python benchmarks/gpu_throughput.py --cpu-offload --modes strategy
    python benchmarks/gpu_throughput.py --find-largest --steps 3 --json benchmarks/results/cpu_offload.json

CPU smoke test (what ``tests/test_benchmark_gpu.py`` runs; MFU and memory are n/a there)::

    python benchmarks/gpu_throughput.py --device cpu --model tiny --steps 3 --json /tmp/out.json

Results go to a table on stdout and to ``--json`` (default ``benchmarks/results/gpu_throughput.json``).
This script deliberately imports neither hydra nor the other benchmarks: the GPU machine it is
meant for has torch and lightning but no hydra-core.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import sys
import time
import traceback
import warnings
import weakref
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, replace
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Literal, Optional

import lightning
import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import Callback
from torch import Tensor, nn
from torch.distributed._composable import checkpoint
from torch.utils.data import DataLoader, TensorDataset

if __package__ in (None, ""):  # run as a script: the demo model lives in the repository's `examples`
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from examples.models import GPTConfig, GPTLightningModule  # noqa: E402
from lightning_mics import MiCSStrategy  # noqa: E402
from lightning_mics.telemetry import dense_peak_flops  # noqa: E402

DEFAULT_JSON = Path(__file__).resolve().parent / "results" / "gpu_throughput.json"
CPU_JSON = DEFAULT_JSON.with_name("gpu_throughput_cpu.json")

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


# ---------------------------------------------------------------------------------- shared pieces
class BenchmarkGPT(GPTLightningModule):
    """The examples' GPT with what both loops must share: the optimizer, and no per-step logging.

    ``GPTLightningModule`` logs the loss every step and warms the learning rate up through a
    scheduler; the plain loop has neither, so both are left out here -- the comparison is about the
    strategy, and a fused AdamW at constant learning rate is the same optimizer in both loops.
    """

    def __init__(self, cfg: BenchConfig) -> None:
        super().__init__(cfg.gpt, learning_rate=cfg.lr, weight_decay=cfg.weight_decay, betas=cfg.betas, warmup_steps=0)
        self.bench = cfg

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        return self._loss(batch)[0]

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return make_optimizer(self, self.bench)


def make_optimizer(module: nn.Module, cfg: BenchConfig) -> torch.optim.Optimizer:
    """AdamW with weight decay on matrices only (as ``GPTLightningModule``); fused on CUDA, where
    one kernel updates all parameters -- the fastest AdamW PyTorch has, for both loops."""
    decay = [p for p in module.parameters() if p.requires_grad and p.ndim >= 2]
    no_decay = [p for p in module.parameters() if p.requires_grad and p.ndim < 2]
    return torch.optim.AdamW(
        [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=cfg.lr,
        betas=cfg.betas,
        # with offload the optimizer steps on host tensors: torch's default (foreach) implementation there
        fused=True if cfg.device == "cuda" and not cfg.cpu_offload else None,
    )


def build_module(cfg: BenchConfig) -> BenchmarkGPT:
    """The model, initialised directly on the device from ``cfg.seed``: the same weights in every mode. With
    CPU offload in host memory instead: the strategy moves one unit at a time to the GPU and its shards back,
    so a model whose states do not fit the GPU never has to."""
    torch.manual_seed(cfg.seed)
    with torch.device("cpu" if cfg.cpu_offload else cfg.device):
        return BenchmarkGPT(cfg)


def make_loader(cfg: BenchConfig) -> DataLoader:
    """``total_steps`` micro-batches of random byte tokens (throughput does not depend on the text),
    the same for every mode; pinned on CUDA so the copy to the device is asynchronous in both loops."""
    gpt = cfg.gpt
    generator = torch.Generator().manual_seed(cfg.seed)
    tokens = torch.randint(0, gpt.vocab_size, (cfg.total_steps * cfg.micro_batch, gpt.seq_len + 1), generator=generator)
    dataset = TensorDataset(tokens[:, :-1], tokens[:, 1:])
    return DataLoader(dataset, batch_size=cfg.micro_batch, shuffle=False, pin_memory=cfg.device == "cuda")


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class StepWindow:
    """Times optimizer steps ``[warmup, warmup + steps)`` and keeps the first and last losses.

    Both loops call :meth:`after_step` once per optimizer step. The clock starts when step
    ``warmup - 1`` has finished on the device and stops when the last step has, so the window holds
    exactly ``steps`` steps of device work and host overhead, and no compilation or allocator warm-up.
    Losses are read (a host sync) only outside the window.
    """

    def __init__(self, cfg: BenchConfig) -> None:
        self.warmup, self.steps = cfg.warmup, cfg.steps
        self.device = torch.device(cfg.device)
        self._start: Optional[float] = None
        self.seconds: Optional[float] = None
        self.first_loss: Optional[float] = None
        self.last_loss: Optional[float] = None

    def after_step(self, step: int, loss: Tensor) -> None:
        if step == 0:
            self.first_loss = float(loss)
        if step == self.warmup - 1:
            synchronize(self.device)
            self._start = time.perf_counter()
        elif step == self.warmup + self.steps - 1:
            synchronize(self.device)
            assert self._start is not None
            self.seconds = time.perf_counter() - self._start
            self.last_loss = float(loss)


class StepWindowCallback(Callback):
    """Feeds Lightning's steps to a :class:`StepWindow` (one micro-batch per step, one epoch)."""

    def __init__(self, window: StepWindow) -> None:
        self.window = window

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        self.window.after_step(batch_idx, outputs["loss"])


# ---------------------------------------------------------------------------------- the two loops
def train_plain(cfg: BenchConfig, compiled: bool, window: StepWindow) -> weakref.ref:
    """The hand-written AMP loop. Blocks get activation checkpointing, then ``torch.compile``, per
    block and in place -- what ``MiCSStrategy`` does to its wrapped blocks before sharding -- so the
    two loops run the same compiled units and differ only by the strategy."""
    module = build_module(cfg)
    for block in module.model.blocks:
        if cfg.activation_checkpointing:
            checkpoint(block)
        if compiled:
            block.compile()
    optimizer = make_optimizer(module, cfg)
    device = torch.device(cfg.device)
    module.train()
    for step, (tokens, targets) in enumerate(make_loader(cfg)):
        tokens = tokens.to(device, non_blocking=True)
        targets = targets.to(device, non_blocking=True)
        with torch.autocast(device.type, dtype=torch.bfloat16):
            loss = module._loss((tokens, targets))[0]
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        window.after_step(step, loss.detach())
    return weakref.ref(module)


def strategy_options(cfg: BenchConfig, compiled: bool) -> dict[str, Any]:
    """``MiCSStrategy`` arguments for this run: the GPU-path options (issue 7) only when asked for."""
    options: dict[str, Any] = {"reshard_after_forward": cfg.reshard_after_forward}
    if compiled:
        options["compile_blocks"] = True
    if cfg.activation_checkpointing:
        options["activation_checkpointing_policy"] = True
    if cfg.prefetch_depth is not None:
        options["prefetch_depth"] = cfg.prefetch_depth
    if cfg.cpu_offload:
        options["cpu_offload"] = True
    return options


def train_strategy(cfg: BenchConfig, compiled: bool, window: StepWindow) -> weakref.ref:
    """The same module and data through ``Trainer(strategy=MiCSStrategy(...))`` on one device."""
    strategy = MiCSStrategy(**strategy_options(cfg, compiled))
    module = build_module(cfg)
    trainer = pl.Trainer(
        strategy=strategy,
        accelerator=cfg.device,
        devices=cfg.devices,
        precision="bf16-mixed",
        max_steps=cfg.total_steps,
        callbacks=[StepWindowCallback(window)],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        limit_val_batches=0,
        # One rank needs no DistributedSampler, and Lightning's would shuffle: keep the plain loop's batch order
        # (with --devices > 1 every rank trains the same batches: a throughput measurement, not a training run).
        use_distributed_sampler=False,
    )
    trainer.fit(module, train_dataloaders=make_loader(cfg))
    return weakref.ref(module)


TRAINERS = {"plain": train_plain, "strategy": train_strategy}


# ---------------------------------------------------------------------------------- measuring
def resolve_peak_flops(cfg: BenchConfig) -> Optional[float]:
    """FLOP/s that MFU is relative to: ``--peak-tflops``, else the GPU's dense bf16 peak
    (:func:`lightning_mics.telemetry.dense_peak_flops`: Lightning's table, 989.4 TFLOP/s for an H100
    SXM); ``None`` on CPU, whose peak is not a meaningful reference."""
    if cfg.peak_tflops is not None:
        return cfg.peak_tflops * 1e12
    if cfg.device != "cuda":
        return None
    return dense_peak_flops(torch.device("cuda", torch.cuda.current_device()), torch.bfloat16)


def release_memory(device: torch.device, compiled: bool) -> None:
    """Drop what the last mode left (compiled graphs hold references to its modules), so the next
    mode's peak memory counts only its own tensors."""
    if compiled:
        torch._dynamo.reset()
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)


def run_mode(cfg: BenchConfig, mode: Mode, peak_flops: Optional[float]) -> ModeResult:
    """Train one mode and turn its timing window into a result; errors become a result too, so a
    failing mode (say, out of memory) does not lose the others' numbers."""
    device = torch.device(cfg.device)
    release_memory(device, compiled=False)
    window = StepWindow(cfg)
    result = ModeResult(mode.name)
    module_ref: Optional[weakref.ref] = None
    try:
        module_ref = TRAINERS[mode.runner](cfg, mode.compiled, window)
    except Exception:  # noqa: BLE001 -- reported in the results, and the exit status
        result.status, result.detail = "error", traceback.format_exc(limit=-8)
        print(f"[{mode.name}] failed:\n{result.detail}", file=sys.stderr)
    if window.seconds is not None and result.status == "ok":
        result.steps_timed = cfg.steps
        result.seconds = window.seconds
        result.step_time_s = window.seconds / cfg.steps
        result.tokens_per_s = cfg.steps * cfg.tokens_per_step / window.seconds
        per_device = result.tokens_per_s / cfg.devices
        result.mfu = cfg.gpt.flops_per_token * per_device / peak_flops if peak_flops else None
    elif result.status == "ok":
        result.status, result.detail = "error", "the timing window never closed (fewer steps ran than asked)"
    result.first_loss, result.last_loss = window.first_loss, window.last_loss
    if device.type == "cuda":
        result.peak_memory_bytes = torch.cuda.max_memory_allocated(device)
        result.peak_reserved_bytes = torch.cuda.max_memory_reserved(device)
    release_memory(device, compiled=mode.compiled)
    if module_ref is not None and module_ref() is not None:
        warnings.warn(f"[{mode.name}] the model outlived its mode; later modes' peak memory includes it.")
    return result


def ratios(results: Sequence[ModeResult]) -> dict[str, float]:
    """Throughput of each strategy mode over its plain counterpart, where both ran."""
    by_name = {r.mode: r for r in results if r.tokens_per_s}
    return {
        f"{a}/{b}": by_name[a].tokens_per_s / by_name[b].tokens_per_s  # type: ignore[operator]
        for a, b in RATIO_PAIRS
        if a in by_name and b in by_name
    }


# ---------------------------------------------------------------------------------- reporting
def _fmt(value: Optional[float], spec: str, scale: float = 1.0, suffix: str = "") -> str:
    return "n/a" if value is None else f"{value * scale:{spec}}{suffix}"


def format_table(cfg: BenchConfig, results: Sequence[ModeResult], ratio: dict[str, float]) -> str:
    gpt = cfg.gpt
    header = (
        f"{'mode':<18} {'status':<8} {'tokens/s':>11} {'step ms':>9} {'MFU':>7} {'peak mem':>10} "
        f"{'loss first→last':>17}"
    )
    lines = [
        f"GPT {cfg.model}: d_model {gpt.d_model}, {gpt.n_layers} layers, {gpt.n_heads} heads, seq {gpt.seq_len}, "
        f"{gpt.num_params / 1e9:.3f}B params, {gpt.flops_per_token / 1e9:.2f} GFLOP/token; micro-batch "
        f"{cfg.micro_batch}, bf16, {cfg.steps} timed steps after {cfg.warmup} warm-up, device {cfg.device}"
        + (f" x {cfg.devices} (tokens/s of the job, MFU per device)" if cfg.devices > 1 else "")
        + ("; strategy with cpu_offload" if cfg.cpu_offload else ""),
        header,
        "-" * len(header),
    ]
    for r in results:
        losses = "n/a" if r.first_loss is None else f"{r.first_loss:.3f}→{_fmt(r.last_loss, '.3f')}"
        lines.append(
            f"{r.mode:<18} {r.status:<8} {_fmt(r.tokens_per_s, ',.0f'):>11} {_fmt(r.step_time_s, '.1f', 1e3):>9} "
            f"{_fmt(r.mfu, '.1f', 100, '%'):>7} {_fmt(r.peak_memory_bytes, '.1f', 2**-30, ' GiB'):>10} {losses:>17}"
        )
    for name, value in ratio.items():
        lines.append(f"throughput {name}: {value:.3f} (target >= {TARGET_RATIO})")
    for r in results:
        if r.mode.startswith("strategy") and r.mfu is not None:
            lines.append(f"MFU {r.mode}: {r.mfu:.1%} (target >= {TARGET_MFU:.0%})")
    return "\n".join(lines)


def report(cfg: BenchConfig, results: Sequence[ModeResult], peak_flops: Optional[float]) -> dict[str, Any]:
    """The JSON document: configuration, environment, per-mode results, ratios and targets."""
    ratio = ratios(results)
    strategy = next((r for r in results if r.mode == "strategy"), None)
    return {
        "benchmark": "gpu_throughput",
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "time_utc": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "config": asdict(cfg),
        "model": {
            **asdict(cfg.gpt),
            "num_params": cfg.gpt.num_params,
            "flops_per_token": cfg.gpt.flops_per_token,
            "tokens_per_step": cfg.tokens_per_step,
        },
        "environment": {
            "device_name": torch.cuda.get_device_name() if cfg.device == "cuda" else platform.processor() or "cpu",
            "peak_flops": peak_flops,
            "torch": torch.__version__,
            "lightning": lightning.__version__,
            "python": platform.python_version(),
        },
        "results": [asdict(r) for r in results],
        "ratios": ratio,
        "targets": {
            "strategy_mfu": TARGET_MFU,
            "strategy/plain": TARGET_RATIO,
            "strategy_mfu_met": None if strategy is None or strategy.mfu is None else strategy.mfu >= TARGET_MFU,
            "strategy/plain_met": ratio["strategy/plain"] >= TARGET_RATIO if "strategy/plain" in ratio else None,
        },
    }


def run(cfg: BenchConfig) -> tuple[list[ModeResult], dict[str, Any]]:
    if cfg.device == "cuda":
        if not torch.cuda.is_available():
            raise SystemExit("--device cuda, but torch sees no CUDA device (use --device cpu for a smoke test).")
        launched = int(os.environ.get("WORLD_SIZE", "1"))
        if launched != cfg.devices:
            raise SystemExit(
                f"--devices {cfg.devices} but {launched} process(es) were launched: start one per GPU with "
                f"torchrun --nproc-per-node={cfg.devices} benchmarks/gpu_throughput.py --devices {cfg.devices} ..."
            )
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    peak_flops = resolve_peak_flops(cfg)
    try:
        results = [run_mode(cfg, MODES[name], peak_flops) for name in cfg.modes]
    finally:
        if dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()
    return results, report(cfg, results, peak_flops)


# ---------------------------------------------------------------------------------- the largest model that fits
#: Host bytes per parameter with offload: the sharded fp32 parameters, gradients and two Adam moments (16, pinned)
#: and the model as built before sharding (4). A layer count needing more than ``HOST_MEMORY_SHARE`` of the free
#: host memory counts as not fitting: it would take the machine down instead of raising an error.
HOST_BYTES_PER_PARAM = 20
HOST_MEMORY_SHARE = 0.8


@dataclass
class Largest:
    """The largest model one setting trains on one GPU: its layer count, every probe, and its measurement."""

    cpu_offload: bool
    layers: Optional[int] = None
    params: Optional[int] = None
    #: each probe: ``layers``, ``params``, ``fits``, ``detail`` (why not)
    probes: Optional[list[dict[str, Any]]] = None
    result: Optional[ModeResult] = None


def search_largest(fits: Callable[[int], bool], start: int, limit: int) -> Optional[int]:
    """The largest ``n <= limit`` with ``fits(n)`` (fitting taken as monotone in ``n``): doubling from ``start``
    until one fails (halving instead when ``start`` fails), then bisection until the gap is within 1/16 of the
    answer -- each probe trains a model, so a few probes, not a linear scan. ``None``: not even 1 fits."""
    if fits(start):
        lo, hi = start, 0
        while not hi:
            if lo >= limit:
                return lo
            n = min(2 * lo, limit)
            lo, hi = (n, 0) if fits(n) else (lo, n)
    else:
        lo, hi = 0, start
        while not lo and hi > 1:
            n = hi // 2
            lo, hi = (n, hi) if fits(n) else (0, n)
        if not lo:
            return None
    while hi - lo > max(1, lo // 16):
        middle = (lo + hi) // 2
        lo, hi = (middle, hi) if fits(middle) else (lo, middle)
    return lo


def free_host_memory() -> float:
    return float(os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"))


def probe_fits(cfg: BenchConfig, layers: int) -> tuple[bool, str]:
    """Whether ``layers`` layers train on the GPU: two optimizer steps of the strategy (the optimizer's states
    exist from the first); a CUDA out-of-memory error means no, any other error is raised."""
    trial = replace(cfg, n_layers=layers, warmup=1, steps=1, modes=("strategy",))
    host_bytes = trial.gpt.num_params * HOST_BYTES_PER_PARAM
    if cfg.cpu_offload and host_bytes > HOST_MEMORY_SHARE * free_host_memory():
        share = f"{HOST_MEMORY_SHARE:.0%}"
        return False, f"needs ~{host_bytes / 2**30:.0f} GiB of host memory, more than {share} of what is free"
    device = torch.device(cfg.device)
    release_memory(device, compiled=False)
    try:
        train_strategy(trial, compiled=False, window=StepWindow(trial))
        return True, ""
    except torch.cuda.OutOfMemoryError as error:
        return False, "CUDA out of memory: " + str(error).split("\n")[0][:200]
    finally:
        release_memory(device, compiled=False)


def find_largest(cfg: BenchConfig, cpu_offload: bool) -> Largest:
    """Search the layer count (width fixed at the preset's), then measure tokens/s at the largest that fits."""
    base = replace(cfg, cpu_offload=cpu_offload, modes=("strategy",))
    largest = Largest(cpu_offload, probes=[])

    def fits(layers: int) -> bool:
        ok, detail = probe_fits(base, layers)
        params = replace(base, n_layers=layers).gpt.num_params
        largest.probes.append({"layers": layers, "params": params, "fits": ok, "detail": detail})  # type: ignore
        print(f"[cpu_offload={cpu_offload}] {layers} layers ({params / 1e9:.2f}B): {'fits' if ok else detail}")
        return ok

    largest.layers = search_largest(fits, base.gpt.n_layers, cfg.max_layers)
    if largest.layers is not None:
        final = replace(base, n_layers=largest.layers)
        largest.params = final.gpt.num_params
        largest.result = run_mode(final, MODES["strategy"], resolve_peak_flops(final))
    return largest


def run_find_largest(cfg: BenchConfig) -> tuple[list[Largest], dict[str, Any]]:
    """Every requested setting's largest model, and the JSON document (:func:`report`'s, plus ``largest``)."""
    assert cfg.find_largest is not None
    if not torch.cuda.is_available():
        raise SystemExit("--find-largest needs a CUDA device: torch sees none.")
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    try:
        found = [find_largest(cfg, offload) for offload in SEARCHES[cfg.find_largest]]
    finally:
        if dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()
    results = [replace(f.result, mode=f"strategy{' cpu_offload' if f.cpu_offload else ''}") for f in found if f.result]
    document = report(cfg, results, resolve_peak_flops(cfg))
    document["largest"] = [asdict(f) for f in found]
    return found, document


def format_largest(cfg: BenchConfig, found: Sequence[Largest]) -> str:
    gpt = cfg.gpt
    lines = [f"largest GPT of width {gpt.d_model} ({gpt.n_heads} heads, seq {gpt.seq_len}) that trains on one GPU:"]
    for f in found:
        setting = "with cpu_offload   " if f.cpu_offload else "states on the GPU  "
        if f.layers is None or f.params is None:
            lines.append(f"  {setting} none (not even one layer)")
            continue
        r = f.result
        measured = "n/a" if r is None or r.tokens_per_s is None else f"{r.tokens_per_s:,.0f} tokens/s"
        memory = "" if r is None or r.peak_memory_bytes is None else f", peak {r.peak_memory_bytes / 2**30:.1f} GiB"
        lines.append(f"  {setting} {f.layers} layers, {f.params / 1e9:.2f}B params: {measured}{memory}")
    return "\n".join(lines)


# ---------------------------------------------------------------------------------- CLI
def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    defaults = BenchConfig()
    parser.add_argument("--model", default=defaults.model, help="GPT preset (tiny, small, medium, large, xl)")
    parser.add_argument("--micro-batch", type=int, default=defaults.micro_batch)
    parser.add_argument("--steps", type=int, default=defaults.steps, help="timed optimizer steps")
    parser.add_argument("--warmup", type=int, default=defaults.warmup, help="untimed steps first (>= 1)")
    parser.add_argument("--device", choices=sorted(DEFAULT_MODES), default=defaults.device)
    parser.add_argument(
        "--devices", type=int, default=defaults.devices, help="GPUs, one rank each under torchrun (strategy modes only)"
    )
    parser.add_argument(
        "--modes", default=None, help=f"comma-separated among {','.join(MODES)}; default: all on cuda, eager on cpu"
    )
    parser.add_argument(
        "--peak-tflops", type=float, default=None, help="dense bf16 peak of a device (default: by GPU name; H100: 989)"
    )
    parser.add_argument("--lr", type=float, default=defaults.lr)
    parser.add_argument("--seed", type=int, default=defaults.seed)
    parser.add_argument("--activation-checkpointing", action="store_true", help="checkpoint every block, both loops")
    parser.add_argument("--prefetch-depth", type=int, default=None, help="MiCSStrategy(prefetch_depth=...)")
    parser.add_argument(
        "--reshard-after-forward", action="store_true", help="MiCSStrategy(reshard_after_forward=True); off by default"
    )
    parser.add_argument(
        "--cpu-offload", action="store_true", help="MiCSStrategy(cpu_offload=True) in the strategy modes (GPU only)"
    )
    parser.add_argument(
        "--find-largest",
        nargs="?",
        const="both",
        choices=sorted(SEARCHES),
        help="search the largest model (layers of the --model width) that trains on one GPU without and/or with "
        "offload, and measure each (default: both)",
    )
    parser.add_argument("--max-layers", type=int, default=defaults.max_layers, help="--find-largest stops here")
    parser.add_argument(
        "--json",
        type=Path,
        default=None,
        help=f"where to write the results (default: {DEFAULT_JSON.name} under benchmarks/results/ for a GPU run, "
        f"{CPU_JSON.name} for a CPU run, so a smoke run never overwrites a GPU measurement)",
    )
    return parser


def parse_args(argv: Optional[Sequence[str]] = None) -> tuple[BenchConfig, Path]:
    parser = build_parser()
    args = parser.parse_args(argv)
    one_gpu_comparison = args.devices == 1 and not args.cpu_offload  # the plain loop has no offload
    default_modes = DEFAULT_MODES[args.device] if one_gpu_comparison else ("strategy", "strategy-compiled")
    modes = tuple(m.strip() for m in args.modes.split(",") if m.strip()) if args.modes else default_modes
    try:
        cfg = BenchConfig(
            model=args.model,
            micro_batch=args.micro_batch,
            steps=args.steps,
            warmup=args.warmup,
            device=args.device,
            devices=args.devices,
            modes=modes,
            peak_tflops=args.peak_tflops,
            lr=args.lr,
            seed=args.seed,
            activation_checkpointing=args.activation_checkpointing,
            prefetch_depth=args.prefetch_depth,
            reshard_after_forward=args.reshard_after_forward,
            cpu_offload=args.cpu_offload,
            find_largest=args.find_largest,
            max_layers=args.max_layers,
        )
    except ValueError as error:
        parser.error(str(error))
    return cfg, args.json or (CPU_JSON if cfg.device == "cpu" else DEFAULT_JSON)


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Run, print the table, write the JSON; exit status 1 when a mode failed."""
    cfg, json_path = parse_args(argv)
    if cfg.find_largest is not None:
        found, document = run_find_largest(cfg)
        print(format_largest(cfg, found))
        json_path.parent.mkdir(parents=True, exist_ok=True)
        json_path.write_text(json.dumps(document, indent=2) + "\n")
        print(f"results: {json_path}")
        return 0 if all(f.result is not None and f.result.status == "ok" for f in found) else 1
    results, document = run(cfg)
    if int(os.environ.get("RANK", "0")) != 0:  # one table and one JSON per job: rank 0's
        return 1 if any(r.status == "error" for r in results) else 0
    print(format_table(cfg, results, document["ratios"]))
    json_path.parent.mkdir(parents=True, exist_ok=True)
    json_path.write_text(json.dumps(document, indent=2) + "\n")
    print(f"results: {json_path}")
    return 1 if any(r.status == "error" for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
