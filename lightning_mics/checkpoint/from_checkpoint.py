"""``LightningModule.load_from_checkpoint`` for either kind of MiCS checkpoint, in one process.

Lightning's classmethod opens its argument as one file, so on a sharded checkpoint (a directory) it
fails with ``IsADirectoryError``; it offers no hook to read anything else, and replacing it would
mean patching Lightning. :func:`load_from_checkpoint` takes the same arguments plus the class: a
sharded directory is read through :func:`~lightning_mics.checkpoint.read_full_state` (integrity
check, safe unpickling) and handed to the class's own ``load_from_checkpoint`` as an in-memory
checkpoint, so hyper-parameters, ``on_load_checkpoint`` and ``strict`` behave exactly as Lightning's.
A single-file checkpoint goes to the classmethod unchanged.

Why a strategy cannot do it: ``Model.load_from_checkpoint(path)`` runs without a Trainer or a strategy, and
Lightning's ``_load_from_checkpoint`` opens ``path`` (``fsspec`` then ``torch.load``) before anything of the
model runs -- ``on_load_checkpoint`` receives the dictionary already read. The only place that sees the path
first, short of replacing Lightning's function for every class, is the user's class: :class:`LoadsShardedCheckpoints`
is that, opt-in.
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


class LoadsShardedCheckpoints:
    """Mix into a LightningModule (first: ``class Model(LoadsShardedCheckpoints, L.LightningModule)``) so that
    ``Model.load_from_checkpoint(path)`` reads a sharded checkpoint directory too, by :func:`load_from_checkpoint`.

    Code that only knows Lightning's spelling (a serving script, another library) then loads MiCS checkpoints
    unchanged. Opt-in per class, not a patch of Lightning: other classes keep Lightning's classmethod, which
    fails on a directory with ``IsADirectoryError``. Files and in-memory checkpoints go to Lightning's as before.
    """

    def __init_subclass__(cls, **kwargs: Any) -> None:
        """Refuse the base order in which Lightning's classmethod would win and the mixin do nothing."""
        super().__init_subclass__(**kwargs)
        owner = next(klass for klass in cls.__mro__ if "load_from_checkpoint" in vars(klass))
        if owner.__module__.startswith(("lightning.", "pytorch_lightning.")):
            raise TypeError(
                f"{cls.__name__}: LoadsShardedCheckpoints must come before {owner.__name__} in the bases, or "
                f"{owner.__name__}.load_from_checkpoint is the one called: class {cls.__name__}"
                f"(LoadsShardedCheckpoints, {owner.__name__})."
            )

    @classmethod
    def load_from_checkpoint(
        cls, checkpoint_path: Any, map_location: Any = None, hparams_file: Optional[PathLike] = None,
        strict: Optional[bool] = None, **kwargs: Any,
    ) -> Any:
        """Lightning's ``load_from_checkpoint``; a directory is read as a sharded MiCS checkpoint."""
        if isinstance(checkpoint_path, (str, Path)) and Path(checkpoint_path).is_dir():
            return load_from_checkpoint(
                cls, checkpoint_path, map_location=map_location, hparams_file=hparams_file, strict=strict, **kwargs
            )
        lightnings = getattr(super(), "load_from_checkpoint", None)  # the LightningModule's, next in the MRO
        if lightnings is None:
            raise TypeError("LoadsShardedCheckpoints is a mixin for a LightningModule: "
                            "class Model(LoadsShardedCheckpoints, L.LightningModule).")
        return lightnings(checkpoint_path, map_location=map_location, hparams_file=hparams_file, strict=strict,
                          **kwargs)
