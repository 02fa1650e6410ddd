"""The rollout ledger: one SQLite database (WAL) in the run directory.

Every transition is written (and committed) before it is acted on, so a controller killed at any instant
leaves a ledger from which `rollout resume` continues. Rows are never rewritten into the past: a stage's
status moves forward, attempts and events are appended. One controller at a time holds the run's lock.

A file that is not such a ledger (corrupt, another program's SQLite database, a newer schema, rows of the
wrong type) is refused with one BadInput line before anything reads from or writes to it. A metric that is
not finite (a NaN loss) is stored as NULL with `nonfinite` saying what it was, so the loss gate can judge it.
"""

from __future__ import annotations

import fcntl
import json
import math
import os
import socket
import sqlite3
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from stepdeploy import safeio
from stepdeploy.errors import BadInput, StepdeployError

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
# Version 1's metrics table held finite values only (value REAL NOT NULL); version 2 rebuilds it.
_MIGRATE_1 = """
ALTER TABLE metrics RENAME TO metrics_v1;
CREATE TABLE metrics (
    run_id TEXT NOT NULL, attempt_id INTEGER NOT NULL, ts REAL NOT NULL, rank INTEGER NOT NULL,
    iteration INTEGER NOT NULL, name TEXT NOT NULL, value REAL, nonfinite TEXT);
INSERT INTO metrics SELECT run_id, attempt_id, ts, rank, iteration, name, value, NULL FROM metrics_v1;
DROP TABLE metrics_v1;
DROP INDEX IF EXISTS metrics_by_attempt;
CREATE INDEX metrics_by_attempt ON metrics (attempt_id, name, iteration);
"""
_NUMBER, _TEXT, _INT = ("real", "integer"), ("text",), ("integer",)
# What every column must hold (SQLite stores any type anywhere): checked when a ledger is opened, so that the
# report and the controller never meet a string where a time should be, or a detail that is not JSON.
_COLUMNS: dict[str, dict[str, tuple[str, ...]]] = {
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
}
_V1_COLUMNS = {**_COLUMNS, "metrics": {k: v for k, v in _COLUMNS["metrics"].items() if k != "nonfinite"}}

# Forward-only status transitions: a resumed controller can never move a stage back into the past.
STAGE_STATES = ("pending", "running", "passed", "failed", "skipped", "stopped")
_FINAL = {"passed", "skipped"}


class LedgerLocked(StepdeployError):
    """Another controller drives this run."""


class NotALedger(BadInput):
    """The file is not a rollout ledger this stepdeploy can read (corrupt, foreign or newer)."""


def _dumps(value: Any) -> str:
    """JSON for a ledger column: standard JSON only (a NaN or infinity becomes null, never the bare word)."""
    return json.dumps(safeio.finite(value))


@dataclass(frozen=True)
class Stage:
    name: str
    position: int
    status: str
    started: float | None
    finished: float | None
    reason: str | None


class Ledger:
    def __init__(self, path: Path, *, clock: Callable[[], float] = time.time, create: bool = True) -> None:
        """Open the ledger at `path`, creating it when there is none (unless not `create`: a reader never
        writes); NotALedger when the file holds something else (nothing is written to such a file)."""
        self.path = path
        self.clock = clock
        self.create = create
        if path.exists() or path.is_symlink():
            safeio.require_regular(path, "rollout ledger")  # a FIFO would block sqlite forever
        try:
            self.db = sqlite3.connect(path, isolation_level=None, timeout=30)
        except sqlite3.Error as exc:
            raise NotALedger(f"{path}: cannot open the rollout ledger: {exc}") from None
        # a damaged page can hold text that is not UTF-8: shown replaced, never an exception
        self.db.text_factory = lambda data: data.decode("utf-8", "replace")
        try:
            self._open()
        except BaseException:
            self.db.close()
            raise

    def _open(self) -> None:
        self.db.row_factory = sqlite3.Row
        try:
            version = self._version()
            if version is None and not self.create:
                raise NotALedger(f"{self.path}: an empty file, not a rollout ledger",
                                 hint="stepdeploy rollout list  (shows the runs and their directories)")
            self.db.execute("PRAGMA journal_mode=WAL")
            self.db.execute("PRAGMA synchronous=FULL")  # a committed transition survives a power cut
            if version is None:
                self.db.executescript(SCHEMA)
                self.db.execute("INSERT OR IGNORE INTO meta VALUES ('schema_version', ?)", (str(SCHEMA_VERSION),))
            elif version == 1:
                with self.tx() as db:
                    for statement in filter(str.strip, _MIGRATE_1.split(";")):
                        db.execute(statement)
                    db.execute("UPDATE meta SET value = ? WHERE key = 'schema_version'", (str(SCHEMA_VERSION),))
        except (sqlite3.DatabaseError, UnicodeDecodeError) as exc:  # sqlite's message can quote damaged bytes
            raise NotALedger(f"{self.path}: not a readable rollout ledger ({exc})",
                             hint="stepdeploy rollout list  (shows the runs and their directories)") from None

    def _version(self) -> int | None:
        """The schema version of the ledger, None for a new (empty) file; NotALedger for anything else."""
        tables = {r[0] for r in self.db.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
        if not tables:
            return None
        hint = "give the run directory of a stepdeploy rollout (stepdeploy rollout list)"
        if not set(_COLUMNS) <= tables:
            raise NotALedger(f"{self.path}: not a stepdeploy rollout ledger (its tables: "
                             f"{', '.join(sorted(tables))[:200]})", hint=hint)
        row = self.db.execute("SELECT value FROM meta WHERE key = 'schema_version'").fetchone()
        version = int(row[0]) if row is not None and str(row[0]).isdigit() else None
        if version not in (1, SCHEMA_VERSION):
            raise NotALedger(f"{self.path}: a rollout ledger of schema {row[0] if row else '(none)'}; this "
                             f"stepdeploy reads schema 1 and {SCHEMA_VERSION}", hint=hint)
        damage = [str(r[0]) for r in self.db.execute("PRAGMA quick_check(3)")]
        if damage != ["ok"]:  # a damaged page or index would fail a later query: refuse it now
            found = " ".join("; ".join(damage).split())[:200]
            raise NotALedger(f"{self.path}: the rollout ledger is damaged ({found})", hint=hint)
        self._check_rows(_V1_COLUMNS if version == 1 else _COLUMNS)
        self._check_links()
        return version

    def _check_rows(self, spec: dict[str, dict[str, tuple[str, ...]]]) -> None:
        for table, columns in spec.items():
            present = {r[1] for r in self.db.execute(f"PRAGMA table_info({table})")}
            if set(columns) - present:
                raise NotALedger(f"{self.path}: table {table} lacks {', '.join(sorted(set(columns) - present))}; "
                                 "not a rollout ledger this stepdeploy wrote")
            tests = [_column_test(name, kinds) for name, kinds in columns.items()]
            bad = self.db.execute(f"SELECT rowid FROM {table} WHERE NOT ({' AND '.join(tests)}) LIMIT 1").fetchone()
            if bad is not None:
                raise NotALedger(f"{self.path}: row {bad[0]} of table {table} holds values of the wrong type; "
                                 "the ledger is corrupt")

    def _check_links(self) -> None:
        """Every attempt, rung and verdict belongs to a stage of its run (what this ledger always writes)."""
        for table, stage in (("attempts", "stage"), ("rungs", "stage"), ("verdicts", "stage")):
            orphan = self.db.execute(f"SELECT {stage} FROM {table} t WHERE NOT EXISTS (SELECT 1 FROM stages s "
                                     f"WHERE s.run_id = t.run_id AND s.name = t.{stage}) LIMIT 1").fetchone()
            if orphan is not None:
                raise NotALedger(f"{self.path}: table {table} names stage {orphan[0]!r}, which its run does not "
                                 "have; the ledger is inconsistent")

    def close(self) -> None:
        self.db.close()

    def _loads(self, text: str) -> Any:
        """A JSON column (valid JSON since _check_rows, but it may nest without bound)."""
        return safeio.loads_json(text, f"{self.path}: a JSON column")

    @contextmanager
    def tx(self) -> Iterator[sqlite3.Connection]:
        self.db.execute("BEGIN IMMEDIATE")
        try:
            yield self.db
        except BaseException:
            self.db.execute("ROLLBACK")
            raise
        self.db.execute("COMMIT")

    # --- runs and stages -------------------------------------------------------------------------------
    def create_run(self, run_id: str, config: dict[str, Any], stages: list[str]) -> None:
        now = self.clock()
        with self.tx() as db:
            db.execute("INSERT INTO runs VALUES (?, ?, ?, 'pending', ?)", (run_id, now, now, _dumps(config)))
            db.executemany("INSERT INTO stages (run_id, name, position, status) VALUES (?, ?, ?, 'pending')",
                           [(run_id, name, i) for i, name in enumerate(stages)])
            self._event(db, run_id, "run", f"run {run_id} created with stages {', '.join(stages)}")

    def run_ids(self) -> list[str]:
        return [r["id"] for r in self.db.execute("SELECT id FROM runs ORDER BY created")]

    def run(self, run_id: str) -> dict[str, Any]:
        row = self.db.execute("SELECT * FROM runs WHERE id = ?", (run_id,)).fetchone()
        if row is None:
            raise StepdeployError(f"no run {run_id!r} in {self.path}")
        return {**dict(row), "config": self._loads(row["config"])}

    def set_run_status(self, run_id: str, status: str) -> None:
        with self.tx() as db:
            db.execute("UPDATE runs SET status = ?, updated = ? WHERE id = ?", (status, self.clock(), run_id))
            self._event(db, run_id, "run", f"run {status}")

    def stages(self, run_id: str) -> list[Stage]:
        rows = self.db.execute("SELECT * FROM stages WHERE run_id = ? ORDER BY position", (run_id,))
        return [Stage(r["name"], r["position"], r["status"], r["started"], r["finished"], r["reason"])
                for r in rows]

    def next_stage(self, run_id: str) -> Stage | None:
        """The first stage not finished for good (passed/skipped): where a (resumed) run continues."""
        return next((s for s in self.stages(run_id) if s.status not in _FINAL), None)

    def set_stage(self, run_id: str, stage: str, status: str, reason: str | None = None) -> None:
        if status not in STAGE_STATES:
            raise ValueError(f"unknown stage status {status!r}")
        now = self.clock()
        with self.tx() as db:
            current = db.execute("SELECT status FROM stages WHERE run_id = ? AND name = ?",
                                 (run_id, stage)).fetchone()
            if current is None:
                raise StepdeployError(f"run {run_id!r} has no stage {stage!r}")
            if current["status"] in _FINAL:
                raise StepdeployError(f"stage {stage} already {current['status']}; it is never re-run")
            started = now if status == "running" else None
            finished = now if status in ("passed", "failed", "skipped", "stopped") else None
            db.execute("UPDATE stages SET status = ?, reason = ?, started = COALESCE(started, ?), "
                       "finished = ? WHERE run_id = ? AND name = ?",
                       (status, reason, started, finished, run_id, stage))
            self._event(db, run_id, "stage", f"{stage} {status}" + (f": {reason}" if reason else ""),
                        stage=stage)

    # --- rungs, attempts, verdicts, events, metrics ----------------------------------------------------
    def add_rungs(self, run_id: str, stage: str, rungs: list[tuple[str, dict[str, Any]]]) -> None:
        with self.tx() as db:
            db.executemany("INSERT OR IGNORE INTO rungs VALUES (?, ?, ?, ?, 'pending', ?, NULL)",
                           [(run_id, stage, name, i, _dumps(cfg)) for i, (name, cfg) in enumerate(rungs)])

    def rungs(self, run_id: str, stage: str) -> list[dict[str, Any]]:
        rows = self.db.execute("SELECT * FROM rungs WHERE run_id = ? AND stage = ? ORDER BY position",
                               (run_id, stage))
        return [{**dict(r), "config": self._loads(r["config"])} for r in rows]

    def set_rung(self, run_id: str, stage: str, rung: str, status: str, reason: str | None = None) -> None:
        with self.tx() as db:
            db.execute("UPDATE rungs SET status = ?, reason = ? WHERE run_id = ? AND stage = ? AND name = ?",
                       (status, reason, run_id, stage, rung))
            self._event(db, run_id, "rung", f"{stage}/{rung} {status}" + (f": {reason}" if reason else ""),
                        stage=stage, rung=rung)

    def start_attempt(self, run_id: str, stage: str, rung: str, detail: dict[str, Any]) -> int:
        with self.tx() as db:
            number = db.execute("SELECT COUNT(*) FROM attempts WHERE run_id = ? AND stage = ? AND rung = ?",
                                (run_id, stage, rung)).fetchone()[0] + 1
            cur = db.execute("INSERT INTO attempts (run_id, stage, rung, number, status, started, detail) "
                             "VALUES (?, ?, ?, ?, 'running', ?, ?)",
                             (run_id, stage, rung, number, self.clock(), _dumps(detail)))
            self._event(db, run_id, "attempt", f"{stage}/{rung} attempt {number} started", stage=stage,
                        rung=rung, data=detail)
            return int(cur.lastrowid or 0)

    def finish_attempt(self, attempt_id: int, status: str, detail: dict[str, Any] | None = None) -> None:
        with self.tx() as db:
            row = db.execute("SELECT * FROM attempts WHERE id = ?", (attempt_id,)).fetchone()
            merged = {**self._loads(row["detail"]), **(detail or {})}
            db.execute("UPDATE attempts SET status = ?, finished = ?, detail = ? WHERE id = ?",
                       (status, self.clock(), _dumps(merged), attempt_id))
            self._event(db, row["run_id"], "attempt", f"{row['stage']}/{row['rung']} attempt {row['number']} "
                        f"{status}", stage=row["stage"], rung=row["rung"], data=detail or {})

    def attempts(self, run_id: str, stage: str | None = None) -> list[dict[str, Any]]:
        sql, args = "SELECT * FROM attempts WHERE run_id = ?", [run_id]
        if stage is not None:
            sql, args = sql + " AND stage = ?", [*args, stage]
        return [{**dict(r), "detail": self._loads(r["detail"])} for r in self.db.execute(sql + " ORDER BY id", args)]

    def verdict(self, run_id: str, stage: str, rung: str, gate: str, passed: bool, measured: Any,
                threshold: Any, reason: str) -> None:
        with self.tx() as db:
            db.execute("INSERT INTO verdicts (run_id, ts, stage, rung, gate, passed, measured, threshold, reason) "
                       "VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)",
                       (run_id, self.clock(), stage, rung, gate, int(passed), _dumps(measured),
                        _dumps(threshold), reason))
            self._event(db, run_id, "gate", f"{stage}/{rung} gate {gate} {'passed' if passed else 'FAILED'}: "
                        f"{reason}", stage=stage, rung=rung)

    def verdicts(self, run_id: str) -> list[dict[str, Any]]:
        rows = self.db.execute("SELECT * FROM verdicts WHERE run_id = ? ORDER BY id", (run_id,))
        return [{**dict(r), "passed": bool(r["passed"]), "measured": self._loads(r["measured"]),
                 "threshold": self._loads(r["threshold"])} for r in rows]

    def event(self, run_id: str, kind: str, message: str, *, stage: str | None = None, rung: str | None = None,
              data: dict[str, Any] | None = None) -> None:
        with self.tx() as db:
            self._event(db, run_id, kind, message, stage=stage, rung=rung, data=data)

    def _event(self, db: sqlite3.Connection, run_id: str, kind: str, message: str, *, stage: str | None = None,
               rung: str | None = None, data: dict[str, Any] | None = None) -> None:
        db.execute("INSERT INTO events (run_id, ts, stage, rung, kind, message, data) VALUES (?, ?, ?, ?, ?, ?, ?)",
                   (run_id, self.clock(), stage, rung, kind, message, _dumps(data or {})))

    def events(self, run_id: str, since_id: int = 0) -> list[dict[str, Any]]:
        rows = self.db.execute("SELECT * FROM events WHERE run_id = ? AND id > ? ORDER BY id", (run_id, since_id))
        return [{**dict(r), "data": self._loads(r["data"])} for r in rows]

    def add_metrics(self, run_id: str, attempt_id: int, rows: list[tuple[float, int, int, str, float]]) -> None:
        """rows: (ts, rank, iteration, name, value), already downsampled by the caller. A value that is not
        finite (a NaN loss) is stored as NULL with `nonfinite` saying what it was: the gates judge it, the
        ledger never refuses it."""
        with self.tx() as db:
            db.executemany("INSERT INTO metrics VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
                           [(run_id, attempt_id, *row[:4], *_metric_value(row[4])) for row in rows])

    def metric_names(self, run_id: str) -> list[str]:
        rows = self.db.execute("SELECT DISTINCT name FROM metrics WHERE run_id = ? ORDER BY name", (run_id,))
        return [r["name"] for r in rows]

    def metrics(self, run_id: str, name: str) -> list[dict[str, Any]]:
        """The finite values of metric `name` (see nonfinite_metrics for the others)."""
        rows = self.db.execute("SELECT * FROM metrics WHERE run_id = ? AND name = ? AND value IS NOT NULL "
                               "ORDER BY ts, rank", (run_id, name))
        return [dict(r) for r in rows]

    def nonfinite_metrics(self, run_id: str) -> list[dict[str, Any]]:
        rows = self.db.execute("SELECT * FROM metrics WHERE run_id = ? AND value IS NULL ORDER BY ts, rank",
                               (run_id,))
        return [dict(r) for r in rows]


def _metric_value(value: float) -> tuple[float | None, str | None]:
    number = float(value)
    return (number, None) if math.isfinite(number) else (None, repr(number))


def _column_test(name: str, kinds: tuple[str, ...]) -> str:
    """SQL that is true when column `name` holds one of `kinds` (SQLite types, or JSON text)."""
    if kinds == ("json",):
        return f"(typeof({name}) = 'text' AND json_valid({name}) AND json_type({name}) = 'object')"
    if kinds == ("jsonany",):
        return f"(typeof({name}) = 'text' AND json_valid({name}))"
    return f"typeof({name}) IN ({', '.join(repr(k) for k in kinds)})"


@contextmanager
def controller_lock(run_dir: Path) -> Iterator[None]:
    """Exactly one controller per run: a second one is refused with who holds the lock and since when.

    The kernel drops a flock when its holder dies (kill -9 included), so a crashed controller never leaves
    the run locked.
    """
    path = run_dir / "controller.lock"
    fh = open(path, "a+")  # noqa: SIM115 - held for the lifetime of the context
    try:
        try:
            fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            fh.seek(0)
            holder = fh.read().strip() or "another controller"
            raise LedgerLocked(f"run {run_dir.name} is being driven by {holder}",
                               hint=f"wait for it, or stop it: stepdeploy rollout stop {run_dir}") from None
        fh.seek(0)
        fh.truncate()
        fh.write(f"pid {os.getpid()} on {socket.gethostname()} since {time.strftime('%Y-%m-%d %H:%M:%S')}\n")
        fh.flush()
        yield
    finally:
        fh.close()
