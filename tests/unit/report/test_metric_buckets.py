"""Issue 36 item 3: the ledger's per-bucket summaries of the metric rows (ledger_buckets.py, table metric_buckets)
give the report the same plotted series as its read of the rows (report/query.py): the same buckets, the same means
within float tolerance, the same exact min..max band (no spike lost), the same counts. A ledger written before the
table existed is read row by row, and a writer that opens it adds the table for the attempts that follow."""

from __future__ import annotations

import math
import random
import shutil
import sqlite3
from pathlib import Path

import pytest

from stepdeploy.ledger import Ledger, NotALedger
from stepdeploy.ledger_schema import BUCKET_ITERATIONS, BUCKETS_FROM
from stepdeploy.report import query

T0 = 1_700_000_000.0
NAMES = ("loss", "rank_step_time_s", "mem_peak_gib")


def _write(led: Ledger, attempts: list[tuple[int, int]], seed: int = 7) -> list[int]:
    """Attempts recording iterations first..last each (two ranks of rank_step_time_s, a spike at 777 and 9,001, a
    NaN now and then), in chunks of uneven size so that a bucket is written by several calls."""
    rng, ids = random.Random(seed), []
    for first, last in attempts:
        attempt = led.start_attempt("r1", "soak", "target", {})
        rows = []
        for it in range(first, last + 1):
            ts = T0 + it * 0.7 + len(ids) * 5.0
            loss = 100.0 if it in (777, 9001) else math.nan if it % 997 == 0 else 3 + math.sin(it / 50)
            rows += [(ts, 0, it, "loss", loss), (ts, 0, it, "mem_peak_gib", 70 + rng.random()),
                     (ts, 0, it, "moe_load/3", 1 + rng.random()),
                     *((ts + rank * 0.01, rank, it, "rank_step_time_s", 0.5 + rng.random() * 0.1) for rank in (0, 1))]
        at = 0
        while at < len(rows):
            step = rng.randrange(1, 700)
            led.add_metrics("r1", attempt, rows[at:at + step])
            at += step
        ids.append(attempt)
    return ids


def _new(path: Path) -> Ledger:
    led = Ledger(path, clock=lambda: T0)
    led.create_run("r1", {}, ["soak"])
    return led


def _without_summaries(src: Path, dst: Path) -> None:
    """A copy of the ledger as a stepdeploy before the summaries wrote it."""
    shutil.copy(src, dst)
    with sqlite3.connect(dst) as db:
        db.execute("DROP TABLE metric_buckets")
        db.execute("DELETE FROM meta WHERE key = ?", (BUCKETS_FROM,))


def _series(path: Path, ids: list[int], limit: int) -> dict[str, list[dict[str, object]]]:
    led = Ledger(path, create=False)
    try:
        return {name: query.series(led.db, "r1", name, ids, limit=limit) for name in NAMES}
    finally:
        led.close()


def _same(summarised: dict[str, list[dict[str, object]]], rows: dict[str, list[dict[str, object]]]) -> None:
    assert summarised.keys() == rows.keys()
    for name in rows:
        got, want = summarised[name], rows[name]
        assert len(got) == len(want) > 0, name
        for a, b in zip(got, want, strict=True):
            assert a.keys() == b.keys()
            for key in b:
                if key in ("ts", "value"):  # a mean: summed in another order
                    assert a[key] == pytest.approx(b[key], rel=1e-12, abs=1e-9), (name, key)
                else:  # which bucket, its rank, count, and its exact min..max band
                    assert a[key] == b[key], (name, key)


@pytest.mark.parametrize("limit", [40, 200, 2000])
def test_the_summaries_plot_what_the_rows_plot(tmp_path: Path, limit: int) -> None:
    led = _new(tmp_path / "new.sqlite")
    ids = _write(led, [(1, 12_000), (11_501, 20_000), (19_990, 20_500)])
    led.close()
    _without_summaries(tmp_path / "new.sqlite", tmp_path / "old.sqlite")
    summarised, rows = _series(tmp_path / "new.sqlite", ids, limit), _series(tmp_path / "old.sqlite", ids, limit)
    _same(summarised, rows)
    loss = summarised["loss"]
    if limit < 20_000:
        assert "low" in loss[0]  # bucketed
        assert max(r["high"] for r in loss) == 100.0  # both spikes kept
        assert sum(1 for r in loss if r["high"] == 100.0) == 2
        assert sum(r["count"] for r in loss) == sum(1 for first, last in [(1, 12_000), (11_501, 20_000),
                                                                          (19_990, 20_500)]
                                                    for it in range(first, last + 1) if it % 997)


def test_the_summaries_are_read_not_the_rows(tmp_path: Path) -> None:
    """With the rows of the summarised metric gone, its series stays (a test that the summaries are used)."""
    led = _new(tmp_path / "new.sqlite")
    ids = _write(led, [(1, 8_000)])
    before = query.series(led.db, "r1", "loss", ids, limit=40)
    led.db.execute("UPDATE metrics SET value = -1.0 WHERE name = 'loss' AND iteration % 2 = 0")
    after = query.series(led.db, "r1", "loss", ids, limit=40)
    assert after == before
    assert query.bucket_width([query.Extent(8_000, 1, 8_000)], 40) % BUCKET_ITERATIONS == 0
    led.close()


def test_an_old_ledger_gets_summaries_for_the_attempts_that_follow(tmp_path: Path) -> None:
    led = _new(tmp_path / "new.sqlite")
    first = _write(led, [(1, 6_000)])
    led.close()
    _without_summaries(tmp_path / "new.sqlite", tmp_path / "old.sqlite")
    old = Ledger(tmp_path / "old.sqlite", create=False)  # a reader adds nothing
    assert old.db.execute("SELECT 1 FROM sqlite_master WHERE name = 'metric_buckets'").fetchone() is None
    old.close()
    writer = Ledger(tmp_path / "old.sqlite", clock=lambda: T0)
    assert writer.db.execute("SELECT value FROM meta WHERE key = ?", (BUCKETS_FROM,)).fetchone()[0] == str(first[0] + 1)
    later = _write(writer, [(5_001, 9_000)], seed=8)
    writer.close()
    led = Ledger(tmp_path / "new.sqlite", clock=lambda: T0)
    assert _write(led, [(5_001, 9_000)], seed=8) == later
    led.close()
    ids = first + later
    mixed = _series(tmp_path / "old.sqlite", ids, 60)  # the first attempt row by row, the second summarised
    _without_summaries(tmp_path / "new.sqlite", tmp_path / "rows.sqlite")
    _same(mixed, _series(tmp_path / "rows.sqlite", ids, 60))
    _same(_series(tmp_path / "new.sqlite", ids, 60), mixed)


@pytest.mark.parametrize("damage", ["low = 'x'", "count = 0", "high = 1e999", "last_iteration = first_iteration - 1",
                                    "first_ts = -5"])
def test_a_bad_summary_is_refused(tmp_path: Path, damage: str, monkeypatch: pytest.MonkeyPatch) -> None:
    led = _new(tmp_path / "new.sqlite")
    ids = _write(led, [(1, 3_000)])
    led.close()
    with sqlite3.connect(tmp_path / "new.sqlite") as db:
        db.execute(f"UPDATE metric_buckets SET {damage} WHERE name = 'loss' AND bucket = 3")
    with pytest.raises(NotALedger):  # a small ledger: checked whole when opened
        Ledger(tmp_path / "new.sqlite", create=False)
    monkeypatch.setattr("stepdeploy.ledger_schema.FULL_CHECK_BYTES", 0)  # a large one: checked as read
    led = Ledger(tmp_path / "new.sqlite", create=False)
    with pytest.raises(query.BadMetric):
        query.series(led.db, "r1", "loss", ids, limit=40)
    led.close()


def test_a_table_without_its_mark_is_refused(tmp_path: Path) -> None:
    led = _new(tmp_path / "new.sqlite")
    led.db.execute("DELETE FROM meta WHERE key = ?", (BUCKETS_FROM,))
    led.close()
    with pytest.raises(NotALedger):
        Ledger(tmp_path / "new.sqlite", create=False)
