"""A joining group that catches up without stalling the live ones (``FaultTolerance(heal="catch_up")``).

Why: with torchft's own heal the joining group receives the live groups' shards at the quorum that admits it,
before the step, and every live group waits in that step's collectives until the transfer is done -- for a
model whose state takes several step times to cross the link, several steps lost by every group at each
rejoin. Here, as in FT-HSDP (arXiv 2602.00277), the transfer happens beside training:

1. **At the quorum** the serving rank reserves a snapshot on a small HTTP server of its own
   (:class:`SnapshotServer`); through torchft's heal (over the groups' process group) only the small rest
   travels -- hyper-parameters, schedulers, the step count -- and the snapshot's address, with a token drawn
   for this heal and the snapshot's largest size. Right after the quorum, before the step's forward, its
   training thread copies its shards (model and optimizer states) into host memory and publishes them there:
   the state at the start of the step, as the heal's small rest is. Only a request with the token gets them.
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

import hmac
import http.client
import io
import logging
import secrets
import socket
import sys
import threading
import time
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Optional
from urllib.parse import urlsplit

import torch
from torch import Tensor
from torch.distributed.tensor import DTensor
from torch.optim import Optimizer

from lightning_mics.fault_tolerance.heal_state import hyper_parameters, set_hyper_parameters
from lightning_mics.shards import laid_out_like

log = logging.getLogger("lightning_mics.fault_tolerance")

#: The most connections a snapshot server handles at once (a thread each); one more is answered a bare 503 by the
#: accepting thread, and a joining rank asks again. One joining group's rank asks once per heal.
MAX_SNAPSHOT_CONNECTIONS = 16
#: Seconds a connection has, from its accept, to send its request line and headers (a joining rank sends them at
#: once); a connection that trickles them (slow-loris) is cut off then, freeing its slot.
REQUEST_HEAD_WITHIN_S = 2.0
#: How many refused requests a server logs one by one per heal (the rest are counted in one line at its end).
REFUSALS_LOGGED = 10
#: The user name of a snapshot address's credentials: ``http://snapshot:<token>@host:port/snapshot/<step>``.
_USER = "snapshot"
_BUSY = b"HTTP/1.0 503 Service Unavailable\r\nContent-Length: 0\r\nConnection: close\r\n\r\n"


class SnapshotUnavailable(RuntimeError):
    """A joining rank could not fetch its snapshot: refused (404: not the snapshot served, or no heal open any more),
    a body larger than the heal announced, or a transport error."""


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


def without_credentials(address: str) -> str:
    """``address`` without its token, for logs and error messages."""
    parts = urlsplit(address)
    host = parts.hostname or ""
    host = f"[{host}]" if ":" in host else host
    netloc = host if parts.port is None else f"{host}:{parts.port}"
    return parts._replace(netloc=netloc).geturl()


class SnapshotServer:
    """This rank's shards at a quorum, served over HTTP to the joining group's rank of the same index -- and to no
    one else.

    One snapshot at a time (a new heal replaces it), under a token drawn for it (:meth:`reserve`): the address the
    heal hands the joining rank carries the token as its credentials, and travels in the heal's state over the
    groups' process group (torchft's ``PGTransport``), never over a listener. A request without the token, with
    another, or for another step is answered a bare 404 -- the same for each, nothing about what is served -- and
    logged with its address. The listener binds ``host`` (group.py: this host's address on the route to the job's
    master, as the group's vote does), starts with the heal's reservation and closes with :meth:`stop` once no
    group catches up from it; it handles :data:`MAX_SNAPSHOT_CONNECTIONS` at once and cuts off a connection whose
    request is not in within :data:`REQUEST_HEAD_WITHIN_S`. The snapshot is serialised once, at the first
    authorised request; its tensors are dropped then, so the server holds one copy whatever the requests."""

    def __init__(self, bytes_per_s: Optional[float] = None, wait_s: float = 60.0, host: str = "127.0.0.1") -> None:
        #: the most bytes per second a snapshot is sent at (``None``: as fast as the network takes it)
        self.bytes_per_s = bytes_per_s
        #: how long a request for a reserved snapshot waits for it to be published
        self.wait_s = wait_s
        #: the address the listener binds (never the wildcard: the snapshot is for the joining groups' route only)
        self.host = host
        self._lock = threading.Condition()
        self._payload: Any = None
        self._published = False
        self._step: Optional[int] = None
        self._token: Optional[str] = None
        self._serialised: Optional[memoryview] = None
        self._serialise_lock = threading.Lock()
        self._server: Optional[_BoundedHTTPServer] = None
        #: how many times a snapshot was serialised (once per published snapshot that someone authorised asked for)
        self.serialisations = 0
        #: snapshots sent whole, and requests refused (bare 404: no or a wrong token, another step, nothing served)
        self.served = 0
        self.refused = 0
        self._refused_this_heal = 0

    def reserve(self, step: int) -> str:
        """The address the snapshot of committed step ``step`` will be served at, before it is taken: the quorum
        hands the address to the joining group at once, and the training thread copies the shards after the
        quorum (:meth:`publish`) -- not in torchft's quorum thread, where the copy would hold up the joining
        group's heal, and with it every group's first step together. A request waits for the publication. A new
        token is drawn: an earlier heal's address opens nothing any more."""
        with self._lock:
            self._replace(step, secrets.token_hex(32))
        return self._address(step)

    def publish(self, step: int, shards: Any) -> str:
        """Serve ``shards`` -- a copy of the live state, not the live tensors: training goes on changing those
        -- as the snapshot of committed step ``step``, from host memory; its address (the reservation's, if
        ``step`` was reserved). Serialised once, at the first authorised request, in the server's thread."""
        shards = to_host(shards, copy=False)
        with self._lock:
            if self._step != step or self._token is None:
                self._replace(step, secrets.token_hex(32))
            self._payload, self._published = shards, True
            self._lock.notify_all()
        return self._address(step)

    def _replace(self, step: Optional[int], token: Optional[str]) -> None:
        """Under the lock: a new snapshot (or none), its token, nothing published nor serialised yet."""
        if self._refused_this_heal > REFUSALS_LOGGED:
            log.warning("fault tolerance: the snapshot server refused %d request(s) in all during the last heal",
                        self._refused_this_heal)
        self._payload, self._published, self._serialised = None, False, None
        self._step, self._token = step, token
        self._refused_this_heal = 0
        self._lock.notify_all()

    @property
    def reserved_step(self) -> Optional[int]:
        """The step of a snapshot reserved and not yet published (``None``: none)."""
        with self._lock:
            return self._step if not self._published else None

    def release(self) -> None:
        """Stop serving the snapshot and free its memory (the listener answers 404 until :meth:`stop`)."""
        with self._lock:
            self._replace(None, None)

    def stop(self) -> None:
        """End the heal: :meth:`release`, and close the listener -- in a thread of its own, since the accept loop
        notices within its poll interval, and the training thread that ends the heal must not wait for it. The
        next :meth:`reserve` opens a new listener."""
        self.release()
        server, self._server = self._server, None
        if server is not None:
            threading.Thread(target=_shut_down, args=(server,), name="mics-ft-snapshot-stop", daemon=True).start()

    @property
    def serving(self) -> bool:
        """Whether a snapshot is reserved or published."""
        return self._step is not None

    @property
    def bound_address(self) -> Optional[tuple[str, int]]:
        """The (host, port) the listener is bound to, ``None`` while it is closed."""
        server = self._server
        return None if server is None else tuple(server.server_address[:2])  # type: ignore[return-value]

    @property
    def open_connections(self) -> int:
        """How many connections the listener is handling now (at most :data:`MAX_SNAPSHOT_CONNECTIONS`)."""
        server = self._server
        return 0 if server is None else server.open_connections

    def _address(self, step: int) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{_USER}:{self._token}@{host}:{self._port()}/snapshot/{step}"

    def close(self) -> None:
        self.release()
        server, self._server = self._server, None
        if server is not None:
            _shut_down(server)

    def _port(self) -> int:
        if self._server is None:
            family = socket.AF_INET6 if ":" in self.host else socket.AF_INET
            self._server = _BoundedHTTPServer((self.host, 0), self._handler(), family, MAX_SNAPSHOT_CONNECTIONS)
            threading.Thread(target=self._server.serve_forever, name="mics-ft-snapshot", daemon=True).start()
        return int(self._server.server_address[1])

    def _authorised(self, path: str, authorization: Optional[str]) -> Optional[tuple[int, str]]:
        """The (step, token) a request asks for if it carries the served snapshot's token and names its step;
        ``None`` otherwise. The token is compared in constant time."""
        with self._lock:
            step, token = self._step, self._token
        if step is None or token is None or path != f"/snapshot/{step}":
            return None
        scheme, _, given = (authorization or "").partition(" ")
        if scheme != "Bearer" or not hmac.compare_digest(given.encode(), token.encode()):
            return None
        return step, token

    def _serialised_snapshot(self, step: int, token: str) -> Optional[memoryview]:
        """The published snapshot of ``step`` (under ``token``) serialised, once for every request: the first
        authorised one serialises it and drops the tensors. ``None`` if it was released or replaced meanwhile, or
        not published within ``wait_s``."""
        with self._lock:
            self._lock.wait_for(lambda: self._published or self._token != token, timeout=self.wait_s)
            if self._token != token or not self._published:
                return None
        with self._serialise_lock:
            with self._lock:
                if self._token != token:
                    return None
                if self._serialised is not None:
                    return self._serialised
                payload = self._payload
            buffer = io.BytesIO()
            torch.save(payload, buffer)
            serialised = buffer.getbuffer()
            with self._lock:
                if self._token != token:
                    return None
                self._serialised, self._payload = serialised, None
                self.serialisations += 1
            return serialised

    def _refuse(self, address: Any) -> None:
        with self._lock:
            self.refused += 1
            self._refused_this_heal += 1
            logged = self._refused_this_heal <= REFUSALS_LOGGED
        if logged:
            log.warning("fault tolerance: the snapshot server refused a request from %s:%s (no valid token for the "
                        "snapshot it serves)", *address[:2])

    def _handler(self) -> type[BaseHTTPRequestHandler]:
        server = self

        class Handler(BaseHTTPRequestHandler):
            timeout = REQUEST_HEAD_WITHIN_S  # each read of the request; the whole head has the same (setup)

            def setup(self) -> None:
                super().setup()
                self._cut_off = threading.Timer(REQUEST_HEAD_WITHIN_S, self._shut)
                self._cut_off.daemon = True
                self._cut_off.start()

            def _shut(self) -> None:
                try:
                    self.connection.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

            def finish(self) -> None:
                self._cut_off.cancel()
                super().finish()

            def do_GET(self) -> None:
                self._cut_off.cancel()  # the request is in; the answer may take as long as the snapshot's size
                self.connection.settimeout(server.wait_s)
                authorised = server._authorised(self.path, self.headers.get("Authorization"))
                if authorised is None:
                    self.send_error(404)
                    return
                data = server._serialised_snapshot(*authorised)
                if data is None:  # released or replaced meanwhile: the asker's heal is over (not a stranger)
                    self._bare_404()
                    return
                self.send_response(200)
                self.send_header("Content-Type", "application/octet-stream")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                send_paced(self.wfile, data, server.bytes_per_s)
                with server._lock:
                    server.served += 1

            def send_response(self, code: int, message: Optional[str] = None) -> None:
                self.send_response_only(code, message)  # no Server or Date header: nothing about this process

            def send_error(self, code: int, message: Optional[str] = None, explain: Optional[str] = None) -> None:
                """Every refusal -- a wrong method, a malformed request, no token -- is the same bare 404: no body,
                nothing that tells one from another (an unknown method is not told apart from a wrong token);
                counted and logged with the asker's address."""
                server._refuse(self.client_address)
                self._bare_404()

            def _bare_404(self) -> None:
                self.close_connection = True
                self.send_response_only(404)
                self.send_header("Content-Length", "0")
                self.send_header("Connection", "close")
                self.end_headers()

            def log_message(self, format: str, *args: Any) -> None:  # quiet: refusals are logged by the server
                pass

        return Handler


class _BoundedHTTPServer(ThreadingHTTPServer):
    """A threading HTTP server that runs at most ``slots`` connections at once: one more is answered a bare 503 from
    the accepting thread and closed, without a thread of its own."""

    daemon_threads = True
    #: the kernel's queue of connections not yet accepted (socketserver's 5 would leave a burst's connections
    #: waiting for a SYN retransmission, a second or more, before the accept loop even sees them)
    request_queue_size = 128

    def __init__(self, address: tuple[str, int], handler: type[BaseHTTPRequestHandler], family: int, slots: int) -> None:
        self.address_family = family
        self._slots = threading.BoundedSemaphore(slots)
        self._capacity = slots
        super().__init__(address, handler)

    @property
    def open_connections(self) -> int:
        return self._capacity - self._slots._value  # type: ignore[attr-defined]  # a read of its counter

    def process_request(self, request: Any, client_address: Any) -> None:
        if not self._slots.acquire(blocking=False):
            try:
                request.setblocking(False)
                request.send(_BUSY)
                request.recv(1 << 16)  # what came of its request: closed unread, it would reset the answer away
            except OSError:
                pass
            self.shutdown_request(request)
            return
        try:
            super().process_request(request, client_address)
        except BaseException:
            self._slots.release()
            raise

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._slots.release()

    def handle_error(self, request: Any, client_address: Any) -> None:
        """A connection that broke off (an asker that hung up mid-body, a head cut off) is the asker's business:
        socketserver would print its traceback on the rank's stderr."""
        log.debug("fault tolerance: a snapshot connection from %s ended in an error (%s)", client_address,
                  sys.exc_info()[1])


def _shut_down(server: ThreadingHTTPServer) -> None:
    server.shutdown()
    server.server_close()


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


#: Seconds between two tries of a snapshot server that answered 503 (all its connections busy).
BUSY_RETRY_S = 0.1


def fetch_snapshot(address: str, timeout: float, max_bytes: Optional[int] = None) -> Any:
    """A :class:`SnapshotServer`'s snapshot (tensors on the host), from the address a heal gave (``http`` only, its
    token as the credentials). ``max_bytes``: what the heal announced as the snapshot's largest size -- a response
    whose ``Content-Length`` is larger (or missing) is refused unread. A server whose connections are all busy
    (503) is asked again until ``timeout``; any other refusal is an error at once."""
    parts = urlsplit(address)
    if parts.scheme != "http" or not parts.hostname or parts.port is None:
        raise ValueError(
            f"a snapshot address is http://{_USER}:<token>@<host>:<port>/snapshot/<step>, as a SnapshotServer makes "
            f"it; got {without_credentials(address)!r}"
        )
    headers = {} if parts.password is None else {"Authorization": f"Bearer {parts.password}"}
    where = without_credentials(address)
    deadline = time.monotonic() + timeout
    while True:
        connection = http.client.HTTPConnection(parts.hostname, parts.port, timeout=timeout)
        try:
            try:
                connection.request("GET", parts.path, headers=headers)
                response = connection.getresponse()
                busy = response.status == 503
            except (ConnectionResetError, BrokenPipeError, http.client.RemoteDisconnected):
                busy = True  # a busy server's 503 can be lost to the reset of its close
                if time.monotonic() + BUSY_RETRY_S >= deadline:
                    raise
            if busy and time.monotonic() + BUSY_RETRY_S < deadline:
                time.sleep(BUSY_RETRY_S)
                continue
            if response.status != 200:
                raise SnapshotUnavailable(
                    f"the snapshot server answered {response.status} to {where}: it serves no such snapshot for "
                    "this token (the heal was closed or replaced)"
                )
            length = response.getheader("Content-Length")
            if length is None or not length.isdigit():
                raise SnapshotUnavailable(f"{where} answered without a Content-Length: refused unread")
            if max_bytes is not None and int(length) > max_bytes:
                raise SnapshotUnavailable(
                    f"{where} announced a body of {int(length)} bytes, more than the {max_bytes} the heal announced: "
                    "refused unread"
                )
            try:
                data = response.read(int(length))
            except http.client.IncompleteRead as short:
                data = short.partial
            if len(data) != int(length):
                raise SnapshotUnavailable(f"{where} closed after {len(data)} of {int(length)} bytes")
        except (OSError, http.client.HTTPException) as error:
            raise SnapshotUnavailable(f"could not fetch {where} ({error or type(error).__name__})") from error
        finally:
            connection.close()
        return torch.load(io.BytesIO(data), weights_only=True)


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

    def __init__(self, address: str, step: int, timeout: float, max_bytes: Optional[int] = None) -> None:
        #: where the snapshot is served, with its token (:attr:`location` is the address without it)
        self.address = address
        #: the largest snapshot the heal announced (a larger body is refused unread)
        self.max_bytes = max_bytes
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
            self._snapshot = fetch_snapshot(self.address, timeout, self.max_bytes)
        except BaseException as error:  # reported to the group at the next step, on every rank alike
            self._error = error
        finally:
            self._done.set()

    @property
    def location(self) -> str:
        """The snapshot's address without its token: what logs and errors name."""
        return without_credentials(self.address)

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
                param.grad = None if gradient is None else laid_out_like(gradient.to(param.device), param)
            set_hyper_parameters(optimizer, kept.hyper_parameters)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        for kept in self.kept:
            set_hyper_parameters(kept.optimizer, current[id(kept.optimizer)])
        replayed, self.kept = len(self.kept), []
        return replayed
