"""Inspecting and loading checkpoints -- all or nothing, onto any layout.

A load first reads and validates every part that is not a tensor shard (commit record, integrity
of every file, trainer state, RNG state, DCP metadata, shapes) and only then writes into the module
and the optimizer, so an error leaves them exactly as they were. DCP reads tensors into the
buffers it is given; when the files were checksum-verified first they can be the live ones, otherwise
(older checkpoints, ``verify="size"``) they are fresh buffers copied in only after every read
succeeded.

DCP stores global offsets, so :func:`load` reads the shards onto any mesh -- other world or
partition size -- or into a plain module in one process without ``torch.distributed``.
"""

from __future__ import annotations

import logging
import pickle
import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any, Optional

import torch
import torch.distributed.checkpoint as dcp
from torch import Tensor, nn
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata
from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict, set_optimizer_state_dict
from torch.distributed.tensor import DTensor, distribute_tensor
from torch.optim import Optimizer

from lightning_mics import _compat as compat
from lightning_mics.checkpoint import coordination, integrity
from lightning_mics.checkpoint.atomic import staging_leftovers
from lightning_mics.checkpoint.format import (
    DATA_DIR_PATTERN,
    FULL_META_KEY,
    MANIFEST_FILE,
    METADATA_FILE,
    MODEL_KEY,
    OLD_MARK,
    OPTIMIZERS_KEY,
    PARTIAL_MARK,
    RNG_DIR,
    TRAINER_STATE_FILE,
    CheckpointError,
    CheckpointInfo,
    CheckpointLayout,
    CommitRecord,
    PathLike,
    read_record,
)
from lightning_mics.checkpoint.rng import check_rng_state, restore_rng_state
from lightning_mics.checkpoint.safe_load import (
    SafeEmptyLoadPlanner,
    SafeFileSystemReader,
    SafeLoadPlanner,
    read_metadata,
    read_torch_file,
    unpickler_reason,
)
from lightning_mics.checkpoint.state_dicts import (
    MAX_LISTED_KEYS,
    indexed_to_name_keyed,
    model_state_dict,
    name_keyed_to_indexed,
    optimizer_state_dict,
    outside_inference_mode,
)

log = logging.getLogger(__name__)

Shapes = dict[str, Optional[tuple[int, ...]]]


def inspect_checkpoint(path: PathLike) -> CheckpointInfo:
    """Validate ``path`` as a checkpoint (sharded directory or full file) without loading tensors.

    Raises ``FileNotFoundError`` or :class:`CheckpointError` with what is wrong and what to do."""
    return open_checkpoint(Path(path))[0]


def open_checkpoint(path: Path) -> tuple[CheckpointInfo, Optional[dict[str, Any]]]:
    """The checkpoint at ``path`` (a full file is read, memory-mapped); a sharded one's record validated."""
    if PARTIAL_MARK in path.name or OLD_MARK in path.name:
        raise CheckpointError(
            f"{path} is the staging area of an interrupted (or in-progress) checkpoint save, not a checkpoint: it may "
            "be incomplete and is never loaded. Load the checkpoint it was meant to replace, or an earlier one."
        )
    if not path.exists():
        leftovers = staging_leftovers(path)
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
    record = read_record(path)
    data_dir = path / record.data
    if data_dir.is_symlink() or not data_dir.is_dir():
        raise CheckpointError(
            f"{path} is damaged: its commit record names {record.data}, which is "
            + ("a symbolic link" if data_dir.is_symlink() else "missing")
            + ". Load another checkpoint or copy this one again."
        )
    missing = [name for name in (METADATA_FILE, TRAINER_STATE_FILE) if not (data_dir / name).is_file()]
    if missing:
        raise CheckpointError(
            f"The checkpoint {path} is damaged; nothing was loaded:\n  "
            + "\n  ".join(f"{data_dir / name}: missing" for name in missing)
            + "\nFiles were deleted or the directory was copied partially: load another checkpoint (pass another "
            "ckpt_path=), or copy this one again."
        )
    leftovers = [p for p in staging_leftovers(path) if not DATA_DIR_PATTERN.match(p.name)]  # not superseded data
    if leftovers and coordination.rank() == 0:
        log.warning(
            "Ignoring incomplete data of an interrupted save of %s: %s. The next save to this path removes it.",
            path,
            [str(p) for p in leftovers],
        )
    info = CheckpointInfo(
        path=path,
        kind="sharded",
        layout=record.layout,
        num_optimizers=record.num_optimizers,
        global_step=record.global_step,
        epoch=record.epoch,
        data_dir=data_dir,
        record=record,
    )
    return info, None


def _why_not_a_checkpoint(path: Path) -> str:
    entries = [entry.name for entry in path.iterdir()]
    if any(name.startswith(PARTIAL_MARK) or DATA_DIR_PATTERN.match(name) for name in entries):
        return (
            f"{path} is an incomplete checkpoint: it holds checkpoint data but no commit record ({MANIFEST_FILE}), so "
            "its save never finished. It is not loaded; use an earlier checkpoint."
        )
    if METADATA_FILE in entries:
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
    raw = read_torch_file(path)
    if isinstance(raw, dict) and isinstance(raw.get("state_dict"), dict):
        meta = raw.get(FULL_META_KEY) or {}
        layout = CheckpointLayout(**meta["layout"]) if isinstance(meta, dict) and meta.get("layout") else None
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


def _shapes(state: Mapping[str, Any]) -> Shapes:
    return {key: tuple(value.shape) if isinstance(value, Tensor) else None for key, value in state.items()}


def _flat_optimizer_shapes(state: Mapping[str, Any]) -> Shapes:
    """``{"<param name>.<state name>": shape}`` of a name-keyed optimizer state."""
    return {
        f"{name}.{key}": tuple(value.shape) if isinstance(value, Tensor) else None
        for name, per_param in state.get("state", {}).items()
        for key, value in per_param.items()
    }


def saved_shapes(metadata: Metadata) -> dict[tuple[str, ...], Optional[tuple[int, ...]]]:
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
    shown = ", ".join(keys[:MAX_LISTED_KEYS])
    more = f" ... and {len(keys) - MAX_LISTED_KEYS} more" if len(keys) > MAX_LISTED_KEYS else ""
    return [f"  {title} ({len(keys)}): {shown}{more}"]


def load(
    path: PathLike,
    module: nn.Module,
    optimizers: Sequence[Optimizer] = (),
    strict: bool = True,
    restore_rng: bool = False,
    for_trainer: bool = False,
    verify: integrity.VerifyMode = "checksum",
    check_state: Optional[Callable[[Mapping[str, Any]], None]] = None,
) -> dict[str, Any]:
    """Load a checkpoint into ``module`` (and ``optimizers``) in place; return the rest of Lightning's dict.

    Works with a sharded directory or a full file, on any layout: FSDP2-sharded modules on another
    world/partition size (call it on every rank), or a plain module in one process without
    ``torch.distributed``. Everything is validated before anything is loaded, and a failure leaves
    ``module`` and ``optimizers`` as they were. ``verify`` checks a sharded checkpoint's files
    against its integrity record first: ``"checksum"`` (default), ``"size"`` (no reading: for very
    large checkpoints) or ``"none"``. ``restore_rng`` restores this rank's RNG states when the world
    size is the one that saved them. ``for_trainer``: the caller resumes Lightning's loops, so a
    file with bare model weights is rejected with the fix. ``check_state`` is called with the
    checkpoint's other (non-tensor) state once it is read and before anything is loaded: an exception
    from it refuses the load with nothing changed (the Fabric strategy checks requested keys there).

    Runs outside inference mode whatever the caller's (``with torch.inference_mode():
    trainer.test(model, ckpt_path=...)``): see :func:`.state_dicts.outside_inference_mode`."""
    with outside_inference_mode():
        return _load(path, module, optimizers, strict, restore_rng, for_trainer, verify, check_state)


def _load(
    path: PathLike,
    module: nn.Module,
    optimizers: Sequence[Optimizer],
    strict: bool,
    restore_rng: bool,
    for_trainer: bool,
    verify: integrity.VerifyMode,
    check_state: Optional[Callable[[Mapping[str, Any]], None]],
) -> dict[str, Any]:
    integrity.check_verify_mode(verify)
    info, raw = open_checkpoint(Path(path))
    if info.kind == "sharded":
        info = _same_generation_on_every_rank(info)
    _check_usable(info, optimizers, for_trainer)
    saved_world = info.layout.world_size if info.layout else None
    want_rng = restore_rng and saved_world == coordination.world_size()
    if info.kind == "sharded":
        assert info.data_dir is not None and info.record is not None
        integrity.verify(info.path, info.data_dir, info.record.files, verify)
        trainer_state = read_torch_file(info.data_dir / TRAINER_STATE_FILE, mmap=False)
        if not isinstance(trainer_state, dict):
            raise CheckpointError(f"{info.data_dir / TRAINER_STATE_FILE} is not Lightning's state dict; it is damaged.")
        rng_state = (
            _read_rng_file(info.data_dir / RNG_DIR / integrity.rng_file_name(coordination.rank())) if want_rng else None
        )
        if check_state is not None:
            check_state(trainer_state)
        verified = verify == "checksum" and info.record.files is not None
        _load_sharded(info, module, optimizers, strict, fresh_buffers=not verified)
    else:
        assert raw is not None
        rng_states = (raw.get(FULL_META_KEY) or {}).get("rng_states") or []
        rng_state = rng_states[coordination.rank()] if want_rng and len(rng_states) > coordination.rank() else None
        if rng_state is not None and not check_rng_state(rng_state):
            raise CheckpointError(f"{info.path} holds damaged RNG states; nothing was loaded.")
        if check_state is not None:
            check_state(_other_state(info, raw))
        trainer_state = _load_full(info, raw, module, optimizers, strict)
    if want_rng and rng_state is not None:
        restore_rng_state(rng_state)
    elif restore_rng and coordination.rank() == 0:
        _warn_rng_not_restored(info, saved_world)
    return trainer_state


def _same_generation_on_every_rank(info: CheckpointInfo) -> CheckpointInfo:
    """``info`` with the commit record rank 0 read. Each rank reads the record itself, and a save can switch it
    between two ranks' reads -- a live fault-tolerant group saving ``last`` while a restarted group loads it, an
    evaluation job loading what training is saving: the ranks would then read the shards of two generations,
    each consistent alone, mixed without an error. A collective, as the sharded read after it is."""
    assert info.record is not None
    if not coordination.distributed():
        return info
    names = coordination.everyones(info.record.data)
    if all(name == names[0] for name in names):
        return info
    record: CommitRecord = coordination.from_rank_zero(info.record)
    if coordination.rank() == 0:
        log.info(
            "The ranks read different commit records of %s (a save switched it meanwhile: %s): every rank loads "
            "rank 0's, %s.", info.path, sorted(set(names)), record.data,
        )
    return replace(info, data_dir=info.path / record.data, record=record, layout=record.layout,
                   num_optimizers=record.num_optimizers, global_step=record.global_step, epoch=record.epoch)


def _check_usable(info: CheckpointInfo, optimizers: Sequence[Optimizer], for_trainer: bool) -> None:
    """Refuse, before anything is read, a checkpoint that cannot do what the caller asks: resume Lightning's
    loops from bare weights, or resume optimizers it holds no (or another number of) states for."""
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


def _warn_rng_not_restored(info: CheckpointInfo, saved_world: Optional[int]) -> None:
    log.warning(
        "RNG states not restored: %s was saved by %s ranks, this run has %d. Training resumes correctly, "
        "but random draws (dropout, augmentation) differ from an uninterrupted run.",
        info.path,
        saved_world if saved_world is not None else "an unknown number of",
        coordination.world_size(),
    )


def _read_rng_file(path: Path) -> Optional[dict[str, Any]]:
    if not path.is_file():
        return None  # a rank that did not exist when saving: handled like another world size
    state = read_torch_file(path, mmap=False)
    if not check_rng_state(state):
        raise CheckpointError(f"{path} is not an RNG state file; the checkpoint is damaged. Nothing was loaded.")
    return state


def _load_sharded(
    info: CheckpointInfo, module: nn.Module, optimizers: Sequence[Optimizer], strict: bool, fresh_buffers: bool
) -> None:
    assert info.data_dir is not None
    saved = saved_shapes(read_metadata(info.data_dir / METADATA_FILE))
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
    if fresh_buffers:
        template = fresh_like(template)
    read_dcp(info.data_dir, template, SafeLoadPlanner())
    set_model_state_dict(module, template[MODEL_KEY], options=StateDictOptions(strict=strict))
    for index, optimizer in enumerate(optimizers):
        set_optimizer_state_dict(module, optimizer, template[OPTIMIZERS_KEY][str(index)])


def fresh_like(tree: Any) -> Any:
    """``tree`` with every tensor replaced by an uninitialised one of the same kind (a DTensor keeps
    its mesh and placements), so a read that fails midway leaves the live tensors untouched."""
    if isinstance(tree, Tensor):
        return torch.empty_like(tree)
    if isinstance(tree, dict):
        return {key: fresh_like(value) for key, value in tree.items()}
    if isinstance(tree, (list, tuple)):
        return type(tree)(fresh_like(value) for value in tree)
    return tree


def read_dcp(data_dir: Path, state: dict[str, Any], planner: DefaultLoadPlanner, no_dist: bool = False) -> None:
    """``dcp.load`` through the safe reader, its failures (reported per rank, with tracebacks) made
    one clear error."""
    reader = SafeFileSystemReader(data_dir)
    # Read (and so vet) the metadata ourselves first: torch 2.11's DCP swallows a failing
    # read_metadata and reports only "metadata is None", losing why the checkpoint was refused.
    reader.read_metadata()
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            if isinstance(planner, SafeEmptyLoadPlanner):
                # dcp.load copies the top-level dict, so a state dict rebuilt from the metadata would
                # be lost; the inner function (what format_utils.dcp_to_torch_save uses) fills ``state``
                compat.load_state_dict_into(state, storage_reader=reader, planner=planner, no_dist=True)
            else:
                no_dist = no_dist or not coordination.distributed()
                dcp.load(state, storage_reader=reader, planner=planner, no_dist=no_dist)
    except CheckpointException as err:
        # each rank's failure is an exception, or (exception, stack) as DCP wraps it
        failures = [f[0] if isinstance(f, tuple) else f for f in err.failures.values()]
        causes = [failure for failure in failures if isinstance(failure, BaseException)]
        for cause in causes:
            if isinstance(cause, CheckpointError):
                raise CheckpointError(str(cause)) from err
        if any(isinstance(cause, pickle.UnpicklingError) for cause in causes):
            raise CheckpointError(
                f"{data_dir} holds objects that torch.load(weights_only=True) refuses to unpickle; it is not loaded "
                "because that could run arbitrary code. "
                + next(unpickler_reason(c) for c in causes if isinstance(c, pickle.UnpicklingError))
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
        state = indexed_to_name_keyed(raw["optimizer_states"][index], names)
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
    return _other_state(info, raw)


def _other_state(info: CheckpointInfo, raw: Mapping[str, Any]) -> dict[str, Any]:
    """A full file's state other than the model, the optimizers and our metadata (none for bare weights)."""
    if info.kind == "weights":
        return {}
    return {key: value for key, value in raw.items() if key not in ("state_dict", "optimizer_states", FULL_META_KEY)}


def _shard_like(full: Any, like: Any) -> Any:
    """This rank's shard of ``full`` laid out like the DTensor ``like``. Every rank holds the full
    tensor (the file is memory-mapped), so each slices its own part: no communication at all."""
    if not isinstance(like, DTensor) or not isinstance(full, Tensor):
        return full
    return distribute_tensor(full.to(like.dtype), like.device_mesh, like.placements, src_data_rank=None)


def read_full_state(
    path: PathLike, verify: integrity.VerifyMode = "checksum"
) -> tuple[dict[str, Tensor], list[dict[str, Any]], dict[str, Any]]:
    """Read a sharded checkpoint into unsharded CPU tensors, in one process, without ``torch.distributed``.

    Returns the model state dict (the module's own parameter names), the optimizer states in
    ``torch.optim`` format (integer ids, with ``param_names`` per group), and Lightning's other state.
    Needs memory for one full copy of what it reads."""
    integrity.check_verify_mode(verify)
    info, _ = open_checkpoint(Path(path))
    if info.kind != "sharded":
        raise CheckpointError(
            f"{info.path} is already a single-file checkpoint; there is nothing to consolidate. Load it with "
            "torch.load(path, weights_only=True) (model weights under 'state_dict'), or pass it as ckpt_path."
        )
    assert info.data_dir is not None and info.record is not None
    integrity.verify(info.path, info.data_dir, info.record.files, verify, collective=False)
    trainer_state = read_torch_file(info.data_dir / TRAINER_STATE_FILE, mmap=False)
    payload: dict[str, Any] = {}
    read_dcp(info.data_dir, payload, SafeEmptyLoadPlanner(), no_dist=True)
    optimizer_states = []
    for index in range(info.num_optimizers):
        optimizer_states.append(name_keyed_to_indexed(payload[OPTIMIZERS_KEY][str(index)])[0])
    return payload.get(MODEL_KEY, {}), optimizer_states, trainer_state
