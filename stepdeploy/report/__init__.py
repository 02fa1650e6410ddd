"""`stepdeploy report`: a rollout run's ledger as a terminal summary, JSON, and an HTML report with PNG plots.

    data = read_run(Ledger(run_dir / "ledger.sqlite"), run_id)   # the only read
    summary = summarise(data)                                    # pure
    console.print(renderables(summary))                          # terminal
    write_report(data, summary, Path("report.html"))             # HTML + PNGs next to it
"""

from stepdeploy.report.html import render_html, write_report
from stepdeploy.report.plots import Plot, write_plots
from stepdeploy.report.summary import (
    GateVerdict,
    KeyFigures,
    RunData,
    RungFigures,
    StageSummary,
    Summary,
    read_run,
    summarise,
)
from stepdeploy.report.terminal import renderables

__all__ = [
    "GateVerdict",
    "KeyFigures",
    "Plot",
    "RunData",
    "RungFigures",
    "StageSummary",
    "Summary",
    "read_run",
    "render_html",
    "renderables",
    "summarise",
    "write_plots",
    "write_report",
]
