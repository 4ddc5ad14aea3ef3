"""CollectiveRecorder: it records without replacing anything in torch, keeps ``torch.compile`` compiling, nests,
refuses an exit out of order, and records a composite collective (the ring) as one call whose parts it does not see."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist
from distributed import run_ranks

from lightning_mics._compat import dispatch_mode_stack
from lightning_mics.collective_recorder import CollectiveRecorder, recorded_as_one

PUBLIC_COLLECTIVES = ("all_gather_into_tensor", "reduce_scatter_tensor", "all_reduce", "broadcast", "isend", "irecv")


def test_recording_replaces_nothing_in_torch_distributed() -> None:
    before = {name: getattr(dist, name) for name in PUBLIC_COLLECTIVES}
    depth = len(dispatch_mode_stack())
    with CollectiveRecorder() as recorder:
        assert {name: getattr(dist, name) for name in PUBLIC_COLLECTIVES} == before
        assert len(dispatch_mode_stack()) == depth + 1
        x = torch.arange(6.0, requires_grad=True)
        (x * x).sum().backward()  # ordinary ops pass through the mode unchanged and are not calls
    assert x.grad is not None and torch.equal(x.grad, 2 * torch.arange(6.0))
    assert recorder.calls == []
    assert len(dispatch_mode_stack()) == depth  # nothing left behind


def test_recorders_must_exit_in_reverse_order() -> None:
    depth = len(dispatch_mode_stack())
    outer, inner = CollectiveRecorder().__enter__(), CollectiveRecorder().__enter__()
    with pytest.raises(RuntimeError, match="reverse order"):
        outer.__exit__(None, None, None)
    assert len(dispatch_mode_stack()) == depth + 2  # the refused exit removed nothing
    inner.__exit__(None, None, None)
    outer.__exit__(None, None, None)
    outer.__exit__(None, None, None)  # a second exit is a no-op
    assert len(dispatch_mode_stack()) == depth
    with pytest.raises(RuntimeError, match="already recording"):
        with outer:
            outer.__enter__()


def _nested_and_composite(rank: int, world_size: int) -> dict[str, Any]:
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    odd = dist.new_group([1])  # collective: every rank
    with CollectiveRecorder() as outer:
        outer.step = 7
        with CollectiveRecorder() as inner:
            payload = torch.ones(world_size * 3)
            with recorded_as_one("reduce_scatter", None, payload):
                dist.all_reduce(torch.ones(2))  # a part of the composite: hidden
            dist.all_reduce(torch.ones(5))
            if rank == 1:
                dist.broadcast(torch.ones(4, dtype=torch.float64), 1, group=odd)
            weight = torch.ones(3, requires_grad=True)
            weight.register_hook(lambda grad: dist.all_reduce(grad) or grad)
            (weight * 2).sum().backward()  # a collective issued by autograd, in backward
        dist.all_reduce(torch.ones(1))  # after inner exited: outer only
    dist.barrier()

    def described(recorder: CollectiveRecorder) -> list[tuple[str, tuple[int, ...], int, int]]:
        return [(c.kind, c.ranks, c.bytes, c.step) for c in recorder.calls]

    return {"outer": described(outer), "inner": described(inner), "gradient": weight.grad}


@pytest.mark.distributed
def test_nested_recorders_and_a_composite_collective() -> None:
    for rank, result in enumerate(run_ranks(_nested_and_composite, 2)):
        world = (0, 1)
        seen_by_both = [("reduce_scatter", world, 2 * 3 * 4), ("all_reduce", world, 5 * 4)]
        if rank == 1:
            seen_by_both.append(("broadcast", (1,), 4 * 8))  # global ranks of the group
        seen_by_both.append(("all_reduce", world, 3 * 4))
        assert result["inner"] == [(*call, 0) for call in seen_by_both]
        assert result["outer"] == [(*call, 7) for call in seen_by_both] + [("all_reduce", world, 4, 7)]
        torch.testing.assert_close(result["gradient"], torch.full((3,), 4.0))  # summed over 2 ranks


def test_torch_compile_still_compiles_while_recording() -> None:
    """A non-infra dispatch mode makes Dynamo skip compilation silently; the recorder's mode says it
    ignores compile internals, so ``compile_blocks`` keeps compiling under telemetry."""
    graphs: list[Any] = []

    def counting_backend(graph_module: Any, example_inputs: Any) -> Any:
        graphs.append(graph_module)
        return graph_module.forward

    compiled = torch.compile(lambda x: (x.sin() * 2).cos(), backend=counting_backend)
    with CollectiveRecorder():
        result = compiled(torch.ones(3))
    assert len(graphs) == 1
    torch.testing.assert_close(result, (torch.ones(3).sin() * 2).cos())


def test_higher_order_operators_run_under_a_recorder() -> None:
    """Models may use higher-order operators in eager (``flex_attention``, ``torch.cond``); torch
    refuses them under a dispatch mode that does not declare support for them."""
    x = torch.arange(3.0)
    with CollectiveRecorder() as recorder:
        taken = torch.cond(x.sum() > 0, lambda t: t + 1, lambda t: t - 1, (x,))
    torch.testing.assert_close(taken, x + 1)
    assert recorder.calls == []
