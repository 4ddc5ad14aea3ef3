"""CPU per step of hop 2's fault-tolerant sums over torchft's gloo process group, one process per replica group.

What it answers: how much CPU does ``FaultTolerance(exact_trajectory=True)``'s share-order sum cost against the
plain fault-tolerant all-reduce, per step of ``--messages`` messages (one per FSDP unit) of ``--numel`` fp32
elements each? On a host whose cores the ranks share, that CPU is step time (``docs/fault-tolerance.md``).
Each variant runs the library's own code on torchft's own ``ProcessGroupGloo``, configured as a quorum
configures it, with no Lighthouse and no training:

* ``all_reduce`` -- ``exact_trajectory=False``: one all-reduce per message (:class:`ManagedTransport`'s path);
* ``chain`` -- ``exact_trajectory=True`` with three or more groups: an all-to-all per message carrying an earlier
  message's summed slices, one all-gather for the last ones (:class:`_ShareOrderChain`);
* ``one_gather`` -- the one-all-gather sum the transport takes with two groups (:class:`_ShareOrderGather`),
  here at any group count (it moves ``(G - 1) / (2 (G - 1) / G)`` times the bytes).

Per variant: process CPU (user + system, every thread) per step, averaged over the ranks; of it, the main
thread's (``time.thread_time``: in training the main thread runs the step, so its CPU is on the step's critical
path, where gloo's own threads add up the all-reduce); and the slowest rank's wall time per step. Usage::

    python benchmarks/exact_sum_cpu.py                 # 3 groups, 5 messages of 98,304 elements, 200 steps
    python benchmarks/exact_sum_cpu.py --groups 4 --numel 1000000
    python benchmarks/exact_sum_cpu.py --smoke         # a few steps, to check it runs
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import resource
import socket
import statistics
import sys
import time
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from types import SimpleNamespace
from typing import Any

REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

VARIANTS = ("all_reduce", "chain", "one_gather")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--groups", type=int, default=3, help="replica groups, one process each (default 3)")
    parser.add_argument("--messages", type=int, default=5, help="hop-2 messages per step (default 5)")
    parser.add_argument("--numel", type=int, default=98_304, help="fp32 elements per message (default 98,304)")
    parser.add_argument("--steps", type=int, default=200, help="measured steps per variant (default 200)")
    parser.add_argument("--rounds", type=int, default=2, help="times each variant runs, interleaved (default 2)")
    parser.add_argument("--smoke", action="store_true", help="a few steps of each variant")
    parser.add_argument("--output", type=Path, help="also write the numbers here as JSON")
    args = parser.parse_args(argv)
    if args.groups < 2 or min(args.messages, args.numel, args.steps, args.rounds) < 1:
        parser.error("--groups must be at least 2; --messages, --numel, --steps and --rounds positive.")
    if args.smoke:
        args.steps, args.rounds = 5, 1
    return args


def _cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def _group(pg: Any, groups: int) -> Any:
    """A :class:`ReplicaGroup` with only what hop 2's transport reads: the process group, the quorum (every group
    live, each reading its own share) and no failure."""
    from lightning_mics.fault_tolerance.group import ReplicaGroup

    group = ReplicaGroup.__new__(ReplicaGroup)
    group.pg, group._pg_is_gloo = pg, True
    group.manager = SimpleNamespace(num_participants=lambda: groups, errored=lambda: None)
    group._holders = ([(q, 0) for q in range(groups)], 1)
    group.not_contributing = frozenset()
    group.options = SimpleNamespace(replica_group=0)
    return group


def average_in_pipeline_order(start: Callable[[Any], Any], messages: list[Any]) -> list[Any]:
    """``start(rows)`` each message in order (each start advancing the earlier ones), then flush them all and wait
    on each in order -- what :class:`~lightning_mics.hop2.pipeline.CrossReplicaPipeline` does in a step. The
    started averages."""
    started = []
    for rows in messages:
        started.append(start(rows))
        for earlier in started[:-1]:
            earlier.advance()
    for running in started:
        running.flush()
    for running in started:
        running.wait()
    return started


def _step(variant: str, group: Any, messages: list[Any], transport: Any) -> None:
    """One step's messages through ``variant``'s sum."""
    from lightning_mics.hop2.transport import _ShareOrderGather

    if variant == "one_gather":
        average_in_pipeline_order(lambda rows: _ShareOrderGather(rows, group), messages)
    elif variant == "chain":
        average_in_pipeline_order(transport.start_average, messages)
    else:
        average_in_pipeline_order(lambda rows: transport.start_average(rows[0]), messages)


def _rank(rank: int, args: argparse.Namespace, port: int, results: Any) -> None:
    import torch
    from torch.distributed import TCPStore
    from torchft.process_group import ProcessGroupGloo

    from lightning_mics.hop2.transport import ManagedTransport

    torch.set_num_threads(1)
    store = TCPStore("127.0.0.1", port, args.groups, is_master=rank == 0, wait_for_workers=False)
    pg = ProcessGroupGloo(timeout=timedelta(seconds=60))
    pg.configure(f"127.0.0.1:{port}/quorum_1", "mics_bench", rank, args.groups)
    group = _group(pg, args.groups)
    generator = torch.Generator().manual_seed(rank)
    source = [torch.randn(1, args.numel, generator=generator) for _ in range(args.messages)]
    transports = {"all_reduce": ManagedTransport(group, None), "chain": ManagedTransport(group, None, True),
                  "one_gather": None}
    measured: dict[str, list[tuple[float, float]]] = {variant: [] for variant in VARIANTS}
    for _ in range(args.rounds):
        for variant in VARIANTS:
            for _ in range(3):  # warm-up
                _step(variant, group, [rows.clone() for rows in source], transports[variant])
            pg.barrier().wait()
            cpu, wall, main = _cpu_seconds(), time.perf_counter(), time.thread_time()
            for _ in range(args.steps):
                _step(variant, group, [rows.clone() for rows in source], transports[variant])
            measured[variant].append(((_cpu_seconds() - cpu) / args.steps, (time.perf_counter() - wall) / args.steps,
                                      (time.thread_time() - main) / args.steps))
            pg.barrier().wait()
    results.put((rank, measured))
    del store


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    context = multiprocessing.get_context("spawn")
    results = context.Queue()
    port = free_port()
    ranks = [context.Process(target=_rank, args=(rank, args, port, results)) for rank in range(args.groups)]
    for process in ranks:
        process.start()
    try:
        gathered = dict(results.get(timeout=600) for _ in ranks)
    finally:
        for process in ranks:
            process.join(timeout=30)
            if process.is_alive():
                process.kill()
    print(f"{args.groups} groups, {args.messages} messages of {args.numel:,} fp32 per step, {args.steps} steps x "
          f"{args.rounds} rounds; load average {os.getloadavg()[0]:.2f} on {os.cpu_count()} cores")
    report: dict[str, Any] = {"settings": vars(args) | {"output": str(args.output)}, "variants": {}}
    base = None
    for variant in VARIANTS:
        # (process CPU, wall, main-thread CPU) per step, of every rank's every round
        measured = [run for rank in range(args.groups) for run in gathered[rank][variant]]
        cpu_ms = 1e3 * statistics.fmean(cpu for cpu, _, _ in measured)
        main_ms = 1e3 * statistics.fmean(main for _, _, main in measured)
        wall_ms = 1e3 * max(wall for _, wall, _ in measured)
        base = base or cpu_ms
        report["variants"][variant] = {"cpu_ms_per_step_per_rank": cpu_ms, "main_thread_cpu_ms_per_step_per_rank":
                                       main_ms, "slowest_wall_ms_per_step": wall_ms, "cpu_vs_all_reduce": cpu_ms / base}
        print(f"  {variant:11s} CPU {cpu_ms:7.2f} ms per step per rank ({cpu_ms / base:.2f}x all_reduce), main "
              f"thread {main_ms:6.2f} ms; slowest wall {wall_ms:7.2f} ms per step")
    if args.output is not None:
        args.output.parent.mkdir(parents=True, exist_ok=True)
        args.output.write_text(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
