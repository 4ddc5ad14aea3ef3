"""A Hugging Face model end to end: ``python examples/hf_finetune.py`` on 4 CPU ranks (2 emulated
nodes), skipped without the ``hf`` extra."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from lm_jobs import REPO

pytestmark = pytest.mark.distributed  # the script starts rank processes
pytest.importorskip("transformers", reason="the hf extra (pip install -e '.[hf]') is not installed")


def test_gpt2_blocks_are_found_the_loss_falls_and_the_weights_go_back_to_transformers(tmp_path: Path) -> None:
    command = [sys.executable, str(REPO / "examples" / "hf_finetune.py"), "--out", str(tmp_path), "--steps", "25"]
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    done = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=500)
    output = done.stdout + done.stderr
    assert done.returncode == 0, output[-5000:]
    # default wrapping: GPT-2's 2 blocks (transformer.h, an nn.ModuleList) + the root
    assert "; 3 FSDP units" in output, output[-3000:]
    first, last = map(float, re.search(r"train loss \(rank 0\): ([\d.]+) \(step 1\) -> ([\d.]+)", output).groups())
    assert last < first - 1.0  # from ~ln(256) = 5.5
    sharded, reloaded = map(float, re.search(r"sharded run ([\d.]+), reloaded with from_pretrained ([\d.]+)", output).groups())
    assert reloaded == pytest.approx(sharded, rel=1e-4)
    assert (tmp_path / "hf" / "config.json").is_file() and (tmp_path / "model.pt").is_file()
