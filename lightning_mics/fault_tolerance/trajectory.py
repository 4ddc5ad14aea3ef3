"""Training data that keeps the failure-free trajectory: every committed step reads the next global batch of
one fixed sample order, whichever replica groups are live.

Why: with a fixed share per group, a lost group's samples go unread, the batch shrinks by its share, a
discarded step's samples are skipped and a restarted group re-reads its share from the start of its epoch --
the run with a failure is another run. Here, as in ReCoVer (arXiv 2605.11215), the global batch stays
constant and the survivors take the lost group's samples over.

* **The order.** Data step ``d`` is torchft's committed-step count. It reads global batch ``d`` of a fixed
  order: epoch ``e = d // steps_per_epoch`` is ``randperm(num_samples)`` seeded with ``seed + e`` (what
  Lightning's ``DistributedSampler`` uses), cut into global batches of ``accumulate x groups x ranks x
  micro_batch`` samples (a remainder is left out, as with ``drop_last``). A restarted group's position is
  the step count it heals, so it never re-reads; a discarded step does not count, so it is re-done on the
  same samples.
* **The split.** Micro-step ``m`` of a global batch has one *share* per replica group of the full job, and
  share ``j`` holds ``micro_batch`` samples per rank, dealt round-robin over the job's ranks in the order
  ``share * ranks_per_group + rank`` -- exactly the samples Lightning's ``DistributedSampler`` gives that
  rank of a job with every group live, so that without failures a fault-tolerant run reads what plain MiCS
  reads, rank for rank. The quorum's ``k`` participating groups take share ``j``
  at participant ``j % k``: with every group live each reads its own share, with one lost the others read its
  share too (same micro-steps, more samples each). Rank ``r`` of a group reads its shares' samples for ``r``,
  collated together into one batch.
* **The gradient.** Each group's loss is the mean over its own samples; hop 2 averages the groups. A group
  with ``n`` of ``G`` shares weighs its gradient by ``n k / G`` (1 when the shares divide evenly), so the sum is
  the mean over the global batch's samples -- exactly the failure-free gradient when the loss is a mean over
  the batch's samples (a token-mean over padded, variable-length samples is not).
* **The loading.** The DataLoader's workers load what the batch sampler predicts: the micro-batch after those
  in flight, with the last quorum's shares. At each micro-step the prediction is checked against what the
  quorum decided; a wrong one -- for the few micro-batches in flight after a failure, a discarded step or a
  heal -- is replaced by loading the right samples in the training process: slower for those micro-steps,
  never another sample.
* **Bit-exact** (``FaultTolerance(exact_trajectory=True)``, the Trainer): a group reading several shares gets
  them as separate micro-batches of the failure-free size (:attr:`DataCursor.separate_shares`); the strategy
  runs one forward and backward per share, each share's gradient accumulates on its own and hop 2 sums them in
  share order (:mod:`lightning_mics.hop2.shares`), so every sum is the one the failure-free run computes. Weight 1.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from functools import lru_cache
from typing import Any, Optional

import torch
from torch.utils.data import DataLoader, Dataset, Sampler


@dataclass(frozen=True)
class MicroBatchKey:
    """Which samples a micro-batch holds: its data step, its micro-step within that step, and its shares."""

    step: int
    micro: int
    shares: tuple[int, ...]

    def of_share(self, share: int) -> MicroBatchKey:
        """The part of this micro-batch that is ``share``'s samples."""
        return MicroBatchKey(self.step, self.micro, (share,))


@dataclass(frozen=True)
class GlobalSampleOrder:
    """The fixed sample order every committed step reads from, and how a global batch is cut (module docstring)."""

    num_samples: int
    #: replica groups of the full job: one share of every micro-step each
    num_shares: int
    ranks_per_group: int
    micro_batch: int
    accumulate: int
    shuffle: bool = True
    seed: int = 0

    def __post_init__(self) -> None:
        if self.steps_per_epoch < 1:
            raise ValueError(
                f"fault tolerance keeps one global batch per step of {self.global_batch} samples ({self.accumulate} "
                f"micro-steps x {self.num_shares} replica groups x {self.ranks_per_group} ranks x micro-batch "
                f"{self.micro_batch}), but the training set has {self.num_samples}: use a smaller batch_size or "
                "accumulate_grad_batches, or a larger dataset."
            )

    @property
    def global_batch(self) -> int:
        return self.accumulate * self.num_shares * self.ranks_per_group * self.micro_batch

    @property
    def steps_per_epoch(self) -> int:
        return self.num_samples // self.global_batch

    def _epoch_order(self, epoch: int) -> list[int]:
        return _permutation(self.num_samples, self.shuffle, self.seed + epoch)

    def global_batch_samples(self, step: int) -> list[int]:
        """The sample indices committed step ``step`` reads, all groups together."""
        order = self._epoch_order(step // self.steps_per_epoch)
        start = (step % self.steps_per_epoch) * self.global_batch
        return order[start : start + self.global_batch]

    def samples(self, key: MicroBatchKey, rank: int) -> list[int]:
        """What rank ``rank`` of a group reads for micro-batch ``key``: its samples of each of the key's shares."""
        order = self._epoch_order(key.step // self.steps_per_epoch)
        ranks = self.num_shares * self.ranks_per_group
        micro_start = (key.step % self.steps_per_epoch) * self.global_batch + key.micro * ranks * self.micro_batch
        out: list[int] = []
        for share in key.shares:
            first = micro_start + share * self.ranks_per_group + rank  # dealt round-robin, as DistributedSampler
            out.extend(order[first : first + ranks * self.micro_batch : ranks])
        return out


@lru_cache(maxsize=4)
def _permutation(num_samples: int, shuffle: bool, seed: int) -> list[int]:
    if not shuffle:
        return list(range(num_samples))
    return torch.randperm(num_samples, generator=torch.Generator().manual_seed(seed)).tolist()


def shares_of(participant: Optional[int], participants: int, num_shares: int, own_share: int) -> tuple[int, ...]:
    """The shares a group reads in a step: those ``j`` with ``j % participants == participant``. A group outside
    the step's participants (its gradient is not summed) reads its own share, so that its forward has data."""
    if participant is None or participants < 1:
        return (own_share,)
    if participants > num_shares:
        raise RuntimeError(
            f"fault tolerance: {participants} replica groups take part in a step of a job of {num_shares}: a group "
            "was started with a replica_group index outside 0..num_replica_groups-1 or another num_replica_groups."
        )
    return tuple(j for j in range(num_shares) if j % participants == participant)


def gradient_weight(shares: Sequence[int], participants: int, num_shares: int) -> float:
    """What a group's gradient is multiplied by before hop 2 averages it over ``participants`` groups, so that
    the average is the mean over the global batch's samples: ``len(shares) * participants / num_shares``."""
    return len(shares) * max(participants, 1) / num_shares


class DataCursor:
    """Where the training data stands, shared by the batch sampler (which predicts what the steps will read)
    and the strategy (which decides it at each quorum). Both run in the training process."""

    def __init__(
        self, order: GlobalSampleOrder, own_share: int, rank: int, first_step: int = 0, separate_shares: bool = False
    ) -> None:
        self.order = order
        #: ``exact_trajectory``: each share of a micro-step is its own micro-batch (the first goes to the loop,
        #: the others are :attr:`other_shares`) and weighs 1 -- hop 2 sums the shares
        self.separate_shares = separate_shares
        self.own_share = own_share
        self.rank = rank
        #: flat index (``step * accumulate + micro``) of the next micro-batch to train on
        self.position = first_step * order.accumulate
        #: the shares of the last quorum, and this group's gradient weight in it
        self.shares: tuple[int, ...] = (own_share,)
        self.weight = 1.0
        self._dispatched = 0
        self._consumed = 0
        self._delivered: deque[tuple[MicroBatchKey, list[Any]]] = deque()
        #: micro-batches the prediction got wrong, loaded in the training process instead
        self.reloaded = 0
        #: the micro-batch being trained on (set at each micro-step)
        self.current: Optional[MicroBatchKey] = None
        #: ``separate_shares``: the batches of the current micro-step's shares after the first (collated, not yet on
        #: the device), which the strategy trains as extra passes before the loop's own
        self.other_shares: list[Any] = []
        #: ``separate_shares``: the losses of the extra passes of the current micro-step, by share (detached, for
        #: logs)
        self.other_share_losses: dict[int, torch.Tensor] = {}

    def predict(self) -> MicroBatchKey:
        """The micro-batch the steps will need after those already in flight (for the batch sampler)."""
        flat = self.position + self._dispatched - self._consumed
        self._dispatched += 1
        return MicroBatchKey(flat // self.order.accumulate, flat % self.order.accumulate, self.shares)

    def restart(self) -> None:
        """A new pass of the loader: nothing is in flight."""
        self._dispatched = self._consumed = 0
        self._delivered.clear()

    def delivered(self, key: MicroBatchKey, other_shares: Optional[list[Any]] = None) -> None:
        self._delivered.append((key, other_shares or []))

    def start_step(self, step: int, participant: Optional[int], participants: int) -> None:
        """At the quorum: the step the groups are at and the shares this group reads in it."""
        self.position = step * self.order.accumulate
        self.shares = shares_of(participant, participants, self.order.num_shares, self.own_share)
        separate = self.separate_shares
        self.weight = 1.0 if separate else gradient_weight(self.shares, participants, self.order.num_shares)

    def take(self) -> tuple[Optional[MicroBatchKey], MicroBatchKey]:
        """(what the loader delivered for this micro-step, what it must be); with ``separate_shares`` the
        delivered extra shares' batches are in :attr:`other_shares`."""
        delivered, self.other_shares = self._delivered.popleft() if self._delivered else (None, [])
        self.other_share_losses = {}
        self._consumed += 1
        accumulate = self.order.accumulate
        needed = MicroBatchKey(self.position // accumulate, self.position % accumulate, self.shares)
        self.position += 1
        self.current = needed
        return delivered, needed


class PredictingBatchSampler(Sampler[list]):
    """The cursor's predictions, each as its key followed by this rank's sample indices, for as long as they are
    asked for. Its length is one epoch's micro-batches, ``steps_per_epoch * accumulate`` (what the Trainer sizes an
    epoch by), but it does not stop there: a discarded step is trained again on its samples, so an epoch with
    discarded steps takes more micro-batches than that. Where it does stop is the reader's: the Trainer's epoch
    ends where the data's does (:class:`~lightning_mics.fault_tolerance.counters.DataEpochs`), a Fabric loop on
    committed steps. (Stopping here instead could not be right with workers: they ask ahead, before the
    step they ask for is known to be discarded.)"""

    def __init__(self, cursor: DataCursor) -> None:
        self.cursor = cursor

    def __len__(self) -> int:
        return self.cursor.order.steps_per_epoch * self.cursor.order.accumulate

    def __iter__(self) -> Iterator[list]:
        while True:
            key = self.cursor.predict()
            yield [key, *self.cursor.order.samples(key, self.cursor.rank)]


class KeyedDataset(Dataset):
    """The user's dataset, answering a :class:`MicroBatchKey` with itself (so that the key travels with its
    samples through the DataLoader's workers)."""

    def __init__(self, dataset: Any) -> None:
        self.dataset = dataset

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, index: Any) -> Any:
        return index if isinstance(index, MicroBatchKey) else self.dataset[index]

    def __getitems__(self, indices: list) -> list:
        key, samples = indices[0], indices[1:]
        getitems = getattr(self.dataset, "__getitems__", None)
        return [key, *(getitems(samples) if getitems is not None else [self.dataset[i] for i in samples])]


class KeyedCollate:
    """The user's collate function over the samples, paired with the micro-batch's key; with ``separate_shares``
    one collated batch per share (a list), each of the failure-free micro-batch's ``micro_batch`` samples."""

    def __init__(self, collate_fn: Callable[[list], Any], separate_shares: bool = False, micro_batch: int = 0) -> None:
        self.collate_fn = collate_fn
        self.separate_shares = separate_shares
        self.micro_batch = micro_batch

    def __call__(self, items: list) -> tuple[MicroBatchKey, Any]:
        key, samples = items[0], items[1:]
        if not self.separate_shares:
            return key, self.collate_fn(samples)
        n = self.micro_batch
        return key, [self.collate_fn(samples[i * n : (i + 1) * n]) for i in range(len(key.shares))]


class TrajectoryDataLoader(DataLoader):
    """The training DataLoader rebuilt on the global sample order: workers, pinning and prefetching as the user
    set them; it yields the collated batches and tells the cursor which micro-batch each one is."""

    def __init__(self, source: DataLoader, cursor: DataCursor) -> None:
        self.cursor = cursor
        self.source_dataset = source.dataset
        self.source_collate = source.collate_fn
        kwargs: dict[str, Any] = {
            "num_workers": source.num_workers,
            "pin_memory": source.pin_memory,
            "timeout": source.timeout,
            "worker_init_fn": source.worker_init_fn,
            "multiprocessing_context": source.multiprocessing_context,
            "persistent_workers": source.persistent_workers,
            "pin_memory_device": source.pin_memory_device,
        }
        if source.num_workers > 0:
            kwargs["prefetch_factor"] = source.prefetch_factor
        super().__init__(
            KeyedDataset(source.dataset),
            batch_sampler=PredictingBatchSampler(cursor),
            collate_fn=KeyedCollate(source.collate_fn, cursor.separate_shares, cursor.order.micro_batch),
            **kwargs,
        )

    def __iter__(self) -> Iterator[Any]:  # type: ignore[override]
        self.cursor.restart()
        for key, batch in super().__iter__():
            if self.cursor.separate_shares:
                self.cursor.delivered(key, batch[1:])
                yield batch[0]
            else:
                self.cursor.delivered(key)
                yield batch

    def load(self, key: MicroBatchKey) -> Any:
        """Micro-batch ``key`` loaded here, in the training process (a prediction was wrong); with
        ``separate_shares`` the first share's batch, the others' in the cursor's ``other_shares``."""
        self.cursor.reloaded += 1
        collate = KeyedCollate(self.source_collate, self.cursor.separate_shares, self.cursor.order.micro_batch)
        samples = [self.source_dataset[i] for i in self.cursor.order.samples(key, self.cursor.rank)]
        _, batch = collate([key, *samples])
        if not self.cursor.separate_shares:
            return batch
        self.cursor.other_shares = batch[1:]
        return batch[0]


def sample_order_of(loader: DataLoader, num_shares: int, ranks_per_group: int, accumulate: int) -> GlobalSampleOrder:
    """The global order for a training DataLoader as Lightning prepared it (its ``DistributedSampler`` gives
    shuffle and seed); one clear error for a loader this cannot reorder."""
    from torch.utils.data import DistributedSampler, IterableDataset, RandomSampler, SequentialSampler

    fix = "or set FaultTolerance(keep_trajectory=False) to give each group a fixed share of the data instead"
    if not isinstance(loader, DataLoader) or isinstance(loader.dataset, IterableDataset):
        raise ValueError(
            "fault tolerance keeps the training trajectory by reading samples by index: the training data must be "
            f"a DataLoader over a map-style dataset (got {type(loader).__name__} over "
            f"{type(getattr(loader, 'dataset', None)).__name__}); {fix}."
        )
    if loader.batch_size is None:
        raise ValueError(
            "fault tolerance keeps the training trajectory by cutting global batches itself: give the training "
            f"DataLoader a batch_size instead of a batch_sampler, {fix}."
        )
    sampler = loader.sampler
    if type(sampler) is DistributedSampler:  # a subclass (Lightning's wrapper of a custom sampler) has its own order
        shuffle, seed = sampler.shuffle, sampler.seed
    elif type(sampler) in (SequentialSampler, RandomSampler):
        shuffle, seed = isinstance(sampler, RandomSampler), 0
    else:
        raise ValueError(
            "fault tolerance keeps the training trajectory with its own sample order (shuffled per epoch, seeded "
            f"like Lightning's DistributedSampler); the training DataLoader has a {type(sampler).__name__}, whose "
            "order it would ignore: give the DataLoader shuffle=True/False instead of a sampler (with "
            f"Trainer(use_distributed_sampler=True), the default), {fix}."
        )
    return GlobalSampleOrder(
        num_samples=len(loader.dataset),  # type: ignore[arg-type]
        num_shares=num_shares,
        ranks_per_group=ranks_per_group,
        micro_batch=loader.batch_size,
        accumulate=accumulate,
        shuffle=shuffle,
        seed=seed,
    )
