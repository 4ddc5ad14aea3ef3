"""Every rank's RNG states, so a resumed run draws the same random numbers as an uninterrupted one."""

from __future__ import annotations

import random
from collections.abc import Mapping
from typing import Any

import torch


def capture_rng_state() -> dict[str, Any]:
    """This process's RNG states (torch, CUDA, numpy, python) as ``weights_only``-loadable values."""
    state: dict[str, Any] = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    try:
        import numpy as np
    except ImportError:  # numpy is optional
        return state
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    state["numpy"] = (kind, torch.from_numpy(keys.astype(np.int64)), int(pos), int(has_gauss), float(cached))
    return state


def restore_rng_state(state: Mapping[str, Any]) -> None:
    """Inverse of :func:`capture_rng_state`."""
    torch.set_rng_state(state["torch"])
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
    if "numpy" in state:
        import numpy as np

        kind, keys, pos, has_gauss, cached = state["numpy"]
        np.random.set_state((kind, keys.numpy().astype(np.uint32), pos, has_gauss, cached))


def check_rng_state(state: object) -> bool:
    """Whether ``state`` has the shape :func:`restore_rng_state` needs (checked before anything is
    loaded, so a damaged RNG file cannot leave a half-restored run)."""
    if not isinstance(state, Mapping) or not isinstance(state.get("torch"), torch.Tensor):
        return False
    python = state.get("python")
    return isinstance(python, (tuple, list)) and len(python) == 3
