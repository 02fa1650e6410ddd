"""train.py with the torch engine as one real process (gloo, world 1): metrics, heartbeat, status files,
atomic checkpoints and resume, a bad configuration, and SIGTERM. The multi-node run is in
tests/integration/test_launch.py."""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import ckpt  # tests/unit/workload/conftest.py puts the workload directory on sys.path
import pytest

import stepdeploy.workload
from stepdeploy.catalog import load_model
from stepdeploy.plan.layout import Layout
from stepdeploy.render.options import RenderOptions
from stepdeploy.render.workload import workload_config

pytest.importorskip("torch")
TRAIN = Path(stepdeploy.workload.__file__).parent / "train.py"


def _port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def config(tmp_path: Path, iterations: int, model: str = "tiny-dense", save_interval: int = 3) -> Path:
    opts = RenderOptions(run_id="unit", iterations=iterations, seq_length=32, global_batch_size=4, lr=1e-2,
                         save_interval=save_interval, pg_timeout_s=30)
    cfg = workload_config(load_model(model), Layout(mbs=2), opts, engine="torch", world=1, peak_tflops=None)
    path = tmp_path / "workload.json"
    path.write_text(json.dumps(cfg))
    return path


# train.py with a slow disk: every torch.save (the checkpoint write) notes its path in $SLOW_LOG, then sleeps
# $SLOW_S seconds before writing
SLOW_DISK = """
import os, sys, time
import torch
sys.path.insert(0, os.environ["WORKLOAD"])
real = torch.save
def slow(obj, path, *args, **kwargs):
    with open(os.environ["SLOW_LOG"], "a") as log:
        log.write(f"{path} {time.time()}\\n")
    time.sleep(float(os.environ["SLOW_S"]))
    if os.environ.get("FULL_AT") and f"iter_{int(os.environ['FULL_AT']):07d}" in str(path):
        raise OSError(28, "No space left on device")
    return real(obj, path, *args, **kwargs)
torch.save = slow
if os.environ.get("FREE_BYTES"):  # the checkpoint disk has this much room left
    import shutil
    usage = shutil.disk_usage
    shutil.disk_usage = lambda path: usage(path)._replace(free=int(os.environ["FREE_BYTES"]))
import train
sys.exit(train.main(sys.argv[1:]))
"""


def start(cfg: Path, out: Path, *extra: str, slow_s: float | None = None, full_at: int | None = None,
          free_bytes: int | None = None) -> subprocess.Popen[str]:
    env = {**os.environ, "RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1",
           "MASTER_PORT": str(_port()), "OMP_NUM_THREADS": "1", "STEPDEPLOY_NODE_NAME": "here"}
    program = [str(TRAIN)]
    if slow_s is not None:
        env |= {"WORKLOAD": str(TRAIN.parent), "SLOW_LOG": str(out.parent / "slow.log"), "SLOW_S": str(slow_s),
                "FULL_AT": str(full_at or ""), "FREE_BYTES": str(free_bytes or "")}
        program = ["-c", SLOW_DISK]
    return subprocess.Popen([sys.executable, *program, "--config", str(cfg), "--out-dir", str(out), *extra],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def finish(proc: subprocess.Popen[str]) -> tuple[int, str]:
    output, _ = proc.communicate(timeout=180)
    return proc.returncode, output


@pytest.mark.parametrize("model", ["tiny-dense", "tiny-moe"])
def test_metrics_heartbeat_status_checkpoints_and_resume(tmp_path: Path, model: str) -> None:
    cfg, out = config(tmp_path, iterations=6, model=model), tmp_path / "out"
    code, output = finish(start(cfg, out))
    assert code == 0, output
    metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [m["iteration"] for m in metrics] == [1, 2, 3, 4, 5, 6]
    assert all(m["loss"] > 0 and m["tokens_per_s"] > 0 and len(m["rank_step_time_s"]) == 1 for m in metrics)
    if model == "tiny-moe":  # every MoE layer's busiest expert over the mean, each step; dropless: nothing dropped
        spec = load_model(model)
        layers = {str(i + 1) for i in range(spec.moe.first_dense_layers, spec.num_layers)}
        experts = spec.moe.num_experts
        for m in metrics:
            assert set(m["moe_load"]) == layers and m["moe_dropped"] == 0.0
            assert all(1.0 <= v <= experts for v in m["moe_load"].values())
            assert m["moe_load_max"] == max(m["moe_load"].values()) and "router_bias" not in m
    else:
        assert not any("moe_load" in m for m in metrics)
    assert json.loads((out / "heartbeat/rank0").read_text())["iteration"] == 6
    status = json.loads((out / "status/rank0.json").read_text())
    assert status["state"] == "exited" and status["code"] == 0 and status["node"] == "here"
    assert (out / "checkpoints/latest").read_text() == "6\n"
    assert {p.name for p in (out / "checkpoints").iterdir()} == {"latest", "iter_0000003", "iter_0000006"}
    assert all((out / "checkpoints" / name / "complete").exists() for name in ("iter_0000003", "iter_0000006"))

    code, output = finish(start(cfg, out, "--iterations", "8"))
    assert code == 0, output
    assert "resumed from checkpoint 6" in output
    metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [m["iteration"] for m in metrics] == [1, 2, 3, 4, 5, 6, 7, 8]
    phases = [json.loads(line) for line in (out / "phases.jsonl").read_text().splitlines()]
    names = [(p["phase"], p.get("iteration")) for p in phases]
    assert names == [("start", None), ("imported", None), ("initialized", None), ("model", None), ("resumed", 0),
                     ("first_step", 1), ("save", 3), ("save_committed", 3), ("save", 6), ("save_committed", 6),
                     ("start", None), ("imported", None), ("initialized", None), ("model", None), ("resumed", 6),
                     ("first_step", 7), ("save", 8), ("save_committed", 8)]
    assert len({p["pid"] for p in phases[:10]}) == 1 and phases[10]["pid"] != phases[0]["pid"]
    times = [p["time"] for p in phases]
    assert times == sorted(times) and all(p["began"] <= p["time"] for p in phases if p["phase"].startswith("save"))
    for p in phases:
        if p["phase"] == "save":  # what the step loop waited for, and that the write went on in the background
            assert p["background"] is True and p["blocking_s"] == pytest.approx(p["time"] - p["began"], abs=1e-3)
        if p["phase"] == "save_committed":
            assert p["background_s"] >= 0 and p["commit_s"] >= 0
    assert ckpt.complete_iterations(out / "checkpoints") == [6, 8]  # retention: the last 2 (the default)


def test_saves_write_in_the_background_and_the_next_save_waits_for_the_one_in_flight(tmp_path: Path) -> None:
    cfg, out = config(tmp_path, iterations=7, save_interval=3), tmp_path / "out"
    code, output = finish(start(cfg, out, slow_s=2.0))
    assert code == 0, output
    phases = [json.loads(line) for line in (out / "phases.jsonl").read_text().splitlines()]
    saves = {p["iteration"]: p for p in phases if p["phase"] == "save"}
    committed = {p["iteration"]: p for p in phases if p["phase"] == "save_committed"}
    assert sorted(saves) == sorted(committed) == [3, 6, 7]
    metrics = {m["iteration"]: m for m in map(json.loads, (out / "metrics.jsonl").read_text().splitlines())}
    # the step loop went on while checkpoint 3 was written: iteration 4 ended before the write did
    assert saves[3]["blocking_s"] < 1.0 and committed[3]["background_s"] >= 2.0
    assert metrics[4]["time"] < committed[3]["time"]
    # 6 found 3's write still going (one save in flight at most) and waited: its blocking time says so
    assert saves[6]["began"] < committed[3]["time"] <= saves[6]["time"]
    assert committed[3]["time"] < committed[6]["time"] < committed[7]["time"]  # and the end waited for the last
    assert ckpt.complete_iterations(out / "checkpoints") == [6, 7]
    assert not [p.name for p in (out / "checkpoints").iterdir() if p.name.startswith(".")]


def test_sigterm_during_a_background_write_leaves_the_previous_checkpoint_latest(tmp_path: Path) -> None:
    cfg, out = config(tmp_path, iterations=100000, save_interval=3), tmp_path / "out"
    proc = start(cfg, out, slow_s=60.0)
    deadline = time.monotonic() + 120
    heartbeat: dict = {}
    while heartbeat.get("state") != "saving" or heartbeat.get("iteration") != 6:
        # checkpoint 3's write (60 s) is in flight; training went on to 6, whose save waits for it, saying so
        assert proc.poll() is None and time.monotonic() < deadline, proc.stdout.read() if proc.stdout else ""
        time.sleep(0.2)
        with contextlib.suppress(OSError, ValueError):
            heartbeat = json.loads((out / "heartbeat/rank0").read_text())
    assert "iter_0000003" in (tmp_path / "slow.log").read_text()
    proc.send_signal(signal.SIGTERM)
    code, output = finish(proc)
    assert code == 143, output
    # the write never ended: nothing was committed, and the stop removed what it had written (issue 36: every
    # soak that ended with a save in flight left its staging directory on every node)
    assert not (out / "checkpoints/latest").exists() and ckpt.latest_iteration(out / "checkpoints") is None
    assert list((out / "checkpoints").iterdir()) == []
    assert "checkpoints: removed .iter_0000003.tmp-" in output and "(its save was never committed)" in output, output


def test_sigterm_during_a_later_background_write_keeps_the_committed_one(tmp_path: Path) -> None:
    cfg, out = config(tmp_path, iterations=100000, save_interval=3), tmp_path / "out"
    proc = start(cfg, out, slow_s=0.0)  # a fast disk until checkpoint 3 is committed
    deadline = time.monotonic() + 120
    while ckpt.latest_iteration(out / "checkpoints") is None:
        assert proc.poll() is None and time.monotonic() < deadline, proc.stdout.read() if proc.stdout else ""
        time.sleep(0.1)
    proc.send_signal(signal.SIGTERM)
    code, output = finish(proc)
    assert code == 143, output
    latest = ckpt.latest_iteration(out / "checkpoints")
    assert latest is not None and latest % 3 == 0
    # a second start on a slow disk, stopped inside its first background write
    slow_log = tmp_path / "slow.log"
    slow_log.unlink(missing_ok=True)
    proc = start(cfg, out, slow_s=60.0)
    while not slow_log.exists():
        assert proc.poll() is None and time.monotonic() < deadline + 120, proc.stdout.read() if proc.stdout else ""
        time.sleep(0.2)
    proc.send_signal(signal.SIGTERM)
    code, output = finish(proc)
    assert code == 143 and f"resumed from checkpoint {latest}" in output, output
    assert (out / "checkpoints/latest").read_text() == f"{latest}\n"
    assert ckpt.latest_iteration(out / "checkpoints") == latest
    # the stop removed its staging directory, nothing else
    assert f"checkpoints: removed .{ckpt.iteration_name(latest + 3)}.tmp-" in output, output
    assert not [p.name for p in (out / "checkpoints").iterdir() if p.name.startswith(".")]
    code, output = finish(start(cfg, out, "--iterations", str(latest + 1)))
    assert code == 0 and "checkpoints: removed" not in output, output  # nothing left for the repair
    assert not [p.name for p in (out / "checkpoints").iterdir() if p.name.startswith(".")]


def test_a_full_disk_fails_the_rank_with_the_reason_and_keeps_the_previous_checkpoint(tmp_path: Path) -> None:
    cfg, out = config(tmp_path, iterations=9, save_interval=3), tmp_path / "out"
    code, output = finish(start(cfg, out, slow_s=0.0, full_at=6))
    assert code == 1, output
    status = json.loads((out / "status/rank0.json").read_text())
    assert status["state"] == "exited" and "No space left on device" in status["reason"], status
    assert "checkpoint 6 in " in status["reason"] and "Fix: free space" in status["reason"], status
    assert "disk full: [Errno 28] No space left on device: checkpoint 6" in output, output
    assert ckpt.latest_iteration(out / "checkpoints") == 3 and (out / "checkpoints/latest").read_text() == "3\n"
    assert not [p.name for p in (out / "checkpoints").iterdir() if p.name.startswith(".")]  # staging, reserve: gone


def test_a_save_that_cannot_fit_fails_before_it_writes_naming_free_and_needed(tmp_path: Path) -> None:
    """Issue 36: a full disk was recorded as "died without exiting" (the exit record could not be written). A
    save that does not fit the room left fails before it fills the disk, naming where, free, needed, the fix."""
    cfg, out = config(tmp_path, iterations=9, save_interval=3), tmp_path / "out"
    code, output = finish(start(cfg, out, slow_s=0.0, free_bytes=4096))
    assert code == 1, output
    status = json.loads((out / "status/rank0.json").read_text())
    reason = status["reason"]
    assert status["state"] == "exited" and "[Errno 28] No space left on device: checkpoint 6 in " in reason, status
    assert "free 0.0 MiB, the save needs about" in reason and "--keep-checkpoints" in reason, reason
    assert sum("iter_0000006" in line for line in (tmp_path / "slow.log").read_text().splitlines()) == 0
    assert ckpt.latest_iteration(out / "checkpoints") == 3
    assert not [p.name for p in (out / "checkpoints").iterdir() if p.name.startswith(".")]


def test_bad_configuration_exits_2_and_says_so(tmp_path: Path) -> None:
    cfg = tmp_path / "workload.json"
    cfg.write_text(json.dumps({"format": 99}))
    code, output = finish(start(cfg, tmp_path / "out"))
    assert code == 2, output
    status = json.loads((tmp_path / "out/status/rank0.json").read_text())
    assert status["code"] == 2 and "unknown workload config format" in status["reason"]


def test_sigterm_stops_the_rank_with_143(tmp_path: Path) -> None:
    out = tmp_path / "out"
    proc = start(config(tmp_path, iterations=100000, save_interval=0), out)
    deadline = time.monotonic() + 120
    while not (out / "heartbeat/rank0").exists():
        assert proc.poll() is None and time.monotonic() < deadline, proc.stdout.read() if proc.stdout else ""
        time.sleep(0.2)
    proc.send_signal(signal.SIGTERM)
    code, output = finish(proc)
    assert code == 143, output
    status = json.loads((out / "status/rank0.json").read_text())
    assert status["state"] == "exited" and status["reason"] == "stopped by signal SIGTERM"


def test_after_the_first_sigterm_later_ones_are_ignored() -> None:
    """A stop sends up to three SIGTERMs (controller, launcher, parent death); a later one arriving while the
    rank writes its exit record would cut it short and the rank would read as killed, not stopped (seen in the
    simulated cluster's detach-and-stop test)."""
    import train

    previous = signal.signal(signal.SIGTERM, train._on_term)
    try:
        try:
            train._on_term(signal.SIGTERM, None)
        except train.Stopped as exc:
            assert str(exc) == "signal SIGTERM"
        else:
            raise AssertionError("the first SIGTERM must stop the rank")
        assert signal.getsignal(signal.SIGTERM) is signal.SIG_IGN
    finally:
        signal.signal(signal.SIGTERM, previous)


def test_synthetic_tokens_are_deterministic_and_differ_per_rank() -> None:
    import synthetic

    table = synthetic.markov_table(100, 1)
    a = synthetic.markov_tokens(table, 1, 5, 0, 0, 2, 130)
    assert (a == synthetic.markov_tokens(table, 1, 5, 0, 0, 2, 130)).all()
    assert not (a == synthetic.markov_tokens(table, 1, 5, 0, 1, 2, 130)).all()  # another DP rank
    assert not (a == synthetic.markov_tokens(table, 1, 6, 0, 0, 2, 130)).all()  # another iteration
    # within a block of BLOCK tokens every token is one of its predecessor's successors
    pairs = {(int(x), int(y)) for row in a for i, (x, y) in enumerate(itertools.pairwise(row.tolist()))
             if (i + 1) % synthetic.BLOCK}
    assert pairs and all(y in table[x].tolist() for x, y in pairs)
