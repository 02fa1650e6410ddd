"""report/plot_base.draw_attempts: the attempts of a series are one line and one band, broken between attempts, with
every point of every attempt where a line per attempt put it (issue 36 item 3: a 72-hour soak's 101 attempts drew
5,900 artists)."""

from __future__ import annotations

import math

from matplotlib.collections import PolyCollection
from matplotlib.figure import Figure

from stepdeploy.report.plot_base import TimeAxis, draw_attempts

AXIS = TimeAxis(origin=100.0, end=200.0, scale=2.0, label="t")


def _points(first: int, count: int, banded: bool) -> list[dict[str, float]]:
    return [{"ts": 100.0 + first + i, "value": float(i), **({"low": i - 1.0, "high": i + 5.0} if banded else {})}
            for i in range(count)]


def test_attempts_are_one_line_broken_between_them() -> None:
    ax = Figure().add_subplot()
    groups = [_points(0, 3, True), [], _points(10, 2, True), _points(20, 1, True)]
    draw_attempts(ax, AXIS, groups, "soak", color="C2", linewidth=1.0)
    (line,) = ax.lines
    assert line.get_label() == "soak"
    x, y = list(line.get_xdata()), list(line.get_ydata())
    want = [[AXIS(p["ts"]) for p in g] for g in groups if g]
    assert [v for v in x if not math.isnan(v)] == [v for g in want for v in g]
    assert [i for i, v in enumerate(x) if math.isnan(v)] == [3, 6]  # one break between each two attempts
    assert [v for v in y if not math.isnan(v)] == [0.0, 1.0, 2.0, 0.0, 1.0, 0.0]
    (band,) = [c for c in ax.collections if isinstance(c, PolyCollection)]
    assert len(band.get_paths()) == 3  # a band per attempt, none across a break
    lows = sorted(round(float(v), 6) for path in band.get_paths() for v in path.vertices[:, 1])
    assert lows[0] == -1.0 and lows[-1] == 7.0


def test_rows_without_a_band_draw_a_line_only_and_nothing_draws_nothing() -> None:
    ax = Figure().add_subplot()
    draw_attempts(ax, AXIS, [_points(0, 4, False), _points(9, 2, False)], None, color="C0")
    assert len(ax.lines) == 1 and not ax.collections
    empty = Figure().add_subplot()
    draw_attempts(empty, AXIS, [[], []], "x")
    assert not empty.lines and not empty.collections
