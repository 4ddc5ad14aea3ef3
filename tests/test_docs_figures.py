"""One source for the published figures: each figure block in the README and docs is what
``benchmarks/figures.py`` renders from its results file, so a quoted number cannot drift from the run that
produced it (``python benchmarks/figures.py`` re-renders; ``--check`` is what this test runs)."""

from __future__ import annotations

import copy
import json

from benchmarks import figures


def test_every_figure_block_matches_its_results_file() -> None:
    assert figures.main(["--check"]) == 0


def test_the_readme_and_the_fault_tolerance_page_quote_their_figures_through_blocks() -> None:
    quoted = {name for document in figures.DOCUMENTS
              for name in (m["name"] for m in figures.BLOCK.finditer((figures.REPO / document).read_text()))}
    assert quoted == set(figures.FIGURES)


def test_a_changed_figure_is_caught() -> None:
    """A results file that says something else than the README makes the check fail (and a hand-edited
    number too)."""
    path, _ = figures.FIGURES["speed-ratio24"]
    results = json.loads((figures.REPO / path).read_text())
    changed = copy.deepcopy(results)
    next(row for row in changed["results"] if row["strategy"] == "mics-auto")["step_time_s"] = 1.75
    readme = (figures.REPO / "README.md").read_text()
    assert figures.render("speed-ratio24", changed) != figures.render("speed-ratio24", results)
    assert figures.stale_blocks("README.md", readme.replace("**1.90**", "**1.75**")) == ["README.md:speed-ratio24"]
    assert figures.stale_blocks("README.md", readme) == []
