"""The workload runs on the nodes as loose files (render copies WORKLOAD_MODULES into the run directory): every
sibling module a shipped module imports, at any depth of the file, must be shipped too -- the H200 run of
2026-12-01 failed with "No module named 'attention'" before this test existed."""

from __future__ import annotations

import ast
from pathlib import Path

import stepdeploy.workload
from stepdeploy.render.run import WORKLOAD_MODULES
from tests.unit._source import python_modules

WORKLOAD = Path(stepdeploy.workload.__file__).parent


def imported_names(path: Path) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module.split(".")[0])
    return names


def test_every_sibling_a_shipped_module_imports_is_shipped() -> None:
    modules = python_modules(WORKLOAD)
    nested = [str(p.relative_to(WORKLOAD)) for p in modules if p.parent != WORKLOAD]
    assert not nested, f"the workload ships as loose files in one directory; nothing can import {nested} there"
    siblings = {p.stem for p in modules if p.stem != "__init__"}
    shipped = {name.removesuffix(".py") for name in WORKLOAD_MODULES}
    missing = {(module, imported) for module in shipped for imported in imported_names(WORKLOAD / f"{module}.py")
               if imported in siblings and imported not in shipped}
    assert not missing, f"add to render.run.WORKLOAD_MODULES: {sorted(missing)}"


def test_the_check_sees_the_engines_own_imports() -> None:
    assert "megatron_model" in imported_names(WORKLOAD / "engine_megatron.py")
    assert {"attention", "layers", "experts_grouped"} <= imported_names(WORKLOAD / "megatron_model.py")
