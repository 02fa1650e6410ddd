"""The package's import graph (issues 19, 39): no cycles, and no import from a floor into one it must not know:
remote/ never reads the ledger, rollout/ never reaches into the simulator or the report. Read from the source
with ast, so an import inside a function counts too (a lazy import hides a cycle, it does not remove it), and so
does an import under `if TYPE_CHECKING:` (a cycle kept for the type checker is still two modules that each need
the other to be read)."""

from __future__ import annotations

import ast
from pathlib import Path

from tests.unit._source import PACKAGE, module_name, python_modules

ROOT = PACKAGE
# (importer prefix, imported prefix): never
FORBIDDEN = [("stepdeploy.remote", "stepdeploy.ledger"), ("stepdeploy.rollout", "stepdeploy.sim"),
             ("stepdeploy.rollout", "stepdeploy.report")]
# Edges left out of the cycle check, each with whose work removes it; an entry whose edge is gone fails the test.
ALLOWED_CYCLE_EDGES: set[tuple[str, str]] = set()


def _sources() -> list[Path]:  # the workload ships as loose files to the nodes: no package imports there
    return [p for p in python_modules(ROOT) if "workload" not in p.relative_to(ROOT).parts]


KNOWN = {module_name(p) for p in _sources()}


def _imports(tree: ast.Module, module: str, top_only: bool) -> set[str]:
    """The stepdeploy modules `module` imports: at module level or anywhere (under TYPE_CHECKING too)."""
    found: set[str] = set()

    def visit(nodes: list[ast.stmt]) -> None:
        for node in nodes:
            if isinstance(node, ast.Import):
                found.update(a.name for a in node.names if a.name.startswith("stepdeploy"))
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:  # relative: resolve against this package
                    package = module.split(".")[: -node.level] if not module.endswith("__init__") else module
                    base = ".".join([*package, *([node.module] if node.module else [])])
                if base.startswith("stepdeploy"):
                    # `from pkg import submodule` depends on the submodule (its package is already loading)
                    subs = {f"{base}.{a.name}" for a in node.names if f"{base}.{a.name}" in KNOWN}
                    found.update(subs)
                    if len(subs) < len(node.names):
                        found.add(base)
            elif isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
                if not top_only:
                    visit(node.body)
            elif isinstance(node, ast.If | ast.Try | ast.With | ast.For | ast.While):
                for field in ("body", "orelse", "finalbody"):
                    visit(getattr(node, field, []) or [])
                for handler in getattr(node, "handlers", []):
                    visit(handler.body)

    visit(tree.body)
    return found


def graph(top_only: bool) -> dict[str, set[str]]:
    sources = {module_name(p): ast.parse(p.read_text()) for p in _sources()}
    return {m: {i for i in _imports(tree, m, top_only) if i in KNOWN and i != m} for m, tree in sources.items()}


def _cycle(edges: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(edges.get(node, ())):
            if state.get(nxt) == 1:
                return [*stack[stack.index(nxt):], nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(edges):
        if node not in state and (found := visit(node)):
            return found
    return None


def _knots(edges: dict[str, set[str]]) -> list[list[str]]:
    """One cycle for each group of modules that reach each other (a strongly connected component of 2 or more)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    knots: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for nxt in sorted(edges.get(node, ())):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            group = set(stack[stack.index(node):])
            del stack[stack.index(node):]
            if len(group) > 1:
                knots.append(_cycle({m: edges.get(m, set()) & group for m in group}) or sorted(group))

    for node in sorted(edges):
        if node not in index:
            visit(node)
    return knots


def _without(edges: dict[str, set[str]], allowed: set[tuple[str, str]]) -> dict[str, set[str]]:
    return {m: {i for i in imports if (m, i) not in allowed} for m, imports in edges.items()}


def test_no_import_cycle() -> None:
    knots = _knots(_without(graph(top_only=False), ALLOWED_CYCLE_EDGES))
    assert not knots, "import cycles (type-checking imports count):\n" + "\n".join(" -> ".join(k) for k in knots)


def test_every_allowed_cycle_edge_still_exists() -> None:
    edges = graph(top_only=False)
    gone = sorted(f"{m} -> {i}" for m, i in ALLOWED_CYCLE_EDGES if i not in edges.get(m, set()))
    assert not gone, f"no longer imported: remove from ALLOWED_CYCLE_EDGES: {gone}"


def test_no_floor_imports_one_it_must_not_know() -> None:
    edges = graph(top_only=False)
    wrong = sorted(f"{m} imports {i}" for m, imports in edges.items() for i in imports
                   for low, high in FORBIDDEN if m.startswith(low) and i.startswith(high))
    assert not wrong, wrong


def test_the_checks_see_a_cycle_and_a_forbidden_import() -> None:
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": set()}) is None
    knots = _knots({"a": {"b"}, "b": {"a"}, "c": {"d"}, "d": {"e"}, "e": {"c", "f"}, "f": set()})
    assert knots == [["a", "b", "a"], ["c", "d", "e", "c"]]
    assert _knots(_without({"a": {"b"}, "b": {"a"}}, {("b", "a")})) == []
    tree = ast.parse("from stepdeploy.ledger import Ledger\ndef f():\n    import stepdeploy.sim.cluster\n"
                     "if TYPE_CHECKING:\n    from stepdeploy.report import summary\n")
    assert _imports(tree, "stepdeploy.remote.x", top_only=True) == {"stepdeploy.ledger", "stepdeploy.report.summary"}
    assert "stepdeploy.sim.cluster" in _imports(tree, "stepdeploy.rollout.x", top_only=False)
    assert "stepdeploy.report.summary" in _imports(tree, "stepdeploy.rollout.x", top_only=False)  # type-checking too
