"""No import cycles between slotkeeper's modules (issue #11): each room imports only rooms
below it. Imports inside `if TYPE_CHECKING:` do not count (they never run); imports inside
functions do (they are how a cycle hides)."""

from __future__ import annotations

import ast
from pathlib import Path

import slotkeeper

PACKAGE = Path(slotkeeper.__file__).parent


def _imports(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    skipped: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            skipped |= {id(n) for child in node.body for n in ast.walk(child)}
    found = set()
    for node in ast.walk(tree):
        if id(node) in skipped:
            continue
        if isinstance(node, ast.ImportFrom) and node.level == 1:
            if node.module:
                found.add(node.module.split(".")[0])
            else:
                found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("slotkeeper."):
            found.add(node.module.split(".")[1])
    return found


def graph() -> dict[str, set[str]]:
    modules = {p.stem: p for p in PACKAGE.glob("*.py") if p.stem != "__init__"}
    return {name: _imports(path) & set(modules) for name, path in modules.items()}


def test_no_import_cycles():
    edges = graph()
    state: dict[str, str] = {}
    cycles: list[list[str]] = []

    def visit(node: str, stack: list[str]) -> None:
        state[node] = "open"
        for nxt in sorted(edges[node]):
            if state.get(nxt) == "open":
                cycles.append(stack[stack.index(nxt):] + [nxt])
            elif nxt not in state:
                visit(nxt, stack + [nxt])
        state[node] = "done"

    for node in sorted(edges):
        if node not in state:
            visit(node, [node])
    assert not cycles, cycles


def test_the_policy_room_is_pure():
    assert graph()["policy"] == set()
