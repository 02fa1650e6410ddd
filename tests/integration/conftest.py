"""The simulated cluster as a session-scoped fixture (real namespaces, sshd, apt, torch).

These tests need root and the host packages the README's test command installs. Run as a normal user they
skip (unit tests still run). Run as root — as the README's command and CI do — a missing prerequisite
fails them instead, so a broken machine can never pass by skipping (STEPDEPLOY_REQUIRE_SIM=1 forces the
same for a normal user).
"""

from __future__ import annotations

import contextlib
import os
import shlex
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from stepdeploy.remote.ssh import Endpoint
from stepdeploy.sim import host
from stepdeploy.sim.cluster import SimConfig, down, up
from stepdeploy.sim.state import SimState, load_state

TEST_CLUSTER = "sdtest"
TEST_SUBNET = "10.78.0.0/24"


# The two files that share the Slurm cluster (slurm_sim): the role's cases first, as its check mode needs
# fresh nodes and its provisioning is what the executor's cases then run on.
SLURM_ROLE_FILE = "test_slurm_role.py"
SLURM_EXECUTOR_FILE = "test_slurm_executor.py"


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    here = Path(__file__).parent
    for item in items:
        if here in Path(str(item.fspath)).parents:
            item.add_marker(pytest.mark.integration)
    executor = [item for item in items if Path(str(item.fspath)).name == SLURM_EXECUTOR_FILE]
    role = [i for i, item in enumerate(items) if Path(str(item.fspath)).name == SLURM_ROLE_FILE]
    if executor and role and items.index(executor[0]) < role[-1]:
        rest = [item for item in items if item not in executor]
        at = rest.index(items[role[-1]]) + 1
        items[:] = rest[:at] + executor + rest[at:]


def require_sim() -> None:
    missing = host.missing_prerequisites(need_build=True)
    if not missing:
        return
    message = "simulated cluster unavailable: " + "; ".join(missing)
    if os.geteuid() == 0 or os.environ.get("STEPDEPLOY_REQUIRE_SIM") == "1":
        pytest.fail(message)
    pytest.skip(message)


@dataclass
class Cluster:
    cfg: SimConfig
    state: SimState

    def endpoint(self, node_name: str) -> Endpoint:
        node = self.state.node(node_name)
        assert node is not None
        return Endpoint(host=node.address, key_file=self.cfg.client_key, known_hosts=self.cfg.known_hosts)

    @property
    def endpoints(self) -> list[Endpoint]:
        return [self.endpoint(n.name) for n in self.state.nodes]


@contextlib.contextmanager
def private_cluster(tmp_path_factory: pytest.TempPathFactory, name: str, subnet: str, http_port: int,
                    nodes: int = 2) -> Iterator[SimConfig]:
    """A cluster of a test module's own (tests that change nodes must not share one), torn down and checked."""
    require_sim()
    cfg = SimConfig(name=name, subnet=subnet, http_port=http_port, state_dir=tmp_path_factory.mktemp("sim") / name)
    try:
        up(cfg, nodes)
        yield cfg
    finally:
        report = down(cfg)
        assert report.leftovers == [], f"sim down left: {report.leftovers}"


@contextlib.contextmanager
def fresh_node(tmp_path_factory: pytest.TempPathFactory, name: str, subnet: str, http_port: int) -> Iterator[Cluster]:
    """One node of a test module's own that nothing has provisioned (private_cluster), its SSH ControlMasters
    closed at the end (Ansible's would keep the node's namespaces alive)."""
    with private_cluster(tmp_path_factory, name, subnet, http_port, nodes=1) as cfg:
        state = load_state(cfg.dir)
        assert state is not None
        try:
            yield Cluster(cfg=cfg, state=state)
        finally:
            close_ssh_masters(cfg.dir / "cp")


@pytest.fixture(scope="session")
def sim_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    """A 2-node simulated cluster shared by the whole test session, torn down (and checked) at the end."""
    require_sim()
    cfg = SimConfig(name=TEST_CLUSTER, subnet=TEST_SUBNET, http_port=8080,
                    state_dir=tmp_path_factory.mktemp("sim") / TEST_CLUSTER)
    try:
        state = up(cfg, 2)
        yield Cluster(cfg=cfg, state=state)
    finally:
        report = down(cfg)
        assert report.leftovers == [], f"sim down left: {report.leftovers}"


@pytest.fixture(scope="session")
def slurm_sim(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SimConfig]:
    """The 2-node cluster test_slurm_role.py provisions with the slurm role (check mode on the fresh nodes
    first) and test_slurm_executor.py then runs its Slurm jobs on: one cluster and one provisioning for both
    (collection orders the role's cases first). Torn down (and checked) at the end of the session."""
    with private_cluster(tmp_path_factory, "sdslurm", "10.89.0.0/24", 8090, nodes=2) as cfg:
        try:
            yield cfg
        finally:  # Ansible's SSH ControlMasters would keep the nodes' namespaces alive
            close_ssh_masters(cfg.dir / "cp")


def close_ssh_masters(control_dir: Path) -> None:
    """Close every SSH ControlMaster whose socket is in `control_dir`."""
    for socket in control_dir.glob("*"):
        subprocess.run(["ssh", "-O", "exit", "-o", f"ControlPath={socket}", "node"], capture_output=True,
                       timeout=30, check=False)


def swapped_host_key_inventory(cluster: SimConfig, tmp_path: Path) -> Path:
    """The cluster's inventory with a known_hosts in which node2's key is node1's (as after a node was replaced or
    its address taken over): every host-key check of node2 must refuse it."""
    entries = [line.split(" ", 1) for line in cluster.known_hosts.read_text().splitlines() if line.strip()]
    (first_host, first_key), (second_host, _) = entries[0], entries[1]
    tampered = tmp_path / "known_hosts"
    tampered.write_text(f"{first_host} {first_key}\n{second_host} {first_key}\n")
    inventory = tmp_path / "inventory.ini"
    inventory.write_text(cluster.inventory.read_text().replace(str(cluster.known_hosts), str(tampered)))
    return inventory


def stepdeploy_cli(*args: str, cwd: Path, timeout: float = 900) -> subprocess.CompletedProcess[str]:
    """The real CLI in a subprocess (as a user runs it), output captured."""
    return subprocess.run([sys.executable, "-m", "stepdeploy", *args], capture_output=True, text=True,
                          timeout=timeout, cwd=cwd)


def processes_of(cfg: SimConfig, run_id: str) -> dict[str, str]:
    """Processes on each node of a 2-node cluster whose command line names the run (workload, launcher,
    launch.sh): empty strings when nothing of the run is left."""
    from stepdeploy.remote.ssh import connection

    found = {}
    for i in (1, 2):
        ep = Endpoint(host=cfg.address(i), key_file=cfg.client_key, known_hosts=cfg.known_hosts)
        with connection(ep) as conn:
            res = conn.run(f"pgrep -af -- {shlex.quote(run_id)} | grep -v pgrep || true", hide=True)
        found[f"node{i}"] = res.stdout.strip()
    return found
