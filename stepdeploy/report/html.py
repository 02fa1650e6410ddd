"""The HTML report: one self-contained file (inline CSS, no scripts) with its PNG plots written next to it.

Rendered from templates/report.html.j2 with StrictUndefined and autoescape on: every value from the ledger
(stage reasons, event messages, gate names, the run's config) is HTML-escaped where it lands.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import time
from collections.abc import Callable
from dataclasses import replace
from functools import cache
from pathlib import Path

import jinja2

from stepdeploy import safeio
from stepdeploy.render.templating import TEMPLATES_DIR
from stepdeploy.report import terminal
from stepdeploy.report.plots import Plot, write_plots
from stepdeploy.report.summary import RunData, Summary, goodput_rows, is_fault

TEMPLATE = "report.html.j2"


@cache
def environment(directory: Path = TEMPLATES_DIR) -> jinja2.Environment:
    env = jinja2.Environment(loader=jinja2.FileSystemLoader(str(directory)), undefined=jinja2.StrictUndefined,
                             autoescape=True, keep_trailing_newline=True)
    env.filters.update(number=terminal.fmt_number, loss=terminal.fmt_loss, count=terminal.fmt_count,
                       percent=terminal.fmt_percent, duration=terminal.fmt_duration, value=terminal.fmt_value,
                       time=terminal.fmt_time)
    return env


def render_html(summary: Summary, plots: list[Plot], *, generated: float) -> str:
    """Pure: the report's text. Plots are referenced by file name, relative to the HTML file."""
    return environment().get_template(TEMPLATE).render(
        summary=summary,
        figures=summary.figures,
        plots=[{"file": p.path.name, "title": p.title, "caption": p.caption} for p in plots],
        notable=summary.notable_events(),
        goodput=goodput_rows(summary.goodput) if summary.goodput else [],
        goodput_title=terminal.goodput_title(summary.goodput) if summary.goodput else "",
        is_fault=is_fault,
        config=json.dumps(summary.config, indent=2, sort_keys=True, default=str),
        generated=generated,
    )


def write_report(data: RunData, summary: Summary, html_path: Path, *,
                 clock: Callable[[], float] = time.time) -> list[Path]:
    """Write the PNGs (named after the HTML file) and then the HTML; return every path written. All or
    nothing: everything is drawn into a private staging directory first, then renamed into place."""
    safeio.check_output_file(html_path, "HTML report")
    html_path.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{html_path.name}.", dir=html_path.parent))
    placed: list[Path] = []
    try:
        drawn = write_plots(data, staging, html_path.stem)
        text = render_html(summary, drawn, generated=clock())  # plots are named relative to the HTML file
        plots = [replace(p, path=html_path.parent / p.path.name) for p in drawn]
        for before, after in zip(drawn, plots, strict=True):
            os.replace(before.path, after.path)
            placed.append(after.path)
        safeio.write_atomic(html_path, text)
    except BaseException:
        for path in placed:
            path.unlink(missing_ok=True)
        raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return [*(p.path for p in plots), html_path]
