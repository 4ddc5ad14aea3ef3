"""The suite's shared set-up: tests/ on ``sys.path`` (the spawned ranks import its helpers too), and an autouse
fixture that undoes what a test's in-process Lightning code leaves in ``os.environ``."""

import os
import sys

# The helpers in this folder (distributed harness, toy models) are imported by the spawned ranks too.
# The repository root, for `benchmarks` and `examples`, comes from pyproject.toml's pytest `pythonpath`.
sys.path.insert(0, os.path.dirname(__file__))

import pytest  # noqa: E402


@pytest.fixture(autouse=True)
def _restore_environment():
    """Undo what a test's in-process Lightning code leaves in ``os.environ``: spawned ranks of later
    tests inherit it. ``seed_everything`` (run by LightningCLI) sets ``PL_GLOBAL_SEED``, which makes
    every later rank re-seed at set-up and train on other data than the single-process reference."""
    saved = dict(os.environ)
    yield
    if os.environ != saved:
        os.environ.clear()
        os.environ.update(saved)

