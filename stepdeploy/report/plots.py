"""PNG plots of a run (matplotlib, Agg through `Figure.savefig`; pyplot's global state is never touched).

Every plot shares one x axis, time since the run was created, with the stages shaded behind the curves, so
a dip in tokens/s lines up with the restart on the timeline. A plot without data is not drawn at all.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from matplotlib.axes import Axes
from matplotlib.figure import Figure
from matplotlib.lines import Line2D

from stepdeploy.report import plots_training as training
from stepdeploy.report.plot_base import (
    Drawer,
    TimeAxis,
    by_segment,
    draw_attempts,
    legend,
    per_attempt,
    plain,
    shade_stages,
)
from stepdeploy.report.summary import RunData, is_fault, rank_skew, stage_span

DPI = 110
SIZE = (10.0, 3.6)
STATUS_COLOR = {"passed": "#2ca02c", "failed": "#d62728", "running": "#ff7f0e", "stopped": "#9467bd",
                "skipped": "#c7c7c7", "pending": "#e0e0e0"}
LABEL_WIDTH_PER_CHAR = 0.0065  # share of the time axis one label character takes; a narrower bar gets no label
MAX_RANK_LINES = 16  # above this, per-rank step time is drawn as a min/median/max band
MAX_FAULT_LABELS = 40  # faults named one by one on the timeline up to this many


RANK_CAPTION = "step time of each rank (lines on top of each other: equally fast ranks; one above: a straggler)"


@dataclass(frozen=True)
class Plot:
    name: str
    title: str
    path: Path
    caption: str


def write_plots(data: RunData, out_dir: Path, prefix: str) -> list[Plot]:
    """Draw every plot that has data into out_dir/<prefix>-<name>.png; return those written, in order."""
    axis = TimeAxis.for_run(data)
    drawers: list[tuple[str, str, str, Drawer]] = [
        ("loss", "Loss", "training loss of every attempt, coloured by stage/rung", _loss),
        ("tokens", "Throughput", "tokens/s of every attempt, coloured by stage/rung", _tokens),
        *training.TRAINING_PLOTS,
        ("rank_step_time", "Per-rank step time", RANK_CAPTION, _rank_step_time),
        ("memory", "GPU memory", "allocated, reserved and peak GPU memory (GiB, the fullest rank)", _memory),
        ("timeline", "Timeline", "stages, attempts (bars), gate verdicts and faults over time", _timeline),
        training.GOODPUT_PLOT,
    ]
    plots = []
    for name, title, caption, drawer in drawers:
        figure = Figure(figsize=SIZE, dpi=DPI, layout="constrained")
        ax = figure.add_subplot()
        if not drawer(data, ax, axis):
            continue
        ax.set_title(title, loc="left", fontsize=11)
        if name not in training.UNTIMED:
            ax.set_xlabel(axis.label)
            ax.set_xlim(0, axis(axis.end) * 1.02)  # room for a marker at the very end
        path = out_dir / f"{prefix}-{name}.png"
        figure.savefig(path)
        plots.append(Plot(name, title, path, caption))
    return plots


def _max_over_ranks(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Memory of the fullest rank per step: the one that runs out first."""
    steps: dict[tuple[int, int], dict[str, Any]] = {}
    for row in rows:
        key = (row["attempt_id"], row["iteration"])
        if key not in steps or row["value"] > steps[key]["value"]:
            steps[key] = row
    return sorted(steps.values(), key=lambda r: r["ts"])


def _loss(data: RunData, ax: Axes, axis: TimeAxis) -> bool:
    return by_segment(data, ax, axis, "loss", "loss")


def _tokens(data: RunData, ax: Axes, axis: TimeAxis) -> bool:
    drawn = by_segment(data, ax, axis, "tokens_per_s", "tokens/s")
    ax.set_ylim(bottom=0)
    return drawn


def _rank_step_time(data: RunData, ax: Axes, axis: TimeAxis) -> bool:
    rows = [r for r in data.metrics.get("rank_step_time_s", []) if r["attempt_id"] in data.segment_of]
    if not rows:
        return False
    shade_stages(data, ax, axis)
    ranks = sorted({r["rank"] for r in rows})
    if len(ranks) > MAX_RANK_LINES:
        _rank_band(rows, ax, axis)
    else:
        for rank in ranks:
            draw_attempts(ax, axis, per_attempt([r for r in rows if r["rank"] == rank]).values(), f"rank {rank}",
                          color=f"C{rank % 10}", linewidth=1.0)
    ax.set_ylabel("step time (s)")
    legend(ax)
    return True


def _rank_band(rows: list[dict[str, Any]], ax: Axes, axis: TimeAxis) -> None:
    """Many ranks: the spread per step (per attempt, so a restart leaves a gap) and the slowest rank's line."""
    for i, attempt_rows in enumerate(per_attempt(rows).values()):
        steps: dict[int, list[dict[str, Any]]] = defaultdict(list)
        for row in attempt_rows:
            steps[row["iteration"]].append(row)
        ordered = sorted(steps.values(), key=lambda group: min(r["ts"] for r in group))
        x = [axis(min(r["ts"] for r in group)) for group in ordered]
        values = [sorted(r["value"] for r in group) for group in ordered]
        ax.fill_between(x, [v[0] for v in values], [v[-1] for v in values], color="C0", alpha=0.3,
                        label="fastest..slowest rank" if i == 0 else None)
        ax.plot(x, [v[len(v) // 2] for v in values], color="C0", label="median rank" if i == 0 else None)
    _, slowest = rank_skew(rows)
    if slowest is not None:
        draw_attempts(ax, axis, per_attempt([r for r in rows if r["rank"] == slowest]).values(),
                      f"slowest: rank {slowest}", color="#d62728", linewidth=1.0)


def _memory(data: RunData, ax: Axes, axis: TimeAxis) -> bool:
    series = {"allocated": "mem_allocated_gib", "reserved": "mem_reserved_gib", "peak": "mem_peak_gib"}
    drawn = False
    for i, (label, name) in enumerate(series.items()):
        rows = [r for r in data.metrics.get(name, []) if r["attempt_id"] in data.segment_of]
        groups = list(per_attempt(_max_over_ranks(rows)).values())
        if not groups:
            continue
        if not drawn:
            shade_stages(data, ax, axis)
        drawn = True
        draw_attempts(ax, axis, groups, label, color=f"C{i}", linewidth=1.2)
    if drawn:
        ax.set_ylabel("GiB")
        ax.set_ylim(bottom=0)
        legend(ax)
    return drawn


LANES = ("stages", "attempts", "gates", "faults")


def _timeline(data: RunData, ax: Axes, axis: TimeAxis) -> bool:
    lane = {name: len(LANES) - 1 - i for i, name in enumerate(LANES)}
    _stage_bars(data, ax, axis, lane["stages"])
    _attempt_bars(data, ax, axis, lane["attempts"])
    _gate_marks(data, ax, axis, lane["gates"])
    _fault_marks(data, ax, axis, lane["faults"])
    ax.set_yticks(list(lane.values()), list(lane))
    ax.set_ylim(-0.7, len(LANES) - 0.3)
    ax.grid(axis="x", alpha=0.3)
    handles = [Line2D([], [], color=c, linewidth=6, label=s) for s, c in STATUS_COLOR.items() if s != "pending"]
    handles += [Line2D([], [], color="#2ca02c", marker="^", linestyle="", label="gate passed"),
                Line2D([], [], color="#d62728", marker="X", linestyle="", label="gate failed"),
                Line2D([], [], color="#ff7f0e", marker="D", linestyle="", label="fault")]
    legend(ax, handles=handles)
    return True


def _bar(ax: Axes, axis: TimeAxis, start: float, end: float, y: float, color: str, label: str) -> None:
    ax.broken_barh([(axis(start), max(axis(end) - axis(start), 1e-9))], (y - 0.3, 0.6), facecolors=color,
                   edgecolors="white", linewidth=0.8)
    if (end - start) / max(axis.end - axis.origin, 1e-9) >= LABEL_WIDTH_PER_CHAR * (len(label) + 1):
        ax.text(axis(start), y, f" {plain(label)}", va="center", ha="left", fontsize=7, clip_on=True)


def _stage_bars(data: RunData, ax: Axes, axis: TimeAxis, y: float) -> None:
    for stage in data.stages:
        start, end = stage_span(data, stage)
        if start is not None:
            _bar(ax, axis, start, data.end_of(end), y, STATUS_COLOR.get(stage.status, "#999999"), stage.name)


def _attempt_bars(data: RunData, ax: Axes, axis: TimeAxis, y: float) -> None:
    for attempt in data.attempts:
        color = STATUS_COLOR.get(attempt["status"], "#999999")
        end = data.end_of(attempt["finished"])
        _bar(ax, axis, attempt["started"], end, y, color, f"{attempt['rung']} #{attempt['number']}")
        if attempt["status"] == "failed":
            ax.plot([axis(end)], [y], marker="x", color="#d62728", markersize=9, markeredgewidth=2)


def _gate_marks(data: RunData, ax: Axes, axis: TimeAxis, y: float) -> None:
    for verdict in data.verdicts:
        passed = verdict["passed"]
        ax.plot([axis(verdict["ts"])], [y], marker="^" if passed else "X", linestyle="",
                color="#2ca02c" if passed else "#d62728", markersize=7 if passed else 10)
        if not passed:
            ax.annotate(plain(verdict["gate"]), (axis(verdict["ts"]), y), xytext=(4, 6), textcoords="offset points",
                        fontsize=7, color="#d62728")


def _fault_marks(data: RunData, ax: Axes, axis: TimeAxis, y: float) -> None:
    """Every fault as a marker (one line of markers: a soak's thousands of monitor findings draw in one call),
    named by its kind; above MAX_FAULT_LABELS faults only each kind's first one is named (the rest would be ink)."""
    faults = [e for e in data.events if is_fault(e)]
    if not faults:
        return
    ax.plot([axis(e["ts"]) for e in faults], [y] * len(faults), marker="D", linestyle="", color="#ff7f0e",
            markersize=7)
    named = faults if len(faults) <= MAX_FAULT_LABELS else list({e["kind"]: e for e in reversed(faults)}.values())
    for event in named:
        ax.annotate(plain(event["kind"]), (axis(event["ts"]), y), xytext=(4, -12), textcoords="offset points",
                    fontsize=7, color="#b35900")
