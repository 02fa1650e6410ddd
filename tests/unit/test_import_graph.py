"""The package's import graph (issue 19): no cycles, and no import from a floor into one it must not know:
remote/ never reads the ledger, rollout/ never reaches into the simulator or the report. Read from the source
with ast, so an import inside a function counts too (a lazy import hides a cycle, it does not remove it); only
imports under `if TYPE_CHECKING:` are left out."""

from __future__ import annotations

import ast
from pathlib import Path

import stepdeploy

ROOT = Path(stepdeploy.__file__).parent
# (importer prefix, imported prefix): never
FORBIDDEN = [("stepdeploy.remote", "stepdeploy.ledger"), ("stepdeploy.rollout", "stepdeploy.sim"),
             ("stepdeploy.rollout", "stepdeploy.report")]


def _sources() -> list[Path]:  # the workload ships as loose files to the nodes: no package imports there
    return [p for p in ROOT.rglob("*.py") if "workload" not in p.relative_to(ROOT).parts]


def _module(path: Path) -> str:
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


KNOWN = {_module(p) for p in _sources()}


def _type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _imports(tree: ast.Module, module: str, top_only: bool) -> set[str]:
    """The stepdeploy modules `module` imports: at module level (not under TYPE_CHECKING) or anywhere."""
    found: set[str] = set()

    def visit(nodes: list[ast.stmt]) -> None:
        for node in nodes:
            if isinstance(node, ast.If) and _type_checking(node):
                visit(node.orelse)  # annotations only: no import at run time
            elif isinstance(node, ast.Import):
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
    sources = {_module(p): ast.parse(p.read_text()) for p in _sources()}
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


def test_no_import_cycle() -> None:
    cycle = _cycle(graph(top_only=False))
    assert cycle is None, " -> ".join(cycle or [])


def test_no_floor_imports_one_it_must_not_know() -> None:
    edges = graph(top_only=False)
    wrong = sorted(f"{m} imports {i}" for m, imports in edges.items() for i in imports
                   for low, high in FORBIDDEN if m.startswith(low) and i.startswith(high))
    assert not wrong, wrong


def test_the_checks_see_a_cycle_and_a_forbidden_import() -> None:
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": set()}) is None
    tree = ast.parse("from stepdeploy.ledger import Ledger\ndef f():\n    import stepdeploy.sim.cluster\n"
                     "if TYPE_CHECKING:\n    from stepdeploy.report import summary\n")
    assert _imports(tree, "stepdeploy.remote.x", top_only=True) == {"stepdeploy.ledger"}
    assert "stepdeploy.sim.cluster" in _imports(tree, "stepdeploy.rollout.x", top_only=False)
    assert not any(i.startswith("stepdeploy.report") for i in _imports(tree, "stepdeploy.rollout.x", top_only=False))
