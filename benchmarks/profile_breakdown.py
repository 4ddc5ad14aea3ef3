"""Where a rank's time goes: summarise py-spy samples of the emulated-cluster benchmark by category.

    sudo python benchmarks/emulated_cluster.py --strategies mics,fsdp-hybrid --profile-dir /tmp/prof
    python benchmarks/profile_breakdown.py /tmp/prof/mics.txt /tmp/prof/fsdp-hybrid.txt

Input: py-spy's ``--format raw`` output recorded with ``--idle`` (one line per distinct stack,
``frame;frame;...;leaf count``, frames as ``function (file:line)``), so time blocked in a collective
counts like time computing. Only samples inside Lightning's training loop count (start-up -- imports,
process-group rendezvous, sharding -- is left out). Each goes to the category of the frame *nearest
the leaf* that matches one of :data:`CATEGORIES` (a collective issued inside a copy-out counts as
the collective) or is autograd's backward or a forward (compute, wherever it was called from); samples
matching none are "other" (Lightning's loop bookkeeping, data loading).
"""

from __future__ import annotations

import argparse
import re
import sys
from collections import Counter
from collections.abc import Iterable
from pathlib import Path

#: (category, pattern on a frame's function name and file), checked from the leaf outwards.
CATEGORIES: tuple[tuple[str, re.Pattern[str]], ...] = (
    ("FSDP2 copy-in / copy-out", re.compile(r"copy_in|copy_out|_to_dtype_if_needed")),
    ("hierarchical reorder (ours)", re.compile(r"_reorder|reorder_")),
    ("ring reduce-scatter (ours, gloo send/recv)", re.compile(r"ring_reduce_scatter|RingReduceScatter")),
    ("all-gather", re.compile(r"all_gather|_allgather")),
    ("reduce-scatter", re.compile(r"reduce_scatter")),
    ("all-reduce", re.compile(r"all_reduce|allreduce")),
    # waiting, before the optimizer step, for the hop 2 sums started during backward (issue 24)
    ("hop 2 wait (overlapped, ours)", re.compile(r"hop2[/\\]pipeline\.py|hop2[/\\]transport\.py")),
    ("barrier / broadcast", re.compile(r"\bbarrier\b|broadcast")),
    ("telemetry / collective recording (ours)", re.compile(r"telemetry\.py|CollectiveRecorder|recorded \(")),
    ("optimizer step", re.compile(r"torch/optim/")),
    ("checkpoint", re.compile(r"checkpoint")),
)
BACKWARD = re.compile(r"\bbackward \(|_engine_run_backward|run_backward")
FORWARD = re.compile(r"training_step|\bforward \(")
TRAINING_LOOP = re.compile(r"training_epoch_loop\.py")


def read_samples(path: Path) -> Counter[tuple[str, ...]]:
    """Stacks (root first) and their sample counts."""
    stacks: Counter[tuple[str, ...]] = Counter()
    for line in path.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        if stack and count.isdigit():
            stacks[tuple(stack.split(";"))] += int(count)
    if not stacks:
        raise ValueError(f"{path} holds no py-spy samples (record with --format raw).")
    return stacks


def categorise(stack: tuple[str, ...]) -> str:
    """The category of the frame nearest the leaf that names one. Forward and backward count as such
    frames too: Lightning runs the boundary micro-step's closure (forward and backward) inside
    ``optimizer.step``, so a search that skipped them would book that compute -- and DDP's bucket
    all-reduce, which waits in C++ under autograd's backward -- as the optimizer step."""
    for frame in reversed(stack):
        for name, pattern in CATEGORIES:
            if pattern.search(frame):
                return name
        if BACKWARD.search(frame):
            return "backward compute (autograd)"
        if FORWARD.search(frame):
            return "forward compute"
    return "other (Lightning loop, data)"


def breakdown(stacks: Counter[tuple[str, ...]]) -> dict[str, float]:
    """Fraction of the training loop's samples per category, largest first."""
    totals: Counter[str] = Counter()
    for stack, count in stacks.items():
        if any(TRAINING_LOOP.search(frame) for frame in stack):
            totals[categorise(stack)] += count
    if not totals:
        raise ValueError("no sample lies inside Lightning's training loop (training_epoch_loop.py).")
    all_samples = sum(totals.values())
    return {name: count / all_samples for name, count in totals.most_common()}


def markdown(tables: dict[str, dict[str, float]]) -> str:
    names = list(tables)
    categories: list[str] = []
    for table in tables.values():
        categories += [c for c in table if c not in categories]
    lines = ["| where the time goes | " + " | ".join(names) + " |", "|---|" + "---:|" * len(names)]
    for category in categories:
        lines.append(f"| {category} | " + " | ".join(f"{tables[n].get(category, 0.0):.0%}" for n in names) + " |")
    return "\n".join(lines)


def main(argv: Iterable[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "profiles", nargs="+", type=Path, help="py-spy raw files, one per strategy (named by file stem)"
    )
    args = parser.parse_args(list(argv) if argv is not None else None)
    try:
        tables = {path.stem: breakdown(read_samples(path)) for path in args.profiles}
    except (OSError, ValueError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    print(markdown(tables))
    return 0


if __name__ == "__main__":
    sys.exit(main())
