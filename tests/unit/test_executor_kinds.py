"""The executors' names are declared once (executor_kinds.py) and every reader takes them from there: the
registry has one module per name and no module without one, the inventory's stepdeploy_executor and the render
option accept exactly those names (local included), and the names module imports nothing of the package (the
pure floors read it). Read with ast where possible: no executor module is imported here, no connection made."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import stepdeploy
from stepdeploy.errors import BadInput
from stepdeploy.executor_kinds import EXECUTOR_KINDS, INVENTORY_ALIASES
from stepdeploy.inventory import load_cluster
from stepdeploy.inventory.nodes import EXECUTOR_CHOICES
from stepdeploy.remote import registry
from stepdeploy.render import RenderOptions

ROOT = Path(stepdeploy.__file__).parent


def _top_level_functions(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    return {n.name for n in tree.body if isinstance(n, ast.FunctionDef)}


def test_the_registry_registers_exactly_the_declared_names() -> None:
    assert tuple(registry.EXECUTORS) == EXECUTOR_KINDS == registry.KINDS
    assert registry.DEFAULT in EXECUTOR_KINDS
    for kind in EXECUTOR_KINDS:
        assert kind in registry.HELP, f"--executor's help leaves out {kind}"


@pytest.mark.parametrize("kind", EXECUTOR_KINDS)
def test_each_name_has_its_module_with_one_constructor(kind: str) -> None:
    module = registry.EXECUTORS[kind]
    path = ROOT.parent / (module.replace(".", "/") + ".py")
    assert path.is_file(), f"executor {kind!r} is registered as {module}, which does not exist"
    assert "create" in _top_level_functions(path), f"{module} has no create(manifest, cluster, local_run, on_event)"


def test_no_executor_module_goes_unregistered() -> None:
    found = {p.stem.removesuffix("_executor") for p in (ROOT / "remote").glob("*_executor.py")
             if "create" in _top_level_functions(p)}
    assert found == set(EXECUTOR_KINDS), "an executor module with create() needs its name in executor_kinds.py"


def test_the_names_module_imports_nothing_of_the_package() -> None:
    tree = ast.parse((ROOT / "executor_kinds.py").read_text())
    imported = [n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)]
    imported += [a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names]
    assert not [m for m in imported if m and m.startswith("stepdeploy")]


def test_the_inventory_accepts_the_registry_names_and_its_aliases_name_registered_executors() -> None:
    assert set(EXECUTOR_KINDS) <= set(EXECUTOR_CHOICES)
    assert set(EXECUTOR_CHOICES.values()) == set(EXECUTOR_KINDS)
    assert set(INVENTORY_ALIASES.values()) <= set(EXECUTOR_KINDS)


@pytest.mark.parametrize(("written", "kind"), [*((k, k) for k in EXECUTOR_KINDS), *INVENTORY_ALIASES.items()])
def test_an_inventory_names_any_registered_executor(tmp_path: Path, written: str, kind: str) -> None:
    inventory = tmp_path / "inv.ini"
    inventory.write_text(f"[gpu]\nnode1 ansible_host=10.90.0.11\n[gpu:vars]\nstepdeploy_executor={written}\n"
                         "stepdeploy_slurm_controller=node1\n")
    assert load_cluster(inventory).executor == kind


@pytest.mark.parametrize("kind", EXECUTOR_KINDS)
def test_the_render_option_accepts_each_registered_executor(kind: str) -> None:
    assert RenderOptions(run_id="r1", executor=kind).executor == kind


def test_the_render_option_refuses_another_name_listing_every_registered_one() -> None:
    with pytest.raises(BadInput, match="unknown executor 'k8s'") as caught:
        RenderOptions(run_id="r1", executor="k8s")
    assert all(kind in str(caught.value) for kind in EXECUTOR_KINDS)
