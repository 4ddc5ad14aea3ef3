"""The emulated cluster's ``--convergence`` mode (``benchmarks/convergence.py``) on synthetic records: the
Markov-chain data and its seeds, the analysis of held-out evaluation points (the two ratios per seed, their means,
the every-seed targets), the planner's H, the report and the command line; a 4-rank check that held-out evaluations
change nothing in training; the ``--regions 2 --smoke`` run.

In detail: the analysis takes the time to mics-auto's final loss, the two ratios per seed, their means and spread
and the headline for the planner's row; the report has its table, chart and docs block -- all on synthetic records,
without root. The last test runs ``--convergence --regions 2 --smoke`` end to end (root, ranks in network
namespaces): the same path with the region level and two-level DiLoCo (its pure parts are
``tests/test_benchmark_regions.py``'s), on one seed to stay near a minute (whether different seeds give different
curves is checked on synthetic records and by the seed tests above)."""

from __future__ import annotations

import itertools
import json
import math
import os
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any, Optional

import pytest
import torch
from distributed import end_session, run_ranks

from benchmarks import convergence, convergence_analysis, convergence_report, emulated_analysis, emulated_cluster
from benchmarks.convergence_analysis import (
    build_convergence_report,
    compare_seed,
    first_reach,
    headline,
    planner_answer,
    seed_check,
    smoothed,
    summarise_rows,
    wire_fraction,
)
from benchmarks.convergence_setup import (
    ConvergenceSettings,
    MarkovChain,
    SequenceDataset,
    init_seed,
    training_sequences,
)
from benchmarks.scenarios import ClusterShape, diloco_spec

REPO = Path(__file__).resolve().parents[1]


# ------------------------------------------------------------------------------------------------ data and seeds
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
    settings = ConvergenceSettings(steps=16)
    one = MarkovChain(256, settings.successors, settings.data_seed)
    two = MarkovChain(256, settings.successors, settings.data_seed)
    assert one.table.equal(two.table) and one.entropy_rate == two.entropy_rate


def test_a_longer_budget_reads_the_same_batches_and_another_seed_other_ones() -> None:
    """A DiLoCo row's longer budget starts with mics-auto's batches (same seed); another seed draws other
    sequences, so its curves cannot repeat the first seed's."""
    chain = MarkovChain(vocab=32, successors=4, seed=0)
    short = training_sequences(chain, data_seed=0, seed=0, steps=4, per_step=8, length=9)
    long = training_sequences(chain, data_seed=0, seed=0, steps=6, per_step=8, length=9)
    assert short.shape == (32, 9) and long.shape == (48, 9) and long[:32].equal(short)
    other = training_sequences(chain, data_seed=0, seed=1, steps=4, per_step=8, length=9)
    assert not other.equal(short)
    assert all(not other[8 * i:8 * (i + 1)].equal(short[8 * i:8 * (i + 1)]) for i in range(4))  # every step's batch
    assert not short[:8].equal(short[8:16])  # each step draws its own
    with pytest.raises(ValueError, match="at least one step"):
        training_sequences(chain, 0, 0, steps=0, per_step=8, length=9)


def test_the_seed_changes_the_initial_model() -> None:
    from examples.models import GPTConfig, GPTLightningModule

    def initial(seed: int) -> torch.Tensor:
        torch.manual_seed(init_seed(seed))  # what pl.seed_everything sets for torch
        model = GPTLightningModule(GPTConfig(seq_len=8, d_model=32, n_layers=1, n_heads=2))
        return torch.cat([p.detach().reshape(-1) for p in model.parameters()])

    assert initial(0).equal(initial(0))
    assert not initial(0).equal(initial(1)) and not initial(1).equal(initial(2))


def test_row_budgets() -> None:
    settings = ConvergenceSettings(steps=256, eval_every=16, diloco_budget=1.5)
    assert settings.row_steps(None) == 256  # synchronous rows: the reference's budget
    # DiLoCo: >= 1.5 x 256 = 384, whole rounds and whole evaluation intervals
    assert [settings.row_steps(h) for h in (4, 8, 16, 32, 64, 128, 256, 512)] == [384] * 6 + [512, 512]
    assert ConvergenceSettings(steps=16, eval_every=4).row_steps(16) == 32
    assert ConvergenceSettings(steps=16, eval_every=4, diloco_budget=1.0).row_steps(8) == 16
    assert ConvergenceSettings(steps=10, eval_every=5).row_steps(4) == 20  # lcm(4, 5) = 20 >= 15


def test_settings_refuse_what_cannot_be_measured() -> None:
    ConvergenceSettings(steps=64).check(world_size=4)
    with pytest.raises(ValueError, match="not a multiple of --eval-every 16"):
        ConvergenceSettings(steps=40).check(world_size=4)
    with pytest.raises(ValueError, match="split evenly over 3 ranks"):
        ConvergenceSettings(steps=16, heldout_samples=512).check(world_size=3)
    with pytest.raises(ValueError, match="steps must be a positive int"):
        ConvergenceSettings(steps=0)
    with pytest.raises(ValueError, match="--diloco-budget must be >= 1"):
        ConvergenceSettings(steps=16, diloco_budget=0.5)
    with pytest.raises(ValueError, match="--seeds takes distinct"):
        ConvergenceSettings(steps=16, seeds=(0, 0))
    assert ConvergenceSettings(steps=16, seeds=[2, 1]).seeds == (2, 1)  # from a job file's JSON list


# ------------------------------------------------------------------------------------------------ curves
def test_trailing_mean() -> None:
    assert smoothed([4.0, 2.0, 3.0, 1.0], 2) == [4.0, 3.0, 2.5, 2.0]
    assert smoothed([5.0, 1.0], 10) == [5.0, 3.0]
    with pytest.raises(ValueError, match="window"):
        smoothed([1.0], 0)


def test_first_reach_takes_the_evaluation_point_itself() -> None:
    times, losses = [1.0, 2.0, 3.0, 4.0], [5.0, 4.0, 2.0, 1.0]
    assert first_reach(times, losses, 3.0) == 3.0  # no interpolation between 2.0 and 3.0
    assert first_reach(times, losses, 2.0) == 3.0  # reached exactly
    assert first_reach(times, losses, 6.0) == 1.0
    assert first_reach(times, losses, 0.5) is None  # never within the budget
    with pytest.raises(ValueError, match="x values"):
        first_reach([1.0], [1.0, 2.0], 1.0)


def run(name: str, heldout: list[float], seconds_per_step: float, seed: int = 0, sync_every: Optional[int] = None,
        eval_every: int = 4, tokens_per_step: int = 100, train: Optional[list[float]] = None,
        tx: float = 4e6) -> dict[str, Any]:
    """A worker's record of a ``--convergence`` row: one training loss and end time per optimizer step, a held-out
    loss every ``eval_every`` steps."""
    n = len(heldout) * eval_every
    train = train or [6.0 - 0.01 * i - 0.1 * seed for i in range(n)]
    return {
        "strategy": name, "status": "ok", "seed": seed, "sync_every": sync_every, "tokens_per_step": tokens_per_step,
        "steps": [{"step": i + 1, "time_s": (i + 1) * seconds_per_step, "loss": train[i]} for i in range(n)],
        "evals": [{"step": (k + 1) * eval_every, "time_s": (k + 1) * eval_every * seconds_per_step,
                   "heldout_loss": loss, "computed": True, "eval_s": 0.1} for k, loss in enumerate(heldout)],
        "eval_s": 0.1 * len(heldout), "inter_node_bytes": 2 * tx, "expected_inter_node_bytes": 2 * tx,
        "inter_node_tx_bytes_per_node": [tx, tx], "inter_node_rx_bytes_per_node": [tx, 0.9 * tx],
    }


#: mics-auto: 16 steps of 1 s, held-out 4 -> 1.5 at steps 4, 8, 12, 16
REFERENCE = run("mics-auto", [4.0, 3.0, 2.0, 1.5], 1.0)


def test_ratios_against_mics_auto() -> None:
    # H=8, a 1.5x budget (24 steps) at 0.25 s a step: below 1.5 first at step 20 (5 s)
    fast = run("mics-diloco", [3.5, 2.5, 1.8, 1.6, 1.45, 1.4], 0.25, sync_every=8)
    slow = run("mics-diloco-h32", [3.9, 3.0, 2.5, 2.2, 2.0, 1.9, 1.8, 1.7], 0.2, sync_every=32)
    twin = run("ddp", [4.0, 3.0, 2.0, 1.5 + 1e-7], 1.5)  # the same trajectory to fp32 rounding
    failed = {"strategy": "zero3", "seed": 0, "status": "failed: timed out"}
    rows = {r["strategy"]: r for r in compare_seed([REFERENCE, fast, slow, twin, failed], window=1)}
    ref = rows["mics-auto"]
    assert ref["time_to_sync_final_loss_ratio"] == 1.0 and ref["final_loss_ratio"] == 1.0
    assert ref["budget_over_reference"] == 1.0 and ref["loss_ratio_at_reference_tokens"] == 1.0
    row = rows["mics-diloco"]
    assert row["reference_final_loss"] == 1.5 and row["budget_over_reference"] == 1.5
    assert row["time_to_reference_loss_s"] == 5.0 and row["tokens_to_reference_loss"] == 2000
    assert row["time_to_sync_final_loss_ratio"] == pytest.approx(5.0 / 16)
    assert row["final_loss_ratio"] == pytest.approx(1.4 / 1.5)
    assert row["loss_ratio_at_reference_tokens"] == pytest.approx(1.6 / 1.5)  # step 16: mid-schedule
    assert row["wall_ratio"] == pytest.approx(6.0 / 16) and row["s_per_step"] == 0.25
    assert rows["mics-diloco-h32"]["time_to_sync_final_loss_ratio"] is None  # ends at 1.7: never reaches 1.5
    assert rows["ddp"]["time_to_sync_final_loss_ratio"] == pytest.approx(1.5)  # 1e-7 above still reaches
    assert rows["zero3"] == {"strategy": "zero3", "seed": 0, "sync_every": None, "status": "failed: timed out"}
    above = run("x", [4.0, 3.0, 2.0, 1.5 * 1.001], 1.0)  # 1e-3 above does not
    assert compare_seed([REFERENCE, above])[1]["time_to_reference_loss_s"] is None
    # without a reference nothing is compared
    alone = compare_seed([fast])[0]
    assert "time_to_sync_final_loss_ratio" not in alone and alone["final_heldout_loss"] == 1.4


def three_seeds(diloco: list[list[float]], seconds_per_step: float = 0.25) -> list[dict[str, Any]]:
    """mics-auto (each seed's held-out curve a little lower) and one DiLoCo row per seed."""
    runs = []
    for seed, curve in enumerate(diloco):
        shift = 0.01 * seed
        runs.append(run("mics-auto", [v - shift for v in (4.0, 3.0, 2.0, 1.5)], 1.0, seed=seed))
        runs.append(run("mics-diloco-h16", [v - shift for v in curve], seconds_per_step, seed=seed, sync_every=16))
    return runs


def test_per_seed_pairs_their_means_and_the_targets() -> None:
    runs = three_seeds([[3.5, 2.5, 1.8, 1.6, 1.45, 1.4], [3.5, 1.4, 1.4, 1.4, 1.4, 1.4],
                        [3.5, 2.5, 1.8, 1.6, 1.55, 1.5]])
    comparison = [row for seed in (0, 1, 2) for row in compare_seed([r for r in runs if r["seed"] == seed])]
    summary = {r["strategy"]: r for r in summarise_rows(comparison)}
    row = summary["mics-diloco-h16"]
    times = [s["time_to_sync_final_loss_ratio"] for s in row["seeds"]]
    assert times == pytest.approx([5.0 / 16, 2.0 / 16, 6.0 / 16])  # seed 2 reaches 1.49 only at its last point
    assert row["time_to_sync_final_loss_ratio"]["mean"] == pytest.approx(13.0 / 48)
    assert row["time_to_sync_final_loss_ratio"]["min"] == pytest.approx(2.0 / 16)
    assert row["time_to_sync_final_loss_ratio"]["max"] == pytest.approx(6.0 / 16)
    assert row["time_to_sync_final_loss_ratio"]["std"] == pytest.approx(statistics.stdev([5.0, 2.0, 6.0]) / 16)
    losses = [s["final_loss_ratio"] for s in row["seeds"]]
    assert losses == pytest.approx([1.4 / 1.5, 1.39 / 1.49, 1.48 / 1.48])
    assert row["s_per_step"] == 0.25 and row["sync_every"] == 16
    top = headline(list(summary.values()), "mics-diloco-h16")
    assert top["headline_strategy"] == "mics-diloco-h16" and top["planner_sync_every"] == 16
    assert top["time_to_sync_final_loss_ratio"] == pytest.approx(13.0 / 48)
    assert top["final_loss_ratio"] == pytest.approx((1.4 / 1.5 + 1.39 / 1.49 + 1.0) / 3)
    assert top["targets_met"] == {key: True for key in convergence_analysis.TARGETS}


def test_one_slow_seed_fails_the_every_seed_target_and_one_unreached_seed_the_mean() -> None:
    # seed 1 reaches only at its last point of 24 steps at 0.45 s: 10.8 / 16 = 0.675 > 0.6; the mean stays <= 0.5
    runs = three_seeds([[3.5, 1.4, 1.4, 1.4, 1.4, 1.4]] * 3)
    runs[3] = run("mics-diloco-h16", [v - 0.01 for v in (3.5, 2.5, 2.0, 1.6, 1.55, 1.4)], 0.45, seed=1,
                  sync_every=16)
    summary = summarise_rows([row for seed in (0, 1, 2) for row in compare_seed([r for r in runs if r["seed"] == seed])])
    top = headline(summary, "mics-diloco-h16")
    assert top["time_to_sync_final_loss_ratio"] == pytest.approx((2 + 10.8 + 2) / 16 / 3)
    assert top["targets_met"]["mean_time_to_sync_final_loss_ratio"]
    assert not top["targets_met"]["every_seed_time_to_sync_final_loss_ratio"]
    assert top["targets_met"]["every_seed_final_loss_ratio"]
    # a seed that never reaches the loss: no mean, every time target missed
    runs[3] = run("mics-diloco-h16", [3.5, 2.5, 2.0, 1.8, 1.7, 1.6], 0.25, seed=1, sync_every=16)
    summary = summarise_rows([row for seed in (0, 1, 2) for row in compare_seed([r for r in runs if r["seed"] == seed])])
    top = headline(summary, "mics-diloco-h16")
    spread = top["spread"]["time_to_sync_final_loss_ratio"]
    assert top["time_to_sync_final_loss_ratio"] is None and spread["seeds_with_value"] == 2 and spread["seeds"] == 3
    assert not top["targets_met"]["mean_time_to_sync_final_loss_ratio"]
    assert not top["targets_met"]["every_seed_time_to_sync_final_loss_ratio"]
    assert top["final_loss_ratio"] is not None  # every seed has a final loss


def test_headline_without_the_planners_row() -> None:
    summary = summarise_rows(compare_seed([REFERENCE, run("mics-diloco", [3.0, 2.0, 1.5, 1.4], 0.2, sync_every=8)]))
    for planner_row in (None, "mics-diloco-h64"):  # the planner named no H, or its row did not run
        top = headline(summary, planner_row)
        assert top["time_to_sync_final_loss_ratio"] is None and top["final_loss_ratio"] is None
        assert not any(top["targets_met"].values())


def test_seed_check_catches_seeds_that_change_nothing() -> None:
    runs = three_seeds([[3.5, 2.5, 1.8, 1.6, 1.45, 1.4]] * 3)
    assert seed_check(runs) == {"distinct": True, "identical": []}
    clone = {**runs[0], "seed": 1}  # seed 1's mics-auto a copy of seed 0's
    check = seed_check([runs[0], clone, *runs[4:]])
    assert not check["distinct"]
    assert check["identical"] == [{"strategy": "mics-auto", "seeds": [0, 1], "heldout_identical": True,
                                   "train_identical": True}]


def test_wire_fraction_is_the_busiest_direction_over_the_step() -> None:
    # 16 steps of 1 s; the busiest direction moves 4 MB over the run = 0.25 MB a step; at 0.5 MB/s that is 0.5 s
    assert wire_fraction(REFERENCE, 0.5e6) == pytest.approx(0.5)
    assert wire_fraction({"strategy": "x", "status": "failed"}, 1e6) is None


# ------------------------------------------------------------------------------------------------ the planner's H
#: A calibration like the one mics-auto's strategy measures on the emulated cluster at ratio 240 (2 x 2 CPU ranks)
CALIBRATED = {"nodes": 2, "gpus_per_node": 2, "gpu_memory_bytes": 1.0, "intra_node_bandwidth": 6.3e8,
              "inter_node_bandwidth": 6.6e6, "compute_flops": 45e9, "intra_node_latency": 1.2e-3,
              "inter_node_latency": 6e-4, "memory_bandwidth": 1.4e9, "overlap": 0.0, "hop2_overlap": 1.0,
              "name": "calibrated"}
MODEL = {"vocab_size": 256, "seq_len": 8, "d_model": 256, "n_layers": 2, "n_heads": 4}


def test_the_planners_h_comes_from_the_library_planner() -> None:
    from examples.models import GPTConfig
    from lightning_mics.planner import ClusterSpec, TrainingSpec, plan

    answer = planner_answer(CALIBRATED, MODEL, micro_batch=4, accumulate=4, memory_bytes=8e9, achieved_flops=8e9)
    direct = plan(ClusterSpec(**{**CALIBRATED, "gpu_memory_bytes": 8e9, "compute_flops": 8e9}),
                  GPTConfig(**MODEL).model_spec(), TrainingSpec(micro_batch=4, accumulation=4, precision="32-true"),
                  grad_accumulation="auto")
    assert direct.semi_sync_advice is not None
    assert answer["sync_every"] == direct.semi_sync_advice.sync_every == 16
    assert answer["inputs"]["cluster"]["compute_flops"] == 8e9 and answer["inputs"]["calibrated_compute_flops"] == 45e9
    assert answer["inputs"]["model"]["hidden"] == 256 and answer["inputs"]["training"]["micro_batch"] == 4
    assert answer["answer"]["synchronous_busy_fraction"] < 0.5 <= answer["answer"]["semi_sync"]["busy_fraction"]
    assert "sync_every=16" in answer["answer"]["explanation"]
    # the calibration's matrix-product rate: the model sees almost no compute and no H reaches half busy
    assert answer["with_calibrated_compute"]["sync_every"] is None
    slower = planner_answer(CALIBRATED, MODEL, 4, 4, 8e9, achieved_flops=5e9)
    assert slower["sync_every"] == 8  # more compute per step: a smaller H keeps the ranks busy
    fast_link = planner_answer({**CALIBRATED, "inter_node_bandwidth": 5e9}, MODEL, 4, 4, 8e9, achieved_flops=8e9)
    assert fast_link["sync_every"] is None  # synchronous training keeps the ranks busy: no advice
    assert convergence_analysis.achieved_flops(0.02, 1e7, micro_batch=4, seq_len=8) == pytest.approx(1.6e10)
    assert convergence_analysis.achieved_flops(None, 1e7, 4, 8) is None


def test_the_planners_row_is_the_rows_own_or_a_new_one() -> None:
    shape = ClusterShape(2, 2)
    specs = emulated_cluster.parse_args(["--convergence"]).specs
    assert emulated_analysis.planned_spec({"sync_every": 32}, specs, shape, None).name == "mics-diloco-h32"
    assert emulated_analysis.planned_spec({"sync_every": 8}, specs, shape, None).name == "mics-diloco"
    new = emulated_analysis.planned_spec({"sync_every": 16}, specs, shape, 0.5)
    assert (new.name, new.sync_every, new.outer_lr) == ("mics-diloco-h16", 16, 0.5)
    assert new.partition_size == diloco_spec(shape, 8).partition_size  # the same layout as the other rows
    assert emulated_analysis.planned_spec({"sync_every": None}, specs, shape, None) is None


# ------------------------------------------------------------------------------------------------ report
def report_of(runs: list[dict[str, Any]], planner_row: Optional[str] = "mics-diloco-h16") -> dict[str, Any]:
    points = [{"bandwidth_ratio": 240.0, "network": {"inter_node_rate_bytes_per_s": 0.5e6},
               "planner": {"row": planner_row, "sync_every": 16}, "runs": runs}]
    return build_convergence_report(points, "python benchmarks/emulated_cluster.py --convergence",
                                    {"window": 1, "entropy_rate": 1.0})


def test_report_keys_table_chart_and_docs_block(tmp_path: Path) -> None:
    runs = three_seeds([[3.5, 2.5, 1.8, 1.6, 1.45, 1.4], [3.5, 1.4, 1.4, 1.4, 1.4, 1.4],
                        [3.5, 2.5, 1.8, 1.6, 1.55, 1.5]])
    report = report_of(runs)
    assert report["headline_bandwidth_ratio"] == 240.0 and report["headline_strategy"] == "mics-diloco-h16"
    assert report["time_to_sync_final_loss_ratio"] == pytest.approx(13.0 / 48)
    assert [s["seed"] for s in report["seeds"]] == [0, 1, 2]
    assert report["seeds"][1]["rows"]["mics-diloco-h16"] == {
        "time_to_sync_final_loss_ratio": pytest.approx(2.0 / 16), "final_loss_ratio": pytest.approx(1.39 / 1.49)}
    assert report["seeds"][0]["rows"]["mics-auto"]["time_to_sync_final_loss_ratio"] == 1.0
    assert report["seeds_distinct"] and report["reference_wire_fraction"]["mean"] == pytest.approx(0.5)
    assert set(report["definitions"]) >= {"time_to_sync_final_loss_ratio", "final_loss_ratio", "heldout_loss"}
    json.dumps(report)  # what convergence.json holds

    text = convergence_report.format_convergence_table(report)
    assert "mics-diloco-h16 (H=16), planner's H" in text and "0.312 / 0.125 / 0.375" in text
    markdown = convergence_report.format_convergence_table(report, markdown=True)
    assert "| 240 | mics-diloco-h16 (H=16), planner's H | 2,400 (1.50) | 0.250 |" in markdown
    block = convergence_report.figure_markdown(report)
    assert "the planner names H = 16" in block and "| mean, time_to_sync_final_loss_ratio <= 0.5 | 0.271 | yes |" in block
    assert "convergence.png" in block
    assert convergence_report.figure_markdown(None) == convergence_report.NOT_MEASURED
    pytest.importorskip("matplotlib")
    chart = convergence_report.draw_convergence(report, tmp_path / "convergence.png")
    assert chart is not None and chart.stat().st_size > 0


def test_a_row_that_did_not_run_is_listed_with_its_status() -> None:
    runs = [REFERENCE, {"strategy": "mics-diloco-planned", "seed": 0,
                        "status": "skipped: the planner names no H for this link"}]
    report = report_of(runs, planner_row=None)
    assert report["time_to_sync_final_loss_ratio"] is None and report["headline_strategy"] is None
    assert "skipped: the planner names no H" in convergence_report.format_convergence_table(report)


def test_reanalysis_recomputes_from_the_records(tmp_path: Path) -> None:
    """``python benchmarks/convergence.py convergence.json`` recomputes the analysis from the unchanged records."""
    report = report_of(three_seeds([[3.5, 2.5, 1.8, 1.6, 1.45, 1.4]] * 3))
    report["date_utc"] = "then"
    report["time_to_sync_final_loss_ratio"] = 0.9  # as an older analysis might have written it
    path = tmp_path / "convergence.json"
    path.write_text(json.dumps(report))
    assert convergence.main([str(path)]) == 0
    again = json.loads(path.read_text())
    assert again["time_to_sync_final_loss_ratio"] == pytest.approx(5.0 / 16) and again["date_utc"] == "then"
    assert again["points"][0]["runs"] == report["points"][0]["runs"]
    old = {"command": "x", "settings": {"window": 16},
           "points": [{"runs": [{"strategy": "mics-auto", "status": "ok", "steps": []}]}]}
    path.write_text(json.dumps(old))  # written before evaluation points were recorded
    with pytest.raises(SystemExit):
        convergence.main([str(path)])


# ------------------------------------------------------------------------------------------------ flags
def test_convergence_defaults() -> None:
    args = emulated_cluster.parse_args(["--convergence"])
    assert [s.name for s in args.specs] == ["mics-auto", "mics-diloco", "mics-diloco-h32"] and args.planner_row
    assert [s.sync_every for s in args.specs] == [None, 8, 32]
    assert (args.cluster.num_nodes, args.cluster.ranks_per_node) == (2, 2)
    assert args.ratios == (240.0,) and args.setup.micro_batch == emulated_cluster.CONVERGENCE_MICRO_BATCH
    settings = args.convergence_settings
    assert settings.steps == emulated_cluster.CONVERGENCE.measured_steps and settings.seeds == (0, 1, 2)
    assert (settings.eval_every, settings.heldout_samples, settings.diloco_budget) == (16, 512, 2.0)
    assert args.setup.model.d_model == emulated_cluster.SMOKE_CONVERGENCE.d_model == 128  # the smoke's model
    assert args.output_dir == emulated_cluster.RESULTS_DIR / "convergence" and args.fork_server
    smoke = emulated_cluster.parse_args(["--convergence", "--smoke"])
    assert [s.name for s in smoke.specs] == ["mics-auto", "mics-diloco"] and smoke.planner_row
    assert smoke.ratios == (240.0,) and smoke.output_dir == emulated_cluster.RESULTS_DIR / "convergence_smoke"
    assert smoke.convergence_settings.seeds == (0, 1) and smoke.convergence_settings.eval_every == 4
    tuned = emulated_cluster.parse_args(["--convergence", "--outer-lr", "0.3", "--convergence-ratios", "24,240",
                                         "--seeds", "3,4", "--strategies", "mics-diloco,mics-auto",
                                         "--no-fork-server"])
    assert [s.name for s in tuned.specs] == ["mics-auto", "mics-diloco"]  # the reference runs first
    assert [s.outer_lr for s in tuned.specs] == [None, 0.3] and tuned.ratios == (24.0, 240.0)
    assert tuned.convergence_settings.seeds == (3, 4) and not tuned.planner_row and not tuned.fork_server
    assert emulated_cluster.parse_args([]).setup.micro_batch == 1  # the throughput rows keep theirs
    assert not emulated_cluster.parse_args([]).fork_server


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--convergence", "--steps", "44"], "not a multiple of --eval-every 16"),
        (["--convergence", "--quick"], "--convergence and --quick exclude each other"),
        (["--convergence", "--scaling"], "--convergence and --scaling exclude each other"),
        (["--convergence", "--bandwidth-ratio", "240"], "give the ratios with --convergence-ratios"),
        (["--convergence", "--warmup-steps", "1"], "--lr-warmup"),
        (["--convergence", "--strategies", "ddp,mics-diloco"], "add it to --strategies"),
        (["--convergence", "--convergence-ratios", "24,x"], "distinct comma-separated positive numbers"),
        (["--convergence", "--seeds", "1,1"], "--seeds takes distinct"),
        (["--convergence", "--diloco-budget", "0.5"], "--diloco-budget must be >= 1"),
        (["--convergence", "--lr", "0"], "--lr must be positive"),
        (["--convergence-ratios", "24"], "only applies with --convergence"),
        (["--seeds", "0"], "only applies with --convergence"),
        (["--strategies", "mics-diloco", "--outer-lr", "-1"], "must be positive"),
    ],
)
def test_bad_convergence_arguments_get_one_clear_error(argv: list[str], message: str,
                                                       capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        emulated_cluster.parse_args(argv)
    assert message in capsys.readouterr().err


# ------------------------------------------------------------------------------------------------ the workers' evaluation
def _train_twice(rank: int, world: int, out_dir: str) -> dict[str, Any]:
    """Each rank of 2 nodes x 2: a synchronous row with parameters kept gathered after forward (AMSP P=1, the
    layout the planner picks here) and a DiLoCo row (H=4), each trained with held-out evaluations every 2 steps
    and with one only at the end; the network counters (namespace-only) stubbed."""
    from benchmarks import convergence_worker
    from benchmarks.scenarios import TrainingSetup, select_strategies
    from examples.models import GPTConfig

    os.environ.update(NODE_RANK=str(rank // 2), LOCAL_RANK=str(rank % 2))
    convergence_worker.counters = lambda: {"time": 0.0, "uplink_tx": 0, "uplink_rx": 0, "lo_tx": 0}
    shape = ClusterShape(2, 2)
    setup = TrainingSetup(model=GPTConfig(seq_len=8, d_model=32, n_layers=1, n_heads=2), micro_batch=2,
                          accumulate=3, warmup_steps=0, measured_steps=8)
    rows = {"mics-zero2": 8, "mics-diloco-h4": 12}
    out: dict[str, Any] = {}
    for name, spec in zip(rows, select_strategies(shape, list(rows))):
        for every in (2, rows[name]):
            path = Path(out_dir, f"{name}-{every}.json")
            settings = ConvergenceSettings(steps=rows[name], eval_every=every, heldout_samples=32, warmup_steps=2)
            convergence_worker.run_convergence(spec, shape, setup, settings, 0, rows[name], path)
            if rank == 0:
                out[f"{name}-{every}"] = json.loads(path.read_text())
    return out


@pytest.mark.distributed
@pytest.mark.timeout(300)
def test_evaluating_the_global_model_leaves_training_unchanged(tmp_path: Path) -> None:
    """The held-out evaluations (a DiLoCo row's with the last synchronised parameters copied in and its own copied
    back; a P=1 row's forward leaving its parameters gathered) change nothing in training: the per-step losses and
    the final held-out loss equal those of the same run evaluated only at its end, to the bit. A DiLoCo row's
    mid-round evaluation is its global model's (before the first synchronisation: the initial model) and is reused
    until the next synchronisation."""
    records = run_ranks(_train_twice, 4, str(tmp_path), timeout=280)[0]
    for name, steps in (("mics-zero2", 8), ("mics-diloco-h4", 12)):
        often, once = records[f"{name}-2"], records[f"{name}-{steps}"]
        assert [s["loss"] for s in often["steps"]] == [s["loss"] for s in once["steps"]], name
        assert often["evals"][-1]["heldout_loss"] == once["evals"][-1]["heldout_loss"], name
        assert [e["step"] for e in often["evals"]] == list(range(2, steps + 1, 2)) and len(once["evals"]) == 1
        assert often["eval_s"] > 0 and all(s["time_s"] > 0 for s in often["steps"])
    diloco = records["mics-diloco-h4-2"]["evals"]
    assert [e["computed"] for e in diloco] == [True, True, False, True, False, True]
    assert diloco[0]["heldout_loss"] == pytest.approx(math.log(256), abs=0.3)  # still the initial model
    assert diloco[1]["heldout_loss"] == diloco[2]["heldout_loss"] != diloco[3]["heldout_loss"]
    synchronous = records["mics-zero2-2"]["evals"]
    assert all(e["computed"] for e in synchronous) and len({e["heldout_loss"] for e in synchronous}) == 4
    assert records["mics-zero2-2"]["compute_micro_step_s"] > 0  # the middle micro-step of every window, timed


# ------------------------------------------------------------------------------------------------ end to end
@pytest.mark.entry_point
@pytest.mark.distributed
@pytest.mark.timeout(240)
@pytest.mark.skipif(not hasattr(os, "geteuid") or os.geteuid() != 0,
                    reason="the emulated cluster's network namespaces, veths and tc need root (CI runs as root)")
def test_convergence_regions_smoke_runs_every_row_and_writes_the_report(tmp_path: Path) -> None:
    """``--convergence --regions 2 --smoke`` as a user starts it (one seed, about a minute): on 2 regions of 2 nodes
    of 2 ranks, mics-auto, flat DiLoCo and two-level DiLoCo -- both at the H the planner names for the cluster with
    its regions -- train and learn; every row's bytes inside a region and across regions lie within 10 % of the byte
    model, flat DiLoCo's a fraction of mics-auto's; the planner's answer, inputs and each mode's H are recorded, and
    convergence_regions.json carries the three ratios and their targets, the chart beside it."""
    process = subprocess.Popen(
        [sys.executable, "benchmarks/emulated_cluster.py", "--convergence", "--regions", "2", "--smoke",
         "--output-dir", str(tmp_path)],
        cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True,
    )
    try:
        output, _ = process.communicate(timeout=210)
    except subprocess.TimeoutExpired:
        output = end_session(process)
        pytest.fail(f"--convergence --regions 2 --smoke ran past 210 s:\n{output[-3000:]}")
    assert process.returncode == 0, output[-4000:]
    report = json.loads((tmp_path / "convergence_regions.json").read_text())
    assert {"time_to_sync_final_loss_ratio", "time_to_flat_diloco_ratio", "final_loss_ratio", "seeds", "targets",
            "sync_every", "bytes_per_level", "regions", "planner", "reference_wire_fraction"} <= set(report)
    assert report["targets"] == {"time_to_sync_final_loss_ratio": 0.5, "time_to_flat_diloco_ratio": 0.8,
                                 "final_loss_ratio": 1.02}
    (point,) = report["points"]
    planner, regions = point["planner"], report["regions"]
    assert planner["from_seed"] == 0 and [p["seed"] for p in planner["per_seed"]] == [0] and "answer" in planner
    assert planner["inputs"]["cluster"]["nodes_per_region"] == 2
    assert planner["inputs"]["cluster"]["region_bandwidth"] == regions["region_measured_bytes_per_s"] > 0
    assert regions["region_measured_bytes_per_s"] < point["network"]["inter_node_measured_bytes_per_s"]
    assert report["settings"]["regions"]["region_rate_bytes_per_s"] == regions["region_rate_bytes_per_s"]
    flat_h, two_h = report["sync_every"]["flat"], report["sync_every"]["two_level"]
    assert flat_h and two_h, planner["modes"]  # the planner names an H for both modes on these links
    settings = ConvergenceSettings(**{k: report["settings"][k] for k in ("steps", "eval_every", "diloco_budget")})
    ran = {r["strategy"]: r for r in point["runs"] if r["status"] == "ok"}
    assert list(ran) == ["mics-auto", f"mics-diloco-h{flat_h}", f"mics-diloco-two-level-h{two_h}"], point["runs"]
    for r in ran.values():
        steps = settings.row_steps(r["sync_every"])
        assert len(r["steps"]) == steps and [e["step"] for e in r["evals"]][-1] == steps
        assert r["bytes_per_level"]["within_target"], (r["strategy"], r["bytes_per_level"])  # as the model says
        assert r["evals"][-1]["heldout_loss"] < r["evals"][0]["heldout_loss"]  # it learns
        assert r["eval_s"] > 0 and r["steps"][-1]["time_s"] > 0
    auto, flat, two = ran.values()
    assert two["diloco_worker_size"] == 2 and two["sync_every"] == two_h  # workers of a region's two nodes
    levels = two["bytes_per_level"]
    assert levels["inside_region"]["measured"] > 4 * levels["across_regions"]["measured"]  # hop 2 every step inside
    assert flat["inter_node_bytes"] / len(flat["steps"]) < auto["inter_node_bytes"] / len(auto["steps"]) / 4
    assert sum(not e["computed"] for e in two["evals"]) > 0  # mid-round points reuse the round's global model
    assert auto["compute_micro_step_s"] > 0 and auto["planner_cluster_spec"]["compute_flops"] > 0
    assert [s["seed"] for s in report["seeds"]] == [0] and report["bytes_per_level_within_target"]
    assert report["reference_wire_fraction"]["mean"] > 0
    assert (tmp_path / "convergence_regions.png").stat().st_size > 0
    assert "| 6 | mics-auto |" in output
