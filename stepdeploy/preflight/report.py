"""The terminal view of a preflight report: nodes x checks with ✔/⚠/✘, the cross-node checks, the
bandwidth sweep, then every failure and warning in full with its fix. The console is passed in."""

from __future__ import annotations

from rich.console import Console
from rich.table import Table
from rich.text import Text

from stepdeploy.preflight.model import Report, Result, Status

STYLE = {Status.OK: "green", Status.WARN: "yellow", Status.FAIL: "red", Status.SKIP: "dim"}
CELL_WIDTH = 38


def _cell(result: Result | None) -> Text:
    if result is None:
        return Text("")
    short = result.observed if len(result.observed) <= CELL_WIDTH else result.observed[:CELL_WIDTH - 1] + "…"
    return Text(f"{result.status.symbol} {short}", style=STYLE[result.status])


def node_table(report: Report) -> Table:
    table = Table(title="per node", title_justify="left")
    table.add_column("check")
    nodes = [n for n in report.nodes]
    for node in nodes:
        table.add_column(node + (" (unreachable)" if node in report.unreachable else ""))
    checks = list(dict.fromkeys(r.check for r in report.results if r.node is not None))
    for check in checks:
        table.add_row(check, *(_cell(report.result(check, node)) for node in nodes))
    return table


def cluster_table(report: Report) -> Table:
    table = Table(title="across nodes", title_justify="left")
    for name in ("check", "", "observed", "expected"):
        table.add_column(name)
    for r in report.results:
        if r.node is None:
            table.add_row(r.check, Text(r.status.symbol, style=STYLE[r.status]), r.observed, r.expected)
    return table


def bandwidth_table(report: Report) -> Table:
    table = Table(title="all_reduce sweep (rank 0)", title_justify="left")
    for name in ("size", "time (us)", "algbw (GB/s)", "busbw (GB/s)", "backend", "ranks"):
        table.add_column(name, justify="right")
    for row in report.bandwidth:
        table.add_row(_size(row["size_bytes"]), f"{row['time_us']:.1f}", f"{row['algbw_gbps']:.2f}",
                      f"{row['busbw_gbps']:.2f}", row.get("backend", ""), str(row.get("world", "")))
    return table


def _size(n: int) -> str:
    for unit, factor in (("GiB", 1024**3), ("MiB", 1024**2), ("KiB", 1024)):
        if n >= factor and n % factor == 0:
            return f"{n // factor} {unit}"
    return f"{n} B"


def render(report: Report, console: Console) -> None:
    console.print(node_table(report))
    console.print(cluster_table(report))
    if report.bandwidth:
        console.print(bandwidth_table(report))
    problems = sorted(report.failures(), key=lambda r: (r.status is not Status.FAIL, r.node or "", r.check))
    if problems:
        console.print(Text("failures and warnings", style="bold"))
    for r in problems:
        where = r.node or "cluster"
        console.print(Text(f"{r.status.symbol} {where} {r.check}: {r.observed}", style=STYLE[r.status]))
        if r.expected:
            console.print(f"    expected: {r.expected}", markup=False, highlight=False)
        if r.fix:
            console.print(f"    fix: {r.fix}", markup=False, highlight=False)
    counts = {s: sum(r.status is s for r in report.results) for s in Status}
    summary = (f"{counts[Status.OK]} ok, {counts[Status.WARN]} warn, {counts[Status.FAIL]} fail, "
               f"{counts[Status.SKIP]} skipped on {len(report.nodes)} node(s)"
               + (f"; unreachable: {', '.join(sorted(report.unreachable))}" if report.unreachable else "")
               + f"; {report.seconds:.1f} s; exit {report.exit_code}")
    console.print(summary, markup=False, highlight=False)
