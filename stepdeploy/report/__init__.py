"""`stepdeploy report`: a rollout run's ledger as a terminal summary, JSON, and an HTML report with PNG plots.

    data = read_run(Ledger(run_dir / "ledger.sqlite"), run_id)   # the only read
    summary = summarise(data)                                    # pure
    console.print(renderables(summary))                          # terminal
    write_report(data, summary, Path("report.html"))             # HTML + PNGs next to it
"""

from importlib import import_module
from typing import Any

from stepdeploy.report.summary import (
    KeyFigures,
    RecordedVerdict,
    RunData,
    RungFigures,
    StageSummary,
    Summary,
    read_run,
    summarise,
)

# The renderers load matplotlib (about 2 s): imported on first use, so reading a summary stays fast.
_LAZY = {"render_html": "html", "write_report": "html", "Plot": "plots", "write_plots": "plots",
         "renderables": "terminal"}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(import_module(f"stepdeploy.report.{_LAZY[name]}"), name)
    raise AttributeError(f"module 'stepdeploy.report' has no attribute {name!r}")

__all__ = [
    "KeyFigures",
    "Plot",
    "RecordedVerdict",
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
