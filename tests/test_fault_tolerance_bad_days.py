"""Fault tolerance on bad days: groups started differently or under one index, a heal that reached only some
ranks, a Lighthouse that is not there or stops. Each ends in one clear error, and no group trains on a state
it should not have."""

from __future__ import annotations

import os
import signal
import tempfile
import time
from dataclasses import replace
from typing import Any

import pytest
import torch
import torch.distributed as dist
from distributed import free_port, run_ranks
from ft_harness import (
    AS_WRITTEN,
    GROUP_WORLD,
    fault_tolerant_trainer,
    lighthouse,
    read,
    shard_digest,
    start_group,
    start_lighthouse,
)
from ft_harness import wait as wait_for_group
from toy import RunConfig, ToyModule

from lightning_mics import FaultTolerance
from lightning_mics.fault_tolerance import (
    GroupConfiguration,
    LighthouseUnavailable,
    ReplicaGroup,
    ReplicaGroupRefused,
    agreement_message,
    agreement_verdict,
    check_healed_whole,
)
from lightning_mics.fault_tolerance.group_vote import GroupVote

pytest.importorskip("torchft")

A = GroupConfiguration.of({"partition_size": 2, "accumulate_grad_batches": 1})
B = GroupConfiguration.of({"partition_size": 2, "accumulate_grad_batches": 2})


def quorum_sum(*members: tuple[int, GroupConfiguration]) -> torch.Tensor:
    """What the agreement all-reduce gives every group: their messages added, through torchft's average."""
    summed = sum(agreement_message(group, configuration.digest_chunks()) for group, configuration in members)
    assert isinstance(summed, torch.Tensor)
    return summed / len(members) * len(members)


# ------------------------------------------------------------------------------------------------ agreement
def test_groups_started_alike_agree() -> None:
    members = [(group, A) for group in range(5)]
    assert all(agreement_verdict(quorum_sum(*members), group) is None for group, _ in members)


def test_two_groups_under_one_index_are_both_refused_and_the_others_go_on() -> None:
    summed = quorum_sum((0, A), (1, A), (1, A))
    assert agreement_verdict(summed, 0) is None
    verdict = agreement_verdict(summed, 1)
    assert verdict is not None and "2 groups claim replica_group=1" in verdict and "MICS_REPLICA_GROUP" in verdict


def test_the_group_started_unlike_the_most_is_refused() -> None:
    summed = quorum_sum((0, B), (1, A), (2, A))  # the odd one out is group 0: the majority decides
    verdict = agreement_verdict(summed, 0)
    assert verdict is not None and "another configuration" in verdict and "group(s) [1, 2]" in verdict
    assert agreement_verdict(summed, 1) is None and agreement_verdict(summed, 2) is None
    tie = quorum_sum((0, A), (1, B))  # a tie: the lowest index's configuration is the reference
    assert agreement_verdict(tie, 0) is None and agreement_verdict(tie, 1) is not None


def test_every_digest_survives_torchfts_average_over_many_groups() -> None:
    from lightning_mics.fault_tolerance import DIGEST_CHUNKS

    configurations = [A if index < 128 else GroupConfiguration.of({"seed": index}) for index in range(256)]
    summed = quorum_sum(*enumerate(configurations))
    for group, configuration in enumerate(configurations):  # every group's digest read back exactly
        chunks = summed[group * DIGEST_CHUNKS : (group + 1) * DIGEST_CHUNKS].round().long().tolist()
        assert chunks == configuration.digest_chunks()
        assert (agreement_verdict(summed, group) is None) == (group < 128)


def test_configurations_name_what_differs() -> None:
    assert A.differences(B) == ["accumulate_grad_batches: 1 vs 2"]
    assert A.differences(A) == [] and A.digest_chunks() == GroupConfiguration.of(dict(A.items)).digest_chunks()
    assert A.digest_chunks() != B.digest_chunks()


# ------------------------------------------------------------------------------------------------ one group
def _heal_checks() -> list[Any]:
    verdicts: list[Any] = []
    for steps in ([7, 7], [7, 3]):  # healed alike; rank 0 healed to step 7 while rank 1 stayed at 3
        try:
            check_healed_whole(steps[dist.get_rank()], torch.device("cpu"))
            verdicts.append(None)
        except ReplicaGroupRefused as refused:
            verdicts.append(str(refused))
    return verdicts


def _lighthouse_trouble(lighthouse_pid: int, address: str) -> dict[str, Any]:
    cpu = torch.device("cpu")
    outcome: dict[str, Any] = {}
    unreachable = f"http://127.0.0.1:{free_port()}"
    start = time.monotonic()
    try:
        ReplicaGroup(FaultTolerance(unreachable, 0, 1, timeout=2), cpu, dict, lambda state: None)
    except LighthouseUnavailable as error:
        outcome["unreachable"] = (str(error), time.monotonic() - start, unreachable)
    group = ReplicaGroup(FaultTolerance(address, 0, 1, timeout=3, quorum_timeout=3, **AS_WRITTEN), cpu, dict,
        lambda s: None)
    try:
        for _ in range(2):
            group.start_step()
            outcome.setdefault("committed", []).append(group.commit())
        if dist.get_rank() == 0:
            os.killpg(lighthouse_pid, signal.SIGKILL)  # the Lighthouse stops mid-run
        start = time.monotonic()
        try:
            group.start_step()
        except LighthouseUnavailable as error:
            outcome["stopped"] = (str(error), time.monotonic() - start)
    finally:
        group.shutdown()
    return outcome


def _one_group(rank: int, world_size: int, lighthouse_pid: int, address: str) -> dict[str, Any]:
    """One group of two ranks: the heal check, then the Lighthouse's absence at start and its death."""
    dist.init_process_group("gloo")
    return {"heal": _heal_checks(), **_lighthouse_trouble(lighthouse_pid, address)}


@pytest.fixture(scope="module")
def one_group() -> list[dict[str, Any]]:
    process, address = start_lighthouse(min_replicas=1)
    try:
        return run_ranks(_one_group, 2, process.pid, address, timeout=100)
    finally:
        process.kill()
        process.wait(timeout=10)


@pytest.mark.distributed
@pytest.mark.timeout(120)
def test_a_heal_that_reached_only_some_ranks_ends_the_whole_group(one_group) -> None:
    for outcome in one_group:
        verdicts = outcome["heal"]
        assert verdicts[0] is None
        assert verdicts[1] is not None and "steps range from 3 to 7" in verdicts[1] and "stale shard" in verdicts[1]


@pytest.mark.distributed
@pytest.mark.timeout(120)
def test_a_lighthouse_that_is_not_there_or_stops_is_one_clear_error_within_the_timeout(one_group) -> None:
    for outcome in one_group:
        message, seconds, unreachable = outcome["unreachable"]
        assert unreachable in message and "torchft_lighthouse" in message and seconds < 15
        assert outcome["committed"] == [True, True]
        message, seconds = outcome["stopped"]
        assert "within 3 s" in message and "ckpt_path='last'" in message
        assert seconds < 15


# ------------------------------------------------------------------------------------------------ two groups
RUN = RunConfig(world_size=2 * GROUP_WORLD, steps=4)


def _fit_configured(rank: int, group: int, address: str, accumulate: int) -> dict[str, Any]:
    cfg = replace(RUN, accumulate=accumulate)
    ft = FaultTolerance(address, group, 2, min_replica_groups=2, timeout=20, quorum_timeout=90, **AS_WRITTEN)
    module = ToyModule(cfg)
    trainer = fault_tolerant_trainer(cfg, ft, [])
    trainer.fit(module)
    replica_group = trainer.strategy.engine.replica_group
    return {
        "digest": shard_digest(module),
        "global_step": trainer.global_step,
        "committed": replica_group.manager.current_step(),
        "discarded": replica_group.discarded_steps,
    }


@pytest.mark.distributed
@pytest.mark.timeout(360)
def test_a_group_started_differently_is_refused_at_the_first_quorum_and_its_fixed_restart_trains() -> None:
    """Group 1 starts with another accumulation: refused at the first quorum, before any step commits. Group 0
    discards the step it was in; restarted alike, group 1 trains with group 0 -- both end at the same step
    with the same shards (Lightning's step count follows committed steps, so the two agree on it)."""
    with lighthouse(min_replicas=2) as address, tempfile.TemporaryDirectory() as out_dir:
        first = start_group(0, out_dir, _fit_configured, address, RUN.accumulate)
        odd = start_group(1, out_dir, _fit_configured, address, RUN.accumulate + 1)
        with pytest.raises(Exception) as refused:  # noqa: PT011 -- the spawned rank's error, as text
            wait_for_group(odd, timeout=180)
        fixed = start_group(1, out_dir, _fit_configured, address, RUN.accumulate)
        wait_for_group(first, timeout=240)
        wait_for_group(fixed, timeout=120)
        results = read(out_dir, 0) + read(out_dir, 1)
    assert "ReplicaGroupRefused" in str(refused.value) and "another configuration" in str(refused.value)
    assert "group(s) [0]" in str(refused.value)
    for result in results:
        assert result["global_step"] == result["committed"] == RUN.steps, result
    assert results[0]["discarded"] >= 1 and results[GROUP_WORLD]["discarded"] == 0
    for rank in range(GROUP_WORLD):
        assert results[rank]["digest"] == results[GROUP_WORLD + rank]["digest"]


def test_a_heal_refused_for_another_configuration_is_that_error_not_a_lighthouse_one() -> None:
    """The heal runs inside torchft's quorum call: its refusal must come out as itself."""

    class RefusingManager:
        def current_step(self) -> int:
            return 0

        def start_quorum(self) -> None:
            raise ReplicaGroupRefused("fault tolerance: replica group 1 cannot heal from the live groups")

    group = ReplicaGroup.__new__(ReplicaGroup)  # no Manager, no Lighthouse: only start_step's error path
    group.manager, group.options = RefusingManager(), FaultTolerance("http://h:1", 1, 2)
    group._watchdog = type("Idle", (), {"kick": lambda self: None})()
    group._check_ranks_present = lambda: None  # no world either: the quorum's error path only
    group.quorums_asked, group._last_quorum, group._discarded_since_quorum = 0, None, False  # a first step
    with pytest.raises(ReplicaGroupRefused, match="cannot heal from the live groups"):
        group.start_step()


class _ExchangeManager:
    """What the quorum's agreement uses of torchft's Manager, one group alone in the quorum: on a ``failing`` rank
    the exchange's collective fails (a peer group lost during it), as torchft records it."""

    def __init__(self, failing: bool) -> None:
        self.failing, self.error = failing, None

    def current_step(self) -> int:
        return 10  # a parameter-check step (check_parameters_every=10)

    def num_participants(self) -> int:
        return 1

    def errored(self) -> Any:
        return self.error

    def report_error(self, error: Exception) -> None:
        self.error = self.error or error

    def allreduce(self, message: torch.Tensor) -> Any:
        manager = self

        class Work:
            def wait(self) -> None:
                if manager.failing:
                    manager.report_error(RuntimeError("Connection reset by peer"))

        return Work()


def _agreement_failing_on_rank_0(rank: int, world_size: int, port: int) -> dict[str, Any]:
    """Rank 0's exchange fails, rank 1's completes, on a parameter-check step; then the step's first collective
    in the group's own world (the forward's all-gather)."""
    from datetime import timedelta

    from lightning_mics.fault_tolerance.agreement import GroupConfiguration

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world_size, timeout=timedelta(seconds=20))
    group = ReplicaGroup.__new__(ReplicaGroup)  # no Lighthouse: the agreement's exchange over a stand-in Manager
    group.manager, group.options = _ExchangeManager(failing=rank == 0), FaultTolerance("http://h:1", 0, 2)
    group.device, group.configuration = torch.device("cpu"), GroupConfiguration(())
    group.catch_up = group.snapshots = None
    group.parameter_digest = lambda: [7, 9]
    group._quorum_groups, group.not_contributing = (0, 1), frozenset()
    group._vote = GroupVote("127.0.0.1", port, timeout=20)
    group._check_agreement()
    forward = torch.ones(3)
    dist.all_reduce(forward)
    return {"errored": group.manager.errored() is not None, "forward": forward.tolist(),
            "quorum_groups": group._quorum_groups}


@pytest.mark.distributed
@pytest.mark.timeout(120)
def test_an_agreement_exchange_failing_on_one_rank_discards_the_step_on_every_rank_of_the_group() -> None:
    """Each rank exchanges over its own torchft group, so a peer lost mid-exchange can fail one rank's exchange and
    not another's. The group then takes one outcome: every rank discards the step and keeps the last membership,
    and none waits in a collective the other skipped (before: rank 1 waited in the parameter check's all-reduce
    that rank 0 had returned before, and rank 0's next collective met it -- a survivor group hung)."""
    results = run_ranks(_agreement_failing_on_rank_0, 2, free_port(), timeout=100)
    for result in results:
        assert result["errored"], result
        assert result["forward"] == [2.0, 2.0, 2.0]
        assert result["quorum_groups"] == (0, 1)  # not this quorum's (group 0 alone): the step is discarded
