"""Saving: sharded (DCP, deduplicated, atomic, with an integrity record) or one full file; in the
foreground or in the background.

Sharded saves write every shard once: DCP keys each shard by (name, offset), the replicas of a
shard in other partition groups have the same key, and DCP's planner keeps one writer per key,
choosing the least-loaded rank -- so a checkpoint is one copy of the states and replicas share the
writing. After the shards, every rank digests what it wrote; rank 0 gathers the digests and
commits (see :mod:`~lightning_mics.checkpoint.atomic`) only if every rank succeeded.

Background saves (:class:`AsyncCheckpointSaver`) copy the states to CPU memory in the foreground --
that copy is the whole training stall -- and write, digest and commit on a worker thread whose
collectives run in a process group of their own, so they never interleave with training's.
"""

from __future__ import annotations

import dataclasses
import os
import warnings
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from datetime import timedelta
from pathlib import Path
from typing import Any, Optional

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemWriter

from lightning_mics import _compat as compat
from lightning_mics.checkpoint import atomic, coordination, gloo_reach, integrity, rng
from lightning_mics.checkpoint.coordination import Group
from lightning_mics.checkpoint.format import (
    FORMAT_VERSION,
    FULL_FORMAT,
    FULL_META_KEY,
    MODEL_KEY,
    OPTIMIZERS_KEY,
    RNG_DIR,
    SHARDED_EXTRAS_KEY,
    TRAINER_STATE_FILE,
    CheckpointError,
    CheckpointLayout,
    CommitRecord,
    PathLike,
)
from lightning_mics.checkpoint.safe_load import safe_trainer_state, torch_bytes


class AsyncCheckpointSaver:
    """Runs sharded saves in the background, at most one at a time.

    A new save, a load, and the removal of the checkpoint being written first wait for the save in
    flight; :meth:`wait` raises its failure (on every rank: all ranks' workers agree on the
    outcome). Call :meth:`close` at teardown so no save is left unfinished."""

    def __init__(self, timeout: Optional[timedelta] = None) -> None:
        #: collective timeout of the workers' group: a dead rank must fail a background save, not hang it
        self.timeout = timeout
        self._executor: Optional[ThreadPoolExecutor] = None
        self._pending: Optional[Future] = None
        self._pending_target: Optional[Path] = None
        self._group: Group = None
        self._group_ready = False
        #: host copies of the last save's states (pinned with CUDA), reused while the next save's have the same
        #: structure, shapes and dtypes
        self._staged: Optional[dict[str, Any]] = None

    @property
    def in_flight(self) -> Optional[Path]:
        """The target of the save still being written, if any."""
        return self._pending_target if self._pending is not None and not self._pending.done() else None

    def group(self) -> Group:
        """The workers' process group, created on first use (a collective: every rank saves together)."""
        if not self._group_ready:
            if coordination.distributed():
                gloo_reach.ensure_gloo_reachable()  # across hosts: fail here, not hang in the first save
                self._group = dist.new_group(backend="gloo", timeout=self.timeout)  # staged states are on CPU
            self._group_ready = True
        return self._group

    def stage(self, payload: dict[str, Any]) -> dict[str, Any]:
        """``payload`` copied to host memory, into the buffers of the last save when they fit: a save then
        stalls training for the copy only (building host tensors afresh deep-copies every DTensor's metadata,
        several times the copy for a small model). Call after :meth:`wait` (the last save is written)."""
        if self._staged is None or not compat.state_dict_similar(payload, self._staged):
            self._staged = compat.create_cpu_state_dict(payload, pin_memory=torch.cuda.is_available())
        return compat.copy_state_dict(payload, self._staged)

    def submit(self, target: Path, work: Callable[[], None]) -> None:
        self.wait()
        if self._executor is None:
            self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="mics-checkpoint")
        self._pending, self._pending_target = self._executor.submit(work), target

    def wait(self) -> None:
        """Block until the save in flight is committed; raise its error if it failed."""
        pending, self._pending, self._pending_target = self._pending, None, None
        if pending is not None:
            pending.result()

    def close(self) -> None:
        try:
            self.wait()
        finally:
            if self._executor is not None:
                self._executor.shutdown(wait=True)
                self._executor = None


def save(
    path: PathLike,
    checkpoint: dict[str, Any],
    layout: Optional[CheckpointLayout] = None,
    full: bool = False,
    saver: Optional[AsyncCheckpointSaver] = None,
    keep_previous: bool = False,
) -> None:
    """Save Lightning's checkpoint dict to ``path`` atomically (a collective: call it on every rank).

    ``checkpoint["state_dict"]`` / ``["optimizer_states"]`` must come from :func:`model_state_dict` /
    :func:`optimizer_state_dict` with the same ``full``. Sharded (default): a directory, every shard
    written once. ``full``: one file written by rank 0, in Lightning's standard format. With a
    ``saver``, a sharded save returns once the states are copied and finishes in the background.
    ``keep_previous``: a sharded save over a checkpoint leaves the data it replaces on disk for a while (for
    readers that opened it just before the switch: a restarted fault-tolerant group loading ``last`` while a live
    group saves it): at least a minute, at most 8 superseded generations (:data:`.atomic.SUPERSEDED_GRACE_S`,
    :data:`.atomic.MAX_SUPERSEDED`), deleted by later saves to ``path``."""
    if saver is not None:
        saver.wait()  # at most one save in flight; its failure surfaces here, before a new one starts
    target = Path(coordination.from_rank_zero(os.path.abspath(path)))
    checkpoint = dict(checkpoint)
    model_state = checkpoint.pop("state_dict", {})
    optimizer_states = checkpoint.pop("optimizer_states", None)
    extras = checkpoint.pop(SHARDED_EXTRAS_KEY, None)
    world = coordination.world_size()
    layout = layout or CheckpointLayout(world, world, world)
    if full:
        if extras:
            raise CheckpointError(
                f"This run's checkpoint holds sharded states beyond the model and optimizers ({sorted(extras)}), "
                "which only a sharded checkpoint keeps: save without save_full_state_dict=True."
            )
        _save_full(target, checkpoint, model_state, optimizer_states, layout)
    else:
        _save_sharded(target, checkpoint, model_state, optimizer_states, layout, saver, keep_previous, extras)


def _agree_on_plan(
    target: Path, trainer_state: dict[str, Any], full: bool, keep_previous: bool = False
) -> tuple[atomic.SavePlan, Optional[dict[str, Any]]]:
    """Rank 0 checks the trainer state and plans the save; every rank gets the plan -- or the error,
    so that all ranks raise it together instead of waiting for rank 0 in a later collective."""
    plan: Optional[atomic.SavePlan] = None
    safe_state: Optional[dict[str, Any]] = None
    error: Optional[str] = None
    if coordination.rank() == 0:
        try:
            safe_state = safe_trainer_state(trainer_state)
            plan = atomic.plan_save(target, int(trainer_state.get("global_step", 0) or 0), full, keep_previous)
            error = plan.error
        except Exception as err:  # noqa: BLE001 - re-raised on every rank below
            error = f"Cannot save a checkpoint to {target}: {err}"
    plan, error = coordination.from_rank_zero((plan, error))
    if error:
        raise CheckpointError(error)
    assert plan is not None
    return plan, safe_state


def _save_sharded(
    target: Path,
    trainer_state: dict[str, Any],
    model_state: dict[str, Any],
    optimizer_states: Optional[list[dict[str, Any]]],
    layout: CheckpointLayout,
    saver: Optional[AsyncCheckpointSaver],
    keep_previous: bool = False,
    extras: Optional[dict[str, Any]] = None,
) -> None:
    group = saver.group() if saver is not None else None
    plan, safe_state = _agree_on_plan(target, trainer_state, full=False, keep_previous=keep_previous)
    payload: dict[str, Any] = {MODEL_KEY: model_state}
    if optimizer_states:
        payload[OPTIMIZERS_KEY] = {str(i): state for i, state in enumerate(optimizer_states)}
    if extras:
        payload[SHARDED_EXTRAS_KEY] = extras
    record = CommitRecord(
        data=plan.data_name,
        layout=layout,
        num_optimizers=len(optimizer_states or []),
        global_step=trainer_state.get("global_step"),
        epoch=trainer_state.get("epoch"),
        versions=versions(),
    )
    # taken now: training goes on while a background save writes
    small_files = {f"{RNG_DIR}/{integrity.rng_file_name(coordination.rank())}": torch_bytes(rng.capture_rng_state())}
    if safe_state is not None:  # rank 0
        small_files[TRAINER_STATE_FILE] = torch_bytes(safe_state)
    if saver is None:
        _write_and_commit(plan, payload, small_files, record, group=None)
        return
    staged = saver.stage(payload)
    saver.submit(target, lambda: _write_and_commit(plan, staged, small_files, record, group))


def _write_and_commit(
    plan: atomic.SavePlan,
    payload: dict[str, Any],
    small_files: dict[str, bytes],
    record: CommitRecord,
    group: Group,
) -> None:
    """Every rank writes its shards and small files and digests them; rank 0 commits if all
    succeeded, else discards the staging; every rank then raises the same error or none."""
    data_dir = Path(plan.data_dir)
    rank = coordination.rank()
    digests: dict[str, Any] = {}
    error: Optional[str] = None
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")  # single process: intended
            dcp.save(payload, storage_writer=FileSystemWriter(data_dir), process_group=group)
        for name, data in small_files.items():
            atomic.write_durably(data_dir / name, data)
        digests = integrity.digest_files(data_dir, integrity.files_written_by(data_dir, rank))
    except Exception as err:  # noqa: BLE001 - shared with every rank below
        error = f"rank {rank}: {type(err).__name__}: {err}"
    gathered = coordination.gather_to_rank_zero((digests, error), group)
    failures: list[str] = []
    if gathered is not None:  # rank 0
        failures = [failure for _, failure in gathered if failure]
        try:
            if failures:
                atomic.discard(plan)
            else:
                files = integrity.complete_listing(data_dir, [digest for digest, _ in gathered])
                atomic.commit_sharded(plan, dataclasses.replace(record, files=files))
        except Exception as err:  # noqa: BLE001 - shared with every rank below
            failures.append(f"rank 0: committing: {type(err).__name__}: {err}")
    failures = coordination.from_rank_zero(failures, group)
    if failures:
        raise CheckpointError(
            f"Saving the checkpoint {plan.target} failed, so it was not committed (a previous checkpoint at that path "
            "is unchanged):\n  " + "\n  ".join(failures)
        )


def _save_full(
    target: Path,
    trainer_state: dict[str, Any],
    model_state: dict[str, Any],
    optimizer_states: Optional[list[dict[str, Any]]],
    layout: CheckpointLayout,
) -> None:
    rng_states = coordination.everyones(rng.capture_rng_state())
    plan, state = _agree_on_plan(target, trainer_state, full=True)
    if state is not None:  # rank 0
        state["state_dict"] = model_state
        if optimizer_states is not None:
            state["optimizer_states"] = optimizer_states
        state[FULL_META_KEY] = {
            "format": FULL_FORMAT,
            "format_version": FORMAT_VERSION,
            "layout": dataclasses.asdict(layout),
            "rng_states": rng_states,
            "versions": versions(),
        }
        atomic.write_durably(Path(plan.staging), torch_bytes(state))
        atomic.publish(plan)
    coordination.barrier()


def versions() -> dict[str, str]:
    import lightning

    return {"torch": str(torch.__version__), "lightning": str(lightning.__version__)}
