"""``examples/minimal.py`` -- the README's Quick usage as one complete script -- runs as a user would start it,
and the library's start-up lines show on the console with no logging set up: the layout once (rank 0), and for
``mics_auto`` the planner's choice once, like Lightning's own ``GPU available`` line."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from lm_jobs import REPO


def _run(*args: str) -> str:
    env = {key: value for key, value in os.environ.items() if not key.startswith(("PYTEST_", "LOCAL_RANK"))}
    done = subprocess.run(
        [sys.executable, "examples/minimal.py", *args], cwd=REPO, env=env, capture_output=True, text=True,
        timeout=300, start_new_session=True,
    )
    output = done.stdout + done.stderr
    assert done.returncode == 0, output[-4000:]
    return output


@pytest.mark.distributed
@pytest.mark.timeout(420)
def test_the_minimal_script_trains_and_shows_its_layout_without_logging_set_up() -> None:
    output = _run()
    assert output.count("MiCS layout: ") == 1, output[-3000:]
    assert output.count("GPU available") == 1  # Lightning's own line, for comparison
    assert output.count("final train_loss: ") == 1
    planned = _run("mics_auto")
    assert planned.count("planner chose ") == 1 and planned.count("MiCS layout: ") == 1, planned[-3000:]
    assert "grad_accumulation=sharded (grad_accumulation=" not in planned  # the reason does not nest itself
