"""The strategy and Trainer a rank of the emulated cluster trains with, from its row's
:class:`~benchmarks.scenarios.StrategySpec`: :func:`build_strategy` (``MiCSStrategy``, Lightning's DDP, or Lightning's
FSDP1 made to run on CPU ranks, :class:`CPUFSDPStrategy`), :func:`measured_trainer`, and :func:`planner_choice` (a
planned row's spec with the layout its strategy chose at set-up).

Shared by the throughput run (``emulated_worker.py``) and the ``--convergence`` run
(:mod:`benchmarks.convergence_worker`), so that both train every row the same way.
"""

from __future__ import annotations

import functools
from typing import Any, Optional

import lightning.pytorch as pl
import torch
from lightning.pytorch.strategies import DDPStrategy, FSDPStrategy, Strategy
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FullyShardedDataParallel

from benchmarks.scenarios import ClusterShape, StrategySpec, TrainingSetup
from examples.models.gpt import Block
from lightning_mics import MiCSStrategy, ShardingSpec


class CPUFSDPStrategy(FSDPStrategy):
    """Lightning's ``FSDPStrategy`` (FSDP1) made to run on CPU ranks, with nothing else changed.

    Three things stand in the way on CPU, each a device assumption rather than a real limitation
    of FSDP1 (which supports CPU + gloo when told its device):

    * Lightning's trainer refuses ``FSDPStrategy`` with ``accelerator="cpu"`` -- the check looks
      for the exact class, so a subclass passes;
    * Lightning passes ``device_id=root_device.index``, which is ``None`` on CPU, and FSDP1 then
      looks for an accelerator and raises -- :meth:`_setup_model` passes ``torch.device("cpu")``;
    * given ``device_mesh=(replicas, shard)``, Lightning builds the mesh with
      ``init_device_mesh("cuda", ...)``, and a ready mesh cannot be passed in because it needs the
      process group the strategy creates -- so the shape is kept aside and a CPU mesh is built
      right after the process group exists (``HYBRID_SHARD``).
    """

    def __init__(self, mesh_shape: Optional[tuple[int, int]] = None, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._cpu_mesh_shape = mesh_shape

    def setup_environment(self) -> None:
        super().setup_environment()
        if self._cpu_mesh_shape is not None:
            self.kwargs["device_mesh"] = init_device_mesh(
                "cpu", self._cpu_mesh_shape, mesh_dim_names=("replicate", "shard")
            )

    def _setup_model(self, model: nn.Module) -> nn.Module:
        return FullyShardedDataParallel(
            module=model,
            cpu_offload=self.cpu_offload,
            mixed_precision=self.mixed_precision_config,
            sharding_strategy=self.sharding_strategy,
            device_id=torch.device("cpu"),
            **self.kwargs,
        )


def build_strategy(spec: StrategySpec, cluster: ClusterShape) -> Strategy:
    if spec.family == "mics":
        p = spec.partition_size
        layout: dict[str, Any] = dict(partition_size=p, hierarchical=bool(spec.hierarchical))
        if spec.planned:
            layout = dict(sharding="auto", grad_accumulation="auto", planner_cluster="calibrate", hierarchical="auto")
        elif spec.params_degree is not None or spec.optim_degree is not None:
            degrees = ShardingSpec(params=spec.params_degree or p, grads=p, optim=spec.optim_degree or p)
            layout = dict(sharding=degrees, hierarchical=bool(spec.hierarchical))
        semi_sync: dict[str, Any] = {}
        if spec.semi_synchronous:  # DiLoCo: the outer optimizer is the library's default unless outer_lr is given
            semi_sync = {"cross_replica_sync": "diloco", "sync_every": spec.sync_every}
            if spec.diloco_worker_size is not None:  # two-level DiLoCo: workers of a region's partition groups
                semi_sync.update(diloco_worker_size=spec.diloco_worker_size, ranks_per_region=spec.ranks_per_region)
            if spec.outer_lr is not None:
                semi_sync["outer_optimizer"] = functools.partial(
                    torch.optim.SGD, lr=spec.outer_lr, momentum=0.9, nesterov=True
                )
        return MiCSStrategy(
            **{"grad_accumulation": spec.grad_accumulation, **layout},
            ranks_per_node=cluster.ranks_per_node,
            process_group_backend="gloo",
            cross_replica_dtype=spec.cross_replica_dtype,
            cross_replica_overlap=spec.cross_replica_overlap,
            **semi_sync,
        )
    if spec.family == "ddp":
        return DDPStrategy(process_group_backend="gloo")
    common: dict[str, Any] = dict(auto_wrap_policy={Block}, process_group_backend="gloo")
    if spec.sharding_strategy == "HYBRID_SHARD":
        mesh = (spec.replication_degree(cluster), spec.partition_size)
        return CPUFSDPStrategy(mesh, sharding_strategy="HYBRID_SHARD", **common)
    return CPUFSDPStrategy(sharding_strategy=spec.sharding_strategy, **common)


def measured_trainer(
    spec: StrategySpec, cluster: ClusterShape, setup: TrainingSetup, max_steps: int, callbacks: list[pl.Callback],
    **extra: Any,
) -> pl.Trainer:
    """The Trainer of one measured run: the strategy under test on this cluster, and nothing the measurement does
    not need (no logger, checkpoints, progress bar, summary or sanity validation)."""
    return pl.Trainer(
        accelerator="cpu",
        devices=cluster.ranks_per_node,
        num_nodes=cluster.num_nodes,
        strategy=build_strategy(spec, cluster),
        max_steps=max_steps,
        accumulate_grad_batches=setup.accumulate,
        callbacks=callbacks,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        **extra,
    )


def planner_choice(spec: StrategySpec, strategy: Strategy, cluster: ClusterShape) -> StrategySpec:
    """A planned row's spec with the layout the strategy resolved at set-up (others: unchanged)."""
    if not spec.planned:
        return spec
    degrees = strategy.sharding.resolve(cluster.world_size, cluster.ranks_per_node)
    return spec.with_choice(
        {
            "partition_size": degrees.grads,
            "params_degree": degrees.params,
            "optim_degree": degrees.optim,
            "grad_accumulation": strategy.grad_accumulation,
            "hierarchical": strategy.layout.settings.hierarchical,
        }
    )
