"""Every rank starts from the same model even when the ranks create it differently, as with DDP: with
``sync_module_states`` training equals single-process training from rank 0's model, without it the replicas diverge,
and meta-device models get agreeing replicas only with it.

Each rank seeds its model with its own rank (rank 0's seed is the reference's). With
``sync_module_states`` (the default) training equals single-process training from rank 0's model;
without it the two partitions shard different models and their replicas never agree -- the silent
divergence the option prevents. Meta-device models, initialised shard by shard from each rank's own
random state, get agreeing replicas too.

4 ranks as 2 nodes x 2, partition 2: replicas {0, 2} and {1, 3}.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from distributed import run_ranks
from toy import RunConfig, ToyModule, assert_matches_reference, fit_with_mics, full_parameters, trainer_kwargs

from lightning_mics import MiCSStrategy

pytestmark = pytest.mark.distributed  # every test here spawns rank processes

CFG = RunConfig(world_size=4, accumulate=2, steps=2)
LAYOUT = {"partition_size": 2, "ranks_per_node": 2}


def _fit_meta(rank: int, sync: bool) -> dict[str, torch.Tensor]:
    trainer = pl.Trainer(strategy=MiCSStrategy(sync_module_states=sync, **LAYOUT), **trainer_kwargs(CFG))
    with trainer.init_module(empty_init=True):
        module = ToyModule(CFG)
    torch.manual_seed(100 + rank)  # each rank materialises its shard from its own random state
    trainer.fit(module)
    return full_parameters(module)


def _runs(rank: int, world_size: int) -> dict[str, Any]:
    own_seed = replace(CFG, seed=rank)
    synced, unsynced = ToyModule(own_seed), ToyModule(own_seed)
    fit_with_mics(synced, CFG, **LAYOUT)
    fit_with_mics(unsynced, CFG, sync_module_states=False, **LAYOUT)
    return {
        "synced": full_parameters(synced),
        "unsynced": full_parameters(unsynced),
        "meta synced": _fit_meta(rank, sync=True),
        "meta unsynced": _fit_meta(rank, sync=False),
    }


@pytest.fixture(scope="module")
def runs() -> list[dict[str, Any]]:
    return run_ranks(_runs, CFG.world_size)


def _same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return all(torch.equal(a[name], b[name]) for name in a)


def test_ranks_that_create_different_models_train_rank_zeros(runs) -> None:
    assert_matches_reference([run["synced"] for run in runs], CFG)


def test_without_sync_the_replicas_diverge(runs) -> None:
    assert _same(runs[0]["unsynced"], runs[1]["unsynced"])  # one partition gathers one model
    assert not _same(runs[0]["unsynced"], runs[2]["unsynced"])  # the other partition trained another


@pytest.mark.parametrize("sync", [True, False])
def test_meta_device_replicas_agree_only_with_sync(runs, sync: bool) -> None:
    key = "meta synced" if sync else "meta unsynced"
    agree = [_same(runs[0][key], run[key]) for run in runs[1:]]
    assert agree == ([True] * 3 if sync else [True, False, False])
