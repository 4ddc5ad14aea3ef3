"""What every replica group must share, and the per-quorum check that they do: a group started with another
configuration would average gradients of a different model, or at other steps."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.optim import Optimizer

from lightning_mics.fault_tolerance.config import CONFIGURATION_BYTES, DIGEST_CHUNKS, MAX_REPLICA_GROUPS
from lightning_mics.fault_tolerance.errors import ReplicaGroupRefused


@dataclass(frozen=True)
class GroupConfiguration:
    """What every replica group of a job must share -- layout, precision, accumulation, model shapes,
    optimizers, number of groups -- as ``(name, value)`` text pairs: a group started with another one would
    average gradients of a different model, or at other steps."""

    items: tuple[tuple[str, str], ...]

    @classmethod
    def of(cls, values: Mapping[str, Any]) -> GroupConfiguration:
        return cls(tuple((name, str(value)) for name, value in values.items()))

    def digest_chunks(self) -> list[int]:
        return digest_chunks(repr(self.items).encode())

    def encoded(self, group: int) -> Tensor:
        """Group ``group``'s configuration as ``CONFIGURATION_BYTES`` of UTF-8 JSON (zero-padded; whole items
        dropped from the end if longer): what groups exchange on a mismatch."""
        items = list(self.items)
        text = json.dumps([group, items]).encode()
        while items and len(text) > CONFIGURATION_BYTES:
            items.pop()
            text = json.dumps([group, items]).encode()
        message = torch.zeros(CONFIGURATION_BYTES, dtype=torch.uint8)
        message[: len(text)] = torch.frombuffer(bytearray(text), dtype=torch.uint8)
        return message

    @classmethod
    def decoded(cls, message: Tensor) -> tuple[int, GroupConfiguration]:
        """``(group, configuration)`` from an :meth:`encoded` message."""
        group, items = json.loads(bytes(message.cpu().tolist()).rstrip(b"\0").decode())
        return int(group), cls(tuple((str(name), str(value)) for name, value in items))

    def differences(self, other: GroupConfiguration) -> list[str]:
        mine, theirs = dict(self.items), dict(other.items)
        return [
            f"{name}: {mine.get(name)} vs {theirs.get(name)}"
            for name in sorted(mine.keys() | theirs.keys())
            if mine.get(name) != theirs.get(name)
        ]

    def __str__(self) -> str:
        return ", ".join(f"{name}={value}" for name, value in self.items)


def digest_chunks(data: bytes) -> list[int]:
    """``data``'s SHA-256 as ``DIGEST_CHUNKS`` 16-bit integers (exact through torchft's float64 average)."""
    digest = hashlib.sha256(data).digest()
    return [int.from_bytes(digest[2 * i : 2 * i + 2], "big") for i in range(DIGEST_CHUNKS)]


def model_signature(module: nn.Module) -> str:
    """Parameter and buffer names, global shapes and dtypes: equal for two groups holding the same model. The
    element count leads, so that a refusal shows a model of another size at a glance."""
    tensors = [(name, t) for name, t in module.state_dict().items() if isinstance(t, Tensor)]
    entries = [f"{name}:{tuple(t.shape)}:{t.dtype}" for name, t in tensors]
    elements = sum(t.numel() for _, t in tensors)
    digest = hashlib.sha256(";".join(entries).encode()).hexdigest()[:16]
    return f"{len(entries)} tensors of {elements:,} elements, sha256 {digest}"


#: What an LR scheduler's state holds that changes as it steps (every other entry is a setting groups share).
_SCHEDULER_PROGRESS = {"last_epoch", "_step_count", "_last_lr", "_get_lr_called_within_step", "_is_initial"}


def _hyper_parameter_value(param_group: Mapping[str, Any], key: str) -> Any:
    """A schedule moves ``lr`` as it steps; ``initial_lr`` (set by torch's schedulers) is the setting."""
    return param_group.get("initial_lr", param_group["lr"]) if key == "lr" else param_group[key]


def run_configuration(
    precision: str,
    accumulate_grad_batches: int,
    module: nn.Module,
    optimizers: Sequence[Optimizer],
    schedulers: Sequence[Any] = (),
) -> dict[str, Any]:
    """What besides the layout every group must share (see :class:`GroupConfiguration`): precision,
    accumulation, the model's tensors, each optimizer's class and hyper-parameters per parameter group (lr,
    betas, weight decay, ...), and each LR scheduler's class and settings. Named one by one, so that a refused
    group is told which one differs."""
    values: dict[str, Any] = {
        "precision": precision,
        "accumulate_grad_batches": accumulate_grad_batches,
        "model": model_signature(module),
        "optimizers": [type(optimizer).__name__ for optimizer in optimizers],
    }
    for i, optimizer in enumerate(optimizers):
        for j, param_group in enumerate(optimizer.param_groups):
            for key in sorted(k for k in param_group if k not in ("params", "initial_lr")):
                values[f"optimizers[{i}].param_groups[{j}].{key}"] = _hyper_parameter_value(param_group, key)
    for k, scheduler in enumerate(schedulers):
        settings = {key: value for key, value in scheduler.state_dict().items() if key not in _SCHEDULER_PROGRESS}
        values[f"lr_schedulers[{k}]"] = f"{type(scheduler).__name__} {settings}"
    return values


#: Where each group's entries sit in the agreement message: configuration digests, presence counts, parameter
#: digests, catching-up flags (each group writes only its own slots, so the sum over groups holds every group's
#: values).
_COUNTS = MAX_REPLICA_GROUPS * DIGEST_CHUNKS
_PARAMETERS = _COUNTS + MAX_REPLICA_GROUPS
_CATCHING_UP = _PARAMETERS + MAX_REPLICA_GROUPS * DIGEST_CHUNKS


def agreement_message(
    group: int, chunks: Sequence[int], parameter_chunks: Optional[Sequence[int]] = None, catching_up: bool = False
) -> Tensor:
    """This group's entry of the quorum's agreement: its configuration digest in its own slot, a 1 in its count
    slot, on a step that checks them its parameter digest (:func:`parameter_digest_chunks`), and a 1 in its
    catching-up slot while its shards are not yet the live groups' (:mod:`~.catch_up`)."""
    message = torch.zeros(_CATCHING_UP + MAX_REPLICA_GROUPS, dtype=torch.float64)
    message[group * DIGEST_CHUNKS : (group + 1) * DIGEST_CHUNKS] = torch.tensor(chunks, dtype=torch.float64)
    message[_COUNTS + group] = 1.0
    if parameter_chunks is not None:
        start = _PARAMETERS + group * DIGEST_CHUNKS
        message[start : start + DIGEST_CHUNKS] = torch.tensor(parameter_chunks, dtype=torch.float64)
    message[_CATCHING_UP + group] = 1.0 if catching_up else 0.0
    return message


def present_groups(summed: Tensor) -> list[int]:
    """The groups of the quorum (each index that sent exactly one message), ascending."""
    return _present(summed)


def catching_up_groups(summed: Tensor) -> frozenset[int]:
    """The groups of the quorum whose shards are not yet the live groups': they contribute nothing this quorum."""
    flags = summed[_CATCHING_UP : _CATCHING_UP + MAX_REPLICA_GROUPS].round().long().tolist()
    return frozenset(group for group in _present(summed) if flags[group] > 0)


def _counts(summed: Tensor) -> list[int]:
    """How many groups sent a message under each index."""
    return summed[_COUNTS:_PARAMETERS].round().long().tolist()


def _present(summed: Tensor) -> list[int]:
    """The groups that sent exactly one message (a duplicated index is refused on its own)."""
    counts = _counts(summed)
    return [group for group in range(MAX_REPLICA_GROUPS) if counts[group] == 1]


def _slot(summed: Tensor, start: int, group: int) -> tuple[int, ...]:
    offset = start + group * DIGEST_CHUNKS
    return tuple(summed[offset : offset + DIGEST_CHUNKS].round().long().tolist())


def _majority(digests: Mapping[int, tuple[int, ...]]) -> tuple[tuple[int, ...], dict[tuple[int, ...], list[int]]]:
    """The most common digest (ties: the one of the lowest group index) and the groups holding each."""
    holders: dict[tuple[int, ...], list[int]] = {}
    for other in sorted(digests):
        holders.setdefault(digests[other], []).append(other)
    reference = max(holders, key=lambda digest: (len(holders[digest]), -holders[digest][0]))
    return reference, holders


def configurations_differ(summed: Tensor) -> bool:
    """Whether any group of the quorum was refused by the configuration check (every group reads the same sum,
    so every group answers alike: the exchange of configurations that names the settings runs in all or none)."""
    return any(count > 1 for count in _counts(summed)) or len({_slot(summed, 0, g) for g in _present(summed)}) > 1


def reference_group(summed: Tensor) -> int:
    """The group whose configuration is the reference (the majority's, its lowest index)."""
    reference, holders = _majority({group: _slot(summed, 0, group) for group in _present(summed)})
    return holders[reference][0]


def parameter_digest_chunks(modules: Sequence[nn.Module]) -> list[int]:
    """A digest of this rank's parameter shards: exact integer sums of their bits (order-independent, so equal
    shards give equal digests whatever the thread count), hashed. Two groups' same-index ranks match exactly
    when their shards are bit-identical -- the invariant fault tolerance keeps. Read from each FSDP unit's
    sharded parameters, never from what the module holds at the moment (an evaluation leaves the root unit's
    parameters gathered in the groups that ran it, not in one that just joined)."""
    from lightning_mics import _compat as compat
    from lightning_mics.shards import fsdp_units

    return tensor_digest_chunks(
        [p for module in modules for unit in fsdp_units(module) for p in compat.fsdp_unit_parameters(unit)]
    )


def tensor_digest_chunks(shards: Sequence[Tensor]) -> list[int]:
    """:func:`parameter_digest_chunks` of given tensors (this rank's shards of DTensors): with DiLoCo, the
    last-synchronised copy, the state that must be bit-identical across groups."""
    from lightning_mics.shards import local_shard

    integer = {torch.float64: torch.int64, torch.float32: torch.int32, torch.bfloat16: torch.int16,
               torch.float16: torch.int16}
    sums = []
    with torch.no_grad():
        for param in shards:
            local = local_shard(param).detach()  # a DTensor's own detach dispatches: ~15 us per parameter
            bits = local.view(integer[local.dtype]) if local.dtype in integer else local
            sums.append(bits.sum(dtype=torch.int64).cpu())
    return digest_chunks(repr(torch.stack(sums).tolist() if sums else []).encode())


def drift_verdict(summed: Tensor, step: int) -> Optional[str]:
    """Why the run must end because the groups' parameters differ at torchft ``step`` (``None``: they agree, or
    this step checked none). Names the groups that differ from the majority."""
    stale = catching_up_groups(summed)  # their shards are a snapshot away from the others', by design
    digests = {group: _slot(summed, _PARAMETERS, group) for group in _present(summed) if group not in stale}
    if len(digests) < 2 or len(set(digests.values())) == 1 or not any(any(d) for d in digests.values()):
        return None
    reference, holders = _majority(digests)
    odd = sorted(group for digest, groups in holders.items() if digest != reference for group in groups)
    return (
        f"the replica groups' parameters differ after committed step {step}: group(s) {odd} hold other shards "
        f"than group(s) {holders[reference]} (a digest of this rank index's shards, compared every "
        "check_parameters_every steps). They must be bit-identical: something the configuration check cannot see "
        "differs between the groups (a learning rate changed in code, a custom optimizer, nondeterministic "
        "kernels, a hardware fault). The run ends here; restart every group from the last checkpoint."
    )


def agreement_verdict(summed: Tensor, group: int) -> Optional[str]:
    """Why ``group`` may not train in this quorum (``summed``: every group's :func:`agreement_message`
    added), or ``None``. Two groups with one index are both refused; a group whose configuration differs
    from the most common one (ties: the one of the lowest index) is refused and the others go on."""
    counts = _counts(summed)
    if counts[group] > 1:
        return (
            f"{counts[group]} groups claim replica_group={group}: give each group's job its own index "
            "(MICS_REPLICA_GROUP), else two groups train on the same share of the data."
        )
    digests = {other: _slot(summed, 0, other) for other in _present(summed)}
    reference, holders = _majority(digests)
    if digests[group] == reference:
        return None
    return (
        f"it was started with another configuration (layout, precision, accumulation, model or optimizers) than "
        f"group(s) {holders[reference]}. Each group's job log lists its configuration "
        "(\"this group's configuration: ...\"); start every group with the same one."
    )


def check_healed_whole(step: int, device: torch.device) -> None:
    """Refuse a group whose ranks disagree on torchft's step after the quorum: a heal that reached only some
    of them (torchft 0.2.0 does not make a group's heal all-or-nothing) would otherwise let the group commit
    steps with a stale shard. A collective of this group's world; the whole group raises."""
    steps = torch.tensor([step, -step], dtype=torch.int64, device=device)
    dist.all_reduce(steps, op=dist.ReduceOp.MAX)
    highest, lowest = int(steps[0]), -int(steps[1])
    if highest != lowest:
        raise ReplicaGroupRefused(
            f"fault tolerance: a heal reached only some ranks of this group (their steps range from {lowest} to "
            f"{highest}); the group ends rather than train on a stale shard. Restart it: it heals anew, all ranks."
        )
