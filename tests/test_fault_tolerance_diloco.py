"""Fault-tolerant semi-synchronous replica groups (``cross_replica_sync="diloco"`` with ``fault_tolerance``): with
every group live it is a hand-written DiLoCo; a group killed mid-round leaves the survivor committing rounds alone,
and its restart heals the global model and the outer momentum, bit-identical from then on; a mid-round checkpoint
resumes exactly.

Each replica group is its own world (a job), joined by torchft; the quorum, heal and commit run once per outer
round, at its synchronisation (as torchft's ``DiLoCo`` does). What must hold:

* with every group live, the run is DiLoCo: in fp64 every group's parameters and the last-synchronised (global)
  model equal a hand-written single-process DiLoCo over the groups' data shares (within 1e-10);
* a group killed mid-round misses rounds while the survivor trains on, committing rounds alone; a restarted
  group heals at a round's quorum -- the last-synchronised model and the outer optimizer's momentum too -- does
  not count twice in that round's average, and from then on holds bit-identical global state with the survivor.
"""

from __future__ import annotations

import copy
import os
import tempfile
import time
from pathlib import Path
from typing import Any, Optional

import pytest
import torch
from ft_harness import GROUP_WORLD, lighthouse, lose_and_restart_group_1, read, start_group, wait
from torch.utils.data import DistributedSampler
from toy import (
    Fp64Module,
    RunConfig,
    ToyLM,
    fp64_precision,
    full_parameters,
    lm_loss,
    make_dataset,
    strip_prefix,
    trainer_kwargs,
)

from lightning_mics import FaultTolerance, MiCSStrategy
from lightning_mics.hop2.diloco import default_outer_optimizer

pytest.importorskip("torchft")

GROUPS = 2
EVERY = 2  # H: outer rounds of two inner steps
RUN = RunConfig(world_size=GROUPS * GROUP_WORLD, micro_batch=2, accumulate=1, steps=8, lr=0.1, momentum=0.9)
LONG_RUN = RunConfig(world_size=GROUPS * GROUP_WORLD, micro_batch=2, accumulate=1, steps=16, lr=0.1, momentum=0.9)


def _global_state(trainer: Any) -> dict[str, Any]:
    """The last-synchronised model (unsharded), the outer momentum shards of this rank and the round counts."""
    (sync,) = trainer.strategy.engine.semi_sync.syncs
    momentum = {name: sync.outer.state[a]["momentum_buffer"].to_local().clone()
                for name, a in zip(sync.names, sync.anchors) if a in sync.outer.state}
    return {
        "anchors": strip_prefix({n: a.full_tensor().detach().clone() for n, a in zip(sync.names, sync.anchors)}),
        "anchor_shards": {n: a.to_local().clone() for n, a in zip(sync.names, sync.anchors)},
        "momentum": momentum,
        "outer_steps": sync.outer_steps,
        "dropped_rounds": sync.dropped_rounds,
        "fragments": [[sync.names[i] for i in fragment] for fragment in sync.fragments],
        "heals": trainer.strategy.engine.semi_sync.heals,
    }


def _run_group(
    rank: int, group: int, address: str, cfg: RunConfig, min_groups: int, role: str, marks: str,
    streaming: Optional[dict[str, Any]] = None,
) -> Any:
    import lightning.pytorch as pl

    options = streaming or {"sync_every": EVERY}
    round_steps = options["sync_every"] // options.get("num_fragments", 1)  # steps between two synchronisations

    class Record(pl.Callback):
        """Per step: (global step, groups in the last quorum). ``doomed``: rank 1 dies mid-round after a round
        with the other group (whichever group started first may have synchronised alone before); ``survivor``:
        once alone after being together, it notes it and slows down so that
        the restarted group heals before the end."""

        def __init__(self) -> None:
            self.steps: list[tuple[int, int]] = []

        def on_train_start(self, trainer, module) -> None:
            """The first two groups start training together, however long each took to start (a loaded host):
            otherwise one may finish alone before the other joins."""
            Path(marks, f"started{group}_{rank}").touch()
            if role in ("survivor", "doomed"):
                others = [Path(marks, f"started{other}_{rank}") for other in range(GROUPS)]
                deadline = time.monotonic() + 120
                while not all(path.exists() for path in others) and time.monotonic() < deadline:
                    time.sleep(0.1)

        def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx) -> None:
            manager = trainer.strategy.engine.replica_group.manager
            self.steps.append((trainer.global_step, manager.num_participants()))
            together = any(live == GROUPS for _, live in self.steps)
            if role == "doomed" and rank == 1 and together and trainer.global_step % round_steps == 1:
                os._exit(1)  # a node lost mid-round, after a round with the other group
            if role == "survivor" and together and manager.num_participants() == 1:
                Path(marks, f"alone{rank}").write_text(str(trainer.global_step))
                time.sleep(0.6)
            elif role in ("survivor", "doomed") and not together:
                time.sleep(0.3)  # a group that synchronised alone first waits for the other one

    ft = FaultTolerance(
        address, group, GROUPS, min_replica_groups=min_groups, timeout=20, quorum_timeout=60, check_parameters_every=1
    )
    record = Record()
    module = Fp64Module(cfg)
    strategy = MiCSStrategy(fault_tolerance=ft, cross_replica_sync="diloco", **options)
    kwargs = trainer_kwargs(cfg) | {"devices": GROUP_WORLD, "callbacks": [record], "plugins": [fp64_precision()]}
    trainer = pl.Trainer(strategy=strategy, **kwargs)
    trainer.fit(module)
    return {
        "params": strip_prefix(full_parameters(module)),
        "global_step": trainer.global_step,
        "steps": record.steps,
        **_global_state(trainer),
    }


def _reference(cfg: RunConfig) -> tuple[dict[str, torch.Tensor], list[dict[str, torch.Tensor]]]:
    """Single-process fp64 DiLoCo: group g's inner gradient is the mean over its ranks' samples, rank k = g * 2 + r
    of the job reading what Lightning's DistributedSampler gives share k of 4 (shuffled, seed 0, epoch 0);
    DiLoCo's outer Nesterov SGD."""
    torch.manual_seed(cfg.seed)
    base = ToyLM().double()
    models = [copy.deepcopy(base) for _ in range(GROUPS)]
    trainable = lambda m: [p for p in m.parameters() if p.requires_grad]  # noqa: E731
    inner = [torch.optim.SGD(trainable(m), lr=cfg.lr, momentum=cfg.momentum) for m in models]
    global_model = copy.deepcopy(base)
    outer = default_outer_optimizer(trainable(global_model))
    dataset = make_dataset(cfg.num_samples)
    tokens, targets = dataset.tensors
    share = [list(DistributedSampler(dataset, cfg.world_size, k, shuffle=True, seed=0)) for k in range(cfg.world_size)]
    for step in range(cfg.steps):
        for g, (model, optimizer) in enumerate(zip(models, inner)):
            rows = [
                share[k][step * cfg.micro_batch + j]
                for k in range(g * GROUP_WORLD, (g + 1) * GROUP_WORLD)
                for j in range(cfg.micro_batch)
            ]
            optimizer.zero_grad()
            lm_loss(model, (tokens[rows], targets[rows])).backward()
            optimizer.step()
        if (step + 1) % EVERY == 0:
            with torch.no_grad():
                for p, *replicas in zip(trainable(global_model), *(trainable(m) for m in models)):
                    p.grad = torch.stack([p - q for q in replicas]).mean(0)
                outer.step()
                outer.zero_grad()
                for model in models:
                    for p, q in zip(trainable(global_model), trainable(model)):
                        q.copy_(p)
    named = lambda m: {n: p.detach().clone() for n, p in m.named_parameters() if p.requires_grad}  # noqa: E731
    return named(global_model), [named(m) for m in models]


def _largest_difference(got: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> float:
    return max((got[name] - value).abs().max().item() for name, value in expected.items())


@pytest.mark.distributed
@pytest.mark.timeout(300)
def test_with_every_group_live_fault_tolerant_diloco_is_diloco_in_fp64() -> None:
    with lighthouse(min_replicas=GROUPS) as address, tempfile.TemporaryDirectory() as out_dir:
        jobs = [start_group(g, out_dir, _run_group, address, RUN, GROUPS, "steady", out_dir) for g in range(GROUPS)]
        for job in jobs:
            wait(job, timeout=240)
        results = [read(out_dir, g) for g in range(GROUPS)]
    global_model, replicas = _reference(RUN)
    for g in range(GROUPS):
        for result in results[g]:
            assert result["global_step"] == RUN.steps
            assert (result["outer_steps"], result["dropped_rounds"], result["heals"]) == (RUN.steps // EVERY, 0, 0)
            assert all(live == GROUPS for _, live in result["steps"][EVERY - 1 :])  # every round had both groups
            assert _largest_difference(result["anchors"], global_model) < 1e-10
            assert _largest_difference(result["params"], replicas[g]) < 1e-10


@pytest.mark.distributed
@pytest.mark.timeout(420)
def test_a_lost_group_misses_rounds_and_a_restarted_one_heals_the_outer_state_too() -> None:
    alone, healed = lose_and_restart_group_1(
        _run_group, lambda address, out, role: (address, LONG_RUN, 1, role, out), "alone{rank}", join_timeout_ms=3000
    )
    rounds = LONG_RUN.steps // EVERY
    for rank in range(GROUP_WORLD):
        kept, back = alone[rank], healed[rank]
        assert kept["global_step"] == back["global_step"] == LONG_RUN.steps
        participants = [live for _, live in kept["steps"]]
        assert GROUPS in participants and 1 in participants[participants.index(GROUPS) :]  # together, then alone
        assert participants[-1] == GROUPS  # and together again at the end
        assert kept["outer_steps"] + kept["dropped_rounds"] == rounds  # every round committed or dropped, none lost
        assert kept["heals"] == 0 and back["heals"] >= 1  # the restarted group healed from the survivor
        # from the heal on, one global state: the last-synchronised model, the outer momentum and (H divides the
        # run) the parameters, bit for bit
        for name, shard in kept["anchor_shards"].items():
            assert torch.equal(shard, back["anchor_shards"][name]), name
        assert kept["momentum"] and kept["momentum"].keys() == back["momentum"].keys()
        for name, buffer in kept["momentum"].items():
            assert torch.equal(buffer, back["momentum"][name]), name
        for name, value in kept["params"].items():
            assert torch.equal(value, back["params"][name]), name
        for name, value in kept["anchors"].items():  # the trained parameters (the frozen gate has no outer copy)
            assert torch.equal(value, kept["params"][name]), name


#: streaming DiLoCo: H=4 in 2 fragments, each average started one inner step before it lands, global values taken
STREAMING = {"sync_every": 4, "num_fragments": 2, "fragment_sync_delay": 1, "fragment_update_alpha": 0.0}


@pytest.mark.distributed
@pytest.mark.timeout(420)
def test_streaming_diloco_with_a_lost_group_heals_at_a_fragments_quorum() -> None:
    """Streaming DiLoCo under fault tolerance runs one quorum per fragment, when its average starts (as torchft
    does): a group lost mid-round misses fragments, the survivor commits them alone, and the restarted group heals
    at a fragment's quorum -- the last-synchronised model, the outer momentum and which fragment is next -- and from
    then on holds the survivor's global state bit for bit; the fragment synchronised last is the global one."""
    alone, healed = lose_and_restart_group_1(
        _run_group, lambda address, out, role: (address, LONG_RUN, 1, role, out, STREAMING), "alone{rank}",
        join_timeout_ms=3000,
    )
    syncs = LONG_RUN.steps // (STREAMING["sync_every"] // STREAMING["num_fragments"])
    for rank in range(GROUP_WORLD):
        kept, back = alone[rank], healed[rank]
        assert kept["global_step"] == back["global_step"] == LONG_RUN.steps
        participants = [live for _, live in kept["steps"]]
        assert GROUPS in participants and 1 in participants[participants.index(GROUPS) :]
        assert participants[-1] == GROUPS
        assert kept["outer_steps"] + kept["dropped_rounds"] == syncs  # every fragment committed or dropped
        assert kept["heals"] == 0 and back["heals"] >= 1
        assert kept["outer_steps"] == back["outer_steps"]  # the healed group knows which fragment is next
        assert len(kept["fragments"]) == 2 and kept["fragments"] == back["fragments"]
        for name, shard in kept["anchor_shards"].items():
            assert torch.equal(shard, back["anchor_shards"][name]), name
        assert kept["momentum"] and kept["momentum"].keys() == back["momentum"].keys()
        for name, buffer in kept["momentum"].items():
            assert torch.equal(buffer, back["momentum"][name]), name
        last = kept["fragments"][(kept["outer_steps"] - 1) % 2]  # the fragment the last step synchronised
        for name in (n.removeprefix("model.") for n in last):
            assert torch.equal(kept["params"][name], back["params"][name]), name
            assert torch.equal(kept["params"][name], kept["anchors"][name]), name


def _resume_in_one_group(rank: int, group: int, address: str, root: str) -> dict[str, Any]:
    """Group 0 alone, epochs of 3 steps: 2 epochs uninterrupted; then 1 epoch (mid-round: H=2), a checkpoint, a new
    Trainer resuming to 2 epochs (resuming at an epoch's end, so the data continue as without the stop)."""
    import lightning.pytorch as pl

    cfg = RunConfig(world_size=GROUPS * GROUP_WORLD, micro_batch=2, accumulate=1, steps=3, lr=0.1, momentum=0.9)

    def fit(epochs: int, ckpt_path: Optional[str] = None) -> tuple[Any, Any]:
        ft = FaultTolerance(address, group, GROUPS, min_replica_groups=1, timeout=20, quorum_timeout=60)
        strategy = MiCSStrategy(fault_tolerance=ft, cross_replica_sync="diloco", sync_every=EVERY)
        kwargs = trainer_kwargs(cfg) | {
            "devices": GROUP_WORLD, "max_steps": -1, "max_epochs": epochs, "plugins": [fp64_precision()]
        }
        module = Fp64Module(cfg)
        trainer = pl.Trainer(strategy=strategy, **kwargs)
        trainer.fit(module, ckpt_path=ckpt_path)
        return trainer, module

    trainer, module = fit(2)
    uninterrupted = {"params": strip_prefix(full_parameters(module)), **_global_state(trainer)}
    trainer, _ = fit(1)
    path = str(Path(root, "diloco_ft.ckpt"))
    trainer.save_checkpoint(path)
    saved_inner_steps = trainer.strategy.engine.semi_sync.syncs[0].inner_steps
    trainer, module = fit(2, ckpt_path=path)
    resumed = {"params": strip_prefix(full_parameters(module)), **_global_state(trainer)}
    return {"uninterrupted": uninterrupted, "resumed": resumed, "saved_inner_steps": saved_inner_steps,
            "global_step": trainer.global_step}


@pytest.mark.distributed
@pytest.mark.timeout(300)
def test_a_checkpoint_taken_mid_round_resumes_exactly_with_fault_tolerance() -> None:
    with lighthouse(min_replicas=1) as address, tempfile.TemporaryDirectory() as out_dir:
        wait(start_group(0, out_dir, _resume_in_one_group, address, out_dir), timeout=240)
        results = read(out_dir, 0)
    for result in results:
        assert result["saved_inner_steps"] == 1 and result["global_step"] == 6
        uninterrupted, resumed = result["uninterrupted"], result["resumed"]
        for name, value in uninterrupted["params"].items():
            assert torch.equal(value, resumed["params"][name]), name
        for name, value in uninterrupted["momentum"].items():
            assert torch.equal(value, resumed["momentum"][name]), name


class _Averaged:
    """A finished average (a single group: its own message)."""

    def wait(self) -> None:
        pass


class _RoundTransport:
    """The round's transport as ``OuterSync`` uses it: averages that are the message itself, and a commit
    verdict set by the test (torchft's, for a group that did or did not lose a peer during the average)."""

    active = True

    def __init__(self, commits: bool) -> None:
        self.commits = commits

    def start_average(self, flat: torch.Tensor) -> _Averaged:
        return _Averaged()

    def commit(self) -> bool:
        return self.commits


@pytest.mark.parametrize("commits, contributors", [(False, 1.0), (True, 0.0), (True, 1.0)])
def test_a_round_that_does_not_commit_is_dropped_back_to_the_last_synchronised_parameters(
    commits: bool, contributors: float
) -> None:
    """A round whose average failed (no commit) or counted no contributing group is dropped: the parameters go
    back to the last-synchronised copy, which, like the outer optimizer's state, is left as it was; a committed
    round steps the outer optimizer on the pseudo-gradient."""
    from lightning_mics.hop2.diloco import OuterSync

    param = torch.nn.Parameter(torch.tensor([1.0, 2.0, 3.0]))
    counter = _RoundTransport(commits)
    sync = OuterSync(["w"], [param], _RoundTransport(commits), every=2, factory=None, round=lambda: True,
                     counter=counter)
    counter.start_average = lambda count: (count.fill_(contributors), _Averaged())[1]  # the groups' mean count
    anchor_before = sync.anchors[0].detach().clone()
    with torch.no_grad():
        param.sub_(torch.tensor([0.5, -0.5, 1.0]))  # the inner steps of the round
    sync.start_fragment(0)
    sync.finish_fragment()
    dropped = not commits or contributors == 0
    assert sync.dropped_rounds == int(dropped)
    if dropped:
        assert torch.equal(param.detach(), anchor_before) and torch.equal(sync.anchors[0], anchor_before)
        assert not sync.outer.state  # the outer optimizer never stepped: no momentum
    else:
        assert not torch.equal(sync.anchors[0], anchor_before) and sync.outer.state
        assert torch.equal(param.detach(), sync.anchors[0].detach())  # alpha 0: the parameters are the global ones
