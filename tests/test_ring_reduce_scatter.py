"""The ring reduce-scatter that replaces gloo's all-reduce-based one: same results, half the bytes
sent, visible to the recorder as one reduce-scatter, and used by FSDP2 in training. Likewise the
direct-exchange all-gather used inside a node: gloo's result bit for bit, ``(n-1)/n`` of the output
sent per rank, recorded as one all-gather, and FSDP2's all-gather when the partition is one node."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist
from distributed import run_ranks
from toy import RunConfig, ToyModule, fit_with_mics

from lightning_mics.collective_recorder import CollectiveRecorder
from lightning_mics.collectives import (
    DirectAllGather,
    RingReduceScatter,
    all_gather_flat,
    direct_all_gather,
    reduce_scatter_flat,
    ring_reduce_scatter,
)

pytestmark = pytest.mark.distributed  # every test here spawns rank processes

WORLD = 4
#: the default group (None), the world as a new group, a strided pair and a group of 3 (not a power of two)
GROUPS = {"default": (0, 1, 2, 3), "world": (0, 1, 2, 3), "odd ranks": (1, 3), "three": (0, 1, 2)}
BLOCK = 1031  # elements each rank receives


def _count_sent_bytes() -> tuple[list[int], Any]:
    sent: list[int] = []
    original = dist.isend

    def counting(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        sent.append(tensor.numel() * tensor.element_size())
        return original(tensor, *args, **kwargs)

    dist.isend = counting
    return sent, original


def _compare_with_gloo(rank: int, world_size: int) -> dict[str, Any]:
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    groups = {name: dist.new_group(list(ranks)) for name, ranks in GROUPS.items()}  # collective: every rank
    groups["default"] = None
    results: dict[str, Any] = {}
    try:  # an input that is not world x output elements: refused before anything is sent
        ring_reduce_scatter(torch.empty(3), torch.empty(3 * world_size + 1), dist.ReduceOp.SUM, None)
        results["size error"] = None
    except ValueError as error:
        results["size error"] = str(error)
    for name, ranks in GROUPS.items():
        if rank not in ranks:
            continue
        group, n = groups[name], len(ranks)
        generator = torch.Generator().manual_seed(rank)
        cases = {
            # integer-valued floats: every summation order gives the same bits
            "sum, exact": (torch.randint(-1000, 1000, (n * BLOCK,), generator=generator).float(), dist.ReduceOp.SUM),
            "avg": (torch.randn(n * BLOCK, generator=generator), dist.ReduceOp.AVG),
            "bf16 sum": (torch.randn(n * BLOCK, generator=generator).bfloat16(), dist.ReduceOp.SUM),
            "max (gloo's own)": (torch.randn(n * BLOCK, generator=generator), dist.ReduceOp.MAX),
        }
        for case, (data, op) in cases.items():
            ours, gloos = torch.empty(BLOCK, dtype=data.dtype), torch.empty(BLOCK, dtype=data.dtype)
            sent, original_isend = _count_sent_bytes()
            try:
                with CollectiveRecorder() as recorder:
                    reduce_scatter_flat(ours, data, op, group)
            finally:
                dist.isend = original_isend
            dist.reduce_scatter_tensor(gloos, data.clone(), op=op, group=group)
            results[f"{name}: {case}"] = {
                "ours": ours,
                "gloo": gloos,
                "sent": sum(sent),
                "calls": [(c.kind, c.ranks, c.bytes) for c in recorder.calls],
                "n": n,
                "input_bytes": data.numel() * data.element_size(),
            }
        for dtype in (torch.float32, torch.bfloat16):
            shard = torch.randn(BLOCK, generator=generator).to(dtype)
            ours, gloos = torch.empty(n * BLOCK, dtype=dtype), torch.empty(n * BLOCK, dtype=dtype)
            sent, original_isend = _count_sent_bytes()
            try:
                with CollectiveRecorder() as recorder:
                    direct_all_gather(ours, shard, group)
            finally:
                dist.isend = original_isend
            all_gather_flat(gloos, shard, group)
            results[f"all-gather {name}: {dtype}"] = {
                "ours": ours, "gloo": gloos, "sent": sum(sent), "n": n,
                "calls": [(c.kind, c.ranks, c.bytes) for c in recorder.calls],
                "output_bytes": ours.numel() * ours.element_size(),
            }
    return results


@pytest.fixture(scope="module")
def compared() -> list[dict[str, Any]]:
    return run_ranks(_compare_with_gloo, WORLD)


def test_ring_refuses_an_input_of_the_wrong_size(compared: list[dict[str, Any]]) -> None:
    for per_rank in compared:
        assert per_rank["size error"] == "reduce-scatter input has 13 elements, expected 4 x 3"


def _cases(per_rank: dict[str, Any]) -> dict[str, Any]:
    return {case: result for case, result in per_rank.items() if case != "size error" and "all-gather" not in case}


def test_direct_all_gather_equals_gloos_sends_n_minus_1_shards_and_is_recorded_once(compared) -> None:
    checked = 0
    for per_rank in compared:
        for case, result in per_rank.items():
            if not case.startswith("all-gather"):
                continue
            n, ranks = result["n"], GROUPS[case.split(":")[0].removeprefix("all-gather ")]
            torch.testing.assert_close(result["ours"], result["gloo"], rtol=0, atol=0, msg=case)
            assert result["calls"] == [("all_gather", ranks, result["output_bytes"])], case
            assert result["sent"] == (n - 1) * result["output_bytes"] // n, case
            checked += 1
    assert checked == 2 * (4 + 4 + 2 + 3)


def test_ring_equals_gloos_reduce_scatter(compared: list[dict[str, Any]]) -> None:
    checked = 0
    for per_rank in compared:
        for case, result in _cases(per_rank).items():
            if "exact" in case or "max" in case:
                torch.testing.assert_close(result["ours"], result["gloo"], rtol=0, atol=0, msg=case)
            elif "bf16" in case:
                torch.testing.assert_close(result["ours"].float(), result["gloo"].float(), rtol=2e-2, atol=2e-2)
            else:
                torch.testing.assert_close(result["ours"], result["gloo"], rtol=1e-5, atol=1e-6, msg=case)
            checked += 1
    assert checked == 4 * (4 + 4 + 2 + 3)  # every member of every group, every case


def test_ring_sends_n_minus_1_blocks_and_is_recorded_as_one_reduce_scatter(compared: list[dict[str, Any]]) -> None:
    for per_rank in compared:
        for case, result in _cases(per_rank).items():
            n, ranks = result["n"], GROUPS[case.split(":")[0]]
            assert result["calls"] == [("reduce_scatter", ranks, result["input_bytes"])], case
            if "max" in case:
                assert result["sent"] == 0, case  # gloo's own collective, no point-to-point sends
            else:
                assert result["sent"] == (n - 1) * result["input_bytes"] // n, case


def _fit_and_inspect(rank: int, world_size: int) -> dict[str, Any]:
    comm_calls: list[int] = []
    original_call = RingReduceScatter.__call__

    def counting_call(self: RingReduceScatter, *args: Any, **kwargs: Any) -> Any:
        comm_calls.append(1)
        return original_call(self, *args, **kwargs)

    gathers: list[int] = []
    original_gather = DirectAllGather.__call__

    def counting_gather(self: DirectAllGather, *args: Any, **kwargs: Any) -> Any:
        gathers.append(1)
        return original_gather(self, *args, **kwargs)

    RingReduceScatter.__call__ = counting_call
    DirectAllGather.__call__ = counting_gather
    sent, original_isend = _count_sent_bytes()
    try:
        cfg = RunConfig(world_size=2, steps=1)
        trainer = fit_with_mics(ToyModule(cfg), cfg)
    finally:
        dist.isend = original_isend
        RingReduceScatter.__call__ = original_call
        DirectAllGather.__call__ = original_gather
    return {
        "comm_calls": len(comm_calls), "units": len(trainer.strategy._fsdp_units), "sends": len(sent),
        "gathers": len(gathers),
    }


def test_fsdp_units_reduce_scatter_over_the_ring_on_gloo() -> None:
    for result in run_ranks(_fit_and_inspect, 2):
        # one optimizer step of one micro-batch: every unit (all hold trainable parameters) reduce-scatters once
        assert result["comm_calls"] == result["units"] > 1
        assert result["sends"] >= result["units"]  # ... point to point: one send per ring step (2 ranks: one step)
        assert result["gathers"] >= result["units"]  # the one-node partition all-gathers by direct exchange
