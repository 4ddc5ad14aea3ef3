"""Reading checkpoint files without running code from them.

Every file of a checkpoint is untrusted. Small files are read with ``torch.load(weights_only=True)``;
DCP's non-tensor entries go through planners that do the same (DCP's default planner would
unpickle them with ``weights_only=False``); DCP's ``.metadata`` -- a pickle that DCP itself reads
with plain ``pickle.load`` -- is read by :class:`SafeFileSystemReader`, whose unpickler admits only
the classes DCP metadata is made of. Anything else is refused with the same message: it is not
loaded because that could run arbitrary code.
"""

from __future__ import annotations

import io
import logging
import pickle
import zipfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta

from lightning_mics import _compat as compat
from lightning_mics.checkpoint.format import METADATA_FILE, CheckpointError

log = logging.getLogger(__name__)

_REFUSED = "it is not loaded because that could run arbitrary code"

#: (module, name) of every global a DCP ``.metadata`` pickle may name: the metadata dataclasses,
#: tensor shapes, and the path its writer recorded. torch dtypes, layouts and memory formats are
#: admitted separately (any attribute of ``torch`` of those types).
_METADATA_GLOBALS = frozenset(
    {
        ("torch.distributed.checkpoint.metadata", name)
        for name in (
            "Metadata",
            "TensorStorageMetadata",
            "BytesStorageMetadata",
            "ChunkStorageMetadata",
            "TensorProperties",
            "MetadataIndex",
            "StorageMeta",
            "_MEM_FORMAT_ENCODING",
        )
    }
    | {
        ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
        ("torch", "Size"),
        ("torch.serialization", "_get_layout"),  # maps a layout's name to the torch.layout object
        ("collections", "OrderedDict"),
        ("pathlib", "Path"),
        ("pathlib", "PosixPath"),
        ("pathlib", "WindowsPath"),
        ("pathlib", "PurePosixPath"),
        ("pathlib", "PureWindowsPath"),
    }
)


class _MetadataUnpickler(pickle.Unpickler):
    """``pickle.Unpickler`` that resolves only DCP metadata classes (the Python docs' "restricting
    globals" recipe): a ``__reduce__`` payload naming any other callable fails before it is called."""

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _METADATA_GLOBALS:
            return super().find_class(module, name)
        if module == "torch":
            value = getattr(torch, name, None)
            if isinstance(value, (torch.dtype, torch.layout, torch.memory_format)):
                return value
        raise pickle.UnpicklingError(f"global '{module}.{name}' is not part of checkpoint metadata")


def read_metadata(path: Path) -> Metadata:
    """DCP's ``.metadata`` at ``path``, unpickled with only DCP's metadata classes admitted."""
    try:
        with open(path, "rb") as handle:
            metadata = _MetadataUnpickler(handle).load()
    except pickle.UnpicklingError as err:
        if "is not part of checkpoint metadata" in str(err):
            raise CheckpointError(
                f"{path} holds objects that the checkpoint metadata reader refuses to unpickle ({err}); {_REFUSED}. "
                "Do not use this checkpoint; load another one."
            ) from err
        raise _damaged_metadata(path, err) from err
    except OSError as err:
        raise CheckpointError(f"{path} cannot be read ({err}); the checkpoint is incomplete or damaged.") from err
    except Exception as err:  # noqa: BLE001 - truncated/garbled pickles fail in many ways
        raise _damaged_metadata(path, err) from err
    if not isinstance(metadata, Metadata):
        raise CheckpointError(f"{path} is not DCP metadata (it holds a {type(metadata).__name__}); it is damaged.")
    return metadata


def _damaged_metadata(path: Path, err: BaseException) -> CheckpointError:
    return CheckpointError(
        f"{path} is damaged ({type(err).__name__}: {err}): the checkpoint's shard index cannot be read. "
        "Load an earlier checkpoint, or copy this one again."
    )


class SafeFileSystemReader(FileSystemReader):
    """DCP's file reader with :func:`read_metadata` instead of an unrestricted ``pickle.load``."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        if kwargs.get("rank") is not None:  # per-rank metadata files are not something our saves write
            raise CheckpointError(f"{self.path} uses per-rank DCP metadata, which lightning-mics does not read.")
        metadata = read_metadata(Path(self.path) / METADATA_FILE)
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


class SafeLoadPlanner(DefaultLoadPlanner):
    """DCP's default planner unpickles non-tensor entries with ``weights_only=False``; this one refuses
    anything but plain data, like every other loading path here."""

    def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
        _safe_load_bytes(self, read_item, value)


class SafeEmptyLoadPlanner(compat.EmptyStateDictLoadPlanner):
    """Rebuilds the whole state dict from the metadata (consolidation), reading non-tensors safely."""

    def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
        _safe_load_bytes(self, read_item, value)


def _safe_load_bytes(planner: DefaultLoadPlanner, read_item: Any, value: io.BytesIO) -> None:
    obj = torch.load(value, map_location="cpu", weights_only=True)
    if planner.flatten_state_dict:
        compat.set_element(planner.original_state_dict, planner.mappings[read_item.dest_index.fqn], obj)
    else:
        planner.state_dict[read_item.dest_index.fqn] = obj


def torch_bytes(obj: Any) -> bytes:
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    return buffer.getvalue()


def loads_safely(data: bytes) -> bool:
    try:
        torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
    except Exception:
        return False
    return True


def safe_trainer_state(state: Mapping[str, Any]) -> dict[str, Any]:
    """Lightning's non-tensor state, checked to load with ``weights_only=True``.

    Checked when saving, because a checkpoint that only fails when resuming is found too late.
    Hyperparameters are informational on resume, so values that cannot be loaded safely (custom
    classes) are stored as their ``repr`` with a warning; anything else is an error naming the key."""
    state = dict(state)
    for key in ("hyper_parameters", "datamodule_hyper_parameters"):
        if key in state:
            hparams = dict(state[key])  # AttributeDict is a custom class; a dict loads safely
            replaced = [name for name, value in hparams.items() if not loads_safely(torch_bytes(value))]
            for name in replaced:
                hparams[name] = repr(hparams[name])
            if replaced:
                log.warning(
                    "Checkpoint %s %s cannot be loaded with weights_only=True; stored as their repr.", key, replaced
                )
            state[key] = hparams
    unsafe = [key for key, value in state.items() if not loads_safely(torch_bytes({key: value}))]
    if unsafe:
        raise CheckpointError(
            f"The checkpoint entries {unsafe} hold objects that torch.load(weights_only=True) refuses to read, so "
            "the checkpoint could not be loaded safely. Make their state_dict() return tensors, numbers, strings "
            "and plain containers."
        )
    return state


def read_torch_file(path: Path, mmap: bool = True) -> Any:
    """``torch.load`` with ``weights_only=True`` and errors that say what is wrong with the file."""
    try:
        is_zip = zipfile.is_zipfile(path)
        with open(path, "rb") as handle:
            is_legacy_pickle = handle.read(1) == b"\x80"  # pickle protocol marker of pre-1.6 torch.save files
    except OSError as err:
        raise CheckpointError(f"{path} cannot be read ({err}); the checkpoint is incomplete or damaged.") from err
    if not (is_zip or is_legacy_pickle):
        raise CheckpointError(f"{path} is not a PyTorch checkpoint file (not written by torch.save), or it is damaged.")
    try:
        # mmap: every rank reads a full checkpoint; mapping it costs no memory until a tensor is used
        return torch.load(path, map_location="cpu", weights_only=True, mmap=is_zip and mmap)
    except pickle.UnpicklingError as err:
        raise CheckpointError(
            f"{path} holds objects that torch.load(weights_only=True) refuses to unpickle; {_REFUSED}. "
            f"Re-save it with plain tensors and containers. {unpickler_reason(err)}"
        ) from err
    except Exception as err:  # noqa: BLE001 - damaged zips and pickles fail in many ways
        raise CheckpointError(
            f"{path} is not a readable PyTorch checkpoint file ({type(err).__name__}: {err}); it is damaged."
        ) from err


def unpickler_reason(err: BaseException) -> str:
    """The one informative line of torch's long weights-only error."""
    lines = [line.strip() for line in str(err).splitlines() if "Unsupported" in line or "WeightsUnpickler" in line]
    return f"({lines[0]})" if lines else ""
