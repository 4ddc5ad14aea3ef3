"""The catch-up heal's parts (``FaultTolerance(heal="catch_up")``): the snapshot served and fetched, the split of
the training state, the replay that must land bit-identically on the live groups' shards, and the agreement's
catching-up slots. The end-to-end proof (a killed and restarted group in fp64) is in
``test_fault_tolerance_trajectory.py``."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from lightning_mics import FaultTolerance, MiCSOptions
from lightning_mics.fault_tolerance.agreement import (
    agreement_message,
    catching_up_groups,
    drift_verdict,
    present_groups,
)
from lightning_mics.fault_tolerance.catch_up import CatchUp, SnapshotServer, fetch_snapshot
from lightning_mics.fault_tolerance.heal_state import load_training_state, split_shards, training_state


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 5), nn.Tanh(), nn.Linear(5, 3))


def _gradients(step: int, model: nn.Module) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(100 + step)
    return [torch.randn(p.shape, generator=generator) for p in model.parameters()]


def _live_step(model: nn.Module, optimizer: torch.optim.Optimizer, scheduler, step: int) -> None:
    """One step as a live group runs it: averaged gradients, clipped, stepped, then the schedule moves."""
    for param, gradient in zip(model.parameters(), _gradients(step, model)):
        param.grad = gradient.clone()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    scheduler.step()


def _training(model: nn.Module):
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.05, weight_decay=0.1)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.5)
    return optimizer, scheduler


def test_a_published_snapshot_is_fetched_whole_and_stops_being_served_once_released() -> None:
    server = SnapshotServer()
    try:
        optimizer_state = {0: {"step": torch.tensor(3.0)}}
        shards = {"model": {"w": torch.arange(6.0).reshape(2, 3)}, "optimizers": [{"state": optimizer_state}]}
        address = server.publish(7, copy.deepcopy(shards))
        assert address.endswith("/snapshot/7")
        got = fetch_snapshot(address, timeout=10)
        assert torch.equal(got["model"]["w"], shards["model"]["w"])
        assert got["optimizers"][0]["state"][0]["step"].item() == 3.0
        with pytest.raises(Exception, match="404"):
            fetch_snapshot(address.replace("/7", "/6"), timeout=10)  # another step's snapshot is not served
        server.release()
        assert not server.serving
        with pytest.raises(Exception, match="404"):
            fetch_snapshot(address, timeout=10)
    finally:
        server.close()


def test_the_split_state_loads_in_two_parts_as_the_whole_would() -> None:
    live = _model()
    optimizer, scheduler = _training(live)
    for step in range(3):
        _live_step(live, optimizer, scheduler, step)
    state = training_state(live.state_dict(), [optimizer], [scheduler], global_step=3)
    small, shards = split_shards(state)
    assert "model" not in small and all("state" not in o for o in small["optimizers"])
    assert set(shards) == {"model", "optimizers"} and all(set(o) == {"state"} for o in shards["optimizers"])

    joiner = _model()
    joined_optimizer, joined_scheduler = _training(joiner)
    _live_step(joiner, joined_optimizer, joined_scheduler, 99)  # its own optimizer states, to be overwritten
    steps: list[int] = []
    load_training_state(small, joiner.state_dict(), [joined_optimizer], [joined_scheduler], steps.append)
    assert steps == [3] and joined_scheduler.state_dict() == scheduler.state_dict()
    assert joined_optimizer.param_groups[0]["lr"] == optimizer.param_groups[0]["lr"]
    assert not torch.equal(next(joiner.parameters()), next(live.parameters()))  # the shards wait for the snapshot
    load_training_state(shards, joiner.state_dict(), [joined_optimizer], [joined_scheduler], steps.append)
    assert steps == [3]
    for a, b in zip(joiner.parameters(), live.parameters()):
        assert torch.equal(a, b)
    for p, q in zip(joiner.parameters(), live.parameters()):
        for key in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(joined_optimizer.state[p][key], optimizer.state[q][key])


def test_replaying_the_kept_steps_on_the_snapshot_lands_bit_identically_on_the_live_shards() -> None:
    """The live group trains 7 steps; the joiner gets the snapshot of step 2 and, in steps 2..6, trains its own
    stale shards with the same averaged gradients (as it does while its download runs), keeping each step. The
    replay from the snapshot must give exactly the live group's parameters and optimizer states, with the
    learning rate the schedule has now."""
    live = _model()
    optimizer, scheduler = _training(live)
    for step in range(2):
        _live_step(live, optimizer, scheduler, step)
    snapshot = copy.deepcopy(split_shards(training_state(live.state_dict(), [optimizer], [scheduler], 2))[1])
    server = SnapshotServer()
    joiner = nn.Sequential(nn.Linear(6, 5), nn.Tanh(), nn.Linear(5, 3))  # other weights: a fresh process
    joined_optimizer, joined_scheduler = _training(joiner)
    try:
        catch_up = CatchUp(server.publish(2, snapshot), step=2, timeout=10)
        joined_scheduler.load_state_dict(scheduler.state_dict())  # the small state, at the quorum
        for group, live_group in zip(joined_optimizer.param_groups, optimizer.param_groups):
            group["lr"] = live_group["lr"]
        for step in range(2, 7):
            _live_step(live, optimizer, scheduler, step)
            for param, gradient in zip(joiner.parameters(), _gradients(step, joiner)):
                param.grad = gradient.clone()
            torch.nn.utils.clip_grad_norm_(joiner.parameters(), 1.0)  # of the same averaged gradients: same norm
            joined_optimizer.step()  # on stale shards: harmless, the snapshot replaces them
            catch_up.keep(joined_optimizer)
            joined_optimizer.zero_grad(set_to_none=True)
            joined_scheduler.step()
        lr_now = joined_optimizer.param_groups[0]["lr"]
        load_training_state(catch_up.snapshot(), joiner.state_dict(), [joined_optimizer], [], lambda step: None)
        assert catch_up.replay() == 5
    finally:
        server.close()
    assert joined_optimizer.param_groups[0]["lr"] == lr_now == optimizer.param_groups[0]["lr"]
    for a, b in zip(joiner.parameters(), live.parameters()):
        assert torch.equal(a, b)
    for p, q in zip(joiner.parameters(), live.parameters()):
        for key in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(joined_optimizer.state[p][key], optimizer.state[q][key]), key
    assert catch_up.kept == []


def test_a_capped_snapshot_is_sent_no_faster_than_its_rate() -> None:
    import io
    import time

    from lightning_mics.fault_tolerance.catch_up import send_paced

    data = memoryview(bytes(range(256)) * 1024)  # 256 KiB
    out = io.BytesIO()
    started = time.monotonic()
    send_paced(out, data, bytes_per_s=1_000_000)
    assert out.getvalue() == bytes(data)
    assert time.monotonic() - started >= 0.19  # its last chunk may leave at 196 ms of 262 KB at 1 MB/s
    server = SnapshotServer(bytes_per_s=2_000_000)
    try:
        address = server.publish(1, {"model": {"w": torch.zeros(200_000)}, "optimizers": []})  # ~800 KB
        started = time.monotonic()
        assert torch.equal(fetch_snapshot(address, timeout=10)["model"]["w"], torch.zeros(200_000))
        assert time.monotonic() - started >= 0.3
    finally:
        server.close()
    with pytest.raises(ValueError, match="catch_up_bytes_per_s=0.*positive number of bytes per second"):
        FaultTolerance(catch_up_bytes_per_s=0)


def test_a_reserved_snapshot_is_served_once_the_training_thread_publishes_it() -> None:
    """The quorum hands out the address of a snapshot not yet taken (:meth:`SnapshotServer.reserve`): a download
    started then waits for the publication and gets what was published; a reservation released without one
    answers 404 (the joining group's catch-up fails and says so), not a hang."""
    import threading
    import time

    server = SnapshotServer(wait_s=10)
    try:
        address = server.reserve(5)
        assert address.endswith("/snapshot/5") and server.serving and server.reserved_step == 5
        catch_up = CatchUp(address, step=5, timeout=10)
        time.sleep(0.2)
        assert not catch_up.downloaded  # waiting for the shards
        server.publish(5, {"model": {"w": torch.full((3,), 2.0)}, "optimizers": []})
        assert server.reserved_step is None
        assert torch.equal(catch_up.snapshot()["model"]["w"], torch.full((3,), 2.0))

        address = server.reserve(6)
        waiting = CatchUp(address, step=6, timeout=10)
        threading.Timer(0.2, server.release).start()
        waiting.wait(10)
        assert waiting.failed
        with pytest.raises(Exception, match="404"):
            waiting.snapshot()
    finally:
        server.close()


def test_the_small_rest_of_the_training_state_is_taken_without_the_shards() -> None:
    """``training_state(..., shards=False)`` -- what a catching-up heal's quorum sends -- is :func:`split_shards`'s
    small part of the whole state, without copying a shard."""
    live = _model()
    optimizer, scheduler = _training(live)
    _live_step(live, optimizer, scheduler, 0)
    whole = training_state(live.state_dict(), [optimizer], [scheduler], global_step=1)
    small = training_state(live.state_dict(), [optimizer], [scheduler], global_step=1, shards=False)
    assert small == split_shards(whole)[0]
    assert "model" not in small and "state" not in small["optimizers"][0]


def test_a_snapshot_that_cannot_be_fetched_is_reported_not_hung() -> None:
    server = SnapshotServer()
    try:
        address = server.publish(3, {"model": {}, "optimizers": []})
        catch_up = CatchUp(address.replace("/3", "/4"), step=4, timeout=10)
        catch_up._done.wait(10)
        assert catch_up.downloaded and catch_up.failed
        with pytest.raises(Exception, match="404"):
            catch_up.snapshot()
    finally:
        server.close()


def test_the_agreement_names_the_catching_up_groups_and_leaves_their_stale_shards_out_of_the_drift_check() -> None:
    chunks = [1, 2]
    summed = (
        agreement_message(0, chunks, [5, 5])
        + agreement_message(1, chunks, [9, 9], catching_up=True)
        + agreement_message(2, chunks, [5, 5])
    )
    assert present_groups(summed) == [0, 1, 2]
    assert catching_up_groups(summed) == frozenset({1})
    assert drift_verdict(summed, 10) is None  # group 1's parameters differ, as they must while it catches up
    caught_up = agreement_message(0, chunks, [5, 5]) + agreement_message(1, chunks, [9, 9]) + agreement_message(
        2, chunks, [5, 5]
    )
    assert catching_up_groups(caught_up) == frozenset()
    assert "group(s) [1]" in drift_verdict(caught_up, 10)  # once caught up, a difference is drift


def test_heal_is_auto_blocking_or_catch_up_and_catch_up_needs_synchronous_hop_2() -> None:
    assert FaultTolerance().heal == "auto"
    with pytest.raises(ValueError, match="heal='eager'.*'auto', 'blocking', 'catch_up'"):
        FaultTolerance(heal="eager")
    MiCSOptions(fault_tolerance=FaultTolerance(), cross_replica_sync="diloco", sync_every=4)  # auto: no refusal
    with pytest.raises(ValueError, match="use heal='blocking' there"):
        MiCSOptions(fault_tolerance=FaultTolerance(heal="catch_up"), cross_replica_sync="diloco", sync_every=4)
    from lightning_mics.fault_tolerance import check_catch_up_heal

    with pytest.raises(ValueError, match="loss scaler.*use heal='blocking', or precision='bf16-mixed'"):
        check_catch_up_heal(FaultTolerance(heal="catch_up"), loss_scaling=True)
    check_catch_up_heal(FaultTolerance(heal="blocking"), "diloco", loss_scaling=True)  # the blocking heal takes both
    check_catch_up_heal(FaultTolerance(), "diloco", loss_scaling=True)  # auto decides, it does not refuse


def test_auto_heal_catches_up_wherever_a_replay_applies_and_says_why_it_blocks_elsewhere() -> None:
    auto = FaultTolerance()
    chosen, note = auto.with_heal_for("every_step", loss_scaling=False)
    assert chosen.heal == "catch_up" and note == "heal='catch_up' (heal='auto')"
    chosen, note = auto.with_heal_for("diloco", loss_scaling=False)
    assert chosen.heal == "blocking" and "falls back: cross_replica_sync='diloco' has no per-step gradients" in note
    chosen, note = auto.with_heal_for("every_step", loss_scaling=True)
    assert chosen.heal == "blocking" and "falls back: a loss scaler" in note
    explicit = FaultTolerance(heal="blocking")
    assert explicit.with_heal_for("every_step") == (explicit, "heal='blocking'")  # an explicit mode stays
