"""The fault-tolerance tests' harness: a Lighthouse on loopback and replica groups of gloo ranks, each group its
own ``torch.distributed`` world (its own port), as two jobs would be on a cluster. Every process it starts is
killed when the test ends, whatever happened.

The ranks are started as ``distributed.run_ranks`` starts its own: forked from the session's fork server (which
has imported torch, Lightning, torchft and the library and runs no thread), or spawned where CUDA is available.
Each rank is a process of its own, so a rank that exits or is killed mid-step is a real process death; torchft's
Manager starts its threads in the rank, after the fork, and its gloo process group runs in-process (no child
processes to outlive a killed rank). The Lighthouse is torchft's native binary, started with ``subprocess`` in
a session of its own: it imports nothing, so the fork server would save it nothing."""

from __future__ import annotations

import hashlib
import os
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from distributed import adopt_starters_state, exit_after_distributed_work, free_port, join_or_kill, start_processes
from toy import RunConfig, trainer_kwargs

from lightning_mics import FaultTolerance, MiCSStrategy

LIGHTHOUSE = Path(sys.executable).parent / "torchft_lighthouse"
#: The heal and quorum cadence the multi-group scenarios were written for: a blocking heal, a quorum every step
#: (their choreography -- a kill at a step, a restart that heals at the next quorum, digests compared from the
#: heal on -- assumes both). ``FaultTolerance()``'s defaults (``heal="auto"``: the catch-up heal; a quorum every 10
#: steps) run in tests/test_fault_tolerance_catch_up.py, the trajectory tests' parametrisation and the
#: fault-tolerance benchmark's smoke (tests/test_entry_points.py).
AS_WRITTEN: dict[str, Any] = {"heal": "blocking", "quorum_every": 1}
GROUP_WORLD = 2


def start_lighthouse(min_replicas: int, join_timeout_ms: int = 1000) -> tuple[subprocess.Popen[bytes], str]:
    """A Lighthouse on loopback (its own session, so that it can be killed whole) and its address. torchft
    0.2.0's Lighthouse has no majority rule: a group that asks for a quorum while the live ones are mid-step
    gets a quorum of its own after ``join_timeout_ms`` (two quorums training apart), so a test where a group
    joins late keeps the join timeout above the live groups' step time.

    Returned once it accepts connections. A Lighthouse that never listens is given up for one on a new port, up to
    three: once, in CI, every group of a test got "transport error" from its Lighthouse until its 60 s
    ``quorum_timeout`` -- likeliest a port another process took between :func:`free_port` and the bind."""
    for _ in range(3):
        port = free_port()
        process = subprocess.Popen(
            [str(LIGHTHOUSE), "--min_replicas", str(min_replicas), "--bind", f"127.0.0.1:{port}",
             "--join_timeout_ms", str(join_timeout_ms), "--heartbeat_timeout_ms", "2000"],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
        )
        deadline = time.monotonic() + 20
        while process.poll() is None and time.monotonic() < deadline:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
            except OSError:
                time.sleep(0.1)
                continue
            time.sleep(0.2)  # listening -- and still alive, so the listener is the Lighthouse
            if process.poll() is None:
                return process, f"http://127.0.0.1:{port}"
        process.kill()
        process.wait(timeout=10)
    raise RuntimeError("the Lighthouse did not start listening (three ports tried)")


@contextmanager
def lighthouse(min_replicas: int, join_timeout_ms: int = 1000) -> Iterator[str]:
    """A Lighthouse for the test's groups; killed at the end."""
    process, address = start_lighthouse(min_replicas, join_timeout_ms)
    try:
        yield address
    finally:
        process.kill()
        process.wait(timeout=10)


def _group_rank(
    rank: int, group: int, port: int, out_dir: str, fn: Any, args: tuple, environment: dict[str, str], output: Any
) -> None:
    adopt_starters_state(environment, output)
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE=str(GROUP_WORLD), RANK=str(rank),
        LOCAL_RANK=str(rank), NODE_RANK="0",
    )
    torch.set_num_threads(1)
    result = fn(rank, group, *args)
    torch.save(result, Path(out_dir) / f"group{group}_rank{rank}.pt")
    exit_after_distributed_work()


def start_group(group: int, out_dir: str, fn: Any, *args: Any) -> Any:
    """One replica group's job: ``GROUP_WORLD`` new ranks with their own world, not waited for. A test that
    needs one group to have reached a point before another starts waits for it (:func:`wait_for_step`):
    a forked group starts within about a second, so start-up time orders nothing."""
    return start_processes(_group_rank, (group, free_port(), out_dir, fn, args), GROUP_WORLD)


def wait(context: Any, timeout: float) -> None:
    """Wait for a group's ranks; raise a failed rank's error or ``TimeoutError``. Every rank still running
    then is SIGKILLed and reaped, whichever way it ended."""
    join_or_kill(context, timeout, "a replica group")


def wait_for_step(path: Path, step: int, timeout: float) -> None:
    """Wait until a rank has written a step number of at least ``step`` to ``path``: how a test orders a
    group's start after another group's progress without guessing how long either takes."""
    deadline = time.monotonic() + timeout
    while not (path.exists() and path.read_text() and int(path.read_text()) >= step):
        if time.monotonic() > deadline:
            raise TimeoutError(f"{path.name} did not reach step {step} within {timeout} s")
        time.sleep(0.2)


def lose_and_restart_group_1(
    fn: Any, args_for: Callable[[str, str, str], tuple], alone_marker: str, join_timeout_ms: int = 1000
) -> tuple[list[Any], list[Any]]:
    """The loss-and-rejoin choreography: group 0 (role ``"survivor"``) and group 1 (``"doomed"``, which must die)
    start; once every rank of group 0 has written ``alone_marker.format(rank=r)`` (it trains alone), group 1 starts
    again (``"restarted"``); both run to their end. ``args_for(address, out_dir, role)``: ``fn``'s arguments after
    ``(rank, group)``. Returns (group 0's results, the restarted group 1's)."""
    import tempfile

    with lighthouse(min_replicas=1, join_timeout_ms=join_timeout_ms) as address, tempfile.TemporaryDirectory() as out:
        survivor = start_group(0, out, fn, *args_for(address, out, "survivor"))
        doomed = start_group(1, out, fn, *args_for(address, out, "doomed"))
        try:
            wait(doomed, timeout=180)
        except Exception:  # noqa: BLE001 -- whichever way the group's ranks die
            pass
        else:
            raise AssertionError("the doomed group ended normally: it never failed")
        for rank in range(GROUP_WORLD):
            wait_for_step(Path(out, alone_marker.format(rank=rank)), 1, timeout=120)
        restarted = start_group(1, out, fn, *args_for(address, out, "restarted"))
        wait(survivor, timeout=300)
        wait(restarted, timeout=120)
        return read(out, 0), read(out, 1)


def run_two_groups(fn: Any, args_for: Callable[[str, str, str], tuple], timeout: float) -> tuple[list[Any], list[Any]]:
    """Groups 0 and 1 from start to end with nothing failing (a Lighthouse with ``min_replicas=2``: every step has
    both) -- the failure-free reference of :func:`lose_and_restart_group_1`'s choreography, with the same
    ``args_for(address, out_dir, role)`` (role ``"together"``)."""
    import tempfile

    with lighthouse(min_replicas=2) as address, tempfile.TemporaryDirectory() as out:
        groups = [start_group(g, out, fn, *args_for(address, out, "together")) for g in range(2)]
        for group in groups:
            wait(group, timeout=timeout)
        return read(out, 0), read(out, 1)


def run_one_group(fn: Any, timeout: float) -> list[Any]:
    """Group 0 alone with a Lighthouse of its own (``min_replicas=1``): ``fn(rank, 0, lighthouse_address)`` on
    each of its ranks; their results."""
    import tempfile

    with lighthouse(min_replicas=1) as address, tempfile.TemporaryDirectory() as out_dir:
        wait(start_group(0, out_dir, fn, address), timeout=timeout)
        return read(out_dir, 0)


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
