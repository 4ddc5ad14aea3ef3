"""``LightningModule.load_from_checkpoint`` for either kind of MiCS checkpoint, in one process.

Lightning's classmethod opens its argument as one file, so on a sharded checkpoint (a directory) it
fails with ``IsADirectoryError``; it offers no hook to read anything else, and replacing it would
mean patching Lightning. :func:`load_from_checkpoint` takes the same arguments plus the class: a
sharded directory is read through :func:`~lightning_mics.checkpoint.read_full_state` (integrity
check, safe unpickling) and handed to the class's own ``load_from_checkpoint`` as an in-memory
checkpoint, so hyper-parameters, ``on_load_checkpoint`` and ``strict`` behave exactly as Lightning's.
A single-file checkpoint goes to the classmethod unchanged.
"""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any, Optional, TypeVar

import torch

from lightning_mics.checkpoint import integrity
from lightning_mics.checkpoint.format import PathLike
from lightning_mics.checkpoint.loading import inspect_checkpoint, read_full_state

#: a LightningModule (or LightningDataModule) subclass
ModuleT = TypeVar("ModuleT")


def load_from_checkpoint(
    module_class: type[ModuleT],
    checkpoint_path: PathLike,
    map_location: Any = None,
    hparams_file: Optional[PathLike] = None,
    strict: Optional[bool] = None,
    verify: integrity.VerifyMode = "checksum",
    **kwargs: Any,
) -> ModuleT:
    """``module_class.load_from_checkpoint(checkpoint_path, ...)`` that also reads sharded checkpoints.

    The model is built unsharded in this process, as with any single-file checkpoint; optimizer
    states are not read. Needs memory for two copies of the weights (the gathered state and the
    in-memory checkpoint Lightning reads it from). ``verify``: how the shards are checked first
    (see :func:`lightning_mics.checkpoint.load`). Other arguments are Lightning's.
    """
    loader = getattr(module_class, "load_from_checkpoint", None)
    if not callable(loader):
        raise TypeError(
            f"{module_class!r} has no load_from_checkpoint: pass a LightningModule (or LightningDataModule) class."
        )
    path = Path(checkpoint_path)
    if inspect_checkpoint(path).kind != "sharded":
        return loader(path, map_location=map_location, hparams_file=hparams_file, strict=strict, **kwargs)
    model_state, _, trainer_state = read_full_state(path, verify=verify)
    buffer = io.BytesIO()
    torch.save({**trainer_state, "state_dict": model_state}, buffer)
    del model_state
    buffer.seek(0)
    return loader(buffer, map_location=map_location, hparams_file=hparams_file, strict=strict, **kwargs)
