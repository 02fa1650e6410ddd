"""What every plot of a run shares (report/plots.py draws the run's plots, plots_training.py the training
metrics' and goodput's): the time axis, the stage shading, per-attempt curves coloured by stage/rung, legends."""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from matplotlib.axes import Axes

from stepdeploy.report.summary import RunData, stage_span

STAGE_SHADES = ("#f2f2f2", "#e3ecf7")


def plain(text: str) -> str:
    """Ledger text drawn as typed: an even number of `$` would otherwise switch matplotlib to mathtext."""
    return text.replace("$", r"\$")


@dataclass(frozen=True)
class TimeAxis:
    origin: float
    end: float
    scale: float
    label: str

    @classmethod
    def for_run(cls, data: RunData) -> TimeAxis:
        end = data.last_seen
        span = end - data.run["created"]
        scale, unit = (1.0, "s") if span <= 180 else (60.0, "min") if span <= 3 * 3600 else (3600.0, "h")
        return cls(data.run["created"], end, scale, f"time since run start ({unit})")

    def __call__(self, ts: float) -> float:
        return (ts - self.origin) / self.scale


Drawer = Callable[[RunData, Axes, "TimeAxis"], bool]


def shade_stages(data: RunData, ax: Axes, axis: TimeAxis) -> None:
    for i, stage in enumerate(data.stages):
        start, end = stage_span(data, stage)
        if start is None or end is None:
            continue
        ax.axvspan(axis(start), axis(end), color=STAGE_SHADES[i % 2], zorder=0)
        ax.annotate(plain(stage.name), (axis(start), 1.0), xycoords=("data", "axes fraction"),
                    xytext=(3, -11 - 10 * (i % 2)), textcoords="offset points", fontsize=8, color="#555555")


def lowest_rank(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Run-wide values (loss, tokens/s) come from rank 0; should several ranks report one, draw one line."""
    lowest = min((r["rank"] for r in rows), default=0)
    return [r for r in rows if r["rank"] == lowest]


def legend(ax: Axes, **kwargs: Any) -> None:
    """Outside the plot, on the right: it never hides a curve, and every plot keeps the same width."""
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0), **kwargs)


def _segment_colors(data: RunData) -> dict[tuple[str, str], Any]:
    segments = list(dict.fromkeys(data.segment_of.values()))
    palette = [f"C{i % 10}" for i in range(len(segments))]
    return dict(zip(segments, palette, strict=True))


def draw_attempts(ax: Axes, axis: TimeAxis, groups: Iterable[list[dict[str, Any]]], label: str | None = None,
                  **style: Any) -> None:
    """A line through each group of points (an attempt's); where they are buckets of a long series
    (report/query.py), the band of each bucket's minimum..maximum behind it, so a spike the mean smooths away still
    shows. All groups are ONE line and one band, broken between groups (a NaN ends a matplotlib line and band): a
    line per attempt drew the same in 5,900 artists for a 72-hour soak (101 attempts x 58 series), 12 s of its
    HTML report."""
    x: list[float] = []
    y: list[float] = []
    low: list[float] = []
    high: list[float] = []
    banded = False
    for points in groups:
        if not points:
            continue
        if x:
            for column in (x, y, low, high):
                column.append(math.nan)
        x += [axis(p["ts"]) for p in points]
        y += [p["value"] for p in points]
        low += [p.get("low", p["value"]) for p in points]
        high += [p.get("high", p["value"]) for p in points]
        banded = banded or "low" in points[0]
    if not x:
        return
    ax.plot(x, y, label=label, **style)
    if banded:
        ax.fill_between(x, low, high, color=style.get("color"), alpha=0.3, linewidth=0)


def per_attempt(rows: list[dict[str, Any]]) -> dict[int, list[dict[str, Any]]]:
    grouped: dict[int, list[dict[str, Any]]] = defaultdict(list)
    for row in rows:
        grouped[row["attempt_id"]].append(row)
    return grouped


def by_segment(data: RunData, ax: Axes, axis: TimeAxis, name: str, ylabel: str) -> bool:
    rows = [r for r in data.metrics.get(name, []) if r["attempt_id"] in data.segment_of]
    if not rows:
        return False
    shade_stages(data, ax, axis)
    colors = _segment_colors(data)
    marker = "." if len(rows) < 150 else None
    segments: dict[tuple[str, str], list[list[dict[str, Any]]]] = defaultdict(list)
    for attempt_id, points in per_attempt(lowest_rank(rows)).items():
        segments[data.segment_of[attempt_id]].append(points)
    for segment, groups in segments.items():
        draw_attempts(ax, axis, groups, plain("/".join(segment)), color=colors[segment], marker=marker,
                      linewidth=1.3)
    ax.set_ylabel(ylabel)
    legend(ax)
    return True


