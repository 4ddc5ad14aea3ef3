"""docs/tests.md is generated, not hand-kept: it is what ``.ci/tests_page.py`` writes from the test files' module
docstrings (each with a short first paragraph) and the last full run's JUnit summary, and the script reads pytest's
JUnit XML right and refuses a subset.

Plain file processing only (no torch, no Lightning, no pytest run): well under a second."""

import ast
import importlib.util
import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
FIRST_PARAGRAPH_MAX = 400


def _load_script():
    spec = importlib.util.spec_from_file_location("tests_page", ROOT / ".ci" / "tests_page.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("tests_page", module)
    spec.loader.exec_module(module)
    return module


tests_page = _load_script()

SAMPLE = """<?xml version="1.0" encoding="utf-8"?><testsuites name="pytest tests"><testsuite name="pytest" errors="1"
 failures="1" skipped="4" tests="9" time="123.456" timestamp="2000-01-01T00:00:00" hostname="h">
<testcase classname="" name="tests.test_b" time="0.000"><skipped message="collection skipped">('/x/tests/test_b.py', 18,
 "Skipped: could not import 'deepspeed': No module named 'deepspeed'")</skipped></testcase>
<testcase classname="tests.test_a" name="test_fast" time="0.010"/>
<testcase classname="tests.test_a" name="test_slow[p-1]" time="61.500"/>
<testcase classname="tests.test_a.TestGroup" name="test_in_class" time="2.000"/>
<testcase classname="tests.test_a" name="test_broken" time="3.000">
 <failure message="assert 1 == 2">E</failure></testcase>
<testcase classname="tests.test_a" name="test_teardown" time="4.000"><error message="teardown">E</error></testcase>
<testcase classname="tests.test_c" name="test_gpu[fp32]" time="0.000">
 <skipped type="pytest.skip" message="needs a CUDA GPU">x</skipped></testcase>
<testcase classname="tests.test_c" name="test_gpu[bf16]" time="0.000">
 <skipped type="pytest.skip" message="needs a CUDA GPU">x</skipped></testcase>
<testcase classname="tests.test_c" name="test_known" time="0.500">
 <skipped type="pytest.xfail" message="known">x</skipped></testcase>
</testsuite></testsuites>
"""


def _fake_repo(tmp_path: Path, names=("test_a.py", "test_b.py", "test_c.py")) -> Path:
    (tmp_path / "tests").mkdir(parents=True)
    (tmp_path / "docs").mkdir()
    for name in names:
        (tmp_path / "tests" / name).write_text(f'"""What {name} proves,\nin two lines.\n\nDetails."""\n')
    (tmp_path / "tests" / "helper.py").write_text('"""A helper | with a pipe."""\n')
    return tmp_path


# --- the repository's page and docstrings --------------------------------------------------------------------------


def test_the_page_is_what_the_docstrings_generate(capsys):
    assert tests_page.main(["--check"]) == 0, capsys.readouterr().err
    page = (ROOT / "docs" / "tests.md").read_text(encoding="utf-8")
    test_files = sorted((ROOT / "tests").glob("test_*.py"))
    assert len(test_files) >= 60, "the glob found almost no test files"
    for path in test_files:
        assert f"[`{path.name}`](../tests/{path.name})" in page, f"{path.name} has no row"
    assert 'python -m pytest tests -q -m "not distributed and not entry_point"' in page


def test_every_test_file_has_a_short_first_paragraph():
    problems = []
    for path in sorted((ROOT / "tests").glob("test_*.py")):
        docstring = ast.get_docstring(ast.parse(path.read_text(encoding="utf-8")))
        if not docstring:
            problems.append(f"{path.name}: no module docstring")
            continue
        paragraph = tests_page.first_paragraph(path)
        if not 30 <= len(paragraph) <= FIRST_PARAGRAPH_MAX:
            problems.append(f"{path.name}: first paragraph of {len(paragraph)} characters (30-{FIRST_PARAGRAPH_MAX})")
        if not paragraph.endswith((".", ".)")):
            problems.append(f"{path.name}: first paragraph is not a sentence (no full stop): ...{paragraph[-40:]!r}")
    assert not problems, "module docstrings (their first paragraph is docs/tests.md's row):\n" + "\n".join(problems)


# --- the script on a repository of its own -------------------------------------------------------------------------


def test_junit_summary_counts_times_and_skip_reasons(tmp_path):
    xml = tmp_path / "junit.xml"
    xml.write_text(SAMPLE)
    summary = tests_page.parse_junit(xml)
    assert (summary["passed"], summary["failed"], summary["errors"], summary["skipped"], summary["xfailed"]) == (
        3, 1, 1, 3, 1)
    assert summary["tests"] == 9 and summary["time_s"] == 123.46
    assert summary["files"] == ["tests/test_a.py", "tests/test_b.py", "tests/test_c.py"]
    assert summary["failing"] == ["tests/test_a.py::test_broken", "tests/test_a.py::test_teardown"]
    assert [entry["test"] for entry in summary["slowest"][:4]] == [
        "tests/test_a.py::test_slow[p-1]", "tests/test_a.py::test_teardown", "tests/test_a.py::test_broken",
        "tests/test_a.py::TestGroup::test_in_class"]
    assert summary["skips"] == [
        {"reason": "needs a CUDA GPU", "count": 2, "files": ["test_c.py"]},
        {"reason": "could not import 'deepspeed': No module named 'deepspeed'", "count": 1, "files": ["test_b.py"]},
    ]
    text = "\n".join(tests_page.render_summary(summary))
    assert "**1 failed, 1 errors, 3 passed, 3 skipped, 1 xfailed** (9 tests in 3 files) in 2 min 03 s" in text
    assert "| `test_a.py::test_slow[p-1]` | 61.5 s |" in text
    assert "| needs a CUDA GPU | 2 | `test_c.py` |" in text
    assert "2000" not in text, "the run's timestamp stays out of the page (no dates in docs/)"


def test_from_junit_stores_the_summary_and_the_page_keeps_it(tmp_path, capsys):
    root = _fake_repo(tmp_path / "repo")
    xml = tmp_path / "junit.xml"
    xml.write_text(SAMPLE)
    assert tests_page.main([], root=root) == 0
    assert "No full-suite summary recorded yet" in (root / "docs" / "tests.md").read_text()
    assert tests_page.main(["--from-junit", str(xml)], root=root) == 0
    stored = json.loads((root / "docs" / "tests-summary.json").read_text())
    assert stored["passed"] == 3
    page = (root / "docs" / "tests.md").read_text()
    assert "3 passed" in page and "No full-suite summary" not in page
    assert "| [`test_a.py`](../tests/test_a.py) | What test_a.py proves, in two lines. |" in page
    assert "| [`helper.py`](../tests/helper.py) | A helper \\| with a pipe. |" in page
    # a docstring edited later: the page is stale until regenerated, and regenerating keeps the run's summary
    (root / "tests" / "test_c.py").write_text('"""What test_c.py proves now."""\n')
    capsys.readouterr()
    assert tests_page.main(["--check"], root=root) == 1
    assert "docs/tests.md is not what .ci/tests_page.py generates" in capsys.readouterr().err
    assert tests_page.main([], root=root) == 0 and tests_page.main(["--check"], root=root) == 0
    page = (root / "docs" / "tests.md").read_text()
    assert "What test_c.py proves now." in page and "3 passed" in page


def test_a_subset_or_a_missing_docstring_is_refused_naming_the_file(tmp_path, capsys):
    root = _fake_repo(tmp_path / "repo", names=("test_a.py", "test_b.py", "test_c.py", "test_d.py"))
    xml = tmp_path / "junit.xml"
    xml.write_text(SAMPLE)
    assert tests_page.main(["--from-junit", str(xml)], root=root) == 2
    assert "left out 1 of 4 test files (tests/test_d.py)" in capsys.readouterr().err
    assert not (root / "docs" / "tests-summary.json").exists()
    (root / "tests" / "test_d.py").write_text("import os\n")
    assert tests_page.main(["--check"], root=root) == 2
    assert "no module docstring" in capsys.readouterr().err
    with pytest.raises(tests_page.PageError, match="test_d.py"):
        tests_page.render(root, None)
    (tmp_path / "bad.xml").write_text("<testsuites><testsuite")
    with pytest.raises(tests_page.PageError, match="not a readable JUnit XML"):
        tests_page.parse_junit(tmp_path / "bad.xml")
