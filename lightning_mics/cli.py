"""``lightning-mics``: LightningCLI for the GPT + embedded-corpus job (``fit``/``validate``/``test``...).

    lightning-mics fit --config examples/cli_config.yaml
    lightning-mics fit --config examples/cli_config.yaml \\
        --trainer.strategy=lightning_mics.MiCSStrategy --trainer.strategy.partition_size=2
    lightning-mics fit --config examples/cli_config.yaml --trainer.strategy=mics
    lightning-mics plan --cluster p3dn --nodes 8 --model gpt-1.3b     # the layout planner

Importing :mod:`lightning_mics` registers the strategy names, and the strategy class is importable
by its dotted path, so both spellings work. The telemetry callback is always on and is
configured under ``--telemetry.*`` (e.g. ``--telemetry.peak_flops=989e12``).
"""

from __future__ import annotations

import sys
from typing import Any, Optional

from lightning.pytorch.cli import LightningCLI

import lightning_mics  # noqa: F401  (registers strategy="mics", "mics_zero3", "mics_replicate")
from lightning_mics.models import ByteCorpusDataModule, GPTLightningModule
from lightning_mics.telemetry import TrainingTelemetry


class MiCSCLI(LightningCLI):
    """LightningCLI with the sequence length linked from the model to the data and telemetry on."""

    def add_arguments_to_parser(self, parser: Any) -> None:
        parser.add_lightning_class_args(TrainingTelemetry, "telemetry")
        parser.link_arguments("model.config", "data.seq_len", compute_fn=_seq_len_of)


def _seq_len_of(config: Any) -> int:
    """The data's window length from the parsed ``model.config`` (a preset name or, parsed as a
    dataclass, a jsonargparse namespace of its fields)."""
    from lightning_mics.models import GPTConfig

    config = getattr(config, "init_args", config)
    if hasattr(config, "as_dict"):
        config = config.as_dict()
    return GPTConfig.resolve(config).seq_len


def main(args: Optional[list[str]] = None, run: bool = True) -> Any:
    """Entry point of the ``lightning-mics`` console script; ``args`` replaces ``sys.argv[1:]`` (tests).

    ``lightning-mics plan ...`` runs the layout planner (:mod:`lightning_mics.plan`) instead of
    LightningCLI; every other subcommand is LightningCLI's.
    """
    argv = list(sys.argv[1:] if args is None else args)
    if argv[:1] == ["plan"]:
        from lightning_mics.plan import main as plan_main

        return plan_main(argv[1:])
    return MiCSCLI(
        GPTLightningModule,
        ByteCorpusDataModule,
        args=args,
        run=run,
        save_config_kwargs={"overwrite": True},
    )


if __name__ == "__main__":
    main()
