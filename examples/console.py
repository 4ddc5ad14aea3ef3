"""What the demo's entry points print: one voice (rank 0), the MiCS layout line, a closing summary.

Both ``examples/train.py`` (Hydra) and ``examples/cli.py`` (LightningCLI) use this module, so the two
print the same things. Every rank runs the same script, and Lightning, the launcher and Python's
warnings speak on each of them ("Seed set", "Initializing distributed", deprecation warnings...):
ranks other than 0 keep only warnings from our own code and errors, unless ``MICS_VERBOSE_RANKS=1``.
"""

from __future__ import annotations

import logging
import os
import statistics
import warnings
from pathlib import Path
from typing import Any, Optional, TypeVar

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback

import lightning_mics
from lightning_mics.telemetry import TrainingTelemetry

C = TypeVar("C", bound=Callback)

#: loggers whose INFO lines repeat on every rank
_CHATTY_LOGGERS = ("lightning.pytorch", "lightning.fabric", "lightning_mics")


def is_rank_zero() -> bool:
    """Whether this process is global rank 0 as the launcher set it (the process a user started is)."""
    if "RANK" in os.environ:  # torchrun, SLURM-style launchers
        return int(os.environ["RANK"]) == 0
    return int(os.environ.get("LOCAL_RANK", 0)) == 0 and int(os.environ.get("NODE_RANK", 0)) == 0  # Lightning's


def configure_console() -> None:
    """Rank 0: show MiCS's INFO lines (the layout line). Other ranks: warnings and errors only."""
    if is_rank_zero() or os.environ.get("MICS_VERBOSE_RANKS") == "1":
        mics = logging.getLogger("lightning_mics")
        if not mics.handlers and not logging.getLogger().handlers:
            handler = logging.StreamHandler()
            handler.setFormatter(logging.Formatter("%(message)s"))
            mics.addHandler(handler)
        mics.setLevel(logging.INFO)
        return
    for name in _CHATTY_LOGGERS:
        logging.getLogger(name).setLevel(logging.WARNING)
    warnings.filterwarnings("ignore", category=DeprecationWarning)
    warnings.filterwarnings("ignore", category=FutureWarning)
    warnings.filterwarnings("ignore", module="lightning")  # rank 0 shows Lightning's advice once


class ValidationStep(Callback):
    """Remembers the optimizer step of the last validation pass (sanity checks aside), so that the
    entry points can validate once more after ``fit`` when training stopped between validations, and
    the summary can say which step its validation loss belongs to."""

    def __init__(self) -> None:
        self.step: Optional[int] = None

    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if not trainer.sanity_checking:
            self.step = trainer.global_step


def validate_at_the_end(trainer: pl.Trainer, model: pl.LightningModule, datamodule: Any) -> None:
    """Run a last validation pass if the last one was before the final step: a summary's validation
    loss is the trained model's, not that of some step before it."""
    marker = find_callback(trainer, ValidationStep)
    if marker is None or not trainer.limit_val_batches or marker.step == trainer.global_step:
        return
    trainer.validate(model, datamodule=datamodule, verbose=False)


def is_library_refusal(error: BaseException) -> bool:
    """Whether ``error`` is lightning_mics refusing a setting: a ``ValueError``/``TypeError`` raised by the library's
    own code, whose message names the fix. The entry points print those as one line; anything else (a bug, a
    crash) keeps its traceback."""
    if not isinstance(error, (ValueError, TypeError)):
        return False
    tb = error.__traceback__
    innermost = None
    while tb is not None:
        innermost, tb = tb, tb.tb_next
    return innermost is not None and f"{os.sep}lightning_mics{os.sep}" in innermost.tb_frame.f_code.co_filename


def write_traceback_to_log_file(error: BaseException) -> Optional[str]:
    """Write ``error``'s traceback to the root logger's log file (Hydra's ``<run dir>/<job>.log``) only, not to the
    console; returns the file's path, or ``None`` when no file handler is configured."""
    import traceback

    for handler in logging.getLogger().handlers:
        if isinstance(handler, logging.FileHandler):
            text = "".join(traceback.format_exception(type(error), error, error.__traceback__))
            handler.emit(logging.makeLogRecord({"msg": text, "levelno": logging.ERROR, "levelname": "ERROR"}))
            handler.flush()
            return handler.baseFilename
    return None


def find_callback(trainer: pl.Trainer, kind: type[C]) -> Optional[C]:
    """The trainer's first callback of type ``kind``, or ``None``."""
    return next((cb for cb in trainer.callbacks if isinstance(cb, kind)), None)  # type: ignore[attr-defined]


def find_telemetry(trainer: pl.Trainer) -> Optional[TrainingTelemetry]:
    return find_callback(trainer, TrainingTelemetry)


def format_summary(trainer: pl.Trainer, model: pl.LightningModule, datamodule: Any, output_dir: Path) -> str:
    """The closing summary of a fit: layout, model, data, losses, throughput, memory, checkpoint."""
    strategy = trainer.strategy
    is_mics = isinstance(strategy, lightning_mics.MiCSStrategy)
    layout = strategy.topology.describe() if is_mics else type(strategy).__name__
    lines = ["", "=" * 30 + " MiCS main job summary " + "=" * 30, layout]
    config = getattr(model, "config", None)
    if config is not None:
        lines.append(
            f"model: GPT d_model={config.d_model} layers={config.n_layers} heads={config.n_heads} "
            f"seq={config.seq_len}, {config.num_params:,} parameters, {config.flops_per_token / 1e6:,.1f} MFLOP/token"
        )
    if hasattr(datamodule, "train_tokens"):
        lines.append(
            f"data: {datamodule.source}, {datamodule.train_tokens.numel():,} train / "
            f"{datamodule.val_tokens.numel():,} val bytes; {trainer.world_size} ranks x {datamodule.batch_size} x "
            f"{datamodule.seq_len} tokens x {trainer.accumulate_grad_batches} micro-steps per optimizer step"
        )
    telemetry = find_telemetry(trainer)
    metrics = trainer.callback_metrics
    if telemetry is not None:
        losses = [s.loss for s in telemetry.steps if s.loss is not None]
        if losses:
            val = ""
            if "val/loss" in metrics:
                marker = find_callback(trainer, ValidationStep)
                at = f" (step {marker.step})" if marker is not None and marker.step is not None else ""
                val = (
                    f"; val loss {float(metrics['val/loss']):.3f}{at}, "
                    f"perplexity {float(metrics['val/perplexity']):.2f}"
                )
            lines.append(
                f"loss: train {losses[0]:.3f} (step 1) -> {losses[-1]:.3f} (step {telemetry.steps[-1].step}){val}"
            )
        lines.append(telemetry.format_summary())
    checkpoint = trainer.checkpoint_callback
    if checkpoint is not None and checkpoint.best_model_path:
        lines.append(f"checkpoint: {checkpoint.best_model_path}")
    stalls = getattr(strategy, "checkpoint_stall_s", [])
    if stalls:
        how = "in the background" if strategy.async_save else "in the foreground"
        lines.append(
            f"checkpoint saves: {len(stalls)} {how}; training stalled "
            f"{statistics.median(stalls) * 1e3:,.0f} ms per save (median), {sum(stalls):.2f} s in all"
        )
    lines.append(f"logs: {output_dir}")
    return "\n".join(lines)
