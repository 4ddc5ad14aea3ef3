"""One rank's ``--convergence`` run of one row and seed (:func:`run_convergence`; ``emulated_worker.py`` calls it when
its job names a convergence run): training on the seed's Markov-chain sequences, the held-out loss of the row's
global model (:class:`HeldOut`) every ``eval_every`` steps, the per-step clock and losses (:class:`LossClock`) and
rank 0's record of the run (:func:`summarize_convergence`).

What the record means and how it is analysed: :mod:`benchmarks.convergence_analysis`. The evaluations leave
training unchanged to the bit (``tests/test_benchmark_convergence.py``): a DiLoCo row's synchronised parameters are
copied in for the forward and its own copied back, and every FSDP2 unit is put back as a step boundary leaves it.
"""

from __future__ import annotations

import dataclasses
import json
import os
import statistics
import time
from pathlib import Path
from typing import Any, Optional

import lightning.pytorch as pl
import torch
import torch.distributed as dist
import torch.nn.functional as F
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.strategies import Strategy
from torch import nn
from torch.distributed.fsdp import FSDPModule

from benchmarks.convergence_setup import (
    ConvergenceSettings,
    MarkovChain,
    SequenceDataset,
    init_seed,
    training_sequences,
)
from benchmarks.emulated_probes import counters, local_tensor
from benchmarks.emulated_strategies import measured_trainer, planner_choice
from benchmarks.netns_regions import region_deltas
from benchmarks.scenarios import ClusterShape, StrategySpec, TrainingSetup
from examples.models import GPTConfig, GPTLightningModule
from lightning_mics.planner import device_memory_bytes, live


class ConvergenceGPT(GPTLightningModule):
    """The benchmark's GPT with its loss kept per micro-batch (a Python float: no collective, nothing added to the
    step)."""

    def __init__(self, config: GPTConfig, settings: ConvergenceSettings) -> None:
        super().__init__(config, learning_rate=settings.learning_rate, warmup_steps=settings.warmup_steps)
        self.micro_losses: list[float] = []

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        loss, _ = self._loss(batch)
        self.micro_losses.append(float(loss.detach()))
        return loss


def _diloco_syncs(strategy: Strategy) -> list[Any]:
    """The DiLoCo state of a MiCS row (one ``OuterSync`` per inner optimizer: its parameters and their
    last-synchronised copies), ``[]`` for a synchronous row."""
    semi = getattr(getattr(strategy, "engine", None), "semi_sync", None)
    return list(semi.syncs) if semi is not None and semi.active else []


def _reset_after_evaluation(root: nn.Module) -> None:
    """Put every FSDP2 unit back as a step boundary leaves it: parameters sharded (a unit that keeps them gathered
    after forward, AMSP ``P=1``, would otherwise train its next forward on the evaluated values) and no record of
    the evaluation's forward in the backward-prefetch order (best effort: FSDP2 internals)."""
    for unit in root.modules():
        if isinstance(unit, FSDPModule):
            unit.reshard()
            state = unit._get_fsdp_state()
            groups = getattr(state, "_fsdp_param_groups", None) or [getattr(state, "_fsdp_param_group", None)]
            for group in groups:
                if group is not None and hasattr(group, "_post_forward_indices"):
                    group._post_forward_indices.clear()
            order = getattr(getattr(state, "_comm_ctx", None), "post_forward_order", None)
            if isinstance(order, list):
                order.clear()


class HeldOut:
    """The held-out loss of a row's global model, each rank a slice of the sequences, one all-reduce of the sums
    over the world. A DiLoCo row's global model is the last synchronised one: its parameter shards are copied in
    for the forward and the row's own copied back after (the same in-place writes as DiLoCo's outer step)."""

    def __init__(self, heldout: SequenceDataset, rank: int, world_size: int) -> None:
        per_rank = len(heldout) // world_size
        rows = heldout.sequences[rank * per_rank:(rank + 1) * per_rank]
        self.inputs, self.targets = rows[:, :-1], rows[:, 1:]

    @torch.no_grad()
    def __call__(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> float:
        root = trainer.strategy.model
        forward = root if isinstance(root, FSDPModule) else pl_module  # FSDP2: through the root unit's hooks
        saved: list[tuple[torch.Tensor, torch.Tensor]] = []
        for sync in _diloco_syncs(trainer.strategy):
            for param, anchor in zip(sync.params, sync.anchors):
                local = local_tensor(param)
                saved.append((local, local.clone()))
                local.copy_(local_tensor(anchor))
        was_training = pl_module.training
        pl_module.eval()
        try:
            logits = forward(self.inputs)
            total = F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), self.targets.reshape(-1),
                                    reduction="sum")
        finally:
            pl_module.train(was_training)
            if isinstance(root, FSDPModule):
                _reset_after_evaluation(root)
            for local, own in saved:
                local.copy_(own)
        sums = torch.tensor([float(total), float(self.targets.numel())], dtype=torch.float64)
        dist.all_reduce(sums)
        return float(sums[0] / sums[1])


class LossClock(Callback):
    """Per optimizer step, on every rank, without any collective (a barrier per step would tie the replica groups
    of a DiLoCo row together between synchronisations and add a cross-node round trip to every row): the time the
    step ended (training time: the evaluations' own time taken out), the mean loss of its micro-batches and the
    uplink's byte counters. Every ``eval_every`` steps the held-out loss of the global model (:class:`HeldOut`);
    a DiLoCo row whose global model has not changed since the last evaluation (no synchronisation since) keeps
    that value without evaluating again. The duration of the accumulation micro-steps that only compute (neither
    the window's first nor its last: no gather, no reduction) gives the achieved compute rate the planner is asked
    with. One barrier at the start gives the ranks a common origin; they share the host's monotonic clock. One more
    after the last step (its time already taken) before the run's final byte counters: until every rank has
    finished, a node's other ranks may still be sending the last collective's bytes."""

    def __init__(self, heldout: HeldOut, eval_every: int, accumulate: int) -> None:
        self.heldout = heldout
        self.eval_every = eval_every
        self.accumulate = accumulate
        self.start: float = 0.0
        self.excluded = 0.0  #: seconds of evaluation so far, taken out of every later step's time
        self.start_counters: dict[str, float] = {}
        self.end_counters: dict[str, float] = {}
        self.steps: list[dict[str, float]] = []
        self.evals: list[dict[str, Any]] = []
        self.compute_micro_s: list[float] = []
        self._last_global_step = 0
        self._micro = 0
        self._micro_start = 0.0
        self._evaluated: Optional[tuple[tuple[int, ...], float]] = None  # (outer steps, loss) of the last evaluation

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        trainer.strategy.barrier()
        self.start_counters = counters()
        self.start = time.monotonic()
        self._last_global_step = trainer.global_step

    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        self._micro_start = time.perf_counter()

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if trainer.global_step == self._last_global_step:  # a micro-step inside the accumulation window
            if self._micro >= 1:
                self.compute_micro_s.append(time.perf_counter() - self._micro_start)
            self._micro += 1
            return
        self._micro = 0
        self._last_global_step = step = trainer.global_step
        losses = pl_module.micro_losses  # type: ignore[attr-defined]
        # the counters first: they carry a "time" of their own, which is not the training clock
        self.steps.append({**counters(), "step": step, "time": time.monotonic() - self.excluded,
                           "loss": sum(losses) / len(losses)})
        losses.clear()
        last = trainer.max_steps > 0 and step >= trainer.max_steps
        if step % self.eval_every == 0 or last:
            began = time.monotonic()
            syncs = _diloco_syncs(trainer.strategy)
            key = tuple(sync.outer_steps for sync in syncs)
            if syncs and self._evaluated is not None and self._evaluated[0] == key:
                loss, computed = self._evaluated[1], False
            else:
                loss, computed = self.heldout(trainer, pl_module), True
                self._evaluated = (key, loss)
            spent = time.monotonic() - began
            self.excluded += spent
            self.evals.append({"step": step, "heldout_loss": loss, "computed": computed, "eval_s": spent})
        if last:
            trainer.strategy.barrier()
            self.end_counters = counters()


def run_convergence(
    spec: StrategySpec, cluster: ClusterShape, setup: TrainingSetup, settings: ConvergenceSettings, seed: int,
    steps: int, output: Optional[Path],
) -> None:
    """One row and seed of ``--convergence``: train for ``steps`` optimizer steps on the seed's Markov-chain
    sequences (the same batches in the same global order for every row of the seed), evaluating the global model on
    the held-out sequences every ``settings.eval_every`` steps; rank 0 writes the per-step losses (mean over
    ranks), times (slowest rank), the evaluation points and the run's inter-node bytes."""
    pl.seed_everything(init_seed(seed), workers=True, verbose=False)
    config = setup.model
    chain = MarkovChain(config.vocab_size, settings.successors, settings.data_seed)
    per_step = setup.accumulate * setup.micro_batch * cluster.world_size
    train = SequenceDataset(training_sequences(chain, settings.data_seed, seed, steps, per_step, config.seq_len + 1))
    heldout = SequenceDataset(chain.sample(settings.heldout_samples, config.seq_len + 1, settings.data_seed + 2))
    rank = int(os.environ["NODE_RANK"]) * cluster.ranks_per_node + int(os.environ["LOCAL_RANK"])
    clock = LossClock(HeldOut(heldout, rank, cluster.world_size), settings.eval_every, setup.accumulate)
    # the training set is exactly the budget; nothing validates through Lightning (the clock evaluates)
    trainer = measured_trainer(spec, cluster, setup, steps, [clock], max_epochs=1, limit_val_batches=0)
    model = ConvergenceGPT(config, settings)  # after the seed: every rank builds the same initial model
    loader = torch.utils.data.DataLoader(train, batch_size=setup.micro_batch, shuffle=False)
    trainer.fit(model, train_dataloaders=loader)
    record = {"rank": trainer.global_rank, "local_rank": trainer.local_rank, "start": clock.start,
              "start_counters": clock.start_counters, "end_counters": clock.end_counters, "steps": clock.steps,
              "evals": clock.evals, "compute_micro_s": statistics.median(clock.compute_micro_s)
              if clock.compute_micro_s else None}
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, record)
    measured = live.planner_cluster_for("calibrate", cluster.world_size, cluster.ranks_per_node, "cpu") \
        if spec.planned else None
    if trainer.global_rank == 0 and output is not None:
        summary = summarize_convergence(gathered, planner_choice(spec, trainer.strategy, cluster), cluster, setup)
        summary.update(seed=seed, budget_steps=steps, entropy_rate=chain.entropy_rate,
                       heldout_loss=summary["evals"][-1]["heldout_loss"])
        if measured is not None:  # what the strategy's planner measured at set-up, for the planner's H
            summary["planner_cluster"] = live.describe_cluster(measured)
            summary["planner_cluster_spec"] = dataclasses.asdict(measured)
            summary["planner_reason"] = trainer.strategy.layout.settings.planner_reason
            summary["device_memory_bytes"] = device_memory_bytes("cpu", cluster.ranks_per_node)
        output.write_text(json.dumps(summary, indent=2))
    dist.barrier()


def summarize_convergence(
    per_rank: list[dict[str, Any]], spec: StrategySpec, cluster: ClusterShape, setup: TrainingSetup
) -> dict[str, Any]:
    """Every rank's per-step records as one curve: loss = mean over ranks (every rank's micro-batches are the same
    size, so the global batch's mean), time = the slowest rank's step end since the earliest start; the evaluation
    points at those times (the loss is the same on every rank: one all-reduce), their cost the slowest rank's."""
    start = min(r["start"] for r in per_rank)
    counts = {len(r["steps"]) for r in per_rank}
    if len(counts) != 1 or len({len(r["evals"]) for r in per_rank}) != 1:
        raise RuntimeError(f"ranks recorded different numbers of optimizer steps or evaluations: {sorted(counts)}")
    steps = []
    for i in range(counts.pop()):
        entries = [r["steps"][i] for r in per_rank]
        steps.append({"step": int(entries[0]["step"]), "time_s": max(e["time"] for e in entries) - start,
                      "loss": statistics.mean(e["loss"] for e in entries),
                      "loss_per_rank": [e["loss"] for e in entries]})
    time_at = {s["step"]: s["time_s"] for s in steps}
    evals = []
    for i, first in enumerate(per_rank[0]["evals"]):
        entries = [r["evals"][i] for r in per_rank]
        evals.append({"step": first["step"], "time_s": time_at[first["step"]], "heldout_loss": first["heldout_loss"],
                      "computed": first["computed"], "eval_s": max(e["eval_s"] for e in entries)})
    leaders = [r for r in per_rank if r["local_rank"] == 0]
    timed = [r["compute_micro_s"] for r in per_rank if r.get("compute_micro_s")]

    def grown(counter: str) -> list[float]:
        """Each node's counter growth from the start barrier to the barrier after the last step."""
        return [r["end_counters"][counter] - r["start_counters"][counter] for r in leaders]

    # the region links' counters (a cluster with regions) are global: rank 0's readings at the two barriers
    across = region_deltas(per_rank[0]["start_counters"], per_rank[0]["end_counters"])
    regions = {} if across is None else {"across_region_rx_bytes": sum(across["rx"]),
                                         "across_region_tx_bytes_per_region": across["tx"],
                                         "across_region_rx_bytes_per_region": across["rx"],
                                         "diloco_worker_size": spec.diloco_worker_size}
    return {
        "strategy": spec.name,
        "family": spec.family,
        "partition_size": spec.partition_size,
        "params_degree": spec.params_degree,
        "optim_degree": spec.optim_degree,
        "grad_accumulation": spec.grad_accumulation,
        "hierarchical": spec.hierarchical,
        "planned": spec.planned,
        "sync_every": spec.sync_every,
        "outer_lr": spec.outer_lr,
        "status": "ok",
        "tokens_per_step": setup.tokens_per_step(cluster),
        "steps": steps,
        "evals": evals,
        "eval_s": sum(e["eval_s"] for e in evals),
        # the slowest rank's median duration of the micro-steps that only compute
        "compute_micro_step_s": max(timed) if timed else None,
        "inter_node_bytes": sum(grown("uplink_tx")),
        "inter_node_tx_bytes_per_node": grown("uplink_tx"),
        "inter_node_rx_bytes_per_node": grown("uplink_rx"),
        "loopback_bytes": sum(grown("lo_tx")),
        **regions,
    }
