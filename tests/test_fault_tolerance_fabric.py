"""Fault tolerance in a Fabric loop: the quorum at each step's first forward, hop 2 through torchft at
``optimizer.step()``, a group that joins late heals at its first forward; the loop runs on
``strategy.committed_steps``. Two replica groups of two gloo ranks, each its own world."""

from __future__ import annotations

import os
import tempfile
import time
from pathlib import Path

import pytest
import torch
from ft_harness import (
    AS_WRITTEN,
    GROUP_WORLD,
    lighthouse,
    lose_and_restart_group_1,
    read,
    shard_digest,
    start_group,
    wait,
    wait_for_step,
)
from toy import (
    Fp64Module,
    RunConfig,
    ToyModule,
    assert_matches_reference,
    fp64_fabric_precision,
    fp64_sgd_reference,
    full_parameters,
    global_batches,
    lm_loss,
    make_dataset,
)

from lightning_mics import FaultTolerance, MiCSFabricStrategy

pytest.importorskip("torchft")

EQUIVALENCE = RunConfig(world_size=2 * GROUP_WORLD, steps=3, accumulate=2)
LATE_JOIN = RunConfig(world_size=2 * GROUP_WORLD, steps=10)


def _fabric_loop(
    rank: int, group: int, address: str, cfg: RunConfig, min_groups: int, pace: float, progress: str
) -> dict:
    from lightning.fabric import Fabric

    ft = FaultTolerance(address, group, 2, min_replica_groups=min_groups, timeout=20, quorum_timeout=90, **AS_WRITTEN)
    strategy = MiCSFabricStrategy(fault_tolerance=ft)
    fabric = Fabric(accelerator="cpu", devices=GROUP_WORLD, strategy=strategy)
    fabric.launch()
    module = ToyModule(cfg)
    model, optimizer = fabric.setup(module, module.configure_optimizers())
    try:  # a second model is refused, before anything is sharded
        fabric.setup_module(ToyModule(cfg))
        second_model = "accepted"
    except ValueError as refused:
        second_model = str(refused)
    tokens, targets = global_batches(cfg)
    me = group * GROUP_WORLD + fabric.global_rank  # this rank among every group's ranks
    started = strategy.committed_steps
    Path(progress, f"group{group}_ready").touch()
    digests: dict[int, str] = {}
    while strategy.committed_steps < cfg.steps:
        step = strategy.committed_steps
        for micro in range(cfg.accumulate):
            first = ((step * cfg.accumulate + micro) * cfg.world_size + me) * cfg.micro_batch
            mine = slice(first, first + cfg.micro_batch)
            with fabric.no_backward_sync(model, enabled=micro < cfg.accumulate - 1):
                fabric.backward(lm_loss(model, (tokens[mine], targets[mine])) / cfg.accumulate)
        optimizer.step()
        optimizer.zero_grad()
        digests[strategy.committed_steps] = shard_digest(module)
        Path(progress, f"group{group}_rank{rank}.step").write_text(str(strategy.committed_steps))
        while pace and strategy.committed_steps >= 3 and not Path(progress, "group1_ready").exists():
            time.sleep(pace)  # alone, 3 steps ahead: the late group is on its way
    group_state = strategy.engine.replica_group
    return {
        "params": full_parameters(module),
        "digests": digests,
        "started": started,
        "discarded": group_state.discarded_steps,
        "committed": strategy.committed_steps,
        "second_model": second_model,
    }


@pytest.mark.distributed
@pytest.mark.timeout(300)
def test_two_fault_tolerant_fabric_groups_train_like_one_process() -> None:
    with lighthouse(min_replicas=2) as address, tempfile.TemporaryDirectory() as out_dir:
        groups = [start_group(g, out_dir, _fabric_loop, address, EQUIVALENCE, 2, 0.0, out_dir) for g in range(2)]
        for context in groups:
            wait(context, timeout=240)
        results = read(out_dir, 0) + read(out_dir, 1)
    assert all(result["discarded"] == 0 and result["committed"] == EQUIVALENCE.steps for result in results)
    assert_matches_reference([result["params"] for result in results], EQUIVALENCE)
    assert all("heals one model and its optimizer" in result["second_model"] for result in results)


@pytest.mark.distributed
@pytest.mark.timeout(300)
def test_a_fabric_group_that_joins_late_heals_at_its_first_forward() -> None:
    with lighthouse(min_replicas=1, join_timeout_ms=5000) as address, tempfile.TemporaryDirectory() as out_dir:
        first = start_group(0, out_dir, _fabric_loop, address, LATE_JOIN, 1, 0.2, out_dir)
        wait_for_step(Path(out_dir, "group0_rank0.step"), 3, timeout=120)  # group 0 trains alone, then waits
        late = start_group(1, out_dir, _fabric_loop, address, LATE_JOIN, 1, 0.2, out_dir)
        wait(first, timeout=240)
        wait(late, timeout=120)
        alone, joined = read(out_dir, 0), read(out_dir, 1)
    for rank in range(GROUP_WORLD):
        assert alone[rank]["committed"] == joined[rank]["committed"] == LATE_JOIN.steps
        healed_at = min(joined[rank]["digests"])
        assert healed_at > 2, "the late group did not heal: it started at step 0"  # it took the live step
        common = sorted(set(alone[rank]["digests"]) & set(joined[rank]["digests"]))
        assert common, "the groups never trained together"
        for step in common:  # bit-identical shards from the heal on
            assert alone[rank]["digests"][step] == joined[rank]["digests"][step], (rank, step)
        for name, value in alone[rank]["params"].items():
            assert torch.equal(value, joined[rank]["params"][name]), name


# ---------------------------------------------------------------------------------------------------------------------
# the trajectory kept in a Fabric loop: strategy.training_batches


TRAJECTORY = RunConfig(world_size=2 * GROUP_WORLD, micro_batch=2, accumulate=2, steps=8, lr=0.2, momentum=0.0)


def _fabric_trajectory(rank: int, group: int, address: str, fail: bool, marks: str) -> dict:
    """Group 1 told to fail dies in the last micro-step of its third step with the other group (before its
    backward); the survivor trains alone, noting it, slowly, so that the restarted group heals before the end."""
    from lightning.fabric import Fabric
    from torch.utils.data import DataLoader

    cfg = TRAJECTORY
    ft = FaultTolerance(address, group, 2, min_replica_groups=1, timeout=10, quorum_timeout=60,
        keep_trajectory=True, **AS_WRITTEN)
    strategy = MiCSFabricStrategy(fault_tolerance=ft, precision=fp64_fabric_precision())
    fabric = Fabric(accelerator="cpu", devices=GROUP_WORLD, strategy=strategy)
    fabric.launch()
    module = Fp64Module(cfg)
    optimizer = torch.optim.SGD([p for p in module.parameters() if p.requires_grad], lr=cfg.lr)
    model, optimizer = fabric.setup(module, optimizer)
    loader = DataLoader(make_dataset(cfg.num_samples), batch_size=cfg.micro_batch)  # in order: no shuffling
    batches = strategy.training_batches(loader, accumulate=cfg.accumulate)
    keys: list[tuple[int, int, tuple[int, ...], int]] = []
    together = False
    while strategy.committed_steps < cfg.steps:
        for micro in range(cfg.accumulate):
            batch = next(batches)  # the step's quorum runs at its first micro-batch
            manager = strategy.engine.replica_group.manager
            key = strategy.engine.data_cursor.current
            keys.append((key.step, key.micro, key.shares, manager.num_participants()))
            together |= manager.num_participants() == 2
            steps_together = {step for step, _, _, live in keys if live == 2}
            if fail and rank == 1 and len(steps_together) > 2 and micro == cfg.accumulate - 1:
                os._exit(1)  # a node lost mid-step
            with fabric.no_backward_sync(model, enabled=micro < cfg.accumulate - 1):
                fabric.backward(lm_loss(model, batch) / cfg.accumulate)
        optimizer.step()
        optimizer.zero_grad()
        live = strategy.engine.replica_group.manager.num_participants()
        if not fail and together and live == 1:
            Path(marks, f"fabric_group{group}_rank{rank}.alone").write_text(str(strategy.committed_steps))
            time.sleep(1.5)
        elif live == 1 and not together:
            time.sleep(0.5)  # the first group up waits for the other
    return {
        "params": full_parameters(module),
        "keys": keys,
        "discarded": strategy.engine.replica_group.discarded_steps,
        "committed": strategy.committed_steps,
    }


@pytest.mark.distributed
@pytest.mark.timeout(420)
def test_a_fabric_loop_on_training_batches_keeps_the_trajectory_through_a_kill_and_a_restart() -> None:
    alone, healed = lose_and_restart_group_1(
        _fabric_trajectory,
        lambda address, out, role: (address, role == "doomed", out),
        "fabric_group0_rank{rank}.alone",
    )
    # step d on samples d * 16 .. d * 16 + 15: the loader's order, global batch of 4 shares x 2 micro-steps x 2
    in_order = fp64_sgd_reference(TRAJECTORY, list(range(TRAJECTORY.num_samples)))
    reference = {f"model.{name}": value for name, value in in_order.items()}
    for rank in range(GROUP_WORLD):
        assert alone[rank]["committed"] == healed[rank]["committed"] == TRAJECTORY.steps
        assert alone[rank]["discarded"] >= 1
        assert {shares for _, _, shares, live in alone[rank]["keys"] if live == 1} >= {(0, 1)}  # read both shares
        started = [step for step, micro, _, _ in alone[rank]["keys"] if micro == 0]
        assert started == sorted(started) and set(started) == set(range(started[0], TRAJECTORY.steps))
        assert len(started) > len(set(started))  # the discarded step was re-done
        for result in (alone[rank], healed[rank]):
            for name, expected in reference.items():
                got = result["params"][name]
                assert got.dtype == torch.float64
                assert (got - expected).abs().max().item() < 1e-10, name
