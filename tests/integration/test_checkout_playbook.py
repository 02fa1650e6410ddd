"""The design card's own command from a checkout: `ansible-playbook -i INVENTORY playbooks/site.yml --check`,
started in the repository's root as an Ansible user types it, with nothing of stepdeploy in between: no
ANSIBLE_* variable, no ansible-runner; the top-level ansible.cfg is what points Ansible at the top-level roles/.
Real Ansible over real SSH on a fresh node of its own cluster ("sdcheck"), which check mode leaves as it was.
Profile sim-standin (the cluster's stand-in NVIDIA repository), so every role of site.yml but slurm runs. The same
check from an installed wheel, through `stepdeploy provision`, is test_wheel_provision.py's."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from .conftest import Cluster, fresh_node
from .test_provision import _upper_files

REPO = Path(__file__).resolve().parents[2]
NODE = "node1"
ROLES = ("common", "nvidia_repo", "nvidia_driver", "cuda_toolkit", "nccl", "python_env", "infiniband")
APT_CACHE = {"var", "var/cache", "var/cache/apt"}  # apt rebuilds its binary cache when it simulates an install
# sshd records every login (this node's first is the play's); not a change the play makes
LOGIN_RECORDS = {"var/log", "var/log/wtmp", "var/log/lastlog", "var/log/btmp"}


@pytest.fixture(scope="module")
def fresh(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    with fresh_node(tmp_path_factory, "sdcheck", "10.95.0.0/24", 8095) as cluster:
        yield cluster


def _user_env(cluster: Cluster) -> dict[str, str]:
    """A shell of a checkout's user: the venv's bin/ on PATH, the checkout importable (the filter plugin imports
    stepdeploy, as an editable install makes it), and no Ansible setting but the SSH sockets' directory."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("ANSIBLE_")}
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH")) if p)
    env["ANSIBLE_SSH_CONTROL_PATH_DIR"] = str(cluster.cfg.dir / "cp")  # closed at teardown, like the others'
    env["NO_COLOR"] = "1"
    return env


def _checkout_state() -> str:
    return subprocess.run(["git", "status", "--porcelain", "--untracked-files=all"], cwd=REPO, capture_output=True,
                          text=True, check=True).stdout


def test_site_yml_check_from_the_checkout(fresh: Cluster, tmp_path: Path) -> None:
    text = fresh.cfg.inventory.read_text()
    assert "stepdeploy_profile=sim-cpu\n" in text
    inventory = tmp_path / "inventory.ini"
    inventory.write_text(text.replace("stepdeploy_profile=sim-cpu\n", "stepdeploy_profile=sim-standin\n"))
    node_before, checkout_before = _upper_files(fresh, NODE), _checkout_state()
    started = time.monotonic()
    playbook_cli = str(Path(sys.executable).parent / "ansible-playbook")
    res = subprocess.run([playbook_cli, "-v", "-i", str(inventory), "playbooks/site.yml", "--check"],
                         cwd=REPO, env=_user_env(fresh), capture_output=True, text=True, timeout=900)
    seconds = time.monotonic() - started
    output = res.stdout + res.stderr
    assert res.returncode == 0, output[-6000:]
    assert f"Using {REPO / 'ansible.cfg'} as config file" in output, output[:2000]
    recap = re.search(rf"^{NODE}\s*:\s*ok=(\d+)\s+changed=(\d+)\s+unreachable=(\d+)\s+failed=(\d+)", res.stdout,
                      re.MULTILINE)
    assert recap is not None, res.stdout[-3000:]
    ok, changed, unreachable, failed = map(int, recap.groups())
    assert (unreachable, failed) == (0, 0) and changed > 0, recap.group(0)
    missing = [role for role in ROLES if f"TASK [{role} : " not in res.stdout]
    assert missing == [], f"roles/ of the checkout not found or not run: {missing}"
    written = {p for p in _upper_files(fresh, NODE) - node_before
               if p not in APT_CACHE | LOGIN_RECORDS and not p.startswith("var/cache/apt/")}
    assert written == set(), "--check changed the node"
    assert _checkout_state() == checkout_before, "--check wrote into the checkout"
    print(f"\nansible-playbook playbooks/site.yml --check from the checkout on {NODE}: {seconds:.1f} s, "
          f"ok={ok} changed={changed}")
