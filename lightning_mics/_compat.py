"""Every private torch, Lightning and torchft API lightning-mics relies on, in one place.

Private APIs change without deprecation, so each entry says what it is for and the versions it was
checked on (torch 2.11 and 2.13, lightning 2.6; the declared floor, lightning 2.5.3, passed
``scripts/version_matrix.sh`` with torch 2.13 on 2026-11-26, and 2.5.2 failed its resume tests). When an
upgrade breaks one, this file is the only one to change. Nothing here patches torch or Lightning: these are
plain imports and accessors.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any, Optional

import torch
import torch.distributed as dist
from torch import Tensor

# DCP internals used to load safely: the planner that rebuilds a whole state dict from metadata
# (what ``format_utils.dcp_to_torch_save`` uses), the inner load that fills a dict in place, and
# the helper that writes a value at a nested path. torch >= 2.2 (checked on 2.11, 2.13).
from torch.distributed.checkpoint._traverse import set_element  # noqa: E402
from torch.distributed.checkpoint.default_planner import (  # noqa: E402
    _EmptyStateDictLoadPlanner as EmptyStateDictLoadPlanner,
)
from torch.distributed.checkpoint.state_dict_loader import _load_state_dict as load_state_dict_into  # noqa: E402

# --------------------------------------------------------------------------------------------------- torch
# FSDP2's interfaces for custom collectives (``FSDPModule.set_custom_all_gather`` /
# ``set_custom_reduce_scatter`` are public, the classes they take are not). torch >= 2.8.
from torch.distributed.fsdp._fully_shard._fsdp_api import AllGather, ReduceScatter  # noqa: E402

# Counting collectives without patching torch.distributed (``collective_recorder.CollectiveRecorder``):
# ``TorchDispatchMode`` sees every dispatcher op a thread issues while the mode is on its stack, the
# c10d collectives (``c10d::allreduce_``, ``c10d::_allgather_base_``, ...) included; it lives in a
# private module but is torch's own mechanism for this (``CommDebugMode`` uses it). Since torch 2.0.
# Its ``ignore_compile_internals`` hook (which keeps torch.compile compiling under the mode) was
# added in 2025 (pytorch#161648); a torch without it ignores the override and compiles nothing while
# recording. The c10d op names and schemas the recorder reads are the same on 2.11 and 2.13.
from torch.utils._python_dispatch import (
    TorchDispatchMode,  # noqa: E402
    _get_current_dispatch_mode_stack,  # noqa: E402
)


def dispatch_mode_stack() -> list[Any]:
    """The dispatch modes active on this thread, innermost last (torch >= 2.0). Autograd carries
    this stack into the threads it runs backward on, so it answers the same there."""
    return _get_current_dispatch_mode_stack()


def unbox_process_group(value: Any) -> dist.ProcessGroup:
    """The :class:`~torch.distributed.ProcessGroup` a c10d dispatcher op receives as an argument
    (a ``torch.ScriptObject`` wrapping it on 2.11 and 2.13; newer torch may hand over the group
    itself). ``ProcessGroup.unbox``, the inverse of ``boxed()``, is undocumented and sits beside
    ``boxed()`` (torch 2.2; checked on 2.11, 2.13)."""
    if isinstance(value, dist.ProcessGroup):
        return value
    return dist.ProcessGroup.unbox(value)


def composable_activation_checkpoint(module: Any) -> Any:
    """Hook-based (non-reentrant) activation checkpointing that keeps module names and state-dict
    keys and composes with ``fully_shard`` applied afterwards (torch >= 2.1)."""
    from torch.distributed._composable.checkpoint_activation import checkpoint

    return checkpoint(module)


def local_tensor(tensor: Tensor) -> Tensor:
    """A DTensor's local shard as the very storage of the parameter or gradient, so in-place
    writes (broadcasts, clipping, optimizer-state slices) land in it. ``DTensor.to_local()`` is an
    autograd op returning a view; this is the attribute it reads (stable since torch 2.0)."""
    return tensor._local_tensor  # type: ignore[attr-defined]


def backend_options(backend: str, timeout: Optional[timedelta]) -> Any:
    """Process-group options carrying ``timeout`` (``new_group(pg_options=...)``), or ``None`` where
    the backend has no options class. Gloo's options class and the timeout field are private
    (torch 2.11, 2.13); NCCL's class is public, its timeout field is not."""
    if timeout is None:
        return None
    if backend == "gloo" and hasattr(dist, "ProcessGroupGloo"):
        options = dist.ProcessGroupGloo._Options()
    elif backend == "nccl" and hasattr(dist, "ProcessGroupNCCL"):
        options = dist.ProcessGroupNCCL.Options()
    else:
        return None
    options._timeout = timeout
    return options


# FSDP2's post-forward (hpZ) mesh. An int ``reshard_after_forward`` makes ``fully_shard`` build a new
# DeviceMesh -- new process groups -- for every unit; lightning-mics builds it once per layout with torch's
# own helper and hands the same mesh info to every unit (lightning_mics.post_forward_mesh). The helper lives
# in ``_fsdp_init`` and FSDPParamGroup / FSDPParam hold it as ``post_forward_mesh_info`` (torch 2.4 - 2.13);
# torch 2.13 keeps a list of param groups per state, older releases a single ``_fsdp_param_group``.
try:
    from torch.distributed.fsdp._fully_shard._fsdp_init import _get_post_forward_mesh_info
except ImportError:  # pragma: no cover - a torch that moved it
    _get_post_forward_mesh_info = None  # type: ignore[assignment]


def _fsdp_internal_missing(what: str) -> RuntimeError:
    return RuntimeError(
        f"lightning-mics shares one post-forward (hpZ) mesh among FSDP units through torch's private {what}, "
        f"which torch {torch.__version__} does not have (checked on 2.11 and 2.13). Use a ShardingSpec whose "
        "params degree is 1 or equals grads (or reshard_after_forward=True/False), or a torch version from "
        "2.11 to 2.13, and report the torch version at lightning-mics."
    )


def post_forward_mesh_info(reshard_after_forward: int, mesh_info: Any) -> Any:
    """The mesh info FSDP2 reshards a unit on ``mesh_info`` to after forward, for a group of
    ``reshard_after_forward`` ranks: built as ``fully_shard`` builds it (a new 2-D DeviceMesh, i.e. new
    process groups, for an int between 1 and the shard size), so sharing it changes no arithmetic."""
    if _get_post_forward_mesh_info is None:
        raise _fsdp_internal_missing("_fsdp_init._get_post_forward_mesh_info")
    return _get_post_forward_mesh_info(reshard_after_forward, mesh_info)


def fsdp_param_groups(unit: Any) -> list[Any]:
    """The FSDPParamGroups of one ``fully_shard``-ed module (one, unless a shard placement puts
    parameters on several meshes)."""
    get_state = getattr(unit, "_get_fsdp_state", None)
    if get_state is None:
        raise _fsdp_internal_missing("FSDPModule._get_fsdp_state")
    state = get_state()
    groups = getattr(state, "_fsdp_param_groups", None)
    if groups is None:  # torch before per-parameter meshes: at most one group
        group = getattr(state, "_fsdp_param_group", None)
        groups = [] if group is None else [group]
    return list(groups)


def fsdp_unit_parameters(unit: Any) -> list[Any]:
    """The parameters one ``fully_shard``-ed module manages itself (not those of units nested in it), in
    FSDP2's order -- the order of its reduce-scatter buffer."""
    params: list[Any] = []
    for group in fsdp_param_groups(unit):
        fsdp_params = getattr(group, "fsdp_params", None)
        if fsdp_params is None:
            raise RuntimeError(
                f"lightning-mics overlaps hop 2 with backward through torch's private FSDPParamGroup.fsdp_params, "
                f"which torch {torch.__version__} does not have (checked on 2.11 and 2.13). Set "
                "MiCSStrategy(cross_replica_overlap=False), and report the torch version at lightning-mics."
            )
        params.extend(fsdp_param.sharded_param for fsdp_param in fsdp_params)
    return params


def fsdp_requires_all_reduce(unit: Any) -> bool:
    """Whether the unit's next reduction is a boundary one: what ``set_requires_all_reduce`` set (FSDP2
    keeps it per parameter group); ``True`` where torch keeps no such flag."""
    return all(getattr(group, "all_reduce_grads", True) for group in fsdp_param_groups(unit))


def set_post_forward_mesh_info(param_group: Any, mesh_info: Any) -> None:
    """Make ``param_group`` reshard to ``mesh_info`` after forward (``None``: not at all). The group and
    each of its FSDPParams hold it; each FSDPParam also derived its post-forward shard's size from it at
    init, which is recomputed here from the parameter's original size (a meta tensor: sizes only)."""
    params = getattr(param_group, "fsdp_params", None)
    if params is None or not hasattr(param_group, "post_forward_mesh_info"):
        raise _fsdp_internal_missing("FSDPParamGroup.post_forward_mesh_info / fsdp_params")
    param_group.post_forward_mesh_info = mesh_info
    for fsdp_param in params:
        init_metadata = getattr(fsdp_param, "_init_sharded_post_forward_param_metadata", None)
        if init_metadata is None or not hasattr(fsdp_param, "_orig_size"):
            raise _fsdp_internal_missing("FSDPParam._init_sharded_post_forward_param_metadata / _orig_size")
        fsdp_param.post_forward_mesh_info = mesh_info
        if mesh_info is not None:
            init_metadata(torch.empty(fsdp_param._orig_size, device="meta"))


# The staging copies of an asynchronous save (what ``dcp.async_save`` itself uses): a CPU twin of a state dict,
# pinned where CUDA is there, refilled in place while its shapes stay the same. torch 2.4 - 2.13.
from torch.distributed._state_dict_utils import (  # noqa: E402
    _check_state_dict_similarity as state_dict_similar,
)
from torch.distributed._state_dict_utils import _copy_state_dict as copy_state_dict  # noqa: E402
from torch.distributed._state_dict_utils import _create_cpu_state_dict as create_cpu_state_dict  # noqa: E402


def op_schema_arguments(op: Any) -> list[Any]:
    """The arguments of a dispatcher op's schema (``OpOverload._schema``; torch 2.0 - 2.13): the collective
    recorder finds a c10d op's process group and tensors by their names there."""
    return list(op._schema.arguments)


def module_buffers(module: Any) -> dict[str, Any]:
    """``module``'s own buffers by name, the dict itself (``nn.Module._buffers``): replacing an entry moves a
    buffer without ``module.to()`` touching the parameters. Stable since torch 1.0."""
    return module._buffers


def module_parameters(module: Any) -> dict[str, Any]:
    """``module``'s own parameters by name, the dict itself (``nn.Module._parameters``; torch 1.0 - 2.13)."""
    return module._parameters


def non_persistent_buffer_names(module: Any) -> set[str]:
    """The names of ``module``'s buffers its ``state_dict`` leaves out (``nn.Module._non_persistent_buffers_set``;
    torch 1.6 - 2.13)."""
    return getattr(module, "_non_persistent_buffers_set", set())


def gloo_all_gather_flat(group: Any, output: Tensor, message: Tensor) -> Any:
    """Gloo's flat all-gather into one tensor (``ProcessGroup._allgather_base``, what ``all_gather_into_tensor``
    calls; torch 1.12 - 2.13): one buffer, no per-rank temporaries. Returns its work."""
    from torch.distributed.distributed_c10d import AllgatherOptions

    return group._allgather_base(output, message, AllgatherOptions())


def process_group_count() -> int:
    """How many process groups this process is a member of, the default group included: torch's registry
    of live groups (``destroy_process_group`` removes them; 0 without a default group). The map is
    private (``distributed_c10d._world.pg_map``, torch 2.0 - 2.13)."""
    if not dist.is_available() or not dist.is_initialized():
        return 0
    from torch.distributed.distributed_c10d import _world

    return len(_world.pg_map)


# ----------------------------------------------------------------------------------------------- Lightning
# lightning 2.5 - 2.6: the helpers Lightning's own DDP/FSDP strategies use to start processes, move
# optimizer state and reduce across ranks; a ParallelStrategy subclass needs the same.
# Fabric (lightning 2.6): the launcher that re-runs the script once per extra local rank (what Fabric's
# DDP/FSDP strategies use), the interface ``fabric.no_backward_sync`` asks a strategy for, and the
# protocol Fabric uses to tell objects with ``state_dict``/``load_state_dict`` in ``fabric.save``
# states. Fabric's connector also sets ``strategy._num_nodes`` and calls ``strategy._set_world_ranks()``
# when present (what its FSDP strategy defines); lightning_mics.fabric provides both.
from lightning.fabric.strategies.launchers.subprocess_script import (  # noqa: E402
    _SubprocessScriptLauncher as FabricSubprocessScriptLauncher,
)
from lightning.fabric.strategies.strategy import _BackwardSyncControl as BackwardSyncControl  # noqa: E402
from lightning.fabric.utilities.distributed import (  # noqa: E402
    _distributed_is_initialized as distributed_is_initialized,
)
from lightning.fabric.utilities.distributed import (  # noqa: E402
    _get_default_process_group_backend_for_device as default_process_group_backend_for_device,
)
from lightning.fabric.utilities.distributed import _init_dist_connection as init_dist_connection  # noqa: E402
from lightning.fabric.utilities.distributed import _sync_ddp_if_available as sync_ddp_if_available  # noqa: E402
from lightning.fabric.utilities.optimizer import _optimizers_to_device as optimizers_to_device  # noqa: E402
from lightning.fabric.utilities.types import _Stateful as Stateful  # noqa: E402

# The launcher that re-runs the script once per extra local rank (what DDPStrategy uses).
from lightning.pytorch.strategies.launchers.subprocess_script import (  # noqa: E402
    _SubprocessScriptLauncher as SubprocessScriptLauncher,
)


def expose_device_mesh(module: Any, mesh: Any) -> None:
    """Make ``LightningModule.device_mesh`` return ``mesh`` inside ``configure_model()``, as
    Lightning's ModelParallelStrategy does (the property reads this private attribute; 2.4 - 2.6)."""
    module._device_mesh = mesh


# Creating an optimizer's states before its first step, as DCP's state-dict helpers do (a step with zero
# gradients and a zero learning rate): a fault-tolerant group that heals before it ever stepped needs its
# states to exist as DTensors on its mesh to copy a peer's into. torch 2.2 - 2.13.
from torch.distributed.checkpoint.state_dict import _init_optim_state as init_optimizer_state  # noqa: E402


def _optimizer_step_progress(trainer: Any) -> Any:
    """Where the Trainer counts optimizer steps (``trainer.global_step`` is its ``total.completed``): the fit
    loop's progress tracker (lightning 2.0 - 2.6)."""
    return trainer.fit_loop.epoch_loop.automatic_optimization.optim_progress.optimizer.step


def set_global_step(trainer: Any, step: int) -> None:
    """Move the Trainer's optimizer-step count (``trainer.global_step``, what ``max_steps`` and checkpoint
    names read) to ``step``: a fault-tolerant group that healed from a peer continues at the peer's step."""
    progress = _optimizer_step_progress(trainer)
    progress.total.ready = progress.total.completed = step
    trainer.fit_loop.epoch_loop._batches_that_stepped = step


def uncount_pending_optimizer_step(trainer: Any) -> None:
    """Inside the optimizer-step hook of a step that will not count: Lightning marked the step ready before the
    hook and marks it completed when the hook returns, so both marks are taken back by one here and
    ``trainer.global_step`` comes out of the step unchanged."""
    progress = _optimizer_step_progress(trainer)
    for tracker in (progress.total, progress.current):
        tracker.ready -= 1
        tracker.completed -= 1


def epoch_length(trainer: Any) -> float:
    """The training batches the Trainer runs in the current epoch (``trainer.num_training_batches``: the loader's
    length, or ``limit_train_batches``)."""
    return trainer.fit_loop.max_batches


def set_epoch_length(trainer: Any, batches: int) -> None:
    """End the Trainer's current epoch after ``batches`` training batches (counted from the epoch's start). The
    fit loop ends an epoch on either of two counts, the batches it marked ready (against ``max_batches``) and,
    for a loader with a length, the batches its data fetcher fetched (``is_last_batch``): both move, so that the
    end-of-epoch hooks, validation and checkpoints follow. A fractional ``val_check_interval`` is a fraction of
    this epoch's length, as Lightning computes it from the loader's (lightning 2.0 - 2.6)."""
    fit_loop = trainer.fit_loop
    fit_loop.max_batches = batches
    fetcher = fit_loop._data_fetcher
    if fetcher is not None and fetcher.length is not None:
        fetcher.length = batches
        fetcher.done = fetcher.fetched >= batches
        fit_loop.epoch_loop.batch_progress.is_last_batch = fetcher.done
    if isinstance(trainer.val_check_interval, float) and trainer.val_check_batch not in (None, float("inf")):
        trainer.val_check_batch = max(1, int(batches * trainer.val_check_interval))


def epoch_batches_ready(trainer: Any) -> int:
    """Training batches of the current epoch fetched so far, the current one included."""
    return int(trainer.fit_loop.epoch_loop.batch_progress.current.ready)


def set_current_epoch(trainer: Any, epoch: int) -> None:
    """Move the Trainer, in the middle of an epoch, to epoch ``epoch`` (``trainer.current_epoch``, what
    ``max_epochs``, epoch-end hooks and checkpoint names read): a fault-tolerant group that healed from a peer
    into a later epoch of the data continues in it."""
    progress = trainer.fit_loop.epoch_progress
    for tracker in (progress.total, progress.current):
        tracker.ready = tracker.started = epoch + 1
        tracker.processed = tracker.completed = epoch


def logging_step(trainer: Any) -> int:
    """The step Lightning stamps on the metrics it logs during training (batches that stepped an
    optimizer, before the current one's count is added): telemetry logs straight to the loggers with
    the same step so its rows line up with ``self.log``'s. The fit loop's counter (lightning 2.0 - 2.6)."""
    return int(trainer.fit_loop.epoch_loop._batches_that_stepped)


def unwrap_optimizer(optimizer: Any) -> Any:
    """The torch optimizer inside Lightning's ``LightningOptimizer`` / Fabric's ``_FabricOptimizer`` (their
    ``_optimizer``; lightning 2.0 - 2.6), or ``optimizer`` itself."""
    return getattr(optimizer, "_optimizer", optimizer)


def user_dataloader(loader: Any) -> Any:
    """The DataLoader inside ``fabric.setup_dataloaders``' wrapper (``_FabricDataLoader._dataloader``; lightning
    2.0 - 2.6), or ``loader`` itself."""
    return getattr(loader, "_dataloader", loader)


from lightning.fabric.wrappers import _unwrap_objects as unwrap_fabric_objects  # noqa: E402,F401


def trainer_of(module: Any) -> Any:
    """The Trainer a LightningModule is attached to, or ``None`` (``LightningModule._trainer``: the public
    ``trainer`` property raises when there is none; lightning 2.0 - 2.6)."""
    return getattr(module, "_trainer", None)


def on_before_batch_transfer(module: Any, batch: Any, dataloader_idx: int) -> Any:
    """The hook the Trainer runs on every batch before moving it to the device (the LightningModule's and its
    datamodule's ``on_before_batch_transfer``, through ``LightningModule._on_before_batch_transfer``; lightning
    2.0 - 2.6)."""
    return module._on_before_batch_transfer(batch, dataloader_idx=dataloader_idx)


def layer_sync(strategy: Any) -> Any:
    """A Trainer strategy's ``sync_batchnorm`` plugin (``Strategy._layer_sync``, set by the Trainer's
    connector; ``None`` without ``sync_batchnorm=True``; lightning 2.0 - 2.6)."""
    return strategy._layer_sync


def reset_optimizers_and_schedulers(strategy: Any) -> None:
    """Forget a Trainer strategy's optimizers and schedulers before they are created again
    (``Strategy._reset_optimizers_and_schedulers``; lightning 2.0 - 2.6)."""
    strategy._reset_optimizers_and_schedulers()


# ------------------------------------------------------------------------------------------------- torchft
# torchft 0.2.0.
TORCHFT_EXTENSION = "torchft._torchft"


def import_torchft_extension() -> None:
    """Import torchft's Rust extension (``torchft._torchft``), which reads ``RUST_LOG`` once, when imported."""
    import torchft._torchft  # noqa: F401


def quorum_id(manager: Any) -> Optional[int]:
    """The Lighthouse's number of the Manager's current quorum (``Manager._quorum_id``), ``None`` where a torchft
    version has none: it changes exactly when the membership does."""
    return getattr(manager, "_quorum_id", None)


def wrapped_process_group(group: Any) -> Any:
    """The process group under torchft's reconfigurable wrapper (``ProcessGroupWrapper._pg``), or ``None``."""
    return getattr(group, "_pg", None)


__all__ = [
    "TORCHFT_EXTENSION",
    "copy_state_dict",
    "layer_sync",
    "reset_optimizers_and_schedulers",
    "create_cpu_state_dict",
    "gloo_all_gather_flat",
    "import_torchft_extension",
    "module_buffers",
    "module_parameters",
    "non_persistent_buffer_names",
    "on_before_batch_transfer",
    "op_schema_arguments",
    "quorum_id",
    "state_dict_similar",
    "trainer_of",
    "unwrap_fabric_objects",
    "unwrap_optimizer",
    "user_dataloader",
    "wrapped_process_group",
    "AllGather",
    "BackwardSyncControl",
    "EmptyStateDictLoadPlanner",
    "FabricSubprocessScriptLauncher",
    "ReduceScatter",
    "Stateful",
    "SubprocessScriptLauncher",
    "TorchDispatchMode",
    "backend_options",
    "composable_activation_checkpoint",
    "default_process_group_backend_for_device",
    "dispatch_mode_stack",
    "distributed_is_initialized",
    "epoch_batches_ready",
    "epoch_length",
    "expose_device_mesh",
    "fsdp_param_groups",
    "fsdp_requires_all_reduce",
    "fsdp_unit_parameters",
    "init_optimizer_state",
    "init_dist_connection",
    "load_state_dict_into",
    "local_tensor",
    "logging_step",
    "optimizers_to_device",
    "post_forward_mesh_info",
    "process_group_count",
    "set_current_epoch",
    "set_element",
    "set_epoch_length",
    "set_global_step",
    "set_post_forward_mesh_info",
    "sync_ddp_if_available",
    "unbox_process_group",
]
