"""Lightning precision flags mapped onto FSDP2 mixed-precision policies.

FSDP2 keeps the sharded parameters (and so the optimizer's master weights) in their original
dtype and casts only the all-gathered copy used for compute. The mapping:

========== ===================================== =====================================
flag       compute / all-gather dtype            gradient reduction and master weights
========== ===================================== =====================================
32-true    fp32                                  fp32
bf16-mixed bf16 (+ autocast)                     fp32
16-mixed   fp16 (+ autocast, ShardedGradScaler)  fp32
bf16-true  bf16 (the module is cast to bf16)     bf16
========== ===================================== =====================================

The mixed modes also run the step under ``torch.autocast`` on the training device: FSDP2 casts the
inputs of each *unit*, but computation that happens between units (e.g. an output head owned by
the root applied to a block's output and an fp32 buffer) would otherwise mix dtypes; autocast also
keeps numerically sensitive ops such as softmax/cross-entropy in fp32.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from contextlib import AbstractContextManager
from typing import Any, Optional, Union

import torch
import torch.distributed as dist
from lightning.fabric.plugins.precision import FSDPPrecision as FabricFSDPPrecision
from lightning.fabric.plugins.precision import HalfPrecision as FabricHalfPrecision
from lightning.fabric.plugins.precision import MixedPrecision as FabricMixedPrecision
from lightning.fabric.plugins.precision import Precision as FabricPrecision
from lightning.pytorch.plugins.precision import FSDPPrecision, HalfPrecision, MixedPrecision, Precision
from torch import Tensor
from torch.distributed.fsdp import MixedPrecisionPolicy
from torch.optim import Optimizer

from lightning_mics.grad_sync import clip_grad_norm_
from lightning_mics.offload import check_clipping

SUPPORTED_PRECISION = ("32-true", "bf16-mixed", "16-mixed", "bf16-true")


def check_precision(precision: str) -> None:
    if precision not in SUPPORTED_PRECISION:
        raise ValueError(
            f"precision={precision!r} is not supported by MiCSStrategy. "
            f"Choose one of: {', '.join(SUPPORTED_PRECISION)}."
        )


def mixed_precision_policy(precision: str) -> MixedPrecisionPolicy:
    """The FSDP2 policy for a precision flag (the table above)."""
    if precision == "bf16-mixed":
        return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    if precision == "16-mixed":
        return MixedPrecisionPolicy(param_dtype=torch.float16, reduce_dtype=torch.float32)
    # "32-true" and "bf16-true": the module is already in its compute dtype.
    return MixedPrecisionPolicy()


def autocast_context(precision: str, device_type: str) -> Optional[AbstractContextManager]:
    """``torch.autocast`` on the training device for the mixed modes (see module docstring), else ``None``.
    Lightning's FSDP plugins autocast on CUDA only, which would leave CPU ranks without it."""
    if "mixed" not in precision:
        return None
    return torch.autocast(device_type, dtype=torch.bfloat16 if precision == "bf16-mixed" else torch.float16)


class MiCSPrecision(FSDPPrecision):
    """Precision plugin for :class:`~lightning_mics.MiCSStrategy`.

    Reuses Lightning's FSDP plugin for dtype contexts and fp16 loss scaling, and replaces what
    differs under FSDP2: the mixed-precision *policy* handed to ``fully_shard`` and gradient
    clipping by norm, which must see the global norm of the sharded gradients.
    """

    def __init__(self, precision: str = "32-true", scaler: Any = None) -> None:
        check_precision(precision)
        super().__init__(precision, scaler=scaler)  # type: ignore[arg-type]
        self.last_grad_norm: torch.Tensor | None = None
        #: Device type for autocast; the strategy sets it to its root device's type at setup.
        self.device_type = "cuda" if torch.cuda.is_available() else "cpu"
        #: The groups over which plain-tensor parameters' gradients are disjoint, for clipping (see
        #: :func:`~lightning_mics.grad_sync.clip_grad_norm_`); the strategy sets it at setup from its
        #: optimizer-state sharding, empty without one.
        self.disjoint_groups: Mapping[Tensor, Sequence[dist.ProcessGroup]] = {}
        #: Run before clipping (the strategy sets it): the boundary gradients cross replicas first where the
        #: engine runs hop 2, also when manual optimization clips before ``optimizer.step()``.
        self.before_clipping: Callable[[Optimizer], None] = lambda optimizer: None

    @classmethod
    def from_plugin(cls, plugin: Precision) -> "MiCSPrecision":
        """Convert the generic plugin Lightning built from ``Trainer(precision=...)``."""
        if isinstance(plugin, cls):
            return plugin
        if type(plugin) not in _CONVERTIBLE:
            raise ValueError(
                f"MiCSStrategy cannot use the precision plugin {type(plugin).__name__}; pass "
                f"Trainer(precision=...) as one of {', '.join(SUPPORTED_PRECISION)} or a MiCSPrecision instance."
            )
        return cls(plugin.precision)

    def mixed_precision_policy(self) -> MixedPrecisionPolicy:
        return mixed_precision_policy(self.precision)

    def forward_context(self) -> AbstractContextManager:
        return autocast_context(self.precision, self.device_type) or super().forward_context()

    def clip_grad_by_norm(self, optimizer: Optimizer, clip_val: Union[int, float]) -> None:  # type: ignore[override]
        """Clip by the true global gradient norm over all shards; the norm is kept for logging. Refused
        for offloaded gradients on NCCL (:func:`~lightning_mics.offload.check_clipping`)."""
        self.before_clipping(optimizer)
        params = list(self.main_params(optimizer))
        check_clipping(params)
        self.last_grad_norm = clip_grad_norm_(params, float(clip_val), disjoint_groups=self.disjoint_groups)


#: Plugins Lightning builds from ``Trainer(precision=...)`` that carry nothing but the flag.
_CONVERTIBLE = (Precision, HalfPrecision, MixedPrecision, FSDPPrecision)


class MiCSFabricPrecision(FabricFSDPPrecision):
    """Precision plugin for the Fabric strategy (:class:`lightning_mics.fabric.MiCSStrategy`).

    Fabric's own FSDP plugin supplies the dtype contexts, input/output casts and fp16 loss scaling
    (``ShardedGradScaler``); this adds what FSDP2 needs instead of FSDP1's ``MixedPrecision``
    config -- the same FSDP2 policy and device-aware autocast as the Trainer's :class:`MiCSPrecision`.
    Gradient clipping is the strategy's (:meth:`~lightning_mics.fabric.MiCSStrategy.clip_gradients_norm`).
    """

    def __init__(self, precision: str = "32-true", scaler: Any = None) -> None:
        check_precision(precision)
        super().__init__(precision, scaler=scaler)  # type: ignore[arg-type]
        #: Device type for autocast; the strategy sets it to its root device's type at setup.
        self.device_type = "cuda" if torch.cuda.is_available() else "cpu"

    @classmethod
    def from_plugin(cls, plugin: FabricPrecision) -> "MiCSFabricPrecision":
        """Convert the generic plugin Fabric built from ``Fabric(precision=...)``."""
        if isinstance(plugin, cls):
            return plugin
        if isinstance(getattr(plugin, "precision", None), str):
            check_precision(plugin.precision)  # e.g. "64-true", "16-true": name the flags that work
        if type(plugin) not in _FABRIC_CONVERTIBLE:
            raise ValueError(
                f"MiCSStrategy cannot use the precision plugin {type(plugin).__name__}; pass "
                f"Fabric(precision=...) as one of {', '.join(SUPPORTED_PRECISION)} or a MiCSFabricPrecision instance."
            )
        return cls(getattr(plugin, "precision", "32-true"))

    def mixed_precision_policy(self) -> MixedPrecisionPolicy:
        return mixed_precision_policy(self.precision)

    def forward_context(self) -> AbstractContextManager:
        return autocast_context(self.precision, self.device_type) or super().forward_context()


#: Plugins Fabric builds from ``Fabric(precision=...)`` that carry nothing but the flag.
_FABRIC_CONVERTIBLE = (FabricPrecision, FabricHalfPrecision, FabricMixedPrecision, FabricFSDPPrecision)


def precision_property(storage: str, plugin_class: Any, default: Callable[[], Any]) -> property:
    """The strategy attribute Lightning reads and sets the precision plugin through (the Trainer's
    ``precision_plugin``, Fabric's ``precision``), always holding ``plugin_class``: the generic plugin the
    framework built from its precision flag (``default()`` when none) is converted on the way in."""

    def get(strategy: Any) -> Any:
        plugin = getattr(strategy, storage)
        if not isinstance(plugin, plugin_class):
            plugin = plugin_class.from_plugin(plugin or default())
            setattr(strategy, storage, plugin)
        return plugin

    def set_(strategy: Any, plugin: Any) -> None:
        setattr(strategy, storage, None if plugin is None else plugin_class.from_plugin(plugin))

    return property(get, set_)
