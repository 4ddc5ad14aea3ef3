"""The package's structure, read from its source (``ast``): the options load none of the runtime, no import circle,
nothing below the front ends imports one, the front ends talk only to the engine, and private torch, Lightning or
torchft API appears only in ``_compat.py`` (the checkers tested on planted cases).

* the options declare and do not implement: ``import lightning_mics.options`` loads none of the runtime;
* no import circle among the library's modules, counting imports inside functions (an import under
  ``if TYPE_CHECKING:`` never runs and is not counted);
* no module below the front ends (``strategy.py``, ``fabric.py``, ``front_end.py``) imports one -- only the
  package's ``__init__``, above them, does (the registries' factories);
* the front ends import only the engine, the options, ``front_end`` and ``_compat`` (Lightning's and torch's
  private API, in one place) from the library;
* a private attribute (``x._name``, or its name given to ``getattr``/``hasattr``/``setattr``) that the library
  does not define itself -- torch's, Lightning's or torchft's -- appears in ``_compat.py`` only, and so does an
  import of a private torch, Lightning or torchft module or name.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import lightning_mics

PACKAGE = Path(lightning_mics.__file__).parent
ROOT = "lightning_mics"
FRONT_ENDS = {f"{ROOT}.strategy", f"{ROOT}.fabric", f"{ROOT}.front_end"}
#: what the front ends may import of the library
FRONT_ENDS_MAY_IMPORT = {f"{ROOT}.engine", f"{ROOT}.options", f"{ROOT}.front_end", f"{ROOT}._compat"}
EXTERNAL = ("torch", "lightning", "torchft")
#: private attributes read outside ``_compat.py`` that are no private API of torch, Lightning or torchft
NOT_THEIRS = {
    "_value": "threading.BoundedSemaphore's count (the standard library's), read by the snapshot server",
    "_no_split_modules": "Hugging Face models' declared list of block classes, read to choose FSDP units",
}


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {_module_name(path): path for path in sorted(PACKAGE.rglob("*.py"))}
TREES = {name: ast.parse(path.read_text(), filename=str(path)) for name, path in MODULES.items()}


def _is_type_checking(node: ast.AST) -> bool:
    test = node.test if isinstance(node, ast.If) else None
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _walk(node: ast.AST, type_checking: bool) -> Iterator[ast.AST]:
    """Every node under ``node``; the bodies of ``if TYPE_CHECKING:`` only with ``type_checking``."""
    for child in ast.iter_child_nodes(node):
        if isinstance(child, ast.If) and _is_type_checking(child) and not type_checking:
            for other in child.orelse:
                yield other
                yield from _walk(other, type_checking)
            continue
        yield child
        yield from _walk(child, type_checking)


def _library_module(name: str) -> str:
    """The library module ``name`` (a module, or a name inside one) resolves to: its longest module prefix."""
    while name not in MODULES:
        name = name.rpartition(".")[0]
    return name


def imports_of(module: str, type_checking: bool = False) -> set[str]:
    """The library modules ``module`` imports, anywhere in its body (functions included)."""
    package = module if MODULES[module].name == "__init__.py" else module.rpartition(".")[0]
    found: set[str] = set()
    for node in _walk(TREES[module], type_checking):
        if isinstance(node, ast.Import):
            found.update(_library_module(a.name) for a in node.names if a.name.split(".")[0] == ROOT)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                source = ".".join(base + ([node.module] if node.module else []))
            else:
                source = node.module or ""
            if source.split(".")[0] != ROOT:
                continue
            for alias in node.names:
                found.add(_library_module(f"{source}.{alias.name}"))
    found.discard(module)
    return found


def import_circles() -> list[list[str]]:
    """The strongly connected components of more than one module in the import graph (Tarjan)."""
    graph = {module: imports_of(module) for module in MODULES}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    circles: list[list[str]] = []

    def visit(module: str) -> None:
        index[module] = low[module] = len(index)
        stack.append(module)
        on_stack.add(module)
        for imported in graph[module]:
            if imported not in index:
                visit(imported)
                low[module] = min(low[module], low[imported])
            elif imported in on_stack:
                low[module] = min(low[module], index[imported])
        if low[module] == index[module]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == module:
                    break
            if len(component) > 1:
                circles.append(sorted(component))

    for module in graph:
        if module not in index:
            visit(module)
    return circles


def test_importing_the_options_loads_no_runtime(tmp_path: Path) -> None:
    """Declarations import no implementation: the options come without DiLoCo's schedule, a replica group,
    wrapping, FSDP or Lightning (the strategy names' registration reads them while Lightning is importing)."""
    absent = (
        "lightning_mics.semi_sync",
        "lightning_mics.hop2.diloco",
        "lightning_mics.fault_tolerance.group",
        "lightning_mics.wrapping",
        "torch.distributed.fsdp",
        "lightning",
    )
    code = f"import sys, lightning_mics.options; print(sorted(m for m in {absent!r} if m in sys.modules))"
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=PACKAGE.parent, timeout=300
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.strip().splitlines()[-1] == "[]"


def test_no_import_circle() -> None:
    assert import_circles() == []


def test_the_checker_finds_a_circle_hidden_in_a_function() -> None:
    """The engine imports the options: an options module importing the engine inside a function closes a circle."""
    saved = TREES[f"{ROOT}.options"]
    TREES[f"{ROOT}.options"] = ast.parse("def f():\n    from lightning_mics.engine import MiCSEngine\n")
    try:
        assert any({f"{ROOT}.engine", f"{ROOT}.options"} <= set(circle) for circle in import_circles())
    finally:
        TREES[f"{ROOT}.options"] = saved


def test_nothing_below_the_front_ends_imports_one() -> None:
    importers = {
        module: sorted(imports_of(module, type_checking=True) & FRONT_ENDS)
        for module in MODULES
        if module not in FRONT_ENDS and module != ROOT
    }
    assert {module: found for module, found in importers.items() if found} == {}


def test_the_front_ends_talk_only_to_the_engine() -> None:
    """What the front ends need of checkpoints, fault tolerance, precision and wrapping, the engine offers."""
    imported = {module: sorted(imports_of(module, type_checking=True) - FRONT_ENDS_MAY_IMPORT) for module in FRONT_ENDS}
    assert imported == {module: [] for module in FRONT_ENDS}


def _defined_names() -> set[str]:
    """Every name the library binds itself, outside ``_compat.py`` (whose private names are the others'):
    functions, classes, attributes it assigns, arguments, imported public names."""
    names: set[str] = set()
    for module, tree in TREES.items():
        if MODULES[module].name == "_compat.py":
            continue
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                names.add(node.name)
            elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
                names.add(node.attr)
            elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
                names.add(node.id)
            elif isinstance(node, ast.arg):
                names.add(node.arg)
            elif isinstance(node, ast.alias) and not node.name.startswith("_"):
                names.add(node.asname or node.name.split(".")[0])
    return names


def private_uses(tree: ast.AST, defined: set[str]) -> Iterator[tuple[int, str]]:
    """(line, what) for each private API of another library that ``tree`` reaches (module docstring)."""
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] in EXTERNAL:
            if any(part.startswith("_") for part in node.module.split(".")):
                yield node.lineno, f"from {node.module} import ..."
            yield from ((node.lineno, f"import {a.name}") for a in node.names if a.name.startswith("_"))
        elif isinstance(node, ast.Import):
            for alias in node.names:
                parts = alias.name.split(".")
                if parts[0] in EXTERNAL and any(part.startswith("_") for part in parts):
                    yield node.lineno, f"import {alias.name}"
        elif isinstance(node, ast.Attribute):
            name = node.attr
            if name.startswith("_") and not name.startswith("__") and name not in defined:
                yield node.lineno, f"._{name[1:]}"
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and len(node.args) > 1:
            name = node.args[1].value if isinstance(node.args[1], ast.Constant) else None
            is_private = isinstance(name, str) and name.startswith("_") and not name.startswith("__")
            if node.func.id in ("getattr", "hasattr", "setattr") and is_private and name not in defined:
                yield node.lineno, f"{node.func.id}(..., {name!r})"


def test_private_apis_only_in_compat() -> None:
    defined = _defined_names() | set(NOT_THEIRS)
    found = [
        f"{MODULES[module].relative_to(PACKAGE.parent)}:{line}: {what}"
        for module, tree in TREES.items()
        if MODULES[module].name != "_compat.py"
        for line, what in private_uses(tree, defined)
    ]
    assert found == []


def test_the_private_api_checker_sees_attributes_getattr_and_imports() -> None:
    tree = ast.parse(
        "from torch.distributed._state_dict_utils import f\n"
        "from lightning.fabric.wrappers import _unwrap_objects\n"
        "x = manager._quorum_id\n"
        "y = getattr(module, '_trainer', None)\n"
        "z = self._engine\n"
    )
    found = [what for _, what in private_uses(tree, {"_engine"})]
    assert found == [
        "from torch.distributed._state_dict_utils import ...",
        "import _unwrap_objects",
        "._quorum_id",
        "getattr(..., '_trainer')",
    ]
