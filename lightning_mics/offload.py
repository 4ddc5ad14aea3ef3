"""CPU offload (``cpu_offload``): the sharded model states live in host memory, the GPU holds what is in flight.

Why: a GPU too small for its share of the model states -- ``1/partition`` of the parameters and gradients
plus the optimizer states -- can still train the model when those states live in host memory, as Lightning's
FSDP (``cpu_offload``) and DeepSpeed's ZeRO-Offload allow. The option maps onto FSDP2's
:class:`~torch.distributed.fsdp.CPUOffloadPolicy`, passed to every ``fully_shard`` call of the layout: each
unit's sharded parameters are copied to the GPU for its all-gather (host to device), its reduce-scattered
gradients are copied back (device to host), and the optimizer steps on host tensors -- so its states are
created, and stay, in host memory. On the GPU remain the gathered parameters and unsharded gradients of the
units in flight, the activations and the buffers. The price is the PCIe traffic of every step and an
optimizer step at host-memory speed, which the planner counts (:mod:`lightning_mics.planner.cost_model`).

Where it cannot work it is refused, once, naming the fix: on CPU ranks (the states are in host memory
already), and with the features whose hooks work on the gradient shards between backward and the optimizer
step as if they were on the GPU -- the compressed hop 2 (``cross_replica_dtype``), torchft's hop 2
(``fault_tolerance``) and AMSP optimizer states sharded across replicas (``ShardingSpec`` optim > grads):
with offload those shards are host tensors, which an NCCL collective does not take. Gradient clipping by
norm all-reduces the norm over the gradients' groups; with host gradients that needs a backend that takes
host tensors (gloo), so on NCCL it is refused at the first clip (:func:`check_clipping`).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, Optional, Union

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.fsdp import CPUOffloadPolicy

from lightning_mics import _compat as compat
from lightning_mics.offload_option import ON_CPU_RANKS, check_offload_optim_degree, offload_requested
from lightning_mics.shards import local_shard

#: What ``cpu_offload`` takes: ``True`` (FSDP2's policy with pinned host memory), ``False``, or a policy.
CPUOffloadOption = Union[bool, CPUOffloadPolicy]


def offload_policy(option: Any) -> Optional[CPUOffloadPolicy]:
    """The FSDP2 policy ``cpu_offload`` stands for: ``None`` for ``False``, pinned host memory for ``True``
    (page-locked buffers let the copies run asynchronously, beside compute), a given policy as it is."""
    if not offload_requested(option):
        return None
    return CPUOffloadPolicy(pin_memory=True) if option is True else option


def check_offload_layout(
    policy: Optional[CPUOffloadPolicy], device_type: str, optim_degree: Optional[int], partition_size: int
) -> None:
    """The same refusals for a resolved layout (also the planner's, and ranks started by an external
    launcher): every rank raises alike."""
    if policy is None:
        return
    if device_type == "cpu":
        raise ValueError(ON_CPU_RANKS)
    check_offload_optim_degree(optim_degree, partition_size)


def describe_offload(policy: Optional[CPUOffloadPolicy]) -> str:
    """One line for the layout log (``None``: no line, offload is off)."""
    if policy is None:
        return ""
    memory = "pinned host memory" if policy.pin_memory else "pageable host memory"
    return (
        f"  cpu offload: on -- sharded parameters, gradients and optimizer states in {memory}; each unit's "
        "shard is copied to the GPU for its all-gather and its gradient back, and the optimizer steps on the CPU"
    )


def move_unsharded_states(root: nn.Module, device: torch.device) -> None:
    """Move what FSDP does not manage -- buffers, and parameters outside any unit -- to ``device``, leaving
    the sharded parameters where the offload policy keeps them. ``root.to(device)`` would copy them to the
    GPU too (FSDP2 then copies pinned shards back, and refuses unpinned ones on the GPU at the first
    forward)."""
    for module in root.modules():
        buffers, params = compat.module_buffers(module), compat.module_parameters(module)
        for name, buffer in buffers.items():
            if buffer is not None and buffer.device != device:
                buffers[name] = buffer.to(device)
        for name, param in params.items():
            if param is not None and not hasattr(param, "device_mesh") and param.device != device:
                with torch.no_grad():
                    params[name] = nn.Parameter(param.to(device), requires_grad=param.requires_grad)


def check_clipping(params: Iterable[Tensor]) -> None:
    """Clipping by norm all-reduces the gradients' partial norms over their groups, on the device the
    gradients are on: with offloaded (host) gradients on NCCL, which takes GPU tensors only, it would fail
    inside the collective; refuse it with the way out instead."""
    if not dist.is_available() or not dist.is_initialized() or dist.get_backend() != "nccl":
        return
    for param in params:
        grad = param.grad
        if grad is None:
            continue
        if local_shard(grad).device.type == "cpu":
            raise ValueError(
                "Gradient clipping by norm does not work with cpu_offload on NCCL yet: the gradients are in host "
                "memory and the norm's all-reduce runs on NCCL, which takes GPU tensors only. Remove gradient "
                "clipping (Trainer(gradient_clip_val=None)) or drop cpu_offload."
            )
        return
