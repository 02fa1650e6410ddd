"""A rollout run, summarised: ledger rows in, a `Summary` dataclass out (pure, apart from `read_run`).

Figures are per rung (a stage without rungs counts as one, named after its attempts). `n/a` (None here)
wherever the ledger holds nothing to compute a figure from: a stage that never ran, a run that failed early,
a CPU run without memory metrics.
"""

from __future__ import annotations

import sqlite3
import statistics
from collections import defaultdict
from dataclasses import asdict, dataclass, field
from functools import cached_property
from typing import Any

from stepdeploy.ledger import Ledger, StageRow
from stepdeploy.ledger_schema import LEDGER_HINT, NotALedger
from stepdeploy.monitor.parse_workload import LAYER_METRICS, METRIC_NAMES, MTP_LOSS
from stepdeploy.report import query
from stepdeploy.report.query import RungFacts

# Informational kinds the ledger and the rollout controller write (the soak's learning-rate schedule, its
# resolved checkpoint interval and its goodput included); anything else (failure, restart, fault injection,
# monitor breaches) counts as a fault/notice.
LEDGER_EVENT_KINDS = ("run", "stage", "rung", "attempt", "gate", "warmup", "config", "stop", "schedule", "checkpoint",
                      "goodput", "launched")


# The metrics the plots draw (report/plots*.py): the scalars and the per-layer/per-depth families by prefix.
PLOTTED = ("loss", "tokens_per_s", "lr", "grad_norm", "moe_load_max", "moe_aux_loss_mean", "router_bias_absmax",
           "rank_step_time_s", "mem_allocated_gib", "mem_reserved_gib", "mem_peak_gib", "moe_load", "moe_aux_loss",
           MTP_LOSS)


@dataclass(frozen=True)
class RunData:
    """What the report reads of one run: its rows, and its metrics as report/query.py aggregates them."""

    run: dict[str, Any]
    stages: list[StageRow]
    rungs: dict[str, list[dict[str, Any]]]
    attempts: list[dict[str, Any]]
    verdicts: list[dict[str, Any]]
    events: list[dict[str, Any]]
    metrics: dict[str, list[dict[str, Any]]]  # what the plots draw: every row, or buckets of a long series
    facts: dict[tuple[str, str], RungFacts] = field(default_factory=dict)  # (stage, rung) -> exact figures
    latest_rung: dict[str, tuple[str, str]] = field(default_factory=dict)  # metric -> rung that recorded it last
    metrics_seen: float | None = None  # the latest time of a metric row

    @cached_property
    def last_seen(self) -> float:
        """The latest time the ledger knows of: where a still-running stage or attempt ends for now."""
        times = [self.run["updated"], *(e["ts"] for e in self.events)]
        return max(times if self.metrics_seen is None else [*times, self.metrics_seen])

    def end_of(self, finished: float | None) -> float:
        return finished if finished is not None else self.last_seen

    @cached_property
    def segment_of(self) -> dict[int, tuple[str, str]]:
        """attempt id -> (stage, rung): metrics rows only name their attempt."""
        return {a["id"]: (a["stage"], a["rung"]) for a in self.attempts}


def read_run(ledger: Ledger, run_id: str) -> RunData:
    """The run's rows, and its metrics read through report/query.py (a long soak is never loaded row by row). A
    metric row that breaks the schema, or a damaged page met while reading, refuses the ledger (NotALedger), as
    the check at open does: a large ledger's metric rows are checked as they are read (ledger_schema.py)."""
    try:
        return _read_run(ledger, run_id)
    except query.BadMetric as exc:
        raise NotALedger(f"{ledger.path}: {exc}; the ledger is corrupt or was not written by stepdeploy",
                         hint=LEDGER_HINT) from None
    except (sqlite3.DatabaseError, UnicodeDecodeError) as exc:
        raise NotALedger(f"{ledger.path}: the rollout ledger is damaged ({' '.join(str(exc).split())[:200]})",
                         hint=LEDGER_HINT) from None


def _read_run(ledger: Ledger, run_id: str) -> RunData:
    stages, attempts = ledger.stages(run_id), ledger.attempts(run_id)
    db, ids = ledger.db, [a["id"] for a in attempts]
    db.execute(f"PRAGMA cache_size = -{query.CACHE_KIB}")  # this connection only: an attempt's pages stay cached
    recorded = {attempt: [n for n in query.attempt_metric_names(db, attempt) if _known(n)] for attempt in ids}
    present = dict.fromkeys(n for names in recorded.values() for n in names)
    per_layer = sorted(n for n in present if "/" in n)
    names = [n for n in METRIC_NAMES if n in present and n in PLOTTED] + [n for n in per_layer if n.split("/")[0]
                                                                           in PLOTTED]
    metrics = {n: query.series(db, run_id, n, ids, sampled=n.split("/")[0] in LAYER_METRICS) for n in names}
    segments: dict[tuple[str, str], list[int]] = defaultdict(list)
    for a in attempts:
        segments[(a["stage"], a["rung"])].append(a["id"])
    rung_of = {a["id"]: (a["stage"], a["rung"]) for a in attempts}
    latest = {name: rung_of[found] for name in ("loss", "tokens_per_s")
              if (found := query.latest_attempt(db, run_id, ids, name)) is not None}
    return RunData(run=ledger.run(run_id), stages=stages, rungs={s.name: ledger.rungs(run_id, s.name) for s in stages},
                   attempts=attempts, verdicts=ledger.verdicts(run_id), events=ledger.events(run_id), metrics=metrics,
                   facts={key: query.rung_facts(db, run_id, seg, METRIC_NAMES) for key, seg in segments.items()},
                   latest_rung=latest,
                   metrics_seen=query.last_metric_time(db, run_id, recorded))


def _known(name: str) -> bool:
    """A metric the report reads: a scalar of METRIC_NAMES, or one per MoE layer or MTP depth."""
    return name in METRIC_NAMES or ("/" in name and name.split("/")[0] in (*LAYER_METRICS, MTP_LOSS))


@dataclass(frozen=True)
class RungFigures:
    stage: str
    rung: str
    status: str
    reason: str | None
    attempts: int
    failed_attempts: int
    steps: int | None  # the highest iteration any attempt of the rung reached
    final_loss: float | None
    # tokens/s, step time and skew: from the rung's last attempt (a failed try before it would blur them)
    tokens_per_s: float | None  # median
    step_time_s: float | None  # median
    rank_skew: float | None  # (slowest rank's mean step time - fastest's) / fastest's; needs >= 2 ranks
    slowest_rank: int | None
    peak_mem_gib: float | None
    wall_s: float | None  # summed over attempts (a running one: until the ledger's last record)
    detail: dict[str, Any]  # the last attempt's detail (rung, nodes, model, ...)


@dataclass(frozen=True)
class StageSummary:
    name: str
    status: str
    reason: str | None
    started: float | None  # its first start (the ledger keeps the latest, after a resume)
    finished: float | None  # None while running
    wall_s: float | None  # first start to finish (or to the ledger's last record while running)
    rungs: list[RungFigures]


@dataclass(frozen=True)
class RecordedVerdict:
    """One gate verdict as the ledger recorded it (rollout/gates.py's GateVerdict, with when and where)."""

    ts: float
    stage: str
    rung: str
    gate: str
    passed: bool
    measured: Any
    threshold: Any
    reason: str


@dataclass(frozen=True)
class KeyFigures:
    steps: int | None
    final_loss: float | None
    final_loss_from: str | None  # stage/rung the figure comes from
    tokens_per_s: float | None
    tokens_per_s_from: str | None
    rank_skew: float | None
    slowest_rank: int | None
    rank_skew_from: str | None
    peak_mem_gib: float | None
    attempts: int
    restarts: int  # attempts beyond the first of their rung
    wall_s: float | None


@dataclass(frozen=True)
class Summary:
    run_id: str
    status: str
    created: float
    updated: float
    config: dict[str, Any]
    stages: list[StageSummary]
    gates: list[RecordedVerdict]
    figures: KeyFigures
    events: list[dict[str, Any]]
    goodput: dict[str, Any] | None = None  # the soak's last `goodput` event (rollout/goodput.py), None before
    checkpoint_interval: dict[str, Any] | None = None  # the soak's resolved `--checkpoint-interval auto`

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    def notable_events(self) -> list[dict[str, Any]]:
        """Failures, failed gates and every event of a kind the ledger itself does not write (faults)."""
        return [e for e in self.events if is_fault(e) or "failed" in e["message"].lower()]


def is_fault(event: dict[str, Any]) -> bool:
    return event["kind"] not in LEDGER_EVENT_KINDS


def summarise(data: RunData) -> Summary:
    stages = [_stage(data, stage) for stage in data.stages]
    gates = [RecordedVerdict(v["ts"], v["stage"], v["rung"], v["gate"], v["passed"], v["measured"], v["threshold"],
                         v["reason"]) for v in data.verdicts]
    run = data.run
    return Summary(run["id"], run["status"], run["created"], run["updated"], run["config"], stages, gates,
                   _key_figures(data, stages), data.events, last_event_data(data.events, "goodput"),
                   last_event_data(data.events, "checkpoint"))


def last_event_data(events: list[dict[str, Any]], kind: str) -> dict[str, Any] | None:
    """The data of the last `kind` event that holds any; None when there is none, or when its figures are not of
    the types the report formats (a ledger edited by hand: event_data_notes says so)."""
    found = [e["data"] for e in events if e["kind"] == kind and e["data"]]
    return found[-1] if found and event_data_problem(kind, found[-1]) is None else None


# The figures of the soak's `goodput` event (rollout/goodput.py) and its `checkpoint` event that the report reads:
# key -> what it must hold. Other keys are not read, and so not checked.
_FIGURE_MAX = 1e12  # seconds, iterations, ratios: far beyond any soak, well within what a float formats
_NUMBER, _OPTIONAL, _COUNT, _LIST, _PARTS, _SHARES, _TEXT = ("number", "optional number", "count", "list",
                                                          "parts", "shares", "text")
EVENT_FIGURES: dict[str, dict[str, str]] = {
    "goodput": {"ratio": _OPTIONAL, "wall_s": _OPTIONAL, "steady_step_s": _OPTIONAL, "max_save_s": _OPTIONAL,
                "overrun_s": _OPTIONAL, "iterations": _COUNT, "saves": _COUNT, "redone": _COUNT, "starts": _LIST,
                "failures": _LIST, "parts": _PARTS, "startup_parts": _PARTS, "failure_parts": _PARTS,
                "shares": _SHARES},
    "checkpoint": {"describe": _TEXT, "iterations": _COUNT},
}


def _is_number(value: Any) -> bool:
    return type(value) in (int, float) and -_FIGURE_MAX <= value <= _FIGURE_MAX  # NaN, inf and bools fail


def _holds(value: Any, shape: str) -> bool:
    checks = {
        _NUMBER: _is_number, _OPTIONAL: lambda v: v is None or _is_number(v),
        _COUNT: lambda v: type(v) is int and 0 <= v <= _FIGURE_MAX,
        _LIST: lambda v: isinstance(v, list), _TEXT: lambda v: v is None or isinstance(v, str),
        _PARTS: lambda v: isinstance(v, dict) and all(_is_number(x) for x in v.values()),
        _SHARES: lambda v: isinstance(v, dict) and all(x is None or _is_number(x) for x in v.values()),
    }
    return bool(checks[shape](value))


def event_data_problem(kind: str, data: Any) -> str | None:
    """What is wrong with an event's data for the report (None: nothing, or a kind it does not read)."""
    if kind not in EVENT_FIGURES:
        return None
    if not isinstance(data, dict):
        return "its data is not an object"
    wrong = [key for key, shape in EVENT_FIGURES[kind].items() if key in data and not _holds(data[key], shape)]
    return f"{', '.join(wrong)} of the wrong type or out of range" if wrong else None


def event_data_notes(events: list[dict[str, Any]]) -> list[str]:
    """One line for each kind whose last event the report leaves out because of event_data_problem."""
    notes = []
    for kind in EVENT_FIGURES:
        last = next((e for e in reversed(events) if e["kind"] == kind and e["data"]), None)
        problem = event_data_problem(kind, last["data"]) if last else None
        if last is not None and problem is not None:
            notes.append(f"the ledger's {kind} event {last['id']} is left out of the report: {problem}")
    return notes


GOODPUT_LABELS = {"productive": "productive", "startup": "start-up", "checkpoint": "checkpoint saves",
                  "failures": "failures", "redone": "redone iterations", "other": "other"}
STARTUP_LABELS = {"launch": "launch", "imports_init": "imports + process group", "model_build": "model build",
                  "checkpoint_load": "checkpoint load", "setup": "data set-up", "first_step_extra": "first step extra"}
FAILURE_LABELS = {"detection": "detection", "stop": "stop", "restart": "restart"}


def goodput_rows(goodput: dict[str, Any]) -> list[tuple[str, float | None, float | None, str]]:
    """(part, seconds, share of the wall, what it holds) for the report's Goodput table."""
    parts, shares = goodput.get("parts", {}), goodput.get("shares", {})
    details = {
        "productive": f"{goodput.get('iterations', 0):,} iterations that count; steady step "
                      + (f"{goodput['steady_step_s']:.3g} s" if goodput.get("steady_step_s") else "n/a"),
        "startup": f"{len(goodput.get('starts', []))} start(s): " + _listed(goodput.get("startup_parts", {}),
                                                                            STARTUP_LABELS),
        "checkpoint": f"{goodput.get('saves', 0)} save(s)" + (f", the longest {goodput['max_save_s']:.3g} s"
                                                              if goodput.get("max_save_s") else ""),
        "failures": f"{len(goodput.get('failures', []))} failure(s): " + _listed(goodput.get("failure_parts", {}),
                                                                                 FAILURE_LABELS),
        "redone": f"{goodput.get('redone', 0):,} iteration(s) a restart threw away",
        "other": "between steps, polls, the soak's end" + (
            f"; the parts exceed the wall by {goodput['overrun_s']:.1f} s (clock skew)"
            if goodput.get("overrun_s") else ""),
    }
    return [(label, parts.get(key), shares.get(key), details[key]) for key, label in GOODPUT_LABELS.items()]


def _listed(values: dict[str, float], labels: dict[str, str]) -> str:
    return ", ".join(f"{labels[k]} {values[k]:.1f} s" for k in labels if values.get(k)) or "none"


def stage_span(data: RunData, stage: StageRow) -> tuple[float | None, float | None]:
    """First start to last finish: a resumed stage's `started` is its latest start, attempts keep the first."""
    attempts = [a for a in data.attempts if a["stage"] == stage.name]
    starts = [t for t in [stage.started, *(a["started"] for a in attempts)] if t is not None]
    ends = [data.end_of(a["finished"]) for a in attempts]
    if stage.finished is not None:
        return min(starts, default=None), stage.finished
    end = data.last_seen if stage.status == "running" else max(ends, default=None)
    return min(starts, default=None), end


def _stage(data: RunData, stage: StageRow) -> StageSummary:
    started, finished = stage_span(data, stage)
    wall = finished - started if started is not None and finished is not None else None
    return StageSummary(stage.name, stage.status, stage.reason, started, stage.finished, wall,
                        [_rung(data, stage.name, rung) for rung in _rung_names(data, stage.name)])


def _rung_names(data: RunData, stage: str) -> list[str]:
    names = [r["name"] for r in data.rungs.get(stage, [])]
    names += [a["rung"] for a in data.attempts if a["stage"] == stage and a["rung"] not in names]
    return list(dict.fromkeys(names))


def _rung(data: RunData, stage: str, rung: str) -> RungFigures:
    row = next((r for r in data.rungs.get(stage, []) if r["name"] == rung), None)
    attempts = [a for a in data.attempts if a["stage"] == stage and a["rung"] == rung]
    status = row["status"] if row else (attempts[-1]["status"] if attempts else "pending")
    facts = data.facts.get((stage, rung), RungFacts())

    def latest(name: str) -> list[dict[str, Any]]:
        """Rows of the rung's last attempt that recorded `name`: what its gate judged, not a failed try."""
        return facts.latest.get(name, [])

    skew, slowest = rank_skew(latest("rank_step_time_s"))
    return RungFigures(
        stage=stage, rung=rung, status=status, reason=row["reason"] if row else None,
        attempts=len(attempts), failed_attempts=sum(a["status"] == "failed" for a in attempts),
        steps=facts.steps, final_loss=facts.final_loss,
        tokens_per_s=_median([r["value"] for r in latest("tokens_per_s")]),
        step_time_s=_median([r["value"] for r in latest("step_time_s")]),
        rank_skew=skew, slowest_rank=slowest, peak_mem_gib=facts.peak_mem_gib,
        wall_s=_attempts_wall(data, attempts), detail=attempts[-1]["detail"] if attempts else {})


def rank_skew(rows: list[dict[str, Any]]) -> tuple[float | None, int | None]:
    """(skew, slowest rank) from per-rank step times; None when fewer than two ranks reported."""
    per_rank: dict[int, list[float]] = defaultdict(list)
    for row in rows:
        per_rank[row["rank"]].append(row["value"])
    if len(per_rank) < 2:
        return None, None
    means = {rank: statistics.fmean(v) for rank, v in per_rank.items()}
    slowest, fastest = max(means, key=means.__getitem__), min(means.values())
    return ((means[slowest] - fastest) / fastest if fastest > 0 else None), slowest


def _attempts_wall(data: RunData, attempts: list[dict[str, Any]]) -> float | None:
    """Summed over attempts; one still running (or left running by a killed controller) counts until now."""
    return sum(data.end_of(a["finished"]) - a["started"] for a in attempts) if attempts else None


def _median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def _key_figures(data: RunData, stages: list[StageSummary]) -> KeyFigures:
    rungs = [r for s in stages for r in s.rungs]
    steps = [r.steps for r in rungs if r.steps is not None]
    loss, loss_from = _latest(data, "loss", lambda r: r.final_loss, rungs)
    tokens, tokens_from = _latest(data, "tokens_per_s", lambda r: r.tokens_per_s, rungs)
    skewed = [r for r in rungs if r.rank_skew is not None]
    worst = max(skewed, key=lambda r: r.rank_skew or 0.0) if skewed else None
    peaks = [r.peak_mem_gib for r in rungs if r.peak_mem_gib is not None]
    with_attempts = {(a["stage"], a["rung"]) for a in data.attempts}
    return KeyFigures(
        steps=sum(steps) if steps else None, final_loss=loss, final_loss_from=loss_from,
        tokens_per_s=tokens, tokens_per_s_from=tokens_from,
        rank_skew=worst.rank_skew if worst else None, slowest_rank=worst.slowest_rank if worst else None,
        rank_skew_from=f"{worst.stage}/{worst.rung}" if worst else None, peak_mem_gib=max(peaks, default=None),
        attempts=len(data.attempts), restarts=len(data.attempts) - len(with_attempts), wall_s=_run_wall(data))


def _latest(data: RunData, name: str, pick: Any, rungs: list[RungFigures]) -> tuple[float | None, str | None]:
    """The figure of the rung that recorded `name` last: the run's most recent configuration."""
    if name not in data.latest_rung:
        return None, None
    stage, rung = data.latest_rung[name]
    figures = next(r for r in rungs if (r.stage, r.rung) == (stage, rung))
    return pick(figures), f"{stage}/{rung}"


def _run_wall(data: RunData) -> float | None:
    return data.last_seen - data.run["created"]
