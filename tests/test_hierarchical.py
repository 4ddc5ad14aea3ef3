"""Hierarchical (two-stage) collectives for partitions that span nodes: with them and with flat ones training equals
single-process training; the recorded collectives run the two stages on the node sub-groups, the slow stage carrying
1/m of the bytes; ``hierarchical=True`` without a multi-node partition is refused.

8 ranks emulate 4 nodes of 2 (``ranks_per_node=2``); partitions of 4 (2 nodes) and 8 (4 nodes).
Hierarchical and flat collectives must both reproduce single-process training, and the recorded
collectives must show the two stages on the right sub-groups.
"""

from __future__ import annotations

import pytest
from distributed import run_ranks
from recording import RecordPerMicroStep
from toy import LAYERS, RunConfig, ToyModule, assert_matches_reference, fit_with_mics, full_parameters

from lightning_mics.topology import MiCSTopology

RANKS_PER_NODE = 2
CFG = RunConfig(world_size=8, accumulate=3, clip=0.5, steps=2)
CASES = [(partition, hierarchical) for partition in (4, 8) for hierarchical in (True, False)]
UNITS_WITH_GRADS = LAYERS + 1


def _train(rank: int, world: int) -> dict:
    results = {}
    for partition, hierarchical in CASES:
        module, recording = ToyModule(CFG), RecordPerMicroStep()
        fit_with_mics(
            module, CFG, callbacks=[recording], partition_size=partition,
            ranks_per_node=RANKS_PER_NODE, hierarchical=hierarchical,
        )
        calls = [c for c in recording.recorder.calls if c.step >= 0]
        results[(partition, hierarchical)] = {"params": full_parameters(module), "calls": calls}
    return results


@pytest.fixture(scope="module")
def runs():
    return run_ranks(_train, 8)


@pytest.mark.distributed
@pytest.mark.parametrize(("partition", "hierarchical"), CASES)
def test_matches_single_process(runs, partition, hierarchical):
    assert_matches_reference([r[(partition, hierarchical)]["params"] for r in runs], CFG)


@pytest.mark.distributed
@pytest.mark.parametrize("partition", [4, 8])
def test_hierarchical_runs_two_stages_on_node_subgroups(runs, partition):
    topo = MiCSTopology.create(8, RANKS_PER_NODE, partition)
    m = topo.ranks_per_node
    for rank, run in enumerate(runs):
        calls = run[(partition, True)]["calls"]
        my_node = topo.node_of(rank)
        intra = tuple(r for r in topo.partition_group_of(rank) if topo.node_of(r) == my_node)
        inter = tuple(r for r in topo.partition_group_of(rank) if r % m == rank % m)
        for kind in ("all_gather", "reduce_scatter"):
            groups = [c.ranks for c in calls if c.kind == kind]
            assert groups, kind
            assert set(groups) == {intra, inter}, (kind, set(groups))  # never the flat partition group
            assert groups.count(intra) == groups.count(inter)  # one of each stage per collective
        # the slow stage moves 1/m of the flat collective's bytes per rank: k shards instead of k*m
        gathered = [c for c in calls if c.kind == "all_gather"]
        inter_bytes = sum(c.bytes for c in gathered if c.ranks == inter)
        intra_bytes = sum(c.bytes for c in gathered if c.ranks == intra)
        assert intra_bytes == m * inter_bytes
        flat_calls = [c for c in run[(partition, False)]["calls"] if c.kind == "all_gather"]
        assert {c.ranks for c in flat_calls} == {topo.partition_group_of(rank)}
        assert sum(c.bytes for c in flat_calls) == intra_bytes  # same data arrives, fewer bytes cross nodes
        # 2-hop sync is unchanged: all-reduce over replicas at the boundary only; the one all-reduce
        # on the partition group per boundary is gradient clipping's norm
        replicas, partition_group = topo.replication_group_of(rank), topo.partition_group_of(rank)
        for step in range(CFG.steps * CFG.accumulate):
            boundary = (step + 1) % CFG.accumulate == 0
            reduced = [c.ranks for c in calls if c.kind == "all_reduce" and c.step == step]
            expected_sync = UNITS_WITH_GRADS if boundary and topo.replication_degree > 1 else 0
            synced = reduced.count(replicas) if len(replicas) > 1 else 0
            assert synced == expected_sync, (rank, step, reduced)
            assert reduced.count(partition_group) == (1 if boundary else 0), (rank, step, reduced)


def test_hierarchical_true_without_multi_node_partition_is_refused():
    from lightning_mics import MiCSStrategy

    from lightning_mics.layout import resolve_layout

    options = MiCSStrategy(partition_size=2, ranks_per_node=2, hierarchical=True).options
    with pytest.raises(ValueError, match="spans nodes"):  # resolved the way every rank resolves its layout
        resolve_layout(
            world_size=8, rank=0, ranks_per_node=options.ranks_per_node, partition_size=options.partition_size,
            reshard_after_forward=True, sharding=None, hierarchical=options.hierarchical, device_type="cpu",
            backend="gloo",
        )
    with pytest.raises(ValueError, match="hierarchical must be"):
        MiCSStrategy(hierarchical="yes")
