"""The architecture, checked on addon/slotkeeper (issue #30; the rules of the developers' guide,
issues #11 and #18):

- the layers: sub-packages in one order, bottom to top (LAYERS, written once here and once in
  docs/ARCHITECTURE.md, which must agree); a module imports only modules of its own layer or
  of a layer below, and never one of the top-level modules that wire the layers together;
- no import cycle between modules, counting imports inside functions and under TYPE_CHECKING;
- at least six layers and at most six modules beside them;
- the pure layers (decisions, identity) do no I/O: no mitmproxy, requests, portalocker;
- size: no module over 500 lines, no class over 300, no function over 60.

The checks can fail: `test_the_checks_see_*` plant each violation in a made-up package."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
PACKAGE = REPO / "addon" / "slotkeeper"
ARCHITECTURE = REPO / "docs" / "ARCHITECTURE.md"

# Bottom to top. docs/ARCHITECTURE.md ("The layers") gives what each owns.
LAYERS = ("wire", "observe", "decisions", "identity", "store", "upstream", "snapshots",
          "routing", "guard", "surfaces", "manage", "launcher")
PURE_LAYERS = ("decisions", "identity")
IO_LIBRARIES = ("mitmproxy", "requests", "portalocker", "prometheus_client", "socket",
                "subprocess")
MAX_TOP_MODULES = 6  # __init__ included
MIN_LAYERS = 6
MAX_MODULE_LINES = 500
MAX_CLASS_LINES = 300
MAX_FUNCTION_LINES = 60


def module_name(root: Path, path: Path) -> str:
    """'routing.walk' for routing/walk.py, 'addon' for addon.py, 'wire' for wire/__init__.py."""
    parts = path.relative_to(root).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts) or "__init__"


def modules(root: Path) -> dict[str, Path]:
    return {module_name(root, p): p for p in sorted(root.rglob("*.py"))}


def imported(name: str, path: Path, known: set[str]) -> set[str]:
    """The package's modules that module `name` imports, anywhere in it."""
    is_package = path.name == "__init__.py"
    here = name.split(".") if is_package else name.split(".")[:-1]
    if name == "__init__":
        here = []
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found |= {a.name.split(".", 1)[1] for a in node.names
                      if a.name.startswith("slotkeeper.")}
            continue
        if not isinstance(node, ast.ImportFrom):
            continue
        if node.level:
            base = here[:len(here) - (node.level - 1)] if node.level > 1 else here
            stem = base + (node.module.split(".") if node.module else [])
        elif (node.module or "").split(".")[0] == "slotkeeper":
            stem = node.module.split(".")[1:]
        else:
            continue
        # `from x import y`: the module x.y where y is one, else the module x
        submodules = {".".join(stem + [a.name]) for a in node.names} & known
        found |= submodules or {".".join(stem) or "__init__"}
    return (found & known) - {name}


def graph(root: Path) -> dict[str, set[str]]:
    found = modules(root)
    return {name: imported(name, path, set(found)) for name, path in found.items()}


def upward_imports(root: Path, layers: tuple[str, ...] = LAYERS) -> list[str]:
    rank = {layer: i for i, layer in enumerate(layers)}
    found = []
    for module, targets in graph(root).items():
        mine = module.split(".")[0] if "." in module or module in rank else None
        if mine is None:
            continue  # a top-level module wires the layers: it may import any
        for target in sorted(targets):
            theirs = target.split(".")[0] if "." in target or target in rank else None
            if theirs is None:
                found.append(f"{module} imports the top-level module {target}")
            elif theirs not in rank or rank[theirs] > rank[mine]:
                found.append(f"{module} ({mine}) imports {target} ({theirs}), a layer above")
    return found


def cycles(root: Path) -> list[list[str]]:
    edges = graph(root)
    found: list[list[str]] = []
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(module: str) -> None:
        state[module] = 1
        path.append(module)
        for target in sorted(edges.get(module, ())):
            if state.get(target) == 1:
                found.append(path[path.index(target):] + [target])
            elif target not in state:
                visit(target)
        path.pop()
        state[module] = 2

    for module in sorted(edges):
        if module not in state:
            visit(module)
    return found


def lines(node: ast.AST) -> int:
    return node.end_lineno - node.lineno + 1  # type: ignore[attr-defined, operator]


def size_violations(root: Path) -> list[str]:
    found = []
    for name, path in modules(root).items():
        total = len(path.read_text().splitlines())
        if total > MAX_MODULE_LINES:
            found.append(f"{name}: {total} lines")
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ClassDef) and lines(node) > MAX_CLASS_LINES:
                found.append(f"{name}: class {node.name}: {lines(node)} lines")
            if (isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
                    and lines(node) > MAX_FUNCTION_LINES):
                found.append(f"{name}: {node.name}(): {lines(node)} lines")
    return found


def io_in_pure_layers(root: Path) -> list[str]:
    found = []
    for name, path in modules(root).items():
        if name.split(".")[0] not in PURE_LAYERS:
            continue
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level
                     else [])
            found += [f"{name} imports {n}" for n in names if n.split(".")[0] in IO_LIBRARIES]
    return found


def documented_layers() -> list[str]:
    """The layers as docs/ARCHITECTURE.md numbers them, bottom first: its lines
    '1. `wire/`...', '2. `observe/`...' under "## The layers"."""
    text = ARCHITECTURE.read_text()
    section = text.split("## The layers", 1)[1].split("\n## ", 1)[0]
    return re.findall(r"^\d+\.\s+\**`(\w+)/`", section, flags=re.M)


# ---- the package --------------------------------------------------------------------------------

def test_no_module_imports_a_layer_above_it_or_the_top_level() -> None:
    assert upward_imports(PACKAGE) == []


def test_no_import_cycle_not_even_inside_functions_or_type_checking() -> None:
    assert cycles(PACKAGE) == []


def test_the_layers_on_disk_are_the_listed_ones_and_few_modules_sit_beside_them() -> None:
    on_disk = {p.name for p in PACKAGE.iterdir() if (p / "__init__.py").is_file()}
    assert on_disk == set(LAYERS)
    assert len(LAYERS) >= MIN_LAYERS
    top = sorted(p.name for p in PACKAGE.glob("*.py"))
    assert len(top) <= MAX_TOP_MODULES, top


def test_architecture_md_lists_the_same_layers_in_the_same_order() -> None:
    assert documented_layers() == list(LAYERS)
    assert len(ARCHITECTURE.read_text().splitlines()) < 400


def test_the_pure_layers_do_no_io() -> None:
    assert io_in_pure_layers(PACKAGE) == []


def test_no_module_class_or_function_over_its_size_limit() -> None:
    assert size_violations(PACKAGE) == []


# ---- the checks themselves ----------------------------------------------------------------------

def _package(root: Path, files: dict[str, str]) -> Path:
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return root


def test_the_checks_see_an_upward_import_and_one_of_the_top_level(tmp_path) -> None:
    root = _package(tmp_path, {
        "top.py": "from .high import b\n",
        "low/__init__.py": "", "low/a.py": "def f():\n    from ..high.b import x\n",
        "high/__init__.py": "", "high/b.py": "from ..low import a\nfrom .. import top\n",
    })
    assert upward_imports(root, ("low", "high")) == [
        "high.b imports the top-level module top",
        "low.a (low) imports high.b (high), a layer above"]


def test_the_checks_see_a_cycle_and_an_oversized_function(tmp_path) -> None:
    """A planted cycle (one side inside a function, the other under TYPE_CHECKING, across two
    sub-packages) and a 61-line function are both reported."""
    body = "".join(f"    x{i} = {i}\n" for i in range(60))
    root = _package(tmp_path, {
        "p/__init__.py": "", "p/a.py": "def f():\n    from ..q.b import x\n",
        "q/__init__.py": "",
        "q/b.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from ..p import a\n",
        "c.py": f"def long():\n{body}",
    })
    assert cycles(root) == [["p.a", "q.b", "p.a"]]
    assert size_violations(root) == ["c: long(): 61 lines"]


@pytest.mark.parametrize("line", ["import mitmproxy.http", "from requests import Session"])
def test_the_checks_see_io_in_a_pure_layer(tmp_path, line) -> None:
    root = _package(tmp_path, {"decisions/__init__.py": "", "decisions/x.py": line + "\n"})
    assert io_in_pure_layers(root) == [f"decisions.x imports {line.split()[1]}"]
