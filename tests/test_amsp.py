"""AMSP per-state sharding: every (P, G, OS) combination equals single-process training and holds each state at
1/degree per rank (within FSDP's row padding), with the collectives the combination implies: optimizer sharding's
reduce-scatter and all-gather in place of the all-reduce, hpZ's backward gathers inside the node, a ZeRO-2-like
layout's one gather per optimizer step.

8 ranks emulate 2 nodes of 4 ranks.
"""

from __future__ import annotations

import pytest
from distributed import run_ranks
from recording import CountLocalStateElements, RecordPerMicroStep
from toy import LAYERS, RunConfig, ToyModule, assert_matches_reference, fit_with_mics, full_parameters

from lightning_mics import MiCSStrategy
from lightning_mics.sharding_spec import ShardingSpec
from lightning_mics.topology import MiCSTopology

RANKS_PER_NODE = 4
CFG = RunConfig(world_size=8, accumulate=3, clip=0.5, steps=2)

#: name -> (params degree, grads degree (= partition), optimizer-state degree)
CASES = {
    "os-across-all-replicas": (4, 4, 8),
    "os-across-some-replicas": (2, 2, 4),
    "hpz-params-in-node": (4, 8, 8),
    "zero2-like-params-kept": (1, 4, 4),
}


def make_strategy(params: int, grads: int, optim: int) -> MiCSStrategy:
    return MiCSStrategy(sharding=ShardingSpec(params, grads, optim), ranks_per_node=RANKS_PER_NODE)


def _train(rank: int, world: int) -> dict:
    results = {}
    for name, degrees in CASES.items():
        module, counts, recording = ToyModule(CFG), CountLocalStateElements(), RecordPerMicroStep()
        fit_with_mics(module, CFG, callbacks=[counts, recording], strategy=make_strategy(*degrees))
        results[name] = {
            "params": full_parameters(module),
            "local": counts.local,
            "calls": [c for c in recording.recorder.calls if c.step >= 0],
            "shapes": {n: tuple(p.shape) for n, p in module.named_parameters()},
            "trainable": {n for n, p in module.named_parameters() if p.requires_grad},
        }
    return results


@pytest.fixture(scope="module")
def runs():
    return run_ranks(_train, 8)


@pytest.mark.distributed
@pytest.mark.parametrize("case", list(CASES))
def test_matches_single_process(runs, case):
    assert_matches_reference([r[case]["params"] for r in runs], CFG)


def _numel(shape) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


@pytest.mark.distributed
@pytest.mark.parametrize("case", list(CASES))
def test_states_are_held_at_their_degrees(runs, case):
    _, partition, optim = CASES[case]
    shapes, trainable = runs[0][case]["shapes"], runs[0][case]["trainable"]
    total = sum(_numel(s) for s in shapes.values())
    total_trainable = sum(_numel(s) for n, s in shapes.items() if n in trainable)
    rows = sum(_numel(s[1:]) for s in shapes.values())
    # every element is held by world/degree ranks (exact), and no rank holds more than its padded share
    assert sum(run[case]["local"]["params"] for run in runs) == total * 8 // partition
    assert sum(run[case]["local"]["optim"] for run in runs) == total_trainable * 8 // optim
    for run in runs:
        local = run[case]["local"]
        assert local["params"] <= total / partition + rows
        assert local["optim"] <= total_trainable / optim + rows + 1, (local["optim"], total_trainable / optim)


@pytest.mark.distributed
def test_optimizer_sharding_replaces_the_all_reduce_with_reduce_scatter_and_all_gather(runs):
    topo = MiCSTopology.create(8, RANKS_PER_NODE, 4)
    for rank, run in enumerate(runs):
        calls = run["os-across-all-replicas"]["calls"]
        replicas = topo.replication_group_of(rank)
        on_replicas = [c for c in calls if c.ranks == replicas]
        # the only all-reduce left on the replicas is gradient clipping's scalar norm (4 bytes)
        assert {c.bytes for c in on_replicas if c.kind == "all_reduce"} == {4}, "the MiCS all-reduce should be gone"
        for step in range(CFG.steps * CFG.accumulate):
            kinds = sorted(c.kind for c in on_replicas if c.step == step)
            boundary = (step + 1) % CFG.accumulate == 0
            expected = ["all_gather", "all_reduce", "reduce_scatter"] if boundary else []
            assert kinds == expected, (rank, step, kinds)
        # same bytes across replicas as the all-reduce it replaces: reduce-scatter + all-gather of the shard
        gathered = [c.bytes for c in on_replicas if c.kind == "all_gather"]
        scattered = [c.bytes for c in on_replicas if c.kind == "reduce_scatter"]
        assert gathered == scattered


@pytest.mark.distributed
def test_hpz_gathers_backward_parameters_inside_the_node(runs):
    # partition 8 spans both nodes, so forward all-gathers are hierarchical (across nodes, then in
    # the node); with params resharded to 4 ranks after forward, backward re-gathers stay in the node.
    topo = MiCSTopology.create(8, RANKS_PER_NODE, 8)
    for rank, run in enumerate(runs):
        calls = [c for c in run["hpz-params-in-node"]["calls"] if c.kind == "all_gather"]
        node = tuple(r for r in range(8) if topo.node_of(r) == topo.node_of(rank))
        across = tuple(r for r in range(8) if r % RANKS_PER_NODE == rank % RANKS_PER_NODE)
        assert {c.ranks for c in calls} == {node, across}
        for step in range(CFG.steps * CFG.accumulate):
            n_across = sum(1 for c in calls if c.step == step and c.ranks == across)
            n_node = sum(1 for c in calls if c.step == step and c.ranks == node)
            assert (n_across, n_node) == (LAYERS + 1, 2 * LAYERS + 1), (rank, step, n_across, n_node)


@pytest.mark.distributed
def test_zero2_like_gathers_once_per_optimizer_step(runs):
    for run in runs:
        calls = run["zero2-like-params-kept"]["calls"]
        per_step = [sum(1 for c in calls if c.kind == "all_gather" and c.step == s) for s in range(6)]
        first, rest = per_step[0], per_step[1:3]
        assert first > 0 and rest == [0, 0], per_step  # gathered in micro-step 0, kept in 1 and 2
        assert per_step[3:] == per_step[:3]


def test_sharding_spec_and_partition_size_are_exclusive():
    with pytest.raises(ValueError, match="either sharding"):
        MiCSStrategy(sharding=ShardingSpec(), partition_size=2)
    with pytest.raises(TypeError, match="ShardingSpec"):
        MiCSStrategy(sharding=(4, 4, 8))
    with pytest.raises(TypeError, match="ShardingSpec or 'auto'"):
        MiCSStrategy(sharding="fastest")
    with pytest.raises(ValueError, match="either sharding"):
        MiCSStrategy(sharding="auto", partition_size=2)
