"""Buffers (BatchNorm running statistics) are one model's: without a sync the ranks' copies differ; with
``buffer_sync`` (broadcast or average) the checkpoint, evaluated in one process, gives the logged validation loss,
under the Trainer and Fabric; only persistent buffers are synced, each once.

Buffers are not sharded: every rank keeps and updates its own copy from its own data, so the copies
drift apart, and DCP deduplicates a replicated tensor by picking one writer per tensor -- without a
sync, a checkpoint mixes ranks' ``running_mean``/``running_var``. Four CPU ranks (partition 2), each
seeing different data, fit a small CNN with BatchNorm and save (Trainer, then Fabric); this process
then loads each checkpoint into a plain model and checks it against what the ranks logged and held.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from checkpoint_helpers import assert_same_tensors
from distributed import run_ranks
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, TensorDataset
from test_fabric import launch
from toy import RunConfig, trainer_kwargs

from lightning_mics import MiCSStrategy
from lightning_mics import checkpoint as ckpt
from lightning_mics.buffer_sync import persistent_buffers, sync_buffers

WORLD_SIZE, MICRO_BATCH, STEPS, VAL_BATCHES_PER_RANK = 4, 4, 3, 2
CHANNELS, CLASSES, SIDE = 8, 4, 6


class ConvBlock(nn.Module):
    def __init__(self, in_channels: int, out_channels: int) -> None:
        super().__init__()
        self.conv = nn.Conv2d(in_channels, out_channels, 3, padding=1, bias=False)
        self.norm = nn.BatchNorm2d(out_channels)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.relu(self.norm(self.conv(x)))


class BatchNormCNN(pl.LightningModule):
    """Two conv + BatchNorm blocks (an ``nn.ModuleList``: each its own FSDP unit) and a linear head."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.blocks = nn.ModuleList([ConvBlock(3, CHANNELS), ConvBlock(CHANNELS, CHANNELS)])
        self.head = nn.Linear(CHANNELS, CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.head(x.mean(dim=(2, 3)))

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        inputs, labels = batch
        return F.cross_entropy(self(inputs), labels)

    def validation_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        inputs, labels = batch
        self.log("val_loss", F.cross_entropy(self(inputs), labels), sync_dist=True, batch_size=len(labels))

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(images(WORLD_SIZE * MICRO_BATCH * STEPS, seed=1), batch_size=MICRO_BATCH)

    def val_dataloader(self) -> DataLoader:
        return DataLoader(validation_images(), batch_size=MICRO_BATCH)


def images(num_samples: int, seed: int) -> TensorDataset:
    """Images whose brightness grows with the sample index, so that the ranks' shares (Lightning's
    ``DistributedSampler`` deals samples out) have clearly different BatchNorm statistics."""
    generator = torch.Generator().manual_seed(seed)
    brightness = torch.linspace(-2.0, 2.0, num_samples).view(-1, 1, 1, 1)
    inputs = torch.randn(num_samples, 3, SIDE, SIDE, generator=generator) * (1.5 + brightness) + brightness
    return TensorDataset(inputs, torch.randint(0, CLASSES, (num_samples,), generator=generator))


def validation_images() -> TensorDataset:
    return images(WORLD_SIZE * MICRO_BATCH * VAL_BATCHES_PER_RANK, seed=2)


def buffers_of(module: nn.Module) -> dict[str, torch.Tensor]:
    return {name: buffer.detach().clone() for name, buffer in module.named_buffers()}


class RecordBuffersBeforeSync(Callback):
    """Each rank's own buffers right before the strategy syncs them: at the start of validation
    (callbacks run before the strategy's hook), and after each training batch (without validation,
    ``ModelCheckpoint`` saves at the epoch end that follows the last one, with no sync between)."""

    def __init__(self) -> None:
        self.before_validation: dict[str, torch.Tensor] = {}
        self.after_last_batch: dict[str, torch.Tensor] = {}

    def on_validation_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.before_validation = buffers_of(pl_module)

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        self.after_last_batch = buffers_of(pl_module)


#: case -> (buffer_sync, save_full_state_dict, validate). ModelCheckpoint saves once, at the end of the
#: epoch: after the validation when there is one (the ranks' buffers were synced at its start), else
#: right after the last training step, so that only the sync at save time can make them equal.
CASES: dict[str, tuple[str, bool, bool]] = {
    "broadcast": ("broadcast", False, True),
    "average": ("average", False, True),
    "none": ("none", False, True),
    "average_full_no_validation": ("average", True, False),
}


def fit_and_save_each_case(rank: int, world_size: int, root: str) -> dict[str, dict[str, Any]]:
    results = {}
    for case, (buffer_sync, full, validate) in CASES.items():
        recorder = RecordBuffersBeforeSync()
        checkpoint = ModelCheckpoint(dirpath=Path(root) / case, filename="model")
        strategy = MiCSStrategy(partition_size=2, ranks_per_node=2, buffer_sync=buffer_sync, save_full_state_dict=full)
        kwargs = trainer_kwargs(RunConfig(world_size=world_size, steps=STEPS))
        kwargs.update(enable_checkpointing=True, max_steps=-1, max_epochs=1)
        kwargs.update(limit_val_batches=VAL_BATCHES_PER_RANK if validate else 0)
        trainer = pl.Trainer(strategy=strategy, callbacks=[recorder, checkpoint], **kwargs)
        module = BatchNormCNN()
        trainer.fit(module)
        results[case] = {
            "path": checkpoint.best_model_path,
            "val_loss": float(trainer.callback_metrics["val_loss"]) if validate else None,
            "before_sync": recorder.before_validation if validate else recorder.after_last_batch,
            "after_fit": buffers_of(module),
        }
    results["fabric_average"] = fabric_train_and_save(Path(root) / "fabric")
    return results


def fabric_train_and_save(path: Path) -> dict[str, Any]:
    """The Fabric strategy, ``buffer_sync="average"``: ``fabric.save`` syncs before taking the state."""
    fabric = launch(partition_size=2, buffer_sync="average")
    module = BatchNormCNN()
    model, optimizer = fabric.setup(module, module.configure_optimizers())
    for inputs, labels in fabric.setup_dataloaders(module.train_dataloader()):  # each rank its own share
        fabric.backward(F.cross_entropy(model(inputs), labels))
        optimizer.step()
        optimizer.zero_grad()
    before_sync = buffers_of(module)
    fabric.save(path, {"model": model, "optimizer": optimizer})
    after_save = buffers_of(module)
    fabric.strategy.sync_buffers(model)  # the public call, given the model fabric.setup returned
    return {"path": str(path), "before_sync": before_sync, "after_fit": after_save}


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, dict[str, Any]]]:
    """One spawn of four ranks runs every case."""
    return run_ranks(fit_and_save_each_case, WORLD_SIZE, str(tmp_path_factory.mktemp("buffers")))


def load_in_one_process(path: str) -> BatchNormCNN:
    assert not torch.distributed.is_initialized()
    model = BatchNormCNN()
    ckpt.load(path, model)
    return model.eval()


def single_process_val_loss(model: BatchNormCNN) -> float:
    inputs, labels = validation_images().tensors
    with torch.no_grad():
        return float(F.cross_entropy(model(inputs), labels))


def mean_over_ranks(per_rank: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """What ``buffer_sync="average"`` gives: floating buffers averaged, integer ones rank 0's."""
    return {
        name: torch.stack([buffers[name] for buffers in per_rank]).mean(0) if value.is_floating_point() else value
        for name, value in per_rank[0].items()
    }


@pytest.mark.distributed
def test_without_a_sync_the_ranks_buffers_differ(ranks: list[dict[str, dict[str, Any]]]) -> None:
    """The premise: each rank's data gives it other running statistics, so the other cases test something."""
    final = [rank["none"]["after_fit"] for rank in ranks]
    for name, value in final[0].items():
        if value.is_floating_point():
            assert all(not torch.allclose(value, other[name], rtol=1e-3) for other in final[1:]), name
    before = [rank["broadcast"]["before_sync"] for rank in ranks]
    assert not torch.allclose(before[0]["blocks.0.norm.running_mean"], before[1]["blocks.0.norm.running_mean"])


@pytest.mark.distributed
@pytest.mark.parametrize("case", ["broadcast", "average"])
def test_checkpoint_evaluated_in_one_process_gives_the_logged_val_loss(
    ranks: list[dict[str, dict[str, Any]]], case: str
) -> None:
    logged = ranks[0][case]["val_loss"]
    assert all(rank[case]["val_loss"] == logged for rank in ranks)
    model = load_in_one_process(ranks[0][case]["path"])
    assert single_process_val_loss(model) == pytest.approx(logged, rel=1e-5)


@pytest.mark.distributed
def test_broadcast_saves_and_keeps_rank_zeros_buffers(ranks: list[dict[str, dict[str, Any]]]) -> None:
    rank_zero = ranks[0]["broadcast"]["before_sync"]
    assert_same_tensors(buffers_of(load_in_one_process(ranks[0]["broadcast"]["path"])), rank_zero)
    for rank in ranks:  # the live model too: every rank holds rank 0's buffers after fit
        assert_same_tensors(rank["broadcast"]["after_fit"], rank_zero)


@pytest.mark.distributed
@pytest.mark.parametrize("case", ["average", "average_full_no_validation", "fabric_average"])
def test_average_saves_and_keeps_the_mean_over_ranks(ranks: list[dict[str, dict[str, Any]]], case: str) -> None:
    """Sharded after a validation; full-state right after a training step (no validation: only the
    sync at save time can have averaged them); ``fabric.save``."""
    expected = mean_over_ranks([rank[case]["before_sync"] for rank in ranks])
    saved = buffers_of(load_in_one_process(ranks[0][case]["path"]))
    assert sorted(saved) == sorted(expected)
    for name, value in expected.items():
        torch.testing.assert_close(saved[name], value, rtol=1e-6, atol=1e-7, msg=lambda m: f"{name}: {m}")
        if value.is_floating_point():  # not rank 0's own: the mean was taken
            assert not torch.allclose(value, ranks[0][case]["before_sync"][name], rtol=1e-3), name
    for rank in ranks:
        assert_same_tensors(rank[case]["after_fit"], ranks[0][case]["after_fit"])


def test_only_persistent_buffers_are_synced_each_once() -> None:
    """What a checkpoint holds: non-persistent buffers (caches rebuilt from constants) are left alone,
    a buffer shared by two modules is one tensor; without torch.distributed nothing is synced."""
    shared = nn.BatchNorm1d(3)
    model = nn.Sequential(shared, shared, nn.BatchNorm1d(2))
    model.register_buffer("cache", torch.zeros(4), persistent=False)
    expected = [shared.running_mean, shared.running_var, shared.num_batches_tracked]
    expected += [model[2].running_mean, model[2].running_var, model[2].num_batches_tracked]
    assert [id(b) for b in persistent_buffers(model)] == [id(b) for b in expected]
    assert sync_buffers(model, "average") == 0
    with pytest.raises(ValueError, match="buffer_sync='mean' is not one of"):
        sync_buffers(model, "mean")  # type: ignore[arg-type]
