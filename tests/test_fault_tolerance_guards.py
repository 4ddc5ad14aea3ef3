"""Fault tolerance's guards against silent failures (a real Lighthouse, replica groups of 2 gloo ranks): another
learning rate or a wider model refused naming it, drifting parameters end every group naming the groups and the
step, too few groups or a lost rank end a group promptly saying why, and a discarded last step is trained again and
never counted.

* a group started with another learning rate is refused at the first quorum, told which setting differs;
* a model of another width: the refusal names the model and its size;
* parameters that drift apart anyway (the learning rate changed in code after the configuration was taken)
  end the run at the next parameter check, naming the groups and the step;
* below ``min_replica_groups`` a group waits at most ``quorum_timeout`` without training, then ends saying
  how many groups are live and how many are required;
* losing one rank of a group ends that group's other rank within seconds, saying a rank was lost (not
  blaming the Lighthouse after ``quorum_timeout``), while the other group trains on;
* a discarded last step is trained again, and the Trainer's step count never counts it.
"""

from __future__ import annotations

import os
import tempfile
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch
from ft_harness import (
    AS_WRITTEN,
    GROUP_WORLD,
    fault_tolerant_trainer,
    lighthouse,
    read,
    run_one_group,
    start_group,
    wait,
)
from toy import RunConfig, ToyModule

from lightning_mics import FaultTolerance

pytest.importorskip("torchft")

RUN = RunConfig(world_size=2 * GROUP_WORLD, steps=6)


def _fit(rank: int, group: int, address: str, lr: float, width_scale: int, retune_lr_to: float | None,
         every: int) -> dict[str, Any]:
    """Fit ``RUN`` in one group; ``retune_lr_to`` changes the learning rate once training started (after the
    configuration was taken, so only the parameter check can see it)."""
    import lightning.pytorch as pl

    cfg = replace(RUN, lr=lr)
    # quorum_timeout bounds how long the group left alone after the other's refusal waits before it ends
    ft = FaultTolerance(address, group, 2, min_replica_groups=2, timeout=20, quorum_timeout=15,
                        check_parameters_every=every, **AS_WRITTEN)
    module = ToyModule(cfg) if width_scale == 1 else _wider(cfg)

    class Retune(pl.Callback):
        def on_train_start(self, trainer: Any, pl_module: Any) -> None:
            if retune_lr_to is not None:
                for param_group in trainer.optimizers[0].param_groups:
                    param_group["lr"] = retune_lr_to

    trainer = fault_tolerant_trainer(cfg, ft, [Retune()])
    trainer.fit(module)
    return {"global_step": trainer.global_step}


def _wider(cfg: RunConfig) -> ToyModule:
    """The toy model with one block more: the same layout and options, another model."""
    from toy import Block

    module = ToyModule(cfg)
    module.model.blocks.append(Block(frozen=False))
    return module


def _two_groups(settings: list[tuple[float, int, float | None, int]], timeout: float,
                only_group_1: bool = False) -> list[str]:
    """Start two groups with ``(lr, width_scale, retune_lr_to, every)`` each; their errors (``""``: finished).
    ``only_group_1``: group 1's error alone is wanted -- once it is in, group 0 (left waiting below
    ``min_replica_groups`` for its ``quorum_timeout``) is killed rather than waited for (its error: ``None``)."""
    errors: list[str | None] = [None, None]
    with lighthouse(min_replicas=2) as address, tempfile.TemporaryDirectory() as out_dir:
        groups = [start_group(g, out_dir, _fit, address, *settings[g]) for g in range(2)]
        for group in (1, 0) if only_group_1 else (0, 1):
            try:
                wait(groups[group], timeout=0.0 if only_group_1 and group == 0 else timeout)
                errors[group] = ""
            except TimeoutError:
                if not (only_group_1 and group == 0):
                    raise
            except Exception as error:  # noqa: BLE001 -- the rank's error, as text
                errors[group] = str(error)
    return errors  # type: ignore[return-value]


@pytest.mark.distributed
@pytest.mark.timeout(240)
def test_a_group_with_another_learning_rate_is_refused_naming_the_setting() -> None:
    errors = _two_groups([(RUN.lr, 1, None, 10), (RUN.lr * 3, 1, None, 10)], timeout=120, only_group_1=True)
    refused = errors[1]
    assert "ReplicaGroupRefused" in refused and "group(s) [0]" in refused, errors
    assert f"optimizers[0].param_groups[0].lr: {RUN.lr * 3} vs {RUN.lr}" in refused, refused


@pytest.mark.distributed
@pytest.mark.timeout(240)
def test_a_group_with_a_wider_model_is_refused_naming_the_model_and_its_size() -> None:
    errors = _two_groups([(RUN.lr, 1, None, 10), (RUN.lr, 2, None, 10)], timeout=120, only_group_1=True)
    refused = errors[1]
    assert "ReplicaGroupRefused" in refused and "model: " in refused and " elements" in refused, errors


@pytest.mark.distributed
@pytest.mark.timeout(240)
def test_parameters_that_drift_apart_end_the_run_naming_the_groups_and_the_step() -> None:
    """Both groups start alike (the configurations agree); group 1 then trains with another learning rate.
    Checked every 2 steps: the run ends at committed step 2 in both groups, naming group 1."""
    errors = _two_groups([(RUN.lr, 1, None, 2), (RUN.lr, 1, RUN.lr * 3, 2)], timeout=120)
    for error in errors:
        assert "ReplicaGroupsDiverged" in error, errors
        assert "after committed step 2" in error and "group(s) [" in error and "[0, 1]" not in error, error


def _alone(rank: int, group: int, address: str) -> dict[str, Any]:
    ft = FaultTolerance(address, group, 2, min_replica_groups=2, timeout=10, quorum_timeout=6, **AS_WRITTEN)
    trainer = fault_tolerant_trainer(RUN, ft, [])
    started = time.monotonic()
    try:
        trainer.fit(ToyModule(RUN))
    except Exception as error:  # noqa: BLE001 -- what ended it, and when
        return {"error": f"{type(error).__name__}: {error}", "seconds": time.monotonic() - started,
                "committed": trainer.strategy.engine.replica_group.manager.current_step()}
    return {"error": None}


@pytest.mark.distributed
@pytest.mark.timeout(120)
def test_below_min_replica_groups_a_group_waits_its_bound_without_training_then_says_why() -> None:
    for result in run_one_group(_alone, timeout=90):
        assert result["error"] is not None and result["error"].startswith("TooFewReplicaGroups"), result
        assert "1 replica group(s) live, min_replica_groups=2 required" in result["error"]
        assert result["committed"] == 0  # it never trained alone
        assert result["seconds"] < 30, result  # its bound (quorum_timeout=6 s) plus start-up, not forever


def _lose_a_rank(rank: int, group: int, address: str, out_dir: str) -> dict[str, Any]:
    import lightning.pytorch as pl

    class LoseRankOne(pl.Callback):
        def on_train_start(self, trainer: Any, pl_module: Any) -> None:
            # both groups train from their first quorum on: a group that started late on a loaded host would
            # otherwise heal at the survivor's last step and end there before it lost its rank
            Path(out_dir, f"started{group}{rank}").touch()
            deadline = time.monotonic() + 90
            while len(list(Path(out_dir).glob("started*"))) < 2 * GROUP_WORLD and time.monotonic() < deadline:
                time.sleep(0.05)

        def on_train_batch_end(self, trainer: Any, *args: Any) -> None:
            if group == 1 and rank == 1 and trainer.global_step >= 2:  # (a late group heals past step 2)
                Path(out_dir, "killed").write_text(str(time.time()))
                os._exit(1)  # a node lost between steps

    cfg = replace(RUN, steps=12)
    ft = FaultTolerance(address, group, 2, min_replica_groups=1, timeout=20, quorum_timeout=60, **AS_WRITTEN)
    trainer = fault_tolerant_trainer(cfg, ft, [LoseRankOne()])
    try:
        trainer.fit(ToyModule(cfg))
    except Exception as error:  # noqa: BLE001
        import traceback
        return {"error": f"{type(error).__name__}: {error}", "ended": time.time(), "tb": traceback.format_exc()}
    return {"error": None, "global_step": trainer.global_step}


@pytest.mark.distributed
@pytest.mark.timeout(180)
def test_losing_one_rank_of_a_group_ends_that_group_promptly_saying_so() -> None:
    with lighthouse(min_replicas=1) as address, tempfile.TemporaryDirectory() as out_dir:
        survivor = start_group(0, out_dir, _lose_a_rank, address, out_dir)
        broken = start_group(1, out_dir, _lose_a_rank, address, out_dir)
        # joining the broken group would terminate its rank 0 (as torchrun's agent does): first let it find out
        # by itself, as a rank on another host would
        rank0_file = Path(out_dir, "group1_rank0.pt")  # rank 1 of group 1 writes nothing: it was lost
        deadline = time.monotonic() + 90
        while not rank0_file.exists() and time.monotonic() < deadline:
            time.sleep(0.2)
        with pytest.raises(Exception):  # noqa: B017 -- rank 1's os._exit
            wait(broken, timeout=30)
        wait(survivor, timeout=120)
        killed = float(Path(out_dir, "killed").read_text())
        rank0 = torch.load(rank0_file, weights_only=False) if rank0_file.exists() else None
        others = read(out_dir, 0)
    assert rank0 is not None and rank0["error"] is not None, rank0
    assert rank0["error"].startswith("ReplicaGroupRankLost"), rank0["tb"]
    assert rank0["error"].startswith("ReplicaGroupRankLost") and "a rank of replica group 1 was lost" in rank0["error"]
    assert rank0["ended"] - killed < 15, rank0  # well under quorum_timeout (60 s)
    assert all(result["error"] is None and result["global_step"] == 12 for result in others), others


def _lose_group_zero(rank: int, group: int, address: str) -> dict[str, Any]:
    import lightning.pytorch as pl
    from lightning.pytorch.utilities.rank_zero import rank_zero_only

    class Record(pl.Callback):
        """Per step: live groups and the rank Lightning's logging sees. Group 0 dies mid-step once the two groups
        trained 2 steps together (whichever started first may have trained alone before)."""

        def __init__(self) -> None:
            self.seen: list[tuple[int, int]] = []

        def on_before_backward(self, trainer: Any, *args: Any) -> None:
            if group == 0 and sum(1 for live, _ in self.seen if live == 2) >= 2:
                os._exit(1)  # the whole of group 0 lost mid-step

        def on_train_batch_end(self, trainer: Any, *args: Any) -> None:
            self.seen.append((trainer.strategy.engine.replica_group.manager.num_participants(), rank_zero_only.rank))
            time.sleep(0.1)

    cfg = replace(RUN, steps=12)
    record = Record()
    trainer = fault_tolerant_trainer(cfg, FaultTolerance(address, group, 2, timeout=10, quorum_timeout=60,
        **AS_WRITTEN), [record])
    trainer.fit(ToyModule(cfg))
    return {"seen": record.seen}


@pytest.mark.distributed
@pytest.mark.timeout(180)
def test_while_group_zero_is_down_the_first_live_group_logs() -> None:
    with lighthouse(min_replicas=1) as address, tempfile.TemporaryDirectory() as out_dir:
        lost, survivor = (start_group(g, out_dir, _lose_group_zero, address) for g in range(2))
        wait(survivor, timeout=150)
        with pytest.raises(Exception):  # noqa: B017 -- group 0's os._exit
            wait(lost, timeout=30)
        results = read(out_dir, 1)
    for rank, result in enumerate(results):
        seen = result["seen"]
        last_together = max(i for i, (live, _) in enumerate(seen) if live == 2)
        together = {logging_rank for live, logging_rank in seen if live == 2}
        after_the_loss = {logging_rank for live, logging_rank in seen[last_together + 1 :] if live == 1}
        assert together == {GROUP_WORLD + rank}, seen  # group 0 logged while it was live
        assert after_the_loss == {rank}, seen  # then group 1's rank 0 became Lightning's rank 0


def _last_step_discarded(rank: int, group: int, address: str) -> dict[str, Any]:
    """Group 0 alone; rank 0 records an error in the last step's backward (as a failed hop-2 collective does),
    so the whole group discards that step. Also what the Trainer showed the end-of-batch callbacks."""
    import lightning.pytorch as pl

    ft = FaultTolerance(address, group, 1, timeout=10, quorum_timeout=15, **AS_WRITTEN)

    class FailLastStepOnce(pl.Callback):
        def __init__(self) -> None:
            self.failed = False
            self.steps_at_batch_end: list[int] = []

        def on_after_backward(self, trainer: Any, pl_module: Any) -> None:
            if rank == 0 and not self.failed and trainer.global_step == RUN.steps - 1:
                self.failed = True
                trainer.strategy.engine.replica_group.manager.report_error(RuntimeError("injected: lost a peer"))

        def on_train_batch_end(self, trainer: Any, *args: Any) -> None:
            self.steps_at_batch_end.append(trainer.global_step)

    probe = FailLastStepOnce()
    trainer = fault_tolerant_trainer(RUN, ft, [probe])
    trainer.fit(ToyModule(RUN))
    replica_group = trainer.strategy.engine.replica_group
    return {"global_step": trainer.global_step, "committed": replica_group.manager.current_step(),
            "discarded": replica_group.discarded_steps, "steps_at_batch_end": probe.steps_at_batch_end}


@pytest.mark.distributed
@pytest.mark.timeout(120)
def test_a_discarded_last_step_is_redone_and_never_counted() -> None:
    """``max_steps`` counts committed steps: the last step, discarded, is trained again, so the run ends with
    ``max_steps`` committed -- and the Trainer's step count never counts the discarded step, not even in the
    end-of-batch callbacks of that step (where a ``ModelCheckpoint`` would name a checkpoint after it)."""
    for result in run_one_group(_last_step_discarded, timeout=90):
        assert result["discarded"] == 1, result
        assert result["committed"] == RUN.steps and result["global_step"] == RUN.steps, result
        # one batch end per step, the discarded one showing the count it started with
        assert result["steps_at_batch_end"] == [*range(1, RUN.steps), RUN.steps - 1, RUN.steps], result
