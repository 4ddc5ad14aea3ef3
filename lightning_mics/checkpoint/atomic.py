"""Atomic saves: stage where no reader looks, then switch with one rename.

A new checkpoint is staged in a hidden sibling ``.last.ckpt.partial-<token>`` and renamed into place;
an existing one gets a new data directory staged inside it, and only the ``os.replace`` of the
commit record switches to it. A save killed at any point leaves the previous checkpoint loadable,
and the hidden staging names never match Lightning's ``last*.ckpt`` pattern, so ``ckpt_path="last"``
never picks one. Saves delete only what they staged themselves, what a previous interrupted save
left under a staging name, and the data directory a *validated* record of this checkpoint names.
"""

from __future__ import annotations

import logging
import os
import secrets
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO, Optional, Union

from lightning_mics.checkpoint import coordination
from lightning_mics.checkpoint.format import (
    DATA_DIR_PATTERN,
    MANIFEST_FILE,
    OLD_MARK,
    PARTIAL_MARK,
    RNG_DIR,
    CheckpointError,
    CommitRecord,
    PathLike,
    read_record,
)

log = logging.getLogger(__name__)

#: ``keep_previous`` (fault tolerance: a restarted group may be reading ``last`` while a live group saves over it):
#: data a save superseded stays on disk at least this long after its switch, so a reader that resolved the record
#: just before it -- and then took a while (its start-up, its group's collectives) to read the shards -- reads it
#: whole however often the live groups save ...
SUPERSEDED_GRACE_S = 60.0
#: ... but at most this many superseded generations, the oldest deleted first: saves every second would keep a
#: minute of them otherwise. With saves minutes apart (a large model) it is the one previous generation.
MAX_SUPERSEDED = 8


def fsync_dir(path: Path) -> None:
    """Make a rename/creation inside ``path`` durable (a crash after the rename must not undo it)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:  # pragma: no cover - platforms without directory handles
        return
    try:
        os.fsync(fd)
    except OSError:  # pragma: no cover
        pass
    finally:
        os.close(fd)


def write_durably(path: Path, data: Union[bytes, Callable[[BinaryIO], None]]) -> None:
    """Write ``data`` (bytes, or a function writing to a binary handle) to a temporary name, fsync it
    and rename it over ``path``: a reader sees the old file or the whole new one, even after a crash."""
    tmp = path.with_name(f".{path.name}{PARTIAL_MARK}{secrets.token_hex(4)}")
    try:
        with open(tmp, "wb") as handle:
            if isinstance(data, bytes):
                handle.write(data)
            else:
                data(handle)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    fsync_dir(path.parent)


@dataclass(frozen=True)
class SavePlan:
    """Where one save writes, decided on rank 0 and shared, so every rank writes to the same place."""

    target: str
    mode: str  #: "new" (nothing there), "update" (a sharded checkpoint there), "replace" (a file/link there)
    staging: str  #: sharded: the directory that becomes the target ("new"/"replace"); full: the temp file
    data_dir: str  #: sharded: where DCP writes
    data_name: str  #: sharded: the data directory's final name
    token: str
    error: Optional[str] = None
    #: "update": leave the replaced data for readers that opened it just before the switch (see SUPERSEDED_GRACE_S)
    keep_previous: bool = False


def staging_leftovers(target: Path) -> list[Path]:
    """Hidden data of interrupted saves or removals of ``target`` (never loadable, safe to delete)."""
    found: list[Path] = []
    parent, prefix = target.parent, f".{target.name}"
    if parent.is_dir():
        for entry in parent.iterdir():
            if entry.name.startswith(prefix + PARTIAL_MARK) or entry.name.startswith(prefix + OLD_MARK):
                found.append(entry)
    if target.is_dir() and not target.is_symlink():
        try:
            current = read_record(target).data if (target / MANIFEST_FILE).is_file() else None
        except CheckpointError:
            current = ""  # damaged record: which data is current is unknown, so none counts as stale
        for entry in target.iterdir():
            stale_data = current != "" and DATA_DIR_PATTERN.match(entry.name) and entry.name != current
            if entry.name.startswith(PARTIAL_MARK) or entry.name.startswith(f".{MANIFEST_FILE}") or stale_data:
                found.append(entry)
    return sorted(found)


def delete(path: Path) -> None:
    """Remove ``path``; a symbolic link is removed itself, never what it points to."""
    if path.is_symlink() or path.is_file():
        path.unlink(missing_ok=True)
    elif path.is_dir():
        shutil.rmtree(path, ignore_errors=True)


def _valid_record(target: Path) -> Optional[CommitRecord]:
    try:
        return read_record(target)
    except CheckpointError as err:
        log.warning("Replacing the damaged checkpoint at %s: %s", target, err)
        return None


def _is_superseded_data(target: Path, leftover: Path) -> bool:
    """A leftover of :func:`staging_leftovers` that is committed data its record no longer names."""
    return leftover.parent == target and DATA_DIR_PATTERN.match(leftover.name) is not None


def _superseded_within_grace(target: Path, leftovers: list[Path]) -> set[Path]:
    """Of the superseded data directories among ``leftovers``, those to keep: superseded less than
    :data:`SUPERSEDED_GRACE_S` ago (their modification time is their switch's, see :func:`commit_sharded`), the
    newest :data:`MAX_SUPERSEDED` - 1 of them (the save being planned supersedes one more)."""
    now = time.time()
    recent = []
    for path in leftovers:
        if not _is_superseded_data(target, path):
            continue
        try:
            superseded_at = path.stat().st_mtime
        except OSError:
            continue
        if now - superseded_at < SUPERSEDED_GRACE_S:
            recent.append((superseded_at, path))
    recent.sort(reverse=True)
    return {path for _, path in recent[: MAX_SUPERSEDED - 1]}


def plan_save(target: Path, global_step: int, full: bool, keep_previous: bool = False) -> SavePlan:
    """Rank 0: clear what interrupted saves left, then choose the staging area for this save."""
    token = secrets.token_hex(4)
    data_name = f"state-step{global_step:09d}-{token}"
    leftovers = staging_leftovers(target)
    kept = _superseded_within_grace(target, leftovers) if keep_previous else set()
    for leftover in leftovers:
        if leftover in kept:
            continue
        if _is_superseded_data(target, leftover):
            # an "update" save with keep_previous leaves the data it replaced to a later save, for its readers
            log.info("Removing %s: checkpoint data its record no longer names (the previous save's).", leftover)
        else:
            log.info("Removing %s left by an interrupted checkpoint save.", leftover)
        delete(leftover)
    staging = target.parent / f".{target.name}{PARTIAL_MARK}{token}"
    plan = dict(target=str(target), staging=str(staging), data_dir=str(staging / data_name), data_name=data_name)
    has_record = (target / MANIFEST_FILE).is_file() and not target.is_symlink()
    if target.is_symlink() or target.is_file():
        mode = "replace"
    elif not target.exists():
        mode = "new"
    elif has_record or not any(target.iterdir()):
        # an existing sharded checkpoint gets new data inside it -- unless its record is damaged, in
        # which case nothing in it can be trusted and the whole directory is replaced
        mode = "update" if has_record and not full and _valid_record(target) is not None else "replace"
    else:
        return SavePlan(
            **plan,
            mode="error",
            token=token,
            error=(
                f"Cannot save a checkpoint to {target}: it is a directory that is not a MiCS checkpoint, and "
                "overwriting it could destroy unrelated files. Nothing was written; remove it or choose another path."
            ),
        )
    if mode == "update":
        plan["data_dir"] = str(target / f"{PARTIAL_MARK}{token}")
    if not full:
        Path(plan["data_dir"], RNG_DIR).mkdir(parents=True)
    else:
        target.parent.mkdir(parents=True, exist_ok=True)
    return SavePlan(**plan, mode=mode, token=token, keep_previous=keep_previous)


def discard(plan: SavePlan) -> None:
    """Rank 0, after a failed save: remove what it staged (the previous checkpoint stays as it was)."""
    delete(Path(plan.data_dir) if plan.mode == "update" else Path(plan.staging))


def publish(plan: SavePlan) -> None:
    """Rank 0, after every rank finished writing: make the staged checkpoint the one at ``target``.

    "new" is one atomic rename; "replace" moves the old entry aside first (a file is replaced
    atomically by ``os.replace`` itself)."""
    target, staging = Path(plan.target), Path(plan.staging)
    aside = target.parent / f".{target.name}{OLD_MARK}{plan.token}"
    if plan.mode == "replace" and target.is_symlink():
        target.unlink()
    elif plan.mode == "replace" and (target.is_dir() or staging.is_dir()):
        os.rename(target, aside)
    os.replace(staging, target)
    fsync_dir(target.parent)
    delete(aside)


def commit_sharded(plan: SavePlan, record: CommitRecord) -> None:
    """Rank 0: make the staged sharded checkpoint current. "update" switches an existing checkpoint by
    replacing its commit record (one atomic ``os.replace``), then deletes the data the old record named."""
    target = Path(plan.target)
    if plan.mode != "update":
        write_durably(Path(plan.staging) / MANIFEST_FILE, record.to_json())
        publish(plan)
        return
    os.rename(plan.data_dir, target / plan.data_name)
    fsync_dir(target)
    try:
        previous: Optional[str] = read_record(target).data
    except CheckpointError:  # damaged since the save was planned: delete nothing it names
        previous = None
    write_durably(target / MANIFEST_FILE, record.to_json())  # the switch
    if previous and previous != plan.data_name:
        if not plan.keep_previous:
            delete(target / previous)  # a validated plain child name: never outside ``target``
        else:  # its modification time says when it was superseded (nothing writes into it any more)
            try:
                os.utime(target / previous)
            except OSError:
                pass


def remove(path: PathLike) -> None:
    """Delete a checkpoint (rank 0 only). It is renamed to a hidden name first, so a removal that is
    interrupted never leaves a half-deleted directory that looks like a checkpoint."""
    if coordination.rank() != 0:
        return
    target = Path(path)
    if target.is_symlink() or target.is_file():
        target.unlink()
    elif target.is_dir():
        aside = target.parent / f".{target.name}{OLD_MARK}{secrets.token_hex(4)}"
        os.rename(target, aside)
        shutil.rmtree(aside)
