"""The cross-replica wire formats: the ``cross_replica_dtype`` values, and the blockwise-int8 codec as
pure functions (no processes): error bound, exact values, zeros, padding, non-finite values."""

from __future__ import annotations

import math

import pytest
import torch

from lightning_mics import wire
from lightning_mics.wire import INT8, INT8_BLOCK, WIRE_FORMATS, resolve_wire_format

B = INT8_BLOCK


def _blocks(x: torch.Tensor) -> torch.Tensor:
    flat = x.reshape(-1).float()
    return torch.cat([flat, flat.new_zeros(wire.round_up_to_blocks(flat.numel()) - flat.numel())]).view(-1, B)


def test_formats_and_their_bytes_per_element() -> None:
    assert list(WIRE_FORMATS) == ["bf16", "fp16", "int8"]
    assert WIRE_FORMATS["bf16"].element_bytes == 2 and WIRE_FORMATS["bf16"].dtype is torch.bfloat16
    assert INT8.element_bytes == 1 + 4 / B and INT8.block == B and INT8.dtype is None
    assert INT8.byte_model() == {"cross_replica_bytes": 1 + 4 / B, "cross_replica_block": B}
    # a message's bytes are exactly what the byte model charges for whole blocks
    for numel in (1, B, 3 * B + 5):
        assert wire.message_bytes(numel) == wire.round_up_to_blocks(numel) * INT8.element_bytes


@pytest.mark.parametrize(
    ("value", "expected"),
    [(None, None), ("bf16", "bf16"), (torch.bfloat16, "bf16"), ("half", "fp16"), ("int8", "int8"), (INT8, "int8")],
)
def test_accepted_spellings(value, expected) -> None:
    resolved = resolve_wire_format(value)
    assert (resolved.name if resolved is not None else None) == expected


def test_unknown_format_names_the_accepted_ones() -> None:
    with pytest.raises(ValueError, match=r"cross_replica_dtype='int4' is not one of \[None, 'bf16', 'fp16', 'int8'\]"):
        resolve_wire_format("int4")
    with pytest.raises(ValueError, match="not one of"):
        resolve_wire_format(torch.int8)  # the option names a wire format, not a tensor dtype


@pytest.mark.parametrize("numel", [1, B - 1, B, 5 * B + 17])
def test_round_trip_error_is_at_most_half_a_scale(numel: int) -> None:
    x = torch.randn(numel, generator=torch.Generator().manual_seed(numel)) * torch.logspace(-3, 2, numel)
    values, scales = wire.quantize_blocks(x)
    assert values.dtype == torch.int8 and scales.dtype == torch.float32
    assert values.shape == (-(-numel // B), B) and values.abs().max() <= 127
    torch.testing.assert_close(scales, _blocks(x).abs().amax(dim=1) / 127)
    decoded = wire.decode(wire.encode(x), numel)
    assert decoded.shape == (numel,)
    bound = (scales / 2).repeat_interleave(B)[:numel]
    assert torch.all((decoded - x).abs() <= bound * (1 + 1e-6))


def test_multiples_of_the_scale_are_exact() -> None:
    scale = 2.0**-5  # absmax 127 * scale: every k * scale is representable on both sides
    codes = torch.arange(-127, 129) % 255 - 127  # every code in [-127, 127], 256 of them
    x = codes.float() * scale
    values, scales = wire.quantize_blocks(x)
    assert scales.tolist() == [scale]
    assert torch.equal(values.view(-1).long(), codes)
    assert torch.equal(wire.decode(wire.encode(x), x.numel()), x)


def test_zero_blocks_and_padding_stay_zero() -> None:
    x = torch.zeros(B + 3)
    x[B + 1] = 1.5  # block 0 all zero, block 1 one value and padding
    values, scales = wire.quantize_blocks(x)
    assert scales[0] == 0 and torch.all(values[0] == 0) and not torch.isnan(scales).any()
    assert torch.equal(wire.decode(wire.encode(x), x.numel()), x)


def test_pack_is_one_uint8_message_and_unpack_inverts_it() -> None:
    x = torch.randn(2 * B + 9, generator=torch.Generator().manual_seed(0))
    message = wire.encode(x)
    assert message.dtype == torch.uint8 and message.dim() == 1
    assert message.numel() == wire.message_bytes(x.numel()) == 3 * B + 3 * 4
    values, scales = wire.quantize_blocks(x)
    unpacked_values, unpacked_scales = wire.unpack(message, x.numel())
    assert torch.equal(unpacked_values, values) and torch.equal(unpacked_scales, scales)
    with pytest.raises(ValueError, match="expected"):
        wire.unpack(message[:-1], x.numel())


def test_half_precision_inputs_quantise_from_their_values() -> None:
    x = torch.randn(B, generator=torch.Generator().manual_seed(1)).bfloat16()
    decoded = wire.decode(wire.encode(x), B)
    assert decoded.dtype == torch.float32
    assert torch.all((decoded - x.float()).abs() <= x.float().abs().max() / 127 / 2 * (1 + 1e-6))


@pytest.mark.parametrize("bad", [math.inf, -math.inf, math.nan])
def test_non_finite_values_are_not_turned_into_finite_ones(bad: float) -> None:
    x = torch.linspace(-1, 1, 2 * B)
    x[3] = bad
    decoded = wire.decode(wire.encode(x), x.numel())
    # the bad element arrives as NaN (the sign of an inf is not kept): clipping and scalers see it
    assert torch.isnan(decoded[3])
    # the rest of its block keeps a scale taken over the finite values only, the other block is untouched
    finite = torch.ones_like(x, dtype=torch.bool)
    finite[3] = False
    assert torch.all((decoded[finite] - x[finite]).abs() <= 1 / 127 / 2 * (1 + 1e-6))
    # and a NaN survives further hops: decode -> add in fp32 -> encode again
    again = wire.decode(wire.encode(decoded + x.nan_to_num()), x.numel())
    assert torch.isnan(again[3]) and torch.isfinite(again[finite]).all()


def test_layout_comparison_and_log_name_the_format() -> None:
    """A model sharded with one ``cross_replica_dtype`` and met by a strategy with another: the
    difference reads as the option's values; the layout log line says what int8 is."""
    from lightning_mics.layout import resolve_layout

    def settings(wire_format):
        return resolve_layout(
            world_size=4, rank=0, ranks_per_node=2, partition_size=2, reshard_after_forward=True, sharding=None,
            hierarchical="auto", device_type="cpu", backend="gloo", cross_replica_wire=wire_format,
        )

    assert settings(INT8).differences(settings(WIRE_FORMATS["bf16"])) == ["cross_replica_dtype: 'int8' vs 'bf16'"]
    assert settings(None).differences(settings(INT8)) == ["cross_replica_dtype: None vs 'int8'"]
    assert settings(INT8) == settings(resolve_wire_format("int8"))
    assert str(WIRE_FORMATS["bf16"]) == "torch.bfloat16"  # the layout log line as it always read
    assert str(INT8) == "int8 (blocks of 256 with one fp32 scale, 1.016 bytes per element)"


def test_a_finite_block_gets_the_same_codes_whether_or_not_another_block_is_not_finite() -> None:
    # quantize_blocks takes a shortcut when every block is finite; both paths must agree
    torch.manual_seed(0)
    finite_block = torch.randn(B) * 3
    clean = torch.cat([finite_block, torch.randn(B)])
    dirty = torch.cat([finite_block, torch.full((B,), math.nan)])
    clean_codes, clean_scales = wire.quantize_blocks(clean)
    dirty_codes, dirty_scales = wire.quantize_blocks(dirty)
    assert torch.equal(clean_codes[0], dirty_codes[0]) and torch.equal(clean_scales[0], dirty_scales[0])
    assert torch.all(dirty_codes[1] == -128)
