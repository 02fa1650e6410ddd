"""The rollout ledger: one SQLite database (WAL) in the run directory.

Every transition is written (and committed) before it is acted on, so a controller killed at any instant
leaves a ledger from which `rollout resume` continues. Rows are never rewritten into the past: a stage's
status moves forward, attempts and events are appended. One controller at a time holds the run's lock.

A file that is not such a ledger (corrupt, another program's SQLite database, a newer schema, rows of the
wrong type) is refused with one BadInput line before anything reads from or writes to it. A metric that is
not finite (a NaN loss) is stored as NULL with `nonfinite` saying what it was, so the loss gate can judge it.
"""

from __future__ import annotations

import errno
import fcntl
import json
import math
import os
import socket
import sqlite3
import stat
import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from stepdeploy import safeio
from stepdeploy.errors import BadInput, StepdeployError
from stepdeploy.ledger_buckets import add_buckets, add_table
from stepdeploy.ledger_schema import (
    ATTEMPT_STATES,
    FINAL,
    MIGRATE_1,
    RUN_STATES,
    SCHEMA,
    SCHEMA_VERSION,
    STAGE_STATES,
    NotALedger,
    check_ledger,
    check_metric_row,
)

# Re-exported: the ledger's readers import them from here.
__all__ = ["ATTEMPT_STATES", "RUN_STATES", "SCHEMA", "SCHEMA_VERSION", "STAGE_STATES", "Ledger", "LedgerLocked",
           "NotALedger", "StageRow", "controller_lock"]


class LedgerLocked(StepdeployError):
    """Another controller drives this run."""


def _dumps(value: Any) -> str:
    """JSON for a ledger column: standard JSON only (a NaN or infinity becomes null, never the bare word)."""
    return json.dumps(safeio.json_safe(value))


@dataclass(frozen=True)
class StageRow:
    """One row of the ledger's stages table: a rollout stage's progress in one run."""

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
        if path.is_symlink():  # sqlite follows it (and creates a dangling one's target): never through a link
            raise NotALedger(f"{path}: a symbolic link, not a rollout ledger; refusing to follow it",
                             hint="give the run directory that holds the ledger itself")
        if path.exists():
            safeio.require_regular(path, "rollout ledger")  # a FIFO would block sqlite forever
        elif not create:
            raise NotALedger(f"{path}: no rollout ledger here", hint="stepdeploy rollout list")
        else:
            os.close(open_run_file(path, "rollout ledger"))  # created here, without following a planted link
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
                with self.tx() as db:
                    for statement in filter(str.strip, SCHEMA.split(";")):
                        db.execute(statement)
                    db.execute("INSERT OR IGNORE INTO meta VALUES ('schema_version', ?)", (str(SCHEMA_VERSION),))
                    add_table(db)
            elif version == 1:
                with self.tx() as db:
                    for statement in filter(str.strip, MIGRATE_1.split(";")):
                        db.execute(statement)
                    db.execute("UPDATE meta SET value = ? WHERE key = 'schema_version'", (str(SCHEMA_VERSION),))
                    add_table(db)
            elif self.create and self.db.execute("SELECT 1 FROM sqlite_master WHERE name = 'metric_buckets'"
                                                 ).fetchone() is None:
                with self.tx() as db:  # a ledger written before the metric summaries (ledger_buckets.py)
                    add_table(db)
        except (sqlite3.DatabaseError, UnicodeDecodeError) as exc:  # sqlite's message can quote damaged bytes
            raise NotALedger(f"{self.path}: not a readable rollout ledger ({exc})",
                             hint="stepdeploy rollout list  (shows the runs and their directories)") from None

    def _version(self) -> int | None:
        """The schema version of the ledger, None for a new (empty) file; NotALedger for anything else."""
        return check_ledger(self.db, self.path)

    def close(self) -> None:
        self.db.close()

    def _loads(self, text: str) -> Any:
        """A JSON column (valid JSON of bounded length since check_ledger; nesting bounded here). A number too
        large for a float (1e999, which the ledger never writes) reads as null, as a NaN is written."""
        return safeio.json_safe(safeio.loads_json(text, f"{self.path}: a JSON column"))

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
        if not stages:  # a run without stages would have nothing to pass and pass
            raise BadInput(f"run {run_id}: a rollout needs at least one stage")
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
        """A run passes only when it has stages and every one passed or was skipped."""
        _known(status, RUN_STATES, "run")
        with self.tx() as db:
            if status == "passed":
                left = [r["name"] for r in db.execute("SELECT name, status FROM stages WHERE run_id = ? ORDER BY "
                                                      "position", (run_id,)) if r["status"] not in FINAL]
                stages = db.execute("SELECT COUNT(*) FROM stages WHERE run_id = ?", (run_id,)).fetchone()[0]
                if left or not stages:
                    raise StepdeployError(f"run {run_id} cannot pass: " + (f"stage {left[0]} has not passed"
                                                                           if left else "it has no stages"))
            db.execute("UPDATE runs SET status = ?, updated = ? WHERE id = ?", (status, self.clock(), run_id))
            self._event(db, run_id, "run", f"run {status}")

    def stages(self, run_id: str) -> list[StageRow]:
        rows = self.db.execute("SELECT * FROM stages WHERE run_id = ? ORDER BY position", (run_id,))
        return [StageRow(r["name"], r["position"], r["status"], r["started"], r["finished"], r["reason"])
                for r in rows]

    def next_stage(self, run_id: str) -> StageRow | None:
        """The first stage not finished for good (passed/skipped): where a (resumed) run continues."""
        return next((s for s in self.stages(run_id) if s.status not in FINAL), None)

    def set_stage(self, run_id: str, stage: str, status: str, reason: str | None = None) -> None:
        _known(status, STAGE_STATES, "stage")
        now = self.clock()
        with self.tx() as db:
            current = db.execute("SELECT status FROM stages WHERE run_id = ? AND name = ?",
                                 (run_id, stage)).fetchone()
            if current is None:
                raise StepdeployError(f"run {run_id!r} has no stage {stage!r}")
            if current["status"] in FINAL:
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
        _known(status, STAGE_STATES, "rung")
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
        _known(status, ATTEMPT_STATES, "attempt")
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

    def events(self, run_id: str, since_id: int = 0, *, kind: str | None = None) -> list[dict[str, Any]]:
        """The run's events after `since_id` in order; of one `kind` only when given."""
        rows = self.db.execute("SELECT * FROM events WHERE run_id = ? AND id > ? AND (?3 IS NULL OR kind = ?3) "
                               "ORDER BY id", (run_id, since_id, kind))
        return [{**dict(r), "data": self._loads(r["data"])} for r in rows]

    def add_metrics(self, run_id: str, attempt_id: int, rows: list[tuple[float, int, int, str, float]]) -> None:
        """rows: (ts, rank, iteration, name, value), already downsampled by the caller. A value that is not
        finite (a NaN loss) is stored as NULL with `nonfinite` saying what it was: the gates judge it, the
        ledger never refuses it. The finite rows are added to their buckets (ledger_buckets.py) in the same
        transaction."""
        with self.tx() as db:
            db.executemany("INSERT INTO metrics VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
                           [(run_id, attempt_id, *row[:4], *_metric_value(row[4])) for row in rows])
            add_buckets(db, run_id, attempt_id, rows)  # the report's summaries of the finite rows

    def metric_names(self, run_id: str) -> list[str]:
        rows = self.db.execute("SELECT DISTINCT name FROM metrics WHERE run_id = ? ORDER BY name", (run_id,))
        return [r["name"] for r in rows]

    def metrics(self, run_id: str, name: str) -> list[dict[str, Any]]:
        """The finite values of metric `name` (see nonfinite_metrics for the others)."""
        rows = self.db.execute("SELECT * FROM metrics WHERE run_id = ? AND name = ? AND value IS NOT NULL "
                               "ORDER BY ts, rank", (run_id, name))
        return self._checked_metrics(rows)

    def nonfinite_metrics(self, run_id: str) -> list[dict[str, Any]]:
        rows = self.db.execute("SELECT * FROM metrics WHERE run_id = ? AND value IS NULL ORDER BY ts, rank",
                               (run_id,))
        return self._checked_metrics(rows)

    def _checked_metrics(self, rows: Iterable[sqlite3.Row]) -> list[dict[str, Any]]:
        """Metric rows as read, each checked (a large ledger's are not checked at open: ledger_schema.py)."""
        out = [dict(r) for r in rows]
        for row in out:
            if (fault := check_metric_row(row)) is not None:
                raise NotALedger(f"{self.path}: {fault}; the ledger is corrupt or was not written by stepdeploy")
        return out


def _known(status: str, states: tuple[str, ...], what: str) -> None:
    """The ledger writes only states it reads back (check_ledger refuses any other)."""
    if status not in states:
        raise ValueError(f"unknown {what} status {status!r} (one of {', '.join(states)})")


def _metric_value(value: float) -> tuple[float | None, str | None]:
    number = float(value)
    return (number, None) if math.isfinite(number) else (None, repr(number))


def open_run_file(path: Path, what: str) -> int:
    """A descriptor (read-write) on the file stepdeploy keeps at `path` in a run directory, created if absent:
    never through a symbolic link (O_NOFOLLOW), never truncated (no O_TRUNC), and refused (BadInput) unless
    it is a regular file with no other name (a hard link to a victim would be written through as well)."""
    flags = os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
    try:
        fd = os.open(path, flags, 0o644)
    except OSError as exc:
        why = "a symbolic link" if exc.errno == errno.ELOOP else exc.strerror or str(exc)
        raise BadInput(f"{path}: cannot open the {what}: {why}; refusing it",
                       hint=f"remove {path} if no stepdeploy command is using it") from None
    info = os.fstat(fd)
    if not stat.S_ISREG(info.st_mode) or info.st_nlink != 1:
        os.close(fd)
        kind = "is not a regular file" if not stat.S_ISREG(info.st_mode) else f"has {info.st_nlink} names"
        raise BadInput(f"{path}: the {what} {kind}; refusing it",
                       hint=f"remove {path} if no stepdeploy command is using it")
    return fd


@contextmanager
def controller_lock(run_dir: Path) -> Iterator[None]:
    """Exactly one controller per run: a second one is refused with who holds the lock and since when.

    The kernel drops a flock when its holder dies (kill -9 included), so a crashed controller never leaves
    the run locked. The lock file is opened by open_run_file: a planted link or device is refused, not used.
    """
    path = run_dir / "controller.lock"
    fd = open_run_file(path, "controller lock")
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 4096, 0).decode("utf-8", "replace").strip() or "another controller"
            raise LedgerLocked(f"run {run_dir.name} is being driven by {holder}",
                               hint=f"wait for it, or stop it: stepdeploy rollout stop {run_dir}") from None
        holder = f"pid {os.getpid()} on {socket.gethostname()} since {time.strftime('%Y-%m-%d %H:%M:%S')}\n"
        os.ftruncate(fd, 0)  # this file only: a regular file with no other name (open_run_file)
        os.pwrite(fd, holder.encode(), 0)
        yield
    finally:
        os.close(fd)
