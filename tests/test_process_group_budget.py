"""Process groups are a budget: on 4 ranks every layout (plain, hierarchical, hpZ, AMSP, a bf16 hop 2) ends ``fit``
with the same groups for 2 and 12 FSDP blocks, as many as its layout log states; calibration leaves none behind, and
each mesh dimension gets its own backend options object.

Before the shared post-forward mesh, hpZ (``ShardingSpec(params=2, grads=4)``, 4 gloo ranks) ended
``trainer.fit`` with 5 process groups for 2 blocks and 25 for 12: ``fully_shard`` built a mesh of two
groups for every block. One spawned run of 4 ranks (emulating 2 nodes of 2) measures every layout
for 2 and 12 blocks, and the calibration probes, so that the whole file costs one spawn.
"""

from __future__ import annotations

import tempfile
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from distributed import kill_ranks, start_ranks
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_mics import _compat as compat
from lightning_mics import process_groups
from lightning_mics.topology import MiCSTopology

WORLD, RANKS_PER_NODE = 4, 2
BLOCKS = (2, 12)
#: layout name -> MiCSStrategy keyword arguments ("spec" entries become ShardingSpec(*degrees))
LAYOUTS: dict[str, dict[str, Any]] = {
    "hpz": {"spec": (2, 4)},  # 1 < params < grads: the post-forward mesh (the case, 4 ranks in one node)
    "plain": {"partition_size": 2, "ranks_per_node": RANKS_PER_NODE},
    "hierarchical": {"partition_size": 4, "ranks_per_node": RANKS_PER_NODE},
    "amsp-optimizer-groups": {"spec": (2, 2, 4), "ranks_per_node": RANKS_PER_NODE},
    "compressed-hop-2": {"partition_size": 2, "ranks_per_node": RANKS_PER_NODE, "cross_replica_dtype": "bf16"},
    "hpz-across-nodes": {"spec": (2, 4, 4), "ranks_per_node": RANKS_PER_NODE},  # hierarchical and hpZ together
}
#: the whole spawned run normally takes ~25 s on 2 cores; past this something hangs
DEADLINE_SECONDS = 300


class Blocks(pl.LightningModule):
    """``n`` tiny blocks in an ``nn.ModuleList``: one FSDP unit each."""

    def __init__(self, n: int) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.blocks = nn.ModuleList(nn.Linear(8, 8) for _ in range(n))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = torch.tanh(block(x))
        return x

    def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor:
        return self(batch[0]).pow(2).mean()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(TensorDataset(torch.randn(4 * WORLD, 8)), batch_size=2)


def _fit(layout: str, blocks: int) -> dict[str, Any]:
    """Fit ``blocks`` blocks on ``layout`` for one step: the groups the fit created, what the layout
    says it created, its log text, and the post-forward mesh every block reshards to."""
    from lightning_mics import MiCSStrategy, ShardingSpec

    kwargs = dict(LAYOUTS[layout])
    if "spec" in kwargs:
        kwargs["sharding"] = ShardingSpec(*kwargs.pop("spec"))
    strategy = MiCSStrategy(**kwargs)
    trainer = pl.Trainer(
        strategy=strategy, accelerator="cpu", devices=WORLD, max_steps=1, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
    )  # fmt: skip
    module = Blocks(blocks)
    before = compat.process_group_count()
    trainer.fit(module)
    infos = [compat.fsdp_param_groups(block)[0].post_forward_mesh_info for block in module.blocks]
    post_forward_groups = {id(info.shard_process_group) for info in infos if info is not None}
    return {
        "created": compat.process_group_count() - before,
        "after_fit": compat.process_group_count(),
        "layout_says": strategy.layout.process_groups,
        "log": strategy.layout.describe(module, blocks + 1),
        "post_forward_groups": len(post_forward_groups),  # the groups blocks re-gather on in backward
        "hpz_shares_one_mesh": all(info is infos[0] for info in infos),
        "post_forward_size": None if infos[0] is None else infos[0].shard_mesh_size,
    }


def _measure(rank: int, world_size: int) -> dict[str, Any]:
    from lightning_mics.planner import calibrate_cluster

    torch.distributed.init_process_group("gloo")  # the world first, so every fit counts only its own groups
    results: dict[str, Any] = {}
    # first, while this process holds no group of an earlier layout: the absolute numbers
    for blocks in BLOCKS:
        results[("hpz", blocks)] = _fit("hpz", blocks)
    before = compat.process_group_count()
    calibrate_cluster(MiCSTopology.create(world_size, RANKS_PER_NODE, 1), payload_bytes=(1 << 10, 1 << 12), repeats=1)
    results["calibration_left"] = compat.process_group_count() - before
    for layout in LAYOUTS:
        if layout != "hpz":
            for blocks in BLOCKS:
                results[(layout, blocks)] = _fit(layout, blocks)
    return results


def _run_ranks_within(seconds: float) -> list[dict[str, Any]]:
    """``distributed.run_ranks(_measure, WORLD)``, but failing (and killing the ranks it started) when
    they are not done within ``seconds``: a hung collective must not hang the suite."""
    with tempfile.TemporaryDirectory() as out_dir:
        context = start_ranks(_measure, WORLD, out_dir, ())
        deadline = time.monotonic() + seconds
        try:
            while not context.join(timeout=5):
                if time.monotonic() > deadline:
                    pytest.fail(f"the process-group measurement did not finish within {seconds} s")
        finally:
            kill_ranks(context)
        return [torch.load(Path(out_dir) / f"rank{r}.pt", weights_only=False) for r in range(WORLD)]


@pytest.fixture(scope="module")
def runs() -> list[dict[str, Any]]:
    return _run_ranks_within(DEADLINE_SECONDS)


@pytest.mark.distributed
def test_hpz_group_count_after_fit_does_not_grow_with_blocks(runs):
    for rank, run in enumerate(runs):
        two, twelve = run[("hpz", 2)], run[("hpz", 12)]
        # the first fit of the process: the default group plus the one post-forward mesh (2 groups);
        # before the fix, 5 with 2 blocks and 25 with 12
        assert two["after_fit"] == 3, (rank, two)
        assert twelve["created"] == two["created"], (rank, two, twelve)
        assert twelve["hpz_shares_one_mesh"] and twelve["post_forward_size"] == 2, (rank, twelve)


@pytest.mark.distributed
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_group_count_does_not_grow_with_blocks_and_the_layout_log_states_it(runs, layout):
    for rank, run in enumerate(runs):
        two, twelve = run[(layout, 2)], run[(layout, 12)]
        assert two["created"] == twelve["created"], (rank, layout, two["created"], twelve["created"])
        # every group the fit created is one the layout counted, and the log says how many
        for result in (two, twelve):
            assert result["layout_says"] == result["created"], (rank, layout, result)
            assert f"{result['created']} process groups created by this layout" in result["log"], result["log"]
            assert result["post_forward_groups"] == 1, (rank, layout, result)


@pytest.mark.distributed
def test_calibration_leaves_no_group(runs):
    assert [run["calibration_left"] for run in runs] == [0] * WORLD


@pytest.mark.parametrize("backend", ["gloo", "nccl"])
def test_each_mesh_dimension_gets_its_own_options_object(monkeypatch, backend):
    """NCCL's split writes into the options it is given: the two dimensions must not share one object."""
    if compat.backend_options(backend, timedelta(seconds=1)) is None:
        pytest.skip(f"this torch build has no {backend} options class")
    seen: dict[str, Any] = {}
    monkeypatch.setattr(process_groups, "init_device_mesh", lambda *args, **kwargs: seen.update(kwargs))
    topology = MiCSTopology.create(WORLD, RANKS_PER_NODE, 2)
    process_groups.build_device_mesh(topology, "cpu", backend, timedelta(seconds=7))
    overrides = seen["backend_override"]
    (_, replicate), (_, shard) = overrides[process_groups.REPLICATE_DIM], overrides[process_groups.SHARD_DIM]
    assert replicate is not shard
    assert replicate._timeout == shard._timeout == timedelta(seconds=7)
