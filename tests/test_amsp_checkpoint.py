"""Checkpoints with AMSP optimizer-state sharding (``optim > grads``): the user's optimizer steps on
slices of the parameter shards, yet a checkpoint holds the states at the partition degree, in the
same format as plain MiCS. So it resumes bit-identically in its own layout, crosses to and from plain
MiCS, and consolidates to the same ``torch.optim`` states.

4 ranks on one node: partition 2, optimizer states sharded 4 ways (across both replicas).
SGD with momentum (one per-element state) and Adam (two per-element states and a scalar ``step``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Optional

import pytest
import torch
from checkpoint_helpers import TRAIN_CONFIG, assert_same_tensors, make_trainer
from distributed import run_ranks
from lightning.pytorch.callbacks import ModelCheckpoint
from toy import ToyModule, full_parameters

from lightning_mics import checkpoint as ckpt
from lightning_mics.sharding_spec import ShardingSpec

pytestmark = pytest.mark.distributed  # every test here spawns rank processes

AMSP = ShardingSpec(params=2, grads=2, optim=4)
PLAIN = 2


class AdamToyModule(ToyModule):
    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam([p for p in self.parameters() if p.requires_grad], lr=1e-2)


MODULES = {"sgd": ToyModule, "adam": AdamToyModule}


def _fit(
    kind: str,
    layout: Any,
    epochs: int,
    resume_from: Optional[Path] = None,
    save_to: Optional[Path] = None,
    save_full_to: Optional[Path] = None,
    save_every_epoch_in: Optional[Path] = None,
) -> dict[str, torch.Tensor]:
    model = MODULES[kind](TRAIN_CONFIG)
    extra: dict[str, Any] = {}
    if save_every_epoch_in is not None:
        extra = {"enable_checkpointing": True, "callbacks": [ModelCheckpoint(save_every_epoch_in, every_n_epochs=1)]}
    trainer = make_trainer(TRAIN_CONFIG.world_size, layout, max_epochs=epochs, **extra)
    trainer.fit(model, ckpt_path=resume_from)
    if save_to is not None:
        trainer.save_checkpoint(save_to)
    if save_full_to is not None:
        trainer.strategy.save_full_state_dict = True
        trainer.save_checkpoint(save_full_to)
    return full_parameters(model)


def _scenarios(rank: int, world_size: int, root: str) -> dict[str, dict[str, dict[str, torch.Tensor]]]:
    results = {}
    for kind in MODULES:
        where = Path(root, kind)
        runs = {
            "amsp": _fit(kind, AMSP, 2),
            "plain": _fit(kind, PLAIN, 2),
            "amsp, saving every epoch": _fit(kind, AMSP, 2, save_every_epoch_in=where / "every_epoch"),
        }
        _fit(kind, AMSP, 1, save_to=where / "amsp", save_full_to=where / "amsp_full.ckpt")
        _fit(kind, PLAIN, 1, save_to=where / "plain")
        runs["amsp resumed from amsp"] = _fit(kind, AMSP, 2, resume_from=where / "amsp")
        runs["amsp resumed from amsp, full file"] = _fit(kind, AMSP, 2, resume_from=where / "amsp_full.ckpt")
        runs["plain resumed from amsp"] = _fit(kind, PLAIN, 2, resume_from=where / "amsp")
        runs["amsp resumed from plain"] = _fit(kind, AMSP, 2, resume_from=where / "plain")
        results[kind] = runs
    return results


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[str, Any], Path]:
    root = tmp_path_factory.mktemp("amsp_checkpoints")
    return run_ranks(_scenarios, TRAIN_CONFIG.world_size, str(root))[0], root


def _assert_close(actual: dict[str, torch.Tensor], expected: dict[str, torch.Tensor], rtol: float = 1e-5) -> None:
    """Same up to the rounding of a different reduction order (relative error per tensor)."""
    assert sorted(actual) == sorted(expected)
    for name, value in expected.items():
        error = ((actual[name] - value).norm() / value.norm()).item()
        assert error < rtol, f"{name}: relative error {error:.2e}"


@pytest.mark.parametrize("kind", list(MODULES))
def test_resume_in_the_same_layout_is_bit_identical_and_saving_changes_nothing(runs, kind: str) -> None:
    results = runs[0][kind]
    assert_same_tensors(results["amsp, saving every epoch"], results["amsp"])
    assert_same_tensors(results["amsp resumed from amsp"], results["amsp"])
    assert_same_tensors(results["amsp resumed from amsp, full file"], results["amsp"])


@pytest.mark.parametrize("kind", list(MODULES))
def test_checkpoints_cross_between_amsp_and_plain_mics(runs, kind: str) -> None:
    results = runs[0][kind]
    _assert_close(results["amsp"], results["plain"])  # the two layouts train the same model
    _assert_close(results["plain resumed from amsp"], results["plain"])
    _assert_close(results["amsp resumed from plain"], results["amsp"])


@pytest.mark.parametrize("kind", list(MODULES))
def test_consolidated_optimizer_states_match_plain_mics(runs, kind: str) -> None:
    root = runs[1] / kind
    _, amsp_states, _ = ckpt.read_full_state(root / "amsp")
    _, plain_states, _ = ckpt.read_full_state(root / "plain")
    full_file = torch.load(root / "amsp_full.ckpt", map_location="cpu", weights_only=True)["optimizer_states"]
    (amsp,), (plain,), (full,) = amsp_states, plain_states, full_file
    names = [group["param_names"] for group in plain["param_groups"]]
    assert [group["param_names"] for group in amsp["param_groups"]] == names
    assert [group["param_names"] for group in full["param_groups"]] == names
    assert sorted(amsp["state"]) == sorted(plain["state"]) == sorted(full["state"])
    expected_keys = {"sgd": {"momentum_buffer"}, "adam": {"step", "exp_avg", "exp_avg_sq"}}[kind]
    for index, per_param in plain["state"].items():
        assert set(amsp["state"][index]) == set(per_param) == expected_keys
        for key, value in per_param.items():
            saved = amsp["state"][index][key]
            assert saved.shape == value.shape, (index, key)
            # the sharded directory and the full file hold the very same values
            torch.testing.assert_close(full["state"][index][key], saved, rtol=0, atol=0)
            if key == "step":
                assert float(saved) == float(value) == 2.0
            else:
                error = ((saved - value).norm() / value.norm().clamp_min(1e-30)).item()
                assert error < 1e-4, (index, key, error)
