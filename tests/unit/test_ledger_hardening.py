"""Issue 18: the ledger keeps a NaN loss (the loss gate fails the stage, `rollout resume` goes on), and a file
that is not a ledger this stepdeploy wrote is refused with one line by every command that reads one."""

from __future__ import annotations

import contextlib
import gc
import hashlib
import json
import math
import os
import sqlite3
import subprocess
import sys
from pathlib import Path
from typing import ClassVar

import pytest
from fuzz.harness import Runner  # tests/unit is on sys.path (pytest's rootdir-relative import)

from stepdeploy.cli.app import main
from stepdeploy.errors import BadInput
from stepdeploy.ledger import Ledger, NotALedger
from stepdeploy.remote.executor import NodeResult, NodeStatus, RunStatus

V1_SCHEMA = """
CREATE TABLE meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE runs (id TEXT PRIMARY KEY, created REAL NOT NULL, updated REAL NOT NULL, status TEXT NOT NULL,
    config TEXT NOT NULL);
CREATE TABLE stages (run_id TEXT NOT NULL, name TEXT NOT NULL, position INTEGER NOT NULL, status TEXT NOT NULL,
    started REAL, finished REAL, reason TEXT, PRIMARY KEY (run_id, name));
CREATE TABLE rungs (run_id TEXT NOT NULL, stage TEXT NOT NULL, name TEXT NOT NULL, position INTEGER NOT NULL,
    status TEXT NOT NULL, config TEXT NOT NULL, reason TEXT, PRIMARY KEY (run_id, stage, name));
CREATE TABLE attempts (id INTEGER PRIMARY KEY AUTOINCREMENT, run_id TEXT NOT NULL, stage TEXT NOT NULL,
    rung TEXT NOT NULL, number INTEGER NOT NULL, status TEXT NOT NULL, started REAL NOT NULL, finished REAL,
    detail TEXT NOT NULL DEFAULT '{}');
CREATE TABLE events (id INTEGER PRIMARY KEY AUTOINCREMENT, run_id TEXT NOT NULL, ts REAL NOT NULL, stage TEXT,
    rung TEXT, kind TEXT NOT NULL, message TEXT NOT NULL, data TEXT NOT NULL DEFAULT '{}');
CREATE TABLE verdicts (id INTEGER PRIMARY KEY AUTOINCREMENT, run_id TEXT NOT NULL, ts REAL NOT NULL,
    stage TEXT NOT NULL, rung TEXT NOT NULL, gate TEXT NOT NULL, passed INTEGER NOT NULL, measured TEXT NOT NULL,
    threshold TEXT NOT NULL, reason TEXT NOT NULL);
CREATE TABLE metrics (run_id TEXT NOT NULL, attempt_id INTEGER NOT NULL, ts REAL NOT NULL, rank INTEGER NOT NULL,
    iteration INTEGER NOT NULL, name TEXT NOT NULL, value REAL NOT NULL);
INSERT INTO meta VALUES ('schema_version', '1');
INSERT INTO runs VALUES ('r1', 1.0, 2.0, 'failed', '{"model": "tiny-dense"}');
INSERT INTO stages VALUES ('r1', 'warmup', 0, 'failed', 1.0, 2.0, NULL);
INSERT INTO metrics VALUES ('r1', 1, 1.5, 0, 1, 'loss', 5.5);
"""


def test_non_finite_metrics_are_kept_as_null_and_named(tmp_path: Path) -> None:
    led = Ledger(tmp_path / "ledger.sqlite")
    led.create_run("r1", {"model": "tiny-dense"}, ["warmup"])
    attempt = led.start_attempt("r1", "warmup", "target", {})
    led.add_metrics("r1", attempt, [(1.0, 0, 1, "loss", 5.0), (2.0, 0, 2, "loss", math.nan),
                                    (3.0, 0, 3, "loss", math.inf), (3.0, 0, 3, "grad_norm", -math.inf)])
    led.finish_attempt(attempt, "failed", {"final_loss": math.nan})
    assert [m["value"] for m in led.metrics("r1", "loss")] == [5.0]
    assert [(m["iteration"], m["name"], m["nonfinite"]) for m in led.nonfinite_metrics("r1")] == [
        (2, "loss", "nan"), (3, "loss", "inf"), (3, "grad_norm", "-inf")]
    assert led.attempts("r1")[0]["detail"] == {"final_loss": None}  # standard JSON: null, never NaN
    led.close()
    assert Ledger(tmp_path / "ledger.sqlite").run("r1")["config"] == {"model": "tiny-dense"}  # opens again


def test_a_version_1_ledger_is_migrated_and_keeps_its_rows(tmp_path: Path) -> None:
    path = tmp_path / "ledger.sqlite"
    with sqlite3.connect(path) as db:
        db.executescript(V1_SCHEMA)
    led = Ledger(path)
    assert led.db.execute("SELECT value FROM meta").fetchone()[0] == "2"
    led.add_metrics("r1", 1, [(2.0, 0, 2, "loss", math.nan)])
    assert [m["value"] for m in led.metrics("r1", "loss")] == [5.5]
    assert len(led.nonfinite_metrics("r1")) == 1


def _settle(path: Path) -> None:
    """The set-up's connections closed and its write-ahead log folded into the file, so that the file hashed
    is the whole database: otherwise whichever connection sqlite closes last (here, the refused Ledger's, when
    garbage collection has already closed the set-up's) checkpoints the log into the file, and the hash moves
    though nothing wrote (the suite saw it once in three full runs)."""
    gc.collect()
    if path.with_name(path.name + "-wal").exists():
        with contextlib.closing(sqlite3.connect(path)) as db:
            db.execute("PRAGMA wal_checkpoint(TRUNCATE)")


def _corrupt(kind: str, path: Path) -> None:
    """Write one kind of file that is not a readable ledger at `path`."""
    if kind == "random bytes":
        path.write_bytes(os.urandom(4096))
    elif kind == "truncated":
        led = Ledger(path)
        led.create_run("r1", {}, ["warmup"])
        led.close()
        data = path.read_bytes()
        path.write_bytes(data[: len(data) // 3])
    elif kind == "foreign database":
        with sqlite3.connect(path) as db:
            db.execute("CREATE TABLE users (name TEXT)")
    elif kind == "newer schema":
        Ledger(path).close()
        with sqlite3.connect(path) as db:
            db.execute("UPDATE meta SET value = '99'")
    elif kind == "wrong types":
        Ledger(path).create_run("r1", {}, ["warmup"])
        with sqlite3.connect(path) as db:
            db.execute("UPDATE runs SET created = 'yesterday'")
    elif kind == "config not JSON":
        Ledger(path).create_run("r1", {}, ["warmup"])
        with sqlite3.connect(path) as db:
            db.execute("UPDATE runs SET config = '{[/x]'")
    elif kind == "foreign config":
        Ledger(path).create_run("r1", {"stages": 7, "model": ["x"]}, ["warmup"])
    elif kind == "unknown stage":
        Ledger(path).create_run("r1", {"inventory": "inv.ini", "model": "tiny-dense", "stages": ["warmup"]},
                                ["bake"])
    elif kind == "fifo":
        os.mkfifo(path)
    elif kind == "empty":
        path.touch()
    elif kind == "orphan attempt":  # an attempt of a stage the run does not have (the report met it)
        led = Ledger(path)
        led.create_run("r1", {}, ["bake"])
        led.add_metrics("r1", led.start_attempt("r1", "warmup", "target", {}), [(1.0, 0, 1, "loss", 2.0)])
    elif kind == "damaged schema":  # a byte of the schema's text that is not UTF-8 (sqlite quotes it)
        led = Ledger(path)
        led.create_run("r1", {}, ["warmup"])
        led.close()
        data = bytearray(path.read_bytes())
        at = data.index(b"threshold TEXT NOT NULL") + 3
        data[at] = 0x85
        path.write_bytes(bytes(data))
    elif kind == "damaged index":
        led = Ledger(path)
        led.create_run("r1", {}, ["warmup"])
        led.add_metrics("r1", 1, [(float(i), 0, i, "loss", 1.0) for i in range(300)])
        led.close()
        with sqlite3.connect(path) as db:
            root = db.execute("SELECT rootpage FROM sqlite_master WHERE name = 'metrics_by_attempt'").fetchone()[0]
            size = db.execute("PRAGMA page_size").fetchone()[0]
        data = bytearray(path.read_bytes())
        data[(root - 1) * size + 8: (root - 1) * size + 64] = os.urandom(56)
        path.write_bytes(bytes(data))


KINDS = ["random bytes", "truncated", "foreign database", "newer schema", "wrong types", "config not JSON", "fifo",
         "damaged schema", "damaged index", "orphan attempt"]


@pytest.mark.parametrize("kind", KINDS)
def test_a_file_that_is_not_a_ledger_is_refused_and_left_alone(tmp_path: Path, kind: str) -> None:
    path = tmp_path / "ledger.sqlite"
    _corrupt(kind, path)
    _settle(path)
    before = hashlib.sha256(path.read_bytes()).hexdigest() if kind != "fifo" else None
    with pytest.raises(NotALedger if kind != "fifo" else BadInput) as caught:
        Ledger(path).run("r1")
    assert str(path) in caught.value.message and "\n" not in caught.value.message
    if before is not None:
        assert hashlib.sha256(path.read_bytes()).hexdigest() == before, "a foreign file was written to"


def _cli(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "stepdeploy", *args], capture_output=True, text=True, timeout=60,
                          cwd=cwd)


FRESH_INTERPRETER_KIND = KINDS[0]  # its commands start `python -m stepdeploy` afresh; the others fork (forked_cli)


@pytest.mark.parametrize("kind", [*KINDS, "empty", "foreign config", "unknown stage"])
def test_every_command_that_reads_a_ledger_exits_2_with_one_line(tmp_path: Path, kind: str,
                                                                 forked_cli: Runner) -> None:
    run = tmp_path / "runs" / "r1"
    run.mkdir(parents=True)
    _corrupt(kind, run / "ledger.sqlite")
    commands = [["report", str(run)], ["report", str(run), "--json"], ["rollout", "status", str(run)],
                ["rollout", "resume", str(run)], ["rollout", "stop", str(run)],
                ["rollout", "list", "--runs", str(tmp_path / "runs")]]
    if kind in ("foreign config", "unknown stage"):  # a ledger in itself: reading it is fine, acting is not
        commands = [["rollout", "resume", str(run)], ["rollout", "stop", str(run)]]
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    for args in commands:
        if kind == FRESH_INTERPRETER_KIND:
            fresh = _cli(*args, cwd=cwd)
            code, stdout, stderr = fresh.returncode, fresh.stdout, fresh.stderr
        else:
            case = forked_cli.run(cwd, args)
            code, stdout, stderr = case.rc, case.stdout, case.stderr
        errors = [line for line in stderr.splitlines() if line.startswith("error: ")]
        assert code == 2 and len(errors) == 1, (args, stdout, stderr)
        assert "Traceback" not in stderr
    assert not (run / "STOP").exists(), "rollout stop acted on a ledger it cannot read"
    if kind == "empty":
        assert (run / "ledger.sqlite").stat().st_size == 0, "a command that reads a ledger wrote one"


def test_text_a_damaged_page_left_undecodable_is_shown_replaced(tmp_path: Path,
                                                                 capsys: pytest.CaptureFixture[str]) -> None:
    run = tmp_path / "r1"
    run.mkdir()
    Ledger(run / "ledger.sqlite").create_run("r1", {"model": "tiny-dense"}, ["warmup"])
    with sqlite3.connect(run / "ledger.sqlite") as db:
        db.execute("UPDATE stages SET reason = CAST(x'ff41d8' AS TEXT)")
    assert _main("report", str(run)) == 0
    assert "\ufffdA\ufffd" in capsys.readouterr().out


class StubExecutor:
    """Stands in for the nodes: the run 'finishes' at once, and its metrics are the given losses."""

    losses: ClassVar[list[float]] = []
    poll_interval_s = 2.0  # what an executor without its own interval was polled at

    def __init__(self, *_args: object) -> None:
        self.targets = [object()]

    def __enter__(self) -> StubExecutor:
        return self

    def __exit__(self, *_exc: object) -> None:
        return None

    def prepare(self, _local: Path) -> list[NodeResult]:
        return [NodeResult("n1", True)]

    def start(self) -> list[NodeResult]:
        return [NodeResult("n1", True)]

    def stop(self, *_args: object) -> list[NodeResult]:
        return [NodeResult("n1", True)]

    def poll(self) -> RunStatus:
        return RunStatus((NodeStatus("n1", "exited", 0),))

    def run_command(self, *_args: object) -> list[object]:
        return []

    def fetch(self, dest: Path) -> list[NodeResult]:
        out = dest / "nodes" / "0-n1" / "out"
        out.mkdir(parents=True, exist_ok=True)
        lines = [json.dumps({"iteration": i, "loss": loss, "time": 1000.0 + i})
                 for i, loss in enumerate(self.losses, 1)]
        (out / "metrics.jsonl").write_text("\n".join(lines) + "\n")
        return [NodeResult("n1", True)]


def _main(*args: str) -> int:
    with pytest.raises(SystemExit) as exited:
        main(list(args))
    return int(exited.value.code or 0)


def _inventory(tmp_path: Path) -> Path:
    inventory = tmp_path / "inv.ini"
    inventory.write_text("[cpu]\nn1 ansible_host=192.0.2.1\n[cpu:vars]\nstepdeploy_gpus_per_node=0\n"
                         "stepdeploy_profile=sim-cpu\n")
    return inventory


def test_resume_replaces_a_running_attempt_whose_run_directory_is_gone(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    from stepdeploy.rollout import attempt as real

    def executor_for(cluster: object, local: Path) -> object:  # the deleted run directory is read for real
        return real.executor_for(cluster, local) if "deleted" in str(local) else StubExecutor()  # type: ignore

    monkeypatch.setattr("stepdeploy.rollout.service.executor_for", executor_for)
    run = tmp_path / "gone"
    run.mkdir()
    led = Ledger(run / "ledger.sqlite")
    led.create_run("gone", {"inventory": str(_inventory(tmp_path)), "model": "tiny-dense", "stages": ["warmup"]},
                   ["warmup"])
    led.set_stage("gone", "warmup", "running")
    led.start_attempt("gone", "warmup", "target", {"local_run": str(run / "attempts" / "deleted")})
    StubExecutor.losses = [5.0, 4.5, 4.0]
    assert _main("rollout", "resume", str(run)) == 0, capsys.readouterr().err
    attempts = led.attempts("gone")
    assert [a["status"] for a in attempts] == ["failed", "passed"]
    assert attempts[0]["detail"]["reason"].startswith("cannot re-attach: ")


def test_a_stage_that_cannot_render_fails_as_a_stage(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    def refuse(*_args: object) -> None:
        raise BadInput("the rendering was refused")

    monkeypatch.setattr("stepdeploy.rollout.service.render_attempt", refuse)
    run = tmp_path / "refused"
    assert _main("rollout", "run", "-i", str(_inventory(tmp_path)), "-m", "tiny-dense", "--stages", "warmup",
                 "--run-dir", str(run)) == 1
    assert "error: warmup: the rendering was refused" in capsys.readouterr().err
    led = Ledger(run / "ledger.sqlite")
    assert [(s.name, s.status) for s in led.stages("refused")] == [("warmup", "failed")]


def test_a_nan_loss_fails_the_warmup_gate_and_resume_goes_on(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                             capsys: pytest.CaptureFixture[str]) -> None:
    inventory = _inventory(tmp_path)
    monkeypatch.setattr("stepdeploy.rollout.service.executor_for", StubExecutor)
    run = tmp_path / "nanrun"
    StubExecutor.losses = [5.0, math.nan, 4.0]
    assert _main("rollout", "run", "-i", str(inventory), "-m", "tiny-dense", "--stages", "warmup",
                 "--run-dir", str(run)) == 1
    err = capsys.readouterr().err
    assert "error: warmup/target: gate loss_finite failed: non-finite loss at iteration 2" in err
    assert "Traceback" not in err and "IntegrityError" not in err
    led = Ledger(run / "ledger.sqlite")
    assert [(m["iteration"], m["nonfinite"]) for m in led.nonfinite_metrics("nanrun")] == [(2, "nan")]
    assert _main("rollout", "status", str(run)) == 0
    assert _main("report", str(run), "--json") == 0
    capsys.readouterr()
    StubExecutor.losses = [5.0, 4.5, 4.0]
    assert _main("rollout", "resume", str(run)) == 0
    assert {s.name: s.status for s in led.stages("nanrun")} == {"warmup": "passed"}
    assert [a["status"] for a in led.attempts("nanrun")] == ["failed", "passed"]
