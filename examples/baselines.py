"""Peer baselines built from Lightning's own strategies, configured like a MiCS layout.

Lightning's ``FSDPStrategy(sharding_strategy="HYBRID_SHARD")`` is the closest existing thing to
MiCS (FSDP1, shard inside a group, replicate across groups). It wants its mesh as a *tuple*
``(replicas, shard_size)``, which a YAML config cannot express; :func:`fsdp_hybrid_shard` takes
plain numbers instead (and validates them with the same layout rules as MiCS), so the Hydra
``strategy=fsdp_hybrid`` option can compare both on the same layout.
"""

from __future__ import annotations

import importlib
from collections.abc import Sequence
from typing import Any, Optional

from lightning.pytorch.strategies import FSDPStrategy
from torch import nn

from lightning_mics.topology import MiCSTopology


def _import_class(path: str) -> type[nn.Module]:
    module_name, _, class_name = path.rpartition(".")
    if not module_name:
        raise ValueError(f"wrap_modules entries must be dotted paths like 'package.module.Class', got {path!r}.")
    cls = getattr(importlib.import_module(module_name), class_name, None)
    if not (isinstance(cls, type) and issubclass(cls, nn.Module)):
        raise ValueError(f"{path!r} does not name an nn.Module subclass.")
    return cls


def fsdp_hybrid_shard(
    devices: int,
    num_nodes: int = 1,
    partition_size: Optional[int] = None,
    accelerator: str = "gpu",
    wrap_modules: Sequence[str] = ("examples.models.gpt.Block",),
    **fsdp_kwargs: Any,
) -> FSDPStrategy:
    """Lightning's ``FSDPStrategy`` in ``HYBRID_SHARD`` mode, sharding over ``partition_size`` ranks
    (default: one node, ``devices``) and replicating across the rest.

    Raises:
        ValueError: on CPU (Lightning builds the hybrid mesh on CUDA only), or for a layout that MiCS
            would also reject.
    """
    if accelerator == "cpu":
        raise ValueError(
            "strategy=fsdp_hybrid (Lightning's FSDPStrategy HYBRID_SHARD) runs on GPUs only: Lightning creates its "
            "device mesh on CUDA. Use it with trainer=gpu, or compare on CPU with strategy=mics / zero3 / replicate."
        )
    if not isinstance(devices, int) or isinstance(devices, bool) or devices < 1:
        raise ValueError(f"fsdp_hybrid needs an explicit number of devices per node, got devices={devices!r}.")
    topology = MiCSTopology.create(devices * num_nodes, devices, partition_size)
    return FSDPStrategy(
        sharding_strategy="HYBRID_SHARD",
        device_mesh=(topology.replication_degree, topology.partition_size),
        auto_wrap_policy={_import_class(path) for path in wrap_modules},
        **fsdp_kwargs,
    )
