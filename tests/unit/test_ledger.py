"""The rollout ledger: real SQLite files, real processes (a controller killed with SIGKILL)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from stepdeploy.errors import StepdeployError
from stepdeploy.ledger import Ledger, LedgerLocked, controller_lock


def _ledger(tmp_path: Path) -> Ledger:
    ticks = iter(range(1000, 100000))
    return Ledger(tmp_path / "ledger.sqlite", clock=lambda: float(next(ticks)))


def test_stages_move_forward_and_resume_point(tmp_path: Path) -> None:
    led = _ledger(tmp_path)
    led.create_run("r1", {"model": "tiny-dense"}, ["warmup", "scale", "soak"])
    assert led.next_stage("r1").name == "warmup"
    led.set_stage("r1", "warmup", "running")
    led.set_stage("r1", "warmup", "passed")
    led.set_stage("r1", "scale", "running")
    led.set_stage("r1", "scale", "failed", reason="rung 2: throughput 0.41 of the previous rung < 0.7")
    assert led.next_stage("r1").name == "scale"  # a failed stage is where resume continues
    with pytest.raises(StepdeployError, match="never re-run"):
        led.set_stage("r1", "warmup", "running")
    stages = {s.name: s for s in led.stages("r1")}
    # clock ticks: create_run 1000 (+ its event 1001), running 1002 (+1003), passed 1004
    assert stages["warmup"].started == 1002 and stages["warmup"].finished == 1004
    assert stages["scale"].reason.startswith("rung 2")
    messages = [e["message"] for e in led.events("r1")]
    assert messages[-1] == "scale failed: rung 2: throughput 0.41 of the previous rung < 0.7"


def test_attempts_verdicts_metrics_roundtrip(tmp_path: Path) -> None:
    led = _ledger(tmp_path)
    led.create_run("r1", {}, ["warmup"])
    led.add_rungs("r1", "warmup", [("target", {"nodes": 2})])
    a1 = led.start_attempt("r1", "warmup", "target", {"pids": {"node1": 10}})
    led.finish_attempt(a1, "failed", {"exit": {"node1": -9}})
    a2 = led.start_attempt("r1", "warmup", "target", {"restored_from": "iter_0000020"})
    led.add_metrics("r1", a2, [(1.0, 0, 1, "loss", 5.5), (2.0, 0, 2, "loss", 5.1)])
    led.verdict("r1", "warmup", "target", "loss_finite", True, measured=5.1, threshold=None, reason="finite")
    attempts = led.attempts("r1")
    assert [(a["number"], a["status"]) for a in attempts] == [(1, "failed"), (2, "running")]
    assert attempts[0]["detail"] == {"pids": {"node1": 10}, "exit": {"node1": -9}}
    assert [m["value"] for m in led.metrics("r1", "loss")] == [5.5, 5.1]
    assert led.verdicts("r1")[0]["passed"] is True


_WRITER = textwrap.dedent("""
    import sys
    from pathlib import Path
    from stepdeploy.ledger import Ledger, controller_lock
    run_dir = Path(sys.argv[1])
    with controller_lock(run_dir):
        led = Ledger(run_dir / "ledger.sqlite")
        led.create_run("r1", {}, ["soak"])
        print("ready", flush=True)
        while True:
            a = led.start_attempt("r1", "soak", "target", {"n": 1})
            led.add_metrics("r1", a, [(1.0, r, i, "loss", 1.0) for r in range(4) for i in range(50)])
            led.finish_attempt(a, "passed")
""")


def test_kill_9_mid_write_leaves_a_consistent_ledger_and_frees_the_lock(tmp_path: Path) -> None:
    proc = subprocess.Popen([sys.executable, "-c", _WRITER, str(tmp_path)], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "ready"
    with pytest.raises(LedgerLocked, match=f"pid {proc.pid}"), controller_lock(tmp_path):
        pass  # a second controller is refused while the first lives
    time.sleep(0.5)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    led = Ledger(tmp_path / "ledger.sqlite")
    assert led.db.execute("PRAGMA integrity_check").fetchone()[0] == "ok"
    attempts = led.attempts("r1")
    assert len(attempts) > 1
    # each transaction is all or nothing: every finished attempt has its 200 metric rows and its event
    for a in attempts:
        rows = led.db.execute("SELECT COUNT(*) FROM metrics WHERE attempt_id = ?", (a["id"],)).fetchone()[0]
        assert rows in (0, 200) and (rows == 200 or a["status"] == "running")
    finished = [a for a in attempts if a["status"] == "passed"]
    ends = [e for e in led.events("r1") if e["message"].endswith("passed")]
    assert len(ends) == len(finished)
    with controller_lock(tmp_path):  # the dead controller's lock is gone
        pass
