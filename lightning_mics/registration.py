"""The strategy names (``"mics"``, ``"mics_auto"``, ...) and their registration with Lightning's two registries.

Kept free of the library's runtime (and of Lightning until it registers): ``import lightning_mics`` registers the
names from inside Lightning's own import when Lightning comes second (see the package docstring), which may
happen while one of the library's modules is half-imported. So the registries hold small factories that import
the front ends only when a Trainer or Fabric builds its strategy, never the classes themselves."""

from __future__ import annotations

from typing import Any

#: The strategy names importing the package registers, with the Trainer and with Fabric alike:
#: name -> (description, MiCSStrategy keyword arguments). ``"mics_auto"`` is the fastest layout the
#: planner finds for the cluster the job runs on (measured at set-up); on the emulated cloud
#: cluster (2 x 4 ranks, ratio 24) it ran 1.31x Lightning's DDP and 1.83x HYBRID_SHARD, where ``"mics"`` (MiCS's
#: least-memory schedule) ran 0.95x HYBRID_SHARD (README, docs/benchmarks.md).
REGISTERED_STRATEGIES: dict[str, tuple[str, dict[str, Any]]] = {
    "mics": ("MiCS: shard inside one node, replicate across nodes, 2-hop gradient sync", {}),
    "mics_auto": (
        "MiCS with the planner's fastest layout and accumulation mode for the measured cluster",
        {"sharding": "auto", "grad_accumulation": "auto", "planner_cluster": "calibrate"},
    ),
    "mics_zero3": ("MiCS strategy sharding across all ranks (ZeRO-3)", {"partition_size": "world"}),
    "mics_replicate": ("MiCS strategy without sharding (DDP-like)", {"partition_size": 1}),
}


def register_strategy_names(strategy_registry: Any, strategy: Any, knows_accumulation: bool) -> None:
    """Register :data:`REGISTERED_STRATEGIES` in ``strategy_registry`` (the Trainer's or Fabric's), each built by
    ``strategy(**options)`` -- a strategy class or a factory.

    ``knows_accumulation=False`` (Fabric: the user's loop decides how many micro-steps make an
    optimizer step) leaves ``grad_accumulation`` at its default, ``"sharded"``, where a name asks for
    ``"auto"``: the planner still chooses the sharding degrees."""
    for name, (description, options) in REGISTERED_STRATEGIES.items():
        if not knows_accumulation and options.get("grad_accumulation") == "auto":
            options = {key: value for key, value in options.items() if key != "grad_accumulation"}
        strategy_registry.register(name, strategy, description=description, **options)


def trainer_strategy(**options: Any) -> Any:
    """``Trainer(strategy="mics")``'s factory: the Trainer's ``MiCSStrategy`` with the name's options."""
    from lightning_mics.strategy import MiCSStrategy

    return MiCSStrategy(**options)


def fabric_strategy(**options: Any) -> Any:
    """``Fabric(strategy="mics")``'s factory: Fabric's ``MiCSStrategy`` with the name's options."""
    from lightning_mics.fabric import MiCSStrategy

    return MiCSStrategy(**options)


def register_with_lightning() -> None:
    """Both registries get every name (idempotent: a name already there is left as it is)."""
    from lightning.fabric.strategies import STRATEGY_REGISTRY
    from lightning.pytorch.strategies import StrategyRegistry

    if "mics" not in StrategyRegistry:
        register_strategy_names(StrategyRegistry, trainer_strategy, knows_accumulation=True)
    if "mics" not in STRATEGY_REGISTRY:
        register_strategy_names(STRATEGY_REGISTRY, fabric_strategy, knows_accumulation=False)
