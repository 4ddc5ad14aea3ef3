"""The replica group's own vote: a few yes/no flags or'ed over every rank of this group's world, over direct TCP
connections between each rank and the group's rank 0.

Fault tolerance asks this question at every step -- "did any rank of this group see the step fail?" -- because a
rank must not let its optimizer step while a peer of its group discards (the group's shards would no longer be
one model). Through the world's process group the question is a collective: a gloo all-reduce of two numbers
costs ~0.3-0.5 ms of CPU per rank on this project's 2-core hosts (its work queue, ring and wake-ups) and, with
NCCL, a kernel launch and a device synchronisation. Over one pre-connected socket per peer it is two small
messages, ~0.05 ms -- and it keeps the property the collective gave: a rank that dies closes its connections,
so the vote fails at once on its peers (they end the group saying so), and a rank that hangs fails it after
``timeout`` seconds, like a collective's timeout."""

from __future__ import annotations

import socket
import struct
from typing import Optional

import torch.distributed as dist

#: One message: the exchange's sequence number (mod 256: a rank out of step with its group is an error, not a
#: silently mixed-up vote) and the flags, one bit each.
_MESSAGE = struct.Struct("!BB")
#: The most flags one vote carries (the bits of one byte).
MAX_FLAGS = 8


class GroupVoteFailed(RuntimeError):
    """A rank of the group did not take part in a vote: it was lost (connection closed or reset), hung past the
    timeout, or is out of step with the others."""


def local_address_towards(host: str, port: int) -> tuple[socket.AddressFamily, str]:
    """This host's address on the route to ``host`` (the job's ``MASTER_ADDR``), and its family: every rank of
    the world reaches the master through it, so the group's other ranks can reach this one there. Found with a
    connected UDP socket, which sends nothing."""
    family, _, _, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_DGRAM)[0]
    with socket.socket(family, socket.SOCK_DGRAM) as probe:
        probe.connect(address)
        return family, probe.getsockname()[0]


class GroupVote:
    """``any(*flags)``: each flag or'ed over every rank of this world (the same answer on every rank). Rank 0
    listens; every other rank connects to it once, at construction (a collective of the world: every rank
    constructs it at the same point). Then each vote is one message from every rank to rank 0 and one back."""

    def __init__(self, master_addr: str, master_port: int, timeout: float) -> None:
        self.rank = dist.get_rank()
        self.world_size = dist.get_world_size()
        self.timeout = timeout
        self._sequence = 0
        self._peers: list[tuple[int, socket.socket]] = []  # rank 0: (rank, connection) of every other rank
        self._to_root: Optional[socket.socket] = None  # every other rank: its connection to rank 0
        if self.world_size == 1:
            return
        listener = None
        address: list[object] = [None]
        if self.rank == 0:
            family, host = local_address_towards(master_addr, master_port)
            listener = socket.create_server((host, 0), family=family, backlog=self.world_size)
            listener.settimeout(timeout)
            address = [listener.getsockname()[:2]]
        dist.broadcast_object_list(address, src=0)
        host, port = address[0]  # type: ignore[misc]
        try:
            if listener is not None:
                for _ in range(self.world_size - 1):
                    connection, _ = listener.accept()
                    self._configure(connection)
                    (rank,) = struct.unpack("!I", _receive(connection, 4))
                    self._peers.append((rank, connection))
                self._peers.sort()
            else:
                connection = socket.create_connection((host, port), timeout=timeout)
                self._configure(connection)
                connection.sendall(struct.pack("!I", self.rank))
                self._to_root = connection
        except OSError as error:
            self.close()
            raise GroupVoteFailed(f"the group's vote could not connect rank {self.rank} to rank 0 ({error})") from error
        finally:
            if listener is not None:
                listener.close()

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
