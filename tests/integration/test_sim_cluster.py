"""The simulated cluster end to end: real SSH (host keys verified), Ansible via ansible-runner, Fabric,
apt from the local repository, and torch.distributed across the node addresses."""

from __future__ import annotations

import json
import subprocess
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import ansible_runner
import paramiko
import pytest
from fabric.exceptions import GroupException

import stepdeploy.workload
from stepdeploy import ansible_run
from stepdeploy.remote.ssh import Endpoint, connection, group
from stepdeploy.sim import repo
from stepdeploy.sim.base import NODE_VENV

from .conftest import Cluster


def test_nodes_are_distinct_hosts_reachable_only_on_the_bridge(sim_cluster: Cluster) -> None:
    seen = {}
    for node in sim_cluster.state.nodes:
        with connection(sim_cluster.endpoint(node.name)) as conn:
            res = conn.run("hostname; ip -o -4 addr show dev eth0; ip route; cat /etc/resolv.conf", hide=True)
        lines = res.stdout.splitlines()
        seen[node.name] = lines
        assert lines[0] == node.name
        assert f"inet {node.address}/24" in lines[1]
        assert not any(line.startswith("default") for line in lines), "a node must have no default route"
    assert len({tuple(v) for v in seen.values()}) == len(seen)


def test_openssh_verifies_host_keys(sim_cluster: Cluster, tmp_path: Path) -> None:
    node = sim_cluster.state.nodes[0]
    base = ["ssh", "-i", str(sim_cluster.cfg.client_key), "-o", "BatchMode=yes",
            "-o", "StrictHostKeyChecking=yes", f"root@{node.address}", "hostname"]
    ok = subprocess.run([*base[:-2], "-o", f"UserKnownHostsFile={sim_cluster.cfg.known_hosts}", *base[-2:]],
                        capture_output=True, text=True, timeout=30)
    assert ok.returncode == 0, ok.stderr
    assert ok.stdout.strip() == node.name

    empty = tmp_path / "known_hosts"
    empty.write_text("")
    refused = subprocess.run([*base[:-2], "-o", f"UserKnownHostsFile={empty}", *base[-2:]],
                             capture_output=True, text=True, timeout=30)
    assert refused.returncode == 255
    assert "Host key verification failed" in refused.stderr


def test_paramiko_rejects_a_wrong_host_key(sim_cluster: Cluster, tmp_path: Path) -> None:
    node1, node2 = sim_cluster.state.nodes[:2]
    # node1's address with node2's key: what a man-in-the-middle (or a reinstalled node) looks like.
    node2_key = next(line for line in sim_cluster.cfg.known_hosts.read_text().splitlines()
                     if line.startswith(f"{node2.address},"))
    forged = tmp_path / "known_hosts"
    forged.write_text(f"{node1.address} {' '.join(node2_key.split()[1:])}\n")
    ep = Endpoint(host=node1.address, key_file=sim_cluster.cfg.client_key, known_hosts=forged)
    with pytest.raises(paramiko.BadHostKeyException), connection(ep) as conn:
        conn.run("true", hide=True)


def test_every_hop_of_a_proxyjump_is_verified(sim_cluster: Cluster, tmp_path: Path,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """node2 reached through node1, as ~/.ssh/config (Fabric builds that hop itself) or the inventory's -J
    say: with node1's key missing from known_hosts the jump is refused, not trusted on first use."""
    node1, node2 = sim_cluster.state.nodes[:2]
    key = sim_cluster.cfg.client_key
    lines = sim_cluster.cfg.known_hosts.read_text().splitlines()
    only_node2 = tmp_path / "known_hosts"
    only_node2.write_text("".join(f"{line}\n" for line in lines if node2.address in line.split()[0].split(",")))
    home = tmp_path / "home"
    (home / ".ssh").mkdir(parents=True)
    (home / ".ssh" / "config").write_text(f"Host {node1.address}\n  User root\n  IdentityFile {key}\n"
                                          f"Host {node2.address}\n  ProxyJump {node1.address}\n")
    monkeypatch.setenv("HOME", str(home))
    for jump in (None, f"root@{node1.address}"):  # ~/.ssh/config's ProxyJump, then the inventory's -J
        refused = Endpoint(host=node2.address, key_file=key, known_hosts=only_node2, proxy_jump=jump)
        with pytest.raises(paramiko.SSHException, match=f"{node1.address}.*not found in known_hosts"), \
                connection(refused) as conn:
            conn.run("true", hide=True)
        known = Endpoint(host=node2.address, key_file=key, known_hosts=sim_cluster.cfg.known_hosts, proxy_jump=jump)
        with connection(known) as conn:
            assert conn.run("hostname", hide=True).stdout.strip() == node2.name


def test_fabric_group_runs_on_every_node(sim_cluster: Cluster) -> None:
    grp = group(sim_cluster.endpoints)
    try:
        results = grp.run("hostname", hide=True)
    finally:
        grp.close()
    by_host = {conn.host: res.stdout.strip() for conn, res in results.items()}
    assert by_host == {n.address: n.name for n in sim_cluster.state.nodes}


def test_fabric_group_with_unknown_host_keys_fails_per_host(sim_cluster: Cluster, tmp_path: Path) -> None:
    empty = tmp_path / "known_hosts"
    empty.write_text("")
    eps = [Endpoint(host=ep.host, key_file=ep.key_file, known_hosts=empty) for ep in sim_cluster.endpoints]
    grp = group(eps)
    with pytest.raises(GroupException) as info:
        grp.run("true", hide=True)
    grp.close()
    failures = info.value.result.failed
    assert set(conn.host for conn in failures) == {ep.host for ep in eps}
    assert all(isinstance(exc, paramiko.SSHException) for exc in failures.values())


def _runner(tmp_path: Path, cluster: Cluster, **kwargs) -> ansible_runner.Runner:
    return ansible_run.run(tmp_path, cluster.cfg.inventory, **kwargs)


def test_ansible_ping_through_ansible_runner(sim_cluster: Cluster, tmp_path: Path) -> None:
    run = _runner(tmp_path, sim_cluster, host_pattern="all", module="ansible.builtin.ping")
    assert run.status == "successful", run.stdout.read()
    pongs = {e["event_data"]["host"]: e["event_data"]["res"]["ping"]
             for e in run.events if e["event"] == "runner_on_ok"}
    assert pongs == {n.name: "pong" for n in sim_cluster.state.nodes}


def _build_deb(tmp_path: Path, name: str, version: str) -> Path:
    """A real Debian package (dpkg-deb) that no Debian mirror has, so only our repository can supply it."""
    pkg = tmp_path / "pkg"
    (pkg / "DEBIAN").mkdir(parents=True)
    (pkg / f"usr/share/{name}").mkdir(parents=True)
    (pkg / f"usr/share/{name}/marker").write_text("installed from the simulated cluster's apt repository\n")
    (pkg / "DEBIAN/control").write_text(
        f"Package: {name}\nVersion: {version}\nArchitecture: all\nMaintainer: stepdeploy tests <t@invalid>\n"
        f"Description: marker package for the simulated cluster tests\n")
    deb = tmp_path / f"{name}_{version}_all.deb"
    subprocess.run(["dpkg-deb", "--root-owner-group", "--build", str(pkg), str(deb)], check=True,
                   capture_output=True)
    return deb


def test_apt_installs_from_local_repository_on_one_node_only(sim_cluster: Cluster, tmp_path: Path) -> None:
    deb = _build_deb(tmp_path, "sdtest-marker", "1.2.3")
    repo.publish(sim_cluster.cfg.dir, [deb])
    playbook = tmp_path / "project" / "apt.yml"
    playbook.parent.mkdir()
    playbook.write_text(
        "- hosts: node1\n  gather_facts: false\n  tasks:\n"
        "    - name: Install the marker package from the local repository\n"
        "      ansible.builtin.apt:\n        name: sdtest-marker=1.2.3\n        update_cache: true\n")
    run = _runner(tmp_path, sim_cluster, playbook="apt.yml")
    assert run.status == "successful", run.stdout.read()
    assert run.stats["changed"] == {"node1": 1}

    def installed(node: str) -> subprocess.CompletedProcess[str] | object:
        with connection(sim_cluster.endpoint(node)) as conn:
            return conn.run("dpkg-query -W -f='${Version}' sdtest-marker", hide=True, warn=True)

    on1, on2 = installed("node1"), installed("node2")
    assert on1.ok and on1.stdout == "1.2.3"
    assert not on2.ok


def test_torchrun_gloo_all_reduce_across_nodes(sim_cluster: Cluster) -> None:
    nodes = sim_cluster.state.nodes
    script = Path(stepdeploy.workload.__file__).parent / "allreduce_check.py"  # shipped, not imported
    master = nodes[0].address

    def launch(rank: int) -> str:
        with connection(sim_cluster.endpoint(nodes[rank].name)) as conn:
            conn.put(str(script), "/tmp/allreduce_check.py")
            cmd = (f"GLOO_SOCKET_IFNAME=eth0 timeout 120 {NODE_VENV}/bin/torchrun --nnodes={len(nodes)} "
                   f"--nproc-per-node=1 --node-rank={rank} --master-addr={master} --master-port=29411 "
                   f"/tmp/allreduce_check.py --backend gloo --timeout-s 30")
            return conn.run(cmd, hide=True, warn=True).stdout

    with ThreadPoolExecutor(len(nodes)) as pool:
        outputs = list(pool.map(launch, range(len(nodes))))
    results = [json.loads(line) for out in outputs for line in out.splitlines() if line.startswith("{")]
    assert sorted(r["rank"] for r in results) == list(range(len(nodes)))
    assert {r["host"] for r in results} == {n.name for n in nodes}
    assert all(r["sum"] == 3.0 and r["world"] == 2 for r in results), results
