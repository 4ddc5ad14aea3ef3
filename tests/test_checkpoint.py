"""Sharded checkpoints: deduplication, layout metadata, resharding (other world size, other partition
size, one plain process), full-state files, consolidation, and one clear error per bad input."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from checkpoint_helpers import (
    STEPS_PER_EPOCH,
    TRAIN_CONFIG,
    Snapshot,
    WideModule,
    assert_same_tensors,
    fit_errors,
    load_and_snapshot,
    momentum_by_name,
    plain_toy_optimizer,
    write_reference_checkpoints,
)
from distributed import run_ranks
from toy import RunConfig, ToyLM, ToyModule

import lightning_mics
from lightning_mics import checkpoint as ckpt
from lightning_mics import consolidate
from lightning_mics.checkpoint.format import PARTIAL_MARK


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Any]]:
    """Checkpoints written by 4 ranks with partition size 2 (two replicas), and what they hold."""
    root = tmp_path_factory.mktemp("reference")
    states = run_ranks(write_reference_checkpoints, TRAIN_CONFIG.world_size, str(root))[0]
    return root, states


def _one_copy_bytes(state: Snapshot) -> int:
    return sum(t.numel() * t.element_size() for group in (state.params, state.momentum) for t in group.values())


@pytest.mark.distributed
def test_each_shard_written_once_and_replicas_share_the_writing(reference: tuple[Path, dict[str, Any]]) -> None:
    root, states = reference
    shard_files = {f: f.stat().st_size for f in (root / "wide").rglob("*.distcp")}
    on_disk = sum(shard_files.values())
    one_copy = _one_copy_bytes(states["wide"])
    print(f"\nwide model, 4 ranks / partition 2: {on_disk} bytes of shards for {one_copy} bytes of states")
    # two replicas of every shard exist in memory; without deduplication the files would hold 2x
    assert one_copy <= on_disk < 1.1 * one_copy
    # replicas share the load: ranks of both partition groups (0,1 and 2,3) wrote a real part
    writers = {int(f.name.split("_")[2]) for f, size in shard_files.items() if size > one_copy / 16}
    assert writers & {0, 1} and writers & {2, 3}, shard_files


@pytest.mark.distributed
def test_layout_that_wrote_it_is_recorded(reference: tuple[Path, dict[str, Any]]) -> None:
    root, _ = reference
    info = ckpt.inspect_checkpoint(root / "sharded")
    assert (info.kind, info.global_step, info.num_optimizers) == ("sharded", STEPS_PER_EPOCH, 1)
    assert info.layout == ckpt.CheckpointLayout(world_size=4, partition_size=2, ranks_per_node=4)
    record = json.loads((root / "sharded" / ckpt.MANIFEST_FILE).read_text())
    assert record["layout"]["partition_size"] == 2 and record["layout"]["world_size"] == 4
    full = ckpt.inspect_checkpoint(root / "full.ckpt")
    assert (full.kind, full.layout) == ("full", info.layout)


@pytest.mark.distributed
@pytest.mark.parametrize(("world_size", "partition_size"), [(2, 2), (4, 4)])
def test_reshard_onto_other_layouts(
    reference: tuple[Path, dict[str, Any]], world_size: int, partition_size: int
) -> None:
    """The sharded directory and the full file both load, bit-identical, under another layout."""
    root, states = reference
    paths = [str(root / "sharded"), str(root / "full.ckpt")]
    for loaded in run_ranks(load_and_snapshot, world_size, partition_size, paths)[0]:
        assert_same_tensors(loaded.params, states["toy"].params)
        assert_same_tensors(loaded.momentum, states["toy"].momentum)


def _load_plain_toy(path: Path) -> tuple[ToyModule, dict[str, torch.Tensor]]:
    """Load into an unsharded module and its optimizer, in this process (no torch.distributed)."""
    module = ToyModule(RunConfig())
    optimizer, names = plain_toy_optimizer(module)
    ckpt.load(path, module, [optimizer])
    return module, momentum_by_name(optimizer.state_dict(), names)


@pytest.mark.distributed
@pytest.mark.parametrize("name", ["sharded", "full.ckpt"])
def test_load_in_one_process_without_distributed(reference: tuple[Path, dict[str, Any]], name: str) -> None:
    root, states = reference
    assert not torch.distributed.is_initialized()
    module, momentum = _load_plain_toy(root / name)
    assert_same_tensors(dict(module.named_parameters()), states["toy"].params)
    assert_same_tensors(momentum, states["toy"].momentum)


@pytest.mark.distributed
@pytest.mark.parametrize("name", ["sharded", "full.ckpt"])
def test_load_from_checkpoint_takes_either_kind(reference: tuple[Path, dict[str, Any]], name: str) -> None:
    root, states = reference
    with pytest.raises(IsADirectoryError):  # why the helper exists: Lightning's classmethod opens one file
        ToyModule.load_from_checkpoint(root / "sharded", cfg=RunConfig())
    module = lightning_mics.load_from_checkpoint(ToyModule, root / name, cfg=RunConfig())
    assert isinstance(module, ToyModule) and not torch.distributed.is_initialized()
    assert_same_tensors(dict(module.named_parameters()), states["toy"].params)
    with pytest.raises(TypeError, match="pass a LightningModule"):
        lightning_mics.load_from_checkpoint(torch.nn.Linear, root / name)


def _consolidate_in_process(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str]:
    """``main(args)``'s exit code and stderr (a subprocess per call would cost seconds of imports)."""
    try:
        code = consolidate.main(list(args))
    except SystemExit as exit_:
        code = int(exit_.code or 0)
    return code, capsys.readouterr().err


@pytest.mark.distributed
def test_consolidation_cli_round_trip(
    reference: tuple[Path, dict[str, Any]], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    root, states = reference
    expected = states["toy"]
    weights, with_optimizer, inner = tmp_path / "weights.pt", tmp_path / "full.pt", tmp_path / "inner.pt"
    command = [sys.executable, "-m", "lightning_mics.consolidate", str(root / "sharded"), str(weights)]
    result = subprocess.run(command, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    for args in (
        [str(root / "sharded"), str(with_optimizer), "--with-optimizer"],
        [str(root / "sharded"), str(inner), "--strip-prefix", "model."],
    ):
        code, stderr = _consolidate_in_process(capsys, *args)
        assert code == 0, stderr

    module = ToyModule(RunConfig())
    module.load_state_dict(torch.load(weights, weights_only=True))  # strict: no wrapper prefixes
    assert_same_tensors(dict(module.named_parameters()), expected.params)

    full = torch.load(with_optimizer, weights_only=True)
    assert full["global_step"] == STEPS_PER_EPOCH and "loops" in full
    module = ToyModule(RunConfig())
    module.load_state_dict(full["state_dict"])
    optimizer, names = plain_toy_optimizer(module)
    optimizer.load_state_dict(full["optimizer_states"][0])
    assert_same_tensors(momentum_by_name(optimizer.state_dict(), names), expected.momentum)

    bare = ToyLM()
    bare.load_state_dict(torch.load(inner, weights_only=True))
    assert_same_tensors({f"model.{n}": p for n, p in bare.named_parameters()}, expected.params)

    # the consolidated full file is itself a checkpoint the loaders take
    _, momentum = _load_plain_toy(with_optimizer)
    assert_same_tensors(momentum, expected.momentum)


@pytest.mark.distributed
def test_consolidation_cli_bad_input(
    reference: tuple[Path, dict[str, Any]], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    root, _ = reference
    out = str(tmp_path / "out.pt")
    for source, fix in ((tmp_path / "nope", "No checkpoint at"), (root / "full.ckpt", "nothing to consolidate")):
        code, stderr = _consolidate_in_process(capsys, str(source), out)
        assert code == 2 and stderr.startswith("error: ") and fix in stderr, stderr
    assert not (tmp_path / "out.pt").exists()


@pytest.mark.distributed
def test_bad_checkpoints_given_to_fit(reference: tuple[Path, dict[str, Any]], tmp_path: Path) -> None:
    """Every bad ``ckpt_path`` fails ``fit`` with one error that names the problem (in every rank)."""
    root, _ = reference
    not_a_checkpoint = tmp_path / "notes"
    not_a_checkpoint.mkdir()
    (not_a_checkpoint / "readme.txt").write_text("hello")
    staging = tmp_path / f".last.ckpt{PARTIAL_MARK}0123abcd"
    uncommitted = tmp_path / "uncommitted.ckpt"
    for copy in (staging, uncommitted):
        subprocess.run(["cp", "-r", str(root / "sharded"), str(copy)], check=True)
    (uncommitted / ckpt.MANIFEST_FILE).unlink()
    bare_weights = tmp_path / "weights.pt"
    torch.save(ToyModule(RunConfig()).state_dict(), bare_weights)
    cases = {
        "missing": ("toy", str(tmp_path / "missing.ckpt")),
        "not a checkpoint": ("toy", str(not_a_checkpoint)),
        "staging dir": ("toy", str(staging)),
        "uncommitted": ("toy", str(uncommitted)),
        "other model, sharded": ("reshaped", str(root / "sharded")),
        "other model, full": ("reshaped", str(root / "full.ckpt")),
        "bare weights": ("toy", str(bare_weights)),
    }
    outcomes = run_ranks(fit_errors, 2, cases)
    assert outcomes[0] == outcomes[1]  # every rank fails the same way: none waits for the others
    errors = outcomes[0]
    assert errors["missing"].startswith("FileNotFoundError: No checkpoint at")
    assert errors["not a checkpoint"].startswith("CheckpointError") and "not a checkpoint" in errors["not a checkpoint"]
    assert "interrupted" in errors["staging dir"] and "never loaded" in errors["staging dir"]
    assert "incomplete" in errors["uncommitted"] and "no commit record" in errors["uncommitted"]
    for name in ("other model, sharded", "other model, full"):
        message = errors[name]
        assert message.startswith("CheckpointError") and "nothing was loaded" in message
        assert "missing in the checkpoint (2): extra.bias, extra.weight" in message
        assert "unexpected in the checkpoint (3): model.blocks.2.gate.weight, model.blocks.2.mix.bias" in message
        assert "model.head.weight: [11, 10] vs [12, 10]" in message
    assert "bare model weights" in errors["bare weights"] and "--with-optimizer" in errors["bare weights"]


class _Trap:
    """Unpickling this runs code (here: creates a file), as a malicious checkpoint would."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Any, ...]:
        return (Path(self.marker).touch, ())


def test_loading_never_unpickles_objects(tmp_path: Path) -> None:
    """A code-running object in a DCP entry (here the learning rate) or in a full file is refused by
    every loading path -- loading into a module, consolidating -- and its code never runs."""
    marker = tmp_path / "code-ran"
    module = ToyModule(RunConfig())
    optimizer, _ = plain_toy_optimizer(module)
    trapped_state = ckpt.optimizer_state_dict(module, optimizer)
    trapped_state["param_groups"][0]["lr"] = _Trap(str(marker))
    sharded = tmp_path / "trapped.ckpt"
    checkpoint = {"state_dict": ckpt.model_state_dict(module), "optimizer_states": [trapped_state], "global_step": 0}
    ckpt.save(sharded, checkpoint)
    full = tmp_path / "trapped.pt"
    torch.save({"state_dict": module.state_dict(), "trap": _Trap(str(marker))}, full)
    assert not marker.exists()

    for path in (sharded, full):
        fresh = ToyModule(RunConfig())
        with pytest.raises(ckpt.CheckpointError, match="refuses to unpickle"):
            ckpt.load(path, fresh, [plain_toy_optimizer(fresh)[0]])
    with pytest.raises(ckpt.CheckpointError, match="refuses to unpickle"):
        ckpt.read_full_state(sharded)
    assert not marker.exists()
    torch.load(full, weights_only=False)  # the trap does go off when unpickled
    assert marker.exists()


def test_files_that_are_not_checkpoints(tmp_path: Path) -> None:
    text = tmp_path / "notes.ckpt"
    text.write_text("not a checkpoint")
    tensor_list = tmp_path / "list.pt"
    torch.save([torch.zeros(1)], tensor_list)
    for path, message in ((text, "not a PyTorch checkpoint file"), (tensor_list, "not a checkpoint")):
        with pytest.raises(ckpt.CheckpointError, match=message):
            ckpt.load(path, ToyModule(RunConfig()))


def test_saving_over_a_directory_that_is_not_a_checkpoint_is_refused(tmp_path: Path) -> None:
    precious = tmp_path / "data"
    precious.mkdir()
    (precious / "results.csv").write_text("1,2,3")
    module = WideModule()
    with pytest.raises(ckpt.CheckpointError, match="Nothing was written"):
        ckpt.save(precious, {"state_dict": ckpt.model_state_dict(module), "global_step": 0})
    assert sorted(p.name for p in precious.iterdir()) == ["results.csv"]
    assert [p.name for p in tmp_path.iterdir()] == ["data"]  # no staging left behind


def _weights_only_checkpoint_then_evaluate(rank: int, world: int, directory: str) -> dict[str, float]:
    from lightning.pytorch.callbacks import ModelCheckpoint
    from lm_jobs import fit_small_gpt, quick_trainer, small_datamodule

    from lightning_mics import MiCSStrategy

    weights_only = ModelCheckpoint(dirpath=directory, save_weights_only=True, every_n_train_steps=2)
    trainer = quick_trainer(
        world, MiCSStrategy(partition_size=2), 2, callbacks=[weights_only], enable_checkpointing=True,
        limit_test_batches=2, limit_val_batches=2,
    )
    model = fit_small_gpt(trainer)
    # after fit the strategy still holds the fit's optimizers: evaluation must not want their state
    # (the checkpoint has none) nor write it (test/validate run under inference mode)
    tested = trainer.test(model, datamodule=small_datamodule(), ckpt_path=weights_only.last_model_path or "best",
                          verbose=False)
    validated = trainer.validate(model, datamodule=small_datamodule(), ckpt_path="best", verbose=False)
    return {"test": float(tested[0]["test/loss"]), "val": float(validated[0]["val/loss"])}


@pytest.mark.distributed
def test_evaluation_loads_a_weights_only_checkpoint_after_fit(tmp_path: Path) -> None:
    results = run_ranks(_weights_only_checkpoint_then_evaluate, 2, str(tmp_path / "ckpts"))
    assert results[0] == results[1]  # synced metrics: one model, one answer
    assert all(0 < value < 10 for value in results[0].values()), results[0]
