"""``fit``, then ``test`` and ``predict`` from sharded, full and weights-only checkpoints inside
``torch.inference_mode()``: the weights equal each checkpoint's bit for bit and resuming equals an uninterrupted
run; ``fit`` after an inference-mode test of an untrained model equals single-process training.

Mirrors Lightning's own FSDP test ``_run_multiple_stages``, which wraps ``trainer.test/predict`` in
``torch.inference_mode()``: the checkpoint load then runs in inference mode too. (Lightning's own
loops run validate/test/predict under ``torch.inference_mode`` with NCCL -- ``torch.no_grad`` with
gloo and for its FSDP strategy -- but load ``ckpt_path`` before entering them; what runs inside
them, such as a callback's ``trainer.save_checkpoint`` on GPUs, is in inference mode.)

Each load is checked to have happened: the model holds other weights (those of the end of fit, or
of another checkpoint) when a stage loads, so a load that silently did nothing changes the metrics,
the predictions and the parameters compared below.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from distributed import run_ranks
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.utils.data import DataLoader
from toy import RunConfig, ToyLM, ToyModule, full_parameters, lm_loss, make_dataset, strip_prefix, trainer_kwargs

from lightning_mics import MiCSStrategy
from lightning_mics import checkpoint as ckpt

WORLD_SIZE = 2
STEPS = 3
EVAL_SAMPLES = 8  # 2 batches of 2 per rank: every rank evaluates the same number of tokens
KINDS = ("sharded", "full", "weights_only")
FROZEN = "model.blocks.1.gate.weight"  # toy.Block(frozen=True): the same in every checkpoint


class EvalToyModule(ToyModule):
    def test_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        self.log("test_loss", lm_loss(self, batch), sync_dist=True)

    def predict_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> Any:
        tokens, _ = batch
        return tokens, self(tokens)

    def test_dataloader(self) -> DataLoader:
        return DataLoader(make_dataset(EVAL_SAMPLES, seed=7), batch_size=2)

    def predict_dataloader(self) -> DataLoader:
        return DataLoader(make_dataset(EVAL_SAMPLES, seed=7), batch_size=2)


def _checkpointed_weights(path: Path) -> dict[str, torch.Tensor]:
    """The model state (parameters and the buffer) a checkpoint holds, unsharded, read in this process."""
    if path.is_dir():
        return ckpt.read_full_state(path)[0]
    raw = torch.load(path, map_location="cpu", weights_only=True)
    return raw["state_dict"]


def _plain_model(weights: dict[str, torch.Tensor]) -> ToyLM:
    model = ToyLM()
    model.load_state_dict(strip_prefix(weights))
    return model.eval()


def _stages(rank: int, world_size: int, root: str, kind: str) -> dict[str, Any]:
    """One trainer: fit ``STEPS`` epochs of one step with a checkpoint per epoch, then, under
    inference mode, test from the step-2 and predict from the step-1 checkpoint, then train again."""
    cfg = RunConfig(world_size=world_size, steps=1)  # one step per epoch: checkpoints at epoch ends
    checkpoints = ModelCheckpoint(
        dirpath=root, filename="{step}", every_n_epochs=1, save_top_k=-1, save_weights_only=kind == "weights_only"
    )
    # stopped by max_epochs: Lightning resumes an epoch-end checkpoint exactly then (see checkpoint_helpers)
    kwargs = {**trainer_kwargs(cfg), "enable_checkpointing": True, "max_steps": -1, "max_epochs": STEPS}
    trainer = pl.Trainer(strategy=MiCSStrategy(save_full_state_dict=kind == "full"), callbacks=[checkpoints], **kwargs)
    model = EvalToyModule(cfg)
    trainer.fit(model)
    out: dict[str, Any] = {"after_fit": full_parameters(model)}
    step1, step2 = Path(root, "step=1.ckpt"), Path(root, "step=2.ckpt")
    out["saved"] = {"step1": _checkpointed_weights(step1), "step2": _checkpointed_weights(step2)}

    with torch.inference_mode():
        tested = trainer.test(model, ckpt_path=str(step2), verbose=False)
    out["test_loss"] = float(tested[0]["test_loss"])
    out["after_test"] = full_parameters(model)

    with torch.inference_mode():
        predictions = trainer.predict(model, ckpt_path=str(step1))
    out["predictions"] = [(tokens.clone(), logits.clone()) for tokens, logits in predictions]
    out["after_predict"] = full_parameters(model)

    # a save inside inference mode (as from a callback of a test/predict loop, which runs in it with NCCL)
    resaved = Path(root, "saved_in_inference_mode.ckpt")
    with torch.inference_mode():
        trainer.save_checkpoint(resaved, weights_only=kind == "weights_only")
    out["resaved"] = _checkpointed_weights(resaved)

    # train again on the weights the inference-mode stages left (resuming where the optimizer state allows)
    if kind == "weights_only":
        trainer.fit_loop.max_epochs = STEPS + 1  # one more step, from step 1's weights, fresh optimizer
        trainer.fit(model)
    else:
        trainer.fit(model, ckpt_path=str(step2))  # step 3 again: must land on fit's parameters
    out["global_step"] = trainer.global_step
    out["after_refit"] = full_parameters(model)
    return out


def _close(actual: torch.Tensor, expected: torch.Tensor) -> None:
    torch.testing.assert_close(actual, expected, rtol=1e-5, atol=1e-6)


@pytest.mark.distributed
@pytest.mark.timeout(300)
@pytest.mark.parametrize("kind", KINDS)
def test_test_and_predict_from_checkpoints_under_inference_mode(tmp_path: Path, kind: str) -> None:
    """``trainer.test``/``predict(ckpt_path=...)`` inside ``torch.inference_mode()`` after ``fit``
    load the checkpoint's weights (sharded, full and weights-only checkpoints), evaluate with them,
    and leave a model that trains again; ``trainer.save_checkpoint`` works in inference mode too."""
    results = run_ranks(_stages, WORLD_SIZE, str(tmp_path), kind, timeout=240)
    first = results[0]
    saved = first["saved"]
    for name, params in first["after_fit"].items():
        if name == FROZEN:
            continue
        assert not torch.equal(params, saved["step2"][name]), f"{name}: the checkpoint equals the model after fit"
        assert not torch.equal(saved["step1"][name], saved["step2"][name]), name

    for rank, result in enumerate(results):
        # every rank loaded the checkpoint exactly (bit-identical parameters)
        for stage, step in (("after_test", "step2"), ("after_predict", "step1")):
            assert sorted(result[stage]) == sorted(first["after_fit"]), (rank, stage)
            for name, value in result[stage].items():
                assert torch.equal(value, saved[step][name]), f"rank {rank}, {stage}: {name} is not the checkpoint's"

        # the checkpoint saved inside inference mode holds the model it had then: step 1's
        assert sorted(result["resaved"]) == sorted(saved["step1"]), rank
        for name, value in saved["step1"].items():
            assert torch.equal(result["resaved"][name], value), f"rank {rank}: saved in inference mode: {name}"

        # and evaluated with it: the test loss of the step-2 weights, the logits of the step-1 weights
        with torch.no_grad():
            tokens, targets = make_dataset(EVAL_SAMPLES, seed=7).tensors
            expected_loss = lm_loss(_plain_model(saved["step2"]), (tokens, targets)).item()
            step1_model = _plain_model(saved["step1"])
            assert result["predictions"], rank
            for tokens, logits in result["predictions"]:
                _close(logits, step1_model(tokens))
        assert result["test_loss"] == pytest.approx(expected_loss, rel=1e-5), rank

        # and trained again afterwards
        if kind == "weights_only":
            assert result["global_step"] == STEPS + 1
            for name, value in result["after_refit"].items():
                assert torch.isfinite(value).all(), name
            changed = [n for n, v in result["after_refit"].items() if not torch.equal(v, saved["step1"][n])]
            assert "model.blocks.0.mix.weight" in changed, changed  # a trainable parameter moved
            assert FROZEN not in changed
        else:
            assert result["global_step"] == STEPS
            for name, value in result["after_refit"].items():
                assert torch.equal(value, first["after_fit"][name]), f"rank {rank}: resumed step 3 differs in {name}"


def _evaluate_then_fit(rank: int, world_size: int) -> dict[str, Any]:
    """``trainer.test`` under inference mode on a model never trained (nor sharded) before, then ``fit``."""
    cfg = RunConfig(world_size=world_size, steps=2)
    trainer = pl.Trainer(strategy=MiCSStrategy(), **trainer_kwargs(cfg))
    model = EvalToyModule(cfg)
    with torch.inference_mode():
        trainer.test(model, verbose=False)
    try:
        trainer.fit(model)
    except RuntimeError as err:
        return {"error": str(err).splitlines()[0]}
    return {"params": full_parameters(model)}


@pytest.mark.distributed
@pytest.mark.timeout(300)
def test_fit_after_evaluating_an_untrained_model_under_inference_mode() -> None:
    from toy import assert_matches_reference

    results = run_ranks(_evaluate_then_fit, WORLD_SIZE, timeout=240)
    for rank, result in enumerate(results):
        assert "error" not in result, f"rank {rank}: {result.get('error')}"
    assert_matches_reference([result["params"] for result in results], RunConfig(world_size=WORLD_SIZE, steps=2))
