"""What TrainingTelemetry costs the job it measures: step time with and without it, in the same run.

    python benchmarks/telemetry_cost.py                       # 2 gloo ranks on CPU
    python benchmarks/telemetry_cost.py --smoke               # the same path in seconds (measures nothing)
    python benchmarks/telemetry_cost.py --accelerator gpu --world 8 --preset small

Each rank trains the example GPT with ``MiCSStrategy`` several times in a row, alternating the variants
(no telemetry; telemetry as shipped, recording sampled steps; telemetry recording every step, i.e. its
recorder's dispatch mode on every aten op) and rotating their order each round, so slow drifts of the
machine hit all of them alike. A step's time is the wall time between two consecutive optimizer-step ends
(after a device sync), so everything the callback does -- its hooks, logging, recording -- is inside it.
The first ``--skip`` steps of each run are left out; the report is the median over the rest of all rounds.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
import warnings
from pathlib import Path
from typing import Any, Optional

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import lightning.pytorch as pl  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402

from examples.models.gpt import GPTConfig, GPTLightningModule  # noqa: E402
from lightning_mics import MiCSStrategy  # noqa: E402
from lightning_mics.telemetry import TrainingTelemetry  # noqa: E402

#: variant name -> TrainingTelemetry arguments (None: no telemetry)
VARIANTS: dict[str, Optional[dict[str, Any]]] = {
    "none": None,
    "sampled (default)": {},
    "every step": {"sample_every": 1},
}


class StepClock(pl.Callback):
    """Wall time between consecutive optimizer-step ends; syncs the device so queued work is counted."""

    def __init__(self) -> None:
        self.ends: list[float] = []

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        if pl_module.device.type == "cuda":
            torch.cuda.synchronize(pl_module.device)
        self.ends.append(time.perf_counter())

    def step_times(self, skip: int) -> list[float]:
        return [b - a for a, b in zip(self.ends[skip:], self.ends[skip + 1 :])]


def _data(args: argparse.Namespace, config: GPTConfig) -> DataLoader:
    """Random tokens, one epoch of ``steps + 1`` micro-batches a rank: the cost under test does not
    depend on them, and nothing is read from disk."""
    samples = args.micro_batch * args.world * (args.steps + 1)
    generator = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, config.vocab_size, (samples, config.seq_len + 1), generator=generator)
    return DataLoader(TensorDataset(tokens[:, :-1], tokens[:, 1:]), batch_size=args.micro_batch)


def _fit(args: argparse.Namespace, variant: Optional[dict[str, Any]], config: GPTConfig) -> list[float]:
    clock = StepClock()
    callbacks: list[pl.Callback] = [clock]
    if variant is not None:
        callbacks.append(TrainingTelemetry(peak_flops=None, prog_bar=False, **variant))
    torch.manual_seed(0)
    module = GPTLightningModule(config, warmup_steps=0)
    trainer = pl.Trainer(
        accelerator=args.accelerator, devices=args.world, strategy=MiCSStrategy(), max_steps=args.steps,
        precision=args.precision, logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, num_sanity_val_steps=0, limit_val_batches=0, callbacks=callbacks,
    )
    trainer.fit(module, train_dataloaders=_data(args, config))
    return clock.step_times(args.skip)


def _rank(rank: int, args: argparse.Namespace, port: int, out: str) -> None:
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE=str(args.world), RANK=str(rank),
        LOCAL_RANK=str(rank), NODE_RANK="0",
    )
    warnings.filterwarnings("ignore", ".*no logger configured.*")  # telemetry logs; no logger is the point
    if args.accelerator == "cpu":
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // args.world))
    config = GPTConfig.preset(args.preset) if args.preset else GPTConfig(seq_len=128, d_model=128, n_layers=4)
    times: dict[str, list[float]] = {name: [] for name in VARIANTS}
    names = list(VARIANTS)
    for round_index in range(args.rounds):
        order = names[round_index % len(names) :] + names[: round_index % len(names)]
        for name in order:
            times[name] += _fit(args, VARIANTS[name], config)
    if rank == 0:
        Path(out).write_text(json.dumps(times))
    os._exit(0)  # see tests/distributed.py: gloo's threads may race the interpreter's teardown


def report(times: dict[str, list[float]]) -> dict[str, Any]:
    """Median step time per variant and its ratio to the run without telemetry."""
    base = statistics.median(times["none"])
    rows = {}
    for name, values in times.items():
        median = statistics.median(values)
        rows[name] = {"steps": len(values), "median_ms": median * 1e3, "ratio": median / base}
    return rows


def main(args: argparse.Namespace) -> None:
    import socket
    import tempfile

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    with tempfile.TemporaryDirectory() as tmp:
        out = str(Path(tmp) / "times.json")
        mp.start_processes(_rank, args=(args, port, out), nprocs=args.world, start_method="spawn")
        times = json.loads(Path(out).read_text())
    rows = report(times)
    print_table(args, rows)


def print_table(args: argparse.Namespace, rows: dict[str, Any]) -> None:
    device = torch.cuda.get_device_name(0) if args.accelerator == "gpu" else f"CPU ({os.cpu_count()} cores)"
    print(f"telemetry cost: {args.world} ranks, {device}, {args.rounds} rounds x {args.steps} steps "
          f"(first {args.skip} of each left out), {args.preset or 'GPT d128 x 4 layers, seq 128'}")
    print(f"{'variant':<20} {'steps':>6} {'median step':>12} {'vs none':>9}")
    for name, row in rows.items():
        print(f"{name:<20} {row['steps']:>6} {row['median_ms']:>10.2f}ms {(row['ratio'] - 1) * 100:>+8.2f}%")
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "device": device, "rows": rows}, indent=2))


def _parse(argv: Optional[list[str]] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--accelerator", choices=("cpu", "gpu"), default="cpu")
    parser.add_argument("--precision", default="32-true")
    parser.add_argument("--preset", default=None, help="a GPTConfig preset (default: d_model 128, 4 layers)")
    parser.add_argument("--micro-batch", type=int, default=8)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--skip", type=int, default=5, help="warm-up steps left out of each run")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--json", default=None, help="also write the table here")
    parser.add_argument("--smoke", action="store_true",
                        help="the same path in seconds (what the tests run): 1 round of 3 steps, 1 left out, "
                             "micro-batch 2; explicit options still win")
    args = parser.parse_args(argv)
    if args.smoke:
        for name, value in SMOKE.items():
            if getattr(args, name) == parser.get_default(name):
                setattr(args, name, value)
    if min(args.world, args.micro_batch, args.rounds) < 1 or not 0 <= args.skip < args.steps - 1:
        parser.error("--world, --micro-batch and --rounds must be positive, and --skip leave at least 2 steps "
                     f"of --steps to time (got --steps {args.steps}, --skip {args.skip}).")
    return args


#: --smoke's settings: every variant's fit runs and is timed, on too few steps for the numbers to mean anything
SMOKE: dict[str, Any] = {"steps": 3, "skip": 1, "rounds": 1, "micro_batch": 2}


if __name__ == "__main__":
    main(_parse())
