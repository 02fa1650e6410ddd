"""The soak's monitors, failure detection and recovery on the simulated cluster (torch engine, gloo), driven
through the CLI: a worker killed with SIGKILL by `--inject` is detected within 10 s, classified as a crash,
every process of the run is stopped (none left), the run restarts from its last checkpoint and the soak
completes; a soak without faults raises no failure finding."""

from __future__ import annotations

import json
import re
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from stepdeploy.ledger import Ledger
from stepdeploy.sim.cluster import SimConfig

from .conftest import private_cluster, processes_of, stepdeploy_cli

FAST = ["-m", "tiny-dense", "--stages", "soak", "--seq", "64", "--gbs", "4", "--checkpoint-interval", "3",
        "--pg-timeout", "30"]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SimConfig]:
    with private_cluster(tmp_path_factory, "sdfault", "10.87.0.0/24", 8088) as cfg:
        yield cfg


def _cli(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return stepdeploy_cli(*args, cwd=cwd, timeout=600)


def _resumed_from(run: Path) -> list[int]:
    logs = sorted((run / "attempts/soak-target/fetched").glob("**/logs/*.log"))
    text = "\n".join(p.read_text(errors="replace") for p in logs)
    return [int(m) for m in re.findall(r"resumed from checkpoint (\d+)", text)]


def test_injected_kill_is_detected_classified_stopped_and_restarted(cluster: SimConfig, tmp_path: Path) -> None:
    run = tmp_path / "killed"
    res = _cli("rollout", "run", "-i", str(cluster.inventory), *FAST, "--soak-duration", "90s",
               "--inject", "kill:rank=last@40s", "--run-dir", str(run), cwd=tmp_path)
    assert res.returncode == 0, res.stdout + res.stderr
    led = Ledger(run / "ledger.sqlite")
    events = led.events("killed")
    fired = [e for e in events if e["kind"] == "inject" and "spec" in e["data"]]
    assert len(fired) == 1 and fired[0]["data"]["rank"] == 1, fired
    detected = [e for e in events if e["kind"] == "detected"]
    assert len(detected) == 1, detected
    assert detected[0]["data"]["kind"] == "crash" and detected[0]["data"]["rank"] == 1, detected
    latency = detected[0]["data"]["time"] - fired[0]["data"]["time"]
    assert 0 < latency <= 10, f"crash detected after {latency:.1f} s"
    stops = [e for e in events if e["kind"] == "stop"]
    assert stops and all(e["data"]["ok"] and not e["data"]["left"] for e in stops), stops
    assert any(e["kind"] == "diagnosis" for e in events)
    assert any(e["kind"] == "restart" for e in events)
    soak = led.attempts("killed", "soak")
    assert [a["status"] for a in soak] == ["failed", "passed"], soak
    failed_at = soak[0]["detail"]["failed_at_iteration"]
    assert soak[0]["detail"]["kind"] == "crash" and failed_at and failed_at > 3, soak[0]["detail"]
    resumed = _resumed_from(run)
    assert resumed and failed_at - resumed[-1] <= 3, (resumed, failed_at)  # lost <= one checkpoint interval
    assert soak[1]["detail"]["iterations"] > failed_at, soak[1]["detail"]  # it trained on after the restart
    assert [s.status for s in led.stages("killed")] == ["passed"]
    _check_goodput(events, failures=1)
    goodput = next(e["data"] for e in events if e["kind"] == "goodput")
    assert 0 <= goodput["redone"] <= 3 and goodput["failures"][0]["kind"] == "crash", goodput  # <= one interval
    assert goodput["failures"][0]["parts"]["detection"] <= 10 and goodput["failures"][0]["restarted_at"]
    assert [s["resumed_from"] for s in goodput["starts"]] == [0, resumed[-1]], goodput["starts"]
    assert processes_of(cluster, "killed-soak") == {"node1": "", "node2": ""}
    prom = (run / "monitor" / "stepdeploy.prom").read_text()
    assert "stepdeploy_heartbeat_age_seconds" in prom and "stepdeploy_netdev_up" in prom


def _check_goodput(events: list[dict], failures: int) -> None:
    """One goodput event; its parts and its overrun make up the soak's wall; time trained and saves seen."""
    (goodput,) = [e["data"] for e in events if e["kind"] == "goodput"]
    assert 0 < goodput["ratio"] < 1 and goodput["saves"] > 0 and len(goodput["failures"]) == failures, goodput
    assert len(goodput["starts"]) == failures + 1 and all(s["first_step"] for s in goodput["starts"]), goodput
    assert sum(goodput["parts"].values()) - goodput["overrun_s"] == pytest.approx(goodput["wall_s"]), goodput


def test_soak_without_faults_raises_no_alarm(cluster: SimConfig, tmp_path: Path) -> None:
    """Also: `--checkpoint-interval auto` resolves an interval (an event), renders with it and saves."""
    run = tmp_path / "quiet"
    auto = [*FAST[:FAST.index("--checkpoint-interval")], *FAST[FAST.index("--checkpoint-interval") + 2:],
            "--checkpoint-interval", "auto", "--mtbf", "30s"]
    res = _cli("rollout", "run", "-i", str(cluster.inventory), *auto, "--soak-duration", "35s",
               "--run-dir", str(run), cwd=tmp_path)
    assert res.returncode == 0, res.stdout + res.stderr
    led = Ledger(run / "ledger.sqlite")
    events = led.events("quiet")
    assert not [e for e in events if e["kind"] in ("detected", "failure", "restart")], events
    alarms = [e for e in events if e["kind"] == "monitor" and e["data"].get("severity") == "fail"]
    assert alarms == []
    (interval,) = [e["data"] for e in events if e["kind"] == "checkpoint"]
    assert interval["mtbf_s"] == 30.0 and interval["save_source"].startswith("estimated: ") and interval["iterations"]
    workload = json.loads((run / "attempts/soak-target/workload.json").read_text())
    assert workload["training"]["save_interval"] == interval["iterations"]
    _check_goodput(events, failures=0)
    assert [a["status"] for a in led.attempts("quiet", "soak")] == ["passed"]
    # it trained: a schedule sized from the soak's length, the loss fell after the warm-up, gradient norms in range
    schedule = next(e["data"] for e in events if e["kind"] == "schedule")
    assert 1 <= schedule["warmup_iterations"] < schedule["decay_iterations"]
    verdicts = {v["gate"]: v for v in led.verdicts("quiet") if v["stage"] == "soak"}
    assert verdicts["loss_trend"]["passed"] and verdicts["grad_norm"]["passed"], verdicts
    assert verdicts["loss_spikes"]["passed"] and "expert_load" not in verdicts  # a dense model
    lrs = [m["value"] for m in led.metrics("quiet", "lr")]
    # the model's peak rate, decayed by the cosine towards a tenth of it: not a constant near-zero rate
    assert max(lrs) == 3e-3 and 3e-4 - 1e-12 <= min(lrs) < max(lrs) / 5, lrs
    rounds = (run / "monitor" / "stepdeploy.prom").read_text()
    assert 'stepdeploy_train_iteration{Hostname="node1"}' in rounds
    assert processes_of(cluster, "quiet-soak") == {"node1": "", "node2": ""}
