"""Resuming: exact equivalence with an uninterrupted run, atomic saves, and a rank SIGKILLed mid-save."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any, Callable, Optional

import pytest
import torch
from checkpoint_helpers import (
    SCENARIO_EPOCHS,
    SCENARIO_TIMEOUT,
    STEPS_PER_EPOCH,
    TRAIN_CONFIG,
    VICTIM_RANK,
    WideModule,
    assert_same_tensors,
    launch_ranks,
    resume_scenarios,
)
from distributed import run_ranks
from lightning.pytorch.callbacks import ModelCheckpoint

from lightning_mics import checkpoint as ckpt
from lightning_mics.checkpoint import atomic, saving


@pytest.mark.distributed
@pytest.mark.parametrize("async_save", [False, True], ids=["sync", "async"])
def test_resumed_run_equals_uninterrupted_run(tmp_path: Path, async_save: bool) -> None:
    """Stopped after one epoch and resumed -- from ``ckpt_path="last"`` and from an explicit
    ``trainer.save_checkpoint`` path -- training with random input masking reaches bit-identical
    parameters (model, optimizer, loops and every rank's RNG restored), also when checkpoints are
    written in the background while training goes on."""
    results = run_ranks(resume_scenarios, TRAIN_CONFIG.world_size, str(tmp_path), async_save)[0]
    for name in ("via_last", "via_path"):
        resumed = results[name]
        assert resumed["global_step"] == 2 * STEPS_PER_EPOCH
        assert resumed["steps_run"] == STEPS_PER_EPOCH  # it resumed rather than started over
        assert_same_tensors(resumed["params"], results["uninterrupted"])


class _KilledHere(BaseException):
    """Stands in for a kill: nothing after it runs, not even ``except Exception`` cleanup."""


def _save_wide(path: Path, module: WideModule, step: int, saver: Optional[ckpt.AsyncCheckpointSaver] = None) -> None:
    """Save (and with a background ``saver``, wait for the save to finish)."""
    ckpt.save(path, {"state_dict": ckpt.model_state_dict(module), "global_step": step}, saver=saver)
    if saver is not None:
        saver.wait()


def _kill_during_dcp_write(monkeypatch: pytest.MonkeyPatch) -> None:
    original = saving.dcp.save

    def write_then_die(*args: Any, **kwargs: Any) -> Any:
        original(*args, **kwargs)  # the shards are on disk, the save is not committed
        raise _KilledHere

    monkeypatch.setattr(saving.dcp, "save", write_then_die)


def _kill_before_commit(monkeypatch: pytest.MonkeyPatch) -> None:
    def die(*args: Any, **kwargs: Any) -> None:
        raise _KilledHere

    monkeypatch.setattr(atomic, "commit_sharded", die)


def _kill_after_new_data_is_in_place(monkeypatch: pytest.MonkeyPatch) -> None:
    """Update mode: the new data directory is renamed into the checkpoint, the record not yet switched."""
    original = atomic.write_durably

    def die_on_record(path: Path, data: bytes) -> None:
        if path.name == ckpt.MANIFEST_FILE:
            raise _KilledHere
        original(path, data)

    monkeypatch.setattr(atomic, "write_durably", die_on_record)


@pytest.mark.parametrize("background", [False, True], ids=["sync", "async"])
@pytest.mark.parametrize(
    "kill", [_kill_during_dcp_write, _kill_before_commit, _kill_after_new_data_is_in_place], ids=lambda f: f.__name__
)
def test_save_killed_midway_leaves_previous_checkpoint(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, kill: Callable[[pytest.MonkeyPatch], None], background: bool
) -> None:
    """A first save and an overwrite, each killed midway: the path holds the previous checkpoint
    (or nothing), "last" never finds the staging data, and the next save cleans it up."""
    saver = ckpt.AsyncCheckpointSaver() if background else None
    module = WideModule()
    previous = {name: value.clone() for name, value in module.state_dict().items()}
    last, first = tmp_path / "last.ckpt", tmp_path / "first.ckpt"
    _save_wide(last, module, step=1)
    with torch.no_grad():
        for param in module.parameters():
            param.add_(1.0)
    newer = {name: value.clone() for name, value in module.state_dict().items()}

    with monkeypatch.context() as patch:
        kill(patch)
        for path in (last, first):
            with pytest.raises(_KilledHere):
                _save_wide(path, module, step=2, saver=saver)

    assert ckpt.inspect_checkpoint(last).global_step == 1
    reloaded = WideModule()
    ckpt.load(last, reloaded)
    assert_same_tensors(reloaded.state_dict(), previous)
    with pytest.raises(FileNotFoundError, match="interrupted save left incomplete data"):
        ckpt.inspect_checkpoint(first)
    finder = ModelCheckpoint(dirpath=tmp_path)
    assert finder._find_last_checkpoints(trainer=None) == {str(last)}  # type: ignore[arg-type]

    for path in (last, first):
        _save_wide(path, module, step=3, saver=saver)
        assert atomic.staging_leftovers(path) == []
        reloaded = WideModule()
        ckpt.load(path, reloaded)
        assert_same_tensors(reloaded.state_dict(), newer)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["first.ckpt", "last.ckpt"]


@pytest.mark.distributed
@pytest.mark.parametrize("mode", ["sync", "async"])
def test_rank_sigkilled_mid_save_exits_and_resumes_from_last(tmp_path: Path, mode: str) -> None:
    """One rank of four is SIGKILLed while writing the second ``last.ckpt`` (``async``: in its
    background checkpoint thread). The others must fail (non-zero) well within the collective
    timeout instead of hanging; the previous ``last.ckpt`` stays intact, and
    ``fit(ckpt_path="last")`` finishes with exactly the uninterrupted parameters."""
    deadline = 3 * SCENARIO_TIMEOUT.total_seconds() + 60  # startup + training + one timeout, generously
    started = time.monotonic()
    codes = launch_ranks(f"interrupted:{mode}", tmp_path, TRAIN_CONFIG.world_size, deadline)
    elapsed = time.monotonic() - started
    assert None not in codes, f"ranks still running after {deadline}s (hang): {codes}"
    assert codes[VICTIM_RANK] == -9
    assert all(code != 0 for code in codes), codes
    print(f"\ninterrupted run: exit codes {codes} after {elapsed:.0f}s")

    last = tmp_path / "checkpoints" / "last.ckpt"
    assert ckpt.inspect_checkpoint(last).global_step == STEPS_PER_EPOCH  # the first save, intact
    assert atomic.staging_leftovers(last), "the killed save should have left (ignored) staging data"

    codes = launch_ranks(f"resume:{mode}", tmp_path, TRAIN_CONFIG.world_size, deadline)
    assert codes == [0] * TRAIN_CONFIG.world_size, _logs(tmp_path, "resume")
    resumed = torch.load(tmp_path / "resume.pt", weights_only=True)
    assert resumed["steps_run"] == (SCENARIO_EPOCHS - 1) * STEPS_PER_EPOCH
    assert_same_tensors(resumed["params"], torch.load(tmp_path / "uninterrupted.pt", weights_only=True))
    assert atomic.staging_leftovers(last) == []  # the resumed run's saves cleaned up


def _logs(root: Path, scenario: str) -> str:
    return "\n".join(p.read_text()[-3000:] for p in sorted(root.glob(f"{scenario}-rank*.log")))
