"""The replica group's vote (``lightning_mics.fault_tolerance.group_vote``): the flags or'ed over every rank, the
same answer everywhere, and a lost, hung or out-of-step rank an error on the others -- not a wrong answer."""

from __future__ import annotations

import os
import random
import time
from datetime import timedelta
from typing import Any

import pytest
import torch.distributed as dist
from distributed import free_port, run_ranks

from lightning_mics.fault_tolerance.group_vote import MAX_FLAGS, GroupVote, GroupVoteFailed

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(120)]


def _join(rank: int, world_size: int, port: int, timeout: float = 20.0) -> GroupVote:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world_size, timeout=timedelta(seconds=30))
    return GroupVote("127.0.0.1", port, timeout)


def _last_vote(vote: GroupVote, flag: bool) -> dict[str, Any]:
    """One more vote, then the connections closed: its error (``None`` if it answered) and how long it took."""
    began = time.monotonic()
    try:
        vote.any(flag)
        error = None
    except GroupVoteFailed as failed:
        error = str(failed)
    vote.close()
    return {"error": error, "seconds": time.monotonic() - began}


def _many_votes(rank: int, world_size: int, port: int) -> list[Any]:
    vote = _join(rank, world_size, port)
    seeded = random.Random(0)  # the same draws on every rank: each knows every rank's flags
    answers, expected = [], []
    for _ in range(300):
        count = seeded.randint(1, MAX_FLAGS)
        flags = [[seeded.random() < 0.15 for _ in range(count)] for _ in range(world_size)]
        answers.append(vote.any(*flags[rank]))
        expected.append(tuple(any(column) for column in zip(*flags)))
    vote.close()
    return [answers, expected]


def test_every_rank_gets_each_flag_ored_over_the_group() -> None:
    results = run_ranks(_many_votes, 3, free_port(), timeout=100)
    answers = [answers for answers, _ in results]
    assert answers[0] == answers[1] == answers[2]
    assert answers[0] == results[0][1]
    assert any(any(answer) for answer in answers[0]) and any(not any(answer) for answer in answers[0])


def _one_rank_leaves(rank: int, world_size: int, port: int) -> dict[str, Any]:
    vote = _join(rank, world_size, port)
    assert vote.any(rank == 1) == (True,)
    if rank == 2:  # what a killed process's connections do: closed by its kernel
        vote.close()
        return {"error": None, "seconds": 0.0}
    return _last_vote(vote, False)  # rank 0 ends after it: its connections close too


def test_a_rank_that_leaves_fails_the_next_vote_at_once_on_every_other_rank() -> None:
    results = run_ranks(_one_rank_leaves, 3, free_port(), timeout=100)
    assert "rank 2 of this group did not vote" in results[0]["error"], results
    assert "rank 0 of this group did not answer" in results[1]["error"], results
    assert max(result["seconds"] for result in results) < 10  # not the 20 s timeout


def _one_rank_hangs(rank: int, world_size: int, port: int) -> dict[str, Any]:
    vote = _join(rank, world_size, port, timeout=1.0)
    if rank == 1:
        time.sleep(4.0)  # past the others' 1 s
    return _last_vote(vote, True)


def test_a_rank_that_does_not_vote_within_the_timeout_fails_the_vote() -> None:
    results = run_ranks(_one_rank_hangs, 2, free_port(), timeout=100)
    assert "rank 1 of this group did not vote (no answer within the timeout)" == results[0]["error"], results
    assert 0.9 < results[0]["seconds"] < 4.0
    assert results[1]["error"] is not None  # rank 0 gave up on it and left: no answer comes


def _out_of_step(rank: int, world_size: int, port: int) -> str | None:
    vote = _join(rank, world_size, port, timeout=2.0)
    vote.any(False)
    if rank == 1:
        vote._sequence += 1  # as if it had voted once more than rank 0
    return _last_vote(vote, False)["error"]


def test_a_rank_out_of_step_with_its_group_is_an_error_not_a_mixed_up_answer() -> None:
    results = run_ranks(_out_of_step, 2, free_port(), timeout=100)
    assert results[0] == "rank 1 of this group is at vote 2, rank 0 at 1"
    assert results[1] is not None


def _alone(rank: int, world_size: int, port: int) -> tuple[bool, ...]:
    vote = _join(rank, world_size, port)
    with pytest.raises(ValueError, match="at most 8 flags"):
        vote.any(*([False] * (MAX_FLAGS + 1)))
    return vote.any(True, False, True)


def test_a_group_of_one_rank_answers_its_own_flags() -> None:
    assert run_ranks(_alone, 1, free_port()) == [(True, False, True)]
