"""The emulated cluster's ``--convergence`` mode (``benchmarks/convergence.py``): the Markov-chain data, the curve
analysis (trailing mean, time to a loss, the ratios against mics-auto, the headline row), the report, its table and
chart, and the command line -- on synthetic records, without root. The last test runs ``--convergence --smoke`` end
to end (root, ranks in network namespaces)."""

from __future__ import annotations

import itertools
import json
import math
import os
import subprocess
import sys
from pathlib import Path
from typing import Any, Optional

import pytest
from distributed import end_session

from benchmarks import convergence, emulated_cluster
from benchmarks.convergence import (
    ConvergenceSettings,
    MarkovChain,
    SequenceDataset,
    build_convergence_report,
    compare_runs,
    headline,
    smoothed,
    time_to_loss,
)

REPO = Path(__file__).resolve().parents[1]


# ------------------------------------------------------------------------------------------------ data
def test_markov_chain_is_learnable_and_reproducible() -> None:
    chain = MarkovChain(vocab=32, successors=4, seed=3)
    assert chain.table.sum(1).tolist() == pytest.approx([1.0] * 32)
    assert ((chain.table > 0).sum(1) == 4).all()
    assert chain.stationary.sum().item() == pytest.approx(1.0)
    assert (chain.stationary @ chain.table).tolist() == pytest.approx(chain.stationary.tolist(), abs=1e-9)
    # the floor lies well below a uniform guess over the vocabulary, and at most ln(successors)
    assert 0.3 < chain.entropy_rate <= math.log(4) + 1e-9 < math.log(32)
    a, b = chain.sample(64, 9, seed=7), chain.sample(64, 9, seed=7)
    assert a.equal(b) and not a.equal(chain.sample(64, 9, seed=8))
    assert all(chain.table[x, y] > 0 for row in a.tolist() for x, y in itertools.pairwise(row))  # only allowed moves
    inputs, targets = SequenceDataset(a)[5]
    assert inputs.tolist() == a[5, :-1].tolist() and targets.tolist() == a[5, 1:].tolist()


def test_same_chain_for_every_strategy() -> None:
    """The workers build the chain from the settings alone: every row trains on the same table and samples."""
    settings = ConvergenceSettings(steps=8)
    one = MarkovChain(256, settings.successors, settings.data_seed)
    two = MarkovChain(256, settings.successors, settings.data_seed)
    assert one.table.equal(two.table) and one.entropy_rate == two.entropy_rate


# ------------------------------------------------------------------------------------------------ curves
def test_trailing_mean() -> None:
    assert smoothed([4.0, 2.0, 3.0, 1.0], 2) == [4.0, 3.0, 2.5, 2.0]
    assert smoothed([5.0, 1.0], 10) == [5.0, 3.0]
    with pytest.raises(ValueError, match="window"):
        smoothed([1.0], 0)


def test_time_to_loss_interpolates_between_the_steps_around_the_crossing() -> None:
    times, losses = [1.0, 2.0, 3.0, 4.0], [5.0, 4.0, 2.0, 1.0]
    assert time_to_loss(times, losses, 3.0) == pytest.approx(2.5)  # halfway from 4.0 (t=2) to 2.0 (t=3)
    assert time_to_loss(times, losses, 2.0) == pytest.approx(3.0)  # reached exactly
    assert time_to_loss(times, losses, 6.0) == 1.0  # already below at the first step
    assert time_to_loss(times, losses, 0.5) is None  # never within the budget
    assert time_to_loss(times, [5.0, 3.0, 3.0, 2.0], 3.0) == pytest.approx(2.0)
    with pytest.raises(ValueError, match="x values"):
        time_to_loss([1.0], [1.0, 2.0], 1.0)


def run(name: str, losses: list[float], seconds_per_step: float, heldout: Optional[float],
        sync_every: Optional[int] = None, tokens_per_step: int = 100) -> dict[str, Any]:
    """A worker's record of a ``--convergence`` row: one loss and end time per optimizer step."""
    return {
        "strategy": name, "status": "ok", "sync_every": sync_every, "tokens_per_step": tokens_per_step,
        "steps": [{"step": i + 1, "time_s": (i + 1) * seconds_per_step, "loss": loss} for i, loss in enumerate(losses)],
        "heldout_loss": heldout, "inter_node_bytes": 1e6, "expected_inter_node_bytes": 1e6,
    }


#: mics-auto: 1 s a step, loss 10 -> 1 over 10 steps (window 1: the raw curve)
REFERENCE = run("mics-auto", [10.0 - i for i in range(10)], 1.0, heldout=2.0)


def test_ratios_against_mics_auto() -> None:
    fast = run("mics-diloco", [10.0 - 1.5 * i for i in range(10)], 0.25, heldout=2.06, sync_every=8)
    slow = run("mics-diloco-h32", [10.0 - 0.5 * i for i in range(10)], 0.2, heldout=3.0, sync_every=32)
    ddp = run("ddp", [10.0 - i for i in range(10)], 1.5, heldout=2.0)
    failed = {"strategy": "zero3", "status": "failed: timed out"}
    rows = {r["strategy"]: r for r in compare_runs([REFERENCE, fast, slow, ddp, failed], window=1)}
    ref = rows["mics-auto"]
    assert ref["time_to_sync_final_loss_ratio"] == pytest.approx(1.0, rel=1e-3) and ref["final_loss_ratio"] == 1.0
    # mics-auto ends at loss 1.0 after 10 s; the fast row reaches 1.0 at step 7 (t = 1.75 s): ratio 0.175
    assert rows["mics-diloco"]["reference_final_loss"] == 1.0
    assert rows["mics-diloco"]["time_to_reference_loss_s"] == pytest.approx(1.75, rel=1e-3)  # (1e-4 tolerance)
    assert rows["mics-diloco"]["tokens_to_reference_loss"] == pytest.approx(700, rel=1e-3)
    assert rows["mics-diloco"]["time_to_sync_final_loss_ratio"] == pytest.approx(0.175, rel=1e-3)
    assert rows["mics-diloco"]["final_loss_ratio"] == pytest.approx(1.03)
    assert rows["mics-diloco"]["wall_ratio"] == pytest.approx(0.25)
    assert rows["mics-diloco-h32"]["time_to_sync_final_loss_ratio"] is None  # ends at 5.5: never reaches 1.0
    assert rows["ddp"]["time_to_sync_final_loss_ratio"] == pytest.approx(1.5, rel=1e-3)
    assert rows["zero3"] == {"strategy": "zero3", "status": "failed: timed out"}

    top = headline(list(rows.values()))
    assert top["headline_strategy"] == "mics-diloco"  # a semi-synchronous row, not DDP
    assert top["time_to_sync_final_loss_ratio"] == pytest.approx(0.175, rel=1e-3)
    assert top["final_loss_ratio"] == pytest.approx(1.03)  # from the same row
    assert top["targets_met"] == {"time_to_sync_final_loss_ratio": True, "final_loss_ratio": True}


def test_the_same_trajectory_to_fp32_rounding_reaches_the_reference_loss() -> None:
    """DDP and mics-auto train the same trajectory, ~1e-7 apart: that is "reached", not "never"."""
    twin = run("ddp", [10.0 - i + 1e-7 for i in range(10)], 1.4, heldout=2.0)
    row = compare_runs([REFERENCE, twin], window=1)[1]
    assert row["time_to_sync_final_loss_ratio"] == pytest.approx(1.4, rel=1e-3)
    assert compare_runs([REFERENCE, run("x", [1.001] * 10, 1.0, heldout=2.0)], window=1)[1][
        "time_to_reference_loss_s"] is None  # 1e-3 above is not


def test_reanalysis_recomputes_from_the_records(tmp_path: Path) -> None:
    """``python benchmarks/convergence.py convergence.json`` recomputes the analysis from the unchanged records."""
    fast = run("mics-diloco", [10.0 - 1.5 * i for i in range(10)], 0.25, heldout=2.06, sync_every=8)
    points = [{"bandwidth_ratio": 240.0, "network": {"inter_node_rate_bytes_per_s": 8e6}, "runs": [REFERENCE, fast]}]
    report = build_convergence_report(points, "cmd", {"window": 1, "entropy_rate": 1.0}, window=1)
    report["date_utc"] = "then"
    report["time_to_sync_final_loss_ratio"] = 0.9  # as an older analysis might have written it
    path = tmp_path / "convergence.json"
    path.write_text(json.dumps(report))
    assert convergence.main([str(path)]) == 0
    again = json.loads(path.read_text())
    assert again["time_to_sync_final_loss_ratio"] == pytest.approx(0.175, rel=1e-3) and again["date_utc"] == "then"
    assert again["points"][0]["runs"] == report["points"][0]["runs"]


def test_smoothing_decides_the_reference_loss() -> None:
    """The target is mics-auto's final *trailing mean*, so one lucky last batch does not set it."""
    noisy = run("mics-auto", [4.0, 3.0, 2.0, 2.2, 1.8, 2.4, 1.0], 1.0, heldout=2.0)
    row = compare_runs([noisy], window=3)[0]
    assert row["final_train_loss"] == pytest.approx((1.8 + 2.4 + 1.0) / 3)


def test_headline_without_a_row_that_reaches_the_loss() -> None:
    """No semi-synchronous row reaches mics-auto's final loss: the time ratio is null (target not met) and the
    headline row is the one with the lowest held-out loss ratio."""
    a = run("mics-diloco", [10.0] * 10, 0.2, heldout=2.5, sync_every=8)
    b = run("mics-diloco-h32", [9.0] * 10, 0.2, heldout=2.2, sync_every=32)
    top = headline(compare_runs([REFERENCE, a, b], window=1))
    assert top["headline_strategy"] == "mics-diloco-h32"
    assert top["time_to_sync_final_loss_ratio"] is None and top["final_loss_ratio"] == pytest.approx(1.1)
    assert top["targets_met"] == {"time_to_sync_final_loss_ratio": False, "final_loss_ratio": False}
    none = headline(compare_runs([REFERENCE], window=1))
    assert none["headline_strategy"] is None and none["time_to_sync_final_loss_ratio"] is None


def test_without_a_reference_nothing_is_compared() -> None:
    rows = compare_runs([run("mics-diloco", [3.0, 2.0], 0.2, heldout=2.0, sync_every=2)], window=1)
    assert "time_to_sync_final_loss_ratio" not in rows[0] and rows[0]["final_train_loss"] == 2.0


def test_report_table_and_chart(tmp_path: Path) -> None:
    fast = run("mics-diloco", [10.0 - 1.5 * i for i in range(10)], 0.25, heldout=2.06, sync_every=8)
    slow = run("mics-diloco-h32", [10.0 - 0.5 * i for i in range(10)], 0.2, heldout=3.0, sync_every=32)
    network = {"inter_node_rate_bytes_per_s": 8e6}
    points = [{"bandwidth_ratio": 240.0, "network": network, "runs": [REFERENCE, fast]},
              {"bandwidth_ratio": 24.0, "network": network, "runs": [REFERENCE, slow]}]
    report = build_convergence_report(points, "python benchmarks/emulated_cluster.py --convergence",
                                      {"window": 1, "entropy_rate": 1.0}, window=1)
    # the top-level keys are the first (headline) ratio's
    assert report["headline_bandwidth_ratio"] == 240.0 and report["headline_strategy"] == "mics-diloco"
    assert report["time_to_sync_final_loss_ratio"] == pytest.approx(0.175, rel=1e-3)
    assert report["points"][1]["headline"]["time_to_sync_final_loss_ratio"] is None
    assert set(report["definitions"]) >= {"time_to_sync_final_loss_ratio", "final_loss_ratio", "loss"}
    json.dumps(report)  # what convergence.json holds

    text = convergence.format_convergence_table(report)
    assert "mics-diloco (semi-sync, H=8)" in text and "not reached" in text
    markdown = convergence.format_convergence_table(report, markdown=True)
    assert "| 240 | mics-diloco (semi-sync, H=8) | 2 | 0.25 |" in markdown
    pytest.importorskip("matplotlib")
    chart = convergence.draw_convergence(report, tmp_path / "convergence.png")
    assert chart is not None and chart.stat().st_size > 0


# ------------------------------------------------------------------------------------------------ settings and flags
def test_budget_must_be_whole_diloco_rounds() -> None:
    ConvergenceSettings(steps=64).check([8, 32], world_size=4)
    with pytest.raises(ValueError, match=r"not a multiple of sync_every \[32\].*multiple of 32"):
        ConvergenceSettings(steps=48).check([8, 32], world_size=4)
    with pytest.raises(ValueError, match="split evenly over 3 ranks"):
        ConvergenceSettings(steps=8).check([], world_size=3)
    with pytest.raises(ValueError, match="steps must be a positive int"):
        ConvergenceSettings(steps=0)


def test_convergence_defaults() -> None:
    args = emulated_cluster.parse_args(["--convergence"])
    assert [s.name for s in args.specs] == list(convergence.CONVERGENCE_STRATEGIES)
    assert [s.sync_every for s in args.specs] == [None, None, 8, 32]
    assert (args.cluster.num_nodes, args.cluster.ranks_per_node) == (2, 2)
    assert args.ratios == (240.0, 24.0) and args.setup.micro_batch == emulated_cluster.CONVERGENCE_MICRO_BATCH
    assert args.convergence_settings.steps == emulated_cluster.CONVERGENCE.measured_steps
    assert args.setup.model.d_model == emulated_cluster.QUICK.d_model  # --quick's model
    assert args.output_dir == emulated_cluster.RESULTS_DIR
    smoke = emulated_cluster.parse_args(["--convergence", "--smoke"])
    assert [s.name for s in smoke.specs] == list(convergence.SMOKE_CONVERGENCE_STRATEGIES)
    assert smoke.ratios == (240.0,) and smoke.output_dir == emulated_cluster.RESULTS_DIR / "convergence_smoke"
    tuned = emulated_cluster.parse_args(["--convergence", "--outer-lr", "0.3", "--convergence-ratios", "24"])
    assert [s.outer_lr for s in tuned.specs] == [None, None, 0.3, 0.3] and tuned.ratios == (24.0,)
    assert emulated_cluster.parse_args([]).setup.micro_batch == 1  # the throughput rows keep theirs


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--convergence", "--steps", "44"], "not a multiple of sync_every [8, 32]"),
        (["--convergence", "--quick"], "--convergence and --quick exclude each other"),
        (["--convergence", "--scaling"], "--convergence and --scaling exclude each other"),
        (["--convergence", "--bandwidth-ratio", "240"], "give the ratios with --convergence-ratios"),
        (["--convergence", "--warmup-steps", "1"], "--lr-warmup"),
        (["--convergence", "--strategies", "ddp,mics-diloco"], "add it to --strategies"),
        (["--convergence", "--convergence-ratios", "24,x"], "distinct comma-separated positive numbers"),
        (["--convergence", "--lr", "0"], "--lr must be positive"),
        (["--convergence-ratios", "24"], "only applies with --convergence"),
        (["--strategies", "mics-diloco", "--outer-lr", "-1"], "must be positive"),
    ],
)
def test_bad_convergence_arguments_get_one_clear_error(argv: list[str], message: str,
                                                       capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        emulated_cluster.parse_args(argv)
    assert message in capsys.readouterr().err


# ------------------------------------------------------------------------------------------------ end to end
@pytest.mark.entry_point
@pytest.mark.distributed
@pytest.mark.timeout(360)
@pytest.mark.skipif(not hasattr(os, "geteuid") or os.geteuid() != 0,
                    reason="the emulated cluster's network namespaces, veths and tc need root (CI runs as root)")
def test_convergence_smoke_runs_every_row_and_writes_the_report(tmp_path: Path) -> None:
    """``--convergence --smoke`` as a user starts it: every row trains, mics-auto and DDP follow the same
    trajectory (both synchronous, same samples), the DiLoCo row's bytes are 1/H of the synchronous ones as the
    byte model says, and convergence.json carries the two top-level keys."""
    process = subprocess.Popen(
        [sys.executable, "benchmarks/emulated_cluster.py", "--convergence", "--smoke", "--output-dir", str(tmp_path)],
        cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True,
    )
    try:
        output, _ = process.communicate(timeout=330)
    except subprocess.TimeoutExpired:
        output = end_session(process)
        pytest.fail(f"--convergence --smoke ran past 330 s:\n{output[-3000:]}")
    assert process.returncode == 0, output[-4000:]
    report = json.loads((tmp_path / "convergence.json").read_text())
    assert {"time_to_sync_final_loss_ratio", "final_loss_ratio", "headline_strategy"} <= set(report)
    (point,) = report["points"]
    runs = {r["strategy"]: r for r in point["runs"]}
    assert list(runs) == list(convergence.SMOKE_CONVERGENCE_STRATEGIES)
    for name, r in runs.items():
        assert r["status"] == "ok", (name, r["status"])
        assert len(r["steps"]) == report["settings"]["steps"] and r["heldout_loss"] > 0
        assert abs(r["inter_node_error"]) < 0.05, (name, r["inter_node_error"])
        assert r["steps"][-1]["loss"] < r["steps"][0]["loss"]  # it learns
    auto, ddp = ([s["loss"] for s in runs[n]["steps"]] for n in ("mics-auto", "ddp"))
    assert auto == pytest.approx(ddp, abs=1e-3)
    assert runs["mics-diloco"]["inter_node_bytes"] < runs["mics-auto"]["inter_node_bytes"] / 4
    assert (tmp_path / "convergence.png").stat().st_size > 0
    assert "| 240 | mics-diloco (semi-sync, H=8) |" in output
