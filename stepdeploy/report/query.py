"""The report's reads of a run's metrics, aggregated in SQL so that a long soak (tens of millions of rows) is
never loaded into Python: every query walks the ledger's index `metrics_by_attempt (attempt_id, name,
iteration)` one attempt and one metric at a time.

- `series`: what a plot draws. Up to MAX_POINTS steps a series is every row, as the ledger holds it; above, it is
  bucketed by iteration ranges (per attempt and rank, at most about MAX_POINTS buckets in all), each bucket one row
  whose `value` is the mean, with `low` and `high` its true minimum and maximum (the plot's envelope, so no spike
  is lost). Per-layer series (`moe_load/<layer>`, ...) above MAX_POINTS are sampled instead: the rows at every
  `width`-th iteration (context lines; their summary series, e.g. `moe_load_max`, keeps the envelope).
- `rung_facts`: the figures the summary needs per rung, exact whatever the run's length.
"""

from __future__ import annotations

import json
import math
import sqlite3
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

MAX_POINTS = 2000  # steps per plotted series before it is bucketed
CACHE_KIB = 65536  # the report's page cache: a soak attempt's rows read once per series, not once per row

_FINITE = "run_id = ? AND attempt_id = ? AND name = ? AND value IS NOT NULL"
_NAMES = """WITH RECURSIVE names(n) AS (
    SELECT (SELECT name FROM metrics WHERE attempt_id = ?1 ORDER BY name LIMIT 1)
    UNION ALL
    SELECT (SELECT name FROM metrics WHERE attempt_id = ?1 AND name > n ORDER BY name LIMIT 1) FROM names
    WHERE n IS NOT NULL)
SELECT n FROM names WHERE n IS NOT NULL"""


def attempt_metric_names(db: sqlite3.Connection, attempt_id: int) -> list[str]:
    """The metric names an attempt recorded (one index seek per name, not a scan of its rows)."""
    return [r[0] for r in db.execute(_NAMES, (attempt_id,))]


def last_metric_time(db: sqlite3.Connection, run_id: str, attempt_names: dict[int, list[str]]) -> float | None:
    """The latest time of a finite row of each attempt's `names`, taken at each one's last iteration (a step is
    recorded after the steps before it): two index seeks per attempt and metric, where no index holds the time."""
    times = [r[0] for attempt, names in attempt_names.items() for name in names for r in db.execute(
        f"SELECT MAX(ts) FROM metrics WHERE {_FINITE} AND iteration = (SELECT iteration FROM metrics WHERE "
        f"{_FINITE} ORDER BY iteration DESC LIMIT 1)", (run_id, attempt, name) * 2) if r[0] is not None]
    return max(times, default=None)


@dataclass(frozen=True)
class Extent:
    """What the index says of one metric of one attempt: distinct iterations, first and last."""

    steps: int
    first: int
    last: int


def extents(db: sqlite3.Connection, name: str, attempt_ids: Sequence[int], limit: int = MAX_POINTS
            ) -> dict[int, Extent]:
    """Each attempt's extent of `name` from the index alone; steps are counted up to `limit` + 1 in all (enough to
    tell a series that fits from one that does not, without walking a long one)."""
    found, left = {}, limit + 1
    for attempt in attempt_ids:
        first = db.execute("SELECT iteration FROM metrics WHERE attempt_id = ? AND name = ? ORDER BY iteration "
                           "LIMIT 1", (attempt, name)).fetchone()
        if first is None:
            continue
        last = db.execute("SELECT iteration FROM metrics WHERE attempt_id = ? AND name = ? ORDER BY iteration DESC "
                          "LIMIT 1", (attempt, name)).fetchone()
        steps = db.execute("SELECT COUNT(*) FROM (SELECT DISTINCT iteration FROM metrics WHERE attempt_id = ? AND "
                           "name = ? LIMIT ?)", (attempt, name, max(left, 0))).fetchone()[0]
        left -= steps
        found[attempt] = Extent(steps, first[0], last[0])
    return found


def bucket_width(spans: Sequence[Extent], limit: int = MAX_POINTS) -> int:
    """Iterations per bucket: 1 (every row) when the steps fit in `limit`; else wide enough that the buckets of
    all attempts together stay within `limit` (each attempt may add one partly filled bucket at each end)."""
    if sum(e.steps for e in spans) <= limit:
        return 1
    room = max(limit - 2 * len(spans), limit // 2)
    return max(2, math.ceil(sum(e.last - e.first + 1 for e in spans) / room))


def series(db: sqlite3.Connection, run_id: str, name: str, attempt_ids: Sequence[int], *, sampled: bool = False,
           limit: int = MAX_POINTS) -> list[dict[str, Any]]:
    """The rows a plot draws of metric `name` (module docstring), in time order within each attempt."""
    spans = extents(db, name, attempt_ids, limit)
    width = bucket_width(list(spans.values()), limit)
    if width == 1:
        return [dict(r) for r in db.execute(
            f"SELECT * FROM metrics WHERE run_id = ? AND attempt_id IN ({', '.join('?' * len(spans))}) AND name = ? "
            "AND value IS NOT NULL ORDER BY ts, rank", (run_id, *spans, name))]
    rows: list[dict[str, Any]] = []
    for attempt, span in spans.items():
        if sampled:  # one index seek per sampled iteration
            wanted = json.dumps(list(range(span.first - span.first % width, span.last + 1, width)))
            found = db.execute(f"SELECT * FROM metrics WHERE {_FINITE} AND iteration IN (SELECT value FROM "
                               "json_each(?)) ORDER BY ts, rank", (run_id, attempt, name, wanted))
            rows += [dict(r) for r in found]
            continue
        found = db.execute(
            "SELECT rank, MIN(iteration) AS iteration, AVG(ts) AS ts, AVG(value) AS value, MIN(value) AS low, "
            f"MAX(value) AS high, COUNT(*) AS count FROM metrics WHERE {_FINITE} GROUP BY rank, iteration / ? "
            "ORDER BY 3, 1", (run_id, attempt, name, width))
        rows += [{"attempt_id": attempt, "name": name, **dict(r)} for r in found]
    return rows


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
    loss = _last_row(db, run_id, attempt_ids, "loss")
    marks = ", ".join("?" * len(attempt_ids))
    peak = db.execute(f"SELECT MAX(value) FROM metrics WHERE run_id = ? AND attempt_id IN ({marks}) AND "
                      "name = 'mem_peak_gib' AND value IS NOT NULL", (run_id, *attempt_ids)).fetchone()[0]
    latest = {}
    for name in LATEST:
        last = _last_row(db, run_id, attempt_ids, name)
        if last is not None:
            latest[name] = [dict(r) for r in db.execute(f"SELECT * FROM metrics WHERE {_FINITE} ORDER BY ts, rank",
                                                        (run_id, last["attempt_id"], name))]
    return RungFacts(steps=max(steps, default=None), final_loss=loss["value"] if loss else None, peak_mem_gib=peak,
                     latest=latest)


def _last_row(db: sqlite3.Connection, run_id: str, attempt_ids: Sequence[int], name: str) -> sqlite3.Row | None:
    marks = ", ".join("?" * len(attempt_ids))
    return db.execute(f"SELECT attempt_id, ts, value FROM metrics WHERE run_id = ? AND attempt_id IN ({marks}) AND "
                      "name = ? AND value IS NOT NULL ORDER BY ts DESC, rank DESC LIMIT 1",
                      (run_id, *attempt_ids, name)).fetchone()


def latest_attempt(db: sqlite3.Connection, run_id: str, attempt_ids: Sequence[int], name: str) -> int | None:
    """The attempt of the run's latest finite row of `name` (the first rank at that time)."""
    marks = ", ".join("?" * len(attempt_ids))
    row = db.execute(f"SELECT attempt_id FROM metrics WHERE run_id = ? AND attempt_id IN ({marks}) AND name = ? AND "
                     "value IS NOT NULL ORDER BY ts DESC, rank LIMIT 1", (run_id, *attempt_ids, name)).fetchone()
    return None if row is None else int(row[0])
