"""The library installs and imports without the demo's dependencies (Hydra, jsonargparse): those are
the ``[examples]`` extra, and the demo lives in ``examples/``, outside the package."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import lightning_mics

#: Every module of the library a user may import, directly or through a console script.
LIBRARY_MODULES = (
    "lightning_mics",
    "lightning_mics.checkpoint",
    "lightning_mics.consolidate",
    "lightning_mics.plan",
    "lightning_mics.planner",
    "lightning_mics.telemetry",
)
DEMO_ONLY = ("hydra", "omegaconf", "jsonargparse", "examples")
#: optional extras the library imports only when their feature is used (``[ft]``: fault tolerance)
OPTIONAL = ("torchft",)

_BLOCKING_IMPORT = """
import importlib, sys
class Block:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in {blocked!r}:
            raise ModuleNotFoundError(f"No module named {{name!r}} (blocked by the test)")
sys.meta_path.insert(0, Block())
for module in {modules!r}:
    importlib.import_module(module)
print("imported")
"""


def test_library_imports_without_the_demo_dependencies(tmp_path: Path) -> None:
    code = _BLOCKING_IMPORT.format(blocked=DEMO_ONLY + OPTIONAL, modules=LIBRARY_MODULES)
    # run outside the repository, so the demo package `examples` is not importable by accident
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=tmp_path, timeout=300)
    assert result.returncode == 0 and "imported" in result.stdout, result.stderr[-2000:]


def test_the_package_holds_no_demo() -> None:
    package = Path(lightning_mics.__file__).parent
    assert not (package / "models").exists() and not (package / "cli.py").exists()
    sources = "\n".join(path.read_text() for path in package.rglob("*.py"))
    for name in DEMO_ONLY + ("torchmetrics",):
        assert f"import {name}" not in sources and f"from {name}" not in sources, name
