"""Each public name means one thing (issue 39): no two modules under stepdeploy/ define a top-level class of the
same name, and no two define a top-level function of the same name that is imported by name (`from m import f`)
from both, somewhere in stepdeploy/, tests/ or bench/. A function called through its module (`probe.script(...)`,
`registry.create`) carries its module with it: that is how peer modules share one interface (one module per
executor, stage or probe), and it stays allowed. Read with ast: nothing is imported, the workload's loose files
and the roles' Ansible modules included."""

from __future__ import annotations

import ast
from collections import defaultdict
from collections.abc import Iterable
from functools import cache
from pathlib import Path

import stepdeploy

PACKAGE = Path(stepdeploy.__file__).parent
REPO = PACKAGE.parent
IMPORTERS = [REPO / "stepdeploy", REPO / "tests", REPO / "bench"]

# name -> why two modules may define it. Keep it short: a new entry needs a reason a newcomer accepts.
ALLOWED = {
    # Peers: workload/torch_ckpt.py and workload/megatron_ckpt.py implement one checkpoint interface, each engine
    # loads its own (loose files on the nodes, chosen by module like the executors).
    "Saver": "one checkpoint interface, one implementation per engine module",
}


def module_name(path: Path, root: Path) -> str:
    parts = path.relative_to(root.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _sources(root: Path) -> dict[str, ast.Module]:
    return {module_name(p, root): ast.parse(p.read_text()) for p in sorted(root.rglob("*.py"))}


def definitions(trees: dict[str, ast.Module]) -> tuple[dict[str, set[str]], dict[str, set[str]]]:
    """(class name -> modules, function name -> modules) of the public top-level definitions."""
    classes: dict[str, set[str]] = defaultdict(set)
    functions: dict[str, set[str]] = defaultdict(set)
    for module, tree in trees.items():
        for node in tree.body:
            if isinstance(node, ast.ClassDef) and not node.name.startswith("_"):
                classes[node.name].add(module)
            elif isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and not node.name.startswith("_"):
                functions[node.name].add(module)
    return classes, functions


def _from_module(node: ast.ImportFrom, importer: str, is_package: bool) -> str:
    if not node.level:
        return node.module or ""
    base = importer.split(".")
    base = base if is_package else base[:-1]
    base = base[: len(base) - node.level + 1]
    return ".".join([*base, *([node.module] if node.module else [])])


def imported_by_name(files: Iterable[Path], root: Path, trees: dict[str, ast.Module]) -> set[tuple[str, str]]:
    """(defining module, name) for every `from m import name` in `files`, followed through re-exports (a
    package's __init__ that imports the name from its module)."""
    reexports: dict[tuple[str, str], tuple[str, str]] = {}
    for module, tree in trees.items():
        is_package = (root.parent / module.replace(".", "/") / "__init__.py").exists()
        for node in tree.body:
            if isinstance(node, ast.ImportFrom):
                source = _from_module(node, module, is_package)
                for alias in node.names:
                    reexports[(module, alias.asname or alias.name)] = (source, alias.name)

    def origin(key: tuple[str, str]) -> tuple[str, str]:
        seen = set()
        while key in reexports and key not in seen:
            seen.add(key)
            key = reexports[key]
        return key

    found = set()
    for path in files:
        under_root = path.is_relative_to(root)
        importer = module_name(path, root) if under_root else ""
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and (under_root or not node.level):
                source = _from_module(node, importer, path.name == "__init__.py")
                if source.split(".")[0] == root.name:
                    found.update(origin((source, alias.name)) for alias in node.names)
    return found


def collisions(root: Path, importers: list[Path]) -> dict[str, set[str]]:
    """name -> the modules that define it, for each name that means more than one thing (the module's rule)."""
    trees = _sources(root)
    classes, functions = definitions(trees)
    bare = imported_by_name([p for d in importers if d.is_dir() for p in d.rglob("*.py")], root, trees)
    found = {name: modules for name, modules in classes.items() if len(modules) > 1}
    for name, modules in functions.items():
        travelling = {m for m in modules if (m, name) in bare}
        if len(travelling) > 1:
            found[name] = modules
    return found


@cache
def _package_collisions() -> dict[str, set[str]]:
    return collisions(PACKAGE, IMPORTERS)


def test_every_public_name_means_one_thing() -> None:
    found = {name: sorted(modules) for name, modules in _package_collisions().items() if name not in ALLOWED}
    assert not found, ("one name, two meanings: rename one (or, for peers that share an interface, reach them "
                       f"through their module): {found}")


def test_the_allow_list_holds_only_names_that_still_collide() -> None:
    stale = sorted(set(ALLOWED) - set(_package_collisions()))
    assert not stale, f"no longer defined twice: remove from ALLOWED: {stale}"


def _package(tmp_path: Path, files: dict[str, str]) -> Path:
    root = tmp_path / "pkg"
    for name, text in {"__init__.py": "", **files}.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
    return root


def test_the_check_finds_a_class_defined_twice_even_under_a_subpackage(tmp_path: Path) -> None:
    root = _package(tmp_path, {"a.py": "class Stage:\n    pass\n", "sub/__init__.py": "",
                               "sub/b.py": "class Stage:\n    pass\nclass _Private:\n    pass\n",
                               "c.py": "class _Private:\n    pass\n"})
    assert collisions(root, [root]) == {"Stage": {"pkg.a", "pkg.sub.b"}}


def test_a_function_counts_when_two_of_its_definitions_are_imported_by_name(tmp_path: Path) -> None:
    root = _package(tmp_path, {"a.py": "def load():\n    pass\n", "b.py": "def load():\n    pass\n",
                               "c.py": "from pkg import a, b\na.load()\nb.load()\n"})
    assert collisions(root, [root]) == {}  # each reached through its module
    (root / "d.py").write_text("from pkg.a import load\n")
    assert collisions(root, [root]) == {}  # one travels bare: the import line says which
    (root / "e.py").write_text("from .b import load\n")
    assert collisions(root, [root]) == {"load": {"pkg.a", "pkg.b"}}


def test_a_re_export_is_followed_to_the_defining_module(tmp_path: Path) -> None:
    root = _package(tmp_path, {"a.py": "def run():\n    pass\n", "sub/__init__.py": "from pkg.sub.b import run\n",
                               "sub/b.py": "def run():\n    pass\n"})
    outside = tmp_path / "tests"
    outside.mkdir()
    (outside / "t.py").write_text("from pkg.a import run\nfrom pkg.sub import run as other\n")
    assert collisions(root, [outside]) == {"run": {"pkg.a", "pkg.sub.b"}}
