"""What ``benchmarks/fault_tolerance.py`` shows: ``fault_tolerance.png`` (committed step over time, both failure runs,
kill and restarts marked: :func:`draw_timeline`) and the table of headline numbers it prints at the end
(:func:`markdown_table`). Both read what the runs logged and the results already derived; they compute nothing new.
"""

from __future__ import annotations

import sys
import textwrap
from pathlib import Path
from typing import Any

from benchmarks.fault_tolerance_logs import NODES, RunLog, commits, read_rows
from benchmarks.fault_tolerance_runs import SLICE_SECONDS
from benchmarks.fault_tolerance_trajectory import FINAL_LOSS_STEPS

#: One marker per group, so that groups committing the same steps stay visible on top of each other.
STYLES = ({"marker": "o", "markersize": 6, "fillstyle": "none"}, {"marker": "x", "markersize": 4},
          {"marker": ".", "markersize": 4})


def draw_timeline(ft: RunLog, baseline: RunLog, steps: int, path: Path, title: str) -> Path | None:
    """Committed step over time since launch: each replica group of the fault-tolerant run (top), the plain
    job restarted from its checkpoints (bottom); kill and restarts marked."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is missing, so no plot: `pip install -e '.[bench]'`", file=sys.stderr)
        return None
    fig, axes = plt.subplots(2, 1, figsize=(10, 7), sharex=True, sharey=True)
    for axis, run, label in ((axes[0], ft, "replica group {}"), (axes[1], baseline, "the job (node {}, rank 0)")):
        rows = read_rows(run)
        for node, style in zip(range(NODES) if run is ft else [0], STYLES):
            mine = commits(rows, node) if run is ft else [r for r in rows if r["node"] == node]
            axis.plot([r["t"] - run.started for r in mine], [r["step"] for r in mine], linestyle="none",
                      label=label.format(node), **style)
        for name, t in run.events.items():
            axis.axvline(t - run.started, color="grey", linestyle="--", linewidth=1)
            axis.text(t - run.started, steps * 0.02, f" {name}", rotation=90, va="bottom", fontsize=8)
        axis.axhline(steps, color="black", linewidth=0.5)
        axis.set_ylabel("committed step" if run is ft else "global step")
        axis.legend(fontsize=8, loc="upper left")
        axis.grid(alpha=0.3)
    axes[0].set_title(textwrap.fill(title, 110), fontsize=9)
    axes[1].set_title("the same failure without fault tolerance: the job restarted from its last checkpoint",
                      fontsize=9)
    axes[1].set_xlabel("seconds since launch")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def markdown_table(results: dict[str, Any]) -> str:
    """The headline numbers, as in docs/fault-tolerance.md."""
    n, f, r = results.get("no_failure"), results.get("failure"), results.get("rejoin")
    rows = [] if n is None else [
        ("no failure: max abs diff to plain `mics`", f"{n['max_abs_diff']:.3g}"),
        ("no failure: step time, fault-tolerant / plain", (f"{n['overhead']:.3f} ({n['ft_step_seconds']:.3f} s / "
         f"{n['plain_step_seconds']:.3f} s)")),
        ("no failure: CPU per step (all ranks), fault-tolerant / plain", _num(n.get("cpu_overhead"), 3)),
    ]
    every_step = (results.get("variants") or {}).get("quorum_every_1")
    if every_step:
        rows.append(("variant `quorum_every=1`: step time / plain", _num(every_step.get("overhead"), 3)))
    by_round = (n or {}).get("overhead_by_round", {}).get("ft")
    if by_round is not None:
        rows.append((f"no failure: fault-tolerant / plain, round by round of {SLICE_SECONDS:g} s slices: quartiles",
                     " / ".join(f"{q:.3f}" for q in by_round["quartiles"]) + f" ({by_round['rounds']} rounds)"))
    if f is not None and r is not None:  # not --only no_failure / goodput
        rows += _failure_rows(f, r)
    if "restart_baseline" in results:
        rows += [
            ("seconds to the final step: restart from checkpoint", f"{results['restart_baseline']['seconds']:.1f}"),
            ("seconds to the final step: fault tolerance", f"{results['ft']['seconds']:.1f}"),
        ]
    t = results.get("trajectory")
    if t is not None:
        rows += [
            ("trajectory: samples skipped / repeated vs no failure", f"{t['samples_skipped']} / {t['samples_repeated']}"
             f" ({t['steps_compared']} steps)"),
            ("trajectory: global batch constant", f"{t['global_batch_constant']} ({t['global_batch']})"),
            ("trajectory: largest per-step loss difference", "-" if t["max_loss_diff"] is None
             else f"{t['max_loss_diff']:.3g}"),
            (f"trajectory: mean loss of the last {FINAL_LOSS_STEPS} steps, relative difference",
             "-" if t.get("final_loss_rel_diff") is None else f"{t['final_loss_rel_diff']:.2g}"),
        ]
    e = results.get("exact_trajectory")
    if e:
        rows.append(("`exact_trajectory=True`: no-failure step time / plain", _num(e.get("overhead"), 3)))
        if "trajectory" in e:
            rows += [("`exact_trajectory=True`: largest per-step loss difference, with failure vs without",
                      _num(e["trajectory"]["max_loss_diff"], 3) if e["trajectory"]["max_loss_diff"] else "0"),
                     ("`exact_trajectory=True`: survivors' stall while it healed, in steps",
                      _num(e["rejoin"]["survivor_stall_steps"], 2))]
    g = results.get("goodput", {})
    if "skipped" in g:
        rows.append(("goodput", f"skipped: {g['skipped']}"))
    elif g:
        rows += [
            ("goodput: fault tolerance (over plain MiCS's failure-free rate)", _num(g["fault_tolerance"], 3)),
            ("goodput: restart from checkpoint (the same denominator)", _num(g["restart_from_checkpoint"], 3)),
            ("goodput: fault tolerance / restart", _num(g["ratio_ft_over_restart"], 2)),
            ("goodput: limit (nodes alive under the schedule)", _num(g.get("limit"), 3)),
            ("goodput: efficiency (fault tolerance / limit)", _num(g.get("efficiency"), 3)),
            (f"goodput: survivors' rate while a group is out (expected {g.get('survivor_rate_expected', 0):.3f})",
             _num(g.get("survivor_rate_while_out"), 3)),
        ]
        phases = g.get("fault_tolerance_phases") or {}
        rows += [(f"goodput lost while {phase.replace('_', ' ')} (`{phase}`: seconds, rate vs failure-free)",
                  f"{stretch['goodput_lost']:.3f} ({stretch['seconds']:.1f} s, "
                  f"{_num(stretch['rate_vs_failure_free'], 2)})") for phase, stretch in phases.items()]
    return "\n".join(["| measure | value |", "|---|---:|", *(f"| {a} | {b} |" for a, b in rows)])


def _failure_rows(f: dict[str, Any], r: dict[str, Any]) -> list[tuple[str, str]]:
    """The table's rows of ``failure.*`` and ``rejoin.*``."""
    return [
        ("node lost: seconds from the kill to the next committed step", _num(f["seconds_to_next_commit"])),
        ("node lost: steps discarded", str(f["steps_discarded"])),
        ("node lost: survivors' committed steps during the outage", (f"{f['survivor_steps_during_outage']} in "
         f"{f['outage_seconds']:.1f} s")),
        ("rejoin: seconds from the restart to its first committed step", _num(r["seconds"])),
        ("rejoin: seconds from the restart to its shards being current (`rejoin.seconds_to_current`)",
         _num(r.get("seconds_to_current"))),
        ("rejoin: steps it took part in while catching up (`rejoin.steps_catching_up`)",
         "-" if r.get("steps_catching_up") is None else str(r["steps_catching_up"])),
        ("rejoin: bit-identical to the survivors", f"{r['bit_identical']} ({r['digests_compared']} digests)"),
        ("rejoin: survivors' longest stall while it healed, in steps (`rejoin.survivor_stall_steps`)",
         _num(r.get("survivor_stall_steps"))),
        ("rejoin: survivors' gap before the step it joined, in steps (`rejoin.heal_step_stall_steps`)",
         _num(r.get("heal_step_stall_steps"))),
    ]


def _num(value: float | None, digits: int = 1) -> str:
    return "-" if value is None else f"{value:.{digits}f}"
