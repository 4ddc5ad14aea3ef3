"""What every replica group must share, and the per-quorum check that they do: a group started with another
configuration would average gradients of a different model, or at other steps."""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.optim import Optimizer

from lightning_mics.fault_tolerance.config import DIGEST_CHUNKS, MAX_REPLICA_GROUPS
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
        digest = hashlib.sha256(repr(self.items).encode()).digest()
        return [int.from_bytes(digest[2 * i : 2 * i + 2], "big") for i in range(DIGEST_CHUNKS)]

    def differences(self, other: GroupConfiguration) -> list[str]:
        mine, theirs = dict(self.items), dict(other.items)
        return [
            f"{name}: {mine.get(name)} vs {theirs.get(name)}"
            for name in sorted(mine.keys() | theirs.keys())
            if mine.get(name) != theirs.get(name)
        ]

    def __str__(self) -> str:
        return ", ".join(f"{name}={value}" for name, value in self.items)


def model_signature(module: nn.Module) -> str:
    """Parameter and buffer names, global shapes and dtypes: equal for two groups holding the same model."""
    entries = [f"{name}:{tuple(t.shape)}:{t.dtype}" for name, t in module.state_dict().items() if isinstance(t, Tensor)]
    return f"{len(entries)} tensors, sha256 {hashlib.sha256(';'.join(entries).encode()).hexdigest()[:16]}"


def run_configuration(
    precision: str, accumulate_grad_batches: int, module: nn.Module, optimizers: Sequence[Optimizer]
) -> dict[str, Any]:
    """What besides the layout every group must share (see :class:`GroupConfiguration`)."""
    return {
        "precision": precision,
        "accumulate_grad_batches": accumulate_grad_batches,
        "model": model_signature(module),
        "optimizers": [type(optimizer).__name__ for optimizer in optimizers],
    }


def agreement_message(group: int, chunks: Sequence[int]) -> Tensor:
    """This group's entry of the quorum's agreement: its digest in its own slot and a 1 in its count slot."""
    message = torch.zeros(MAX_REPLICA_GROUPS * (DIGEST_CHUNKS + 1), dtype=torch.float64)
    message[group * DIGEST_CHUNKS : (group + 1) * DIGEST_CHUNKS] = torch.tensor(chunks, dtype=torch.float64)
    message[MAX_REPLICA_GROUPS * DIGEST_CHUNKS + group] = 1.0
    return message


def agreement_verdict(summed: Tensor, group: int) -> Optional[str]:
    """Why ``group`` may not train in this quorum (``summed``: every group's :func:`agreement_message`
    added), or ``None``. Two groups with one index are both refused; a group whose configuration differs
    from the most common one (ties: the one of the lowest index) is refused and the others go on."""
    counts = summed[MAX_REPLICA_GROUPS * DIGEST_CHUNKS :].round().long().tolist()
    if counts[group] > 1:
        return (
            f"{counts[group]} groups claim replica_group={group}: give each group's job its own index "
            "(MICS_REPLICA_GROUP), else two groups train on the same share of the data."
        )
    digests = {
        other: tuple(summed[other * DIGEST_CHUNKS : (other + 1) * DIGEST_CHUNKS].round().long().tolist())
        for other in range(MAX_REPLICA_GROUPS)
        if counts[other] == 1
    }
    holders: dict[tuple[int, ...], list[int]] = {}
    for other in sorted(digests):
        holders.setdefault(digests[other], []).append(other)
    reference = max(holders, key=lambda digest: (len(holders[digest]), -holders[digest][0]))
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
