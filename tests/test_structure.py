"""The structure rules of the developers' guide, enforced on addon/slotkeeper (issue #18): no
module over 500 lines, no class over 300, no function over 60, and no import cycle, counting
imports inside functions and under TYPE_CHECKING. The exceptions are listed here, each with
its reason in docs/DESIGN.md ("Module map")."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "addon" / "slotkeeper"
MAX_MODULE_LINES = 500
MAX_CLASS_LINES = 300
MAX_FUNCTION_LINES = 60
# Modules allowed to break the module/function size limits, each with its reason in
# docs/DESIGN.md ("Structure rules"). None today: the Ollama and Anthropic surfaces were split.
EXCEPTIONS: set[str] = set()


def modules() -> dict[str, ast.Module]:
    return {path.name: ast.parse(path.read_text(), str(path))
            for path in sorted(PACKAGE.glob("*.py"))}


def lines(node: ast.AST) -> int:
    return node.end_lineno - node.lineno + 1  # type: ignore[attr-defined, operator]


def size_violations() -> list[str]:
    found = []
    for name, tree in modules().items():
        if name in EXCEPTIONS:
            continue
        total = len((PACKAGE / name).read_text().splitlines())
        if total > MAX_MODULE_LINES:
            found.append(f"{name}: {total} lines")
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef) and lines(node) > MAX_CLASS_LINES:
                found.append(f"{name}: class {node.name}: {lines(node)} lines")
            if (isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
                    and lines(node) > MAX_FUNCTION_LINES):
                found.append(f"{name}: {node.name}(): {lines(node)} lines")
    return found


def imports_of(name: str, tree: ast.Module) -> set[str]:
    """The package's modules `name` imports, anywhere in it (functions, TYPE_CHECKING)."""
    local = {p.stem for p in PACKAGE.glob("*.py")}
    out: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            if node.level == 1 and node.module:
                out.add(node.module.split(".")[0])
            elif node.level == 1:
                out.update(alias.name for alias in node.names)
            elif node.level == 0 and node.module and node.module.startswith("slotkeeper."):
                out.add(node.module.split(".")[1])
            elif node.level == 0 and node.module == "slotkeeper":
                out.update(alias.name for alias in node.names)
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.startswith("slotkeeper."):
                    out.add(alias.name.split(".")[1])
    return {m for m in out if m in local and m != name.removesuffix(".py")}


def cycles() -> list[list[str]]:
    graph = {name.removesuffix(".py"): imports_of(name, tree)
             for name, tree in modules().items()}
    found: list[list[str]] = []
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(module: str) -> None:
        state[module] = 1
        path.append(module)
        for target in sorted(graph.get(module, ())):
            if state.get(target) == 1:
                found.append(path[path.index(target):] + [target])
            elif target not in state:
                visit(target)
        path.pop()
        state[module] = 2

    for module in sorted(graph):
        if module not in state:
            visit(module)
    return found


def test_no_module_class_or_function_over_its_size_limit() -> None:
    assert size_violations() == []


def test_no_import_cycle_not_even_inside_functions_or_type_checking() -> None:
    assert cycles() == []


def test_the_exceptions_are_still_needed() -> None:
    """An exception that no longer breaks a rule leaves the list (so it cannot hide a new
    violation later)."""
    for name in EXCEPTIONS:
        tree = ast.parse((PACKAGE / name).read_text())
        too_long = len((PACKAGE / name).read_text().splitlines()) > MAX_MODULE_LINES or any(
            isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))
            and lines(n) > (MAX_CLASS_LINES if isinstance(n, ast.ClassDef)
                            else MAX_FUNCTION_LINES)
            for n in ast.walk(tree))
        assert too_long, f"{name} keeps the rules now: take it off EXCEPTIONS"


def test_the_checks_see_a_cycle_and_an_oversized_function(tmp_path, monkeypatch) -> None:
    """The checker itself can fail: a planted cycle (one side inside a function, the other
    under TYPE_CHECKING) and a 61-line function are both reported."""
    (tmp_path / "a.py").write_text("def f():\n    from .b import x\n")
    (tmp_path / "b.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
                                   "    from .a import f\n")
    body = "".join(f"    x{i} = {i}\n" for i in range(60))
    (tmp_path / "c.py").write_text(f"def long():\n{body}")
    monkeypatch.setattr(__import__(__name__), "PACKAGE", tmp_path)
    assert cycles() == [["a", "b", "a"]]
    assert size_violations() == ["c.py: long(): 61 lines"]
