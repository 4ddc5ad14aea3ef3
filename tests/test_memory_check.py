"""The demo's memory check (examples/memory_check.py): a run whose CPU ranks cannot fit is refused
before any rank starts, with the estimate and a fix that does fit."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from lm_jobs import REPO, TRAIN_SCRIPT

from examples.memory_check import USABLE_FRACTION, check_fits_memory, estimate_per_rank_bytes
from examples.models import GPTConfig
from lightning_mics import MiCSTopology

GB = 1e9
#: the CPU trainer's layout: 4 ranks on one machine as 2 emulated nodes x 2, partition = one node
TOPOLOGY = MiCSTopology.create(4, 2, 2)
LAYOUT = dict(topology=TOPOLOGY, ranks_on_this_host=4)


def test_a_run_too_big_for_the_machine_is_refused_with_a_batch_size_that_fits() -> None:
    small = GPTConfig.preset("small")
    fix = r"needs ~\d+\.\d GB per rank .* use trainer=gpu or data\.batch_size=(\d+)"
    with pytest.raises(ValueError, match=fix) as err:
        check_fits_memory(small, 8, "32-true", **LAYOUT, on_gpu=False, available_bytes=24 * GB)
    suggested = int(str(err.value).split("data.batch_size=")[1].split()[0])
    assert 1 <= suggested < 8
    plan = check_fits_memory(small, suggested, "32-true", **LAYOUT, on_gpu=False, available_bytes=24 * GB)
    assert plan is not None and plan.fits and plan.needed_bytes <= USABLE_FRACTION * 24 * GB
    with pytest.raises(ValueError):  # the next size up is what did not fit
        check_fits_memory(small, suggested + 1, "32-true", **LAYOUT, on_gpu=False, available_bytes=24 * GB)


def test_estimate_grows_with_the_batch_and_shrinks_with_sharding_and_checkpointing() -> None:
    small = GPTConfig.preset("small")
    base = estimate_per_rank_bytes(small, 4, "32-true", TOPOLOGY)
    assert base is not None
    assert estimate_per_rank_bytes(small, 8, "32-true", TOPOLOGY) > base
    assert estimate_per_rank_bytes(small, 4, "32-true", MiCSTopology.create(4, 4, 4)) < base  # more shards
    assert estimate_per_rank_bytes(small, 4, "32-true", TOPOLOGY, activation_checkpointing=True) < base
    assert estimate_per_rank_bytes(small, 4, "bf16-mixed", TOPOLOGY) < base  # 16-bit activations
    assert estimate_per_rank_bytes(small, 4, "transformer-engine", TOPOLOGY) is None  # not modelled


def test_default_job_fits_and_gpu_runs_are_not_checked_here() -> None:
    tiny = GPTConfig.preset("tiny")
    plan = check_fits_memory(tiny, 8, "32-true", **LAYOUT, on_gpu=False, available_bytes=24 * GB)
    assert plan is not None and plan.fits and plan.per_rank_bytes < 1.5 * GB
    xl = GPTConfig.preset("xl")
    assert check_fits_memory(xl, 8, "bf16-mixed", **LAYOUT, on_gpu=True, available_bytes=1 * GB) is None


def test_main_job_refuses_before_launch_in_one_line(tmp_path: Path) -> None:
    # a 1.2B model in fp32 on 4 CPU ranks needs far more than any CI machine has
    command = [sys.executable, str(TRAIN_SCRIPT), "model=gpt_xl", f"hydra.run.dir={tmp_path}"]
    done = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=120)
    assert done.returncode != 0
    assert "Traceback" not in done.stderr
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("error: This run needs ~") and "trainer=gpu" in last
    assert "Initializing distributed" not in done.stdout + done.stderr  # refused before any rank started
