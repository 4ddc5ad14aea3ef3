"""``goodput.*`` of ``benchmarks/fault_tolerance.py``: what each method commits under run (6)'s failure schedule.

Committed samples per second in the window, for fault tolerance and for restart from checkpoint, over one
failure-free rate (:func:`failure_free_rate`, :func:`goodput_results`); how far each had got at any moment
(:func:`ft_progress`, :func:`restart_progress`: a restarted job's steps past its last checkpoint are lost); the
schedule's limit (:func:`alive_fraction`), the survivors' rate while a group is out, and where the fault-tolerant
window went, stretch by stretch of each outage (:func:`goodput_phases`).
"""

from __future__ import annotations

from typing import Any

from benchmarks.fault_tolerance_analysis import measured_pairs
from benchmarks.fault_tolerance_logs import NODES, RunLog, commits, read_events, read_rows, relative
from benchmarks.fault_tolerance_runs import Schedule


def steps_per_second(rows: list[dict[str, Any]], key: str = "step", skip: int = 3) -> float | None:
    """The mean rate of a failure-free run: node 0's lines, the first ``skip`` (warm-up) left out."""
    mine = [r for r in rows if r["node"] == 0][skip:]
    if len(mine) < 2 or mine[-1]["t"] <= mine[0]["t"]:
        return None
    return (mine[-1][key] - mine[0][key]) / (mine[-1]["t"] - mine[0]["t"])


def failure_free_steps_per_second(run: RunLog, key: str = "step") -> float | None:
    """The mean rate of a failure-free run (:func:`steps_per_second`); of a time-sliced one (run 1), over the steps
    inside its slices only -- its wall clock also holds the other runs' slices, when it was stopped."""
    rows = read_rows(run)
    if run.slices is None:
        return steps_per_second(rows, key)
    pairs = measured_pairs(run, [row for row in rows if row["node"] == 0])
    seconds = sum(b["t"] - a["t"] for a, b in pairs)
    return sum(b[key] - a[key] for a, b in pairs) / seconds if seconds > 0 else None


def ft_progress(rows: list[dict[str, Any]], at: float) -> int:
    """Fault tolerance: the committed steps at time ``at`` (the most any group had logged by then)."""
    return max((r["step"] for r in rows if r["t"] <= at), default=0)


def restart_progress(rows: list[dict[str, Any]], launches: list[float], kills: list[float], at: float) -> int:
    """Restart from checkpoint: the steps done at time ``at`` that are not lost (node 0's lines, ``global_step``;
    ``launches``: when each attempt started, in order). A running attempt's last step counts; once it is killed,
    only what the next attempt resumes from (its first step minus one) does -- as does an attempt that is
    starting (it resumes from the last checkpoint)."""
    mine = [r for r in rows if r["node"] == 0]
    starts = sorted(launches)
    current = max((i for i, t in enumerate(starts) if t <= at), default=0)

    def lines_of(attempt: int) -> list[dict[str, Any]]:
        end = starts[attempt + 1] if attempt + 1 < len(starts) else float("inf")
        return [r for r in mine if starts[attempt] <= r["t"] < end]

    def resumed(attempt: int) -> int:  # what attempt ``attempt`` resumed from
        lines = lines_of(attempt) if attempt < len(starts) else []
        if lines:
            return lines[0]["global_step"] - 1
        return resumed(attempt - 1) if attempt > 0 else 0  # never logged: no new checkpoint either

    killed = any(starts[current] < k <= at for k in kills)
    done = [r for r in lines_of(current) if r["t"] <= at]
    if killed:
        return resumed(current + 1)
    return done[-1]["global_step"] if done else resumed(current)


#: The stretches of each outage in the fault-tolerant goodput run, in order (:func:`goodput_phases`).
OUTAGE_PHASES = ("detecting", "alone", "replacement_starting", "catching_up", "all_live")


def goodput_phases(run: RunLog, rows: list[dict[str, Any]], window: tuple[float, float],
                   failure_free_steps_per_second: float) -> dict[str, dict[str, float]]:
    """Where the fault-tolerant goodput run's window went, stretch by stretch of each outage: from a kill until
    the survivors commit without the lost group (``detecting``: the Lighthouse's heartbeat timeout), until its
    replacement is launched (``alone``), until the replacement's processes are set up (``replacement_starting``:
    imports and setup -- on this host they share the survivors' cores, where a real replacement brings its own),
    until it contributes (``catching_up``), and the rest (``all_live``). Per stretch: its seconds in the window,
    committed steps per second over the failure-free rate, and the share of the window's failure-free steps it
    lost (``goodput_lost``; over every stretch they add up to 1 - goodput)."""
    start, end = window
    kills = sorted((t, int(name.rsplit("node", 1)[1])) for name, t in run.events.items() if name.startswith("kill"))
    restarts = sorted(t for name, t in run.events.items() if name.startswith("restart"))
    bounds: list[tuple[float, str]] = [(start, "all_live")]
    for index, (kill, node) in enumerate(kills):
        before = ft_progress(rows, kill)
        committed = min((r["t"] for r in rows if r["t"] > kill and r["step"] > before), default=end)
        restart = next((t for t in restarts if t > kill), end)
        setup = min((e["t"] for e in read_events(run, node) if e["event"] == "train_start" and e["t"] > restart),
                    default=end)
        joined = min((r["t"] for r in rows if r["node"] == node and r["t"] > restart and r.get("contributes", True)
                      and r.get("current", True)), default=end)
        bounds += [(kill, "detecting"), (committed, "alone"), (restart, "replacement_starting"),
                   (setup, "catching_up"), (joined, "all_live")]
    bounds.sort(key=lambda bound: bound[0])
    out = {phase: {"seconds": 0.0, "steps": 0.0} for phase in OUTAGE_PHASES}
    for (begin, phase), (finish, _) in zip(bounds, bounds[1:] + [(end, "")]):
        begin, finish = max(begin, start), min(finish, end)
        if finish > begin:
            out[phase]["seconds"] += finish - begin
            out[phase]["steps"] += ft_progress(rows, finish) - ft_progress(rows, begin)
    for stretch in out.values():
        stretch["rate_vs_failure_free"] = (stretch["steps"] / stretch["seconds"] / failure_free_steps_per_second
                                           if stretch["seconds"] else None)
        stretch["goodput_lost"] = (stretch["seconds"] * failure_free_steps_per_second - stretch["steps"]) / (
            (end - start) * failure_free_steps_per_second)
    return out


def alive_fraction(run: RunLog, window: tuple[float, float]) -> float:
    """``goodput.limit``: the time-weighted fraction of the cluster's nodes alive in ``window`` under the schedule --
    each node down from its kill to its replacement's launch (``kill<k>.node<n>`` .. ``restart<k>.node<n>``), up
    again from the launch whether or not it trains yet. The most any method could commit."""
    start, end = window
    down = 0.0
    for name, kill in run.events.items():
        if name.startswith("kill"):
            restart = run.events.get("restart" + name[len("kill"):], end)
            down += max(0.0, min(restart, end) - max(kill, start))
    return 1 - down / (NODES * (end - start))


def survivor_rate_while_out(phases: dict[str, dict[str, float]], free_steps_per_second: float) -> float | None:
    """``goodput.survivor_rate_while_out``: the survivors' committed steps per second over the failure-free rate
    while a group is out -- from their first commit without it until its replacement is set up (the ``alone`` and
    ``replacement_starting`` stretches of :func:`goodput_phases`). Every step reads the whole global batch, so this
    is also the ratio of committed samples; on nodes with CPUs of their own it is about (G - 1) / G."""
    out = [phases[name] for name in ("alone", "replacement_starting")]
    seconds = sum(stretch["seconds"] for stretch in out)
    return sum(stretch["steps"] for stretch in out) / seconds / free_steps_per_second if seconds else None


def failure_free_rate(plain: RunLog | None, ft_reference: RunLog) -> tuple[float | None, str]:
    """Goodput's denominator, in steps per second: plain MiCS's failure-free rate from run 1 (time-sliced, the same
    benchmark run); only with ``--only goodput``, which runs no plain MiCS, fault tolerance's run 5."""
    if plain is not None:
        return failure_free_steps_per_second(plain, key="global_step"), "plain MiCS, no failure (run 1, time-sliced)"
    return (steps_per_second(commits(read_rows(ft_reference), 0)),
            "fault tolerance, no failure (run 5; --only goodput runs no plain MiCS)")


def goodput_results(ft: RunLog, restart: RunLog | None, free: float | None, denominator: str,
                    schedule: Schedule, global_batch: int) -> dict[str, Any]:
    """Committed samples per second over the window, for fault tolerance and for restart from checkpoint, each
    over the same failure-free rate ``free`` (steps per second, :func:`failure_free_rate`; ``denominator`` says
    whose). Also the schedule's ``limit`` (:func:`alive_fraction`),
    ``efficiency`` = goodput / limit and the survivors' rate while a group is out. ``restart``: ``None`` without its
    runs (``--only goodput``)."""
    ft_rows = read_rows(ft)
    ft_start = ft.events["window_start"]
    window = (ft_start, ft_start + schedule.window)
    ft_steps = ft_progress(ft_rows, window[1]) - ft_progress(ft_rows, ft_start)
    ft_rate = ft_steps * global_batch / schedule.window
    ft_goodput = ft_rate / (free * global_batch) if free else None
    restart_steps = restart_rate = restart_goodput = None
    if restart is not None:
        restart_rows, restart_start = read_rows(restart), restart.events["window_start"]
        launches = [t for name, t in restart.events.items() if name.startswith("launch")]
        kills = [t for name, t in restart.events.items() if name.startswith("kill")]
        restart_steps = (restart_progress(restart_rows, launches, kills, restart_start + schedule.window)
                         - restart_progress(restart_rows, launches, kills, restart_start))
        restart_rate = restart_steps * global_batch / schedule.window
        restart_goodput = restart_rate / (free * global_batch) if free else None
    limit = alive_fraction(ft, window)
    phases = goodput_phases(ft, ft_rows, window, free) if free else None
    return {
        "fault_tolerance": ft_goodput,
        "restart_from_checkpoint": restart_goodput,
        "limit": limit,
        "efficiency": ft_goodput / limit if ft_goodput is not None else None,
        "restart_efficiency": restart_goodput / limit if restart_goodput is not None else None,
        "survivor_rate_while_out": survivor_rate_while_out(phases, free) if phases and free else None,
        "survivor_rate_expected": (NODES - 1) / NODES,
        "ratio_ft_over_restart": ft_goodput / restart_goodput if ft_goodput and restart_goodput else None,
        "denominator": denominator,
        "committed_samples_per_second": {"fault_tolerance": ft_rate, "restart_from_checkpoint": restart_rate},
        "committed_steps": {"fault_tolerance": ft_steps, "restart_from_checkpoint": restart_steps},
        "failure_free_samples_per_second": free * global_batch if free else None,
        "global_batch": global_batch,
        "schedule": {"period_seconds": schedule.period, "failures": schedule.failures,
                     "window_seconds": schedule.window, "restart_delay_seconds": schedule.restart_delay,
                     "kills": [{"at_seconds": at, "node": node} for at, node in schedule.kills()],
                     "window_starts_at_step": schedule.warmup + 1,
                     },
        "events": {"fault_tolerance": relative(ft),
                   "restart_from_checkpoint": None if restart is None else relative(restart)},
        "failures": {"fault_tolerance": ft.failures,
                     "restart_from_checkpoint": None if restart is None else restart.failures},
        "fault_tolerance_phases": phases,
    }
