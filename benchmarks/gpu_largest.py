"""``gpu_throughput.py --find-largest``: the largest model (the preset's width, its number of layers searched) that
trains on one GPU without and with CPU offload, each measured at its largest.

A CUDA out-of-memory error means "does not fit" (:func:`probe_fits`); the search doubles, then bisects
(:func:`search_largest`), since each probe trains a model.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, replace
from typing import Any, Optional

import torch
import torch.distributed as dist

from benchmarks.gpu_config import MODES, SEARCHES, BenchConfig, ModeResult
from benchmarks.gpu_loops import StepWindow, train_strategy
from benchmarks.gpu_measure import release_memory, report, resolve_peak_flops, run_mode

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
