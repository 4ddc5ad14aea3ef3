"""lightning-mics: MiCS (and AMSP-style) sharded training as a PyTorch Lightning strategy.

Importing the package registers the strategy names ``"mics"``, ``"mics_auto"``, ``"mics_zero3"`` and
``"mics_replicate"`` with Lightning's Trainer and with Fabric (each has its own registry), so
``Trainer(strategy="mics")`` and ``Fabric(strategy="mics")`` work after ``import lightning_mics``.

Why the registration may wait: the layout planner (``lightning-mics plan``, ``lightning_mics.planner``) is pure
arithmetic and must start without Lightning, yet importing any submodule runs this file first. So when Lightning
is already imported the names are registered at once; otherwise a one-shot import hook registers them the moment
``lightning`` finishes importing (every ``lightning.pytorch`` / ``lightning.fabric`` import goes through it), then
removes itself. Either way the names exist before a ``Trainer`` or ``Fabric`` can be built. The public classes
below are loaded on first access (PEP 562), for the same reason.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import sys
from collections.abc import Sequence
from types import ModuleType
from typing import TYPE_CHECKING, Any, Optional

__version__ = "0.1.0"

#: public name -> the module that defines it (imported on first access)
_PUBLIC: dict[str, str] = {
    "CollectiveRecorder": "lightning_mics.collective_recorder",
    "FaultTolerance": "lightning_mics.fault_tolerance",
    "LoadsShardedCheckpoints": "lightning_mics.checkpoint",
    "MiCSFabricStrategy": "lightning_mics.fabric",
    "MiCSOptions": "lightning_mics.options",
    "MiCSPrecision": "lightning_mics.precision",
    "MiCSStrategy": "lightning_mics.strategy",
    "MiCSTopology": "lightning_mics.topology",
    "ShardingSpec": "lightning_mics.sharding_spec",
    "clip_grad_norm_": "lightning_mics.grad_sync",
    "defer_cross_replica_sync": "lightning_mics.grad_sync",
    "load_from_checkpoint": "lightning_mics.checkpoint",
}
#: the class each public name is bound to inside its module, where the two differ
_DEFINED_AS = {"MiCSFabricStrategy": "MiCSStrategy"}

__all__ = [
    "CollectiveRecorder",
    "FaultTolerance",
    "LoadsShardedCheckpoints",
    "MiCSFabricStrategy",
    "MiCSOptions",
    "MiCSPrecision",
    "MiCSStrategy",
    "MiCSTopology",
    "ShardingSpec",
    "clip_grad_norm_",
    "defer_cross_replica_sync",
    "load_from_checkpoint",
]

if TYPE_CHECKING:
    from lightning_mics.checkpoint import LoadsShardedCheckpoints, load_from_checkpoint
    from lightning_mics.collective_recorder import CollectiveRecorder
    from lightning_mics.fabric import MiCSStrategy as MiCSFabricStrategy
    from lightning_mics.fault_tolerance import FaultTolerance
    from lightning_mics.grad_sync import clip_grad_norm_, defer_cross_replica_sync
    from lightning_mics.options import MiCSOptions
    from lightning_mics.precision import MiCSPrecision
    from lightning_mics.sharding_spec import ShardingSpec
    from lightning_mics.strategy import MiCSStrategy
    from lightning_mics.topology import MiCSTopology


def __getattr__(name: str) -> Any:
    module = _PUBLIC.get(name)
    if module is None:  # an AttributeError lets ``from lightning_mics import <submodule>`` import the submodule
        raise AttributeError(f"module 'lightning_mics' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), _DEFINED_AS.get(name, name))
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_PUBLIC))


def trainer_strategy(**options: Any) -> Any:
    """``Trainer(strategy="mics")``'s factory: the Trainer's ``MiCSStrategy`` with the name's options."""
    from lightning_mics.strategy import MiCSStrategy

    return MiCSStrategy(**options)


def fabric_strategy(**options: Any) -> Any:
    """``Fabric(strategy="mics")``'s factory: Fabric's ``MiCSStrategy`` with the name's options."""
    from lightning_mics.fabric import MiCSStrategy

    return MiCSStrategy(**options)


def register_with_lightning() -> None:
    """Both registries get every name (idempotent: a name already there is left as it is). The registries hold
    the two factories above, which import a front end only when a Trainer or Fabric builds its strategy; the names
    come from :mod:`lightning_mics.options`, which imports no Lightning -- so it is never half-imported when
    Lightning's own import runs this."""
    from lightning.fabric.strategies import STRATEGY_REGISTRY
    from lightning.pytorch.strategies import StrategyRegistry

    from lightning_mics.options import register_strategy_names

    if "mics" not in StrategyRegistry:
        register_strategy_names(StrategyRegistry, trainer_strategy, knows_accumulation=True)
    if "mics" not in STRATEGY_REGISTRY:
        register_strategy_names(STRATEGY_REGISTRY, fabric_strategy, knows_accumulation=False)


def _register() -> None:
    register_with_lightning()


class _RegisterWhenLightningLoads(importlib.abc.MetaPathFinder):
    """Finds nothing itself: when ``lightning`` is about to be imported, it lets the other finders find it and
    makes its loader register the strategy names right after ``lightning``'s own code ran. It leaves
    ``sys.meta_path`` at its first use."""

    def find_spec(
        self, fullname: str, path: Optional[Sequence[str]], target: Optional[ModuleType] = None
    ) -> Optional[importlib.machinery.ModuleSpec]:
        if fullname != "lightning":
            return None
        _remove_hook()
        spec = importlib.util.find_spec("lightning")
        loader = None if spec is None else spec.loader
        if loader is None or not hasattr(loader, "exec_module"):
            return spec  # not a loader we can follow
        run_lightning = loader.exec_module

        def exec_module(module: ModuleType) -> None:
            run_lightning(module)
            _register()

        loader.exec_module = exec_module  # type: ignore[method-assign]  # this spec's loader instance only
        return spec


def _remove_hook() -> None:
    sys.meta_path[:] = [finder for finder in sys.meta_path if not isinstance(finder, _RegisterWhenLightningLoads)]


if "lightning" in sys.modules:
    _register()
elif not any(isinstance(finder, _RegisterWhenLightningLoads) for finder in sys.meta_path):
    sys.meta_path.insert(0, _RegisterWhenLightningLoads())
