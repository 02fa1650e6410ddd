"""The soak's detect / stop / restart / resume state machine, driven through stepdeploy.testing's scripted
executor and fake clock: every case a minute or more of soak time, each in about a second of test time
(rendering the run directory is most of it)."""

from __future__ import annotations

import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import pytest

from stepdeploy.inventory import load_cluster
from stepdeploy.ledger import Ledger
from stepdeploy.rollout.config import RolloutConfig, StageFailed, StageStopped
from stepdeploy.rollout.runner import Rollout
from stepdeploy.testing import FakeClock, FakeNodes

INVENTORY = ("[sim]\nnode1 ansible_host=10.9.0.11\nnode2 ansible_host=10.9.0.12\n"
             "[sim:vars]\nstepdeploy_gpus_per_node=0\nstepdeploy_profile=sim-cpu\n")
BASE = RolloutConfig(inventory="", model="tiny-dense", stages=("soak",), soak_duration_s=60.0, checkpoint_interval=5,
                     poll_interval_s=1.0, monitor_interval_s=5.0, heartbeat_timeout_s=30.0, node_wait_s=60.0)


@dataclass
class Soak:
    tmp: Path
    clock: FakeClock
    nodes: FakeNodes
    config: RolloutConfig
    run_dir: Path
    ledger: Ledger

    def rollout(self, **kwargs: Any) -> Rollout:
        return Rollout(self.run_dir, self.ledger, "r", self.config, cluster=load_cluster(Path(self.config.inventory)),
                       clock=self.clock.clock, executors=self.nodes.executor, **kwargs)

    def run(self, **kwargs: Any) -> str | None:
        """Drive the rollout to its end: None when it passed, else the StageFailed's message."""
        try:
            self.rollout(**kwargs).run()
        except StageFailed as exc:
            return exc.message
        return None

    def events(self, kind: str) -> list[dict[str, Any]]:
        return [e for e in self.ledger.events("r") if e["kind"] == kind]

    def attempts(self) -> list[str]:
        return [a["status"] for a in self.ledger.attempts("r")]

    def stage(self) -> str:
        return self.ledger.stages("r")[-1].status

    def stop(self) -> None:
        """What `rollout stop` does first: the STOP file the controller looks for."""
        (self.run_dir / "STOP").write_text("stop requested\n")


def _soak(tmp_path: Path, stages: tuple[str, ...] = ("soak",), **config: Any) -> Soak:
    inventory = tmp_path / "inv.ini"
    inventory.write_text(INVENTORY)
    clock = FakeClock()
    cfg = replace(BASE, inventory=str(inventory), stages=stages, **config)
    run_dir = tmp_path / "r"
    run_dir.mkdir()
    ledger = Ledger(run_dir / "ledger.sqlite", clock=clock.time)
    ledger.create_run("r", cfg.to_json(), list(cfg.stages))
    return Soak(tmp_path, clock, FakeNodes(clock), cfg, run_dir, ledger)


@pytest.fixture
def soak(tmp_path: Path) -> Soak:
    return _soak(tmp_path)


def _nothing_running(s: Soak) -> None:
    assert "running" not in s.attempts(), s.attempts()
    run = s.nodes.current
    assert run is None or not run.active, "processes of the run left running"


def test_a_killed_rank_is_detected_stopped_and_restarted_from_its_checkpoint(soak: Soak) -> None:
    soak.nodes.at(start=1, after_s=20, kill=1)
    began = time.monotonic()
    assert soak.run() is None
    assert time.monotonic() - began < 10  # a minute of soak, with a failure and a restart
    assert soak.attempts() == ["failed", "passed"] and soak.stage() == "passed"
    (detected,) = soak.events("detected")
    assert detected["data"]["kind"] == "crash" and detected["data"]["rank"] == 1
    assert detected["data"]["time"] - soak.ledger.stages("r")[0].started <= 21  # at the next poll
    assert [s.resumed_from for s in soak.nodes.starts] == [0, 15]  # the last checkpoint before iteration 17
    assert soak.events("restart") and soak.events("diagnosis")
    _nothing_running(soak)


def test_the_schedule_event_warns_an_moe_soak_too_short_for_expert_load(tmp_path: Path, soak: Soak) -> None:
    (tmp_path / "moe").mkdir()
    moe = _soak(tmp_path / "moe", model="tiny-moe")  # 60 s at the assumed 1.0 s a step: ~60 iterations
    moe.run()
    schedule = moe.events("schedule")[0]
    assert schedule["data"]["expert_load_warning"].startswith("the soak's ~60 iterations may end before")
    assert schedule["message"].endswith("gives it room")
    soak.run()
    assert soak.events("schedule")[0]["data"]["expert_load_warning"] is None  # tiny-dense: no expert_load gate


def test_a_hung_rank_is_detected_by_its_heartbeat_timeout(soak: Soak) -> None:
    soak.nodes.at(start=1, after_s=20, hang=0)
    assert soak.run() is None
    (detected,) = soak.events("detected")
    hung_at = soak.nodes.starts[0].at + 20
    assert detected["data"]["kind"] == "hang"
    assert 30 <= detected["data"]["time"] - hung_at <= 33  # the timeout (30 s) from its last beat, plus a poll
    assert soak.attempts() == ["failed", "passed"]


def test_restarts_stop_at_the_limit(tmp_path: Path) -> None:
    s = _soak(tmp_path, soak_max_restarts=2, soak_max_stalled_restarts=9, soak_duration_s=600.0)
    for start in (1, 2, 3):
        s.nodes.at(start=start, after_s=10 + 10 * start, kill=1)  # each start gets further than the last
    why = s.run()
    assert why and why.startswith("soak: unrecovered failure after 2 restart(s)"), why
    assert s.attempts() == ["failed", "failed", "failed"] and s.stage() == "failed"
    verdict = next(v for v in s.ledger.verdicts("r") if v["gate"] == "no_unrecovered_failure")
    assert not verdict["passed"] and (verdict["measured"], verdict["threshold"]) == (3, 2)
    assert len(s.nodes.starts) == 3
    _nothing_running(s)


def test_restarts_without_progress_stop_the_soak_early(tmp_path: Path) -> None:
    s = _soak(tmp_path, soak_max_restarts=9, soak_max_stalled_restarts=2, soak_duration_s=600.0)
    s.nodes.at(start=1, after_s=20, kill=1)  # iteration 17
    s.nodes.at(start=2, after_s=10, kill=1)  # 15 + 7 = 22: progress
    s.nodes.at(start=3, after_s=5, kill=1)  # 20 + 2: no further
    s.nodes.at(start=4, after_s=5, kill=1)  # 20 + 2: no further
    why = s.run()
    assert why and "2 restart(s) in a row made no progress" in why, why
    assert s.attempts() == ["failed"] * 4
    assert next(v for v in s.ledger.verdicts("r") if v["gate"] == "progress")["passed"] == 0
    _nothing_running(s)


def test_a_controller_that_died_is_replaced_and_re_attaches(soak: Soak) -> None:
    class ControllerKilled(BaseException):  # like SIGKILL: nothing of the controller's runs after it
        pass

    def die(live: Any) -> None:
        if live.iteration and live.iteration >= 10:
            raise ControllerKilled

    with pytest.raises(ControllerKilled):
        soak.rollout(on_tick=die).run()
    assert soak.attempts() == ["running"]  # the job outlives its controller
    assert soak.run() is None
    assert soak.attempts() == ["passed"] and len(soak.nodes.starts) == 1  # one attempt, re-attached
    assert any("re-attached" in e["message"] for e in soak.events("attempt"))


def test_a_stop_during_a_restart_ends_the_stage_stopped_and_launches_nothing(soak: Soak) -> None:
    soak.nodes.at(start=1, after_s=20, kill=1)
    soak.nodes.on("stop", soak.stop)  # `rollout stop` while the recovery stops the failed run
    with pytest.raises(StageStopped, match="stopped on request"):
        soak.rollout().run()
    assert soak.stage() == "stopped" and soak.ledger.run("r")["status"] == "stopped"
    assert soak.attempts() == ["failed"] and len(soak.nodes.starts) == 1  # no new start after the stop
    assert not soak.events("restart")
    assert not [e for e in soak.events("stage") if "failed" in e["message"]]
    assert not [e for e in soak.events("run") if e["message"] == "run failed"]
    _nothing_running(soak)


def test_a_stop_while_a_lost_node_is_waited_for_ends_the_stage_stopped(soak: Soak) -> None:
    soak.nodes.at(start=1, after_s=20, unreachable="node2", for_s=600)
    soak.nodes.on("poll", soak.stop, nth=25)  # during the node wait (polls every 2 s)
    with pytest.raises(StageStopped, match="while waiting for node2"):
        soak.rollout().run()
    assert soak.stage() == "stopped" and soak.attempts() == ["failed"] and len(soak.nodes.starts) == 1


def test_a_stop_during_the_run_ends_the_attempt_and_the_stage_stopped(soak: Soak) -> None:
    soak.nodes.on("poll", soak.stop, nth=30)
    with pytest.raises(StageStopped):
        soak.rollout().run()
    assert soak.attempts() == ["stopped"] and soak.stage() == "stopped"
    _nothing_running(soak)


def test_a_lost_node_that_comes_back_is_waited_for_and_the_soak_restarts(soak: Soak) -> None:
    soak.nodes.at(start=1, after_s=20, unreachable="node2", for_s=25)
    assert soak.run() is None
    (detected,) = soak.events("detected")
    assert detected["data"]["kind"] == "node-loss" and detected["data"]["node"] == "node2"
    waits = [e["message"] for e in soak.events("node-wait")]
    assert waits[0].startswith("waiting up to 60 s for node2") and waits[-1] == "node2 reachable again"
    assert soak.attempts() == ["failed", "passed"]


def test_a_lost_node_that_stays_away_fails_the_soak(soak: Soak) -> None:
    soak.nodes.at(start=1, after_s=20, unreachable="node2", for_s=600)
    why = soak.run()
    assert why == "soak: node(s) node2 lost and not back within 60 s"
    assert soak.attempts() == ["failed"] and soak.stage() == "failed"


@pytest.mark.parametrize("stages", [("soak",), ("warmup",)])
def test_a_refused_start_leaves_its_attempt_failed_not_running(tmp_path: Path, stages: tuple[str, ...]) -> None:
    s = _soak(tmp_path, stages=stages)
    refusal = "unreachable: SSHException: Server '10.9.0.12' not found in known_hosts"
    s.nodes.fail("start", "node2", refusal)
    why = s.run()
    assert why == f"{stages[0]}/target: node2: {refusal}", why
    assert s.attempts() == ["failed"] and s.stage() == "failed"
    assert s.ledger.attempts("r")[0]["detail"]["why"] == why


def test_an_error_while_following_stops_the_run_and_fails_the_attempt(soak: Soak) -> None:
    def broken() -> None:
        raise RuntimeError("a bug in a monitor")

    soak.nodes.on("poll", broken, nth=10)
    with pytest.raises(RuntimeError):
        soak.rollout().run()
    assert soak.attempts() == ["failed"]
    assert soak.ledger.attempts("r")[0]["detail"]["why"] == "RuntimeError: a bug in a monitor"
    _nothing_running(soak)


def test_a_full_disk_during_a_save_is_named_once_and_not_restarted(soak: Soak) -> None:
    soak.nodes.at(start=1, after_s=20, exit_rank=1,
                  line="OSError: [Errno 28] No space left on device: '/var/lib/stepdeploy/runs/r/out/iter_0000015'")
    why = soak.run()
    assert why and why.startswith("soak: no space left on device on node2: [rank 1] OSError: [Errno 28]"), why
    diagnosis = soak.events("diagnosis")[-1]
    assert diagnosis["data"]["diagnoses"][0]["signature"] == "disk_full"
    assert soak.attempts() == ["failed"] and soak.stage() == "failed" and len(soak.nodes.starts) == 1
    _nothing_running(soak)


def test_a_full_disk_in_the_upload_is_named_as_such(soak: Soak) -> None:
    soak.nodes.at(start=1, after_s=20, kill=1)
    soak.nodes.on("prepare", lambda: soak.nodes.fail("prepare", "node2", "unreachable: OSError: size mismatch in put!  "
                                                     "0 != 1843921"), nth=2)  # the restart's upload
    soak.nodes.respond(r"^df -P -k", "Filesystem 1024-blocks Used Available Capacity Mounted on\n"
                                     "/dev/sdb1 1000000 1000000 0 100% /var/lib/stepdeploy\n")
    why = soak.run()
    assert why == ("soak/target: no space left on device on node2: unreachable: OSError: size mismatch in put!  "
                   "0 != 1843921 (df: 0 MiB free on /var/lib/stepdeploy)"), why
    assert soak.attempts() == ["failed", "failed"] and soak.stage() == "failed"  # the restart's too, not running
    _nothing_running(soak)


def test_the_diagnosis_reads_only_the_failed_attempts_lines(soak: Soak) -> None:
    soak.nodes.at(start=1, after_s=20, exit_rank=1, line="torch.OutOfMemoryError: CUDA out of memory.")
    soak.nodes.at(start=2, after_s=10, exit_rank=1, line="Segmentation fault (core dumped)")
    assert soak.run() is None
    first, second = (e["data"]["diagnoses"] for e in soak.events("diagnosis"))
    assert [d["signature"] for d in first] == ["cuda_oom"]
    assert [d["signature"] for d in second] == ["segfault"]  # not the first attempt's OOM again
    assert soak.attempts() == ["failed", "failed", "passed"]


def test_an_injected_kill_goes_through_the_executor_and_node_faults_through_the_strategy(tmp_path: Path) -> None:
    s = _soak(tmp_path, inject=("kill:rank=last@20s", "link-down:node=2@40s,for=30s"))
    acted: list[tuple[str, str, float]] = []

    class Recorded:
        def link_down(self, executor: Any, node: Any, iface: str, for_s: float) -> tuple[bool, str]:
            acted.append((node.name, iface, for_s))
            return True, f"{iface} down on {node.name}"

        def node_loss(self, executor: Any, node: Any, for_s: float) -> tuple[bool, str]:
            raise AssertionError("no node-loss was asked for")

    assert s.run(faults=Recorded()) is None
    kills = [(n, c) for n, c in s.nodes.commands if c.startswith("kill -0")]
    assert kills == [("node2", "kill -0 1001 && kill -9 1001")]
    assert s.events("detected")[0]["data"]["kind"] == "crash"
    assert acted == [("node2", "eth0", 30.0)]


def test_a_stop_during_a_warm_up_ends_it_stopped_not_failed_by_its_gate(tmp_path: Path) -> None:
    s = _soak(tmp_path, stages=("warmup",), warmup_iterations=1000)
    s.nodes.on("poll", s.stop, nth=5)
    with pytest.raises(StageStopped, match="warmup/target: stopped on request"):
        s.rollout().run()
    assert s.attempts() == ["stopped"] and s.stage() == "stopped" and s.ledger.verdicts("r") == []
    _nothing_running(s)


def test_a_soak_of_fixed_iterations_ends_when_they_are_trained_across_a_restart(tmp_path: Path) -> None:
    s = _soak(tmp_path, soak_iterations=40, soak_duration_s=3600.0)  # 40 steps of 1 s: well inside the hour
    s.nodes.at(start=1, after_s=20, kill=0)
    began = s.clock.time()
    assert s.run() is None
    assert s.attempts() == ["failed", "passed"] and s.stage() == "passed"
    assert [st.resumed_from for st in s.nodes.starts] == [0, 15]  # the restart goes on to 40 from its checkpoint
    assert s.ledger.attempts("r")[-1]["detail"]["why"] == "40 iterations trained"
    assert s.clock.time() - began < 120  # it did not wait for the hour
    schedule = s.events("schedule")[0]["data"]
    assert (schedule["expected_iterations"], schedule["warmup_iterations"], schedule["decay_iterations"]) == (40, 2, 40)
    assert schedule["source"] == "fixed by --soak-iterations"
    assert {g["gate"] for g in s.ledger.verdicts("r") if g["passed"]} >= {"loss_finite", "loss_trend"}
    _nothing_running(s)


def test_hostile_records_from_a_node_are_skipped_counted_and_the_soak_still_ends(soak: Soak) -> None:
    """What a node writes is untrusted (issue 36): a metrics line that is not an object, NaN and 1e12 iterations, a
    phase without its time. Before: AttributeError, MemoryError and a goodput KeyError left the ledger `running`."""
    nodes = soak.nodes
    nodes.metrics += [[1], {"iteration": float("nan"), "time": 1.0, "loss": 1.0},
                      {"iteration": 10**12, "time": 1.0, "loss": 1.0}]
    nodes.phases.append({"phase": "start", "pid": 4242})  # no time
    assert soak.run() is None
    assert soak.attempts() == ["passed"] and soak.stage() == "passed"
    (bad,) = {e["message"] for e in soak.events("node_data")}
    assert "metrics.jsonl: 3 bad record(s)" in bad and "phases.jsonl: 1 bad record(s)" in bad
    assert soak.events("goodput")  # the goodput step read the phases it could
    _nothing_running(soak)
