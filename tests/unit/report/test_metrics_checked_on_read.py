"""Issue 36 items 3 and 5: a large ledger's metric rows are checked as they are read, not all at open
(ledger_schema.FULL_CHECK_BYTES): every row the report reads, bucketed, sampled or whole, is checked as the open
check would, and a bad one refuses the ledger (exit 2, one line), whatever the path that read it. Here every ledger
counts as large (the threshold set to 0), and the report of a good one is the same either way."""

from __future__ import annotations

import json
import sqlite3
from pathlib import Path

import pytest

from stepdeploy.ledger import Ledger
from stepdeploy.report import query
from tests.unit.test_ledger_hardening import _main

T0 = 1_700_000_000.0
STEPS = 60  # with MAX_POINTS 20: the scalars are bucketed, the per-layer series sampled


def _ledger(run: Path) -> None:
    run.mkdir()
    ticks = iter(range(100_000))
    led = Ledger(run / "ledger.sqlite", clock=lambda: T0 + next(ticks) * 0.01)
    led.create_run("r1", {"model": "tiny-moe", "stages": ["soak"]}, ["soak"])
    led.add_rungs("r1", "soak", [("target", {"nodes": 1})])
    led.set_stage("r1", "soak", "running")
    attempt = led.start_attempt("r1", "soak", "target", {})
    rows = []
    for it in range(1, STEPS + 1):
        ts = T0 + 100 + it
        rows += [(ts, 0, it, "loss", 8.0 - it * 0.05), (ts, 0, it, "tokens_per_s", 1000.0 + it),
                 (ts, 0, it, "step_time_s", 0.5), (ts, 0, it, "rank_step_time_s", 0.5),
                 (ts, 1, it, "rank_step_time_s", 0.51), (ts, 0, it, "moe_load/3", 1.2),
                 (ts, 0, it, "mem_peak_gib", 9.0)]
    led.add_metrics("r1", attempt, rows)
    led.finish_attempt(attempt, "passed")
    led.close()


@pytest.fixture
def large(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("stepdeploy.ledger_schema.FULL_CHECK_BYTES", 0)
    monkeypatch.setattr(query, "MAX_POINTS", 20)


def _report_json(run: Path, capsys: pytest.CaptureFixture[str]) -> dict[str, object]:
    assert _main("report", str(run), "--json") == 0
    return json.loads(capsys.readouterr().out)


def test_a_good_large_ledger_reports_as_a_small_one(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    run = tmp_path / "r1"
    _ledger(run)
    monkeypatch.setattr(query, "MAX_POINTS", 20)
    whole = _report_json(run, capsys)
    monkeypatch.setattr("stepdeploy.ledger_schema.FULL_CHECK_BYTES", 0)
    assert _report_json(run, capsys) == whole


# (statement, the path that reads the row): every one a value the open check refuses
BAD = [
    ("UPDATE metrics SET value = 'high' WHERE name = 'loss' AND iteration = 30", "bucketed"),
    ("UPDATE metrics SET value = 9e999 WHERE name = 'tokens_per_s' AND iteration = 7", "bucketed"),
    ("UPDATE metrics SET rank = -3 WHERE name = 'rank_step_time_s' AND rank = 1 AND iteration = 9", "bucketed"),
    ("UPDATE metrics SET iteration = 12.5 WHERE name = 'loss' AND iteration = 12", "bucketed"),
    ("UPDATE metrics SET ts = -1 WHERE name = 'loss' AND iteration = 1", "bucketed"),
    ("UPDATE metrics SET nonfinite = 'x' WHERE name = 'loss' AND iteration = 40", "bucketed"),
    ("UPDATE metrics SET value = X'00' WHERE name = 'moe_load/3' AND iteration = 3", "sampled"),
    ("UPDATE metrics SET ts = 'now' WHERE name = 'step_time_s' AND iteration = 60", "latest rows"),
    ("UPDATE metrics SET value = 'much' WHERE name = 'mem_peak_gib' AND iteration = 5", "peak memory"),
    ("INSERT INTO metrics VALUES ('r1', 99, 1.0, 0, 1, 'loss', 1.0, NULL)", "an attempt the ledger lacks"),
    ("INSERT INTO metrics VALUES ('r1', 'one', 1.0, 0, 1, 'loss', 1.0, NULL)", "an attempt that is text"),
]


@pytest.mark.parametrize(("statement", "path"), BAD, ids=[p for _, p in BAD])
@pytest.mark.usefixtures("large")
def test_a_bad_metric_row_read_refuses_the_ledger(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                  statement: str, path: str) -> None:
    run = tmp_path / "r1"
    _ledger(run)
    with sqlite3.connect(run / "ledger.sqlite") as db:
        db.execute(statement)
    db.close()
    for args in (["report", str(run)], ["report", str(run), "--json"]):
        code = _main(*args)
        err = capsys.readouterr().err
        errors = [line for line in err.splitlines() if line.startswith("error: ")]
        assert code == 2 and len(errors) == 1 and "Traceback" not in err, (path, code, err)


def test_the_bad_rows_are_refused_at_open_in_a_small_ledger(tmp_path: Path, capsys: pytest.CaptureFixture[str]
                                                            ) -> None:
    """The same statements, the ledger under the threshold: refused by the check at open, as before (a row of an
    attempt the ledger lacks is checked by its values there, and read by nothing)."""
    for n, (statement, _) in enumerate(b for b in BAD if b[1] != "an attempt the ledger lacks"):
        run = tmp_path / f"r{n}"
        _ledger(run)
        with sqlite3.connect(run / "ledger.sqlite") as db:
            db.execute(statement)
        db.close()
        assert _main("report", str(run), "--json") == 2
        assert "error: " in capsys.readouterr().err
