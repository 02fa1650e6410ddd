"""Executors by name: which one drives a run (one place decides), each a module with one constructor imported
only when used, all implementing the one protocol; events leave through the caller's callback; no module
under remote/ knows the ledger. No connection is made here."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

import stepdeploy.remote
from stepdeploy.errors import BadInput
from stepdeploy.inventory.model import Cluster, Node, SshSettings
from stepdeploy.remote import registry
from stepdeploy.remote.executor import Executor
from stepdeploy.remote.fabric_executor import FabricExecutor
from stepdeploy.remote.local_executor import LocalExecutor
from stepdeploy.remote.slurm_executor import SlurmExecutor
from stepdeploy.remote.transport import LocalChannel, SshChannel
from tests.unit._source import module_name, python_modules

LOCAL = SshSettings(connection="local")
REMOTE_DIR = Path(stepdeploy.remote.__file__).parent


def nodes(*connections: SshSettings) -> list[Node]:
    return [Node(name=f"n{i}", address=f"10.0.0.{i}", ssh=ssh) for i, ssh in enumerate(connections, 1)]


def manifest(count: int, executor: str | None = None) -> dict[str, Any]:
    data: dict[str, Any] = {"run_id": "r1", "run_dir": "/runs/r1", "stage": "warmup", "inputs": {},
                            "nodes": [{"name": f"n{i}", "dir": f"nodes/{i - 1}-n{i}"} for i in range(1, count + 1)]}
    if executor is not None:
        data["executor"] = executor
    if executor == "slurm":
        data["slurm"] = {"script": "sbatch.sh", "job_name": "sd-warmup-r1"}
    return data


@pytest.mark.parametrize(("rendered", "requested", "connections", "kind"), [
    (None, None, (SshSettings(), SshSettings()), "fabric"),
    (None, None, (LOCAL, LOCAL), "local"),  # every node of the inventory is this machine
    (None, None, (LOCAL, SshSettings()), "fabric"),  # one is not
    (None, "local", (SshSettings(),), "local"),
    ("local", None, (SshSettings(),), "local"),  # as rendered: `rollout stop` from a fresh shell finds it
    ("local", "fabric", (SshSettings(),), "fabric"),  # the same files run either way
    ("fabric", None, (LOCAL,), "fabric"),
    ("slurm", None, (LOCAL,), "slurm"),
    ("slurm", "slurm", (SshSettings(),), "slurm"),
])
def test_one_place_decides_the_executor(rendered: str | None, requested: str | None,
                                        connections: tuple[SshSettings, ...], kind: str) -> None:
    cluster = Cluster(source=Path("x.ini"), nodes=nodes(*connections))
    assert registry.kind_for(manifest(len(connections), rendered), cluster, requested) == kind


def test_slurm_needs_a_run_rendered_for_it_and_unknown_names_list_the_executors() -> None:
    cluster = Cluster(source=Path("x.ini"), nodes=nodes(SshSettings()))
    with pytest.raises(BadInput, match="rendered for the fabric executor, not slurm") as caught:
        registry.kind_for(manifest(1), cluster, "slurm")
    assert caught.value.hint == "render it again with --executor slurm"
    with pytest.raises(BadInput, match="rendered for the slurm executor, not local"):
        registry.kind_for(manifest(1, "slurm"), cluster, "local")
    with pytest.raises(BadInput, match="'k8s' is not an executor; use one of fabric, slurm, local"):
        registry.kind_for(manifest(1), cluster, "k8s")


def test_the_default_for_a_new_rendering() -> None:
    assert registry.default_kind(Cluster(source=Path("x"), nodes=nodes(SshSettings()))) == "fabric"
    assert registry.default_kind(Cluster(source=Path("x"), nodes=nodes(LOCAL))) == "local"
    assert registry.default_kind(Cluster(source=Path("x"), nodes=nodes(LOCAL), executor="slurm")) == "slurm"
    assert registry.default_kind(Cluster(source=Path("x"), nodes=nodes(LOCAL)), "fabric") == "fabric"


def test_each_executor_is_built_by_its_module_with_the_channels_the_inventory_says(tmp_path: Path) -> None:
    cluster = Cluster(source=Path("x.ini"), nodes=nodes(SshSettings(user="ops"), LOCAL))
    fabric = registry.create(manifest(2), cluster, tmp_path, requested="fabric")
    assert isinstance(fabric, FabricExecutor) and fabric.kind == "fabric"
    first, second = (t.channel for t in fabric.targets)
    assert isinstance(first, SshChannel) and first.endpoint.user == "ops" and isinstance(second, LocalChannel)
    local = registry.create(manifest(1), Cluster(source=Path("x.ini"), nodes=nodes(LOCAL)), tmp_path)
    assert isinstance(local, LocalExecutor) and isinstance(local.targets[0].channel, LocalChannel)
    assert local.describe(tmp_path) == [f"n1 (this machine): upload {tmp_path} to /runs/r1, start setsid nohup "
                                        "bash nodes/0-n1/launch.sh"]
    events: list[tuple[str, dict]] = []
    slurm = registry.create(manifest(2, "slurm"), cluster, tmp_path, on_event=lambda m, d: events.append((m, d)))
    assert isinstance(slurm, SlurmExecutor) and slurm.jobs_file == tmp_path / "slurm-jobs"
    slurm.on_event("submitted", {"job_id": "7"})
    assert events == [("submitted", {"job_id": "7"})]
    for executor in (fabric, local, slurm):
        assert _implements(executor), f"{type(executor).__name__} lacks part of the Executor protocol"


def _implements(executor: object) -> bool:
    wanted = [name for name in dir(Executor) if not name.startswith("_") or name in ("__enter__", "__exit__")]
    wanted += list(Executor.__annotations__)
    return all(hasattr(executor, name) for name in wanted)


def test_the_local_executor_refuses_nodes_the_inventory_reaches_over_ssh(tmp_path: Path) -> None:
    cluster = Cluster(source=Path("x.ini"), nodes=nodes(SshSettings(), SshSettings()))
    with pytest.raises(BadInput, match="runs every node on this machine, but the run has 2 nodes"):
        registry.create(manifest(2), cluster, tmp_path, requested="local")
    one = registry.create(manifest(1), cluster, tmp_path, requested="local")  # one node: this machine is it
    assert isinstance(one, LocalExecutor)


def test_the_registry_imports_no_executor_until_one_is_asked_for() -> None:
    code = ("import sys; import stepdeploy.remote.registry; "
            "print(sorted(m for m in sys.modules if m.endswith('_executor') or m.startswith(('fabric', 'paramiko'))))")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert res.stdout.strip() == "[]", res.stdout


def _imports(path: Path) -> set[str]:
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module:
            found |= {node.module, *(f"{node.module}.{a.name}" for a in node.names)}
        elif isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
    return found


def test_no_module_under_remote_knows_the_ledger_and_executors_do_not_import_each_other() -> None:
    executors = python_modules(REMOTE_DIR, "*_executor.py")
    for path in python_modules(REMOTE_DIR):
        imports = _imports(path)
        assert not any(i == "stepdeploy.ledger" or i.startswith("stepdeploy.ledger.") for i in imports), path.name
        if path.name.endswith("_executor.py"):
            others = {module_name(p) for p in executors} - {module_name(path), "stepdeploy.remote.node_executor"}
            assert not imports & others, f"{path.name} imports {imports & others}"
