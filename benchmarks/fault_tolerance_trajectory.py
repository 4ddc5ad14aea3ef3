"""``trajectory.*`` of ``benchmarks/fault_tolerance.py``: whether a run with failures read the same global batch at
every committed step as the run without, and how far their losses drift apart.

From the micro-step records every rank writes (:func:`~benchmarks.fault_tolerance_logs.read_sample_records`). Which
attempts of a step committed (:func:`committed_records`) is the delicate part: a group killed between its commit and
its commit line counts as its quorum decided. :func:`trajectory_section` and :func:`goodput_trajectory` are the
sections of the JSON built on :func:`trajectory_results`.
"""

from __future__ import annotations

import argparse
import statistics
from typing import Any

from benchmarks.fault_tolerance_logs import RunLog, read_sample_records

#: ``trajectory.final_loss_rel_diff``: the mean loss over this many last steps, with failures against without.
FINAL_LOSS_STEPS = 20


def committed_records(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The records of committed attempts of steps, with this group in the step's quorum (a group outside it --
    ``participant`` ``None`` -- trains nothing: its gradient is not summed). An attempt is one process's
    consecutive micro-steps of one step (micro 0 onwards); it committed when the commit line after it says so
    (or, in records written before those lines existed, its last record). An attempt with neither -- its process
    was killed between its group's commit and its own line, or stopped at the end -- committed when an attempt of
    another group at the same step, in a quorum of as many groups, did: a step commits in all of its quorum's
    groups or in none."""
    attempts: list[tuple[list[dict[str, Any]], list[bool | None]]] = []
    previous: tuple[Any, ...] | None = None
    for record in records:
        process = (record["node"], record["rank"], record.get("pid"))
        if "commit" in record:  # the outcome of this process's attempt of that step
            if attempts and previous == (process, record["step"]):
                attempts[-1][1][0] = record["commit"]
            continue
        if previous is None or process != previous[0] or record["step"] != previous[1] or record["micro"] == 0:
            attempts.append(([], [None]))
        attempts[-1][0].append(record)
        if record.get("committed") is not None:
            attempts[-1][1][0] = record["committed"]
        previous = (process, record["step"])
    committed_by = {(rows[0]["step"], rows[0].get("participants"), rows[0]["node"])
                    for rows, outcome in attempts if outcome[0] is True}
    out: list[dict[str, Any]] = []
    for rows, outcome in attempts:
        first = rows[0]
        done = outcome[0]
        if done is None:
            done = any(step == first["step"] and live == first.get("participants") and node != first["node"]
                       for step, live, node in committed_by)
        if done:
            out.extend(r for r in rows if r.get("participant") is not None)
    return out


def step_samples(records: list[dict[str, Any]]) -> dict[int, list[int]]:
    """Committed step -> every sample index trained in it (all groups, ranks and micro-steps; a sample read
    twice appears twice)."""
    out: dict[int, list[int]] = {}
    for record in committed_records(records):
        out.setdefault(record["step"], []).extend(record["samples"])
    return out


def step_losses(records: list[dict[str, Any]]) -> dict[int, float]:
    """Committed step -> its training loss: the mean over its samples (each rank's loss is the mean over its
    own samples of the micro-batch -- or, with ``share_losses``, of each share's -- so weighted by their count),
    summed exactly (``math.fsum``): the same losses give the same mean whichever group logged which."""
    import math

    terms: dict[int, list[float]] = {}
    counts: dict[int, int] = {}
    for record in committed_records(records):
        n = len(record["samples"])
        losses = record.get("share_losses") or [record["loss"]]
        terms.setdefault(record["step"], []).extend(loss * (n / len(losses)) for loss in losses)
        counts[record["step"]] = counts.get(record["step"], 0) + n
    return {step: math.fsum(terms[step]) / count for step, count in counts.items() if count}


def trajectory_results(reference: list[dict[str, Any]], run: list[dict[str, Any]],
                       max_steps: int | None = None) -> dict[str, Any]:
    """A run's committed steps against a failure-free reference's (both: micro-step records), over the steps
    0..N-1 that both reached (N: the fewer steps of the two, at most ``max_steps``):

    * ``samples_skipped`` / ``samples_repeated``: over those steps, how many sample reads the reference made
      that the run did not / the run made that the reference did not (per sample index: its count in the run
      minus its count in the reference; a step the run has no record of skips all its samples);
    * ``steps_differing``: steps whose samples (as a multiset) are not the reference's same step's;
    * ``global_batch_constant``: every step of both read the same number of samples;
    * ``max_loss_diff``: the largest |per-step loss difference| (``step_losses``), at ``max_loss_diff_step``;
    * ``final_loss_rel_diff``: |mean loss of the last :data:`FINAL_LOSS_STEPS` steps compared, run - reference| over
      the reference's (``final_loss_steps``: the first and last of them);
      ``first_step_loss_differs`` / ``first_step_loss_diff_over_1e-3``: where it first is > 0 / > 1e-3 (the same
      samples summed in another order differ in fp32's last bits, and training amplifies that step by step).
    """
    from collections import Counter

    ref, got = step_samples(reference), step_samples(run)
    ref_loss, got_loss = step_losses(reference), step_losses(run)
    last = min(max(ref, default=-1), max(got, default=-1), max_steps - 1 if max_steps is not None else float("inf"))
    steps = range(int(last) + 1)
    ref_counts: Counter[int] = Counter()
    got_counts: Counter[int] = Counter()
    differing = 0
    for step in steps:
        mine, theirs = Counter(got.get(step, [])), Counter(ref.get(step, []))
        ref_counts.update(theirs)
        got_counts.update(mine)
        differing += mine != theirs
    sizes = {len(ref.get(step, [])) for step in steps} | {len(got.get(step, [])) for step in steps}
    diffs = {step: abs(got_loss[step] - ref_loss[step]) for step in steps if step in got_loss and step in ref_loss}
    final = sorted(diffs)[-FINAL_LOSS_STEPS:]
    final_ref = statistics.fmean(ref_loss[step] for step in final) if final else None
    worst = max(diffs, key=diffs.__getitem__, default=None)
    return {
        "samples_skipped": sum((ref_counts - got_counts).values()),
        "samples_repeated": sum((got_counts - ref_counts).values()),
        "steps_differing": differing,
        "global_batch_constant": bool(steps) and len(sizes) == 1,
        "global_batch": sorted(sizes)[0] if len(sizes) == 1 else sorted(sizes),
        "steps_compared": len(steps),
        "max_loss_diff": diffs[worst] if worst is not None else None,
        "max_loss_diff_step": worst,
        "first_step_loss_differs": next((step for step in sorted(diffs) if diffs[step] > 0), None),
        "first_step_loss_diff_over_1e-3": next((step for step in sorted(diffs) if diffs[step] > 1e-3), None),
        "steps_with_loss_compared": len(diffs),
        "final_loss_rel_diff": (abs(statistics.fmean(got_loss[step] for step in final) - final_ref) / abs(final_ref)
                                if final_ref else None),
        "final_loss_steps": [final[0], final[-1]] if final else None,
        "micro_steps_recorded": len(run),
        "micro_steps_committed": len(committed_records(run)),
        "micro_batches_reloaded": sum(max((r.get("reloaded", 0) for r in run if (r["node"], r["rank"], r.get("pid"))
                                           == process), default=0)
                                      for process in {(r["node"], r["rank"], r.get("pid")) for r in run}),
    }


def trajectory_section(reference: list[dict[str, Any]], failure: RunLog, args: argparse.Namespace,
                       compared: str = "run 2 (a group killed at --kill-at-step and restarted) against run 5 (no "
                                       "failure), same seed and options") -> dict[str, Any]:
    """``trajectory.*``: run 2's committed steps against run 5's (``reference``: its sample records)."""
    return {
        **trajectory_results(reference, read_sample_records(failure.log_dir), args.reference_steps or None),
        "compared": compared,
        "reference_steps": args.reference_steps or args.steps,
    }


def goodput_trajectory(reference: list[dict[str, Any]], goodput: RunLog, args: argparse.Namespace) -> dict[str, Any]:
    """The samples the fault-tolerant goodput run read, against the reference's same steps (no losses: its
    learning-rate schedule differs, max_steps being out of reach)."""
    compare = args.reference_steps or None  # the steps the reference ran (all, but in --smoke)
    read = trajectory_results(reference, read_sample_records(goodput.log_dir), compare)
    return {key: read[key] for key in ("samples_skipped", "samples_repeated", "steps_differing",
                                       "global_batch_constant", "steps_compared")}
