"""NCCL on several GPUs, one rank per GPU: the layouts real jobs start with (2-hop, hierarchical, hpZ, a bf16 or
int8 hop 2, AMSP, ``mics_auto`` with calibration) equal single-process training, and a background save resumes as
the uninterrupted run; skipped below 2 GPUs (``bash benchmarks/run_on_gpu.sh multi`` runs it).

Every other multi-rank test runs on CPU ranks over gloo (and ``test_cuda_path.py`` shares one GPU
over gloo, since NCCL refuses two ranks per device); what only NCCL runs -- FSDP2's AVG / pre-divided
reductions, NCCL's reduce-scatter inside the partition, the all-to-all of the compressed hop 2 on the
device, NCCL sub-communicators for the hierarchical stages, hpZ's post-forward mesh and AMSP's
optimizer groups, the background checkpoint writer beside NCCL -- has never been executed. This file
is ready for the first machine with two or more GPUs (``bash benchmarks/run_on_gpu.sh multi``): one
rank per GPU, world = every visible GPU (rounded down to an even number), ``accelerator="cuda"``, NCCL.

One spawn of ranks trains every layout in turn (start-up dominates); each is compared with the fp32
single-process reference of ``tests/toy.py``:

* 2-hop MiCS, partition = half the world, sharded and unsharded accumulation (3 micro-steps, clipping);
* hierarchical collectives: the whole world as one partition over 2 emulated nodes (``ranks_per_node``);
* hpZ, ``ShardingSpec(params=2, grads=4)`` (4 or more GPUs);
* hop 2 in bf16 and int8 (close to fp32, replicas bit-identical, different from the fp32 wire);
* AMSP: optimizer states sharded across replicas (``ShardingSpec(half, half, world)``);
* ``mics_auto``: ``sharding="auto"``, ``grad_accumulation="auto"``, ``planner_cluster="calibrate"``;
* a checkpoint written in the background (``async_save=True``) after one epoch and resumed: equal to
  the uninterrupted run of two epochs.

Skipped (module level) unless two CUDA devices are visible.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from checkpoint_helpers import NoisyToyModule
from distributed import run_ranks
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.distributed.tensor import DTensor
from toy import (
    INT8_RTOL,
    RunConfig,
    ToyModule,
    assert_compressed_run,
    assert_matches_reference,
    lm_loss,
    trainer_kwargs,
)

from lightning_mics import MiCSStrategy, ShardingSpec

#: ``MICS_MULTI_GPU_TEST_ON_CPU=4`` runs this file on 4 CPU ranks over gloo instead: a check of the test
#: itself on a machine without GPUs (the layouts' NCCL paths are what it cannot check there).
CPU_DRY_RUN = int(os.environ.get("MICS_MULTI_GPU_TEST_ON_CPU", "0"))
GPUS = CPU_DRY_RUN or (torch.cuda.device_count() if torch.cuda.is_available() else 0)
ACCELERATOR, BACKEND = ("cpu", "gloo") if CPU_DRY_RUN else ("cuda", "nccl")
pytestmark = [
    pytest.mark.distributed,
    pytest.mark.skipif(GPUS < 2, reason=f"needs >= 2 CUDA devices for NCCL across GPUs; {GPUS} visible"),
]

#: one rank per GPU; an even world so that every layout below divides it
WORLD = GPUS - GPUS % 2
HALF = max(WORLD // 2, 1)
CLIP = 0.5
CFG = RunConfig(world_size=max(WORLD, 2), accumulate=3, clip=CLIP)
#: fp32 on GPUs vs the CPU reference: same maths, other summation orders (as in test_cuda_path.py)
FP32_RTOL = 1e-4
BF16_WIRE_RTOL = 1e-2
#: the spawn trains ~9 tiny runs; NCCL start-up and compiling nothing: minutes at most
DEADLINE_SECONDS = 540

#: layout name -> MiCSStrategy keyword arguments, for the world this machine has
LAYOUTS: dict[str, dict[str, Any]] = {
    "2-hop sharded": {"partition_size": HALF},
    "2-hop unsharded": {"partition_size": HALF, "grad_accumulation": "unsharded"},
    "hierarchical": {"partition_size": WORLD, "ranks_per_node": HALF, "hierarchical": True},
    "bf16 hop 2": {"partition_size": HALF, "cross_replica_dtype": "bf16"},
    "int8 hop 2": {"partition_size": HALF, "cross_replica_dtype": "int8"},
    "amsp optimizer groups": {"sharding": ShardingSpec(params=HALF, grads=HALF, optim=WORLD)},
    "mics_auto calibrated": {
        "sharding": "auto",
        "grad_accumulation": "auto",
        "ranks_per_node": HALF,
        "planner_cluster": "calibrate",
    },
}
if WORLD >= 4:
    LAYOUTS["hpz"] = {"sharding": ShardingSpec(params=2, grads=4)}


def full_parameters(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Unsharded parameters, gathered by the job's own backend. ``toy.full_parameters`` gathers CUDA
    shards through host memory on a CPU mesh (gloo sharing a GPU crashed in ``full_tensor``), which a
    NCCL-only world cannot do: it has no backend for CPU tensors."""
    return {
        name: (p.full_tensor() if isinstance(p, DTensor) else p).detach().cpu().clone()
        for name, p in module.named_parameters()
    }


def _trainer(cfg: RunConfig, strategy: MiCSStrategy, **overrides: Any) -> pl.Trainer:
    kwargs = {**trainer_kwargs(cfg), "accelerator": ACCELERATOR, "devices": cfg.world_size, **overrides}
    return pl.Trainer(strategy=strategy, **kwargs)


def _nccl(**options: Any) -> MiCSStrategy:
    return MiCSStrategy(process_group_backend=BACKEND, **options)


class _NoisyOnDevice(NoisyToyModule):
    """``NoisyToyModule`` with its mask drawn by the device's RNG: resuming must restore CUDA RNG states."""

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        tokens, targets = batch
        dropped = torch.rand(tokens.shape, device=tokens.device) < 0.3
        self.steps_run += 1
        return lm_loss(self, (tokens.masked_fill(dropped, 0), targets))


def _resume(root: str) -> dict[str, Any]:
    """Two epochs uninterrupted vs one epoch, saved in the background, and resumed from ``last``."""
    cfg = RunConfig(world_size=CFG.world_size, steps=2)
    model = _NoisyOnDevice(cfg)
    _trainer(cfg, _nccl(partition_size=HALF), max_steps=-1, max_epochs=2).fit(model)
    results: dict[str, Any] = {"uninterrupted": full_parameters(model)}

    def checkpoints() -> list[ModelCheckpoint]:
        return [ModelCheckpoint(dirpath=Path(root, "checkpoints"), save_last=True, every_n_epochs=1)]

    for epochs, ckpt_path in ((1, None), (2, "last")):
        model = _NoisyOnDevice(cfg)
        trainer = _trainer(
            cfg,
            _nccl(partition_size=HALF, async_save=True),
            max_steps=-1,
            max_epochs=epochs,
            enable_checkpointing=True,
            callbacks=checkpoints(),
        )
        trainer.fit(model, ckpt_path=ckpt_path)
    results["resumed"] = {"params": full_parameters(model), "steps_run": model.steps_run}
    return results


def _train(rank: int, world: int, root: str) -> dict[str, Any]:
    if ACCELERATOR == "cuda":
        torch.cuda.set_device(rank)
    results: dict[str, Any] = {}
    for name, options in LAYOUTS.items():
        module = ToyModule(CFG)
        strategy = _nccl(**options)
        _trainer(CFG, strategy).fit(module)
        results[name] = {"params": full_parameters(module), "backend": strategy.process_group_backend}
    results["resume"] = _resume(root)
    return results


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    return run_ranks(_train, WORLD, str(tmp_path_factory.mktemp("multi_gpu")), timeout=DEADLINE_SECONDS)


def _params(runs: list[dict[str, Any]], name: str) -> list[dict[str, torch.Tensor]]:
    assert all(run[name]["backend"] == BACKEND for run in runs), name
    return [run[name]["params"] for run in runs]


#: replicas of each shard in the 2-hop layouts: rank r and r + HALF hold the same shard
REPLICAS = [[r, r + HALF] for r in range(HALF)]
CHECKS: dict[str, Callable[[list[dict[str, Any]]], None]] = {
    "bf16 hop 2": lambda runs: assert_compressed_run(
        _params(runs, "bf16 hop 2"), CFG, BF16_WIRE_RTOL, REPLICAS, runs[0]["2-hop sharded"]["params"]
    ),
    "int8 hop 2": lambda runs: assert_compressed_run(
        _params(runs, "int8 hop 2"), CFG, INT8_RTOL, REPLICAS, runs[0]["2-hop sharded"]["params"]
    ),
}


@pytest.mark.timeout(DEADLINE_SECONDS + 60)
@pytest.mark.parametrize("name", list(LAYOUTS))
def test_nccl_layout_matches_single_process(runs, name: str) -> None:
    check = CHECKS.get(name)
    if check is not None:
        check(runs)
    else:
        assert_matches_reference(_params(runs, name), CFG, rtol=FP32_RTOL)


@pytest.mark.timeout(DEADLINE_SECONDS + 60)
def test_async_save_and_resume_equals_the_uninterrupted_run(runs) -> None:
    for rank, run in enumerate(runs):
        resumed, uninterrupted = run["resume"]["resumed"], run["resume"]["uninterrupted"]
        assert resumed["steps_run"] == 2, rank  # it resumed after epoch 1 rather than starting over
        for name, value in uninterrupted.items():
            torch.testing.assert_close(resumed["params"][name], value, rtol=1e-6, atol=1e-7, msg=f"rank {rank} {name}")
