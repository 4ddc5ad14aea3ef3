"""Start a benchmark's rank processes by forking a server that imported torch, Lightning and this library once.

Every rank of the emulated benchmarks is a new Python process in a node's network namespace, and each pays
~6 s of CPU for its imports before its first step (Lightning alone ~4 s: it imports torchmetrics, which imports
``transformers`` where it is installed, and ``torch._dynamo``). A smoke run starts 30-40 ranks on 2 cores: the
imports are most of its time. The fork server pays them once per benchmark: it runs on the host, imports
:data:`PRELOAD`, and for each request forks a child that enters the node's network namespace (``setns``, what
``ip netns exec`` does first), optionally its own UTS namespace with the node's address as hostname (what the
fault-tolerance benchmark's ``unshare --uts`` does), takes the requester's environment, working directory and
log file, and runs the rank's module as ``__main__`` -- the same code a fresh ``python -m module`` runs.

Only the smoke runs use it (``--smoke``: they check that every path runs and measure nothing): a node started
that way is up in a second, faster than a real one. Measured runs start fresh interpreters, each in its node's
cpu cgroup (:mod:`benchmarks.cpu_quota`), so a starting node imports on its own CPU as a real one does. A forked
child joins the cgroup its request names before it runs anything.

The server forks from a single thread (a lock held by another thread at the fork would stay held in every
child): it refuses to serve if an import started one. Each child runs in a session of its own, so a benchmark
kills it, and only it, with ``os.killpg`` as it kills a spawned rank; the server reports each child's exit
status back over the request's connection (:class:`ForkedProcess` reads it: ``poll``/``wait`` as on a
``subprocess.Popen``).

Run by :class:`ForkServer`; by hand: ``python -m benchmarks.fork_server serve --socket PATH``.
"""

from __future__ import annotations

import argparse
import ctypes
import errno
import functools
import importlib
import importlib.util
import os
import pickle
import select
import signal
import socket
import struct
import subprocess
import sys
import time
import traceback
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

from benchmarks.cpu_quota import join

#: Imported too where installed: torchft (~1 s of CPU per rank). Its ``Manager`` takes ``socket.gethostname()``
#: as a default argument, evaluated at import -- the server's name, not the node address a forked rank is given
#: -- so the library passes the rank's own name when it builds one.
OPTIONAL_PRELOAD = ("torchft",)
#: What (nearly) every rank of the emulated benchmarks imports: the rest a rank imports in milliseconds.
PRELOAD = (
    "torch",
    "torch.distributed.checkpoint",
    "torch.distributed.fsdp",
    "lightning.pytorch",
    "lightning_mics",
    "lightning_mics.telemetry",
    "examples.models",
    *OPTIONAL_PRELOAD,
)
#: Read by the interpreter or a library as it starts or loads, so a child cannot take them from its request:
#: the server is started with the values its children ask for, and a request asking for others is refused.
STARTUP_VARIABLES = ("PYTHONWARNINGS", "OMP_NUM_THREADS", "PYTHONHASHSEED", "PYTHONPATH")
#: In the server's environment only: OpenBLAS (loaded by numpy, which torch imports) starts a thread per
#: core as it loads; with one thread the server stays forkable without relying on OpenBLAS's fork handler.
SERVER_ONLY_ENVIRONMENT = {"OPENBLAS_NUM_THREADS": "1"}

CLONE_NEWNET = 0x40000000
CLONE_NEWUTS = 0x04000000
CLONE_NEWNS = 0x00020000
MS_REC = 0x4000
MS_SLAVE = 0x80000
MNT_DETACH = 0x2
NETNS_DIR = Path("/run/netns")  # where `ip netns add` keeps its namespaces
REPO_ROOT = Path(__file__).resolve().parent.parent
_LENGTH = struct.Struct("!Q")


@dataclass(frozen=True)
class StartRequest:
    """One rank to start: ``python -m module *args`` with this environment, in this directory, writing stdout and
    stderr to the descriptor sent with the request."""

    module: str
    args: tuple[str, ...]
    environment: dict[str, str]
    cwd: str
    namespace: Optional[str]  #: the network namespace (``ip netns`` name) to enter; ``None``: the server's
    hostname: Optional[str]  #: a UTS namespace of its own with this hostname; ``None``: the server's
    #: the cgroup directory the child joins before it runs (its node's CPU quota, :mod:`benchmarks.cpu_quota`);
    #: ``None``: the server's
    cgroup: Optional[str] = None


# ---------------------------------------------------------------------------------- server
def serve(socket_path: str, preload: Sequence[str]) -> int:
    """Import ``preload``, then fork one child per request on ``socket_path`` until SIGTERM."""
    for name in preload:
        if name in OPTIONAL_PRELOAD and importlib.util.find_spec(name) is None:
            continue
        importlib.import_module(name)
    threads = len(os.listdir("/proc/self/task"))
    if threads != 1:
        print(f"fork server: {threads} threads after importing {', '.join(preload)}: an import started one, and "
              "a fork copies only the forking thread; start the ranks fresh instead (--no-fork-server; the "
              "fault-tolerance benchmark's --node-start fresh)",
              file=sys.stderr, flush=True)
        return 1
    stopping = False

    def stop(signum: int, frame: Any) -> None:
        nonlocal stopping
        stopping = True

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(socket_path)
    listener.listen(64)
    ready = Path(ready_path(socket_path))
    partial = ready.with_name(ready.name + ".tmp")
    partial.write_text("ready\n")
    os.replace(partial, ready)  # whole: a reader never sees it empty
    children: dict[int, socket.socket] = {}
    while not stopping:
        try:
            readable, _, _ = select.select([listener], [], [], 0.05)
        except InterruptedError:
            readable = []
        if readable:
            connection, _ = listener.accept()
            pid = _start_child(listener, connection, list(children.values()))
            if pid is None:
                connection.close()
            else:
                children[pid] = connection
        _report_exits(children)
    listener.close()
    for connection in children.values():  # the children run on in their sessions: the benchmark stops them
        connection.close()
    return 0


def ready_path(socket_path: str | Path) -> str:
    """The file the server creates once it listens (the socket's file exists a moment before); it holds the CPU
    seconds the server's imports took."""
    return f"{socket_path}.ready"


def _start_child(listener: socket.socket, connection: socket.socket, others: list[socket.socket]) -> Optional[int]:
    """Read a request, fork its child and send back the child's pid; ``None`` if the request was refused or
    unreadable. ``others``: the connections of earlier children, which the new child closes."""
    try:
        header, descriptors, _, _ = socket.recv_fds(connection, _LENGTH.size, 1)
        if len(header) != _LENGTH.size or len(descriptors) != 1:
            return None
        payload = _receive_exactly(connection, _LENGTH.unpack(header)[0])
        request: StartRequest = pickle.loads(payload)
    except (OSError, EOFError, pickle.UnpicklingError):
        return None
    refused = _refusal(request)
    if refused is not None:
        os.close(descriptors[0])
        _send_message(connection, ("refused", refused))
        return None
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid == 0:
        for handle in (listener, connection, *others):
            handle.close()
        _run_child(request, descriptors[0])  # never returns
    os.close(descriptors[0])
    _send_message(connection, ("started", pid))
    return pid


def _refusal(request: StartRequest) -> Optional[str]:
    different = [name for name in STARTUP_VARIABLES if request.environment.get(name) != os.environ.get(name)]
    if different:
        return (f"the request's {', '.join(different)} differ from the fork server's, and only a new interpreter "
                "reads them: start the fork server with the ranks' values, or start these ranks fresh")
    if request.namespace is not None and not (NETNS_DIR / request.namespace).exists():
        return f"no network namespace {request.namespace!r} under {NETNS_DIR}"
    return None


def _run_child(request: StartRequest, output: int) -> None:
    """In the forked child: become the requested rank, run its module as ``__main__``, exit with its code."""
    code = 1
    try:
        os.setsid()
        os.dup2(output, 1)
        os.dup2(output, 2)
        os.close(output)
        for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGCHLD):
            signal.signal(signum, signal.SIG_DFL)
        join(request.cgroup)
        if request.namespace is not None:
            _enter_network_namespace(request.namespace)
        if request.hostname is not None:
            _own_hostname(request.hostname)
        os.environ.clear()
        os.environ.update(request.environment)
        os.chdir(request.cwd)
        sys.argv = [request.module, *request.args]
        import runpy

        runpy.run_module(request.module, run_name="__main__", alter_sys=True)
        code = 0
    except SystemExit as exit_:  # as the interpreter treats it: None is 0, a message is printed and 1
        if exit_.code is None or isinstance(exit_.code, int):
            code = exit_.code or 0
        else:
            print(exit_.code, file=sys.stderr)
            code = 1
    except BaseException:
        traceback.print_exc()
        code = 1
    finally:
        try:
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(code)


@functools.cache
def _libc() -> ctypes.CDLL:
    return ctypes.CDLL(None, use_errno=True)


def _libc_call(name: str, *args: Any, what: Optional[str] = None) -> None:
    """Call libc's ``name``; a non-zero return is an ``OSError`` saying ``what`` failed (default: ``name``)."""
    if getattr(_libc(), name)(*args) != 0:
        number = ctypes.get_errno()
        raise OSError(number, f"{what or name}: {os.strerror(number)}")


def _enter_network_namespace(namespace: str) -> None:
    """Enter ``ip netns``'s namespace ``namespace`` as ``ip netns exec`` does (root; the child is single-threaded):
    ``setns`` into it, then a mount namespace of the child's own with ``/sys`` mounted again, so that
    ``/sys/class/net`` shows this namespace's interfaces (the ranks read their uplink's byte counters there)."""
    descriptor = os.open(NETNS_DIR / namespace, os.O_RDONLY)
    try:
        _libc_call("setns", descriptor, CLONE_NEWNET)
    finally:
        os.close(descriptor)
    _libc_call("unshare", CLONE_NEWNS)
    # the mounts below stay in this namespace: nothing propagates back to the host's
    _libc_call("mount", b"none", b"/", None, MS_SLAVE | MS_REC, None, what="mount --make-rslave /")
    _libc().umount2(b"/sys", MNT_DETACH)  # fails harmlessly where /sys was not mounted
    _libc_call("mount", namespace.encode(), b"/sys", b"sysfs", 0, None, what=f"mounting /sys for {namespace}")


def _own_hostname(hostname: str) -> None:
    """A UTS namespace of the child's own with ``hostname``: every namespace shares the host's name otherwise."""
    _libc_call("unshare", CLONE_NEWUTS)
    socket.sethostname(hostname)


def _report_exits(children: dict[int, socket.socket]) -> None:
    """Reap every child that ended and send its exit code (``-signal`` if killed, as ``Popen.returncode``)."""
    while children:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        connection = children.pop(pid, None)
        if connection is None:
            continue
        try:
            _send_message(connection, ("exited", os.waitstatus_to_exitcode(status)))
        except OSError:  # the benchmark that asked is gone
            pass
        connection.close()


def _send_message(connection: socket.socket, message: tuple[str, Any]) -> None:
    payload = pickle.dumps(message)
    connection.sendall(_LENGTH.pack(len(payload)) + payload)


def _receive_exactly(connection: socket.socket, size: int) -> bytes:
    chunks, left = [], size
    while left:
        chunk = connection.recv(left)
        if not chunk:
            raise EOFError(f"the connection closed {left} bytes before the end of a message")
        chunks.append(chunk)
        left -= len(chunk)
    return b"".join(chunks)


def _receive_message(connection: socket.socket) -> tuple[str, Any]:
    return pickle.loads(_receive_exactly(connection, _LENGTH.unpack(_receive_exactly(connection, _LENGTH.size))[0]))


# ---------------------------------------------------------------------------------- client
class ForkedProcess:
    """A rank the fork server started: the parts of ``subprocess.Popen`` the benchmarks use (``pid``, ``poll``,
    ``wait``, ``returncode``). It runs in a session of its own (``os.killpg(pid, ...)`` stops it); its exit code
    arrives over the connection that asked for it."""

    def __init__(self, pid: int, connection: socket.socket, module: str) -> None:
        self.pid = pid
        self.args = ["python", "-m", module]
        self.returncode: Optional[int] = None
        self._connection: Optional[socket.socket] = connection

    def poll(self) -> Optional[int]:
        if self.returncode is None:
            self._read(timeout=0.0)
        return self.returncode

    def wait(self, timeout: Optional[float] = None) -> int:
        if self.returncode is None and not self._read(timeout):
            raise subprocess.TimeoutExpired(self.args, timeout or 0.0)
        assert self.returncode is not None
        return self.returncode

    def _read(self, timeout: Optional[float]) -> bool:
        """Take the exit code if it arrived within ``timeout`` (``None``: wait for it); whether it did."""
        if self._connection is None:
            return self._wait_without_server(timeout)
        readable, _, _ = select.select([self._connection], [], [], timeout)
        if not readable:
            return False
        try:
            kind, value = _receive_message(self._connection)
        except (OSError, EOFError):  # the server is gone before the process ended
            self._connection.close()
            self._connection = None
            return self._wait_without_server(timeout)
        if kind != "exited":
            raise RuntimeError(f"unexpected message from the fork server about process {self.pid}: {kind} {value}")
        self.returncode = int(value)
        self._connection.close()
        self._connection = None
        return True

    def _wait_without_server(self, timeout: Optional[float]) -> bool:
        """With the server gone nobody reaps the process for us or knows its exit code: wait until it is gone and
        report it as killed (a benchmark stops its fork server only after its ranks)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while _alive(self.pid):
            if deadline is not None and time.monotonic() >= deadline:
                return False
            time.sleep(0.01)
        self.returncode = -signal.SIGKILL
        return True


def _alive(pid: int) -> bool:
    """Whether ``pid`` still runs (a zombie, ended but not reaped, does not)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state not in ("Z", "X")


class ForkServer:
    """The benchmark side: start the server (a ``subprocess.Popen`` the caller tracks and stops like any other
    process), then :meth:`start` ranks through it."""

    def __init__(self, socket_path: Path, environment: dict[str, str], preload: Sequence[str] = PRELOAD) -> None:
        self.socket_path = socket_path
        self.environment = environment
        server_environment = {**environment, **SERVER_ONLY_ENVIRONMENT}
        self.process = subprocess.Popen(
            [sys.executable, "-m", "benchmarks.fork_server", "serve", "--socket", str(socket_path),
             "--preload", ",".join(preload)],
            env=server_environment, cwd=REPO_ROOT, start_new_session=True,
        )

    def wait_until_ready(self, timeout: float = 180.0) -> None:
        """Until the server listens (its imports take seconds); raise if it exits or ``timeout`` passes."""
        deadline = time.monotonic() + timeout
        while True:
            if self.process.poll() is not None:
                raise RuntimeError(f"the fork server exited with {self.process.returncode} before it listened")
            if Path(ready_path(self.socket_path)).exists():
                return
            if time.monotonic() > deadline:
                raise RuntimeError(f"the fork server did not listen on {self.socket_path} within {timeout:.0f} s")
            time.sleep(0.05)

    def start(self, argv: Sequence[str], environment: dict[str, str], cwd: Path, output: int,
              namespace: Optional[str] = None, hostname: Optional[str] = None,
              cgroup: Optional[str] = None) -> ForkedProcess:
        """Start ``argv`` (``[python, "-m", module, *args]``, as it would be spawned) forked from the server,
        in ``namespace`` and the cgroup directory ``cgroup``, writing to the descriptor ``output``."""
        if len(argv) < 3 or argv[1] != "-m":
            raise ValueError(f"the fork server runs modules (`python -m module ...`), not {list(argv)}")
        self.wait_until_ready()
        request = StartRequest(argv[2], tuple(argv[3:]), dict(environment), str(cwd), namespace, hostname,
                               cgroup)
        payload = pickle.dumps(request)
        connection = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            connection.connect(str(self.socket_path))
            socket.send_fds(connection, [_LENGTH.pack(len(payload))], [output])
            connection.sendall(payload)
            kind, value = _receive_message(connection)
        except BaseException:
            connection.close()
            raise
        if kind != "started":
            connection.close()
            raise RuntimeError(f"the fork server refused {argv[2]}: {value}")
        return ForkedProcess(int(value), connection, argv[2])


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True)
    server = commands.add_parser("serve", help="import the modules, then fork a child per request")
    server.add_argument("--socket", required=True, help="the Unix socket to listen on (must not exist)")
    server.add_argument("--preload", default=",".join(PRELOAD), help="comma-separated modules to import first")
    args = parser.parse_args(argv)
    if os.path.exists(args.socket):
        parser.error(f"--socket {args.socket} exists: give a new path")
    try:
        return serve(args.socket, [name for name in args.preload.split(",") if name])
    except OSError as error:
        if error.errno == errno.EADDRINUSE:
            parser.error(f"--socket {args.socket} is in use")
        raise


if __name__ == "__main__":
    sys.exit(main())
