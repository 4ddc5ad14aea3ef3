"""``benchmarks/gpu_throughput.py`` runs end to end on CPU, so a GPU session only has to measure.

The smoke test runs the exact CPU command of the script's docstring in a fresh process (the strategy
mode initialises a process group and sets launcher variables, which must not leak into this pytest
process). Beyond "it runs", it checks what makes the comparison meaningful: both loops train the same
model on the same batches, so their losses agree step for step to bf16 precision.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:  # `benchmarks` is a folder of the repository, not an installed package
    sys.path.insert(0, str(REPO))

from benchmarks import gpu_throughput  # noqa: E402


@pytest.fixture(scope="module")
def smoke(tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("gpu_throughput") / "out.json"
    command = [sys.executable, "benchmarks/gpu_throughput.py", "--device", "cpu", "--model", "tiny", "--steps", "3"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}  # a smoke test, on a machine other jobs share
    done = subprocess.run(
        [*command, "--json", str(out)], cwd=REPO, env=env, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, f"stdout:\n{done.stdout}\nstderr:\n{done.stderr}"
    assert "throughput strategy/plain:" in done.stdout
    return json.loads(out.read_text())


@pytest.mark.distributed
def test_cpu_smoke_run_measures_both_loops(smoke):
    results = {r["mode"]: r for r in smoke["results"]}
    assert list(results) == ["plain", "strategy"]  # compiled modes are opt-in on CPU
    for r in results.values():
        assert r["status"] == "ok", r["detail"]
        assert r["steps_timed"] == 3 and r["tokens_per_s"] > 0
        assert r["mfu"] is None and r["peak_memory_bytes"] is None  # no meaningful peak or CUDA allocator on CPU
    assert set(smoke["ratios"]) == {"strategy/plain"}
    assert smoke["model"]["tokens_per_step"] == 8 * 128
    assert smoke["targets"]["strategy_mfu_met"] is None


@pytest.mark.distributed
def test_both_loops_train_the_same_model_on_the_same_batches(smoke):
    plain, strategy = (next(r for r in smoke["results"] if r["mode"] == m) for m in ("plain", "strategy"))
    for key in ("first_loss", "last_loss"):  # FSDP2's bf16 parameters vs autocast's casts: ~1e-5 apart
        assert strategy[key] == pytest.approx(plain[key], rel=1e-3)


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--warmup", "0"], "--warmup must be >= 1"),
        (["--modes", "plain,fast"], "Unknown mode"),
        (["--model", "huge"], "Unknown GPT size"),
    ],
)
def test_bad_arguments_are_one_clear_error(argv, message, capsys):
    with pytest.raises(SystemExit):
        gpu_throughput.parse_args(argv)
    assert message in capsys.readouterr().err


def test_defaults_are_the_issue_setting():
    cfg, path = gpu_throughput.parse_args([])
    gpt = cfg.gpt
    assert (gpt.d_model, gpt.n_layers, gpt.n_heads, gpt.seq_len, cfg.micro_batch) == (2048, 24, 16, 2048, 8)
    assert cfg.modes == ("plain", "strategy", "plain-compiled", "strategy-compiled")
    assert path == REPO / "benchmarks" / "results" / "gpu_throughput.json"
    # a CPU (smoke) run never lands on the GPU result
    assert gpu_throughput.parse_args(["--device", "cpu"])[1] == REPO / "benchmarks" / "results" / "gpu_throughput_cpu.json"
    assert gpu_throughput.parse_args(["--device", "cpu"])[0].modes == ("plain", "strategy")
