"""`stepdeploy report RUN`: what a rollout run did, read from its ledger (it never changes the run).

Exit codes: 0 the report was made (whatever the run's outcome), 2 no run directory / ledger / run in it.
"""

from __future__ import annotations

import sys
from pathlib import Path

import typer

from stepdeploy import safeio
from stepdeploy.cli.output import console, emit_json, info, out, warn
from stepdeploy.errors import BadInput
from stepdeploy.ledger import Ledger
from stepdeploy.report.summary import RunData, event_data_notes, read_run, summarise

LEDGER_FILE = "ledger.sqlite"
TABLE_WIDTH = 150  # tables stay readable when stdout is a pipe (rich assumes 80 columns there)


def report(
    run: Path = typer.Argument(..., help="The run directory (holds ledger.sqlite)."),
    html: Path | None = typer.Option(None, "--html", help="Also write an HTML report here, PNG plots next to it."),
    json_out: bool = typer.Option(False, "--json", help="Print the summary as JSON on stdout."),
) -> None:
    """Summarise a rollout run: stages, gate verdicts, key figures; optionally an HTML report with plots."""
    if html is not None:
        safeio.check_output_file(html, "HTML report")  # before the work: a directory, a FIFO, no permission
    data = load_run_data(run)
    from stepdeploy.report import renderables, write_report  # matplotlib: loaded only to make a report

    for note in event_data_notes(data.events):  # figures a hand-edited ledger holds wrong: left out, said so
        warn(note)
    summary = summarise(data)
    if json_out:
        emit_json(summary.to_json())
    else:
        target = out if out.is_terminal else console(file=sys.stdout, width=TABLE_WIDTH, highlight=False)
        target.print(renderables(summary))
    if html is not None:
        written = write_report(data, summary, html)
        info(f"wrote {html} and {len(written) - 1} plot(s) next to it")


def load_run_data(run_dir: Path) -> RunData:
    """The run's ledger rows; BadInput (exit 2) when there is no run to report on."""
    hint = "stepdeploy rollout list  (shows the runs and their directories)"
    if not run_dir.is_dir():
        raise BadInput(f"{run_dir} is not a run directory", hint=hint)
    path = run_dir / LEDGER_FILE
    if not path.is_file():
        raise BadInput(f"{run_dir} has no {LEDGER_FILE}: not a rollout run directory", hint=hint)
    ledger = Ledger(path, create=False)  # NotALedger (exit 2) for a corrupt, foreign or empty file
    try:
        return read_run(ledger, _run_id(ledger, run_dir))
    finally:
        ledger.close()


def _run_id(ledger: Ledger, run_dir: Path) -> str:
    """The run named after its directory, else the most recent run in the ledger."""
    ids = ledger.run_ids()
    if not ids:
        raise BadInput(f"{run_dir / LEDGER_FILE} holds no run yet",
                       hint=f"start one: stepdeploy rollout run -i INVENTORY --run-dir {run_dir}")
    return run_dir.name if run_dir.name in ids else ids[-1]
