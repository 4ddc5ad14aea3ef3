"""Checkpoints for MiCS: sharded (DCP) directories, single-file full checkpoints, safe loading.

A **sharded checkpoint** is a directory, committed atomically::

    last.ckpt/
        mics_checkpoint.json        commit record: format, layout, current data dir, size + CRC-32 of every file
        state-step000000042-1a2b3c4d/
            .metadata, __*_0.distcp  DCP: model + optimizer states as DTensor shards
            trainer_state.pt         rank 0: Lightning's loops, callbacks, schedulers, precision state
            rng/rank00000.pt ...     every rank's RNG states (exact resume)

One module per concern:

* :mod:`.format` -- names on disk, the commit record and its validation (a checkpoint directory is
  untrusted input: nothing it contains may steer where we read, write or delete).
* :mod:`.saving` -- deduplicated sharded saves (replicas share the writing), full files, background
  saves (:class:`AsyncCheckpointSaver`).
* :mod:`.atomic` -- staging and the one-rename commit: a save killed at any point leaves the
  previous checkpoint loadable.
* :mod:`.integrity` -- the size and CRC-32 of every file, verified before anything is loaded.
* :mod:`.safe_load` -- nothing is unpickled beyond plain data: small files with
  ``torch.load(weights_only=True)``, DCP's metadata with an unpickler that admits only DCP's
  metadata classes, DCP's non-tensor entries through weights-only planners.
* :mod:`.loading` -- all-or-nothing loads onto any mesh (other world or partition size) or into a
  plain module in one process; :func:`read_full_state` for consolidation.
* :mod:`.fabric_entries` -- ``fabric.save``'s entries beside the model and optimizers, in the
  Trainer's format (a Fabric save resumes in the Trainer and back).
* :mod:`.from_checkpoint` -- ``LightningModule.load_from_checkpoint`` for sharded directories too.
* :mod:`.state_dicts`, :mod:`.rng`, :mod:`.coordination` -- state dicts of sharded modules, RNG
  states, and the few collectives (no-ops without ``torch.distributed``).

A **full checkpoint** (``MiCSStrategy(save_full_state_dict=True)``, or :mod:`lightning_mics.consolidate`
with ``--with-optimizer``) is one ``torch.save`` file in Lightning's usual format -- unsharded
``state_dict``, ``optimizer_states`` in ``torch.optim`` format -- gathered on rank 0. :func:`load`
accepts either kind, whatever the current layout.
"""

from lightning_mics.checkpoint.atomic import remove
from lightning_mics.checkpoint.format import (
    FORMAT_VERSION,
    FULL_FORMAT,
    FULL_META_KEY,
    MANIFEST_FILE,
    METADATA_FILE,
    MODEL_KEY,
    OPTIMIZERS_KEY,
    RNG_DIR,
    SHARDED_FORMAT,
    TRAINER_STATE_FILE,
    CheckpointError,
    CheckpointInfo,
    CheckpointLayout,
    CommitRecord,
    FileDigest,
    PathLike,
    read_record,
)
from lightning_mics.checkpoint.from_checkpoint import LoadsShardedCheckpoints, load_from_checkpoint
from lightning_mics.checkpoint.integrity import VERIFY_MODES, VerifyMode
from lightning_mics.checkpoint.loading import inspect_checkpoint, load, read_full_state
from lightning_mics.checkpoint.rng import capture_rng_state, restore_rng_state
from lightning_mics.checkpoint.saving import AsyncCheckpointSaver, save
from lightning_mics.checkpoint.state_dicts import model_state_dict, optimizer_state_dict, outside_inference_mode

__all__ = [
    "LoadsShardedCheckpoints",
    "FORMAT_VERSION",
    "FULL_FORMAT",
    "FULL_META_KEY",
    "MANIFEST_FILE",
    "METADATA_FILE",
    "MODEL_KEY",
    "OPTIMIZERS_KEY",
    "RNG_DIR",
    "SHARDED_FORMAT",
    "TRAINER_STATE_FILE",
    "VERIFY_MODES",
    "AsyncCheckpointSaver",
    "CheckpointError",
    "CheckpointInfo",
    "CheckpointLayout",
    "CommitRecord",
    "FileDigest",
    "PathLike",
    "VerifyMode",
    "capture_rng_state",
    "inspect_checkpoint",
    "load",
    "load_from_checkpoint",
    "model_state_dict",
    "optimizer_state_dict",
    "outside_inference_mode",
    "read_full_state",
    "read_record",
    "remove",
    "restore_rng_state",
    "save",
]
