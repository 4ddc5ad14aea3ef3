"""The README and docs/ hold together: relative links and their anchors resolve, fenced ``python`` blocks parse, the
README stays short and its test command is the one .ci/run runs; the pages stay a manual (no dates, commit hashes,
issue numbers or hand-typed measured figures, at most 500 lines) and every results folder is cited and exists.

Plain text processing only (no torch, no Lightning): it runs in well under a second."""

import ast
import re
import shlex
import textwrap
import unicodedata
from collections.abc import Iterable
from pathlib import Path
from typing import Optional

import pytest

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
DOCS = ROOT / "docs"
README_MAX_LINES = 250

FENCE = re.compile(r"^(\s*)(`{3,}|~{3,})\s*([^\s`]*)")
HEADING = re.compile(r"^ {0,3}(#{1,6})\s+(.*?)(?:\s+#+)?\s*$")
# [text](target) and ![alt](target); target without spaces, optionally followed by a "title"
LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\[\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+(?:\"[^\"]*\"|'[^']*'))?\s*\)")
INLINE_CODE = re.compile(r"(`+)(?:(?!\1).)+?\1")
EXTERNAL = re.compile(r"^(?:[a-zA-Z][a-zA-Z0-9+.-]*:|//)")  # http:, https:, mailto:, ...


def markdown_files() -> list[Path]:
    return [README, *sorted(DOCS.glob("*.md"))]


def split_fences(text: str) -> tuple[list[str], list[tuple[str, str]]]:
    """The lines outside fenced code blocks (fenced lines blanked, so numbering is kept) and the blocks
    as (info string, dedented body)."""
    prose, blocks = [], []
    fence = None  # (indent, marker, info, body lines)
    for line in text.split("\n"):
        match = FENCE.match(line)
        if fence is None:
            if match:
                fence = (match.group(1), match.group(2), match.group(3).lower(), [])
                prose.append("")
            else:
                prose.append(line)
            continue
        indent, marker, info, body = fence
        if match and match.group(2)[0] == marker[0] and len(match.group(2)) >= len(marker) and not match.group(3):
            blocks.append((info, textwrap.dedent("\n".join(body))))
            fence = None
        else:
            body.append(line)
        prose.append("")
    if fence is not None:
        raise AssertionError(f"unclosed ``` fence (opened as {fence[1]}{fence[2]})")
    return prose, blocks


def github_slug(heading: str) -> str:
    """GitHub's anchor for a heading: the rendered text lowercased, every character that is not a
    letter, mark, number, connector (`_`), space or `-` dropped, spaces turned into `-`."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link's text, not its target
    text = re.sub(r"<[^>]+>", "", text).lower()
    kept = "".join(
        ch for ch in text if ch in " -" or unicodedata.category(ch)[0] in "LMN" or unicodedata.category(ch) == "Pc"
    )
    return kept.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    """Every heading anchor of a Markdown file, duplicates numbered -1, -2, ... as GitHub does."""
    prose, _ = split_fences(path.read_text(encoding="utf-8"))
    seen: dict[str, int] = {}
    result = set()
    for line in prose:
        match = HEADING.match(line)
        if not match:
            continue
        slug = github_slug(match.group(2))
        if slug in seen:
            seen[slug] += 1
            slug = f"{slug}-{seen[slug]}"
        else:
            seen[slug] = 0
        result.add(slug)
    return result


def relative_links(path: Path) -> list[tuple[int, str]]:
    """(line number, target) of every relative link or image outside code (fences and `inline code`)."""
    prose, _ = split_fences(path.read_text(encoding="utf-8"))
    found = []
    for number, line in enumerate(prose, 1):
        for match in LINK.finditer(INLINE_CODE.sub("", line)):
            target = match.group(1)
            if not EXTERNAL.match(target):
                found.append((number, target))
    return found


def broken_links(path: Path) -> list[str]:
    problems = []
    for number, target in relative_links(path):
        file_part, _, anchor = target.partition("#")
        resolved = (path.parent / file_part).resolve() if file_part else path
        where = f"{path.relative_to(ROOT) if path.is_relative_to(ROOT) else path}:{number}: {target}"
        if not resolved.exists():
            problems.append(f"{where}: {file_part} does not exist")
        elif anchor:
            if resolved.is_dir() or resolved.suffix.lower() != ".md":
                problems.append(f"{where}: an anchor into {file_part}, which is not a Markdown file")
            elif anchor not in anchors(resolved):
                problems.append(f"{where}: no heading with anchor #{anchor} in {resolved.name}")
    return problems


def python_blocks(path: Path) -> list[str]:
    _, blocks = split_fences(path.read_text(encoding="utf-8"))
    return [body for info, body in blocks if info in ("python", "py", "python3")]


# --- the scanners themselves catch what they are meant to catch -------------------------------------------------


def test_github_slug_rules():
    assert github_slug("Fewer bytes across nodes: `cross_replica_dtype=\"bf16\"` or `\"int8\"`") == (
        "fewer-bytes-across-nodes-cross_replica_dtypebf16-or-int8"
    )
    assert github_slug('`Trainer(strategy="mics")` and `MiCSStrategy(...)`') == "trainerstrategymics-and-micsstrategy"
    assert github_slug("Per-state sharding (AMSP)") == "per-state-sharding-amsp"
    assert github_slug("MiCS ≥ 2.5× at ratio 24") == "mics--25-at-ratio-24"


def test_checker_reports_broken_links_anchors_and_duplicates(tmp_path):
    (tmp_path / "other.md").write_text("# Title\n\n## Same\n\n## Same\n\n```bash\n# not a heading\n```\n")
    (tmp_path / "pic.png").write_bytes(b"")
    page = tmp_path / "page.md"
    page.write_text(
        "# Page\n"
        "[ok](other.md) [ok](other.md#same-1) ![ok](pic.png) [ok](#page) [web](https://example.com)\n"
        "[missing](nothere.md) ![missing](img/none.png)\n"
        "[bad anchor](other.md#same-2) [fenced](other.md#not-a-heading)\n"
        "`[in code](nothere.md)`\n"
        "```python\n[in fence](nothere.md)\n```\n"
    )
    problems = broken_links(page)
    assert len(relative_links(page)) == 8
    assert [p.split(": ", 2)[1] for p in problems] == [
        "nothere.md",
        "img/none.png",
        "other.md#same-2",
        "other.md#not-a-heading",
    ]


def test_python_block_scanner_finds_indented_blocks(tmp_path):
    page = tmp_path / "page.md"
    page.write_text("* item\n\n  ```python\n  x = 1\n  ```\n\n```bash\nnot python(\n```\n\n```python\ndef f(:\n```\n")
    blocks = python_blocks(page)
    assert len(blocks) == 2
    ast.parse(blocks[0])
    with pytest.raises(SyntaxError):
        ast.parse(blocks[1])


# --- the repository's documents -----------------------------------------------------------------------------------


def test_relative_links_and_anchors_resolve():
    files = markdown_files()
    assert len(files) >= 10, f"expected README.md and docs/*.md, found {[f.name for f in files]}"
    links = {path: relative_links(path) for path in files}
    assert sum(len(found) for found in links.values()) >= 30, "the link scanner found almost no links"
    assert any("#" in target for found in links.values() for _, target in found), "no anchors were checked"
    assert any(target.startswith("../") for _, target in links[DOCS / "benchmarks.md"]), "the image link moved"
    problems = [problem for path in files for problem in broken_links(path)]
    assert not problems, "broken links:\n" + "\n".join(problems)


def test_every_doc_is_listed_in_the_index():
    listed = {target.partition("#")[0] for _, target in relative_links(DOCS / "index.md")}
    missing = sorted(path.name for path in DOCS.glob("*.md") if path.name != "index.md" and path.name not in listed)
    assert not missing, f"docs/index.md does not link {missing}"
    assert "docs/index.md" in {target for _, target in relative_links(README)}


def test_python_blocks_parse():
    blocks = {path: python_blocks(path) for path in markdown_files()}
    assert sum(len(found) for found in blocks.values()) >= 3, "the scanner found almost no ```python blocks"
    failures = []
    for path, found in blocks.items():
        for body in found:
            try:
                ast.parse(body)
            except SyntaxError as error:
                failures.append(f"{path.relative_to(ROOT)}: {error.msg} at block line {error.lineno}: {error.text!r}")
    assert not failures, "```python blocks that do not parse:\n" + "\n".join(failures)


def test_readme_is_short():
    lines = len(README.read_text(encoding="utf-8").splitlines())
    assert 0 < lines <= README_MAX_LINES, f"README.md has {lines} lines; move depth into docs/"


def ci_test_command() -> str:
    """The pytest command of .ci/run (without the shell's `|| ...` tail)."""
    commands = []
    for line in (ROOT / ".ci" / "run").read_text(encoding="utf-8").splitlines():
        line = line.split("#", 1)[0].strip()
        head = re.split(r"\s*(?:\|\||&&|;)\s*", line)[0]
        if " pytest " in f" {head} ":
            commands.append(head)
    assert len(commands) == 1, f".ci/run should run pytest once, found {commands}"
    return commands[0]


def section_blocks(path: Path, heading: str) -> list[tuple[str, str]]:
    """The fenced blocks between the heading `heading` and the next heading of the same or a higher level."""
    lines = path.read_text(encoding="utf-8").split("\n")
    prose, _ = split_fences("\n".join(lines))
    start = level = None
    end = len(lines)
    for number, line in enumerate(prose):
        match = HEADING.match(line)
        if not match:
            continue
        if start is None and match.group(2) == heading:
            start, level = number, len(match.group(1))
        elif start is not None and len(match.group(1)) <= level:
            end = number
            break
    assert start is not None, f"no heading {heading!r} in {path.name}"
    return split_fences("\n".join(lines[start:end]))[1]


def test_readme_test_command_is_what_ci_runs():
    command = ci_test_command()
    assert shlex.split(command)[:3] == ["python", "-m", "pytest"]
    shell_commands = [
        part.strip()
        for info, body in section_blocks(README, "The two commands")
        if info in ("bash", "sh", "shell")
        for line in body.splitlines()
        if not line.lstrip().startswith("#")
        for part in line.split("&&")
    ]
    assert shell_commands, "no shell commands under the README's '## The two commands'"
    pytest_commands = [c for c in shell_commands if " pytest " in f" {c} "]
    assert pytest_commands == [command], (
        f"the README's test command(s) {pytest_commands} should be exactly .ci/run's {command!r}"
    )


# --- a manual, not a lab notebook: no dates, commit hashes or issue numbers; every results folder cited --------------

RESULTS = ROOT / "benchmarks" / "results"
DOCS_MAX_LINES = 500

DATE = re.compile(r"(?<![\w-])(?:19|20)\d\d-[01]\d-[0-3]\d(?![\w-])|\b\d{1,2}:\d\d(?::\d\d)? UTC\b")
# 7-40 hex characters standing alone, with at least one digit and one letter a-f (so "deadbeef" words and plain
# numbers are not hashes); not part of a path, a name or a longer word
COMMIT = re.compile(r"(?<![\w./-])(?=[0-9a-f]*[0-9])(?=[0-9a-f]*[a-f])[0-9a-f]{7,40}(?![\w/-])")
ISSUE = re.compile(r"\b(?:issues?|PRs?|pull requests?)\s+#?\d+", re.IGNORECASE)
HASH_NUMBER = re.compile(r"(?<![\w&#/])#\d+\b")  # "#12" in prose (outside code, link targets stripped)
LINK_TARGET = re.compile(r"\]\([^)]*\)")
RESULTS_PATH = re.compile(r"benchmarks/results/[\w.*+/-]*[\w*]")


def history_findings(text: str) -> list[tuple[int, str]]:
    """(line number, finding) for what makes a page a lab notebook: dates and times of day, commit hashes, issue
    numbers ("#12" only in prose: a fenced block or `inline code` may quote a program's "#1")."""
    def line_of(match: re.Match) -> int:
        return text.count("\n", 0, match.start()) + 1

    found = [(line_of(m), f"date {m.group(0)!r}") for m in DATE.finditer(text)]
    found += [(line_of(m), f"commit hash {m.group(0)!r}") for m in COMMIT.finditer(text)]
    found += [(line_of(m), f"issue reference {m.group(0)!r}") for m in ISSUE.finditer(text)]
    prose, _ = split_fences(text)
    for number, line in enumerate(prose, 1):
        line = ISSUE.sub("", LINK_TARGET.sub("]()", INLINE_CODE.sub("", line)))
        found += [(number, f"issue reference {m.group(0)!r}") for m in HASH_NUMBER.finditer(line)]
    return sorted(found)


def _pages_linked_from(page: Path) -> set[Path]:
    linked = set()
    for _, target in relative_links(page):
        file_part = target.partition("#")[0]
        if file_part:
            resolved = (page.parent / file_part).resolve()
            if resolved.suffix == ".md" and resolved.is_file() and resolved.is_relative_to(RESULTS):
                linked.add(resolved)
    return linked


def citing_pages() -> list[Path]:
    """README, docs/*.md, and the pages beside the results they reach: a benchmarks/results/ page one of them
    links, and the README.md of a results folder one of them cites (to a fixed point)."""
    pages = list(markdown_files())
    while True:
        texts = [page.read_text(encoding="utf-8") for page in pages]
        more = {linked for page in pages for linked in _pages_linked_from(page)}
        more |= {folder / "README.md" for folder in RESULTS.iterdir()
                 if (folder / "README.md").is_file() and any(cites(text, folder) for text in texts)}
        more -= set(pages)
        if not more:
            return pages
        pages += sorted(more)


def cites(text: str, entry: Path) -> bool:
    """Whether ``text`` names the results folder or file ``entry`` (a top-level entry of benchmarks/results/)."""
    name = re.escape(entry.name)
    after = r"(?![\w-]|\.\w)"  # not a longer name (a sentence's full stop may follow)
    if entry.is_dir():  # results/NAME, ../NAME/ or `NAME/`
        return re.search(rf"results/{name}{after}|(?:\.\./|(?<![\w./-])){name}/", text) is not None
    return re.search(rf"(?:results/|\]\(){name}{after}", text) is not None  # results/NAME, or a link beside it


def test_history_scanner_catches_dates_hashes_and_issue_numbers():
    page = (
        "Run 2026-11-28 at 22:30 UTC from commit 8ec78b0 (issue 24, see #12); `vs #1` and [x](a.md#2-nodes) are fine.\n"
        "Not hashes: 1234567, deadbeef, a 12.7 M model, benchmarks/results/ab_12345ff/, 0x1f2e3d4c, fe36f72abc_x.\n"
        "```text\n#1 in a fence is output, 2026-01-02 is not\n```\n"
    )
    assert history_findings(page) == sorted([
        (1, "date '2026-11-28'"), (1, "date '22:30 UTC'"), (4, "date '2026-01-02'"), (1, "commit hash '8ec78b0'"),
        (1, "issue reference 'issue 24'"), (1, "issue reference '#12'"),
    ])
    assert [f for _, f in history_findings("The Issue #7 and issues 3 and PR 9.")] == [
        "issue reference 'Issue #7'", "issue reference 'PR 9'", "issue reference 'issues 3'"]


def test_docs_and_readme_hold_no_dates_commit_hashes_or_issue_numbers():
    problems = [f"{path.relative_to(ROOT)}:{number}: {finding}" for path in markdown_files()
                for number, finding in history_findings(path.read_text(encoding="utf-8"))]
    assert not problems, ("history belongs beside the results (benchmarks/results/) or in CHANGELOG.md, not in the "
                          "manual:\n" + "\n".join(problems))


def test_no_docs_page_is_over_500_lines():
    long = {path.name: n for path in DOCS.glob("*.md") if (n := len(path.read_text(encoding="utf-8").splitlines()))
            > DOCS_MAX_LINES}
    assert not long, f"docs pages over {DOCS_MAX_LINES} lines (move history beside the results): {long}"


def test_every_results_folder_is_cited_by_a_page():
    pages = citing_pages()
    assert any(page.is_relative_to(RESULTS) for page in pages), "no docs page links a history beside the results"
    texts = [page.read_text(encoding="utf-8") for page in pages]
    entries = sorted(p for p in RESULTS.iterdir() if not p.name.startswith("."))
    assert len(entries) >= 5, f"benchmarks/results/ is nearly empty: {entries}"
    uncited = [entry.name for entry in entries if not any(cites(text, entry) for text in texts)]
    assert not uncited, ("results no page cites (README, docs/, or a results page a doc links); cite them where the "
                         f"reason matters or `git rm -r` them: {uncited}")


def test_results_citation_rule(tmp_path):
    (tmp_path / "run_a").mkdir()
    (tmp_path / "run.json").write_text("{}")
    assert cites("see `benchmarks/results/run_a/`", tmp_path / "run_a")
    assert cites("beside it, `run_a/` holds", tmp_path / "run_a")
    assert cites("in benchmarks/results/run_a.", tmp_path / "run_a")
    assert not cites("benchmarks/results/run_ab/ and run_a.json", tmp_path / "run_a")
    assert cites("(`benchmarks/results/run.json`)", tmp_path / "run.json")
    assert not cites("benchmarks/results/run.json5 and run.json", tmp_path / "run.json")


def test_every_cited_results_path_exists():
    cited = {(page, match.group(0)) for page in citing_pages()
             for match in RESULTS_PATH.finditer(page.read_text(encoding="utf-8"))}
    assert len(cited) >= 5, "the scanner found almost no benchmarks/results/ paths"
    missing = sorted(f"{page.relative_to(ROOT)}: {path}" for page, path in cited
                     if not (sorted(ROOT.glob(path)) if "*" in path else (ROOT / path).exists()))
    assert not missing, "cited results that do not exist:\n" + "\n".join(missing)


def test_no_scripts_in_the_results():
    scripts = sorted(str(p.relative_to(ROOT)) for p in RESULTS.rglob("*") if p.suffix in (".py", ".sh", ".ipynb"))
    assert not scripts, f"scripts belong in benchmarks/, not beside the results: {scripts}"


def test_links_of_the_history_pages_resolve():
    """The experiment logs the docs link, and CHANGELOG.md, link back into the docs and to their results."""
    pages = [page for page in citing_pages() if page.is_relative_to(RESULTS)] + [ROOT / "CHANGELOG.md"]
    assert len(pages) >= 3, f"expected the experiment logs and the changelog, found {pages}"
    problems = [problem for page in pages for problem in broken_links(page)]
    assert not problems, "broken links:\n" + "\n".join(problems)


# --- measured figures come from results files: none typed by hand into the prose ---------------------------------

#: a decimal with a unit of time, memory, rate or ratio, or a percentage: what a measured figure looks like (the
#: number and its unit on one line or either side of a line break)
_GAP = r"[ \t\u00a0]*(?:\n[ \t]*)?"
MEASURED = re.compile(
    rf"\d+\.\d+{_GAP}(?:×|x\b|%|s\b|ms\b|GiB|MiB|MB|GB|samples/s|tokens/s)|\b\d+(?:\.\d+)?{_GAP}%"
)
FIGURE_BLOCK = re.compile(r"<!-- figures:[\w-]+ -->\n.*?<!-- /figures -->", re.DOTALL)
#: what a script writes from a tool's own output and a test regenerates to compare (docs/tests.md's last run, from
#: pytest's JUnit XML by .ci/tests_page.py, which tests/test_tests_page.py checks): not typed, so not scanned
GENERATED_BLOCK = re.compile(r"<!-- generated:[\w-]+ -->\n.*?<!-- /generated -->", re.DOTALL)
# `code`, ``code``: within one paragraph (a code span may wrap onto the next line, never past a blank one)
CODE_SPAN = re.compile(r"(?<!`)(`+)(?!`)(?:(?!\n[ \t]*\n).)+?(?<!`)\1(?!`)", re.DOTALL)

#: The numbers that look like measurements and are not: each exact phrase (line breaks in the page may fall on any of
#: its spaces) and why it may stay. A measured number belongs in a figure block rendered from its results file.
NOT_MEASURED = {
    "≥ 55 % MFU": "target (docs/gpu.md; gpu_throughput.json's `targets`)",
    "≥ 97 % of the plain loop's throughput": "target (docs/gpu.md; gpu_throughput.json's `targets`)",
    "The target of 1.5x": "target (step over wire floor, docs/benchmarks.md)",
    "The target is ±20 %": "target (the planner's accuracy against the benchmark)",
    "(target ±20 %)": "target (the planner's accuracy against the benchmark)",
    "at most 1 % of a step": "target (telemetry's cost)",
    "`heartbeat_interval` | 0.5 s": "default (FaultTolerance.heartbeat_interval)",
    "torchft's 0.1 s": "default (torchft's own heartbeat interval)",
    "the final loss within 1 %": "bound (trajectory.final_loss_rel_diff <= 0.01, the fault-tolerance table)",
    "A gap under 10 % is written in per cent": "threshold (how the plan table writes a gap)",
    "within 2 % of the fastest (`tie_tolerance`)": "default (the planner's tie_tolerance)",
    "within 5 % of the usable GPU memory (`memory_tie_tolerance`)": "default (the planner's memory_tie_tolerance)",
    "the paper reports up to 2.82×": "paper (the MiCS paper's published speed-up)",
    "within 1 % of single-process training": "bound (tests/test_equivalence.py, bf16 hop 2)",
    "within 2 % of single-process training": "bound (tests/test_equivalence.py, int8 hop 2: INT8_RTOL)",
    "~0.25x the bytes": "arithmetic (int8 blocks: (1 + 4/256) / 4 of fp32's bytes)",
}


def _phrase(phrase: str) -> re.Pattern:
    return re.compile(r"\s+".join(re.escape(word) for word in phrase.split()))


def hand_typed_figures(text: str, allowed: Optional[Iterable[str]] = None) -> list[tuple[int, str]]:
    """(line number, number) of every measurement-shaped number in ``text`` outside figure blocks, fenced code,
    inline code and link targets, and outside the ``allowed`` phrases (default: :data:`NOT_MEASURED`)."""
    allowed = list(NOT_MEASURED) if allowed is None else list(allowed)
    text = FIGURE_BLOCK.sub(lambda m: "\n" * m.group(0).count("\n"), text)
    text = GENERATED_BLOCK.sub(lambda m: "\n" * m.group(0).count("\n"), text)
    prose = "\n".join(split_fences(text)[0])
    skipped = [m.span() for m in CODE_SPAN.finditer(prose)] + [m.span() for m in LINK_TARGET.finditer(prose)]
    skipped += [m.span() for phrase in allowed for m in _phrase(phrase).finditer(prose)]
    return [(prose.count("\n", 0, m.start()) + 1, m.group(0)) for m in MEASURED.finditer(prose)
            if not any(start <= m.start() and m.end() <= end for start, end in skipped)]


def scanned_pages() -> list[Path]:
    return markdown_files()


def test_figure_scanner_catches_typed_measurements_and_skips_blocks_code_and_allowed_phrases():
    page = (
        "`mics_auto` ran 1.31× DDP and predicted 4.88 s per\n"
        "step, 45.6 GiB; 2 % busy, 0.254x the bytes and 12.5% of it.\n"
        "<!-- figures:speed -->\nrendered 1.90 s and 2.36×\n<!-- /figures -->\n"
        "```text\n4.89 s in a fence\n```\n"
        "`0.86 MB inline` and `a span that\nwraps 7.0 GB` stay; [a link](results/lr0.3%/x.md); 1.003 and 12 steps pass.\n"
        "The target of 1.5x stays, as does the target\nof 1.5x across a line break.\n"
        "A figure wrapped as 3.07\n× is caught.\n"
        "<!-- generated:tests-summary -->\nwritten from pytest's output: 9.99 s\n<!-- /generated -->\n"
    )
    assert hand_typed_figures(page, allowed=["target of 1.5x"]) == [
        (1, "1.31×"), (1, "4.88 s"), (2, "45.6 GiB"), (2, "2 %"), (2, "0.254x"), (2, "12.5%"), (13, "3.07\n×")]
    assert hand_typed_figures(page, allowed=[])[6:] == [(11, "1.5x"), (12, "1.5x"), (13, "3.07\n×")]


def test_docs_quote_no_hand_typed_measured_figures():
    pages = scanned_pages()
    assert README in pages and DOCS / "usage.md" in pages and len(pages) >= 10
    found = [f"{path.relative_to(ROOT)}:{line}: {number!r}" for path in pages
             for line, number in hand_typed_figures(path.read_text(encoding="utf-8"))]
    assert not found, (
        "measured figures typed into the prose: render it with benchmarks/figures.py from a results file or reword it "
        "(a target, default, bound or the paper's figure goes into tests/test_docs.py's NOT_MEASURED with its reason):\n"
        + "\n".join(found)
    )


def test_every_allowed_figure_phrase_is_still_needed():
    texts = [path.read_text(encoding="utf-8") for path in scanned_pages()]
    unused = [phrase for phrase in NOT_MEASURED
              if not any(hand_typed_figures(text, allowed=[]) != hand_typed_figures(text, allowed=[phrase])
                         for text in texts)]
    assert not unused, f"allow-list phrases that no page needs any more (drop them): {unused}"
