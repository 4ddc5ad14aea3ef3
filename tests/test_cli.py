"""LightningCLI: both strategy spellings and the fit / validate / test subcommands with the YAML config, a
registered name over the config's strategy (its settings applied to the config's options, or refused over another
class), and errors as one line with the fix."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from distributed import run_ranks
from lm_jobs import CLI_CONFIG, REPO, SMALL_GPT

from examples.cli import main
from lightning_mics import MiCSStrategy

WORLD = 2
#: LightningCLI's warning when it is given ``args`` while ``sys.argv`` has arguments too (every script run, once)
NO_ARGS_WARNING = "LightningCLI's args parameter is intended"
SMALL_MODEL_JSON = (
    f'{{"seq_len": {SMALL_GPT.seq_len}, "d_model": {SMALL_GPT.d_model}, '
    f'"n_layers": {SMALL_GPT.n_layers}, "n_heads": {SMALL_GPT.n_heads}}}'
)


def test_options_after_a_registered_strategy_name_get_the_fix() -> None:
    fix = r"--trainer.strategy=lightning_mics.MiCSStrategy --trainer.strategy.partition_size=3"
    with pytest.raises(ValueError, match=fix):
        main(["fit", "--trainer.strategy=mics", "--trainer.strategy.partition_size=3"], run=False)


def _quick_args(subcommand: str, root: str, *extra: str) -> list[str]:
    return [
        subcommand,
        f"--config={CLI_CONFIG}",
        f"--trainer.devices={WORLD}",
        f"--trainer.default_root_dir={root}",
        "--trainer.max_steps=2",
        "--trainer.limit_val_batches=2",
        "--trainer.limit_test_batches=2",
        "--trainer.enable_checkpointing=false",
        "--trainer.enable_progress_bar=false",
        f"--model.config={SMALL_MODEL_JSON}",
        "--data.max_bytes=20000",
        *extra,
    ]


def _run_cli(rank: int, world_size: int, root: str) -> dict:
    by_class_path = main(
        _quick_args(
            "fit",
            f"{root}/class_path",
            "--trainer.strategy=lightning_mics.MiCSStrategy",
            "--trainer.strategy.partition_size=2",
            "--trainer.strategy.ranks_per_node=2",
        )
    )
    by_name = main(_quick_args("fit", f"{root}/name", "--trainer.strategy=mics"))
    validated = main(_quick_args("validate", f"{root}/validate", "--trainer.strategy=mics"))
    tested = main(_quick_args("test", f"{root}/test", "--trainer.strategy=mics"))
    strategies = [cli.trainer.strategy for cli in (by_class_path, by_name)]
    return dict(
        strategy_types=[type(s) for s in strategies],
        partition_sizes=[s.topology.partition_size for s in strategies],
        spec=by_class_path.trainer.strategy.partition_size_spec,
        telemetry_steps=[
            len(cb.steps) for cli in (by_class_path, by_name) for cb in cli.trainer.callbacks if hasattr(cb, "steps")
        ],
        data_seq_len=by_name.datamodule.seq_len,
        val_metrics=sorted(validated.trainer.callback_metrics),
        test_metrics=sorted(tested.trainer.callback_metrics),
    )


@pytest.mark.distributed
def test_cli_runs_both_strategy_spellings_and_every_stage(tmp_path: Path) -> None:
    results = run_ranks(_run_cli, WORLD, str(tmp_path))
    for result in results:
        assert result["strategy_types"] == [MiCSStrategy, MiCSStrategy]
        assert result["spec"] == 2
        assert result["partition_sizes"] == [2, 2]  # "mics": one node = the 2 local devices
        assert result["telemetry_steps"] == [2, 2]  # the telemetry callback is on by default
        assert result["data_seq_len"] == SMALL_GPT.seq_len  # linked from the model config
        assert {"val/loss", "val/perplexity"} <= set(result["val_metrics"])
        assert {"test/loss", "test/perplexity"} <= set(result["test_metrics"])
    assert (tmp_path / "class_path").is_dir()  # LightningCLI saved its config under the run directory
    assert list((tmp_path / "class_path").rglob("config.yaml"))


@pytest.mark.parametrize(
    ("name", "applied"),
    [("mics", {}), ("mics_auto", {"sharding": "auto", "grad_accumulation_spec": "auto"}),
     ("mics_zero3", {"partition_size_spec": "world"})],
)
def test_a_registered_name_over_the_config_applies_its_settings_to_the_configs_options(name, applied, capsys) -> None:
    """The README's `--trainer.strategy=mics` with the example config: the config's ranks_per_node=2 is kept (it
    was silently dropped, which made 2 nodes x 2 ranks one node of 4: ZeRO-3), the name's own settings on top."""
    cli = main([f"--config={CLI_CONFIG}", f"--trainer.strategy={name}"], run=False)
    strategy = cli.trainer.strategy
    assert isinstance(strategy, MiCSStrategy) and strategy.ranks_per_node_override == 2
    for attribute, value in applied.items():
        assert getattr(strategy, attribute) == value, attribute
    assert f"--trainer.strategy={name} applied to the config's MiCSStrategy options" in capsys.readouterr().err


def test_a_registered_name_over_another_strategy_class_in_the_config_is_refused(tmp_path: Path) -> None:
    config = tmp_path / "ddp.yaml"
    config.write_text(
        "trainer:\n  strategy:\n    class_path: lightning.pytorch.strategies.DDPStrategy\n"
        "    init_args:\n      find_unused_parameters: true\n"
    )
    with pytest.raises(ValueError, match=r"replace the config's lightning.pytorch.strategies.DDPStrategy.*"
                       r"--trainer.strategy=lightning_mics.MiCSStrategy"):
        main([f"--config={config}", "--trainer.strategy=mics"], run=False)


def test_naming_the_configs_strategy_class_keeps_the_configs_options() -> None:
    # the config's class with one option changed: ranks_per_node=2 from the YAML must survive
    cli = main(
        [
            f"--config={CLI_CONFIG}",
            "--trainer.strategy=lightning_mics.strategy.MiCSStrategy",  # the same class, spelled another way
            "--trainer.strategy.partition_size=2",
        ],
        run=False,
    )
    assert cli.trainer.strategy.ranks_per_node_override == 2
    assert cli.trainer.strategy.partition_size_spec == 2


@pytest.mark.distributed
def test_cli_command_succeeds_with_one_voice_and_a_summary(tmp_path: Path) -> None:
    command = [sys.executable, "examples/cli.py", *_quick_args("fit", str(tmp_path), "--trainer.strategy=mics")]
    done = subprocess.run(
        command, cwd=REPO, env={**os.environ, "PYTHONUNBUFFERED": "1"}, capture_output=True, text=True, timeout=300
    )
    output = done.stdout + done.stderr
    assert done.returncode == 0, output[-4000:]
    assert "object at 0x" not in output  # no object repr for an exit status
    assert output.count("Initializing distributed") == 1  # rank 1 is quiet
    assert output.count("Seed set") == 1
    assert output.count("MiCS main job summary") == 1 and "tokens/s" in done.stdout
    assert output.count("MiCS layout") == 2  # the layout line when sharding, and in the summary
    assert NO_ARGS_WARNING not in output


def test_cli_layout_error_is_one_line_with_the_fix() -> None:
    command = [
        sys.executable,
        "examples/cli.py",
        "fit",
        f"--config={CLI_CONFIG}",
        "--trainer.strategy.partition_size=3",
    ]
    done = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=120)
    assert done.returncode != 0
    assert "Traceback" not in done.stderr, done.stderr[-3000:]
    assert "partition_size" in done.stderr.strip().splitlines()[-1]
    assert NO_ARGS_WARNING not in done.stderr  # run as a script, LightningCLI gets sys.argv itself: no warning
