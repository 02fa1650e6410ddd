"""`sim up` is repeatable, `sim down` leaves nothing behind, and missing prerequisites give one clear error.

These use their own cluster (not the session fixture) because they tear it down. The checks of what is
left are made independently of the code under test: `ip`, /proc/self/mountinfo and /proc/*/root.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from stepdeploy.sim.cluster import SimConfig, down, status, up

from .conftest import require_sim

NAME = "sdtdown"


def _stepdeploy(*args: str, user: str | None = None, env: dict | None = None) -> subprocess.CompletedProcess:
    argv = [sys.executable, "-m", "stepdeploy", *args]
    if user is not None:
        argv = ["setpriv", f"--reuid={user}", f"--regid={user}", "--clear-groups", *argv]
    return subprocess.run(argv, capture_output=True, text=True, timeout=600, env=env)


def _traces(name: str, state_dir: Path) -> list[str]:
    """Everything on the host that carries the cluster's name or lives in its state directory."""
    found: list[str] = []
    netns = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    found += [line for line in netns.splitlines() if f"sd-{name}-" in line]
    links = subprocess.run(["ip", "-o", "link", "show"], capture_output=True, text=True).stdout
    found += [line.split(":")[1].strip() for line in links.splitlines() if f"sd-{name}" in line]
    mounts = Path("/proc/self/mountinfo").read_text().splitlines()
    found += [m.split()[4] for m in mounts if m.split()[4].startswith(str(state_dir))]
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit():
            try:
                root = os.readlink(proc / "root")
                cmdline = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode()
            except OSError:
                continue
            if root.startswith(str(state_dir)) or f"sd-{name}-" in cmdline or str(state_dir) in cmdline:
                found.append(f"pid {proc.name}: {cmdline[:80]}")
    return found


def test_up_is_repeatable_and_down_leaves_nothing(tmp_path: Path) -> None:
    require_sim()
    cfg = SimConfig(name=NAME, subnet="10.79.0.0/24", http_port=8081, state_dir=tmp_path / NAME)
    try:
        first = up(cfg, 2)
        pids = [n.pid for n in first.nodes]
        assert all(n["ssh"] for n in status(cfg)["nodes"])
        again = up(cfg, 2)  # idempotent: same processes, nothing restarted
        assert [n.pid for n in again.nodes] == pids
        grown = up(cfg, 3)  # grows: a third node, the first two untouched
        assert [n.pid for n in grown.nodes][:2] == pids and len(grown.nodes) == 3
        hosts = (Path(grown.nodes[0].root) / "etc/hosts").read_text()
        assert "node3" in hosts  # running nodes learn about the new one
        assert _traces(NAME, cfg.dir), "the cluster should be visible before teardown"
    finally:
        report = down(cfg)
    assert report.leftovers == []
    assert _traces(NAME, cfg.dir) == []
    assert status(cfg)["nodes"] == []
    assert down(cfg).leftovers == []  # a second down is a no-op, not an error


def test_down_after_a_crashed_up_cleans_what_was_recorded(tmp_path: Path) -> None:
    """Kill the node processes behind the state file's back (a crash): down still removes everything."""
    require_sim()
    cfg = SimConfig(name=NAME, subnet="10.79.0.0/24", http_port=8081, state_dir=tmp_path / NAME)
    sim = up(cfg, 1)
    subprocess.run(["kill", "-9", str(sim.nodes[0].pid)], check=True)
    report = down(cfg)
    assert report.leftovers == []
    assert _traces(NAME, cfg.dir) == []


def test_cli_status_json_and_shrinking_is_refused(tmp_path: Path) -> None:
    require_sim()
    env = {**os.environ, "STEPDEPLOY_SIM_DIR": str(tmp_path)}
    try:
        res = _stepdeploy("sim", "up", "--nodes", "2", "--name", NAME, "--subnet", "10.79.0.0/24",
                          "--json", env=env)
        assert res.returncode == 0, res.stderr
        data = json.loads(res.stdout)
        assert data["up"] and [n["address"] for n in data["nodes"]] == ["10.79.0.11", "10.79.0.12"]
        shrink = _stepdeploy("sim", "up", "--nodes", "1", "--name", NAME, "--subnet", "10.79.0.0/24",
                             env=env)
        assert shrink.returncode == 2
        assert "only adds nodes" in shrink.stderr and "Traceback" not in shrink.stderr
        ssh = _stepdeploy("sim", "ssh", "node2", "--name", NAME, "--", "hostname", env=env)
        assert ssh.returncode == 0 and ssh.stdout.strip() == "node2"
    finally:
        res = _stepdeploy("sim", "down", "--name", NAME, env=env)
    assert res.returncode == 0, res.stderr
    assert _traces(NAME, tmp_path / NAME) == []


def test_without_root_one_clear_error_and_exit_4(tmp_path: Path) -> None:
    if os.geteuid() != 0:
        pytest.skip("needs root to drop to another user")
    tmp_path.chmod(0o777)
    env = {"PATH": os.environ["PATH"], "STEPDEPLOY_SIM_DIR": str(tmp_path), "HOME": str(tmp_path),
           "PYTHONPATH": str(Path(__file__).parents[2])}
    res = _stepdeploy("sim", "up", "--nodes", "1", "--name", NAME, user="65534", env=env)
    assert res.returncode == 4, res.stderr
    lines = [line for line in res.stderr.splitlines() if line.startswith("error:")]
    assert len(lines) == 1 and "root" in lines[0]
    assert "Traceback" not in res.stderr
