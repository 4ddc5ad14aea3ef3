"""Every benchmark and example a user runs, through its real main path, as a user starts it (a subprocess).

What other files already run end to end is not repeated here: the main job (``test_main_job.py``), the
LightningCLI (``test_cli.py``), the minimal script (``test_minimal_example.py``), the Hugging Face and litgpt
examples, ``gpu_throughput.py`` on CPU (``test_benchmark_gpu.py``), the plots and the memory check. Here: the
emulated-cluster and fault-tolerance benchmarks (root: network namespaces), the telemetry-cost benchmark and
the fault-tolerance demo, each in its smoke mode (seconds to two minutes), each checked on what it wrote.

A benchmark that crashes on main is a defect even when the library's tests pass: ``fault_tolerance.py`` did,
for a day, with nothing noticing. Marked ``entry_point`` (and ``distributed``): the fast loop skips them.
Every run is bounded; on a timeout its whole process group is killed.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from distributed import free_port
from lm_jobs import REPO

pytestmark = [pytest.mark.entry_point, pytest.mark.distributed]

needs_root = pytest.mark.skipif(
    not hasattr(os, "geteuid") or os.geteuid() != 0, reason="network namespaces need root (CI runs as root)"
)


def _run(*args: str, timeout: float) -> str:
    """``python <args>`` from the repository root; its output. The whole process group goes on a timeout."""
    process = subprocess.Popen(
        [sys.executable, *args], cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        start_new_session=True, env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    try:
        output, _ = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        output, _ = process.communicate()
        pytest.fail(f"{' '.join(args)} ran past {timeout} s:\n{output[-3000:]}")
    assert process.returncode == 0, f"{' '.join(args)} exited {process.returncode}:\n{output[-4000:]}"
    return output


@needs_root
@pytest.mark.timeout(400)
def test_fault_tolerance_benchmark_runs_its_main_path(tmp_path: Path) -> None:
    """Every run (plain, fault-tolerant, a node killed and restarted, restart from checkpoint), and the JSON
    keys the docs quote; the groups bit-identical and the rejoin healed bit-identically."""
    _run("benchmarks/fault_tolerance.py", "--smoke", "--output-dir", str(tmp_path), timeout=360)
    results = json.loads((tmp_path / "fault_tolerance.json").read_text())
    assert results["no_failure"]["max_abs_diff_between_groups"] == 0
    assert results["no_failure"]["overhead"] > 0
    assert results["failure"]["steps_discarded"] <= 1
    assert results["rejoin"]["bit_identical"] is True and results["rejoin"]["digests_compared"] > 0
    assert results["ft"]["seconds"] > 0 and results["restart_baseline"]["seconds"] > 0
    assert (tmp_path / "fault_tolerance.png").stat().st_size > 0


@needs_root
@pytest.mark.timeout(300)
def test_emulated_cluster_benchmark_runs_its_main_path(tmp_path: Path) -> None:
    """Namespaces, shaped links, the planner's layout trained for a step, bytes against the byte model."""
    output = _run(
        "benchmarks/emulated_cluster.py", "--quick", "--strategies", "mics-auto", "--steps", "1", "--warmup-steps",
        "0", "--output-dir", str(tmp_path), timeout=240,
    )
    (row,) = json.loads((tmp_path / "emulated_cluster.json").read_text())["results"]
    assert row["strategy"] == "mics-auto" and row["status"] == "ok", row.get("status")
    assert row["step_time_s"] > 0 and row["wire_floor_s"] > 0
    assert abs(row["inter_node_error"]) < 0.05  # measured inter-node bytes within 5 % of the byte model
    assert "| mics-auto |" in output


@pytest.mark.timeout(180)
def test_telemetry_cost_benchmark_runs_its_main_path(tmp_path: Path) -> None:
    table = tmp_path / "cost.json"
    _run("benchmarks/telemetry_cost.py", "--steps", "4", "--skip", "1", "--rounds", "1", "--json", str(table),
         timeout=150)
    rows = json.loads(table.read_text())["rows"]
    assert set(rows) == {"none", "sampled (default)", "every step"}
    assert all(row["steps"] > 0 and row["median_ms"] > 0 for row in rows.values())


@pytest.mark.timeout(240)
def test_fault_tolerance_demo_kills_and_restarts_a_group(tmp_path: Path) -> None:
    output = _run(
        "examples/fault_tolerance_demo.py", "--steps", "30", "--kill-after", "6", "--restart-after", "1",
        "--port", str(free_port()), "--out", str(tmp_path), "--timeout", "200", timeout=220,
    )
    assert "killed group 1" in output and "restarted group 1" in output
    assert "healed from a live group" in output, output[-2000:]
    assert (tmp_path / "fault_tolerance.png").stat().st_size > 0
