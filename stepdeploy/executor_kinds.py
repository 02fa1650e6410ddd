"""The executors' names, declared once: what remote/registry.py registers (it imports `<kind>_executor` from
remote/ for each), and what the inventory (`stepdeploy_executor`), the render options (`--executor`) and the
manifest accept. Names only, on the bottom floor, so pure modules check a name without importing remote/.

A fourth executor: its name here, and `remote/<name>_executor.py` with a `create(...)` (docs/executors.md).
"""

from __future__ import annotations

from typing import Literal, get_args

ExecutorKind = Literal["fabric", "slurm", "local"]
EXECUTOR_KINDS: tuple[ExecutorKind, ...] = get_args(ExecutorKind)
DEFAULT_EXECUTOR: ExecutorKind = "fabric"
EXECUTOR_HELP = "fabric (SSH), slurm (sbatch) or local (this machine, no SSH)"
# The inventory's other spelling of an executor (docs/inventory.md): `stepdeploy_executor=ssh` means fabric.
INVENTORY_ALIASES: dict[str, ExecutorKind] = {"ssh": "fabric"}

__all__ = ["DEFAULT_EXECUTOR", "EXECUTOR_HELP", "EXECUTOR_KINDS", "INVENTORY_ALIASES", "ExecutorKind"]
