"""Goodput of a soak: how much of its wall time trained, and where the rest went (pure: rows in, figures out).

The wall is the soak stage's first start to its end (or now). It splits into:

- productive: the step time of every iteration whose result survived (a run of an iteration counts unless a later
  start resumed from a checkpoint before it), a start's first step counted at a steady step at most;
- start-up, per start of the workload: from its launch (the attempt's start in the ledger; the soak's own start
  for the first, so rendering counts) to its first step's start, split by out/phases.jsonl into launch (render,
  SSH, the launcher, interpreter), imports + process group, model build (+ optimizer), checkpoint load, data set-up,
  plus the first step's cost above a steady step;
- checkpoint stalls: every save's blocking time (`save` phase: time - began);
- failures, per `detected` event: detection (the failure -- the last step, phase or injection of the attempt
  before it -- to its detection), stop (detection to the soak's `stop` event), restart (the stop to the next
  launch, or to the soak's end when none followed);
- redone: the step time of the runs a restart threw away (each had to be, or has to be, run again);
- other: the remainder (between steps, controller polls, the end); never negative: when the parts add up to more
  than the wall (the nodes' clocks and the controller's disagree) the excess is reported as `overrun_s`.

Times of metrics and phases come from rank 0's node, those of attempts and events from the controller.
The cost is linear in the lines, phases, attempts and events: every "the last before" and "the next after" is one
forward walk of a time-ordered list over the starts' (or the failures') times in order, two pointers that only move
on (a start's first step is looked up among the lines of its iteration, a dict built in one pass). Both sides come in
time order -- the ledger returns attempts and events by time, a node writes its lines and phases as its clock goes --
and sorted() takes a list already in order in one pass; a side that is not in order (a node's clock stepped back
mid-soak, rows not written in time order) is really sorted, so such a soak costs O(n log n) with the same answers.
Nothing is ever quadratic. Caveat: the first-step lookup costs the lines of the start's iteration per start, a few
for a real soak (the runs of one iteration that restarts redid), more only when many starts name one iteration that
many lines hold.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import asdict, dataclass, field
from typing import Any

PARTS = ("productive", "startup", "checkpoint", "failures", "redone", "other")
STARTUP_PARTS = ("launch", "imports_init", "model_build", "checkpoint_load", "setup", "first_step_extra")
FAILURE_PARTS = ("detection", "stop", "restart")
LAUNCH_SLACK_S = 5.0  # a node clock a little behind the controller's must not give a start to the attempt before


class _Parted:
    parts: dict[str, float]

    @property
    def total(self) -> float:
        return sum(self.parts.values())


@dataclass(frozen=True)
class StartCost(_Parted):
    began: float  # its launch
    first_step: float | None  # when its first step began (None: it never took one)
    resumed_from: int | None
    parts: dict[str, float]


@dataclass(frozen=True)
class FailureCost(_Parted):
    kind: str | None
    failed_at: float
    detected_at: float
    stopped_at: float | None
    restarted_at: float | None  # the next launch; None: the soak ended first
    parts: dict[str, float]


@dataclass(frozen=True)
class Goodput:
    started: float
    ended: float
    productive_s: float
    iterations: int  # runs that count
    steady_step_s: float | None
    starts: list[StartCost]
    saves: int
    checkpoint_s: float
    max_save_s: float | None
    failures: list[FailureCost]
    redone: int
    redone_s: float
    parts: dict[str, float] = field(default_factory=dict)  # every PARTS entry, seconds
    overrun_s: float = 0.0

    @property
    def wall_s(self) -> float:
        return self.ended - self.started

    @property
    def ratio(self) -> float | None:
        return self.productive_s / self.wall_s if self.wall_s > 0 else None

    def shares(self) -> dict[str, float | None]:
        return {name: (value / self.wall_s if self.wall_s > 0 else None) for name, value in self.parts.items()}

    def to_json(self) -> dict[str, Any]:
        data = asdict(self)
        return {**data, "wall_s": self.wall_s, "ratio": self.ratio, "shares": self.shares(),
                "startup_parts": _summed([s.parts for s in self.starts], STARTUP_PARTS),
                "failure_parts": _summed([f.parts for f in self.failures], FAILURE_PARTS)}

    def describe(self) -> str:
        ratio = "n/a" if self.ratio is None else f"{self.ratio:.1%}"
        p = self.parts
        text = (f"goodput {ratio} of {self.wall_s:.0f} s: productive {p['productive']:.1f} s "
                f"({self.iterations} iterations), start-up {p['startup']:.1f} s ({len(self.starts)} start(s)), "
                f"checkpoint saves {p['checkpoint']:.1f} s ({self.saves}), failures {p['failures']:.1f} s "
                f"({len(self.failures)}), redone {p['redone']:.1f} s ({self.redone} iterations), "
                f"other {p['other']:.1f} s")
        return text + (f"; the parts exceed the wall by {self.overrun_s:.1f} s (clock skew between the nodes and "
                       "the controller)" if self.overrun_s > 0 else "")


def _summed(parts: list[dict[str, float]], names: tuple[str, ...]) -> dict[str, float]:
    return {name: sum(p.get(name, 0.0) for p in parts) for name in names}


def counted(iterations: list[int]) -> list[bool]:
    """Whether each run (in file order) counts: no later run goes back to its iteration or before it."""
    flags, lowest = [False] * len(iterations), None
    for i in range(len(iterations) - 1, -1, -1):
        flags[i] = lowest is None or iterations[i] < lowest
        lowest = iterations[i] if lowest is None else min(lowest, iterations[i])
    return flags


def breakdown(started: float, ended: float, metrics: list[dict[str, Any]], phases: list[dict[str, Any]],
              attempts: list[dict[str, Any]], events: list[dict[str, Any]]) -> Goodput:
    """`metrics`: every line of the soak's metrics.jsonl (redone ones included), `phases`: its phases.jsonl,
    `attempts`/`events`: the soak's ledger rows."""
    lines = [m for m in metrics if _num(m.get("iteration")) is not None and _num(m.get("step_time_s")) is not None]
    keep = counted([int(m["iteration"]) for m in lines])
    groups = _starts(phases)
    firsts = _first_step_lines(lines, groups)
    steady = _median([float(m["step_time_s"]) for i, m in enumerate(lines) if keep[i] and i not in firsts]
                     or [float(m["step_time_s"]) for m in lines])
    launches = sorted(float(a["started"]) for a in attempts)[1:]  # the first start's launch: the soak's start
    starts = _start_costs(groups, [started, *launches], steady)
    # a first step's cost above a steady step is start-up's, not the step's
    extra = {i: min(starts[g].parts.get("first_step_extra", 0.0), float(lines[i]["step_time_s"]))
             for i, g in firsts.items()}
    productive = sum(float(m["step_time_s"]) - extra.get(i, 0.0) for i, m in enumerate(lines) if keep[i])
    redone = [i for i in range(len(lines)) if not keep[i]]
    redone_s = sum(float(lines[i]["step_time_s"]) - extra.get(i, 0.0) for i in redone)
    saves = [float(p["time"]) - float(p["began"]) for p in phases
             if p.get("phase") == "save" and _num(p.get("began")) is not None]
    failures = _failures(events, attempts, lines, phases, started, ended)
    parts = {"productive": productive, "startup": sum(s.total for s in starts), "checkpoint": sum(saves),
             "failures": sum(f.total for f in failures), "redone": redone_s}
    rest = (ended - started) - sum(parts.values())
    return Goodput(started, ended, productive, sum(keep), steady, starts, len(saves), sum(saves),
                   max(saves, default=None), failures, len(redone), redone_s, {**parts, "other": max(rest, 0.0)},
                   max(-rest, 0.0))


def _num(value: Any) -> float | None:
    """A finite number, else None (a NaN time or step would poison every sum it enters)."""
    ok = isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)
    return float(value) if ok else None


def _median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def _starts(phases: list[dict[str, Any]]) -> list[dict[str, dict[str, Any]]]:
    """One {phase: line} per start of the workload: a `start` line and the lines of its pid after it."""
    groups: list[dict[str, dict[str, Any]]] = []
    current: dict[Any, dict[str, dict[str, Any]]] = {}
    for line in phases:
        name, pid = line.get("phase"), line.get("pid")
        if _num(line.get("time")) is None:  # read_phases refuses such lines; a caller that did not ask it is safe too
            continue
        if name == "start":
            current[pid] = {"start": line}
            groups.append(current[pid])
        elif name != "save" and pid in current:
            current[pid].setdefault(str(name), line)
    return groups


def _first_step_lines(lines: list[dict[str, Any]], groups: list[dict[str, dict[str, Any]]]) -> dict[int, int]:
    """{metrics line index: start index} of every start's first step (its iteration, the line nearest in time;
    the first in the file of lines equally near)."""
    by_iteration: dict[Any, list[int]] = {}
    for i, m in enumerate(lines):
        by_iteration.setdefault(m["iteration"], []).append(i)
    found = {}
    for g, group in enumerate(groups):
        first = group.get("first_step")
        if first is None:
            continue
        try:
            same = by_iteration.get(first.get("iteration"))
        except TypeError:  # an unhashable iteration (a list) equals no metrics line's
            continue
        if same:  # the lines of one iteration: the ones the restarts redid, a few
            found[min(same, key=lambda i: abs(float(lines[i].get("time") or 0.0) - float(first["time"])))] = g
    return found


def _ordered(*parts: list[float]) -> list[float]:
    """The values of all parts sorted (stable: equal values keep their order, part by part), NaN left out: a NaN
    passes no comparison, so never a `max(x ... if x <= y)` or `next(x ... if x > y)`. Linear for parts in time
    order: sorted() finds a run already in order in one pass (n - 1 comparisons) and merges the parts' runs."""
    return sorted(v for part in parts for v in part if not math.isnan(v))


def _walk_order(limits: list[float]) -> list[int]:
    """The indices of `limits` (NaN ones left out: nothing compares to a NaN) in ascending order of the limit (one
    pass when they are in order already; a skewed clock's are sorted, O(m log m))."""
    return sorted((i for i, limit in enumerate(limits) if not math.isnan(limit)), key=limits.__getitem__)


def _last_at_most_each(ordered: list[float], limits: list[float]) -> list[float | None]:
    """For each limit `max(x for x in ordered if x <= limit)` of a sorted list (of equal values the first, as max()
    gives), None when there is none or the limit is NaN: one forward walk over `ordered` with the limits in order,
    each element of `ordered` passed once (n + m steps, not m binary searches)."""
    found: list[float | None] = [None] * len(limits)
    at = run = 0  # ordered[:at]: <= the limit so far; ordered[run:at]: the run of equal values just below `at`
    for i in _walk_order(limits):
        while at < len(ordered) and ordered[at] <= limits[i]:
            if at == 0 or ordered[at - 1] < ordered[at]:
                run = at
            at += 1
        if at:
            found[i] = ordered[run]
    return found


def _first_after_each(ordered: list[float], limits: list[float], *, strict: bool) -> list[float | None]:
    """For each limit `next(x for x in ordered if x > limit)` (`x >= limit` unless strict) of a sorted list, else
    None (a NaN limit too): one forward walk, as _last_at_most_each."""
    found: list[float | None] = [None] * len(limits)
    at = 0  # ordered[:at]: not after the limit so far
    for i in _walk_order(limits):
        limit = limits[i]
        while at < len(ordered) and (ordered[at] <= limit if strict else ordered[at] < limit):
            at += 1
        if at < len(ordered):
            found[i] = ordered[at]
    return found


def _start_costs(groups: list[dict[str, dict[str, Any]]], launches: list[float], steady: float | None
                 ) -> list[StartCost]:
    costs, used = [], set()
    starts = [float(group["start"]["time"]) for group in groups]
    launched = _last_at_most_each(_ordered(launches), [t0 + LAUNCH_SLACK_S for t0 in starts])
    for group, t0, found in zip(groups, starts, launched, strict=True):
        launch = t0 if found is None else found
        launch = t0 if launch in used else launch  # a second start within one attempt began on its own
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


def _time(group: dict[str, dict[str, Any]], phase: str) -> float | None:
    line = group.get(phase)
    return float(line["time"]) if line is not None else None


def _failures(events: list[dict[str, Any]], attempts: list[dict[str, Any]], lines: list[dict[str, Any]],
              phases: list[dict[str, Any]], started: float, ended: float) -> list[FailureCost]:
    launches = _ordered([float(a["started"]) for a in attempts])
    detected = [e for e in events if e["kind"] == "detected"]
    stops = _ordered([float(e["ts"]) for e in events if e["kind"] == "stop"])
    injected = [float(e["data"]["time"]) for e in events if e["kind"] == "inject" and _num(e["data"].get("time"))]
    seen = _ordered([float(m["time"]) for m in lines if _num(m.get("time")) is not None],
                    [float(p["time"]) for p in phases if _num(p.get("time")) is not None], injected)
    times = [_num(event["data"].get("time")) or float(event["ts"]) for event in detected]
    # the launch before each detection, the last thing seen up to it (if after that launch), the stop after it
    sinces, lasts = _last_at_most_each(launches, times), _last_at_most_each(seen, times)
    stops_after = _first_after_each(stops, times, strict=False)
    afters = [at if stopped is None else stopped for at, stopped in zip(times, stops_after, strict=True)]
    restarts = _first_after_each(launches, afters, strict=True)  # the next launch after the stop
    costs = []
    for event, at, found, last, stopped, after, restarted in zip(detected, times, sinces, lasts, stops_after, afters,
                                                                  restarts, strict=True):
        since = started if found is None else found
        failed = last if last is not None and since <= last else since
        parts = {"detection": at - failed, "stop": after - at, "restart": (restarted or ended) - after}
        costs.append(FailureCost(event["data"].get("kind"), failed, at, stopped, restarted,
                                 {k: max(0.0, v) for k, v in parts.items()}))
    return costs


class LiveGoodput:
    """The effective ratio while the soak runs, from what the controller has anyway: the metrics lines it
    fetched at the end of the earlier attempts (exact) and the latest line of every poll (the iterations
    since the poll before are taken at the polled line's step time). No start-up or save split: that is the end's.
    Iterations are kept as runs of one step time (first, last, step), never one entry per iteration: a line
    that says iteration 10**12 costs one run, not terabytes."""

    def __init__(self, started: float, lines: list[dict[str, Any]]) -> None:
        self.started = started
        self.runs: list[list[float]] = []  # [first, last, step time]: iterations first..last as they count so far
        self.done = 0  # iterations that count so far (the last run's last)
        self.productive = 0.0
        for line in lines:
            self.observe(line)

    def observe(self, line: dict[str, Any]) -> None:
        iteration, step = line.get("iteration"), _num(line.get("step_time_s"))
        if type(iteration) is not int or iteration < 1 or step is None or not math.isfinite(step):
            return
        if iteration <= self.done:  # a restart went back (or the same line again): drop what it redoes
            self._drop_from(iteration)
        count = iteration - self.done
        if self.runs and self.runs[-1][2] == step:
            self.runs[-1][1] = iteration
        else:
            self.runs.append([self.done + 1, iteration, step])
        self.done = iteration
        self.productive += step * count

    def _drop_from(self, iteration: int) -> None:
        while self.runs and self.runs[-1][0] >= iteration:
            first, last, step = self.runs.pop()
            self.productive -= step * (last - first + 1)
        if self.runs and self.runs[-1][1] >= iteration:
            last, step = self.runs[-1][1], self.runs[-1][2]
            self.productive -= step * (last - iteration + 1)
            self.runs[-1][1] = iteration - 1
        self.done = iteration - 1

    def ratio(self, now: float) -> float | None:
        wall = now - self.started
        return min(max(self.productive, 0.0) / wall, 1.0) if wall > 0 else None
