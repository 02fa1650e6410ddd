"""Issue 21's controller findings on the simulated cluster, through the CLI as a user runs it (torch engine,
gloo): a `rollout stop` during the soak's restart ends the stage `stopped` (not failed), launches nothing
more and leaves nothing on the nodes; a start that a node refuses leaves its attempt `failed`, never `running`."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from stepdeploy.ledger import Ledger
from stepdeploy.remote.ssh import Endpoint, connection
from stepdeploy.sim.cluster import SimConfig

from .conftest import private_cluster, processes_of, stepdeploy_cli

FAST = ["-m", "tiny-dense", "--stages", "soak", "--seq", "64", "--gbs", "4", "--checkpoint-interval", "3",
        "--pg-timeout", "30"]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SimConfig]:
    with private_cluster(tmp_path_factory, "sdstop", "10.121.0.0/24", 8121) as cfg:
        yield cfg


def _events(run: Path, run_id: str) -> list[dict]:
    ledger = run / "ledger.sqlite"
    if not ledger.exists():
        return []
    try:
        return Ledger(ledger, create=False).events(run_id)
    except Exception:  # being created by the controller: try again
        return []


def test_a_stop_during_the_soaks_restart_ends_it_stopped(cluster: SimConfig, tmp_path: Path) -> None:
    run = tmp_path / "stopr"
    controller = subprocess.Popen(
        [sys.executable, "-m", "stepdeploy", "rollout", "run", "-i", str(cluster.inventory), *FAST,
         "--soak-duration", "5m", "--inject", "kill:rank=last@30s", "--run-dir", str(run)],
        cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.time() + 300
        while time.time() < deadline:  # the kill is detected: the soak is about to stop, diagnose and restart
            if any(e["kind"] == "detected" for e in _events(run, "stopr")):
                break
            if controller.poll() is not None:
                pytest.fail(f"the controller ended before the failure: {controller.communicate()}")
            time.sleep(0.05)
        else:
            pytest.fail("the injected kill was never detected")
        (run / "STOP").write_text("stop requested\n")  # what `rollout stop` writes first, in the restart's window
        stopped = stepdeploy_cli("rollout", "stop", str(run), cwd=tmp_path, timeout=300)
        output, errors = controller.communicate(timeout=180)
    finally:
        if controller.poll() is None:
            os.kill(controller.pid, signal.SIGKILL)
            controller.wait()
    assert stopped.returncode == 0, stopped.stdout + stopped.stderr
    assert "nothing of it runs on any node" in stopped.stderr
    assert controller.returncode == 1, output + errors  # the soak did not complete (as any stop: docs/rollout.md)
    assert "stopped: soak: stopped on request before its restart" in errors, errors
    assert "error:" not in errors and "hint:" not in errors, errors  # a stop is not a failure to fix
    led = Ledger(run / "ledger.sqlite")
    assert [s.status for s in led.stages("stopr")] == ["stopped"]
    assert led.run("stopr")["status"] == "stopped"
    assert [a["status"] for a in led.attempts("stopr", "soak")] == ["failed"]  # nothing launched after the stop
    messages = [e["message"] for e in led.events("stopr")]
    assert "run failed" not in messages and not [m for m in messages if m.startswith("soak failed")], messages
    assert not [e for e in led.events("stopr") if e["kind"] == "restart"]
    assert processes_of(cluster, "stopr-soak") == {"node1": "", "node2": ""}


def test_a_start_a_node_refuses_leaves_its_attempt_failed(cluster: SimConfig, tmp_path: Path) -> None:
    run = tmp_path / "refused"
    taken = "/var/lib/stepdeploy/runs/refused-soak"  # another rendering already holds node2's run directory
    ep = Endpoint(host=cluster.address(2), key_file=cluster.client_key, known_hosts=cluster.known_hosts)
    with connection(ep) as conn:
        conn.run(f"mkdir -p {taken} && echo '{{}}' > {taken}/manifest.json", hide=True)
    try:
        res = stepdeploy_cli("rollout", "run", "-i", str(cluster.inventory), *FAST, "--soak-duration", "60s",
                             "--run-dir", str(run), cwd=tmp_path, timeout=600)
    finally:
        with connection(ep) as conn:
            conn.run(f"rm -rf -- {taken}", hide=True)
    assert res.returncode == 1, res.stdout + res.stderr
    assert "error: soak/target: node2: " in res.stderr and "already holds another rendering" in res.stderr
    led = Ledger(run / "ledger.sqlite")
    attempts = led.attempts("refused", "soak")
    assert [a["status"] for a in attempts] == ["failed"], attempts
    assert "already holds another rendering" in attempts[0]["detail"]["why"]
    assert [s.status for s in led.stages("refused")] == ["failed"] and led.run("refused")["status"] == "failed"
    assert processes_of(cluster, "refused-soak") == {"node1": "", "node2": ""}
