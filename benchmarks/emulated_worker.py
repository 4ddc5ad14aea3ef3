"""One rank of the emulated-cluster benchmark: train the GPT with one strategy and measure it.

Started by ``emulated_cluster.py`` inside a node's network namespace, with Lightning's usual
environment (``MASTER_ADDR``, ``NODE_RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``) and
``GLOO_SOCKET_IFNAME=uplink``. Rank 0 writes one JSON record to ``--output``.

What is measured, per optimizer step (the window from one optimizer step to the next):

* **step time** -- wall time between two barriers at consecutive step boundaries (so it is the
  slowest rank's time); the median over the measured steps is reported;
* **inter-node bytes** -- the growth of the ``uplink`` veth's ``tx_bytes`` kernel counter
  (``/sys/class/net/uplink/statistics``), read by local rank 0 of every node at the same
  boundaries and summed over nodes: every byte that leaves a node is counted once. Each node's
  ``tx_bytes`` and ``rx_bytes`` are kept too (per node, per direction: the wire floor is set by the
  busiest shaped direction). ``lo``'s ``tx_bytes`` gives the node-local (loopback) bytes the same way;
* **peak memory** -- ``ru_maxrss`` of each rank process (resident-set high-water mark: the Python
  interpreter, torch and Lightning included; ``import_rss_bytes`` is the same before the model
  exists), and the model-state bytes each rank holds at the end;
* **gradient bytes held during accumulation** -- after the first (non-boundary) backward of each
  window: the distinct storages behind the ranks' ``.grad`` tensors plus FSDP2's internal
  partial-reduction buffers (where MiCS keeps its accumulated gradient shard until the boundary).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import os
import resource
import statistics
import time
from pathlib import Path
from typing import Any, Optional

import lightning.pytorch as pl
import torch
import torch.distributed as dist
import torch.nn.functional as F
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.strategies import DDPStrategy, FSDPStrategy, Strategy
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule, FullyShardedDataParallel
from torch.distributed.tensor import DTensor

from benchmarks.convergence import (
    ConvergenceSettings,
    MarkovChain,
    SequenceDataset,
    init_seed,
    training_sequences,
)
from benchmarks.scenarios import ClusterShape, StrategySpec, TrainingSetup
from examples.models import ByteCorpusDataModule, GPTConfig, GPTLightningModule
from examples.models.gpt import Block
from lightning_mics import MiCSStrategy, ShardingSpec
from lightning_mics.planner import device_memory_bytes, live
from lightning_mics.accounting import model_state_bytes

UPLINK = "uplink"


def _rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


IMPORT_RSS_BYTES = _rss_bytes()


# ---------------------------------------------------------------------------------- strategies
class CPUFSDPStrategy(FSDPStrategy):
    """Lightning's ``FSDPStrategy`` (FSDP1) made to run on CPU ranks, with nothing else changed.

    Three things stand in the way on CPU, each a device assumption rather than a real limitation
    of FSDP1 (which supports CPU + gloo when told its device):

    * Lightning's trainer refuses ``FSDPStrategy`` with ``accelerator="cpu"`` -- the check looks
      for the exact class, so a subclass passes;
    * Lightning passes ``device_id=root_device.index``, which is ``None`` on CPU, and FSDP1 then
      looks for an accelerator and raises -- :meth:`_setup_model` passes ``torch.device("cpu")``;
    * given ``device_mesh=(replicas, shard)``, Lightning builds the mesh with
      ``init_device_mesh("cuda", ...)``, and a ready mesh cannot be passed in because it needs the
      process group the strategy creates -- so the shape is kept aside and a CPU mesh is built
      right after the process group exists (``HYBRID_SHARD``).
    """

    def __init__(self, mesh_shape: Optional[tuple[int, int]] = None, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._cpu_mesh_shape = mesh_shape

    def setup_environment(self) -> None:
        super().setup_environment()
        if self._cpu_mesh_shape is not None:
            self.kwargs["device_mesh"] = init_device_mesh(
                "cpu", self._cpu_mesh_shape, mesh_dim_names=("replicate", "shard")
            )

    def _setup_model(self, model: nn.Module) -> nn.Module:
        return FullyShardedDataParallel(
            module=model,
            cpu_offload=self.cpu_offload,
            mixed_precision=self.mixed_precision_config,
            sharding_strategy=self.sharding_strategy,
            device_id=torch.device("cpu"),
            **self.kwargs,
        )


def build_strategy(spec: StrategySpec, cluster: ClusterShape) -> Strategy:
    if spec.family == "mics":
        p = spec.partition_size
        layout: dict[str, Any] = dict(partition_size=p, hierarchical=bool(spec.hierarchical))
        if spec.planned:
            layout = dict(sharding="auto", grad_accumulation="auto", planner_cluster="calibrate", hierarchical="auto")
        elif spec.params_degree is not None or spec.optim_degree is not None:
            degrees = ShardingSpec(params=spec.params_degree or p, grads=p, optim=spec.optim_degree or p)
            layout = dict(sharding=degrees, hierarchical=bool(spec.hierarchical))
        semi_sync: dict[str, Any] = {}
        if spec.semi_synchronous:  # DiLoCo: the outer optimizer is the library's default unless outer_lr is given
            semi_sync = {"cross_replica_sync": "diloco", "sync_every": spec.sync_every}
            if spec.outer_lr is not None:
                semi_sync["outer_optimizer"] = functools.partial(
                    torch.optim.SGD, lr=spec.outer_lr, momentum=0.9, nesterov=True
                )
        return MiCSStrategy(
            **{"grad_accumulation": spec.grad_accumulation, **layout},
            ranks_per_node=cluster.ranks_per_node,
            process_group_backend="gloo",
            cross_replica_dtype=spec.cross_replica_dtype,
            cross_replica_overlap=spec.cross_replica_overlap,
            **semi_sync,
        )
    if spec.family == "ddp":
        return DDPStrategy(process_group_backend="gloo")
    common: dict[str, Any] = dict(auto_wrap_policy={Block}, process_group_backend="gloo")
    if spec.sharding_strategy == "HYBRID_SHARD":
        mesh = (spec.replication_degree(cluster), spec.partition_size)
        return CPUFSDPStrategy(mesh, sharding_strategy="HYBRID_SHARD", **common)
    return CPUFSDPStrategy(sharding_strategy=spec.sharding_strategy, **common)


# ---------------------------------------------------------------------------------- measuring
def _counter(ifname: str, direction: str = "tx") -> int:
    return int(Path(f"/sys/class/net/{ifname}/statistics/{direction}_bytes").read_text())


def _counters() -> dict[str, float]:
    """Time and the byte counters at a step boundary: the uplink in both directions (each is its own
    tbf-shaped queue, so the wire floor needs the busier one) and loopback."""
    return {"time": time.perf_counter(), "uplink_tx": _counter(UPLINK), "uplink_rx": _counter(UPLINK, "rx"),
            "lo_tx": _counter("lo")}


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def held_gradient_bytes(module: nn.Module) -> int:
    """Bytes of gradient storage this rank holds right now (see module docstring); views into one
    flat buffer (FSDP1's sharded ``FlatParameter`` gradient) count as that buffer once."""
    storages: dict[int, int] = {}
    for param in module.parameters():
        if param.grad is not None:
            storage = _local(param.grad).untyped_storage()
            storages[storage.data_ptr()] = storage.nbytes()
    for unit in module.modules():
        if isinstance(unit, FSDPModule):
            group = getattr(unit._get_fsdp_state(), "_fsdp_param_group", None)  # FSDP2 internals, best effort
            partial = getattr(group, "_partial_reduce_output", None)
            if isinstance(partial, torch.Tensor):
                storages[partial.untyped_storage().data_ptr()] = partial.untyped_storage().nbytes()
            for fsdp_param in getattr(group, "fsdp_params", ()):  # unsharded accumulation's full gradients
                unsharded = getattr(fsdp_param, "_unsharded_param", None)
                for grad in (getattr(unsharded, "grad", None), getattr(fsdp_param, "unsharded_accumulated_grad", None)):
                    if isinstance(grad, torch.Tensor):
                        storages[grad.untyped_storage().data_ptr()] = grad.untyped_storage().nbytes()
    return sum(storages.values())


class StepProbe(Callback):
    """Records time and interface counters at every optimizer-step boundary (after a barrier), and
    the gradient bytes held after the first backward of each accumulation window."""

    def __init__(self, accumulate: int) -> None:
        self.accumulate = accumulate
        self.boundaries: list[dict[str, float]] = []
        self.held_grad_bytes: list[int] = []
        self._micro_step = 0
        self._last_global_step = 0

    def _mark(self, trainer: pl.Trainer) -> None:
        trainer.strategy.barrier()
        self.boundaries.append(_counters())

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._last_global_step = trainer.global_step

    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        if not self.boundaries:
            self._mark(trainer)

    def on_after_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._micro_step == 0 and self.accumulate > 1:
            self.held_grad_bytes.append(held_gradient_bytes(pl_module))

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        self._micro_step += 1
        if trainer.global_step != self._last_global_step:  # the optimizer stepped: a window closed
            self._last_global_step = trainer.global_step
            self._micro_step = 0
            self._mark(trainer)


def per_node_means(node_leaders: list[dict[str, Any]], counter: str, warmup_steps: int) -> list[float]:
    """Each node's mean growth of ``counter`` per measured step, in node order: the wire floor needs
    the busiest node's uplink, which the sum over nodes hides when traffic is not symmetric."""
    means = []
    for leader in sorted(node_leaders, key=lambda r: r["rank"]):
        values = [b[counter] for b in leader["boundaries"]][warmup_steps:]
        means.append((values[-1] - values[0]) / max(len(values) - 1, 1))
    return means


def summarize(
    per_rank: list[dict[str, Any]], spec: StrategySpec, cluster: ClusterShape, setup: TrainingSetup
) -> dict[str, Any]:
    """Turn every rank's raw records into the strategy's result record (on rank 0)."""
    rank0 = per_rank[0]
    times = [b["time"] for b in rank0["boundaries"]]
    step_times = [t1 - t0 for t0, t1 in zip(times, times[1:])][setup.warmup_steps :]
    node_leaders = [r for r in per_rank if r["local_rank"] == 0]

    def per_step(counter: str) -> list[int]:
        """Sum over nodes of the counter's growth in each measured step."""
        steps = len(rank0["boundaries"]) - 1
        totals = [0] * steps
        for leader in node_leaders:
            values = [b[counter] for b in leader["boundaries"]]
            for i in range(steps):
                totals[i] += values[i + 1] - values[i]
        return totals[setup.warmup_steps :]

    inter, loopback = per_step("uplink_tx"), per_step("lo_tx")
    # A semi-synchronous row's window is whole rounds of sync_every steps (scenarios.measured_steps_for): its
    # step time is the mean over them, the outer synchronisation's step included -- a median would be an inner step.
    step_time = statistics.mean(step_times) if spec.semi_synchronous else statistics.median(step_times)
    tokens_per_step = setup.tokens_per_step(cluster)
    held = [max(r["held_grad_bytes"]) for r in per_rank if r["held_grad_bytes"]]
    return {
        "strategy": spec.name,
        "family": spec.family,
        "partition_size": spec.partition_size,
        "hierarchical": spec.hierarchical,
        "sharding_strategy": spec.sharding_strategy,
        "grad_accumulation": spec.grad_accumulation,
        "params_degree": spec.params_degree,
        "optim_degree": spec.optim_degree,
        "planned": spec.planned,
        "cross_replica_dtype": spec.cross_replica_dtype,
        "cross_replica_overlap": spec.cross_replica_overlap,
        "sync_every": spec.sync_every,
        "outer_lr": spec.outer_lr,
        "status": "ok",
        "step_time_s": step_time,
        "step_time_basis": "mean over whole rounds of sync_every steps (semi-synchronous)" if spec.semi_synchronous
        else "median",
        "inner_step_time_median_s": statistics.median(step_times) if spec.semi_synchronous else None,
        "step_times_s": step_times,
        "tokens_per_step": tokens_per_step,
        "tokens_per_s": tokens_per_step / step_time,
        "inter_node_bytes_per_step": statistics.mean(inter),
        "inter_node_bytes_per_step_each": inter,
        # per node (node order), mean per measured step: what leaves (tx) and enters (rx) each uplink
        "inter_node_tx_bytes_per_step_per_node": per_node_means(node_leaders, "uplink_tx", setup.warmup_steps),
        "inter_node_rx_bytes_per_step_per_node": per_node_means(node_leaders, "uplink_rx", setup.warmup_steps),
        "loopback_bytes_per_step": statistics.mean(loopback),
        "peak_mem_bytes": max(r["peak_rss_bytes"] for r in per_rank),
        "peak_mem_bytes_per_rank": [r["peak_rss_bytes"] for r in per_rank],
        "import_rss_bytes": max(r["import_rss_bytes"] for r in per_rank),
        "model_state_bytes_per_rank": [r["model_state_bytes"] for r in per_rank],
        "grad_bytes_during_accumulation": max(held) if held else None,
    }


# ---------------------------------------------------------------------------------- main
def _mark(boundaries: list[dict[str, float]]) -> None:
    """:meth:`StepProbe._mark` without a Trainer: barrier, then time and counters."""
    dist.barrier()
    boundaries.append(_counters())


def run_deepspeed(spec: StrategySpec, cluster: ClusterShape, setup: TrainingSetup, output: Optional[Path]) -> None:
    """The ``deepspeed-mics`` / ``deepspeed-zero3`` rows: DeepSpeed's own MiCS or ZeRO-3 driven directly (Lightning's
    ``DeepSpeedStrategy`` refuses CPU), measured as :class:`StepProbe` measures the Trainer rows:
    a barrier and the counters before the first micro-batch and after every optimizer step, the
    held gradient bytes after the first backward of each window. The gloo shim and the disabled
    shared-memory op (``benchmarks/deepspeed_peer.py``) exist only in this function's processes."""
    from benchmarks import deepspeed_peer

    reason = deepspeed_peer.unavailable_reason()
    if reason is not None:  # the orchestrator skips the row before launching; a direct call says why
        raise SystemExit(f"{spec.name}: {reason}")
    node, local = int(os.environ["NODE_RANK"]), int(os.environ["LOCAL_RANK"])
    rank = node * cluster.ranks_per_node + local
    # DeepSpeed's CPU accelerator reads the ranks per node from these (MiCS's group arithmetic)
    os.environ["NDEV_PER_NODE"] = os.environ["LOCAL_SIZE"] = str(cluster.ranks_per_node)
    deepspeed_peer.init_distributed(rank, cluster.world_size)
    built = deepspeed_peer.build(setup.model, spec.partition_size, setup.micro_batch, setup.accumulate,
                                 setup.total_steps, setup.corpus_bytes)
    boundaries: list[dict[str, float]] = []
    held: list[int] = []
    with deepspeed_peer.gloo_coalescing_shim():
        batches = iter(built.loader)
        _mark(boundaries)
        for _ in range(setup.total_steps):
            for micro in range(setup.accumulate):
                deepspeed_peer.micro_step(built.engine, next(batches))
                if micro == 0 and setup.accumulate > 1:
                    held.append(deepspeed_peer.held_gradient_bytes(built.engine))
                built.engine.step()  # DeepSpeed steps the optimizer at the window's last micro-step
            _mark(boundaries)
    record = {
        "rank": rank,
        "local_rank": local,
        "boundaries": boundaries,
        "held_grad_bytes": held,
        "peak_rss_bytes": _rss_bytes(),
        "import_rss_bytes": IMPORT_RSS_BYTES,
        "model_state_bytes": deepspeed_peer.model_state_bytes(built.engine),
    }
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, record)
    if rank == 0 and output is not None:
        output.write_text(json.dumps(summarize(gathered, spec, cluster, setup), indent=2))
    dist.barrier()


def measured_trainer(
    spec: StrategySpec, cluster: ClusterShape, setup: TrainingSetup, max_steps: int, callbacks: list[pl.Callback],
    **extra: Any,
) -> pl.Trainer:
    """The Trainer of one measured run: the strategy under test on this cluster, and nothing the measurement does
    not need (no logger, checkpoints, progress bar, summary or sanity validation)."""
    return pl.Trainer(
        accelerator="cpu",
        devices=cluster.ranks_per_node,
        num_nodes=cluster.num_nodes,
        strategy=build_strategy(spec, cluster),
        max_steps=max_steps,
        accumulate_grad_batches=setup.accumulate,
        callbacks=callbacks,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        **extra,
    )


def run(spec: StrategySpec, cluster: ClusterShape, setup: TrainingSetup, output: Optional[Path]) -> None:
    if spec.family == "deepspeed":
        return run_deepspeed(spec, cluster, setup, output)
    pl.seed_everything(1234, workers=True, verbose=False)
    probe = StepProbe(setup.accumulate)
    trainer = measured_trainer(spec, cluster, setup, setup.total_steps, [probe], limit_val_batches=0)
    model = GPTLightningModule(setup.model, warmup_steps=0)
    data = ByteCorpusDataModule(seq_len=setup.model.seq_len, batch_size=setup.micro_batch, max_bytes=setup.corpus_bytes)
    trainer.fit(model, datamodule=data)
    states = model_state_bytes(model, trainer.optimizers)
    record = {
        "rank": trainer.global_rank,
        "local_rank": trainer.local_rank,
        "boundaries": probe.boundaries,
        "held_grad_bytes": probe.held_grad_bytes,
        "peak_rss_bytes": _rss_bytes(),
        "import_rss_bytes": IMPORT_RSS_BYTES,
        "model_state_bytes": states["total"],
    }
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, record)
    # what the planner measured at set-up (this process's cached measurement; asked on every rank, as
    # a measurement would be collective)
    measured = live.planner_cluster_for("calibrate", cluster.world_size, cluster.ranks_per_node, "cpu") \
        if spec.planned else None
    if trainer.global_rank == 0 and output is not None:
        summary = summarize(gathered, planner_choice(spec, trainer.strategy, cluster), cluster, setup)
        if measured is not None:  # what the planner measured and why it chose the layout (the layout log's words)
            summary["planner_cluster"] = live.describe_cluster(measured)
            summary["planner_cluster_spec"] = dataclasses.asdict(measured)
            summary["planner_reason"] = trainer.strategy.layout.settings.planner_reason
        output.write_text(json.dumps(summary, indent=2))
    dist.barrier()


# ---------------------------------------------------------------------------------- --convergence
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
                local = _local(param)
                saved.append((local, local.clone()))
                local.copy_(_local(anchor))
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
        self.start_counters = _counters()
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
        self.steps.append({**_counters(), "step": step, "time": time.monotonic() - self.excluded,
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
            self.end_counters = _counters()


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
    }


def planner_choice(spec: StrategySpec, strategy: Strategy, cluster: ClusterShape) -> StrategySpec:
    """A planned row's spec with the layout the strategy resolved at set-up (others: unchanged)."""
    if not spec.planned:
        return spec
    degrees = strategy.sharding.resolve(cluster.world_size, cluster.ranks_per_node)
    return spec.with_choice(
        {
            "partition_size": degrees.grads,
            "params_degree": degrees.params,
            "optim_degree": degrees.optim,
            "grad_accumulation": strategy.grad_accumulation,
            "hierarchical": strategy.layout.settings.hierarchical,
        }
    )


def main() -> None:
    # One intra-op thread per rank: 8 ranks share 2 cores, oversubscription would only add noise. Set here, before
    # any torch work, not at import: importing this module (the tests do) must not change the importer's threads.
    torch.set_num_threads(1)
    torch.set_num_interop_threads(1)
    parser = argparse.ArgumentParser(description="One rank of benchmarks/emulated_cluster.py (not run by hand).")
    parser.add_argument("--job", type=Path, required=True, help="JSON: strategy, cluster and training setup")
    parser.add_argument("--output", type=Path, help="where rank 0 writes the result record")
    args = parser.parse_args()
    job = json.loads(args.job.read_text())
    setup_fields = dict(job["setup"])
    setup_fields["model"] = GPTConfig(**setup_fields["model"])
    spec, cluster, setup = StrategySpec.from_dict(job["strategy"]), ClusterShape(**job["cluster"]), \
        TrainingSetup(**setup_fields)
    if job.get("convergence") is not None:
        row = job["convergence_run"]
        run_convergence(spec, cluster, setup, ConvergenceSettings(**job["convergence"]), int(row["seed"]),
                        int(row["steps"]), args.output)
    else:
        run(spec, cluster, setup, args.output)
    os._exit(0)  # skip interpreter teardown of gloo threads: the result is written, peers are done


if __name__ == "__main__":
    main()
