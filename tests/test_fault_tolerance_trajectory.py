"""Fault tolerance keeps the training trajectory (``FaultTolerance(keep_trajectory=True)``, the default): a group
killed mid-step and restarted while the other reads both shares ends within 1e-10 of single-process training in fp64
(with ``exact_trajectory=True``, on the failure-free run's bits in fp32 with AdamW); the global sample order, the
loader's reloads, and the loaders it refuses.

* the global sample order: every committed step's global batch is the next slice of one seeded permutation per
  epoch, its micro-steps' shares and ranks cut it without overlap, and the live groups' shares cover every
  share of a micro-step exactly once, their gradient weights making the hop-2 average a mean over samples;
* the cursor's predictions: after a discarded step, a heal or a changed quorum, the few micro-batches in flight
  are reloaded and later predictions are right again;
* the rebuilt DataLoader keeps its workers and delivers exactly the predicted samples;
* loaders it cannot reorder are refused naming the fix;
* and the proof: in fp64 with SGD, two groups of two ranks where one group is killed mid-step, the survivor
  trains alone reading both shares, and the restarted group heals and trains on, end where single-process
  training on the same global batches does (within 1e-10).
"""

from __future__ import annotations

import itertools
import os
import time
from dataclasses import replace
from pathlib import Path
from typing import Any, Optional

import pytest
import torch
from ft_harness import (
    AS_WRITTEN,
    GROUP_WORLD,
    fault_tolerant_trainer,
    lose_and_restart_group_1,
    run_one_group,
    run_two_groups,
)
from torch.utils.data import DataLoader, DistributedSampler, IterableDataset, TensorDataset
from toy import (
    Fp64Module,
    RunConfig,
    ToyModule,
    fp64_precision,
    fp64_sgd_reference,
    full_parameters,
    lm_loss,
    make_dataset,
)

from lightning_mics import FaultTolerance
from lightning_mics.fault_tolerance.trajectory import (
    DataCursor,
    GlobalSampleOrder,
    MicroBatchKey,
    TrajectoryDataLoader,
    gradient_weight,
    sample_order_of,
    shares_of,
)

pytest.importorskip("torchft")

ORDER = GlobalSampleOrder(num_samples=100, num_shares=3, ranks_per_group=2, micro_batch=2, accumulate=2, seed=7)


def _epoch_permutation(n: int, seed: int) -> list[int]:
    return torch.randperm(n, generator=torch.Generator().manual_seed(seed)).tolist()


def test_each_step_reads_the_next_slice_of_one_seeded_permutation_per_epoch() -> None:
    assert ORDER.global_batch == 24 and ORDER.steps_per_epoch == 4  # 100 // 24; 4 samples left out per epoch
    for epoch in range(2):
        permutation = _epoch_permutation(100, 7 + epoch)
        for step_in_epoch in range(4):
            step = epoch * 4 + step_in_epoch
            assert ORDER.global_batch_samples(step) == permutation[step_in_epoch * 24 : (step_in_epoch + 1) * 24]


def test_micro_steps_shares_and_ranks_cut_a_global_batch_without_overlap() -> None:
    for step in (0, 5):
        read = []
        for micro in range(ORDER.accumulate):
            for share in range(ORDER.num_shares):
                for rank in range(ORDER.ranks_per_group):
                    read += ORDER.samples(MicroBatchKey(step, micro, (share,)), rank)
        assert sorted(read) == sorted(ORDER.global_batch_samples(step))
        assert len(set(read)) == len(read)


@pytest.mark.parametrize("num_shares", [1, 2, 3, 4, 8])
def test_the_live_groups_take_every_share_once_and_their_weights_average_over_samples(num_shares: int) -> None:
    for participants in range(1, num_shares + 1):
        taken = [shares_of(p, participants, num_shares, own_share=p) for p in range(participants)]
        assert sorted(s for shares in taken for s in shares) == list(range(num_shares))
        weights = [gradient_weight(shares, participants, num_shares) for shares in taken]
        # hop 2 averages over the participants: sum_g (w_g / k) * mean_g must be sum_g (n_g / G) * mean_g
        for shares, weight in zip(taken, weights):
            assert weight / participants == pytest.approx(len(shares) / num_shares)
        if participants == num_shares:
            assert taken == [(p,) for p in range(num_shares)] and weights == [1.0] * num_shares
    assert shares_of(None, 2, 4, own_share=3) == (3,)  # outside the step: its own share, gradient not summed
    with pytest.raises(RuntimeError, match="num_replica_groups"):
        shares_of(0, 5, 4, own_share=0)


def test_after_a_discard_or_a_heal_the_in_flight_micro_batches_are_reloaded_then_predictions_are_right() -> None:
    order = replace(ORDER, num_shares=2, accumulate=2)
    cursor = DataCursor(order, own_share=1, rank=0)
    in_flight = 3

    def run_step(step: int, participant: int, participants: int) -> int:
        """One optimizer step as the Trainer takes it: the loader keeps ``in_flight`` micro-batches ahead."""
        cursor.start_step(step, participant, participants)
        wrong = 0
        for _ in range(order.accumulate):
            while cursor._dispatched - cursor._consumed < in_flight:
                cursor.delivered(cursor.predict())
            delivered, needed = cursor.take()
            wrong += delivered != needed
        return wrong

    # between steps the loader holds in_flight - 1 micro-batches: those are what a surprise costs
    assert run_step(0, 1, 2) == 0 and run_step(1, 1, 2) == 0  # both groups live, own share: all predicted
    assert run_step(2, 1, 2) == 0  # this step is discarded: step 2 again
    assert run_step(2, 1, 2) == 2  # the two in flight were predicted as step 3's: reloaded
    assert run_step(3, 1, 2) == 0  # predicted after the discard was known: right again
    assert run_step(4, 0, 1) == 2  # the other group is lost: this one reads both shares
    assert cursor.current == MicroBatchKey(4, 1, (0, 1))
    assert run_step(5, 0, 1) == 0
    assert run_step(12, 0, 2) == 2  # a heal jumped ahead
    assert run_step(13, 0, 2) == 0
    assert cursor.reloaded == 0  # the cursor alone counts nothing: the loader's load() does


def test_the_rebuilt_loader_keeps_its_workers_and_delivers_the_predicted_samples() -> None:
    dataset = TensorDataset(torch.arange(100).unsqueeze(1))
    source = DataLoader(dataset, batch_size=2, sampler=DistributedSampler(dataset, 4, 0, shuffle=True, seed=7),
                        num_workers=2, prefetch_factor=3)
    order = sample_order_of(source, num_shares=2, ranks_per_group=2, accumulate=3)
    assert (order.micro_batch, order.seed, order.shuffle, order.num_samples) == (2, 7, True, 100)
    cursor = DataCursor(order, own_share=1, rank=1)
    loader = TrajectoryDataLoader(source, cursor)
    assert loader.num_workers == 2 and loader.prefetch_factor == 3 and len(loader) == order.steps_per_epoch * 3
    cursor.start_step(0, 1, 2)
    # past one epoch's length too: an epoch with a discarded step takes more (the reader decides where it ends)
    for batch in itertools.islice(loader, len(loader) + order.accumulate):
        delivered, needed = cursor.take()
        assert delivered == needed
        assert batch[0].squeeze(1).tolist() == order.samples(needed, 1)
        if needed.micro == order.accumulate - 1:
            cursor.start_step(needed.step + 1, 1, 2)
    assert needed.step == order.steps_per_epoch  # the first step of the next epoch was delivered
    assert loader.load(MicroBatchKey(3, 0, (0, 1)))[0].squeeze(1).tolist() == order.samples(
        MicroBatchKey(3, 0, (0, 1)), 1
    )


class _Stream(IterableDataset):
    def __iter__(self):
        return iter(range(10))


def test_loaders_it_cannot_reorder_are_refused_naming_the_fix() -> None:
    dataset = TensorDataset(torch.arange(40))
    with pytest.raises(ValueError, match="map-style dataset.*keep_trajectory=False"):
        sample_order_of(DataLoader(_Stream(), batch_size=2), 2, 2, 1)
    with pytest.raises(ValueError, match="batch_size instead of a batch_sampler"):
        sample_order_of(DataLoader(dataset, batch_sampler=[[0, 1]]), 2, 2, 1)
    weighted = torch.utils.data.WeightedRandomSampler([1.0] * 40, 40)
    with pytest.raises(ValueError, match="WeightedRandomSampler, whose order it would ignore"):
        sample_order_of(DataLoader(dataset, batch_size=2, sampler=weighted), 2, 2, 1)
    from lightning.fabric.utilities.distributed import DistributedSamplerWrapper

    wrapped = DistributedSamplerWrapper(weighted, num_replicas=4, rank=0)  # what Lightning makes of a custom one
    with pytest.raises(ValueError, match="DistributedSamplerWrapper, whose order it would ignore"):
        sample_order_of(DataLoader(dataset, batch_size=2, sampler=wrapped), 2, 2, 1)
    with pytest.raises(ValueError, match="smaller batch_size or accumulate_grad_batches"):
        sample_order_of(DataLoader(dataset, batch_size=8), 2, 2, 2)


# ------------------------------------------------------------------------------------------------ the proof
RUN = RunConfig(world_size=2 * GROUP_WORLD, micro_batch=2, accumulate=2, steps=14, lr=0.5, momentum=0.0)
STEPS_TOGETHER_BEFORE_THE_KILL = 2


class _AdamW32Module(ToyModule):
    """fp32 with AdamW: the setting where a last-bit difference of one step grows into another loss curve."""

    def configure_optimizers(self):
        return torch.optim.AdamW([p for p in self.parameters() if p.requires_grad], lr=3e-2, weight_decay=0.01)


def _run_group(
    rank: int, group: int, address: str, fail: bool, marks: str, quorum_every: int, heal: str, exact: bool = False
) -> dict[str, Any]:
    import lightning.pytorch as pl

    class Record(pl.Callback):
        """Told to fail, the group dies in the last micro-step's backward of its third step with the other group
        (whichever group started first may have trained alone before); the survivor notes that it trains alone
        after the loss and slows down so that the restarted group heals before the end."""

        def __init__(self) -> None:
            self.keys: list[tuple[int, int, tuple[int, ...], int]] = []
            self.was_together = False
            #: the first step this group's gradients counted in after joining two groups (catch-up heal)
            self.contributed_from: Optional[int] = None

        def on_before_backward(self, trainer, module, loss) -> None:
            key = trainer.strategy.engine._training_data.cursor.current
            manager = trainer.strategy.engine.replica_group.manager
            self.keys.append((key.step, key.micro, key.shares, manager.num_participants()))
            self.was_together |= manager.num_participants() == 2
            group_ = trainer.strategy.engine.replica_group
            if manager.num_participants() == 2 and group_.contributes and self.contributed_from is None:
                self.contributed_from = key.step
            together = {step for step, _, _, live in self.keys if live == 2}
            last_micro = key.micro == RUN.accumulate - 1
            if fail and rank == 1 and len(together) > STEPS_TOGETHER_BEFORE_THE_KILL and last_micro:
                os._exit(1)  # a node lost mid-step, after the other group's shares are on the wire

        def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx) -> None:
            manager = trainer.strategy.engine.replica_group.manager
            if not fail and manager.num_participants() == 1 and self.was_together:
                Path(marks, f"group{group}_rank{rank}.alone").write_text(str(manager.current_step()))
                time.sleep(1.5)
            elif manager.num_participants() == 1 and not self.was_together:
                time.sleep(0.5)  # the first group up waits for the other, or it may reach the end before the kill

    ft = FaultTolerance(
        address, group, 2, min_replica_groups=1, timeout=10, quorum_timeout=60, quorum_every=quorum_every, heal=heal,
        exact_trajectory=exact,
    )
    record = Record()
    module = _AdamW32Module(RUN) if exact else Fp64Module(RUN)
    module.train_dataloader = lambda: DataLoader(make_dataset(RUN.num_samples), batch_size=RUN.micro_batch)
    plugins = [] if exact else [fp64_precision()]
    trainer = fault_tolerant_trainer(RUN, ft, [record], plugins=plugins)
    trainer.fit(module)
    cursor = trainer.strategy.engine._training_data.cursor
    return {
        "params": full_parameters(module.model),
        "keys": record.keys,
        "reloaded": cursor.reloaded,
        "discarded": trainer.strategy.engine.replica_group.discarded_steps,
        "global_step": trainer.global_step,
        "quorums_asked": trainer.strategy.engine.replica_group.quorums_asked,
        "replayed": trainer.strategy.engine.replica_group.replayed_steps,
        "contributed_from": record.contributed_from,
    }


@pytest.mark.distributed
@pytest.mark.timeout(420)
@pytest.mark.parametrize("quorum_every, heal", [(1, "blocking"), (3, "blocking"), (3, "catch_up")])
def test_a_killed_and_restarted_group_leaves_the_training_as_without_failures_in_fp64(
    quorum_every: int, heal: str
) -> None:
    """With ``quorum_every=3`` the groups ask for a quorum at every third committed step only (and after the
    discarded one): the loss is still noticed at once, and the restarted group joins at such a step. With
    ``heal="catch_up"`` it joins without its shards, fetches them in the background while the survivor reads
    every share, then replays the steps it missed -- and ends exactly where the blocking heal does."""
    alone, healed = lose_and_restart_group_1(
        _run_group,
        lambda address, out, role: (address, role == "doomed", out, quorum_every, heal),
        "group0_rank{rank}.alone",
        # the restarted group waits up to 3 of the survivor's slowed-down steps for its next quorum: the Lighthouse
        # must not give it a quorum of its own meanwhile (docs/fault-tolerance.md, quorum_every)
        join_timeout_ms=1000 * 2 * quorum_every,
    )
    # step d reads slice d of the seeded permutation (Lightning's DistributedSampler seed, epoch 0)
    reference = fp64_sgd_reference(RUN, _epoch_permutation(RUN.num_samples, 0))
    for rank in range(GROUP_WORLD):
        assert alone[rank]["global_step"] == healed[rank]["global_step"] == RUN.steps
        assert 1 <= alone[rank]["discarded"] <= 2
        shares_while_alone = {shares for _, _, shares, live in alone[rank]["keys"] if live == 1}
        assert shares_while_alone == {(0, 1)}, alone[rank]["keys"]  # the survivor read the lost group's share
        started = [step for step, micro, _, _ in alone[rank]["keys"] if micro == 0]
        redone = sorted({step for step in started if started.count(step) > 1})
        assert redone, started  # the discarded step was re-done on its own samples
        assert started == sorted(started)  # and no step was skipped or read out of order
        assert set(started) == set(range(started[0], RUN.steps))  # from its first step (or heal) to the end
        assert alone[rank]["reloaded"] > 0  # the predictions in flight were corrected, not trained on
        assert min(step for step, *_ in healed[rank]["keys"]) > redone[-1]  # healed: it re-read no step
        joined_at = min(step for step, _, _, live in healed[rank]["keys"] if live == 2)
        assert joined_at % quorum_every == 0, joined_at  # the survivor let it in at its next quorum
        catching_up = 0
        if heal == "catch_up":  # it replayed the step it joined in (at least), then read shares
            assert healed[rank]["replayed"] >= 1, healed[rank]
            contributed = healed[rank]["contributed_from"]
            assert contributed is not None and contributed > joined_at
            keys = alone[rank]["keys"]
            while_catching_up = {shares for step, _, shares, _ in keys if joined_at <= step < contributed}
            assert while_catching_up == {(0, 1)}, keys  # the survivor read both shares meanwhile
            catching_up = contributed - joined_at  # a quorum at each of those steps
        else:
            assert healed[rank]["replayed"] == 0
        if quorum_every > 1:  # a quorum at the process's first step, after the discard and at multiples of 3
            asked = alone[rank]["quorums_asked"]
            assert asked <= len(set(started)) // quorum_every + 3 + catching_up, (asked, catching_up)
        for result in (alone[rank], healed[rank]):
            for name, expected in reference.items():
                got = result["params"][name]
                assert got.dtype == torch.float64
                assert (got - expected).abs().max().item() < 1e-10, name


@pytest.mark.distributed
@pytest.mark.timeout(420)
def test_with_exact_trajectory_a_killed_and_restarted_group_ends_bit_identical_to_no_failure_in_fp32_adamw() -> None:
    """``exact_trajectory=True``: the survivor trains the lost group's share as an extra pass of the failure-free
    micro-batch, each share's gradient apart, hop 2 summed in fp64 -- so the run with a kill, a discarded step and
    a catch-up heal ends on exactly the failure-free run's fp32 AdamW parameters (equal bits, not within a
    tolerance), where summing the shares in fp32 (``exact_trajectory=False``) ends elsewhere."""
    args = lambda address, out, role: (address, role == "doomed", out, 1, "catch_up", True)  # noqa: E731
    alone, healed = lose_and_restart_group_1(_run_group, args, "group0_rank{rank}.alone", join_timeout_ms=2000)
    together = run_two_groups(_run_group, args, timeout=300)
    for rank in range(GROUP_WORLD):
        shares_while_alone = {shares for _, _, shares, live in alone[rank]["keys"] if live == 1}
        assert shares_while_alone == {(0, 1)}, alone[rank]["keys"]  # the survivor trained both shares
        assert alone[rank]["discarded"] >= 1
        assert healed[rank]["replayed"] >= 1  # the restarted group caught up by replaying
        for g, result in enumerate((alone[rank], healed[rank])):
            for name, expected in together[g][rank]["params"].items():
                got = result["params"][name]
                assert got.dtype == torch.float32
                assert torch.equal(got, expected), (name, rank, (got - expected).abs().max().item())


EPOCHS_RUN = RunConfig(world_size=GROUP_WORLD, accumulate=2, steps=4)  # one group: 4 steps per epoch
#: the Trainer's step counts at which one step is discarded: mid-epoch, the last of epoch 0, the run's last
DISCARD_AT = (1, 3, 7)


def _epochs_with_discards(rank: int, group: int, address: str) -> dict[str, Any]:
    """Two epochs under ``max_epochs`` (no ``max_steps``) in group 0 alone, three steps discarded by an error
    recorded in their backward; what the Trainer showed at each batch, epoch and validation end."""
    import lightning.pytorch as pl

    ft = FaultTolerance(address, group, 1, timeout=10, quorum_timeout=15, **AS_WRITTEN)

    class Probe(pl.Callback):
        def __init__(self) -> None:
            self.discarded_at: set[int] = set()
            self.batches: list[tuple[int, int, int]] = []  # (epoch, global_step after the batch, data step)
            self.epoch_ends: list[int] = []
            self.validation_ends: list[int] = []

        def on_after_backward(self, trainer: Any, pl_module: Any) -> None:
            step = trainer.global_step
            boundary = (trainer.fit_loop.epoch_loop.batch_idx + 1) % EPOCHS_RUN.accumulate == 0
            if rank == 0 and boundary and step in DISCARD_AT and step not in self.discarded_at:
                self.discarded_at.add(step)
                trainer.strategy.engine.replica_group.manager.report_error(RuntimeError("injected: lost a peer"))

        def on_train_batch_end(self, trainer: Any, *args: Any) -> None:
            cursor = trainer.strategy.engine.data_cursor
            self.batches.append((trainer.current_epoch, trainer.global_step, cursor.current.step))

        def on_train_epoch_end(self, trainer: Any, pl_module: Any) -> None:
            self.epoch_ends.append(trainer.global_step)

        def on_validation_end(self, trainer: Any, pl_module: Any) -> None:
            self.validation_ends.append(trainer.global_step)

    class WithValidation(ToyModule):
        def validation_step(self, batch: Any, batch_idx: int) -> Any:
            return lm_loss(self, batch)

        def val_dataloader(self) -> Any:
            return DataLoader(make_dataset(8, seed=5), batch_size=2)

    probe = Probe()
    trainer = fault_tolerant_trainer(EPOCHS_RUN, ft, [probe], max_steps=-1, max_epochs=2)
    trainer.fit(WithValidation(EPOCHS_RUN))
    replica_group = trainer.strategy.engine.replica_group
    return {"global_step": trainer.global_step, "epoch": trainer.current_epoch,
            "committed": replica_group.manager.current_step(), "discarded": replica_group.discarded_steps,
            "batches": probe.batches, "epoch_ends": probe.epoch_ends, "validation_ends": probe.validation_ends}


@pytest.mark.distributed
@pytest.mark.timeout(120)
def test_under_max_epochs_discarded_steps_lengthen_the_epoch_so_every_global_batch_is_trained() -> None:
    """A discarded step is trained again one step later; under ``max_epochs`` the epoch takes that step's batches
    more, so that each Trainer epoch trains every global batch of the data's epoch -- also when the discarded step
    was an epoch's last, or the run's -- and its end (validation, ``on_train_epoch_end``) falls on the data's."""
    steps_per_epoch = EPOCHS_RUN.steps
    for result in run_one_group(_epochs_with_discards, timeout=100):
        assert result["discarded"] == len(DISCARD_AT), result
        assert result["committed"] == result["global_step"] == 2 * steps_per_epoch, result
        assert result["epoch"] == 2, result
        assert result["epoch_ends"] == [steps_per_epoch, 2 * steps_per_epoch], result
        assert result["validation_ends"] == [steps_per_epoch, 2 * steps_per_epoch], result
        # the data steps the committed steps trained: every global batch of both epochs, once, in order; and the
        # Trainer's epoch is the data's at every batch
        committed, before = [], 0
        for epoch, global_step, data_step in result["batches"]:
            assert epoch == data_step // steps_per_epoch, result
            if global_step > before:
                committed.append(data_step)
            before = global_step
        assert committed == list(range(2 * steps_per_epoch)), result
        assert len(result["batches"]) == (2 * steps_per_epoch + len(DISCARD_AT)) * EPOCHS_RUN.accumulate


def test_keep_trajectory_is_true_false_or_unset() -> None:
    assert FaultTolerance().keep_trajectory is None  # on with the Trainer, fixed shares with Fabric
    with pytest.raises(ValueError, match="keep_trajectory='yes'"):
        FaultTolerance(keep_trajectory="yes")  # type: ignore[arg-type]


def _refusals(rank: int, group: int, address: str) -> dict[str, str]:
    """Two fits the trajectory cannot serve, in one group: a training_step taking ``dataloader_iter``, and two
    training DataLoaders. Each must end with its error before any step."""

    class IterStep(ToyModule):
        def training_step(self, dataloader_iter):  # type: ignore[override]
            batch, _, _ = next(dataloader_iter)
            return lm_loss(self, batch)

    class TwoLoaders(ToyModule):
        def train_dataloader(self):
            return [super().train_dataloader(), super().train_dataloader()]

        def training_step(self, batch, batch_idx):
            return lm_loss(self, batch[0])

    errors = {}
    for name, module_class in (("dataloader_iter", IterStep), ("two_loaders", TwoLoaders)):
        ft = FaultTolerance(address, group, 2, min_replica_groups=1, timeout=10, quorum_timeout=20, **AS_WRITTEN)
        trainer = fault_tolerant_trainer(RUN, ft, [])
        try:
            trainer.fit(module_class(RUN))
            errors[name] = "no error"
        except ValueError as error:
            errors[name] = str(error)
        finally:
            if trainer.strategy.engine.replica_group is not None:
                trainer.strategy.engine.replica_group.shutdown()
    return errors


@pytest.mark.distributed
@pytest.mark.timeout(180)
def test_a_dataloader_iter_step_and_two_training_loaders_are_refused_naming_the_fix() -> None:
    for errors in run_one_group(_refusals, timeout=150):
        assert "takes `dataloader_iter`" in errors["dataloader_iter"], errors
        assert "keep_trajectory=False" in errors["dataloader_iter"]
        assert "one training DataLoader; got 2" in errors["two_loaders"], errors


def test_with_every_group_live_each_rank_reads_what_lightnings_distributed_sampler_gives_it() -> None:
    """Rank for rank the samples plain MiCS (one world, Lightning's DistributedSampler) reads: so a fault-tolerant
    run without failures trains exactly as plain MiCS does."""
    order = replace(ORDER, num_samples=96, accumulate=2)  # 4 whole steps of 24: no padding on either side
    world = order.num_shares * order.ranks_per_group
    for share in range(order.num_shares):
        for rank in range(order.ranks_per_group):
            sampler = DistributedSampler(range(96), world, share * order.ranks_per_group + rank, shuffle=True, seed=7)
            dealt = list(sampler)
            ours = [i for step in range(4) for micro in range(2)
                    for i in order.samples(MicroBatchKey(step, micro, (share,)), rank)]
            assert ours == dealt
