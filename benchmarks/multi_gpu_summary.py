"""One table for ``bash benchmarks/run_on_gpu.sh multi``: every multi-GPU check and the benchmark's rows.

Why a script of its own: the shell stage runs pytest (``tests/test_multi_gpu.py``, a JUnit XML report)
and ``gpu_throughput.py`` under torchrun (a JSON document); whoever copies the result into
``docs/gpu.md`` needs both in one place, with what did not run said as plainly as what passed.

    python benchmarks/multi_gpu_summary.py OUT/multi_tests.xml OUT/gpu_throughput_multi.json GPUS

Exit status 1 when a test failed or errored, or a benchmark mode failed or is missing.
"""

from __future__ import annotations

import json
import sys
import xml.etree.ElementTree as ElementTree
from pathlib import Path
from typing import Any


def junit_rows(junit: Path) -> list[tuple[str, str]]:
    """``(test, outcome)`` per test case of a pytest JUnit report; one ``missing`` row without a report."""
    if not junit.is_file():
        return [(str(junit), "missing (pytest did not finish)")]
    rows = []
    for case in ElementTree.parse(junit).getroot().iter("testcase"):
        outcome = "passed"
        for child in case:
            if child.tag in ("failure", "error"):
                outcome = "FAILED" if child.tag == "failure" else "ERROR"
            elif child.tag == "skipped":
                outcome = f"skipped: {child.get('message', '')}"
        rows.append((case.get("name", "?"), outcome))
    return rows or [(str(junit), "no tests collected")]


def benchmark_rows(document: Path) -> list[tuple[str, str]]:
    """``(mode, tokens/s, MFU per GPU, peak memory)`` as text per mode of a ``gpu_throughput.py`` JSON."""
    if not document.is_file():
        return [("benchmark", f"missing: {document} (the torchrun job did not finish)")]
    results: list[dict[str, Any]] = json.loads(document.read_text())["results"]
    rows = []
    for r in results:
        if r["status"] != "ok":
            rows.append((f"benchmark {r['mode']}", f"FAILED: {r['detail'].strip().splitlines()[-1:]}"))
            continue
        mfu = "n/a" if r["mfu"] is None else f"{r['mfu']:.1%}"
        memory = "n/a" if r["peak_memory_bytes"] is None else f"{r['peak_memory_bytes'] / 2**30:.1f} GiB"
        rows.append((f"benchmark {r['mode']}", f"{r['tokens_per_s']:,.0f} tokens/s, MFU {mfu}/GPU, peak {memory}/GPU"))
    return rows


def main(argv: list[str]) -> int:
    if len(argv) != 3:
        print(__doc__, file=sys.stderr)
        return 2
    junit, document, gpus = Path(argv[0]), Path(argv[1]), argv[2]
    rows = junit_rows(junit) + benchmark_rows(document)
    width = max(len(name) for name, _ in rows)
    print(f"run_on_gpu.sh multi: {gpus} GPUs, one rank each, NCCL")
    print(f"{'check':<{width}}  result")
    print("-" * (width + 40))
    for name, outcome in rows:
        print(f"{name:<{width}}  {outcome}")
    bad = ("FAILED", "ERROR", "missing", "no tests")
    return 1 if any(outcome.startswith(bad) for _, outcome in rows) else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
