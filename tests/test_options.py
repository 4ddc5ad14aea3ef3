"""Options are declared once (``MiCSOptions``): each has a docstring, ``docs/options.md``'s table is generated from
them, both front ends, Hydra and LightningCLI see every option, an unknown name is refused naming the closest, and
Fabric refuses the Trainer-only ones."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest
import yaml
from jsonargparse import ArgumentParser

from lightning_mics import MiCSFabricStrategy, MiCSStrategy
from lightning_mics.options import TRAINER_ONLY, MiCSOptions, as_timedelta, option_docs, options_markdown

ROOT = Path(__file__).resolve().parents[1]
NAMES = [f.name for f in dataclasses.fields(MiCSOptions)]
DEFAULTS = {f.name: f.default for f in dataclasses.fields(MiCSOptions)}


def test_every_option_has_a_docstring() -> None:
    docs = option_docs()
    assert list(docs) == NAMES
    assert all(len(text) > 20 for text in docs.values())


def test_the_docs_table_is_generated_from_the_options() -> None:
    text = (ROOT / "docs" / "options.md").read_text()
    match = re.search(r"<!-- BEGIN OPTIONS TABLE.*?-->\n(.*?)\n<!-- END OPTIONS TABLE -->", text, re.S)
    assert match is not None, "docs/options.md lost its table markers"
    assert match.group(1) == options_markdown(), "regenerate: python -m lightning_mics.options --markdown"
    documented = re.findall(r"^\| `(\w+)` \|", match.group(1), re.M)
    assert documented == NAMES


def test_the_hydra_strategy_config_lists_every_option_with_its_default() -> None:
    config = yaml.safe_load((ROOT / "conf" / "strategy" / "mics.yaml").read_text())
    assert config.pop("_target_") == "lightning_mics.MiCSStrategy"
    assert sorted(config) == sorted(NAMES)
    config.pop("ranks_per_node")  # interpolated from the cluster group
    config["timeout"] = as_timedelta(config["timeout"])
    assert config == {name: value for name, value in DEFAULTS.items() if name != "ranks_per_node"}


def test_lightning_cli_sees_every_option_of_both_front_ends() -> None:
    for strategy in (MiCSStrategy, MiCSFabricStrategy):
        parser = ArgumentParser(exit_on_error=False)
        parser.add_class_arguments(strategy, "strategy")
        keys = {action.dest.split(".", 1)[1] for action in parser._actions if action.dest.startswith("strategy.")}
        assert set(NAMES) <= keys, set(NAMES) - keys
    parsed = parser.parse_args(["--strategy.partition_size=2", "--strategy.grad_accumulation=unsharded"])
    assert (parsed.strategy.partition_size, parsed.strategy.grad_accumulation) == (2, "unsharded")


def test_options_by_name_or_as_an_object_with_overrides() -> None:
    base = MiCSOptions(partition_size=2, prefetch_depth=3)
    strategy = MiCSStrategy(base, prefetch_depth=0)
    assert strategy.options == dataclasses.replace(base, prefetch_depth=0)
    assert (strategy.partition_size_spec, strategy.prefetch_depth) == (2, 0)
    fabric_strategy = MiCSFabricStrategy(partition_size=2, cross_replica_dtype="bf16")
    assert fabric_strategy.options == MiCSOptions(partition_size=2, cross_replica_dtype="bf16")


def test_setting_an_option_attribute_revalidates() -> None:
    strategy = MiCSStrategy()
    strategy.save_full_state_dict = True
    assert strategy.options.save_full_state_dict is True
    with pytest.raises(ValueError, match="prefetch_depth must be a non-negative int"):
        strategy.prefetch_depth = -1


def test_an_unknown_option_names_the_closest_one() -> None:
    with pytest.raises(TypeError, match="unknown option 'partiton_size': did you mean 'partition_size'"):
        MiCSStrategy(partiton_size=2)
    with pytest.raises(TypeError, match="first argument of MiCSStrategy is a lightning_mics.MiCSOptions"):
        MiCSStrategy(8)  # type: ignore[arg-type]


@pytest.mark.parametrize("name", sorted(TRAINER_ONLY))
def test_fabric_refuses_trainer_only_options_saying_why(name: str) -> None:
    value = not DEFAULTS[name]
    MiCSStrategy(**{name: value})  # the Trainer takes it
    with pytest.raises(ValueError, match=f"{name} is a Trainer option"):
        MiCSFabricStrategy(**{name: value})
    with pytest.raises(ValueError, match="grad_accumulation='auto' needs the number of micro-steps"):
        MiCSFabricStrategy(grad_accumulation="auto")


def test_fabric_keeps_the_trajectory_only_when_asked_and_only_through_training_batches() -> None:
    from lightning_mics import FaultTolerance

    MiCSStrategy(fault_tolerance=FaultTolerance(keep_trajectory=True))  # the Trainer keeps the trajectory
    kept = MiCSFabricStrategy(fault_tolerance=FaultTolerance(keep_trajectory=True))
    assert kept._keeps_trajectory
    assert not MiCSFabricStrategy(fault_tolerance=FaultTolerance())._keeps_trajectory  # unset: fixed shares
    fixed = MiCSFabricStrategy(fault_tolerance={"keep_trajectory": False})
    with pytest.raises(ValueError, match="training_batches .* needs .*keep_trajectory=True"):
        fixed.training_batches([], accumulate=1)
    with pytest.raises(RuntimeError, match="Set up the model and its optimizer"):
        kept.training_batches([], accumulate=1)


def test_lightning_cli_takes_fault_tolerance_as_true_or_its_fields() -> None:
    from lightning_mics import FaultTolerance

    parser = ArgumentParser(exit_on_error=False)
    parser.add_class_arguments(MiCSStrategy, "strategy")
    assert parser.parse_args(["--strategy.fault_tolerance=true"]).strategy.fault_tolerance is True
    fields = '{"lighthouse": "http://h:29510", "replica_group": 1, "num_replica_groups": 2}'
    built = parser.instantiate(parser.parse_args([f"--strategy.fault_tolerance={fields}"]))
    assert built.strategy.options.fault_tolerance == FaultTolerance("http://h:29510", 1, 2)
