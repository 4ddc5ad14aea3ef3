"""The one multi-process harness every distributed test uses.

``run_ranks(fn, world_size, *args)`` starts ``world_size`` fresh processes, sets the environment a
launcher such as torchrun would (so Lightning sees externally created processes), runs
``fn(rank, world_size, *args)`` in each and returns the per-rank return values. An exception in
any rank fails the calling test with that rank's traceback.

The ranks are forked from a fork server that imported torch, Lightning and this library once for
the whole session (``multiprocessing``'s "forkserver"): a process that never ran anything, so each
rank starts as fresh as a spawned one, without paying the imports again (about 6 s of CPU per rank:
8 spawned ranks cost a 2-core machine ~25 s before their first collective). Every rank gets this
process's environment as it is when the ranks start, as a spawned process would. Where CUDA is
available the ranks are spawned instead: the server's imports may have initialised the driver,
which a forked process cannot use.

The fault-tolerance harness (``ft_harness.py``) starts its replica groups' ranks the same way,
through :func:`start_processes`; torchft's Manager starts its threads in the ranks, after the fork.
A fork copies only the forking thread, so the server must have no other (see :func:`start_fork_server`);
every forked rank checks that it has none.
"""

from __future__ import annotations

import multiprocessing
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.multiprocessing as mp

#: What the fork server imports once: what (nearly) every rank imports anyway. Installed packages only:
#: Python 3.11's fork server ignores its starter's ``sys.path``, so this folder's helpers would not be
#: found there (a rank imports them in milliseconds once these are loaded).
PRELOAD = [
    "pytest",
    "torch",
    "torch.distributed.checkpoint",
    "torch.distributed.fsdp",
    "lightning.pytorch",
    "lightning_mics",
    "lightning_mics.checkpoint",
    "lightning_mics.telemetry",
    "torchft",  # ~1 s per fault-tolerance rank; the server skips it where it is not installed
]

#: Added to the fork server's own environment only. numpy (which torch imports) loads OpenBLAS, whose
#: pool starts a worker thread per extra core as the library loads; OpenBLAS stops it before each fork
#: (its own fork handler), but with one thread the server needs no library's handler to be forkable, and
#: :func:`check_forked_from_one_thread` can be strict. Ranks take their starter's environment
#: (:func:`adopt_starters_state`); they just keep a single-threaded OpenBLAS.
FORK_SERVER_ENVIRONMENT = {"OPENBLAS_NUM_THREADS": "1"}


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def start_method() -> str:
    """``forkserver`` (preloaded with :data:`PRELOAD`) on hosts without CUDA, else ``spawn``;
    ``MICS_TEST_START_METHOD=spawn`` spawns every rank (the slower way, to rule the fork server out)."""
    if torch.cuda.is_available() or os.environ.get("MICS_TEST_START_METHOD") == "spawn":
        return "spawn"
    start_fork_server()
    return "forkserver"


def start_fork_server() -> None:
    """Start the session's fork server (a no-op once it runs) with :data:`PRELOAD` imported and no thread
    but its main one: what another thread held at the fork (a lock in the allocator, OpenMP or torchft's
    runtime) would stay held forever in the rank. :data:`FORK_SERVER_ENVIRONMENT` is in force only while
    the server starts; every later start of a process finds it running."""
    from multiprocessing import forkserver

    multiprocessing.get_context("forkserver").set_forkserver_preload(PRELOAD)
    saved = {name: os.environ.get(name) for name in FORK_SERVER_ENVIRONMENT}
    os.environ.update(FORK_SERVER_ENVIRONMENT)
    try:
        forkserver.ensure_running()
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def check_forked_from_one_thread() -> None:
    """In a forked rank: fail, naming the cause, if the fork server runs more than one thread (a preloaded
    module started one), rather than leave a rank to hang on a lock a thread of the server held."""
    server = f"/proc/{os.getppid()}"
    try:
        is_server = b"multiprocessing.forkserver" in Path(server, "cmdline").read_bytes()
        threads = len(os.listdir(Path(server, "task")))
    except OSError:  # no /proc, or the server is gone: nothing to judge
        return
    if is_server and threads > 1:
        raise RuntimeError(f"the fork server runs {threads} threads: a module of PRELOAD started one; fork "
                           "only from a single thread (set MICS_TEST_START_METHOD=spawn to rule the server out)")


class StartersOutput:
    """Pickled into a rank: this process's stdout and stderr descriptors as they are when the rank starts
    (pytest's capture of the running test), where a spawned rank's output goes. A forked rank would
    otherwise write to the fork server's, those of the test that started the server."""

    def __reduce__(self) -> tuple:
        from multiprocessing import reduction

        return _Output, (reduction.DupFd(1), reduction.DupFd(2))  # only while a process is being started


class _Output:
    def __init__(self, stdout: Any, stderr: Any) -> None:
        self.descriptors = stdout, stderr

    def install(self) -> None:
        for target, descriptor in zip((1, 2), self.descriptors):
            received = descriptor.detach()
            os.dup2(received, target)
            os.close(received)


def adopt_starters_state(environment: dict[str, str], output: _Output | None) -> None:
    """In a new rank: the environment and output of the process that started it, as if spawned."""
    os.environ.clear()
    os.environ.update(environment)
    if output is not None:  # forked from the fork server
        output.install()
        check_forked_from_one_thread()


def _worker(
    rank: int,
    fn: Callable[..., Any],
    world_size: int,
    port: int,
    out_dir: str,
    args: tuple,
    environment: dict[str, str] | None = None,
    output: _Output | None = None,
) -> None:
    if environment is not None:
        adopt_starters_state(environment, output)
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        WORLD_SIZE=str(world_size),
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        NODE_RANK="0",
    )
    os.environ.pop("LOCAL_WORLD_SIZE", None)
    torch.set_num_threads(1)  # 8 ranks share 2 cores: avoid oversubscription
    result = fn(rank, world_size, *args)
    torch.save(result, Path(out_dir) / f"rank{rank}.pt")
    exit_after_distributed_work()


def exit_after_distributed_work() -> None:
    """Leave a rank process once its work and results are done, without the interpreter's teardown.

    gloo's worker threads can still be joinable when the interpreter destroys process-group objects
    at exit, which aborts the process ("terminate called without an active exception", exit -6)
    after everything succeeded -- a torch-side exit race (cf. pytorch/pytorch#179291), seen in about
    one run of the suite in five. Tests judge the work, so the rank exits directly after it."""
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def start_processes(worker: Callable[..., Any], args: tuple, nprocs: int) -> Any:
    """Start ``worker(index, *args, environment, output)`` on ``nprocs`` new processes, forked from the fork
    server or spawned (:func:`start_method`), and return their torch ProcessContext without waiting. The
    worker passes ``environment`` and ``output`` to :func:`adopt_starters_state` first."""
    method = start_method()
    output = StartersOutput() if method == "forkserver" else None
    return mp.start_processes(
        worker, args=(*args, dict(os.environ), output), nprocs=nprocs, join=False, start_method=method
    )


def start_ranks(fn: Callable[..., Any], world_size: int, out_dir: str, args: tuple) -> Any:
    """Start ``_worker(rank, fn, ...)`` on ``world_size`` new processes; their torch ProcessContext."""
    return start_processes(_worker, (fn, world_size, free_port(), out_dir, args), world_size)


def kill_ranks(context: Any) -> None:
    """SIGKILL every rank of ``context`` still running, and reap it."""
    for process in context.processes:
        if process.is_alive():
            process.kill()
        process.join(timeout=10)


def join_or_kill(context: Any, timeout: float, what: str) -> None:
    """Wait for every process of ``context`` to end: a failed one's error is raised (torch's join ends the
    others), ``TimeoutError`` after ``timeout`` seconds. However it ends (the test interrupted too), every
    process still running is SIGKILLed and reaped: none outlives the test."""
    deadline = time.monotonic() + timeout
    try:
        while not context.join(timeout=max(1.0, deadline - time.monotonic())):
            if time.monotonic() > deadline:
                raise TimeoutError(f"{what} did not finish within {timeout} s")
    finally:
        kill_ranks(context)


def run_ranks(fn: Callable[..., Any], world_size: int, *args: Any, timeout: float = 900) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` new ranks; return their results. Ranks
    still running after ``timeout`` seconds (or when the test is interrupted) are killed."""
    with tempfile.TemporaryDirectory() as out_dir:
        context = start_ranks(fn, world_size, out_dir, args)
        join_or_kill(context, timeout, f"{world_size} ranks of {fn.__name__}")
        return [torch.load(Path(out_dir) / f"rank{r}.pt", weights_only=False) for r in range(world_size)]


def end_session(process: subprocess.Popen, grace_s: float = 20.0) -> str:
    """End a script started with ``start_new_session=True`` that ran past its bound, and return its output: SIGTERM
    to its session first -- the emulated-cluster benchmarks tear down on it, killing the ranks they started inside
    network namespaces (in sessions of their own, which a signal to this session never reaches) and removing the
    namespaces -- then, after ``grace_s``, SIGKILL to the session."""
    _signal_session(process, signal.SIGTERM)
    try:
        output, _ = process.communicate(timeout=grace_s)
    except subprocess.TimeoutExpired:
        _signal_session(process, signal.SIGKILL)
        output, _ = process.communicate()
    return output


def _signal_session(process: subprocess.Popen, sig: int) -> None:
    try:
        os.killpg(process.pid, sig)
    except ProcessLookupError:  # the session ended meanwhile
        pass


def run_script(*args: str, timeout: float, cwd: Path) -> str:
    """``python <args>`` from ``cwd``, in a session of its own; its output (stdout and stderr). On a timeout the
    whole session goes (the script and every rank it started) and the test fails; a non-zero exit fails it too."""
    import pytest

    process = subprocess.Popen(
        [sys.executable, *args], cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        start_new_session=True, env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    try:
        output, _ = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        output = end_session(process)
        pytest.fail(f"{' '.join(args)} ran past {timeout} s:\n{output[-3000:]}")
    assert process.returncode == 0, f"{' '.join(args)} exited {process.returncode}:\n{output[-4000:]}"
    return output
