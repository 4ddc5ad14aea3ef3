"""``FaultTolerance(exact_trajectory=True)``'s parts: each data share's gradients kept apart and packed one row per
share, summed across groups in share order (the same bits whichever group read which share, also over a real torchft
gloo group), shares placed on the quorum ranks that read them, the loader's separate share batches, and the option's
refusals.

The end-to-end proof (a group killed and restarted in fp32 with AdamW, equal bits with the failure-free run) is in
``test_fault_tolerance_trajectory.py``."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
import torch
from distributed import free_port, run_ranks
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from benchmarks.exact_sum_cpu import average_in_pipeline_order

from lightning_mics import FaultTolerance, MiCSOptions
from lightning_mics.fault_tolerance.group import ReplicaGroup
from lightning_mics.fault_tolerance.trajectory import DataCursor, GlobalSampleOrder, MicroBatchKey, TrajectoryDataLoader
from lightning_mics.hop2.shares import ShareGradients
from lightning_mics.hop2.transport import (
    LAG_BEFORE_SECOND_STAGE,
    ManagedTransport,
    _ChainedSum,
    _ShareOrderChain,
    _ShareOrderGather,
    gather_moves_no_more,
)


# ------------------------------------------------------------------------ the sum in share order
class _World:
    """The quorum's collectives, run in one process: each rank's k-th collective of a kind meets every other rank's
    k-th (as on a process group, where they start in the same order everywhere); a wait delivers once every rank
    has started it (the tests start every rank's before they wait on any)."""

    def __init__(self, ranks: int) -> None:
        self.ranks = ranks
        self.all_to_all: dict[int, list[torch.Tensor]] = {rank: [] for rank in range(ranks)}
        self.all_gather: dict[int, list[torch.Tensor]] = {rank: [] for rank in range(ranks)}
        self.started: list[str] = []  #: the kinds of collective quorum rank 0 started, in order


class _Future:
    def __init__(self, fill: Any) -> None:
        self.fill = fill

    def wait(self) -> None:
        self.fill()


class _Group:
    """What the exact sums use of a :class:`ReplicaGroup`, for quorum rank ``rank`` of ``world``."""

    def __init__(self, world: _World, rank: int, holders: list[tuple[int, int]], slots: int) -> None:
        self.world, self.rank, self.holders, self.slots = world, rank, holders, slots
        self.manager = SimpleNamespace(num_participants=lambda: world.ranks, errored=lambda: None)

    def share_holders(self) -> tuple[list[tuple[int, int]], int]:
        return self.holders, self.slots

    def _record(self, kind: str, sent: dict[int, list[torch.Tensor]], message: torch.Tensor) -> int:
        if self.rank == 0:
            self.world.started.append(kind)
        sent[self.rank].append(message.clone())  # what it sends, as started (the caller may reuse it)
        return len(sent[self.rank]) - 1

    def start_all_to_all(self, message: torch.Tensor) -> tuple[torch.Tensor, _Future]:
        k = self._record("all_to_all", self.world.all_to_all, message)
        received = torch.empty_like(message)

        def fill() -> None:
            for q in range(self.world.ranks):
                received[q] = self.world.all_to_all[q][k][self.rank]

        return received, _Future(fill)

    def start_all_gather(self, message: torch.Tensor) -> tuple[list[torch.Tensor], _Future]:
        k = self._record("all_gather", self.world.all_gather, message)
        gathered = [torch.empty_like(message) for _ in range(self.world.ranks)]

        def fill() -> None:
            for q in range(self.world.ranks):
                gathered[q].copy_(self.world.all_gather[q][k])

        return gathered, _Future(fill)

    def start_all_gather_into(self, output: torch.Tensor, message: torch.Tensor) -> tuple[torch.Tensor, _Future]:
        k = self._record("all_gather", self.world.all_gather, message)

        def fill() -> None:
            output.copy_(torch.cat([self.world.all_gather[q][k] for q in range(self.world.ranks)]))

        return output, _Future(fill)


def _chained_averages(messages_per_rank: list[list[torch.Tensor]], holders: list[tuple[int, int]],
                      world: _World | None = None) -> list[list[torch.Tensor]]:
    """Every rank's messages (``[rows, n]`` each) started in order through one step's chain, as the pipeline
    does (each rank's k-th start before any rank's (k+1)-th, then a flush and the waits in start order); each
    rank's averages (row 0 of each message)."""
    world = world or _World(len(messages_per_rank))
    slots = max(rows.shape[0] for messages in messages_per_rank for rows in messages)
    groups = [_Group(world, rank, holders, slots) for rank in range(world.ranks)]
    chains = [_ShareOrderChain() for _ in groups]
    started: list[list[Any]] = [[] for _ in groups]
    for k in range(len(messages_per_rank[0])):
        for rank, group in enumerate(groups):
            started[rank].append(chains[rank].start(messages_per_rank[rank][k], group))
            for earlier in started[rank][:-1]:
                earlier.advance()
    for rank in range(world.ranks):
        for running in started[rank]:
            running.flush()
    for rank in range(world.ranks):
        for running in started[rank]:
            running.wait()
    return [[rows[0].clone() for rows in messages] for messages in messages_per_rank]


def _share_order_average(rows_per_rank: list[torch.Tensor], holders: list[tuple[int, int]]) -> list[torch.Tensor]:
    return [averages[0] for averages in _chained_averages([[rows] for rows in rows_per_rank], holders)]


def _awkward_shares(n: int = 1001) -> list[torch.Tensor]:
    """Three shares' gradients whose fp32 sum depends on the order they are added in."""
    generator = torch.Generator().manual_seed(3)
    scales = (1.0, 3e-4, 7e3)
    return [torch.randn(n, generator=generator) * scale for scale in scales]


@pytest.mark.parametrize("n", [1001, 1002])  # slices padded; or filling row 0 exactly (gathered in place)
def test_summed_in_share_order_the_average_is_the_same_bits_whichever_group_read_which_share(n: int) -> None:
    s0, s1, s2 = _awkward_shares(n)
    assert not torch.equal((s0 + s2) + s1, (s0 + s1) + s2)  # the order matters for these numbers
    # every group live: group g reads share g
    together = _share_order_average([s0[None].clone(), s1[None].clone(), s2[None].clone()],
                                    holders=[(0, 0), (1, 0), (2, 0)])
    # group 2 lost: quorum rank 0 reads shares 0 and 2 (rows 0 and 1), rank 1 share 1 (one row, padded to two)
    alone = _share_order_average([torch.stack([s0, s2]), s1[None].clone()], holders=[(0, 0), (1, 0), (0, 1)])
    expected = ((s0 + s1) + s2) / 3
    for result in together + alone:
        assert torch.equal(result, expected)


def _gathered_average(rows_per_rank: list[torch.Tensor], holders: list[tuple[int, int]]) -> list[torch.Tensor]:
    world = _World(len(rows_per_rank))
    slots = max(rows.shape[0] for rows in rows_per_rank)
    sums = [_ShareOrderGather(rows, _Group(world, rank, holders, slots)) for rank, rows in enumerate(rows_per_rank)]
    for running in sums:
        running.wait()
    return [rows[0].clone() for rows in rows_per_rank]


@pytest.mark.parametrize("n", [1001, 1002])
def test_one_all_gather_gives_the_two_stages_bits(n: int) -> None:
    """The one-collective sum (taken where it moves no more bytes) adds the same values in the same order as the
    two stages: the same bits, with two groups, one group alone reading every share, and three groups."""
    s0, s1, s2 = _awkward_shares(n)
    two = _gathered_average([s0[None].clone(), s1[None].clone()], holders=[(0, 0), (1, 0)])
    assert all(torch.equal(result, (s0 + s1) / 2) for result in two)
    assert all(torch.equal(a, b) for a, b in zip(two, _share_order_average(
        [s0[None].clone(), s1[None].clone()], holders=[(0, 0), (1, 0)])))
    (alone,) = _gathered_average([torch.stack([s0, s1, s2])], holders=[(0, 0), (0, 1), (0, 2)])
    assert torch.equal(alone, ((s0 + s1) + s2) / 3)
    # a group lost: rank 0 reads shares 0 and 2, rank 1 share 1 (its one row padded to two)
    lost = _gathered_average([torch.stack([s0, s2]), s1[None].clone()], holders=[(0, 0), (1, 0), (0, 1)])
    assert all(torch.equal(result, ((s0 + s1) + s2) / 3) for result in lost)


#: message sizes of the torchft-gloo test's chain (the first set by the test): carried and gathered second stages
CHAIN_SIZES = (0, 7, 300, 1003)


def _sums_over_torchft_gloo(rank: int, world_size: int, port: int, n: int) -> dict[str, Any]:
    """Quorum rank ``rank`` of ``world_size`` groups over torchft's own gloo process group (as a replica group
    configures it at a quorum), every group live: rank ``rank``'s awkward shares of four messages averaged through
    one step's chain, and the first through the one-all-gather sum."""
    from datetime import timedelta

    from torch.distributed import TCPStore
    from torchft.process_group import ProcessGroupGloo

    store = TCPStore("127.0.0.1", port, world_size, is_master=rank == 0, wait_for_workers=False)
    pg = ProcessGroupGloo(timeout=timedelta(seconds=30))
    pg.configure(f"127.0.0.1:{port}/quorum_1", "mics_group_test", rank, world_size)
    group = ReplicaGroup.__new__(ReplicaGroup)  # no Lighthouse: hop 2's collectives over the real process group
    group.pg, group._pg_is_gloo = pg, True
    group.manager = SimpleNamespace(num_participants=lambda: world_size, errored=lambda: None)
    group._holders = ([(q, 0) for q in range(world_size)], 1)
    chain = _ShareOrderChain()
    messages = [_awkward_shares(size or n)[rank][None].clone() for size in CHAIN_SIZES]
    average_in_pipeline_order(lambda rows: chain.start(rows, group), messages)
    rows = _awkward_shares(n)[rank][None].clone()
    _ShareOrderGather(rows, group).wait()
    del store
    return {"chain": [message[0] for message in messages], "one_gather": rows[0]}


@pytest.mark.distributed
@pytest.mark.timeout(120)
@pytest.mark.parametrize("n", [1001, 1002])
def test_over_torchft_gloo_both_sums_give_the_share_order_bits(n: int) -> None:
    """The collectives as hop 2 starts them on torchft's gloo group (the flat all-gather under its wrapper, the
    all-to-alls carrying earlier messages' second stages): every quorum rank ends with the share-order average of
    every message, three groups."""
    results = run_ranks(_sums_over_torchft_gloo, 3, free_port(), n, timeout=100)
    expected = [((s0 + s1) + s2) / 3 for s0, s1, s2 in (_awkward_shares(size or n) for size in CHAIN_SIZES)]
    for result in results:
        assert all(torch.equal(got, want) for got, want in zip(result["chain"], expected))
        assert torch.equal(result["one_gather"], expected[0])


def test_the_transport_takes_one_collective_only_where_it_moves_no_more_bytes() -> None:
    # (quorum groups, most shares one group reads): the all-gather's rows received per rank, (q - 1) s, against
    # the two stages' (q - 1)(s + 1) / q
    assert [gather_moves_no_more(q, s) for q, s in [(1, 1), (1, 3), (2, 1)]] == [True, True, True]
    assert [gather_moves_no_more(q, s) for q, s in [(2, 2), (3, 1), (3, 2), (4, 1), (8, 1)]] == [False] * 5

    def started(quorum: int, slots: int) -> type:
        holders = [(rank, 0) for rank in range(quorum)]
        group = _Group(_World(quorum), 0, holders, slots)
        group.contributes = True  # type: ignore[attr-defined]
        rows = torch.zeros(slots, 12)
        return type(ManagedTransport(group, None, in_share_order=True).start_average(rows))  # type: ignore[arg-type]

    assert started(2, 1) is _ShareOrderGather and started(1, 3) is _ShareOrderGather
    assert started(3, 1) is _ChainedSum and started(2, 2) is _ChainedSum


# ------------------------------------------------------------------------ shares kept apart
def test_each_share_accumulates_apart_and_packs_into_its_own_row_in_share_order() -> None:
    model = nn.Linear(3, 2)
    shares = ShareGradients(model)
    params = list(model.parameters())

    def backward(scale: float) -> None:
        model(torch.ones(1, 3) * scale).sum().backward()

    shares.use(2)  # the first share of the step takes .grad as it is (None)
    backward(1.0)
    shares.use(0)
    backward(10.0)
    shares.use(2)
    backward(1.0)  # accumulates onto share 2's gradient, not share 0's
    shares.use(0)
    backward(10.0)
    assert shares.others == 1
    numel = [p.numel() for p in params]
    rows = shares.pack(params, numel)
    weight_share0, weight_share2 = rows[0, :6].view(2, 3), rows[1, :6].view(2, 3)
    assert torch.equal(weight_share0, torch.full((2, 3), 20.0)) and torch.equal(weight_share2, torch.full((2, 3), 2.0))
    shares.clear()
    assert shares.others == 0 and shares.current is None


def test_the_share_placement_is_worked_out_once_per_step_for_all_its_messages() -> None:
    worked_out: list[int] = []
    stub = SimpleNamespace(_holders=None, _share_holders=lambda: worked_out.append(1) or ([(0, 0)], 1))
    assert ReplicaGroup.share_holders(stub) == ReplicaGroup.share_holders(stub) == ([(0, 0)], 1)
    assert worked_out == [1]


def test_shares_are_placed_on_the_quorum_ranks_that_read_them() -> None:
    def holders(num_shares: int, quorum_groups: tuple[int, ...], catching_up: tuple[int, ...], mine: int, rank: int):
        contributors = [g for g in quorum_groups if g not in catching_up]
        mine_index = contributors.index(mine) if mine in contributors else None
        stub = SimpleNamespace(
            options=SimpleNamespace(num_replica_groups=num_shares, replica_group=mine),
            participation=lambda: (0, rank if not catching_up else mine_index, len(contributors)),
            not_contributing=catching_up,
            _quorum_groups=quorum_groups,
            _contributors=lambda: contributors,
            manager=SimpleNamespace(participating_rank=lambda: rank),
            _replica_id=ReplicaGroup._replica_id,
        )
        return ReplicaGroup._share_holders(stub)

    assert holders(3, (0, 1, 2), (), 0, 0) == ([(0, 0), (1, 0), (2, 0)], 1)
    assert holders(3, (0, 1), (), 1, 1) == ([(0, 0), (1, 0), (0, 1)], 2)  # a lost group's share read by rank 0
    # group 1 catching up (quorum ranks by replica id: 0, 1, 2): contributors 0 and 2 read every share
    assert holders(3, (0, 1, 2), (1,), 2, 2) == ([(0, 0), (2, 0), (0, 1)], 2)
    # with 11 groups torchft ranks "mics_group_10" before "mics_group_2": the mapping follows it
    groups = tuple(range(11))
    placed, slots = holders(11, groups, (3,), 10, 2)
    assert slots == 2 and placed[0] == (0, 0) and placed[2] == (3, 0)  # contributor 2 is group 10 at rank 2
    with pytest.raises(RuntimeError, match="exact_trajectory=False"):
        holders(11, groups, (3,), 10, 5)  # torchft said otherwise: refuse rather than mix shares up


# ------------------------------------------------------------------------ the data
def test_the_loader_delivers_each_share_of_a_micro_step_as_its_own_failure_free_batch() -> None:
    order = GlobalSampleOrder(num_samples=48, num_shares=3, ranks_per_group=2, micro_batch=2, accumulate=1, seed=5)
    dataset = TensorDataset(torch.arange(48))
    cursor = DataCursor(order, own_share=0, rank=1, separate_shares=True)
    cursor.start_step(0, participant=0, participants=2)  # group 2 lost: this group reads shares 0 and 2
    loader = TrajectoryDataLoader(DataLoader(dataset, batch_size=2), cursor)
    batch = next(iter(loader))
    delivered, needed = cursor.take()
    assert needed.shares == (0, 2) and cursor.weight == 1.0
    assert batch[0].tolist() == order.samples(MicroBatchKey(0, 0, (0,)), 1)
    (other,) = cursor.other_shares
    assert other[0].tolist() == order.samples(needed.of_share(2), 1)
    reloaded = loader.load(MicroBatchKey(1, 0, (0, 2)))  # a wrong prediction: loaded here, shares apart too
    assert reloaded[0].tolist() == order.samples(MicroBatchKey(1, 0, (0,)), 1)
    assert cursor.other_shares[0][0].tolist() == order.samples(MicroBatchKey(1, 0, (2,)), 1)


# ------------------------------------------------------------------------ the option
def test_exact_trajectory_is_refused_where_its_sums_cannot_be_exact() -> None:
    with pytest.raises(ValueError, match="true or false"):
        FaultTolerance(exact_trajectory="yes")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="keep_trajectory=False"):
        FaultTolerance(exact_trajectory=True, keep_trajectory=False)
    ft = FaultTolerance(lighthouse="http://x:1", replica_group=0, num_replica_groups=2, exact_trajectory=True)
    with pytest.raises(ValueError, match="cross_replica_dtype"):
        MiCSOptions(fault_tolerance=ft, cross_replica_dtype="bf16")
    with pytest.raises(ValueError, match="exact_trajectory=False"):
        MiCSOptions(fault_tolerance=ft, cross_replica_sync="diloco", sync_every=10)
    from lightning_mics.fault_tolerance import check_exact_trajectory

    with pytest.raises(ValueError, match="bf16-mixed"):
        check_exact_trajectory(ft, loss_scaling=True)
    with pytest.raises(ValueError, match="grad_accumulation='sharded'"):
        check_exact_trajectory(ft, grad_accumulation="unsharded")
    check_exact_trajectory(ft, grad_accumulation="sharded")


def test_fabric_refuses_exact_trajectory_naming_the_fix() -> None:
    """Fabric's loop is the user's: the strategy cannot add a lost group's share as an extra pass."""
    from lightning_mics import MiCSFabricStrategy

    ft = FaultTolerance(lighthouse="http://x:1", replica_group=0, num_replica_groups=2, exact_trajectory=True)
    strategy = MiCSFabricStrategy(fault_tolerance=ft)
    with pytest.raises(ValueError, match="exact_trajectory=False"):
        strategy._join_fault_domain(torch.optim.SGD(nn.Linear(2, 2).parameters(), lr=0.1), loss_scaling=False)


@pytest.mark.parametrize("lost", [False, True])
def test_in_a_chain_each_messages_second_stage_rides_on_a_later_all_to_all_and_the_last_ones_share_one_gather(
    lost: bool,
) -> None:
    """Five messages of different sizes in one step: one collective per message (message k's all-to-all carries
    message k - LAG's summed slices) and one all-gather for the messages nothing later carried -- each average the
    share-order bits, with every group live and with group 2 lost (rank 0 reading shares 0 and 2)."""
    sizes = [7, 1001, 1002, 12, 300]
    shares = [_awkward_shares(n) for n in sizes]
    expected = [((s0 + s1) + s2) / 3 for s0, s1, s2 in shares]
    if lost:
        messages = [[torch.stack([s0, s2]) for s0, _, s2 in shares], [s1[None].clone() for _, s1, _ in shares]]
        holders = [(0, 0), (1, 0), (0, 1)]
    else:
        messages = [[share[g][None].clone() for share in shares] for g in range(3)]
        holders = [(0, 0), (1, 0), (2, 0)]
    world = _World(len(messages))
    averages = _chained_averages(messages, holders, world)
    assert world.started == ["all_to_all"] * len(sizes) + ["all_gather"]
    assert LAG_BEFORE_SECOND_STAGE < len(sizes)  # the chain carried some second stages
    for rank_averages in averages:
        for got, want in zip(rank_averages, expected):
            assert torch.equal(got, want)


def test_a_message_waited_on_before_a_later_one_carried_it_is_gathered_then_the_chain_goes_on() -> None:
    """A unit whose gradients report twice before a step (a second boundary backward) waits on its earlier
    message mid-step: every message not yet carried is gathered then, and later messages chain afresh."""
    shares = [_awkward_shares(n) for n in (10, 11, 12, 13)]
    world = _World(3)
    groups = [_Group(world, rank, [(0, 0), (1, 0), (2, 0)], 1) for rank in range(3)]
    chains = [_ShareOrderChain() for _ in groups]
    first = [chains[g].start(shares[0][g][None].clone(), groups[g]) for g in range(3)]
    for running in first[1:]:  # (one process plays every rank: the others' gathers start before rank 0 waits)
        running.flush()
    for running in first:
        running.wait()  # nothing carried it yet: rank 0's wait starts its gather
    later: list[list[Any]] = [[], [], []]
    for share in shares[1:]:  # every rank's k-th start before any rank's (k+1)-th
        for g in range(3):
            later[g].append(chains[g].start(share[g][None].clone(), groups[g]))
    for messages in later:
        for running in messages:
            running.flush()
    for messages in later:
        for running in messages:
            running.wait()
    assert world.started == ["all_to_all", "all_gather", "all_to_all", "all_to_all", "all_to_all", "all_gather"]
    for g in range(3):
        assert torch.equal(first[g].rows[0], ((shares[0][0] + shares[0][1]) + shares[0][2]) / 3)
        for running, share in zip(later[g], shares[1:]):
            assert torch.equal(running.rows[0], ((share[0] + share[1]) + share[2]) / 3)
