"""The provisioning roles on the simulated cluster: real Ansible over real SSH, real apt from the cluster's
repository (real Debian packages with their dependency closure, plus stand-ins carrying NVIDIA's package
names and versions in their own repository), real pip from its wheelhouse.

One 3-node cluster of its own (name, subnet and port differ from every other test's): node1 and node2 are
provisioned with the `sim-standin` profile; node3 stays fresh — it is what `--limit node1,node2` must not touch
and what `--check` must not change (that case has marker `bench`: bench/suite_bench.sh runs it; the suite's
check mode of every role on a fresh node is test_wheel_provision.py's, same profile).
"""

from __future__ import annotations

import hashlib
import json
import shlex
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from stepdeploy import ansible_run
from stepdeploy.provision.runner import ProvisionRequest, extravars
from stepdeploy.render.facts import default_facts_dir
from stepdeploy.sim import mirror, repo, standins
from stepdeploy.sim.cluster import SimConfig, down, up
from stepdeploy.sim.state import SimState

from .conftest import require_sim

REPO_ROOT = Path(__file__).resolve().parents[2]
ANSIBLE = REPO_ROOT  # playbooks/ and roles/: the checkout's top level (the design card's layout)
SITE = ANSIBLE / "playbooks" / "site.yml"
PROFILE = "sim-standin"
PROVISIONED = ("node1", "node2")
FRESH = "node3"
# What a provisioned node has and a fresh one lacks.
LIMITS_FILE = "/etc/security/limits.d/90-stepdeploy.conf"
NCCL_FACTS = "/etc/stepdeploy/nccl.json"
VENV = "/opt/stepdeploy/env"


@dataclass
class RolesCluster:
    cfg: SimConfig
    state: SimState
    timings: dict[str, float] = field(default_factory=dict)

    @property
    def control_dir(self) -> Path:
        """Where this cluster's SSH ControlMaster sockets live, so teardown can close exactly those."""
        return self.cfg.dir / "cp"

    def close_ssh_masters(self) -> None:
        for socket in self.control_dir.glob("*"):
            subprocess.run(["ssh", "-O", "exit", "-o", f"ControlPath={socket}", "node"], capture_output=True,
                           timeout=30, check=False)

    def address(self, name: str) -> str:
        node = self.state.node(name)
        assert node is not None
        return node.address

    def sh(self, name: str, command: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        """Run `command` on a node over OpenSSH with host-key checking."""
        argv = ["ssh", "-i", str(self.cfg.client_key), "-o", "BatchMode=yes", "-o", "StrictHostKeyChecking=yes",
                "-o", f"UserKnownHostsFile={self.cfg.known_hosts}", f"root@{self.address(name)}", command]
        res = subprocess.run(argv, capture_output=True, text=True, timeout=120)
        if check:
            assert res.returncode == 0, f"{name}: `{command}` exited {res.returncode}: {res.stderr}"
        return res

    def playbook(self, tmp: Path, playbook: Path = SITE, *, limit: str | None = None, check: bool = False,
                 diff: bool = False, extravars: dict | None = None):
        cmdline = " ".join(a for a, on in (("--check", check), ("--diff", diff)) if on)
        return ansible_run.run(
            tmp, self.cfg.inventory, playbook=str(playbook), limit=limit, cmdline=cmdline or None,
            extravars={"stepdeploy_profile": PROFILE, **(extravars or {})},
            envvars={"ANSIBLE_ROLES_PATH": str(ANSIBLE / "roles"), "ANSIBLE_PIPELINING": "True",
                     "ANSIBLE_SSH_CONTROL_PATH_DIR": str(self.control_dir)},
        )


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RolesCluster]:
    require_sim()
    cfg = SimConfig(name="sdroles", subnet="10.81.0.0/24", http_port=8083,
                    state_dir=tmp_path_factory.mktemp("sim") / "sdroles")
    cluster = None
    try:
        state = up(cfg, 3)
        repo.publish(cfg.dir, mirror.ensure_debs(Path(state.base)))
        standins.publish(cfg.dir, standins.build_all())
        cluster = RolesCluster(cfg=cfg, state=state)
        yield cluster
    finally:
        if cluster is not None:
            cluster.close_ssh_masters()  # no SSH connection outlives the nodes
        report = down(cfg)
        assert report.leftovers == [], f"sim down left: {report.leftovers}"


def _events_failed(runner) -> list[str]:
    return [f"{e['event_data'].get('host')}: {e['event_data'].get('task')}: "
            f"{e['event_data'].get('res', {}).get('msg', '')}"
            for e in runner.events if e.get("event") == "runner_on_failed"]


def _absent(cluster: RolesCluster, name: str) -> None:
    """Nothing the roles create exists on `name`."""
    script = (f"test ! -e {LIMITS_FILE} && test ! -e {NCCL_FACTS} && test ! -e {VENV} "
              "&& test ! -e /etc/apt/sources.list.d/nvidia-cuda.sources && test ! -e /root/.ssh/id_ed25519 "
              "&& ! grep -q 'stepdeploy nodes' /etc/hosts && ! dpkg -s chrony >/dev/null 2>&1 "
              "&& ! dpkg -s nvidia-driver >/dev/null 2>&1 && test \"$(cat /sys/class/net/eth0/mtu)\" = 1500")
    cluster.sh(name, script)


@pytest.mark.bench  # the suite's check-mode case of every role: test_wheel_provision.py (same profile, node files)
def test_check_mode_on_a_fresh_node_changes_nothing(cluster: RolesCluster, tmp_path: Path) -> None:
    runner = cluster.playbook(tmp_path, limit=FRESH, check=True)
    assert runner.rc == 0, _events_failed(runner)
    assert runner.stats["failures"] == {}
    assert runner.stats["changed"].get(FRESH, 0) > 0, "check mode should report what it would change"
    _absent(cluster, FRESH)


def _facts_dir(cluster: RolesCluster) -> Path:
    """Where `stepdeploy provision` brings the nodes' NCCL facts (and `stepdeploy render` reads them)."""
    return default_facts_dir(cluster.cfg.inventory)


def test_site_provisions_two_nodes(cluster: RolesCluster, tmp_path: Path) -> None:
    start = time.monotonic()
    runner = cluster.playbook(tmp_path, limit=",".join(PROVISIONED), extravars=extravars(
        ProvisionRequest(inventory=cluster.cfg.inventory)))
    cluster.timings["first"] = time.monotonic() - start
    assert runner.rc == 0, _events_failed(runner)
    assert set(runner.stats["ok"]) == set(PROVISIONED)
    assert runner.stats["failures"] == {} and runner.stats["dark"] == {}
    assert all(runner.stats["changed"].get(n, 0) > 0 for n in PROVISIONED)


def test_second_run_changes_nothing(cluster: RolesCluster, tmp_path: Path) -> None:
    start = time.monotonic()
    runner = cluster.playbook(tmp_path, limit=",".join(PROVISIONED), extravars=extravars(
        ProvisionRequest(inventory=cluster.cfg.inventory)))
    cluster.timings["rerun"] = time.monotonic() - start
    assert runner.rc == 0, _events_failed(runner)
    changed = [f"{e['event_data']['host']}: {e['event_data']['task']}" for e in runner.events
               if e.get("event") == "runner_on_ok" and e["event_data"].get("res", {}).get("changed")]
    assert changed == [], f"not idempotent: {changed}"
    assert {n: runner.stats["changed"].get(n, 0) for n in PROVISIONED} == dict.fromkeys(PROVISIONED, 0)
    print(f"\nsite.yml on 2 nodes: first run {cluster.timings.get('first', 0):.1f} s, "
          f"re-run {cluster.timings['rerun']:.1f} s")


def test_the_limited_out_node_is_untouched(cluster: RolesCluster) -> None:
    _absent(cluster, FRESH)


def test_mtu_9000_and_jumbo_ping_between_nodes(cluster: RolesCluster) -> None:
    for name in PROVISIONED:
        assert cluster.sh(name, "cat /sys/class/net/eth0/mtu").stdout.strip() == "9000"
        rule = cluster.sh(name, "cat /etc/udev/rules.d/70-stepdeploy-mtu.rules").stdout
        assert 'KERNEL=="eth0"' in rule and "mtu 9000" in rule
    # The "switch": the bridge and the host ends of the veths carry jumbo frames.
    bridge = Path("/sys/class/net") / cluster.state.bridge
    assert (bridge / "mtu").read_text().strip() == "9000"
    for node in cluster.state.nodes:
        assert (Path("/sys/class/net") / node.veth / "mtu").read_text().strip() == "9000"
    for src, dst in (PROVISIONED, PROVISIONED[::-1]):
        res = cluster.sh(src, f"ping -M do -s 8972 -c 2 -W 2 {cluster.address(dst)}")
        assert "2 received" in res.stdout
    # A fresh node still at 1500 cannot take the jumbo frame: the ping really tests the MTU.
    assert cluster.sh("node1", f"ping -M do -s 8972 -c 1 -W 1 {cluster.address(FRESH)}", check=False).returncode != 0


def test_limits_sysctls_hosts_and_chrony(cluster: RolesCluster) -> None:
    for name in PROVISIONED:
        limits = cluster.sh(name, f"cat {LIMITS_FILE}").stdout
        for line in ("* hard memlock unlimited", "root soft memlock unlimited", "* soft nofile 1048576"):
            assert line in limits
        assert "size=50%" in cluster.sh(name, "grep /dev/shm /etc/fstab").stdout
        sysctl = cluster.sh(name, "cat /etc/sysctl.d/90-stepdeploy-infiniband.conf "
                                  "/etc/sysctl.d/90-stepdeploy-common.conf").stdout
        assert "net.ipv4.conf.all.arp_ignore = 1" in sysctl and "vm.max_map_count = 1048576" in sysctl
        # Network sysctls are per network namespace: applied for real on the node.
        assert cluster.sh(name, "sysctl -n net.ipv4.conf.all.arp_ignore net.ipv4.conf.all.arp_announce"
                          ).stdout.split() == ["1", "2"]
        hosts = cluster.sh(name, "sed -n '/BEGIN stepdeploy nodes/,/END stepdeploy nodes/p' /etc/hosts").stdout
        for other in cluster.state.nodes:
            assert f"{other.address} {other.name}" in hosts
        assert cluster.sh(name, "dpkg -s chrony | grep -c '^Status: install ok installed'").stdout.strip() == "1"
        assert "pool pool.ntp.org iburst" in cluster.sh(name, "cat /etc/chrony/chrony.conf").stdout


def test_ssh_trust_between_provisioned_nodes(cluster: RolesCluster) -> None:
    for src, dst in (PROVISIONED, PROVISIONED[::-1]):
        for target in (dst, cluster.address(dst)):
            res = cluster.sh(src, f"ssh -o BatchMode=yes -o StrictHostKeyChecking=yes {target} hostname")
            assert res.stdout.strip() == dst
    # node3 was not in the play: it trusts nobody and nobody has its host key.
    res = cluster.sh("node1", f"ssh -o BatchMode=yes -o StrictHostKeyChecking=yes {FRESH} true", check=False)
    assert res.returncode == 255 and "Host key verification failed" in res.stderr


def test_venv_with_torch_cpu_from_the_wheelhouse(cluster: RolesCluster) -> None:
    for name in PROVISIONED:
        res = cluster.sh(name, f"{VENV}/bin/python -c 'import torch; print(torch.__version__, "
                               "torch.ones(2).sum().item())'")
        assert res.stdout.split() == ["2.13.0+cpu", "2.0"]


def test_nvidia_standins_pinned_and_held(cluster: RolesCluster) -> None:
    query = "dpkg-query -W -f='${Package} ${Version}\\n' nvidia-driver cuda-toolkit-12-3 libnccl2 libnccl-dev"
    for name in PROVISIONED:
        versions = dict(line.split() for line in cluster.sh(name, query).stdout.splitlines())
        assert versions == {"nvidia-driver": "550.54.15-1", "cuda-toolkit-12-3": "12.3.2-1",
                            "libnccl2": "2.19.3-1+cuda12.3", "libnccl-dev": "2.19.3-1+cuda12.3"}
        held = set(cluster.sh(name, "apt-mark showhold").stdout.split())
        assert {"nvidia-driver", "nvidia-kernel-dkms", "cuda-toolkit-12-3", "libnccl2", "libnccl-dev"} <= held
        policy = cluster.sh(name, "apt-cache policy libnccl2").stdout
        assert "2.19.3-1+cuda12.3" in policy and "1001" in policy
        assert "release 12.3" in cluster.sh(name, "bash -lc 'nvcc --version'").stdout
        assert cluster.sh(name, "readlink /usr/local/cuda").stdout.strip() == "/usr/local/cuda-12.3"


def test_nccl_facts_saved_for_the_launch_templates(cluster: RolesCluster, tmp_path: Path) -> None:
    for name in PROVISIONED:
        on_node = cluster.sh(name, f"cat {NCCL_FACTS}").stdout
        assert (_facts_dir(cluster) / f"{name}.json").read_text() == on_node, "provisioning brings the facts back"
        facts = json.loads(on_node)
        assert facts["socket_ifname"] == "eth0"
        assert facts["hcas"] == [] and facts["ib_hca"] is None and facts["gid_index"] is None
        assert facts["netdevs"] == [{"name": "eth0", "present": True, "operstate": "up", "mtu": 9000}]
        assert facts["env"] == {"NCCL_SOCKET_IFNAME": "eth0", "GLOO_SOCKET_IFNAME": "eth0",
                                "OMPI_MCA_btl_tcp_if_include": "eth0"}
    assert not (_facts_dir(cluster) / f"{FRESH}.json").exists(), "node3 was not provisioned"
    # `stepdeploy render` finds them next to the inventory: env.sh says where NCCL_SOCKET_IFNAME came from,
    # the manifest names each node's facts file with its hash, and node3 is rendered from the inventory.
    out = tmp_path / "run"
    res = subprocess.run([sys.executable, "-m", "stepdeploy", "render", "-i", str(cluster.cfg.inventory), "-m",
                          "tiny-dense", "--seq", "64", "--gbs", "6", "--out", str(out)],
                         capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    manifest = json.loads((out / "manifest.json").read_text())
    for rank, node in enumerate(manifest["nodes"]):
        saved = _facts_dir(cluster) / f"{node['name']}.json"
        env = (out / node["dir"] / "env.sh").read_text()
        if node["name"] in PROVISIONED:
            assert node["facts"] == {"path": str(saved), "sha256": hashlib.sha256(saved.read_bytes()).hexdigest()}
            assert f"found by provisioning ({saved})\nexport NCCL_SOCKET_IFNAME=eth0\n" in env, env
        else:
            assert "facts" not in node and "(inventory stepdeploy_train_iface)\nexport NCCL_SOCKET_IFNAME=eth0" in env
            assert f"{FRESH}: no NCCL facts saved by provisioning" in res.stderr
        assert rank == node["node_rank"]


def test_conda_path_in_check_mode(cluster: RolesCluster, tmp_path: Path) -> None:
    """No conda channel is reachable here: the conda path runs in check mode from an air-gapped installer
    file, and the environment file it would write is checked in the diff."""
    installer = tmp_path / "Miniforge3-test.sh"
    installer.write_text("#!/bin/sh\necho 'a stand-in installer: check mode never runs it'\nexit 1\n")
    play = tmp_path / "conda.yml"
    play.write_text(f"""---
- name: Conda environment (check mode)
  hosts: {FRESH}
  gather_facts: true
  roles:
    - role: python_env
      python_env_manager: conda
      python_env_python_version: "3.10"
      python_env_packages: ["torch==2.3.1", "megatron-core==0.8.0"]
      python_env_pip_find_links: [http://mirror.example/wheels/]
      python_env_conda_channels: [http://mirror.example/conda-forge]
      python_env_conda_installer_src: {shlex.quote(str(installer))}
""")
    (tmp_path / "run").mkdir()
    runner = cluster.playbook(tmp_path / "run", play, check=True, diff=True)
    assert runner.rc == 0, _events_failed(runner)
    diffs = [d.get("after", "") for e in runner.events if e.get("event") == "runner_on_ok"
             for d in (e["event_data"].get("res", {}).get("diff") or []) if isinstance(d, dict)]
    env_file = next(d for d in diffs if "dependencies:" in d)
    for line in ("  - python=3.10", "      - torch==2.3.1", "      - megatron-core==0.8.0",
                 "      - --find-links http://mirror.example/wheels/", "  - http://mirror.example/conda-forge"):
        assert line in env_file.splitlines(), env_file
    cluster.sh(FRESH, "test ! -e /etc/stepdeploy/environment.yml && test ! -e /opt/miniforge3 "
                      "&& test ! -e /var/tmp/miniforge-installer.sh "
                      "&& test ! -e /var/lib/stepdeploy/installers/miniforge-installer.sh")
