"""`stepdeploy provision --check` from the installed wheel (tests/wheel_venv.py), run from a directory outside
this checkout: the playbooks, the roles and the filter plugin all come from the wheel's package, real Ansible
over real SSH on a fresh node of its own ("sdwheel"), which check mode leaves as it was. With the sim-standin
profile, so every role of site.yml but slurm runs in check mode (the suite's check-mode case of those roles on a
fresh node; test_slurm_role.py has the slurm role's)."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from tests.wheel_venv import REPO, InstalledWheel

from .conftest import Cluster, fresh_node
from .test_provision import _upper_files

NODE = "node1"
APT_CACHE = {"var", "var/cache", "var/cache/apt"}  # apt rebuilds its binary cache when it simulates an install


@pytest.fixture(scope="module")
def fresh(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    """A node of its own that nothing has provisioned (the session's sdtest nodes have had the common role from
    test_provision.py), so check mode meets every role's first-run paths."""
    with fresh_node(tmp_path_factory, "sdwheel", "10.90.0.0/24", 8091) as cluster:
        yield cluster


def test_provision_check_from_the_installed_wheel(fresh: Cluster, wheel_install: InstalledWheel, tmp_path: Path,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ANSIBLE_SSH_CONTROL_PATH_DIR", str(fresh.cfg.dir / "cp"))
    # The sim-standin profile: the NVIDIA roles (against the stand-in repository every simulated cluster
    # serves) run in check mode too, so this is also the suite's check-mode case of every role on a fresh
    # node (test_roles.py's own moved to bench/, marker `bench`).
    text = fresh.cfg.inventory.read_text()
    assert "stepdeploy_profile=sim-cpu\n" in text
    inventory = tmp_path / "inventory.ini"
    inventory.write_text(text.replace("stepdeploy_profile=sim-cpu\n", "stepdeploy_profile=sim-standin\n"))
    before = _upper_files(fresh, NODE)
    started = time.monotonic()
    res = wheel_install.run(wheel_install.stepdeploy, "provision", inventory, "--check", "--limit", NODE, "--json",
                            "--log-dir", tmp_path / "log", cwd=tmp_path, timeout=900)
    seconds = time.monotonic() - started
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    recap = json.loads(res.stdout)
    assert recap["check"] is True and set(recap["hosts"]) == {NODE}
    assert recap["hosts"][NODE]["status"] == "done" and recap["hosts"][NODE]["failed"] == 0, recap
    assert recap["hosts"][NODE]["changed"] > 0, "check mode should report what it would change on a fresh node"
    compat = yaml.safe_load((REPO / "playbooks/compat.yml").read_text())[0]["tasks"]
    assert recap["tasks"] > len(compat) + 1, "only the compatibility play ran: the roles were not found"
    command = json.loads((tmp_path / "log" / "artifacts" / "run" / "command").read_text())
    (playbook,) = [Path(arg) for arg in command["command"] if arg.endswith("site.yml")]
    assert wheel_install.venv in playbook.parents, f"site.yml came from {playbook}, not the wheel"
    assert command["env"]["ANSIBLE_ROLES_PATH"].startswith(str(wheel_install.venv))
    changed = _upper_files(fresh, NODE) - before
    assert {p for p in changed if p not in APT_CACHE and not p.startswith("var/cache/apt/")} == set(), \
        "--check changed the node"
    assert not (tmp_path / ".stepdeploy").exists(), "--check wrote facts"
    print(f"\nprovision --check from the wheel on {NODE}: {seconds:.1f} s, {recap['tasks']} tasks")
