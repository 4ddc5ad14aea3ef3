"""A joining group that catches up without stalling the live ones (``FaultTolerance(heal="catch_up")``).

Why: with torchft's own heal the joining group receives the live groups' shards at the quorum that admits it,
before the step, and every live group waits in that step's collectives until the transfer is done -- for a
model whose state takes several step times to cross the link, several steps lost by every group at each
rejoin. Here, as in FT-HSDP (arXiv 2602.00277), the transfer happens beside training:

1. **At the quorum** the serving rank reserves a snapshot on a small HTTP server of its own
   (:class:`SnapshotServer`); through torchft's heal only the small rest travels -- hyper-parameters,
   schedulers, the step count -- and the snapshot's address. Right after the quorum, before the step's
   forward, its training thread copies its shards (model and optimizer states) into host memory and
   publishes them there: the state at the start of the step, as the heal's small rest is.
2. **While the snapshot downloads** (:class:`CatchUp`, a background thread per rank) the joining group takes
   part in every step with the others but contributes nothing: it reads no share of the data (the live groups
   read it), sends zeros in hop 2, and keeps a host copy of each committed step's averaged, clipped gradients
   and the hyper-parameters they were applied with.
3. **Once every rank of the group has its snapshot** (agreed at the start of a step) it loads the snapshot and
   replays the kept steps through its optimizers: the same gradients, hyper-parameters and optimizer code as
   the live groups ran, so its shards are bit-identical to theirs. It contributes from that step on (while a group
   catches up, every step has a quorum, whose agreement tells every group who contributes).

The live groups lose only what any quorum with a new member costs (the process group is rebuilt) and the joining
group's first, cold step. The price is host memory: the serving rank's snapshot until the groups agree the
joiner caught up, and the joiner's kept gradients -- one gradient shard per step it needed to download.
"""

from __future__ import annotations

import io
import logging
import socket
import threading
import time
import urllib.request
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Optional

import torch
from torch import Tensor
from torch.distributed.tensor import DTensor
from torch.optim import Optimizer

from lightning_mics.fault_tolerance.heal_state import hyper_parameters, set_hyper_parameters

log = logging.getLogger("lightning_mics.fault_tolerance")


def to_host(tree: Any, copy: bool = True) -> Any:
    """``tree`` with every tensor (a DTensor: its local shard) in host memory -- a copy, or with ``copy=False``
    the tensor itself where it is there already (a tree that is a copy of the live state)."""
    if isinstance(tree, DTensor):
        return to_host(tree.to_local(), copy)
    if isinstance(tree, Tensor):
        return tree.detach().to("cpu", copy=copy)
    if isinstance(tree, dict):
        return {key: to_host(value, copy) for key, value in tree.items()}
    if isinstance(tree, (list, tuple)):
        return type(tree)(to_host(value, copy) for value in tree)
    return tree


class SnapshotServer:
    """This rank's shards at a quorum, served over HTTP to the joining group's rank of the same index.

    One snapshot at a time (a new heal replaces it); :meth:`release` frees it once no group needs it. The server
    listens on every interface and advertises ``socket.gethostname()``, as torchft's own checkpoint server does."""

    def __init__(self, bytes_per_s: Optional[float] = None, wait_s: float = 60.0) -> None:
        #: the most bytes per second a snapshot is sent at (``None``: as fast as the network takes it)
        self.bytes_per_s = bytes_per_s
        #: how long a request for a reserved snapshot waits for it to be published
        self.wait_s = wait_s
        self._lock = threading.Condition()
        self._payload: Any = None
        self._step: Optional[int] = None
        self._server: Optional[ThreadingHTTPServer] = None

    def reserve(self, step: int) -> str:
        """The address the snapshot of committed step ``step`` will be served at, before it is taken: the quorum
        hands the address to the joining group at once, and the training thread copies the shards after the
        quorum (:meth:`publish`) -- not in torchft's quorum thread, where the copy would hold up the joining
        group's heal, and with it every group's first step together. A request waits for the publication."""
        with self._lock:
            self._payload, self._step = None, step
        return self._address(step)

    def publish(self, step: int, shards: Any) -> str:
        """Serve ``shards`` -- a copy of the live state, not the live tensors: training goes on changing those
        -- as the snapshot of committed step ``step``, from host memory; its address. Serialised per request,
        in the server's thread."""
        shards = to_host(shards, copy=False)
        with self._lock:
            self._payload, self._step = shards, step
            self._lock.notify_all()
        return self._address(step)

    @property
    def reserved_step(self) -> Optional[int]:
        """The step of a snapshot reserved and not yet published (``None``: none)."""
        with self._lock:
            return self._step if self._payload is None else None

    def release(self) -> None:
        """Stop serving the snapshot and free its memory."""
        with self._lock:
            self._payload, self._step = None, None
            self._lock.notify_all()

    @property
    def serving(self) -> bool:
        """Whether a snapshot is reserved or published."""
        return self._step is not None

    def _address(self, step: int) -> str:
        return f"http://{socket.gethostname()}:{self._port()}/snapshot/{step}"

    def close(self) -> None:
        self.release()
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None

    def _port(self) -> int:
        if self._server is None:
            self._server = ThreadingHTTPServer(("", 0), self._handler())
            self._server.daemon_threads = True
            threading.Thread(target=self._server.serve_forever, name="mics-ft-snapshot", daemon=True).start()
        return int(self._server.server_address[1])

    def _handler(self) -> type[BaseHTTPRequestHandler]:
        server = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 (http.server's name)
                with server._lock:  # a reserved snapshot: wait until it is published (or replaced, released)
                    server._lock.wait_for(
                        lambda: server._payload is not None or self.path != f"/snapshot/{server._step}",
                        timeout=server.wait_s,
                    )
                    payload, step = server._payload, server._step
                if payload is None or self.path != f"/snapshot/{step}":
                    self.send_error(404, f"no snapshot {self.path} here (serving step {step})")
                    return
                buffer = io.BytesIO()
                torch.save(payload, buffer)
                self.send_response(200)
                self.send_header("Content-Type", "application/octet-stream")
                self.send_header("Content-Length", str(buffer.tell()))
                self.end_headers()
                send_paced(self.wfile, buffer.getbuffer(), server.bytes_per_s)

            def log_message(self, format: str, *args: Any) -> None:  # quiet: one line per heal is logged instead
                pass

        return Handler


#: Bytes written at a time when a snapshot is sent at a capped rate.
PACING_CHUNK_BYTES = 1 << 16


def send_paced(out: Any, data: memoryview, bytes_per_s: Optional[float]) -> None:
    """Write ``data`` to ``out``, no faster than ``bytes_per_s`` on average (in chunks, sleeping whenever ahead
    of the rate); all at once when uncapped."""
    if bytes_per_s is None:
        out.write(data)
        return
    started = time.monotonic()
    for offset in range(0, len(data), PACING_CHUNK_BYTES):
        chunk = data[offset : offset + PACING_CHUNK_BYTES]
        ahead = started + offset / bytes_per_s - time.monotonic()
        if ahead > 0:
            time.sleep(ahead)
        out.write(chunk)


def fetch_snapshot(address: str, timeout: float) -> Any:
    """A :class:`SnapshotServer`'s snapshot (tensors on the host)."""
    with urllib.request.urlopen(address, timeout=timeout) as response:
        return torch.load(io.BytesIO(response.read()), weights_only=True)


@dataclass
class KeptStep:
    """One committed step the joining group missed: an optimizer's averaged (and clipped) gradients, host copies
    of this rank's shards (``None`` where a parameter had none), and the hyper-parameters it stepped with."""

    optimizer: Optimizer
    gradients: list[Optional[Tensor]]
    hyper_parameters: list[dict[str, Any]]


class CatchUp:
    """This rank's side of a catching-up heal (module docstring): the snapshot downloading in the background, the
    steps kept meanwhile, and the replay."""

    def __init__(self, address: str, step: int, timeout: float) -> None:
        self.address = address
        #: the committed step the snapshot was taken at (before that step's update)
        self.step = step
        self.kept: list[KeptStep] = []
        self._snapshot: Any = None
        self._error: Optional[BaseException] = None
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._fetch, args=(timeout,), name="mics-ft-catch-up", daemon=True)
        self._thread.start()

    def _fetch(self, timeout: float) -> None:
        try:
            self._snapshot = fetch_snapshot(self.address, timeout)
        except BaseException as error:  # reported to the group at the next step, on every rank alike
            self._error = error
        finally:
            self._done.set()

    def wait(self, timeout: float) -> None:
        """Until the download ended, at most ``timeout`` seconds."""
        self._done.wait(timeout)

    @property
    def downloaded(self) -> bool:
        """Whether the download ended (with the snapshot or an error)."""
        return self._done.is_set()

    @property
    def failed(self) -> bool:
        return self._done.is_set() and self._error is not None

    @property
    def error(self) -> Optional[BaseException]:
        return self._error

    @torch.no_grad()
    def keep(self, optimizer: Optimizer) -> None:
        """After ``optimizer`` stepped in a committed step: its gradients and hyper-parameters, for the replay."""
        params = [p for group in optimizer.param_groups for p in group["params"]]
        self.kept.append(
            KeptStep(
                optimizer,
                [None if p.grad is None else to_host(p.grad) for p in params],
                hyper_parameters(optimizer),
            )
        )

    def snapshot(self) -> Any:
        """The downloaded snapshot (after :attr:`downloaded`); raises the download's error."""
        self._done.wait()
        if self._error is not None:
            raise self._error
        return self._snapshot

    @torch.no_grad()
    def replay(self) -> int:
        """Step the optimizers again through every kept step, in order, from the loaded snapshot: each with the
        gradients and hyper-parameters the live groups used. The hyper-parameters in effect now are put back
        after. How many steps were replayed."""
        current = {id(k.optimizer): hyper_parameters(k.optimizer) for k in self.kept}
        for kept in self.kept:
            optimizer = kept.optimizer
            params = [p for group in optimizer.param_groups for p in group["params"]]
            for param, gradient in zip(params, kept.gradients):
                param.grad = None if gradient is None else _like(param, gradient)
            set_hyper_parameters(optimizer, kept.hyper_parameters)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        for kept in self.kept:
            set_hyper_parameters(kept.optimizer, current[id(kept.optimizer)])
        replayed, self.kept = len(self.kept), []
        return replayed


def _like(param: Tensor, local: Tensor) -> Tensor:
    """A kept gradient shard as ``param``'s gradient: on its device, and a DTensor on its mesh if it is one."""
    if isinstance(param, DTensor):
        return DTensor.from_local(
            local.to(param.device), param.device_mesh, param.placements, run_check=False, shape=param.shape,
            stride=param.stride(),
        )
    return local.to(param.device)
