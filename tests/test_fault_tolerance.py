"""Partition groups as fault domains (torchft), a real Lighthouse and 2 replica groups of 2 gloo ranks: they train
like one process (also with a bf16 or int8 hop 2), a killed group's restart heals bit-identical to the survivor, one
group writes the checkpoint both resume from; the options, refused layouts, the watchdog and the quorum schedule.

The multi-group tests run a real Lighthouse and two replica groups of two gloo ranks, each group its own
``torch.distributed`` world (its own port), as two jobs would on a cluster. Every process they start is
killed at the end, whatever happened.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from ft_harness import (
    AS_WRITTEN,
    GROUP_WORLD,
    LIGHTHOUSE,
    fault_tolerant_trainer,
    lighthouse,
    read,
    shard_digest,
    start_group,
    wait,
    wait_for_step,
)
from distributed import run_ranks
from toy import RunConfig, ToyModule, assert_matches_reference, full_parameters, trainer_kwargs

from lightning_mics import FaultTolerance, MiCSStrategy
from lightning_mics.fault_tolerance import AGREEMENT_BYTES, check_fault_tolerant_layout

pytest.importorskip("torchft")


# ------------------------------------------------------------------------------------------------ options
def test_fault_tolerance_reads_the_environment_and_names_what_is_missing(monkeypatch) -> None:
    for name in ("TORCHFT_LIGHTHOUSE", "MICS_REPLICA_GROUP", "MICS_NUM_REPLICA_GROUPS"):
        monkeypatch.delenv(name, raising=False)
    with pytest.raises(ValueError, match="needs the Lighthouse's address"):
        FaultTolerance().resolved()
    monkeypatch.setenv("TORCHFT_LIGHTHOUSE", "http://127.0.0.1:1")
    with pytest.raises(ValueError, match="needs this group's index and the number of groups"):
        FaultTolerance().resolved()
    monkeypatch.setenv("MICS_REPLICA_GROUP", "1")
    monkeypatch.setenv("MICS_NUM_REPLICA_GROUPS", "3")
    assert FaultTolerance(min_replica_groups=2).resolved() == FaultTolerance("http://127.0.0.1:1", 1, 3, 2)
    with pytest.raises(ValueError, match=r"replica_group=3, num_replica_groups=3"):
        FaultTolerance(replica_group=3).resolved()
    with pytest.raises(ValueError, match="min_replica_groups=0"):
        FaultTolerance(min_replica_groups=0)
    with pytest.raises(ValueError, match=r"quorum_every=0\) must be a positive number"):
        FaultTolerance(quorum_every=0)
    with pytest.raises(ValueError, match=r"quorum_every=2.5\) must be a whole number"):
        FaultTolerance(quorum_every=2.5)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"heartbeat_interval=0\) must be a positive number"):
        FaultTolerance(heartbeat_interval=0)


def test_the_strategy_takes_fault_tolerance_as_an_object_true_or_a_dict() -> None:
    assert MiCSStrategy(fault_tolerance=True).options.fault_tolerance == FaultTolerance()
    by_dict = MiCSStrategy(fault_tolerance={"lighthouse": "http://h:29510", "timeout": 5}).options.fault_tolerance
    assert by_dict == FaultTolerance(lighthouse="http://h:29510", timeout=5)
    with pytest.raises(TypeError, match="fault_tolerance must be a lightning_mics.FaultTolerance"):
        MiCSStrategy(fault_tolerance="yes")


def test_layouts_that_cannot_lose_a_group_are_refused() -> None:
    check_fault_tolerant_layout(1, False)
    with pytest.raises(ValueError, match="holds 2 replicas of the partition. Launch each partition as its own job"):
        check_fault_tolerant_layout(2, False)
    with pytest.raises(ValueError, match="optimizer states sharded across replicas"):
        check_fault_tolerant_layout(1, True)


def test_the_watchdog_ends_a_rank_that_stops_stepping() -> None:
    from lightning_mics.fault_tolerance import Watchdog

    exits: list[int] = []
    watchdog = Watchdog(0.4, exit=exits.append)
    for _ in range(4):  # kicked in time: nothing happens
        time.sleep(0.2)
        watchdog.kick()
    assert exits == []
    time.sleep(1.5)  # no step for longer than the watchdog
    assert exits == [1]
    watchdog.stop()


# ------------------------------------------------------------------------------------------------ equivalence
EQUIVALENCE = RunConfig(world_size=2 * GROUP_WORLD, steps=3, accumulate=2)


class ValidatedToyModule(ToyModule):
    """The toy with a validation set: each group must evaluate all of it (not a share), so that the groups'
    metrics agree."""

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        from toy import lm_loss

        self.log("val_loss", lm_loss(self, batch), sync_dist=True)

    def val_dataloader(self) -> Any:
        from toy import make_dataset

        return torch.utils.data.DataLoader(make_dataset(16, seed=7), batch_size=2)


WIRES = (None, "bf16", "int8")


def _agreement_bytes(step: int) -> int:
    """The agreement crosses groups when the quorum forms and every ``check_parameters_every`` (10) steps; in
    between, with the quorum unchanged, it is skipped."""
    return AGREEMENT_BYTES if step == 0 or step % 10 == 0 else 0


def _fit_in_group(rank: int, group: int, address: str) -> dict[Any, dict[str, Any]]:
    """One fit per hop-2 wire format, one after the other in the same processes (each fit its own torchft
    Manager: a second Manager in a world must not find the first one's address)."""
    return {wire: _fit_with_wire(group, address, wire) for wire in WIRES}


def _fit_with_wire(group: int, address: str, wire: Any) -> dict[str, Any]:
    import lightning.pytorch as pl

    from lightning_mics import _compat as compat
    from lightning_mics.accounting import CROSS_REPLICA
    from lightning_mics.shards import padded_shard_numel
    from lightning_mics.telemetry import TrainingTelemetry

    ft = FaultTolerance(address, group, 2, min_replica_groups=2, timeout=20, quorum_timeout=60, **AS_WRITTEN)
    module = ValidatedToyModule(EQUIVALENCE)
    telemetry = TrainingTelemetry(peak_flops=None, prog_bar=False)  # it sees torchft's collectives too
    class Packed(pl.Callback):  # what hop 2 packs: this rank's shards of the gradients the step has, per unit
        numel = 0
        unit_numels: list[int] = []

        def on_before_optimizer_step(self, trainer: Any, module: Any, optimizer: Any) -> None:
            self.numel = sum(padded_shard_numel(p) for p in module.parameters() if p.grad is not None)
            self.unit_numels = [
                sum(padded_shard_numel(p) for p in compat.fsdp_unit_parameters(unit) if p.grad is not None)
                for unit in trainer.strategy.fsdp_units
            ]

    packed = Packed()
    strategy = MiCSStrategy(fault_tolerance=ft, cross_replica_dtype=wire)
    kwargs = trainer_kwargs(EQUIVALENCE) | {"devices": GROUP_WORLD, "limit_val_batches": None, "val_check_interval": 2}
    trainer = pl.Trainer(strategy=strategy, callbacks=[telemetry, packed], **kwargs)
    trainer.fit(module)
    from lightning.pytorch.utilities.rank_zero import rank_zero_only

    return {
        "params": full_parameters(module),
        "logging_rank": rank_zero_only.rank,
        "val_loss": float(trainer.callback_metrics["val_loss"]),
        "cross_replica_bytes": [record.comm.by_group[CROSS_REPLICA] for record in telemetry.steps],
        "discarded": trainer.strategy.engine.replica_group.discarded_steps,
        "packed_numel": packed.numel,
        "unit_numels": packed.unit_numels,
    }


@pytest.fixture(scope="module")
def wire_runs() -> dict[Any, list[dict[str, Any]]]:
    """2 groups x 2 ranks fit once per wire format; per format, the 4 ranks' results (group 0's first)."""
    with lighthouse(min_replicas=2) as address, tempfile.TemporaryDirectory() as out_dir:
        groups = [start_group(g, out_dir, _fit_in_group, address) for g in range(2)]
        for context in groups:
            wait(context, timeout=400)
        ranks = read(out_dir, 0) + read(out_dir, 1)
    return {wire: [results[wire] for results in ranks] for wire in WIRES}


@pytest.mark.distributed
@pytest.mark.timeout(450)
def test_two_fault_tolerant_groups_train_like_one_process(wire_runs) -> None:
    """2 groups x 2 ranks, hop 2 through torchft, accumulation 2: the same parameters as single-process
    training on the 4 ranks' global batches."""
    results = wire_runs[None]
    assert_matches_reference([result["params"] for result in results], EQUIVALENCE)
    assert all(result["discarded"] == 0 for result in results)
    assert [result["logging_rank"] for result in results] == [0, 1, 2, 3]  # only group 0's rank 0 logs
    assert len({result["val_loss"] for result in results}) == 1  # every group evaluated the same data
    for result in results:  # cross-replica traffic: the packed fp32 shards every step, and the groups' agreement
        hop2 = 4 * result["packed_numel"]  # when the quorum forms (step 0) and on parameter-check steps only
        assert result["cross_replica_bytes"] == [hop2 + _agreement_bytes(step) for step in range(EQUIVALENCE.steps)]


@pytest.mark.distributed
@pytest.mark.timeout(450)
@pytest.mark.parametrize("wire", ["bf16", "int8"])
def test_a_compressed_hop_2_between_groups_cuts_its_bytes_and_keeps_the_groups_identical(wire_runs, wire) -> None:
    """bf16: torchft's all-reduce in bf16, 2 bytes an element. int8: each group's blockwise int8 message
    all-gathered, decoded and summed in fp32 -- a quarter of the bytes (plus a scale per block) per message.
    Close to single-process training, not equal to it, and both groups hold the same model."""
    from toy import INT8_RTOL, reference_training

    from lightning_mics.wire import message_bytes

    results = wire_runs[wire]
    params = [result["params"] for result in results]
    assert_matches_reference(params, EQUIVALENCE, rtol=1e-2 if wire == "bf16" else INT8_RTOL)
    for rank in range(GROUP_WORLD):  # both groups hold the same model: they got the same average
        for name, value in params[rank].items():
            assert torch.equal(value, params[GROUP_WORLD + rank][name]), name
    reference, _ = reference_training(EQUIVALENCE)
    assert any(not torch.allclose(params[0]["model." + n], reference[n], rtol=0, atol=0) for n in reference)
    for result in results:  # telemetry: hop 2 once per step (and the agreement). bf16: the all-reduced messages;
        numel = result["packed_numel"]  # int8: the all-gathers' payload, both groups' messages, one per FSDP unit
        assert sum(result["unit_numels"]) == numel  # behind backward: every shard goes in its unit's message
        message = 2 * numel if wire == "bf16" else sum(2 * message_bytes(n) for n in result["unit_numels"] if n)
        expected = [message + _agreement_bytes(step) for step in range(EQUIVALENCE.steps)]
        assert result["cross_replica_bytes"] == expected, (wire, numel)


def test_collectives_outside_this_world_are_cross_replica_traffic() -> None:
    from lightning_mics.collective_recorder import CollectiveCall
    from lightning_mics.accounting import CROSS_REPLICA, INTRA_PARTITION, OTHER, classify_calls
    from lightning_mics.topology import MiCSTopology

    topology = MiCSTopology.create(world_size=2, ranks_per_node=2, partition_size=2)
    calls = [CollectiveCall("reduce_scatter", (0, 1), 40, 0), CollectiveCall("all_reduce", (), 12, 0)]
    assert classify_calls(calls, topology, rank=0).by_group == {INTRA_PARTITION: 40, CROSS_REPLICA: 12, OTHER: 0}


# ------------------------------------------------------------------------------------------------ checkpoints
EPOCH = RunConfig(world_size=2 * GROUP_WORLD, steps=3, accumulate=2)  # one epoch is 3 steps


def two_epoch_reference(cfg: RunConfig) -> dict[str, torch.Tensor]:
    """Single-process training for two epochs of ``cfg``'s data, in the order Lightning's DistributedSampler
    deals each epoch to the ranks (a permutation seeded with the epoch; global micro-batch i is slice i)."""
    from toy import ToyLM, lm_loss, make_dataset

    torch.manual_seed(cfg.seed)
    model = ToyLM()
    optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=cfg.lr, momentum=cfg.momentum)
    tokens, targets = make_dataset(cfg.num_samples).tensors
    size = cfg.world_size * cfg.micro_batch
    for epoch in range(2):
        order = torch.randperm(cfg.num_samples, generator=torch.Generator().manual_seed(epoch))
        for step in range(cfg.steps):
            optimizer.zero_grad()
            for micro in range(step * cfg.accumulate, (step + 1) * cfg.accumulate):
                batch = order[micro * size : (micro + 1) * size]
                (lm_loss(model, (tokens[batch], targets[batch])) / cfg.accumulate).backward()
            optimizer.step()
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def _fit_then_save(rank: int, group: int, address: str, directory: str, resume: bool) -> dict[str, Any]:
    from lightning.pytorch.callbacks import ModelCheckpoint

    ft = FaultTolerance(address, group, 2, min_replica_groups=2, timeout=20, quorum_timeout=60, **AS_WRITTEN)
    module = ToyModule(EPOCH)
    epochs = {"max_steps": -1, "max_epochs": 2 if resume else 1}
    # every group's callback saves to the same (shared) directory; one group writes. Every group's job is
    # launched alike, with ckpt_path="last": the first run finds no checkpoint and starts afresh
    callback = ModelCheckpoint(dirpath=directory, save_last=True)
    trainer = fault_tolerant_trainer(EPOCH, ft, [callback], enable_checkpointing=True, **epochs)
    trainer.fit(module, ckpt_path="last")
    return {"params": full_parameters(module), "step": trainer.strategy.engine.replica_group.manager.current_step()}


@pytest.mark.distributed
@pytest.mark.timeout(400)
def test_one_group_writes_the_checkpoint_and_the_groups_resume_from_it() -> None:
    """Both groups' ModelCheckpoint saves to the same directory after an epoch: the quorum's first group writes
    it, with torchft's step; both resume from it for a second epoch and end where two epochs of single-process
    training do."""
    from lightning_mics.checkpoint import inspect_checkpoint
    from lightning_mics.engine import FAULT_TOLERANCE_KEY

    with lighthouse(min_replicas=2) as address, tempfile.TemporaryDirectory() as out_dir:
        directory = Path(out_dir) / "shared"
        checkpoint = directory / "last.ckpt"
        for resume in (False, True):
            groups = [start_group(g, out_dir, _fit_then_save, address, str(directory), resume) for g in range(2)]
            for context in groups:
                wait(context, timeout=300)
            results = read(out_dir, 0) + read(out_dir, 1)
            if not resume:
                assert [result["step"] for result in results] == [EPOCH.steps] * 4
                info = inspect_checkpoint(checkpoint)
                assert info.data_dir is not None
                state = torch.load(info.data_dir / "trainer_state.pt", weights_only=False)
                assert state[FAULT_TOLERANCE_KEY]["manager"]["step"] == EPOCH.steps
                assert state[FAULT_TOLERANCE_KEY]["replica_group"] == 0  # the first group of the quorum wrote it
    assert [result["step"] for result in results] == [2 * EPOCH.steps] * 4  # torchft's step went on from it
    reference = two_epoch_reference(EPOCH)
    for result in results:
        for name, expected in reference.items():
            got = result["params"]["model." + name]
            assert ((got - expected).norm() / expected.norm()).item() < 1e-5, name


# ------------------------------------------------------------------------------------------------ a lost group
LONG = RunConfig(world_size=2 * GROUP_WORLD, steps=24)
FAIL_AFTER_STEPS_TOGETHER = 2


def _run_group(rank: int, group: int, address: str, fail: bool, directory: str) -> dict[str, Any]:
    import lightning.pytorch as pl
    from lightning.pytorch.callbacks import ModelCheckpoint

    class Record(pl.Callback):
        """Per step: (the Manager's step, live groups) and this rank's shard digest. Told to fail, the group dies
        during its third step with the other group (after the quorum, before hop 2); the survivor slows down
        while alone so that the restarted group can rejoin before the run ends."""

        def __init__(self) -> None:
            self.digests: dict[int, str] = {}
            self.participants: list[tuple[int, int]] = []

        def on_before_backward(self, trainer, module, loss) -> None:  # hop 2 starts inside backward
            together = [step for step, live in self.participants if live == 2]
            if fail and rank == 1 and len(together) >= FAIL_AFTER_STEPS_TOGETHER:
                os._exit(1)  # a node lost mid-step: no cleanup, no goodbye

        def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx) -> None:
            manager = trainer.strategy.engine.replica_group.manager
            self.digests[manager.current_step()] = shard_digest(module)
            self.participants.append((manager.current_step(), manager.num_participants()))
            if manager.num_participants() < 2 and not fail and len(self.participants) > 1:
                if any(live == 2 for _, live in self.participants):  # alone after a loss (not before the other came)
                    # the test starts the replacement only once this is on record
                    alone = Path(directory).parent / f"group{group}_rank{rank}.alone"
                    alone.write_text(str(manager.current_step()))
                time.sleep(3.0)  # give the replacement time to start and heal

    ft = FaultTolerance(address, group, 2, min_replica_groups=1, timeout=10, quorum_timeout=60, **AS_WRITTEN)
    record = Record()
    module = ToyModule(LONG)
    # every 2 committed steps: "last" exists before the failure (the third step together), so the restart
    # loads it, then heals; a discarded step is not counted, so no checkpoint is named after it
    checkpoints = ModelCheckpoint(dirpath=directory, save_last=True, every_n_train_steps=2)
    trainer = fault_tolerant_trainer(LONG, ft, [record, checkpoints], enable_checkpointing=True)
    trainer.fit(module, ckpt_path="last")  # as every group's job is launched: the restart loads, then heals
    replica_group = trainer.strategy.engine.replica_group
    return {
        "digests": record.digests,
        "participants": record.participants,
        "global_step": trainer.global_step,
        "discarded": replica_group.discarded_steps if replica_group is not None else None,
        "resumed_from": trainer.ckpt_path,
    }


@pytest.mark.distributed
@pytest.mark.timeout(420)
def test_a_lost_group_costs_a_step_and_its_restart_heals_from_the_survivor() -> None:
    with lighthouse(min_replicas=1) as address, tempfile.TemporaryDirectory() as out_dir:
        shared = str(Path(out_dir) / "checkpoints")
        survivor = start_group(0, out_dir, _run_group, address, False, shared)
        doomed = start_group(1, out_dir, _run_group, address, True, shared)
        with pytest.raises(Exception):  # noqa: B017 -- whichever way the group's ranks die
            wait(doomed, timeout=180)
        for rank in range(GROUP_WORLD):  # the survivor has trained a step alone: the loss is on the record
            wait_for_step(Path(out_dir, f"group0_rank{rank}.alone"), 1, timeout=120)
        restarted = start_group(1, out_dir, _run_group, address, False, shared)
        wait(survivor, timeout=300)
        wait(restarted, timeout=120)
        first, second = read(out_dir, 0), read(out_dir, 1)
    for rank in range(GROUP_WORLD):
        alone, healed = first[rank], second[rank]
        live = [count for _, count in alone["participants"]]
        assert alone["global_step"] == healed["global_step"] == LONG.steps  # both finished the run
        assert 1 <= alone["discarded"] <= 2, alone  # the step the failure hit, not the job
        lost_at = next((step for (step, count), before in zip(alone["participants"][1:], live) if count < before), None)
        assert lost_at is not None, alone["participants"]
        assert live[-1] == 2  # alone after the loss, together again at the end
        assert alone["resumed_from"] is None and healed["resumed_from"] is not None  # it loaded "last", then
        assert min(healed["digests"]) >= lost_at > 0  # healed: it started at the survivor's step, not at 0
        common = sorted(set(alone["digests"]) & set(healed["digests"]))
        assert len(common) >= 2, "the groups never trained together after the heal"
        for step in common:  # bit-identical shards at every step both took part in
            assert alone["digests"][step] == healed["digests"][step], f"rank {rank}, step {step}"


def test_the_lighthouse_binary_is_installed() -> None:
    assert LIGHTHOUSE.exists() or shutil.which("torchft_lighthouse"), "the [ft] extra brings torchft_lighthouse"


class _StubManager:
    """torchft's Manager as the replica group calls it, without a Lighthouse: one group alone in its quorums,
    counting the quorums and torchft's commits, with an error that only this rank recorded when told."""

    def __init__(self, **_: Any) -> None:
        self.step, self.batches, self.error = 0, 0, None
        self.quorums, self.torchft_commits = 0, 0
        self._quorum_id = 1

    def start_quorum(self) -> None:
        self.quorums += 1
        self.error = None

    def should_commit(self) -> bool:
        self.torchft_commits += 1
        self.step += self.error is None
        return self.error is None

    def current_step(self) -> int:
        return self.step

    def num_participants(self) -> int:
        return 1

    def participating_rank(self) -> int:
        return 0

    def errored(self) -> Any:
        return self.error

    def report_error(self, error: Exception) -> None:
        self.error = error

    def allreduce(self, tensor: torch.Tensor) -> Any:
        """The agreement's exchange at the first quorum: one group's average is its own message."""
        future: torch.futures.Future = torch.futures.Future()
        future.set_result(tensor)
        return future

    def state_dict(self) -> dict[str, int]:
        return {"step": self.step, "batches_committed": self.batches}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.step, self.batches = state["step"], state["batches_committed"]

    def shutdown(self, wait: bool = False) -> None:
        pass


def _manager_arguments(rank: int, world_size: int) -> dict[str, Any]:
    import torch.distributed as dist
    import torchft

    from lightning_mics.fault_tolerance import group as group_module

    dist.init_process_group("gloo")
    built: dict[str, Any] = {}

    def recording_manager(**arguments: Any) -> _StubManager:
        built.update(arguments)
        return _StubManager()

    torchft.Manager = recording_manager
    options = FaultTolerance("http://unused:1", 0, 1, heartbeat_interval=0.25, quorum_timeout=30)
    group = group_module.ReplicaGroup(options, torch.device("cpu"), state_fn=dict, load_fn=lambda state: None)
    group.shutdown()
    return {name: built[name].total_seconds() for name in ("heartbeat_interval", "quorum_timeout")}


@pytest.mark.distributed
def test_the_heartbeat_interval_and_the_quorum_timeout_reach_torchfts_manager() -> None:
    """``FaultTolerance(heartbeat_interval=...)`` is torchft's own knob, passed through (ours defaults to 0.5 s,
    torchft's to 0.1)."""
    assert run_ranks(_manager_arguments, 1)[0] == {"heartbeat_interval": 0.25, "quorum_timeout": 30.0}
    assert FaultTolerance().heartbeat_interval == 0.5


def _quorum_decisions(rank: int, world_size: int) -> dict[str, Any]:
    import torch.distributed as dist
    import torchft

    from lightning_mics.fault_tolerance import group as group_module

    dist.init_process_group("gloo")
    torchft.Manager = _StubManager  # the group builds its Manager from ``torchft`` at construction
    ft = FaultTolerance("http://unused:1", 0, 1, quorum_every=3, check_parameters_every=1000)
    group = group_module.ReplicaGroup(ft, torch.device("cpu"), state_fn=dict, load_fn=lambda state: None)
    manager = group.manager
    asked, committed = [], []
    for step in range(8):
        before = manager.quorums
        group.start_step()
        asked.append(manager.quorums > before)
        if step == 4 and rank == 1:
            manager.report_error(RuntimeError("a failure only rank 1 saw"))
        committed.append(group.commit())
        group.last_step_discarded = False  # what undoing Lightning's counters does before the next quorum
    group.shutdown()
    return {"asked": asked, "committed": committed, "step": manager.current_step(),
            "torchft_commits": manager.torchft_commits}


@pytest.mark.distributed
def test_a_quorum_every_third_step_and_after_a_discard_decided_alike_on_every_rank_of_the_group() -> None:
    """``quorum_every=3``: a quorum at the first step, at committed steps 3 and 6, and right after a discarded
    step; between quorums the step commits through the group's own all-reduce, advancing torchft's step. An
    error recorded on rank 1 only discards the step on both ranks, and both ask for the next quorum."""
    ranks = run_ranks(_quorum_decisions, 2)
    assert ranks[0] == ranks[1]  # one decision per group
    result = ranks[0]
    assert result["committed"] == [True] * 4 + [False] + [True] * 3
    # committed step at each start: 0 (first), 1, 2, 3, 4 (discarded), 4 (after the discard), 5, 6
    assert result["asked"] == [True, False, False, True, False, True, False, True]
    assert result["step"] == 7
    assert result["torchft_commits"] == 4  # torchft's own commit exactly after each quorum


class _TwoGroupManager(_StubManager):
    """Two groups in every quorum (the other one simulated): the agreement's exchange completes only when it is
    waited on, and then the other group's message is averaged in -- on a parameter-check step, on rank 1 only,
    with other parameters than this group's (rank 0's shards agree, rank 1's drifted)."""

    def __init__(self, rank: int, every: int, ours: list[int], events: list[str]) -> None:
        super().__init__()
        self.rank, self.every, self.ours, self.events = rank, every, ours, events

    def num_participants(self) -> int:
        return 2

    def allreduce(self, tensor: torch.Tensor) -> Any:
        from lightning_mics.fault_tolerance.agreement import GroupConfiguration, agreement_message, digest_chunks

        manager, step = self, self.step
        manager.events.append(f"exchange started at {step}")

        class Work:
            def wait(self) -> None:
                manager.events.append(f"exchange waited at {step}")
                checks = step > 0 and step % manager.every == 0
                theirs = (digest_chunks(b"drifted") if manager.rank == 1 else manager.ours) if checks else None
                other = agreement_message(1, GroupConfiguration(()).digest_chunks(), theirs)
                tensor.add_(other).div_(2)  # torchft's average over the quorum

        return Work()


def _parameter_check_behind_the_step(rank: int, world_size: int, quorum_every: int) -> dict[str, Any]:
    import torch.distributed as dist
    import torchft

    from lightning_mics.fault_tolerance import group as group_module
    from lightning_mics.fault_tolerance.agreement import digest_chunks
    from lightning_mics.fault_tolerance.errors import ReplicaGroupsDiverged

    dist.init_process_group("gloo")
    events: list[str] = []
    ours = digest_chunks(b"ours")
    torchft.Manager = lambda **_: _TwoGroupManager(rank, 2, ours, events)
    ft = FaultTolerance("http://unused:1", 0, 2, quorum_every=quorum_every, check_parameters_every=2)
    group = group_module.ReplicaGroup(ft, torch.device("cpu"), state_fn=dict, load_fn=lambda state: None,
                                      parameter_digest=lambda: ours)
    error = None
    try:
        for step in range(4):
            group.start_step()
            events.append(f"forward and backward at {step}")
            group.commit()
    except ReplicaGroupsDiverged as diverged:
        error = str(diverged)
    group.shutdown()
    return {"events": events, "error": error, "step": group.manager.current_step()}


@pytest.mark.distributed
@pytest.mark.parametrize("quorum_every", [3, 2])
def test_a_parameter_check_in_an_unchanged_quorum_runs_behind_the_step_and_ends_the_run_at_its_commit(
    quorum_every: int,
) -> None:
    """``check_parameters_every=2``: the first quorum's agreement waits before the forward (the membership is
    new); the check at committed step 2 -- between quorums (``quorum_every=3``) or at a quorum that kept the
    membership (2) -- starts before the step's forward and is waited for at its commit. Only rank 1's shards
    drifted: both ranks of the group end there, before the optimizer step, rank 1 naming the group and the step,
    rank 0 saying another rank found it."""
    ranks = run_ranks(_parameter_check_behind_the_step, 2, quorum_every)
    for rank, result in enumerate(ranks):
        assert result["events"] == [
            "exchange started at 0", "exchange waited at 0", "forward and backward at 0",
            "forward and backward at 1",
            "exchange started at 2", "forward and backward at 2", "exchange waited at 2",
        ], result
        assert result["step"] == 2, result  # step 2 never committed
        assert result["error"] is not None and "after committed step 2" in result["error"], result
    assert "group(s) [1] hold other shards than group(s) [0]" in ranks[1]["error"], ranks[1]
    assert "another rank of this group found" in ranks[0]["error"], ranks[0]
