"""report/query.py: a long series is plotted as at most MAX_POINTS buckets whose min..max envelope is the series'
true minimum and maximum; a short one is every row, as the ledger holds it; per-layer series are sampled."""

from __future__ import annotations

import math
from pathlib import Path

from stepdeploy.ledger import Ledger
from stepdeploy.report import query

T0 = 1_700_000_000.0


def _ledger(tmp_path: Path, attempts: list[tuple[int, int]], name: str = "loss") -> tuple[Ledger, list[int]]:
    """One run whose attempts record `name` at iterations first..last each (a spike of 100 at iteration 777)."""
    led = Ledger(tmp_path / "ledger.sqlite", clock=lambda: T0)
    led.create_run("r1", {}, ["soak"])
    ids = []
    for first, last in attempts:
        attempt = led.start_attempt("r1", "soak", "target", {})
        led.add_metrics("r1", attempt, [(T0 + it, 0, it, name, 100.0 if it == 777 else math.sin(it / 50))
                                        for it in range(first, last + 1)])
        ids.append(attempt)
    return led, ids


def test_a_long_series_keeps_its_envelope_in_few_points(tmp_path: Path) -> None:
    led, ids = _ledger(tmp_path, [(1, 100_000)])
    rows = query.series(led.db, "r1", "loss", ids, limit=500)
    assert len(rows) <= 500
    assert min(r["low"] for r in rows) == min(math.sin(it / 50) for it in range(1, 100_001))
    assert max(r["high"] for r in rows) == 100.0  # the one-step spike survives
    assert sum(r["count"] for r in rows) == 100_000
    assert [r["ts"] for r in rows] == sorted(r["ts"] for r in rows)
    assert all(r["low"] <= r["value"] <= r["high"] for r in rows)


def test_attempts_are_bucketed_each_within_the_limit(tmp_path: Path) -> None:
    led, ids = _ledger(tmp_path, [(1, 30_000), (29_001, 60_000), (59_500, 90_000)])
    rows = query.series(led.db, "r1", "loss", ids, limit=300)
    assert len(rows) <= 300
    assert {r["attempt_id"] for r in rows} == set(ids)
    for attempt, (first, last) in zip(ids, [(1, 30_000), (29_001, 60_000), (59_500, 90_000)], strict=True):
        mine = [r for r in rows if r["attempt_id"] == attempt]
        assert sum(r["count"] for r in mine) == last - first + 1
        assert max(r["high"] for r in mine) == max(100.0 if it == 777 else math.sin(it / 50)
                                                   for it in range(first, last + 1))


def test_a_short_series_is_every_row_as_the_ledger_holds_it(tmp_path: Path) -> None:
    led, ids = _ledger(tmp_path, [(1, 1200), (1001, 1800)])  # 2,000 steps: not bucketed
    assert query.series(led.db, "r1", "loss", ids) == led.metrics("r1", "loss")
    assert query.bucket_width([query.Extent(2000, 1, 2000)]) == 1
    assert query.bucket_width([query.Extent(2001, 1, 2001)]) > 1


def test_per_layer_series_are_sampled_rows(tmp_path: Path) -> None:
    led, ids = _ledger(tmp_path, [(1, 50_000)], name="moe_load/3")
    rows = query.series(led.db, "r1", "moe_load/3", ids, sampled=True, limit=400)
    assert 100 <= len(rows) <= 400
    held = {r["iteration"]: r for r in led.metrics("r1", "moe_load/3")}
    assert all(held[r["iteration"]] == r for r in rows)  # real rows, not means
