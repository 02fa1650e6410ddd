"""Executors by name, and the one place that decides which one drives a run.

Each executor is a module with one constructor, imported only when it is used (like torchx's schedulers):

    create(manifest, cluster, local_run, on_event) -> Executor      (remote/executor.py's protocol)

`manifest` is the rendered run's manifest, `cluster` the inventory that reaches its nodes, `local_run` the
rendered directory on the controller (an executor may keep its own bookkeeping there, as slurm keeps its job
ids), `on_event` where the executor's events go. A fourth executor is one such module, `<name>_executor.py`, and
its name in executor_kinds.py.

Which executor drives a run (`kind_for`): slurm for a run rendered for Slurm (it needs its sbatch.sh), else the
one asked for (`--executor`), else the one the run was rendered for, else local when the inventory says every
node of the run is this machine (ansible_connection=local), else fabric (SSH).
"""

from __future__ import annotations

import importlib
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from stepdeploy.errors import BadInput
from stepdeploy.executor_kinds import DEFAULT_EXECUTOR, EXECUTOR_HELP, EXECUTOR_KINDS
from stepdeploy.inventory.model import Cluster
from stepdeploy.remote.executor import EventSink, Executor, no_events
from stepdeploy.remote.transport import is_local
from stepdeploy.render.manifest import Manifest

# fabric_executor: SSH to every node (the default); slurm_executor: one sbatch job, the nodes over SSH for files
# and proofs; local_executor: this machine, no SSH. The names are executor_kinds.py's, declared once there.
EXECUTORS = {kind: f"stepdeploy.remote.{kind}_executor" for kind in EXECUTOR_KINDS}
KINDS = EXECUTOR_KINDS
DEFAULT = DEFAULT_EXECUTOR
HELP = EXECUTOR_HELP


def check_kind(kind: str | None, option: str = "--executor") -> str | None:
    """`kind` when it names an executor (None stays None); BadInput listing the executors otherwise."""
    if kind is not None and kind not in EXECUTORS:
        raise BadInput(f"{option} {kind!r} is not an executor; use one of {', '.join(KINDS)}")
    return kind


def all_local(cluster: Cluster, names: list[str] | None = None) -> bool:
    """Whether the inventory says every node (of `names`, else all) is this machine."""
    nodes = [n for n in cluster.nodes if names is None or n.name in names]
    return bool(nodes) and all(is_local(n) for n in nodes)


def default_kind(cluster: Cluster, requested: str | None = None) -> str:
    """The executor a new rendering is for: the one asked for, else the inventory's stepdeploy_executor, else
    local when every host is ansible_connection=local, else fabric."""
    return check_kind(requested) or cluster.executor or ("local" if all_local(cluster) else DEFAULT)


def kind_for(manifest: Manifest | Mapping[str, Any], cluster: Cluster, requested: str | None = None) -> str:
    """The executor that drives the rendered run `manifest` (see the module's docstring)."""
    manifest = Manifest.of(manifest)
    rendered = manifest.executor
    check_kind(requested)
    if rendered == "slurm" or requested == "slurm":
        if rendered != requested and requested is not None:
            raise BadInput(f"the run was rendered for the {rendered or DEFAULT} executor, not {requested}",
                           hint=f"render it again with --executor {requested}")
        return "slurm"
    if requested is not None:
        return requested
    if rendered in EXECUTORS:
        return str(rendered)
    return "local" if all_local(cluster, manifest.node_names) else DEFAULT


def create(manifest: Manifest | Mapping[str, Any], cluster: Cluster, local_run: Path, *,
           requested: str | None = None, on_event: EventSink = no_events) -> Executor:
    """The executor that drives the rendered run in `local_run` (KeyError: a node the inventory lacks)."""
    manifest = Manifest.of(manifest)
    module = importlib.import_module(EXECUTORS[kind_for(manifest, cluster, requested)])
    return module.create(manifest, cluster, local_run, on_event)


__all__ = ["DEFAULT", "EXECUTORS", "HELP", "KINDS", "all_local", "check_kind", "create", "default_kind", "kind_for"]
