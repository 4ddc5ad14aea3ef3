"""Fault tolerance on the emulated cluster: what losing a node costs with ``MiCSStrategy(fault_tolerance=...)``
and without it.

    sudo "$(command -v python)" benchmarks/fault_tolerance.py --quick     # ~20 minutes on 2 cores
    sudo "$(command -v python)" benchmarks/fault_tolerance.py --output-dir /tmp/ft

3 emulated nodes x 2 CPU ranks (:mod:`benchmarks.netns`; links shaped as in ``emulated_cluster.py``: 1/15 of
the measured gloo loopback throughput; each node's processes in a cpu cgroup of host cores / 3, so that a lost
node's CPU is not lent to the survivors and a starting node imports on its own), the Lighthouse on the switch
(a host no node's failure takes down). With fault tolerance each node is one replica group: its own
``torch.distributed`` world of 2 gloo ranks, built with ``FaultTolerance()``'s defaults -- only the Lighthouse,
the group indices and the timeouts set (``settings.fault_tolerance``) -- for every headline key. Runs of the same
GPT, data and seeds (:mod:`benchmarks.fault_tolerance_worker`):

1. no failure, plain ``mics`` (one world of 6 ranks, partition = node) and fault-tolerant: the parameters'
   largest difference, and the step-time ratio (fault-tolerant / plain, ``overhead``); with
   ``--exact-trajectory`` (the default) a run with ``exact_trajectory=True`` (``exact_trajectory.overhead``), and
   one with a quorum at every step (``variants.quorum_every_1.overhead``). These runs share the host in time
   slices: all launched at once, each runs
   alone for 3 s while the others wait stopped (SIGSTOP), round after round, so that the other tenants' load,
   which drifts over minutes, weighs on every mode alike; each run's step times are the steps inside its slices
   (``time_sliced``, and ``overhead_by_round``: how the ratio moves from one round to the next);
2. fault-tolerant, every rank of node 2 SIGKILLed once it logged step ``--kill-at-step``: seconds from the
   kill to the survivors' next committed step without it, steps discarded, the survivors' committed steps
   during the outage;
3. node 2 started again ``--restart-delay`` seconds after the kill (launched as the first time, with
   ``ckpt_path="last"``): seconds to its first committed step, and whether its model and optimizer shards
   equal the survivors' at every step both committed after the heal (a SHA-256 per rank and step);
4. the same failure without fault tolerance: plain ``mics``, ``ModelCheckpoint`` every ``--checkpoint-every``
   steps, the job killed at the same step and started again from its last checkpoint by a loop (as a job
   scheduler would) -- wall time to the final step, against run 2's (which checkpoints alike);
5. the trajectory (``trajectory.*``): fault-tolerant, no failure, as many steps as run 2 and otherwise alike
   (same seed and data); every rank of runs 2-3 and 5 logs, per micro-step, the sample indices it trained on,
   the loss and whether the step committed. From those: whether every committed step of run 2 read the same
   global batch as run 5 (``samples_skipped``, ``samples_repeated``, ``steps_differing``,
   ``global_batch_constant``) and its largest per-step training-loss difference (``max_loss_diff``; the loss of
   a step: the mean over its committed samples, from each rank's mean loss -- per share with
   ``exact_trajectory``), and the mean loss of the last 20 steps of each (``final_loss_rel_diff``); with
   ``--exact-trajectory`` (the default) runs 2 and 5 once more with ``FaultTolerance(exact_trajectory=True)``: the
   ``exact_trajectory`` section;
6. goodput (``goodput.*``) under a failure schedule: a group killed every ``--goodput-period`` seconds (the
   groups in turn, ``--goodput-failures`` kills, mid-period) and started again ``--restart-delay`` s later,
   for a window of ``failures x period`` seconds from the 4th committed step -- once fault-tolerant, once
   plain ``mics`` restarted whole from its last checkpoint. Goodput: committed samples per second in the
   window over plain MiCS's failure-free rate (run 1's, for both); ``limit``: the time-weighted fraction of
   the nodes alive under the schedule (the most any method could commit), ``efficiency`` = goodput / limit;
   ``survivor_rate_while_out``: the survivors' committed samples per second while a group is out, over the
   failure-free rate (G - 1 / G on nodes with CPUs of their own).
   ``--smoke`` skips it (``{"skipped": "..."}``): the kills need minutes.

Writes ``<output-dir>/fault_tolerance.json`` (nested objects: ``{"no_failure": {"max_abs_diff": ...}, ...}``)
and ``fault_tolerance.png`` (committed step over time, both failure runs, kill and restart marked). Every
process started is killed and the namespaces are removed on every exit (errors, Ctrl-C, SIGTERM).
"""

# This file is the entry point: the command line (parse_args), which runs to make and which numbers each section
# of the JSON takes from them (measure), and the report written at the end (benchmark, main). The docstring above
# is --help's text, so the rest of the benchmark is named here, one module per concern:
#   fault_tolerance_logs.py        the cluster's shape, a run's record (RunLog), the readers of the ranks' logs
#   fault_tolerance_launch.py      starting and stopping ranks and Lighthouses (Bench, launch_node, watch, ...)
#   fault_tolerance_runs.py        runs (1)-(6), one function each, and the goodput runs' failure Schedule
#   fault_tolerance_analysis.py    step times, no_failure.*, failure.*, rejoin.*
#   fault_tolerance_trajectory.py  trajectory.*: the samples and losses against the failure-free run
#   fault_tolerance_goodput.py     goodput.*
#   fault_tolerance_report.py      the plot and the printed table
#   fault_tolerance_worker.py      one rank of any run

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import os
import platform
import shutil
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: make `benchmarks`, `examples` and `lightning_mics` importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.emulated_network import add_link_arguments, link_request, set_up_network
from benchmarks.fault_tolerance_analysis import (
    failure_results,
    median_step_seconds,
    no_failure_results,
    rejoin_results,
    seconds_to_final_step,
    variant_overhead,
)
from benchmarks.fault_tolerance_goodput import failure_free_rate, goodput_results
from benchmarks.fault_tolerance_launch import MODEL, Bench, RunFailed, lighthouse_binary
from benchmarks.fault_tolerance_logs import NODES, RANKS_PER_NODE, VICTIM, RunLog, read_sample_records, relative
from benchmarks.fault_tolerance_report import draw_timeline, markdown_table
from benchmarks.fault_tolerance_runs import (
    run_ft_failure,
    run_ft_goodput,
    run_ft_reference,
    run_no_failure_sliced,
    run_restart_baseline,
    run_restart_goodput,
    schedule_of,
)
from benchmarks.fault_tolerance_trajectory import goodput_trajectory, trajectory_section
from benchmarks.netns import REPO_ROOT, EmulatedCluster, PrerequisiteError, check_prerequisites, prepare_host
from benchmarks.scenarios import ClusterShape, TrainingSetup

RESULTS_DIR = REPO_ROOT / "benchmarks" / "results"


@dataclass(frozen=True)
class Preset:
    """Run lengths of a mode: long enough after the kill for the restarted node to start (imports, ~20-40 s on
    a busy 2-core host) and train with the others before the end."""

    no_failure_steps: int
    steps: int
    kill_at_step: int
    checkpoint_every: int
    restart_delay: float
    probe_seconds: float
    run_timeout: float
    goodput_period: float  #: seconds between two kills of the goodput runs
    goodput_failures: int  #: kills in the goodput window (0: no goodput runs)
    #: the reference run (5) is stopped once it committed this many steps (0: it runs all ``steps``); its
    #: learning-rate schedule is still that of ``steps``, so the steps it did compare
    reference_steps: int = 0


FULL = Preset(no_failure_steps=400, steps=300, kill_at_step=70, checkpoint_every=25, restart_delay=20.0,
              probe_seconds=3.0, run_timeout=900.0, goodput_period=90.0, goodput_failures=4)
QUICK = Preset(no_failure_steps=300, steps=200, kill_at_step=35, checkpoint_every=10, restart_delay=10.0,
               probe_seconds=1.0, run_timeout=400.0, goodput_period=40.0, goodput_failures=3)
#: The main path in about two minutes (what the test suite runs): every run, the kill and the rejoin, few steps.
#: No goodput runs (a kill schedule needs minutes), and the trajectory compared over the first 30 steps only (the
#: kill and the outage, not the rejoin): the test suite's smoke run has 300 s.
SMOKE = Preset(no_failure_steps=6, steps=100, kill_at_step=8, checkpoint_every=5, restart_delay=2.0,
               probe_seconds=0.5, run_timeout=240.0, goodput_period=0.0, goodput_failures=0, reference_steps=30)
#: ``--smoke``'s steps with the fork server (its default): the restarted node forks in a second instead of importing
#: for ~15 s and joins at the quorum of step 20 or 30 (measured on a loaded host: 21, 21, 31), its shards current
#: a step later; 70 steps leave it three more quorums' margin and 40 steps to be compared on. Fresh processes
#: keep :data:`SMOKE`'s 100.
SMOKE_FORKED_STEPS = 70
#: ``--node-start``'s choices: how every node's ranks start (``parse_args`` says what each means).
NODE_STARTS = ("fresh", "forked")
#: ``FaultTolerance``'s options the benchmark sets itself in every fault-tolerant run: where the Lighthouse is, the
#: group's indices and the timeouts. Every other option of the headline runs is the default.
FT_SET_BY_BENCHMARK = ("lighthouse", "replica_group", "num_replica_groups", "timeout", "quorum_timeout")
#: The ``exact_trajectory`` section's runs: the one option it changes.
EXACT = {"exact_trajectory": True}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="shorter runs: the whole benchmark in about 20 minutes")
    parser.add_argument("--smoke", action="store_true",
                        help="the main path with few steps, about 3 minutes: checks that it runs, measures nothing")
    parser.add_argument("--output-dir", type=Path, default=RESULTS_DIR, help="where fault_tolerance.json/.png go")
    parser.add_argument("--steps", type=int, help="optimizer steps of the failure runs (quick: 200, default 300)")
    parser.add_argument("--no-failure-steps", type=int, help="steps of each no-failure run (quick: 300, default 400)")
    parser.add_argument("--kill-at-step", type=int,
                        help="kill node 2 half a step after it logged this step (quick: 35, default 70)")
    parser.add_argument("--checkpoint-every", type=int, help="ModelCheckpoint interval in steps (quick: 10, 25)")
    parser.add_argument("--restart-delay", type=float,
                        help="seconds from the kill to the node's restart (quick: 10, default 20)")
    parser.add_argument("--goodput-period", type=float,
                        help="goodput runs: seconds between two kills (quick: 40, default 90)")
    parser.add_argument("--goodput-failures", type=int,
                        help="goodput runs: kills in the window of failures x period seconds (quick: 3, default "
                        "4, smoke: 0); 0 skips the goodput runs")
    parser.add_argument("--ft-timeout", type=float, default=5.0,
                        help="FaultTolerance(timeout=...): how long a survivor's hop 2 waits for a dead peer (5 s)")
    parser.add_argument("--batch-size", type=int, default=4, help="samples per rank per step (default 4)")
    parser.add_argument("--checkpoints", choices=("async", "sync"), default="async",
                        help="how the runs that checkpoint write (MiCSStrategy(async_save=...)); default async: a "
                        "save then stalls training for the copy only, which keeps the saves out of the survivors' "
                        "stall while a group heals")
    parser.add_argument("--only", choices=("all", "rejoin", "no_failure", "trajectory", "goodput"), default="all",
                        help="rejoin: runs 2-3 only (a node killed and restarted): the failure and rejoin numbers, "
                        "in about two minutes (to compare heal settings); no_failure: run 1 only (the overhead); "
                        "trajectory: runs 2-3 and 5 (the failure, rejoin and trajectory numbers); goodput: runs 5 "
                        "and 6 (fault tolerance's goodput under the schedule, without the restart baseline)")
    parser.add_argument("--exact-trajectory", action=argparse.BooleanOptionalAction, default=True,
                        help="also run the exact_trajectory section: the failure and reference runs and a "
                        "no-failure run with FaultTolerance(exact_trajectory=True) (the run with a failure "
                        "bit-identical to the run without; off by default in the library); default on")
    parser.add_argument("--node-start", choices=NODE_STARTS,
                        help="how a node's ranks start (every start: the first, a replacement, a restart). fresh: a "
                        "new interpreter in the node's cpu cgroup, importing on the node's own CPU as a real node "
                        "does (the default); forked: forked from one process that imported torch and Lightning "
                        "once (benchmarks/fork_server.py), a node up in a second -- faster than a real one, for "
                        "--smoke (its default), which measures nothing")
    parser.add_argument("--fork-server", action=argparse.BooleanOptionalAction, default=None,
                        help="--fork-server: --node-start forked; --no-fork-server: --node-start fresh")
    add_link_arguments(parser)  # the emulated network's options, as emulated_cluster.py has them
    parser.add_argument("--work-dir", type=Path, help="keep every rank's log and step lines here (default: a "
                        "temporary directory, removed at the end)")
    args = parser.parse_args(argv)
    if args.work_dir is not None and args.work_dir.exists() and any(args.work_dir.iterdir()):
        parser.error(f"--work-dir {args.work_dir} is not empty: give a new or empty directory.")
    preset = SMOKE if args.smoke else QUICK if args.quick else FULL
    if args.fork_server is not None:
        aliased = "forked" if args.fork_server else "fresh"
        if args.node_start not in (None, aliased):
            parser.error(f"--{'' if args.fork_server else 'no-'}fork-server means --node-start {aliased}; "
                         f"give one of the two, not --node-start {args.node_start} with it.")
        args.node_start = aliased
    if args.node_start is None:
        args.node_start = "forked" if args.smoke else "fresh"
    args.fork_server = args.node_start != "fresh"
    if args.smoke and args.node_start == "forked" and args.steps is None:
        args.steps = SMOKE_FORKED_STEPS
    for name, value in asdict(preset).items():
        if getattr(args, name, None) is None:
            setattr(args, name, value)
    if not 0 < args.kill_at_step < args.steps:
        parser.error(f"--kill-at-step must lie between 0 and --steps ({args.steps}), got {args.kill_at_step}.")
    if min(args.checkpoint_every, args.no_failure_steps, args.batch_size) < 1 or args.restart_delay < 0:
        parser.error("--checkpoint-every, --no-failure-steps and --batch-size must be positive, --restart-delay >= 0.")
    if args.goodput_failures < 0 or (args.goodput_failures > 0 and args.goodput_period <= args.restart_delay):
        parser.error("--goodput-failures must be >= 0, and --goodput-period longer than --restart-delay.")
    setup = TrainingSetup(model=MODEL, micro_batch=args.batch_size, accumulate=1, warmup_steps=0,
                          measured_steps=args.steps)
    try:
        args.link = link_request(args, setup, args.probe_seconds)
    except ValueError as error:
        parser.error(str(error))
    return args


def check_host() -> None:
    """Refuse early with one message naming what is missing: root, ip/tc (netns.py), unshare, torchft."""
    check_prerequisites()
    if shutil.which("unshare") is None:
        raise PrerequisiteError(
            "Missing `unshare` on PATH: each emulated node's ranks get their own hostname (the node's address, "
            "which torchft advertises to the other groups); install util-linux."
        )
    if importlib.util.find_spec("torchft") is None or lighthouse_binary() is None:
        raise PrerequisiteError(
            "Missing torchft (its Manager and the torchft_lighthouse server) in this Python: "
            "pip install -e '.[ft]' and run with this environment's Python."
        )


def fault_tolerance_settings(ft_options: dict[str, Any] | None = None) -> dict[str, Any]:
    """``settings.fault_tolerance``: the options of the runs, as the worker builds them (``ft_options`` on top of
    the defaults), without what differs per group (the Lighthouse's address, the group's index), and which of them
    are not ``FaultTolerance()``'s defaults besides those the benchmark sets (``non_default``: empty for the
    headline runs)."""
    from lightning_mics import FaultTolerance

    from benchmarks.fault_tolerance_worker import QUORUM_TIMEOUT_S

    built = FaultTolerance(timeout=5.0, quorum_timeout=QUORUM_TIMEOUT_S, **(ft_options or {}))
    defaults = asdict(FaultTolerance())
    options = {name: value for name, value in asdict(built).items() if name not in ("lighthouse", "replica_group")}
    return {"options": options, "non_default": sorted(name for name, value in asdict(built).items()
                                                      if name not in FT_SET_BY_BENCHMARK and value != defaults[name])}


def no_failure_plan(args: argparse.Namespace) -> list[tuple[str, str, dict[str, Any]]]:
    """Run (1)'s runs, as (name, mode, :func:`launch_no_failure`'s keywords), all sharing the host in time slices
    (:func:`run_no_failure_sliced`): plain MiCS, fault tolerance with its defaults, ``exact_trajectory=True``
    (unless ``--no-exact-trajectory``) and a quorum at every step; ``--smoke``: plain and fault tolerance."""
    plan: list[tuple[str, str, dict[str, Any]]] = [("plain", "plain", {}), ("ft", "ft", {})]
    if args.smoke:
        return plan
    if args.exact_trajectory:
        plan.append(("ft-exact", "ft", {"name": "ft-exact-no-failure", "ft_options": EXACT}))
    return plan + [("ft-quorum-every-step", "ft", {"name": "ft-no-failure-every-step",
                                                   "ft_options": {"quorum_every": 1}})]


def no_failure_runs_by_kind(
    plan: list[tuple[str, str, dict[str, Any]]], runs: dict[str, RunLog]
) -> tuple[list[RunLog], list[RunLog], RunLog | None, list[RunLog]]:
    """:func:`no_failure_plan`'s runs that ran, sorted by what they compare, in plan order: the plain ones, the
    fault-tolerant ones as configured by default, the one with a quorum at every step (or ``None``), and the
    ``exact_trajectory`` ones -- read from each run's keywords, so the plan is the one place that names them."""
    plains, defaults, exacts, every_step = [], [], [], None
    for name, mode, fields in plan:
        run = runs.get(name)
        if run is None:
            continue
        if mode == "plain":
            plains.append(run)
        elif fields.get("ft_options") == EXACT:
            exacts.append(run)
        elif "quorum_every" in fields.get("ft_options", {}):
            every_step = run
        else:
            defaults.append(run)
    return plains, defaults, every_step, exacts


def measure(bench: Bench) -> tuple[dict[str, Any], RunLog, RunLog | None]:
    """The runs, in order, and their numbers (``--only rejoin``: runs 2-3 alone)."""
    args = bench.args
    if args.only == "rejoin":
        print("[1/1] ft-failure ...", flush=True)
        run = run_ft_failure(bench)
        (Path(run.log_dir) / "run.json").write_text(json.dumps(asdict(run)))
        # no failure-free run here: the stall is counted in this run's own median step (the outage is a few of its
        # steps, so the median is the steady step); the full benchmark uses run 5's
        rejoin = rejoin_results(run, median_step_seconds(run), args.checkpoint_every)
        rejoin["step_time_source"] = "the failure run's own median step (--only rejoin runs no failure-free run)"
        return {"failure": failure_results(run, args.steps), "rejoin": rejoin}, run, None
    schedule = schedule_of(args)
    if args.only == "trajectory":
        schedule = replace(schedule, failures=0)
    plan = no_failure_plan(args) if args.only in ("all", "no_failure") else []
    todo: list[tuple[str, Callable[[], RunLog]]] = []
    if args.only in ("all", "trajectory"):
        todo.append(("ft-failure", lambda: run_ft_failure(bench)))
    if args.only == "all":
        todo.append(("restart-baseline", lambda: run_restart_baseline(bench)))
    if args.only in ("all", "trajectory", "goodput"):
        todo.append(("ft-reference", lambda: run_ft_reference(bench)))
    exact_section = args.exact_trajectory and not args.smoke and args.only in ("all", "trajectory")
    if exact_section:  # the labelled section: the same two runs with exact_trajectory=True
        todo.append(("ft-exact-failure", lambda: run_ft_failure(bench, "ft-exact-failure", EXACT, port_offset=4)))
        todo.append(("ft-exact-reference", lambda: run_ft_reference(bench, "ft-exact-reference", EXACT,
                                                                    port_offset=5)))
    if schedule.failures > 0 and args.only in ("all", "goodput"):
        todo.append(("ft-goodput", lambda: run_ft_goodput(bench, schedule)))
    if schedule.failures > 0 and args.only == "all":
        todo.append(("restart-goodput", lambda: run_restart_goodput(bench, schedule)))
    runs: dict[str, RunLog] = {}
    steps_total = len(todo) + bool(plan)
    if plan:
        print(f"[1/{steps_total}] no failure, time-sliced: {', '.join(name for name, _, _ in plan)} ...", flush=True)
        began = time.monotonic()
        runs = run_no_failure_sliced(bench, plan)
        for run in runs.values():
            (Path(run.log_dir) / "run.json").write_text(json.dumps(asdict(run)))  # kept with --work-dir
        print(f"    {time.monotonic() - began:.0f} s; slices: " + ", ".join(
            f"{name} {len(run.slices or [])}" for name, run in runs.items()), flush=True)
    for number, (name, run) in enumerate(todo, start=1 + bool(plan)):
        print(f"[{number}/{steps_total}] {name} ...", flush=True)
        began = time.monotonic()
        runs[name] = run()
        (Path(runs[name].log_dir) / "run.json").write_text(json.dumps(asdict(runs[name])))  # kept with --work-dir
        print(f"    {time.monotonic() - began:.0f} s; events: " + ", ".join(
            f"{k} at {t - runs[name].started:.1f} s" for k, t in runs[name].events.items()), flush=True)
    no_failure, plains, every_step, exacts = None, [], None, []
    if plan:
        plains, defaults, every_step, exacts = no_failure_runs_by_kind(plan, runs)
        no_failure = no_failure_results(plains, defaults, every_step, exacts)
    variants = {"quorum_every_1": {"settings": fault_tolerance_settings({"quorum_every": 1}),
                                   **variant_overhead(plains, [every_step])}} if every_step is not None else {}
    if args.only == "no_failure":
        section = {"settings": fault_tolerance_settings(EXACT), **variant_overhead(plains, exacts)} if exacts else None
        return {"no_failure": no_failure, "exact_trajectory": section, "variants": variants}, runs["ft"], None
    reference = read_sample_records(runs["ft-reference"].log_dir)  # run 5's: runs 2 and 6 are held to it
    global_batch = NODES * RANKS_PER_NODE * args.batch_size
    if args.only == "goodput":
        free, denominator = failure_free_rate(None, runs["ft-reference"])
        goodput = goodput_results(runs["ft-goodput"], None, free, denominator, schedule, global_batch)
        goodput["trajectory"] = goodput_trajectory(reference, runs["ft-goodput"], args)
        return {"goodput": goodput}, runs["ft-goodput"], None
    failure_free_step = median_step_seconds(runs["ft-reference"])
    exact = exact_trajectory_section(runs, plains, exacts, args) if exact_section else None
    if args.only == "trajectory":
        return {
            "failure": failure_results(runs["ft-failure"], args.steps),
            "rejoin": rejoin_results(runs["ft-failure"], failure_free_step, args.checkpoint_every),
            "trajectory": trajectory_section(reference, runs["ft-failure"], args),
            "exact_trajectory": exact,
        }, runs["ft-failure"], None
    ft_seconds = seconds_to_final_step(runs["ft-failure"], args.steps)
    baseline_seconds = seconds_to_final_step(runs["restart-baseline"], args.steps)
    results = {
        "no_failure": no_failure,
        "failure": failure_results(runs["ft-failure"], args.steps),
        "rejoin": rejoin_results(runs["ft-failure"], failure_free_step, args.checkpoint_every),
        "restart_baseline": {"seconds": baseline_seconds, "events": relative(runs["restart-baseline"]),
                             "failures": runs["restart-baseline"].failures},
        "ft": {"seconds": ft_seconds, "events": relative(runs["ft-failure"]), "failures": runs["ft-failure"].failures,
               "speedup_vs_restart_baseline": baseline_seconds / ft_seconds},
    }
    results["rejoin"]["restart_attempts"] = 1 + len(runs["ft-failure"].failures)
    results["trajectory"] = trajectory_section(reference, runs["ft-failure"], args)
    results["exact_trajectory"] = exact
    results["variants"] = variants
    if schedule.failures > 0:
        free, denominator = failure_free_rate(runs["plain"], runs["ft-reference"])
        goodput = goodput_results(runs["ft-goodput"], runs["restart-goodput"], free, denominator, schedule,
                                  global_batch)
        goodput["schedule"]["checkpoint_every"] = args.checkpoint_every
        goodput["trajectory"] = goodput_trajectory(reference, runs["ft-goodput"], args)
        results["goodput"] = goodput
    else:
        results["goodput"] = {"skipped": "--goodput-failures 0 (--smoke): a failure schedule needs minutes"}
    return results, runs["ft-failure"], runs["restart-baseline"]


def exact_trajectory_section(runs: dict[str, RunLog], plains: list[RunLog], exacts: list[RunLog],
                             args: argparse.Namespace) -> dict[str, Any]:
    """The labelled ``exact_trajectory`` section: ``FaultTolerance(exact_trajectory=True)`` (not the default) --
    its failure run against its own failure-free reference (``trajectory``: bit-exact losses expected), the
    rejoin and the failure as in the headline, and its no-failure cost against plain MiCS (``overhead``)."""
    failure, reference = runs["ft-exact-failure"], runs["ft-exact-reference"]
    rejoin = rejoin_results(failure, median_step_seconds(reference), args.checkpoint_every)
    return {
        "settings": fault_tolerance_settings(EXACT),
        **variant_overhead(plains, exacts),
        "trajectory": trajectory_section(read_sample_records(reference.log_dir), failure, args,
                                         compared="the exact_trajectory failure run against its own no-failure run"),
        "failure": {key: value for key, value in failure_results(failure, args.steps).items()
                    if key in ("steps_discarded", "seconds_to_next_commit")},
        "rejoin": {key: rejoin[key] for key in ("bit_identical", "digests_compared", "survivor_stall_steps")},
    }


def work_directory(keep: Path | None) -> contextlib.AbstractContextManager[str]:
    """Where the runs' logs go: ``--work-dir`` (kept), or a temporary directory removed at the end."""
    if keep is None:
        return tempfile.TemporaryDirectory(prefix="micsft-")
    keep.mkdir(parents=True, exist_ok=True)
    return contextlib.nullcontext(str(keep))


def benchmark(args: argparse.Namespace) -> dict[str, Any]:
    """Build the cluster, shape it, run everything, write the JSON and the plot; return the report."""
    command = "python benchmarks/fault_tolerance.py " + " ".join(sys.argv[1:])
    load_before = os.getloadavg()
    started = time.monotonic()
    with EmulatedCluster(NODES, mtu=args.mtu) as cluster, work_directory(args.work_dir) as tmp:
        if args.fork_server:
            cluster.start_fork_server()  # imports while links are probed
        network = set_up_network(cluster, ClusterShape(NODES, RANKS_PER_NODE), args.link)
        bench = Bench(cluster, args, Path(tmp), cluster.add_switch_address())
        results, ft, baseline = measure(bench)
        title = (f"{NODES} nodes x {RANKS_PER_NODE} CPU ranks (gloo), one replica group per node; GPT "
                 f"{MODEL.num_params / 1e6:.2f} M params, {args.batch_size} x {MODEL.seq_len} tokens per rank; "
                 f"inter-node {network.inter_node_rate_bytes_per_s / 1e6:.0f} MB/s; node {VICTIM} SIGKILLed at "
                 f"step {args.kill_at_step}, restarted {args.restart_delay:g} s later; checkpoints every "
                 f"{args.checkpoint_every} steps")
        args.output_dir.mkdir(parents=True, exist_ok=True)
        chart = None if baseline is None else draw_timeline(
            ft, baseline, args.steps, args.output_dir / "fault_tolerance.png", title)
        cpu = cluster.cpu_settings()  # before the teardown removes the cgroups
    settings = {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items() if k != "link"}
    report = {
        **results,
        "command": command,
        "title": title,
        "settings": {**settings, "model": asdict(MODEL), "model_params": MODEL.num_params,
                     "fault_tolerance": fault_tolerance_settings(), "num_replica_groups": NODES,
                     **cpu},
        "network": asdict(network),
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "load_before": load_before,
                    "load_after": os.getloadavg()},
        "total_seconds": time.monotonic() - started,
    }
    path = args.output_dir / "fault_tolerance.json"
    path.write_text(json.dumps(report, indent=2))
    print(f"wrote {path}" + (f" and {chart}" if chart else ""))
    return report


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if not prepare_host(check_host):  # and teardown runs on SIGTERM too, as for Ctrl-C
        return 2
    print(f"load average before: {' '.join(f'{x:.2f}' for x in os.getloadavg())} on {os.cpu_count()} cores")
    try:
        report = benchmark(args)
    except KeyboardInterrupt:
        print("\ninterrupted: namespaces, links and every process started were removed", file=sys.stderr)
        return 130
    except RunFailed as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    print(f"load average after: {' '.join(f'{x:.2f}' for x in report['machine']['load_after'])}; "
          f"total {report['total_seconds']:.0f} s\n")
    print(markdown_table(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
