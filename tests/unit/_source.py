"""The package's Python source as the guards read it (issue 39): every module under a directory, at any depth.

A guard that globs `dir/*.py` stops seeing a module the day it moves into a subpackage (rollout/stages/ was
never checked by the rollout's no-simulator rule); every guard over the source walks it through this one helper.
The bench scripts, which tests run on one row, are imported through `bench_script`.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import stepdeploy

PACKAGE = Path(stepdeploy.__file__).parent


def python_modules(package_dir: Path = PACKAGE, pattern: str = "*.py") -> list[Path]:
    """Every file under `package_dir` (recursively) whose name matches `pattern`, sorted."""
    return sorted(p for p in package_dir.rglob(pattern) if p.is_file() and "__pycache__" not in p.parts)


def module_name(path: Path) -> str:
    """`path`'s dotted module name (a package's __init__.py is the package)."""
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def bench_script(name: str) -> ModuleType:
    """bench/`name`.py imported as the module `name` (the bench scripts are not a package): the tests that keep a
    bench's table from rotting run its functions on one row."""
    path = PACKAGE.parent / "bench" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec and spec.loader, path
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module
