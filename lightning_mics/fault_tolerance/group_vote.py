"""The replica group's own vote: a few yes/no flags or'ed over every rank of this group's world, over direct TCP
connections between each rank and the group's rank 0.

Fault tolerance asks this question at every step -- "did any rank of this group see the step fail?" -- because a
rank must not let its optimizer step while a peer of its group discards (the group's shards would no longer be
one model). Through the world's process group the question is a collective: a gloo all-reduce of two numbers
costs ~0.3-0.5 ms of CPU per rank on this project's 2-core hosts (its work queue, ring and wake-ups) and, with
NCCL, a kernel launch and a device synchronisation. Over one pre-connected socket per peer it is two small
messages, ~0.05 ms -- and it keeps the property the collective gave: a rank that dies closes its connections,
so the vote fails at once on its peers (they end the group saying so), and a rank that hangs fails it after
``timeout`` seconds, like a collective's timeout.

Only the group's ranks take part: a connection to rank 0 counts once it proved it knows the group's secret (an HMAC
challenge, :class:`GroupVote`), so a stranger on the network that connects first takes no rank's seat and votes
nothing. The messages after that are not signed: the vote, like gloo, NCCL and torchft, assumes no one on the path
between two ranks of the job rewrites their traffic (docs/fault-tolerance.md, "The trust model")."""

from __future__ import annotations

import hashlib
import hmac
import logging
import secrets
import selectors
import socket
import struct
import time
from typing import Optional

import torch.distributed as dist

log = logging.getLogger("lightning_mics.fault_tolerance")

#: One message: the exchange's sequence number (mod 256: a rank out of step with its group is an error, not a
#: silently mixed-up vote) and the flags, one bit each.
_MESSAGE = struct.Struct("!BB")
#: The most flags one vote carries (the bits of one byte).
MAX_FLAGS = 8
#: Bytes of the group's secret (drawn by rank 0, sent to the others over the world's process group).
SECRET_BYTES = 32
#: Bytes of rank 0's challenge, fresh for every connection: a recorded proof does not open another one.
CHALLENGE_BYTES = 16
#: What a rank answers a challenge with: its rank and the HMAC-SHA256 of (challenge, rank) under the secret.
_PROOF = struct.Struct("!I32s")
#: Rank 0's answer to a proof it accepted (the rank's seat is taken; the connection is the vote's from now on).
_SEATED = b"\x01"
#: Seconds a connection has, from its accept, to prove it is a rank of this group before rank 0 closes it. A rank
#: answers within a round trip; a stranger, or a silent connection, holds no one up for longer than this, and rank
#: 0 keeps accepting meanwhile.
PROOF_WITHIN_S = 3.0
#: The most connections rank 0 keeps waiting for a proof at once; beyond, the oldest is closed (a real rank's
#: connection is refused only if that many arrived after it within one round trip -- then the rank connects again).
MAX_UNPROVEN = 64
#: How many refused connections rank 0 logs one by one (the rest are counted in one line).
REFUSALS_LOGGED = 10
_DOMAIN = b"lightning-mics group vote v1"


class GroupVoteFailed(RuntimeError):
    """A rank of the group did not take part in a vote: it was lost (connection closed or reset), hung past the
    timeout, or is out of step with the others -- or, at the start, never proved itself to rank 0."""


def local_address_towards(host: str, port: int) -> tuple[socket.AddressFamily, str]:
    """This host's address on the route to ``host`` (the job's ``MASTER_ADDR``), and its family: every rank of
    the world reaches the master through it, so the group's other ranks can reach this one there. Found with a
    connected UDP socket, which sends nothing."""
    family, _, _, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_DGRAM)[0]
    with socket.socket(family, socket.SOCK_DGRAM) as probe:
        probe.connect(address)
        return family, probe.getsockname()[0]


def proof(secret: bytes, challenge: bytes, rank: int) -> bytes:
    """What rank ``rank`` answers ``challenge`` with: its rank and a MAC no one without the group's secret can
    make, bound to this challenge (so a proof seen on the wire opens no later connection)."""
    mac = hmac.new(secret, _DOMAIN + challenge + struct.pack("!I", rank), hashlib.sha256).digest()
    return _PROOF.pack(rank, mac)


class GroupVote:
    """``any(*flags)``: each flag or'ed over every rank of this world (the same answer on every rank). Rank 0
    listens; every other rank connects to it once, at construction (a collective of the world: every rank
    constructs it at the same point). Then each vote is one message from every rank to rank 0 and one back.

    Who may take part: rank 0 draws a secret and sends it, with its listener's address, to the other ranks over
    the world's own process group; a connection counts only once it answered rank 0's challenge with that
    secret's MAC for a rank in range that has no seat yet (:meth:`_admit`). Anything else -- a stranger first in
    line, a wrong MAC, garbage, silence -- is closed and logged with its address, without holding up the ranks:
    only a rank that never proves itself within ``timeout`` fails the group (:class:`GroupVoteFailed`)."""

    def __init__(self, master_addr: str, master_port: int, timeout: float) -> None:
        self.rank = dist.get_rank()
        self.world_size = dist.get_world_size()
        self.timeout = timeout
        self._sequence = 0
        self._peers: list[tuple[int, socket.socket]] = []  # rank 0: (rank, connection) of every other rank
        self._to_root: Optional[socket.socket] = None  # every other rank: its connection to rank 0
        #: connections rank 0 closed without a seat (strangers, bad proofs), counted for the tests and the log
        self.refused = 0
        if self.world_size == 1:
            return
        listener = None
        offer: list[object] = [None]
        if self.rank == 0:
            family, host = local_address_towards(master_addr, master_port)
            listener = socket.create_server((host, 0), family=family, backlog=self.world_size + MAX_UNPROVEN)
            offer = [(listener.getsockname()[:2], secrets.token_bytes(SECRET_BYTES))]
        dist.broadcast_object_list(offer, src=0)  # the group's own world: the secret crosses no listener of ours
        (host, port), secret = offer[0]  # type: ignore[misc]
        try:
            if listener is not None:
                self._peers = self._admit(listener, secret)
            else:
                self._to_root = self._join(host, port, secret)
        except OSError as error:
            self.close()
            raise GroupVoteFailed(f"the group's vote could not connect rank {self.rank} to rank 0 ({error})") from error
        except GroupVoteFailed:
            self.close()
            raise
        finally:
            if listener is not None:
                listener.close()

    def _admit(self, listener: socket.socket, secret: bytes) -> list[tuple[int, socket.socket]]:
        """Rank 0: accept until every other rank proved itself, within ``timeout``; each connection has
        :data:`PROOF_WITHIN_S` from its accept (one selector over the listener and every unproven connection, so
        a slow or silent one holds no other up). The seated connections in rank order."""
        deadline = time.monotonic() + self.timeout
        seated: dict[int, socket.socket] = {}
        unproven: dict[socket.socket, _Unproven] = {}  # insertion order: oldest first
        listener.setblocking(False)
        selector = selectors.DefaultSelector()
        selector.register(listener, selectors.EVENT_READ)
        try:
            while len(seated) < self.world_size - 1:
                now = time.monotonic()
                for connection, pending in list(unproven.items()):
                    if now >= pending.deadline:
                        self._refuse(selector, unproven, connection, f"no proof within {PROOF_WITHIN_S:g} s")
                if now >= deadline:
                    missing = sorted(set(range(1, self.world_size)) - set(seated))
                    raise GroupVoteFailed(
                        f"the group's vote: rank(s) {missing} of this group did not connect to rank 0 and prove "
                        f"themselves within {self.timeout:g} s ({self.refused} other connection(s) refused)"
                    )
                wake = min([deadline, *(pending.deadline for pending in unproven.values())])
                for key, _ in selector.select(max(0.0, wake - now)):
                    if key.fileobj is listener:
                        self._accept_all(listener, selector, unproven)
                    else:
                        self._read_proof(key.fileobj, secret, selector, unproven, seated)  # type: ignore[arg-type]
        except BaseException:
            for connection in seated.values():
                connection.close()
            raise
        finally:
            why = "the group was complete" if len(seated) == self.world_size - 1 else "rank 0 gave up waiting"
            for connection in list(unproven):
                self._refuse(selector, unproven, connection, f"{why} before it proved itself")
            selector.close()
        if self.refused > REFUSALS_LOGGED:
            log.warning("fault tolerance: the group's vote refused %d connection(s) in all", self.refused)
        return sorted(seated.items())

    def _accept_all(
        self, listener: socket.socket, selector: selectors.BaseSelector, unproven: dict[socket.socket, _Unproven]
    ) -> None:
        while True:
            try:
                connection, address = listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            connection.setblocking(False)
            challenge = secrets.token_bytes(CHALLENGE_BYTES)
            unproven[connection] = _Unproven(address, challenge, time.monotonic() + PROOF_WITHIN_S)
            selector.register(connection, selectors.EVENT_READ)
            try:
                sent = connection.send(challenge)  # a fresh connection's send buffer takes 16 bytes at once
            except OSError as error:
                self._refuse(selector, unproven, connection, f"reset before its challenge ({error})")
                continue
            if sent != len(challenge):
                self._refuse(selector, unproven, connection, "its challenge could not be sent whole")
            if len(unproven) > MAX_UNPROVEN:
                oldest = next(iter(unproven))
                self._refuse(selector, unproven, oldest, f"more than {MAX_UNPROVEN} connections waiting to prove")

    def _read_proof(
        self,
        connection: socket.socket,
        secret: bytes,
        selector: selectors.BaseSelector,
        unproven: dict[socket.socket, _Unproven],
        seated: dict[int, socket.socket],
    ) -> None:
        pending = unproven[connection]
        try:
            chunk = connection.recv(_PROOF.size - len(pending.received))
        except (BlockingIOError, InterruptedError):
            return
        except OSError as error:
            self._refuse(selector, unproven, connection, f"reset before its proof ({error})")
            return
        if not chunk:
            self._refuse(selector, unproven, connection, "closed before its proof")
            return
        pending.received += chunk
        if len(pending.received) < _PROOF.size:
            return
        rank, _ = _PROOF.unpack(pending.received)
        # the MAC first, in constant time: a stranger learns nothing from which check failed
        if not hmac.compare_digest(pending.received, proof(secret, pending.challenge, rank)):
            self._refuse(selector, unproven, connection, "a wrong proof: not a rank of this group")
        elif not 1 <= rank < self.world_size:
            self._refuse(selector, unproven, connection, f"rank {rank} outside 1..{self.world_size - 1}")
        elif rank in seated:
            self._refuse(selector, unproven, connection, f"rank {rank} is connected already")
        else:
            selector.unregister(connection)
            del unproven[connection]
            try:
                connection.setblocking(True)
                self._configure(connection)
                connection.sendall(_SEATED)
            except OSError as error:  # it proved itself, then left: its seat stays free for it to connect again
                connection.close()
                log.warning("fault tolerance: rank %d of this group left right after proving itself (%s)", rank, error)
                return
            seated[rank] = connection

    def _refuse(
        self,
        selector: selectors.BaseSelector,
        unproven: dict[socket.socket, _Unproven],
        connection: socket.socket,
        why: str,
    ) -> None:
        pending = unproven.pop(connection)
        try:
            selector.unregister(connection)
        except (KeyError, ValueError):
            pass
        connection.close()
        self.refused += 1
        if self.refused <= REFUSALS_LOGGED:
            log.warning(
                "fault tolerance: the group's vote refused a connection from %s (%s)", _format(pending.address), why
            )

    def _join(self, host: str, port: int, secret: bytes) -> socket.socket:
        """Every other rank: connect to rank 0, answer its challenge, wait for the seat. A connection rank 0 closed
        before seating it (it took too long to prove itself, say, on a host whose cores are busy) is tried again
        until ``timeout``."""
        deadline = time.monotonic() + self.timeout
        while True:
            left = max(deadline - time.monotonic(), 0.001)
            connection: Optional[socket.socket] = None
            try:
                connection = socket.create_connection((host, port), timeout=left)
                self._configure(connection)
                connection.settimeout(left)
                challenge = _receive(connection, CHALLENGE_BYTES)
                connection.sendall(proof(secret, challenge, self.rank))
                if _receive(connection, len(_SEATED)) != _SEATED:
                    raise ConnectionResetError("rank 0 answered the proof with something else")
                connection.settimeout(self.timeout)
                return connection
            except OSError as error:
                if connection is not None:
                    connection.close()
                if isinstance(error, socket.timeout) or time.monotonic() + 0.05 >= deadline:
                    raise GroupVoteFailed(
                        f"the group's vote: rank 0 did not seat rank {self.rank} within {self.timeout:g} s "
                        f"({_why(error)})"
                    ) from error
                time.sleep(0.05)

    def _configure(self, connection: socket.socket) -> None:
        connection.settimeout(self.timeout)
        connection.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def any(self, *flags: bool) -> tuple[bool, ...]:
        """Each of ``flags`` or'ed over every rank of the group. Raises :class:`GroupVoteFailed` when a rank was
        lost, hung for ``timeout`` seconds or voted out of step."""
        if len(flags) > MAX_FLAGS:
            raise ValueError(f"a group vote carries at most {MAX_FLAGS} flags, got {len(flags)}")
        mask = sum(1 << i for i, flag in enumerate(flags) if flag)
        sequence, self._sequence = self._sequence, (self._sequence + 1) % 256
        if self.world_size > 1:
            mask = self._exchange(sequence, mask)
        return tuple(bool(mask >> i & 1) for i in range(len(flags)))

    def _exchange(self, sequence: int, mask: int) -> int:
        if self._to_root is not None:
            try:
                self._to_root.sendall(_MESSAGE.pack(sequence, mask))
                got, result = _MESSAGE.unpack(_receive(self._to_root, _MESSAGE.size))
            except OSError as error:
                raise GroupVoteFailed(f"rank 0 of this group did not answer its vote ({_why(error)})") from error
            if got != sequence:
                raise GroupVoteFailed(f"rank 0 of this group is at vote {got}, this rank at {sequence}")
            return result
        for rank, connection in self._peers:
            try:
                got, flags = _MESSAGE.unpack(_receive(connection, _MESSAGE.size))
            except OSError as error:
                raise GroupVoteFailed(f"rank {rank} of this group did not vote ({_why(error)})") from error
            if got != sequence:
                raise GroupVoteFailed(f"rank {rank} of this group is at vote {got}, rank 0 at {sequence}")
            mask |= flags
        for rank, connection in self._peers:
            try:
                connection.sendall(_MESSAGE.pack(sequence, mask))
            except OSError as error:
                raise GroupVoteFailed(f"rank {rank} of this group was lost ({_why(error)})") from error
        return mask

    def close(self) -> None:
        """Close every connection (the peers' next vote then fails at once); idempotent."""
        for _, connection in self._peers:
            connection.close()
        self._peers = []
        if self._to_root is not None:
            self._to_root.close()
            self._to_root = None


def _receive(connection: socket.socket, size: int) -> bytes:
    """Exactly ``size`` bytes; a closed connection is an error (the peer's process ended)."""
    data = b""
    while len(data) < size:
        chunk = connection.recv(size - len(data))
        if not chunk:
            raise ConnectionResetError("connection closed")
        data += chunk
    return data


def _why(error: OSError) -> str:
    return "no answer within the timeout" if isinstance(error, socket.timeout) else str(error) or type(error).__name__


class _Unproven:
    """A connection rank 0 accepted and is waiting for a proof from: where it came from, its challenge, the bytes
    of its answer so far, and when it is closed if the answer is not complete."""

    __slots__ = ("address", "challenge", "deadline", "received")

    def __init__(self, address: object, challenge: bytes, deadline: float) -> None:
        self.address = address
        self.challenge = challenge
        self.deadline = deadline
        self.received = b""


def _format(address: object) -> str:
    if isinstance(address, tuple) and len(address) >= 2:
        host, port = address[0], address[1]
        return f"[{host}]:{port}" if ":" in str(host) else f"{host}:{port}"
    return str(address)
