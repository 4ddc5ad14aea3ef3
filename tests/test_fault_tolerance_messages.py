"""Hop 2's messages over torchft's process group (:class:`~lightning_mics.fault_tolerance.group.ReplicaGroup`'s
``start_*``): a failed collective is recorded for the commit (the step is dropped), never raised; a message
registers no timer or callback of torchft's (the process group times a hung collective out itself); the
all-reduce's average is taken over the contributing groups."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any, Optional

import pytest
import torch

pytest.importorskip("torchft")

from lightning_mics.fault_tolerance.group import ReplicaGroup  # noqa: E402
from lightning_mics.hop2.transport import ManagedTransport  # noqa: E402


class _Manager:
    """What the ``start_*`` methods use of torchft's Manager; ``wrap_future`` (its per-message timer) must not be."""

    def __init__(self, participants: int = 3) -> None:
        self.error: Optional[Exception] = None
        self.participants = participants

    def errored(self) -> Optional[Exception]:
        return self.error

    def report_error(self, error: Exception) -> None:
        self.error = error

    def num_participants(self) -> int:
        return self.participants

    def wrap_future(self, *args: Any) -> Any:
        raise AssertionError("a hop-2 message registered a torchft timer (Manager.wrap_future)")


class _Work:
    def __init__(self) -> None:
        self.future: torch.futures.Future[Any] = torch.futures.Future()

    def wait(self) -> None:
        self.future.wait()


class _ProcessGroup:
    """Collectives that start and are completed (or failed) by the test."""

    def __init__(self) -> None:
        self.started: list[tuple[str, _Work, Any]] = []

    def _start(self, name: str, payload: Any) -> _Work:
        work = _Work()
        self.started.append((name, work, payload))
        return work

    def allreduce(self, tensors: list[torch.Tensor], options: Any) -> _Work:
        return self._start("allreduce", tensors)

    def allgather(self, outputs: list[list[torch.Tensor]], inputs: list[torch.Tensor], options: Any) -> _Work:
        return self._start("allgather", outputs)

    def alltoall_base(self, received: torch.Tensor, message: torch.Tensor, *rest: Any) -> _Work:
        return self._start("alltoall", received)

    def allgather_into_tensor_coalesced(self, outputs: list[torch.Tensor], inputs: list[torch.Tensor],
                                        options: Any) -> _Work:
        return self._start("allgather_into", outputs)


def _group(participants: int = 3, not_contributing: frozenset[int] = frozenset()) -> ReplicaGroup:
    group = ReplicaGroup.__new__(ReplicaGroup)  # no Lighthouse: only the message path
    group.manager = _Manager(participants)
    group.pg = _ProcessGroup()
    group._pg_is_gloo = False  # torchft's NCCL wrapper's path: every collective through the wrapper
    group.not_contributing = not_contributing
    group._quorum_groups = tuple(range(participants))
    group.options = SimpleNamespace(replica_group=0)
    return group


def _start(group: ReplicaGroup, start: str, message: torch.Tensor) -> Any:
    if start == "all_gather_into":
        return group.start_all_gather_into(torch.empty(3 * message.numel()), message)
    return getattr(group, f"start_{start}" + ("_sum" if start == "all_reduce" else ""))(message)


@pytest.mark.parametrize("start", ["all_reduce", "all_gather", "all_to_all", "all_gather_into"])
def test_a_failed_message_is_recorded_for_the_commit_not_raised(start: str) -> None:
    group = _group()
    message = torch.ones(4)
    started = _start(group, start, message)
    future = started if start == "all_reduce" else started[1]
    lost = RuntimeError("Connection reset by peer")
    group.pg.started[0][1].future.set_exception(lost)
    future.wait()  # completes, does not raise
    assert group.manager.error is lost
    # once the step failed, the next message is not even started
    assert _start(group, start, message) is None
    assert len(group.pg.started) == 1


def test_a_message_that_arrives_records_nothing() -> None:
    group = _group()
    future = group.start_all_reduce_sum(torch.ones(4))
    group.pg.started[0][1].future.set_result(None)
    future.wait()
    assert group.manager.error is None


@pytest.mark.parametrize(("not_contributing", "divisor"), [(frozenset(), 3), (frozenset({2}), 2)])
def test_the_all_reduce_averages_over_the_contributing_groups(not_contributing: frozenset[int], divisor: int) -> None:
    group = _group(3, not_contributing)
    group.options = SimpleNamespace(replica_group=0, num_replica_groups=3)
    flat = torch.full((5,), 6.0)
    average = ManagedTransport(group, wire=None).start_average(flat)
    name, work, (sent,) = group.pg.started[0]
    assert name == "allreduce" and sent is flat
    flat.mul_(3)  # what the sum over three groups leaves in the buffer
    work.future.set_result(None)
    average.wait()
    assert torch.equal(flat, torch.full((5,), 18.0 / divisor))
