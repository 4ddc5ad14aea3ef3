"""Training telemetry: throughput, step time, MFU and communication volume per optimizer step.

:class:`TrainingTelemetry` is a Lightning callback. It measures each *optimizer step* (all
micro-steps of one accumulation window) rather than each batch, because that is the unit MiCS's
schedule repeats: ``accumulate_grad_batches`` rounds of all-gather + reduce-scatter inside the
partition group, then one all-reduce across the replication group.

Communication is counted from the collectives this rank actually issues (through
:class:`~lightning_mics.collective_recorder.CollectiveRecorder`), and split by the group each ran on:

* **intra-partition** -- the rank's partition group (all-gathers of parameters, reduce-scatters of
  gradients; also the scalar all-reduce of sharded gradient clipping),
* **cross-replica** -- the rank's replication group (the boundary gradient all-reduce),
* **other** -- anything else (e.g. world-wide metric syncs).

:func:`lightning_mics.accounting.analytic_comm_bytes` gives the same numbers from parameter shapes alone, which
is how the tests check the accounting and how one predicts the traffic of a layout before running it.

The recorder is on only for sampled steps (:class:`~lightning_mics.comm_sampling.CommSampler`: the first two,
every ``sample_every``-th, and the ones that differ from the pattern); the others report the bytes of the
last recorded step, flagged ``comm_measured=False``. Always on, its Python call per aten op would cost
more than the 1 % of step time telemetry may cost (docs/benchmarks.md, "Telemetry cost").
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Optional, Union

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.fabric.utilities.throughput import get_available_flops
from lightning.pytorch.callbacks import Callback
from torch import Tensor

from lightning_mics import _compat as compat
from lightning_mics.accounting import (
    CROSS_REPLICA,
    INTRA_PARTITION,
    OTHER,
    CommBytes,
    classify_calls,
    model_state_bytes,
    unique_parameters,
)
from lightning_mics.collective_recorder import CollectiveRecorder
from lightning_mics.comm_sampling import DEFAULT_SAMPLE_EVERY, CommSampler
from lightning_mics.engine import MiCSEngine
from lightning_mics.shards import local_shard
from lightning_mics.topology import MiCSTopology

log = logging.getLogger(__name__)

#: Lightning's table lists the H200 at its 2:4-sparse peak (2 PFLOP/s); MFU is relative to the dense one.
_DENSE_H200_16BIT = 989e12


def dense_peak_flops(device: torch.device, dtype: torch.dtype) -> Optional[float]:
    """Peak dense FLOP/s of one ``device`` computing in ``dtype``, for MFU; ``None`` where unknown
    (and on CPU, whose peak is no meaningful reference).

    Lightning's :func:`~lightning.fabric.utilities.throughput.get_available_flops` is the source: it
    tells H100 SXM from PCIe and NVL, and uses TF32 for fp32 when ``torch.set_float32_matmul_precision``
    allows it. Its H200 entries are sparse peaks, so the dense figure replaces them for 16-bit compute.
    """
    if device.type != "cuda":
        return None
    if dtype in (torch.bfloat16, torch.float16) and "h200" in torch.cuda.get_device_name(device).lower():
        return _DENSE_H200_16BIT
    flops = get_available_flops(device, dtype)
    return float(flops) if flops is not None else None


def compute_dtype(precision: str) -> Optional[torch.dtype]:
    """The matmul dtype of a Lightning precision setting (``"bf16-mixed"`` -> bf16, ...)."""
    prefixes = (("bf16", torch.bfloat16), ("16", torch.float16), ("32", torch.float32), ("64", torch.float64))
    for prefix, dtype in prefixes:
        if precision.startswith(prefix):
            return dtype
    return None


# ---------------------------------------------------------------------------------- the callback
def _held_bytes(t: Tensor) -> int:
    """Bytes of this rank's shard of ``t`` (every optimizer step, so through the shard itself, not ``to_local()``)."""
    local = local_shard(t)
    return local.numel() * local.element_size()


@dataclass(frozen=True)
class StepTelemetry:
    """Measurements of one optimizer step on this rank."""

    step: int  #: ``trainer.global_step`` after the step
    micro_steps: int
    step_time_s: float
    tokens: int  #: tokens of the whole step over all ranks (local tokens x world size)
    tokens_per_s: float
    mfu: Optional[float]
    comm: CommBytes
    #: This rank's training loss over the window (sum of Lightning's accumulation-normalised
    #: micro-batch losses = their mean); ``None`` when ``training_step`` returns no loss.
    loss: Optional[float] = None
    #: Whether ``comm`` was recorded in this step; ``False``: the bytes of the last recorded step with the
    #: same layout and accumulation, which every full step repeats (see ``TrainingTelemetry(sample_every=...)``).
    comm_measured: bool = True
    #: ``time.perf_counter()`` at the window's first micro-batch and after its optimizer step: the summary's
    #: throughput divides the tokens by the wall-clock these span, not a mean of per-step rates.
    started_at: float = 0.0
    ended_at: float = 0.0
    #: DiLoCo: the step started an outer average (its collectives cross replicas; the round's other steps' do not)
    outer_round: bool = False


def default_tokens_in_batch(batch: Any) -> int:
    """Tokens in one micro-batch: the element count of its first tensor (the input ids)."""
    if isinstance(batch, Tensor):
        return batch.numel()
    if isinstance(batch, Mapping):
        value = batch.get("input_ids", next(iter(batch.values()), None))
        return default_tokens_in_batch(value)
    if isinstance(batch, (list, tuple)) and batch:
        return default_tokens_in_batch(batch[0])
    raise TypeError(
        f"Cannot count tokens in a batch of type {type(batch).__name__}; pass "
        "TrainingTelemetry(tokens_in_batch=...) a function returning the number of tokens."
    )


def _metrics(record: StepTelemetry) -> dict[str, float]:
    """What one step logs: ``perf/*`` and ``comm/*`` (bytes by kind and group, and whether recorded)."""
    metrics = {"perf/tokens_per_s": record.tokens_per_s, "perf/step_time_s": record.step_time_s}
    if record.mfu is not None:
        metrics["perf/mfu"] = record.mfu
    metrics["comm/measured"] = float(record.comm_measured)
    metrics.update({f"comm/{kind}_bytes": float(n) for kind, n in record.comm.by_kind.items()})
    metrics.update({f"comm/{group}_bytes": float(n) for group, n in record.comm.by_group.items()})
    return metrics


def _hashable(topology: Optional[MiCSTopology]) -> Any:
    """The topology as part of a dictionary key: itself where it hashes, else its identity."""
    try:
        hash(topology)
        return topology
    except TypeError:
        return id(topology)


def _window_may_be_short(trainer: pl.Trainer, batch_idx: int) -> bool:
    """Whether the accumulation window starting at ``batch_idx`` may end early: fewer batches are left in
    the epoch than it accumulates, and Lightning steps at the epoch's end. Unknown epoch length: no."""
    batches = trainer.num_training_batches
    if not isinstance(batches, int):  # an iterable dataset without a length: inf
        return False
    return batches - batch_idx < trainer.accumulate_grad_batches


def _engine_of(strategy: Any) -> Optional[MiCSEngine]:
    """The engine of a MiCS strategy (the Trainer's or Fabric's); ``None`` for any other strategy."""
    engine = getattr(strategy, "engine", None)
    return engine if isinstance(engine, MiCSEngine) else None


def _outer_round_of(strategy: Any) -> Optional[tuple[int, bool]]:
    """DiLoCo on a MiCS strategy: (steps between two outer averages, whether the next step starts one)."""
    engine = _engine_of(strategy)
    return None if engine is None else engine.outer_round()


def _topology_of(strategy: Any) -> Optional[MiCSTopology]:
    """The MiCS layout to classify traffic against: a set-up MiCS strategy's (Trainer or Fabric); ``None`` for
    any other strategy, or before its processes are set up (traffic is then reported by kind only)."""
    engine = _engine_of(strategy)
    layout = None if engine is None else engine.layout_or_none
    return None if layout is None else layout.settings.topology


class TrainingTelemetry(Callback):
    """Log tokens/s, step time, MFU and communication bytes per optimizer step.

    Args:
        peak_flops: peak FLOP/s of *one* device, for MFU. ``"auto"``: looked up for known GPUs when
            GPUs, for the trainer's precision (:func:`dense_peak_flops`, from Lightning's
            ``get_available_flops``); ``None``: no MFU.
        flops_per_token: training FLOPs per token; default: the LightningModule's
            ``flops_per_token`` attribute (e.g. :class:`~examples.models.GPTLightningModule`).
        tokens_in_batch: counts a micro-batch's tokens on this rank (default: first tensor's numel).
            Ranks are assumed to see equally many tokens (true with Lightning's distributed sampler).
        prog_bar: show the headline numbers in the progress bar.
        sample_every: record the collectives of every ``sample_every``-th optimizer step (besides the first
            two, those after a change of layout or accumulation, after validation and at an epoch's end);
            the others report the last recorded step's bytes with ``comm_measured=False``. ``1``: record
            every step, at the cost of a Python call per aten op (several % of a GPU step).

    Everything is logged under ``perf/*`` and ``comm/*`` (bytes; ``comm/measured``: 1 where recorded)
    straight to the trainer's loggers, every ``log_every_n_steps`` optimizer steps, with the step Lightning
    stamps on ``self.log``'s metrics; with a progress bar the headline numbers also go through ``self.log``.
    :attr:`steps` keeps the per-step records; :meth:`summary` gives total tokens over total time and the
    per-step rates' spread.
    A step's time runs from the first micro-batch's ``on_train_batch_start`` to the optimizer step's
    ``on_train_batch_end`` (what runs between steps is not in it); the summary's throughput counts the
    wall-clock from the first step to the last, validation passes excluded.
    """

    def __init__(
        self,
        peak_flops: Union[float, str, None] = "auto",
        flops_per_token: Optional[float] = None,
        tokens_in_batch: Optional[Callable[[Any], int]] = None,
        prog_bar: bool = True,
        sample_every: int = DEFAULT_SAMPLE_EVERY,
    ) -> None:
        if isinstance(peak_flops, str) and peak_flops != "auto":
            raise ValueError(f"peak_flops must be a number of FLOP/s, 'auto' or None, got {peak_flops!r}.")
        if isinstance(peak_flops, (int, float)) and peak_flops <= 0:
            raise ValueError(f"peak_flops must be positive, got {peak_flops}.")
        self.peak_flops_setting = peak_flops
        self.flops_per_token_setting = flops_per_token
        self.tokens_in_batch = tokens_in_batch or default_tokens_in_batch
        self.prog_bar = prog_bar
        self.steps: list[StepTelemetry] = []
        self.memory_per_rank: list[dict[str, int]] = []
        self.topology: Optional[MiCSTopology] = None
        self.peak_flops: Optional[float] = None
        self.flops_per_token: Optional[float] = None
        self._recorder: Optional[CollectiveRecorder] = None
        #: one sampler per kind of step: DiLoCo's outer-average steps repeat their own pattern, the inner steps theirs
        self._samplers: dict[bool, CommSampler[CommBytes]] = {
            False: CommSampler(sample_every),
            True: CommSampler(sample_every),
        }
        #: DiLoCo: optimizer steps between two outer averages (``None``: hop 2, if any, every step)
        self._outer_every: Optional[int] = None
        self._window_outer = False
        self._window_start: Optional[float] = None
        #: (start, end) of each validation pass during training: not training time
        self._validation_spans: list[tuple[float, float]] = []
        self._validation_started: Optional[float] = None
        self._window_tokens = 0
        self._window_micro_steps = 0
        self._window_loss: Optional[Tensor] = None
        self._last_global_step = 0
        #: the most gradient bytes this rank held at an optimizer step
        self._grad_bytes = 0
        self._world_size = 1
        self._rank = 0
        self._device = torch.device("cpu")

    # ------------------------------------------------------------------ lifecycle
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.steps.clear()
        self._validation_spans.clear()
        self._grad_bytes = 0
        self._world_size, self._rank = trainer.world_size, trainer.global_rank
        self._device = pl_module.device
        self.topology = _topology_of(trainer.strategy)
        self.peak_flops = self._resolve_peak_flops(trainer)
        self.flops_per_token = self.flops_per_token_setting or getattr(pl_module, "flops_per_token", None)
        self._last_global_step = trainer.global_step
        self._window_start = None
        for sampler in self._samplers.values():
            sampler.restart()

    def on_before_optimizer_step(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: torch.optim.Optimizer
    ) -> None:
        # Gradients exist from the backward to the optimizer step only (MiCSStrategy frees them right
        # after it): this is where they are counted.
        grads = sum(_held_bytes(p.grad) for p in unique_parameters(pl_module) if p.grad is not None)
        self._grad_bytes = max(self._grad_bytes, grads)

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._stop_recording()
        local = model_state_bytes(pl_module, [compat.unwrap_optimizer(o) for o in trainer.optimizers])
        if self._grad_bytes > local["grads"]:
            local["total"] += self._grad_bytes - local["grads"]
            local["grads"] = self._grad_bytes
        if dist.is_available() and dist.is_initialized():
            gathered: list[Any] = [None] * dist.get_world_size()
            dist.all_gather_object(gathered, local)
            self.memory_per_rank = gathered
        else:
            self.memory_per_rank = [local]

    def on_validation_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._validation_started = time.perf_counter()

    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._validation_started is not None:
            self._validation_spans.append((self._validation_started, time.perf_counter()))
            self._validation_started = None
        # FSDP2 leaves the root unit gathered after an evaluation pass: the next step skips its first
        # all-gather, so it is recorded (and not taken as the pattern).
        for sampler in self._samplers.values():
            sampler.interrupt()

    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        self._stop_recording()

    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self._stop_recording()

    def _stop_recording(self) -> None:
        if self._recorder is not None:
            self._recorder.__exit__(None, None, None)
            self._recorder = None

    # ------------------------------------------------------------------ per step
    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        if self._window_start is None:
            self._synchronize()
            self.topology = _topology_of(trainer.strategy)
            outer = _outer_round_of(trainer.strategy)
            self._outer_every, self._window_outer = outer if outer is not None else (None, False)
            layout_key = (trainer.accumulate_grad_batches, _hashable(self.topology), self._world_size)
            if self._sampler.should_record(layout_key, _window_may_be_short(trainer, batch_idx)):
                self._start_recording()  # entered here: what ran between steps (validation, saves) is not seen
            self._window_start = time.perf_counter()
            self._window_tokens = self._window_micro_steps = 0
            self._window_loss = None

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if self._window_start is None:
            return
        self._window_tokens += self.tokens_in_batch(batch)
        self._window_micro_steps += 1
        loss = outputs.get("loss") if isinstance(outputs, Mapping) else outputs
        if isinstance(loss, Tensor):
            # Kept as a tensor until the boundary: no device sync per micro-step.
            self._window_loss = loss.detach() if self._window_loss is None else self._window_loss + loss.detach()
        if trainer.global_step == self._last_global_step:
            return  # inside an accumulation window: the optimizer has not stepped yet
        self._last_global_step = trainer.global_step
        self._synchronize()
        ended_at = time.perf_counter()
        elapsed = max(ended_at - self._window_start, 1e-9)
        comm, measured = self._window_comm()
        tokens = self._window_tokens * self._world_size
        tokens_per_s = tokens / elapsed
        mfu = None
        if self.peak_flops and self.flops_per_token:
            mfu = self.flops_per_token * tokens_per_s / (self.peak_flops * self._world_size)
        record = StepTelemetry(
            step=trainer.global_step,
            micro_steps=self._window_micro_steps,
            step_time_s=elapsed,
            tokens=tokens,
            tokens_per_s=tokens_per_s,
            mfu=mfu,
            comm=comm,
            loss=float(self._window_loss) if self._window_loss is not None else None,
            comm_measured=measured,
            started_at=self._window_start,
            ended_at=ended_at,
            outer_round=self._window_outer,
        )
        self.steps.append(record)
        self._log(trainer, pl_module, record)
        self._window_start = None

    def _start_recording(self) -> None:
        if self._recorder is None:
            self._recorder = CollectiveRecorder().__enter__()
        self._recorder.reset()

    @property
    def _sampler(self) -> CommSampler[CommBytes]:
        """The sampler of the step in progress: DiLoCo's outer-average steps apart from the others."""
        return self._samplers[self._window_outer]

    def _window_comm(self) -> tuple[CommBytes, bool]:
        """This step's bytes and whether they were recorded; unrecorded: the sampler's reference."""
        if self._recorder is None:
            reference = self._sampler.reference
            assert reference is not None, "CommSampler records every step until it has a reference"
            return reference, False
        comm = classify_calls(self._recorder.calls, self.topology, self._rank)
        self._stop_recording()
        self._sampler.recorded(comm)
        return comm, True

    def _log(self, trainer: pl.Trainer, pl_module: pl.LightningModule, record: StepTelemetry) -> None:
        """One ``log_metrics`` call per logger, every ``log_every_n_steps`` steps, as Lightning's own
        throttle; the headline numbers also through ``self.log`` when a progress bar shows them.
        Why not ``self.log`` for everything: at ~0.6 ms a call, 14 calls a step cost 4 % of a 240 ms step."""
        every: int = getattr(trainer, "log_every_n_steps", 50)  # set by the Trainer at run time, not declared
        if trainer.loggers and every > 0 and (record.step % every == 0 or trainer.should_stop):
            step = compat.logging_step(trainer)
            metrics = _metrics(record)
            for logger in trainer.loggers:
                logger.log_metrics(metrics, step=step)
        if not (self.prog_bar and trainer.progress_bar_callback is not None):
            return
        headline = {"perf/tokens_per_s": record.tokens_per_s, "perf/mfu": record.mfu}
        if record.comm.by_group:
            headline["intra_MB"] = record.comm.by_group[INTRA_PARTITION] / 1e6
            headline["cross_MB"] = record.comm.by_group[CROSS_REPLICA] / 1e6
        else:
            headline["comm_MB"] = record.comm.total / 1e6
        for name, value in headline.items():
            if value is not None:
                pl_module.log(
                    name, float(value), on_step=True, on_epoch=False, prog_bar=True, logger=False, batch_size=1
                )

    def _synchronize(self) -> None:
        if self._device.type == "cuda":
            torch.cuda.synchronize(self._device)

    def _resolve_peak_flops(self, trainer: pl.Trainer) -> Optional[float]:
        if self.peak_flops_setting != "auto":
            return float(self.peak_flops_setting) if self.peak_flops_setting is not None else None
        dtype = compute_dtype(str(getattr(trainer, "precision", "")))
        if self._device.type != "cuda" or dtype is None:
            return None
        flops = dense_peak_flops(self._device, dtype)
        if flops is None:
            log.info("No known peak FLOP/s for this device; pass TrainingTelemetry(peak_flops=...) to get MFU.")
        return flops

    # ------------------------------------------------------------------ reporting
    def summary(self, skip_first: int = 1) -> dict[str, Any]:
        """Throughput and step times over the recorded steps, leaving out the first ``skip_first``
        (warm-up) when there are more.

        ``tokens_per_s`` is total work over total time: the tokens of those steps over the wall-clock from
        the first one's start to the last one's end, less the validation passes in between (time between
        steps -- data loading, checkpoint saves -- is training time and counts). A mean of per-step rates
        would weigh a fast step as much as a slow one and read high on a noisy host; the per-step rates are
        given only as a distribution (``tokens_per_s_per_step``: p10, median, p90).
        """
        steps = self.steps[skip_first:] if len(self.steps) > skip_first else self.steps
        if not steps:
            return {"steps": 0}

        def mean(values: Iterable[float]) -> float:
            values = list(values)
            return sum(values) / len(values)

        start, end = steps[0].started_at, steps[-1].ended_at
        validation = sum(max(0.0, min(b, end) - max(a, start)) for a, b in self._validation_spans)
        seconds = max(end - start - validation, 1e-9)
        tokens = sum(s.tokens for s in steps)
        tokens_per_s = tokens / seconds
        mfu = None
        if self.peak_flops and self.flops_per_token:
            mfu = self.flops_per_token * tokens_per_s / (self.peak_flops * self._world_size)
        by_kind, by_group, outer_step = self._bytes_per_step(steps)
        return {
            "steps": len(steps),
            "tokens": tokens,
            "seconds": seconds,
            "validation_seconds": validation,
            "tokens_per_s": tokens_per_s,
            "tokens_per_s_per_step": _quantiles([s.tokens_per_s for s in steps]),
            "step_time_s": mean(s.step_time_s for s in steps),
            "mfu": mfu,
            "bytes_by_kind": by_kind,
            "bytes_by_group": by_group,
            "outer_every": self._outer_every,
            "outer_round_step_bytes": outer_step,
            "memory_per_rank": self.memory_per_rank,
        }

    def _bytes_per_step(
        self, steps: Sequence[StepTelemetry]
    ) -> tuple[dict[str, float], dict[str, float], Optional[dict[str, float]]]:
        """Bytes per optimizer step by kind and by group, and (DiLoCo) a step that starts an outer average by
        group. With DiLoCo the per-step figure is the schedule's average -- ``(H - 1)`` inner steps and one
        outer-average step per ``H`` -- not the mean of whichever steps a run happened to end on."""
        kinds, groups = steps[0].comm.by_kind.keys(), steps[0].comm.by_group.keys()

        def means(chosen: Sequence[StepTelemetry]) -> tuple[dict[str, float], dict[str, float]]:
            n = len(chosen)
            return (
                {k: sum(s.comm.by_kind.get(k, 0) for s in chosen) / n for k in kinds},
                {g: sum(s.comm.by_group.get(g, 0) for s in chosen) / n for g in groups},
            )

        every = self._outer_every
        inner = [s for s in steps if not s.outer_round]
        outer = [s for s in steps if s.outer_round]
        if every is None or not outer or not inner:
            by_kind, by_group = means(steps)
            return by_kind, by_group, (means(outer)[1] if outer else None)
        (inner_kind, inner_group), (outer_kind, outer_group) = means(inner), means(outer)
        return (
            {k: ((every - 1) * inner_kind[k] + outer_kind[k]) / every for k in kinds},
            {g: ((every - 1) * inner_group[g] + outer_group[g]) / every for g in groups},
            outer_group,
        )

    def format_summary(self, skip_first: int = 1) -> str:
        """A few human-readable lines for the end of a run."""
        s = self.summary(skip_first)
        if not s["steps"]:
            return "telemetry: no optimizer step recorded"
        p10, median, p90 = s["tokens_per_s_per_step"]
        counted = "validation not counted" if s["validation_seconds"] else "wall-clock"
        lines = [
            f"throughput: {s['tokens_per_s']:,.0f} tokens/s over all ranks ({s['tokens']:,} tokens in "
            f"{s['seconds']:,.2f} s, {s['steps']} optimizer steps after warm-up, {counted})"
            + (f", MFU {s['mfu'] * 100:.1f}%" if s["mfu"] is not None else ", MFU n/a (peak_flops unknown)"),
            f"  step time {s['step_time_s'] * 1e3:,.1f} ms mean; per-step rate p10 / median / p90: "
            f"{p10:,.0f} / {median:,.0f} / {p90:,.0f} tokens/s",
        ]
        comm = ", ".join(f"{k} {_fmt_bytes(v)}" for k, v in s["bytes_by_kind"].items() if v)
        every = s["outer_every"]
        averaged = f" (DiLoCo: averaged over its round, one outer average every {every} steps)" if every else ""
        lines.append(f"bytes moved per optimizer step, per rank{averaged}: {comm or 'none'}")
        if s["bytes_by_group"]:
            g = s["bytes_by_group"]
            lines.append(
                f"  intra-partition {_fmt_bytes(g[INTRA_PARTITION])}, cross-replica {_fmt_bytes(g[CROSS_REPLICA])}, "
                f"other {_fmt_bytes(g[OTHER])}"
            )
        if every:
            outer = s["outer_round_step_bytes"]
            lines.append(
                f"  a step that starts the outer average: cross-replica {_fmt_bytes(outer[CROSS_REPLICA])}"
                if outer and CROSS_REPLICA in outer
                else "  no outer average started in the recorded steps"
            )
        if s["memory_per_rank"]:
            per_rank = " ".join(_fmt_bytes(m["total"]) for m in s["memory_per_rank"])
            m0 = s["memory_per_rank"][0]
            lines.append(
                f"model states per rank (params + grads + optimizer): {per_rank}  "
                f"[rank 0: {_fmt_bytes(m0['params'])} + {_fmt_bytes(m0['grads'])} + {_fmt_bytes(m0['optimizer'])}]"
            )
        return "\n".join(lines)


def _quantiles(values: Sequence[float]) -> tuple[float, float, float]:
    """p10, median and p90 (nearest rank) of per-step values: their spread, never their mean."""
    ordered = sorted(values)

    def at(q: float) -> float:
        return ordered[min(len(ordered) - 1, max(0, math.ceil(q * len(ordered)) - 1))]

    return at(0.1), at(0.5), at(0.9)


def _fmt_bytes(n: float) -> str:
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if abs(n) >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n:.0f} B"
