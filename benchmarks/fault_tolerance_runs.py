"""The runs of ``benchmarks/fault_tolerance.py``, one function each: it launches the run, drives its failures and
restarts, and returns its :class:`~benchmarks.fault_tolerance_logs.RunLog`.

Run (1), every no-failure run sharing the host in time slices (:func:`run_no_failure_sliced`); runs (2)-(3), a node
killed and restarted (:func:`run_ft_failure`, :func:`restart_victim`); run (4), the same failure restarted from a
checkpoint (:func:`run_restart_baseline`); run (5), run 2 without its failure (:func:`run_ft_reference`); run (6),
both methods under a failure :class:`Schedule` (:func:`run_ft_goodput`, :func:`run_restart_goodput`). What each
run measures is in the entry point's docstring; the numbers come from ``fault_tolerance_analysis``,
``fault_tolerance_trajectory`` and ``fault_tolerance_goodput``.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import subprocess
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from benchmarks.emulated_rows import last_error
from benchmarks.fault_tolerance_launch import (
    LIGHTHOUSE_PORT,
    Bench,
    RunFailed,
    expect_done,
    expect_done_or,
    kill_node,
    launch_all,
    launch_node,
    sigkill,
    start_lighthouse,
    stop_all,
    stop_group,
    watch,
)
from benchmarks.fault_tolerance_logs import NODES, RANKS_PER_NODE, VICTIM, RunLog, logged_step, read_rows
from benchmarks.fault_tolerance_worker import Job
from benchmarks.netns import RankProcess

#: Run (1): seconds each no-failure run runs at a time while the others wait stopped (:func:`run_no_failure_sliced`).
#: Short against the host's drift (other tenants come and go over tens of seconds), long against a step (0.15-0.25
#: s here): the step a stop cuts through is left out, so a slice of 3 s keeps about 12 whole steps.
SLICE_SECONDS = 3.0
#: Run (1)'s fault-tolerant collective timeout: a collective in flight when its run is stopped waits out the other
#: runs' slices (3 s each) before its peers answer, which the benchmark's usual 10 s would not always allow.
SLICED_FT_TIMEOUT_S = 60.0


@dataclass
class SlicedRun:
    """One run of run (1) while it shares the host with the others: its processes, its Lighthouse (fault
    tolerance: each run its own, stopped and resumed with it) and its log."""

    name: str
    job: Job
    nodes: dict[int, list[RankProcess]]
    lighthouse: subprocess.Popen[bytes] | None
    log: RunLog

    def processes(self) -> list[Any]:
        return [proc for procs in self.nodes.values() for proc in procs]

    def pause(self) -> None:
        """SIGSTOP every process of the run (each rank's session: the rank and anything it started), then its
        Lighthouse: what is in flight waits where it is, and nothing of this run takes CPU meanwhile."""
        _signal_sessions([*self.processes(), *([self.lighthouse] if self.lighthouse else [])], signal.SIGSTOP)

    def resume(self) -> None:
        """SIGCONT the Lighthouse first, then the ranks (whose heartbeats and quorum requests it answers)."""
        _signal_sessions([*([self.lighthouse] if self.lighthouse else []), *self.processes()], signal.SIGCONT)

    def trained(self) -> bool:
        """Whether every rank logged its first step (start-up done: imports, sharding, the first quorum)."""
        paths = [Path(self.job.log_dir) / f"node{node}.rank{rank}.jsonl"
                 for node in range(NODES) for rank in range(RANKS_PER_NODE)]
        return all(path.exists() and path.stat().st_size > 0 for path in paths)


def _signal_sessions(procs: list[Any], sig: signal.Signals) -> None:
    for proc in procs:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, sig)


def run_no_failure_sliced(bench: Bench, plan: list[tuple[str, str, dict[str, Any]]]) -> dict[str, RunLog]:
    """Run (1): every run of ``plan`` (:func:`no_failure_plan`) launched at once, each taking the host alone in
    turn for :data:`SLICE_SECONDS` while the others wait stopped (SIGSTOP), round after round until each finished.
    Each run is then measured on the same minutes of this shared host as the others, a few seconds apart: the
    drift of the other tenants' load, which moved runs made one after the other by 10-30 % here, weighs on every
    run alike. The steps each run took within its slices while every run was still going are its measurement
    (:attr:`RunLog.slices`); a step that a stop cut through is not. A run's start-up (imports, sharding, the first
    quorum) is not measured: each run is stopped once every rank logged a step, until all have."""
    started: list[SlicedRun] = []
    try:
        for index, (name, mode, fields) in enumerate(plan):
            started.append(launch_no_failure(bench, mode, index, **fields))
        deadline = time.monotonic() + bench.args.run_timeout * len(plan)  # each run gets 1 / len(plan) of the host
        waiting = list(started)
        while waiting:  # start-up: all at once; each waits stopped from its first step until every run got there
            for run in list(waiting):
                _check_running(run, deadline, "starting")
                if run.trained():
                    run.pause()
                    waiting.remove(run)
            time.sleep(0.05)
        slices: dict[str, list[tuple[float, float]]] = {run.name: [] for run in started}
        for run in started:
            run.log.slices = slices[run.name]
        rotation, paired = list(started), True
        while rotation:
            ended = False
            for run in list(rotation):
                run.resume()
                resumed = time.time()
                outcome = watch(run.nodes, min(time.monotonic() + SLICE_SECONDS, deadline))
                run.pause()
                if paired:
                    slices[run.name].append((resumed, time.time()))
                if outcome == "done":
                    rotation.remove(run)
                    ended = True
                elif outcome != "timeout":
                    expect_done(outcome, run.job, f"{run.name} without failure (time-sliced)")
                else:
                    _check_running(run, deadline, "training")
            paired = paired and not ended  # later rounds are no comparison of every run: one has ended
        return {name: run.log for (name, _, _), run in zip(plan, started)}
    finally:
        for run in started:
            run.resume()  # a stopped process does not act on SIGTERM
        bench.cluster.stop_all([proc for run in started for proc in run.processes()])
        for run in started:
            if run.lighthouse is not None:
                bench.cluster.stop(run.lighthouse)


def _check_running(run: SlicedRun, deadline: float, doing: str) -> None:
    """Raise :class:`RunFailed` (with the ranks' last errors) if a rank of ``run`` failed or ``deadline`` passed."""
    failed = [(node, code) for node, procs in run.nodes.items() for code in (proc.poll() for proc in procs)
              if code not in (None, 0)]
    if failed:
        expect_done(f"failed: node {failed[0][0]} exited with {failed[0][1]}", run.job,
                    f"{run.name} without failure, {doing}")
    if time.monotonic() >= deadline:
        expect_done("timeout", run.job, f"{run.name} without failure, still {doing} at the deadline")


def launch_no_failure(bench: Bench, mode: str, index: int, name: str = "",
                      ft_options: dict[str, Any] | None = None) -> SlicedRun:
    """Launch one run of run (1): plain MiCS or fault tolerance, no failure; every rank saves its parameter shards
    at the end. Fault tolerance gets a Lighthouse of its own (port ``index`` above the benchmark's), which wants all
    3 groups, and a start barrier that holds every group before the first quorum.
    ``name``: the run's directory (default ``<mode>-no-failure``); ``ft_options``: FaultTolerance options other
    than its defaults (a labelled section's run; none for the headline's)."""
    name = name or f"{mode}-no-failure"
    fields: dict[str, Any] = {"save_params": True, "digests": True, "ft_options": dict(ft_options or {})}
    lighthouse = None
    if mode == "ft":
        address, lighthouse = start_lighthouse(bench, NODES, LIGHTHOUSE_PORT + 10 + index)
        fields |= {"lighthouse": address, "start_barrier": str(bench.work / f"{name}-barrier")}
        Path(fields["start_barrier"]).mkdir()
    job = replace(bench.job(name, mode, bench.args.no_failure_steps, **fields), timeout=SLICED_FT_TIMEOUT_S)
    log = RunLog(job.log_dir, job.log_dir, time.time())
    return SlicedRun(name, job, launch_all(bench, job), lighthouse, log)


def run_no_failure(bench: Bench, mode: str, name: str = "", ft_options: dict[str, Any] | None = None) -> RunLog:
    """One run of run (1) alone on the host, not time-sliced (for A/B experiments)."""
    run = launch_no_failure(bench, mode, 0, name, ft_options)
    try:
        expect_done(watch(run.nodes, time.monotonic() + bench.args.run_timeout), run.job, f"{mode} without failure")
    finally:
        stop_all(bench, run.nodes)
        if run.lighthouse is not None:
            bench.cluster.stop(run.lighthouse)
    return run.log


def run_ft_failure(bench: Bench, name: str = "ft-failure", ft_options: dict[str, Any] | None = None,
                   port_offset: int = 1) -> RunLog:
    """Runs (2) and (3): fault tolerance, node 2 SIGKILLed at ``--kill-at-step`` and started again (as the
    first time: ``ckpt_path="last"``) ``--restart-delay`` seconds later; every rank logs its shard digests.
    ``ft_options``: other than the defaults (the ``exact_trajectory`` section's run)."""
    args = bench.args
    address, lighthouse = start_lighthouse(bench, 2, LIGHTHOUSE_PORT + port_offset)  # fewest groups that may train
    barrier = bench.work / f"{name}-barrier"
    barrier.mkdir()
    job = bench.job(name, "ft", args.steps, lighthouse=address, digests=True, start_barrier=str(barrier),
                    checkpoint_dir=str(bench.work / f"{name}-checkpoints"), checkpoint_every=args.checkpoint_every,
                    record_samples=True, ft_options=dict(ft_options or {}))
    run = RunLog(name, job.log_dir, time.time())
    nodes = launch_all(bench, job)
    deadline = time.monotonic() + args.run_timeout
    try:
        outcome = watch(nodes, deadline, lambda: logged_step(job.log_dir, VICTIM, "step") >= args.kill_at_step)
        if outcome != "trigger":
            expect_done(outcome, job, "fault tolerance, before the kill")
        kill_node(bench, run, nodes[VICTIM])
        time.sleep(max(0.0, run.events["kill"] + args.restart_delay - time.time()))
        restart_victim(bench, replace(job, start_barrier=None), run, nodes, deadline)
    finally:
        stop_all(bench, nodes)
        bench.cluster.stop(lighthouse)
    return run


def restart_victim(
    bench: Bench, job: Job, run: RunLog, nodes: dict[int, list[RankProcess]], deadline: float,
    max_attempts: int = 3,
) -> None:
    """Start node 2 again (it joins a running job: no start barrier) and wait for the end. If the restarted
    group itself fails, a loop (the scheduler) starts it again, up to ``max_attempts`` times; each failure's
    last error line is kept in ``run.failures`` and the JSON."""
    for attempt in range(max_attempts):
        port = bench.next_port()
        nodes[VICTIM] = launch_node(bench, job, VICTIM, port)
        run.events["restart" if attempt == 0 else f"restart{attempt + 1}"] = time.time()
        outcome = watch(nodes, deadline)
        if outcome == "done":
            return
        if attempt + 1 == max_attempts or not outcome.startswith(f"failed: node {VICTIM} "):
            expect_done(outcome, job, "fault tolerance, after the restart")
        reason = last_error(Path(job.log_dir) / f"node{VICTIM}.rank0.port{port}.log")
        run.failures.append(f"restart {attempt + 1} of node {VICTIM} failed: {reason}")
        print(f"    {run.failures[-1]}", flush=True)
        bench.cluster.stop_all(nodes[VICTIM])


def run_restart_baseline(bench: Bench, max_attempts: int = 4) -> RunLog:
    """Run (4): plain MiCS with checkpoints, relaunched whole from its last checkpoint by a loop whenever it
    fails; in the first attempt node 2 is SIGKILLed at the same step as in run (2). The other ranks are given
    30 s to notice (they fail in their next cross-node collective), then stopped."""
    args = bench.args
    job = bench.job("restart-baseline", "plain", args.steps, checkpoint_dir=str(bench.work / "plain-checkpoints"),
                    checkpoint_every=args.checkpoint_every)
    run = RunLog("restart-baseline", job.log_dir, time.time())
    deadline = time.monotonic() + args.run_timeout
    for attempt in range(max_attempts):
        nodes = launch_all(bench, job)
        try:
            trigger = None if attempt else (lambda: logged_step(job.log_dir, VICTIM) >= args.kill_at_step)
            outcome = watch(nodes, deadline, trigger)
            if outcome == "done":
                return run
            if outcome == "trigger":
                kill_node(bench, run, nodes.pop(VICTIM))
                watch(nodes, time.monotonic() + 30)
                run.events["job_down"] = time.time()
                time.sleep(max(0.0, run.events["kill"] + args.restart_delay - time.time()))
            elif outcome == "timeout":
                expect_done(outcome, job, "plain MiCS with restarts")
        finally:
            stop_all(bench, nodes)
        run.events[f"restart{attempt + 1}" if attempt else "restart"] = time.time()
    raise RunFailed(f"plain MiCS with restarts did not finish in {max_attempts} attempts: {job.log_dir}")


def run_ft_reference(bench: Bench, name: str = "ft-reference", ft_options: dict[str, Any] | None = None,
                     port_offset: int = 2) -> RunLog:
    """Run (5): run 2 without its failure -- fault tolerance, as many steps, the same seed, data, checkpoints
    and Lighthouse; every rank logs its micro-steps' samples (the trajectory run 2 is held to). No digests: its
    step time is also the failure-free step the survivors' stall is counted in. ``ft_options``: as run 2's."""
    args = bench.args
    address, lighthouse = start_lighthouse(bench, 2, LIGHTHOUSE_PORT + port_offset)
    barrier = bench.work / f"{name}-barrier"
    barrier.mkdir()
    job = bench.job(name, "ft", args.steps, lighthouse=address, start_barrier=str(barrier),
                    checkpoint_dir=str(bench.work / f"{name}-checkpoints"),
                    checkpoint_every=args.checkpoint_every, record_samples=True, ft_options=dict(ft_options or {}))
    run = RunLog(name, job.log_dir, time.time())
    nodes = launch_all(bench, job)
    # two steps past: every group's records of the steps compared are written before it is stopped
    enough = (lambda: logged_step(job.log_dir, 0, "step") >= args.reference_steps + 2) if args.reference_steps else None
    try:
        outcome = watch(nodes, time.monotonic() + args.run_timeout, enough)
        if outcome != "trigger":
            expect_done(outcome, job, "fault tolerance, the reference run")
    finally:
        stop_all(bench, nodes)
        bench.cluster.stop(lighthouse)
    return run


@dataclass(frozen=True)
class Schedule:
    """The goodput runs' failures: ``failures`` kills, one every ``period`` seconds (mid-period) of a window of
    ``failures x period`` seconds that starts at the ``warmup``-th committed step; the victims in turn
    (``victims``), each started again ``restart_delay`` seconds after its kill."""

    period: float
    failures: int
    restart_delay: float
    victims: tuple[int, ...] = tuple(range(NODES - 1, -1, -1))
    warmup: int = 3

    @property
    def window(self) -> float:
        return self.period * self.failures

    def kills(self) -> list[tuple[float, int]]:
        """(seconds from the window's start, node) of every kill."""
        return [((k + 0.5) * self.period, self.victims[k % len(self.victims)]) for k in range(self.failures)]


def schedule_of(args: argparse.Namespace) -> Schedule:
    return Schedule(args.goodput_period, args.goodput_failures, args.restart_delay)


def wait_for_window(run: RunLog, job: Job, nodes: dict[int, list[RankProcess]], warmup: int,
                    deadline: float) -> float:
    """Block until node 0 logged its ``warmup + 1``-th step line; that line's time (the window's start)."""
    def started() -> bool:
        path = Path(job.log_dir) / "node0.rank0.jsonl"
        return path.exists() and sum(line.endswith("}") for line in path.read_text().splitlines()) > warmup

    expect_done_or(watch(nodes, deadline, started), "trigger", job, f"{run.name}, before the window")
    rows = [r for r in read_rows(run) if r["node"] == 0]
    run.events["window_start"] = rows[warmup]["t"]
    return rows[warmup]["t"]


def run_ft_goodput(bench: Bench, schedule: Schedule) -> RunLog:
    """Run (6), fault tolerance: the groups in turn SIGKILLed on ``schedule`` and each started again (as the
    first time, ``ckpt_path="last"``: it heals from the live groups) ``restart_delay`` s later; checkpoints as
    in run 2. A restarted group that fails by itself is started again at once (``run.failures``). Every rank
    is stopped at the window's end; ``max_steps`` is out of reach."""
    args = bench.args
    address, lighthouse = start_lighthouse(bench, 1, LIGHTHOUSE_PORT + 3)
    barrier = bench.work / "ft-goodput-barrier"
    barrier.mkdir()
    job = bench.job("ft-goodput", "ft", 100_000, lighthouse=address, start_barrier=str(barrier),
                    checkpoint_dir=str(bench.work / "ft-goodput-checkpoints"),
                    checkpoint_every=args.checkpoint_every, record_samples=True)
    rejoin = replace(job, start_barrier=None)
    run = RunLog("ft-goodput", job.log_dir, time.time())
    nodes = launch_all(bench, job)
    deadline = time.monotonic() + args.run_timeout + schedule.window
    try:
        start = wait_for_window(run, job, nodes, schedule.warmup, deadline)
        pending: list[tuple[float, str, int]] = sorted(
            [(start + at, "kill", node) for at, node in schedule.kills()]
            + [(start + at + schedule.restart_delay, "restart", node) for at, node in schedule.kills()]
        )
        end = start + schedule.window
        while True:
            due = [event for event in pending if event[0] <= time.time()]
            for event in due:
                pending.remove(event)
                _, action, node = event
                count = sum(name.startswith(action) for name in run.events)
                if action == "kill":
                    sigkill(bench, nodes.pop(node, []))
                else:
                    nodes[node] = launch_node(bench, rejoin, node, bench.next_port())
                run.events[f"{action}{count + 1}.node{node}"] = time.time()
            if time.time() >= end:
                break
            for node, procs in list(nodes.items()):
                codes = [proc.poll() for proc in procs]
                if any(code is not None for code in codes):  # a group failed (or ended) by itself: again
                    reason = last_error(max(Path(job.log_dir).glob(f"node{node}.rank0.port*.log"),
                                             key=lambda path: path.stat().st_mtime))
                    run.failures.append(f"node {node} exited ({codes}) at {time.time() - start:.1f} s: {reason}")
                    print(f"    {run.failures[-1]}", flush=True)
                    stop_group(bench, procs)
                    nodes[node] = launch_node(bench, rejoin, node, bench.next_port())
            if time.monotonic() > deadline:
                raise RunFailed(f"fault tolerance under the goodput schedule ran past its deadline: {job.log_dir}")
            time.sleep(0.05)
        run.events["window_end"] = end
    finally:
        stop_all(bench, nodes)
        bench.cluster.stop(lighthouse)
    return run


def run_restart_goodput(bench: Bench, schedule: Schedule) -> RunLog:
    """Run (6) without fault tolerance: plain MiCS with checkpoints every ``--checkpoint-every`` steps, a node
    SIGKILLed on ``schedule`` (whatever the job is doing then: training or starting again); the others are
    given 30 s to notice, then stopped, and the whole job is started again from its last checkpoint
    ``restart_delay`` s after the kill (or once it is down, if later). A failure by itself also restarts it.
    After the window the job runs on until the attempt then current logged a step (what its progress at the
    window's end was: the checkpoint it resumed from), then everything is stopped."""
    args = bench.args
    job = bench.job("restart-goodput", "plain", 100_000, checkpoint_dir=str(bench.work / "plain-goodput-checkpoints"),
                    checkpoint_every=args.checkpoint_every)
    run = RunLog("restart-goodput", job.log_dir, time.time())
    deadline = time.monotonic() + args.run_timeout + schedule.window
    nodes = launch_all(bench, job)
    run.events["launch1"] = run.started
    try:
        start = wait_for_window(run, job, nodes, schedule.warmup, deadline)
        kills = [(start + at, node) for at, node in schedule.kills()]
        end = start + schedule.window
        while True:
            if kills and time.time() >= kills[0][0]:
                _, node = kills.pop(0)
                sigkill(bench, nodes.pop(node))
                killed = time.time()
                run.events[f"kill{schedule.failures - len(kills)}.node{node}"] = killed
                watch(nodes, time.monotonic() + 30)
                stop_all(bench, nodes)
                time.sleep(max(0.0, killed + schedule.restart_delay - time.time()))
                nodes = launch_all(bench, job)
                run.events[f"launch{sum(name.startswith('launch') for name in run.events) + 1}"] = time.time()
                continue
            outcome = watch(nodes, time.monotonic() + 0.2)
            if outcome.startswith("failed") or outcome == "done":
                run.failures.append(f"the job {outcome} at {time.time() - start:.1f} s")
                stop_all(bench, nodes)
                nodes = launch_all(bench, job)
                run.events[f"launch{sum(name.startswith('launch') for name in run.events) + 1}"] = time.time()
            if time.time() >= end:
                break
            if time.monotonic() > deadline:
                raise RunFailed(f"plain MiCS under the goodput schedule ran past its deadline: {job.log_dir}")
        run.events["window_end"] = end
        launched = max(t for name, t in run.events.items() if name.startswith("launch"))
        logged = lambda: any(r["t"] > launched and r["node"] == 0 for r in read_rows(run))  # noqa: E731
        if not logged():
            watch(nodes, min(deadline, time.monotonic() + 120), logged)
    finally:
        stop_all(bench, nodes)
    return run
