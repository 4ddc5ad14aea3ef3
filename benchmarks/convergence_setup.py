"""What a ``--convergence`` run trains: its rows, bandwidth ratios and seeds, the settings every row shares
(:class:`ConvergenceSettings`) and the data.

The data (:class:`MarkovChain`) is learnable -- random tokens cannot be learnt below ``ln(vocab)`` -- and its
best possible loss is known: a fixed random first-order Markov chain over the byte vocabulary, each token followed
by one of ``successors`` tokens with random probabilities. Its entropy rate (nats per token) is the floor of the
loss; a model that has learnt the table reaches it.

The orchestrator and every rank (:mod:`benchmarks.convergence_worker`) import this module, so it needs nothing
but torch; the analysis of what the rows record is :mod:`benchmarks.convergence_analysis`'s.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import torch
from torch import Tensor
from torch.utils.data import Dataset

#: The synchronous reference every other row is compared against.
REFERENCE = "mics-auto"
#: In ``--strategies``: the DiLoCo row with the H the planner names for the link (resolved once the first
#: ``mics-auto`` run of a ratio has measured the cluster; it is the H = 8 or H = 32 row when the planner names 8 or 32).
PLANNED_ROW = "mics-diloco-planned"
#: The rows of a convergence run (``--strategies`` may name others, ``REFERENCE`` among them).
CONVERGENCE_STRATEGIES = ("mics-auto", "mics-diloco", "mics-diloco-h32", PLANNED_ROW)
SMOKE_CONVERGENCE_STRATEGIES = ("mics-auto", "mics-diloco", PLANNED_ROW)
#: Bandwidth ratios of a convergence run: the cross-region setting (1/240 of loopback); others by flag.
CONVERGENCE_RATIOS = (240.0,)
SMOKE_CONVERGENCE_RATIOS = (240.0,)
#: Seeds of a run: each changes the model's initialisation and the draw (and so the order) of training sequences.
CONVERGENCE_SEEDS = (0, 1, 2)
SMOKE_CONVERGENCE_SEEDS = (0, 1)
#: Model initialisation of seed ``s``: ``pl.seed_everything(INIT_SEED_BASE + s)`` on every rank.
INIT_SEED_BASE = 1234


# ------------------------------------------------------------------------------------------------ settings
@dataclass(frozen=True)
class ConvergenceSettings:
    """What every row of a convergence run trains with, besides the model and cluster (one JSON object in the
    job file, so the workers and the report share it)."""

    steps: int  #: the reference's token budget, in optimizer steps (synchronous rows run exactly this many)
    learning_rate: float = 3e-3  #: peak AdamW learning rate (inner optimizer for DiLoCo rows)
    warmup_steps: int = 10  #: linear warm-up, then cosine decay to 0.1x at the row's last step
    successors: int = 4  #: tokens that may follow each token in the Markov chain
    data_seed: int = 0  #: the chain's table; training sequences use ``data_seed + 1`` (and the seed), held-out ``+ 2``
    heldout_samples: int = 512  #: held-out sequences, the same for every row and seed
    eval_every: int = 16  #: optimizer steps between two held-out evaluations (the same token counts for every row)
    #: a DiLoCo row's budget is at least this many times the reference's (whole rounds, whole evaluation intervals)
    diloco_budget: float = 2.0
    seeds: tuple[int, ...] = CONVERGENCE_SEEDS
    window: int = 16  #: trailing-mean window (steps) of the training-loss curves (the table's last column)

    def __post_init__(self) -> None:
        object.__setattr__(self, "seeds", tuple(self.seeds))
        for name in ("steps", "successors", "heldout_samples", "window", "eval_every"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"convergence {name.replace('_', '-')} must be a positive int, got {value!r}.")
        if not self.learning_rate > 0:
            raise ValueError(f"--lr must be positive, got {self.learning_rate!r}.")
        if self.warmup_steps < 0:
            raise ValueError(f"convergence warm-up steps must be >= 0, got {self.warmup_steps!r}.")
        if not self.diloco_budget >= 1.0:
            raise ValueError(f"--diloco-budget must be >= 1 (a multiple of the reference's), got {self.diloco_budget!r}.")
        if not self.seeds or len(set(self.seeds)) != len(self.seeds) or any(
            isinstance(s, bool) or not isinstance(s, int) or s < 0 for s in self.seeds
        ):
            raise ValueError(f"--seeds takes distinct non-negative ints, got {self.seeds!r}.")

    def row_steps(self, sync_every: Optional[int]) -> int:
        """A row's budget in optimizer steps: the reference's for a synchronous row; for a DiLoCo row the smallest
        multiple of both ``H`` (whole rounds: its last model is the synchronised one) and ``eval_every`` (its last
        step is an evaluation point) that is at least ``diloco_budget`` times the reference's."""
        if not sync_every:
            return self.steps
        unit = math.lcm(sync_every, self.eval_every)
        return -(-math.ceil(self.diloco_budget * self.steps) // unit) * unit

    def check(self, world_size: int) -> None:
        """Refuse a reference budget that does not end on an evaluation point, or a held-out set the ranks cannot
        split evenly."""
        if self.steps % self.eval_every:
            raise ValueError(
                f"--steps {self.steps} is not a multiple of --eval-every {self.eval_every}: the reference's final "
                "model would not be evaluated."
            )
        if self.heldout_samples % world_size:
            raise ValueError(f"the {self.heldout_samples} held-out samples must split evenly over {world_size} ranks.")


# ------------------------------------------------------------------------------------------------ data
class MarkovChain:
    """A fixed random first-order Markov chain over ``vocab`` tokens: token ``i`` is followed by one of
    ``successors`` distinct tokens (drawn at random), with probabilities ``w / sum(w)``, ``w ~ Exp(1)`` (a flat
    Dirichlet). Sequences start from the stationary distribution, so every position predicts with the same
    best-possible loss, the chain's entropy rate."""

    def __init__(self, vocab: int, successors: int, seed: int) -> None:
        if not 1 <= successors <= vocab:
            raise ValueError(f"successors must lie in [1, {vocab}], got {successors}.")
        generator = torch.Generator().manual_seed(seed)
        table = torch.zeros(vocab, vocab, dtype=torch.float64)
        for token in range(vocab):
            following = torch.randperm(vocab, generator=generator)[:successors]
            weights = -torch.log(torch.rand(successors, generator=generator, dtype=torch.float64))
            table[token, following] = weights / weights.sum()
        self.table = table
        stationary = torch.full((vocab,), 1.0 / vocab, dtype=torch.float64)
        for _ in range(1000):  # power iteration; a random sparse chain mixes in a few dozen steps
            stationary = stationary @ table
        self.stationary = stationary / stationary.sum()

    @property
    def entropy_rate(self) -> float:
        """Nats per token of the best predictor: ``sum_i pi_i H(P_i)`` -- the floor of the loss."""
        logs = torch.where(self.table > 0, self.table.log(), torch.zeros_like(self.table))
        return float(-(self.stationary[:, None] * self.table * logs).sum())

    def sample(self, count: int, length: int, seed: int) -> Tensor:
        """``count`` sequences of ``length`` tokens (int64), reproducibly from ``seed``."""
        generator = torch.Generator().manual_seed(seed)
        out = torch.empty(count, length, dtype=torch.int64)
        out[:, 0] = torch.multinomial(self.stationary.float(), count, replacement=True, generator=generator)
        table = self.table.float()
        for t in range(1, length):
            out[:, t] = torch.multinomial(table[out[:, t - 1]], 1, generator=generator)[:, 0]
        return out


#: Seeds of the training draws: step ``t`` of seed ``s`` draws with ``data_seed + 1 + DRAW_STRIDE * s + t``.
DRAW_STRIDE = 1_000_003


def training_sequences(chain: MarkovChain, data_seed: int, seed: int, steps: int, per_step: int,
                       length: int) -> Tensor:
    """The training sequences of seed ``seed``: ``per_step`` sequences (one global batch) per optimizer step, each
    step's batch drawn with its own generator. So a longer budget (a DiLoCo row's) reads the same batches as a
    shorter one (``mics-auto``'s) over their common steps, and another seed reads other sequences in another order."""
    if steps < 1 or per_step < 1:
        raise ValueError(f"need at least one step of one sequence, got {steps} steps of {per_step}.")
    base = data_seed + 1 + DRAW_STRIDE * seed
    return torch.cat([chain.sample(per_step, length, base + step) for step in range(steps)])


def init_seed(seed: int) -> int:
    """The global seed every rank of a row sets before building the model (:data:`INIT_SEED_BASE` + ``seed``)."""
    return INIT_SEED_BASE + seed


class SequenceDataset(Dataset[tuple[Tensor, Tensor]]):
    """Sequences of ``seq_len + 1`` tokens as (inputs, next-token targets), in a fixed order: with Lightning's
    ``DistributedSampler`` (no shuffling) global optimizer step ``s`` reads samples ``[s * B, (s + 1) * B)`` --
    ``B`` = ranks x accumulation x micro-batch -- whatever the strategy, so every row of a seed sees the same
    batches."""

    def __init__(self, sequences: Tensor) -> None:
        self.sequences = sequences

    def __len__(self) -> int:
        return self.sequences.shape[0]

    def __getitem__(self, index: int) -> tuple[Tensor, Tensor]:
        row = self.sequences[index]
        return row[:-1], row[1:]
