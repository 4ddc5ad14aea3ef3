"""Shared pieces of the GPT / main-job and entry-point tests: a very small GPT, a quick multi-rank fit, paths, a
script run from the repository root, the root-only marker."""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path
from types import ModuleType
from typing import Any

import lightning.pytorch as pl
import pytest
from distributed import run_script

from examples.models import ByteCorpusDataModule, GPTConfig, GPTLightningModule

REPO = Path(__file__).resolve().parent.parent
CONF_DIR = REPO / "conf"
TRAIN_SCRIPT = REPO / "examples" / "train.py"
CLI_CONFIG = REPO / "examples" / "cli_config.yaml"

needs_root = pytest.mark.skipif(
    not hasattr(os, "geteuid") or os.geteuid() != 0,
    reason="the emulated cluster's network namespaces, veths and tc need root (CI runs as root)",
)


def run_from_repo(*args: str, timeout: float) -> str:
    """``python <args>`` from the repository root (:func:`distributed.run_script`), as the docs run them."""
    return run_script(*args, timeout=timeout, cwd=REPO)

#: Small enough for several fits in one test on 2 cores; odd sizes (d_model 20) exercise FSDP padding.
SMALL_GPT = GPTConfig(seq_len=16, d_model=20, n_layers=2, n_heads=2)
MICRO_BATCH = 2
#: A slice of the corpus: enough windows for a few steps on 4 ranks, fast to tokenise.
CORPUS_BYTES = 20_000


def small_datamodule() -> ByteCorpusDataModule:
    return ByteCorpusDataModule(seq_len=SMALL_GPT.seq_len, batch_size=MICRO_BATCH, max_bytes=CORPUS_BYTES)


def quick_trainer(world_size: int, strategy: Any, steps: int, accumulate: int = 1, **overrides: Any) -> pl.Trainer:
    """A CPU trainer that does nothing but train (no checkpoints, progress bar or validation)."""
    kwargs: dict[str, Any] = dict(
        accelerator="cpu",
        devices=world_size,
        strategy=strategy,
        max_steps=steps,
        accumulate_grad_batches=accumulate,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        limit_val_batches=0,
    )
    kwargs.update(overrides)
    return pl.Trainer(**kwargs)


def fit_small_gpt(trainer: pl.Trainer) -> GPTLightningModule:
    model = GPTLightningModule(SMALL_GPT, warmup_steps=0)
    trainer.fit(model, datamodule=small_datamodule())
    return model


def load_train_script() -> ModuleType:
    """``examples/train.py`` as a module (it is a script, not part of the package)."""
    spec = importlib.util.spec_from_file_location("mics_train_script", TRAIN_SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
