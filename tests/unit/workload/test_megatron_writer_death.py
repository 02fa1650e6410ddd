"""Issue 21: megatron-core waits for its persistent checkpoint writer without a timeout, so a writer killed mid-save
(the OOM killer) left its rank blocked in "saving" for ~10 minutes before the rollout declared a hang. The Saver's
watchdog (megatron_writer.WriterWatchdog) ends the rank at once, naming the writer's death."""

from __future__ import annotations

import json
import multiprocessing
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import megatron_writer  # tests/unit/workload/conftest.py puts the workload directory on sys.path
import pytest

FORK = multiprocessing.get_context("fork")


def _sleep_as_a_writer(seconds: float, ready: Any) -> None:
    # a forked child inherits the test process's signal dispositions: another test in this process may have left
    # SIGTERM ignored (train.py's stop handler ignores the later ones); a writer has the default
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    ready.set()
    time.sleep(seconds)


def sleeper() -> Any:
    ready = FORK.Event()
    process = FORK.Process(target=_sleep_as_a_writer, args=(60, ready), daemon=True)
    process.start()
    assert ready.wait(30), "the sleeper did not start"
    return process


def deaths_within(watchdog: Any, deaths: list[Any], seconds: float) -> list[Any]:
    deadline = time.monotonic() + seconds
    while not deaths and time.monotonic() < deadline:
        time.sleep(0.02)
    return deaths


def test_a_writer_that_dies_is_reported_at_once_also_one_started_after_the_watch_began() -> None:
    writer: list[Any] = []  # megatron-core 0.16 starts its writer inside the first request: none to watch at first
    deaths: list[Any] = []
    watchdog = megatron_writer.WriterWatchdog(lambda: writer[0] if writer else None, deaths.append, interval=0.05)
    time.sleep(0.2)
    writer.append(sleeper())
    time.sleep(0.2)
    assert deaths == [], "reported a writer that is alive"
    killed = time.monotonic()
    os.kill(writer[0].pid, signal.SIGKILL)
    assert deaths_within(watchdog, deaths, 10) == writer
    assert time.monotonic() - killed < 2
    assert deaths[0].exitcode == -signal.SIGKILL
    watchdog.thread.join(2)
    assert not watchdog.thread.is_alive()


def test_a_writer_ended_after_disarm_is_not_a_death() -> None:
    process = sleeper()
    deaths: list[Any] = []
    watchdog = megatron_writer.WriterWatchdog(lambda: process, deaths.append, interval=0.05)
    watchdog.disarm()  # what finish() and abort() do before they end the writer
    process.kill()
    process.join(5)
    watchdog.thread.join(2)
    assert not watchdog.thread.is_alive() and deaths == []


def test_a_writer_stopped_by_sigterm_leaves_the_rank_its_own_stop_first() -> None:
    """A stop signals every process of the run: the rank's stop (exit 143) disarms the watchdog within the grace.
    A SIGTERM that reached the writer alone is reported after the grace."""
    for rank_stops, reported in ((True, []), (False, ["reported"])):
        process = sleeper()
        deaths: list[Any] = []
        watchdog = megatron_writer.WriterWatchdog(lambda p=process: p, deaths.append, interval=0.05, stop_grace_s=1.0)
        process.terminate()
        time.sleep(0.5)
        assert deaths == [], "reported before the grace"
        if rank_stops:
            watchdog.disarm()
        watchdog.thread.join(5)
        assert ["reported" for _ in deaths] == reported


def test_a_sigterm_that_reached_the_writer_alone_is_reported_within_seconds() -> None:
    """Issue 36: a writer ended by SIGTERM while its rank went on was reported only after the whole stop grace.
    When the rank's own stop has not begun (its SIGTERM handler not yet ignoring SIGTERM), it is reported after
    the short notice."""
    previous = signal.signal(signal.SIGTERM, signal.SIG_DFL)  # this process: not stopping
    try:
        process = sleeper()
        deaths: list[Any] = []
        watchdog = megatron_writer.WriterWatchdog(lambda: process, deaths.append, interval=0.05, stop_grace_s=60.0,
                                                  stop_notice_s=0.5)
        killed = time.monotonic()
        process.terminate()
        assert deaths_within(watchdog, deaths, 10) == [process]
        assert time.monotonic() - killed < 5
        watchdog.thread.join(2)
    finally:
        signal.signal(signal.SIGTERM, previous)


def test_the_exit_cause_is_named() -> None:
    assert megatron_writer.exit_cause(-9) == "killed by signal SIGKILL"
    assert megatron_writer.exit_cause(1) == "exit code 1"
    assert megatron_writer.exit_cause(0) == "exit code 0"


class Files:
    def __init__(self, status: Path) -> None:
        self.status, self.exits = status, []

    def exited(self, code: int, reason: str) -> None:
        self.exits.append((code, reason))


def test_a_writer_death_logs_records_and_exits_the_rank_and_its_other_children(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    class Exited(BaseException):
        pass

    def exit_(code: int) -> None:
        raise Exited(code)

    monkeypatch.setattr(os, "_exit", exit_)
    other = sleeper()  # megatron's results Manager, say (the only child it may end here: pytest's are not its own)
    monkeypatch.setattr(multiprocessing, "active_children", lambda: [other])
    dead = type("Writer", (), {"pid": 4242, "exitcode": -9})()
    files = Files(tmp_path / "rank0.json")
    with pytest.raises(Exited, match="1"):
        megatron_writer.writer_died(0, files, dead, "during the save of iteration 4")
    reason = "checkpoint writer process 4242 died (killed by signal SIGKILL) during the save of iteration 4"
    assert files.exits == [(1, reason)]
    assert f"[rank 0] {reason}: the rank cannot save, it exits" in capsys.readouterr().out
    other.join(5)
    assert other.exitcode == -signal.SIGKILL
    # the rank already recorded an exit of its own (a stop): left to it
    files.status.write_text(json.dumps({"state": "exited", "code": 143}))
    megatron_writer.writer_died(0, files, dead, "between saves")
    assert len(files.exits) == 1


def test_the_writer_is_found_where_each_megatron_core_keeps_it(monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("megatron.core", reason="megatron-core not importable (pip install megatron-core==0.16.1)")
    from megatron.core.dist_checkpointing.strategies.async_utils import PersistentAsyncCaller

    started, unstarted = type("P", (), {"pid": 7})(), type("P", (), {"pid": None})()
    queue_016 = type("Queue", (), {"persistent_caller": type("Caller", (), {"process": started})()})()
    monkeypatch.delattr(PersistentAsyncCaller, "_persistent_process", raising=False)
    assert megatron_writer.writer_process(queue_016) is started  # 0.16: on the queue's caller
    assert megatron_writer.writer_process(None) is None
    queue_016.persistent_caller.process = unstarted
    assert megatron_writer.writer_process(queue_016) is None
    monkeypatch.setattr(PersistentAsyncCaller, "_persistent_process", started, raising=False)
    assert megatron_writer.writer_process(None) is started  # 0.19: one per process, on the class


def test_a_writer_killed_during_a_save_ends_its_rank_within_seconds(tmp_path: Path) -> None:
    """The real save path on CPU: megatron-core's persistent writer SIGKILLed while it copies the tensors of the
    save of iteration 4, the rank blocked in megatron-core's wait for that copy (without the watchdog it waits
    there for good: the script then runs into this test's timeout)."""
    pytest.importorskip("megatron.core", reason="megatron-core not importable (pip install megatron-core==0.16.1)")
    pytest.importorskip("psutil", reason="dist-checkpointing's writer needs psutil")
    script = Path(__file__).with_name("megatron_cpu_writer_death.py")
    workdir = tmp_path / "run"
    proc = subprocess.run([sys.executable, str(script), str(workdir), "--steps", "2", "--kill-at", "4"],
                          capture_output=True, text=True, timeout=180, check=False)
    ended = time.time()
    lines = proc.stdout.splitlines()
    killed = next(json.loads(line) for line in lines if line.startswith('{"killed"'))
    assert ended - killed["at"] < 30, f"the rank ended {ended - killed['at']:.1f} s after its writer's death"
    assert proc.returncode == megatron_writer.WRITER_DIED_EXIT, proc.stdout[-2000:] + proc.stderr[-4000:]
    reason = (f"checkpoint writer process {killed['killed']} died (killed by signal SIGKILL) "
              "during the save of iteration 4")
    assert any(reason in line for line in lines), proc.stdout[-2000:]
    status = json.loads((workdir / "out" / "status" / "rank0.json").read_text())
    assert (status["state"], status["code"], status["reason"]) == ("exited", 1, reason)
    # checkpoint 2 stays the latest; the rank's other children (megatron's results Manager) ended with it
    assert (workdir / "checkpoints" / "latest").read_text().strip() == "2"
    deadline = time.monotonic() + 10
    while any(_running(pid) for pid in killed["children"]) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(_running(pid) for pid in killed["children"]), killed["children"]


def _running(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False
