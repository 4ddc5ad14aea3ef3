"""What a rank of the emulated cluster measures in a throughput run, and how rank 0 turns every rank's raw records
into the row's result record (:func:`summarize`).

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

import os
import statistics
import time
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

from benchmarks.netns_regions import REGION_COUNTERS_ENV, region_counters, region_deltas
from benchmarks.scenarios import ClusterShape, StrategySpec, TrainingSetup

UPLINK = "uplink"


def _counter(ifname: str, direction: str = "tx") -> int:
    return int(Path(f"/sys/class/net/{ifname}/statistics/{direction}_bytes").read_text())


def counters() -> dict[str, float]:
    """Time and the byte counters at a step boundary: the uplink in both directions (each is its own
    tbf-shaped queue, so the wire floor needs the busier one) and loopback; on a cluster with regions also every
    region link's (``region<r>_tx`` / ``_rx``, read from the switch namespace: :mod:`benchmarks.netns_regions`)."""
    return {"time": time.perf_counter(), "uplink_tx": _counter(UPLINK), "uplink_rx": _counter(UPLINK, "rx"),
            "lo_tx": _counter("lo"), **region_counters(os.environ.get(REGION_COUNTERS_ENV))}


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """This rank's part of ``t``: a DTensor's local shard, a plain tensor itself."""
    return t.to_local() if isinstance(t, DTensor) else t


def held_gradient_bytes(module: nn.Module) -> int:
    """Bytes of gradient storage this rank holds right now (see module docstring); views into one
    flat buffer (FSDP1's sharded ``FlatParameter`` gradient) count as that buffer once."""
    storages: dict[int, int] = {}
    for param in module.parameters():
        if param.grad is not None:
            storage = local_tensor(param.grad).untyped_storage()
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
        self.boundaries.append(counters())

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
    boundaries = rank0["boundaries"][setup.warmup_steps:]
    across = region_deltas(boundaries[0], boundaries[-1])  # the region links' counters are global: rank 0's
    measured = max(len(boundaries) - 1, 1)
    regions = {} if across is None else {
        "across_region_rx_bytes_per_step": sum(across["rx"]) / measured,
        "across_region_tx_bytes_per_step_per_region": [b / measured for b in across["tx"]],
        "across_region_rx_bytes_per_step_per_region": [b / measured for b in across["rx"]],
    }
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
        **regions,
    }
