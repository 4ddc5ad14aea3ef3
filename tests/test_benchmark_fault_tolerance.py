"""``benchmarks/fault_tolerance.py`` without a cluster: its options and refusals, and the numbers it derives from
the ranks' step logs on synthetic runs with a known kill, discarded step, outage and rejoin -- the outage, the
rejoin's trajectory checks, the survivors' stall, goodput, and each variant's overhead against the same plain runs."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks import fault_tolerance as bench
from benchmarks.fault_tolerance_analysis import (
    SurvivorGaps,
    cpu_ratio,
    cpu_seconds_per_step,
    failure_results,
    heal_step_stall_steps,
    median_step_seconds,
    ratio_by_round,
    rejoin_results,
    slice_step_seconds,
    step_intervals,
    survivor_gaps,
    survivor_stall_steps,
    time_slicing,
    variant_overhead,
)
from benchmarks.fault_tolerance_goodput import (
    alive_fraction,
    failure_free_rate,
    failure_free_steps_per_second,
    ft_progress,
    goodput_phases,
    goodput_results,
    restart_progress,
    steps_per_second,
    survivor_rate_while_out,
)
from benchmarks.fault_tolerance_launch import MODEL
from benchmarks.fault_tolerance_logs import RunLog, read_rows, read_sample_records
from benchmarks.fault_tolerance_report import markdown_table
from benchmarks.fault_tolerance_runs import Schedule, schedule_of
from benchmarks.fault_tolerance_trajectory import FINAL_LOSS_STEPS, trajectory_results

KILL, RESTART = 4.5, 7.5


def test_quick_fills_every_run_length_and_bad_lengths_are_refused(tmp_path: Path) -> None:
    args = bench.parse_args(["--quick"])
    assert (args.steps, args.kill_at_step, args.checkpoint_every) == (
        bench.QUICK.steps, bench.QUICK.kill_at_step, bench.QUICK.checkpoint_every
    )
    assert bench.parse_args(["--quick", "--steps", "50", "--kill-at-step", "20"]).steps == 50
    # the smoke's restarted node joins sooner when the ranks fork (its default): fewer steps then, unless asked
    assert bench.parse_args(["--smoke"]).steps == bench.SMOKE_FORKED_STEPS < bench.SMOKE.steps
    assert bench.parse_args(["--smoke", "--no-fork-server"]).steps == bench.SMOKE.steps
    assert bench.parse_args(["--smoke", "--steps", "90"]).steps == 90
    # measured runs start every node fresh, importing on its own CPU quota; only the smoke forks
    assert bench.parse_args(["--quick"]).node_start == "fresh" and not bench.parse_args(["--quick"]).fork_server
    assert bench.parse_args(["--smoke", "--node-start", "fresh"]).steps == bench.SMOKE.steps
    assert bench.parse_args(["--quick", "--fork-server"]).node_start == "forked"
    with pytest.raises(SystemExit):
        bench.parse_args(["--quick", "--fork-server", "--node-start", "fresh"])
    with pytest.raises(SystemExit):  # the sleeping fork is gone
        bench.parse_args(["--quick", "--node-start", "own-cores"])
    for tuned in ("--quorum-every", "--heal", "--heartbeat-interval", "--catch-up-share"):  # headline = defaults
        with pytest.raises(SystemExit):
            bench.parse_args(["--quick", tuned, "1"])
    with pytest.raises(SystemExit):
        bench.parse_args(["--quick", "--kill-at-step", str(bench.QUICK.steps)])
    (tmp_path / "old.log").write_text("x")
    with pytest.raises(SystemExit):
        bench.parse_args(["--quick", "--work-dir", str(tmp_path)])


def test_the_network_request_is_built_as_emulated_cluster_builds_it() -> None:
    """The links come from emulated_cluster's own options and builder, so the two benchmarks cannot drift:
    this benchmark once crashed in set_up_network on an attribute only emulated_cluster's parser set."""
    from benchmarks import emulated_cluster, emulated_network

    args = bench.parse_args(["--smoke", "--calibrate", "tcp", "--inter-node-mbps", "50", "--mtu", "1500"])
    link = args.link
    assert isinstance(link, emulated_network.LinkRequest)
    assert (link.calibrate, link.inter_node_mbps, link.mtu, link.fixed_rate_bytes_per_s) == ("tcp", 50.0, 1500, None)
    assert link.probe_seconds == bench.SMOKE.probe_seconds and link.setup.model == MODEL
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


def _write_run(directory: Path, healed_digest: str = "same", catching_up: bool = False) -> RunLog:
    """3 nodes x 2 ranks, one line per rank and step: node 2 is killed after step 4 (t=4.5); the survivors
    discard the step it hit (t=5.2), commit steps 5-6 alone, and node 2, restarted at t=7.5, heals and
    commits steps 7-8 with them -- with ``catching_up``, its shards are stale in step 7 (other digests) and
    current from step 8, and it contributes from step 9 (the survivors' commit of step 8 comes late)."""
    lines: dict[tuple[int, int], list[dict]] = {(n, r): [] for n in range(3) for r in range(2)}

    def log(node: int, t: float, step: int, live: int, discarded: int, digest: str = "same", current: bool = True,
            contributes: bool = True) -> None:
        for rank in range(2):
            lines[node, rank].append(
                {"t": t, "node": node, "rank": rank, "step": step, "live": live, "discarded": discarded,
                 "digest": f"{digest}{rank}{step}", "loss": 1.0, "current": current, "contributes": contributes}
            )

    for step in range(1, 5):
        for node in range(3):
            log(node, float(step), step, 3, 0)
    for node in (0, 1):
        log(node, 5.2, 4, 3, 1)  # discarded: the count did not grow
        log(node, 6.0, 5, 2, 1)
        log(node, 7.0, 6, 2, 1)
        log(node, 8.5, 7, 3, 1)
        log(node, 11.5 if catching_up else 9.5, 8, 3, 1)
        if catching_up:
            log(node, 12.5, 9, 3, 1)
    if catching_up:
        log(2, 8.5, 7, 3, 0, "stale", current=False, contributes=False)
        log(2, 11.5, 8, 3, 0, healed_digest, contributes=False)
        log(2, 12.5, 9, 3, 0, healed_digest)
    else:
        log(2, 8.5, 7, 3, 0, healed_digest)
        log(2, 9.5, 8, 3, 0, healed_digest)
    for (node, rank), rows in lines.items():
        (directory / f"node{node}.rank{rank}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return RunLog("ft-failure", str(directory), 0.0, events={"kill": KILL, "restart": RESTART})


def test_a_failure_run_yields_the_outage_numbers(tmp_path: Path) -> None:
    results = failure_results(_write_run(tmp_path), steps=8)
    assert results["seconds_to_next_commit"] == pytest.approx(6.0 - KILL)  # the discarded line is no commit
    assert results["steps_discarded"] == 1
    assert results["survivor_steps_during_outage"] == 2  # steps 5 and 6, alone
    assert results["outage_seconds"] == pytest.approx(8.5 - KILL)
    assert results["killed_at_step"] == 4


def test_a_rejoin_is_bit_identical_only_if_every_common_step_matches(tmp_path: Path) -> None:
    (tmp_path / "same").mkdir()
    healed = rejoin_results(_write_run(tmp_path / "same"), failure_free_step=1.0)
    assert healed == {"seconds": pytest.approx(8.5 - RESTART), "bit_identical": True, "first_step": 7,
                      "digests_compared": 2 * 2 * 2,  # 2 ranks x 2 peers x steps 7, 8
                      "seconds_to_current": pytest.approx(8.5 - RESTART), "steps_catching_up": 0,
                      "first_contributing_step": 7, "seconds_starting": 0.0, "checkpoint_save_seconds": 0.0,
                      "failure_free_step_seconds": 1.0,
                      # node 0's longest gap spanning the heal (7.0 -> 8.5) in failure-free steps (1 s), minus one
                      "survivor_stall_steps": pytest.approx(0.5),
                      # node 0's gap before its commit of step 7 (7.0 -> 8.5) in its median step time (1 s), minus one
                      "heal_step_stall_steps": pytest.approx(0.5)}
    (tmp_path / "other").mkdir()
    assert rejoin_results(_write_run(tmp_path / "other", healed_digest="stale"), 1.0)["bit_identical"] is False


def test_a_catching_up_rejoin_is_compared_from_its_shards_being_current(tmp_path: Path) -> None:
    """Its stale step is not compared (its digests differ by design), its time to current counts the download,
    and the survivors' stall window runs until then: their late commit of step 8 is in it."""
    (tmp_path / "catching-up").mkdir()
    # the restarted processes were set up and asked for their first quorum at t=8.0
    (tmp_path / "catching-up" / "events.node2.rank0.jsonl").write_text(
        json.dumps({"t": 1.0, "event": "train_start", "pid": 1}) + "\n"  # the first launch: before the restart
        + json.dumps({"t": 8.0, "event": "train_start", "pid": 2}) + "\n"
    )
    healed = rejoin_results(_write_run(tmp_path / "catching-up", catching_up=True), failure_free_step=0.5)
    assert healed["seconds_starting"] == pytest.approx(8.0 - RESTART)
    assert healed["bit_identical"] is True and healed["digests_compared"] == 2 * 2 * 2  # steps 8, 9
    assert healed["seconds"] == pytest.approx(8.5 - RESTART)
    assert healed["seconds_to_current"] == pytest.approx(11.5 - RESTART) and healed["steps_catching_up"] == 1
    assert healed["first_contributing_step"] == 9
    # node 0's gaps from the restart (7.5) to 11.5: 7.0 -> 8.5, 8.5 -> 11.5, 11.5 -> 12.5; the longest (3 s) in
    # failure-free steps (0.5 s), minus one -- whatever the steps in the window took
    assert healed["survivor_stall_steps"] == pytest.approx(3.0 / 0.5 - 1)


def test_a_survivor_left_out_of_a_quorum_is_compared_only_where_its_own_shards_are_current(tmp_path: Path) -> None:
    """On a slow host the Lighthouse can form the heal's quorum with one survivor and the restarted node, and the
    survivor left out heals from them at the next quorum: its step while catching up carries stale digests by
    design and is not held against the rejoin; its current steps still are."""
    run = _write_run(tmp_path, catching_up=True)
    for rank in range(2):
        path = tmp_path / f"node1.rank{rank}.jsonl"
        rows = [json.loads(line) for line in path.read_text().splitlines()]
        for row in rows:
            if row["step"] == 9:
                row.update(current=False, contributes=False, digest=f"behind{rank}9")
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    healed = rejoin_results(run, failure_free_step=0.5)
    assert healed["bit_identical"] is True
    assert healed["digests_compared"] == 2 * 3  # 2 ranks x (node 0: steps 8, 9; node 1: step 8)
    for rank in range(2):  # a current step that differs still fails the rejoin
        path = tmp_path / f"node1.rank{rank}.jsonl"
        path.write_text(path.read_text().replace(f"same{rank}8", f"drift{rank}8"))
    assert rejoin_results(run, failure_free_step=0.5)["bit_identical"] is False


def test_the_heal_steps_own_gap_leaves_the_saves_out_and_the_stall_counts_everything() -> None:
    """Node 0 commits every second, a save every 3 steps adds 0.5 s to the next gap; the heal step (7) comes
    after a save and took 1 s more than a step: 0.5 s of it was the save. The heal step's own gap takes the save
    out; the survivors' stall, as its definition says, does not (the longest gap is 2 s: 1 step lost)."""
    times, t = [], 0.0
    for step in range(1, 12):
        t += 1.0 + (0.5 if step > 1 and (step - 1) % 3 == 0 else 0.0) + (0.5 if step == 7 else 0.0)
        times.append(t)
    rows = [{"t": when, "node": 0, "step": step, "global_step": step} for step, when in zip(range(1, 12), times)]
    gaps = SurvivorGaps(rows, [b - a for a, b in zip(times, times[1:])],
                              [row["global_step"] % 3 == 0 for row in rows[:-1]], 0.0)
    gaps.save_seconds = 0.5
    assert heal_step_stall_steps(gaps, 7) == pytest.approx(0.5)
    assert survivor_stall_steps(rows, times[3], times[8], failure_free_step=1.0) == pytest.approx(1.0)
    assert survivor_stall_steps(rows, times[3], None, failure_free_step=1.0) is None  # never healed


def test_what_a_save_costs_is_read_from_the_run(tmp_path: Path) -> None:
    lines, t = [], 0.0
    for step in range(1, 31):
        t += 1.0 + (0.4 if step > 1 and (step - 1) % 5 == 0 else 0.0)
        lines.append({"t": t, "node": 0, "rank": 0, "step": step, "global_step": step, "live": 3, "discarded": 0,
                      "digest": "d", "loss": 1.0})
    (tmp_path / "node0.rank0.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
    gaps = survivor_gaps(RunLog("x", str(tmp_path), 0.0), checkpoint_every=5)
    assert gaps.save_seconds == pytest.approx(0.4) and sum(gaps.saved) == 5
    assert survivor_gaps(RunLog("x", str(tmp_path), 0.0), checkpoint_every=0).save_seconds == 0.0
    (tmp_path / "drifted").mkdir()
    drifted = rejoin_results(_write_run(tmp_path / "drifted", healed_digest="off", catching_up=True), 1.0)
    assert drifted["bit_identical"] is False


# ------------------------------------------------------------------------------------ trajectory
#: 3 groups x 2 ranks x 2 samples per rank: a global batch of 12, step s reads samples 12 s .. 12 s + 11
GROUPS, RANKS, MICRO = 3, 2, 2


def _samples(step: int, share: int, rank: int) -> list[int]:
    start = step * GROUPS * RANKS * MICRO + (share * RANKS + rank) * MICRO
    return list(range(start, start + MICRO))


def _records(steps: int, kill_at: int | None = None, rejoin_at: int | None = None, pid: int = 1,
             loss: float = 1.0) -> list[dict]:
    """What the worker logs for ``steps`` committed steps of a fault-tolerant run. With ``kill_at``: group 2
    dies during step ``kill_at`` (the survivors' attempt of it with all three is discarded: not committed),
    groups 0 and 1 redo it and train on alone reading group 2's share too (group 0 takes shares 0 and 2);
    with ``rejoin_at``: group 2, restarted (another pid), heals to that step and all three train on."""
    out: list[dict] = []

    def log(node: int, step: int, shares: tuple[int, ...], participant: int | None, participants: int,
            committed: bool, process: int = pid) -> None:
        for rank in range(RANKS):
            samples = [i for share in shares for i in _samples(step, share, rank)]
            out.append({"t": float(step), "node": node, "rank": rank, "pid": process, "step": step, "micro": 0,
                        "shares": list(shares), "samples": samples, "loss": loss + step / 100,
                        "participant": participant, "participants": participants, "committed": committed})

    for step in range(steps):
        alone = kill_at is not None and step >= kill_at and (rejoin_at is None or step < rejoin_at)
        if kill_at is not None and step == kill_at:
            for node in range(GROUPS):
                if node != 2:
                    log(node, step, (node,), node, GROUPS, committed=False)  # the attempt the kill discarded
        if alone:
            log(0, step, (0, 2), 0, 2, True)
            log(1, step, (1,), 1, 2, True)
        else:
            for node in range(GROUPS):
                log(node, step, (node,), node, GROUPS, True, pid + 1 if rejoin_at is not None and step >= rejoin_at
                    and node == 2 else pid)
    return sorted(out, key=lambda r: (r["node"], r["rank"], r["t"]))


def test_a_kill_and_a_rejoin_that_keep_the_trajectory_pass_every_check() -> None:
    reference = _records(10)
    results = trajectory_results(reference, _records(10, kill_at=3, rejoin_at=6))
    assert results["samples_skipped"] == 0 and results["samples_repeated"] == 0
    assert results["steps_differing"] == 0 and results["global_batch_constant"] is True
    assert results["global_batch"] == GROUPS * RANKS * MICRO and results["steps_compared"] == 10
    assert results["max_loss_diff"] == 0.0 and results["steps_with_loss_compared"] == 10
    assert results["micro_steps_committed"] == 10 * GROUPS * RANKS - (6 - 3) * RANKS  # group 2 away for 3 steps


def test_a_skipped_sample_is_detected() -> None:
    """The survivors drop the lost group's share (a fixed share per group): its samples go unread."""
    run = [r for r in _records(10, kill_at=3) if not (r["shares"] == [0, 2])] + [
        {**r, "shares": [0], "samples": r["samples"][:MICRO]} for r in _records(10, kill_at=3) if r["shares"] == [0, 2]
    ]
    results = trajectory_results(_records(10), run)
    assert results["samples_skipped"] == (10 - 3) * RANKS * MICRO and results["samples_repeated"] == 0
    assert results["global_batch_constant"] is False and results["steps_differing"] == 7


def test_a_repeated_sample_is_detected() -> None:
    """A restarted group re-reads a share it read before (from the start of its epoch, say), the batch size
    unchanged: repeated samples -- and those of the step it should have read skipped."""
    run = _records(10, kill_at=3, rejoin_at=6)
    for record in run:
        if record["node"] == 2 and record["step"] == 6:
            record["samples"] = _samples(0, 2, record["rank"])
    results = trajectory_results(_records(10), run)
    assert results["samples_repeated"] == RANKS * MICRO and results["samples_skipped"] == RANKS * MICRO
    assert results["global_batch_constant"] is True and results["steps_differing"] == 1


def test_a_discarded_attempt_counted_as_committed_would_repeat_its_samples() -> None:
    run = _records(10, kill_at=3)
    for record in run:
        record["committed"] = True  # the discarded attempt of step 3 now counts
    results = trajectory_results(_records(10), run)
    assert results["samples_repeated"] == 2 * RANKS * MICRO and results["global_batch_constant"] is False


def test_a_changed_global_batch_is_detected_and_a_loss_difference_measured() -> None:
    run = _records(10, loss=1.25)
    run = [r for r in run if not (r["step"] == 4 and r["node"] == 1 and r["rank"] == 1)]  # one rank's share lost
    results = trajectory_results(_records(10), run)
    assert results["global_batch_constant"] is False and results["global_batch"] == [10, 12]
    assert results["samples_skipped"] == MICRO and results["steps_differing"] == 1
    assert results["max_loss_diff"] == pytest.approx(0.25)
    assert results["first_step_loss_differs"] == 0 and results["first_step_loss_diff_over_1e-3"] == 0
    clean = trajectory_results(_records(10), _records(10))
    assert clean["first_step_loss_differs"] is None and clean["first_step_loss_diff_over_1e-3"] is None
    assert clean["final_loss_rel_diff"] == 0.0


def test_the_final_loss_is_the_mean_of_the_last_steps_compared() -> None:
    """Losses 1 + step/100 in the reference; the run's are 0.5 higher over its last 5 of 30 steps only."""
    reference, run = _records(30), _records(30)
    for record in run:
        if record["step"] >= 25:
            record["loss"] += 0.5
    results = trajectory_results(reference, run)
    last = range(30 - FINAL_LOSS_STEPS, 30)
    mean_ref = sum(1 + step / 100 for step in last) / len(last)
    assert results["final_loss_steps"] == [last[0], last[-1]]
    assert results["final_loss_rel_diff"] == pytest.approx(0.5 * 5 / len(last) / mean_ref)


def test_a_group_outside_the_quorum_trains_nothing_and_a_run_cut_short_is_compared_where_both_reached() -> None:
    run = _records(6)
    run += [{**r, "participant": None, "node": 3} for r in run if r["step"] == 2 and r["node"] == 0]
    results = trajectory_results(_records(10), run)
    assert results["steps_compared"] == 6 and results["samples_skipped"] == 0 and results["samples_repeated"] == 0


def test_records_are_read_back_as_the_worker_writes_them_a_cut_last_line_left_out(tmp_path: Path) -> None:
    records = _records(3)
    for node in range(GROUPS):
        for rank in range(RANKS):
            mine = [json.dumps(r) for r in records if (r["node"], r["rank"]) == (node, rank)]
            (tmp_path / f"samples.node{node}.rank{rank}.jsonl").write_text("\n".join(mine) + '\n{"t": 9.0, "no')
    (tmp_path / "node0.rank0.jsonl").write_text('{"t": 1.0}\n')  # the step log: not a sample record
    assert trajectory_results(records, read_sample_records(tmp_path))["steps_differing"] == 0
    assert len(read_sample_records(tmp_path)) == len(records)


# ------------------------------------------------------------------------------------ goodput
def test_the_schedule_kills_the_groups_in_turn_mid_period_and_smoke_skips_it() -> None:
    schedule = schedule_of(bench.parse_args(["--quick"]))
    assert schedule.window == bench.QUICK.goodput_period * bench.QUICK.goodput_failures
    assert [node for _, node in schedule.kills()] == [2, 1, 0][: bench.QUICK.goodput_failures]
    assert schedule.kills()[0][0] == pytest.approx(schedule.period / 2)
    assert bench.parse_args(["--smoke"]).goodput_failures == 0
    with pytest.raises(SystemExit):
        bench.parse_args(["--quick", "--goodput-period", "5", "--restart-delay", "10"])


def test_restart_progress_loses_what_came_after_the_checkpoint() -> None:
    """Attempt 1 (launched at 0) logs steps 1-7 at t=1..7 and is killed at 7.5; attempt 2 (launched at 10)
    resumed from the checkpoint at step 5: it logs steps 6.. from t=20."""
    rows = [{"t": float(s), "node": 0, "global_step": s} for s in range(1, 8)]
    rows += [{"t": 20.0 + i, "node": 0, "global_step": 6 + i} for i in range(5)]
    progress = lambda at: restart_progress(rows, [0.0, 10.0], [7.5], at)  # noqa: E731
    assert progress(6.5) == 6  # running: its last step counts
    assert progress(8.0) == 5  # killed: only the checkpoint it will resume from
    assert progress(15.0) == 5  # starting again
    assert progress(22.5) == 8


def test_goodput_is_committed_samples_per_second_over_the_failure_free_rate(tmp_path: Path) -> None:
    def run(name: str, rows: list[dict], **events: float) -> RunLog:
        (tmp_path / name).mkdir()
        (tmp_path / name / "node0.rank0.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        return RunLog(name, str(tmp_path / name), 0.0, events=dict(events))

    line = lambda t, step: {"t": t, "node": 0, "step": step, "global_step": step}  # noqa: E731
    ft_free = run("ft-free", [line(0.5 * s, s) for s in range(1, 41)])  # 2 steps/s
    plain_free = run("plain-free", [line(0.5 * s, s) for s in range(1, 41)])  # 2 steps/s
    # window 10 s from t=2: fault tolerance commits 18 steps (2 -> 20); the restarts 8 (8 -> 16). Node 2 is down
    # from 4 to 6 s (2 of the window's 3 x 10 node-seconds)
    ft = run("ft", [line(2.0 + 10 * i / 18, 2 + i) for i in range(19)], window_start=2.0,
             **{"kill1.node2": 4.0, "restart1.node2": 6.0})
    restart = run("restart", [line(2.0 + i, 8 + i) for i in range(9)] + [line(12.5, 17)], window_start=2.0,
                  launch1=0.0)
    free, denominator = failure_free_rate(plain_free, ft_free)
    assert free == pytest.approx(2.0) and denominator.startswith("plain MiCS")
    results = goodput_results(ft, restart, free, denominator, Schedule(5.0, 2, 1.0), global_batch=24)
    assert results["committed_steps"] == {"fault_tolerance": 18, "restart_from_checkpoint": 8}
    # one denominator for both: plain MiCS's failure-free rate
    assert results["fault_tolerance"] == pytest.approx(18 / 10 / 2)
    assert results["restart_from_checkpoint"] == pytest.approx(8 / 10 / 2)
    assert results["ratio_ft_over_restart"] == pytest.approx(0.9 / 0.4)
    assert results["limit"] == pytest.approx(1 - 2.0 / 30.0)
    assert results["efficiency"] == pytest.approx(0.9 / (1 - 2.0 / 30.0))
    assert results["committed_samples_per_second"]["fault_tolerance"] == pytest.approx(18 * 24 / 10)
    assert results["schedule"]["window_seconds"] == 10.0
    # --only goodput: no plain MiCS and no restart-from-checkpoint runs; the denominator says so
    free, denominator = failure_free_rate(None, ft_free)
    alone = goodput_results(ft, None, free, denominator, Schedule(5.0, 2, 1.0), global_batch=24)
    assert alone["fault_tolerance"] == results["fault_tolerance"] and "--only goodput" in alone["denominator"]
    assert alone["restart_from_checkpoint"] is None and alone["ratio_ft_over_restart"] is None
    assert alone["committed_steps"] == {"fault_tolerance": 18, "restart_from_checkpoint": None}
    table = markdown_table({"goodput": alone})
    assert "| goodput: fault tolerance (over plain MiCS's failure-free rate) | 0.900 |" in table
    assert "| goodput: restart from checkpoint (the same denominator) | - |" in table


def test_a_node_down_until_the_window_ends_counts_until_then_and_a_kill_before_it_from_its_start(
    tmp_path: Path
) -> None:
    run = RunLog("ft", str(tmp_path), 0.0, events={"kill1.node2": 5.0, "restart1.node2": 15.0,
                                                         "kill2.node1": 25.0})
    assert alive_fraction(run, (10.0, 30.0)) == pytest.approx(1 - (5.0 + 5.0) / (3 * 20.0))


def _with_commit_lines(records: list[dict]) -> list[dict]:
    """The worker's format: the record before the backward (``committed`` unknown), then a commit line."""
    out: list[dict] = []
    for record in records:
        out.append({**record, "committed": None})
        out.append({k: record[k] for k in ("node", "rank", "pid", "step")} | {"commit": record["committed"]})
    return out


def test_a_group_killed_between_its_commit_and_its_commit_line_counts_as_its_quorum_decided() -> None:
    """Group 2 committed step 2 with the others and was killed before writing that it did; it had also started
    the 3-group attempt of step 3 (discarded, no commit line either). Its step-2 samples were trained (the other
    groups of that 3-group quorum committed it); its step-3 attempt's were not (they did not)."""
    run = _with_commit_lines(_records(10, kill_at=3))
    last_commit = max(i for i, r in enumerate(run) if r["node"] == 2 and r.get("commit") is not None and r["step"] == 2)
    del run[last_commit]
    run += [{**r, "step": 3, "samples": _samples(3, 2, r["rank"]), "committed": None}
            for r in run if r["node"] == 2 and r["step"] == 2 and "commit" not in r]
    results = trajectory_results(_records(10), run)
    assert results["samples_skipped"] == 0 and results["samples_repeated"] == 0
    assert results["global_batch_constant"] is True and results["max_loss_diff"] == 0.0


def _cpu_run(directory: Path, name: str, cpu_per_step: dict[tuple[int, int], float], warmup_cpu: float) -> RunLog:
    """A no-failure run whose ranks each log 8 steps, the first 3 slower (warm-up), then ``cpu_per_step``."""
    run_dir = directory / name
    run_dir.mkdir()
    for (node, rank), per_step in cpu_per_step.items():
        cpu, rows = 0.0, []
        for step in range(1, 9):
            cpu += warmup_cpu if step <= 3 else per_step
            rows.append({"t": float(step), "node": node, "rank": rank, "step": step, "cpu": cpu})
        (run_dir / f"node{node}.rank{rank}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return RunLog(name, str(run_dir), 0.0)


def test_cpu_per_step_sums_every_rank_after_the_warm_up_and_the_ratio_averages_the_runs(tmp_path: Path) -> None:
    ranks = [(node, rank) for node in range(3) for rank in range(2)]
    plain = [_cpu_run(tmp_path, "plain", {key: 0.04 for key in ranks}, warmup_cpu=5.0),
             _cpu_run(tmp_path, "plain-2", {key: 0.06 for key in ranks}, warmup_cpu=5.0)]
    ft = _cpu_run(tmp_path, "ft", {key: 0.05 + (0.03 if key == (2, 1) else 0.0) for key in ranks}, warmup_cpu=9.0)
    assert cpu_seconds_per_step(plain[0]) == pytest.approx(6 * 0.04)  # the warm-up steps left out
    assert cpu_seconds_per_step(ft) == pytest.approx(6 * 0.05 + 0.03)
    assert cpu_ratio(plain, [ft]) == pytest.approx((6 * 0.05 + 0.03) / (6 * 0.05))
    (tmp_path / "old").mkdir()  # a run logged before the worker wrote its CPU time: no number, not a wrong one
    (tmp_path / "old" / "node0.rank0.jsonl").write_text(json.dumps({"t": 1.0, "node": 0, "rank": 0, "step": 1}) + "\n")
    assert cpu_ratio(plain, [RunLog("old", str(tmp_path / "old"), 0.0)]) is None


def test_the_goodput_window_is_split_into_the_stretches_of_each_outage(tmp_path: Path) -> None:
    """One kill of node 2 at 10 s: the survivors commit again at 12 s, the replacement is launched at 20 s, set up
    at 25 s and contributes from 28 s; one committed step a second otherwise (the failure-free rate)."""
    rows = [{"t": float(t), "node": node, "rank": 0, "step": t, "contributes": True, "current": True}
            for t in range(1, 10) for node in (0, 1, 2)]
    rows += [{"t": float(t), "node": node, "rank": 0, "step": t - 2, "contributes": True, "current": True}
             for t in range(12, 41) for node in (0, 1)]
    rows += [{"t": 26.0, "node": 2, "rank": 0, "step": 24, "contributes": False, "current": False}]
    rows += [{"t": float(t), "node": 2, "rank": 0, "step": t - 2, "contributes": True, "current": True}
             for t in range(28, 41)]
    rows.sort(key=lambda row: row["t"])
    (tmp_path / "events.node2.rank0.jsonl").write_text(
        "".join(json.dumps({"t": t, "event": "train_start"}) + "\n" for t in (-5.0, 25.0)))
    run = RunLog("ft-goodput", str(tmp_path), -10.0, events={"kill1.node2": 10.0, "restart1.node2": 20.0})
    phases = goodput_phases(run, rows, (0.0, 40.0), failure_free_steps_per_second=1.0)
    assert {phase: stretch["seconds"] for phase, stretch in phases.items()} == {
        "detecting": 2.0, "alone": 8.0, "replacement_starting": 5.0, "catching_up": 3.0, "all_live": 22.0}
    assert phases["detecting"]["steps"] == 1  # step 10 came 2 s after step 9
    assert phases["alone"]["rate_vs_failure_free"] == pytest.approx(1.0)
    committed = ft_progress(rows, 40.0) - ft_progress(rows, 0.0)
    assert sum(stretch["goodput_lost"] for stretch in phases.values()) == pytest.approx(1 - committed / 40.0)
    # while out (alone and replacement starting, 13 s): 13 steps at 1 step/s failure-free -- nothing lost
    assert survivor_rate_while_out(phases, 1.0) == pytest.approx(13 / 13)
    assert survivor_rate_while_out(phases, 1.5) == pytest.approx(13 / 13 / 1.5)


def _timed_run(directory: Path, name: str, step_seconds: float) -> RunLog:
    """A no-failure run whose ranks log 10 steps ``step_seconds`` apart, the first 3 slower (warm-up)."""
    run_dir = directory / name
    run_dir.mkdir()
    for node in range(3):
        for rank in range(2):
            t, rows = 0.0, []
            for step in range(1, 11):
                t += 5.0 if step <= 3 else step_seconds
                rows.append({"t": t, "node": node, "rank": rank, "step": step, "cpu": t})
            (run_dir / f"node{node}.rank{rank}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return RunLog(name, str(run_dir), 0.0)


def test_a_variants_overhead_is_its_runs_pooled_against_the_same_plain_runs(tmp_path: Path) -> None:
    plains = [_timed_run(tmp_path, "plain", 0.10), _timed_run(tmp_path, "plain-2", 0.10)]
    exacts = [_timed_run(tmp_path, "exact", 0.12), _timed_run(tmp_path, "exact-2", 0.13)]
    numbers = variant_overhead(plains, exacts)
    assert numbers["overhead"] == pytest.approx(1.25)  # the pooled median of 0.12 and 0.13 steps
    assert numbers["runs_step_seconds"] == pytest.approx([0.12, 0.13])
    assert numbers["cpu_overhead"] == pytest.approx(1.25)
    assert variant_overhead(plains, []) == {}


def test_the_headline_runs_are_fault_tolerances_defaults_and_a_section_says_what_it_changed() -> None:
    headline = bench.fault_tolerance_settings()
    assert headline["non_default"] == []
    assert headline["options"]["heal"] == "auto" and headline["options"]["quorum_every"] == 10
    assert bench.fault_tolerance_settings(bench.EXACT)["non_default"] == ["exact_trajectory"]


@pytest.mark.parametrize("extra, exact_runs", [([], 1), (["--no-exact-trajectory"], 0), (["--smoke"], 0)])
def test_the_no_failure_runs_measure_fault_tolerances_default_and_each_option_once(
    extra: list[str], exact_runs: int
) -> None:
    plan = bench.no_failure_plan(bench.parse_args(["--quick", *extra]))
    names = [name for name, _, _ in plan]
    exacts = [name for name, _, fields in plan if fields.get("ft_options") == bench.EXACT]
    assert len(exacts) == exact_runs
    assert names[:2] == ["plain", "ft"] and plan[1][2] == {}  # fault tolerance with its defaults
    if "--smoke" in extra:
        assert names == ["plain", "ft"]
    else:
        assert names[-1] == "ft-quorum-every-step" and plan[-1][2]["ft_options"] == {"quorum_every": 1}
    runs = {name: RunLog(name, f"/logs/{name}", 0.0) for name in names}
    plains, defaults, every_step, exact = bench.no_failure_runs_by_kind(plan, runs)
    assert [run.name for run in plains] == ["plain"]
    assert [run.name for run in defaults] == ["ft"]
    assert [run.name for run in exact] == exacts
    assert (every_step is None) == ("--smoke" in extra)


def _sliced_run(directory: Path, name: str, step_seconds: list[float], slices: list[tuple[float, float]],
                cpu_per_second: float = 2.0) -> RunLog:
    """A time-sliced run: every rank logs a step every ``step_seconds[k]`` while slice ``k`` runs (its first line
    at the slice's start ends a step that a stop cut through), and nothing in between; a start-up line before."""
    run_dir = directory / name
    run_dir.mkdir()
    for node in range(3):
        for rank in range(2):
            rows, step, cpu = [{"t": slices[0][0] - 30.0, "node": node, "rank": rank, "step": 1, "cpu": 5.0}], 1, 5.0
            for (start, end), seconds in zip(slices, step_seconds):
                t = start + 0.5 * seconds  # the step in flight when the run was stopped ends here
                while t <= end:
                    step, cpu = step + 1, cpu + cpu_per_second * seconds / 6
                    rows.append({"t": t, "node": node, "rank": rank, "step": step, "cpu": cpu})
                    t += seconds
            (run_dir / f"node{node}.rank{rank}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return RunLog(name, str(run_dir), 0.0, slices=list(slices))


def test_a_time_sliced_run_measures_only_the_steps_inside_its_slices_and_each_round_against_plain(
    tmp_path: Path
) -> None:
    """Plain and fault tolerance took the host in turn, 3 s each; the host got slower in round 2 (both modes alike).
    The steps cut by a stop (they span the other run's slice) and the start-up are not step times."""
    plain_slices = [(100.0, 103.0), (106.0, 109.0), (112.0, 115.0)]
    ft_slices = [(103.0, 106.0), (109.0, 112.0), (115.0, 118.0)]
    plain = _sliced_run(tmp_path, "plain", [0.2, 0.3, 0.2], plain_slices)
    ft = _sliced_run(tmp_path, "ft", [0.25, 0.375, 0.25], ft_slices, cpu_per_second=2.0)
    assert max(step_intervals(plain)) == pytest.approx(0.3)  # no interval spans a stop or the start-up
    assert median_step_seconds(plain) == pytest.approx(0.2)
    assert slice_step_seconds(ft) == pytest.approx([0.25, 0.375, 0.25])
    by_round = ratio_by_round(plain, ft)
    assert by_round is not None and by_round["rounds"] == 3
    assert by_round["quartiles"] == pytest.approx([1.25, 1.25, 1.25])  # the slow round cancels out
    # CPU per step: 2 CPU-s per second over 6 ranks, so a step costs 2 x its seconds, from in-slice steps only
    plain_cpu = cpu_seconds_per_step(plain)
    assert plain_cpu is not None and 0.4 < plain_cpu < 0.6
    assert cpu_ratio([plain], [ft]) == pytest.approx(1.25, rel=1e-2)  # each mean weighs rounds by their steps
    unsliced = RunLog("plain", plain.log_dir, 0.0)  # the same lines read as a run made alone
    assert max(step_intervals(unsliced)) > 3.0 and ratio_by_round(unsliced, ft) is None
    assert time_slicing(unsliced, {"ft": ft}) == {}
    sliced = time_slicing(plain, {"ft": ft, "quorum_every_step": None})
    assert sliced["time_sliced"]["rounds"] == 3 and set(sliced["overhead_by_round"]) == {"ft"}
    # the failure-free rate the restarts' goodput is held to: steps per second while the run had the host, not
    # over its wall clock, which holds the other run's slices
    rate = failure_free_steps_per_second(plain)
    assert rate is not None and 1 / 0.3 < rate < 1 / 0.2
    alone = failure_free_steps_per_second(unsliced)
    assert alone == pytest.approx(steps_per_second(read_rows(plain))) and alone < rate / 1.5
