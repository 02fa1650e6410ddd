"""The rollout through Slurm on the simulated cluster: real munge, slurmctld and slurmd from the Debian
packages, installed by roles/slurm with real Ansible; `rollout run --executor slurm` as a user runs it.

- warmup and a short soak of the torch engine run as Slurm jobs across 2 nodes (each node's ranks started by
  launch_ranks.py); a worker killed with SIGKILL ends its job, the attempt names it (not a rank srun killed after
  it) and the soak resubmits (a new job id, in the ledger) and resumes from its checkpoint;
- `rollout stop` cancels the job (scancel) and nothing of the run is left on any node (this one with one
  srun task per rank, `stepdeploy_slurm_tasks=gpu`, instead of one launch_ranks.py per node).
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from stepdeploy import ansible_run
from stepdeploy.ledger import Ledger
from stepdeploy.remote.ssh import Endpoint, connection
from stepdeploy.sim.cluster import SimConfig

from .conftest import close_ssh_masters, stepdeploy_cli

REPO_ROOT = Path(__file__).resolve().parents[2]
FAST = ["--seq", "64", "--gbs", "4", "--warmup-iterations", "4", "--checkpoint-interval", "2",
        "--pg-timeout", "30", "--executor", "slurm"]
ANSIBLE = REPO_ROOT  # playbooks/ and roles/: the checkout's top level (the design card's layout)
SITE = ANSIBLE / "playbooks" / "site.yml"


@pytest.fixture(scope="module")
def cluster(slurm_sim: SimConfig, tmp_path_factory: pytest.TempPathFactory) -> Iterator[SimConfig]:
    """The session's Slurm cluster (conftest.slurm_sim): test_slurm_role.py's cases provision it first (site.yml
    with the slurm role); run without them, or after they left Slurm down, roles/slurm is applied here."""
    cfg = slurm_sim
    control = cfg.dir / "cp-executor"
    try:
        if _on(cfg, 1, "sinfo -h -N -o %t 2>/dev/null").split() != ["idle", "idle"]:
            runner = ansible_run.run(tmp_path_factory.mktemp("ansible"), cfg.inventory, playbook=str(SITE),
                                     tags="slurm", extravars={"stepdeploy_profile": "sim-cpu",
                                                              "stepdeploy_slurm": True},
                                     envvars={"ANSIBLE_ROLES_PATH": str(ANSIBLE / "roles"),
                                              "ANSIBLE_SSH_CONTROL_PATH_DIR": str(control)})
            assert runner.rc == 0, f"roles/slurm failed: {runner.stdout.read()[-3000:]}"
        assert _on(cfg, 1, "sinfo -h -N -o %t").split() == ["idle", "idle"], _on(cfg, 1, "sinfo")
        yield cfg
    finally:  # Ansible's SSH ControlMasters would keep the nodes' namespaces alive
        close_ssh_masters(control)


def _on(cfg: SimConfig, index: int, command: str) -> str:
    ep = Endpoint(host=cfg.address(index), key_file=cfg.client_key, known_hosts=cfg.known_hosts)
    with connection(ep) as conn:
        return conn.run(command, hide=True, warn=True).stdout


def _cli(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return stepdeploy_cli(*args, cwd=cwd, timeout=600)


def _controller(args: list[str], cwd: Path) -> subprocess.Popen[str]:
    return subprocess.Popen([sys.executable, "-m", "stepdeploy", *args], cwd=cwd, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)


def _remote_dir(run: Path, attempt: str) -> str | None:
    manifest = run / "attempts" / attempt / "manifest.json"
    return json.loads(manifest.read_text())["run_dir"] if manifest.exists() else None


def _rank_file(cfg: SimConfig, index: int, run: Path, attempt: str, name: str) -> dict:
    remote = _remote_dir(run, attempt)
    if remote is None:
        return {}
    try:
        return json.loads(_on(cfg, index, f"cat {remote}/out/{name} 2>/dev/null || true"))
    except ValueError:
        return {}


def _wait_for_iteration(cfg: SimConfig, run: Path, attempt: str, at_least: int, timeout: float) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        if int(_rank_file(cfg, 1, run, attempt, "heartbeat/rank0").get("iteration") or 0) >= at_least:
            return
        time.sleep(1)
    pytest.fail(f"{attempt} never reached iteration {at_least}")


def _left_on_nodes(cfg: SimConfig, run_id: str) -> dict[str, str]:
    """Processes on each node whose environment carries the run's id or whose command line names it."""
    probe = (f"for p in /proc/[0-9]*; do tr '\\0' '\\n' < $p/environ 2>/dev/null | grep -q '^STEPDEPLOY_RUN_ID="
             f"{run_id}' && echo ${{p#/proc/}}; done; pgrep -af -- {run_id} | grep -v pgrep; true")
    return {f"node{i}": _on(cfg, i, probe).strip() for i in (1, 2)}


def _jobs(cfg: SimConfig) -> str:
    return _on(cfg, 1, "squeue -h -o '%i %j %T'").strip()


def _slurm_events(led: Ledger, run_id: str) -> list[dict]:
    return [e for e in led.events(run_id) if e["kind"] == "slurm"]


def test_warmup_and_soak_as_slurm_jobs_and_a_killed_rank_is_resubmitted(cluster: SimConfig, tmp_path: Path) -> None:
    run = tmp_path / "sl"
    ctl = _controller(["rollout", "run", "-i", str(cluster.inventory), "-m", "tiny-dense", "--stages",
                       "warmup,soak", "--soak-duration", "90s", *FAST, "--run-dir", str(run)], tmp_path)
    try:
        _wait_for_iteration(cluster, run, "soak-target", 3, 180)
        victim = _rank_file(cluster, 2, run, "soak-target", "status/rank1.json")
        assert victim.get("node") == "node2" and victim.get("pid"), victim
        _on(cluster, 2, f"kill -KILL {int(victim['pid'])}")
        output, _ = ctl.communicate(timeout=240)
    finally:
        if ctl.poll() is None:
            ctl.kill()
            ctl.wait()
    assert ctl.returncode == 0, output
    led = Ledger(run / "ledger.sqlite")
    assert {s.name: s.status for s in led.stages("sl")} == {"warmup": "passed", "soak": "passed"}
    soak = led.attempts("sl", "soak")
    assert [a["status"] for a in soak] == ["failed", "passed"], soak
    assert "node2 rank 1" in soak[0]["detail"]["why"], soak[0]
    launch = (run / "attempts" / "soak-target" / "nodes" / "1-node2" / "launch.sh").read_text()
    assert '-I "$run_dir/workload/launch_ranks.py"' in launch  # Slurm's tasks run stepdeploy's launcher

    events = _slurm_events(led, "sl")
    submitted = [e for e in events if "submitted" in e["message"]]
    ids = [e["data"]["job_id"] for e in submitted]
    assert [e["stage"] for e in submitted] == ["warmup", "soak", "soak"], [e["message"] for e in events]
    assert len(set(ids)) == 3, ids  # the resubmission is a new job
    assert "resubmission 1" in submitted[-1]["message"]
    ended = {e["data"]["job_id"]: e["data"]["state"] for e in events if e["data"].get("state")}
    assert ended.get(ids[0]) == "COMPLETED", events  # warmup's job ran to its end
    assert ended.get(ids[1]) in ("FAILED", "CANCELLED"), events  # the killed rank ended the soak's first job
    assert (run / "attempts" / "soak-target" / "slurm-jobs").read_text().split() == ids[1:]

    remote = _remote_dir(run, "soak-target")
    log = _on(cluster, 1, f"cat {remote}/logs/0-node1.log")
    assert "resumed from checkpoint" in log, log[-2000:]
    # Slurm's own output, on the batch host: srun names the first task that ended badly, which ended the step
    # (--kill-on-bad-exit). Which task that is, is a race Slurm decides: node2's launcher reporting its killed
    # worker, or node1's rank 0 failing on the lost peer first. Who was killed is judged above, from the ledger.
    slurm_err = _on(cluster, 1, f"cat {remote}/logs/slurm-{ids[1]}.err")
    assert re.search(r"srun: error: node[12]: task [01]: Exited with exit code [1-9]\d*", slurm_err), slurm_err
    assert _jobs(cluster) == ""
    assert _left_on_nodes(cluster, "sl-soak") == {"node1": "", "node2": ""}


def test_rollout_stop_cancels_the_job_and_leaves_nothing(cluster: SimConfig, tmp_path: Path) -> None:
    """With one task per GPU (here: per node, CPU nodes train one rank each): srun starts the ranks directly."""
    inventory = tmp_path / "per-gpu.ini"
    inventory.write_text(cluster.inventory.read_text() + "\n[all:vars]\nstepdeploy_slurm_tasks=gpu\n")
    run = tmp_path / "st"
    ctl = _controller(["rollout", "run", "-i", str(inventory), "-m", "tiny-dense", "--stages", "soak",
                       "--soak-duration", "10m", *FAST, "--run-dir", str(run)], tmp_path)
    try:
        _wait_for_iteration(cluster, run, "soak-target", 2, 150)
        assert "sd-soak-st-soak RUNNING" in _jobs(cluster)
        assert "exec /opt/stepdeploy/venv/bin/python" in (run / "attempts/soak-target/sbatch.sh").read_text()
        ranks = [_rank_file(cluster, i, run, "soak-target", f"status/rank{i - 1}.json") for i in (1, 2)]
        assert [(r.get("node"), r.get("state")) for r in ranks] == [("node1", "running"), ("node2", "running")]
        started = time.monotonic()
        stopped = _cli("rollout", "stop", str(run), cwd=tmp_path)
        took = time.monotonic() - started
        assert stopped.returncode == 0, stopped.stdout + stopped.stderr
        assert "nothing of it runs on any node" in stopped.stderr
        output, _ = ctl.communicate(timeout=120)
    finally:
        if ctl.poll() is None:
            os.kill(ctl.pid, signal.SIGKILL)
            ctl.wait()
    assert ctl.returncode == 1, output  # the controller records the stop: the soak did not complete
    assert took < 60, f"rollout stop took {took:.0f} s"
    assert _jobs(cluster) == ""
    assert _left_on_nodes(cluster, "st-soak") == {"node1": "", "node2": ""}
    led = Ledger(run / "ledger.sqlite")
    cancelled = [e for e in _slurm_events(led, "st") if e["message"].startswith("scancel")]
    assert cancelled and "no job of the run is left in Slurm" in cancelled[0]["message"], cancelled
    assert [a["status"] for a in led.attempts("st", "soak")] == ["stopped"]
