"""The numbers ``benchmarks/fault_tolerance.py`` derives from the step logs of runs (1)-(5), goodput and trajectory
aside.

Step times -- in a time-sliced run only those of steps inside its slices (:func:`measured_pairs`) -- and CPU per
step; the no-failure exactness and overhead (``no_failure.*``, a labelled section's ``overhead``:
:func:`no_failure_results`, :func:`variant_overhead`); the outage after the kill (``failure.*``:
:func:`failure_results`); the rejoin and what it cost the survivors (``rejoin.*``: :func:`rejoin_results`,
:class:`SurvivorGaps`); the time to the final step (:func:`seconds_to_final_step`). Functions of the logs only
(:mod:`benchmarks.fault_tolerance_logs`), so ``tests/test_benchmark_fault_tolerance.py`` checks them on synthetic
ones.
"""

from __future__ import annotations

import itertools
import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from benchmarks.fault_tolerance_logs import (
    NODES,
    RANKS_PER_NODE,
    VICTIM,
    Row,
    RunLog,
    commits,
    median_interval,
    read_events,
    read_rows,
)
from benchmarks.fault_tolerance_runs import SLICE_SECONDS


def measured_pairs(run: RunLog, rows: list[Row], skip: int = 3) -> list[tuple[Row, Row]]:
    """One rank's consecutive lines (``rows``, in time order) whose interval is a measured step: in a time-sliced
    run (:attr:`RunLog.slices`), both lines within one slice -- the step began and ended while the run had the host,
    so a stop cut through none; else every pair after the first ``skip`` lines (warm-up)."""
    if run.slices is None:
        return list(itertools.pairwise(rows[skip:]))
    return [pair for start, end in run.slices for pair in pairs_within(rows, start, end)]


def pairs_within(rows: list[Row], start: float, end: float) -> list[tuple[Row, Row]]:
    """Consecutive lines of one rank that both fall within ``[start, end]``: the steps of one slice."""
    return [(a, b) for a, b in itertools.pairwise(rows) if start <= a["t"] and b["t"] <= end]


def step_intervals(run: RunLog, skip: int = 3) -> list[float]:
    """Node 0 rank 0's measured step times (:func:`measured_pairs`)."""
    rows = [row for row in read_rows(run) if row["node"] == 0]
    return [b["t"] - a["t"] for a, b in measured_pairs(run, rows, skip)]


def median_step_seconds(run: RunLog, skip: int = 3) -> float:
    """Median of node 0 rank 0's measured step times (:func:`measured_pairs`: the first ``skip`` left out as
    warm-up, or in a time-sliced run those within its slices)."""
    return statistics.median(step_intervals(run, skip))


def pooled_median_step_seconds(runs: list[RunLog], skip: int = 3) -> float:
    """:func:`median_step_seconds` over the step intervals of several runs together (several runs of one mode:
    a load that drifts during the benchmark weighs on every mode alike)."""
    return statistics.median([interval for run in runs for interval in step_intervals(run, skip)])


def slice_step_seconds(run: RunLog) -> list[float | None]:
    """A time-sliced run's median step time in each of its slices (``None``: no whole step in it)."""
    rows = [row for row in read_rows(run) if row["node"] == 0]
    out: list[float | None] = []
    for start, end in run.slices or []:
        intervals = [b["t"] - a["t"] for a, b in pairs_within(rows, start, end)]
        out.append(statistics.median(intervals) if intervals else None)
    return out


def ratio_by_round(plain: RunLog, other: RunLog) -> dict[str, Any] | None:
    """Round by round of a time-sliced run (1), ``other``'s median step time in its slice over plain MiCS's in
    the same round (seconds apart): how much one round's ratio moves -- the host's noise at this time scale --
    as the quartiles over the rounds. ``None`` for runs that were not time-sliced."""
    ratios = [b / a for a, b in zip(slice_step_seconds(plain), slice_step_seconds(other)) if a and b]
    if len(ratios) < 2:
        return None
    q1, q2, q3 = statistics.quantiles(ratios, n=4) if len(ratios) >= 4 else (min(ratios), statistics.median(ratios),
                                                                            max(ratios))
    return {"rounds": len(ratios), "quartiles": [q1, q2, q3]}


def cpu_seconds_per_step(run: RunLog, skip: int = 3) -> float | None:
    """CPU seconds that all ranks together spent per step (every thread of every rank's process: the
    ``time.process_time()`` of each logged line), over the steps the step times use (:func:`measured_pairs`).
    The ranks keep this host's cores busy (6 ranks on 2 cores), so a step takes as long as the CPU it needs: this
    ratio is the overhead without the wall clock's noise, and where it comes from is in each thread's CPU (the
    Lighthouse, a process of its own, is not counted: about 1 ms a step)."""
    by_rank: dict[tuple[int, int], list[dict[str, Any]]] = {}
    for row in read_rows(run, None):
        by_rank.setdefault((row["node"], row["rank"]), []).append(row)
    total = 0.0
    for rows in by_rank.values():
        pairs = measured_pairs(run, rows, skip)
        steps = sum(b["step"] - a["step"] for a, b in pairs)
        if not pairs or "cpu" not in rows[0] or steps == 0:
            return None
        total += sum(b["cpu"] - a["cpu"] for a, b in pairs) / steps
    return total


def mean_or_none(values: list[float | None]) -> float | None:
    return None if not values or any(value is None for value in values) else statistics.fmean(values)  # type: ignore[arg-type]


def max_abs_diff(plain: RunLog, ft: RunLog) -> tuple[float, float]:
    """Largest |difference| of any parameter shard: fault-tolerant vs plain (same node and rank: the same
    shard of the same partition layout), and between the fault-tolerant groups."""
    import torch

    def shards(run: RunLog, node: int, rank: int) -> dict[str, Any]:
        return torch.load(Path(run.log_dir) / f"node{node}.rank{rank}.params.pt", weights_only=True)

    to_plain = between_groups = 0.0
    for rank in range(RANKS_PER_NODE):
        group0 = shards(ft, 0, rank)
        for node in range(NODES):
            mine, reference = shards(ft, node, rank), shards(plain, node, rank)
            for name, value in mine.items():
                to_plain = max(to_plain, (value - reference[name]).abs().max().item())
                between_groups = max(between_groups, (value - group0[name]).abs().max().item())
    return to_plain, between_groups


def identical_steps(plain: RunLog, ft: RunLog) -> int:
    """How many first steps left every rank's model and optimizer shards bit-identical to plain MiCS's."""
    digests = [{(r["node"], r["rank"], r["step"]): r["digest"] for r in read_rows(run, None)} for run in (plain, ft)]
    steps = sorted({step for _, _, step in digests[0]})
    for count, step in enumerate(steps):
        if any(digests[1].get(key) != value for key, value in digests[0].items() if key[2] == step):
            return count
    return len(steps)


def no_failure_results(
    plains: list[RunLog], fts: list[RunLog], every_step: RunLog | None = None, exacts: list[RunLog] | None = None
) -> dict[str, Any]:
    """The no-failure numbers: exactness from the first plain / fault-tolerant pair, step times pooled over every
    run of a mode (each run's measured steps: :func:`measured_pairs`), with ``every_step`` the overhead of a quorum
    at every step, and with ``exacts`` (``exact_trajectory=True``'s runs) that option's overhead. Time-sliced runs
    (:func:`run_no_failure_sliced`) add how each overhead moves from one round of slices to the next
    (``overhead_by_round``, :func:`ratio_by_round`) and the slicing itself (``time_sliced``)."""
    plain, ft = plains[0], fts[0]
    to_plain, between_groups = max_abs_diff(plain, ft)
    plain_step, ft_step = pooled_median_step_seconds(plains), pooled_median_step_seconds(fts)
    plain_loss = {(r["node"], r["step"]): r["loss"] for r in read_rows(plain, None) if r["rank"] == 0}
    ft_loss = {(r["node"], r["step"]): r["loss"] for r in read_rows(ft, None) if r["rank"] == 0}
    return {"max_abs_diff": to_plain, "max_abs_diff_between_groups": between_groups, "overhead": ft_step / plain_step,
            "plain_step_seconds": plain_step, "ft_step_seconds": ft_step,
            "loss_max_abs_diff": max(abs(loss - plain_loss[key]) for key, loss in ft_loss.items()),
            "identical_steps": identical_steps(plain, ft),
            "discarded": max(row["discarded"] for row in read_rows(ft)),
            "runs_step_seconds": {"plain": [median_step_seconds(run) for run in plains],
                                  "ft": [median_step_seconds(run) for run in fts]},
            "cpu_overhead": cpu_ratio(plains, fts),
            "runs_cpu_seconds_per_step": {"plain": [cpu_seconds_per_step(run) for run in plains],
                                          "ft": [cpu_seconds_per_step(run) for run in fts]},
            **time_slicing(plain, {"ft": ft, "quorum_every_step": every_step,
                                   "exact_trajectory": exacts[0] if exacts else None})}


def time_slicing(plain: RunLog, others: dict[str, RunLog | None]) -> dict[str, Any]:
    """For a time-sliced run (1): the slices (seconds each, rounds, whole steps measured per run) and each
    overhead's quartiles over the rounds (:func:`ratio_by_round`); ``{}`` for runs made one after the other."""
    if plain.slices is None:
        return {}
    runs = {"plain": plain, **{name: run for name, run in others.items() if run is not None}}
    return {"time_sliced": {"slice_seconds": SLICE_SECONDS, "rounds": len(plain.slices),
                            "measured_steps": {name: len(step_intervals(run)) for name, run in runs.items()}},
            "overhead_by_round": {name: ratio_by_round(plain, run) for name, run in runs.items() if name != "plain"}}


def variant_overhead(plains: list[RunLog], variants: list[RunLog]) -> dict[str, Any]:
    """A labelled section's no-failure cost: its runs' step time over the same plain runs' (time-sliced with them),
    and the CPU ratio; ``{}`` without such runs."""
    if not variants:
        return {}
    step = pooled_median_step_seconds(variants)
    return {"overhead": step / pooled_median_step_seconds(plains), "step_seconds": step,
            "cpu_overhead": cpu_ratio(plains, variants),
            "runs_step_seconds": [median_step_seconds(run) for run in variants]}


def cpu_ratio(plains: list[RunLog], fts: list[RunLog]) -> float | None:
    """Fault tolerance's CPU per step over plain MiCS's (each the mean over its runs): ``no_failure.cpu_overhead``."""
    plain = mean_or_none([cpu_seconds_per_step(run) for run in plains])
    ft = mean_or_none([cpu_seconds_per_step(run) for run in fts])
    return ft / plain if plain and ft else None


def failure_results(run: RunLog, steps: int) -> dict[str, Any]:
    """Run (2)'s numbers from the survivors' (nodes 0 and 1) committed steps."""
    rows = read_rows(run)
    kill, restart = run.events["kill"], run.events["restart"]
    survivors = [commits(rows, node) for node in range(NODES) if node != VICTIM]
    resumed = [next((r["t"] for r in mine if r["t"] > kill and r["live"] < NODES), None) for mine in survivors]
    rejoined = [next((r["t"] for r in mine if r["t"] > restart and r["live"] == NODES), None) for mine in survivors]
    outage_end = max((t for t in rejoined if t is not None), default=rows[-1]["t"])
    during = [r for r in survivors[0] if kill < r["t"] <= outage_end and r["live"] < NODES]
    first = survivors[0][0]["t"]
    before = [r for r in survivors[0] if r["t"] <= kill]
    return {
        "seconds_to_next_commit": min(r["t"] for mine in survivors for r in mine if r["t"] > kill) - kill,
        "seconds_to_commit_without_lost_node": max(t - kill for t in resumed) if None not in resumed else None,
        "steps_discarded": max(row["discarded"] for row in rows if row["node"] != VICTIM),
        "survivor_steps_during_outage": len(during),
        "outage_seconds": outage_end - kill,
        "survivor_steps_per_second_during_outage": len(during) / (outage_end - kill),
        "steps_per_second_before_kill": (len(before) - 1) / (before[-1]["t"] - first) if len(before) > 1 else None,
        "killed_at_step": max(r["step"] for r in rows if r["node"] == VICTIM and r["t"] <= kill),
        "final_step": steps,
    }


def rejoin_results(run: RunLog, failure_free_step: float, checkpoint_every: int = 0) -> dict[str, Any]:
    """Run (3)'s numbers: the restarted node's first commit, its first commit with its shards current (a catch-up
    heal downloads them meanwhile; the blocking one has them at once), its digests vs the survivors' (per rank,
    at every step both committed with their shards current after the heal), and what the heal cost the
    survivors: ``survivor_stall_steps`` (:func:`survivor_stall_steps`, in ``failure_free_step`` seconds -- run 5's
    median step) and the heal step's own gap (``heal_step_stall_steps``, the survivors' saves every
    ``checkpoint_every`` steps taken out)."""
    restart = run.events["restart"]
    mine = [r for r in commits(read_rows(run), VICTIM) if r["t"] > restart]
    current = [r for r in mine if r.get("current", True)]
    compared, equal = 0, True
    for rank in range(RANKS_PER_NODE):
        rows = read_rows(run, rank)
        healed = {r["step"]: r["digest"] for r in rows
                  if r["node"] == VICTIM and r["t"] > restart and r.get("current", True)}
        for node in (n for n in range(NODES) if n != VICTIM):
            # a survivor left out of a quorum heals too: its steps before its shards are current are not compared
            peer = {r["step"]: r["digest"] for r in rows if r["node"] == node and r.get("current", True)}
            common = sorted(set(healed) & set(peer))
            compared += len(common)
            equal = equal and bool(common) and all(healed[s] == peer[s] for s in common)
    contributing = [r for r in mine if r.get("contributes", True)]
    healed_at = current[0]["t"] if current else None
    joining = [e["t"] for e in read_events(run, VICTIM) if e["t"] > restart and e["event"] == "train_start"]
    heal_began = joining[0] if joining else restart
    gaps = survivor_gaps(run, checkpoint_every)
    return {"seconds": mine[0]["t"] - restart if mine else None, "bit_identical": equal and compared > 0,
            "first_step": mine[0]["step"] if mine else None, "digests_compared": compared,
            "seconds_to_current": healed_at - restart if healed_at is not None else None,
            "steps_catching_up": current[0]["step"] - mine[0]["step"] if current and mine else None,
            "first_contributing_step": contributing[0]["step"] if contributing else None,
            "seconds_starting": heal_began - restart,
            "checkpoint_save_seconds": gaps.save_seconds,
            "failure_free_step_seconds": failure_free_step,
            "survivor_stall_steps": survivor_stall_steps(gaps.rows, restart, healed_at, failure_free_step),
            "heal_step_stall_steps": heal_step_stall_steps(gaps, mine[0]["step"] if mine else None)}


@dataclass
class SurvivorGaps:
    """Node 0's commits (``rows``) and the time between each and the one before (``gaps[i]``: before
    ``rows[i + 1]``); ``saved[i]``: whether that gap holds a checkpoint save (written after the row of a step
    that is a multiple of ``checkpoint_every``: Lightning runs ModelCheckpoint after the step logger); and
    ``save_seconds``: what a save adds to a step, from this run (median gap with a save minus without)."""

    rows: list[dict[str, Any]]
    gaps: list[float]
    saved: list[bool]
    save_seconds: float

    def corrected(self, i: int) -> float:
        """Gap ``i`` without its checkpoint save: the survivors' saves are no cost of the heal."""
        return self.gaps[i] - self.save_seconds if self.saved[i] else self.gaps[i]


def survivor_gaps(run: RunLog, checkpoint_every: int) -> SurvivorGaps:
    rows = commits(read_rows(run), 0)
    gaps = [b["t"] - a["t"] for a, b in itertools.pairwise(rows)]
    saved = [checkpoint_every > 0 and a.get("global_step", 0) % checkpoint_every == 0 for a in rows[:-1]]
    with_save = [g for g, s in zip(gaps, saved) if s]
    without = [g for g, s in zip(gaps, saved) if not s]
    excess = statistics.median(with_save) - statistics.median(without) if len(with_save) > 1 and without else 0.0
    return SurvivorGaps(rows, gaps, saved, max(excess, 0.0))


def survivor_stall_steps(rows: list[dict[str, Any]], restart: float, healed_at: float | None,
                         failure_free_step: float) -> float | None:
    """How long the survivors stood still while the restarted group healed: node 0's longest gap between two of
    its commits that spans any of [``restart`` -- the replacement's launch --, the restarted group's first commit
    with its shards current (with a catch-up heal, after its background download and replay)], in median
    failure-free step times (``failure_free_step``), minus one: 0 when no step was lost. Nothing is taken out
    (checkpoint saves and quorums that fall in the window count). ``None`` when the group never rejoined."""
    if healed_at is None or failure_free_step <= 0:
        return None
    times = [row["t"] for row in rows]
    spans = [b - a for a, b in itertools.pairwise(times) if b >= restart and a <= healed_at]
    return max(spans) / failure_free_step - 1 if spans else None


def heal_step_stall_steps(gaps: SurvivorGaps, first_step: int | None) -> float | None:
    """The heal's own cost to the survivors: node 0's gap before its commit of the step the restarted group first
    committed with it (the step whose quorum healed it), a checkpoint save taken out, in node 0's median step
    time, minus one. :func:`survivor_stall_steps` takes the longest gap anywhere while the group heals, which
    also catches steps slow for other reasons (a quorum, the joining processes' start on this host's cores)."""
    if first_step is None:
        return None
    times = [row["t"] for row in gaps.rows]
    for i, row in enumerate(gaps.rows[1:]):
        if row["step"] == first_step:
            return gaps.corrected(i) / median_interval(times) - 1
    return None


def seconds_to_final_step(run: RunLog, steps: int) -> float:
    """Launch to the first moment every node that got there had logged global step ``steps`` (a restarted node
    that never rejoined does not count; ``rejoin.seconds`` is then ``None``)."""
    rows = [r for r in read_rows(run) if r["global_step"] >= steps]
    finals = [min(r["t"] for r in rows if r["node"] == node) for node in {r["node"] for r in rows}]
    return max(finals) - run.started
