"""What a MiCS checkpoint is on disk: names, the commit record and its validation, the layout.

A checkpoint directory is untrusted input -- downloaded, shared, copied between clusters -- so the
commit record is validated field by field before anything acts on it: a path it names must be a
plain child of the checkpoint directory, since saves delete the data directory the previous record
names and loads read from it. Anything else is a damaged checkpoint, refused before any read,
write or delete.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional, Union

PathLike = Union[str, os.PathLike]

#: ``format`` of the commit record of a sharded checkpoint directory.
SHARDED_FORMAT = "lightning-mics-sharded"
#: ``format`` stored under :data:`FULL_META_KEY` in a single-file full checkpoint.
FULL_FORMAT = "lightning-mics-full"
#: Records without the integrity listing (``files``) are version 1 too: readers that do not know
#: the listing ignore it, so older lightning-mics still loads newer checkpoints.
FORMAT_VERSION = 1
#: The commit record. A directory without it is not (yet) a checkpoint.
MANIFEST_FILE = "mics_checkpoint.json"
#: Rank 0's file with everything that is not model or optimizer state.
TRAINER_STATE_FILE = "trainer_state.pt"
#: DCP's metadata file inside a data directory.
METADATA_FILE = ".metadata"
RNG_DIR = "rng"
#: Key of a full checkpoint holding what MiCS adds to Lightning's dict (layout, RNG, parameter names).
FULL_META_KEY = "mics"
#: Keys of the DCP payload.
MODEL_KEY, OPTIMIZERS_KEY = "model", "optimizers"
#: Key (in Lightning's checkpoint dict and in the DCP payload) of sharded states beyond the model and the
#: optimizers -- DiLoCo's outer state and each replica group's own parameters (:mod:`lightning_mics.hop2.diloco`):
#: saved with the shards, never in rank 0's trainer state.
SHARDED_EXTRAS_KEY = "mics_sharded_extras"

PARTIAL_MARK = ".partial-"
OLD_MARK = ".old-"
DATA_DIR_PATTERN = re.compile(r"^state-step\d+-[0-9a-f]+$")
#: Deepest file of a data directory: ``rng/rankNNNNN.pt``.
_MAX_FILE_DEPTH = 2


class CheckpointError(ValueError):
    """A checkpoint cannot be used as asked; the message says why and what to do instead."""


@dataclass(frozen=True)
class CheckpointLayout:
    """The process layout that wrote a checkpoint (informational: loading works under any layout)."""

    world_size: int
    partition_size: int
    ranks_per_node: int

    @property
    def replication_degree(self) -> int:
        return self.world_size // self.partition_size


@dataclass(frozen=True)
class FileDigest:
    """Size and checksum of one file of a checkpoint, as recorded at commit."""

    size: int
    crc32: str  #: 8 lowercase hex digits


@dataclass(frozen=True)
class CommitRecord:
    """The validated content of ``mics_checkpoint.json``."""

    data: str  #: the committed data directory: a plain child name of the checkpoint directory
    layout: Optional[CheckpointLayout]
    num_optimizers: int
    global_step: Optional[int]
    epoch: Optional[int]
    #: every file of the data directory (relative POSIX paths) with its digest; ``None`` for
    #: checkpoints written before integrity records existed
    files: Optional[dict[str, FileDigest]] = None
    versions: dict[str, str] = field(default_factory=dict)

    def to_json(self) -> bytes:
        record: dict[str, Any] = {
            "format": SHARDED_FORMAT,
            "format_version": FORMAT_VERSION,
            "data": self.data,
            "layout": None if self.layout is None else vars(self.layout).copy(),
            "num_optimizers": self.num_optimizers,
            "global_step": self.global_step,
            "epoch": self.epoch,
            "versions": dict(self.versions),
        }
        if self.files is not None:
            record["checksum"] = "crc32"
            record["files"] = {name: vars(digest).copy() for name, digest in sorted(self.files.items())}
        return json.dumps(record, indent=2, sort_keys=True).encode()


@dataclass(frozen=True)
class CheckpointInfo:
    """What :func:`~lightning_mics.checkpoint.inspect_checkpoint` found at a path."""

    path: Path
    kind: str  #: ``"sharded"``, ``"full"`` or ``"weights"``
    layout: Optional[CheckpointLayout]
    num_optimizers: int
    global_step: Optional[int]
    epoch: Optional[int]
    data_dir: Optional[Path] = None  #: the committed DCP directory of a sharded checkpoint
    record: Optional[CommitRecord] = None  #: the commit record of a sharded checkpoint


def is_plain_name(name: object) -> bool:
    """A single path component naming a child of a directory: not empty, ``.``/``..``, absolute,
    or containing a separator -- so joining it to a directory can never leave that directory."""
    if not isinstance(name, str) or name in ("", ".", "..") or "\0" in name:
        return False
    separators = {"/", "\\", os.sep} | ({os.altsep} if os.altsep else set())
    return not any(sep in name for sep in separators)


def is_data_file_name(name: object) -> bool:
    """A file inside a data directory, as the integrity listing names it (``rng/rank00000.pt``)."""
    if not isinstance(name, str):
        return False
    parts = name.split("/")
    return len(parts) <= _MAX_FILE_DEPTH and all(is_plain_name(part) for part in parts)


def read_record(checkpoint_dir: Path) -> CommitRecord:
    """Read and validate the commit record of ``checkpoint_dir``; any flaw is a :class:`CheckpointError`."""
    record_path = checkpoint_dir / MANIFEST_FILE
    try:
        raw = json.loads(record_path.read_text())
    except (OSError, ValueError) as err:
        raise CheckpointError(f"{record_path} is unreadable or corrupt ({err}); the checkpoint is damaged.") from err
    if not isinstance(raw, dict) or raw.get("format") != SHARDED_FORMAT:
        raise CheckpointError(f"{record_path} is not a MiCS checkpoint record.")
    version = raw.get("format_version")
    if not _is_int(version):
        raise CheckpointError(_damaged(record_path, "format_version", version, "an integer"))
    if version > FORMAT_VERSION:
        raise CheckpointError(
            f"{checkpoint_dir} was written by a newer lightning-mics (format {version} > {FORMAT_VERSION}); "
            "upgrade lightning-mics to load it."
        )
    data = raw.get("data")
    if not (is_plain_name(data) and DATA_DIR_PATTERN.match(data)):
        raise CheckpointError(
            _damaged(record_path, "data", data, "the name of a data directory inside the checkpoint (state-step...)")
        )
    return CommitRecord(
        data=data,
        layout=_layout(record_path, raw.get("layout")),
        num_optimizers=_count(record_path, raw, "num_optimizers", optional=False),
        global_step=_count(record_path, raw, "global_step", optional=True),
        epoch=_count(record_path, raw, "epoch", optional=True),
        files=_files(record_path, raw.get("files")),
        versions={str(k): str(v) for k, v in raw["versions"].items()} if isinstance(raw.get("versions"), dict) else {},
    )


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _damaged(record_path: Path, key: str, value: object, expected: str) -> str:
    shown = repr(value) if len(repr(value)) <= 80 else repr(value)[:77] + "..."
    return (
        f"{record_path} is damaged: its field '{key}' is {shown}, expected {expected}. The checkpoint is not used "
        "(nothing was read, written or deleted because of it); load an earlier checkpoint, or save to this path "
        "again to replace it."
    )


def _count(record_path: Path, raw: Mapping[str, Any], key: str, optional: bool) -> Optional[int]:
    value = raw.get(key, 0 if not optional else None)
    if value is None and optional:
        return None
    if not _is_int(value) or value < 0:
        return _raise(_damaged(record_path, key, value, "a non-negative integer" + (" or null" if optional else "")))
    return value


def _layout(record_path: Path, value: object) -> Optional[CheckpointLayout]:
    if value is None:
        return None
    names = ("world_size", "partition_size", "ranks_per_node")
    if not (
        isinstance(value, dict) and set(value) == set(names) and all(_is_int(value[n]) and value[n] > 0 for n in names)
    ):
        _raise(_damaged(record_path, "layout", value, f"null or positive integers {list(names)}"))
    assert isinstance(value, dict)
    return CheckpointLayout(**{name: value[name] for name in names})


def _files(record_path: Path, value: object) -> Optional[dict[str, FileDigest]]:
    if value is None:
        return None
    if not isinstance(value, dict) or not value:
        _raise(_damaged(record_path, "files", value, "a listing of the data directory's files"))
    assert isinstance(value, dict)
    files = {}
    for name, digest in value.items():
        if not is_data_file_name(name):
            _raise(_damaged(record_path, "files", name, "file names inside the data directory"))
        if not (
            isinstance(digest, dict)
            and _is_int(digest.get("size"))
            and digest["size"] >= 0
            and isinstance(digest.get("crc32"), str)
            and re.fullmatch(r"[0-9a-f]{8}", digest["crc32"])
        ):
            _raise(_damaged(record_path, f"files[{name!r}]", digest, '{"size": bytes, "crc32": 8 hex digits}'))
        files[name] = FileDigest(size=digest["size"], crc32=digest["crc32"])
    return files


def _raise(message: str) -> Any:
    raise CheckpointError(message)
