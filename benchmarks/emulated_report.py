"""What the emulated cluster prints and draws for its throughput rows: the table (plain text and Markdown), the
chart, the title of a report and the one-line summary of each row as it finishes (a ``--convergence`` row's too).

Formatting only: every function here reads records the rows and the analysis (:mod:`benchmarks.emulated_rows`,
:mod:`benchmarks.emulated_analysis`) wrote; ``--scaling``'s and ``--convergence``'s reports have their own tables
and charts (:mod:`benchmarks.scaling`, :mod:`benchmarks.convergence_report`).
"""

from __future__ import annotations

import argparse
import sys
import textwrap
from pathlib import Path
from typing import Any, Optional

from benchmarks.emulated_network import NetworkSettings


def format_table(records: list[dict[str, Any]]) -> str:
    header = ("strategy", "p", "hier", "step s", "tokens/s", "inter MB/step", "expected", "err",
              "floor s", "step/floor", "loopback MB", "expected", "peak RSS MB", "grad held MB")
    rows = [header]
    failures: list[str] = []
    for r in records:
        if r.get("status") != "ok":
            rows.append((r["strategy"], str(r["partition_size"]), _yes_no(r.get("hierarchical")), "-", "-", "-",
                         _mb(r.get("expected_inter_node_bytes_per_step")), "-", "-", "-", "-", "-", "-",
                         "skipped*" if is_skipped(r) else "failed*"))
            failures.append(f"* {r['strategy']}: {r.get('status')}")
            continue
        rows.append((
            _label(r, short=True), str(r["partition_size"]), _yes_no(r.get("hierarchical")),
            f"{r['step_time_s']:.2f}", f"{r['tokens_per_s']:,.0f}",
            _mb(r["inter_node_bytes_per_step"]), _mb(r["expected_inter_node_bytes_per_step"]),
            f"{r.get('inter_node_error', 0) * 100:+.1f}%", *_floor_cells(r),
            _mb(r["loopback_bytes_per_step"]), _mb(r["expected_loopback_bytes_per_step"]),
            _mb(r["peak_mem_bytes"]), _mb(r.get("grad_bytes_during_accumulation")),
        ))
    widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
    lines = ["  ".join(cell.rjust(w) if i else cell.ljust(w) for i, (cell, w) in enumerate(zip(row, widths)))
             for row in rows]
    return "\n".join([lines[0], "-" * len(lines[0]), *lines[1:], *failures])


def format_markdown(records: list[dict[str, Any]]) -> str:
    """The same table in Markdown, for docs/benchmarks.md."""
    lines = ["| strategy | partition | hier. | step time (s) | tokens/s | inter-node MB/step | expected | "
             "wire floor (s) | step / floor | loopback MB/step | expected | peak RSS/rank (MB) | grad held (MB) |",
             "|---|---:|:-:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in records:
        if r.get("status") != "ok":
            lines.append(f"| {r['strategy']} | {r['partition_size']} | {_yes_no(r.get('hierarchical'))} | "
                         f"{r.get('status')} | | | {_mb(r.get('expected_inter_node_bytes_per_step'))} | | | | | | |")
            continue
        floor, ratio = _floor_cells(r)
        lines.append(
            f"| {_label(r)} | {r['partition_size']} | {_yes_no(r.get('hierarchical'))} | {r['step_time_s']:.2f} | "
            f"{r['tokens_per_s']:,.0f} | {_mb(r['inter_node_bytes_per_step'])} | "
            f"{_mb(r['expected_inter_node_bytes_per_step'])} ({r.get('inter_node_error', 0) * 100:+.1f}%) | "
            f"{floor} | {ratio} | "
            f"{_mb(r['loopback_bytes_per_step'])} | {_mb(r['expected_loopback_bytes_per_step'])} | "
            f"{_mb(r['peak_mem_bytes'])} | {_mb(r.get('grad_bytes_during_accumulation'))} |"
        )
    return "\n".join(lines)


def _label(record: dict[str, Any], short: bool = False) -> str:
    """The row's name; a semi-synchronous row says so, since its step time and bytes are averages over rounds."""
    every = record.get("sync_every")
    if not every:
        return record["strategy"]
    if short:
        return f"{record['strategy']} (H={every})"
    return f"{record['strategy']} (semi-synchronous, H={every}: step and bytes are means over whole rounds)"


def _floor_cells(record: dict[str, Any]) -> tuple[str, str]:
    """The wire floor (s) and step / floor as table cells (``-`` when the row has none)."""
    floor, ratio = record.get("wire_floor_s"), record.get("step_over_floor")
    return ("-" if floor is None else f"{floor:.2f}", "-" if ratio is None else f"{ratio:.2f}x")


def _mb(value: Optional[float]) -> str:
    return "-" if value is None else f"{value / 1e6:,.1f}"


def _yes_no(value: Optional[bool]) -> str:
    return "-" if value is None else ("yes" if value else "no")


def draw_chart(records: list[dict[str, Any]], path: Path, title: str) -> Optional[Path]:
    """Throughput and inter-node bytes (measured next to expected) per strategy, as a PNG."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is missing, so no chart: `pip install -e '.[bench]'`", file=sys.stderr)
        return None
    names = [r["strategy"] for r in records]
    ok = [r.get("status") == "ok" for r in records]
    positions = list(range(len(records)))
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(10, 7.5), sharex=True)
    top.bar(positions, [r["tokens_per_s"] if good else 0 for r, good in zip(records, ok)], color="tab:blue")
    top.set_ylabel("tokens/s (all ranks)")
    top.set_title(textwrap.fill(title, 110), fontsize=9)
    for x, (r, good) in enumerate(zip(records, ok)):
        label = f"{r['tokens_per_s']:,.0f}" if good else ("skipped" if is_skipped(r) else "failed")
        top.annotate(label, (x, r["tokens_per_s"] if good else 0),
                     ha="center", va="bottom", fontsize=8)
    width = 0.4
    bottom.bar([x - width / 2 for x in positions],
               [r["inter_node_bytes_per_step"] / 1e6 if good else 0 for r, good in zip(records, ok)],
               width, label="measured (veth tx_bytes)", color="tab:orange")
    bottom.bar([x + width / 2 for x in positions], [r["expected_inter_node_bytes_per_step"] / 1e6 for r in records],
               width, label="analytic (gloo ring model)", color="tab:gray")
    bottom.set_ylabel("inter-node MB per optimizer step")
    bottom.legend(fontsize=8)
    bottom.set_xticks(positions, names, rotation=20, ha="right")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def report_title(args: argparse.Namespace, network: NetworkSettings) -> str:
    setup = args.setup
    return (f"{args.cluster.num_nodes} nodes x {args.cluster.ranks_per_node} ranks (gloo, CPU), GPT "
            f"{setup.model.num_params / 1e6:.1f}M params, micro-batch {setup.micro_batch}x{setup.model.seq_len} "
            f"tokens, accumulate {setup.accumulate}; inter-node {network.inter_node_rate_bytes_per_s * 8 / 1e9:.2f} "
            f"Gbit/s, gloo loopback {network.loopback_gloo_per_node_bytes_per_s * 8 / 1e9:.1f} Gbit/s per node")


def one_line(record: dict[str, Any]) -> str:
    """A throughput row's result in one line, printed as the row finishes."""
    if record.get("status") != "ok":
        return f"{record.get('status')} ({record.get('wall_s', 0):.0f} s)"
    floor, ratio = _floor_cells(record)
    return (f"step {record['step_time_s']:.2f} s, {record['tokens_per_s']:,.0f} tokens/s, inter-node "
            f"{_mb(record['inter_node_bytes_per_step'])} MB/step (expected "
            f"{_mb(record['expected_inter_node_bytes_per_step'])}), wire floor {floor} s (step {ratio}), "
            f"peak RSS {_mb(record['peak_mem_bytes'])} MB ({record.get('wall_s', 0):.0f} s)" + level_text(record))


def level_text(record: dict[str, Any]) -> str:
    """With regions: the bytes per level, measured against the model (``""`` without regions)."""
    levels = record.get("bytes_per_level")
    if not levels:
        return ""

    def cell(level: str) -> str:
        entry = levels[level]
        error = "-" if entry["error"] is None else f"{entry['error']:+.1%}"
        return f"{_mb(entry['measured'])} MB (model {_mb(entry['expected'])}, {error})"

    return f"; inside regions {cell('inside_region')}, across regions {cell('across_regions')}"


def convergence_line(record: dict[str, Any]) -> str:
    """A ``--convergence`` run's result in one line, printed as the run finishes."""
    if record.get("status") != "ok":
        return f"{record.get('status')} ({record.get('wall_s', 0):.0f} s)"
    steps, evals = record["steps"], record["evals"]
    return (f"{len(steps)} steps in {steps[-1]['time_s']:.0f} s ({steps[-1]['time_s'] / len(steps):.3f} s/step), "
            f"held-out {evals[0]['heldout_loss']:.3f} -> {evals[-1]['heldout_loss']:.3f} "
            f"({sum(e['computed'] for e in evals)} of {len(evals)} evaluations computed, {record['eval_s']:.1f} s "
            f"taken out), inter-node {_mb(record.get('inter_node_bytes'))} MB (expected "
            f"{_mb(record.get('expected_inter_node_bytes'))}) ({record.get('wall_s', 0):.0f} s with start-up)"
            + level_text(record))


def all_ran(records: list[dict[str, Any]]) -> bool:
    """Whether every row ran or was skipped (a mode's exit status: 1 when one failed)."""
    return all(r.get("status") == "ok" or is_skipped(r) for r in records)


def is_skipped(record: dict[str, Any]) -> bool:
    """Whether the row was skipped (an optional peer missing, no planner answer), not failed."""
    return str(record.get("status", "")).startswith("skipped")
