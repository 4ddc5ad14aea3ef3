"""The 2-hop schedule, proven by counting collectives, and the per-rank share of model states.

8 ranks emulate 2 nodes of 4 (``ranks_per_node=4``). Every collective issued during a training
micro-step is recorded with its group, then checked against the MiCS schedule:

* all-gathers and reduce-scatters run only on this rank's partition group, inside one node;
* all-reduces run only on this rank's replication group, and only on the last micro-step of each
  accumulation window -- one per FSDP unit that has gradients.
"""

from __future__ import annotations

import pytest
from distributed import run_ranks
from recording import CountLocalStateElements, RecordPerMicroStep
from toy import LAYERS, ManualAccumulationModule, RunConfig, ToyModule, fit_with_mics

from lightning_mics.topology import MiCSTopology

pytestmark = pytest.mark.distributed  # every test here spawns rank processes

ACCUMULATE = 3
RANKS_PER_NODE = 4
UNITS_WITH_GRADS = LAYERS + 1  # one per transformer-like block, plus the root (embedding/head)


def _collect(rank: int, world: int, partition: int, manual: bool, grad_accumulation: str) -> dict:
    cfg = RunConfig(world_size=world, accumulate=ACCUMULATE, steps=2)
    module = ManualAccumulationModule(cfg) if manual else ToyModule(cfg)
    recorder_cb, memory_cb = RecordPerMicroStep(), CountLocalStateElements()
    fit_with_mics(
        module,
        cfg,
        callbacks=[recorder_cb, memory_cb],
        partition_size=partition,
        ranks_per_node=RANKS_PER_NODE,
        grad_accumulation=grad_accumulation,
    )
    full_shapes = {name: tuple(p.shape) for name, p in module.named_parameters()}
    trainable = {name for name, p in module.named_parameters() if p.requires_grad}
    calls = [c for c in recorder_cb.recorder.calls if c.step >= 0]
    return {"calls": calls, "local": memory_cb.local, "shapes": full_shapes, "trainable": trainable}


CASES = {  # partition size, manual optimization, grad_accumulation
    "mics-partition-4": (4, False, "sharded"),  # one node per partition, 2 replicas
    "mics-partition-2": (2, False, "sharded"),  # 2 partitions per node, 4 replicas
    "zero3": (8, False, "sharded"),  # partition spans both nodes (hierarchical stages): nothing to all-reduce
    "replicate": (1, False, "sharded"),  # DDP-like: only the all-reduce, across all 8 ranks
    "manual-partition-4": (4, True, "sharded"),
    # unsharded accumulation: reduce-scatter (and all-reduce) only on the boundary micro-step
    "unsharded-partition-4": (4, False, "unsharded"),
    "unsharded-zero3": (8, False, "unsharded"),
}


def _collect_all(rank: int, world: int) -> dict:
    return {name: _collect(rank, world, *case) for name, case in CASES.items()}


@pytest.fixture(scope="module")
def runs():
    return run_ranks(_collect_all, 8)


@pytest.mark.parametrize("case", list(CASES))
def test_collectives_follow_the_two_hop_schedule(runs, case):
    partition, _, grad_accumulation = CASES[case]
    topo = MiCSTopology.create(8, RANKS_PER_NODE, partition)
    micro_steps = sorted({c.step for r in runs for c in r[case]["calls"]})
    assert micro_steps, "no collectives recorded during training"
    for rank, run in enumerate(runs):
        calls = run[case]["calls"]
        partition = topo.partition_group_of(rank)
        if topo.spans_nodes:  # hierarchical: across nodes among same-local-rank peers, then in the node
            m = topo.ranks_per_node
            stage_groups = {
                tuple(r for r in partition if r % m == rank % m),
                tuple(r for r in partition if topo.node_of(r) == topo.node_of(rank)),
            }
        else:
            stage_groups = {partition}
        for call in calls:
            if call.kind in ("all_gather", "reduce_scatter"):
                assert call.ranks in stage_groups, call
                if not topo.spans_nodes:
                    assert len({topo.node_of(r) for r in call.ranks}) == 1, f"{call} leaves the node"
            elif call.kind == "all_reduce":
                assert call.ranks == topo.replication_group_of(rank), call
            else:
                pytest.fail(f"unexpected collective during a training step: {call}")
        for step in range(2 * ACCUMULATE):
            boundary = (step + 1) % ACCUMULATE == 0
            all_reduces = sum(1 for c in calls if c.kind == "all_reduce" and c.step == step)
            reduce_scatters = sum(1 for c in calls if c.kind == "reduce_scatter" and c.step == step)
            if topo.replication_degree > 1:
                assert all_reduces == (UNITS_WITH_GRADS if boundary else 0), (rank, step, all_reduces)
            else:
                assert all_reduces == 0
            # hop 1 runs whenever there is something to scatter: every micro-step when sharded,
            # only on the boundary when gradients accumulate unsharded
            stages = 2 if topo.spans_nodes else 1
            scatters = topo.partition_size > 1 and (grad_accumulation == "sharded" or boundary)
            assert reduce_scatters == (stages * UNITS_WITH_GRADS if scatters else 0), (rank, step)


@pytest.mark.parametrize("case", list(CASES))
def test_each_rank_holds_one_partition_share_of_every_state(runs, case):
    partition, _, _ = CASES[case]
    topo = MiCSTopology.create(8, RANKS_PER_NODE, partition)
    shapes, trainable = runs[0][case]["shapes"], runs[0][case]["trainable"]
    totals = {
        "params": sum(_numel(s) for s in shapes.values()),
        "grads": sum(_numel(s) for n, s in shapes.items() if n in trainable),
        "optim": sum(_numel(s) for n, s in shapes.items() if n in trainable),
    }
    # FSDP shards dim 0 in chunks of ceil(d0 / p) rows (the last ranks may get fewer), so no rank
    # holds more than that padded share, which exceeds total / p by less than one row per tensor.
    padded_share = {
        "params": sum(_padded_rows(s, partition) for s in shapes.values()),
        "grads": sum(_padded_rows(s, partition) for n, s in shapes.items() if n in trainable),
    }
    padded_share["optim"] = padded_share["grads"]
    for kind, total in totals.items():
        row_slack = sum(_numel(s[1:]) for n, s in shapes.items() if kind == "params" or n in trainable)
        for group in topo.partition_groups:
            local = [runs[r][case]["local"][kind] for r in group]
            assert sum(local) == total, f"{kind}: partition {group} holds {sum(local)} of {total} elements"
            assert max(local) <= padded_share[kind], (kind, local, padded_share[kind])
            # what each rank measured holds: 1/p of the state, plus less than one row per tensor
            assert max(local) < total / partition + row_slack, (kind, local, total, partition)
        for group in topo.replication_groups:  # replicas hold the same shard
            assert len({runs[r][case]["local"][kind] for r in group}) == 1, (kind, group)


def _padded_rows(shape: tuple[int, ...], partition: int) -> int:
    return -(-shape[0] // partition) * _numel(shape[1:])


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n
