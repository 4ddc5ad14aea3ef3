"""``benchmarks/gpu_throughput.py`` runs end to end on CPU (both loops on the same batches), so a GPU session only
has to measure; its argument errors, ``run_on_gpu.sh multi`` refusing fewer than 2 GPUs, and the multi-GPU summary
failing on a failed check or a missing report.

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

from benchmarks import gpu_throughput

REPO = Path(__file__).resolve().parents[1]


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
        (["--devices", "2", "--modes", "plain,strategy"], "torchrun --nproc-per-node=2"),
        (["--devices", "2", "--device", "cpu"], "runs only the strategy modes on CUDA"),
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


def test_all_gpus_run_the_strategy_modes_and_count_the_jobs_tokens():
    """``--devices N`` (``run_on_gpu.sh multi``): strategy modes by default, tokens of all N ranks per step."""
    cfg, _ = gpu_throughput.parse_args(["--devices", "4"])
    single, _ = gpu_throughput.parse_args([])
    assert cfg.modes == ("strategy", "strategy-compiled")
    assert cfg.tokens_per_step == 4 * single.tokens_per_step


def test_multi_stage_refuses_fewer_than_two_gpus(tmp_path):
    """``run_on_gpu.sh multi`` on a machine without 2 GPUs: one clear message, exit 2, nothing run."""
    import torch

    if torch.cuda.is_available() and torch.cuda.device_count() >= 2:
        pytest.skip("this machine has >= 2 GPUs: the stage would run")
    env = {**os.environ, "OUT": str(tmp_path), "PYTHON": sys.executable}
    done = subprocess.run(
        ["bash", "benchmarks/run_on_gpu.sh", "multi"], cwd=REPO, env=env, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 2, done.stderr
    assert "needs at least 2 visible GPUs" in done.stderr and not (tmp_path / "multi_tests.log").exists()


def test_multi_summary_is_one_table_and_fails_on_a_failed_check(tmp_path):
    from benchmarks import multi_gpu_summary

    junit = tmp_path / "tests.xml"
    junit.write_text(
        '<testsuites><testsuite><testcase name="a"/><testcase name="b"><failure message="x"/></testcase>'
        '<testcase name="c"><skipped message="no GPUs"/></testcase></testsuite></testsuites>'
    )
    document = tmp_path / "bench.json"
    result = {"mode": "strategy", "status": "ok", "tokens_per_s": 1234.0, "mfu": 0.5, "peak_memory_bytes": 2**31}
    document.write_text(json.dumps({"results": [result]}))
    assert multi_gpu_summary.junit_rows(junit) == [("a", "passed"), ("b", "FAILED"), ("c", "skipped: no GPUs")]
    assert multi_gpu_summary.benchmark_rows(document) == [
        ("benchmark strategy", "1,234 tokens/s, MFU 50.0%/GPU, peak 2.0 GiB/GPU")
    ]
    assert multi_gpu_summary.main([str(junit), str(document), "2"]) == 1  # b failed
    assert multi_gpu_summary.main([str(tmp_path / "none.xml"), str(document), "2"]) == 1  # no report
