"""Which modules become FSDP2 units, and applying ``fully_shard`` to them on the MiCS mesh.

Each wrapped module is one all-gather / reduce-scatter unit: its parameters are gathered together
just before its forward and freed after, so peak memory holds one unit unsharded at a time. Too few
units waste memory; too many send many small messages. Repeated blocks (the children of an
``nn.ModuleList``, e.g. transformer layers) are the natural unit, and that is the default policy.
"""

from __future__ import annotations

import inspect
import itertools
import logging
from collections.abc import Callable, Iterable, Iterator
from typing import Any, Union

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor

from lightning_mics import _compat as compat

log = logging.getLogger(__name__)

#: A callable ``(module_name, module) -> bool`` that says whether to wrap ``module``.
WrapPredicate = Callable[[str, nn.Module], bool]
#: What users may pass as ``auto_wrap_policy``: ``None`` (default: ModuleList children),
#: module classes, a callable predicate, or ``False``/empty to wrap only the root.
AutoWrapPolicy = Union[None, bool, type[nn.Module], Iterable[type[nn.Module]], WrapPredicate]


def wrap_module_list_children(name: str, module: nn.Module, parent: nn.Module | None = None) -> bool:
    """Default predicate: wrap every child of an ``nn.ModuleList`` that owns parameters."""
    return isinstance(parent, nn.ModuleList) and any(True for _ in module.parameters())


def make_wrap_predicate(policy: AutoWrapPolicy) -> Callable[[str, nn.Module, nn.Module | None], bool]:
    """Normalise the user's ``auto_wrap_policy`` into ``predicate(name, module, parent)``.

    Raises:
        TypeError: when the policy is not one of the accepted forms.
    """
    if policy is None or policy is True:
        return wrap_module_list_children
    if policy is False:
        return lambda name, module, parent: False
    if isinstance(policy, type) and issubclass(policy, nn.Module):
        policy = (policy,)
    if isinstance(policy, (list, tuple, set, frozenset)):
        classes = tuple(policy)
        bad = [c for c in classes if not (isinstance(c, type) and issubclass(c, nn.Module))]
        if bad:
            raise TypeError(f"auto_wrap_policy entries must be nn.Module subclasses, got {bad!r}.")
        return lambda name, module, parent: isinstance(module, classes)
    if callable(policy):
        _check_predicate_signature(policy)
        user_predicate = policy
        return lambda name, module, parent: bool(user_predicate(name, module))
    raise TypeError(
        f"auto_wrap_policy={policy!r} is not supported. Pass None (wrap nn.ModuleList children), a module class or "
        "a list of module classes, a callable (name, module) -> bool, or False (wrap only the root)."
    )


def _check_predicate_signature(policy: Callable[..., Any]) -> None:
    """A policy callable is called as ``policy(name, module)``: refuse one that cannot be, now,
    rather than with a TypeError from deep inside the model setup."""
    try:
        signature = inspect.signature(policy)
    except (TypeError, ValueError):  # builtins without a signature: nothing to check
        return
    try:
        signature.bind("blocks.0", nn.Module())
    except TypeError:
        raise TypeError(
            f"auto_wrap_policy callable {getattr(policy, '__name__', policy)!r}{signature} cannot be called as "
            "policy(name, module): it must take the module's qualified name and the module and return True to wrap "
            "it, e.g. `lambda name, module: isinstance(module, Block)`."
        ) from None


def check_reshard_group(reshard_after_forward: bool | int, partition_size: int) -> None:
    """An int ``reshard_after_forward`` is the group parameters are resharded to after forward:
    FSDP2 needs it to divide the partition (shard) size."""
    if isinstance(reshard_after_forward, bool):
        return
    if partition_size % reshard_after_forward:
        divisors = [d for d in range(1, partition_size + 1) if partition_size % d == 0]
        raise ValueError(
            f"reshard_after_forward={reshard_after_forward} is not a group size that divides the partition size "
            f"{partition_size}. Use True (reshard to the whole partition), False (keep parameters gathered), or one of "
            f"{divisors}."
        )


def select_modules_to_wrap(root: nn.Module, policy: AutoWrapPolicy) -> list[tuple[str, nn.Module]]:
    """Pick the modules to wrap, children before parents (FSDP2 must be applied bottom-up).

    A candidate is skipped, with a log line, when it shares a parameter with modules outside it
    (tied weights such as an embedding reused as the output head): a shared parameter must live in
    the unit of the common ancestor, or one side would see a sharded tensor.
    """
    predicate = make_wrap_predicate(policy)
    parents: dict[str, nn.Module | None] = {"": None}
    for name, module in root.named_modules():
        for child_name, _ in module.named_children():
            parents[f"{name}.{child_name}" if name else child_name] = module

    owners: dict[int, set[str]] = {}
    for module_name, module in root.named_modules(remove_duplicate=False):
        for param in module.parameters(recurse=False):
            owners.setdefault(id(param), set()).add(module_name)

    chosen: list[tuple[str, nn.Module]] = []
    for name, module in root.named_modules():
        if module is root or not predicate(name, module, parents.get(name)):
            continue
        prefix = name + "."
        tied = [
            pid
            for pid in {id(p) for p in module.parameters()}
            if any(owner != name and not owner.startswith(prefix) for owner in owners[pid])
        ]
        if tied:
            log.info("not wrapping %s separately: it shares parameters with modules outside it (tied weights)", name)
            continue
        chosen.append((name, module))
    # named_modules() is pre-order (parents first); FSDP2 wants children first.
    return list(reversed(chosen))


def select_modules_to_checkpoint(
    root: nn.Module, policy: AutoWrapPolicy, wrapped: list[tuple[str, nn.Module]]
) -> list[tuple[str, nn.Module]]:
    """Modules whose activations are recomputed in backward. ``True``: every wrapped block;
    ``None``/``False``: none; classes or a callable: as for ``auto_wrap_policy``."""
    if policy is None or policy is False:
        return []
    if policy is True:
        return list(wrapped)
    predicate = make_wrap_predicate(policy)
    return [(name, m) for name, m in root.named_modules() if m is not root and predicate(name, m, None)]


def apply_activation_checkpointing(modules: list[tuple[str, nn.Module]]) -> None:
    """Recompute each module's forward in backward instead of storing its activations.

    Uses the composable (hook-based, non-reentrant) checkpoint, which leaves module names and
    state-dict keys unchanged and composes with ``fully_shard`` applied afterwards.
    """
    for _, module in modules:
        compat.composable_activation_checkpoint(module)


def set_explicit_prefetch(blocks: list[FSDPModule], depth: int) -> None:
    """Let each block's all-gather start ``depth`` blocks early, forward and backward, so that
    communication overlaps the previous blocks' compute. ``blocks`` are in forward order."""
    if depth < 1:
        return
    for i, block in enumerate(blocks):
        following = blocks[i + 1 : i + 1 + depth]
        preceding = list(reversed(blocks[max(0, i - depth) : i]))
        if following:
            block.set_modules_to_forward_prefetch(following)
        if preceding:
            block.set_modules_to_backward_prefetch(preceding)


def shard_model(
    root: nn.Module,
    mesh: DeviceMesh,
    policy: AutoWrapPolicy = None,
    reshard_after_forward: bool | int = True,
    mp_policy: MixedPrecisionPolicy | None = None,
    force_sum_reduction: bool = False,
    activation_checkpointing: AutoWrapPolicy = None,
    compile_blocks: bool = False,
    prefetch_depth: int = 0,
) -> list[FSDPModule]:
    """Apply ``fully_shard`` to the selected blocks and then to ``root``; return all FSDP units
    (blocks in forward order, then the root).

    Before sharding, blocks may get activation checkpointing and ``torch.compile`` (in place, so
    parameter names do not change); after sharding, explicit prefetching between blocks.

    ``root`` itself is never resharded after forward (its parameters are needed again at once in
    backward), which is also FSDP2's own default for the root.

    ``force_sum_reduction`` makes FSDP use only SUM reductions with explicit division, which gloo
    needs (it implements neither ``AVG`` nor ``PREMUL_SUM``).
    """
    mp_policy = mp_policy or MixedPrecisionPolicy()
    wrapped = select_modules_to_wrap(root, policy)  # children first
    apply_activation_checkpointing(select_modules_to_checkpoint(root, activation_checkpointing, wrapped))
    blocks: list[FSDPModule] = []
    for _, module in wrapped:
        if compile_blocks:
            module.compile()
        fully_shard(module, mesh=mesh, reshard_after_forward=reshard_after_forward, mp_policy=mp_policy)
        blocks.append(module)  # type: ignore[arg-type]
    fully_shard(root, mesh=mesh, reshard_after_forward=False, mp_policy=mp_policy)
    blocks.reverse()  # forward (pre-)order
    set_explicit_prefetch(blocks, prefetch_depth)
    units = [*blocks, root]
    for unit in units:
        unit.set_force_sum_reduction_for_comms(force_sum_reduction)  # type: ignore[union-attr]
    log.debug("sharded %d FSDP units", len(units))
    return units  # type: ignore[return-value]


def _unique_states(module: nn.Module) -> Iterator[Tensor]:
    """Parameters and buffers, each once (tied weights are one tensor)."""
    seen: set[int] = set()
    for tensor in itertools.chain(module.parameters(), module.buffers()):
        if id(tensor) not in seen:
            seen.add(id(tensor))
            yield tensor


def has_meta_tensors(module: nn.Module) -> bool:
    return any(t.is_meta for t in _unique_states(module))


def materialize_meta_module(module: nn.Module, device: torch.device) -> None:
    """Allocate a meta-device module's (already sharded) storage on ``device`` and initialise it.

    Called after ``fully_shard`` so that each rank only allocates its shard. Every submodule that
    defines ``reset_parameters`` re-initialises its own parameters, which is how PyTorch modules
    (and the models in this project) define their initial values.
    """
    module.to_empty(device=device)
    missing = []
    for name, submodule in module.named_modules():
        owns_state = any(True for _ in submodule.parameters(recurse=False)) or any(
            True for _ in submodule.buffers(recurse=False)
        )
        if not owns_state:
            continue
        reset = getattr(submodule, "reset_parameters", None)
        if callable(reset):
            with torch.no_grad():
                reset()
        else:
            missing.append(name or type(submodule).__name__)
    if missing:
        raise TypeError(
            "The model was created on the meta device, but these modules own parameters or buffers and define no "
            f"`reset_parameters()` to initialise them after sharding: {missing}. Add a `reset_parameters()` method to "
            "them, or create the model without `empty_init=True`/meta device."
        )


# ---------------------------------------------------------------------------------------------
# Starting every rank from the same model
# ---------------------------------------------------------------------------------------------


@torch.no_grad()
def broadcast_module_states(module: nn.Module, src: int = 0, device: torch.device | None = None) -> None:
    """Give every rank global rank ``src``'s parameters and buffers, as DDP does when it wraps a model.

    ``fully_shard`` keeps each rank's slice of *its own* copy, so without this a rank that seeded
    differently (or loaded pretrained weights that others did not) would contribute a different
    model's slice -- and replicas of a shard would differ for the whole run. Called before
    sharding, collectively. Meta tensors have no values yet and are skipped (see
    :func:`broadcast_shards_across_replicas`). ``device``: where the collective needs the data
    (the GPU for NCCL); tensors elsewhere travel through a staging copy, one at a time."""
    for tensor in _unique_states(module):
        if tensor.is_meta:
            continue
        target = tensor.data
        if (device is not None and target.device != device) or not target.is_contiguous():
            staged = target.to(device or target.device).contiguous()
            dist.broadcast(staged, src)
            target.copy_(staged)
        else:
            dist.broadcast(target, src)


@torch.no_grad()
def broadcast_shards_across_replicas(module: nn.Module, replica_group: dist.ProcessGroup | None) -> None:
    """After meta-device materialisation: every replica of a shard takes the first replica's values,
    and unsharded buffers take global rank 0's. Each rank initialised only its own shard, from its
    own random state, so replicas agree only if every rank's RNG did; this makes them agree anyway.
    Collective over the world (buffers) and ``replica_group`` (shards; ``None``: no replicas)."""
    for tensor in _unique_states(module):
        if isinstance(tensor, DTensor):
            if replica_group is not None:
                dist.broadcast(compat.local_tensor(tensor), dist.get_global_rank(replica_group, 0), group=replica_group)
        else:
            dist.broadcast(tensor.data, 0)
