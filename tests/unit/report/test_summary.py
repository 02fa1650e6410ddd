"""The summary's figures, computed from a ledger written with the real Ledger API (see conftest)."""

from __future__ import annotations

import io
from pathlib import Path

import pytest
from rich.console import Console

from stepdeploy.ledger import Ledger
from stepdeploy.report import Summary, read_run, renderables, summarise
from stepdeploy.report.summary import rank_skew
from stepdeploy.report.terminal import fmt_duration, fmt_number, fmt_value

from .conftest import HOSTILE, T0, Clock, Steps, run_attempt


def _summary(run_dir: Path) -> Summary:
    ledger = Ledger(run_dir / "ledger.sqlite")
    try:
        return summarise(read_run(ledger, "r1"))
    finally:
        ledger.close()


def _rungs(summary: Summary) -> dict[str, object]:
    return {f"{s.name}/{r.rung}": r for s in summary.stages for r in s.rungs}


def test_stages_and_rungs(full_run: Path) -> None:
    summary = _summary(full_run)
    assert summary.status == "passed"
    assert [(s.name, s.status) for s in summary.stages] == [("warmup", "passed"), ("scale", "passed"),
                                                            ("soak", "passed")]
    rungs = _rungs(summary)
    assert list(rungs) == ["warmup/target", "scale/proxy-1gpu", "scale/one-node", "scale/all-nodes", "soak/target"]
    assert [r.steps for r in rungs.values()] == [10, 20, 20, 20, 60]
    assert [(r.attempts, r.failed_attempts) for r in rungs.values()] == [(1, 0), (1, 0), (1, 0), (2, 1), (2, 1)]
    soak = rungs["soak/target"]
    assert soak.final_loss == pytest.approx(5.0 - 0.03 * 60)
    assert soak.tokens_per_s == 2200.0  # the last attempt's, not blurred by attempt 1's 2100
    assert soak.peak_mem_gib == 11.25
    assert soak.detail["restored_from"] == "iter_0000020"


def test_throughput_and_skew_come_from_the_attempt_that_passed(full_run: Path) -> None:
    rung = _rungs(_summary(full_run))["scale/all-nodes"]
    assert rung.tokens_per_s == 1500.0  # attempt 1 (failed gate) ran at 800
    assert rung.rank_skew == pytest.approx(0.25) and rung.slowest_rank == 1  # attempt 1's straggler was rank 3
    assert rung.step_time_s == 0.5


def test_single_rank_and_equal_ranks(full_run: Path) -> None:
    rungs = _rungs(_summary(full_run))
    assert rungs["scale/proxy-1gpu"].rank_skew is None
    assert rungs["scale/one-node"].rank_skew == 0.0
    assert rungs["warmup/target"].rank_skew == pytest.approx(0.2) and rungs["warmup/target"].slowest_rank == 2


def test_key_figures(full_run: Path) -> None:
    fig = _summary(full_run).figures
    assert fig.steps == 10 + 20 + 20 + 20 + 60
    assert fig.final_loss == pytest.approx(3.2) and fig.final_loss_from == "soak/target"
    assert fig.tokens_per_s == 2200.0 and fig.tokens_per_s_from == "soak/target"
    assert (fig.rank_skew, fig.slowest_rank, fig.rank_skew_from) == (pytest.approx(0.25), 1, "scale/all-nodes")
    assert fig.peak_mem_gib == 11.25
    assert (fig.attempts, fig.restarts) == (7, 2)
    assert fig.wall_s == 442.0  # the conftest clock: 170 steps of 2 s, 7 attempt ends, 100 s paused, 5 + 10 s gaps


def test_gate_verdicts_keep_measured_and_threshold(full_run: Path) -> None:
    gates = _summary(full_run).gates
    assert [(g.stage, g.rung, g.gate, g.passed) for g in gates][2:4] == [
        ("scale", "all-nodes", "scaling_efficiency", False), ("scale", "all-nodes", "scaling_efficiency", True)]
    assert (gates[2].measured, gates[2].threshold) == (0.41, 0.7)
    assert gates[4].measured == {"failures": 1, "recovered": 1}


def test_notable_events_are_failures_and_faults(full_run: Path) -> None:
    notable = _summary(full_run).notable_events()
    assert [e["kind"] for e in notable] == ["attempt", "gate", "rung", "stage", "run", "fault", "attempt"]
    assert notable[5]["message"] == HOSTILE


def test_run_that_failed_early_has_no_figures(early_failure: Path) -> None:
    summary = _summary(early_failure)
    assert [(s.name, s.status) for s in summary.stages] == [("warmup", "failed"), ("scale", "pending"),
                                                            ("soak", "pending")]
    assert summary.stages[0].reason == "rank 0 exited 1: ImportError: torch"
    assert summary.stages[1].rungs == [] and summary.stages[1].wall_s is None
    rung = summary.stages[0].rungs[0]
    assert (rung.rung, rung.status, rung.attempts, rung.failed_attempts, rung.wall_s) == ("target", "failed", 1, 1,
                                                                                          12.0)
    fig = summary.figures
    assert (fig.steps, fig.final_loss, fig.tokens_per_s, fig.rank_skew, fig.peak_mem_gib) == (None,) * 5
    assert (fig.attempts, fig.restarts) == (1, 0)


def _text(summary: Summary) -> str:
    buffer = io.StringIO()
    Console(file=buffer, width=220, color_system=None).print(renderables(summary))
    return buffer.getvalue()


def test_terminal_summary(full_run: Path) -> None:
    text = _text(_summary(full_run))
    for expected in ("run r1  passed", "Gate verdicts", "scaling_efficiency", "FAIL", "0.41", "0.7",
                     "failures=1, recovered=1", "25.0%  (worst: scale/all-nodes, slowest rank 1)", "11.25 GiB",
                     "7  (2 restart(s))", "7m 22s", "3.2000  (soak/target)", "2,200  (median, soak/target)"):
        assert expected in text, expected
    assert "[bold red]SIGKILL[/]" in text  # ledger text is never rich markup
    warmup_row = next(line for line in text.splitlines() if "│ target " in line)
    assert "n/a" in warmup_row  # a CPU rung has no memory figure


def test_terminal_summary_of_an_early_failure(early_failure: Path) -> None:
    text = _text(_summary(early_failure))
    assert "No gate verdicts recorded." in text and "ImportError: torch" in text
    assert "steps               │ n/a" in text and "peak memory         │ n/a" in text


def test_rank_skew_and_formatting() -> None:
    rows = [{"rank": 0, "value": 1.0}, {"rank": 1, "value": 1.5}, {"rank": 0, "value": 1.0}, {"rank": 1, "value": 2.5}]
    assert rank_skew(rows) == (1.0, 1)
    assert rank_skew(rows[:1]) == (None, None)
    assert fmt_duration(442) == "7m 22s" and fmt_duration(3723) == "1h 02m 03s" and fmt_duration(None) == "n/a"
    assert fmt_number(123456.7) == "123,457" and fmt_number(0.41) == "0.41" and fmt_number(None) == "n/a"
    assert fmt_value({"a": 0.5, "b": None, "c": [True, 3]}) == "a=0.5, b=-, c=[yes, 3]"


def test_a_run_in_progress_counts_until_its_last_record(tmp_path: Path) -> None:
    run_dir = tmp_path / "r1"
    run_dir.mkdir()
    clock = Clock()
    led = Ledger(run_dir / "ledger.sqlite", clock=clock)
    led.create_run("r1", {}, ["soak"])
    led.set_stage("r1", "soak", "running")
    run_attempt(led, clock, "soak", "target", Steps(1, 15, lambda i: 4.0, 1000.0, (1.0, 1.0)), None)
    led.close()  # the controller was killed: the attempt stays `running`, its last metric is at T0 + 30
    summary = _summary(run_dir)
    stage = summary.stages[0]
    assert (stage.status, stage.started, stage.finished, stage.wall_s) == ("running", T0, None, 30.0)
    assert stage.rungs[0].status == "running" and stage.rungs[0].wall_s == 30.0 and stage.rungs[0].steps == 15
    assert summary.figures.wall_s == 30.0
