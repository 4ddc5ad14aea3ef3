"""The compressed hop 2 (``cross_replica_dtype``) sums in fp32 on every backend: bit for bit the fp32 sum of the
wire-rounded messages, rounded once, with the backend read as gloo and as NCCL, on 4 ranks and on a group of 3; its
bytes are one packed reduce-scatter and all-gather, and the int8 and bf16 hops never sync the device with the host.

Before, the 16-bit hop summed in the wire dtype wherever it was not gloo (NCCL adds bf16 in bf16 at
every ring hop) and gloo's own ring rounded each partial sum to bf16 per hop; the int8 hop branched on
tensor values (``bool(...any())``) at every ring step, a device-to-host sync on a GPU. Now every
backend takes the same path: each rank's pieces are rounded once, exchanged, decoded and added in fp32
in group-rank order, and the sum is rounded once. So the result must equal, bit for bit, a reference
computed here from the wire-rounded inputs in fp32 -- with the backend read as gloo and as NCCL (the
only thing the backend still decides is where messages live, forced here through ``_backend_name``).

One spawn of 4 gloo ranks checks every format on the world and on a group of 3 (pieces padded, a piece
travelling to a non-power-of-two group), the recorded bytes, and the int8 and bf16 paths under a
dispatch mode that fails on any op that syncs an accelerator with the host.
"""

from __future__ import annotations

from typing import Any
from unittest import mock

import pytest
import torch
import torch.distributed as dist
from distributed import run_ranks

from lightning_mics import collectives, wire
from lightning_mics._compat import TorchDispatchMode
from lightning_mics.collective_recorder import CollectiveRecorder
from lightning_mics.collectives import compressed_all_reduce_
from lightning_mics.wire import WIRE_FORMATS, WireFormat

pytestmark = pytest.mark.distributed

WORLD = 4
GROUPS = {"world": (0, 1, 2, 3), "three": (0, 1, 3)}
NUMEL = 1000  # not a multiple of 3 or of 3 x 256: pieces are padded
BACKENDS = ("gloo", "nccl")


def _input(rank: int, case: str) -> torch.Tensor:
    """Values whose bf16 sums round differently in 16 bits than in fp32 (mixed magnitudes)."""
    generator = torch.Generator().manual_seed(rank * 1000 + sum(map(ord, case)))
    return torch.randn(NUMEL, generator=generator) * torch.logspace(-2, 2, NUMEL)


def _reference(ranks: tuple[int, ...], case: str, fmt: WireFormat) -> torch.Tensor:
    """What the all-reduce must return: each rank's input rounded to the wire (per piece, with the
    codec's plain per-message functions), added in fp32 in group-rank order, the sum rounded once."""
    n = len(ranks)
    piece = wire.round_up_to_blocks(-(-NUMEL // n), fmt.block)

    def rounded(x: torch.Tensor) -> torch.Tensor:
        if fmt.dtype is not None:
            return x.to(fmt.dtype).float()
        return wire.decode(wire.encode(x, fmt.block), x.numel(), fmt.block)

    padded = [torch.cat([_input(r, case), torch.zeros(n * piece - NUMEL)]).view(n, piece) for r in ranks]
    sums = []
    for i in range(n):
        total = rounded(padded[0][i]).clone()
        for other in padded[1:]:
            total += rounded(other[i])
        sums.append(rounded(total))
    return torch.cat(sums)[:NUMEL]


class _FailOnHostSync(TorchDispatchMode):
    """Fails on the ops that make an accelerator wait for the host: reading a value (``.item()``,
    ``bool(t)``, ``int(t)``), ``nonzero`` and boolean-mask indexing, whose output size depends on values."""

    SYNCING = ("aten::_local_scalar_dense", "aten::nonzero", "aten::masked_select", "aten::item")

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        name = func._schema.name
        boolean_index = name.startswith("aten::index") and any(
            isinstance(i, torch.Tensor) and i.dtype == torch.bool
            for arg in args
            if isinstance(arg, (list, tuple))
            for i in arg
        )
        if name in self.SYNCING or boolean_index:
            raise AssertionError(f"{name} syncs the device with the host inside the compressed hop")
        return func(*args, **kwargs)


def _all_reduce(rank: int, case: str, fmt: WireFormat, group: Any, backend: str) -> tuple[torch.Tensor, dict]:
    tensor = _input(rank, case)
    with mock.patch.object(collectives, "_backend_name", lambda _: backend), CollectiveRecorder() as recorder:
        compressed_all_reduce_(tensor, group, fmt)
    return tensor, dict(recorder.bytes_by_kind())


def _run(rank: int, world: int) -> dict:
    dist.init_process_group("gloo", rank=rank, world_size=world)
    groups = {name: dist.new_group(list(ranks)) for name, ranks in GROUPS.items()}
    results: dict[Any, Any] = {}
    for name, ranks in GROUPS.items():
        if rank not in ranks:
            continue
        for fmt_name, fmt in WIRE_FORMATS.items():
            case = f"{name}/{fmt_name}"
            expected = _reference(ranks, case, fmt)
            for backend in BACKENDS:
                result, recorded = _all_reduce(rank, case, fmt, groups[name], backend)
                results[(case, backend)] = {"equal": torch.equal(result, expected), "bytes": recorded}
    for fmt_name in ("int8", "bf16"):
        with _FailOnHostSync():
            tensor = _input(rank, "no sync")
            tensor[7] = float("inf")  # the non-finite bookkeeping runs too
            compressed_all_reduce_(tensor, groups["world"], WIRE_FORMATS[fmt_name])
        results[("no sync", fmt_name)] = bool(torch.isnan(tensor[7]) or torch.isinf(tensor[7]))
    return results


@pytest.fixture(scope="module")
def runs() -> list[dict]:
    return run_ranks(_run, WORLD, timeout=240)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("fmt", list(WIRE_FORMATS))
@pytest.mark.parametrize("group", list(GROUPS))
def test_sums_are_fp32_sums_of_wire_rounded_messages_bit_for_bit(runs, group, fmt, backend) -> None:
    for rank in GROUPS[group]:
        assert runs[rank][(f"{group}/{fmt}", backend)]["equal"], (rank, group, fmt, backend)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("fmt", list(WIRE_FORMATS))
@pytest.mark.parametrize("group", list(GROUPS))
def test_bytes_are_a_packed_reduce_scatter_and_all_gather(runs, group, fmt) -> None:
    """What the byte model charges: one reduce-scatter and one all-gather of ``n`` messages."""
    n, spec = len(GROUPS[group]), WIRE_FORMATS[fmt]
    piece = wire.round_up_to_blocks(-(-NUMEL // n), spec.block)
    message = wire.row_message_numel(piece, spec) * (2 if spec.dtype is not None else 1)
    for rank in GROUPS[group]:
        for backend in BACKENDS:
            recorded = runs[rank][(f"{group}/{fmt}", backend)]["bytes"]
            assert recorded == {"reduce_scatter": n * message, "all_gather": n * message}, (rank, backend)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("fmt", ["int8", "bf16"])
def test_no_host_sync_inside_the_compressed_hop(runs, fmt) -> None:
    assert all(run[("no sync", fmt)] for run in runs)


def test_host_sync_detector_catches_a_value_read() -> None:
    """The detector itself: a branch on a tensor's value is caught (else the test above proves nothing)."""
    with pytest.raises(AssertionError, match="_local_scalar_dense"), _FailOnHostSync():
        bool(torch.ones(3).any())
    with pytest.raises(AssertionError, match="syncs"), _FailOnHostSync():
        torch.arange(3.0)[torch.tensor([True, False, True])]


def test_row_codec_without_processes_reads_no_values() -> None:
    """encode_rows / decode_rows: each row is its own message, equal to the per-message codec, sync-free."""
    rows = torch.randn(3, 2 * wire.INT8_BLOCK, generator=torch.Generator().manual_seed(0))
    rows[1, 5] = float("nan")
    int8 = WIRE_FORMATS["int8"]
    with _FailOnHostSync():
        messages = wire.encode_rows(rows, int8)
        decoded = wire.decode_rows(messages, int8, rows.shape[1])
    for i in range(3):
        assert torch.equal(messages[i], wire.encode(rows[i]))
    torch.testing.assert_close(
        decoded, torch.stack([wire.decode(wire.encode(r), r.numel()) for r in rows]), equal_nan=True, rtol=0, atol=0
    )
    with pytest.raises(ValueError, match="whole blocks"):
        wire.encode_rows(torch.zeros(2, 10), int8)
