"""Quantities with units on the command line and in configs: ``"100Gb/s"``, ``"80GiB"``, ``"10B"``."""

from __future__ import annotations

import re
from typing import Union

# ---------------------------------------------------------------------------------------------- parsing helpers

_UNIT_RE = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:[eE][-+]?[0-9]+)?)\s*([A-Za-z/]*)\s*$")
_BANDWIDTH_UNITS = {
    "": 1.0,
    "b/s": 1.0,
    "bps": 1 / 8,
    "kb/s": 1e3,
    "mb/s": 1e6,
    "gb/s": 1e9,
    "tb/s": 1e12,
    "gbps": 1e9 / 8,
    "gbit/s": 1e9 / 8,
    "mbps": 1e6 / 8,
    "tbps": 1e12 / 8,
}
_SIZE_UNITS = {
    "": 1.0,
    "b": 1.0,
    "kb": 1e3,
    "mb": 1e6,
    "gb": 1e9,
    "tb": 1e12,
    "kib": 1024.0,
    "mib": 1024.0**2,
    "gib": 1024.0**3,
    "tib": 1024.0**4,
}
_TIME_UNITS = {"": 1.0, "s": 1.0, "ms": 1e-3, "us": 1e-6, "ns": 1e-9}
_FLOPS_UNITS = {"": 1.0, "flops": 1.0, "gflops": 1e9, "tflops": 1e12, "pflops": 1e15}
_COUNT_UNITS = {"": 1.0, "k": 1e3, "m": 1e6, "b": 1e9, "t": 1e12}


def _parse_quantity(text: Union[str, float, int], units: dict[str, float], what: str, example: str) -> float:
    if isinstance(text, (int, float)) and not isinstance(text, bool):
        return float(text)
    match = _UNIT_RE.match(str(text))
    unit = match.group(2).lower() if match else None
    if match is None or unit not in units:
        raise ValueError(
            f"Cannot read {what} {text!r}: write a number with one of the units {sorted(units)} (e.g. {example!r})."
        )
    return float(match.group(1)) * units[unit]


def parse_bandwidth(text: Union[str, float]) -> float:
    """``"100Gbps"`` (bits) or ``"12.5GB/s"`` (bytes) -> bytes/s."""
    return _parse_quantity(text, _BANDWIDTH_UNITS, "bandwidth", "100Gbps")


def parse_bytes(text: Union[str, float]) -> float:
    """``"40GiB"`` / ``"40GB"`` -> bytes."""
    return _parse_quantity(text, _SIZE_UNITS, "memory size", "40GiB")


def parse_seconds(text: Union[str, float]) -> float:
    """``"30us"`` / ``"5e-6"`` -> seconds."""
    return _parse_quantity(text, _TIME_UNITS, "latency", "30us")


def parse_flops(text: Union[str, float]) -> float:
    """``"120TFLOPS"`` -> FLOP/s."""
    return _parse_quantity(text, _FLOPS_UNITS, "compute rate", "120TFLOPS")


def parse_count(text: Union[str, float]) -> int:
    """``"10B"`` / ``"1.3e9"`` / ``"350M"`` -> an int."""
    return int(round(_parse_quantity(text, _COUNT_UNITS, "count", "10B")))
