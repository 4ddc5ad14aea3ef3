"""Wire formats for the cross-replica gradient hop (``cross_replica_dtype``).

Hop 2 of MiCS -- the once-per-optimizer-step all-reduce of gradient shards across replicas -- is the
only traffic that crosses the slow inter-node links, so it is the one worth compressing. A
:class:`WireFormat` says what one element costs there and how a message is encoded:

* ``"bf16"`` / ``"fp16"``: a 16-bit float dtype, 2 bytes per element (one rounding per message);
* ``"int8"``: blockwise int8. Elements travel in blocks of :data:`INT8_BLOCK`, each with one fp32
  scale ``absmax / 127``; a value is ``round(x / scale)`` in ``[-127, 127]``, so it decodes to
  within ``scale / 2`` of ``x``. ``1 + 4 / INT8_BLOCK`` bytes per element (1.016 for 256).

The int8 codec is the pure functions below (:func:`quantize_blocks`, :func:`dequantize_blocks`,
:func:`pack`, :func:`unpack`, :func:`encode`, :func:`decode`): no process group, so they are tested
on their own. One message is one ``uint8`` tensor: the int8 values, then the fp32 scales' bytes --
one send per message instead of two. :func:`encode_rows` / :func:`decode_rows` do the same for every
row of a 2-D tensor at once (one message per destination rank, any format): what
:func:`~lightning_mics.collectives.compressed_all_reduce_` exchanges. None of them reads a tensor's
value on the host, so on a GPU they queue kernels without waiting for them.

Non-finite gradients are not hidden: an inf or NaN element is sent as the otherwise unused code
``-128`` and decodes as NaN (the sign of an inf is lost), and the block's scale is taken over its
finite elements only, so the other elements of the block keep their precision. Summed on the
receiving side in fp32, the NaN reaches every replica, where Lightning's and the strategy's
``error_if_nonfinite`` clipping or a mixed-precision scaler's inf check sees it, as it would have
seen the inf in full precision.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional, Union

import torch
from torch import Tensor

#: Elements that share one fp32 scale in the int8 format. Smaller blocks follow the gradient's local
#: magnitude more closely (less error for small elements next to large ones) and cost more scale
#: bytes: 256 -> 4 / 256 = 1.6 % over 1 byte per element.
INT8_BLOCK = 256
#: The largest int8 code used for values; -128 marks a non-finite element.
_QMAX = 127
_NONFINITE_CODE = -128
_SCALE_BYTES = 4  # fp32


@dataclass(frozen=True)
class WireFormat:
    """How gradients travel across replicas: by name, at ``element_bytes`` per element.

    ``dtype``: the 16-bit float formats' torch dtype (messages are that dtype); ``None`` for int8,
    whose messages are packed ``uint8`` (:func:`encode`). ``block``: elements per scale -- each
    rank's piece of the ring is padded to a multiple of it, which byte counts must include (1: no
    blocks)."""

    name: str
    element_bytes: float
    dtype: Optional[torch.dtype] = None
    block: int = 1

    def __str__(self) -> str:
        """For the layout log: the dtype as it always read for the 16-bit formats, else what int8 is."""
        if self.dtype is not None:
            return str(self.dtype)
        return f"{self.name} (blocks of {self.block} with one fp32 scale, {self.element_bytes:.4g} bytes per element)"

    @property
    def option(self) -> Union[torch.dtype, str]:
        """The resolved ``cross_replica_dtype`` as the strategies expose it: the dtype of a 16-bit
        float format (as it always read), else the format's name (int8 has no single torch dtype)."""
        return self.dtype if self.dtype is not None else self.name

    def byte_model(self) -> dict[str, Any]:
        """The keyword arguments the byte schedule takes for this format
        (:class:`~lightning_mics.schedule.StepLayout`, :func:`~lightning_mics.telemetry.analytic_comm_bytes`)."""
        return {"cross_replica_bytes": self.element_bytes, "cross_replica_block": self.block}


BF16 = WireFormat("bf16", 2.0, torch.bfloat16)
FP16 = WireFormat("fp16", 2.0, torch.float16)
INT8 = WireFormat("int8", 1 + _SCALE_BYTES / INT8_BLOCK, None, INT8_BLOCK)

#: The formats ``cross_replica_dtype`` accepts, by the names it accepts.
WIRE_FORMATS: dict[str, WireFormat] = {f.name: f for f in (BF16, FP16, INT8)}
_ALIASES: dict[object, str] = {
    "bfloat16": "bf16",
    "float16": "fp16",
    "half": "fp16",
    torch.bfloat16: "bf16",
    torch.float16: "fp16",
}


def resolve_wire_format(value: object) -> Optional[WireFormat]:
    """``cross_replica_dtype``'s accepted spellings -> a :class:`WireFormat` (``None``: the
    gradient's own dtype, no compression)."""
    if value is None or isinstance(value, WireFormat):
        return value
    name = _ALIASES.get(value, value)
    if not isinstance(name, str) or name not in WIRE_FORMATS:
        raise ValueError(
            f"cross_replica_dtype={value!r} is not one of {[None, *WIRE_FORMATS]}: None all-reduces gradients across "
            "replicas in their own dtype (fp32 in the mixed modes), 'bf16'/'fp16' send half the bytes between "
            f"partitions, 'int8' about a quarter (blocks of {INT8_BLOCK} with one fp32 scale each); sums stay fp32 "
            "inside the partition and in the optimizer."
        )
    return WIRE_FORMATS[name]


# ------------------------------------------------------------------------------------ int8 codec
def round_up_to_blocks(numel: int, block: int = INT8_BLOCK) -> int:
    """``numel`` rounded up to whole blocks."""
    return -(-numel // block) * block


def quantize_blocks(x: Tensor, block: int = INT8_BLOCK) -> tuple[Tensor, Tensor]:
    """Blockwise int8 of a flat tensor: ``(values int8 [blocks, block], scales fp32 [blocks])``.

    ``x`` is zero-padded to whole blocks. Per block, ``scale = absmax / 127`` over its finite
    elements and ``value = round(x / scale)`` (round half to even); an all-zero block has scale 0
    and values 0. Non-finite elements get the code -128 (module docstring).

    No branch on tensor values (no device-to-host sync on an accelerator, where this runs once per
    hop-2 message): non-finite magnitudes are zeroed before the absmax, and an element that divides
    to a non-finite code is one that was not finite (a finite one divides to at most 127 in size)."""
    flat = x.reshape(-1).float()
    padded = round_up_to_blocks(flat.numel(), block)
    if padded != flat.numel():
        flat = torch.cat([flat, flat.new_zeros(padded - flat.numel())])
    blocks = flat.view(-1, block)
    scales = blocks.abs().nan_to_num_(nan=0.0, posinf=0.0).amax(dim=1).div_(_QMAX)
    divisor = torch.where(scales > 0, scales, torch.ones((), dtype=scales.dtype, device=scales.device))
    codes = torch.div(blocks, divisor[:, None]).round_()
    nonfinite = float(_NONFINITE_CODE)
    codes.nan_to_num_(nan=nonfinite, posinf=nonfinite, neginf=nonfinite).clamp_(_NONFINITE_CODE, _QMAX)
    return codes.to(torch.int8), scales


def dequantize_blocks(values: Tensor, scales: Tensor) -> Tensor:
    """Inverse of :func:`quantize_blocks`: flat fp32 ``values * scale`` (NaN for code -128), without
    a device-to-host sync (a masked fill, not a branch or a boolean index)."""
    decoded = values.float().mul_(scales.view(-1, 1))
    return decoded.masked_fill_(values == _NONFINITE_CODE, float("nan")).reshape(-1)


def message_bytes(numel: int, block: int = INT8_BLOCK) -> int:
    """Bytes of one packed message of ``numel`` elements: 1 per (padded) element + 4 per block."""
    padded = round_up_to_blocks(numel, block)
    return padded + padded // block * _SCALE_BYTES


def pack(values: Tensor, scales: Tensor) -> Tensor:
    """One ``uint8`` message: the int8 values' bytes, then the fp32 scales' bytes."""
    return torch.cat([values.reshape(-1).view(torch.uint8), scales.contiguous().view(torch.uint8)])


def unpack(message: Tensor, numel: int, block: int = INT8_BLOCK) -> tuple[Tensor, Tensor]:
    """Split a :func:`pack` message of ``numel`` (padded) elements back into values and scales."""
    padded = round_up_to_blocks(numel, block)
    if message.numel() != message_bytes(padded, block):
        raise ValueError(f"int8 message has {message.numel()} bytes, expected {message_bytes(padded, block)}")
    values = message[:padded].view(torch.int8).view(-1, block)
    scales = message[padded:].clone().view(torch.float32)  # clone: fp32 needs 4-byte alignment
    return values, scales


def encode(x: Tensor, block: int = INT8_BLOCK) -> Tensor:
    """``x`` (any float dtype, flat or not) as one packed int8 message."""
    return pack(*quantize_blocks(x, block))


def decode(message: Tensor, numel: int, block: int = INT8_BLOCK) -> Tensor:
    """The first ``numel`` fp32 values of an :func:`encode` message."""
    return dequantize_blocks(*unpack(message, numel, block))[:numel]


# ------------------------------------------------------------------------- one message per row
def row_message_numel(numel: int, wire: WireFormat) -> int:
    """Elements of one :func:`encode_rows` message for a row of ``numel`` (padded) elements."""
    return numel if wire.dtype is not None else message_bytes(numel, wire.block)


def encode_rows(rows: Tensor, wire: WireFormat) -> Tensor:
    """Each row of a 2-D tensor as one ``wire`` message, in one vectorised pass: ``[rows, message]``.

    16-bit formats: the row rounded to the dtype. int8: the row's values' bytes, then its scales'
    bytes -- :func:`pack` per row; a row's length must be whole blocks. Row messages are what the
    compressed all-reduce exchanges (one per destination rank), so every row is encoded alike."""
    if wire.dtype is not None:
        return rows.to(wire.dtype)
    count, numel = rows.shape
    if numel % wire.block:
        raise ValueError(f"int8 rows must be whole blocks of {wire.block}; got rows of {numel} elements")
    values, scales = quantize_blocks(rows, wire.block)
    return torch.cat([values.view(count, numel).view(torch.uint8), scales.view(count, -1).view(torch.uint8)], dim=1)


def decode_rows(messages: Tensor, wire: WireFormat, numel: int) -> Tensor:
    """Inverse of :func:`encode_rows`: ``[rows, numel]`` fp32 (NaN where a non-finite int8 element was)."""
    if wire.dtype is not None:
        return messages.float()
    count = messages.shape[0]
    if messages.shape[1] != row_message_numel(numel, wire):
        raise ValueError(f"int8 row messages have {messages.shape[1]} bytes, expected {row_message_numel(numel, wire)}")
    values = messages[:, :numel].view(torch.int8).reshape(-1, wire.block)
    scales = messages[:, numel:].contiguous().view(torch.float32)  # contiguous: fp32 needs 4-byte alignment
    return dequantize_blocks(values, scales.reshape(-1)).view(count, numel)
