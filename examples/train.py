"""The main job: train a GPT on Python's own documentation with MiCS, configured by Hydra.

    python examples/train.py                                        # 4 CPU ranks, 2 emulated nodes
    python examples/train.py strategy.partition_size=2 trainer.devices=4 trainer.accumulate_grad_batches=4
    python examples/train.py trainer=gpu model=gpt_xl meta_init=true
    python examples/train.py -m strategy.partition_size=1,2,4        # one run per layout

Configs live in ``conf/`` (groups: strategy, model, data, trainer). Each run writes to Hydra's run
directory (``outputs/<date>/<time>/`` or ``multirun/.../<job>/``): the composed config, CSV (and
TensorBoard) logs, ``logs/training.png`` (loss and tokens/s per step, drawn from the CSV), the
sharded checkpoint, and ``summary.txt`` with what is printed at the end.

Ranks: Lightning's launcher re-runs this script once per extra rank (with Hydra's run directory
pinned so all ranks share it). Under ``-m`` each sweep job re-runs only its own overrides.
"""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Optional

import hydra
import lightning.pytorch as pl
import torch.distributed as dist
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from hydra.utils import instantiate
from lightning.pytorch.loggers import CSVLogger, Logger
from omegaconf import DictConfig, OmegaConf, open_dict, read_write

from lightning_mics.telemetry import TrainingTelemetry
from lightning_mics.topology import MiCSTopology

log = logging.getLogger("train")

REPO_ROOT = Path(__file__).resolve().parent.parent
if str(REPO_ROOT) not in sys.path:  # the configs' _target_s name the demo package `examples.*`
    sys.path.insert(0, str(REPO_ROOT))
CONFIG_DIR = str(REPO_ROOT / "conf")
from examples.console import (  # noqa: E402  (needs REPO_ROOT on sys.path)
    ValidationStep,
    configure_console,
    format_summary,
    is_library_refusal,
    validate_at_the_end,
    write_traceback_to_log_file,
)
from examples.memory_check import check_fits_memory  # noqa: E402
MICS_TARGETS = ("lightning_mics.MiCSStrategy", "lightning_mics.strategy.MiCSStrategy")
#: Hydra options that must survive when a sweep job's command line is rebuilt for its ranks.
_HYDRA_CONFIG_FLAGS = ("--config-path", "-cp", "--config-name", "-cn", "--config-dir", "-cd")


def validate_layout(cfg: DictConfig) -> Optional[MiCSTopology]:
    """Check the MiCS layout before any process starts, so a bad override fails at once with the fix.

    Returns the layout, or ``None`` for non-MiCS strategies or device counts only known at launch.
    """
    if cfg.strategy.get("_target_") not in MICS_TARGETS:
        return None
    devices, num_nodes = cfg.trainer.devices, cfg.trainer.num_nodes
    if not isinstance(devices, int) or devices < 1:
        return None  # "auto", -1 or a device list: Lightning resolves it, the strategy validates it
    ranks_per_node = cfg.strategy.ranks_per_node or devices
    try:
        return MiCSTopology.create(devices * num_nodes, ranks_per_node, cfg.strategy.partition_size)
    except ValueError as error:
        raise ValueError(
            f"Invalid MiCS layout for trainer.devices={devices} x trainer.num_nodes={num_nodes} with "
            f"ranks_per_node={ranks_per_node}: {error} Override strategy.partition_size (or cluster.ranks_per_node / "
            "trainer.devices) accordingly."
        ) from None


class ConfigurationError(ValueError):
    """A mistake in the job's configuration, found before any rank starts; its message names the fix."""


def check_memory(cfg: DictConfig, topology: Optional[MiCSTopology]) -> None:
    """Refuse, before any rank starts, a MiCS run whose CPU ranks cannot fit in this machine's memory
    (see :mod:`examples.memory_check`); GPU runs and other strategies are not checked."""
    if topology is None or not isinstance(cfg.data.get("batch_size"), int):
        return
    gpt = instantiate(cfg.model.config)
    check_fits_memory(
        gpt,
        micro_batch=cfg.data.batch_size,
        precision=str(cfg.trainer.precision),
        topology=topology,
        ranks_on_this_host=cfg.trainer.devices,
        on_gpu=str(cfg.trainer.accelerator) in ("gpu", "cuda"),
        activation_checkpointing=bool(cfg.strategy.get("activation_checkpointing_policy")),
    )


#: Trainer options a command-line override could set to a non-number, and the type each needs.
_TRAINER_NUMBERS: dict[str, tuple[type, ...]] = {
    "max_steps": (int,),
    "max_epochs": (int, type(None)),
    "accumulate_grad_batches": (int,),
    "num_nodes": (int,),
    "log_every_n_steps": (int,),
    "num_sanity_val_steps": (int,),
    "check_val_every_n_epoch": (int, type(None)),
    "gradient_clip_val": (int, float, type(None)),
    "limit_train_batches": (int, float, type(None)),
    "limit_val_batches": (int, float, type(None)),
}


def validate_trainer_numbers(cfg: DictConfig) -> None:
    """A Hydra override such as ``trainer.max_steps=abc`` arrives as a string; refuse it here with
    the fix instead of as a TypeError from deep inside Lightning's loops."""
    for key, types in _TRAINER_NUMBERS.items():
        value = cfg.trainer.get(key)
        if key in cfg.trainer and (isinstance(value, bool) or not isinstance(value, types)):
            kind = "an integer" if types[0] is int and float not in types else "a number"
            raise ValueError(
                f"trainer.{key}={value!r} is not {kind}" + (" (or null)" if type(None) in types else "")
                + f": write e.g. trainer.{key}={'100' if kind == 'an integer' else '1.0'}."
            )


def build_loggers(cfg: DictConfig, output_dir: Path) -> list[Logger]:
    """CSV logs always (when enabled); TensorBoard when asked or, with ``auto``, when it is installed."""
    loggers: list[Logger] = []
    if cfg.logging.csv:
        loggers.append(CSVLogger(save_dir=str(output_dir), name="logs", version=""))
    tensorboard = cfg.logging.tensorboard
    if tensorboard:
        try:
            from lightning.pytorch.loggers import TensorBoardLogger

            loggers.append(TensorBoardLogger(save_dir=str(output_dir), name="tensorboard", version=""))
        except ModuleNotFoundError:
            if tensorboard != "auto":
                raise
    return loggers


def _route_rank_relaunch_to_this_job() -> None:
    """Make Lightning's launcher re-run *this* job for the other ranks.

    The launcher re-runs ``sys.argv`` plus ``hydra.run.dir=<HydraConfig.run.dir>``. In a multirun,
    ``sys.argv`` holds the whole sweep (``-m a=1,2``) and ``run.dir`` is not the job's directory, so
    every rank would start a sweep of its own. Rewrite both to this job's overrides and directory.
    """
    hydra_cfg = HydraConfig.get()
    if hydra_cfg.mode != RunMode.MULTIRUN:
        return
    kept: list[str] = []
    args = sys.argv[1:]
    for i, arg in enumerate(args):
        if arg.split("=", 1)[0] in _HYDRA_CONFIG_FLAGS:
            kept.append(arg)
            if "=" not in arg and i + 1 < len(args):
                kept.append(args[i + 1])
    sys.argv = [sys.argv[0], *kept, *hydra_cfg.overrides.task]
    with read_write(hydra_cfg), open_dict(hydra_cfg):
        hydra_cfg.run.dir = hydra_cfg.runtime.output_dir


@contextmanager
def _isolated_launch_environment() -> Iterator[None]:
    """Give each job of a multirun a fresh start: the launcher leaves ``LOCAL_RANK``/``MASTER_PORT``...
    in ``os.environ`` (which would make the next job believe its ranks already exist) and the
    process group alive."""
    saved = dict(os.environ)
    try:
        yield
    finally:
        if dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()
        os.environ.clear()
        os.environ.update(saved)


def train(cfg: DictConfig) -> Optional[float]:
    """Run one job; return the final validation loss (what a Hydra sweeper would minimise)."""
    with _isolated_launch_environment():
        _route_rank_relaunch_to_this_job()
        configure_console()
        try:
            validate_trainer_numbers(cfg)
            check_memory(cfg, validate_layout(cfg))
        except ValueError as error:
            raise ConfigurationError(str(error)) from None
        output_dir = Path(HydraConfig.get().runtime.output_dir)
        pl.seed_everything(cfg.seed, workers=True)

        telemetry: TrainingTelemetry = instantiate(cfg.telemetry)
        checkpoint = instantiate(cfg.checkpoint, dirpath=str(output_dir / "checkpoints"))
        trainer: pl.Trainer = instantiate(
            cfg.trainer,
            strategy=instantiate(cfg.strategy, _convert_="all"),
            callbacks=[telemetry, checkpoint, ValidationStep()],
            logger=build_loggers(cfg, output_dir),
            default_root_dir=str(output_dir),
        )
        with trainer.init_module(empty_init=cfg.meta_init):
            model = instantiate(cfg.model, _convert_="all")
        datamodule = instantiate(cfg.data)
        trainer.fit(model, datamodule=datamodule, ckpt_path=cfg.ckpt_path)
        validate_at_the_end(trainer, model, datamodule)

        val_loss = trainer.callback_metrics.get("val/loss")
        if trainer.is_global_zero:
            summary = format_summary(trainer, model, datamodule, output_dir)
            metrics_csv = output_dir / "logs" / "metrics.csv"
            if cfg.logging.csv and metrics_csv.is_file():
                from examples.plots import write_training_plot  # matplotlib: rank 0, at the end only

                plot = write_training_plot(metrics_csv)
                summary += f"\nplot: {plot}" if plot else ""
            print(summary, flush=True)
            (output_dir / "summary.txt").write_text(summary.strip() + "\n")
            if HydraConfig.get().output_subdir is not None:
                OmegaConf.save(cfg, output_dir / "resolved_config.yaml", resolve=True)
        return float(val_loss) if val_loss is not None else None


@hydra.main(version_base="1.3", config_path=CONFIG_DIR, config_name="config")
def main(cfg: DictConfig) -> Optional[float]:
    try:
        return train(cfg)
    except ConfigurationError as error:  # found before launch: one line with the fix, no traceback
        if os.environ.get("HYDRA_FULL_ERROR") == "1":
            raise
        sys.exit(f"error: {error} (set HYDRA_FULL_ERROR=1 for the traceback)")
    except (ValueError, TypeError) as error:  # the library refusing a setting once the ranks run: the same one line
        if os.environ.get("HYDRA_FULL_ERROR") == "1" or not is_library_refusal(error):
            raise
        logged = write_traceback_to_log_file(error)
        where = f"the traceback is in {logged}" if logged else "set HYDRA_FULL_ERROR=1 for the traceback"
        sys.exit(f"error: {error} ({where})")


if __name__ == "__main__":
    main()
