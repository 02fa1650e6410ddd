"""Render -> launch -> follow -> stop on this module's own 2-node simulated cluster, over real SSH: the torch
engine trains across the two nodes (loss falls), logs stream with node and rank prefixes, the run outlives
the controller that launched it, stop leaves no process, and a killed rank is named by the controller
while its peer exits within the process-group timeout."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from stepdeploy.cli.run import executor_for_run_dir
from stepdeploy.remote.executor import LogCursor, RunStatus
from stepdeploy.remote.fabric_executor import FabricExecutor
from stepdeploy.render import RenderOptions
from stepdeploy.render.build import build, write_run
from stepdeploy.sim.cluster import SimConfig

from .conftest import private_cluster, swapped_host_key_inventory

PG_TIMEOUT = 15


@pytest.fixture(scope="module")
def sdrun(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SimConfig]:
    with private_cluster(tmp_path_factory, "sdrun", "10.83.0.0/24", 8085) as cfg:
        yield cfg


def rendered(cfg: SimConfig, tmp_path: Path, run_id: str, iterations: int, model: str = "tiny-dense") -> Path:
    opts = RenderOptions(run_id=run_id, iterations=iterations, seq_length=64, global_batch_size=8, lr=1e-2,
                         pg_timeout_s=PG_TIMEOUT, save_interval=10)
    out = tmp_path / run_id
    write_run(build(str(cfg.inventory), model, "mbs=2", opts), out)
    return out


def wait(executor: FabricExecutor, until, timeout: float, cursor: LogCursor | None = None,
         lines: list[str] | None = None) -> RunStatus:
    deadline = time.monotonic() + timeout
    while True:
        status = executor.poll()
        if cursor is not None and lines is not None:
            executor.follow(lines.append, cursor)
        if until(status):
            return status
        assert time.monotonic() < deadline, f"timed out; last status {status}"
        time.sleep(0.5)


def no_run_processes(executor: FabricExecutor) -> None:
    """Independent of the stop probe: nothing on any node runs the workload or the launcher of this run."""
    for result in executor.run_command(f"grep -l STEPDEPLOY_RUN_ID={executor.run_id} /proc/[0-9]*/environ "
                                       "2>/dev/null | grep -v self || true"):
        assert result.ok and result.stdout.strip() == "", f"{result.node}: {result.stdout}"


def test_train_across_two_nodes_loss_falls_and_logs_stream(sdrun: SimConfig, tmp_path: Path) -> None:
    run = rendered(sdrun, tmp_path, "falls-1", iterations=24)
    with executor_for_run_dir(run, None) as executor:
        assert all(r.ok for r in executor.prepare(run)), "upload failed"
        assert all(r.ok for r in executor.prepare(run)), "a second upload of the same rendering must be a no-op"
        assert all(r.ok for r in executor.start())
        cursor, lines = LogCursor(), []
        status = wait(executor, lambda s: not s.running, 180, cursor, lines)
        executor.follow(lines.append, cursor)
        assert status.finished_ok, status.culprits()
        assert {r.rank for r in status.ranks} == {0, 1}
        assert any(line.startswith("node1 | [rank 0] iter 24/24") for line in lines), lines[-20:]
        assert any(line.startswith("node2 | [rank 1] exit 0") for line in lines), lines[-20:]
        fetched = executor.fetch(tmp_path / "fetched")
        assert all(r.ok for r in fetched)
        metrics = [json.loads(line) for line in (tmp_path / "fetched/nodes/0-node1/out/metrics.jsonl").open()]
        losses = [m["loss"] for m in metrics]
        assert len(losses) == 24 and len(metrics[0]["rank_step_time_s"]) == 2
        assert sum(losses[-4:]) / 4 < sum(losses[:3]) / 3 - 0.3, losses
        latest = executor.run_command("cat out/checkpoints/latest && ls out/checkpoints")
        assert all(r.stdout.split()[0] == "24" and "iter_0000024" in r.stdout for r in latest)
        assert all(s.ok for s in executor.stop(grace_s=2))
        no_run_processes(executor)


def test_run_outlives_its_controller_and_stop_leaves_nothing(sdrun: SimConfig, tmp_path: Path) -> None:
    run = rendered(sdrun, tmp_path, "detach-1", iterations=100000)
    launched = subprocess.run([sys.executable, "-m", "stepdeploy", "run", "launch", str(run)],
                              capture_output=True, text=True, timeout=120)
    if launched.returncode == 2 and "No such command 'run'" in launched.stderr:
        launched = subprocess.run([sys.executable, "-c", "import sys; from stepdeploy.cli.run import app; "
                                   "app(['launch', sys.argv[1]])", str(run)], capture_output=True, text=True,
                                  timeout=120)
    assert launched.returncode == 0, launched.stdout + launched.stderr
    # The launching controller is gone (its SSH sessions with it); a new one finds the run training.
    with executor_for_run_dir(run, None) as executor:
        status = wait(executor, lambda s: all((r.iteration or 0) >= 2 for r in s.ranks) and len(s.ranks) == 2, 120)
        assert status.running and all(n.state == "running" for n in status.nodes)
        started = time.monotonic()
        stops = executor.stop(grace_s=10)
        assert all(s.ok and s.left == () for s in stops), stops
        assert all(s.signalled for s in stops)
        assert time.monotonic() - started < 30
        no_run_processes(executor)
        after = executor.poll()
        assert not after.running
        assert {r.code for r in after.ranks} == {143}, after.ranks  # SIGTERM reached both ranks


def test_killed_rank_is_named_and_its_peer_exits_within_the_timeout(sdrun: SimConfig, tmp_path: Path) -> None:
    run = rendered(sdrun, tmp_path, "kill-1", iterations=100000)
    with executor_for_run_dir(run, None) as executor:
        assert all(r.ok for r in executor.prepare(run))
        assert all(r.ok for r in executor.start())
        status = wait(executor, lambda s: len(s.ranks) == 2 and all((r.iteration or 0) >= 2 for r in s.ranks), 120)
        victim = next(r for r in status.ranks if r.rank == 1)
        assert victim.node == "node2"
        killed = time.monotonic()
        target = next(t for t in executor.targets if t.name == "node2")
        res = target.channel.run(f"kill -KILL {victim.pid}")
        assert res.ok, res.stderr
        survivor = wait(executor, lambda s: next(r for r in s.ranks if r.rank == 0).state == "exited", PG_TIMEOUT + 15)
        elapsed = time.monotonic() - killed
        assert elapsed < PG_TIMEOUT + 10, f"the surviving rank took {elapsed:.1f} s"
        rank0 = next(r for r in survivor.ranks if r.rank == 0)
        assert rank0.code == 3 and "collective failed" in rank0.reason, rank0
        causes = survivor.culprits()
        assert causes[0].startswith("node node2 rank 1: died without exiting"), causes
        stops = executor.stop(grace_s=5)  # node2's launcher stops its ranks at once; the stop proves nothing is left
        assert all(s.ok for s in stops), stops
        no_run_processes(executor)


def test_a_changed_host_key_on_one_node_leaves_every_node_unwritten(sdrun: SimConfig, tmp_path: Path) -> None:
    """Issue 36: node2's key in known_hosts is node1's (as after a node was replaced or an address taken over). The
    upload used to write node1 as root before node2 was refused; every node must be reached first."""
    run = rendered(sdrun, tmp_path, "hostkey-1", iterations=10)
    inventory = swapped_host_key_inventory(sdrun, tmp_path)
    with executor_for_run_dir(run, str(inventory)) as executor:
        results = {r.node: r for r in executor.prepare(run)}
    assert not any(r.ok for r in results.values()), results
    assert "nothing written" in results["node1"].detail and "node2" in results["node1"].detail
    # the real known_hosts: look on node1 for anything of the upload
    with executor_for_run_dir(run, None) as honest:
        found = honest.targets[0].channel.run(f"ls -d {honest.run_dir}* 2>/dev/null | wc -l")
    assert found.rc == 0 and found.stdout.strip() == "0", found.stdout
