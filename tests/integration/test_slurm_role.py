"""The optional `slurm` role on the simulated cluster: real Debian Slurm (22.05) and munge packages from the
cluster's repository, real Ansible over real SSH, real slurmctld/slurmd daemons (started without systemd, as
the nodes have none), real jobs.

One 2-node cluster ("sdslurm", conftest's slurm_sim, which test_slurm_executor.py's jobs run on after these
cases): `--check` on the fresh nodes changes nothing; site.yml with every
role (but python_env, which test_roles.py covers) and stepdeploy_slurm=true; then `sinfo`, `srun -N2`, a
failing batch job, the shared munge key (never in Ansible's output), memlock taken from slurmd, and a re-run
that changes nothing but starting the slurmd stopped before it. A 4-node cluster ("sdslurm4", markers `slurm4`
and `bench`: left out of the suite's default run, which keeps the 2-node case; run it with `-m slurm4` or
bench/suite_bench.sh) runs the role alone and `srun -N4`.
"""

from __future__ import annotations

import re
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from stepdeploy import ansible_run
from stepdeploy.sim.cluster import SimConfig

from .conftest import close_ssh_masters, private_cluster

REPO_ROOT = Path(__file__).resolve().parents[2]
ANSIBLE = REPO_ROOT  # playbooks/ and roles/: the checkout's top level (the design card's layout)
SITE = ANSIBLE / "playbooks" / "site.yml"
PROFILE = "sim-cpu"  # no NVIDIA roles: the simulated nodes have no GPU
SERVICE = "/usr/local/sbin/stepdeploy-slurm-service"


@dataclass
class SlurmCluster:
    cfg: SimConfig
    nodes: list[str]
    timings: dict[str, float] = field(default_factory=dict)
    artifacts: list[Path] = field(default_factory=list)

    def sh(self, name: str, command: str, check: bool = True, timeout: int = 120) -> subprocess.CompletedProcess[str]:
        """Run `command` on a node over OpenSSH with host-key checking."""
        index = int(name.removeprefix("node"))
        argv = ["ssh", "-i", str(self.cfg.client_key), "-o", "BatchMode=yes", "-o", "StrictHostKeyChecking=yes",
                "-o", f"UserKnownHostsFile={self.cfg.known_hosts}", f"root@{self.cfg.address(index)}", command]
        res = subprocess.run(argv, capture_output=True, text=True, timeout=timeout)
        if check:
            assert res.returncode == 0, f"{name}: `{command}` exited {res.returncode}: {res.stderr}"
        return res

    def playbook(self, tmp: Path, *, tags: str | None = None, skip_tags: str | None = None, check: bool = False):
        self.artifacts.append(tmp)
        return ansible_run.run(
            tmp, self.cfg.inventory, playbook=str(SITE), tags=tags, skip_tags=skip_tags,
            cmdline="--check" if check else None,
            extravars={"stepdeploy_profile": PROFILE, "stepdeploy_slurm": True},
            envvars={"ANSIBLE_ROLES_PATH": str(ANSIBLE / "roles"), "ANSIBLE_PIPELINING": "True",
                     "ANSIBLE_SSH_CONTROL_PATH_DIR": str(self.cfg.dir / "cp")},
        )

    def close_ssh_masters(self) -> None:
        """No SSH ControlMaster outlives the nodes."""
        close_ssh_masters(self.cfg.dir / "cp")

    def node_states(self) -> dict[str, str]:
        out = self.sh("node1", "sinfo --noheader --Node --format='%N %T'").stdout
        return dict(line.split() for line in out.splitlines() if line.strip())


def _cluster(tmp_path_factory: pytest.TempPathFactory, name: str, subnet: str, port: int,
             nodes: int) -> Iterator[SlurmCluster]:
    with private_cluster(tmp_path_factory, name, subnet, port, nodes=nodes) as cfg:
        cluster = SlurmCluster(cfg=cfg, nodes=[f"node{i}" for i in range(1, nodes + 1)])
        try:
            yield cluster
        finally:
            cluster.close_ssh_masters()


@pytest.fixture(scope="module")
def slurm2(slurm_sim: SimConfig) -> Iterator[SlurmCluster]:
    """The session's Slurm cluster (conftest.slurm_sim), fresh here: test_slurm_executor.py runs on it after."""
    cluster = SlurmCluster(cfg=slurm_sim, nodes=["node1", "node2"])
    try:
        yield cluster
    finally:
        cluster.close_ssh_masters()


@pytest.fixture(scope="module")
def slurm4(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SlurmCluster]:
    yield from _cluster(tmp_path_factory, "sdslurm4", "10.91.0.0/24", 8092, 4)


def _failed(runner) -> list[str]:
    return [f"{e['event_data'].get('host')}: {e['event_data'].get('task')}: "
            f"{e['event_data'].get('res', {}).get('msg', '')} {e['event_data'].get('res', {}).get('stderr', '')}"
            for e in runner.events if e.get("event") in ("runner_on_failed", "runner_on_unreachable")]


def _changed(runner) -> list[str]:
    return [f"{e['event_data']['host']}: {e['event_data']['task']}" for e in runner.events
            if e.get("event") == "runner_on_ok" and e["event_data"].get("res", {}).get("changed")]


def _hostnames(out: str) -> list[str]:
    return sorted(line.strip() for line in out.splitlines() if line.strip())


def test_check_mode_on_fresh_nodes_changes_nothing(slurm2: SlurmCluster, tmp_path: Path) -> None:
    runner = slurm2.playbook(tmp_path, tags="slurm", check=True)
    assert runner.rc == 0, _failed(runner)
    for name in slurm2.nodes:
        res = slurm2.sh(name, "dpkg -s slurmd munge; test -e /etc/slurm/slurm.conf || echo no-conf; "
                              f"test -e {SERVICE} || echo no-script", check=False)
        assert "is not installed" in res.stderr and "no-conf" in res.stdout and "no-script" in res.stdout


def test_site_with_slurm_provisions_two_nodes(slurm2: SlurmCluster, tmp_path: Path) -> None:
    start = time.monotonic()
    # Every role of site.yml, the slurm role included, but python_env: test_roles.py covers it, and its torch
    # install from the wheelhouse alone takes 80 s on a loaded 2-core machine.
    runner = slurm2.playbook(tmp_path, skip_tags="python_env")
    slurm2.timings["first"] = time.monotonic() - start
    assert runner.rc == 0, _failed(runner)
    assert runner.stats["failures"] == {} and runner.stats["dark"] == {}
    assert any("Run slurmctld without systemd" in c for c in _changed(runner))


def test_sinfo_shows_every_node_idle(slurm2: SlurmCluster) -> None:
    assert slurm2.node_states() == dict.fromkeys(slurm2.nodes, "idle")
    conf = slurm2.sh("node2", "cat /etc/slurm/slurm.conf").stdout
    assert f"SlurmctldHost=node1({slurm2.cfg.address(1)})" in conf
    assert "ProctrackType=proctrack/linuxproc" in conf and "PropagateResourceLimitsExcept=MEMLOCK" in conf
    assert "Gres=" not in conf and "GresTypes" not in conf  # no GPU on a simulated node
    for index, name in enumerate(slurm2.nodes, start=1):
        assert re.search(rf"^NodeName={name} NodeAddr={re.escape(slurm2.cfg.address(index))} CPUs=\d+ .*"
                         r"RealMemory=\d+ State=UNKNOWN$", conf, re.M), conf


def test_srun_runs_on_every_node(slurm2: SlurmCluster) -> None:
    res = slurm2.sh("node1", "srun --nodes=2 --ntasks-per-node=1 hostname", timeout=120)
    assert _hostnames(res.stdout) == slurm2.nodes
    # A batch job from the other node; its state and exit code come back through scontrol.
    job = slurm2.sh("node2", "sbatch --parsable --nodes=2 --output=/tmp/slurm-%j.out "
                             "--wrap='srun hostname; exit 3'").stdout.strip()
    assert job.isdigit()
    state = ""
    for _ in range(60):
        state = slurm2.sh("node1", f"scontrol show job -o {job}").stdout
        if "JobState=FAILED" in state or "JobState=COMPLETED" in state:
            break
        time.sleep(1)
    assert "JobState=FAILED" in state and "ExitCode=3:0" in state, state
    batch_host = re.search(r"BatchHost=(\S+)", state)
    assert batch_host is not None and batch_host.group(1) in slurm2.nodes, state
    assert _hostnames(slurm2.sh(batch_host.group(1), f"cat /tmp/slurm-{job}.out").stdout) == slurm2.nodes


def test_munge_key_is_shared_private_and_never_logged(slurm2: SlurmCluster) -> None:
    sums = {name: slurm2.sh(name, "sha256sum /etc/munge/munge.key").stdout.split()[0] for name in slurm2.nodes}
    assert len(set(sums.values())) == 1, "every node must hold the same munge key"
    for name in slurm2.nodes:
        assert slurm2.sh(name, "stat -c '%a %U %G' /etc/munge/munge.key").stdout.split() == ["400", "munge", "munge"]
    # A credential made on node1 decodes on node2 (the shared key, for real).
    cred = slurm2.sh("node1", "munge -n").stdout.strip()
    assert "STATUS:          Success" in slurm2.sh("node2", f"echo {cred} | unmunge").stdout
    # Ansible's output and event records never contain the key (in either encoding).
    key_b64 = slurm2.sh("node1", "base64 -w0 /etc/munge/munge.key").stdout.strip()
    key_hex = slurm2.sh("node1", "od -An -tx1 -v /etc/munge/munge.key | tr -d ' \\n'").stdout.strip()
    assert len(key_b64) >= 44 and len(key_hex) >= 64
    leaks = [str(p) for run in slurm2.artifacts for p in run.rglob("*") if p.is_file()
             and any(k in p.read_text(errors="replace") for k in (key_b64, key_hex))]
    assert leaks == [], f"the munge key appears in {leaks}"


def test_jobs_take_memlock_from_slurmd(slurm2: SlurmCluster) -> None:
    # PropagateResourceLimitsExcept=MEMLOCK: a job gets slurmd's memlock, not the submitting shell's 64 KiB.
    slurmd_kib = {}
    for name in slurm2.nodes:
        limits = slurm2.sh(name, "grep 'Max locked memory' /proc/$(cat /run/slurmd.pid)/limits").stdout.split()
        slurmd_kib[name] = limits[3] if limits[3] == "unlimited" else str(int(limits[3]) // 1024)
    assert all(v != "64" for v in slurmd_kib.values())
    out = slurm2.sh("node1", "ulimit -S -l 64 && srun --nodes=2 --ntasks-per-node=1 "
                             "sh -c 'echo $(hostname) $(ulimit -l)'").stdout
    assert dict(line.split() for line in out.splitlines()) == slurmd_kib


def test_rerun_changes_nothing_but_starting_a_stopped_slurmd(slurm2: SlurmCluster, tmp_path: Path) -> None:
    # One re-run shows both: idempotence (no other task on either node changes) and pid-file daemon handling
    # (the slurmd stopped on node2 is found stopped and started; every other daemon is found running).
    slurm2.sh("node2", f"{SERVICE} stop slurmd")
    assert slurm2.sh("node2", f"{SERVICE} status slurmd", check=False).returncode != 0
    start = time.monotonic()
    runner = slurm2.playbook(tmp_path, tags="slurm")
    slurm2.timings["rerun"] = time.monotonic() - start
    assert runner.rc == 0, _failed(runner)
    assert _changed(runner) == ["node2: Run slurmd without systemd"]
    assert runner.stats["changed"] == {"node2": 1}
    assert slurm2.node_states() == dict.fromkeys(slurm2.nodes, "idle")
    assert _hostnames(slurm2.sh("node1", "srun -N2 hostname").stdout) == slurm2.nodes
    print(f"\nsite.yml (all roles but python_env, + slurm) on 2 nodes: {slurm2.timings.get('first', 0):.1f} s; "
          f"re-run --tags slurm {slurm2.timings['rerun']:.1f} s")


@pytest.mark.slurm4
@pytest.mark.bench
def test_four_nodes(slurm4: SlurmCluster, tmp_path: Path) -> None:
    start = time.monotonic()
    runner = slurm4.playbook(tmp_path, tags="slurm")  # the compatibility play and the slurm role
    elapsed = time.monotonic() - start
    assert runner.rc == 0, _failed(runner)
    assert slurm4.node_states() == dict.fromkeys(slurm4.nodes, "idle")
    assert _hostnames(slurm4.sh("node3", "srun --nodes=4 --ntasks-per-node=1 hostname").stdout) == slurm4.nodes
    print(f"\nsite.yml --tags slurm on 4 nodes: {elapsed:.1f} s")
