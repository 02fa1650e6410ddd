"""The terminal summary as rich renderables (printing is the caller's: pass them to any Console).

Every value from the ledger goes into a `Text`, never through rich markup: a message such as `[red]` or
`[/]` is shown as typed and cannot restyle or break the output.
"""

from __future__ import annotations

import time
from typing import Any

from rich.console import Group, RenderableType
from rich.table import Table
from rich.text import Text

from stepdeploy.report.summary import RungFigures, Summary, goodput_rows, is_fault

STATUS_STYLE = {"passed": "green", "failed": "bold red", "running": "yellow", "skipped": "dim",
                "stopped": "magenta", "pending": "dim"}
NOTABLE_EVENTS_SHOWN = 15


# --- formatting, shared with the HTML report ------------------------------------------------
def fmt_number(value: float | None, digits: int = 4, unit: str = "") -> str:
    if value is None:
        return "n/a"
    text = f"{value:,.0f}" if abs(value) >= 1000 else f"{value:.{digits}g}"
    return f"{text} {unit}".rstrip()


def fmt_loss(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.4f}"


def fmt_count(value: int | None) -> str:
    return "n/a" if value is None else f"{value:,}"


def fmt_percent(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.1%}"


def fmt_duration(seconds: float | None) -> str:
    if seconds is None:
        return "n/a"
    if seconds < 60:
        return f"{seconds:.1f} s"
    minutes, secs = divmod(round(seconds), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}h {minutes:02d}m {secs:02d}s" if hours else f"{minutes}m {secs:02d}s"


def fmt_value(value: Any) -> str:
    """A gate's measured value or threshold (any JSON) as one short line."""
    if value is None:
        return "-"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, int | float):
        return fmt_number(float(value)) if isinstance(value, float) else str(value)
    if isinstance(value, dict):
        return ", ".join(f"{k}={fmt_value(v)}" for k, v in value.items())
    if isinstance(value, list):
        return "[" + ", ".join(fmt_value(v) for v in value) + "]"
    return str(value)


def fmt_time(ts: float | None) -> str:
    return "n/a" if ts is None else time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(ts))


def _status(status: str) -> Text:
    return Text(status, style=STATUS_STYLE.get(status, ""))


def header(summary: Summary) -> Text:
    text = Text("run ")
    text.append(summary.run_id, style="bold")
    text.append("  ")
    text.append_text(_status(summary.status))
    text.append(f"  created {fmt_time(summary.created)}, wall time {fmt_duration(summary.figures.wall_s)}")
    return text


def stage_table(summary: Summary) -> Table:
    table = Table(title="Stages", title_justify="left")
    for column in ("stage", "rung", "status", "attempts", "steps", "final loss", "tokens/s", "rank skew",
                   "peak mem", "wall", "reason"):
        table.add_column(column, overflow="fold")
    for stage in summary.stages:
        table.add_row(Text(stage.name, style="bold"), "", _status(stage.status), "", "", "", "", "", "",
                      fmt_duration(stage.wall_s), Text(stage.reason or ""))
        for rung in stage.rungs:
            table.add_row("", *_rung_cells(rung))
    return table


def _rung_cells(rung: RungFigures) -> list[RenderableType]:
    attempts = f"{rung.attempts}" + (f" ({rung.failed_attempts} failed)" if rung.failed_attempts else "")
    return [Text(rung.rung), _status(rung.status), attempts, fmt_count(rung.steps),
            fmt_loss(rung.final_loss), fmt_number(rung.tokens_per_s), fmt_percent(rung.rank_skew),
            fmt_number(rung.peak_mem_gib, unit="GiB"), fmt_duration(rung.wall_s), Text(rung.reason or "")]


def gate_table(summary: Summary) -> Table:
    table = Table(title="Gate verdicts", title_justify="left")
    for column in ("stage/rung", "gate", "verdict", "measured", "threshold", "reason"):
        table.add_column(column, overflow="fold")
    for gate in summary.gates:
        verdict = Text("pass", style="green") if gate.passed else Text("FAIL", style="bold red")
        table.add_row(Text(f"{gate.stage}/{gate.rung}"), Text(gate.gate), verdict, Text(fmt_value(gate.measured)),
                      Text(fmt_value(gate.threshold)), Text(gate.reason))
    return table


def figures_table(summary: Summary) -> Table:
    fig = summary.figures
    table = Table(title="Key figures", title_justify="left", show_header=False)
    table.add_column("figure", style="bold")
    table.add_column("value")
    rows = [
        ("steps", fmt_count(fig.steps), "highest iteration per rung, summed"),
        ("final loss", fmt_loss(fig.final_loss), fig.final_loss_from),
        ("tokens/s", fmt_number(fig.tokens_per_s), fig.tokens_per_s_from and f"median, {fig.tokens_per_s_from}"),
        ("rank step-time skew", fmt_percent(fig.rank_skew),
         fig.rank_skew_from and f"worst: {fig.rank_skew_from}, slowest rank {fig.slowest_rank}"),
        ("peak memory", fmt_number(fig.peak_mem_gib, unit="GiB"), None),
        ("attempts", str(fig.attempts), f"{fig.restarts} restart(s)"),
        ("wall time", fmt_duration(fig.wall_s), None),
    ]
    for name, value, note in rows:
        table.add_row(name, Text(value + (f"  ({note})" if note else "")))
    return table


def goodput_title(goodput: dict[str, Any]) -> str:
    return (f"Goodput: {fmt_percent(goodput.get('ratio'))} effective training time (productive step time over "
            f"the soak's wall time, {fmt_duration(goodput.get('wall_s'))})")


def goodput_table(summary: Summary) -> Table | Text:
    goodput = summary.goodput
    if goodput is None:
        return Text("Goodput: n/a (recorded when a soak ends)")
    table = Table(title=goodput_title(goodput), title_justify="left")
    for column in ("part", "time", "share", "what"):
        table.add_column(column, overflow="fold")
    for part, seconds, share, what in goodput_rows(goodput):
        table.add_row(part, fmt_duration(seconds), fmt_percent(share), Text(what))
    interval = summary.checkpoint_interval
    if interval is not None:
        table.caption = Text(f"checkpoint interval (auto): {interval.get('describe') or interval.get('iterations')}")
    return table


def events_table(summary: Summary, limit: int = NOTABLE_EVENTS_SHOWN) -> Table | Text:
    events = summary.notable_events()
    if not events:
        return Text("No failures or faults recorded.")
    shown = events[-limit:]
    title = "Failures and faults" + (f" (last {limit} of {len(events)})" if len(events) > limit else "")
    table = Table(title=title, title_justify="left")
    for column in ("time", "kind", "where", "message"):
        table.add_column(column, overflow="fold")
    for event in shown:
        where = "/".join(part for part in (event["stage"], event["rung"]) if part)
        style = "bold red" if is_fault(event) else ""
        table.add_row(fmt_time(event["ts"]), Text(event["kind"], style=style), Text(where), Text(event["message"]))
    return table


def renderables(summary: Summary) -> Group:
    parts: list[RenderableType] = [header(summary), stage_table(summary)]
    parts.append(gate_table(summary) if summary.gates else Text("No gate verdicts recorded."))
    parts += [figures_table(summary), goodput_table(summary), events_table(summary)]
    return Group(*parts)
