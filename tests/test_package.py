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


_LOADED_BY = """
import sys
{code}
print(sorted(name for name in ("lightning", "torch.distributed.fsdp") if name in sys.modules))
"""

_PLAN_HELP = """
from lightning_mics.plan import console_main
sys.argv = ["lightning-mics", "plan", "--help"]
try:
    console_main()
except SystemExit as done:
    assert not done.code, done.code
"""


def _modules_loaded_by(code: str, cwd: Path) -> str:
    result = subprocess.run(
        [sys.executable, "-c", _LOADED_BY.format(code=code)], capture_output=True, text=True, cwd=cwd, timeout=300
    )
    assert result.returncode == 0, result.stderr[-2000:]
    return result.stdout.strip().splitlines()[-1]


def test_the_planner_and_plan_help_start_without_lightning_or_fsdp(tmp_path: Path) -> None:
    """The planner is arithmetic: its CLI must not pay for Lightning's import (or FSDP's)."""
    assert _modules_loaded_by("import lightning_mics.planner", tmp_path) == "[]"
    assert _modules_loaded_by(_PLAN_HELP, tmp_path) == "[]"
    # the check can fail: the package's public classes do load both
    both = "['lightning', 'torch.distributed.fsdp']"
    assert _modules_loaded_by("from lightning_mics import MiCSStrategy", tmp_path) == both


_REGISTERED = """
from lightning.pytorch.strategies import StrategyRegistry
from lightning.fabric.strategies import STRATEGY_REGISTRY
import lightning_mics
for name in ("mics", "mics_auto", "mics_zero3", "mics_replicate"):
    assert name in StrategyRegistry and name in STRATEGY_REGISTRY, name
from lightning.pytorch import Trainer
from lightning.fabric import Fabric
trainer = Trainer(strategy="mics_zero3", accelerator="cpu", devices=1, logger=False, enable_checkpointing=False)
assert isinstance(trainer.strategy, lightning_mics.MiCSStrategy), type(trainer.strategy)
assert trainer.strategy.options.partition_size == "world", trainer.strategy.options
fabric = Fabric(strategy="mics", accelerator="cpu", devices=1)
assert isinstance(fabric.strategy, lightning_mics.MiCSFabricStrategy), type(fabric.strategy)
print("registered")
"""


def test_import_lightning_mics_registers_the_strategy_names_whatever_the_import_order(tmp_path: Path) -> None:
    """``import lightning_mics`` before Lightning (the names wait for Lightning's import), after it, through a
    public class, or before a Fabric import: every strategy name is in both registries."""
    firsts = (
        "import lightning_mics",
        "import lightning",
        "from lightning_mics import MiCSStrategy",
        "import lightning_mics; import lightning.fabric",
    )
    # all four at once: each is a fresh interpreter importing Lightning, most of it waiting on the disk and the GIL
    processes = [
        subprocess.Popen([sys.executable, "-c", first + "\n" + _REGISTERED], stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True, cwd=tmp_path)
        for first in firsts
    ]
    try:
        for first, process in zip(firsts, processes):
            stdout, stderr = process.communicate(timeout=300)
            assert process.returncode == 0 and "registered" in stdout, (first, stderr[-2000:])
    finally:
        for process in processes:
            if process.poll() is None:
                process.kill()
                process.wait()


def test_every_public_name_is_loaded_on_first_access() -> None:
    assert sorted(lightning_mics.__all__) == sorted(lightning_mics._PUBLIC)
    for name in lightning_mics.__all__:
        assert getattr(lightning_mics, name) is not None, name
    assert lightning_mics.MiCSFabricStrategy is not lightning_mics.MiCSStrategy
