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

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import itertools
import json
import os
import platform
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: make `benchmarks`, `examples` and `lightning_mics` importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.emulated_cluster import _last_error, add_link_arguments, link_request, set_up_network
from benchmarks.fault_tolerance_worker import Job
from benchmarks.netns import (
    REPO_ROOT,
    UPLINK,
    EmulatedCluster,
    PrerequisiteError,
    RankProcess,
    check_prerequisites,
    prepare_host,
    rank_environment,
)
from benchmarks.scenarios import ClusterShape, TrainingSetup
from examples.fault_tolerance_demo import kill as sigkill_session
from examples.models import GPTConfig

RESULTS_DIR = REPO_ROOT / "benchmarks" / "results"
NODES = 3
RANKS_PER_NODE = 2
VICTIM = NODES - 1
LIGHTHOUSE_PORT = 29510
MASTER_PORT_BASE = 29700


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
#: The Lighthouse's join timeout: longer than the stretch between two quorums (``quorum_every`` steps of 0.15-0.25
#: s), else a restarted group that waits for the survivors' next quorum gets one with whichever survivor asks
#: first, the others left out (docs/fault-tolerance.md). A lost group is dropped after the heartbeat timeout (2 s)
#: whatever this is.
LIGHTHOUSE_JOIN_TIMEOUT_MS = 5000
#: ``--node-start``'s choices: how every node's ranks start (``parse_args`` says what each means).
NODE_STARTS = ("fresh", "forked")
#: ``FaultTolerance``'s options the benchmark sets itself in every fault-tolerant run: where the Lighthouse is, the
#: group's indices and the timeouts. Every other option of the headline runs is the default.
FT_SET_BY_BENCHMARK = ("lighthouse", "replica_group", "num_replica_groups", "timeout", "quorum_timeout")
#: The ``exact_trajectory`` section's runs: the one option it changes.
EXACT = {"exact_trajectory": True}
#: ``trajectory.final_loss_rel_diff``: the mean loss over this many last steps, with failures against without.
FINAL_LOSS_STEPS = 20
#: The demo's tiny GPT, shorter and shallower: ~0.5 M parameters, a step of a few tenths of a second here.
MODEL = GPTConfig(seq_len=64, d_model=128, n_layers=2, n_heads=4)


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


def lighthouse_binary() -> str | None:
    beside = Path(sys.executable).parent / "torchft_lighthouse"
    return str(beside) if beside.exists() else shutil.which("torchft_lighthouse")


# ---------------------------------------------------------------------------------- launching
@dataclass
class Bench:
    """The cluster, where this benchmark's files go, and the ports handed out so far (every launch gets fresh
    ones, so that no restart waits for a port of the killed processes)."""

    cluster: EmulatedCluster
    args: argparse.Namespace
    work: Path
    lighthouse_host: str
    launches: int = 0

    def job(self, name: str, mode: str, steps: int, **fields: Any) -> Job:
        """A run's Job with its own log directory."""
        log_dir = self.work / name
        log_dir.mkdir(parents=True, exist_ok=True)
        nodes = NODES if mode == "plain" else 1
        fields.setdefault("async_save", self.args.checkpoints == "async")
        return Job(mode=mode, steps=steps, nodes=nodes, ranks_per_node=RANKS_PER_NODE, num_groups=NODES,
                   model=asdict(MODEL), batch_size=self.args.batch_size, corpus_bytes=400_000, log_dir=str(log_dir),
                   timeout=self.args.ft_timeout, **fields)

    def next_port(self) -> int:
        self.launches += 1
        return MASTER_PORT_BASE + self.launches


def launch_node(bench: Bench, job: Job, node: int, port: int) -> list[RankProcess]:
    """Start node ``node``'s ranks of ``job`` in its namespace. Each rank runs under ``unshare --uts`` with the
    node's address as hostname: the namespaces share the host's hostname otherwise (resolving to 127.0.0.1),
    and torchft advertises ``socket.gethostname()`` for its manager and checkpoint servers."""
    cluster = bench.cluster
    path = Path(job.log_dir) / f"job-node{node}-{port}.json"
    path.write_text(json.dumps(asdict(job)))
    plain = job.mode == "plain"
    master = cluster.node_address(0 if plain else node)
    address = cluster.node_address(node)
    procs = []
    for local in range(RANKS_PER_NODE):
        env = rank_environment(MASTER_ADDR=master, MASTER_PORT=str(port), WORLD_SIZE=str(RANKS_PER_NODE * job.nodes),
                               NODE_RANK=str(node if plain else 0), LOCAL_RANK=str(local), GLOO_SOCKET_IFNAME=UPLINK)
        argv = [sys.executable, "-m", "benchmarks.fault_tolerance_worker", "--job", str(path), "--node", str(node)]
        log = Path(job.log_dir) / f"node{node}.rank{local}.port{port}.log"
        with log.open("wb") as handle:
            procs.append(cluster.spawn_rank(node, argv, env, handle, hostname=address))
    return procs


def launch_all(bench: Bench, job: Job) -> dict[int, list[RankProcess]]:
    """Every node's ranks: one world on one port (plain), or one world per node on ports of its own (ft)."""
    port = bench.next_port()
    return {node: launch_node(bench, job, node, port if job.mode == "plain" else bench.next_port())
            for node in range(NODES)}


#: the Lighthouse's ``--heartbeat_timeout_ms``, in seconds: a group whose last heartbeat is older is lost
LIGHTHOUSE_HEARTBEAT_TIMEOUT_S = 2.0


def start_lighthouse(bench: Bench, min_replicas: int, port: int) -> tuple[str, subprocess.Popen[bytes]]:
    """A Lighthouse on the switch (its own host): join timeout :data:`LIGHTHOUSE_JOIN_TIMEOUT_MS`, heartbeat
    timeout 2 s, as the demo's."""
    binary = lighthouse_binary()
    assert binary is not None
    bind = f"{bench.lighthouse_host}:{port}"
    argv = [binary, "--min_replicas", str(min_replicas), "--bind", bind, "--join_timeout_ms",
            str(LIGHTHOUSE_JOIN_TIMEOUT_MS), "--heartbeat_timeout_ms", str(int(LIGHTHOUSE_HEARTBEAT_TIMEOUT_S * 1000))]
    log = (bench.work / f"lighthouse-{port}.log").open("wb")
    proc = bench.cluster.spawn_in(bench.cluster.switch_namespace, argv, stdout=log, stderr=subprocess.STDOUT)
    time.sleep(1.0)
    if proc.poll() is not None:
        raise RuntimeError(f"the Lighthouse did not start: {_last_error(Path(log.name))}")
    return f"http://{bind}", proc


class RunFailed(RuntimeError):
    """A run that should have finished did not (a rank failed or the run timed out); says which and why."""


def watch(
    nodes: dict[int, list[RankProcess]], deadline: float, trigger: Callable[[], bool] | None = None
) -> str:
    """Wait until every rank exited (``"done"``), ``trigger()`` holds (``"trigger"``), a rank failed
    (``"failed: ..."``) or ``deadline`` passed (``"timeout"``)."""
    while True:
        codes = [(node, proc.poll()) for node, procs in nodes.items() for proc in procs]
        failed = [(node, code) for node, code in codes if code not in (None, 0)]
        if failed:
            return f"failed: node {failed[0][0]} exited with {failed[0][1]}"
        if all(code == 0 for _, code in codes):
            return "done"
        if trigger is not None and trigger():
            return "trigger"
        if time.monotonic() > deadline:
            return "timeout"
        time.sleep(0.05)


def logged_step(log_dir: str, node: int, key: str = "global_step") -> int:
    """The last ``key`` that node ``node``'s rank 0 logged (0 before its first step)."""
    path = Path(log_dir) / f"node{node}.rank0.jsonl"
    if not path.exists():
        return 0
    lines = path.read_text().splitlines()
    complete = [line for line in lines if line.endswith("}")]
    return int(json.loads(complete[-1])[key]) if complete else 0


def kill_node(bench: Bench, run: RunLog, procs: list[RankProcess]) -> None:
    """SIGKILL a node's ranks (their whole process groups: a lost node, no cleanup) half a step after it logged
    the kill step -- in the middle of its next step, where a failure lands on average."""
    times = [row["t"] for row in read_rows(run) if row["node"] == VICTIM][-6:]
    if len(times) > 1:
        time.sleep(0.5 * median_interval(times))
    for proc in procs:
        sigkill_session(proc)
        bench.cluster.forget(proc)
    run.events["kill"] = time.time()


def expect_done(outcome: str, job: Job, what: str) -> None:
    if outcome != "done":
        logs = sorted(Path(job.log_dir).glob("*.log"))
        details = "; ".join(f"{log.name}: {_last_error(log)}" for log in logs)
        raise RunFailed(f"{what}: {outcome} ({details})")


def stop_all(bench: Bench, nodes: dict[int, list[RankProcess]]) -> None:
    """Every rank of every node at once (one grace period, not one per rank)."""
    bench.cluster.stop_all([proc for procs in nodes.values() for proc in procs])


# ---------------------------------------------------------------------------------- the runs
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
        reason = _last_error(Path(job.log_dir) / f"node{VICTIM}.rank0.port{port}.log")
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


def expect_done_or(outcome: str, wanted: str, job: Job, what: str) -> None:
    if outcome != wanted:
        expect_done(outcome if outcome != "done" else "ended early", job, what)


def sigkill(bench: Bench, procs: list[RankProcess]) -> None:
    for proc in procs:
        sigkill_session(proc)
        bench.cluster.forget(proc)


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
                    reason = _last_error(max(Path(job.log_dir).glob(f"node{node}.rank0.port*.log"),
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


def stop_group(bench: Bench, procs: list[RankProcess]) -> None:
    bench.cluster.stop_all(procs)


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


# ---------------------------------------------------------------------------------- analysis
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


Row = dict[str, Any]


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


def median_interval(times: list[float]) -> float:
    return statistics.median([b - a for a, b in itertools.pairwise(times)])


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
    at every step both committed after the heal, from its shards being current), and what the heal cost the
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
            peer = {r["step"]: r["digest"] for r in rows if r["node"] == node}
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


def read_events(run: RunLog, node: int) -> list[dict[str, Any]]:
    """Node ``node`` rank 0's events (``events.node<n>.rank0.jsonl``, see the worker), in time order."""
    path = Path(run.log_dir) / f"events.node{node}.rank0.jsonl"
    if not path.exists():
        return []
    return sorted((json.loads(line) for line in path.read_text().splitlines() if line.endswith("}")),
                  key=lambda event: event["t"])


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


# ---------------------------------------------------------------------------------- trajectory
def read_sample_records(log_dir: str | Path) -> list[dict[str, Any]]:
    """Every rank's micro-step records (``samples.node<n>.rank<r>.jsonl``, see the worker), each file in the
    order it was written; a last line cut by a SIGKILL is left out."""
    return [json.loads(line) for path in sorted(Path(log_dir).glob("samples.node*.rank*.jsonl"))
            for line in path.read_text().splitlines() if line.endswith("}")]


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


# ---------------------------------------------------------------------------------- goodput
def steps_per_second(rows: list[dict[str, Any]], key: str = "step", skip: int = 3) -> float | None:
    """The mean rate of a failure-free run: node 0's lines, the first ``skip`` (warm-up) left out."""
    mine = [r for r in rows if r["node"] == 0][skip:]
    if len(mine) < 2 or mine[-1]["t"] <= mine[0]["t"]:
        return None
    return (mine[-1][key] - mine[0][key]) / (mine[-1]["t"] - mine[0]["t"])


def failure_free_steps_per_second(run: RunLog, key: str = "step") -> float | None:
    """The mean rate of a failure-free run (:func:`steps_per_second`); of a time-sliced one (run 1), over the steps
    inside its slices only -- its wall clock also holds the other runs' slices, when it was stopped."""
    rows = read_rows(run)
    if run.slices is None:
        return steps_per_second(rows, key)
    pairs = measured_pairs(run, [row for row in rows if row["node"] == 0])
    seconds = sum(b["t"] - a["t"] for a, b in pairs)
    return sum(b[key] - a[key] for a, b in pairs) / seconds if seconds > 0 else None


def ft_progress(rows: list[dict[str, Any]], at: float) -> int:
    """Fault tolerance: the committed steps at time ``at`` (the most any group had logged by then)."""
    return max((r["step"] for r in rows if r["t"] <= at), default=0)


def restart_progress(rows: list[dict[str, Any]], launches: list[float], kills: list[float], at: float) -> int:
    """Restart from checkpoint: the steps done at time ``at`` that are not lost (node 0's lines, ``global_step``;
    ``launches``: when each attempt started, in order). A running attempt's last step counts; once it is killed,
    only what the next attempt resumes from (its first step minus one) does -- as does an attempt that is
    starting (it resumes from the last checkpoint)."""
    mine = [r for r in rows if r["node"] == 0]
    starts = sorted(launches)
    current = max((i for i, t in enumerate(starts) if t <= at), default=0)

    def lines_of(attempt: int) -> list[dict[str, Any]]:
        end = starts[attempt + 1] if attempt + 1 < len(starts) else float("inf")
        return [r for r in mine if starts[attempt] <= r["t"] < end]

    def resumed(attempt: int) -> int:  # what attempt ``attempt`` resumed from
        lines = lines_of(attempt) if attempt < len(starts) else []
        if lines:
            return lines[0]["global_step"] - 1
        return resumed(attempt - 1) if attempt > 0 else 0  # never logged: no new checkpoint either

    killed = any(starts[current] < k <= at for k in kills)
    done = [r for r in lines_of(current) if r["t"] <= at]
    if killed:
        return resumed(current + 1)
    return done[-1]["global_step"] if done else resumed(current)


#: The stretches of each outage in the fault-tolerant goodput run, in order (:func:`goodput_phases`).
OUTAGE_PHASES = ("detecting", "alone", "replacement_starting", "catching_up", "all_live")


def goodput_phases(run: RunLog, rows: list[dict[str, Any]], window: tuple[float, float],
                   failure_free_steps_per_second: float) -> dict[str, dict[str, float]]:
    """Where the fault-tolerant goodput run's window went, stretch by stretch of each outage: from a kill until
    the survivors commit without the lost group (``detecting``: the Lighthouse's heartbeat timeout), until its
    replacement is launched (``alone``), until the replacement's processes are set up (``replacement_starting``:
    imports and setup -- on this host they share the survivors' cores, where a real replacement brings its own),
    until it contributes (``catching_up``), and the rest (``all_live``). Per stretch: its seconds in the window,
    committed steps per second over the failure-free rate, and the share of the window's failure-free steps it
    lost (``goodput_lost``; over every stretch they add up to 1 - goodput)."""
    start, end = window
    kills = sorted((t, int(name.rsplit("node", 1)[1])) for name, t in run.events.items() if name.startswith("kill"))
    restarts = sorted(t for name, t in run.events.items() if name.startswith("restart"))
    bounds: list[tuple[float, str]] = [(start, "all_live")]
    for index, (kill, node) in enumerate(kills):
        before = ft_progress(rows, kill)
        committed = min((r["t"] for r in rows if r["t"] > kill and r["step"] > before), default=end)
        restart = next((t for t in restarts if t > kill), end)
        setup = min((e["t"] for e in read_events(run, node) if e["event"] == "train_start" and e["t"] > restart),
                    default=end)
        joined = min((r["t"] for r in rows if r["node"] == node and r["t"] > restart and r.get("contributes", True)
                      and r.get("current", True)), default=end)
        bounds += [(kill, "detecting"), (committed, "alone"), (restart, "replacement_starting"),
                   (setup, "catching_up"), (joined, "all_live")]
    bounds.sort(key=lambda bound: bound[0])
    out = {phase: {"seconds": 0.0, "steps": 0.0} for phase in OUTAGE_PHASES}
    for (begin, phase), (finish, _) in zip(bounds, bounds[1:] + [(end, "")]):
        begin, finish = max(begin, start), min(finish, end)
        if finish > begin:
            out[phase]["seconds"] += finish - begin
            out[phase]["steps"] += ft_progress(rows, finish) - ft_progress(rows, begin)
    for stretch in out.values():
        stretch["rate_vs_failure_free"] = (stretch["steps"] / stretch["seconds"] / failure_free_steps_per_second
                                           if stretch["seconds"] else None)
        stretch["goodput_lost"] = (stretch["seconds"] * failure_free_steps_per_second - stretch["steps"]) / (
            (end - start) * failure_free_steps_per_second)
    return out


def alive_fraction(run: RunLog, window: tuple[float, float]) -> float:
    """``goodput.limit``: the time-weighted fraction of the cluster's nodes alive in ``window`` under the schedule --
    each node down from its kill to its replacement's launch (``kill<k>.node<n>`` .. ``restart<k>.node<n>``), up
    again from the launch whether or not it trains yet. The most any method could commit."""
    start, end = window
    down = 0.0
    for name, kill in run.events.items():
        if name.startswith("kill"):
            restart = run.events.get("restart" + name[len("kill"):], end)
            down += max(0.0, min(restart, end) - max(kill, start))
    return 1 - down / (NODES * (end - start))


def survivor_rate_while_out(phases: dict[str, dict[str, float]], free_steps_per_second: float) -> float | None:
    """``goodput.survivor_rate_while_out``: the survivors' committed steps per second over the failure-free rate
    while a group is out -- from their first commit without it until its replacement is set up (the ``alone`` and
    ``replacement_starting`` stretches of :func:`goodput_phases`). Every step reads the whole global batch, so this
    is also the ratio of committed samples; on nodes with CPUs of their own it is about (G - 1) / G."""
    out = [phases[name] for name in ("alone", "replacement_starting")]
    seconds = sum(stretch["seconds"] for stretch in out)
    return sum(stretch["steps"] for stretch in out) / seconds / free_steps_per_second if seconds else None


def failure_free_rate(plain: RunLog | None, ft_reference: RunLog) -> tuple[float | None, str]:
    """Goodput's denominator, in steps per second: plain MiCS's failure-free rate from run 1 (time-sliced, the same
    benchmark run); only with ``--only goodput``, which runs no plain MiCS, fault tolerance's run 5."""
    if plain is not None:
        return failure_free_steps_per_second(plain, key="global_step"), "plain MiCS, no failure (run 1, time-sliced)"
    return (steps_per_second(commits(read_rows(ft_reference), 0)),
            "fault tolerance, no failure (run 5; --only goodput runs no plain MiCS)")


def goodput_results(ft: RunLog, restart: RunLog | None, free: float | None, denominator: str,
                    schedule: Schedule, global_batch: int) -> dict[str, Any]:
    """Committed samples per second over the window, for fault tolerance and for restart from checkpoint, each
    over the same failure-free rate ``free`` (steps per second, :func:`failure_free_rate`; ``denominator`` says
    whose). Also the schedule's ``limit`` (:func:`alive_fraction`),
    ``efficiency`` = goodput / limit and the survivors' rate while a group is out. ``restart``: ``None`` without its
    runs (``--only goodput``)."""
    ft_rows = read_rows(ft)
    ft_start = ft.events["window_start"]
    window = (ft_start, ft_start + schedule.window)
    ft_steps = ft_progress(ft_rows, window[1]) - ft_progress(ft_rows, ft_start)
    ft_rate = ft_steps * global_batch / schedule.window
    ft_goodput = ft_rate / (free * global_batch) if free else None
    restart_steps = restart_rate = restart_goodput = None
    if restart is not None:
        restart_rows, restart_start = read_rows(restart), restart.events["window_start"]
        launches = [t for name, t in restart.events.items() if name.startswith("launch")]
        kills = [t for name, t in restart.events.items() if name.startswith("kill")]
        restart_steps = (restart_progress(restart_rows, launches, kills, restart_start + schedule.window)
                         - restart_progress(restart_rows, launches, kills, restart_start))
        restart_rate = restart_steps * global_batch / schedule.window
        restart_goodput = restart_rate / (free * global_batch) if free else None
    limit = alive_fraction(ft, window)
    phases = goodput_phases(ft, ft_rows, window, free) if free else None
    return {
        "fault_tolerance": ft_goodput,
        "restart_from_checkpoint": restart_goodput,
        "limit": limit,
        "efficiency": ft_goodput / limit if ft_goodput is not None else None,
        "restart_efficiency": restart_goodput / limit if restart_goodput is not None else None,
        "survivor_rate_while_out": survivor_rate_while_out(phases, free) if phases and free else None,
        "survivor_rate_expected": (NODES - 1) / NODES,
        "ratio_ft_over_restart": ft_goodput / restart_goodput if ft_goodput and restart_goodput else None,
        "denominator": denominator,
        "committed_samples_per_second": {"fault_tolerance": ft_rate, "restart_from_checkpoint": restart_rate},
        "committed_steps": {"fault_tolerance": ft_steps, "restart_from_checkpoint": restart_steps},
        "failure_free_samples_per_second": free * global_batch if free else None,
        "global_batch": global_batch,
        "schedule": {"period_seconds": schedule.period, "failures": schedule.failures,
                     "window_seconds": schedule.window, "restart_delay_seconds": schedule.restart_delay,
                     "kills": [{"at_seconds": at, "node": node} for at, node in schedule.kills()],
                     "window_starts_at_step": schedule.warmup + 1,
                     },
        "events": {"fault_tolerance": relative(ft),
                   "restart_from_checkpoint": None if restart is None else relative(restart)},
        "failures": {"fault_tolerance": ft.failures,
                     "restart_from_checkpoint": None if restart is None else restart.failures},
        "fault_tolerance_phases": phases,
    }


# ---------------------------------------------------------------------------------- report
#: One marker per group, so that groups committing the same steps stay visible on top of each other.
STYLES = ({"marker": "o", "markersize": 6, "fillstyle": "none"}, {"marker": "x", "markersize": 4},
          {"marker": ".", "markersize": 4})

def draw_timeline(ft: RunLog, baseline: RunLog, steps: int, path: Path, title: str) -> Path | None:
    """Committed step over time since launch: each replica group of the fault-tolerant run (top), the plain
    job restarted from its checkpoints (bottom); kill and restarts marked."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is missing, so no plot: `pip install -e '.[bench]'`", file=sys.stderr)
        return None
    fig, axes = plt.subplots(2, 1, figsize=(10, 7), sharex=True, sharey=True)
    for axis, run, label in ((axes[0], ft, "replica group {}"), (axes[1], baseline, "the job (node {}, rank 0)")):
        rows = read_rows(run)
        for node, style in zip(range(NODES) if run is ft else [0], STYLES):
            mine = commits(rows, node) if run is ft else [r for r in rows if r["node"] == node]
            axis.plot([r["t"] - run.started for r in mine], [r["step"] for r in mine], linestyle="none",
                      label=label.format(node), **style)
        for name, t in run.events.items():
            axis.axvline(t - run.started, color="grey", linestyle="--", linewidth=1)
            axis.text(t - run.started, steps * 0.02, f" {name}", rotation=90, va="bottom", fontsize=8)
        axis.axhline(steps, color="black", linewidth=0.5)
        axis.set_ylabel("committed step" if run is ft else "global step")
        axis.legend(fontsize=8, loc="upper left")
        axis.grid(alpha=0.3)
    axes[0].set_title(textwrap.fill(title, 110), fontsize=9)
    axes[1].set_title("the same failure without fault tolerance: the job restarted from its last checkpoint",
                      fontsize=9)
    axes[1].set_xlabel("seconds since launch")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def markdown_table(results: dict[str, Any]) -> str:
    """The headline numbers, as in docs/fault-tolerance.md."""
    n, f, r = results.get("no_failure"), results.get("failure"), results.get("rejoin")
    rows = [] if n is None else [
        ("no failure: max abs diff to plain `mics`", f"{n['max_abs_diff']:.3g}"),
        ("no failure: step time, fault-tolerant / plain", (f"{n['overhead']:.3f} ({n['ft_step_seconds']:.3f} s / "
         f"{n['plain_step_seconds']:.3f} s)")),
        ("no failure: CPU per step (all ranks), fault-tolerant / plain", _num(n.get("cpu_overhead"), 3)),
    ]
    every_step = (results.get("variants") or {}).get("quorum_every_1")
    if every_step:
        rows.append(("variant `quorum_every=1`: step time / plain", _num(every_step.get("overhead"), 3)))
    by_round = (n or {}).get("overhead_by_round", {}).get("ft")
    if by_round is not None:
        rows.append((f"no failure: fault-tolerant / plain, round by round of {SLICE_SECONDS:g} s slices: quartiles",
                     " / ".join(f"{q:.3f}" for q in by_round["quartiles"]) + f" ({by_round['rounds']} rounds)"))
    if f is not None and r is not None:  # not --only no_failure / goodput
        rows += _failure_rows(f, r)
    if "restart_baseline" in results:
        rows += [
            ("seconds to the final step: restart from checkpoint", f"{results['restart_baseline']['seconds']:.1f}"),
            ("seconds to the final step: fault tolerance", f"{results['ft']['seconds']:.1f}"),
        ]
    t = results.get("trajectory")
    if t is not None:
        rows += [
            ("trajectory: samples skipped / repeated vs no failure", f"{t['samples_skipped']} / {t['samples_repeated']}"
             f" ({t['steps_compared']} steps)"),
            ("trajectory: global batch constant", f"{t['global_batch_constant']} ({t['global_batch']})"),
            ("trajectory: largest per-step loss difference", "-" if t["max_loss_diff"] is None
             else f"{t['max_loss_diff']:.3g}"),
            (f"trajectory: mean loss of the last {FINAL_LOSS_STEPS} steps, relative difference",
             "-" if t.get("final_loss_rel_diff") is None else f"{t['final_loss_rel_diff']:.2g}"),
        ]
    e = results.get("exact_trajectory")
    if e:
        rows.append(("`exact_trajectory=True`: no-failure step time / plain", _num(e.get("overhead"), 3)))
        if "trajectory" in e:
            rows += [("`exact_trajectory=True`: largest per-step loss difference, with failure vs without",
                      _num(e["trajectory"]["max_loss_diff"], 3) if e["trajectory"]["max_loss_diff"] else "0"),
                     ("`exact_trajectory=True`: survivors' stall while it healed, in steps",
                      _num(e["rejoin"]["survivor_stall_steps"], 2))]
    g = results.get("goodput", {})
    if "skipped" in g:
        rows.append(("goodput", f"skipped: {g['skipped']}"))
    elif g:
        rows += [
            ("goodput: fault tolerance (over plain MiCS's failure-free rate)", _num(g["fault_tolerance"], 3)),
            ("goodput: restart from checkpoint (the same denominator)", _num(g["restart_from_checkpoint"], 3)),
            ("goodput: fault tolerance / restart", _num(g["ratio_ft_over_restart"], 2)),
            ("goodput: limit (nodes alive under the schedule)", _num(g.get("limit"), 3)),
            ("goodput: efficiency (fault tolerance / limit)", _num(g.get("efficiency"), 3)),
            (f"goodput: survivors' rate while a group is out (expected {g.get('survivor_rate_expected', 0):.3f})",
             _num(g.get("survivor_rate_while_out"), 3)),
        ]
        phases = g.get("fault_tolerance_phases") or {}
        rows += [(f"goodput lost while {phase.replace('_', ' ')} (`{phase}`: seconds, rate vs failure-free)",
                  f"{stretch['goodput_lost']:.3f} ({stretch['seconds']:.1f} s, "
                  f"{_num(stretch['rate_vs_failure_free'], 2)})") for phase, stretch in phases.items()]
    return "\n".join(["| measure | value |", "|---|---:|", *(f"| {a} | {b} |" for a, b in rows)])


def _failure_rows(f: dict[str, Any], r: dict[str, Any]) -> list[tuple[str, str]]:
    """The table's rows of ``failure.*`` and ``rejoin.*``."""
    return [
        ("node lost: seconds from the kill to the next committed step", _num(f["seconds_to_next_commit"])),
        ("node lost: steps discarded", str(f["steps_discarded"])),
        ("node lost: survivors' committed steps during the outage", (f"{f['survivor_steps_during_outage']} in "
         f"{f['outage_seconds']:.1f} s")),
        ("rejoin: seconds from the restart to its first committed step", _num(r["seconds"])),
        ("rejoin: seconds from the restart to its shards being current (`rejoin.seconds_to_current`)",
         _num(r.get("seconds_to_current"))),
        ("rejoin: steps it took part in while catching up (`rejoin.steps_catching_up`)",
         "-" if r.get("steps_catching_up") is None else str(r["steps_catching_up"])),
        ("rejoin: bit-identical to the survivors", f"{r['bit_identical']} ({r['digests_compared']} digests)"),
        ("rejoin: survivors' longest stall while it healed, in steps (`rejoin.survivor_stall_steps`)",
         _num(r.get("survivor_stall_steps"))),
        ("rejoin: survivors' gap before the step it joined, in steps (`rejoin.heal_step_stall_steps`)",
         _num(r.get("heal_step_stall_steps"))),
    ]


def _num(value: float | None, digits: int = 1) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


# ---------------------------------------------------------------------------------- main
def trajectory_section(reference: list[dict[str, Any]], failure: RunLog, args: argparse.Namespace,
                       compared: str = "run 2 (a group killed at --kill-at-step and restarted) against run 5 (no "
                                       "failure), same seed and options") -> dict[str, Any]:
    """``trajectory.*``: run 2's committed steps against run 5's (``reference``: its sample records)."""
    return {
        **trajectory_results(reference, read_sample_records(failure.log_dir), args.reference_steps or None),
        "compared": compared,
        "reference_steps": args.reference_steps or args.steps,
    }


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
        return ({"failure": failure_results(run, args.steps),
                 "rejoin": rejoin_results(run, args.checkpoint_every)}, run, None)
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


def goodput_trajectory(reference: list[dict[str, Any]], goodput: RunLog, args: argparse.Namespace) -> dict[str, Any]:
    """The samples the fault-tolerant goodput run read, against the reference's same steps (no losses: its
    learning-rate schedule differs, max_steps being out of reach)."""
    compare = args.reference_steps or None  # the steps the reference ran (all, but in --smoke)
    read = trajectory_results(reference, read_sample_records(goodput.log_dir), compare)
    return {key: read[key] for key in ("samples_skipped", "samples_repeated", "steps_differing",
                                       "global_batch_constant", "steps_compared")}


def relative(run: RunLog) -> dict[str, float]:
    return {name: t - run.started for name, t in run.events.items()}


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
