"""The per-bucket summaries of a run's finite metric rows (table metric_buckets, ledger_schema.py), written by
Ledger.add_metrics in the transaction that inserts the rows, so that the report of a long soak reads O(buckets)
rows, not O(rows) (report/query.py).

A bucket is one attempt's rows of one metric and rank whose iteration // BUCKET_ITERATIONS is the same; it holds
their count, the sums of their times and values, their lowest and highest time, iteration and value. Every insert
adds to its bucket (an UPSERT), so rows written in any order and any number of calls sum to what one GROUP BY over
the rows would give. Per-layer metrics (a '/' in the name) are not summarised: the report samples them.
"""

from __future__ import annotations

import math
import sqlite3
from collections.abc import Sequence

from stepdeploy.ledger_schema import BUCKET_ITERATIONS, BUCKETS_FROM

UPSERT = """INSERT INTO metric_buckets VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)
ON CONFLICT (attempt_id, name, rank, bucket) DO UPDATE SET
    count = count + excluded.count, first_iteration = MIN(first_iteration, excluded.first_iteration),
    last_iteration = MAX(last_iteration, excluded.last_iteration), sum_ts = sum_ts + excluded.sum_ts,
    first_ts = MIN(first_ts, excluded.first_ts), last_ts = MAX(last_ts, excluded.last_ts),
    sum_value = sum_value + excluded.sum_value, low = MIN(low, excluded.low), high = MAX(high, excluded.high)"""
CREATE = """CREATE TABLE IF NOT EXISTS metric_buckets (
    run_id TEXT NOT NULL, attempt_id INTEGER NOT NULL, name TEXT NOT NULL, rank INTEGER NOT NULL,
    bucket INTEGER NOT NULL, count INTEGER NOT NULL, first_iteration INTEGER NOT NULL,
    last_iteration INTEGER NOT NULL, sum_ts REAL NOT NULL, first_ts REAL NOT NULL, last_ts REAL NOT NULL,
    sum_value REAL NOT NULL, low REAL NOT NULL, high REAL NOT NULL, PRIMARY KEY (attempt_id, name, rank, bucket))"""


def summarised(name: str) -> bool:
    """Whether metric `name` is summarised in buckets (the per-layer ones are not)."""
    return "/" not in name


def add_buckets(db: sqlite3.Connection, run_id: str, attempt_id: int,
                rows: Sequence[tuple[float, int, int, str, float]]) -> None:
    """Add `rows` (ts, rank, iteration, name, value) to their buckets; inside the caller's transaction."""
    found: dict[tuple[str, int, int], list[float]] = {}
    for ts, rank, iteration, name, value in rows:
        number = float(value)
        if not math.isfinite(number) or not summarised(name):
            continue
        key = (name, rank, iteration // BUCKET_ITERATIONS)
        b = found.get(key)
        if b is None:
            found[key] = [1, iteration, iteration, ts, ts, ts, number, number, number]
            continue
        b[0] += 1
        b[1], b[2] = min(b[1], iteration), max(b[2], iteration)
        b[3] += ts
        b[4], b[5] = min(b[4], ts), max(b[5], ts)
        b[6] += number
        b[7], b[8] = min(b[7], number), max(b[8], number)
    db.executemany(UPSERT, [(run_id, attempt_id, name, rank, bucket, *b) for (name, rank, bucket), b in found.items()])


def add_table(db: sqlite3.Connection) -> None:
    """Give a ledger written before metric_buckets existed the (empty) table; its attempts up to the last with a
    metric row are read row by row (meta BUCKETS_FROM names the first attempt after them)."""
    last = db.execute("SELECT MAX(attempt_id) FROM metrics").fetchone()[0]
    db.execute(CREATE)
    db.execute("INSERT INTO meta VALUES (?, ?)", (BUCKETS_FROM, str(int(last or 0) + 1)))
