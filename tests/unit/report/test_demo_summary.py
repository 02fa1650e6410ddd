"""The demo's closing summary says what the rollout's ledger holds: its stages, its gates, the soak's goodput,
where the report is, and the command a user types next on real nodes."""

from __future__ import annotations

from pathlib import Path

from stepdeploy.cli import demo


def test_the_summary_reads_the_ledger(full_run: Path) -> None:
    lines = demo.proved(full_run, 2, 247.0)
    text = "\n".join(lines)
    assert "rollout   passed: warmup passed, scale passed, soak passed" in text
    assert "gates     " in text and "no_unrecovered_failure" in text
    assert f"report    {full_run / 'report.html'}" in text and "took      4.1 min" in text
    assert lines[-1].startswith("next, on real GPU nodes") and "stepdeploy provision inventory/dgx.ini" in lines[-1]


def test_a_failed_rollout_is_not_called_passed(early_failure: Path) -> None:
    text = "\n".join(demo.proved(early_failure, 2, 60.0))
    assert "rollout   failed: warmup failed" in text and "goodput   not recorded" in text
