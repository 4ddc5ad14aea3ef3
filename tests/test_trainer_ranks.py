"""What a script reads from the Trainer before ``fit``: ranks, world size, node rank and ``is_global_zero``
equal to DDP's from construction on, for every registered name and the class -- under Lightning's own
launcher (the process that builds the Trainer is rank 0 of its node), a launched rank (``LOCAL_RANK`` /
``NODE_RANK``, as Lightning's launcher and multi-node jobs set them), torchrun and SLURM.

Scripts size data or learning rates by ``trainer.world_size`` and guard downloads with
``if trainer.is_global_zero:`` before ``fit``; MiCS once reported ``world_size == 1`` and rank 0 on every
launched rank until ``fit``. Construction only: no process is started.
"""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import pytest

from lightning_mics import MiCSStrategy

#: every way to ask for MiCS, against DDP
STRATEGIES = ["mics", "mics_auto", "mics_zero3", "mics_replicate", "class"]

LAUNCHED_RANK = {"LOCAL_RANK": "2", "NODE_RANK": "1"}
TORCHRUN = {
    "RANK": "5", "LOCAL_RANK": "1", "WORLD_SIZE": "8", "LOCAL_WORLD_SIZE": "4", "GROUP_RANK": "1",
    "TORCHELASTIC_RUN_ID": "test", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29555",
}
SLURM = {
    "SLURM_NTASKS": "8", "SLURM_NTASKS_PER_NODE": "4", "SLURM_PROCID": "6", "SLURM_LOCALID": "2", "SLURM_NODEID": "1",
    "SLURM_JOB_NAME": "train", "SLURM_JOB_ID": "1234", "SLURM_NODELIST": "node[1-2]", "MASTER_PORT": "29556",
}
ENVIRONMENTS = {"single process": ({}, 1), "launched rank": (LAUNCHED_RANK, 2), "torchrun": (TORCHRUN, 2),
                "slurm": (SLURM, 2)}
_CLEARED = sorted({*LAUNCHED_RANK, *TORCHRUN, *SLURM, "SLURM_NNODES", "JSM_NAMESPACE_SIZE", "PMI_SIZE"})


def _observed(strategy: Any, num_nodes: int) -> tuple[Any, ...]:
    trainer = pl.Trainer(accelerator="cpu", devices=4, num_nodes=num_nodes, strategy=strategy, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    return (trainer.world_size, trainer.global_rank, trainer.local_rank, trainer.node_rank, trainer.num_devices,
            trainer.num_nodes, trainer.is_global_zero)


@pytest.mark.parametrize("environment", list(ENVIRONMENTS))
@pytest.mark.parametrize("name", STRATEGIES)
def test_ranks_at_construction_equal_ddps(monkeypatch: pytest.MonkeyPatch, name: str, environment: str) -> None:
    for variable in _CLEARED:
        monkeypatch.delenv(variable, raising=False)
    variables, num_nodes = ENVIRONMENTS[environment]
    for variable, value in variables.items():
        monkeypatch.setenv(variable, value)
    ddp = _observed("ddp", num_nodes)
    mics = _observed(MiCSStrategy(partition_size=2) if name == "class" else name, num_nodes)
    assert mics == ddp, (name, environment)
    if environment != "single process":  # the point: not rank 0 of a world of 1
        assert mics[0] == 8 and mics[1] != 0 and mics[-1] is False, mics
