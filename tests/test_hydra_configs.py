"""The Hydra config groups compose, instantiate, accept overrides, and reject bad input clearly."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir
from hydra.errors import ConfigCompositionException, MissingConfigException
from hydra.utils import instantiate
from lightning.pytorch.strategies import FSDPStrategy
from lm_jobs import CONF_DIR, load_train_script
from omegaconf import DictConfig
from omegaconf.errors import MissingMandatoryValue

from examples.models import ByteCorpusDataModule, GPTConfig, GPTLightningModule
from lightning_mics import MiCSStrategy, ShardingSpec
from lightning_mics.wire import INT8


def options(group: str) -> list[str]:
    return sorted(p.stem for p in (CONF_DIR / group).glob("*.yaml"))


@pytest.fixture(scope="module", autouse=True)
def hydra_context() -> Iterator[None]:
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        yield


def config(*overrides: str) -> DictConfig:
    return compose(config_name="config", overrides=list(overrides))


def test_every_group_has_its_options() -> None:
    assert options("strategy") == ["fsdp_hybrid", "mics", "mics_auto", "mics_diloco", "replicate", "zero3"]
    assert {"gpt_tiny", "gpt_small", "gpt_xl"} <= set(options("model"))
    assert options("trainer") == ["cpu", "gpu"]
    assert "pydoc" in options("data")


def test_defaults_are_mics_on_four_cpu_ranks_as_two_nodes() -> None:
    cfg = config()
    strategy = instantiate(cfg.strategy, _convert_="all")
    assert isinstance(strategy, MiCSStrategy)
    assert strategy.partition_size_spec is None and strategy.ranks_per_node_override == 2
    assert cfg.trainer.accelerator == "cpu" and cfg.trainer.devices == 4
    layout = load_train_script().validate_layout(cfg)
    assert (layout.partition_size, layout.replication_degree) == (2, 2)


@pytest.mark.parametrize(("option", "partition_size"), [("mics", None), ("zero3", "world"), ("replicate", 1)])
def test_mics_strategy_options(option: str, partition_size: object) -> None:
    strategy = instantiate(config(f"strategy={option}").strategy, _convert_="all")
    assert isinstance(strategy, MiCSStrategy) and strategy.partition_size_spec == partition_size


def test_mics_auto_option_plans_the_layout_for_the_measured_cluster() -> None:
    strategy = instantiate(config("strategy=mics_auto").strategy, _convert_="all")
    assert isinstance(strategy, MiCSStrategy) and strategy.partition_size_spec is None
    assert (strategy.sharding, strategy.grad_accumulation_spec, strategy.planner_cluster) == ("auto", "auto", "calibrate")


def test_mics_diloco_option_with_overrides_for_h_and_the_outer_optimizer() -> None:
    strategy = instantiate(config("strategy=mics_diloco").strategy, _convert_="all")
    assert (strategy.options.cross_replica_sync, strategy.options.sync_every) == ("diloco", 8)
    outer = strategy.options.outer_optimizer([torch.zeros(2, requires_grad=True)])
    assert isinstance(outer, torch.optim.SGD)
    assert {k: outer.defaults[k] for k in ("lr", "momentum", "nesterov")} == {"lr": 0.7, "momentum": 0.9, "nesterov": True}
    strategy = instantiate(
        config(
            "strategy=mics_diloco",
            "strategy.sync_every=32",
            "strategy.outer_optimizer.lr=0.5",
            "strategy.cross_replica_dtype=bf16",
        ).strategy,
        _convert_="all",
    )
    assert strategy.options.sync_every == 32 and strategy.cross_replica_dtype == torch.bfloat16
    assert strategy.options.outer_optimizer([torch.zeros(2, requires_grad=True)]).defaults["lr"] == 0.5
    strategy = instantiate(config("strategy=mics_diloco", "strategy.outer_optimizer=null").strategy, _convert_="all")
    assert strategy.options.outer_optimizer is None  # DiLoCo's default outer optimizer
    with pytest.raises(Exception, match="sync_every must be a positive int"):
        instantiate(config("strategy=mics_diloco", "strategy.sync_every=0").strategy, _convert_="all")


def test_amsp_sharding_spec_and_gpu_options_from_the_command_line() -> None:
    strategy = instantiate(
        config(
            "strategy.sharding={_target_:lightning_mics.ShardingSpec,params:node,grads:node,optim:world}",
            "strategy.hierarchical=false",
            "strategy.prefetch_depth=2",
            "strategy.activation_checkpointing_policy=true",
            "strategy.async_save=true",
            "strategy.checkpoint_verify=size",
            "strategy.grad_accumulation=unsharded",
            "strategy.cross_replica_dtype=bf16",
        ).strategy,
        _convert_="all",
    )
    assert strategy.sharding == ShardingSpec("node", "node", "world")
    assert (strategy.hierarchical, strategy.prefetch_depth, strategy.activation_checkpointing_policy) == (False, 2, True)
    assert strategy.engine.async_saver is not None and strategy.checkpoint_verify == "size"
    assert strategy.grad_accumulation == "unsharded" and strategy.cross_replica_dtype == torch.bfloat16


def test_int8_cross_replica_dtype_from_the_command_line() -> None:
    strategy = instantiate(config("strategy.cross_replica_dtype=int8").strategy, _convert_="all")
    assert strategy.cross_replica_dtype == "int8" and strategy.cross_replica_wire == INT8


def test_planner_chooses_the_whole_layout_from_the_command_line() -> None:
    strategy = instantiate(
        config("strategy.sharding=auto", "strategy.grad_accumulation=auto").strategy, _convert_="all"
    )
    assert (strategy.sharding, strategy.grad_accumulation_spec, strategy.grad_accumulation) == ("auto", "auto", None)


def test_fsdp_hybrid_baseline_builds_lightnings_strategy_on_gpu_and_refuses_cpu() -> None:
    strategy = instantiate(config("strategy=fsdp_hybrid", "trainer=gpu", "trainer.devices=4", "trainer.num_nodes=2").strategy)
    assert isinstance(strategy, FSDPStrategy)
    assert strategy.kwargs["device_mesh"] == (2, 4)
    with pytest.raises(Exception, match="runs on GPUs only"):
        instantiate(config("strategy=fsdp_hybrid").strategy)


@pytest.mark.parametrize("option", options("model"))
def test_every_model_size_composes_to_a_valid_gpt(option: str) -> None:
    cfg = config(f"model={option}")
    gpt_config: GPTConfig = instantiate(cfg.model.config)
    assert gpt_config.d_model % gpt_config.n_heads == 0
    assert cfg.data.seq_len == gpt_config.seq_len  # the data follows the model's context length
    if option == "gpt_tiny":  # only the tiny one is cheap enough to build here
        model = instantiate(cfg.model, _convert_="all")
        assert isinstance(model, GPTLightningModule)
        assert sum(p.numel() for p in model.parameters()) == gpt_config.num_params
    if option == "gpt_xl":
        assert 1.1e9 < gpt_config.num_params < 1.5e9


def test_data_options(tmp_path: Path) -> None:
    datamodule = instantiate(config().data)
    assert isinstance(datamodule, ByteCorpusDataModule)
    tokens, targets = next(iter(datamodule.train_dataloader()))
    assert tokens.shape == (8, 128) and (tokens[:, 1:] == targets[:, :-1]).all()
    with pytest.raises(MissingMandatoryValue, match="data.path"):
        instantiate(config("data=text_file").data)
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("hello MiCS " * 200)
    custom = instantiate(config("data=text_file", f"data.path={corpus}", "data.seq_len=16").data)
    assert custom.val_dataset()[0][0].shape == (16,)


def test_trainer_options() -> None:
    gpu = config("trainer=gpu")
    assert gpu.trainer.accelerator == "gpu" and gpu.trainer.precision == "bf16-mixed"
    assert gpu.strategy.ranks_per_node is None  # detected from the launcher on real nodes
    trainer = instantiate(config("trainer.devices=2").trainer, strategy=MiCSStrategy(), logger=False)
    assert trainer.num_devices == 2 and isinstance(trainer.strategy, MiCSStrategy)


def test_command_line_overrides() -> None:
    cfg = config(
        "strategy.partition_size=2", "trainer.devices=4", "trainer.accumulate_grad_batches=4", "model=gpt_small"
    )
    assert cfg.strategy.partition_size == 2 and cfg.trainer.accumulate_grad_batches == 4
    assert cfg.model.config.d_model == 768 and cfg.data.seq_len == 1024
    assert instantiate(cfg.strategy, _convert_="all").partition_size_spec == 2


def test_invalid_overrides_fail_with_a_clear_error() -> None:
    with pytest.raises(MissingConfigException, match="gpt_huge"):
        config("model=gpt_huge")
    with pytest.raises(ConfigCompositionException, match="partition_sz"):
        config("strategy.partition_sz=2")
    with pytest.raises(ValueError, match=r"Invalid MiCS layout.*Valid choices.*strategy.partition_size"):
        load_train_script().validate_layout(config("strategy.partition_size=3"))
    with pytest.raises(ValueError, match=r"trainer.max_steps='abc' is not an integer: write e.g. trainer.max_steps=1"):
        load_train_script().validate_trainer_numbers(config("trainer.max_steps=abc"))
    with pytest.raises(ValueError, match=r"trainer.gradient_clip_val='x' is not a number \(or null\)"):
        load_train_script().validate_trainer_numbers(config("trainer.gradient_clip_val=x"))
    load_train_script().validate_trainer_numbers(config("trainer.max_steps=7", "trainer.gradient_clip_val=0.5"))
    with pytest.raises(Exception, match="divisible by n_heads=5"):  # Hydra wraps it, message kept
        instantiate(config("model.config.n_heads=5").model.config)


@pytest.mark.parametrize("convert", ["all", "none"])
def test_fault_tolerance_fields_from_the_command_line_with_or_without_converting_the_config(convert: str) -> None:
    """``strategy.fault_tolerance`` as a dict of FaultTolerance's fields -- exact_trajectory and the catch-up heal
    included -- whether instantiate hands it over as a dict or as Hydra's own DictConfig."""
    override = ('strategy.fault_tolerance={lighthouse: "http://lighthouse:29510", replica_group: 1, '
                'num_replica_groups: 3, heal: catch_up, exact_trajectory: true}')
    strategy = instantiate(config(override).strategy, _convert_=convert)
    ft = strategy.options.fault_tolerance
    assert (ft.replica_group, ft.num_replica_groups, ft.heal, ft.exact_trajectory) == (1, 3, "catch_up", True)
