"""Every benchmark and example not run end to end elsewhere, through its real main path, as a user starts it (a
subprocess, in its smoke mode), checked on what it printed and wrote: the fault-tolerance, telemetry-cost,
exact-sum and ring benchmarks, ``profile_breakdown.py`` and ``examples/plots.py`` (the emulated cluster's smoke runs
are in ``test_entry_points_emulated.py``).

A benchmark that crashes on main is a defect even when the library's tests pass: ``fault_tolerance.py`` did,
for a day, with nothing noticing. Each script here runs in its smoke mode (``--smoke``: the whole main path,
few steps, tiny settings) and is checked on what it printed or wrote, not only on its exit code.

Already run end to end elsewhere, so not repeated here:

* ``examples/train.py`` (the main job) -- ``test_main_job.py``; its memory refusal (``examples/memory_check.py``,
  a module of the main job, no script of its own) -- ``test_memory_check.py``;
* ``examples/cli.py`` -- ``test_cli.py``; ``examples/minimal.py`` -- ``test_minimal_example.py``;
* ``examples/hf_finetune.py`` -- ``test_hf_example.py``; ``examples/litgpt_fabric.py`` (the Fabric example) --
  ``test_litgpt_example.py`` (skipped without litgpt);
* ``benchmarks/gpu_throughput.py`` on CPU (both loops) and ``multi_gpu_summary.py`` -- ``test_benchmark_gpu.py``;
* ``examples/fault_tolerance_demo.py --smoke`` -- ``test_fault_tolerance_demo.py``.

The emulated cluster's own smoke runs (``emulated_cluster.py --smoke``, ``--smoke --scaling``, with
``compare_planner.py`` and ``profile_breakdown.py``) are in ``test_entry_points_emulated.py``: a file of their own,
so that the two pytest-xdist workers (``--dist loadfile``) share the minutes of smoke runs.

``benchmarks/exact_sum_cpu.py`` runs here too (hop 2's fault-tolerant sums over torchft's gloo group).
``benchmarks/netprobe.py`` and ``gloo_probe.py`` are the emulated cluster's own probes, started by it in every
node (its link rate is their measurement), so its smoke runs cover them; ``scaling.py`` is the ``--scaling``
mode's module. Marked ``entry_point`` (and ``distributed`` where ranks are started): the fast loop skips
them. Every run is bounded; on a timeout its whole process group (it and every rank it started) is killed.
"""

from __future__ import annotations

import csv
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
from lm_jobs import REPO, needs_root, run_from_repo

pytestmark = pytest.mark.entry_point



# ------------------------------------------------------------------------------------ emulated cluster
@needs_root
@pytest.mark.distributed
@pytest.mark.timeout(450)
def test_fault_tolerance_benchmark_runs_its_main_path(tmp_path: Path) -> None:
    """Every run (plain, fault-tolerant, a node killed and restarted, restart from checkpoint), and the JSON
    keys the docs quote; the groups bit-identical and the rejoin healed bit-identically. About 90 s here; the
    bound leaves room for a host like CI's, where it took 231 s."""
    output = run_from_repo("benchmarks/fault_tolerance.py", "--smoke", "--output-dir", str(tmp_path), timeout=420)
    results = json.loads((tmp_path / "fault_tolerance.json").read_text())
    assert results["no_failure"]["max_abs_diff_between_groups"] == 0
    assert results["no_failure"]["overhead"] > 0
    assert results["failure"]["steps_discarded"] <= 1
    assert results["rejoin"]["bit_identical"] is True and results["rejoin"]["digests_compared"] > 0, results["rejoin"]
    trajectory = results["trajectory"]  # the failure run read what the failure-free one did, step for step
    assert trajectory["samples_skipped"] == 0 and trajectory["samples_repeated"] == 0, trajectory
    assert trajectory["global_batch_constant"] is True and trajectory["steps_compared"] > 0, trajectory
    assert results["ft"]["seconds"] > 0 and results["restart_baseline"]["seconds"] > 0
    assert results["network"]["inter_node_rate_bytes_per_s"] > 0  # the links came from set_up_network
    assert (tmp_path / "fault_tolerance.png").stat().st_size > 0
    assert "| rejoin: bit-identical to the survivors | True (" in output


# ------------------------------------------------------------------------------------ other benchmarks
@pytest.mark.distributed
@pytest.mark.timeout(180)
def test_telemetry_cost_benchmark_runs_its_main_path(tmp_path: Path) -> None:
    table = tmp_path / "cost.json"
    output = run_from_repo("benchmarks/telemetry_cost.py", "--smoke", "--json", str(table), timeout=150)
    rows = json.loads(table.read_text())["rows"]
    assert set(rows) == {"none", "sampled (default)", "every step"}
    assert all(row["steps"] > 0 and row["median_ms"] > 0 for row in rows.values())
    assert "every step" in output.splitlines()[-1]  # the printed table ends with the last variant


@pytest.mark.distributed
@pytest.mark.timeout(150)
def test_exact_sum_cpu_benchmark_times_every_variant(tmp_path: Path) -> None:
    output = run_from_repo("benchmarks/exact_sum_cpu.py", "--smoke", "--messages", "3", "--numel", "1000",
                  "--output", str(tmp_path / "cpu.json"), timeout=130)
    variants = json.loads((tmp_path / "cpu.json").read_text())["variants"]
    assert set(variants) == {"all_reduce", "chain", "one_gather"}, output[-2000:]
    assert all(v["cpu_ms_per_step_per_rank"] > 0 and v["slowest_wall_ms_per_step"] > 0 for v in variants.values())
    # the main thread's share (the training step's critical path) is part of the process's CPU
    assert all(0 < v["main_thread_cpu_ms_per_step_per_rank"] <= v["cpu_ms_per_step_per_rank"] for v in variants.values())
    assert variants["all_reduce"]["cpu_vs_all_reduce"] == 1.0
    assert "chain" in output and "x all_reduce" in output


@pytest.mark.distributed
@pytest.mark.timeout(120)
def test_ring_reduce_scatter_benchmark_checks_and_times_both(tmp_path: Path) -> None:
    output = run_from_repo("benchmarks/ring_reduce_scatter.py", "--ranks", "2", "--sizes-kb", "16", "--repeats", "2",
                  timeout=100)
    row = re.search(r"^\s*2\s+16\s+(\S+)\s+(\S+)\s+(\S+)x$", output, re.MULTILINE)
    assert row is not None, output[-2000:]
    assert float(row.group(1)) > 0 and float(row.group(2)) > 0


def test_profile_breakdown_reads_py_spy_profiles_from_the_command_line(tmp_path: Path) -> None:
    """The script as the docs run it, on two raw py-spy files (the emulated smoke feeds it real ones where
    py-spy is installed): one column per file, named by its stem; a file without samples is one clear error."""
    loop = "run (lightning/pytorch/loops/training_epoch_loop.py:140)"
    samples = {
        "mics": [(f"{loop};forward (examples/models/gpt.py:80)", 30),
                 (f"{loop};step (torch/distributed/_ring.py:1);ring_reduce_scatter (lightning_mics/x.py:2)", 10)],
        "ddp": [(f"{loop};forward (examples/models/gpt.py:80)", 20), (f"{loop};all_reduce (torch/c10d.py:3)", 20)],
    }
    for name, lines in samples.items():
        (tmp_path / f"{name}.txt").write_text("".join(f"{stack} {count}\n" for stack, count in lines))
    table = run_from_repo("benchmarks/profile_breakdown.py", str(tmp_path / "mics.txt"), str(tmp_path / "ddp.txt"),
                 timeout=60)
    assert table.splitlines()[0] == "| where the time goes | mics | ddp |"
    assert "| forward compute | 75% | 50% |" in table
    assert "| ring reduce-scatter (ours, gloo send/recv) | 25% | 0% |" in table
    assert "| all-reduce | 0% | 50% |" in table
    (tmp_path / "empty.txt").write_text("")
    done = subprocess.run([sys.executable, "benchmarks/profile_breakdown.py", str(tmp_path / "empty.txt")],
                          cwd=REPO, capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and "holds no py-spy samples" in done.stderr


# ------------------------------------------------------------------------------------ examples
@pytest.mark.timeout(120)
def test_plots_script_draws_a_run_log(tmp_path: Path) -> None:
    """``python examples/plots.py metrics.csv``, as the main job's docs redraw a finished run's plot."""
    pytest.importorskip("matplotlib")
    metrics = tmp_path / "metrics.csv"
    with metrics.open("w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=["step", "train/loss", "perf/tokens_per_s"])
        writer.writeheader()
        writer.writerows({"step": s, "train/loss": 5.0 - s / 10, "perf/tokens_per_s": 1000 + s} for s in range(6))
    output = run_from_repo("examples/plots.py", str(metrics), timeout=100)
    assert output.strip().splitlines()[-1] == str(tmp_path / "training.png")
    assert (tmp_path / "training.png").read_bytes().startswith(b"\x89PNG")
