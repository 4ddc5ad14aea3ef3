"""Which modules become FSDP units, and how precision flags map to FSDP2 policies (no processes)."""

from __future__ import annotations

import pytest
import torch
from lightning.pytorch.plugins.precision import DoublePrecision, HalfPrecision, MixedPrecision, Precision
from torch import nn
from toy import Block, ToyLM

from lightning_mics.precision import MiCSPrecision
from lightning_mics.wrapping import materialize_meta_module, select_modules_to_wrap


def _names(model, policy):
    return [name for name, _ in select_modules_to_wrap(model, policy)]


def test_default_policy_wraps_module_list_children_bottom_up():
    assert _names(ToyLM(), None) == ["blocks.2", "blocks.1", "blocks.0"]


def test_class_and_callable_policies():
    model = ToyLM()
    assert _names(model, nn.Linear) == [
        "blocks.2.gate", "blocks.2.mix", "blocks.1.gate", "blocks.1.mix", "blocks.0.gate", "blocks.0.mix"
    ]  # the tied head is skipped: it shares its weight with the embedding
    assert _names(model, [Block]) == ["blocks.2", "blocks.1", "blocks.0"]
    assert _names(model, lambda name, module: name == "blocks.1") == ["blocks.1"]
    assert _names(model, False) == []


def test_tied_parameter_keeps_module_in_common_ancestor_unit():
    model = ToyLM()
    model.blocks[0].mix.weight = model.blocks[2].mix.weight  # tie two blocks together
    assert _names(model, None) == ["blocks.1"]


def test_bad_policy_is_one_clear_error():
    with pytest.raises(TypeError, match="auto_wrap_policy"):
        select_modules_to_wrap(ToyLM(), 42)
    with pytest.raises(TypeError, match="nn.Module subclasses"):
        select_modules_to_wrap(ToyLM(), [nn.Linear, "Block"])


def test_meta_materialisation_requires_reset_parameters():
    class NoReset(nn.Module):
        def __init__(self):
            super().__init__()
            self.w = nn.Parameter(torch.empty(3))

    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(2, 2), NoReset())
    with pytest.raises(TypeError, match="reset_parameters"):
        materialize_meta_module(model, torch.device("cpu"))


def test_meta_materialisation_initialises_values():
    with torch.device("meta"):
        model = nn.Linear(4, 4)
    materialize_meta_module(model, torch.device("cpu"))
    assert not model.weight.is_meta and model.weight.abs().sum() > 0


@pytest.mark.parametrize(
    ("flag", "param_dtype", "reduce_dtype"),
    [
        ("32-true", None, None),
        ("bf16-true", None, None),
        ("bf16-mixed", torch.bfloat16, torch.float32),
        ("16-mixed", torch.float16, torch.float32),
    ],
)
def test_precision_policy(flag, param_dtype, reduce_dtype):
    policy = MiCSPrecision(flag).mixed_precision_policy()
    assert (policy.param_dtype, policy.reduce_dtype) == (param_dtype, reduce_dtype)


def test_mixed_precision_autocasts_on_the_training_device():
    plugin = MiCSPrecision("bf16-mixed")
    plugin.device_type = "cpu"
    with plugin.forward_context():
        out = torch.nn.functional.linear(torch.randn(2, 3), torch.randn(4, 3))
    assert out.dtype == torch.bfloat16


def test_bf16_true_casts_the_module():
    model = MiCSPrecision("bf16-true").convert_module(nn.Linear(2, 2))
    assert model.weight.dtype == torch.bfloat16


@pytest.mark.parametrize(
    "plugin", [Precision(), HalfPrecision("bf16-true"), MixedPrecision("bf16-mixed", "cpu")]
)
def test_lightning_plugins_convert(plugin):
    assert MiCSPrecision.from_plugin(plugin).precision == plugin.precision


@pytest.mark.parametrize("plugin", [DoublePrecision(), HalfPrecision("16-true")])
def test_unsupported_precision_is_one_clear_error(plugin):
    with pytest.raises(ValueError, match="32-true, bf16-mixed, 16-mixed, bf16-true"):
        MiCSPrecision.from_plugin(plugin)


def test_layout_log_says_when_the_whole_model_is_one_unit() -> None:
    from lightning_mics.layout import MiCSLayout
    from lightning_mics.topology import MiCSTopology

    layout = MiCSLayout(MiCSTopology.create(4, 2, 2), None, None, True, "gloo")  # type: ignore[arg-type]
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU(), torch.nn.Linear(4, 2))  # no ModuleList
    assert "pass auto_wrap_policy={YourBlockClass}" in layout.describe(model, num_units=1)
    assert "auto_wrap_policy" not in layout.describe(model, num_units=3)
    replicated = MiCSLayout(MiCSTopology.create(4, 2, 1), None, None, True, "gloo")  # type: ignore[arg-type]
    assert "auto_wrap_policy" not in replicated.describe(model, num_units=1)  # nothing is gathered anyway
