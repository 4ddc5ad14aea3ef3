"""Telemetry records collectives on sampled optimizer steps only: the recorder's dispatch mode (a Python
call per aten op) is off the stack in the other steps, which report the last clean recorded step's bytes.

Unit level: the callback's hooks are driven by a stand-in trainer (no processes); the multi-rank runs
in tests/test_telemetry.py check the sampled bytes against the analytic formula."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
import torch

from lightning_mics._compat import dispatch_mode_stack
from lightning_mics.collective_recorder import CollectiveCall, _RecordingMode
from lightning_mics.comm_sampling import CommSampler
from lightning_mics.telemetry import TrainingTelemetry, _window_may_be_short


def _recording() -> bool:
    return any(isinstance(mode, _RecordingMode) for mode in dispatch_mode_stack())


def test_sampler_records_the_warm_up_every_nth_and_the_steps_that_differ() -> None:
    sampler: CommSampler[int] = CommSampler(every=4, warmup=2)
    decisions = []
    for window in range(10):
        record = sampler.should_record("layout", may_be_short=window == 9)
        if record:
            sampler.recorded(window)
        decisions.append(record)
    # warm-up 0, 1; every 4th: 4, 8; the window that may be cut short at the epoch's end: 9
    assert [w for w, d in enumerate(decisions) if d] == [0, 1, 4, 8, 9]
    assert sampler.reference == 8  # the short window is reported as measured but is not the pattern
    sampler.interrupt()  # a validation pass: the next step is recorded and is not the pattern either
    assert sampler.should_record("layout") and (sampler.recorded(10), sampler.reference) == (None, 8)
    assert not sampler.should_record("layout")
    # a new layout (or accumulation) drops the reference and warms up again
    assert sampler.should_record("other") and sampler.reference is None
    with pytest.raises(ValueError, match="sample_every must be >= 1"):
        CommSampler(every=0)


class _Logger:
    def __init__(self) -> None:
        self.rows: list[tuple[int, dict[str, float]]] = []

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        self.rows.append((step, metrics))


class _Trainer(SimpleNamespace):
    """What the callback reads of a Lightning trainer."""

    def __init__(self, batches: int, accumulate: int = 1) -> None:
        super().__init__(
            world_size=1, global_rank=0, global_step=0, precision="32-true", strategy=None,
            num_training_batches=batches, accumulate_grad_batches=accumulate, optimizers=[],
            loggers=[_Logger()], log_every_n_steps=1, should_stop=False, progress_bar_callback=None,
            fit_loop=SimpleNamespace(epoch_loop=SimpleNamespace(_batches_that_stepped=0)),
        )


class _Module(SimpleNamespace):
    def __init__(self) -> None:
        super().__init__(device=torch.device("cpu"), flops_per_token=None)

    def log(self, *args: Any, **kwargs: Any) -> None:
        raise AssertionError("without a progress bar, telemetry logs straight to the loggers")


def _run(telemetry: TrainingTelemetry, steps: int) -> tuple[list[bool], _Logger]:
    """Drive ``steps`` optimizer steps of one micro-batch; a recorded step sees one 8-byte all-reduce."""
    trainer, module = _Trainer(batches=steps), _Module()
    telemetry.on_train_start(trainer, module)  # type: ignore[arg-type]
    active = []
    for index in range(steps):
        telemetry.on_train_batch_start(trainer, module, torch.zeros(2, 3), index)  # type: ignore[arg-type]
        active.append(_recording())
        if telemetry._recorder is not None:
            telemetry._recorder.calls.append(CollectiveCall("all_reduce", (0,), 8, 0))
        trainer.global_step += 1
        telemetry.on_train_batch_end(trainer, module, torch.tensor(1.0), torch.zeros(2, 3), index)  # type: ignore
        trainer.fit_loop.epoch_loop._batches_that_stepped += 1
    telemetry.teardown(trainer, module, "fit")  # type: ignore[arg-type]
    return active, trainer.loggers[0]


def test_the_recorder_is_off_the_dispatch_stack_in_unsampled_steps() -> None:
    telemetry = TrainingTelemetry(peak_flops=None, prog_bar=False, sample_every=3)
    active, logger = _run(telemetry, steps=8)
    # steps 1, 2 (warm-up), 4 and 7 (every 3rd window); with one micro-batch a step is never cut short
    assert active == [True, True, False, True, False, False, True, False]
    assert [s.comm_measured for s in telemetry.steps] == active
    assert {s.comm.by_kind["all_reduce"] for s in telemetry.steps} == {8}  # unrecorded: the pattern's bytes
    assert [metrics["comm/measured"] for _, metrics in logger.rows] == [float(a) for a in active]
    assert [step for step, _ in logger.rows] == list(range(8))  # Lightning's step for self.log's rows
    assert not _recording()


def test_a_window_that_the_epochs_end_may_cut_short_is_recognised() -> None:
    trainer = _Trainer(batches=5, accumulate=2)  # windows: batches 0-1, 2-3, and 4 alone
    assert [_window_may_be_short(trainer, start) for start in (0, 2, 4)] == [False, False, True]  # type: ignore
    trainer.num_training_batches = float("inf")  # an iterable dataset: its end is not known in advance
    assert not _window_may_be_short(trainer, 4)  # type: ignore[arg-type]


def test_sample_every_1_records_every_step() -> None:
    telemetry = TrainingTelemetry(peak_flops=None, prog_bar=False, sample_every=1)
    active, _ = _run(telemetry, steps=5)
    assert active == [True] * 5 and all(s.comm_measured for s in telemetry.steps)
