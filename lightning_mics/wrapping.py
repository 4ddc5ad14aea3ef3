"""Which modules become FSDP2 units, and applying ``fully_shard`` to them on the MiCS mesh.

Each wrapped module is one all-gather / reduce-scatter unit: its parameters are gathered together
just before its forward and freed after, so peak memory holds one unit unsharded at a time. Too few
units waste memory and leave nothing to overlap; too many send many small messages.

The default policy (``auto_wrap_policy=None``) must work for every model, so it tries, in order
(see :func:`plan_wrapping`):

1. repeated blocks: the children of every ``nn.ModuleList`` (e.g. transformer layers), plus every
   module whose class name a Hugging Face style ``_no_split_modules`` attribute lists -- the
   classes Hugging Face, accelerate and FSDP users treat as "one layer";
2. when neither finds anything (CNNs built from ``nn.Sequential`` stages, plain MLPs), a size
   rule: the largest modules that still split the model into several units.
"""

from __future__ import annotations

import itertools
import logging
import weakref
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor

from lightning_mics import _compat as compat
from lightning_mics.post_forward_mesh import PostForwardMeshes, shard_with_shared_post_forward_mesh
from lightning_mics.wrap_policy import AutoWrapPolicy, make_wrap_predicate, wrap_module_list_children

log = logging.getLogger(__name__)


class RootUnit(nn.Module):
    """The FSDP2 root unit around a LightningModule.

    Lightning calls ``training_step`` rather than ``forward``; routing the call through this
    wrapper's ``forward`` (Lightning's forward redirection) makes FSDP2's root hooks run, which
    unshard the parameters owned directly by the LightningModule and drive the backward hooks.
    """

    def __init__(self, module: nn.Module) -> None:
        super().__init__()
        self.module = module

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.module(*args, **kwargs)


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


#: Names of the rules, as the layout line prints them (``... by nn.ModuleList children``).
MODULE_LIST_RULE = "nn.ModuleList children"
NO_SPLIT_RULE = "_no_split_modules"
SIZE_RULE = "size"
EXPLICIT_RULE = "auto_wrap_policy"

#: The size rule looks for the coarsest split into at least this many units: enough for each
#: unit's all-gather to hide behind its neighbour's compute and for peak memory to hold a small
#: part of the model. Measured on resnet18's shape (11.7M parameters): 8 gives 10 units whose
#: largest is a single 512-channel convolution (2.4M, 20%, the smallest a unit can get there);
#: asking for more only cuts the small early stages finer (more, smaller messages, same peak);
#: asking for 4 gives 7 units, the largest a whole residual block holding 31% of the model.
SIZE_RULE_MIN_UNITS = 8
#: Under the size rule a module becomes a unit only if it holds at least ``1/SIZE_RULE_SPREAD`` of
#: the largest unit's budget: a lone BatchNorm or stem convolution is not worth a collective of
#: its own and stays with the root.
SIZE_RULE_SPREAD = 8


@dataclass(frozen=True)
class WrapPlan:
    """The modules of ``root`` that become FSDP units (children before parents, as ``fully_shard``
    must be applied bottom-up) and the rule that chose each; the root is always a unit too."""

    root: nn.Module
    modules: tuple[tuple[str, nn.Module], ...]
    #: for each entry of ``modules``, the rule that chose it (``MODULE_LIST_RULE``, ...)
    rules: tuple[str, ...]
    #: size rule only: the parameter counts of the smallest and largest module it wrapped
    size_range: tuple[int, int] | None = None

    @property
    def num_units(self) -> int:
        return len(self.modules) + 1

    def summary(self) -> str:
        """``"2 x GPT2Block by nn.ModuleList children, root"``: how many units of which classes, and why."""
        groups: dict[str, Counter[str]] = {}
        for (_, module), rule in zip(self.modules, self.rules):
            groups.setdefault(rule, Counter())[_class_name(module)] += 1
        parts = []
        for rule, classes in groups.items():
            counts = " + ".join(f"{n} x {name}" for name, n in sorted(classes.items(), key=lambda kv: (-kv[1], kv[0])))
            if rule == SIZE_RULE and self.size_range is not None:
                low, high = map(_short_count, self.size_range)
                rule = f"size, {low if low == high else f'{low}-{high}'} params each"
            parts.append(f"{counts} by {rule}")
        return ", ".join([*parts, "root"])


def _class_name(module: nn.Module) -> str:
    """The module's own class name, also once ``fully_shard`` has swapped its class for ``FSDP<Name>``."""
    return next(c for c in type(module).__mro__ if not issubclass(c, FSDPModule)).__name__


def _short_count(n: int) -> str:
    """1234567 -> "1.2M": parameter counts as people say them."""
    for factor, suffix in ((1e9, "B"), (1e6, "M"), (1e3, "K")):
        if n >= factor:
            return f"{n / factor:.3g}{suffix}"
    return str(n)


def select_modules_to_wrap(root: nn.Module, policy: AutoWrapPolicy) -> list[tuple[str, nn.Module]]:
    """The modules :func:`plan_wrapping` wraps, children before parents."""
    return list(plan_wrapping(root, policy).modules)


def plan_wrapping(root: nn.Module, policy: AutoWrapPolicy) -> WrapPlan:
    """Pick the modules to wrap, children before parents (FSDP2 must be applied bottom-up).

    An explicit ``policy`` (classes, a callable, ``False``) is applied as given. The default
    (``None``/``True``) wraps the children of every ``nn.ModuleList`` and every module whose class
    name is listed in a ``_no_split_modules`` attribute of any module of the model (Hugging Face's
    declaration of its layer classes, read by duck typing, without importing transformers); a module
    that would own no parameters of its own, all of them being in units nested in it, is dropped.
    Only when these find nothing does the size rule (:func:`_size_rule_modules`) apply.

    Under every policy a candidate is skipped, with a log line, when it shares a parameter with
    modules outside it (tied weights such as an embedding reused as the output head): a shared
    parameter must live in the unit of the common ancestor, or one side would see a sharded tensor.
    """
    tree = _ModuleTree(root)
    if policy is not None and policy is not True:
        predicate = make_wrap_predicate(policy)
        chosen = [
            (name, module)
            for name, module in tree.modules
            if predicate(name, module, tree.parents[name]) and tree.can_wrap(name, module)
        ]
        return WrapPlan(root, tuple(reversed(chosen)), (EXPLICIT_RULE,) * len(chosen))

    no_split = _no_split_class_names(root)
    by_rule: list[tuple[str, nn.Module, str]] = []
    for name, module in tree.modules:
        if wrap_module_list_children(name, module, tree.parents[name]):
            rule = MODULE_LIST_RULE
        elif type(module).__name__ in no_split and tree.sizes[name] > 0:
            rule = NO_SPLIT_RULE
        else:
            continue
        if tree.can_wrap(name, module):
            by_rule.append((name, module, rule))
    by_rule = _drop_units_without_own_parameters(by_rule)
    if by_rule:
        children_first = list(reversed(by_rule))
        return WrapPlan(root, tuple((name, m) for name, m, _ in children_first), tuple(r for *_, r in children_first))

    sized = _size_rule_modules(tree)
    if not sized:
        return WrapPlan(root, (), ())
    sizes = [tree.sizes[name] for name, _ in sized]
    return WrapPlan(root, tuple(reversed(sized)), (SIZE_RULE,) * len(sized), (min(sizes), max(sizes)))


class _ModuleTree:
    """``root``'s modules in pre-order (without the root), each one's parent, parameter count and
    which modules share parameters with modules outside them."""

    def __init__(self, root: nn.Module) -> None:
        self.root = root
        self.modules = [(name, module) for name, module in root.named_modules() if module is not root]
        self.by_name: dict[str, nn.Module] = dict(self.modules)
        self.parents: dict[str, nn.Module | None] = {"": None}
        self.children: dict[str, list[str]] = {}
        for name, module in root.named_modules():
            for child_name, _ in module.named_children():
                full = f"{name}.{child_name}" if name else child_name
                self.parents[full] = module
                self.children.setdefault(name, []).append(full)
        self._owners: dict[int, set[str]] = {}
        for module_name, module in root.named_modules(remove_duplicate=False):
            for param in module.parameters(recurse=False):
                self._owners.setdefault(id(param), set()).add(module_name)
        #: parameters (elements) under each module, a tied tensor counted once; a module reused
        #: under several names appears under the first only, as in ``named_modules()``
        self.sizes: dict[str, int] = {name: _numel(module) for name, module in self.modules}
        self._shares_outside: dict[str, bool] = {}

    def shares_parameters_outside(self, name: str, module: nn.Module) -> bool:
        """Whether a parameter under ``module`` also belongs to a module outside it (tied weights,
        or a submodule reused elsewhere). Cached: the size rule asks once per budget tried."""
        if name not in self._shares_outside:
            prefix = name + "."
            self._shares_outside[name] = any(
                owner != name and not owner.startswith(prefix)
                for pid in {id(p) for p in module.parameters()}
                for owner in self._owners[pid]
            )
        return self._shares_outside[name]

    def can_wrap(self, name: str, module: nn.Module) -> bool:
        if self.shares_parameters_outside(name, module):
            log.info("not wrapping %s separately: it shares parameters with modules outside it (tied weights)", name)
            return False
        return True


def _numel(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())  # parameters() yields a tied tensor once


def _no_split_class_names(root: nn.Module) -> set[str]:
    """The class names listed in ``_no_split_modules`` by any module of ``root`` (a LightningModule
    may hold a Hugging Face ``PreTrainedModel`` as an attribute, so all of them are asked)."""
    names: set[str] = set()
    for name, module in root.named_modules():
        declared = getattr(module, "_no_split_modules", None)
        if declared is None:
            continue
        if isinstance(declared, str) or not isinstance(declared, (list, tuple, set, frozenset)) or not all(
            isinstance(entry, str) for entry in declared
        ):
            raise TypeError(
                f"{name or type(module).__name__}._no_split_modules={declared!r} must be a list of module class names "
                "(strings), as in Hugging Face models, e.g. ['MyDecoderLayer']. Fix the attribute, or choose the FSDP "
                "units yourself with auto_wrap_policy={MyDecoderLayer}."
            )
        names.update(declared)
    return names


def _drop_units_without_own_parameters(chosen: list[tuple[str, nn.Module, str]]) -> list[tuple[str, nn.Module, str]]:
    """Drop chosen modules whose parameters all sit in other chosen modules nested in them (e.g. a
    stage in an ``nn.ModuleList`` whose layers ``_no_split_modules`` names): such a unit would
    gather nothing."""
    chosen_ids = {id(module) for _, module, _ in chosen}
    kept = []
    for name, module, rule in chosen:
        nested = [sub for sub in module.modules() if sub is not module and id(sub) in chosen_ids]
        in_nested = {id(p) for sub in nested for p in sub.parameters()}
        if any(id(p) not in in_nested for p in module.parameters()):
            kept.append((name, module, rule))
    return kept


def _size_rule_modules(tree: _ModuleTree) -> list[tuple[str, nn.Module]]:
    """The size rule, for models with no ``nn.ModuleList`` and no ``_no_split_modules``.

    For a budget of ``B`` parameters, cut the module tree top-down: a module larger than ``B`` is
    split into its children (a leaf cannot be, and is wrapped as it is); a module of at most ``B``
    becomes a unit if it holds at least ``B / SIZE_RULE_SPREAD`` parameters, else it stays in the
    root's unit. A module that shares parameters with modules outside it is never a unit: it is
    split, and a tied leaf stays in the root. The cut keeps whole blocks together whenever they
    fit the budget -- the largest modules that still split the model -- rather than wrapping
    single layers inside them.

    ``B`` is the largest module size (tried largest first) whose cut has at least
    ``SIZE_RULE_MIN_UNITS`` units; if no budget gives that many, the one giving the most (the
    larger budget on ties). Pre-order in, pre-order out; deterministic for a given model.
    """
    best: list[str] = []
    for budget in sorted({size for size in tree.sizes.values() if size > 0}, reverse=True):
        cut = _cut(tree, budget)
        if len(cut) >= SIZE_RULE_MIN_UNITS:
            best = cut
            break
        if len(cut) > len(best):
            best = cut
    return [(name, tree.by_name[name]) for name in best]


def _cut(tree: _ModuleTree, budget: int) -> list[str]:
    """The size rule's units for one budget (see :func:`_size_rule_modules`), in pre-order."""
    floor = budget / SIZE_RULE_SPREAD
    chosen: list[str] = []

    def visit(parent: str) -> None:
        for name in tree.children.get(parent, []):
            size = tree.sizes.get(name, 0)  # a reused module's second name has no entry: visited once
            if size == 0:
                continue
            module = tree.by_name[name]
            splittable = any(tree.sizes.get(child, 0) > 0 for child in tree.children.get(name, []))
            tied = tree.shares_parameters_outside(name, module)
            if splittable and (tied or size > budget):
                visit(name)
            elif not tied and (size >= floor or size > budget):
                chosen.append(name)

    visit("")
    return chosen


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
    policy: AutoWrapPolicy | WrapPlan = None,
    reshard_after_forward: bool | int = True,
    mp_policy: MixedPrecisionPolicy | None = None,
    force_sum_reduction: bool = False,
    activation_checkpointing: AutoWrapPolicy = None,
    compile_blocks: bool = False,
    prefetch_depth: int = 0,
    post_forward_meshes: PostForwardMeshes | None = None,
    offload_policy: CPUOffloadPolicy | None = None,
) -> list[FSDPModule]:
    """Apply ``fully_shard`` to the selected blocks and then to ``root``; return all FSDP units
    (blocks in forward order, then the root). ``offload_policy`` (``cpu_offload``) goes to every call alike:
    a unit left on the GPU would hold its states there, which is what the option is asked to avoid.

    Before sharding, blocks may get activation checkpointing and ``torch.compile`` (in place, so
    parameter names do not change); after sharding, explicit prefetching between blocks.

    ``root`` itself is never resharded after forward (its parameters are needed again at once in
    backward), which is also FSDP2's own default for the root.

    ``force_sum_reduction`` makes FSDP use only SUM reductions with explicit division, which gloo
    needs (it implements neither ``AVG`` nor ``PREMUL_SUM``).

    ``policy``: an ``auto_wrap_policy``, or the :class:`WrapPlan` that :func:`plan_wrapping` made
    for this ``root`` (the strategies plan first, to log what they wrapped).

    An int ``reshard_after_forward`` (hpZ) reshards every block onto one post-forward mesh per size,
    held by ``post_forward_meshes`` (the layout's; a new one for this call when ``None``), instead of
    the mesh ``fully_shard`` would create for each block (:mod:`lightning_mics.post_forward_mesh`).
    """
    mp_policy = mp_policy or MixedPrecisionPolicy()
    post_forward_meshes = post_forward_meshes if post_forward_meshes is not None else PostForwardMeshes()
    plan = policy if isinstance(policy, WrapPlan) else plan_wrapping(root, policy)
    if plan.root is not root:
        raise ValueError("This WrapPlan was made for another module: call plan_wrapping(root, policy) for this root.")
    wrapped = list(plan.modules)  # children first
    offload: dict[str, Any] = {} if offload_policy is None else {"offload_policy": offload_policy}
    apply_activation_checkpointing(select_modules_to_checkpoint(root, activation_checkpointing, wrapped))
    blocks: list[FSDPModule] = []
    for _, module in wrapped:
        if compile_blocks:
            module.compile()
        shard_with_shared_post_forward_mesh(
            module, mesh, reshard_after_forward, post_forward_meshes, mp_policy=mp_policy, **offload
        )
        blocks.append(module)  # type: ignore[arg-type]
    fully_shard(root, mesh=mesh, reshard_after_forward=False, mp_policy=mp_policy, **offload)
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
def broadcast_shards_across_replicas(
    module: nn.Module, replica_group: dist.ProcessGroup | None, device: torch.device | None = None
) -> None:
    """After meta-device materialisation: every replica of a shard takes the first replica's values,
    and unsharded buffers take global rank 0's. Each rank initialised only its own shard, from its
    own random state, so replicas agree only if every rank's RNG did; this makes them agree anyway.
    Collective over the world (buffers) and ``replica_group`` (shards; ``None``: no replicas).
    ``device``: where the collective needs the data (NCCL: the GPU); shards elsewhere -- in host memory
    with ``cpu_offload`` -- travel through a staging copy, one at a time."""
    for tensor in _unique_states(module):
        if isinstance(tensor, DTensor):
            if replica_group is not None:
                src = dist.get_global_rank(replica_group, 0)
                _broadcast_staged(compat.local_tensor(tensor), src, replica_group, device)
        else:
            _broadcast_staged(tensor.data, 0, None, device)


def _broadcast_staged(
    target: Tensor, src: int, group: dist.ProcessGroup | None, device: torch.device | None
) -> None:
    """``dist.broadcast`` of ``target``, through a copy on ``device`` when it lies elsewhere."""
    if device is None or target.device == device:
        dist.broadcast(target, src, group=group)
        return
    staged = target.to(device)
    dist.broadcast(staged, src, group=group)
    target.copy_(staged)


class ShardRegistry:
    """Which sharded parameter replaced which original, and which model each shard belongs to.

    ``fully_shard`` registers new DTensor parameters under the old names, so an optimizer created from
    the model before it was sharded (Fabric's ``fabric.setup(model, optimizer)``) still holds the originals;
    this points it at the shards. Originals are held weakly (an id alone could be reused by a new tensor)."""

    def __init__(self) -> None:
        self._shard_of: dict[int, tuple[weakref.ref, nn.Parameter]] = {}
        self._model_of: dict[int, nn.Module] = {}

    def originals(self, module: nn.Module) -> dict[int, tuple[weakref.ref, str]]:
        """Taken before sharding ``module``, for :meth:`record`."""
        return {id(p): (weakref.ref(p), name) for name, p in module.named_parameters()}

    def record(self, module: nn.Module, originals: dict[int, tuple[weakref.ref, str]]) -> None:
        """After sharding ``module``: remember each original's shard, and the model of each shard."""
        shards = dict(module.named_parameters())
        for pid, (ref, name) in originals.items():
            if name in shards:
                self._shard_of[pid] = (ref, shards[name])
        self._model_of.update({id(shard): module for shard in shards.values()})

    def models_of(self, optimizer: torch.optim.Optimizer) -> list[nn.Module]:
        """The recorded models whose shards ``optimizer`` steps, each once."""
        models = (self._model_of.get(id(p)) for group in optimizer.param_groups for p in group["params"])
        return list({id(m): m for m in models if m is not None}.values())

    def point_at_shards(self, optimizer: torch.optim.Optimizer) -> None:
        """Replace the original parameters in ``optimizer``'s groups by their shards."""
        if all(isinstance(p, DTensor) for group in optimizer.param_groups for p in group["params"]):
            return
        if any(optimizer.state.values()):
            raise ValueError(
                "The optimizer already has state (it has stepped) for parameters of the unsharded model, which "
                "cannot be sharded. Create the optimizer afresh and pass it to fabric.setup(model, optimizer); load "
                "saved optimizer states with fabric.load(path, {'model': model, 'optimizer': optimizer})."
            )
        for group in optimizer.param_groups:
            group["params"] = [p if isinstance(p, DTensor) else self._shard(p) for p in group["params"]]

    def _shard(self, param: Tensor) -> nn.Parameter:
        ref, shard = self._shard_of.get(id(param), (None, None))
        if ref is None or ref() is not param or shard is None:
            raise ValueError(
                f"The optimizer holds a parameter of shape {tuple(param.shape)} that belongs to no model set up by "
                "MiCSStrategy. Create the optimizer from the model's parameters and set both up together, "
                "`model, optimizer = fabric.setup(model, optimizer)`, or create it after "
                "`model = fabric.setup_module(model)`."
            )
        return shard
