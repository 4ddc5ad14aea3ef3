"""What every part of ``benchmarks/fault_tolerance.py`` reads: the emulated cluster's shape, a run's record, and the
files its ranks write.

The launcher (:mod:`benchmarks.fault_tolerance_launch`, :mod:`benchmarks.fault_tolerance_runs`) reads these logs to
time its kills and to see a run train; the analysis (``fault_tolerance_analysis``, ``fault_tolerance_trajectory``,
``fault_tolerance_goodput``) and the report take every number from them. The readers live here, beside
:class:`RunLog`, so that both sides share one reading of the files :mod:`benchmarks.fault_tolerance_worker` writes:

* ``node<n>.rank<r>.jsonl``: one line per step (:func:`read_rows`, :func:`commits`, :func:`logged_step`);
* ``events.node<n>.rank0.jsonl``: what a rank did when (:func:`read_events`);
* ``samples.node<n>.rank<r>.jsonl``: per micro-step, its samples, its loss and whether its step committed
  (:func:`read_sample_records`).
"""

from __future__ import annotations

import itertools
import json
import statistics
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

NODES = 3
RANKS_PER_NODE = 2
VICTIM = NODES - 1


@dataclass
class RunLog:
    """Where a run's ranks logged, when it was launched, and its events (``time.time()``: every namespace
    shares the host's clock)."""

    name: str
    log_dir: str
    started: float
    events: dict[str, float] = field(default_factory=dict)
    failures: list[str] = field(default_factory=list)  #: restarts that failed themselves (and were retried)
    #: run (1): the stretches ``(resumed, paused)`` in which this run's processes ran while every other run of
    #: the comparison waited, up to the round in which the first run ended (:func:`run_no_failure_sliced`);
    #: ``None``: it ran alone
    slices: list[tuple[float, float]] | None = None


def relative(run: RunLog) -> dict[str, float]:
    return {name: t - run.started for name, t in run.events.items()}


Row = dict[str, Any]


def read_rows(run: RunLog, rank: int | None = 0) -> list[dict[str, Any]]:
    """Every logged line of the run (of local rank ``rank`` on every node; ``None``: all ranks), by time."""
    pattern = "node*.rank*.jsonl" if rank is None else f"node*.rank{rank}.jsonl"
    rows = [json.loads(line) for path in sorted(Path(run.log_dir).glob(pattern))
            for line in path.read_text().splitlines() if line.endswith("}")]
    return sorted(rows, key=lambda row: row["t"])


def commits(rows: list[dict[str, Any]], node: int) -> list[dict[str, Any]]:
    """Node ``node``'s lines that committed a step (the step count grew; a discarded step leaves it)."""
    out: list[dict[str, Any]] = []
    for row in rows:
        if row["node"] == node and (not out or row["step"] > out[-1]["step"]):
            out.append(row)
    return out


def logged_step(log_dir: str, node: int, key: str = "global_step") -> int:
    """The last ``key`` that node ``node``'s rank 0 logged (0 before its first step)."""
    path = Path(log_dir) / f"node{node}.rank0.jsonl"
    if not path.exists():
        return 0
    lines = path.read_text().splitlines()
    complete = [line for line in lines if line.endswith("}")]
    return int(json.loads(complete[-1])[key]) if complete else 0


def read_events(run: RunLog, node: int) -> list[dict[str, Any]]:
    """Node ``node`` rank 0's events (``events.node<n>.rank0.jsonl``, see the worker), in time order."""
    path = Path(run.log_dir) / f"events.node{node}.rank0.jsonl"
    if not path.exists():
        return []
    return sorted((json.loads(line) for line in path.read_text().splitlines() if line.endswith("}")),
                  key=lambda event: event["t"])


def read_sample_records(log_dir: str | Path) -> list[dict[str, Any]]:
    """Every rank's micro-step records (``samples.node<n>.rank<r>.jsonl``, see the worker), each file in the
    order it was written; a last line cut by a SIGKILL is left out."""
    return [json.loads(line) for path in sorted(Path(log_dir).glob("samples.node*.rank*.jsonl"))
            for line in path.read_text().splitlines() if line.endswith("}")]


def median_interval(times: list[float]) -> float:
    return statistics.median([b - a for a, b in itertools.pairwise(times)])
