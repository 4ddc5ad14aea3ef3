"""The emulated cluster's smoke runs, as a user starts them (a subprocess, root): ``emulated_cluster.py --smoke``
with ``compare_planner.py`` and ``profile_breakdown.py`` on what it wrote, and ``--smoke --scaling``; each checked on
what it printed and wrote (the rows, the bytes against the byte model, the charts).

A file of their own, beside ``test_entry_points.py``'s other smoke runs, so that pytest-xdist's two workers
(``--dist loadfile``) share these minutes. Every run is bounded; on a timeout its whole process group is killed.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
from lm_jobs import needs_root, run_from_repo

pytestmark = pytest.mark.entry_point



@needs_root
@pytest.mark.distributed
@pytest.mark.timeout(300)
def test_emulated_cluster_smoke_and_compare_planner_on_its_results(tmp_path: Path) -> None:
    """One run covers every worker family (the live planner's FSDP2 layout, Lightning's FSDP1 and DDP): each
    trains on the shaped links with its measured inter-node bytes within 5 % of the byte model; then
    ``compare_planner.py`` reads the JSON the run wrote (the planner's inputs and predictions for each row),
    and ``profile_breakdown.py`` reads the run's py-spy profiles where py-spy is installed."""
    from benchmarks.emulated_cluster import SMOKE_STRATEGIES

    profiles = tmp_path / "profiles" if shutil.which("py-spy") else None
    output = run_from_repo("benchmarks/emulated_cluster.py", "--smoke", "--output-dir", str(tmp_path),
                  *(["--profile-dir", str(profiles)] if profiles else []), timeout=270)
    report = json.loads((tmp_path / "emulated_cluster.json").read_text())
    rows = {row["strategy"]: row for row in report["results"]}
    assert list(rows) == list(SMOKE_STRATEGIES)
    for name, row in rows.items():
        assert row["status"] == "ok", (name, row.get("status"))
        assert row["step_time_s"] > 0 and row["wire_floor_s"] > 0
        assert abs(row["inter_node_error"]) < 0.05, (name, row["inter_node_error"])  # bytes as the model says
        assert f"| {name} |" in output  # the Markdown table
    assert report["network"]["inter_node_measured_bytes_per_s"] > 0
    assert (tmp_path / "emulated_cluster.png").stat().st_size > 0

    results = str(tmp_path / "emulated_cluster.json")
    compared = json.loads(run_from_repo("benchmarks/compare_planner.py", "--results", results, "--calibrated-compute",
                               "--json", timeout=60))
    assert [row["strategy"] for row in compared["rows"]] == list(SMOKE_STRATEGIES)
    for row in compared["rows"]:
        assert row["predicted_step_time_s"] > 0
        assert row["predicted_inter_node_bytes"] == pytest.approx(row["measured_inter_node_bytes"], rel=0.05)
    text = run_from_repo("benchmarks/compare_planner.py", "--results", results, "--calibrated-compute", timeout=60)
    assert "planner's choice" in text and "(live calibration)" in text

    if profiles is not None:
        files = sorted(profiles.glob("*.txt"))
        assert [f.stem for f in files] == sorted(SMOKE_STRATEGIES)
        table = run_from_repo("benchmarks/profile_breakdown.py", *map(str, files), timeout=60)
        assert table.startswith("| where the time goes |") and "forward compute" in table


@needs_root
@pytest.mark.distributed
@pytest.mark.timeout(300)
def test_emulated_cluster_scaling_smoke_and_compare_planner_per_point(tmp_path: Path) -> None:
    """``--scaling``: two node counts on one link rate (the first point's), scaling.json and its chart; then
    ``compare_planner.py`` fits a compute rate per point and predicts every (nodes, strategy)."""
    from benchmarks.emulated_cluster import SMOKE_SCALING_NODES, SMOKE_SCALING_STRATEGIES

    output = run_from_repo("benchmarks/emulated_cluster.py", "--smoke", "--scaling", "--output-dir", str(tmp_path),
                  timeout=270)
    report = json.loads((tmp_path / "scaling.json").read_text())
    assert report["nodes"] == list(SMOKE_SCALING_NODES)
    rates = {point["network"]["inter_node_rate_bytes_per_s"] for point in report["points"]}
    assert len(rates) == 1, rates  # every node count on the first point's link
    for point in report["points"]:
        for row in point["results"]:
            assert row["strategy"] in SMOKE_SCALING_STRATEGIES and row["status"] == "ok", row.get("status")
            assert abs(row["inter_node_error"]) < 0.05
    assert (tmp_path / "scaling.png").stat().st_size > 0
    assert "kept for every node count" in output

    points = len(SMOKE_SCALING_NODES) * len(SMOKE_SCALING_STRATEGIES)
    text = run_from_repo("benchmarks/compare_planner.py", "--results", str(tmp_path / "scaling.json"), "--fit-compute",
                timeout=60)
    assert re.search(rf"\d+/{points} \(nodes, strategy\) points within \+-20%", text), text
    assert text.count("(fitted)") == len(SMOKE_SCALING_NODES)
