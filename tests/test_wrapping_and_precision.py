"""Which modules become FSDP units, and how precision flags map to FSDP2 policies (no processes), and one
multi-rank check that a CNN without an ``nn.ModuleList`` trains sharded in several units."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from distributed import run_ranks
from lightning.pytorch.plugins.precision import DoublePrecision, HalfPrecision, MixedPrecision, Precision
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, TensorDataset
from toy import Block, RunConfig, ToyLM, full_parameters, strip_prefix, trainer_kwargs

from lightning_mics.layout import LayoutSettings, MiCSLayout
from lightning_mics.precision import MiCSPrecision
from lightning_mics.topology import MiCSTopology
from lightning_mics.wrapping import SIZE_RULE, materialize_meta_module, plan_wrapping, select_modules_to_wrap


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


def test_layout_log_warns_when_the_whole_model_is_one_unit(caplog: pytest.LogCaptureFixture) -> None:
    layout = _layout(partition_size=2)
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2))
    with caplog.at_level(logging.INFO, logger="lightning_mics"):
        layout.log_description(logging.getLogger("lightning_mics.test"), model, 1, plan_wrapping(model, False))
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "pass auto_wrap_policy={YourBlockClass}" in warnings[0]
    assert "; 1 FSDP units (root)" in caplog.records[0].getMessage()
    assert layout.single_unit_warning(3) is None
    assert _layout(partition_size=1).single_unit_warning(1) is None  # nothing is gathered anyway


def _layout(partition_size: int) -> MiCSLayout:
    topology = MiCSTopology.create(4, 2, partition_size)
    settings = LayoutSettings(0, topology, None, True, "sharded", None, False, False, None, "cpu", "gloo")
    return MiCSLayout(settings, None)  # type: ignore[arg-type]


# ---------------------------------------------------------------------------------------------
# The default policy for models without an nn.ModuleList
# ---------------------------------------------------------------------------------------------


class BasicBlock(nn.Module):
    """torchvision's resnet block: two 3x3 convolutions with norms, a 1x1 projection when the shape changes."""

    def __init__(self, cin: int, cout: int, stride: int, norm: Callable[[int], nn.Module]) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = norm(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = norm(cout)
        self.downsample = (
            nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), norm(cout))
            if stride != 1 or cin != cout
            else None
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        identity = x if self.downsample is None else self.downsample(x)
        return torch.relu(self.bn2(self.conv2(torch.relu(self.bn1(self.conv1(x))))) + identity)


class ResNet18Like(nn.Module):
    """torchvision's resnet18 layout (stem, four ``nn.Sequential`` stages of two BasicBlocks, head):
    no ``nn.ModuleList`` anywhere. ``width=64, classes=1000`` has resnet18's 11,689,512 parameters."""

    def __init__(self, width: int = 64, classes: int = 1000, norm: Callable[[int], nn.Module] = nn.BatchNorm2d) -> None:
        super().__init__()
        w = width
        self.conv1 = nn.Conv2d(3, w, 7, 2, 3, bias=False)
        self.bn1 = norm(w)
        self.layer1 = nn.Sequential(BasicBlock(w, w, 1, norm), BasicBlock(w, w, 1, norm))
        self.layer2 = nn.Sequential(BasicBlock(w, 2 * w, 2, norm), BasicBlock(2 * w, 2 * w, 1, norm))
        self.layer3 = nn.Sequential(BasicBlock(2 * w, 4 * w, 2, norm), BasicBlock(4 * w, 4 * w, 1, norm))
        self.layer4 = nn.Sequential(BasicBlock(4 * w, 8 * w, 2, norm), BasicBlock(8 * w, 8 * w, 1, norm))
        self.fc = nn.Linear(8 * w, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.relu(self.bn1(self.conv1(x)))
        x = self.layer4(self.layer3(self.layer2(self.layer1(x))))
        return self.fc(x.mean(dim=(2, 3)))


def test_resnet_without_module_list_is_split_by_size_into_blocks_and_convolutions() -> None:
    model = ResNet18Like()
    assert sum(p.numel() for p in model.parameters()) == 11_689_512
    plan = plan_wrapping(model, None)
    assert [name for name, _ in plan.modules] == [
        "fc", "layer4.1.conv2", "layer4.1.conv1", "layer4.0.conv2", "layer4.0.conv1",
        "layer3.1", "layer3.0", "layer2", "layer1",
    ]  # children-first order; layer4's blocks (31% and 40% of the model) are split into their convolutions
    assert set(plan.rules) == {SIZE_RULE}
    assert not any(isinstance(m, nn.BatchNorm2d) for _, m in plan.modules)  # norms stay in their block / the root
    assert plan.summary() == (
        "4 x Conv2d + 2 x BasicBlock + 2 x Sequential + 1 x Linear by size, 148K-2.36M params each, root"
    )
    line = _layout(partition_size=2).describe(model, plan.num_units, plan)
    assert "; 10 FSDP units (4 x Conv2d + 2 x BasicBlock" in line


def test_size_rule_keeps_whole_blocks_when_they_split_the_model() -> None:
    """Eight equal blocks in one nn.Sequential: each block is a unit, never a layer inside one."""
    blocks = nn.Sequential(
        *[nn.Sequential(nn.Linear(16, 64), nn.GELU(), nn.Linear(64, 16), nn.LayerNorm(16)) for _ in range(8)]
    )
    model = nn.Sequential(nn.Embedding(50, 16), blocks, nn.LayerNorm(16))
    plan = plan_wrapping(model, None)
    assert [name for name, _ in plan.modules] == [f"1.{i}" for i in reversed(range(8))] + ["0"]
    assert plan.summary() == "8 x Sequential + 1 x Embedding by size, 800-2.16K params each, root"


class MyLayer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.proj(x)


class HFLikeModel(nn.Module):
    """Declares its layer class as Hugging Face models do; the layers sit nested in nn.Sequential."""

    _no_split_modules = ["MyLayer", "NotInThisModel"]

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(20, 8)
        self.encoder = nn.Sequential(nn.Sequential(MyLayer(), MyLayer()), nn.Sequential(MyLayer()))
        self.norm = nn.LayerNorm(8)


def test_no_split_modules_name_the_units_wherever_the_layers_sit() -> None:
    assert _names(HFLikeModel(), None) == ["encoder.1.0", "encoder.0.1", "encoder.0.0"]

    class Holder(nn.Module):  # a LightningModule holding a PreTrainedModel as an attribute
        def __init__(self) -> None:
            super().__init__()
            self.backbone = HFLikeModel()
            self.classifier = nn.Linear(8, 2)

    plan = plan_wrapping(Holder(), None)
    assert [name for name, _ in plan.modules] == [f"backbone.encoder.{i}" for i in ("1.0", "0.1", "0.0")]
    assert plan.summary() == "3 x MyLayer by _no_split_modules, root"


def test_no_split_modules_inside_module_list_stages_replace_the_empty_stages() -> None:
    class Staged(nn.Module):  # Hugging Face's ResNet: stages in an nn.ModuleList, layers named in _no_split_modules
        _no_split_modules = ["MyLayer"]

        def __init__(self) -> None:
            super().__init__()
            self.stages = nn.ModuleList(
                [nn.Sequential(MyLayer(), MyLayer()), nn.Sequential(MyLayer(), nn.LayerNorm(8))]
            )

    plan = plan_wrapping(Staged(), None)
    # stage 0 would own no parameter of its own (both layers are units): not a unit; stage 1 keeps its norm
    assert [name for name, _ in plan.modules] == ["stages.1.0", "stages.1", "stages.0.1", "stages.0.0"]
    assert plan.summary() == "3 x MyLayer by _no_split_modules, 1 x Sequential by nn.ModuleList children, root"


def test_malformed_no_split_modules_is_one_clear_error() -> None:
    model = HFLikeModel()
    model._no_split_modules = [MyLayer]  # classes, not names
    with pytest.raises(TypeError, match=r"list of module class names .*auto_wrap_policy=\{MyDecoderLayer\}"):
        plan_wrapping(model, None)


def test_explicit_policies_win_over_the_default_rules() -> None:
    assert _names(ResNet18Like(width=4), [BasicBlock]) == [f"layer{s}.{b}" for s in (4, 3, 2, 1) for b in (1, 0)]
    assert _names(ResNet18Like(width=4), False) == []
    assert _names(HFLikeModel(), lambda name, module: name == "embed") == ["embed"]  # _no_split_modules ignored
    assert set(plan_wrapping(HFLikeModel(), nn.LayerNorm).rules) == {"auto_wrap_policy"}


def test_size_rule_never_wraps_tied_modules_separately() -> None:
    body = nn.Sequential(*[nn.Sequential(nn.Linear(16, 16), nn.Tanh()) for _ in range(8)])
    embed, head = nn.Embedding(64, 16), nn.Linear(16, 64, bias=False)
    head.weight = embed.weight
    model = nn.Sequential(embed, body, nn.Sequential(nn.LayerNorm(16), head))  # the head sits in a container
    names = _names(model, None)
    assert names == [f"1.{i}" for i in reversed(range(8))]  # embedding, head and the head's container stay in the root
    shared = nn.Linear(16, 16)  # one module reused under two names: its parameters are tied to itself
    layers = [nn.Sequential(nn.Linear(16, 16), nn.Tanh()) for _ in range(8)]
    reused = nn.Sequential(*layers, shared, nn.Sequential(shared))
    assert _names(reused, None) == [str(i) for i in reversed(range(8))]
    assert _names(ToyLM(), None) == ["blocks.2", "blocks.1", "blocks.0"]  # ModuleList models: unchanged


def test_a_plan_for_another_root_is_refused() -> None:
    from lightning_mics.wrapping import shard_model

    with pytest.raises(ValueError, match="plan_wrapping"):
        shard_model(nn.Linear(2, 2), None, plan_wrapping(nn.Linear(2, 2), None))  # type: ignore[arg-type]


# ---------------------------------------------------------------------------------------------
# A CNN trains sharded, unit by unit, exactly as in one process
# ---------------------------------------------------------------------------------------------

CNN_CFG = RunConfig(world_size=2, micro_batch=2, steps=2, lr=0.1, momentum=0.9)


def _tiny_cnn() -> ResNet18Like:
    torch.manual_seed(CNN_CFG.seed)
    return ResNet18Like(width=4, classes=5, norm=lambda channels: nn.GroupNorm(2, channels))  # batch-independent


def _images() -> tuple[torch.Tensor, torch.Tensor]:
    """Global micro-batch ``i`` is rows ``[i * G, (i + 1) * G)``, ``G = world_size * micro_batch``."""
    g = torch.Generator().manual_seed(7)
    n = CNN_CFG.world_size * CNN_CFG.micro_batch * CNN_CFG.steps
    return torch.randn(n, 3, 16, 16, generator=g), torch.randint(0, 5, (n,), generator=g)


class CNNModule(pl.LightningModule):
    def __init__(self, rank: int) -> None:
        super().__init__()
        self.model = _tiny_cnn()
        self.rank = rank

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        images, labels = batch
        return F.cross_entropy(self.model(images), labels)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=CNN_CFG.lr, momentum=CNN_CFG.momentum)

    def train_dataloader(self) -> DataLoader:
        """This rank's part of each global micro-batch, fixed (no distributed sampler to reorder it)."""
        images, labels = _images()
        micro, world = CNN_CFG.micro_batch, CNN_CFG.world_size
        rows = [step * world * micro + self.rank * micro + i for step in range(CNN_CFG.steps) for i in range(micro)]
        return DataLoader(TensorDataset(images[rows], labels[rows]), batch_size=micro, shuffle=False)


def _train_cnn_sharded(rank: int, world_size: int) -> dict[str, Any]:
    from lightning_mics import MiCSStrategy

    module = CNNModule(rank)
    trainer = pl.Trainer(
        strategy=MiCSStrategy(partition_size=world_size), use_distributed_sampler=False, **trainer_kwargs(CNN_CFG)
    )
    trainer.fit(module)
    plan = trainer.strategy._wrap_plan
    units = trainer.strategy._fsdp_units
    return {"params": strip_prefix(full_parameters(module)), "units": len(units), "summary": plan.summary()}


def _train_cnn_in_one_process() -> dict[str, torch.Tensor]:
    model = _tiny_cnn()
    optimizer = torch.optim.SGD(model.parameters(), lr=CNN_CFG.lr, momentum=CNN_CFG.momentum)
    images, labels = _images()
    global_batch = CNN_CFG.world_size * CNN_CFG.micro_batch
    for step in range(CNN_CFG.steps):
        rows = slice(step * global_batch, (step + 1) * global_batch)
        optimizer.zero_grad()
        F.cross_entropy(model(images[rows]), labels[rows]).backward()
        optimizer.step()
    return {name: p.detach().clone() for name, p in model.named_parameters()}


@pytest.mark.distributed
def test_cnn_without_module_list_trains_sharded_in_several_units_as_in_one_process() -> None:
    per_rank = run_ranks(_train_cnn_sharded, CNN_CFG.world_size)
    reference = _train_cnn_in_one_process()
    initial = _tiny_cnn().state_dict()
    for rank, result in enumerate(per_rank):
        assert result["units"] == 10, result["summary"]  # the size rule split it, as for the full-size resnet18
        assert " by size, " in result["summary"], result["summary"]
        params = result["params"]
        assert sorted(params) == sorted(reference)
        for name, expected in reference.items():
            assert not torch.equal(expected, initial[name]), name  # training moved it: the comparison is not vacuous
            error = ((params[name] - expected).norm() / expected.norm()).item()
            assert error < 1e-5, f"rank {rank}, {name}: relative error {error:.2e}"
