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

import importlib
import os
import sys
from pathlib import Path
from typing import Any, Optional

if __package__ in (None, ""):  # run as a script: make the ``examples`` package importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from lightning.pytorch.cli import LightningCLI  # noqa: E402

import lightning_mics  # noqa: F401,E402  (registers strategy="mics", "mics_auto", "mics_zero3", "mics_replicate")
from examples.console import configure_console, format_summary  # noqa: E402
from examples.memory_check import check_fits_memory  # noqa: E402
from examples.models import ByteCorpusDataModule, GPTLightningModule  # noqa: E402
from lightning_mics import MiCSStrategy, MiCSTopology  # noqa: E402
from lightning_mics.telemetry import TrainingTelemetry  # noqa: E402


class MiCSCLI(LightningCLI):
    """LightningCLI with the sequence length linked from the model to the data, telemetry on, and
    the main job's closing summary after ``fit`` (rank 0)."""

    def add_arguments_to_parser(self, parser: Any) -> None:
        parser.add_lightning_class_args(TrainingTelemetry, "telemetry")
        parser.link_arguments("model.config", "data.seq_len", compute_fn=_seq_len_of)

    def before_fit(self) -> None:
        """Refuse a run whose CPU ranks cannot fit in this machine's memory before they start."""
        strategy, trainer = self.trainer.strategy, self.trainer
        if not isinstance(strategy, MiCSStrategy) or strategy.partition_size_spec == "auto":
            return
        topology = MiCSTopology.create(
            trainer.num_devices * trainer.num_nodes,
            strategy.ranks_per_node_override or trainer.num_devices,
            strategy.partition_size_spec,
        )
        check_fits_memory(
            self.model.config,
            micro_batch=self.datamodule.batch_size,
            precision=str(trainer.precision),
            topology=topology,
            ranks_on_this_host=trainer.num_devices,
            on_gpu=strategy.root_device.type == "cuda",
            activation_checkpointing=bool(strategy.activation_checkpointing_policy),
            flags=("--trainer.accelerator=gpu", "--data.batch_size"),
        )

    def after_fit(self) -> None:
        output_dir = Path(self.trainer.log_dir or ".")  # a broadcast: every rank asks
        if self.trainer.is_global_zero:
            print(format_summary(self.trainer, self.model, self.datamodule, output_dir), flush=True)


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


def _config_files(argv: list[str]) -> list[Path]:
    files = []
    for i, arg in enumerate(argv):
        if arg == "--config" and i + 1 < len(argv):
            files.append(Path(argv[i + 1]))
        elif arg.startswith("--config="):
            files.append(Path(arg.split("=", 1)[1]))
    return files


def _resolve_class(dotted: str) -> Any:
    module_name, _, name = dotted.rpartition(".")
    try:
        return getattr(importlib.import_module(module_name), name) if module_name else None
    except (ImportError, AttributeError):
        return None


def keep_configured_strategy_options(argv: list[str]) -> list[str]:
    """Drop ``--trainer.strategy=<class>`` when a ``--config`` file already configures that class, and apply a
    registered name to the config's MiCS options (:func:`_apply_registered_name`).

    jsonargparse starts a class named on the command line from its defaults, so repeating the
    config's class (``--trainer.strategy=lightning_mics.MiCSStrategy --trainer.strategy.partition_size=2``)
    would silently lose the file's other options (``ranks_per_node``). Without the repeat, the
    ``--trainer.strategy.*`` options are merged into the file's. Naming another class still starts
    from that class's defaults, with a note saying so."""
    named = [arg for arg in argv if arg.startswith("--trainer.strategy=")]
    if not named:
        return argv
    import yaml

    configured = None
    for file in _config_files(argv):
        if file.is_file():
            strategy = ((yaml.safe_load(file.read_text()) or {}).get("trainer") or {}).get("strategy")
            if isinstance(strategy, dict) and "class_path" in strategy:
                configured = strategy["class_path"]
    given = named[-1].split("=", 1)[1]
    if configured is None:
        return argv
    if "." not in given:
        return _apply_registered_name(argv, named, given, configured)
    if _resolve_class(given) is not None and _resolve_class(given) is _resolve_class(configured):
        return [arg for arg in argv if arg not in named]
    print(
        f"note: --trainer.strategy={given} replaces the config's {configured}: its init_args are not carried over.",
        file=sys.stderr,
    )
    return argv


def _apply_registered_name(argv: list[str], named: list[str], name: str, configured: str) -> list[str]:
    """``--trainer.strategy=<registered name>`` over a config that configures a strategy class with options.

    jsonargparse would replace the config's whole strategy entry with the bare name, dropping its options
    without a word (``ranks_per_node: 2`` lost turns 2 nodes x 2 ranks into one node of 4: ZeRO-3). When the
    config's class is MiCS's, the name's own settings are applied on top of the config's options instead (the
    name becomes ``--trainer.strategy.<option>=<value>`` arguments); another class's options cannot apply to
    MiCS, so that is refused with the spelling that says what to keep."""
    from lightning_mics.options import REGISTERED_STRATEGIES

    if name not in REGISTERED_STRATEGIES:
        return argv  # another library's name: jsonargparse decides
    if _resolve_class(configured) is not MiCSStrategy:
        raise ValueError(
            f"--trainer.strategy={name} would replace the config's {configured} and drop its init_args. Either remove "
            "the strategy from the config, or configure MiCS by its class: --trainer.strategy=lightning_mics."
            "MiCSStrategy --trainer.strategy.<option>=<value>."
        )
    _, options = REGISTERED_STRATEGIES[name]
    settings = [f"--trainer.strategy.{option}={value}" for option, value in options.items()]
    print(
        f"note: --trainer.strategy={name} applied to the config's MiCSStrategy options"
        + (f" ({', '.join(arg.split('.', 2)[2] for arg in settings)})" if settings else "")
        + ".",
        file=sys.stderr,
    )
    return [arg for arg in argv if arg not in named] + settings


def main(args: Optional[list[str]] = None, run: bool = True) -> MiCSCLI:
    """Run LightningCLI on the demo model; ``args`` replaces ``sys.argv[1:]`` (tests)."""
    configure_console()
    from_command_line = args is None
    argv = list(sys.argv[1:] if args is None else args)
    check_strategy_arguments(argv)
    resolved = keep_configured_strategy_options(argv)
    if from_command_line:  # LightningCLI warns when given args while sys.argv has some: hand it sys.argv itself
        sys.argv[1:] = resolved
    return MiCSCLI(
        GPTLightningModule,
        ByteCorpusDataModule,
        args=None if from_command_line else resolved,
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
