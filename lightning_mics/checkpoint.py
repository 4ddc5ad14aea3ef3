"""Checkpoints for MiCS: sharded (DCP) directories, single-file full checkpoints, safe loading.

A **sharded checkpoint** is a directory, committed atomically::

    last.ckpt/
        mics_checkpoint.json        commit record: format, layout that wrote it, which data dir is current
        state-step000000042-1a2b3c4d/
            .metadata, __*_0.distcp  DCP: model + optimizer states as DTensor shards
            trainer_state.pt         rank 0: Lightning's loops, callbacks, schedulers, precision state
            rng/rank00000.pt ...     every rank's RNG states (exact resume)

Why this shape:

* **Deduplicated.** DCP keys each shard by (name, offset); the replicas of a shard in other partition
  groups have the same key, and DCP's planner keeps one writer per key, choosing the least-loaded
  rank -- so a checkpoint is one copy of the states and replicas share the writing.
* **Atomic.** Nothing is written where a reader looks. A new checkpoint is staged in a hidden sibling
  ``.last.ckpt.partial-<token>`` and renamed into place after a barrier; an existing one gets a new
  data directory staged inside it, and only the ``os.replace`` of the commit record switches to it.
  A save killed at any point leaves the previous checkpoint loadable, and the hidden staging names
  never match Lightning's ``last*.ckpt`` pattern, so ``ckpt_path="last"`` never picks one. Stale
  staging data is reported on load and removed by the next save to the same path.
* **Reshardable.** DCP stores global offsets, so :func:`load` reads the shards onto any mesh -- other
  world or partition size -- or into a plain module in one process without ``torch.distributed``.
* **Safe.** Nothing is unpickled: small files are read with ``torch.load(weights_only=True)``, the
  commit record is JSON, and DCP's non-tensor entries go through a planner that also uses
  ``weights_only=True`` (DCP's default planner would unpickle them).

A **full checkpoint** (``MiCSStrategy(save_full_state_dict=True)``, or :mod:`lightning_mics.consolidate`
with ``--with-optimizer``) is one ``torch.save`` file in Lightning's usual format -- unsharded
``state_dict``, ``optimizer_states`` in ``torch.optim`` format -- gathered on rank 0. :func:`load`
accepts either kind, whatever the current layout.
"""

from __future__ import annotations

import io
import json
import logging
import os
import random
import re
import secrets
import shutil
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Optional, Union

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import Tensor, nn
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, _EmptyStateDictLoadPlanner
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata
from torch.distributed.tensor import DTensor, distribute_tensor
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.optim import Optimizer

log = logging.getLogger(__name__)

PathLike = Union[str, os.PathLike]

#: ``format`` of the commit record of a sharded checkpoint directory.
SHARDED_FORMAT = "lightning-mics-sharded"
#: ``format`` stored under :data:`FULL_META_KEY` in a single-file full checkpoint.
FULL_FORMAT = "lightning-mics-full"
FORMAT_VERSION = 1
#: The commit record. A directory without it is not (yet) a checkpoint.
MANIFEST_FILE = "mics_checkpoint.json"
#: Rank 0's file with everything that is not model or optimizer state.
TRAINER_STATE_FILE = "trainer_state.pt"
RNG_DIR = "rng"
#: Key of a full checkpoint holding what MiCS adds to Lightning's dict (layout, RNG, parameter names).
FULL_META_KEY = "mics"
#: Keys of the DCP payload.
MODEL_KEY, OPTIMIZERS_KEY = "model", "optimizers"

_PARTIAL_MARK = ".partial-"
_OLD_MARK = ".old-"
_DATA_DIR_PATTERN = re.compile(r"^state-step\d+-[0-9a-f]+$")
_MAX_LISTED_KEYS = 20


class CheckpointError(ValueError):
    """A checkpoint cannot be used as asked; the message says why and what to do instead."""


@dataclass(frozen=True)
class CheckpointLayout:
    """The process layout that wrote a checkpoint (informational: loading works under any layout)."""

    world_size: int
    partition_size: int
    ranks_per_node: int

    @property
    def replication_degree(self) -> int:
        return self.world_size // self.partition_size


@dataclass(frozen=True)
class CheckpointInfo:
    """What :func:`inspect_checkpoint` found at a path."""

    path: Path
    kind: str  #: ``"sharded"`` or ``"full"``
    layout: Optional[CheckpointLayout]
    num_optimizers: int
    global_step: Optional[int]
    epoch: Optional[int]
    data_dir: Optional[Path] = None  #: the committed DCP directory of a sharded checkpoint


# ---------------------------------------------------------------------------------------------------------------------
# collectives (no-ops without torch.distributed, so everything here also works in a single plain process)


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def _rank() -> int:
    return dist.get_rank() if _distributed() else 0


def _world_size() -> int:
    return dist.get_world_size() if _distributed() else 1


def _barrier() -> None:
    if not _distributed():
        return
    if dist.get_backend() == "nccl":
        dist.barrier(device_ids=[torch.cuda.current_device()])
    else:
        dist.barrier()


def _from_rank_zero(obj: Any) -> Any:
    """Rank 0's ``obj`` on every rank: decisions about the file system are taken once, so that all
    ranks take the same branch (and raise the same error) instead of racing on what they see."""
    if not _distributed():
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


# ---------------------------------------------------------------------------------------------------------------------
# state dicts


def model_state_dict(module: nn.Module, full: bool = False) -> dict[str, Any]:
    """The module's state keyed by its own parameter names (no wrapper prefixes).

    Sharded (default): DTensor shards, no communication. ``full``: gathered, unsharded CPU tensors on
    rank 0 and an empty dict on the other ranks (a collective: call it on every rank)."""
    return get_model_state_dict(module, options=_options(full))


def optimizer_state_dict(module: nn.Module, optimizer: Optimizer, full: bool = False) -> dict[str, Any]:
    """The optimizer's state keyed by parameter name (sharded), or -- ``full`` -- gathered on rank 0
    in ``torch.optim``'s own format (integer parameter ids), as a plain optimizer would save it."""
    state = get_optimizer_state_dict(module, optimizer, options=_options(full))
    if not full or _rank() != 0:
        return state
    indexed, _ = _name_keyed_to_indexed(state)
    return indexed


def _options(full: bool) -> StateDictOptions:
    return StateDictOptions(full_state_dict=full, cpu_offload=full)


def _name_keyed_to_indexed(state: Mapping[str, Any]) -> tuple[dict[str, Any], list[list[str]]]:
    """Name-keyed optimizer state (DCP's form) -> ``torch.optim`` format; also the names per group.

    The names are kept as each group's ``param_names`` (which ``torch.optim`` itself understands),
    so a loader can check that the ids mean the same parameters."""
    index: dict[str, int] = {}
    groups, names = [], []
    for group in state["param_groups"]:
        group_names = list(group["params"])
        for name in group_names:
            index[name] = len(index)
        groups.append({**group, "params": [index[name] for name in group_names], "param_names": group_names})
        names.append(group_names)
    return {"state": {index[name]: value for name, value in state["state"].items()}, "param_groups": groups}, names


def _indexed_to_name_keyed(state: Mapping[str, Any], names: Sequence[Sequence[str]]) -> dict[str, Any]:
    """``torch.optim`` format -> name-keyed, given this optimizer's parameter names per group."""
    saved_groups = state["param_groups"]
    sizes = [len(group["params"]) for group in saved_groups]
    if sizes != [len(group_names) for group_names in names]:
        raise CheckpointError(
            f"The checkpoint's optimizer has parameter groups of sizes {sizes}, this optimizer "
            f"{[len(group_names) for group_names in names]}: it was saved for another model or "
            "`configure_optimizers`; nothing was loaded."
        )
    for saved, group_names in zip(saved_groups, names):
        saved_names = saved.get("param_names")
        if saved_names is not None and list(saved_names) != list(group_names):
            differ = [f"{a} vs {b}" for a, b in zip(saved_names, group_names) if a != b]
            raise CheckpointError(
                "The checkpoint's optimizer state belongs to other parameters (checkpoint vs this optimizer): "
                + ", ".join(differ[:_MAX_LISTED_KEYS])
                + "; nothing was loaded."
            )
    name_of: dict[int, str] = {}
    groups = []
    for saved, group_names in zip(saved_groups, names):
        name_of.update(zip((int(i) for i in saved["params"]), group_names))
        group = {key: value for key, value in saved.items() if key != "param_names"}
        groups.append({**group, "params": list(group_names)})
    return {"state": {name_of[int(i)]: value for i, value in state["state"].items()}, "param_groups": groups}


# ---------------------------------------------------------------------------------------------------------------------
# RNG states


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


# ---------------------------------------------------------------------------------------------------------------------
# small safe files


def _fsync_dir(path: Path) -> None:
    """Make a rename/creation inside ``path`` durable (a crash after the rename must not undo it)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:  # pragma: no cover - platforms without directory handles
        return
    try:
        os.fsync(fd)
    except OSError:  # pragma: no cover
        pass
    finally:
        os.close(fd)


def _write_durably(path: Path, data: bytes) -> None:
    """Write ``data`` to a temporary name, fsync it and rename it over ``path`` (atomic replace)."""
    tmp = path.with_name(f".{path.name}{_PARTIAL_MARK}{secrets.token_hex(4)}")
    with open(tmp, "wb") as handle:
        handle.write(data)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(tmp, path)
    _fsync_dir(path.parent)


def _torch_bytes(obj: Any) -> bytes:
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    return buffer.getvalue()


def _loads_safely(data: bytes) -> bool:
    try:
        torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
    except Exception:
        return False
    return True


def _safe_trainer_state(state: Mapping[str, Any]) -> dict[str, Any]:
    """Lightning's non-tensor state, checked to load with ``weights_only=True``.

    Checked when saving, because a checkpoint that only fails when resuming is found too late.
    Hyperparameters are informational on resume, so values that cannot be loaded safely (custom
    classes) are stored as their ``repr`` with a warning; anything else is an error naming the key."""
    state = dict(state)
    for key in ("hyper_parameters", "datamodule_hyper_parameters"):
        if key in state:
            hparams = dict(state[key])  # AttributeDict is a custom class; a dict loads safely
            replaced = [name for name, value in hparams.items() if not _loads_safely(_torch_bytes(value))]
            for name in replaced:
                hparams[name] = repr(hparams[name])
            if replaced:
                log.warning(
                    "Checkpoint %s %s cannot be loaded with weights_only=True; stored as their repr.", key, replaced
                )
            state[key] = hparams
    unsafe = [key for key, value in state.items() if not _loads_safely(_torch_bytes({key: value}))]
    if unsafe:
        raise CheckpointError(
            f"The checkpoint entries {unsafe} hold objects that torch.load(weights_only=True) refuses to read, so "
            "the checkpoint could not be loaded safely. Make their state_dict() return tensors, numbers, strings "
            "and plain containers."
        )
    return state


def _read_torch_file(path: Path) -> Any:
    """``torch.load`` with ``weights_only=True`` and errors that say what is wrong with the file."""
    import pickle
    import zipfile

    is_zip = zipfile.is_zipfile(path)
    with open(path, "rb") as handle:
        is_legacy_pickle = handle.read(1) == b"\x80"  # pickle protocol marker of pre-1.6 torch.save files
    if not (is_zip or is_legacy_pickle):
        raise CheckpointError(f"{path} is not a PyTorch checkpoint file (not written by torch.save).")
    try:
        # mmap: every rank reads a full checkpoint; mapping it costs no memory until a tensor is used
        return torch.load(path, map_location="cpu", weights_only=True, mmap=is_zip)
    except pickle.UnpicklingError as err:
        raise CheckpointError(
            f"{path} holds objects that torch.load(weights_only=True) refuses to unpickle; it is not loaded because "
            f"that could run arbitrary code. Re-save it with plain tensors and containers. {_unpickler_reason(err)}"
        ) from err
    except (RuntimeError, EOFError, OSError, ValueError) as err:
        raise CheckpointError(f"{path} is not a readable PyTorch checkpoint file (torch.load failed: {err}).") from err


def _unpickler_reason(err: BaseException) -> str:
    """The one informative line of torch's long weights-only error."""
    lines = [line.strip() for line in str(err).splitlines() if "Unsupported" in line or "WeightsUnpickler" in line]
    return f"({lines[0]})" if lines else ""


class _SafeLoadPlanner(DefaultLoadPlanner):
    """DCP's default planner unpickles non-tensor entries with ``weights_only=False``; this one refuses
    anything but plain data, like every other loading path here."""

    def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
        _safe_load_bytes(self, read_item, value)


class _SafeEmptyLoadPlanner(_EmptyStateDictLoadPlanner):
    """Rebuilds the whole state dict from the metadata (consolidation), reading non-tensors safely."""

    def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
        _safe_load_bytes(self, read_item, value)


def _safe_load_bytes(planner: DefaultLoadPlanner, read_item: Any, value: io.BytesIO) -> None:
    from torch.distributed.checkpoint._traverse import set_element

    obj = torch.load(value, map_location="cpu", weights_only=True)
    if planner.flatten_state_dict:
        set_element(planner.original_state_dict, planner.mappings[read_item.dest_index.fqn], obj)
    else:
        planner.state_dict[read_item.dest_index.fqn] = obj


# ---------------------------------------------------------------------------------------------------------------------
# staging and commit


@dataclass(frozen=True)
class _SavePlan:
    """Where one save writes, decided on rank 0 and shared, so every rank writes to the same place."""

    target: str
    mode: str  #: "new" (nothing there), "update" (a sharded checkpoint there), "replace" (a file/link there)
    staging: str  #: sharded: the directory that becomes the target ("new"/"replace"); full: the temp file
    data_dir: str  #: sharded: where DCP writes
    data_name: str  #: sharded: the data directory's final name
    token: str
    error: Optional[str] = None


def _staging_leftovers(target: Path) -> list[Path]:
    """Hidden data of interrupted saves or removals of ``target`` (never loadable, safe to delete)."""
    found: list[Path] = []
    parent, prefix = target.parent, f".{target.name}"
    if parent.is_dir():
        for entry in parent.iterdir():
            if entry.name.startswith(prefix + _PARTIAL_MARK) or entry.name.startswith(prefix + _OLD_MARK):
                found.append(entry)
    if target.is_dir() and not target.is_symlink():
        try:
            current = _read_manifest(target).get("data") if (target / MANIFEST_FILE).is_file() else None
        except CheckpointError:
            current = ""  # damaged record: which data is current is unknown, so none counts as stale
        for entry in target.iterdir():
            stale_data = current != "" and _DATA_DIR_PATTERN.match(entry.name) and entry.name != current
            if entry.name.startswith(_PARTIAL_MARK) or entry.name.startswith(f".{MANIFEST_FILE}") or stale_data:
                found.append(entry)
    return sorted(found)


def _delete(path: Path) -> None:
    if path.is_symlink() or path.is_file():
        path.unlink(missing_ok=True)
    elif path.is_dir():
        shutil.rmtree(path, ignore_errors=True)


def _plan_save(target: Path, global_step: int, full: bool) -> _SavePlan:
    """Rank 0: clear what interrupted saves left, then choose the staging area for this save."""
    token = secrets.token_hex(4)
    data_name = f"state-step{global_step:09d}-{token}"
    for leftover in _staging_leftovers(target):
        log.info("Removing %s left by an interrupted checkpoint save.", leftover)
        _delete(leftover)
    staging = target.parent / f".{target.name}{_PARTIAL_MARK}{token}"
    plan = dict(target=str(target), staging=str(staging), data_dir=str(staging / data_name), data_name=data_name)
    if target.is_symlink() or target.is_file():
        mode = "replace"
    elif not target.exists():
        mode = "new"
    elif (target / MANIFEST_FILE).is_file() or not any(target.iterdir()):
        mode = "replace" if full or not (target / MANIFEST_FILE).is_file() else "update"
    else:
        return _SavePlan(
            **plan,
            mode="error",
            token=token,
            error=(
                f"Cannot save a checkpoint to {target}: it is a directory that is not a MiCS checkpoint, and "
                "overwriting it could destroy unrelated files. Nothing was written; remove it or choose another path."
            ),
        )
    if mode == "update":
        plan["data_dir"] = str(target / f"{_PARTIAL_MARK}{token}")
    if not full:
        Path(plan["data_dir"], RNG_DIR).mkdir(parents=True)
    else:
        target.parent.mkdir(parents=True, exist_ok=True)
    return _SavePlan(**plan, mode=mode, token=token)


def _agree_on_plan(
    target: Path, trainer_state: Mapping[str, Any], full: bool
) -> tuple[_SavePlan, Optional[dict[str, Any]]]:
    """Rank 0 checks the trainer state and plans the save; every rank gets the plan -- or the error,
    so that all ranks raise it together instead of waiting for rank 0 in a later collective."""
    plan: Optional[_SavePlan] = None
    safe_state: Optional[dict[str, Any]] = None
    error: Optional[str] = None
    if _rank() == 0:
        try:
            safe_state = _safe_trainer_state(trainer_state)
            plan = _plan_save(target, int(trainer_state.get("global_step", 0) or 0), full)
            error = plan.error
        except Exception as err:  # noqa: BLE001 - re-raised on every rank below
            error = f"Cannot save a checkpoint to {target}: {err}"
    plan, error = _from_rank_zero((plan, error))
    if error:
        raise CheckpointError(error)
    assert plan is not None
    return plan, safe_state


def _publish(plan: _SavePlan) -> None:
    """Rank 0, after every rank finished writing: make the staged checkpoint the one at ``target``.

    "update" switches an existing sharded checkpoint by replacing its commit record (one atomic
    ``os.replace``); "new" is one atomic rename; "replace" moves the old entry aside first (a file is
    replaced atomically by ``os.replace`` itself)."""
    target, staging = Path(plan.target), Path(plan.staging)
    if plan.mode == "update":
        return  # done by _commit_sharded: the record is what switches
    aside = target.parent / f".{target.name}{_OLD_MARK}{plan.token}"
    if plan.mode == "replace" and target.is_symlink():
        target.unlink()
    elif plan.mode == "replace" and (target.is_dir() or staging.is_dir()):
        os.rename(target, aside)
    os.replace(staging, target)
    _fsync_dir(target.parent)
    _delete(aside)


def _commit_sharded(plan: _SavePlan, manifest: dict[str, Any]) -> None:
    manifest_bytes = json.dumps(manifest, indent=2, sort_keys=True).encode()
    target = Path(plan.target)
    if plan.mode == "update":
        os.rename(plan.data_dir, target / plan.data_name)
        _fsync_dir(target)
        previous = _read_manifest(target).get("data")
        _write_durably(target / MANIFEST_FILE, manifest_bytes)  # the switch
        if previous and previous != plan.data_name:
            _delete(target / previous)
        return
    _write_durably(Path(plan.staging) / MANIFEST_FILE, manifest_bytes)
    _publish(plan)


def _read_manifest(path: Path) -> dict[str, Any]:
    try:
        record = json.loads((path / MANIFEST_FILE).read_text())
    except (OSError, ValueError) as err:
        raise CheckpointError(f"{path / MANIFEST_FILE} is unreadable or corrupt ({err}); the checkpoint is damaged.")
    if not isinstance(record, dict) or record.get("format") != SHARDED_FORMAT:
        raise CheckpointError(f"{path / MANIFEST_FILE} is not a MiCS checkpoint record.")
    if int(record.get("format_version", 0)) > FORMAT_VERSION:
        raise CheckpointError(
            f"{path} was written by a newer lightning-mics (format {record['format_version']} > {FORMAT_VERSION}); "
            "upgrade lightning-mics to load it."
        )
    return record


# ---------------------------------------------------------------------------------------------------------------------
# save


def save(
    path: PathLike,
    checkpoint: dict[str, Any],
    layout: Optional[CheckpointLayout] = None,
    full: bool = False,
) -> None:
    """Save Lightning's checkpoint dict to ``path`` atomically (a collective: call it on every rank).

    ``checkpoint["state_dict"]`` / ``["optimizer_states"]`` must come from :func:`model_state_dict` /
    :func:`optimizer_state_dict` with the same ``full``. Sharded (default): a directory, every shard
    written once. ``full``: one file written by rank 0, in Lightning's standard format."""
    target = Path(_from_rank_zero(os.path.abspath(path)))
    checkpoint = dict(checkpoint)
    model_state = checkpoint.pop("state_dict", {})
    optimizer_states = checkpoint.pop("optimizer_states", None)
    layout = layout or CheckpointLayout(_world_size(), _world_size(), _world_size())
    if full:
        _save_full(target, checkpoint, model_state, optimizer_states, layout)
    else:
        _save_sharded(target, checkpoint, model_state, optimizer_states, layout)


def _save_sharded(
    target: Path,
    trainer_state: dict[str, Any],
    model_state: dict[str, Any],
    optimizer_states: Optional[list[dict[str, Any]]],
    layout: CheckpointLayout,
) -> None:
    plan, safe_state = _agree_on_plan(target, trainer_state, full=False)
    data_dir = Path(plan.data_dir)
    payload: dict[str, Any] = {MODEL_KEY: model_state}
    if optimizer_states:
        payload[OPTIMIZERS_KEY] = {str(i): state for i, state in enumerate(optimizer_states)}
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")  # single process: intended
        dcp.save(payload, storage_writer=FileSystemWriter(data_dir))
    _write_durably(data_dir / RNG_DIR / f"rank{_rank():05d}.pt", _torch_bytes(capture_rng_state()))
    if safe_state is not None:  # rank 0
        _write_durably(data_dir / TRAINER_STATE_FILE, _torch_bytes(safe_state))
    _barrier()  # every rank's shards and RNG file are on disk
    if _rank() == 0:
        manifest = {
            "format": SHARDED_FORMAT,
            "format_version": FORMAT_VERSION,
            "data": plan.data_name,
            "layout": asdict(layout),
            "num_optimizers": len(optimizer_states or []),
            "global_step": trainer_state.get("global_step"),
            "epoch": trainer_state.get("epoch"),
            "versions": _versions(),
        }
        _commit_sharded(plan, manifest)
    _barrier()


def _save_full(
    target: Path,
    trainer_state: dict[str, Any],
    model_state: dict[str, Any],
    optimizer_states: Optional[list[dict[str, Any]]],
    layout: CheckpointLayout,
) -> None:
    rng_states: list[Any] = [None] * _world_size()
    if _distributed():
        dist.all_gather_object(rng_states, capture_rng_state())
    else:
        rng_states = [capture_rng_state()]
    plan, state = _agree_on_plan(target, trainer_state, full=True)
    if state is not None:  # rank 0
        state["state_dict"] = model_state
        if optimizer_states is not None:
            state["optimizer_states"] = optimizer_states
        state[FULL_META_KEY] = {
            "format": FULL_FORMAT,
            "format_version": FORMAT_VERSION,
            "layout": asdict(layout),
            "rng_states": rng_states,
            "versions": _versions(),
        }
        _write_durably(Path(plan.staging), _torch_bytes(state))
        _publish(plan)
    _barrier()


def _versions() -> dict[str, str]:
    import lightning

    return {"torch": str(torch.__version__), "lightning": str(lightning.__version__)}


def remove(path: PathLike) -> None:
    """Delete a checkpoint (rank 0 only). It is renamed to a hidden name first, so a removal that is
    interrupted never leaves a half-deleted directory that looks like a checkpoint."""
    if _rank() != 0:
        return
    target = Path(path)
    if target.is_symlink() or target.is_file():
        target.unlink()
    elif target.is_dir():
        aside = target.parent / f".{target.name}{_OLD_MARK}{secrets.token_hex(4)}"
        os.rename(target, aside)
        shutil.rmtree(aside)


# ---------------------------------------------------------------------------------------------------------------------
# inspect and load


def inspect_checkpoint(path: PathLike) -> CheckpointInfo:
    """Validate ``path`` as a checkpoint (sharded directory or full file) without loading tensors.

    Raises ``FileNotFoundError`` or :class:`CheckpointError` with what is wrong and what to do."""
    return _open_checkpoint(Path(path))[0]


def _open_checkpoint(path: Path) -> tuple[CheckpointInfo, Optional[dict[str, Any]]]:
    if _PARTIAL_MARK in path.name or _OLD_MARK in path.name:
        raise CheckpointError(
            f"{path} is the staging area of an interrupted (or in-progress) checkpoint save, not a checkpoint: it may "
            "be incomplete and is never loaded. Load the checkpoint it was meant to replace, or an earlier one."
        )
    if not path.exists():
        leftovers = _staging_leftovers(path)
        hint = (
            f" An interrupted save left incomplete data at {[str(p) for p in leftovers]}; it cannot be loaded."
            if leftovers
            else ""
        )
        raise FileNotFoundError(
            f"No checkpoint at {path}.{hint} Pass a checkpoint directory written by MiCSStrategy, a single-file "
            "checkpoint, or ckpt_path='last' with a ModelCheckpoint(save_last=True)."
        )
    if path.is_file():
        return _open_full(path)
    if not (path / MANIFEST_FILE).is_file():
        raise CheckpointError(_why_not_a_checkpoint(path))
    record = _read_manifest(path)
    data_dir = path / str(record.get("data"))
    missing = [name for name in (".metadata", TRAINER_STATE_FILE) if not (data_dir / name).is_file()]
    if missing:
        raise CheckpointError(
            f"{path} is incomplete: its commit record names {data_dir.name}, which lacks {missing} (files were deleted "
            "or the directory was copied partially). Load another checkpoint or copy this one again."
        )
    leftovers = _staging_leftovers(path)
    if leftovers and _rank() == 0:
        log.warning(
            "Ignoring incomplete data of an interrupted save of %s: %s. The next save to this path removes it.",
            path,
            [str(p) for p in leftovers],
        )
    layout = CheckpointLayout(**record["layout"]) if record.get("layout") else None
    info = CheckpointInfo(
        path=path,
        kind="sharded",
        layout=layout,
        num_optimizers=int(record.get("num_optimizers", 0)),
        global_step=record.get("global_step"),
        epoch=record.get("epoch"),
        data_dir=data_dir,
    )
    return info, None


def _why_not_a_checkpoint(path: Path) -> str:
    entries = [entry.name for entry in path.iterdir()]
    if any(name.startswith(_PARTIAL_MARK) or _DATA_DIR_PATTERN.match(name) for name in entries):
        return (
            f"{path} is an incomplete checkpoint: it holds checkpoint data but no commit record ({MANIFEST_FILE}), so "
            "its save never finished. It is not loaded; use an earlier checkpoint."
        )
    if ".metadata" in entries:
        return (
            f"{path} is a torch.distributed.checkpoint directory not written by MiCSStrategy (no {MANIFEST_FILE}). "
            "Load it with the tool that wrote it, or convert it: torch.distributed.checkpoint.format_utils."
            "dcp_to_torch_save gives a file you can load into the module before training."
        )
    return (
        f"{path} is a directory but not a checkpoint (no {MANIFEST_FILE}). Pass a checkpoint directory written by "
        "MiCSStrategy (e.g. <dirpath>/last.ckpt) or a single-file checkpoint."
    )


def _open_full(path: Path) -> tuple[CheckpointInfo, dict[str, Any]]:
    raw = _read_torch_file(path)
    if isinstance(raw, dict) and isinstance(raw.get("state_dict"), dict):
        meta = raw.get(FULL_META_KEY) or {}
        layout = CheckpointLayout(**meta["layout"]) if meta.get("layout") else None
        kind = "full"
        num_optimizers = len(raw.get("optimizer_states") or [])
    elif isinstance(raw, dict) and raw and all(isinstance(value, Tensor) for value in raw.values()):
        layout, kind, num_optimizers = None, "weights", 0
    else:
        raise CheckpointError(
            f"{path} is a PyTorch file but not a checkpoint: expected Lightning's checkpoint dict (with 'state_dict') "
            "or a model state dict of tensors."
        )
    info = CheckpointInfo(
        path=path,
        kind=kind,
        layout=layout,
        num_optimizers=num_optimizers,
        global_step=raw.get("global_step") if kind == "full" else None,
        epoch=raw.get("epoch") if kind == "full" else None,
    )
    return info, raw


Shapes = dict[str, Optional[tuple[int, ...]]]


def _shapes(state: Mapping[str, Any]) -> Shapes:
    return {key: tuple(value.shape) if isinstance(value, Tensor) else None for key, value in state.items()}


def _flat_optimizer_shapes(state: Mapping[str, Any]) -> Shapes:
    """``{"<param name>.<state name>": shape}`` of a name-keyed optimizer state."""
    return {
        f"{name}.{key}": tuple(value.shape) if isinstance(value, Tensor) else None
        for name, per_param in state["state"].items()
        for key, value in per_param.items()
    }


def _saved_shapes(metadata: Metadata) -> dict[tuple[str, ...], Optional[tuple[int, ...]]]:
    """Every entry of a DCP checkpoint by its path in the saved (nested) payload, with global shapes."""
    planner_data = metadata.planner_data or {}
    return {
        tuple(str(part) for part in planner_data.get(flat_key, (flat_key,))): (
            tuple(entry.size) if isinstance(entry, TensorStorageMetadata) else None
        )
        for flat_key, entry in metadata.state_dict_metadata.items()
    }


def _check_match(what: str, path: Path, expected: Shapes, saved: Shapes, strict: bool) -> set[str]:
    """Raise one error listing every missing, unexpected and mismatched-shape key; return the keys
    to load (with ``strict=False`` missing and unexpected keys are skipped, mismatched shapes never)."""
    missing = sorted(set(expected) - set(saved))
    unexpected = sorted(set(saved) - set(expected))
    mismatched = sorted(key for key in set(expected) & set(saved) if expected[key] != saved[key])
    if mismatched or (strict and (missing or unexpected)):
        lines = [f"The checkpoint at {path} does not match this {what}; nothing was loaded."]
        lines += _listing("missing in the checkpoint", missing)
        lines += _listing("unexpected in the checkpoint", unexpected)
        lines += _listing(
            "shape mismatch (checkpoint vs this model)",
            [f"{key}: {list(saved[key] or [])} vs {list(expected[key] or [])}" for key in mismatched],
        )
        fix = "Load a checkpoint of the same model and `configure_optimizers`"
        if not mismatched:
            fix += ", or set `strict_loading = False` on the LightningModule to skip missing/unexpected keys"
        lines.append(fix + ".")
        raise CheckpointError("\n".join(lines))
    return set(expected) & set(saved)


def _listing(title: str, keys: Sequence[str]) -> list[str]:
    if not keys:
        return []
    shown = ", ".join(keys[:_MAX_LISTED_KEYS])
    more = f" ... and {len(keys) - _MAX_LISTED_KEYS} more" if len(keys) > _MAX_LISTED_KEYS else ""
    return [f"  {title} ({len(keys)}): {shown}{more}"]


def load(
    path: PathLike,
    module: nn.Module,
    optimizers: Sequence[Optimizer] = (),
    strict: bool = True,
    restore_rng: bool = False,
    for_trainer: bool = False,
) -> dict[str, Any]:
    """Load a checkpoint into ``module`` (and ``optimizers``) in place; return the rest of Lightning's dict.

    Works with a sharded directory or a full file, on any layout: FSDP2-sharded modules on another
    world/partition size (call it on every rank), or a plain module in one process without
    ``torch.distributed``. Everything is validated before anything is loaded. ``restore_rng`` restores
    this rank's RNG states when the world size is the one that saved them. ``for_trainer``: the caller
    resumes Lightning's loops, so a file with bare model weights is rejected with the fix."""
    info, raw = _open_checkpoint(Path(path))
    if for_trainer and info.kind == "weights":
        raise CheckpointError(
            f"{info.path} holds bare model weights (a state dict, e.g. from `python -m lightning_mics.consolidate` "
            "without --with-optimizer), which Lightning cannot restore a run from. Load them into the module before "
            "calling the Trainer -- `lightning_mics.checkpoint.load(path, model)` or "
            "`model.load_state_dict(torch.load(path, weights_only=True))` -- or consolidate with --with-optimizer."
        )
    if optimizers and info.num_optimizers == 0:
        raise CheckpointError(
            f"{info.path} holds no optimizer state (saved with weights_only=True?), so training cannot resume from "
            "it. Use it with trainer.validate/test, or load its weights into the module before fit with "
            "`lightning_mics.checkpoint.load(path, model)` and start a new run."
        )
    if optimizers and info.num_optimizers != len(optimizers):
        raise CheckpointError(
            f"{info.path} holds the state of {info.num_optimizers} optimizer(s), this run has {len(optimizers)}: it "
            "was saved with another `configure_optimizers`."
        )
    if info.kind == "sharded":
        trainer_state = _load_sharded(info, module, optimizers, strict)
        rng_file = info.data_dir / RNG_DIR / f"rank{_rank():05d}.pt" if info.data_dir else None
        rng_state = _read_torch_file(rng_file) if restore_rng and rng_file and rng_file.is_file() else None
    else:
        assert raw is not None
        trainer_state = _load_full(info, raw, module, optimizers, strict)
        rng_states = (raw.get(FULL_META_KEY) or {}).get("rng_states") or []
        rng_state = rng_states[_rank()] if restore_rng and len(rng_states) > _rank() else None
    if restore_rng:
        saved_world = info.layout.world_size if info.layout else None
        if saved_world == _world_size() and rng_state is not None:
            restore_rng_state(rng_state)
        elif _rank() == 0:
            log.warning(
                "RNG states not restored: %s was saved by %s ranks, this run has %d. Training resumes correctly, "
                "but random draws (dropout, augmentation) differ from an uninterrupted run.",
                info.path,
                saved_world if saved_world is not None else "an unknown number of",
                _world_size(),
            )
    return trainer_state


def _load_sharded(
    info: CheckpointInfo, module: nn.Module, optimizers: Sequence[Optimizer], strict: bool
) -> dict[str, Any]:
    assert info.data_dir is not None
    saved = _saved_shapes(FileSystemReader(info.data_dir).read_metadata())
    template: dict[str, Any] = {MODEL_KEY: model_state_dict(module)}
    saved_model = {".".join(key[1:]): shape for key, shape in saved.items() if key[0] == MODEL_KEY}
    keep = _check_match("model", info.path, _shapes(template[MODEL_KEY]), saved_model, strict)
    template[MODEL_KEY] = {key: value for key, value in template[MODEL_KEY].items() if key in keep}
    if optimizers:
        template[OPTIMIZERS_KEY] = {}
        for index, optimizer in enumerate(optimizers):
            state = optimizer_state_dict(module, optimizer)
            prefix = (OPTIMIZERS_KEY, str(index), "state")
            saved_state = {".".join(key[3:]): shape for key, shape in saved.items() if key[:3] == prefix}
            _check_match(f"optimizer (#{index})", info.path, _flat_optimizer_shapes(state), saved_state, True)
            template[OPTIMIZERS_KEY][str(index)] = state
    _read_dcp(info.data_dir, template, _SafeLoadPlanner())
    set_model_state_dict(module, template[MODEL_KEY], options=StateDictOptions(strict=strict))
    for index, optimizer in enumerate(optimizers):
        set_optimizer_state_dict(module, optimizer, template[OPTIMIZERS_KEY][str(index)])
    return _read_torch_file(info.data_dir / TRAINER_STATE_FILE)


def _read_dcp(data_dir: Path, state: dict[str, Any], planner: DefaultLoadPlanner, no_dist: bool = False) -> None:
    """``dcp.load`` whose failures (reported per rank, with tracebacks) become one clear error."""
    import pickle

    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            if isinstance(planner, _EmptyStateDictLoadPlanner):
                # dcp.load copies the top-level dict, so a state dict rebuilt from the metadata would
                # be lost; the inner function (what format_utils.dcp_to_torch_save uses) fills ``state``
                _load_state_dict(state, storage_reader=FileSystemReader(data_dir), planner=planner, no_dist=True)
            else:
                no_dist = no_dist or not _distributed()
                dcp.load(state, storage_reader=FileSystemReader(data_dir), planner=planner, no_dist=no_dist)
    except CheckpointException as err:
        # each rank's failure is an exception, or (exception, stack) as DCP wraps it
        failures = [f[0] if isinstance(f, tuple) else f for f in err.failures.values()]
        causes = [failure for failure in failures if isinstance(failure, BaseException)]
        if any(isinstance(cause, pickle.UnpicklingError) for cause in causes):
            raise CheckpointError(
                f"{data_dir} holds objects that torch.load(weights_only=True) refuses to unpickle; it is not loaded "
                "because that could run arbitrary code. "
                + next(_unpickler_reason(c) for c in causes if isinstance(c, pickle.UnpicklingError))
            ) from err
        summary = "; ".join(sorted({f"{type(cause).__name__}: {cause}" for cause in causes})) or str(err)
        raise CheckpointError(f"Reading the shards in {data_dir} failed (damaged checkpoint?): {summary}") from err


def _load_full(
    info: CheckpointInfo,
    raw: dict[str, Any],
    module: nn.Module,
    optimizers: Sequence[Optimizer],
    strict: bool,
) -> dict[str, Any]:
    saved_model: dict[str, Any] = raw if info.kind == "weights" else raw["state_dict"]
    current_model = model_state_dict(module)
    keep = _check_match("model", info.path, _shapes(current_model), _shapes(saved_model), strict)
    optimizer_states = []
    for index, optimizer in enumerate(optimizers):
        current = optimizer_state_dict(module, optimizer)
        names = [list(group["params"]) for group in current["param_groups"]]
        state = _indexed_to_name_keyed(raw["optimizer_states"][index], names)
        _check_match(
            f"optimizer (#{index})", info.path, _flat_optimizer_shapes(current), _flat_optimizer_shapes(state), True
        )
        state["state"] = {
            name: {key: _shard_like(value, current["state"][name][key]) for key, value in per_param.items()}
            for name, per_param in state["state"].items()
        }
        optimizer_states.append(state)
    model_state = {key: _shard_like(saved_model[key], current_model[key]) for key in keep}
    set_model_state_dict(module, model_state, options=StateDictOptions(strict=strict))
    for optimizer, state in zip(optimizers, optimizer_states):
        set_optimizer_state_dict(module, optimizer, state)
    if info.kind == "weights":
        return {}
    return {key: value for key, value in raw.items() if key not in ("state_dict", "optimizer_states", FULL_META_KEY)}


def _shard_like(full: Any, like: Any) -> Any:
    """This rank's shard of ``full`` laid out like the DTensor ``like``. Every rank holds the full
    tensor (the file is memory-mapped), so each slices its own part: no communication at all."""
    if not isinstance(like, DTensor) or not isinstance(full, Tensor):
        return full
    return distribute_tensor(full.to(like.dtype), like.device_mesh, like.placements, src_data_rank=None)


# ---------------------------------------------------------------------------------------------------------------------
# consolidation


def read_full_state(path: PathLike) -> tuple[dict[str, Tensor], list[dict[str, Any]], dict[str, Any]]:
    """Read a sharded checkpoint into unsharded CPU tensors, in one process, without ``torch.distributed``.

    Returns the model state dict (the module's own parameter names), the optimizer states in
    ``torch.optim`` format (integer ids, with ``param_names`` per group), and Lightning's other state.
    Needs memory for one full copy of what it reads."""
    info, _ = _open_checkpoint(Path(path))
    if info.kind != "sharded":
        raise CheckpointError(
            f"{info.path} is already a single-file checkpoint; there is nothing to consolidate. Load it with "
            "torch.load(path, weights_only=True) (model weights under 'state_dict'), or pass it as ckpt_path."
        )
    assert info.data_dir is not None
    payload: dict[str, Any] = {}
    _read_dcp(info.data_dir, payload, _SafeEmptyLoadPlanner(), no_dist=True)
    optimizer_states = []
    for index in range(info.num_optimizers):
        optimizer_states.append(_name_keyed_to_indexed(payload[OPTIMIZERS_KEY][str(index)])[0])
    trainer_state = _read_torch_file(info.data_dir / TRAINER_STATE_FILE)
    return payload.get(MODEL_KEY, {}), optimizer_states, trainer_state
