"""lightning-mics: MiCS (and AMSP-style) sharded training as a PyTorch Lightning strategy.

Importing the package registers the strategy names ``"mics"``, ``"mics_zero3"`` and
``"mics_replicate"`` with Lightning, so ``Trainer(strategy="mics")`` works after ``import lightning_mics``.
"""

from lightning.pytorch.strategies import StrategyRegistry

from lightning_mics.collectives import CollectiveRecorder
from lightning_mics.grad_sync import clip_grad_norm_, defer_cross_replica_sync
from lightning_mics.precision import MiCSPrecision
from lightning_mics.sharding_spec import ShardingSpec
from lightning_mics.strategy import MiCSStrategy
from lightning_mics.topology import MiCSTopology

__version__ = "0.1.0"

__all__ = [
    "CollectiveRecorder",
    "MiCSPrecision",
    "MiCSStrategy",
    "MiCSTopology",
    "ShardingSpec",
    "clip_grad_norm_",
    "defer_cross_replica_sync",
]

if "mics" not in StrategyRegistry:
    MiCSStrategy.register_strategies(StrategyRegistry)
