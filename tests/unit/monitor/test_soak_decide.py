"""The soak's pure decisions: when a run in flight has failed (and how), collection rounds judged per node,
progress between restarts, and a link flap seen only in carrier_down_count."""

from __future__ import annotations

from stepdeploy.monitor.model import Finding, Severity
from stepdeploy.remote.executor import EXITED, RUNNING, UNREACHABLE, NodeStatus, RankStatus, RunStatus
from stepdeploy.rollout import monitors
from stepdeploy.rollout.stages.soak import stalled_restarts

from . import faults


def _status(*ranks: RankStatus, node_states: dict[str, str] | None = None) -> RunStatus:
    states = node_states or {}
    nodes = sorted({r.node for r in ranks} | set(states))
    return RunStatus(tuple(NodeStatus(n, states.get(n, RUNNING), ranks=tuple(r for r in ranks if r.node == n))
                           for n in nodes))


def _rank(rank: int, state: str = RUNNING, code: int | None = None, age: float = 1.0, it: int = 10) -> RankStatus:
    return RankStatus(rank, f"node{rank + 1}", 100 + rank, state, code, iteration=it, heartbeat_age_s=age)


def test_healthy_run_is_not_a_failure():
    assert monitors.decide(_status(_rank(0), _rank(1)), [], 60) is None


def test_died_rank_is_a_crash_at_once():
    verdict = monitors.decide(_status(_rank(0), _rank(1, "died")), [], 60)
    assert verdict is not None and (verdict.kind, verdict.rank, verdict.node) == ("crash", 1, "node2")


def test_collective_exits_wait_while_another_rank_runs_then_a_stale_heartbeat_is_a_hang():
    waiting = _status(_rank(0, age=40, it=7), _rank(1, EXITED, code=3), node_states={"node2": EXITED})
    assert monitors.decide(waiting, [], 60) is None  # rank 0 may be the stuck one: not "link" yet
    stuck = _status(_rank(0, age=61, it=7), _rank(1, EXITED, code=3), node_states={"node2": EXITED})
    verdict = monitors.decide(stuck, [], 60)
    assert verdict is not None and (verdict.kind, verdict.rank) == ("hang", 0)


def test_hang_culprit_is_the_stopped_rank_not_its_waiting_peer():
    both = _status(_rank(0, age=17, it=27), _rank(1, age=17.4, it=27))
    plain = monitors.decide(both, [], 15)
    assert plain is not None and (plain.kind, plain.rank) == ("hang", 1)  # heartbeats alone: a coin toss
    verdict = monitors.decide(both, [], 15, {0: "T", 1: "S"})
    assert verdict is not None and (verdict.kind, verdict.rank, verdict.node) == ("hang", 0, "node1")
    assert "is stopped (T) while its peers wait" in verdict.evidence[0]
    assert monitors.decide(both, [], 15, {0: "S", 1: "D"}).rank == 1


def test_probe_reads_each_ranks_process_state():
    from stepdeploy.monitor import probe

    spec = probe.ProbeSpec(run_dir="/r")
    assert "/proc/$pid/stat" in probe.commands(spec)["procs"]
    out = faults.with_section(faults.recorded(1), "procs", "rank0 84 T\nrank1 81 S\njunk")
    assert probe.parse(out, "n", spec, 0.0).rank_proc_states == {0: "T", 1: "S"}


def test_collective_exits_everywhere_are_link():
    ended = _status(_rank(0, EXITED, code=3), _rank(1, EXITED, code=3),
                    node_states={"node1": EXITED, "node2": EXITED})
    verdict = monitors.decide(ended, [], 60)
    assert verdict is not None and verdict.kind == "link"


def test_link_finding_and_lost_node_act_at_once():
    down = Finding("link", Severity.FAIL, "eth0", "interface up -> down", node="node2")
    verdict = monitors.decide(_status(_rank(0), _rank(1)), [down], 60)
    assert verdict is not None and (verdict.kind, verdict.node) == ("link", "node2")
    lost = _status(_rank(0), node_states={"node2": UNREACHABLE})
    verdict = monitors.decide(lost, [], 60)
    assert verdict is not None and (verdict.kind, verdict.node) == ("node-loss", "node2")
    assert monitors.unreachable_nodes(lost) == ["node2"]


def test_progress_and_stalled_restarts():
    assert monitors.progress_iteration(_status(_rank(0, it=12), _rank(1, it=11))) == 12
    assert stalled_restarts([]) == 0
    assert stalled_restarts([30, 45]) == 0
    assert stalled_restarts([30, 30]) == 1
    assert stalled_restarts([30, 12, None]) == 2
    assert stalled_restarts([30, 12, 40]) == 0


def test_judge_round_compares_each_node_with_its_own_previous_sample():
    first, second = faults.parse(faults.recorded(1), "a"), faults.parse(faults.recorded(2), "a")
    down = faults.parse(faults.set_operstate(faults.recorded(2), "eth0", "down"), "b")
    assert monitors.judge_round({}, [first], monitors.MonitorLimits()) == []  # a first sample judges nothing
    found = monitors.judge_round({"a": first, "b": first}, [second, down], monitors.MonitorLimits())
    assert [(f.node, f.kind, f.subject) for f in found] == [("b", "link", "eth0")]


def _flaps(count: int, operstate: str = "up"):
    body = faults.section(faults.recorded(2), "net") + f"\neth0/carrier_down_count:{count}"
    return faults.parse(faults.set_operstate(faults.with_section(faults.recorded(2), "net", body), "eth0", operstate))


def test_link_that_went_down_and_up_between_samples_is_a_link_warning_from_the_judge():
    before, after = _flaps(0), _flaps(2)
    assert before.netdevs[0].stats["carrier_down_count"] == 0 and after.netdevs[0].operstate == "up"
    found = monitors.judge_round({"h200": before}, [after], monitors.MonitorLimits())
    assert [(f.kind, f.severity, f.subject) for f in found] == [("link", Severity.WARN, "eth0")]
    assert "went down 2 time(s)" in found[0].message
    assert monitors.judge_round({"h200": after}, [after], monitors.MonitorLimits()) == []
    # still down: a failure, whatever the run does
    down = monitors.judge_round({"h200": before}, [_flaps(1, "down")], monitors.MonitorLimits())
    assert {(f.kind, f.severity) for f in down} == {("link", Severity.FAIL)} and len(down) == 2


def test_a_flap_the_run_trained_through_is_a_warning_not_a_restart():
    """Issue 36 item 7: a 20 s blip that TCP rode out (heartbeats within the timeout, no collective failed)."""
    flap = monitors.judge_round({"h200": _flaps(0)}, [_flaps(1)], monitors.MonitorLimits())
    training = _status(_rank(0, age=35.0), _rank(1, age=34.0))  # the stall of the blip, under the 60 s timeout
    graded = monitors.grade_flaps(flap, training, 60)
    assert [(f.kind, f.severity) for f in graded] == [("link", Severity.WARN)]
    assert "the run trained on" in graded[0].message and "a warning, no restart" in graded[0].message
    assert monitors.fail_findings(graded) == []
    assert monitors.decide(training, monitors.fail_findings(graded), 60) is None


def test_a_flap_with_ranks_failing_is_a_link_failure_at_once():
    flap = monitors.judge_round({"h200": _flaps(0)}, [_flaps(1)], monitors.MonitorLimits())
    for failing in (_status(_rank(0), _rank(1, EXITED, code=3), node_states={"node2": EXITED}),  # collective failed
                    _status(_rank(0, age=61.0), _rank(1, age=61.0))):  # stuck past the timeout
        graded = monitors.grade_flaps(flap, failing, 60)
        assert [(f.kind, f.severity) for f in graded] == [("link", Severity.FAIL)], failing
        assert "the run did not train on: rank " in graded[0].message
        verdict = monitors.decide(failing, monitors.fail_findings(graded), 60)
        assert verdict is not None and (verdict.kind, verdict.node) == ("link", "h200"), verdict
        assert verdict.evidence[0].startswith("monitor: h200 eth0: link went down 1 time(s)")


def test_grading_leaves_other_findings_alone():
    down = Finding("link", Severity.FAIL, "eth0", "interface up -> down", node="node2")
    drops = Finding("netdev", Severity.WARN, "eth0", "rx_dropped +500", node="node2")
    assert monitors.grade_flaps([down, drops], _status(_rank(0), _rank(1)), 60) == [down, drops]


def test_standin_nvidia_smi_answers_the_monitors_query(tmp_path):
    import shutil
    import subprocess

    from stepdeploy.monitor import parse_gpu

    for csv in faults.SHARED.glob("*.csv"):
        shutil.copy(csv, tmp_path)
    command = parse_gpu.query_command().replace("nvidia-smi", f"sh {faults.SHARED / 'nvidia-smi-standin.sh'}", 1)
    res = subprocess.run(command, shell=True, capture_output=True, text=True,
                         env={"NVIDIA_SMI_FIXTURES": str(tmp_path), "PATH": "/usr/bin:/bin"})
    assert res.returncode == 0, res.stderr
    gpus = parse_gpu.parse_query_csv(res.stdout)
    assert [(g.index, g.bus_id, g.remap_pending) for g in gpus] == [(0, "00000000:00:06.0", False),
                                                                  (1, "00000000:00:07.0", False)]
