"""CPU offload (``cpu_offload``): the option, its refusals, the planner's memory and time, and -- on a GPU --
training with the sharded states in host memory exactly like one process.

What CPU can show: the option's validation and every refusal (a real Trainer and a real Fabric on CPU
ranks raise the error before anything starts), that FSDP2 itself would *not* refuse offload on a CPU mesh
(so the refusal is ours to make), that every ``fully_shard`` call of a layout gets the policy, the
planner's arithmetic with and without offload, and a model that fits only with it. What needs a GPU (skipped
here): the run itself -- shards and optimizer states in host memory, parameters equal to single-process
training (four gloo ranks share the one GPU, as in tests/test_cuda_path.py).
"""

from __future__ import annotations

import logging
from dataclasses import replace
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from distributed import run_ranks
from torch import nn
from torch.distributed.fsdp import CPUOffloadPolicy, OffloadPolicy
from toy import RunConfig, ToyModule, assert_matches_reference, full_parameters, trainer_kwargs

from lightning_mics import MiCSFabricStrategy, MiCSStrategy, ShardingSpec, post_forward_mesh, wrapping
from lightning_mics import offload as off
from lightning_mics import offload_option
from lightning_mics.engine import MiCSEngine
from lightning_mics.layout import MiCSLayout, layout_planner, resolve_layout
from lightning_mics.options import MiCSOptions
from lightning_mics.planner import (
    CLUSTER_PRESETS,
    GIB,
    ClusterSpec,
    ModelSpec,
    TrainingSpec,
    choose_layout,
    estimate,
    host_copies,
    memory_breakdown,
    plan,
    plan_layout_for,
)

PINNED = CPUOffloadPolicy(pin_memory=True)
CPU_RANKS = "on CPU ranks they already are there -- drop cpu_offload"


# ---------------------------------------------------------------------------------------------- the option


def test_the_option_maps_onto_fsdp2s_policy() -> None:
    assert MiCSOptions().cpu_offload is False and off.offload_policy(False) is None
    assert off.offload_policy(True) == PINNED  # page-locked: the copies run beside compute
    unpinned = CPUOffloadPolicy(pin_memory=False)
    assert off.offload_policy(unpinned) is unpinned
    assert MiCSStrategy(cpu_offload=True).cpu_offload is True
    assert MiCSFabricStrategy(cpu_offload=unpinned).options.cpu_offload == unpinned


@pytest.mark.parametrize(
    ("value", "message"),
    [("true", "write cpu_offload=True"), (1, "got 1"), (OffloadPolicy(), "got OffloadPolicy")],
)
def test_a_malformed_value_is_refused_when_the_strategy_is_built(value: Any, message: str) -> None:
    with pytest.raises(TypeError, match=f"cpu_offload must be True, False or a .*CPUOffloadPolicy.*{message}"):
        MiCSStrategy(cpu_offload=value)


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"cross_replica_dtype": "bf16"}, "with cross_replica_dtype='bf16'.*Drop cross_replica_dtype"),
        ({"cross_replica_dtype": "int8"}, "with cross_replica_dtype='int8'"),
        ({"fault_tolerance": {"lighthouse": "http://h:1", "replica_group": 0, "num_replica_groups": 2}}, "torchft"),
        ({"sharding": ShardingSpec(params=1, grads=2, optim=4)}, r"optim=4 > grads=2.*Use optim equal to grads"),
    ],
)
def test_refused_with_hooks_that_work_on_device_gradients(options: dict[str, Any], message: str) -> None:
    """Each of these runs on the gradient shards between backward and the step, which offload has moved."""
    with pytest.raises(ValueError, match=message):
        MiCSOptions(cpu_offload=True, **options)
    MiCSOptions(**options)  # each is fine alone


def test_optimizer_degrees_by_name_are_checked_once_the_world_is_known() -> None:
    spec = ShardingSpec(params="node", grads="node", optim="world")
    MiCSOptions(cpu_offload=True, sharding=spec)  # "world" vs "node" is unknown until launch
    with pytest.raises(ValueError, match="optim=16 > grads=8"):
        offload_option.check_offload_before_launch(True, "cuda", world_size=16, ranks_per_node=8, sharding=spec)
    offload_option.check_offload_before_launch(True, "cuda", world_size=8, ranks_per_node=8, sharding=spec)  # one node: equal
    offload_option.check_offload_before_launch(False, "cpu", world_size=16, ranks_per_node=8, sharding=spec)  # offload off


# ---------------------------------------------------------------------------------------------- CPU ranks


def test_a_trainer_on_cpu_ranks_refuses_cpu_offload_before_starting_them() -> None:
    with pytest.raises(ValueError, match=CPU_RANKS):
        pl.Trainer(accelerator="cpu", devices=2, strategy=MiCSStrategy(cpu_offload=True), logger=False)
    pl.Trainer(accelerator="cpu", devices=2, strategy=MiCSStrategy(), logger=False)  # the same without offload


def test_fabric_on_cpu_ranks_refuses_cpu_offload() -> None:
    from lightning.fabric import Fabric

    with pytest.raises(ValueError, match=CPU_RANKS):
        Fabric(accelerator="cpu", devices=2, strategy=MiCSFabricStrategy(cpu_offload=CPUOffloadPolicy(False)))


def test_a_layout_on_cpu_ranks_refuses_it_too() -> None:
    """Ranks started by an external launcher resolve their layout in every rank: the same error there."""
    with pytest.raises(ValueError, match=CPU_RANKS):
        resolve_layout(**_layout_args(device_type="cpu", backend="gloo"), cpu_offload=True)


def _fsdp2_on_a_cpu_mesh(rank: int, world: int) -> dict[str, str]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.distributed.init_process_group("gloo", rank=rank, world_size=world)
    mesh = init_device_mesh("cpu", (world,))
    outcome = {}
    for pin in (False, True):
        model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
        try:
            fully_shard(model[0], mesh=mesh, offload_policy=CPUOffloadPolicy(pin_memory=pin))
            fully_shard(model, mesh=mesh, offload_policy=CPUOffloadPolicy(pin_memory=pin))
            model(torch.randn(3, 4)).sum().backward()
            outcome[f"pin={pin}"] = "trained"
        except Exception as error:  # noqa: BLE001 -- what torch raises is what this records
            outcome[f"pin={pin}"] = f"{type(error).__name__}: {error}"
    return outcome


@pytest.mark.distributed
@pytest.mark.skipif(torch.cuda.is_available(), reason="shows what FSDP2 does on a machine without an accelerator")
def test_fsdp2_itself_would_not_refuse_offload_on_cpu_ranks() -> None:
    """Why the refusal is ours: unpinned, FSDP2 "offloads" to where the states already are and trains without
    a word; pinned, it fails with an error that does not say what is wrong with the job."""
    (outcome,) = run_ranks(_fsdp2_on_a_cpu_mesh, 1)
    assert outcome["pin=False"] == "trained"
    assert "cpu_offload" not in outcome["pin=True"] and outcome["pin=True"] != "trained"


# ---------------------------------------------------------------------------------------------- the layout


def _layout_args(**overrides: Any) -> dict[str, Any]:
    args: dict[str, Any] = dict(
        world_size=4,
        rank=0,
        ranks_per_node=2,
        partition_size=2,
        reshard_after_forward=True,
        sharding=None,
        hierarchical="auto",
        device_type="cuda",
        backend="nccl",
    )
    return args | overrides


def test_the_layout_records_offload_compares_it_and_logs_it() -> None:
    offloaded = resolve_layout(**_layout_args(), cpu_offload=True)
    plain = resolve_layout(**_layout_args())
    assert (offloaded.cpu_offload, plain.cpu_offload) == (PINNED, None)
    # a model sharded with its states on the host is not the same model as one sharded without
    assert plain.differences(offloaded) == ["cpu_offload: None vs CPUOffloadPolicy(pin_memory=True)"]
    text = MiCSLayout(offloaded, device_mesh=None).describe(nn.Linear(4, 4), num_units=1)  # type: ignore[arg-type]
    assert "cpu offload: on -- sharded parameters, gradients and optimizer states in pinned host memory" in text
    assert "cpu offload" not in MiCSLayout(plain, device_mesh=None).describe(nn.Linear(4, 4), 1)  # type: ignore


def test_a_spec_whose_optimizer_degree_resolves_beyond_the_gradients_is_refused_in_the_layout() -> None:
    spec = ShardingSpec(params="node", grads="node", optim="world")
    with pytest.raises(ValueError, match="optim=4 > grads=2"):
        resolve_layout(**_layout_args(partition_size=None, sharding=spec), cpu_offload=True)


def test_every_fully_shard_call_gets_the_policy(monkeypatch: pytest.MonkeyPatch) -> None:
    """Blocks (through the post-forward-mesh helper) and the root alike: a unit left out would keep its
    states on the GPU."""
    calls: list[tuple[str, Any]] = []

    def fake_fully_shard(module: nn.Module, **kwargs: Any) -> nn.Module:
        calls.append((type(module).__name__, kwargs.get("offload_policy")))
        module.set_force_sum_reduction_for_comms = lambda enabled: None  # type: ignore[assignment]
        return module

    monkeypatch.setattr(wrapping, "fully_shard", fake_fully_shard)
    monkeypatch.setattr(post_forward_mesh, "fully_shard", fake_fully_shard)
    root = nn.Sequential(nn.ModuleList([nn.Linear(4, 4), nn.Linear(4, 4)]), nn.Linear(4, 2))
    wrapping.shard_model(root, mesh=None, offload_policy=PINNED)  # type: ignore[arg-type]
    assert calls == [("Linear", PINNED), ("Linear", PINNED), ("Sequential", PINNED)]
    calls.clear()
    wrapping.shard_model(nn.Sequential(nn.ModuleList([nn.Linear(4, 4)])), mesh=None)  # type: ignore[arg-type]
    assert [policy for _, policy in calls] == [None, None]  # without offload: FSDP2's default (no policy)


def test_states_fsdp_does_not_manage_move_and_nothing_else() -> None:
    module = nn.BatchNorm1d(3)
    off.move_unsharded_states(module, torch.device("meta"))
    assert {t.device.type for t in [*module.parameters(), *module.buffers()]} == {"meta"}


def test_the_engine_hands_the_option_to_the_layout() -> None:
    class Rank:  # what MiCSEngine.resolve_layout reads of a strategy
        world_size, global_rank, num_processes, is_global_zero = 4, 0, 4, False
        root_device = torch.device("cuda", 0)

    engine = MiCSEngine(MiCSOptions(cpu_offload=True, partition_size=2))
    engine.backend = "nccl"
    assert engine.resolve_layout(Rank(), None, "32-true", 1).cpu_offload == PINNED


def test_clipping_offloaded_gradients_on_nccl_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    """The norm's all-reduce would get host tensors, which NCCL does not take; gloo does (no refusal)."""
    param = nn.Parameter(torch.zeros(3))
    param.grad = torch.ones(3)  # where offload leaves it: host memory
    monkeypatch.setattr(off.dist, "is_initialized", lambda: True)
    monkeypatch.setattr(off.dist, "get_backend", lambda group=None: "gloo")
    off.check_clipping([param])
    monkeypatch.setattr(off.dist, "get_backend", lambda group=None: "nccl")
    with pytest.raises(ValueError, match="clipping by norm does not work with cpu_offload on NCCL"):
        off.check_clipping([param])


# ---------------------------------------------------------------------------------------------- the planner

#: 12 layers + the root unit; 1.2e9 parameters, bf16-mixed (4-byte params and grads, 8-byte Adam states).
MODEL = ModelSpec(params=1_200_000_000, layers=12, hidden=2048, seq_len=1024)
ONE_NODE = ClusterSpec.generic(nodes=1, gpus_per_node=8, gpu_memory_bytes=16 * GIB)


def test_offload_counts_only_what_stays_on_the_device() -> None:
    layout = ShardingSpec.uniform(4).resolve(8, 8)
    psi, units = float(MODEL.params), MODEL.num_units
    plain = memory_breakdown(layout, MODEL, TrainingSpec())
    offloaded = memory_breakdown(layout, MODEL, TrainingSpec(cpu_offload=True))
    assert (plain.params, plain.grads, plain.optimizer, plain.host) == (psi * 4 / 4, psi * 4 / 4, psi * 8 / 4, 0)
    assert (offloaded.params, offloaded.grads, offloaded.optimizer) == (0, 0, 0)
    assert offloaded.host == pytest.approx(psi * (4 + 4) / 4 + psi * 8 / 4)  # the states, now in host memory
    assert (offloaded.held_params, offloaded.activations) == (plain.held_params, plain.activations)
    assert offloaded.buffers == pytest.approx(plain.buffers + 2 * psi / units * 4 / 4)  # + shards copied in
    # a partition of one gathers nothing without offload; with it every unit is copied in from the host
    one = ShardingSpec.uniform(1).resolve(8, 8)
    assert memory_breakdown(one, MODEL, TrainingSpec()).buffers == 0
    assert memory_breakdown(one, MODEL, TrainingSpec(cpu_offload=True)).buffers > 0
    # ... and accumulates unsharded on the device across micro-steps (FSDP2 keeps that accumulator there)
    accumulating = memory_breakdown(one, MODEL, TrainingSpec(cpu_offload=True, accumulation=4))
    assert accumulating.grads == psi * 4


def test_offload_costs_pcie_copies_and_a_host_optimizer_step() -> None:
    layout = ShardingSpec.uniform(4).resolve(8, 8)  # P = G: reshards after forward, gathers again in backward
    psi, units, link = float(MODEL.params), MODEL.num_units, ONE_NODE.host_link_bandwidth
    plain = estimate(layout, ONE_NODE, MODEL, TrainingSpec())
    offloaded = estimate(layout, ONE_NODE, MODEL, TrainingSpec(cpu_offload=True))
    shards = psi * 4 / 4 / link  # one copy of this rank's parameter shards, host to device
    assert offloaded.host_copy_s == pytest.approx(shards + shards * (units - 1) / units + psi * 4 / 4 / link)
    assert plain.host_copy_s == 0 and not plain.cpu_offload and offloaded.cpu_offload
    ratio = ONE_NODE.memory_bandwidth / ONE_NODE.host_memory_bandwidth
    assert offloaded.optimizer_step_s == pytest.approx(plain.optimizer_step_s * ratio)
    assert offloaded.step_time_s > plain.step_time_s  # offload buys memory, not speed
    # sharded accumulation over several micro-steps adds to host gradients: those copies are synchronous
    copies = host_copies(layout, MODEL, TrainingSpec(cpu_offload=True, accumulation=4), ONE_NODE)
    assert copies.blocking_s == pytest.approx(4 * psi * 4 / 4 / link) and copies.backward_s < copies.forward_s
    unsharded = host_copies(layout, MODEL, TrainingSpec(cpu_offload=True, accumulation=4), ONE_NODE, "unsharded")
    assert (unsharded.blocking_s, unsharded.boundary_s) == (0, pytest.approx(psi * 4 / 4 / link))
    faster_link = replace(ONE_NODE, host_link_bandwidth=2 * link)  # overridable by the cluster spec
    assert host_copies(layout, MODEL, TrainingSpec(cpu_offload=True), faster_link).forward_s == pytest.approx(
        shards / 2
    )


def test_a_model_too_big_for_the_devices_fits_with_offload() -> None:
    forty_billion, training = 40_000_000_000, TrainingSpec(activation_checkpointing=True)
    with pytest.raises(ValueError, match="no partition size fits.*cpu_offload=True on GPUs"):
        choose_layout(8, 8, forty_billion, 40 * GIB, training=training)
    choice = choose_layout(8, 8, forty_billion, 40 * GIB, training=replace(training, cpu_offload=True))
    assert choice.estimate.fits and choice.estimate.cpu_offload
    assert choice.estimate.memory.host > 40 * GIB > choice.estimate.memory.total


def test_with_offload_auto_sharding_can_pick_a_smaller_partition() -> None:
    """MiCS's case: on 4 nodes with 100 Gbps links and 8 micro-steps per step, a 20B model needs partitions
    of 16 (spanning nodes) to fit its states in 32 GiB; with the states on the host a partition of one node
    fits, and keeps the per-micro-step reduce-scatters off the slow links: the planner takes it."""
    cluster = replace(CLUSTER_PRESETS["p3dn"], nodes=4)
    model = ModelSpec.from_param_count(20_000_000_000, seq_len=512)
    training = TrainingSpec(accumulation=8, activation_checkpointing=True)
    plain = choose_layout(32, 8, model.params, 32 * GIB, cluster, model, training, uniform_only=False)
    offloaded = choose_layout(
        32, 8, model.params, 32 * GIB, cluster, model, replace(training, cpu_offload=True), uniform_only=False
    )
    assert (plain.partition_size, offloaded.partition_size) == (16, 8)
    assert offloaded.estimate.step_time_s < plain.estimate.step_time_s
    assert plan(cluster, model, training).find(8, 8, 8).fits is False  # without offload one node cannot hold it


def test_offload_never_plans_optimizer_states_across_replicas() -> None:
    ranked = plan(replace(ONE_NODE, nodes=2), MODEL, TrainingSpec(cpu_offload=True)).ranked
    assert ranked and all(c.layout.optim == c.layout.grads for c in ranked)
    assert any(c.layout.optim > c.layout.grads for c in plan(replace(ONE_NODE, nodes=2), MODEL).ranked)


def test_the_plan_report_and_the_layout_log_say_offload_is_on(caplog: pytest.LogCaptureFixture) -> None:
    result = plan(ONE_NODE, MODEL, TrainingSpec(cpu_offload=True), uniform_only=True)
    assert "cpu offload on:" in result.explain() and "cpu-offload" in result.table()
    assert result.to_dict()["winner"]["cpu_offload"] is True and result.to_dict()["training"]["cpu_offload"]
    module = nn.Linear(64, 64)
    assert plan_layout_for(module, 2, 2, "cpu", cpu_offload=True).estimate.cpu_offload
    planner = layout_planner(
        module, world_size=2, device=torch.device("cpu"), precision="32-true", accumulation=1,
        log=logging.getLogger("test_cpu_offload"), cpu_offload=True,
    )
    with caplog.at_level(logging.INFO, logger="test_cpu_offload"):
        planner(2, None, "sharded", True)
    assert "cpu offload on:" in caplog.text and "host optimizer step" in caplog.text


# ---------------------------------------------------------------------------------------------- configs


def test_hydra_and_the_command_line_take_it() -> None:
    from hydra import compose, initialize_config_dir
    from hydra.utils import instantiate
    from jsonargparse import ArgumentParser
    from lm_jobs import CONF_DIR

    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        assert compose(config_name="config").strategy.cpu_offload is False
        on = compose(config_name="config", overrides=["strategy.cpu_offload=true"])
        assert instantiate(on.strategy, _convert_="all").options.cpu_offload is True
        policy = "{_target_: torch.distributed.fsdp.CPUOffloadPolicy, pin_memory: false}"
        given = compose(config_name="config", overrides=[f"strategy.cpu_offload={policy}"])
        assert instantiate(given.strategy, _convert_="all").options.cpu_offload == CPUOffloadPolicy(pin_memory=False)
    parser = ArgumentParser(exit_on_error=False)
    parser.add_class_arguments(MiCSStrategy, "strategy")
    assert parser.parse_args(["--strategy.cpu_offload=true"]).strategy.cpu_offload is True
    built = parser.instantiate(parser.parse_args(['--strategy.cpu_offload={"pin_memory": false}']))
    assert built.strategy.options.cpu_offload == CPUOffloadPolicy(pin_memory=False)


# ---------------------------------------------------------------------------------------------- on a GPU

WORLD = 4
#: as tests/test_cuda_path.py: fp32 on GPU vs the CPU reference, and bf16-mixed's bound
VARIANTS: dict[str, tuple[str, RunConfig, float]] = {
    "fp32": ("32-true", RunConfig(world_size=WORLD), 1e-4),
    "bf16 accumulate+clip": ("bf16-mixed", RunConfig(world_size=WORLD, accumulate=3, clip=0.5), 3e-2),
}


def _train_offloaded(rank: int, world: int, names: tuple[str, ...]) -> dict[str, dict[str, Any]]:
    device = torch.device("cuda", 0)
    torch.cuda.set_device(device)  # every rank on GPU 0 (gloo: NCCL refuses two ranks on one device)
    results = {}
    for name in names:
        precision, cfg, _ = VARIANTS[name]
        strategy = MiCSStrategy(
            parallel_devices=[device] * WORLD, process_group_backend="gloo", partition_size=2, cpu_offload=True
        )
        module = ToyModule(cfg)
        kwargs = {**trainer_kwargs(cfg), "accelerator": "cuda", "devices": 1, "precision": precision}
        trainer = pl.Trainer(strategy=strategy, **kwargs)
        trainer.fit(module)
        states = [t for state in trainer.optimizers[0].state.values() for t in state.values() if torch.is_tensor(t)]
        results[name] = {
            "params": full_parameters(module),
            "shard_devices": {p.to_local().device.type for p in module.parameters()},
            "optimizer_state_devices": {(t.to_local() if hasattr(t, "to_local") else t).device.type for t in states},
        }
    return results


@pytest.mark.distributed
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_offloaded_ranks_on_one_gpu_match_single_process() -> None:
    per_rank = run_ranks(_train_offloaded, WORLD, tuple(VARIANTS))
    for name, (_, cfg, rtol) in VARIANTS.items():
        runs = [rank[name] for rank in per_rank]
        for run in runs:
            assert run["shard_devices"] == {"cpu"}  # the sharded parameters live in host memory
            assert run["optimizer_state_devices"] == {"cpu"}  # so the optimizer's states were made there
        assert_matches_reference([run["params"] for run in runs], cfg, rtol=rtol)


# ---------------------------------------------------------------------------------- the GPU benchmark (CPU parts)


def _gpu_benchmark(module: str = "gpu_throughput") -> Any:
    """``benchmarks/<module>.py``, one of the GPU benchmark's modules."""
    import importlib
    import sys
    from pathlib import Path

    repo = str(Path(__file__).resolve().parents[1])
    if repo not in sys.path:  # `benchmarks` is a folder of the repository, not an installed package
        sys.path.insert(0, repo)
    return importlib.import_module(f"benchmarks.{module}")


def test_the_benchmark_searches_few_models_for_the_largest_that_fits() -> None:
    largest = _gpu_benchmark("gpu_largest")
    tried: list[int] = []

    def fits_up_to(limit: int) -> Any:
        def fits(layers: int) -> bool:
            tried.append(layers)
            return layers <= limit

        return fits

    assert largest.search_largest(fits_up_to(150), 24, 512) == 150
    assert tried == [24, 48, 96, 192, 144, 168, 156, 150]  # doubling, then bisection to within 1/16
    assert largest.search_largest(fits_up_to(5), 24, 512) == 5  # the preset itself is too big: halving first
    assert largest.search_largest(fits_up_to(0), 24, 512) is None
    assert largest.search_largest(fits_up_to(10**6), 24, 100) == 100  # --max-layers


def test_the_benchmark_takes_cpu_offload_on_gpus_only(capsys: pytest.CaptureFixture[str]) -> None:
    bench, loops, largest = _gpu_benchmark(), _gpu_benchmark("gpu_loops"), _gpu_benchmark("gpu_largest")
    cfg, _ = bench.parse_args(["--cpu-offload"])
    assert cfg.cpu_offload and cfg.modes == ("strategy", "strategy-compiled")  # the plain loop has no offload
    assert loops.strategy_options(cfg, compiled=False)["cpu_offload"] is True
    assert bench.parse_args(["--find-largest"])[0].find_largest == "both"
    for argv, message in (
        (["--cpu-offload", "--device", "cpu"], "--cpu-offload moves the strategy's states"),
        (["--cpu-offload", "--modes", "plain,strategy"], "the plain loop has no offload"),
        (["--find-largest", "offload", "--device", "cpu"], "on --device cuda"),
    ):
        with pytest.raises(SystemExit):
            bench.parse_args(argv)
        assert message in capsys.readouterr().err
    found = [largest.Largest(False, 48, 2_400_000_000, []), largest.Largest(True, None)]
    text = largest.format_largest(cfg, found)
    assert "states on the GPU   48 layers, 2.40B params: n/a" in text and "with cpu_offload    none" in text
