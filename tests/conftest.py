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


#: The pytest-xdist group every test that starts processes runs in (``--dist loadgroup``): one worker runs them
#: one after the other, as without xdist -- they time heartbeats, kills and restarts and size their ranks for the
#: machine's cores -- while the other workers take the single-process tests beside them.
RANK_STARTING_GROUP = "rank-starting"


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Under pytest-xdist (``-n 2 --dist loadgroup``), keep the rank-starting tests (``distributed``,
    ``entry_point``) on one worker; without xdist the marker does nothing."""
    for item in items:
        if item.get_closest_marker("distributed") or item.get_closest_marker("entry_point"):
            item.add_marker(pytest.mark.xdist_group(RANK_STARTING_GROUP))
