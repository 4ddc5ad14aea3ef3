"""A litgpt model end to end under ``Fabric(strategy="mics")``: ``python examples/litgpt_fabric.py``
on 4 CPU ranks (2 emulated nodes x 2), skipped without the ``litgpt`` extra (CI does not install it:
litgpt pins versions of jsonargparse and huggingface-hub that could clash with the ``dev`` extra)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("litgpt", reason="the litgpt extra (pip install -e '.[litgpt]') is not installed")

import torch  # noqa: E402
from lm_jobs import REPO  # noqa: E402

from examples import litgpt_fabric  # noqa: E402

pytestmark = pytest.mark.distributed  # the script starts rank processes

LAYERS = 2
STEPS = 10


def test_litgpt_blocks_are_found_the_loss_falls_and_the_weights_load_strictly_into_litgpt(tmp_path: Path) -> None:
    argv = [
        "--out",
        str(tmp_path),
        "--devices",
        "4",
        "--steps",
        str(STEPS),
        "--accumulate",
        "2",
        "--layers",
        str(LAYERS),
    ]
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    done = subprocess.run(
        [sys.executable, str(REPO / "examples" / "litgpt_fabric.py"), *argv],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    output = done.stdout + done.stderr
    assert done.returncode == 0, output[-5000:]
    # default wrapping: litgpt's blocks (GPT.transformer.h, an nn.ModuleList), one unit each, + the root
    assert f"; {LAYERS + 1} FSDP units" in output, output[-3000:]
    assert "partition_size=2, replicas=2" in output, output[-3000:]  # 2 emulated nodes x 2 ranks
    losses = [float(x) for x in re.findall(r"^step \d+: loss ([\d.]+)", output, flags=re.MULTILINE)]
    assert len(losses) == STEPS, output[-3000:]
    assert losses[-1] < losses[0] - 1.0  # from ~ln(256) = 5.5
    sharded = float(re.search(r"fixed-batch loss: sharded run ([\d.]+)", output).group(1))

    # here, independently of the script: a fresh, unsharded litgpt.GPT takes the consolidated weights
    # with strict=True (the checkpoint keeps litgpt's own key names) and gives the sharded run's loss
    args = litgpt_fabric.parse_args(argv)
    plain = litgpt_fabric.GPT(litgpt_fabric.litgpt_config(args))
    state = torch.load(tmp_path / "model.pt", weights_only=True)
    assert set(state) == set(plain.state_dict())
    plain.load_state_dict(state, strict=True)
    inputs, targets = litgpt_fabric.fixed_batch(litgpt_fabric.corpus_split()[1], args.seq_len, args.micro_batch)
    with torch.no_grad():
        reloaded = float(litgpt_fabric.lm_loss(plain.eval(), inputs, targets))
    assert reloaded == pytest.approx(sharded, abs=1e-5)
    assert (tmp_path / "last.ckpt" / "mics_checkpoint.json").is_file()  # the sharded checkpoint directory
