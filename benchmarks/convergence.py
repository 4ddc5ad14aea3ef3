"""Held-out loss against tokens and wall-clock on the emulated cluster: the ``--convergence`` mode of
``emulated_cluster.py``; and the command that re-analyses its results.

Why: a semi-synchronous row (DiLoCo, ``mics-diloco``) sends ``1 / H`` of the synchronous bytes across nodes, so its
steps are faster where the link is slow -- but it is not synchronous training, so its loss per token may be worse.
Step time alone cannot say whether it pays; the time to reach a given loss can. This mode trains the same model on
the same data under a synchronous reference (``mics-auto``) and DiLoCo rows (H = 8, H = 32 and the H the planner
names for the link), for several seeds, and evaluates every row's *synchronised* model on the same held-out
sequences at the same token counts.

The mode's modules:

* :mod:`benchmarks.convergence_setup` -- the rows, ratios and seeds of a run, the settings every row trains with
  and the learnable data;
* :mod:`benchmarks.convergence_worker` -- one rank's run of one row and seed (``emulated_worker.py`` starts it):
  training, the held-out evaluations of the global model and the record rank 0 writes;
* :mod:`benchmarks.convergence_analysis` -- the pure analysis of those records (each seed's ratios, their spread,
  the headline, the planner's H) and ``convergence.json``;
* :mod:`benchmarks.convergence_report` -- its tables, docs block and chart;
* :mod:`benchmarks.convergence_regions` -- ``--regions``: two-level DiLoCo against flat DiLoCo and ``mics-auto``,
  each DiLoCo row at the planner's H for the cluster with its regions, and ``convergence_regions.json``;
* :func:`benchmarks.emulated_modes.run_convergence` -- the run: one cluster, every ratio, seed and row.

This file: ``python benchmarks/convergence.py RESULTS.json`` computes a results file's analysis again from its
unchanged records (:func:`reanalyse`), so that the file follows a change to the analysis without training again.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any, Optional

if __package__ in (None, ""):  # run as a script: make `benchmarks` importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.convergence_analysis import build_convergence_report  # noqa: E402
from benchmarks.convergence_regions import build_regions_report  # noqa: E402
from benchmarks.convergence_report import draw_convergence, format_convergence_table  # noqa: E402

ANALYSIS_KEYS = ("comparison", "summary", "headline", "seed_check", "reference_wire_fraction")


def reanalyse(report: dict[str, Any]) -> dict[str, Any]:
    """The report with every analysis computed again from its runs' records (which the analysis never changes):
    how a results file follows a change to the analysis without training again."""
    if not all("evals" in r for point in report["points"] for r in point["runs"] if r.get("status") == "ok"):
        raise ValueError("this convergence.json has no held-out evaluation points (written before they were "
                         "recorded): run `emulated_cluster.py --convergence` again.")
    points = [{k: v for k, v in point.items() if k not in ANALYSIS_KEYS} for point in report["points"]]
    build = build_regions_report if report.get("regions") else build_convergence_report  # --regions: two-level's
    fresh = build(points, report["command"], report["settings"])
    return {**{k: v for k, v in report.items() if k not in fresh}, **fresh}


def main(argv: Optional[list[str]] = None) -> int:
    """``python benchmarks/convergence.py RESULTS.json``: re-analyse a ``--convergence`` results file in place
    (analysis, headline, chart beside it) and print its tables."""
    import argparse
    import json

    parser = argparse.ArgumentParser(description=main.__doc__)
    parser.add_argument("results", type=Path, help="convergence.json written by emulated_cluster.py --convergence")
    args = parser.parse_args(argv)
    if not args.results.is_file():
        parser.error(f"{args.results} does not exist: run `emulated_cluster.py --convergence` first.")
    try:
        report = reanalyse(json.loads(args.results.read_text()))
    except ValueError as error:
        parser.error(str(error))
    args.results.write_text(json.dumps(report, indent=2))
    chart = draw_convergence(report, args.results.with_suffix(".png"))
    print(format_convergence_table(report))
    print("\n" + format_convergence_table(report, markdown=True))
    print(f"\nrewrote {args.results}" + (f" and {chart}" if chart else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
