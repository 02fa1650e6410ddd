"""Issue 18: host keys are verified on every hop, and an inventory can turn that off only with --insecure.

Fabric builds the jump connection of a ProxyJump (from ~/.ssh/config) itself, with AutoAddPolicy; every hop of
a connection stepdeploy makes must reject unknown keys and load the cluster's known_hosts, like the node's own.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from fuzz.harness import Runner  # tests/unit is on sys.path (pytest's rootdir-relative import)
from paramiko import AutoAddPolicy, RejectPolicy

from stepdeploy.remote.ssh import Endpoint, connection

KNOWN = "jump.example.org ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIHK2Zsd4IHFoAtQlaQ7Xc0nlU0TGHvOsC6fdQ7zsBzKO\n"


def hops(conn: object) -> list[object]:
    found = []
    while conn is not None and not isinstance(conn, str):
        found.append(conn)
        conn = conn.gateway  # type: ignore[attr-defined]
    return found


@pytest.fixture
def known_hosts(tmp_path: Path) -> Path:
    path = tmp_path / "known_hosts"
    path.write_text(KNOWN)
    return path


def test_a_proxyjump_from_ssh_config_is_verified_like_the_node(tmp_path: Path, known_hosts: Path,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / ".ssh").mkdir()
    (tmp_path / ".ssh" / "config").write_text("Host node1.example.org\n  ProxyJump jump.example.org\n")
    monkeypatch.setenv("HOME", str(tmp_path))
    conn = connection(Endpoint(host="node1.example.org", known_hosts=known_hosts))
    node, jump = hops(conn)
    assert jump.host == "jump.example.org"  # type: ignore[attr-defined]
    for hop in (node, jump):
        assert isinstance(hop.client._policy, RejectPolicy), "a hop takes unknown host keys"  # type: ignore[attr-defined]
    assert "jump.example.org" in jump.client.get_host_keys()  # type: ignore[attr-defined]


def test_an_inventory_proxyjump_chain_is_built_and_every_hop_verified(known_hosts: Path) -> None:
    conn = connection(Endpoint(host="192.0.2.5", known_hosts=known_hosts, proxy_jump="ops@j1.example:2222,j2"))
    node, second, first = hops(conn)
    assert (second.host, first.host, first.user, first.port) == ("j2", "j1.example", "ops", 2222)  # type: ignore
    assert all(isinstance(h.client._policy, RejectPolicy) for h in (node, second, first))  # type: ignore


def test_only_an_accepted_insecure_node_takes_unknown_keys(known_hosts: Path) -> None:
    conn = connection(Endpoint(host="192.0.2.5", known_hosts=known_hosts, proxy_jump="j1", verify=False))
    assert all(isinstance(h.client._policy, AutoAddPolicy) for h in hops(conn))  # type: ignore[attr-defined]
    assert "jump.example.org" in conn.client.get_host_keys()  # a known key that changes is still refused


SETTINGS = ["ansible_host_key_checking=false", "ansible_ssh_common_args='-o StrictHostKeyChecking=no'"]


@pytest.mark.parametrize("setting", SETTINGS)
def test_commands_that_connect_refuse_an_inventory_without_host_key_checking(tmp_path: Path, setting: str,
                                                                            forked_cli: Runner) -> None:
    inventory = tmp_path / "inv.ini"
    inventory.write_text(f"[gpu]\nn1 ansible_host=127.0.0.1 ansible_port=1 {setting}\n"
                         "[gpu:vars]\nstepdeploy_profile=sim-cpu\n")
    variable = setting.split("=")[0]
    cwd = tmp_path / "cwd"
    cwd.mkdir()

    def _cli(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
        """The first setting through a fresh `python -m stepdeploy`, the other forked from the zygote."""
        if setting == SETTINGS[0]:
            return subprocess.run([sys.executable, "-m", "stepdeploy", *args], capture_output=True, text=True,
                                  timeout=120, cwd=cwd)
        case = forked_cli.run(cwd, list(args))
        return subprocess.CompletedProcess(args, case.rc, case.stdout, case.stderr)

    for args in (["preflight", str(inventory)], ["provision", str(inventory), "--check"],
                 ["rollout", "run", "-i", str(inventory), "-m", "tiny-dense", "--dry-run"]):
        res = _cli(*args, cwd=cwd)
        assert res.returncode == 2, (args, res.stderr)
        lines = res.stderr.splitlines()
        assert lines[0].startswith(f"warning: {variable}=") and "turns SSH host-key checking off for n1" in lines[0]
        assert lines[1].startswith("error: ") and "--insecure" in lines[2] and "Traceback" not in res.stderr
    shown = _cli("inventory", "show", str(inventory), cwd=cwd)  # connects to nothing: warned, not refused
    assert shown.returncode == 0 and shown.stderr.startswith(f"warning: {variable}=")
    accepted = _cli("preflight", str(inventory), "--insecure", "--timeout", "5", cwd=cwd)
    assert accepted.returncode == 3, accepted.stderr  # on to the node, which does not answer on port 1
    assert accepted.stderr.startswith(f"warning: {variable}=") and "error:" not in accepted.stderr
