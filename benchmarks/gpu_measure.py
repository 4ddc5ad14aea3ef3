"""Running the modes of ``gpu_throughput.py`` and what they measured: one mode trained and its timing window turned
into a result (:func:`run_mode`; an error becomes a result too), MFU against the device's peak, the throughput
ratios, the table and the JSON document (:func:`report`), and :func:`run`, all modes of a run.
"""

from __future__ import annotations

import gc
import os
import platform
import sys
import traceback
import warnings
import weakref
from collections.abc import Sequence
from dataclasses import asdict
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Optional

import lightning
import torch
import torch.distributed as dist

from benchmarks.gpu_config import MODES, RATIO_PAIRS, TARGET_MFU, TARGET_RATIO, BenchConfig, Mode, ModeResult
from benchmarks.gpu_loops import TRAINERS, StepWindow
from lightning_mics.telemetry import dense_peak_flops


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
