"""`stepdeploy provision` as a user runs it (the CLI, real Ansible over real SSH on the simulated cluster):
refusal before any change, unreachable nodes, and the recap/exit-code contract."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from stepdeploy.remote.ssh import connection

from .conftest import Cluster

ROOT = Path(__file__).resolve().parents[2]
COMPAT_PLAY = ROOT / "playbooks" / "compat.yml"
STANDIN_GB10_SMI = "#!/bin/sh\necho 'NVIDIA GB10, 12.1, 122572'\n"


def _provision(*args: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k != "NO_COLOR"}
    return subprocess.run([sys.executable, "-m", "stepdeploy", "provision", *args], capture_output=True,
                          text=True, timeout=900, env=env)


def _inventory_with(cluster: Cluster, tmp_path: Path, *, profile: str, extra_hosts: str = "") -> Path:
    text = cluster.cfg.inventory.read_text().replace("stepdeploy_profile=sim-cpu", f"stepdeploy_profile={profile}")
    if extra_hosts:
        text = text.replace("[sim]\n", f"[sim]\n{extra_hosts}\n")
    inv = tmp_path / "inventory.ini"
    inv.write_text(text)
    return inv


def _upper_files(cluster: Cluster, node: str) -> set[str]:
    """Every file the node has written since it started (its overlay upper dir), minus Ansible's scratch."""
    state = cluster.state.node(node)
    assert state is not None
    upper = Path(state.root).parent / "upper"
    return {str(p.relative_to(upper)) for p in upper.rglob("*")
            if not str(p.relative_to(upper)).startswith(("root/.ansible", "tmp", "var/tmp"))}


@pytest.fixture
def gb10_on_node2(sim_cluster: Cluster) -> Iterator[None]:
    """A stand-in nvidia-smi on node2 that reports a DGX Spark's GB10 (sm_121), removed afterwards."""
    with connection(sim_cluster.endpoint("node2")) as conn:
        conn.put(io.BytesIO(STANDIN_GB10_SMI.encode()), "/usr/local/bin/nvidia-smi")
        conn.run("chmod +x /usr/local/bin/nvidia-smi && nvidia-smi --query-gpu=name --format=csv", hide=True)
    try:
        yield
    finally:
        with connection(sim_cluster.endpoint("node2")) as conn:
            conn.run("rm -f /usr/local/bin/nvidia-smi", hide=True)


def test_seed_profile_on_gb10_is_refused_before_any_node_changes(
        sim_cluster: Cluster, tmp_path: Path, gb10_on_node2: None) -> None:
    inv = _inventory_with(sim_cluster, tmp_path, profile="seed-2024")
    before = {n.name: _upper_files(sim_cluster, n.name) for n in sim_cluster.state.nodes}
    res = _provision(str(inv), "--json", "--log-dir", str(tmp_path / "log"))
    assert res.returncode == 1, res.stderr
    recap = json.loads(res.stdout)
    compat_tasks = len(yaml.safe_load(COMPAT_PLAY.read_text())[0]["tasks"]) + 1  # + facts
    assert recap["tasks"] == compat_tasks, "no task after the compatibility play may run"
    assert {h: v["status"] for h, v in recap["hosts"].items()} == {"node1": "failed", "node2": "failed"}
    assert all(h["changed"] == 0 for h in recap["hosts"].values())
    conflict, stopped = recap["failures"]
    assert conflict["host"] == "node2" and "compatibility matrix" in conflict["task"]
    assert "CUDA 12.3" in conflict["message"] and "sm_121" in conflict["message"]
    # a profile that would work on THIS host: the simulated node2 reports a GB10 but its CPU is x86_64, and
    # spark-cuda13's packages are aarch64 (a real DGX Spark is aarch64 and is offered spark-cuda13: the unit test
    # test_an_aarch64_node_is_offered_only_aarch64_profiles); never a profile of another CPU architecture
    assert "blackwell-cu130" in conflict["message"] and "spark-cuda13" not in conflict["message"]
    assert stopped["host"] == "node1" and "failed on node2, so no node is changed" in stopped["message"]
    after = {n.name: _upper_files(sim_cluster, n.name) for n in sim_cluster.state.nodes}
    assert after == before, "a refused provision must not change any node"


def test_unreachable_node_is_reported_with_exit_3_and_others_still_run(
        sim_cluster: Cluster, tmp_path: Path) -> None:
    ghost = "ghost ansible_host=10.78.0.99"  # on the bridge's subnet, but no node there
    inv = _inventory_with(sim_cluster, tmp_path, profile="sim-cpu", extra_hosts=ghost)
    res = _provision(str(inv), "--json", "--check", "--tags", "never", "--log-dir", str(tmp_path / "log"))
    assert res.returncode == 3, res.stdout + res.stderr
    recap = json.loads(res.stdout)
    assert recap["hosts"]["ghost"]["unreachable"] is True
    assert recap["hosts"]["node1"]["status"] == "done" and recap["hosts"]["node1"]["failed"] == 0
    assert "Traceback" not in res.stderr


def test_inventory_without_a_profile_is_bad_input(sim_cluster: Cluster, tmp_path: Path) -> None:
    inv = tmp_path / "inventory.ini"
    inv.write_text("\n".join(line for line in sim_cluster.cfg.inventory.read_text().splitlines()
                             if not line.startswith("stepdeploy_profile")) + "\n")
    res = _provision(str(inv))
    assert res.returncode == 2
    assert res.stderr.startswith("error:") and "stepdeploy_profile" in res.stderr


def test_a_role_failure_on_one_node_shows_its_task_and_message(sim_cluster: Cluster, tmp_path: Path) -> None:
    """node2 is told to install a package no repository has: the recap names node2's failed task and apt's
    message; node1 succeeds; exit 1."""
    inv = _inventory_with(sim_cluster, tmp_path, profile="sim-cpu")
    host_vars = tmp_path / "host_vars"
    host_vars.mkdir()
    (host_vars / "node2.yml").write_text("common_packages: [stepdeploy-no-such-package]\n")
    res = _provision(str(inv), "--tags", "common", "--json", "--log-dir", str(tmp_path / "log"))
    assert res.returncode == 1, res.stdout + res.stderr
    recap = json.loads(res.stdout)
    assert recap["hosts"]["node1"]["failed"] == 0 and recap["hosts"]["node2"]["status"] == "failed"
    (failure,) = recap["failures"]
    assert failure["host"] == "node2" and failure["task"].startswith("common : ")
    assert "stepdeploy-no-such-package" in failure["message"]
    # The human recap of the same failure, on node2 alone: node1's success is judged above, and its second pass
    # through the common role would only make this run wait for it (Ansible ends node2's play at the failed
    # task; node1 would go on through the rest of the role).
    human = _provision(str(inv), "--tags", "common", "--limit", "node2", "--log-dir", str(tmp_path / "log2"))
    assert human.returncode == 1
    assert "FAILED node2: common : " in human.stdout and "full log:" in human.stdout
