"""The suite's shared set-up: tests/ on ``sys.path`` (the spawned ranks import its helpers too), the xdist groups
the two workers share the suite by, and an autouse fixture that undoes what a test's in-process Lightning code
leaves in ``os.environ``."""

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


#: Files of independent smoke runs (no shared fixtures): each test is an xdist group of its own, so that the two
#: workers share these minutes-long runs instead of one worker taking the whole file.
SPREAD_FILES = frozenset({"test_entry_points.py"})


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Every test's xdist group (``--dist loadgroup`` in pyproject.toml): its file -- a module's fixtures then start
    their ranks once, on one worker -- or, in :data:`SPREAD_FILES`, the test itself."""
    for item in items:
        group = item.nodeid if item.path.name in SPREAD_FILES else item.nodeid.split("::", 1)[0]
        item.add_marker(pytest.mark.xdist_group(name=group))
