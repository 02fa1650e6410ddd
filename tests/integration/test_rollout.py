"""The staged rollout on the simulated cluster, driven through the CLI as a user would (torch engine, gloo):
a gate that fails and a resume that continues from that stage, a full rollout and its report, and a
controller killed with SIGKILL in the middle of the soak that `rollout resume` picks up."""

from __future__ import annotations

import json
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

# The simulated nodes share this machine's 2 cores, so two ranks cannot scale like two GPUs would: the
# scaling-efficiency gate is set for that environment here (its default, 0.7, is for real hardware).
FAST = ["--seq", "64", "--gbs", "4", "--warmup-iterations", "4", "--scale-iterations", "8",
        "--checkpoint-interval", "3", "--min-scaling-efficiency", "0.1", "--pg-timeout", "30"]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SimConfig]:
    with private_cluster(tmp_path_factory, "sdroll", "10.84.0.0/24", 8086) as cfg:
        yield cfg


def _cli(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return stepdeploy_cli(*args, cwd=cwd, timeout=900)


def test_failing_gate_stops_then_resume_completes_and_report_renders(cluster: SimConfig, tmp_path: Path) -> None:
    run = tmp_path / "gated"
    first = _cli("rollout", "run", "-i", str(cluster.inventory), "-m", "tiny-moe", "--stages", "warmup,scale,soak",
                 "--soak-duration", "20s", "--max-step-time", "0.001", *FAST, "--run-dir", str(run), cwd=tmp_path)
    assert first.returncode == 1, first.stdout + first.stderr
    assert "gate step_time failed" in first.stderr
    led = Ledger(run / "ledger.sqlite")
    stages = {s.name: s.status for s in led.stages("gated")}
    assert stages == {"warmup": "passed", "scale": "failed", "soak": "pending"}

    again = _cli("rollout", "resume", str(run), "--max-step-time", "120", cwd=tmp_path)
    assert again.returncode == 0, again.stdout + again.stderr
    stages = {s.name: s.status for s in led.stages("gated")}
    assert stages == {"warmup": "passed", "scale": "passed", "soak": "passed"}
    attempts = led.attempts("gated")
    assert [a["rung"] for a in attempts if a["stage"] == "warmup"] == ["target"]  # not re-run
    first_rung = [a["status"] for a in attempts if a["rung"] == "proxy-1-gpu"]
    assert first_rung == ["failed", "passed"]
    assert any(e["kind"] == "config" and "max_step_time_s" in e["message"] for e in led.events("gated"))
    # an MoE target: MoE proxies on the ladder, and the soak's expert load judged
    assert {a["rung"] for a in attempts if a["stage"] == "scale"} == {"proxy-1-gpu", "proxy-all-nodes"}
    soak_gates = {v["gate"]: v["passed"] for v in led.verdicts("gated") if v["stage"] == "soak"}
    assert soak_gates.get("expert_load") is True and soak_gates.get("tokens_dropped") is True, soak_gates
    assert [m["name"] for m in led.metrics("gated", "moe_load_max")], "no expert load in the ledger"
    assert processes_of(cluster, "gated") == {"node1": "", "node2": ""}

    report = _cli("report", str(run), "--html", str(run / "report.html"), cwd=tmp_path)
    assert report.returncode == 0, report.stderr
    html = (run / "report.html").read_text()
    assert "step_time" in html and "soak" in html
    pngs = sorted(p.name for p in run.glob("report-*.png"))
    assert {"report-loss.png", "report-timeline.png", "report-tokens.png"} <= set(pngs)
    # the training metrics the workload records (an MoE model: its expert load) and the soak's goodput
    assert {"report-lr.png", "report-grad_norm.png", "report-moe_load.png", "report-goodput.png"} <= set(pngs)
    assert all((run / p).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" for p in pngs)
    assert "<h2>Goodput</h2>" in html and "effective training time" in html
    # the soak's schedule counts its iterations after the start-up the warm-up measured (launch to its first step)
    (schedule,) = [e["data"] for e in led.events("gated") if e["kind"] == "schedule"]
    assert 0 < schedule["startup_s"] <= 10.0, schedule  # at most half the 20 s soak
    assert schedule["expected_iterations"] == max(2, int((20.0 - schedule["startup_s"]) / schedule["step_s"]))
    (goodput,) = [e["data"] for e in led.events("gated") if e["kind"] == "goodput"]
    assert 0 < goodput["ratio"] < 1 and goodput["failures"] == [] and len(goodput["starts"]) == 1, goodput


def test_controller_killed_mid_soak_is_resumed_without_orphans(cluster: SimConfig, tmp_path: Path) -> None:
    run = tmp_path / "killed"
    controller = subprocess.Popen(
        [sys.executable, "-m", "stepdeploy", "rollout", "run", "-i", str(cluster.inventory), "-m", "tiny-dense",
         "--stages", "soak", "--soak-duration", "45s", *FAST, "--run-dir", str(run)],
        cwd=tmp_path, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.time() + 240
        while time.time() < deadline:  # wait until the soak is really training
            if _soak_iteration(cluster, run) >= 4:
                break
            time.sleep(1)
        else:
            pytest.fail("the soak never got going")
    finally:
        os.kill(controller.pid, signal.SIGKILL)
        controller.wait()
    assert processes_of(cluster, "killed-soak")["node1"], "the job must outlive its controller"

    resumed = _cli("rollout", "resume", str(run), cwd=tmp_path)
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    led = Ledger(run / "ledger.sqlite")
    assert [s.status for s in led.stages("killed")] == ["passed"]
    soak = led.attempts("killed", "soak")
    assert len(soak) == 1 and soak[0]["status"] == "passed", soak  # one continuous attempt, re-attached
    assert any("re-attached" in e["message"] for e in led.events("killed"))
    (goodput,) = [e["data"] for e in led.events("killed") if e["kind"] == "goodput"]  # the whole soak's, once
    assert goodput["started"] == led.stages("killed")[0].started and len(goodput["starts"]) == 1, goodput
    assert goodput["iterations"] == soak[0]["detail"]["iterations"] and goodput["redone"] == 0, goodput
    assert processes_of(cluster, "killed-soak") == {"node1": "", "node2": ""}


def _soak_iteration(cfg: SimConfig, run: Path) -> int:
    """Rank 0's last heartbeat iteration of the soak, read on node1 (0 before the soak trains)."""
    manifest = run / "attempts/soak-target/manifest.json"
    if not manifest.exists():
        return 0
    remote = json.loads(manifest.read_text())["run_dir"]
    ep = Endpoint(host=cfg.address(1), key_file=cfg.client_key, known_hosts=cfg.known_hosts)
    with connection(ep) as conn:
        res = conn.run(f"cat {remote}/out/heartbeat/rank0 2>/dev/null || true", hide=True)
    try:
        return int(json.loads(res.stdout)["iteration"])
    except (ValueError, KeyError):
        return 0
