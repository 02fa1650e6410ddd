"""The report's reads of a run's metrics, aggregated in SQL so that a long soak (tens of millions of rows) is
never loaded into Python: every query walks the ledger's index `metrics_by_attempt (attempt_id, name,
iteration)` one attempt and one metric at a time.

- `series`: what a plot draws. Up to MAX_POINTS steps a series is every row, as the ledger holds it; above, it is
  bucketed by iteration ranges (per attempt and rank, at most about MAX_POINTS buckets in all), each bucket one row
  whose `value` is the mean, with `low` and `high` its true minimum and maximum (the plot's envelope, so no spike
  is lost). Per-layer series (`moe_load/<layer>`, ...) above MAX_POINTS are sampled instead: the rows at every
  `width`-th iteration (context lines; their summary series, e.g. `moe_load_max`, keeps the envelope). A width
  above BUCKET_ITERATIONS is a multiple of it, and an attempt the ledger summarises (ledger_buckets.py, from meta
  BUCKETS_FROM on) has its buckets read from table metric_buckets: O(buckets) rows, the same buckets, counts and
  min..max band as the rows give, the means to float rounding. A ledger without the table is read row by row.
- `rung_facts`: the figures the summary needs per rung, exact whatever the run's length.

Every metric row read is checked against the ledger's schema as it is read (ledger_schema.check_metric_row; a
bucket by its aggregates: the lowest and highest time, iteration and value, the type of every iteration and each
`nonfinite`): a large ledger's metric rows are not checked when it is opened (ledger_schema.FULL_CHECK_BYTES), and
one that breaks the schema raises BadMetric (report/summary.py refuses the ledger with it). The latest row of a
metric is taken at each attempt's last iteration (a step is recorded after the steps before it; the index holds no
time), so the summary's final loss and latest figures are a few index seeks per attempt, not a walk of its rows.
"""

from __future__ import annotations

import json
import math
import sqlite3
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from stepdeploy.ledger_buckets import summarised
from stepdeploy.ledger_schema import (
    BUCKET_ITERATIONS,
    NONFINITE,
    buckets_from,
    check_metric_row,
)
from stepdeploy.noderecords import ITERATION_MAX

MAX_POINTS = 2000  # steps per plotted series before it is bucketed
CACHE_KIB = 65536  # the report's page cache: a soak attempt's rows read once per series, not once per row

_FINITE = "run_id = ? AND attempt_id = ? AND name = ? AND value IS NOT NULL"
_NAMES = """WITH RECURSIVE names(n) AS (
    SELECT (SELECT name FROM metrics WHERE attempt_id = ?1 ORDER BY name LIMIT 1)
    UNION ALL
    SELECT (SELECT name FROM metrics WHERE attempt_id = ?1 AND name > n ORDER BY name LIMIT 1) FROM names
    WHERE n IS NOT NULL)
SELECT n FROM names WHERE n IS NOT NULL"""


class BadMetric(ValueError):
    """A metric row read from the ledger breaks its schema (str(): what is wrong)."""


def checked(rows: Iterable[sqlite3.Row]) -> list[dict[str, Any]]:
    """The rows as dicts, each checked (BadMetric for the first that breaks the schema)."""
    out = []
    for row in rows:
        found = dict(row)
        if (fault := check_metric_row(found)) is not None:
            raise BadMetric(fault)
        out.append(found)
    return out


def _check(metric: str, /, **columns: Any) -> None:
    if (fault := check_metric_row({"name": metric, **columns})) is not None:
        raise BadMetric(fault)


def attempt_metric_names(db: sqlite3.Connection, attempt_id: int) -> list[str]:
    """The metric names an attempt recorded (one index seek per name, not a scan of its rows)."""
    names = [r[0] for r in db.execute(_NAMES, (attempt_id,))]
    for name in names:
        _check(str(name), name=name)
    return names


def last_metric_time(db: sqlite3.Connection, run_id: str, attempt_names: dict[int, list[str]]) -> float | None:
    """The latest time of a finite row of each attempt's `names`, taken at each one's last iteration (a step is
    recorded after the steps before it): two index seeks per attempt and metric, where no index holds the time."""
    times = [r[0] for attempt, names in attempt_names.items() for name in names for r in db.execute(
        f"SELECT MAX(ts) FROM metrics WHERE {_FINITE} AND iteration = (SELECT iteration FROM metrics WHERE "
        f"{_FINITE} ORDER BY iteration DESC LIMIT 1)", (run_id, attempt, name) * 2) if r[0] is not None]
    for ts in times:
        _check("?", ts=ts)
    return max(times, default=None)


@dataclass(frozen=True)
class Extent:
    """What the index says of one metric of one attempt: distinct iterations, first and last."""

    steps: int
    first: int
    last: int


_ENDS = ("SELECT (SELECT iteration FROM metrics WHERE attempt_id = ?1 AND name = ?2 ORDER BY iteration LIMIT 1), "
         "(SELECT iteration FROM metrics WHERE attempt_id = ?1 AND name = ?2 ORDER BY iteration DESC LIMIT 1)")


def extents(db: sqlite3.Connection, name: str, attempt_ids: Sequence[int], limit: int = MAX_POINTS
            ) -> dict[int, Extent]:
    """Each attempt's extent of `name` from the index alone; steps are counted up to `limit` + 1 in all (enough to
    tell a series that fits from one that does not, without walking a long one)."""
    found, left = {}, limit + 1
    for attempt in attempt_ids:
        first, last = db.execute(_ENDS, (attempt, name)).fetchone()
        if first is None:
            continue
        _check(name, iteration=first)
        _check(name, iteration=last)
        steps = 0 if left <= 0 else db.execute(
            "SELECT COUNT(*) FROM (SELECT DISTINCT iteration FROM metrics WHERE attempt_id = ? AND name = ? LIMIT ?)",
            (attempt, name, left)).fetchone()[0]
        left -= steps
        found[attempt] = Extent(steps, first, last)
    return found


def bucket_width(spans: Sequence[Extent], limit: int = MAX_POINTS) -> int:
    """Iterations per bucket: 1 (every row) when the steps fit in `limit`; else wide enough that the buckets of
    all attempts together stay within `limit` (each attempt may add one partly filled bucket at each end)."""
    if sum(e.steps for e in spans) <= limit:
        return 1
    room = max(limit - 2 * len(spans), limit // 2)
    width = max(2, math.ceil(sum(e.last - e.first + 1 for e in spans) / room))
    if width <= BUCKET_ITERATIONS:
        return width
    return math.ceil(width / BUCKET_ITERATIONS) * BUCKET_ITERATIONS  # whole ledger buckets (metric_buckets)


def series(db: sqlite3.Connection, run_id: str, name: str, attempt_ids: Sequence[int], *, sampled: bool = False,
           limit: int = MAX_POINTS) -> list[dict[str, Any]]:
    """The rows a plot draws of metric `name` (module docstring), in time order within each attempt."""
    spans = extents(db, name, attempt_ids, limit)
    width = bucket_width(list(spans.values()), limit)
    if width == 1:
        return checked(db.execute(
            f"SELECT * FROM metrics WHERE run_id = ? AND attempt_id IN ({', '.join('?' * len(spans))}) AND name = ? "
            "AND value IS NOT NULL ORDER BY ts, rank", (run_id, *spans, name)))
    rows: list[dict[str, Any]] = []
    first_summarised = buckets_from(db) if width % BUCKET_ITERATIONS == 0 and summarised(name) else None
    for attempt, span in spans.items():
        if sampled:  # one index seek per sampled iteration
            wanted = json.dumps(list(range(span.first - span.first % width, span.last + 1, width)))
            found = db.execute(f"SELECT * FROM metrics WHERE {_FINITE} AND iteration IN (SELECT value FROM "
                               "json_each(?)) ORDER BY ts, rank", (run_id, attempt, name, wanted))
            rows += checked(found)
            continue
        if first_summarised is not None and attempt >= first_summarised:  # the ledger's summaries of its rows
            found = db.execute(_SUMMARIES, (run_id, attempt, name, width // BUCKET_ITERATIONS))
        else:
            found = db.execute(_BUCKETS, (run_id, attempt, name, width))
        rows += [_bucket(attempt, name, dict(r)) for r in found]
    return rows


_BUCKETS = (
    "SELECT rank, MIN(iteration) AS iteration, AVG(ts) AS ts, AVG(value) AS value, MIN(value) AS low, "
    "MAX(value) AS high, COUNT(*) AS count, MIN(ts) AS first_ts, MAX(ts) AS last_ts, MAX(iteration) AS last, "
    f"SUM(typeof(iteration) != 'integer' OR (nonfinite IS NOT NULL AND nonfinite NOT IN "
    f"({', '.join(repr(n) for n in NONFINITE)}))) AS bad FROM metrics WHERE {_FINITE} GROUP BY rank, iteration / ? "
    "ORDER BY 3, 1")


# Each summary row as read: its columns' types, and the ranges no aggregate below carries (_bucket checks the lowest
# and highest time, iteration and value of each bucket; a sum out of range makes its mean out of range).
_INTEGERS = ("rank", "bucket", "count", "first_iteration", "last_iteration")
_REALS = ("sum_ts", "first_ts", "last_ts", "sum_value", "low", "high")
_SUMMARY_BAD = (f"{' || '.join(f'typeof({c})' for c in _INTEGERS)} != '{'integer' * len(_INTEGERS)}' OR "
                + " OR ".join(f"typeof({c}) NOT IN ('real', 'integer')" for c in _REALS)
                + f" OR count < 1 OR bucket NOT BETWEEN 0 AND {ITERATION_MAX} OR last_iteration < first_iteration OR "
                  "last_ts < first_ts OR sum_ts < 0 OR typeof(run_id) != 'text' OR typeof(name) != 'text'")
# The same buckets from the ledger's summaries (ledger_buckets.py): a bucket of `width` iterations is the
# width // BUCKET_ITERATIONS summaries whose bucket // that is the same; every summary row is checked (`bad`).
_SUMMARIES = (
    "SELECT rank, MIN(first_iteration) AS iteration, SUM(sum_ts) / SUM(count) AS ts, "
    "SUM(sum_value) / SUM(count) AS value, MIN(low) AS low, MAX(high) AS high, SUM(count) AS count, "
    "MIN(first_ts) AS first_ts, MAX(last_ts) AS last_ts, MAX(last_iteration) AS last, "
    f"SUM({_SUMMARY_BAD}) AS bad FROM metric_buckets WHERE run_id = ? AND attempt_id = ? AND name = ? "
    "GROUP BY rank, bucket / ? ORDER BY 3, 1")


def _bucket(attempt: int, name: str, row: dict[str, Any]) -> dict[str, Any]:
    """A bucket's row, its rows checked by its aggregates (the text or blob that MAX would meet sorts after every
    number)."""
    first_ts, last_ts, last, bad = row.pop("first_ts"), row.pop("last_ts"), row.pop("last"), row.pop("bad")
    for columns in ({"ts": first_ts, "iteration": row["iteration"], "value": row["low"], "rank": row["rank"]},
                    {"ts": last_ts, "iteration": last, "value": row["high"]}):
        _check(name, **columns)
    if bad:
        raise BadMetric(f"a metric row or bucket ({name[:80]}) holds a value of the wrong type or out of range")
    return {"attempt_id": attempt, "name": name, **row}


@dataclass(frozen=True)
class RungFacts:
    """One rung's figures from its finite metric rows (summary.py's RungFigures says what each is)."""

    steps: int | None = None  # the highest iteration of any METRIC_NAMES row
    final_loss: float | None = None  # the last loss in (time, rank) order
    peak_mem_gib: float | None = None
    # the rows of the rung's last attempt that recorded each of these (what its gate judged)
    latest: dict[str, list[dict[str, Any]]] = field(default_factory=dict)


LATEST = ("tokens_per_s", "step_time_s", "rank_step_time_s")


def rung_facts(db: sqlite3.Connection, run_id: str, attempt_ids: Sequence[int], names: Sequence[str]) -> RungFacts:
    """Exact figures of a rung (its attempts' ids): an index seek or one index range per attempt and metric."""
    if not attempt_ids:
        return RungFacts()
    steps = [r[0] for attempt in attempt_ids for name in names for r in db.execute(
        f"SELECT iteration FROM metrics WHERE {_FINITE} ORDER BY iteration DESC LIMIT 1", (run_id, attempt, name))]
    for step in steps:
        _check("?", iteration=step)
    loss = _last_row(db, run_id, attempt_ids, "loss")
    marks = ", ".join("?" * len(attempt_ids))
    peak = db.execute(f"SELECT MAX(value) FROM metrics WHERE run_id = ? AND attempt_id IN ({marks}) AND "
                      "name = 'mem_peak_gib' AND value IS NOT NULL", (run_id, *attempt_ids)).fetchone()[0]
    _check("mem_peak_gib", value=peak)
    latest = {}
    for name in LATEST:
        last = _last_row(db, run_id, attempt_ids, name)
        if last is not None:
            latest[name] = checked(db.execute(f"SELECT * FROM metrics WHERE {_FINITE} ORDER BY ts, rank",
                                              (run_id, last["attempt_id"], name)))
    return RungFacts(steps=max(steps, default=None), final_loss=loss["value"] if loss else None, peak_mem_gib=peak,
                     latest=latest)


def _latest(db: sqlite3.Connection, run_id: str, attempt_ids: Sequence[int], name: str, *, rank_desc: bool
            ) -> dict[str, Any] | None:
    """The latest finite row of `name` in (time, rank) order (rank_desc: the last rank at that time, else the
    first), taken at each attempt's last iteration: two index seeks and that iteration's rows per attempt."""
    best: dict[str, Any] | None = None
    order = "ts DESC, rank DESC" if rank_desc else "ts DESC, rank"
    for attempt in attempt_ids:
        found = checked(db.execute(
            f"SELECT * FROM metrics WHERE {_FINITE} AND iteration = (SELECT iteration FROM metrics WHERE {_FINITE} "
            f"ORDER BY iteration DESC LIMIT 1) ORDER BY {order} LIMIT 1", (run_id, attempt, name) * 2))
        if found and (best is None or (found[0]["ts"], found[0]["rank"] if rank_desc else -found[0]["rank"])
                      > (best["ts"], best["rank"] if rank_desc else -best["rank"])):
            best = found[0]
    return best


def _last_row(db: sqlite3.Connection, run_id: str, attempt_ids: Sequence[int], name: str) -> dict[str, Any] | None:
    return _latest(db, run_id, attempt_ids, name, rank_desc=True)


def latest_attempt(db: sqlite3.Connection, run_id: str, attempt_ids: Sequence[int], name: str) -> int | None:
    """The attempt of the run's latest finite row of `name` (the first rank at that time)."""
    row = _latest(db, run_id, attempt_ids, name, rank_desc=False)
    return None if row is None else int(row["attempt_id"])
