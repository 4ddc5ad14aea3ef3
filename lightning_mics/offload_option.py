"""What ``cpu_offload`` may be, and what it cannot be combined with: checked when the options are created and
before the launcher starts the ranks, without importing FSDP (:mod:`lightning_mics.offload` resolves the option to
FSDP2's policy and moves the states).

The refusals, and why: the features whose hooks work on the gradient shards between backward and the optimizer
step as if they were on the GPU -- the compressed hop 2, torchft's hop 2, AMSP optimizer states sharded across
replicas -- cannot take host (offloaded) shards, and on CPU ranks the states are in host memory already.
"""

from __future__ import annotations

from typing import Any, Optional

from lightning_mics.sharding_spec import ShardingSpec

ON_CPU_RANKS = (
    "cpu_offload moves model states from the GPU to host memory; on CPU ranks they already are there -- drop "
    "cpu_offload (or run on GPUs: Trainer(accelerator='gpu'))."
)
_HOST_GRADIENTS = "with cpu_offload the gradient shards are in host memory when backward ends"


def offload_requested(option: Any) -> bool:
    """Whether ``cpu_offload`` asks for offload: ``False``/``None`` no, ``True`` or a
    ``torch.distributed.fsdp.CPUOffloadPolicy`` yes; anything else is refused, naming the accepted forms."""
    if option is False or option is None:
        return False
    if option is True:
        return True
    from torch.distributed.fsdp import CPUOffloadPolicy  # a policy object was made with FSDP imported already

    if isinstance(option, CPUOffloadPolicy):
        return True
    raise TypeError(
        f"cpu_offload must be True, False or a torch.distributed.fsdp.CPUOffloadPolicy, got {option!r}"
        + (f"; write cpu_offload={option.lower() == 'true'}." if option in ("true", "false", "True", "False") else ".")
    )


def check_cpu_offload_option(
    option: Any, cross_replica_dtype: Any, fault_tolerance: Any, sharding: Any
) -> None:
    """Refuse ``cpu_offload`` with the options whose step hooks need the gradient shards on the GPU, when
    the options are created (before anything is launched). Degrees given by name ("node", "world") are
    compared once the world size is known (:func:`check_offload_before_launch`)."""
    if not offload_requested(option):
        return
    if cross_replica_dtype is not None:
        raise ValueError(
            f"cpu_offload cannot be combined with cross_replica_dtype={cross_replica_dtype!r}: the compressed hop 2 "
            f"packs and all-reduces the gradient shards after backward, and {_HOST_GRADIENTS}. Drop "
            "cross_replica_dtype (hop 2 then runs inside FSDP2, on the GPU, before the copy to host memory) or "
            "cpu_offload."
        )
    if fault_tolerance is not None:
        raise ValueError(
            "cpu_offload cannot be combined with fault_tolerance: torchft's hop 2 all-reduces the gradient shards "
            f"after backward, and {_HOST_GRADIENTS}. Drop one of the two."
        )
    if isinstance(sharding, ShardingSpec) and isinstance(sharding.optim, int) and isinstance(sharding.grads, int):
        check_offload_optim_degree(sharding.optim, sharding.grads)


def check_offload_optim_degree(optim_degree: Optional[int], partition_size: int) -> None:
    """AMSP ``optim > grads`` reduce-scatters the gradient shards across replicas before the step: refused."""
    if optim_degree is not None and optim_degree > partition_size:
        raise ValueError(
            f"cpu_offload cannot be combined with optimizer states sharded across replicas (ShardingSpec optim="
            f"{optim_degree} > grads={partition_size}): that reduce-scatters the gradient shards before the step, "
            f"and {_HOST_GRADIENTS}. Use optim equal to grads -- offload already takes the optimizer states off the "
            "GPU -- or drop cpu_offload."
        )


def check_offload_before_launch(
    option: Any, device_type: Optional[str], world_size: int, ranks_per_node: int, sharding: Any
) -> None:
    """What the launcher knows before it starts the ranks: their device type and the world. ``cpu_offload``
    on CPU ranks, or with a spec whose optimizer degree resolves beyond its gradient degree, is refused
    here, once, instead of in every rank."""
    if not offload_requested(option):
        return
    if device_type == "cpu":
        raise ValueError(ON_CPU_RANKS)
    if isinstance(sharding, ShardingSpec) and world_size >= 1:
        degrees = sharding.resolve(world_size, ranks_per_node)
        check_offload_optim_degree(degrees.optim, degrees.grads)
