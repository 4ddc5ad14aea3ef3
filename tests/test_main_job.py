"""The real entry point, ``python examples/train.py``, on 2 CPU ranks for a few steps: it trains, logs, checkpoints
and prints its summary (the validation loss of the trained model's last step), and a refusal raised inside the ranks
prints as one line with the fix."""

from __future__ import annotations

import csv
import os
import subprocess
import sys
from pathlib import Path

import pytest
from lm_jobs import REPO, TRAIN_SCRIPT

pytestmark = pytest.mark.distributed  # every test here spawns rank processes

STEPS = 12


def test_main_job_trains_logs_checkpoints_and_summarises(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    command = [
        sys.executable,
        str(TRAIN_SCRIPT),
        f"hydra.run.dir={run_dir}",
        "trainer.devices=2",
        f"trainer.max_steps={STEPS}",
        "trainer.accumulate_grad_batches=1",
        "trainer.val_check_interval=5",  # validates at steps 5 and 10; the job validates once more at 12
        "trainer.limit_val_batches=2",
        "trainer.log_every_n_steps=1",
        "+trainer.enable_progress_bar=false",
        "model.warmup_steps=2",
        "model.learning_rate=0.01",
        "data.batch_size=4",
    ]
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    done = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=400)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-5000:]

    with open(run_dir / "logs" / "metrics.csv") as f:
        losses = [float(row["train/loss"]) for row in csv.DictReader(f) if row.get("train/loss")]
    assert len(losses) == STEPS
    assert losses[-1] < losses[0] - 0.5, losses  # from ~ln(256) = 5.5 towards the text's byte entropy

    checkpoints = list((run_dir / "checkpoints").iterdir())
    assert len(checkpoints) == 1 and any(checkpoints[0].iterdir()), checkpoints

    summary = (run_dir / "summary.txt").read_text()
    assert summary in done.stdout  # printed at the end, and kept with the run
    for expected in ("MiCS layout", "tokens/s", "model states per rank", "intra-partition", "checkpoint:", "plot:"):
        assert expected in summary
    assert f"(step {STEPS})" in summary.split("val loss", 1)[1].split(",")[0]  # the trained model's, not step 10's
    assert (run_dir / "logs" / "training.png").read_bytes().startswith(b"\x89PNG")  # next to metrics.csv
    assert (run_dir / ".hydra" / "config.yaml").is_file()  # Hydra's own record of the composed config

    # one voice: rank 1 says nothing at INFO level, and leaves no empty log file of its own
    output = done.stdout + done.stderr
    assert output.count("Initializing distributed") == 1, output[-3000:]
    assert output.count("MiCS layout") == 2  # the layout line, and the summary's copy of it
    assert not list(run_dir.glob("train_ddp_process_*.log"))


def test_a_refusal_raised_inside_the_ranks_prints_as_one_line_with_the_fix(tmp_path: Path) -> None:
    """The library refusing a setting once the ranks run (fault tolerance without a Lighthouse: known only when
    the group joins) ends the job with one line naming the fix; the traceback goes to the job's log file."""
    run_dir = tmp_path / "run"
    env = {k: v for k, v in os.environ.items() if k not in ("TORCHFT_LIGHTHOUSE", "HYDRA_FULL_ERROR")}
    command = [sys.executable, str(TRAIN_SCRIPT), f"hydra.run.dir={run_dir}", "trainer.devices=1", "cluster.ranks_per_node=1",
               "trainer.max_steps=1", "+trainer.enable_progress_bar=false",
               "strategy.fault_tolerance={replica_group: 0, num_replica_groups: 2}"]
    done = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode != 0
    output = done.stdout + done.stderr
    assert "Traceback" not in output, output[-3000:]
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("error: fault_tolerance needs the Lighthouse's address"), last
    assert "TORCHFT_LIGHTHOUSE" in last and "the traceback is in" in last
    log_file = Path(last.rsplit("the traceback is in ", 1)[1].rstrip(")"))
    assert "Traceback" in log_file.read_text() and log_file.is_relative_to(run_dir)
