"""lightning-mics: MiCS (and AMSP-style) sharded training as a PyTorch Lightning strategy.

Importing the package registers the strategy names ``"mics"``, ``"mics_auto"``, ``"mics_zero3"`` and
``"mics_replicate"`` with Lightning's Trainer and with Fabric (each has its own registry), so
``Trainer(strategy="mics")`` and ``Fabric(strategy="mics")`` work after ``import lightning_mics``.
"""

from lightning.fabric.strategies import STRATEGY_REGISTRY as FABRIC_STRATEGY_REGISTRY
from lightning.pytorch.strategies import StrategyRegistry

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

__version__ = "0.1.0"

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

if "mics" not in StrategyRegistry:
    MiCSStrategy.register_strategies(StrategyRegistry)
if "mics" not in FABRIC_STRATEGY_REGISTRY:
    MiCSFabricStrategy.register_strategies(FABRIC_STRATEGY_REGISTRY)
