"""The package's Python source as the guards read it (issue 39): every module under a directory, at any depth.

A guard that globs `dir/*.py` stops seeing a module the day it moves into a subpackage (rollout/stages/ was
never checked by the rollout's no-simulator rule); every guard over the source walks it through this one helper.
"""

from __future__ import annotations

from pathlib import Path

import stepdeploy

PACKAGE = Path(stepdeploy.__file__).parent


def python_modules(package_dir: Path = PACKAGE, pattern: str = "*.py") -> list[Path]:
    """Every file under `package_dir` (recursively) whose name matches `pattern`, sorted."""
    return sorted(p for p in package_dir.rglob(pattern) if p.is_file() and "__pycache__" not in p.parts)


def module_name(path: Path) -> str:
    """`path`'s dotted module name (a package's __init__.py is the package)."""
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
