"""LightningCLI for the main job's GPT + embedded-corpus model (``fit``/``validate``/``test``...).

    python examples/cli.py fit --config examples/cli_config.yaml
    python examples/cli.py fit --config examples/cli_config.yaml \\
        --trainer.strategy=lightning_mics.MiCSStrategy --trainer.strategy.partition_size=2
    python examples/cli.py fit --config examples/cli_config.yaml --trainer.strategy=mics
    python examples/cli.py validate --config examples/cli_config.yaml --ckpt_path=<checkpoint dir>

Importing :mod:`lightning_mics` registers the strategy names, and the strategy class is importable
by its dotted path, so both spellings work. The telemetry callback is always on and is
configured under ``--telemetry.*`` (e.g. ``--telemetry.peak_flops=989e12``). The layout planner is
the library's own command: ``lightning-mics plan ...``.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any, Optional

if __package__ in (None, ""):  # run as a script: make the ``examples`` package importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from lightning.pytorch.cli import LightningCLI  # noqa: E402

import lightning_mics  # noqa: F401,E402  (registers strategy="mics", "mics_zero3", "mics_replicate")
from examples.models import ByteCorpusDataModule, GPTLightningModule  # noqa: E402
from lightning_mics.telemetry import TrainingTelemetry  # noqa: E402


class MiCSCLI(LightningCLI):
    """LightningCLI with the sequence length linked from the model to the data and telemetry on."""

    def add_arguments_to_parser(self, parser: Any) -> None:
        parser.add_lightning_class_args(TrainingTelemetry, "telemetry")
        parser.link_arguments("model.config", "data.seq_len", compute_fn=_seq_len_of)


def _seq_len_of(config: Any) -> int:
    """The data's window length from the parsed ``model.config`` (a preset name or, parsed as a
    dataclass, a jsonargparse namespace of its fields)."""
    from examples.models import GPTConfig

    config = getattr(config, "init_args", config)
    if hasattr(config, "as_dict"):
        config = config.as_dict()
    return GPTConfig.resolve(config).seq_len


def check_strategy_arguments(argv: list[str]) -> None:
    """A registered name (``--trainer.strategy=mics``) takes no options; jsonargparse would refuse
    ``--trainer.strategy.partition_size=...`` after it with a type error that does not say why."""
    named = [arg.split("=", 1)[1] for arg in argv if arg.startswith("--trainer.strategy=")]
    options = [arg.split("=", 1)[0] for arg in argv if arg.startswith("--trainer.strategy.")]
    if named and options and "." not in named[-1]:
        raise ValueError(
            f"--trainer.strategy={named[-1]} is a registered name, which takes no options ({', '.join(options)}). "
            "Name the class to configure it: --trainer.strategy=lightning_mics.MiCSStrategy "
            + " ".join(arg for arg in argv if arg.startswith("--trainer.strategy."))
        )


def main(args: Optional[list[str]] = None, run: bool = True) -> MiCSCLI:
    """Run LightningCLI on the demo model; ``args`` replaces ``sys.argv[1:]`` (tests)."""
    check_strategy_arguments(list(sys.argv[1:] if args is None else args))
    return MiCSCLI(
        GPTLightningModule,
        ByteCorpusDataModule,
        args=args,
        run=run,
        save_config_kwargs={"overwrite": True},
    )


if __name__ == "__main__":
    try:
        main()  # the CLI object is not an exit status: success exits 0, an exception non-zero
    except ValueError as error:  # configuration mistakes (e.g. an invalid layout): one line, the fix in it
        if os.environ.get("MICS_FULL_ERROR"):
            raise
        sys.exit(f"error: {error} (set MICS_FULL_ERROR=1 for the traceback)")
