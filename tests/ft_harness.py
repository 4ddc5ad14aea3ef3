"""The fault-tolerance tests' harness: a Lighthouse on loopback and replica groups of spawned gloo ranks, each
group its own ``torch.distributed`` world (its own port), as two jobs would be on a cluster. Every process it
starts is killed when the test ends, whatever happened."""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
import torch.multiprocessing as mp
from distributed import exit_after_distributed_work, free_port
from toy import RunConfig, trainer_kwargs

from lightning_mics import FaultTolerance, MiCSStrategy

LIGHTHOUSE = Path(sys.executable).parent / "torchft_lighthouse"
GROUP_WORLD = 2


def start_lighthouse(min_replicas: int, join_timeout_ms: int = 1000) -> tuple[subprocess.Popen[bytes], str]:
    """A Lighthouse on loopback (its own session, so that it can be killed whole) and its address. torchft
    0.2.0's Lighthouse has no majority rule: a group that asks for a quorum while the live ones are mid-step
    gets a quorum of its own after ``join_timeout_ms`` (two quorums training apart), so a test where a group
    joins late keeps the join timeout above the live groups' step time."""
    port = free_port()
    process = subprocess.Popen(
        [str(LIGHTHOUSE), "--min_replicas", str(min_replicas), "--bind", f"127.0.0.1:{port}",
         "--join_timeout_ms", str(join_timeout_ms), "--heartbeat_timeout_ms", "2000"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    time.sleep(0.5)
    if process.poll() is not None:
        raise RuntimeError("the Lighthouse did not start")
    return process, f"http://127.0.0.1:{port}"


@contextmanager
def lighthouse(min_replicas: int, join_timeout_ms: int = 1000) -> Iterator[str]:
    """A Lighthouse for the test's groups; killed at the end."""
    process, address = start_lighthouse(min_replicas, join_timeout_ms)
    try:
        yield address
    finally:
        process.kill()
        process.wait(timeout=10)


def _group_rank(rank: int, group: int, port: int, out_dir: str, fn: Any, args: tuple) -> None:
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE=str(GROUP_WORLD), RANK=str(rank),
        LOCAL_RANK=str(rank), NODE_RANK="0",
    )
    torch.set_num_threads(1)
    result = fn(rank, group, *args)
    torch.save(result, Path(out_dir) / f"group{group}_rank{rank}.pt")
    exit_after_distributed_work()


def start_group(group: int, out_dir: str, fn: Any, *args: Any) -> Any:
    """One replica group's job: ``GROUP_WORLD`` spawned ranks with their own world, not waited for."""
    return mp.start_processes(
        _group_rank, args=(group, free_port(), out_dir, fn, args), nprocs=GROUP_WORLD, join=False,
        start_method="spawn",
    )


def wait(context: Any, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    try:
        while not context.join(timeout=max(1.0, deadline - time.monotonic())):
            if time.monotonic() > deadline:
                raise TimeoutError(f"a replica group did not finish within {timeout} s")
    finally:
        kill(context)


def kill(context: Any) -> None:
    for process in context.processes:
        if process.is_alive():
            process.kill()
        process.join(timeout=10)


def read(out_dir: str, group: int) -> list[Any]:
    return [torch.load(Path(out_dir) / f"group{group}_rank{r}.pt", weights_only=False) for r in range(GROUP_WORLD)]


def fault_tolerant_trainer(cfg: RunConfig, ft: FaultTolerance, callbacks: list, **overrides: Any) -> Any:
    import lightning.pytorch as pl

    kwargs = trainer_kwargs(cfg) | {"devices": GROUP_WORLD, "callbacks": callbacks} | overrides
    return pl.Trainer(strategy=MiCSStrategy(fault_tolerance=ft), **kwargs)


def shard_digest(module: torch.nn.Module) -> str:
    """A digest of this rank's shards: equal on two groups' ranks of one index exactly when they hold the same."""
    digest = hashlib.sha256()
    for _, p in sorted(module.named_parameters()):
        local = p.to_local() if hasattr(p, "to_local") else p
        digest.update(local.detach().contiguous().numpy().tobytes())
    return digest.hexdigest()
