"""Issue 36 (items 4, 5): a ledger's values are validated when it is read (states, types, ranges, JSON, schema
objects), a run without stages never passes, bad event data never crashes `report`, and no file in a run
directory is opened through a planted link."""

from __future__ import annotations

import hashlib
import json
import os
import sqlite3
from pathlib import Path

import pytest

from stepdeploy.errors import BadInput, StepdeployError
from stepdeploy.ledger import Ledger, NotALedger, controller_lock
from tests.unit.test_ledger_hardening import _inventory, _main

T0 = 1_700_000_000.0


def _run(tmp_path: Path, name: str = "r1") -> Path:
    """A run directory whose ledger `rollout resume` would act on (a real inventory and configuration)."""
    run = tmp_path / name
    run.mkdir()
    ticks = iter(range(100_000))
    led = Ledger(run / "ledger.sqlite", clock=lambda: T0 + next(ticks))
    led.create_run(name, {"inventory": str(_inventory(tmp_path)), "model": "tiny-dense", "stages": ["warmup"]},
                   ["warmup"])
    led.close()
    return run


def _edit(run: Path, *statements: str) -> str:
    """Apply `statements` with plain sqlite3 (as a hand or another program would); the file's hash after."""
    with sqlite3.connect(run / "ledger.sqlite") as db:
        for statement in statements:
            db.execute(statement)
    db.close()
    return hashlib.sha256((run / "ledger.sqlite").read_bytes()).hexdigest()


def _refused(capsys: pytest.CaptureFixture[str], *args: str) -> str:
    """The command exits 2 with one `error:` line and no traceback; that line."""
    code = _main(*args)
    err = capsys.readouterr().err
    errors = [line for line in err.splitlines() if line.startswith("error: ")]
    assert code == 2 and len(errors) == 1 and "Traceback" not in err, (args, code, err)
    return errors[0]


def _must_not_drive(*_args: object) -> None:
    raise AssertionError("the rollout was driven from a ledger that should have been refused")


def test_an_unknown_stage_status_is_refused_by_status_and_resume(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                 capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr("stepdeploy.rollout.service.executor_for", _must_not_drive)
    run = _run(tmp_path)
    before = _edit(run, "UPDATE stages SET status = 'bogus'")
    assert "column status" in _refused(capsys, "rollout", "status", str(run))
    _refused(capsys, "rollout", "resume", str(run))
    _refused(capsys, "report", str(run))
    assert hashlib.sha256((run / "ledger.sqlite").read_bytes()).hexdigest() == before, "a refused ledger was written"


def test_a_run_without_stages_cannot_pass(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    led = Ledger(tmp_path / "ledger.sqlite")
    with pytest.raises(BadInput, match="at least one stage"):
        led.create_run("empty", {}, [])
    led.create_run("r1", {}, ["warmup", "scale"])
    led.set_stage("r1", "warmup", "passed")
    with pytest.raises(StepdeployError, match="cannot pass: stage scale"):
        led.set_run_status("r1", "passed")
    led.close()
    run = _run(tmp_path, "nostages")  # a ledger edited so that its run has no stages and "passed"
    _edit(run, "DELETE FROM stages", "UPDATE runs SET status = 'passed'")
    assert "has no stages" in _refused(capsys, "report", str(run))
    run = _run(tmp_path, "early")  # passed while its stage is pending
    _edit(run, "UPDATE runs SET status = 'passed'")
    assert "marked passed" in _refused(capsys, "rollout", "status", str(run))


def test_a_verdict_that_is_not_0_or_1_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    run = _run(tmp_path)
    _edit(run, "INSERT INTO verdicts (run_id, ts, stage, rung, gate, passed, measured, threshold, reason) VALUES "
               f"('r1', {T0}, 'warmup', 'target', 'loss_finite', 5, '1.0', '2.0', 'planted')")
    assert "column passed" in _refused(capsys, "rollout", "status", str(run))
    _refused(capsys, "report", str(run), "--json")


def test_a_planted_trigger_is_refused_before_it_fires(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    run = _run(tmp_path)
    before = _edit(run, "CREATE TRIGGER wipe AFTER UPDATE ON stages BEGIN DELETE FROM events; END")
    with pytest.raises(NotALedger, match="trigger 'wipe'"):
        Ledger(run / "ledger.sqlite").set_stage("r1", "warmup", "running")
    assert "trigger" in _refused(capsys, "rollout", "status", str(run))
    _refused(capsys, "rollout", "resume", str(run))
    with sqlite3.connect(run / "ledger.sqlite") as db:
        assert db.execute("SELECT COUNT(*) FROM events").fetchone()[0] == 1, "the trigger fired"
    db.close()
    assert hashlib.sha256((run / "ledger.sqlite").read_bytes()).hexdigest() == before


@pytest.mark.parametrize("statement", ["CREATE VIEW stage_view AS SELECT * FROM stages",
                                       "CREATE TABLE notes (text TEXT)",
                                       "CREATE INDEX by_kind ON events (kind)"])
def test_a_planted_schema_object_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                            statement: str) -> None:
    run = _run(tmp_path)
    _edit(run, statement)
    assert "never has" in _refused(capsys, "report", str(run))
    assert _main("rollout", "list", "--runs", str(tmp_path)) == 2
    assert "never has" in capsys.readouterr().err  # named in a warning; the error line counts the unreadable


@pytest.mark.parametrize("statement", [
    "UPDATE runs SET created = 1e308", "UPDATE runs SET updated = -5", "UPDATE events SET ts = 9e999",
    "UPDATE stages SET position = -1", "UPDATE runs SET status = 'won'",
    "INSERT INTO metrics VALUES ('r1', 1, 1.0, 0, 1, 'loss', 9e999, NULL)",
    "INSERT INTO metrics VALUES ('r1', 1, 1.0, -3, 1, 'loss', 1.0, NULL)",
    "UPDATE runs SET config = '{\"model\": \"' || printf('%.*c', 5000000, 'x') || '\"}'"])
def test_values_out_of_range_are_refused_by_report(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                   statement: str) -> None:
    run = _run(tmp_path)
    _edit(run, statement)
    _refused(capsys, "report", str(run))


@pytest.mark.parametrize("data", [{"ratio": "x"}, {"wall_s": "long", "parts": [1, 2]}, {"parts": {"productive": "1"}},
                                  {"iterations": 1.5, "starts": 3}, {"shares": {"other": [1]}},
                                  {"overrun_s": 1e300}, {"ratio": True, "max_save_s": {"a": 1}}])
def test_goodput_data_of_the_wrong_types_never_crashes_the_report(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], data: dict[str, object]) -> None:
    run = _run(tmp_path)
    _edit(run, "INSERT INTO events (run_id, ts, stage, rung, kind, message, data) VALUES "
               f"('r1', {T0 + 50}, 'soak', NULL, 'goodput', 'planted', '{json.dumps(data)}')",
               f"INSERT INTO events (run_id, ts, stage, rung, kind, message, data) VALUES ('r1', {T0 + 51}, 'soak', "
               "NULL, 'checkpoint', 'planted', '{\"describe\": 7, \"iterations\": \"many\"}')")
    for args in (["report", str(run)], ["report", str(run), "--json"]):
        assert _main(*args) == 0
        captured = capsys.readouterr()
        assert "Traceback" not in captured.err
        assert "goodput event 2 is left out" in captured.err and "checkpoint event 3 is left out" in captured.err
    assert _main("report", str(run), "--json") == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["goodput"] is None and summary["checkpoint_interval"] is None


def test_a_good_goodput_event_is_still_reported(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    run = _run(tmp_path)
    data = {"ratio": 0.5, "wall_s": 100.0, "iterations": 10, "parts": {"productive": 50.0}, "shares": {"other": None}}
    _edit(run, "INSERT INTO events (run_id, ts, stage, rung, kind, message, data) VALUES "
               f"('r1', {T0 + 50}, 'soak', NULL, 'goodput', 'ok', '{json.dumps(data)}')")
    assert _main("report", str(run), "--json") == 0
    captured = capsys.readouterr()
    assert json.loads(captured.out)["goodput"]["ratio"] == 0.5 and "left out" not in captured.err


def test_a_planted_lock_link_is_refused_and_its_target_untouched(tmp_path: Path,
                                                                 capsys: pytest.CaptureFixture[str]) -> None:
    victim = tmp_path / "victim"
    victim.write_text("precious\n")
    run = tmp_path / "planted"
    run.mkdir()
    (run / "controller.lock").symlink_to(victim)
    assert "symbolic link" in _refused(capsys, "rollout", "run", "-i", str(_inventory(tmp_path)), "-m", "tiny-dense",
                                       "--stages", "warmup", "--run-dir", str(run))
    assert victim.read_text() == "precious\n", "the lock's target was written"
    assert not (run / "ledger.sqlite").exists()
    with pytest.raises(BadInput, match="symbolic link"), controller_lock(run):
        pass
    assert victim.read_text() == "precious\n"


@pytest.mark.parametrize("kind", ["hard link", "fifo", "directory", "dangling link"])
def test_the_lock_is_never_opened_through_something_planted(tmp_path: Path, kind: str) -> None:
    victim = tmp_path / "victim"
    victim.write_text("precious\n")
    run = tmp_path / "run"
    run.mkdir()
    lock = run / "controller.lock"
    {"hard link": lambda: os.link(victim, lock), "fifo": lambda: os.mkfifo(lock), "directory": lock.mkdir,
     "dangling link": lambda: lock.symlink_to(tmp_path / "created")}[kind]()
    with pytest.raises(BadInput), controller_lock(run):
        pass
    assert victim.read_text() == "precious\n" and not (tmp_path / "created").exists()


def test_a_ledger_link_is_refused_and_never_followed(tmp_path: Path) -> None:
    run = tmp_path / "run"
    run.mkdir()
    (run / "ledger.sqlite").symlink_to(tmp_path / "elsewhere.sqlite")
    with pytest.raises(NotALedger, match="symbolic link"):
        Ledger(run / "ledger.sqlite")
    assert not (tmp_path / "elsewhere.sqlite").exists()


def test_the_lock_is_held_and_released_as_before(tmp_path: Path) -> None:
    with controller_lock(tmp_path):
        assert (tmp_path / "controller.lock").read_text().startswith(f"pid {os.getpid()} ")
        with pytest.raises(StepdeployError, match=f"driven by pid {os.getpid()}"), controller_lock(tmp_path):
            pass
    with controller_lock(tmp_path):
        pass
