"""The local executor on this machine, no SSH and no simulated cluster: the guarantees test_launch.py proves for
the fabric executor -- the torch engine trains (loss falls) and logs stream with node and rank prefixes, the run
outlives the controller that launched it, stop leaves no process, a killed rank is named while its peer exits
within the process-group timeout -- here for one node of two ranks; then `run` and `preflight` choosing it for an
inventory whose host is ansible_connection=local, and a whole rollout with `--executor local`."""

from __future__ import annotations

import json
import os
import shlex
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from stepdeploy.cli.run import executor_for_run_dir
from stepdeploy.ledger import Ledger
from stepdeploy.remote.executor import LogCursor
from stepdeploy.remote.local_executor import LocalExecutor
from stepdeploy.render import RenderOptions
from stepdeploy.render.build import build, write_run

from .test_launch import PG_TIMEOUT, no_run_processes, wait

WORKTREE = str(Path(__file__).resolve().parents[2])
INVENTORY = """[gpu]
box ansible_host=127.0.0.1 {connection}

[gpu:vars]
stepdeploy_gpus_per_node=0
stepdeploy_fabric=ethernet
"""


def inventory(tmp_path: Path, connection: str = "ansible_connection=local") -> Path:
    path = tmp_path / "inv.ini"
    path.write_text(INVENTORY.format(connection=connection))
    return path


def rendered(tmp_path: Path, run_id: str, iterations: int, **opts: object) -> Path:
    """A run of one node, two ranks, whose run directory on the node lives in a private directory of the test."""
    remote = tmp_path / "remote"
    remote.mkdir(mode=0o700, exist_ok=True)
    options = RenderOptions(run_id=run_id, iterations=iterations, seq_length=64, global_batch_size=8, lr=1e-2,
                            pg_timeout_s=PG_TIMEOUT, save_interval=10, nproc_per_node=2, remote_dir=str(remote),
                            **({"python": sys.executable} | opts))  # type: ignore[arg-type]
    out = tmp_path / run_id
    write_run(build(str(inventory(tmp_path)), "tiny-dense", "mbs=2", options), out)
    return out


def cli(*args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": WORKTREE}
    return subprocess.run([sys.executable, "-m", "stepdeploy", *args], capture_output=True, text=True,
                          timeout=timeout, env=env)


def test_train_loss_falls_logs_stream_fetch_and_stop(tmp_path: Path) -> None:
    run = rendered(tmp_path, "local-falls", iterations=24)
    with executor_for_run_dir(run, None) as executor:
        assert isinstance(executor, LocalExecutor)  # chosen for the ansible_connection=local inventory
        assert all(r.ok for r in executor.prepare(run)), "upload failed"
        assert all(r.ok for r in executor.prepare(run)), "a second upload of the same rendering must be a no-op"
        assert all(r.ok for r in executor.start())
        cursor, lines = LogCursor(), []
        status = wait(executor, lambda s: not s.running, 180, cursor, lines)
        executor.follow(lines.append, cursor)
        assert status.finished_ok, status.culprits()
        assert {r.rank for r in status.ranks} == {0, 1}
        assert any(line.startswith("box | [rank 0] iter 24/24") for line in lines), lines[-20:]
        assert any(line.startswith("box | [rank 1] exit 0") for line in lines), lines[-20:]
        # a diagnostics file (traces.py writes out/first-step-rank<R>-<it>.json, profile-rank<R>.json) comes back
        assert all(r.ok for r in executor.run_command("echo '{\"step_s\": 1.5}' > out/first-step-rank0-1.json"))
        assert all(r.ok for r in executor.fetch(tmp_path / "fetched"))
        assert json.loads((tmp_path / "fetched/nodes/0-box/out/first-step-rank0-1.json").read_text()) == {"step_s": 1.5}
        metrics = [json.loads(line) for line in (tmp_path / "fetched/nodes/0-box/out/metrics.jsonl").open()]
        losses = [m["loss"] for m in metrics]
        assert len(losses) == 24 and len(metrics[0]["rank_step_time_s"]) == 2
        assert sum(losses[-4:]) / 4 < sum(losses[:3]) / 3 - 0.3, losses
        latest = executor.run_command("cat out/checkpoints/latest && ls out/checkpoints")
        assert all(r.stdout.split()[0] == "24" and "iter_0000024" in r.stdout for r in latest)
        assert all(s.ok for s in executor.stop(grace_s=2))
        no_run_processes(executor)


def test_run_outlives_its_controller_and_stop_leaves_nothing(tmp_path: Path) -> None:
    run = rendered(tmp_path, "local-detach", iterations=100000)
    dry = cli("run", "launch", str(run), "--dry-run")
    assert dry.returncode == 0 and dry.stdout.startswith("box (this machine): upload"), dry.stdout + dry.stderr
    launched = cli("run", "launch", str(run))
    assert launched.returncode == 0, launched.stdout + launched.stderr
    # The launching controller is gone; a new one (a fresh shell) finds the run training.
    with executor_for_run_dir(run, None) as executor:
        status = wait(executor, lambda s: all((r.iteration or 0) >= 2 for r in s.ranks) and len(s.ranks) == 2, 120)
        assert status.running and all(n.state == "running" for n in status.nodes)
        listed = cli("run", "status", str(run), "--json")
        assert listed.returncode == 0 and json.loads(listed.stdout)["nodes"][0]["state"] == "running", listed.stderr
        started = time.monotonic()
        stopped = cli("run", "stop", str(run), "--grace", "10")
        assert stopped.returncode == 0, stopped.stdout + stopped.stderr
        assert "box: ok nothing of the run is left" in stopped.stdout
        assert time.monotonic() - started < 30
        no_run_processes(executor)
        after = executor.poll()
        assert not after.running
        assert {r.code for r in after.ranks} == {143}, after.ranks  # SIGTERM reached both ranks


def test_killed_rank_is_named_and_its_peer_exits_within_the_timeout(tmp_path: Path) -> None:
    run = rendered(tmp_path, "local-kill", iterations=100000)
    with executor_for_run_dir(run, None) as executor:
        assert all(r.ok for r in executor.prepare(run))
        assert all(r.ok for r in executor.start())
        status = wait(executor, lambda s: len(s.ranks) == 2 and all((r.iteration or 0) >= 2 for r in s.ranks), 120)
        victim = next(r for r in status.ranks if r.rank == 1)
        killed = time.monotonic()
        assert executor.run_command(f"kill -KILL {victim.pid}")[0].ok
        survivor = wait(executor, lambda s: next(r for r in s.ranks if r.rank == 0).state == "exited", PG_TIMEOUT + 15)
        elapsed = time.monotonic() - killed
        assert elapsed < PG_TIMEOUT + 10, f"the surviving rank took {elapsed:.1f} s"
        causes = survivor.culprits()
        assert causes[0].startswith("node box rank 1: died without exiting"), causes
        stops = executor.stop(grace_s=5)
        assert all(s.ok for s in stops), stops
        no_run_processes(executor)


def test_follow_exits_with_the_runs_outcome(tmp_path: Path) -> None:
    """`run launch --follow` (and `run logs --follow`) end as `run status` would: a run whose ranks never start (the
    node's Python is /bin/false) fails, so `run launch --follow && next` does not go on (it exited 0 before)."""
    run = rendered(tmp_path, "local-false", iterations=3, python="/bin/false")
    launched = cli("run", "launch", str(run), "--follow")
    assert launched.returncode == 1, launched.stdout + launched.stderr
    assert "box: exited (exit 1)" in launched.stdout, launched.stdout
    followed = cli("run", "logs", str(run), "--follow")
    assert followed.returncode == 1, followed.stdout + followed.stderr
    assert cli("run", "status", str(run)).returncode == 1


def test_executor_local_runs_here_an_inventory_host_reached_over_ssh_otherwise(tmp_path: Path) -> None:
    """`--executor local` drives a run whose inventory host is an SSH address nobody answers at; the run's
    processes do not see the controller's PYTHONPATH (the environment an SSH login would give them)."""
    run = rendered(tmp_path, "local-flag", iterations=100000)
    inventory(tmp_path, connection="ansible_port=1")  # the same host, now reached over SSH (nobody listens)
    assert cli("run", "status", str(run), "--executor", "local").returncode == 1  # not started: a failed run
    launched = cli("run", "launch", str(run), "--executor", "local")
    assert launched.returncode == 0, launched.stdout + launched.stderr
    with executor_for_run_dir(run, None, executor="local") as executor:
        wait(executor, lambda s: len(s.ranks) == 2 and all((r.iteration or 0) >= 1 for r in s.ranks), 120)
        [environ] = executor.run_command("cat /proc/$(cat nodes/0-box/launch.pid)/environ | tr '\\0' '\\n'")
        assert "STEPDEPLOY_RUN_ID=local-flag" in environ.stdout and "PYTHONPATH=" not in environ.stdout
        assert cli("run", "stop", str(run), "--executor", "local").returncode == 0
        no_run_processes(executor)


def test_preflight_checks_an_ansible_connection_local_host_without_ssh(tmp_path: Path) -> None:
    res = cli("preflight", str(inventory(tmp_path)), "--no-bandwidth", "--json", "--python", sys.executable)
    report = json.loads(res.stdout)
    assert res.returncode in (0, 1), res.stderr
    assert report["unreachable"] == {}, report["unreachable"]
    assert any(r["check"] == "python" and r["node"] == "box" and r["status"] == "ok" for r in report["results"]), \
        report["results"]


def test_a_rollout_with_the_local_executor(tmp_path: Path) -> None:
    """`rollout run --executor local` end to end; the runs' directory and the nodes' venv are the test's own
    (a private mount namespace), so nothing lands in this machine's /var/lib/stepdeploy or /opt."""
    if os.geteuid() != 0 or shutil.which("unshare") is None:
        pytest.fail("needs root and unshare (a private mount namespace)")
    varlib, opt = tmp_path / "varlib", tmp_path / "opt"
    runs = varlib / "runs"
    runs.mkdir(mode=0o700, parents=True)
    opt.mkdir()
    (opt / "venv").symlink_to(sys.prefix)
    inv = inventory(tmp_path, connection="")  # reached over SSH as far as the inventory says: --executor decides
    rollout = tmp_path / "r1"
    command = (f"mkdir -p /var/lib/stepdeploy /opt/stepdeploy && mount --bind {shlex.quote(str(varlib))} "
               f"/var/lib/stepdeploy && mount --bind {shlex.quote(str(opt))} /opt/stepdeploy && "
               f"exec {shlex.quote(sys.executable)} -m stepdeploy rollout run -i {shlex.quote(str(inv))} "
               f"-m tiny-dense --stages warmup --warmup-iterations 4 --executor local --pg-timeout 30 "
               f"--run-dir {shlex.quote(str(rollout))}")
    res = subprocess.run(["unshare", "-m", "sh", "-c", command], capture_output=True, text=True, timeout=300,
                         env={**os.environ, "PYTHONPATH": WORKTREE})
    assert res.returncode == 0, res.stdout + res.stderr[-3000:]
    ledger = Ledger(rollout / "ledger.sqlite", create=False)
    [run_id] = ledger.run_ids()
    assert ledger.run(run_id)["status"] == "passed"
    [attempt] = ledger.attempts(run_id)
    assert attempt["status"] == "passed" and attempt["detail"]["iterations"] == 4
    manifest = json.loads((Path(attempt["detail"]["local_run"]) / "manifest.json").read_text())
    assert manifest["executor"] == "local"
    uploaded = sorted(p.name for p in runs.iterdir() if not p.name.startswith("."))  # .compile-cache aside
    assert uploaded == [f"{run_id}-warmup-{attempt['rung']}-a1"]
    stray = subprocess.run(f"grep -l STEPDEPLOY_RUN_ID={run_id} /proc/[0-9]*/environ 2>/dev/null | grep -v self",
                           shell=True, capture_output=True, text=True)
    assert stray.stdout.strip() == "", stray.stdout
