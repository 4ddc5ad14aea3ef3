"""benchmarks/fault_tolerance.py without a cluster: its options, its refusals, and the numbers it derives
from the ranks' step logs (a synthetic run with a known kill, discarded step, outage and rejoin)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks import fault_tolerance as bench

KILL, RESTART = 4.5, 7.5


def test_quick_fills_every_run_length_and_bad_lengths_are_refused(tmp_path: Path) -> None:
    args = bench.parse_args(["--quick"])
    assert (args.steps, args.kill_at_step, args.checkpoint_every) == (
        bench.QUICK.steps, bench.QUICK.kill_at_step, bench.QUICK.checkpoint_every
    )
    assert bench.parse_args(["--quick", "--steps", "50", "--kill-at-step", "20"]).steps == 50
    with pytest.raises(SystemExit):
        bench.parse_args(["--quick", "--kill-at-step", str(bench.QUICK.steps)])
    (tmp_path / "old.log").write_text("x")
    with pytest.raises(SystemExit):
        bench.parse_args(["--quick", "--work-dir", str(tmp_path)])


def test_the_network_request_is_built_as_emulated_cluster_builds_it() -> None:
    """The links come from emulated_cluster's own options and builder, so the two benchmarks cannot drift:
    this benchmark once crashed in set_up_network on an attribute only emulated_cluster's parser set."""
    from benchmarks import emulated_cluster

    args = bench.parse_args(["--smoke", "--calibrate", "tcp", "--inter-node-mbps", "50", "--mtu", "1500"])
    link = args.link
    assert isinstance(link, emulated_cluster.LinkRequest)
    assert (link.calibrate, link.inter_node_mbps, link.mtu, link.fixed_rate_bytes_per_s) == ("tcp", 50.0, 1500, None)
    assert link.probe_seconds == bench.SMOKE.probe_seconds and link.setup.model == bench.MODEL
    ours = {k: v for k, v in vars(bench.parse_args(["--quick"]).link).items() if k not in ("setup", "probe_seconds")}
    theirs = {k: v for k, v in vars(emulated_cluster.parse_args(["--quick"]).link).items()
              if k not in ("setup", "probe_seconds")}
    assert ours == theirs  # the same defaults


@pytest.mark.parametrize("argv, message", [(["--bandwidth-ratio", "-1"], "--bandwidth-ratio must be positive"),
                                           (["--inter-node-mbps", "0"], "--inter-node-mbps must be positive"),
                                           (["--mtu", "10"], "--mtu must be at least 68")])
def test_bad_link_settings_get_one_clear_error(argv: list[str], message: str,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        bench.parse_args(["--quick", *argv])
    assert message in capsys.readouterr().err


def _write_run(directory: Path, healed_digest: str = "same") -> bench.RunLog:
    """3 nodes x 2 ranks, one line per rank and step: node 2 is killed after step 4 (t=4.5); the survivors
    discard the step it hit (t=5.2), commit steps 5-6 alone, and node 2, restarted at t=7.5, heals and
    commits steps 7-8 with them."""
    lines: dict[tuple[int, int], list[dict]] = {(n, r): [] for n in range(3) for r in range(2)}

    def log(node: int, t: float, step: int, live: int, discarded: int, digest: str = "same") -> None:
        for rank in range(2):
            lines[node, rank].append(
                {"t": t, "node": node, "rank": rank, "step": step, "live": live, "discarded": discarded,
                 "digest": f"{digest}{rank}{step}", "loss": 1.0}
            )

    for step in range(1, 5):
        for node in range(3):
            log(node, float(step), step, 3, 0)
    for node in (0, 1):
        log(node, 5.2, 4, 3, 1)  # discarded: the count did not grow
        log(node, 6.0, 5, 2, 1)
        log(node, 7.0, 6, 2, 1)
        log(node, 8.5, 7, 3, 1)
        log(node, 9.5, 8, 3, 1)
    log(2, 8.5, 7, 3, 0, healed_digest)
    log(2, 9.5, 8, 3, 0, healed_digest)
    for (node, rank), rows in lines.items():
        (directory / f"node{node}.rank{rank}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return bench.RunLog("ft-failure", str(directory), 0.0, events={"kill": KILL, "restart": RESTART})


def test_a_failure_run_yields_the_outage_numbers(tmp_path: Path) -> None:
    results = bench.failure_results(_write_run(tmp_path), steps=8)
    assert results["seconds_to_next_commit"] == pytest.approx(6.0 - KILL)  # the discarded line is no commit
    assert results["steps_discarded"] == 1
    assert results["survivor_steps_during_outage"] == 2  # steps 5 and 6, alone
    assert results["outage_seconds"] == pytest.approx(8.5 - KILL)
    assert results["killed_at_step"] == 4


def test_a_rejoin_is_bit_identical_only_if_every_common_step_matches(tmp_path: Path) -> None:
    (tmp_path / "same").mkdir()
    healed = bench.rejoin_results(_write_run(tmp_path / "same"))
    assert healed == {"seconds": pytest.approx(8.5 - RESTART), "bit_identical": True, "first_step": 7,
                      "digests_compared": 2 * 2 * 2,  # 2 ranks x 2 peers x steps 7, 8
                      # node 0's longest gap spanning the heal (7.0 -> 8.5) in its median step time (1 s), minus one
                      "survivor_stall_steps": pytest.approx(0.5)}
    (tmp_path / "other").mkdir()
    assert bench.rejoin_results(_write_run(tmp_path / "other", healed_digest="stale"))["bit_identical"] is False
