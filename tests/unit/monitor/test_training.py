"""Training judgements: a stale heartbeat is a hang on that rank, NaN loss fails, spikes and stragglers warn;
a steady run raises nothing."""

from __future__ import annotations

from stepdeploy.monitor.model import MonitorLimits, Severity
from stepdeploy.monitor.training import judge_training

from . import faults

T0 = 1_800_000_000.0


def _sample(now, beats=None, states=None, rows=None):
    out = faults.clock(faults.recorded(1), now)
    out = faults.with_section(out, "heartbeats", faults.heartbeats(beats or {}))
    out = faults.with_section(out, "statuses", faults.statuses(states or {}))
    return faults.parse(faults.with_section(out, "metrics", faults.metrics(rows or [])))


def _found(prev, cur, limits=None):
    return [(f.kind, f.severity, f.subject) for f in judge_training(prev, cur, limits)]


def test_steady_training_raises_nothing():
    running = {0: "running", 1: "running", 2: "running", 3: "running"}
    prev = _sample(T0, {r: (20, T0 - 1) for r in range(4)}, running, faults.steady_rows(20))
    cur = _sample(T0 + 5, {r: (30, T0 + 4) for r in range(4)}, running, faults.steady_rows(30))
    assert judge_training(prev, cur) == []


def test_stale_heartbeat_is_a_hang_on_that_rank():
    states = {0: "running", 1: "running"}
    prev = _sample(T0, {0: (10, T0 - 1), 1: (10, T0 - 1)}, states)
    cur = _sample(T0 + 200, {0: (50, T0 + 199), 1: (10, T0 - 1)}, states)
    findings = judge_training(prev, cur)
    assert [(f.kind, f.severity, f.subject) for f in findings] == [("hang", Severity.FAIL, "rank 1")]
    assert "no heartbeat for 201 s (timeout 180 s), stuck after iteration 10 (pid 1001)" in findings[0].message
    later = _sample(T0 + 210, {0: (51, T0 + 209), 1: (10, T0 - 1)}, states)
    assert judge_training(cur, later) == []  # reported once, when it crossed the timeout
    assert _found(prev, cur, MonitorLimits(heartbeat_timeout_s=300)) == []


def test_an_exited_rank_with_an_old_heartbeat_is_not_a_hang():
    prev = _sample(T0, {0: (10, T0 - 1)}, {0: "running"})
    cur = _sample(T0 + 500, {0: (10, T0 - 1)}, {0: "exited"})
    assert judge_training(prev, cur) == []


def test_nan_loss_fails():
    rows = faults.steady_rows(20)
    prev = _sample(T0, rows=rows)
    cur = _sample(T0 + 5, rows=[*rows, (21, float("nan"), 1.0, [0.5] * 4), (22, 2.3, 1.0, [0.5] * 4)])
    findings = judge_training(prev, cur)
    assert [(f.kind, f.severity, f.subject) for f in findings] == [("loss", Severity.FAIL, "training")]
    assert findings[0].message == "loss nan at iteration 21"


def test_loss_spike_warns_only_with_enough_history():
    rows = faults.steady_rows(20)
    spike = (21, 9.0, 1.0, [0.5] * 4)
    findings = judge_training(_sample(T0, rows=rows), _sample(T0 + 5, rows=[*rows, spike]))
    assert [(f.kind, f.severity) for f in findings] == [("loss", Severity.WARN)]
    assert "loss spike 9 > 3 x running median" in findings[0].message and "iteration 21" in findings[0].message
    short = rows[:5]
    assert judge_training(_sample(T0, rows=short), _sample(T0 + 5, rows=[*short, spike])) == []


def test_grad_norm_inf_fails_and_large_warns():
    rows = faults.steady_rows(20)
    cur = _sample(T0 + 5, rows=[*rows, (21, 2.4, float("inf"), [0.5] * 4), (22, 2.4, 250.0, [0.5] * 4)])
    assert _found(_sample(T0, rows=rows), cur) == [("grad_norm", Severity.FAIL, "training"),
                                                   ("grad_norm", Severity.WARN, "training")]


def test_straggler_is_the_slow_rank():
    rows = faults.steady_rows(20)
    slow = [(i, 2.4, 1.0, [0.50, 0.51, 0.50, 0.80]) for i in range(21, 25)]
    findings = judge_training(_sample(T0, rows=rows), _sample(T0 + 5, rows=[*rows, *slow]))
    assert [(f.kind, f.severity, f.subject) for f in findings] == [("straggler", Severity.WARN, "rank 3")]
    assert "mean step time 0.800 s > 1.2 x the ranks' median 0.505 s over 4 steps" in findings[0].message
    assert judge_training(_sample(T0, rows=rows), _sample(T0 + 5, rows=[*rows, *slow[:2]])) == []  # too few
