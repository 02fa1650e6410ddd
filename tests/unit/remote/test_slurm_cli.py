"""The CLI side of the slurm executor: `--executor` checked before anything starts, the dry run names the
sbatch command, and `rollout stop` lets a running controller stop its own attempt first."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from pathlib import Path

from stepdeploy.cli.rollout import _let_the_controller_stop
from stepdeploy.ledger import Ledger, controller_lock

INVENTORY = "[g]\nnode1 ansible_host=10.90.0.11\nnode2 ansible_host=10.90.0.12\n[g:vars]\nstepdeploy_gpus_per_node=0\n"


def _cli(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "stepdeploy", *args], capture_output=True, text=True, cwd=cwd,
                          timeout=120)


def test_an_unknown_executor_is_one_line_exit_2(tmp_path: Path) -> None:
    (tmp_path / "inv.ini").write_text(INVENTORY)
    res = _cli("rollout", "run", "-i", "inv.ini", "-m", "tiny-dense", "--executor", "k8s", "--run-dir", "r",
               cwd=tmp_path)
    assert res.returncode == 2, res.stderr
    assert [line for line in res.stderr.splitlines() if line.startswith("error:")] == [
        "error: --executor 'k8s' is not an executor; use one of fabric, slurm, local"]
    assert not (tmp_path / "r").exists()


def test_the_dry_run_shows_the_sbatch_command_on_the_controller(tmp_path: Path) -> None:
    (tmp_path / "inv.ini").write_text(INVENTORY + "stepdeploy_slurm_controller=node2\n")
    res = _cli("rollout", "run", "-i", "inv.ini", "-m", "tiny-dense", "--executor", "slurm", "--stages", "warmup",
               "--dry-run", cwd=tmp_path)
    assert res.returncode == 0, res.stderr
    assert json.loads(res.stdout)["commands"].startswith("on node2: sbatch --parsable <run>/sbatch.sh")
    plain = _cli("rollout", "run", "-i", "inv.ini", "-m", "tiny-dense", "--stages", "warmup", "--dry-run",
                 cwd=tmp_path)
    assert "setsid nohup" in json.loads(plain.stdout)["commands"]


def _ledger_with_a_running_attempt(run_dir: Path) -> tuple[Ledger, int]:
    led = Ledger(run_dir / "ledger.sqlite")
    led.create_run("r", {}, ["soak"])
    return led, led.start_attempt("r", "soak", "target", {"local_run": str(run_dir / "attempts/soak-target")})


def test_without_a_controller_stop_does_not_wait(tmp_path: Path) -> None:
    led, attempt = _ledger_with_a_running_attempt(tmp_path)
    started = time.monotonic()
    _let_the_controller_stop(tmp_path, led, [attempt], wait_s=30)
    assert time.monotonic() - started < 1


def test_stop_waits_for_the_controller_to_record_its_attempt_stopped(tmp_path: Path) -> None:
    led, attempt = _ledger_with_a_running_attempt(tmp_path)
    released = threading.Event()

    def controller() -> None:  # holds the lock, records the stop 1.5 s later, then exits
        with controller_lock(tmp_path):
            time.sleep(1.5)
            Ledger(tmp_path / "ledger.sqlite").finish_attempt(attempt, "stopped", {"why": "stop requested"})
            released.wait(10)

    thread = threading.Thread(target=controller)
    thread.start()
    time.sleep(0.3)
    try:
        started = time.monotonic()
        _let_the_controller_stop(tmp_path, led, [attempt], wait_s=30)
        waited = time.monotonic() - started
    finally:
        released.set()
        thread.join()
    assert 1.0 < waited < 5, waited
    assert led.attempts("r")[0]["status"] == "stopped"


def test_stop_gives_up_waiting_after_its_limit(tmp_path: Path) -> None:
    led, attempt = _ledger_with_a_running_attempt(tmp_path)
    with controller_lock(tmp_path):
        started = time.monotonic()
        _let_the_controller_stop(tmp_path, led, [attempt], wait_s=2)
        assert 2 <= time.monotonic() - started < 5
