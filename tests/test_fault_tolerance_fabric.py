"""Fault tolerance in a Fabric loop: the quorum at each step's first forward, hop 2 through torchft at
``optimizer.step()``, a group that joins late heals at its first forward; the loop runs on
``strategy.committed_steps``. Two replica groups of two gloo ranks, each its own world."""

from __future__ import annotations

import tempfile
import time
from pathlib import Path

import pytest
import torch
from ft_harness import GROUP_WORLD, lighthouse, read, shard_digest, start_group, wait, wait_for_step
from toy import RunConfig, ToyModule, assert_matches_reference, full_parameters, global_batches, lm_loss

from lightning_mics import FaultTolerance, MiCSFabricStrategy

pytest.importorskip("torchft")

EQUIVALENCE = RunConfig(world_size=2 * GROUP_WORLD, steps=3, accumulate=2)
LATE_JOIN = RunConfig(world_size=2 * GROUP_WORLD, steps=10)


def _fabric_loop(
    rank: int, group: int, address: str, cfg: RunConfig, min_groups: int, pace: float, progress: str
) -> dict:
    from lightning.fabric import Fabric

    ft = FaultTolerance(address, group, 2, min_replica_groups=min_groups, timeout=20, quorum_timeout=90)
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
