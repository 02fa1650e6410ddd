"""workload/launch_ranks.py, the launcher of a node's ranks, run for real: worker processes, signals, exit codes,
and a real torch.distributed process group over the environment it gives (rank 0 hosts the TCPStore)."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

import stepdeploy.workload
from stepdeploy.monitor.diagnose import SIGNATURES
from stepdeploy.workload import launch_ranks

LAUNCHER = Path(stepdeploy.workload.__file__).parent / "launch_ranks.py"

WORKER = """
import json, os, signal, sys, time
rank = int(os.environ["RANK"])
out = sys.argv[1]
keys = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE", "MASTER_ADDR",
        "MASTER_PORT", "OMP_NUM_THREADS", "CARRIED")
with open(f"{out}/rank{rank}.json", "w") as handle:
    json.dump({"env": {k: os.environ.get(k) for k in keys}, "pid": os.getpid(), "sid": os.getsid(0)}, handle)
mode = sys.argv[2]
if mode == "ignore-term":
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
if mode == "fail" and rank == int(sys.argv[3]):
    time.sleep(0.3)
    sys.exit(7)
if mode == "kill" and rank == int(sys.argv[3]):
    time.sleep(0.3)
    os.kill(os.getpid(), signal.SIGKILL)
if mode == "ok":
    sys.exit(0)
time.sleep(120)
"""


def _launch(tmp_path: Path, *worker_args: str, nnodes: int = 1, nproc: int = 2, node_rank: int = 0,
            port: int = 29999) -> subprocess.Popen[str]:
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    cmd = [sys.executable, "-I", str(LAUNCHER), f"--nnodes={nnodes}", f"--nproc-per-node={nproc}",
           f"--node-rank={node_rank}", "--master-addr=127.0.0.1", f"--master-port={port}", "--", str(script),
           str(tmp_path), *worker_args]
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"} | {"CARRIED": "yes"}
    return subprocess.Popen(cmd, env=env, stderr=subprocess.PIPE, text=True, start_new_session=True)


def _records(tmp_path: Path, ranks: range, timeout: float = 20.0) -> dict[int, dict]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = {}
        for rank in ranks:
            path = tmp_path / f"rank{rank}.json"
            if path.exists() and path.stat().st_size:
                found[rank] = json.loads(path.read_text())
        if len(found) == len(ranks):
            return found
        time.sleep(0.05)
    raise AssertionError(f"the workers of ranks {list(ranks)} did not all start")


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as handle:
            return handle.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def test_each_worker_gets_torchruns_environment_in_a_session_of_its_own(tmp_path: Path) -> None:
    proc = _launch(tmp_path, "ok", nnodes=2, nproc=3, node_rank=1, port=29123)
    _out, err = proc.communicate(timeout=30)
    assert proc.returncode == 0, err
    records = _records(tmp_path, range(3, 6))
    for local, rank in enumerate(range(3, 6)):
        env = records[rank]["env"]
        assert env == {"RANK": str(rank), "LOCAL_RANK": str(local), "WORLD_SIZE": "6", "LOCAL_WORLD_SIZE": "3",
                       "GROUP_RANK": "1", "GROUP_WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1",
                       "MASTER_PORT": "29123", "OMP_NUM_THREADS": "1", "CARRIED": "yes"}
        assert records[rank]["sid"] == records[rank]["pid"]  # its own session, as torchrun's workers
    assert not (tmp_path / "rank0.json").exists()


def test_a_failing_worker_stops_the_others_at_once_and_its_code_is_the_launchers(tmp_path: Path) -> None:
    started = time.monotonic()
    proc = _launch(tmp_path, "fail", "1", nproc=3)
    _out, err = proc.communicate(timeout=30)
    took = time.monotonic() - started
    assert proc.returncode == 7, err
    assert "local rank 1" in err and "exited 7" in err
    assert took < 10, f"the others sleep 120 s; the launcher took {took:.1f} s to stop them"
    records = _records(tmp_path, range(3))
    assert not [r for r, rec in records.items() if _alive(rec["pid"])], "a worker outlived its launcher"


def test_a_killed_worker_reads_as_killed_to_the_diagnosis(tmp_path: Path) -> None:
    proc = _launch(tmp_path, "kill", "0", nproc=2)
    _out, err = proc.communicate(timeout=30)
    assert proc.returncode == 128 + signal.SIGKILL, err
    killed = next(s for s in SIGNATURES if s.name == "killed")
    assert killed.pattern.search(err), err


def test_sigterm_to_the_launcher_stops_every_worker(tmp_path: Path) -> None:
    proc = _launch(tmp_path, "sleep", nproc=2)
    records = _records(tmp_path, range(2))
    proc.send_signal(signal.SIGTERM)
    _out, err = proc.communicate(timeout=30)
    assert proc.returncode == 128 + signal.SIGTERM, err
    assert "SIGTERM" in err
    assert not [r for r, rec in records.items() if _alive(rec["pid"])]


def test_a_worker_that_ignores_sigterm_is_killed_after_the_grace(tmp_path: Path) -> None:
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    env = dict(os.environ, RANK="0")
    child = subprocess.Popen([sys.executable, str(script), str(tmp_path), "ignore-term"], env=env)
    _records(tmp_path, range(1))
    started = time.monotonic()
    launch_ranks.stop({child.pid: 0}, grace_s=0.5)
    took = time.monotonic() - started
    child.returncode = -signal.SIGKILL  # reaped by stop(), not by Popen
    assert 0.5 <= took < 5
    assert not _alive(child.pid)


@pytest.mark.parametrize("args", [
    ["--nnodes=1", "--nproc-per-node=1", "--node-rank=1", "--master-addr=h", "--master-port=1", "--", "x.py"],
    ["--nnodes=1", "--nproc-per-node=0", "--node-rank=0", "--master-addr=h", "--master-port=1", "--", "x.py"],
    ["--nnodes=1", "--nproc-per-node=1", "--node-rank=0", "--master-addr=h", "--master-port=70000", "--", "x.py"],
    ["--nnodes=1", "--nproc-per-node=1", "--node-rank=0", "--master-addr=h", "--master-port=1", "--"],
])
def test_bad_arguments_exit_2_and_start_nothing(args: list[str]) -> None:
    res = subprocess.run([sys.executable, "-I", str(LAUNCHER), *args], capture_output=True, text=True, timeout=30)
    assert res.returncode == 2
    assert "error" in res.stderr


PG_WORKER = """
import os, sys
from datetime import timedelta
import torch
import torch.distributed as dist
dist.init_process_group("gloo", timeout=timedelta(seconds=60))
value = torch.tensor([float(dist.get_rank() + 1)])
dist.all_reduce(value)
with open(os.path.join(sys.argv[1], f"sum{dist.get_rank()}"), "w") as handle:
    handle.write(str(value.item()))
dist.destroy_process_group()
"""


def test_two_nodes_of_workers_form_one_process_group(tmp_path: Path) -> None:
    script = tmp_path / "pg.py"
    script.write_text(PG_WORKER)
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    env = dict(os.environ, GLOO_SOCKET_IFNAME="lo")
    nodes = [subprocess.Popen([sys.executable, "-I", str(LAUNCHER), "--nnodes=2", "--nproc-per-node=2",
                               f"--node-rank={node}", "--master-addr=127.0.0.1", f"--master-port={port}", "--",
                               str(script), str(tmp_path)], env=env, stderr=subprocess.PIPE, text=True)
             for node in (1, 0)]  # the other node first: its ranks wait for rank 0's store
    for node in nodes:
        _out, err = node.communicate(timeout=120)
        assert node.returncode == 0, err
    assert [float((tmp_path / f"sum{rank}").read_text()) for rank in range(4)] == [10.0] * 4
