"""Integrity record: the size and CRC-32 of every file of a checkpoint, checked before loading.

DCP keeps no checksums, so a few flipped bytes inside a tensor shard would load without complaint
and training would go on from wrong weights. At commit, each rank digests the files it wrote
(reading them back from the page cache: cheap next to writing them) and rank 0 records them all.
A load verifies the files first -- spread over the ranks -- and refuses a damaged checkpoint before
touching the model or the optimizer.
"""

from __future__ import annotations

import logging
import zlib
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Optional

from lightning_mics.checkpoint import coordination
from lightning_mics.checkpoint.format import (
    METADATA_FILE,
    RNG_DIR,
    TRAINER_STATE_FILE,
    CheckpointError,
    FileDigest,
)
from lightning_mics.options import VERIFY_MODES, VerifyMode

log = logging.getLogger(__name__)

_CHUNK = 16 << 20


def check_verify_mode(verify: object) -> VerifyMode:
    if verify not in VERIFY_MODES:
        raise ValueError(f"verify={verify!r} is not one of {list(VERIFY_MODES)}.")
    return verify  # type: ignore[return-value]


def digest_file(path: Path) -> FileDigest:
    crc, size = 0, 0
    with open(path, "rb") as handle:
        while chunk := handle.read(_CHUNK):
            crc = zlib.crc32(chunk, crc)
            size += len(chunk)
    return FileDigest(size=size, crc32=f"{crc:08x}")


def digest_files(data_dir: Path, names: Iterable[str]) -> dict[str, FileDigest]:
    return {name: digest_file(data_dir / name) for name in names}


def files_written_by(data_dir: Path, rank: int) -> list[str]:
    """The files of ``data_dir`` this rank wrote: its DCP shards (DCP prefixes them ``__<rank>_``),
    its RNG file, and on rank 0 DCP's metadata and the trainer state."""
    names = [entry.name for entry in data_dir.iterdir() if entry.is_file() and entry.name.startswith(f"__{rank}_")]
    names.append(f"{RNG_DIR}/{rng_file_name(rank)}")
    if rank == 0:
        names += [METADATA_FILE, TRAINER_STATE_FILE]
    return sorted(name for name in names if (data_dir / name).is_file())


def rng_file_name(rank: int) -> str:
    return f"rank{rank:05d}.pt"


def all_files(data_dir: Path) -> list[str]:
    """Every file under ``data_dir`` as a relative POSIX path."""
    return sorted(path.relative_to(data_dir).as_posix() for path in data_dir.rglob("*") if path.is_file())


def complete_listing(data_dir: Path, per_rank: Iterable[Mapping[str, FileDigest]]) -> dict[str, FileDigest]:
    """Rank 0: the digests every rank sent, plus any file of ``data_dir`` none of them claimed
    (digested here), so the record always covers the whole data directory."""
    listing: dict[str, FileDigest] = {}
    for digests in per_rank:
        listing.update(digests)
    unclaimed = [name for name in all_files(data_dir) if name not in listing]
    listing.update(digest_files(data_dir, unclaimed))
    return listing


def verify(
    checkpoint: Path,
    data_dir: Path,
    files: Optional[Mapping[str, FileDigest]],
    mode: VerifyMode,
    collective: bool = True,
) -> None:
    """Raise one :class:`CheckpointError` naming every damaged or missing file.

    ``collective`` (every rank calls it): the work is spread over the ranks (rank r checks every
    r-th file) and the findings shared, so every rank raises the same error or none does."""
    if mode == "none":
        return
    if files is None:
        if coordination.rank() == 0:
            log.info(
                "%s has no integrity record (saved by an older lightning-mics): its files are not verified.", checkpoint
            )
        return
    names = sorted(files)
    if collective:
        names = names[coordination.rank() :: coordination.world_size()]
    problems = [problem for name in names if (problem := _problem(data_dir, name, files[name], mode))]
    if collective:
        problems = [problem for found in coordination.everyones(problems) for problem in found]
    found = sorted(problems)
    if found:
        raise CheckpointError(
            f"The checkpoint {checkpoint} is damaged; nothing was loaded:\n  "
            + "\n  ".join(found)
            + "\nUse an earlier checkpoint (pass another ckpt_path=), or copy this one again from where it came from."
        )


def _problem(data_dir: Path, name: str, expected: FileDigest, mode: VerifyMode) -> Optional[str]:
    path = data_dir / name
    try:
        size = path.stat().st_size
        if not path.is_file():
            return f"{path}: not a file"
    except FileNotFoundError:
        return f"{path}: missing"
    except OSError as err:
        return f"{path}: unreadable ({err})"
    if size != expected.size:
        how = "truncated" if size < expected.size else "grown"
        return f"{path}: {size} bytes, recorded {expected.size} ({how})"
    if mode == "checksum":
        try:
            actual = digest_file(path).crc32
        except OSError as err:
            return f"{path}: unreadable ({err})"
        if actual != expected.crc32:
            return f"{path}: checksum {actual}, recorded {expected.crc32} (its bytes changed)"
    return None
