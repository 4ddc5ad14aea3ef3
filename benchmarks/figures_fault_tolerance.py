"""The figure blocks of docs/fault-tolerance.md: the renderers :data:`benchmarks.figures.FIGURES` names for the
``benchmarks/fault_tolerance.py`` results (the headline table, the trajectory, ``quorum_every``, catch-up, exact and
CPU tables and "What it costs"). A module of their own because they are one benchmark's and ``figures.py`` holds
every other page's; formatting only, every number is the results file's.
"""

from __future__ import annotations

from typing import Any


def fault_tolerance_table(results: dict[str, Any]) -> str:
    """docs/fault-tolerance.md's table of one ``benchmarks/fault_tolerance.py`` run."""
    n, f, r = results["no_failure"], results["failure"], results["rejoin"]
    ft, baseline = results["ft"], results["restart_baseline"]
    steps = results.get("settings", {}).get("no_failure_steps")
    identical = f"{n['identical_steps']} of {steps or n['identical_steps'] + n.get('differing_steps', 0)}"
    identical += " steps identical" + ("" if n["identical_steps"] else ": the first sum differs in its last bits")
    lines = [
        "| measure | value |",
        "|---|---:|",
        f"| no failure: step time, fault-tolerant / plain (`no_failure.overhead`) | **{n['overhead']:.3f}** "
        f"({n['ft_step_seconds']:.3f} s / {n['plain_step_seconds']:.3f} s) |",
        f"| no failure: max abs diff of the parameters to plain `mics`, and between groups | {n['max_abs_diff']:g} and "
        f"{n['max_abs_diff_between_groups']:g} ({identical}) |",
        "| node lost: seconds from the kill to the survivors' next committed step | "
        f"{f['seconds_to_next_commit']:.1f} |",
        f"| node lost: steps discarded | {f['steps_discarded']} |",
        f"| rejoin: seconds from the restart to its first committed step | {r['seconds']:.1f} "
        f"({'bit-identical' if r['bit_identical'] else 'NOT bit-identical'}, {r['digests_compared']} digests) |",
        f"| seconds to the final step ({f['final_step']}): restart from checkpoint / fault tolerance | "
        f"{baseline['seconds']:.1f} / {ft['seconds']:.1f} ({baseline['seconds'] / ft['seconds']:.2f}x) |",
    ]
    return "\n".join(lines) + "\n"


def _extended(table: str, rows: list[str]) -> str:
    """A rendered table with ``rows`` added at its end."""
    return "\n".join(table.rstrip("\n").split("\n") + rows) + "\n"


def fault_tolerance_trajectory_table(results: dict[str, Any]) -> str:
    """docs/fault-tolerance.md's table of a run with the trajectory and goodput sections (issue 32)."""
    t, g, r = results["trajectory"], results["goodput"], results["rejoin"]
    lines = fault_tolerance_table(results).rstrip("\n").split("\n") + [
        f"| rejoin: survivors' longest gap between commits, in step times, minus one (`survivor_stall_steps`) | "
        f"{r['survivor_stall_steps']:.2f} |",
        f"| trajectory: samples skipped / repeated, against the failure-free run ({t['steps_compared']} steps) | "
        f"{t['samples_skipped']} / {t['samples_repeated']} |",
        f"| trajectory: global batch constant | {'yes' if t['global_batch_constant'] else 'NO'} "
        f"({t['global_batch']} samples) |",
        f"| trajectory: largest per-step loss difference, with failures vs without | {t['max_loss_diff']:.2g} "
        + (f"(step {t['max_loss_diff_step']}) |" if t["max_loss_diff"] else "(every step equal) |"),
        f"| trajectory: micro-batches reloaded (predicted wrong) | {t['micro_batches_reloaded']} |",
    ]
    if "skipped" in g:
        lines.append(f"| goodput | skipped: {g['skipped']} |")
    else:
        lines += [
            f"| goodput, committed samples/s over failure-free: fault tolerance / restart from checkpoint | "
            f"{g['fault_tolerance']:.2f} / {g['restart_from_checkpoint']:.2f} ({g['ratio_ft_over_restart']:.2f}x) |",
        ]
    return "\n".join(lines) + "\n"


def fault_tolerance_quorum_every_table(results: dict[str, Any]) -> str:
    """docs/fault-tolerance.md's table of a run with ``--quorum-every`` (the trajectory table, then what a quorum
    at every step costs against it)."""
    n, settings = results["no_failure"], results["settings"]
    runs = n["runs_step_seconds"]
    return _extended(fault_tolerance_trajectory_table(results), [
        f"| no failure: step times of the interleaved runs, plain / fault-tolerant (s) | "
        f"{' '.join(f'{t:.3f}' for t in runs['plain'])} / {' '.join(f'{t:.3f}' for t in runs['ft'])} |",
        f"| no failure: overhead with a quorum every step instead of every {settings['quorum_every']} "
        f"(`no_failure.overhead_quorum_every_step`) | {n['overhead_quorum_every_step']:.3f} |",
        f"| rejoin: survivors' gap before the step the restarted group joined, in step times, minus one "
        f"(`rejoin.heal_step_stall_steps`) | {results['rejoin']['heal_step_stall_steps']:.2f} |",
    ])


def fault_tolerance_catch_up_table(results: dict[str, Any]) -> str:
    """docs/fault-tolerance.md's table of a run with ``--heal catch_up`` (the quorum-every table, then the
    catch-up's own numbers and the stall as this benchmark first defined it)."""
    r = results["rejoin"]
    return _extended(fault_tolerance_quorum_every_table(results), [
        f"| rejoin: seconds from the restart to its shards being current (`rejoin.seconds_to_current`) | "
        f"{r['seconds_to_current']:.1f} |",
        f"| rejoin: steps it took part in without contributing, catching up (`rejoin.steps_catching_up`) | "
        f"{r['steps_catching_up']} |",
        f"| rejoin: what a survivors' checkpoint save adds to a step, taken out of the stall "
        f"(`rejoin.checkpoint_save_seconds`) | {r['checkpoint_save_seconds']:.3f} s |",
        f"| rejoin: the longest stall as first defined -- from the restart, saves left in, in the outage's "
        f"step (`rejoin.survivor_stall_steps_as_before`) | {r['survivor_stall_steps_as_before']:.2f} |",
    ])


def fault_tolerance_exact_table(results: dict[str, Any]) -> str:
    """docs/fault-tolerance.md's table of a run with ``--exact-trajectory`` (the catch-up table, then where the
    losses of the run with a failure first differ from the failure-free run's)."""
    t = results["trajectory"]
    first = t["first_step_loss_differs"]
    return _extended(fault_tolerance_catch_up_table(results), [
        f"| trajectory: `exact_trajectory` | {'on' if t.get('exact_trajectory') else 'off'} |",
        f"| trajectory: first step whose loss differs from the failure-free run's, of {t['steps_with_loss_compared']} "
        f"| {'none' if first is None else first} |",
    ])


def fault_tolerance_cpu_table(results: dict[str, Any]) -> str:
    """The ``--exact-trajectory`` table, then the no-failure CPU per step and where the goodput window went
    (``goodput.fault_tolerance_phases``)."""
    n = results["no_failure"]
    cpu = n["runs_cpu_seconds_per_step"]
    rows = [
        f"| no failure: CPU seconds per step, every thread of every rank, fault-tolerant / plain "
        f"(`no_failure.cpu_overhead`) | **{n['cpu_overhead']:.3f}** ({' '.join(f'{x:.3f}' for x in cpu['ft'])} / "
        f"{' '.join(f'{x:.3f}' for x in cpu['plain'])} s) |",
    ]
    for phase, stretch in (results.get("goodput", {}).get("fault_tolerance_phases") or {}).items():
        rate = stretch["rate_vs_failure_free"]
        rows.append(
            f"| goodput lost while `{phase}` (its seconds in the window; committed steps/s over failure-free) | "
            f"{stretch['goodput_lost']:.3f} ({stretch['seconds']:.1f} s; {'-' if rate is None else f'{rate:.2f}'}) |"
        )
    return _extended(fault_tolerance_exact_table(results), rows)


def _fmt(value: Any, pattern: str = "{:.3f}") -> str:
    return "-" if value is None else pattern.format(value)


def fault_tolerance_defaults_table(results: dict[str, Any]) -> str:
    """docs/fault-tolerance.md's "What it costs": one ``fault_tolerance.py --quick`` run with ``FaultTolerance()``'s
    defaults on nodes with CPUs of their own -- each measure, its value and the bound it is held to -- then the
    labelled sections (``exact_trajectory=True``, ``quorum_every=1``)."""
    settings = results["settings"]
    n, f, r, t, g = (results[key] for key in ("no_failure", "failure", "rejoin", "trajectory", "goodput"))
    groups = settings["num_replica_groups"]
    quota = settings.get("cpu_quota_per_node")
    changed = ", ".join(settings["fault_tolerance"]["non_default"]) or "none"
    rows = [
        ("`FaultTolerance` options other than its defaults (besides Lighthouse, group index, timeouts)", changed, ""),
        ("replica groups (one per node) x ranks; CPU quota per node", f"{groups} x 2; "
         + (f"{quota:.3g} cores" if quota else "none: " + str(settings.get("cpu_quota_unavailable"))), ""),
        ("no failure: step time, fault-tolerant / plain MiCS (`no_failure.overhead`)",
         f"{n['overhead']:.3f} ({n['ft_step_seconds']:.3f} s / {n['plain_step_seconds']:.3f} s)", "<= 1.03"),
        ("node lost: seconds from the kill to the next committed step", f"{f['seconds_to_next_commit']:.1f}", ""),
        ("node lost: steps discarded (`failure.steps_discarded`)", str(f["steps_discarded"]), "<= 1"),
        ("rejoin: seconds from the restart to its first committed step", f"{r['seconds']:.1f}", ""),
        ("rejoin: bit-identical to the survivors (`rejoin.bit_identical`)",
         f"{r['bit_identical']} ({r['digests_compared']} digests)", "True"),
        ("rejoin: survivors' longest gap between commits while it healed, in failure-free steps, minus one "
         "(`rejoin.survivor_stall_steps`)", _fmt(r["survivor_stall_steps"], "{:.2f}"), "<= 1"),
        ("trajectory: samples skipped / repeated, with a failure vs without",
         f"{t['samples_skipped']} / {t['samples_repeated']} ({t['steps_compared']} steps)", "0 / 0"),
        ("trajectory: global batch constant", f"{t['global_batch_constant']} ({t['global_batch']} samples)", "True"),
        ("trajectory: mean loss of the last 20 steps, relative difference (`trajectory.final_loss_rel_diff`)",
         _fmt(t["final_loss_rel_diff"], "{:.2g}"), "<= 0.01"),
        ("trajectory: largest per-step loss difference", _fmt(t["max_loss_diff"], "{:.3g}"), ""),
        ("goodput: fault tolerance, over plain MiCS's failure-free rate (`goodput.fault_tolerance`)",
         _fmt(g["fault_tolerance"]), ""),
        ("goodput: restart from checkpoint, the same denominator", _fmt(g["restart_from_checkpoint"]), ""),
        ("goodput: fault tolerance / restart from checkpoint", _fmt(g["ratio_ft_over_restart"], "{:.2f}"), ">= 2"),
        ("goodput: the schedule's limit, nodes alive (`goodput.limit`)", _fmt(g["limit"]), ""),
        ("goodput: efficiency, goodput / limit (`goodput.efficiency`)", _fmt(g["efficiency"]), ">= 0.9"),
        ("goodput: survivors' committed rate while a group is out, over failure-free",
         _fmt(g["survivor_rate_while_out"]), f"{(groups - 1) / groups:.3f} +- 0.1"),
    ]
    exact = results.get("exact_trajectory")
    if exact:
        rows += [
            ("`exact_trajectory=True`: no-failure step time / plain MiCS", _fmt(exact["overhead"]), ""),
            ("`exact_trajectory=True`: largest per-step loss difference, with a failure vs without",
             _fmt(exact["trajectory"]["max_loss_diff"], "{:.3g}"), "<= 1e-3"),
            ("`exact_trajectory=True`: survivors' stall while it healed, failure-free steps minus one",
             _fmt(exact["rejoin"]["survivor_stall_steps"], "{:.2f}"), ""),
        ]
    every_step = (results.get("variants") or {}).get("quorum_every_1")
    if every_step:
        rows.append(("`quorum_every=1`: no-failure step time / plain MiCS", _fmt(every_step["overhead"]), ""))
    lines = ["| measure | value | bound |", "|---|---:|---:|", *(f"| {a} | {b} | {c} |" for a, b, c in rows)]
    return "\n".join(lines) + "\n"
