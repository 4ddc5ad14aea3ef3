"""The library's start-up lines -- the layout, the planner's choice, fault-tolerance membership -- on the console
like Lightning's own, with no logging set up by the user.

Lightning shows its lines (``GPU available: ...``) because ``lightning.pytorch`` gives its logger a stream
handler when the root logger has none. ``lightning_mics`` logs through ``logging.getLogger("lightning_mics")``
(the layout line on global rank 0 only); without the same treatment a plain script showed nothing. Done when a
strategy is created, not at import, and never when the user configured logging (their handlers get the lines).
"""

from __future__ import annotations

import logging

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
