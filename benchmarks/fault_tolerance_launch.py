"""Starting and stopping the processes of ``benchmarks/fault_tolerance.py``'s runs on the emulated cluster.

:class:`Bench` (the cluster, the options, the work directory, fresh ports for every launch), a node's ranks started
in its namespace (:func:`launch_node`, :func:`launch_all`), a Lighthouse on the switch (:func:`start_lighthouse`),
waiting on the ranks (:func:`watch`, :func:`expect_done`, :class:`RunFailed`), and a node lost or stopped
(:func:`kill_node`, :func:`sigkill`, :func:`stop_all`). These are the building blocks of every run; what each run
is made of -- which nodes, which Lighthouse, when a kill -- is in :mod:`benchmarks.fault_tolerance_runs`.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from benchmarks.emulated_rows import last_error
from benchmarks.fault_tolerance_logs import NODES, RANKS_PER_NODE, VICTIM, RunLog, median_interval, read_rows
from benchmarks.fault_tolerance_worker import Job
from benchmarks.netns import UPLINK, EmulatedCluster, RankProcess, rank_environment
from examples.fault_tolerance_demo import kill as sigkill_session
from examples.models import GPTConfig

LIGHTHOUSE_PORT = 29510
MASTER_PORT_BASE = 29700
#: The Lighthouse's join timeout: longer than the stretch between two quorums (``quorum_every`` steps of 0.15-0.25
#: s), else a restarted group that waits for the survivors' next quorum gets one with whichever survivor asks
#: first, the others left out (docs/fault-tolerance.md) -- a safe event: the one left out heals at the next quorum,
#: as on a host a third as fast (10 steps of 0.6 s). Not longer: the Lighthouse also holds the survivors' quorum
#: for a group that heartbeats but does not ask yet (a restarted one setting up) until this passes. A lost group
#: is dropped after the heartbeat timeout (2 s) whatever this is.
LIGHTHOUSE_JOIN_TIMEOUT_MS = 5000
#: The demo's tiny GPT, shorter and shallower: ~0.5 M parameters, a step of a few tenths of a second here.
MODEL = GPTConfig(seq_len=64, d_model=128, n_layers=2, n_heads=4)


def lighthouse_binary() -> str | None:
    beside = Path(sys.executable).parent / "torchft_lighthouse"
    return str(beside) if beside.exists() else shutil.which("torchft_lighthouse")


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
        raise RuntimeError(f"the Lighthouse did not start: {last_error(Path(log.name))}")
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


def sigkill(bench: Bench, procs: list[RankProcess]) -> None:
    for proc in procs:
        sigkill_session(proc)
        bench.cluster.forget(proc)


def expect_done(outcome: str, job: Job, what: str) -> None:
    if outcome != "done":
        logs = sorted(Path(job.log_dir).glob("*.log"))
        details = "; ".join(f"{log.name}: {last_error(log)}" for log in logs)
        raise RunFailed(f"{what}: {outcome} ({details})")


def expect_done_or(outcome: str, wanted: str, job: Job, what: str) -> None:
    if outcome != wanted:
        expect_done(outcome if outcome != "done" else "ended early", job, what)


def stop_all(bench: Bench, nodes: dict[int, list[RankProcess]]) -> None:
    """Every rank of every node at once (one grace period, not one per rank)."""
    bench.cluster.stop_all([proc for procs in nodes.values() for proc in procs])


def stop_group(bench: Bench, procs: list[RankProcess]) -> None:
    bench.cluster.stop_all(procs)
