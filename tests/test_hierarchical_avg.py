"""The two-stage reduce-scatter with ``ReduceOp.AVG``, the op FSDP2 passes on NCCL (gloo runs get SUM): SUM and AVG
equal a reference for 2 nodes x 2 and 4 nodes x 1 (a stage over one rank is a copy, not a collective), and training
with FSDP2 choosing its reductions as on NCCL equals single-process training.

On gloo FSDP2 is told to reduce with SUM and divide itself (``force_sum_reduction``), so the training
runs of ``test_hierarchical.py`` never hand :class:`HierarchicalReduceScatter` a ``ReduceOp.AVG``; on
NCCL FSDP2 passes AVG for fp32 and bf16 gradients. Here 4 gloo ranks (one spawn) run it with AVG:

* called directly, SUM and AVG against a reference computed from every rank's input, for 2 nodes of 2
  ranks and for 4 nodes of 1 rank (``ranks_per_node=1``: the node stage is over a single rank, where
  NCCL's AVG is not to be trusted -- FSDP2's own comment, which avoids it -- so that stage must be a
  copy, not a collective; before, it ran one);
* in training, FSDP2 left to choose its reductions as it does on NCCL (``force_sum_reduction`` off):
  the hook really receives AVG, and the parameters equal single-process training.

The ring reduce-scatter's AVG is covered in ``test_ring_reduce_scatter.py``; the compressed hop 2 has
no reduction op of its own (it sums, the caller divides: ``test_compressed_hop.py``).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist
from distributed import run_ranks
from toy import RunConfig, ToyModule, assert_matches_reference, fit_with_mics, full_parameters

from lightning_mics import layout as layout_module
from lightning_mics.collective_recorder import CollectiveRecorder
from lightning_mics.collectives import HierarchicalReduceScatter, create_hierarchical_groups
from lightning_mics.topology import MiCSTopology

pytestmark = pytest.mark.distributed

WORLD = 4
NODE_SIZES = (2, 1)  # ranks per node: 2 nodes of 2, 4 nodes of 1 (the partition is all 4 ranks)
SHARD = 7  # elements per rank's output
OPS = {"sum": dist.ReduceOp.SUM, "avg": dist.ReduceOp.AVG}
CFG = RunConfig(world_size=WORLD, accumulate=2, clip=0.5, steps=2)


def _input(rank: int) -> torch.Tensor:
    return torch.randn(WORLD * SHARD, generator=torch.Generator().manual_seed(100 + rank))


def _direct(rank: int, ranks_per_node: int) -> dict[str, Any]:
    """HierarchicalReduceScatter with SUM and AVG: this rank's output next to the reference's."""
    topology = MiCSTopology.create(WORLD, ranks_per_node, WORLD)
    groups = create_hierarchical_groups(topology, rank)
    comm = HierarchicalReduceScatter(groups)
    shard_rank = topology.partition_group_of(rank).index(rank)
    total = sum(_input(r) for r in range(WORLD)).view(WORLD, SHARD)[shard_rank]
    results = {}
    for name, op in OPS.items():
        output = torch.empty(SHARD)
        try:
            with CollectiveRecorder() as recorder:
                comm(output, _input(rank), dist.group.WORLD, op=op)
            results[f"{name} stage sizes"] = [len(c.ranks) for c in recorder.calls if c.kind == "reduce_scatter"]
        except Exception as error:  # noqa: BLE001 -- reported per case, the test names it
            results[name] = f"{type(error).__name__}: {error}"
            continue
        expected = total / WORLD if name == "avg" else total
        results[name] = (output, expected)
    return results


def _fit_with_fsdp_choosing_avg(ranks_per_node: int) -> dict[str, Any]:
    """Train with FSDP2 reducing as on NCCL (AVG) and record the ops the two-stage hook received."""
    seen: list[str] = []
    original_call, original_shard = HierarchicalReduceScatter.__call__, layout_module.shard_model

    def recording_call(self: Any, *args: Any, **kwargs: Any) -> Any:  # FSDP2 passes keywords
        op = kwargs.get("op", args[3] if len(args) > 3 else dist.ReduceOp.SUM)
        seen.append("avg" if op == dist.ReduceOp.AVG else "sum" if op == dist.ReduceOp.SUM else str(op))
        return original_call(self, *args, **kwargs)

    HierarchicalReduceScatter.__call__ = recording_call  # type: ignore[method-assign]
    layout_module.shard_model = lambda *a, **kw: original_shard(*a, **{**kw, "force_sum_reduction": False})
    try:
        module = ToyModule(CFG)
        fit_with_mics(module, CFG, partition_size=WORLD, ranks_per_node=ranks_per_node, hierarchical=True)
    finally:
        HierarchicalReduceScatter.__call__ = original_call  # type: ignore[method-assign]
        layout_module.shard_model = original_shard
    return {"params": full_parameters(module), "ops": sorted(set(seen))}


def _run(rank: int, world: int) -> dict[Any, Any]:
    dist.init_process_group("gloo", rank=rank, world_size=world)
    results: dict[Any, Any] = {}
    for ranks_per_node in NODE_SIZES:
        results[("direct", ranks_per_node)] = _direct(rank, ranks_per_node)
    # the fits join this world (Lightning reuses an initialised default group): destroying it and letting them
    # initialise another on the same port could race on the TCPStore
    for ranks_per_node in NODE_SIZES:
        results[("fit", ranks_per_node)] = _fit_with_fsdp_choosing_avg(ranks_per_node)
    return results


@pytest.fixture(scope="module")
def runs() -> list[dict]:
    return run_ranks(_run, WORLD, timeout=240)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("op", list(OPS))
@pytest.mark.parametrize("ranks_per_node", NODE_SIZES)
def test_two_stage_reduce_scatter_matches_the_reference(runs, ranks_per_node, op) -> None:
    for rank, run in enumerate(runs):
        result = run[("direct", ranks_per_node)][op]
        assert not isinstance(result, str), f"rank {rank}: {result}"
        output, expected = result
        torch.testing.assert_close(output, expected, rtol=1e-6, atol=1e-6)
        # a stage over one rank is a copy, not a collective (NCCL's AVG over one rank is not trusted)
        expected_stages = [2, 2] if ranks_per_node == 2 else [WORLD]
        assert run[("direct", ranks_per_node)][f"{op} stage sizes"] == expected_stages, rank


@pytest.mark.timeout(300)
@pytest.mark.parametrize("ranks_per_node", NODE_SIZES)
def test_training_with_avg_reductions_matches_single_process(runs, ranks_per_node) -> None:
    for run in runs:
        assert run[("fit", ranks_per_node)]["ops"] == ["avg"]  # the NCCL path really ran
    assert_matches_reference([run[("fit", ranks_per_node)]["params"] for run in runs], CFG)
