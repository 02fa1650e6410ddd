"""`stepdeploy report RUN`: stdout summary or JSON, --html files, and bad input as BadInput (exit 2)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import typer
from typer.testing import CliRunner

from stepdeploy.cli.report import report
from stepdeploy.errors import EXIT_BAD_INPUT, BadInput
from stepdeploy.ledger import Ledger


def _app() -> typer.Typer:
    app = typer.Typer()
    app.command()(report)
    return app


def test_terminal_summary_on_stdout(full_run: Path) -> None:
    result = CliRunner().invoke(_app(), [str(full_run)])
    assert result.exit_code == 0, result.output
    assert "Gate verdicts" in result.stdout and "scaling_efficiency" in result.stdout
    assert "130" in result.stdout


def test_json_on_stdout(full_run: Path) -> None:
    result = CliRunner().invoke(_app(), [str(full_run), "--json"])
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    assert data["run_id"] == "r1" and data["status"] == "passed"
    assert data["figures"]["steps"] == 130 and data["figures"]["restarts"] == 2
    assert [s["name"] for s in data["stages"]] == ["warmup", "scale", "soak"]
    assert data["stages"][0]["rungs"][0]["peak_mem_gib"] is None


def test_html_option_writes_the_report(full_run: Path, tmp_path: Path) -> None:
    html = tmp_path / "site" / "index.html"
    result = CliRunner().invoke(_app(), [str(full_run), "--html", str(html), "--json"])
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["run_id"] == "r1"  # stdout stays pure JSON
    assert f"wrote {html} and 5 plot(s)" in " ".join(result.stderr.split())  # stderr is wrapped at 80 columns
    assert sorted(p.name for p in html.parent.iterdir()) == [
        "index-loss.png", "index-memory.png", "index-rank_step_time.png", "index-timeline.png", "index-tokens.png",
        "index.html"]


def test_a_run_dir_named_otherwise_reports_the_latest_run(full_run: Path, tmp_path: Path) -> None:
    renamed = full_run.rename(tmp_path / "elsewhere")
    result = CliRunner().invoke(_app(), [str(renamed), "--json"])
    assert json.loads(result.stdout)["run_id"] == "r1"


@pytest.mark.parametrize("case", ["no dir", "no ledger", "empty ledger", "not sqlite"])
def test_bad_input(tmp_path: Path, case: str) -> None:
    run_dir = tmp_path / "r1"
    if case != "no dir":
        run_dir.mkdir()
    if case == "empty ledger":
        Ledger(run_dir / "ledger.sqlite").close()
    if case == "not sqlite":
        (run_dir / "ledger.sqlite").write_text("not a database, just text that is long enough" * 10)
    with pytest.raises(BadInput) as caught:
        report(run_dir, None, False)
    assert caught.value.exit_code == EXIT_BAD_INPUT
    assert str(run_dir) in caught.value.message and caught.value.hint
