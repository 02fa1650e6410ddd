"""What a rollout ledger holds, and the check that a file holds exactly that before anything reads it.

The ledger's SQLite file lives in a run directory and is read back by `rollout resume/status/list` and
`report`, so it is input: `check_ledger` refuses (NotALedger, one line, exit 2) a file that is not a ledger
this stepdeploy wrote, before anything reads a row or writes a byte. That covers the schema (exactly the
tables and indexes below: a trigger or view would run or answer as SQL stepdeploy never wrote), every
column's type, every value's range (known states only, finite times within [0, 1e10], positions, ranks and
iterations as the nodes' records allow, a verdict that is 0 or 1), JSON columns of bounded length, and the
rows' links (each run has stages, a passed run only stages that passed or were skipped).

Metric rows are checked when they are read, in a ledger larger than FULL_CHECK_BYTES: a 72-hour soak holds some 42
million, and checking each at every open took 25 s (its `PRAGMA quick_check` 5 s more). Such a ledger has every
other table checked whole (rows and pages), its metrics' attempts checked against the attempts it holds (from the
index), and each metric row checked by the query that reads it (`check_metric_row`; report/query.py's aggregates
carry the same checks over the rows they aggregate): a row of the wrong type or out of range that a reader meets
refuses the ledger as the check at open does, and a damaged page it meets does too (report/summary.py). The same
holds for the metric summaries (table metric_buckets, ledger_buckets.py; optional: a ledger written before them has
none, and meta BUCKETS_FROM comes with the table, never without).
"""

from __future__ import annotations

import sqlite3
from pathlib import Path

from stepdeploy.errors import BadInput
from stepdeploy.noderecords import ITERATION_MAX, RANK_MAX, TIME_MAX

SCHEMA_VERSION = 2  # 2: metrics.value may be NULL, with metrics.nonfinite ('nan', 'inf', '-inf')
SCHEMA = """
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS runs (
    id TEXT PRIMARY KEY, created REAL NOT NULL, updated REAL NOT NULL, status TEXT NOT NULL,
    config TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS stages (
    run_id TEXT NOT NULL, name TEXT NOT NULL, position INTEGER NOT NULL, status TEXT NOT NULL,
    started REAL, finished REAL, reason TEXT, PRIMARY KEY (run_id, name));
CREATE TABLE IF NOT EXISTS rungs (
    run_id TEXT NOT NULL, stage TEXT NOT NULL, name TEXT NOT NULL, position INTEGER NOT NULL,
    status TEXT NOT NULL, config TEXT NOT NULL, reason TEXT, PRIMARY KEY (run_id, stage, name));
CREATE TABLE IF NOT EXISTS attempts (
    id INTEGER PRIMARY KEY AUTOINCREMENT, run_id TEXT NOT NULL, stage TEXT NOT NULL, rung TEXT NOT NULL,
    number INTEGER NOT NULL, status TEXT NOT NULL, started REAL NOT NULL, finished REAL,
    detail TEXT NOT NULL DEFAULT '{}');
CREATE TABLE IF NOT EXISTS events (
    id INTEGER PRIMARY KEY AUTOINCREMENT, run_id TEXT NOT NULL, ts REAL NOT NULL, stage TEXT, rung TEXT,
    kind TEXT NOT NULL, message TEXT NOT NULL, data TEXT NOT NULL DEFAULT '{}');
CREATE TABLE IF NOT EXISTS verdicts (
    id INTEGER PRIMARY KEY AUTOINCREMENT, run_id TEXT NOT NULL, ts REAL NOT NULL, stage TEXT NOT NULL,
    rung TEXT NOT NULL, gate TEXT NOT NULL, passed INTEGER NOT NULL, measured TEXT NOT NULL,
    threshold TEXT NOT NULL, reason TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS metrics (
    run_id TEXT NOT NULL, attempt_id INTEGER NOT NULL, ts REAL NOT NULL, rank INTEGER NOT NULL,
    iteration INTEGER NOT NULL, name TEXT NOT NULL, value REAL, nonfinite TEXT);
CREATE INDEX IF NOT EXISTS metrics_by_attempt ON metrics (attempt_id, name, iteration);
"""
# The per-bucket summaries of the finite metric rows (table metric_buckets): per attempt, metric (one without a
# '/': the per-layer ones are sampled, never bucketed, by the report), rank and bucket of BUCKET_ITERATIONS
# iterations (bucket = iteration // BUCKET_ITERATIONS), the rows' count, sums of time and value, lowest and
# highest time, iteration and value. Written by Ledger.add_metrics with the rows, so that the report of a long soak
# reads O(buckets) rows, not O(rows). A ledger written before the table existed gets it (empty) when a writer
# opens it, with meta 'metric_buckets_from' the first attempt whose rows are all summarised (the attempts before
# it are read row by row); a ledger without the table is read row by row.
BUCKET_ITERATIONS = 16
BUCKETS_FROM = "metric_buckets_from"
# Version 1's metrics table held finite values only (value REAL NOT NULL); version 2 rebuilds it.
MIGRATE_1 = """
ALTER TABLE metrics RENAME TO metrics_v1;
CREATE TABLE metrics (
    run_id TEXT NOT NULL, attempt_id INTEGER NOT NULL, ts REAL NOT NULL, rank INTEGER NOT NULL,
    iteration INTEGER NOT NULL, name TEXT NOT NULL, value REAL, nonfinite TEXT);
INSERT INTO metrics SELECT run_id, attempt_id, ts, rank, iteration, name, value, NULL FROM metrics_v1;
DROP TABLE metrics_v1;
DROP INDEX IF EXISTS metrics_by_attempt;
CREATE INDEX metrics_by_attempt ON metrics (attempt_id, name, iteration);
"""

# The states each row may be in (what the ledger's writers and the rollout write, nothing else).
RUN_STATES = ("pending", "running", "passed", "failed", "stopped")
STAGE_STATES = ("pending", "running", "passed", "failed", "skipped", "stopped")  # rungs' too
ATTEMPT_STATES = ("running", "passed", "failed", "stopped")
FINAL = frozenset(("passed", "skipped"))  # a stage in one of these is never re-run
MAX_TEXT_CHARS = 1 << 20  # a reason, a message, a name
MAX_JSON_CHARS = 1 << 22  # a config, a detail, an event's data (a long soak's goodput is some 100 KiB)
MAX_POSITION = 1_000_000

NONFINITE = ("nan", "inf", "-inf")  # what metrics.nonfinite may say
_NUMBER, _TEXT, _INT = ("real", "integer"), ("text",), ("integer",)
# What every column must hold (SQLite stores any type anywhere), so that the report and the controller never
# meet a string where a time should be, or a detail that is not JSON.
COLUMNS: dict[str, dict[str, tuple[str, ...]]] = {
    "meta": {"key": _TEXT, "value": _TEXT},
    "runs": {"id": _TEXT, "created": _NUMBER, "updated": _NUMBER, "status": _TEXT, "config": ("json",)},
    "stages": {"run_id": _TEXT, "name": _TEXT, "position": _INT, "status": _TEXT, "started": (*_NUMBER, "null"),
               "finished": (*_NUMBER, "null"), "reason": (*_TEXT, "null")},
    "rungs": {"run_id": _TEXT, "stage": _TEXT, "name": _TEXT, "position": _INT, "status": _TEXT,
              "config": ("json",), "reason": (*_TEXT, "null")},
    "attempts": {"id": _INT, "run_id": _TEXT, "stage": _TEXT, "rung": _TEXT, "number": _INT, "status": _TEXT,
                 "started": _NUMBER, "finished": (*_NUMBER, "null"), "detail": ("json",)},
    "events": {"id": _INT, "run_id": _TEXT, "ts": _NUMBER, "stage": (*_TEXT, "null"), "rung": (*_TEXT, "null"),
               "kind": _TEXT, "message": _TEXT, "data": ("json",)},
    "verdicts": {"id": _INT, "run_id": _TEXT, "ts": _NUMBER, "stage": _TEXT, "rung": _TEXT, "gate": _TEXT,
                 "passed": _INT, "measured": ("jsonany",), "threshold": ("jsonany",), "reason": _TEXT},
    "metrics": {"run_id": _TEXT, "attempt_id": _INT, "ts": _NUMBER, "rank": _INT, "iteration": _INT,
                "name": _TEXT, "value": (*_NUMBER, "null"), "nonfinite": (*_TEXT, "null")},
    "metric_buckets": {"run_id": _TEXT, "attempt_id": _INT, "name": _TEXT, "rank": _INT, "bucket": _INT,
                       "count": _INT, "first_iteration": _INT, "last_iteration": _INT, "sum_ts": _NUMBER,
                       "first_ts": _NUMBER, "last_ts": _NUMBER, "sum_value": _NUMBER, "low": _NUMBER,
                       "high": _NUMBER},
}
OPTIONAL_TABLES = frozenset(("metric_buckets",))  # a ledger written before it has none (read row by row)
LARGE_TABLES = frozenset(("metrics", "metric_buckets"))  # checked as read in a large ledger
V1_COLUMNS = {**{t: c for t, c in COLUMNS.items() if t != "metric_buckets"},
              "metrics": {k: v for k, v in COLUMNS["metrics"].items() if k != "nonfinite"}}


def _states(states: tuple[str, ...]) -> str:
    return f"IN ({', '.join(repr(s) for s in states)})"


_TIME = f"BETWEEN 0 AND {TIME_MAX!r}"  # NULL passes where the column may be NULL (checked by its type)
_FINITE_RANGE = "BETWEEN -1.7976931348623157e308 AND 1.7976931348623157e308"
# What every value must satisfy beyond its type (SQL on the column; a NULL the type allows passes).
RANGES: dict[str, dict[str, str]] = {
    "runs": {"created": _TIME, "updated": _TIME, "status": _states(RUN_STATES)},
    "stages": {"position": f"BETWEEN 0 AND {MAX_POSITION}", "status": _states(STAGE_STATES), "started": _TIME,
               "finished": _TIME},
    "rungs": {"position": f"BETWEEN 0 AND {MAX_POSITION}", "status": _states(STAGE_STATES)},
    "attempts": {"number": f"BETWEEN 1 AND {ITERATION_MAX}", "status": _states(ATTEMPT_STATES), "started": _TIME,
                 "finished": _TIME},
    "events": {"ts": _TIME},
    "verdicts": {"ts": _TIME, "passed": "IN (0, 1)"},
    "metrics": {"ts": _TIME, "rank": f"BETWEEN 0 AND {RANK_MAX}", "iteration": f"BETWEEN 0 AND {ITERATION_MAX}",
                "value": _FINITE_RANGE,
                "nonfinite": _states(NONFINITE)},
    "metric_buckets": {"rank": f"BETWEEN 0 AND {RANK_MAX}", "bucket": f"BETWEEN 0 AND {ITERATION_MAX}",
                       "count": "BETWEEN 1 AND 9007199254740992",
                       "first_iteration": f"BETWEEN 0 AND {ITERATION_MAX}",
                       "last_iteration": f"BETWEEN first_iteration AND {ITERATION_MAX}",
                       "sum_ts": "BETWEEN 0 AND 1.7976931348623157e308", "first_ts": _TIME,
                       "last_ts": f"BETWEEN first_ts AND {TIME_MAX!r}", "low": _FINITE_RANGE, "high": _FINITE_RANGE,
                       "sum_value": _FINITE_RANGE},
}
FULL_CHECK_BYTES = 64 << 20  # a ledger up to this size has every metric row checked when it is opened
_INDEXES = {"metrics_by_attempt": "metrics", **{f"sqlite_autoindex_{t}_1": t for t in ("meta", "runs", "stages",
                                                                                        "rungs", "metric_buckets")}}
LEDGER_HINT = _HINT = "give the run directory of a stepdeploy rollout (stepdeploy rollout list)"


class NotALedger(BadInput):
    """The file is not a rollout ledger this stepdeploy can read (corrupt, foreign or newer)."""


def check_ledger(db: sqlite3.Connection, path: Path) -> int | None:
    """The schema version of the ledger open in `db`, None for a new (empty) file; NotALedger for anything
    else. Reads only: a refused file is never written to."""
    tables = {r[0] for r in db.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
    if not tables:
        _check_objects(db, path)  # an index, view or trigger without a table is not an empty file either
        return None
    if not set(COLUMNS) - OPTIONAL_TABLES <= tables:
        raise NotALedger(f"{path}: not a stepdeploy rollout ledger (its tables: "
                         f"{', '.join(sorted(tables))[:200]})", hint=_HINT)
    _check_objects(db, path)
    row = db.execute("SELECT value FROM meta WHERE key = 'schema_version'").fetchone()
    version = int(row[0]) if row is not None and str(row[0]).isdigit() else None
    if version not in (1, SCHEMA_VERSION):
        raise NotALedger(f"{path}: a rollout ledger of schema {str(row[0])[:40] if row else '(none)'}; this "
                         f"stepdeploy reads schema 1 and {SCHEMA_VERSION}", hint=_HINT)
    whole = _size(db) <= FULL_CHECK_BYTES or version == 1  # version 1 is rebuilt (every row read) when opened
    checks = ["PRAGMA quick_check(3)"] if whole else [f"PRAGMA quick_check({t})" for t in sorted(tables)
                                                       if t not in LARGE_TABLES]
    for check in checks:
        damage = [str(r[0]) for r in db.execute(check)]
        if damage != ["ok"]:  # a damaged page or index would fail a later query: refuse it now
            found = " ".join("; ".join(damage).split())[:200]
            raise NotALedger(f"{path}: the rollout ledger is damaged ({found})", hint=_HINT)
    spec = V1_COLUMNS if version == 1 else COLUMNS
    for table, columns in spec.items():
        if table not in tables:  # an optional table (OPTIONAL_TABLES) this ledger does not have
            continue
        if whole or table not in LARGE_TABLES:
            _check_rows(db, path, table, columns)
        elif table == "metrics":
            _check_metric_attempts(db, path, columns)
        else:
            _check_columns(db, path, table, columns)
    if version == 1 and "metric_buckets" in tables:
        raise NotALedger(f"{path}: a rollout ledger of schema 1 with table metric_buckets, which schema 1 never had",
                         hint=_HINT)
    _check_buckets_from(db, path, "metric_buckets" in tables)
    _check_links(db, path)
    return version


def _size(db: sqlite3.Connection) -> int:
    return int(db.execute("PRAGMA page_count").fetchone()[0]) * int(db.execute("PRAGMA page_size").fetchone()[0])


_METRIC_ATTEMPTS = """WITH RECURSIVE a(id) AS (
    SELECT (SELECT attempt_id FROM metrics ORDER BY attempt_id LIMIT 1)
    UNION ALL
    SELECT (SELECT attempt_id FROM metrics WHERE attempt_id > a.id ORDER BY attempt_id LIMIT 1) FROM a
    WHERE a.id IS NOT NULL)
SELECT id FROM a WHERE id IS NOT NULL LIMIT 1000001"""


def _check_metric_attempts(db: sqlite3.Connection, path: Path, columns: dict[str, tuple[str, ...]]) -> None:
    """A large ledger's metrics at open (their rows are checked as they are read): the columns, and the attempts
    its rows name (one index seek each) are attempts the ledger holds."""
    present = {r[1] for r in db.execute("PRAGMA table_info(metrics)")}
    if set(columns) - present:
        raise NotALedger(f"{path}: table metrics lacks {', '.join(sorted(set(columns) - present))}; "
                         "not a rollout ledger this stepdeploy wrote")
    attempts = {r[0] for r in db.execute("SELECT id FROM attempts")}
    for (attempt,) in db.execute(_METRIC_ATTEMPTS):
        if type(attempt) is not int or attempt not in attempts:
            raise NotALedger(f"{path}: table metrics holds rows of attempt {str(attempt)[:40]!r}, which the ledger "
                             "does not hold; the ledger is corrupt or was not written by stepdeploy", hint=_HINT)


def _check_columns(db: sqlite3.Connection, path: Path, table: str, columns: dict[str, tuple[str, ...]]) -> None:
    present = {r[1] for r in db.execute(f"PRAGMA table_info({table})")}
    if set(columns) - present:
        raise NotALedger(f"{path}: table {table} lacks {', '.join(sorted(set(columns) - present))}; "
                         "not a rollout ledger this stepdeploy wrote")


def _check_buckets_from(db: sqlite3.Connection, path: Path, has_table: bool) -> None:
    """meta's BUCKETS_FROM: an attempt id (text of digits) where the ledger has table metric_buckets, absent
    where it has not."""
    row = db.execute("SELECT value FROM meta WHERE key = ?", (BUCKETS_FROM,)).fetchone()
    if row is None if has_table else row is not None:
        raise NotALedger(f"{path}: table metric_buckets and meta {BUCKETS_FROM!r} come together; this ledger has "
                         "one without the other", hint=_HINT)
    if row is not None and not (type(row[0]) is str and row[0].isdigit() and len(row[0]) <= 16):
        raise NotALedger(f"{path}: meta {BUCKETS_FROM!r} is not an attempt id", hint=_HINT)


def buckets_from(db: sqlite3.Connection) -> int | None:
    """The first attempt whose finite metric rows are all summarised in metric_buckets; None: no such table
    (check_ledger has checked the value)."""
    row = db.execute("SELECT value FROM meta WHERE key = ?", (BUCKETS_FROM,)).fetchone()
    return None if row is None else int(row[0])


def check_bucket_row(row: dict[str, object]) -> str | None:
    """What is wrong with one metric_buckets row as read (the columns it has), or None: COLUMNS and RANGES of
    table metric_buckets, as check_ledger's SQL checks them at open in a small ledger."""
    def number(v: object, low: float, high: float) -> bool:
        return _in(v, low, high, False)
    tests = {"run_id": lambda v: type(v) is str and len(v) <= MAX_TEXT_CHARS,
             "name": lambda v: type(v) is str and len(v) <= MAX_TEXT_CHARS,
             "attempt_id": lambda v: type(v) is int, "rank": lambda v: _in(v, 0, RANK_MAX, True),
             "bucket": lambda v: _in(v, 0, ITERATION_MAX, True), "count": lambda v: _in(v, 1, 1 << 53, True),
             "first_iteration": lambda v: _in(v, 0, ITERATION_MAX, True),
             "last_iteration": lambda v: _in(v, 0, ITERATION_MAX, True),
             "sum_ts": lambda v: number(v, 0, _FLOAT_MAX), "first_ts": lambda v: number(v, 0, TIME_MAX),
             "last_ts": lambda v: number(v, 0, TIME_MAX), "sum_value": lambda v: number(v, -_FLOAT_MAX, _FLOAT_MAX),
             "low": lambda v: number(v, -_FLOAT_MAX, _FLOAT_MAX), "high": lambda v: number(v, -_FLOAT_MAX, _FLOAT_MAX)}
    for column, value in row.items():
        test = tests.get(column)
        if test is not None and not test(value):
            return (f"a metric bucket ({str(row.get('name', '?'))[:80]}) holds a value of the wrong type or out of "
                    f"range in column {column}")
    if (type(row.get("first_iteration")) is int and type(row.get("last_iteration")) is int
            and row["first_iteration"] > row["last_iteration"]):  # type: ignore[operator]
        return f"a metric bucket ({str(row.get('name', '?'))[:80]}) ends before it starts"
    return None


def _in(value: object, low: float, high: float, integral: bool) -> bool:
    if integral:
        return type(value) is int and low <= value <= high
    return type(value) in (int, float) and low <= value <= high  # NaN fails


_FLOAT_MAX = 1.7976931348623157e308


_METRIC_TESTS = {"run_id": lambda v: type(v) is str and len(v) <= MAX_TEXT_CHARS,
                 "name": lambda v: type(v) is str and len(v) <= MAX_TEXT_CHARS,
                 "attempt_id": lambda v: type(v) is int, "ts": lambda v: _in(v, 0, TIME_MAX, False),
                 "rank": lambda v: _in(v, 0, RANK_MAX, True), "iteration": lambda v: _in(v, 0, ITERATION_MAX, True),
                 "value": lambda v: v is None or _in(v, -_FLOAT_MAX, _FLOAT_MAX, False),
                 "nonfinite": lambda v: v is None or v in NONFINITE}


def check_metric_row(row: dict[str, object]) -> str | None:
    """What is wrong with one metric row as read (any subset of its columns), or None: the checks that
    check_ledger's SQL makes at open (COLUMNS and RANGES of table metrics)."""
    if row.keys() == _METRIC_TESTS.keys():  # a whole row (what the readers read): the same tests, inline
        run_id, name, attempt, ts, rank, iteration, value, nonfinite = (
            row["run_id"], row["name"], row["attempt_id"], row["ts"], row["rank"], row["iteration"], row["value"],
            row["nonfinite"])
        if (type(run_id) is str and len(run_id) <= MAX_TEXT_CHARS and type(name) is str
                and len(name) <= MAX_TEXT_CHARS and type(attempt) is int and type(ts) in (int, float)
                and 0 <= ts <= TIME_MAX and type(rank) is int and 0 <= rank <= RANK_MAX and type(iteration) is int
                and 0 <= iteration <= ITERATION_MAX and (nonfinite is None or nonfinite in NONFINITE)
                and (value is None or (type(value) in (int, float) and -_FLOAT_MAX <= value <= _FLOAT_MAX))):
            return None
    for column, value in row.items():  # which column is wrong (or a partial row)
        test = _METRIC_TESTS.get(column)
        if test is not None and not test(value):
            return (f"a metric row ({str(row.get('name', '?'))[:80]}) holds a value of the wrong type or out of "
                    f"range in column {column}")
    return None


def _check_objects(db: sqlite3.Connection, path: Path) -> None:
    """Exactly the tables and indexes SCHEMA creates (and sqlite's own bookkeeping of AUTOINCREMENT): a
    trigger would run its SQL on the next write, a view or another table is not what stepdeploy wrote."""
    names = set()
    for kind, name, table in db.execute("SELECT type, name, tbl_name FROM sqlite_master"):
        known = ((kind == "table" and (name in COLUMNS or name == "sqlite_sequence"))
                 or (kind == "index" and _INDEXES.get(name) == table))
        if not known:
            raise NotALedger(f"{path}: holds a {kind} {str(name)[:80]!r} that a stepdeploy ledger never has; "
                             "refusing it (nothing was run or written)", hint=_HINT)
        names.add(name)
    if "sqlite_sequence" in names and db.execute(
            "SELECT 1 FROM sqlite_sequence WHERE typeof(seq) != 'integer' OR seq NOT BETWEEN 0 AND 9007199254740992 "
            "OR name NOT IN ('attempts', 'events', 'verdicts') LIMIT 1").fetchone() is not None:
        raise NotALedger(f"{path}: its AUTOINCREMENT counters (sqlite_sequence) are not a ledger's", hint=_HINT)


def _check_rows(db: sqlite3.Connection, path: Path, table: str, columns: dict[str, tuple[str, ...]]) -> None:
    present = {r[1] for r in db.execute(f"PRAGMA table_info({table})")}
    if set(columns) - present:
        raise NotALedger(f"{path}: table {table} lacks {', '.join(sorted(set(columns) - present))}; "
                         "not a rollout ledger this stepdeploy wrote")
    tests = {name: value_test(name, kinds, RANGES.get(table, {}).get(name)) for name, kinds in columns.items()}
    bad = db.execute(f"SELECT rowid FROM {table} WHERE NOT ({' AND '.join(tests.values())}) LIMIT 1").fetchone()
    if bad is None:
        return
    column = next(name for name, test in tests.items()
                  if not db.execute(f"SELECT {test} FROM {table} WHERE rowid = ?", (bad[0],)).fetchone()[0])
    raise NotALedger(f"{path}: row {bad[0]} of table {table}: column {column} holds a value of the wrong type, "
                     "out of range or an unknown state; the ledger is corrupt or was not written by stepdeploy",
                     hint=_HINT)


def value_test(name: str, kinds: tuple[str, ...], allowed: str | None) -> str:
    """SQL that is true when column `name` holds one of `kinds` (SQLite types, or JSON text) and, when
    `allowed` is given, a value it allows (or a NULL its kinds allow)."""
    if kinds in (("json",), ("jsonany",)):
        test = f"(typeof({name}) = 'text' AND length({name}) <= {MAX_JSON_CHARS} AND json_valid({name})"
        return test + (f" AND json_type({name}) = 'object')" if kinds == ("json",) else ")")
    test = f"typeof({name}) IN ({', '.join(repr(k) for k in kinds)})"
    if "text" in kinds:
        test += f" AND (typeof({name}) != 'text' OR length({name}) <= {MAX_TEXT_CHARS})"
    if allowed is not None:
        test += f" AND ({name} IS NULL OR {name} {allowed})"
    return f"({test})"


def _check_links(db: sqlite3.Connection, path: Path) -> None:
    """Every stage belongs to a run and every attempt, rung and verdict to a stage of its run; every run has
    a stage, and a passed run passed (or skipped) every one (what this ledger always writes)."""
    for table, stage in (("attempts", "stage"), ("rungs", "stage"), ("verdicts", "stage")):
        orphan = db.execute(f"SELECT {stage} FROM {table} t WHERE NOT EXISTS (SELECT 1 FROM stages s "
                            f"WHERE s.run_id = t.run_id AND s.name = t.{stage}) LIMIT 1").fetchone()
        if orphan is not None:
            raise NotALedger(f"{path}: table {table} names stage {str(orphan[0])[:80]!r}, which its run does "
                             "not have; the ledger is inconsistent")
    checks = (
        ("SELECT run_id FROM stages s WHERE NOT EXISTS (SELECT 1 FROM runs r WHERE r.id = s.run_id)",
         "has stages of run {!r}, which it does not hold"),
        ("SELECT id FROM runs r WHERE NOT EXISTS (SELECT 1 FROM stages s WHERE s.run_id = r.id)",
         "run {!r} has no stages"),
        (f"SELECT id FROM runs r WHERE status = 'passed' AND EXISTS (SELECT 1 FROM stages s WHERE s.run_id = r.id "
         f"AND s.status NOT IN ({', '.join(repr(s) for s in sorted(FINAL))}))",
         "run {!r} is marked passed with a stage that did not pass"),
    )
    for sql, what in checks:
        found = db.execute(sql + " LIMIT 1").fetchone()
        if found is not None:
            raise NotALedger(f"{path}: " + what.format(str(found[0])[:80]) + "; the ledger is inconsistent",
                             hint=_HINT)
