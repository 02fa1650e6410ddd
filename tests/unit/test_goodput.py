"""Goodput of a soak from hand-built metrics, phases, attempts and events (every figure worked out by hand in the
comments: the soak's timeline, second by second)."""

from __future__ import annotations

from typing import Any

import pytest

from stepdeploy.rollout.goodput import LiveGoodput, breakdown, counted


def _phase(name: str, time: float, pid: int, **data: Any) -> dict[str, Any]:
    return {"phase": name, "time": time, "pid": pid, **data}


def _steps(first: int, last: int, began: float, first_step_s: float, step_s: float,
           saves: dict[int, float] | None = None) -> tuple[list[dict[str, Any]], list[dict[str, Any]], float]:
    """Metrics lines of iterations first..last from `began` (the first step takes first_step_s, the rest
    step_s), and `save` phases after the iterations in `saves` ({iteration: seconds it blocks})."""
    lines, saved, t = [], [], began
    for it in range(first, last + 1):
        t += first_step_s if it == first else step_s
        lines.append({"iteration": it, "step_time_s": first_step_s if it == first else step_s, "time": t})
        if it in (saves or {}):
            saved.append(_phase("save", t + saves[it], 0, iteration=it, began=t))
            t += saves[it]
    return lines, saved, t


def _start(pid: int, start: float, initialized: float, model: float, resumed: float, resumed_from: int,
           first_step: float, step_s: float, iteration: int) -> list[dict[str, Any]]:
    return [_phase("start", start, pid), _phase("initialized", initialized, pid), _phase("model", model, pid),
            _phase("resumed", resumed, pid, iteration=resumed_from, load_s=0.1),
            _phase("first_step", first_step, pid, iteration=iteration, step_s=step_s)]


def _clean(saves: dict[int, float] | None = None) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    # soak 1000 -> 1100; attempt launched at 1002; the process starts at 1004, its process group is up at 1006,
    # the model built at 1007, nothing to resume at 1007.5; its first step runs 1008 -> 1011 (3 s), then 40 steps
    # of 2 s: 1011 -> 1091 (+ the saves)
    lines, saved, _ = _steps(1, 41, 1008.0, 3.0, 2.0, saves)
    return lines, _start(7, 1004.0, 1006.0, 1007.0, 1007.5, 0, 1011.0, 3.0, 1) + saved


ATTEMPT = [{"number": 1, "started": 1002.0, "status": "passed"}]


def test_a_clean_soak() -> None:
    lines, phases = _clean()
    g = breakdown(1000.0, 1100.0, lines, phases, ATTEMPT, [])
    # steady step 2 s; the first step's extra 1 s goes to start-up: productive 2 + 40 x 2 = 82
    assert (g.steady_step_s, g.iterations, g.productive_s, g.ratio) == (2.0, 41, 82.0, 0.82)
    (start,) = g.starts
    # launch 1000 -> 1004 (render, SSH, torchrun), imports 1004 -> 1006, model 1006 -> 1007, load -> 1007.5,
    # set-up -> 1008, the first step's extra 1 s
    assert start.parts == {"launch": 4.0, "imports_init": 2.0, "model_build": 1.0, "checkpoint_load": 0.5,
                           "setup": 0.5, "first_step_extra": 1.0}
    assert (start.began, start.first_step, start.resumed_from) == (1000.0, 1008.0, 0)
    # the last step ends at 1091: 9 s to the end is other
    assert g.parts == {"productive": 82.0, "startup": 9.0, "checkpoint": 0.0, "failures": 0.0, "redone": 0.0,
                       "other": 9.0}
    assert (g.saves, g.failures, g.redone, g.overrun_s) == (0, [], 0, 0.0)
    data = g.to_json()
    assert data["wall_s"] == 100.0 and data["shares"]["startup"] == 0.09
    assert data["startup_parts"]["launch"] == 4.0 and data["failure_parts"] == {"detection": 0.0, "stop": 0.0,
                                                                                "restart": 0.0}


def test_a_soak_with_saves() -> None:
    lines, phases = _clean({10: 1.5, 20: 1.5, 30: 1.5, 40: 1.5})
    g = breakdown(1000.0, 1100.0, lines, phases, ATTEMPT, [])
    assert (g.saves, g.checkpoint_s, g.max_save_s) == (4, 6.0, 1.5)
    assert g.parts == {"productive": 82.0, "startup": 9.0, "checkpoint": 6.0, "failures": 0.0, "redone": 0.0,
                       "other": 3.0}
    assert "checkpoint saves 6.0 s (4)" in g.describe()


def test_a_kill_and_a_restart_from_the_checkpoint() -> None:
    # attempt 1 (launched 2001): starts at 2003, up 2004, model 2005, resumed (nothing) 2005.5; first step 3 s
    # ends 2008.5; steps 2-12 of 2 s, checkpoint 10 saved 2026.5 -> 2027.5; iteration 12 ends 2031.5
    lines1, saves1, _ = _steps(1, 12, 2005.5, 3.0, 2.0, {10: 1.0})
    phases = _start(10, 2003.0, 2004.0, 2005.0, 2005.5, 0, 2008.5, 3.0, 1) + saves1
    # kill injected at 2032, detected at 2034, everything stopped at 2040, attempt 2 launched at 2050
    events = [{"kind": "inject", "ts": 2032.0, "data": {"time": 2032.0}},
              {"kind": "detected", "ts": 2034.1, "data": {"kind": "crash", "time": 2034.0}},
              {"kind": "failure", "ts": 2034.5, "data": {"kind": "crash", "iteration": 12}},
              {"kind": "stop", "ts": 2040.0, "data": {"ok": True}},
              {"kind": "restart", "ts": 2041.0, "data": {"restart": 1, "time": 2041.0}}]
    # attempt 2: starts 2052, up 2053, model 2054, checkpoint 10 loaded at 2056; first step (iteration 11) 4 s
    # ends 2060; steps 12-50 of 2 s with checkpoint 20 saved 2078 -> 2079; iteration 50 ends 2139
    lines2, saves2, end = _steps(11, 50, 2056.0, 4.0, 2.0, {20: 1.0})
    phases += _start(11, 2052.0, 2053.0, 2054.0, 2056.0, 10, 2060.0, 4.0, 11) + saves2
    attempts = [{"number": 1, "started": 2001.0, "status": "failed"},
                {"number": 2, "started": 2050.0, "status": "passed"}]
    g = breakdown(2000.0, 2200.0, lines1 + lines2, phases, attempts, events)
    assert end == 2139.0
    # iterations 11 and 12 of attempt 1 were thrown away by the restart from checkpoint 10
    assert (g.redone, g.redone_s, g.iterations) == (2, 4.0, 50)
    # productive: 1 (3 - 1) + 2-10 (18) + 11 (4 - 2) + 12-50 (78)
    assert (g.productive_s, g.ratio) == (100.0, 0.5)
    assert [s.parts for s in g.starts] == [
        {"launch": 3.0, "imports_init": 1.0, "model_build": 1.0, "checkpoint_load": 0.5, "setup": 0.0,
         "first_step_extra": 1.0},
        {"launch": 2.0, "imports_init": 1.0, "model_build": 1.0, "checkpoint_load": 2.0, "setup": 0.0,
         "first_step_extra": 2.0}]
    assert [s.resumed_from for s in g.starts] == [0, 10]
    (failure,) = g.failures
    # the injection at 2032 (after the last step's end at 2031.5) -> detected 2034 -> stopped 2040 -> launch 2050
    assert (failure.kind, failure.failed_at, failure.stopped_at, failure.restarted_at) == ("crash", 2032.0, 2040.0,
                                                                                           2050.0)
    assert failure.parts == {"detection": 2.0, "stop": 6.0, "restart": 10.0}
    # other: 2031.5 -> 2032 and 2139 -> 2200
    assert g.parts == {"productive": 100.0, "startup": 14.5, "checkpoint": 2.0, "failures": 18.0, "redone": 4.0,
                       "other": 61.5}


def test_a_failure_without_an_injection_dates_from_the_last_step_and_may_end_the_soak() -> None:
    lines, phases = _clean()
    events = [{"kind": "detected", "ts": 1095.0, "data": {"kind": "hang"}},
              {"kind": "stop", "ts": 1097.0, "data": {}}]
    g = breakdown(1000.0, 1100.0, lines, phases, [{"number": 1, "started": 1002.0, "status": "failed"}], events)
    # the last step ended at 1091; no restart followed: the stop to the end is the restart's
    assert g.failures[0].parts == {"detection": 4.0, "stop": 2.0, "restart": 3.0}
    assert g.failures[0].restarted_at is None and g.parts["other"] == 0.0


def test_parts_beyond_the_wall_are_an_overrun_not_a_negative_remainder() -> None:
    lines, phases = _clean()
    g = breakdown(1000.0, 1085.0, lines, phases, ATTEMPT, [])  # a controller clock 6 s behind the node's
    assert g.parts["other"] == 0.0 and g.overrun_s == 6.0
    assert "exceed the wall by 6.0 s" in g.describe()


def test_runs_count_unless_a_later_run_goes_back_to_them() -> None:
    assert counted([1, 2, 3, 4, 3, 4, 5]) == [True, True, False, False, True, True, True]
    assert counted([1, 2, 5, 6, 3]) == [True, True, False, False, True]  # a restart never caught up: still lost
    assert counted([]) == []


def test_nothing_ran() -> None:
    g = breakdown(5.0, 5.0, [], [], [], [])
    assert g.ratio is None and g.productive_s == 0.0 and g.steady_step_s is None


def test_the_live_ratio_from_fetched_lines_and_polled_ones() -> None:
    lines, _, _ = _steps(1, 12, 2005.5, 3.0, 2.0)
    live = LiveGoodput(2000.0, lines)
    assert live.productive == 25.0  # 3 + 11 x 2
    live.observe({"iteration": 11, "step_time_s": 4.0})  # the restart from checkpoint 10: 11 and 12 dropped
    assert live.productive == 25.0 - 4.0 + 4.0
    live.observe({"iteration": 15, "step_time_s": 2.0})  # 12-15 at the polled step time
    live.observe({"iteration": 15, "step_time_s": 2.0})  # the same line on the next poll
    assert live.productive == 33.0
    live.observe({"iteration": 20, "step_time_s": 2.0, "loss": 3.0})
    live.observe({"iteration": None})
    assert live.ratio(2100.0) == pytest.approx(0.43) and live.ratio(2000.0) is None


class _QuietMonitor:
    """A monitor that finds nothing (the soak's Watch asks it every poll)."""

    def __init__(self) -> None:
        self.findings: list = []

    def maybe_collect(self, status: object, now: float) -> list:
        return []

    def proc_states(self) -> dict:
        return {}


def test_every_poll_updates_the_live_ratio_and_the_view_shows_it() -> None:
    import time
    from types import SimpleNamespace

    from stepdeploy.remote.executor import NodeStatus, RankStatus, RunStatus
    from stepdeploy.rollout.attempt import Live
    from stepdeploy.rollout.clock import REAL
    from stepdeploy.rollout.stages.soak import Watch
    from stepdeploy.rollout.view import figures

    live = Live(stage="soak", rung="target", last={"iteration": 4, "step_time_s": 2.0, "loss": 3.5})
    service = SimpleNamespace(live=live, config=SimpleNamespace(heartbeat_timeout_s=180.0), clock=REAL)
    watch = Watch(service, _QuietMonitor(), None, LiveGoodput(time.time() - 20.0, []))  # type: ignore[arg-type]
    healthy = RunStatus((NodeStatus("node1", "running", None, (RankStatus(0, "node1", 7, "running", iteration=4,
                                                                          heartbeat_age_s=1.0),)),))
    assert watch.check(healthy) is None
    assert live.goodput == pytest.approx(8.0 / 20.0, abs=0.01)  # iterations 1-4 at 2 s in 20 s
    assert figures(live) == "loss 3.5000, step 2.000 s, goodput 40%"
