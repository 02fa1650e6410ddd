"""The demo's closing summary says what the rollout's ledger holds: its stages, its gates, the soak's goodput,
where the report is, and the command a user types next on real nodes."""

from __future__ import annotations

from pathlib import Path

import pytest
from typer.testing import CliRunner

from stepdeploy.cli import demo
from stepdeploy.cli.app import app


def test_the_summary_reads_the_ledger(full_run: Path) -> None:
    lines = demo.proved(full_run, 2, 247.0)
    text = "\n".join(lines)
    assert "rollout   passed: warmup passed, scale passed, soak passed" in text
    assert "gates     " in text and "no_unrecovered_failure" in text
    assert f"report    {full_run / 'report.html'}" in text and "took      4.1 min" in text
    assert lines[-1].startswith("next, on real GPU nodes") and lines[-1].endswith(demo.NEXT)


def test_the_next_command_passes_the_offline_checks(monkeypatch: pytest.MonkeyPatch) -> None:
    """The rollout the summary tells a user to type next is one plan and render accept (its stack included)."""
    monkeypatch.chdir(Path(__file__).resolve().parents[3])
    commands = [c.split() for c in demo.NEXT.split(" && ")]
    assert [c[:2] for c in commands] == [["stepdeploy", "provision"], ["stepdeploy", "preflight"],
                                         ["stepdeploy", "rollout"]]
    res = CliRunner().invoke(app, [*commands[-1][1:], "--dry-run"])
    assert res.exit_code == 0, res.output


def test_a_failed_rollout_is_not_called_passed(early_failure: Path) -> None:
    text = "\n".join(demo.proved(early_failure, 2, 60.0))
    assert "rollout   failed: warmup failed" in text and "goodput   not recorded" in text
