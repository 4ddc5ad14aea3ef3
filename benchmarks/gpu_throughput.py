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
of the window, the same way for both loops (see :class:`~benchmarks.gpu_loops.StepWindow`). Each window includes the
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
This script deliberately imports no hydra and, of the other benchmarks, only its own modules
(``benchmarks/gpu_*.py``): the GPU machine it is meant for has torch and lightning but no hydra-core.

This file is the entry point and the command line. The modes, the run's configuration and a mode's result are
:mod:`benchmarks.gpu_config`'s; the two training loops and what they share (model, optimizer, data, timing window)
:mod:`benchmarks.gpu_loops`'s; running the modes, MFU, the table and the JSON document :mod:`benchmarks.gpu_measure`'s;
``--find-largest`` :mod:`benchmarks.gpu_largest`'s.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Optional

if __package__ in (None, ""):  # run as a script: the demo model lives in the repository's `examples`
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.gpu_config import DEFAULT_MODES, MODES, SEARCHES, BenchConfig  # noqa: E402
from benchmarks.gpu_largest import format_largest, run_find_largest  # noqa: E402
from benchmarks.gpu_measure import format_table, run  # noqa: E402

DEFAULT_JSON = Path(__file__).resolve().parent / "results" / "gpu_throughput.json"
CPU_JSON = DEFAULT_JSON.with_name("gpu_throughput_cpu.json")


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
