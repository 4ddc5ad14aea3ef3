"""One strategy row of the emulated cluster: its ranks launched in their nodes' namespaces, waited for, and rank
0's record read back -- or a record saying why the row failed or was skipped.

Each rank is ``python -m benchmarks.emulated_worker --job JOB`` (forked from the fork server where one runs); the
job file carries the strategy, the cluster, the training setup and, for ``--convergence``, the row's settings,
seed and budget (:class:`ConvergenceRun`). Every mode of ``emulated_cluster.py`` (:mod:`benchmarks.emulated_modes`)
runs its rows through :func:`run_strategy`, so they start, time out and fail alike.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any, Optional

from benchmarks.convergence_setup import ConvergenceSettings
from benchmarks.emulated_network import MASTER_PORT_BASE
from benchmarks.netns import UPLINK, EmulatedCluster, RankProcess, rank_environment
from benchmarks.netns_regions import REGION_COUNTERS_ENV
from benchmarks.scenarios import StrategySpec, measured_steps_for


@dataclass(frozen=True)
class ConvergenceRun:
    """One row and seed of ``--convergence``: the settings every row shares, the seed, and the row's budget."""

    settings: ConvergenceSettings
    seed: int
    steps: int


def run_strategy(
    cluster: EmulatedCluster, spec: StrategySpec, args: argparse.Namespace, work_dir: Path, index: int,
    convergence: Optional[ConvergenceRun] = None,
) -> dict[str, Any]:
    """Launch every rank of one strategy in its node's namespace and return rank 0's record (or a
    failure record naming the reason). ``convergence``: a ``--convergence`` run of the row instead of a
    throughput measurement."""
    shape, setup = args.cluster, args.setup
    if convergence is None:  # a semi-synchronous row measures whole rounds of sync_every steps
        setup = replace(setup, measured_steps=measured_steps_for(spec, setup.measured_steps))
    work_dir.mkdir(parents=True, exist_ok=True)
    job = work_dir / f"{spec.name}.job.json"
    setup_dict = asdict(setup)
    job.write_text(json.dumps({
        "strategy": spec.to_dict(), "cluster": asdict(shape), "setup": setup_dict,
        "convergence": None if convergence is None else asdict(convergence.settings),
        "convergence_run": None if convergence is None else {"seed": convergence.seed, "steps": convergence.steps},
    }))
    output = work_dir / f"{spec.name}.result.json"
    base_env = rank_environment(MASTER_ADDR=cluster.node_address(0), MASTER_PORT=str(MASTER_PORT_BASE + index),
                                WORLD_SIZE=str(shape.world_size), GLOO_SOCKET_IFNAME=UPLINK)
    if cluster.regions is not None:  # where the ranks read the region links' counters
        base_env[REGION_COUNTERS_ENV] = cluster.region_counter_file or ""
    procs: list[tuple[int, RankProcess, Path]] = []
    started = time.monotonic()
    try:
        for rank in range(shape.world_size):
            node, local = divmod(rank, shape.ranks_per_node)
            env = {**base_env, "NODE_RANK": str(node), "LOCAL_RANK": str(local)}
            log = work_dir / f"{spec.name}.rank{rank}.log"
            argv = [sys.executable, "-m", "benchmarks.emulated_worker", "--job", str(job)]
            if rank == 0:
                argv += ["--output", str(output)]
                if args.profile_dir is not None:
                    args.profile_dir.mkdir(parents=True, exist_ok=True)
                    profile = args.profile_dir / f"{spec.name}.txt"
                    argv = ["py-spy", "record", "--idle", "--rate", "100", "--format", "raw", "-o", str(profile),
                            "--", *argv]
            with log.open("wb") as log_file:
                if argv[0] == "py-spy":  # profiled: py-spy starts the rank
                    proc = cluster.spawn(node, argv, env=env, stdout=log_file, stderr=subprocess.STDOUT)
                else:
                    proc = cluster.spawn_rank(node, argv, env, log_file)
                procs.append((rank, proc, log))
        failure = _wait_all(procs, started + args.run_timeout)
    finally:
        for _, proc, _ in procs:
            cluster.stop(proc)
    wall = time.monotonic() - started
    if failure is None and output.exists():
        record = json.loads(output.read_text())
        record["wall_s"] = wall
        return record
    return {"strategy": spec.name, "family": spec.family, "partition_size": spec.partition_size,
            "hierarchical": spec.hierarchical, "sharding_strategy": spec.sharding_strategy,
            "status": failure or "failed: rank 0 wrote no result", "wall_s": wall}


def skip_reason(spec: StrategySpec) -> Optional[str]:
    """Why a row cannot run on this machine (an optional peer that is not installed), or ``None``."""
    if spec.family == "deepspeed":
        from benchmarks.deepspeed_peer import unavailable_reason

        return unavailable_reason()
    return None


def skipped_record(spec: StrategySpec, reason: str) -> dict[str, Any]:
    return {"strategy": spec.name, "family": spec.family, "partition_size": spec.partition_size,
            "hierarchical": spec.hierarchical, "sharding_strategy": spec.sharding_strategy,
            "status": f"skipped: {reason}", "wall_s": 0.0}


def _wait_all(procs: list[tuple[int, RankProcess, Path]], deadline: float) -> Optional[str]:
    """Wait for every rank; the first failure (or the timeout) stops the run and is described."""
    while True:
        pending = False
        for rank, proc, log in procs:
            code = proc.poll()
            if code is None:
                pending = True
            elif code != 0:
                return f"failed: rank {rank} exited with {code}: {last_error(log)}"
        if not pending:
            return None
        if time.monotonic() > deadline:
            return "failed: timed out (see --run-timeout)"
        time.sleep(0.5)


def last_error(log: Path) -> str:
    """A failed process's log in one line: its last line that names an error, else its last line."""
    lines = [line.strip() for line in log.read_text(errors="replace").splitlines() if line.strip()]
    errors = [line for line in lines if "Error" in line or "error" in line]
    return (errors or lines or ["(no output)"])[-1][:300]
