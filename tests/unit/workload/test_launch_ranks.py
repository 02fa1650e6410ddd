"""workload/launch_ranks.py, the launcher of a node's ranks, run for real: worker processes, signals, exit codes,
and a real torch.distributed process group over the environment it gives (rank 0 hosts the TCPStore)."""

from __future__ import annotations

import contextlib
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
from stepdeploy import noderecords
from stepdeploy.monitor.classify import classify
from stepdeploy.monitor.diagnose import SIGNATURES
from stepdeploy.remote import poll_answer
from stepdeploy.remote.executor import NodeStatus, RunStatus
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
            port: int = 29999, worker: str = WORKER, status_dir: Path | None = None,
            node: str = "n9") -> subprocess.Popen[str]:
    script = tmp_path / "worker.py"
    script.write_text(worker)
    options = [f"--status-dir={status_dir}"] if status_dir is not None else []
    cmd = [sys.executable, "-I", str(LAUNCHER), f"--nnodes={nnodes}", f"--nproc-per-node={nproc}",
           f"--node-rank={node_rank}", "--master-addr=127.0.0.1", f"--master-port={port}", *options, "--",
           str(script), str(status_dir or tmp_path), *worker_args]
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "STEPDEPLOY_NODE_NAME")}
    env |= {"CARRIED": "yes", "STEPDEPLOY_NODE_NAME": node}
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


# A rank as train.py writes its status file (metrics.RankFiles): "running" at start, "exited" with its code and reason
# on SIGTERM or its own error. Rank argv[3] fails once every rank of its node has written its start: `kill` (SIGKILL,
# no exit record), `exit` (os._exit(3), no exit record), `own` (its own exit record, then exit 1), `silent` (SIGKILL
# before it wrote anything); `sleep`: no rank fails.
STATUS_WORKER = """
import json, os, signal, sys, time
rank, status_dir, mode, failing = int(os.environ["RANK"]), sys.argv[1], sys.argv[2], int(sys.argv[3])
path = os.path.join(status_dir, f"rank{rank}.json")

def write(record):
    with open(path + ".tmp", "w") as handle:
        json.dump({"rank": rank, "pid": os.getpid(), "node": os.environ["STEPDEPLOY_NODE_NAME"], **record}, handle)
    os.replace(path + ".tmp", path)

def exited(code, reason):
    write({"state": "exited", "code": code, "reason": reason})
    sys.exit(code)

signal.signal(signal.SIGTERM, lambda *_: exited(143, "stopped by signal SIGTERM"))
if rank != failing or mode != "silent":
    write({"state": "running"})
if rank == failing and mode != "sleep":
    first = rank - int(os.environ["LOCAL_RANK"])
    node_ranks = range(first, first + int(os.environ["LOCAL_WORLD_SIZE"]))
    others = [os.path.join(status_dir, f"rank{r}.json") for r in node_ranks if r != rank]
    while not all(os.path.exists(other) for other in others):
        time.sleep(0.01)
    if mode in ("kill", "silent"):
        os.kill(os.getpid(), signal.SIGKILL)
    if mode == "exit":
        os._exit(3)
    exited(1, "RuntimeError: the worker's own words")
time.sleep(120)
"""


def _ended(tmp_path: Path, mode: str) -> tuple[int, float, float, dict[int, dict]]:
    """Node rank 1 of two, ranks 2 and 3; rank 3 fails as `mode` says. (launcher code, its start and end times,
    {rank: the status file as written})."""
    status_dir = tmp_path / "status"
    status_dir.mkdir()
    began = time.time()
    proc = _launch(tmp_path, mode, "3", nnodes=2, nproc=2, node_rank=1, worker=STATUS_WORKER, status_dir=status_dir)
    _out, err = proc.communicate(timeout=60)
    ended = time.time()
    assert sorted(p.name for p in status_dir.iterdir()) == ["rank2.json", "rank3.json"], err  # no temporaries
    return proc.returncode, began, ended, {r: json.loads((status_dir / f"rank{r}.json").read_text()) for r in (2, 3)}


def test_a_sigkilled_worker_is_recorded_died_first_and_the_other_stopped_after_it(tmp_path: Path) -> None:
    code, began, ended, files = _ended(tmp_path, "kill")
    assert code == 128 + signal.SIGKILL
    killed, victim = (noderecords.status_record(files[r]) for r in (3, 2))  # through the controller's schema
    assert (killed.rank, killed.state, killed.code, killed.node) == (3, "died", 137, "n9")
    assert killed.reason == ("was killed by signal 9 (SIGKILL), seen by its launcher first on its node; "
                             "no exit record of its own")
    assert killed.failed_first_at is not None and began < killed.failed_first_at < ended
    assert killed.stopped_after_rank is None and files[3]["launcher_saw"] == "was killed by signal 9 (SIGKILL)"
    # the other rank wrote its own exit on the launcher's SIGTERM: kept, and marked as stopped after rank 3
    assert (victim.state, victim.code, victim.reason) == ("exited", 143, "stopped by signal SIGTERM")
    assert victim.stopped_after_rank == 3 and victim.failed_first_at is None
    assert files[2]["launcher_saw"] == "exited 143"


def test_a_worker_exiting_3_without_a_record_is_recorded_exited_3(tmp_path: Path) -> None:
    code, began, _ended_at, files = _ended(tmp_path, "exit")
    assert code == 3
    failed = noderecords.status_record(files[3])
    assert (failed.state, failed.code) == ("exited", 3) and failed.reason.startswith("exited 3, seen by its launcher")
    assert failed.failed_first_at is not None and failed.failed_first_at > began
    assert files[2]["stopped_after_rank"] == 3


def test_a_workers_own_exit_record_is_kept(tmp_path: Path) -> None:
    code, _began, _ended_at, files = _ended(tmp_path, "own")
    assert code == 1
    own = noderecords.status_record(files[3])
    assert (own.state, own.code, own.reason) == ("exited", 1, "RuntimeError: the worker's own words")
    assert own.failed_first_at is not None and files[3]["launcher_saw"] == "exited 1"


def test_a_worker_that_wrote_nothing_gets_the_launchers_record_not_an_earlier_starts(tmp_path: Path) -> None:
    """An earlier start's record (another pid: a soak's restart reuses the run directory) is not this worker's."""
    status_dir = tmp_path / "status"
    status_dir.mkdir()
    earlier = {"rank": 3, "pid": 1, "state": "exited", "code": 143, "reason": "an earlier start's"}
    (status_dir / "rank3.json").write_text(json.dumps(earlier))
    proc = _launch(tmp_path, "silent", "3", nnodes=2, nproc=2, node_rank=1, worker=STATUS_WORKER,
                   status_dir=status_dir)
    _out, err = proc.communicate(timeout=60)
    assert proc.returncode == 137, err
    record = json.loads((status_dir / "rank3.json").read_text())
    assert record["pid"] != 1 and record["node"] == "n9"  # its pid, env.sh's STEPDEPLOY_NODE_NAME
    assert (record["rank"], record["state"], record["code"]) == (3, "died", 137) and "failed_first_at" in record


def test_a_stopped_worker_that_wrote_no_exit_is_recorded_as_stopped(tmp_path: Path) -> None:
    """A worker SIGKILLed after the grace (it ignored SIGTERM) left only its start: it died, stopped after rank 3."""
    (tmp_path / "rank2.json").write_text(json.dumps({"rank": 2, "pid": 4242, "state": "running", "node": "n1"}))
    launch_ranks.write_record(str(tmp_path), 2, 4242, signal.SIGKILL, {"stopped_after_rank": 3},
                              "stopped by its launcher after rank 3 failed")
    record = noderecords.parse_status((tmp_path / "rank2.json").read_text())
    assert (record.state, record.code, record.stopped_after_rank, record.pid) == ("died", 137, 3, 4242)
    assert record.reason == ("was killed by signal 9 (SIGKILL), stopped by its launcher after rank 3 failed; "
                             "no exit record of its own")
    assert [p.name for p in tmp_path.iterdir()] == ["rank2.json"]


def _wait_for(path: Path, timeout: float = 20.0) -> dict:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with contextlib.suppress(OSError, ValueError):
            return json.loads(path.read_text())
        time.sleep(0.02)
    raise AssertionError(f"{path} was never written")


@pytest.mark.parametrize("launcher_killed", [True, False])
def test_a_node_killed_whole_after_the_first_failure_is_not_blamed(tmp_path: Path, launcher_killed: bool) -> None:
    """The Slurm case (CI, 2026-12-06) with real launchers: node2's worker is SIGKILLed, node2's launcher exits, and
    then node1 is killed as srun --kill-on-bad-exit kills it: its launcher with its worker (no record: "running" over
    a dead pid), or its worker alone (its launcher records it, a moment later). Nothing runs when the controller reads
    the status files: it must name node2's rank 1, not the lowest rank."""
    status_dir = tmp_path / "status"
    status_dir.mkdir()
    nodes = [_launch(tmp_path, "sleep", "-1", nnodes=2, nproc=1, node_rank=rank, worker=STATUS_WORKER,
                     status_dir=status_dir, node=name) for rank, name in enumerate(("node1", "node2"))]
    workers = [_wait_for(status_dir / f"rank{rank}.json")["pid"] for rank in (0, 1)]
    os.kill(workers[1], signal.SIGKILL)
    assert nodes[1].wait(timeout=30) == 137
    os.kill(workers[0], signal.SIGKILL)
    if launcher_killed:
        nodes[0].kill()
    nodes[0].wait(timeout=30)
    ranks = []
    for rank, name in enumerate(("node1", "node2")):
        text = (status_dir / f"rank{rank}.json").read_text()
        answer = {"state": "exited", "exit_code": 137, "processes": [], "node": name, "now": time.time(),
                  "ranks": [{"file": f"rank{rank}.json", "status": text, "heartbeat": None}]}
        ranks += poll_answer.node_status(name, json.dumps(answer)).ranks
    assert {r.rank: r.state for r in ranks} == {0: "died", 1: "died"}
    assert (ranks[0].failed_first_at is None) == launcher_killed
    verdict = classify(RunStatus(tuple(NodeStatus(r.node, "exited", 137, (r,)) for r in ranks)))
    assert (verdict.kind, verdict.node, verdict.rank) == ("crash", "node2", 1), verdict


def test_without_a_status_dir_nothing_is_written(tmp_path: Path) -> None:
    proc = _launch(tmp_path, "fail", "1", nproc=2)
    proc.communicate(timeout=30)
    assert proc.returncode == 7
    assert sorted(p.name for p in tmp_path.iterdir()) == ["rank0.json", "rank1.json", "worker.py"]


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
