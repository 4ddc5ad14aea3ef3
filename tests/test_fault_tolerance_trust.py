"""Fault tolerance's own channels admit only the job's ranks (docs/fault-tolerance.md, "The trust model"): hostile
clients on 127.0.0.1 against the catch-up snapshot server and the group's vote are refused, served nothing and
logged, and during a real heal and vote the training commits every step and ends bit-identical to a run without
them.

A hostile client on 127.0.0.1 against the group's vote (``group_vote.py``) and the catch-up snapshot server
(``catch_up.py``): connections with a wrong secret, an out-of-range or duplicate rank, garbage, silence, a replayed
proof; snapshot requests without the token, with a wrong one, for another step, 50 at once, a slow-loris, a body,
and a response larger than the heal announced. Each is refused with nothing served, no extra copy of the snapshot
made, and the refusal logged with the stranger's address -- and, in the end-to-end test, while a real catch-up heal
and a real vote run, the training beside it commits every step and ends bit-identical to a run without the
stranger. Also: the snapshot server binds the routed address (never the wildcard), the heal's state travels over
torchft's process-group transport (torchft's manager hands a stranger no checkpoint URL), and only a rank that
never arrives fails the group's start."""

from __future__ import annotations

import logging
import os
import secrets
import socket
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta
from pathlib import Path
from typing import Any, Optional
from urllib.parse import urlsplit

import pytest
import torch
import torch.distributed as dist
from distributed import free_port, run_ranks
from torch import nn

from lightning_mics.fault_tolerance.catch_up import (
    MAX_SNAPSHOT_CONNECTIONS,
    REQUEST_HEAD_WITHIN_S,
    SnapshotServer,
    SnapshotUnavailable,
    fetch_snapshot,
)
from lightning_mics.fault_tolerance.group_vote import (
    CHALLENGE_BYTES,
    PROOF_WITHIN_S,
    GroupVote,
    GroupVoteFailed,
    proof,
)
from lightning_mics.fault_tolerance.heal_state import snapshot_bytes_bound, split_shards, training_state

#: What the snapshot server answers every refused request: a status line and two headers, nothing else.
BARE_404 = b"HTTP/1.0 404 Not Found\r\nContent-Length: 0\r\nConnection: close\r\n\r\n"
BUSY_503 = b"HTTP/1.0 503 Service Unavailable\r\nContent-Length: 0\r\nConnection: close\r\n\r\n"


# ------------------------------------------------------------------------------------------- hostile helpers
def _exchange(port: int, request: bytes, timeout: float = 10.0) -> bytes:
    """Send ``request`` to 127.0.0.1:``port`` as a stranger and read everything until the server closes."""
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as connection:
        try:
            connection.sendall(request)
        except OSError:
            pass
        return _read_until_closed(connection)


def _read_until_closed(connection: socket.socket) -> bytes:
    received = b""
    try:
        while chunk := connection.recv(1 << 16):
            received += chunk
    except ConnectionResetError:
        pass
    return received


def _get(step: int, token: Optional[str] = None) -> bytes:
    authorization = b"" if token is None else f"Authorization: Bearer {token}\r\n".encode()
    return f"GET /snapshot/{step} HTTP/1.1\r\nHost: x\r\n".encode() + authorization + b"\r\n"


def _slow_loris(port: int, every_s: float = 0.3) -> tuple[float, bytes]:
    """A connection that trickles its request head a byte at a time: (seconds until the server cut it off, what
    the server sent)."""
    began = time.monotonic()
    with socket.create_connection(("127.0.0.1", port), timeout=10) as connection:
        for byte in _get(1) * 10:
            try:
                connection.send(bytes([byte]))
            except OSError:
                break
            readable, received = _poll(connection, every_s)
            if readable:
                return time.monotonic() - began, received + _read_until_closed(connection)
        return time.monotonic() - began, _read_until_closed(connection)


def _poll(connection: socket.socket, seconds: float) -> tuple[bool, bytes]:
    connection.settimeout(seconds)
    try:
        return True, connection.recv(1 << 16)  # b"" when closed
    except TimeoutError:
        return False, b""
    except ConnectionResetError:
        return True, b""
    finally:
        connection.settimeout(10)


def _attack_snapshot_server(server: SnapshotServer, address: str, step: int) -> dict[str, Any]:
    """Everything a stranger on this host tries against a snapshot being served, with what came back. The token
    is read from the address only to check that no answer or log contains it."""
    port = urlsplit(address).port
    assert port is not None
    wrong = secrets.token_hex(32)
    answers = {
        "no token": _exchange(port, _get(step)),
        "a wrong token": _exchange(port, _get(step, wrong)),
        "another step": _exchange(port, _get(step + 1)),
        "another step, a wrong token": _exchange(port, _get(step - 1, wrong)),
        "the root": _exchange(port, b"GET / HTTP/1.1\r\nHost: x\r\n\r\n"),
        "basic credentials": _exchange(
            port, f"GET /snapshot/{step} HTTP/1.1\r\nAuthorization: Basic {wrong}\r\n\r\n".encode()
        ),
        "a body": _exchange(
            port, f"POST /snapshot/{step} HTTP/1.1\r\nContent-Length: 1000000000\r\n\r\n".encode() + b"x" * 65536
        ),
        "garbage": _exchange(port, bytes(range(256)) * 4 + b"\r\n\r\n"),
    }
    with ThreadPoolExecutor(50) as pool:
        parallel = list(pool.map(lambda _: _exchange(port, _get(step)), range(50)))
    loris_seconds, loris_answer = _slow_loris(port)
    return {
        "answers": answers,
        "parallel": parallel,
        "loris": (loris_seconds, loris_answer),
        "serialisations_after": server.serialisations,
        "port": port,
    }


def _listening(port: int) -> list[str]:
    """The local addresses sockets listen on at ``port`` on this host, from /proc/net/tcp and tcp6 (what
    ``ss -ltn`` reads): "127.0.0.1", "0.0.0.0", "::"..."""
    found = []
    for table, width in (("/proc/net/tcp", 8), ("/proc/net/tcp6", 32)):
        if not os.path.exists(table):
            continue
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            local, state = fields[1], fields[3]
            host_hex, port_hex = local.split(":")
            if state == "0A" and int(port_hex, 16) == port:
                raw = bytes.fromhex(host_hex)
                if width == 8:
                    found.append(socket.inet_ntop(socket.AF_INET, raw[::-1]))
                else:  # four little-endian 32-bit words
                    words = b"".join(raw[i : i + 4][::-1] for i in range(0, 16, 4))
                    found.append(socket.inet_ntop(socket.AF_INET6, words))
    return found


def _check_refused(attack: dict[str, Any], token: str) -> None:
    for what, answer in attack["answers"].items():  # garbage without an HTTP version is answered nothing at all
        assert answer == BARE_404 or (what == "garbage" and answer == b""), (what, answer)
    assert all(answer in (BARE_404, BUSY_503) for answer in attack["parallel"]), set(attack["parallel"])
    assert BARE_404 in attack["parallel"]
    seconds, answer = attack["loris"]
    assert answer in (b"", BARE_404) and seconds < REQUEST_HEAD_WITHIN_S + 1.5, attack["loris"]
    everything = b"".join([*attack["answers"].values(), *attack["parallel"], answer])
    assert token.encode() not in everything


# ------------------------------------------------------------------------------------------- the snapshot server
def _shards() -> dict[str, Any]:
    return {"model": {"w": torch.arange(20_000.0)}, "optimizers": [{"state": {0: {"step": torch.tensor(2.0)}}}]}


def test_a_stranger_gets_a_bare_404_for_every_request_and_the_snapshot_is_serialised_once(
    caplog: pytest.LogCaptureFixture,
) -> None:
    server = SnapshotServer(host="127.0.0.1")
    try:
        address = server.publish(5, _shards())
        token = urlsplit(address).password
        assert token and len(token) == 64
        with caplog.at_level(logging.WARNING, logger="lightning_mics.fault_tolerance"):
            attack = _attack_snapshot_server(server, address, 5)
        _check_refused(attack, token)
        assert attack["serialisations_after"] == 0 and server.served == 0  # nothing serialised for a stranger
        # each refusal answered 404 is counted (a parallel request beyond the server's slots is answered 503 instead)
        assert server.refused >= len(attack["answers"]) + attack["parallel"].count(BARE_404)
        refusals = [r.getMessage() for r in caplog.records if "snapshot server refused a request" in r.message]
        assert refusals and all("from 127.0.0.1:" in message for message in refusals)
        assert token not in caplog.text

        # the joining rank, with the token, several times and beside strangers: one serialisation for all
        with ThreadPoolExecutor(8) as pool:
            strangers = [pool.submit(_exchange, attack["port"], _get(5)) for _ in range(20)]
            got = [pool.submit(fetch_snapshot, address, 10) for _ in range(3)]
            results = [future.result() for future in got]
            assert all(s.result() in (BARE_404, BUSY_503) for s in strangers)
        for result in results:
            assert torch.equal(result["model"]["w"], torch.arange(20_000.0))
        assert server.serialisations == 1 and server.served == 3
        assert server._payload is None  # the tensors were dropped once serialised: one copy in memory
    finally:
        server.close()


def test_the_snapshot_server_binds_the_address_it_is_given_never_the_wildcard() -> None:
    server = SnapshotServer(host="127.0.0.1")
    try:
        assert server.bound_address is None  # no listener before a heal
        address = server.reserve(1)
        host, port = server.bound_address  # type: ignore[misc]
        assert host == "127.0.0.1" and urlsplit(address).hostname == "127.0.0.1"
        assert _listening(port) == ["127.0.0.1"]  # as ss -ltn shows it: not 0.0.0.0, not ::
    finally:
        server.close()


def test_the_client_takes_http_only_and_refuses_a_body_larger_than_announced() -> None:
    server = SnapshotServer(host="127.0.0.1")
    try:
        address = server.publish(2, _shards())
        for scheme in ("https", "file", "ftp", "gopher"):
            with pytest.raises(ValueError, match=r"a snapshot address is http://snapshot:<token>@"):
                fetch_snapshot(address.replace("http", scheme, 1), timeout=5)
        bound = snapshot_bytes_bound(_shards())
        assert torch.equal(fetch_snapshot(address, 10, max_bytes=bound)["model"]["w"], torch.arange(20_000.0))
        with pytest.raises(SnapshotUnavailable, match=r"more than the 1000 the heal announced: refused unread") as e:
            fetch_snapshot(address, 10, max_bytes=1000)
        assert urlsplit(address).password not in str(e.value)  # errors name the address without its token
    finally:
        server.close()

    # whatever answers at a snapshot's address (a port taken over once the server closed): a huge Content-Length
    # is refused before a byte of the body is read, a missing one too, a short body is an error
    for head, match in (
        (b"HTTP/1.0 200 OK\r\nContent-Length: 1000000000000\r\n\r\n", "more than the 100000 the heal announced"),
        (b"HTTP/1.0 200 OK\r\n\r\n", "without a Content-Length"),
        (b"HTTP/1.0 200 OK\r\nContent-Length: 5000\r\n\r\n", "closed after"),
    ):
        port, stop = _hostile_server(head + b"x" * 1000)
        try:
            began = time.monotonic()
            with pytest.raises(SnapshotUnavailable, match=match):
                fetch_snapshot(f"http://snapshot:{'0' * 64}@127.0.0.1:{port}/snapshot/1", 5, max_bytes=100_000)
            assert time.monotonic() - began < 3
        finally:
            stop()


def _hostile_server(answer: bytes) -> tuple[int, Any]:
    """A listener on 127.0.0.1 that answers every connection with ``answer`` and closes (after 1 s, so that a client
    that reads on would see the close, not wait)."""
    listener = socket.create_server(("127.0.0.1", 0))
    listener.settimeout(0.2)
    stopped = threading.Event()

    def serve() -> None:
        while not stopped.is_set():
            try:
                connection, _ = listener.accept()
            except TimeoutError:
                continue
            connection.recv(1 << 16)  # the request (closed unread, the answer would be reset away)
            connection.sendall(answer)
            time.sleep(0.3)
            connection.close()
        listener.close()

    threading.Thread(target=serve, daemon=True).start()
    return listener.getsockname()[1], stopped.set


def test_slow_and_idle_connections_are_cut_off_without_keeping_the_joining_rank_out() -> None:
    """Every connection slot held by an idle stranger: the next one is answered a bare 503 at once, the slots free
    themselves within the head bound, and the joining rank (which asks again on a 503) gets its snapshot."""
    server = SnapshotServer(host="127.0.0.1")
    idle: list[socket.socket] = []
    try:
        address = server.publish(4, _shards())
        port = urlsplit(address).port
        began = time.monotonic()
        idle = [socket.create_connection(("127.0.0.1", port), timeout=10) for _ in range(MAX_SNAPSHOT_CONNECTIONS)]
        while server.open_connections < MAX_SNAPSHOT_CONNECTIONS:  # all accepted
            assert time.monotonic() - began < REQUEST_HEAD_WITHIN_S, server.open_connections
            time.sleep(0.01)
        assert _exchange(port, _get(4)) in (BUSY_503, b"")
        got = fetch_snapshot(address, timeout=15)
        waited = time.monotonic() - began
        assert torch.equal(got["model"]["w"], torch.arange(20_000.0))
        assert waited < REQUEST_HEAD_WITHIN_S + 2.0, waited
        for connection in idle:  # each was closed by the server, having received nothing
            assert _poll(connection, 5.0) == (True, b"")
    finally:
        for connection in idle:
            connection.close()
        server.close()


def test_a_heal_that_ends_closes_the_listener_and_the_next_heal_has_a_new_token() -> None:
    server = SnapshotServer(host="127.0.0.1")
    try:
        first = server.reserve(3)
        server.publish(3, _shards())
        port = urlsplit(first).port
        server.stop()
        deadline = time.monotonic() + 5
        while _listening(port) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert _listening(port) == []  # serves only while a heal is open
        with pytest.raises(SnapshotUnavailable):
            fetch_snapshot(first, timeout=5)
        second = server.reserve(3)  # the same step, a new heal
        server.publish(3, _shards())
        assert urlsplit(second).password != urlsplit(first).password
        with pytest.raises(SnapshotUnavailable, match="404"):  # the earlier heal's token opens nothing
            fetch_snapshot(second.replace(urlsplit(second).password, urlsplit(first).password), timeout=5)
        assert torch.equal(fetch_snapshot(second, timeout=10)["model"]["w"], torch.arange(20_000.0))
    finally:
        server.close()


def test_the_announced_bound_holds_for_a_real_snapshot_and_is_what_the_quorum_sends() -> None:
    class Long(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            name = "a_parameter_name_as_long_as_a_transformer_block_s_fully_qualified_one_" * 3
            self.layers = nn.ModuleDict({f"{name}{i}": nn.Linear(7, 3) for i in range(40)})

    model = Long()
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    optimizer.step()
    whole = training_state(model.state_dict(), [optimizer], [], global_step=1)
    small, shards = split_shards(whole)
    import io

    buffer = io.BytesIO()
    torch.save(shards, buffer)
    assert buffer.tell() <= small["snapshot_bytes_bound"] < 4 * buffer.tell() + (1 << 17)
    at_quorum = training_state(model.state_dict(), [optimizer], [], global_step=1, shards=False)
    assert at_quorum["snapshot_bytes_bound"] == small["snapshot_bytes_bound"]


# ------------------------------------------------------------------------------------------- the group's vote
def _join_world(rank: int, world_size: int, port: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world_size, timeout=timedelta(seconds=30))


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []
        logging.getLogger("lightning_mics.fault_tolerance").addHandler(self)

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def _stranger(host: str, port: int, answer: Optional[Any]) -> socket.socket:
    """A connection to rank 0's vote that reads the challenge and sends ``answer(challenge)`` (``None``: nothing)."""
    connection = socket.create_connection((host, port), timeout=10)
    challenge = b""
    while len(challenge) < CHALLENGE_BYTES:
        challenge += connection.recv(CHALLENGE_BYTES - len(challenge))
    if answer is not None:
        connection.sendall(answer(challenge))
    return connection


def _vote_attacks(host: str, port: int, secret: bytes, rank: int) -> dict[str, socket.socket]:
    """What a stranger (and, for the range checks, a rank that knows the secret) tries before ``rank`` connects."""
    other = secrets.token_bytes(len(secret))
    return {
        "silent": _stranger(host, port, None),
        "a wrong secret": _stranger(host, port, lambda c: proof(other, c, rank)),
        "garbage": _stranger(host, port, lambda c: os.urandom(300)),
        "a rank out of range": _stranger(host, port, lambda c: proof(secret, c, 7)),
        "rank 0's own": _stranger(host, port, lambda c: proof(secret, c, 0)),
        "a replayed proof": _stranger(host, port, lambda c: proof(secret, bytes(CHALLENGE_BYTES), rank)),
    }


def _vote_with_strangers(rank: int, world_size: int, port: int) -> dict[str, Any]:
    """Rank 2 attacks rank 0's listener before it joins, then tries to join a second time; rank 1 arrives last, a
    second later, so every attack happens while rank 0 still waits for real ranks."""
    _join_world(rank, world_size, port)
    records = _Records()
    outcomes: dict[str, bytes] = {}
    original = GroupVote._join

    def late(self: GroupVote, host: str, port_: int, secret: bytes) -> socket.socket:
        time.sleep(1.0)
        return original(self, host, port_, secret)

    def attack_then_join(self: GroupVote, host: str, port_: int, secret: bytes) -> socket.socket:
        attacks = _vote_attacks(host, port_, secret, self.rank)
        connection = original(self, host, port_, secret)
        attacks["a duplicate rank"] = _stranger(host, port_, lambda c: proof(secret, c, self.rank))
        for what, stranger in attacks.items():
            outcomes[what] = _poll(stranger, 10.0)[1]  # closed, never seated: b""
            stranger.close()
        return connection

    if rank == 1:
        GroupVote._join = late  # type: ignore[method-assign]
    elif rank == 2:
        GroupVote._join = attack_then_join  # type: ignore[method-assign]
    began = time.monotonic()
    vote = GroupVote("127.0.0.1", port, timeout=20)
    seconds = time.monotonic() - began
    answers = [vote.any(rank == 1), vote.any(False, False), vote.any(rank == 2, rank == 0, False)]
    vote.close()
    return {"answers": answers, "refused": vote.refused, "seconds": seconds, "logs": records.messages,
            "outcomes": outcomes}


@pytest.mark.distributed
@pytest.mark.timeout(120)
def test_the_vote_seats_only_ranks_that_prove_the_secret_and_strangers_hold_no_one_up() -> None:
    results = run_ranks(_vote_with_strangers, 3, free_port(), timeout=100)
    expected = [(True,), (False, False), (True, True, False)]
    assert [r["answers"] for r in results] == [expected] * 3  # the real ranks' vote, as if no stranger came
    outcomes = results[2]["outcomes"]
    assert set(outcomes) == {"silent", "a wrong secret", "garbage", "a rank out of range", "rank 0's own",
                             "a replayed proof", "a duplicate rank"}
    assert all(answer == b"" for answer in outcomes.values()), outcomes  # closed, never a seat byte
    root = results[0]
    assert root["refused"] == 7, root
    assert root["seconds"] < PROOF_WITHIN_S, root  # the silent stranger, first in line, held nobody up
    refusals = [m for m in root["logs"] if "the group's vote refused a connection from 127.0.0.1:" in m]
    assert len(refusals) == 7, root["logs"]
    for why in ("a wrong proof: not a rank of this group", "rank 7 outside 1..2", "rank 0 outside 1..2",
                "rank 2 is connected already", "the group was complete before it proved itself"):
        assert any(why in m for m in refusals), (why, refusals)


def _a_rank_never_arrives(rank: int, world_size: int, port: int) -> Optional[dict[str, Any]]:
    _join_world(rank, world_size, port)
    if rank == 1:
        def stay_away(self: GroupVote, host: str, port_: int, secret: bytes) -> socket.socket:
            _stranger(host, port_, lambda c: proof(b"x" * 32, c, 1)).close()  # only a stranger comes
            time.sleep(3.0)
            raise RuntimeError("rank 1 stayed away")

        GroupVote._join = stay_away  # type: ignore[method-assign]
        with pytest.raises(RuntimeError, match="stayed away"):
            GroupVote("127.0.0.1", port, timeout=2)
        return None
    began = time.monotonic()
    try:
        GroupVote("127.0.0.1", port, timeout=2)
    except GroupVoteFailed as error:
        return {"error": str(error), "seconds": time.monotonic() - began}
    return {"error": None, "seconds": time.monotonic() - began}


@pytest.mark.distributed
@pytest.mark.timeout(60)
def test_only_a_rank_that_never_arrives_fails_the_group_with_one_clear_error() -> None:
    root, _ = run_ranks(_a_rank_never_arrives, 2, free_port(), timeout=50)
    assert root["error"] == (
        "the group's vote: rank(s) [1] of this group did not connect to rank 0 and prove themselves within 2 s "
        "(1 other connection(s) refused)"
    ), root
    assert 1.9 < root["seconds"] < 3.0


# ------------------------------------------------------------------------------------------- end to end
def _e2e_run() -> Any:
    """Two groups of two ranks, fp32 AdamW with ``exact_trajectory``: the run's every bit depends on every committed
    step's gradients, so any effect a stranger had on the training would show."""
    from toy import RunConfig

    return RunConfig(world_size=4, micro_batch=2, accumulate=2, steps=10, lr=0.5, momentum=0.0)


def _train_with_strangers(rank: int, group: int, address: str, marks: str, strangers: bool) -> dict[str, Any]:
    """One rank of a replica group. Group 0 serves the catch-up heal; with ``strangers`` its rank 0 runs the snapshot
    attacks right after it publishes the snapshot (the joining group's download runs beside them), and group 1's
    rank 1 attacks rank 0's vote listener before it connects itself. Group 0, when told to wait, trains alone
    until group 1 has started (the heal must happen mid-run)."""
    import lightning.pytorch as pl
    from ft_harness import fault_tolerant_trainer
    from torch.utils.data import DataLoader
    from toy import ToyModule, full_parameters, make_dataset

    from lightning_mics import FaultTolerance
    from lightning_mics.fault_tolerance import catch_up, group_vote

    run = _e2e_run()
    found: dict[str, Any] = {}
    trainer_box: dict[str, Any] = {}

    if strangers and group == 0 and rank == 0:
        publish = catch_up.SnapshotServer.publish

        def publish_then_attack(self: SnapshotServer, step: int, shards: Any) -> str:
            address_ = publish(self, step, shards)
            if "attack" not in found:
                found["token"] = urlsplit(address_).password
                found["bound"] = self.bound_address
                found["listening"] = _listening(self.bound_address[1])  # type: ignore[index]
                found["attack"] = _attack_snapshot_server(self, address_, step)
                manager = trainer_box["trainer"].strategy.engine.replica_group.manager
                found["transport"] = type(manager._checkpoint_transport).__name__
                found["metadata"] = _torchft_checkpoint_metadata(manager)
            return address_

        catch_up.SnapshotServer.publish = publish_then_attack  # type: ignore[method-assign]
    if strangers and group == 1 and rank == 1:
        join = group_vote.GroupVote._join

        def attack_then_join(self: GroupVote, host: str, port: int, secret: bytes) -> socket.socket:
            attacks = _vote_attacks(host, port, secret, self.rank)
            connection = join(self, host, port, secret)
            found["vote"] = {what: _poll(s, 10.0)[1] for what, s in attacks.items()}
            for s in attacks.values():
                s.close()
            return connection

        group_vote.GroupVote._join = attack_then_join  # type: ignore[method-assign]

    class AdamW(ToyModule):
        def configure_optimizers(self):
            return torch.optim.AdamW([p for p in self.parameters() if p.requires_grad], lr=3e-2, weight_decay=0.01)

    class Pace(pl.Callback):
        def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx) -> None:
            engine = trainer.strategy.engine
            Path(marks, f"group{group}_rank{rank}.step").write_text(str(trainer.global_step))
            if group == 0 and engine.replica_group.manager.num_participants() == 1 and trainer.global_step >= 2:
                waited = time.monotonic()
                while not Path(marks, "group1.started").exists() and time.monotonic() - waited < 120:
                    time.sleep(0.1)
                time.sleep(0.5)  # a step at a time until group 1 is in the quorum

    if group == 1:
        Path(marks, "group1.started").write_text("1")
    ft = FaultTolerance(address, group, 2, min_replica_groups=1, timeout=30, quorum_timeout=60, quorum_every=1,
                        heal="catch_up", exact_trajectory=True)
    module = AdamW(run)
    module.train_dataloader = lambda: DataLoader(make_dataset(run.num_samples), batch_size=run.micro_batch)
    trainer = fault_tolerant_trainer(run, ft, [Pace()])
    trainer_box["trainer"] = trainer
    trainer.fit(module)
    replica_group = trainer.strategy.engine.replica_group
    snapshots = replica_group.snapshots
    return found | {
        "params": full_parameters(module.model),
        "global_step": trainer.global_step,
        "discarded": replica_group.discarded_steps,
        "replayed": replica_group.replayed_steps,
        "vote_refused": replica_group._vote.refused,
        "served": snapshots.served,
        "serialisations": snapshots.serialisations,
        "refused": snapshots.refused,
        "still_listening": snapshots.bound_address,
    }


def _torchft_checkpoint_metadata(manager: Any) -> list[str]:
    """What torchft's manager server tells anyone who asks where each rank's checkpoint is (its HTTP transport's URL,
    which a stranger would fetch the heal's state from)."""
    from torchft._torchft import ManagerClient

    client = ManagerClient(manager._manager.address(), connect_timeout=timedelta(seconds=5))
    return [client._checkpoint_metadata(r, timeout=timedelta(seconds=5)) for r in range(2)]


def _late_join(strangers: bool) -> tuple[list[Any], list[Any]]:
    """Group 0 trains alone; group 1 starts once it reached step 2 and joins with a catch-up heal."""
    from ft_harness import lighthouse, read, start_group, wait, wait_for_step

    with lighthouse(min_replicas=1, join_timeout_ms=3000) as address, tempfile.TemporaryDirectory() as out:
        first = start_group(0, out, _train_with_strangers, address, out, strangers)
        try:
            for rank in range(2):
                wait_for_step(Path(out, f"group0_rank{rank}.step"), 2, timeout=120)
            second = start_group(1, out, _train_with_strangers, address, out, strangers)
            wait(second, timeout=240)
        finally:
            wait(first, timeout=240)
        return read(out, 0), read(out, 1)


@pytest.mark.distributed
@pytest.mark.timeout(600)
def test_strangers_during_a_real_heal_and_a_real_vote_change_nothing_in_the_training() -> None:
    pytest.importorskip("torchft")
    attacked = _late_join(strangers=True)
    reference = _late_join(strangers=False)
    server = attacked[0][0]
    token = server["token"]
    # the snapshot port: on the routed address only (MASTER_ADDR 127.0.0.1 here), never the wildcard
    assert server["bound"][0] == "127.0.0.1" and server["listening"] == ["127.0.0.1"], server["listening"]
    # the heal's state went over torchft's process group: its manager names no checkpoint URL, let alone a token
    assert server["transport"] == "PGTransport"
    assert server["metadata"] == ["<n/a>", "<n/a>"]
    _check_refused(server["attack"], token)
    assert server["attack"]["serialisations_after"] <= 1  # at most the joining rank's own request
    # the joining rank got its snapshot once, serialised once, however many strangers asked
    for rank in range(2):
        assert attacked[0][rank]["served"] == 1 and attacked[0][rank]["serialisations"] == 1, attacked[0][rank]
        assert attacked[0][rank]["still_listening"] is None  # the heal ended: the listener closed
    assert server["refused"] >= len(server["attack"]["answers"]) - 1 + 50
    # the vote: every stranger closed without a seat, group 1's rank 0 refused all six, and the group trained
    assert attacked[1][1]["vote"] == {what: b"" for what in attacked[1][1]["vote"]}
    assert len(attacked[1][1]["vote"]) == 6 and attacked[1][0]["vote_refused"] == 6
    for run in (attacked, reference):
        for group in range(2):
            for rank in range(2):
                result = run[group][rank]
                assert result["global_step"] == _e2e_run().steps and result["discarded"] == 0, result
        assert all(run[1][rank]["replayed"] >= 1 for rank in range(2))  # group 1 caught up in both runs
    for group in range(2):
        for rank in range(2):
            for name, expected in reference[group][rank]["params"].items():
                got = attacked[group][rank]["params"][name]
                assert torch.equal(got, expected), (group, rank, name, (got - expected).abs().max().item())
            for name, value in attacked[0][rank]["params"].items():  # and the groups agree with each other
                assert torch.equal(attacked[1][rank]["params"][name], value), name
