"""What a rank holds of a sharded tensor or model, read from the shapes torch gives them.

FSDP2 shards every parameter along dim 0 into a DTensor, padded to a multiple of its shard degree; its units
are the modules ``fully_shard`` was applied to. Every module that packs, sums, checks or counts shards -- hop 2's
packing, the optimizer-state slices, the clipping norm, fault tolerance's digests, telemetry -- reads them
through these helpers, so that a layout's shapes are read one way everywhere.
"""

from __future__ import annotations

from collections.abc import Sequence

from torch import Tensor, nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor, Shard

from lightning_mics import _compat as compat
from lightning_mics.accounting import UnitShapes, padded_numel


def local_shard(t: Tensor) -> Tensor:
    """The tensor holding this rank's elements: a DTensor's local shard (its storage, so in-place
    writes land in the parameter or gradient), or ``t`` itself."""
    return compat.local_tensor(t) if isinstance(t, DTensor) else t


def laid_out_like(local: Tensor, like: Tensor) -> Tensor:
    """``local`` (this rank's elements) as a tensor laid out like ``like``: a DTensor on its mesh, with its
    placements, shape and stride (no check, no copy), or ``local`` itself where ``like`` is a plain tensor."""
    if not isinstance(like, DTensor):
        return local
    return DTensor.from_local(
        local, like.device_mesh, like.placements, run_check=False, shape=like.shape, stride=like.stride()
    )


def fsdp_units(module: nn.Module) -> list[FSDPModule]:
    """All FSDP units inside ``module`` (including itself), in module order."""
    return [m for m in module.modules() if isinstance(m, FSDPModule)]


def padded_shard_numel(param: Tensor) -> int:
    """Elements one rank holds of ``param``'s shard once FSDP2 pads dim 0 (:func:`~lightning_mics.accounting.
    padded_numel` over the degree it is sharded on), so that every rank of a replication group packs alike
    (the same offsets for the same parameters)."""
    if not isinstance(param, DTensor):
        return param.numel()
    shards = 1
    for dim, placement in enumerate(param.placements):
        if isinstance(placement, Shard):
            shards *= param.device_mesh.size(dim)
    return padded_numel(tuple(param.shape), shards) // shards


def fsdp_unit_shapes(units: Sequence[nn.Module], reshard_after_forward: bool = True) -> list[UnitShapes]:
    """Describe each FSDP unit by the global shapes of the parameters it owns.

    The outermost unit (the root) is taken never to reshard after forward -- FSDP2's and
    :func:`~lightning_mics.wrapping.shard_model`'s rule -- the others follow ``reshard_after_forward``.
    """
    unit_ids = {id(u) for u in units}
    nested_in_other: set[int] = set()
    for unit in units:
        for sub in unit.modules():
            if sub is not unit and id(sub) in unit_ids:
                nested_in_other.add(id(sub))
    specs = []
    for unit in units:
        owned: dict[int, nn.Parameter] = {}
        skip: set[int] = set()
        for sub in unit.modules():
            if sub is not unit and isinstance(sub, FSDPModule):
                skip.update(id(p) for p in sub.parameters())
        for param in unit.parameters():
            if id(param) not in skip:
                owned[id(param)] = param
        is_root = id(unit) not in nested_in_other
        specs.append(
            UnitShapes(
                shapes=tuple(tuple(p.shape) for p in owned.values()),
                trainable=tuple(p.requires_grad for p in owned.values()),
                reshard_after_forward=bool(reshard_after_forward) and not is_root,
            )
        )
    return specs
