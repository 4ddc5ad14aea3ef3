"""The library's start-up lines -- the layout, the planner's choice, fault-tolerance membership -- on the console
like Lightning's own, with no logging set up by the user.

Lightning shows its lines (``GPU available: ...``) because ``lightning.pytorch`` gives its logger a stream
handler when the root logger has none. ``lightning_mics`` logs through ``logging.getLogger("lightning_mics")``
(the layout line on global rank 0 only); without the same treatment a plain script showed nothing. Done when a
strategy is created, not at import, and never when the user configured logging (their handlers get the lines).
"""

from __future__ import annotations

import logging
import os
import sys
import warnings

from lightning_mics import _compat as compat

LOGGER_NAME = "lightning_mics"


def show_start_up_lines() -> None:
    """Give the library's logger Lightning's treatment: INFO, and a plain stream handler unless the application
    configured logging (a root handler) or this logger has one already. Idempotent."""
    logger = logging.getLogger(LOGGER_NAME)
    if logger.level == logging.NOTSET:
        logger.setLevel(logging.INFO)
    if logger.handlers or logging.getLogger().hasHandlers():
        return
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter("%(message)s"))
    logger.addHandler(handler)
    logger.propagate = False  # as Lightning's: a root handler added later would print every line twice


#: the logger of fault tolerance's status lines (``fault tolerance: ...``), which every rank of a group would print alike
FAULT_TOLERANCE_LOGGER = "lightning_mics.fault_tolerance"
#: torchft's Python loggers (its Manager's lines; the Rust side is ``RUST_LOG``'s, read once when it is imported)
TORCHFT_LOGGER = "torchft"


class _OncePerGroup(logging.Filter):
    """Passes a group-wide status line (``fault tolerance: ...`` below ERROR) on the group's rank 0 only: each rank
    of a group reaches it alike, and a line per rank multiplies what the user reads by the group's size. Errors,
    and lines about this rank alone, pass on every rank."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno >= logging.ERROR or not str(record.msg).startswith("fault tolerance:"):
            return True
        import torch.distributed as dist

        return not (dist.is_available() and dist.is_initialized()) or dist.get_rank() == 0


class _NotOnThisBackend(logging.Filter):
    """Drops torchft's "Unable to reset NCCL flight recorder" warning, which its Manager prints at every quorum of
    every rank where NCCL's flight recorder does not exist (gloo, CPU): nothing the user can act on."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "NCCL flight recorder" not in record.getMessage()


def quiet_torchft() -> None:
    """Fault tolerance's console: torchft's INFO lines quiet unless the user asks, status lines once per group.

    torchft's Rust core logs every quorum and commit at INFO to stderr (two to five lines a step) unless ``RUST_LOG``
    says otherwise when the extension is first imported; it is imported here with ``RUST_LOG=warn`` for that one
    import when the user set no ``RUST_LOG`` (the environment is left as it was). ``RUST_LOG=info`` brings the
    lines back; so does ``logging.getLogger("torchft").setLevel(logging.INFO)`` for its Python side, which is set
    to WARNING here only when nobody set its level. Idempotent."""
    if compat.TORCHFT_EXTENSION not in sys.modules and "RUST_LOG" not in os.environ:
        os.environ["RUST_LOG"] = "warn"
        try:
            compat.import_torchft_extension()  # reads RUST_LOG once, here
        except ImportError:
            pass  # no torchft: the Manager's import says how to install it
        finally:
            del os.environ["RUST_LOG"]
    torchft_logger = logging.getLogger(TORCHFT_LOGGER)
    if torchft_logger.level == logging.NOTSET:
        torchft_logger.setLevel(logging.WARNING)
    manager_logger = logging.getLogger(f"{TORCHFT_LOGGER}.manager")
    if not any(isinstance(f, _NotOnThisBackend) for f in manager_logger.filters):
        manager_logger.addFilter(_NotOnThisBackend())
    status = logging.getLogger(FAULT_TOLERANCE_LOGGER)
    if not any(isinstance(f, _OncePerGroup) for f in status.filters):
        status.addFilter(_OncePerGroup())
    # torchft's PGTransport, on every heal: a read-only receive buffer it copies at once, and torch's pytree
    # deprecation inside its unpickling -- torchft's own code, nothing for the user to change (these two only)
    warnings.filterwarnings("ignore", message="The given buffer is not writable", module=r"torchft\.checkpointing\.")
    warnings.filterwarnings("ignore", message=r".*LeafSpec.* is deprecated", module=r"torchft\.checkpointing\.")
