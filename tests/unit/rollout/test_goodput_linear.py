"""Goodput's breakdown is linear in the restarts (issue 36 item 3; the walk's step counts: test_goodput_walk.py) and
gives exactly what the earlier, quadratic one gave: `reference_breakdown` below is that one, kept as the reference,
and both are run on soaks of 0, 1 and many restarts built at random (with noise: a node's clock behind the
controller's, reused pids, lines without a time, first steps naming another iteration, detections without a time,
missing stops) and on free-form rows full of ties. The timing is bench/goodput_restarts.py's (docs/benchmarks.md),
not a test's."""

from __future__ import annotations

import random
from typing import Any
from unittest.mock import patch

from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from stepdeploy.rollout import goodput
from stepdeploy.rollout.goodput import (
    LAUNCH_SLACK_S,
    FailureCost,
    Goodput,
    StartCost,
    _num,
    _starts,
    _time,
)

Rows = list[dict[str, Any]]
Soak = tuple[float, float, Rows, Rows, Rows, Rows]


# --- the reference: goodput.py's breakdown before issue 36 item 3 (each start and each failure scanned every line,
# launch and stop: quadratic in the restarts) ----------------------------------------------------------------------
def reference_breakdown(started: float, ended: float, metrics: Rows, phases: Rows, attempts: Rows,
                        events: Rows) -> Goodput:
    """goodput.breakdown with its three lookups as they were (below): nothing else of it changed."""
    with patch.multiple(goodput, _first_step_lines=_ref_first_step_lines, _start_costs=_ref_start_costs,
                        _failures=_ref_failures):
        return goodput.breakdown(started, ended, metrics, phases, attempts, events)


def _ref_first_step_lines(lines: Rows, groups: list[dict[str, dict[str, Any]]]) -> dict[int, int]:
    found = {}
    for g, group in enumerate(groups):
        first = group.get("first_step")
        same = [i for i, m in enumerate(lines) if first is not None and m["iteration"] == first.get("iteration")]
        if first is not None and same:
            found[min(same, key=lambda i: abs(float(lines[i].get("time") or 0.0) - float(first["time"])))] = g
    return found


def _ref_start_costs(groups: list[dict[str, dict[str, Any]]], launches: list[float], steady: float | None
                     ) -> list[StartCost]:
    costs, used = [], set()
    for group in groups:
        t0 = float(group["start"]["time"])
        launch = max((x for x in launches if x <= t0 + LAUNCH_SLACK_S), default=t0)
        launch = t0 if launch in used else launch
        used.add(launch)
        marks = [("launch", launch), ("imports_init", t0), ("model_build", _time(group, "initialized")),
                 ("checkpoint_load", _time(group, "optimizer") or _time(group, "model")),
                 ("setup", _time(group, "resumed"))]
        first = group.get("first_step")
        began = float(first["time"]) - float(first.get("step_s") or 0.0) if first else None
        parts: dict[str, float] = {}
        for (name, since), (_next, until) in zip(marks, [*marks[1:], ("end", began)], strict=True):
            if since is not None and until is not None:
                parts[name] = max(0.0, until - since)
        if first is not None and steady is not None:
            parts["first_step_extra"] = max(0.0, float(first.get("step_s") or 0.0) - steady)
        resumed = group.get("resumed", {}).get("iteration")
        costs.append(StartCost(launch, began, resumed, parts))
    return costs


def _ref_failures(events: Rows, attempts: Rows, lines: Rows, phases: Rows, started: float, ended: float
                  ) -> list[FailureCost]:
    launches = sorted(float(a["started"]) for a in attempts)
    detected = [e for e in events if e["kind"] == "detected"]
    stops = sorted(float(e["ts"]) for e in events if e["kind"] == "stop")
    injected = [float(e["data"]["time"]) for e in events if e["kind"] == "inject" and _num(e["data"].get("time"))]
    seen = [float(m["time"]) for m in lines if _num(m.get("time")) is not None]
    seen += [float(p["time"]) for p in phases if _num(p.get("time")) is not None] + injected
    costs = []
    for event in detected:
        at = _num(event["data"].get("time")) or float(event["ts"])
        since = max((x for x in launches if x <= at), default=started)
        failed = max((t for t in seen if since <= t <= at), default=since)
        stopped = next((t for t in stops if t >= at), None)
        after = stopped if stopped is not None else at
        restarted = next((x for x in launches if x > after), None)
        parts = {"detection": at - failed, "stop": after - at, "restart": (restarted or ended) - after}
        costs.append(FailureCost(event["data"].get("kind"), failed, at, stopped, restarted,
                                 {k: max(0.0, v) for k, v in parts.items()}))
    return costs


# --- soaks with restarts ---------------------------------------------------------------------------------------
def soak(restarts: int, rng: random.Random, noise: bool = True) -> Soak:
    """A soak of `restarts` kills, each detected, stopped and restarted from the last checkpoint: (started, ended,
    metrics, phases, attempts, events). Times on a half-second grid (ties between nodes and controller)."""
    metrics: Rows = []
    phases: Rows = []
    attempts: Rows = []
    events: Rows = []
    started = t = 1000.0
    done = checkpoint = 0
    for number in range(1, restarts + 2):
        launch = t + rng.choice([0.0, 0.5, 2.0])
        attempts.append({"number": number, "started": launch, "status": "passed"})
        pid = rng.randrange(3) if noise else number
        t = launch + rng.choice([-1.0, 1.5, 2.0])  # -1: the node's clock behind the controller's
        phases.append({"phase": "start", "time": t, "pid": pid})
        for name in ("initialized", "model", "optimizer", "resumed"):
            if not noise or rng.random() < 0.8:
                t += rng.choice([0.0, 0.5, 1.0])
                extra = {"iteration": checkpoint} if name == "resumed" else {}
                phases.append({"phase": name, "time": t, "pid": pid, **extra})
        done = checkpoint
        for step in range(rng.randint(0 if noise else 1, 6)):
            done += 1
            step_s = rng.choice([1.0, 2.0, 2.0, 3.5])
            t += step_s
            line: dict[str, Any] = {"iteration": done, "step_time_s": step_s, "time": t}
            if noise and rng.random() < 0.1:
                del line["time"]
            metrics.append(line)
            if noise and rng.random() < 0.05:
                metrics.append(dict(line))  # the same line twice
            if step == 0:
                first = {"phase": "first_step", "time": t, "pid": pid, "iteration": done, "step_s": step_s}
                if noise and rng.random() < 0.15:
                    first["iteration"] = rng.choice([done - 1, done + 1, None])
                if noise and rng.random() < 0.1:
                    del first["step_s"]
                phases.append(first)
            if rng.random() < 0.3:
                save_s = rng.choice([0.5, 1.0])
                phases.append({"phase": "save", "time": t + save_s, "pid": pid, "iteration": done, "began": t})
                t, checkpoint = t + save_s, done
        if number <= restarts:
            t = _failure(events, t, number, rng, noise)
    ended = t + rng.choice([0.0, 5.0])
    return started, ended, metrics, phases, attempts, events


def _failure(events: Rows, t: float, number: int, rng: random.Random, noise: bool) -> float:
    if rng.random() < 0.7:
        t += rng.choice([0.5, 1.0])
        events.append({"kind": "inject", "ts": t, "data": {"time": t}})
    t += rng.choice([0.5, 2.0, 3.0])
    when = {"time": t} if not noise or rng.random() < 0.8 else {}
    events.append({"kind": "detected", "ts": t + 0.1, "data": {"kind": rng.choice(["crash", "hang"]), **when}})
    if not noise or rng.random() < 0.9:
        t += rng.choice([1.0, 6.0])
        events.append({"kind": "stop", "ts": t, "data": {"ok": True}})
    events.append({"kind": "restart", "ts": t + 0.5, "data": {"restart": number, "time": t + 0.5}})
    return t + 1.0


def _outcome(function: Any, args: Soak) -> str:
    """repr of the result (every field, -0.0 and NaN included), or the exception's type and message."""
    try:
        return repr(function(*args))
    except Exception as exc:  # the same bad row must fail the same way in both
        return f"raised {type(exc).__name__}: {exc}"


def _same(args: Soak) -> None:
    assert _outcome(goodput.breakdown, args) == _outcome(reference_breakdown, args)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(restarts=st.integers(0, 40), seed=st.integers(0, 2**32 - 1), noise=st.booleans())
@example(restarts=0, seed=1, noise=False)
@example(restarts=1, seed=2, noise=False)
@example(restarts=1, seed=3, noise=True)
def test_soaks_with_restarts_match_the_reference(restarts: int, seed: int, noise: bool) -> None:
    _same(soak(restarts, random.Random(seed), noise))


def test_many_restarts_match_the_reference() -> None:
    for seed, restarts in ((11, 300), (12, 600)):
        args = soak(restarts, random.Random(seed))
        _same(args)
        assert len(goodput.breakdown(*args).failures) == restarts


# --- free-form rows: ties, duplicate iterations, missing and odd values -------------------------------------------


def _rarely(odd: st.SearchStrategy[Any], usual: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    """`odd` once in five draws, else `usual`."""
    return st.integers(0, 4).flatmap(lambda k: odd if k == 0 else usual)


def _with(key: str, values: st.SearchStrategy[Any]) -> st.SearchStrategy[dict[str, Any]]:
    """{key: value}, or {} (the key missing) once in five."""
    return _rarely(st.just({}), values.map(lambda v: {key: v}))


GRID = st.integers(0, 12).map(lambda x: 1000.0 + x / 2)  # half seconds: ties everywhere
TIME = _rarely(st.one_of(st.floats(990.0, 1010.0), st.sampled_from([0.0, -0.0])), GRID)
ODD_TIME = _rarely(st.sampled_from([None, float("nan"), float("inf"), "1001.5"]), TIME)


@st.composite
def _line(draw: st.DrawFn) -> dict[str, Any]:
    return {"iteration": draw(_rarely(st.sampled_from([2.0, True]), st.integers(1, 3))),
            "step_time_s": draw(st.sampled_from([1.0, 2.0, 2.0, 0.5, float("nan")])), **draw(_with("time", ODD_TIME))}


@st.composite
def _phase(draw: st.DrawFn, pid: int, name: str) -> dict[str, Any]:
    row = {"phase": name, "pid": pid, "time": draw(_rarely(st.just(float("nan")), TIME))}
    if name == "save":
        row["time"] = draw(TIME)
        row |= draw(_with("began", TIME))
    if name in ("first_step", "resumed"):
        row |= draw(_with("iteration", _rarely(st.sampled_from([None, [1], 3.0, 0]), st.integers(1, 3))))
    if name == "first_step":
        row |= draw(_with("step_s", st.sampled_from([0.5, 1.0, 2.5])))
    return row


@st.composite
def _phases(draw: st.DrawFn) -> Rows:
    """Runs of one pid's phases, most after a `start` of it."""
    rows: Rows = []
    for _ in range(draw(st.integers(0, 8))):
        pid = draw(st.integers(0, 2))
        names = draw(st.lists(st.sampled_from(["initialized", "model", "optimizer", "resumed", "first_step",
                                               "first_step", "first_step", "save"]), min_size=1, max_size=4))
        rows += [draw(_phase(pid, name)) for name in ["start"] * (draw(st.integers(0, 3)) > 0) + names]
    return rows


@st.composite
def _event(draw: st.DrawFn) -> dict[str, Any]:
    kind = draw(st.sampled_from(["detected", "detected", "stop", "inject", "restart"]))
    data = draw(_with("time", st.one_of(TIME, st.none()))) if kind != "inject" else {"time": draw(TIME)}
    return {"kind": kind, "ts": draw(TIME), "data": {"kind": "crash", **data}}


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(started=TIME, ended=TIME, metrics=st.lists(_line(), min_size=2, max_size=25), phases=_phases(),
       launches=st.lists(TIME, max_size=6), events=st.lists(_event(), max_size=10))
def test_free_form_rows_match_the_reference(started: float, ended: float, metrics: Rows, phases: Rows,
                                            launches: list[float], events: Rows) -> None:
    attempts = [{"number": n, "started": s} for n, s in enumerate(launches, 1)]
    _same((started, ended, metrics, phases, attempts, events))


def test_the_nearest_line_is_the_first_of_equally_near_ones() -> None:
    """Ties the binary search must break as min() did: equal times, and equal distances on either side."""
    lines = [{"iteration": 3, "step_time_s": 1.0, "time": t} for t in (1002.0, 1004.0, 1002.0, 1006.0, 1004.0)]
    phases = [{"phase": "start", "time": 1000.0, "pid": 1},
              {"phase": "first_step", "time": 1004.0, "pid": 1, "iteration": 3, "step_s": 1.0},
              {"phase": "start", "time": 1001.0, "pid": 2},
              {"phase": "first_step", "time": 1003.0, "pid": 2, "iteration": 3, "step_s": 1.0},
              {"phase": "start", "time": 1002.0, "pid": 3},
              {"phase": "first_step", "time": 1005.0, "pid": 3, "iteration": 3, "step_s": 1.0},
              {"phase": "start", "time": 1003.0, "pid": 4},
              {"phase": "first_step", "time": 1007.0, "pid": 4, "iteration": 3.0, "step_s": 1.0}]
    groups = _starts(phases)
    # 1004: lines 1 and 4 -> 1; 1003: 1002 (0, 2) and 1004 (1, 4) -> 0; 1005: 1004 (1, 4), 1006 (3) -> 1; 1007: 3
    assert goodput._first_step_lines(lines, groups) == _ref_first_step_lines(lines, groups) == {1: 2, 0: 1, 3: 3}
